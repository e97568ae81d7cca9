"""Elastic degree of parallelism (issue 13) in the scheduling core, on a virtual clock: a
collaboration group's worker runs several batches side by side, each on its own block of
ranks, and the DoP-aware policies pick each batch's DoP again at every chunk."""

from __future__ import annotations

import pytest

from onepiece.sched.core import SchedCore
from onepiece.sched.costs import CostModel
from onepiece.sched.keys import at_dop
from onepiece.sched.options import ScheduleSpec
from onepiece.sched.policies import best_fit, frugal_fit
from onepiece.sched.policy import Batch, Policy, View, Worker
from onepiece.sched.virtual import VirtualStage, request

# GF-DiT's published per-step times (Qwen-Image on H20, ms at SP1 / SP2 / SP4): small shapes
# gain nothing from more ranks, large ones a lot.
S, M, L = "512x512x1/cfg/L64", "1024x1024x1/cfg/L64", "1536x1536x1/cfg/L64"
MS = {S: (155, 161, 172), M: (605, 350, 207), L: (1557, 880, 464)}
TABLE = {at_dop(k, d): {1: ms / 1000} for k, row in MS.items() for d, ms in zip((1, 2, 4), row)}


def cost(key: str, batch: int) -> float:
    return TABLE[key][1] * batch


def stage(policy: str, ranks: int = 4, workers: int = 1, **opts) -> VirtualStage:
    core = SchedCore(ScheduleSpec(policy=policy, chunk_steps=2, max_batch=1, **opts), CostModel(TABLE))
    return VirtualStage(core, cost, workers=workers, ranks=ranks)


def dops_of(st: VirtualStage, uid: str) -> list[int]:
    return [len(p.ranks) for run in st.runs for p in run.parts if uid in p.uids]


@pytest.mark.parametrize("policy", ["edf-best-fit", "slo"])
def test_each_shape_gets_the_smallest_dop_that_meets_its_deadline(policy) -> None:
    st = stage(policy)
    st.submit(0.0, request("s", S, steps=10, deadline=30.0))
    st.submit(0.0, request("l", L, steps=20, deadline=10.0))  # 9.3 s at DoP 4, 17.6 s at 2
    out = st.run()
    assert dops_of(st, "l")[0] == 4 and set(dops_of(st, "s")) == {1}  # spare ranks never make S faster
    assert out["l"].end <= 10.0 and out["s"].status == "completed"


def test_slo_runs_a_request_at_its_knee_not_at_the_slowest_dop_that_meets_its_deadline_alone() -> None:
    # M: 2.4 s at DoP 1 meets a 10 s deadline, but leaves it only the slack it would have alone;
    # its knee (the smallest DoP within 10% of its fastest) is 4, done in 0.8 s.
    m = request("m", M, steps=4, deadline=10.0)
    view = View(0.0, [m], [Worker("w0", ranks=4)], CostModel(TABLE), 1, lambda key, batch: 2, lambda r: 0)
    assert best_fit(view, m, [1, 2, 4]) == 1 and frugal_fit(view, m, [1, 2, 4]) == 4
    assert frugal_fit(view, m, [1, 2]) == 2  # two ranks left: the faster of what fits


def test_slo_gives_a_request_no_dop_gets_in_time_its_most_frugal_dop() -> None:
    m = request("m", M, steps=10, deadline=1.0)  # 2.1 s at its fastest: hopeless
    view = View(0.0, [m], [Worker("w0", ranks=4)], CostModel(TABLE), 1, lambda key, batch: 2, lambda r: 0)
    assert best_fit(view, m, [1, 2, 4]) == 4 and frugal_fit(view, m, [1, 2, 4]) == 1  # 6.05 rank-s, not 8.3


def test_four_small_requests_run_side_by_side_one_rank_each() -> None:
    st = stage("edf-best-fit")
    for i in range(4):
        st.submit(0.0, request(f"s{i}", S, steps=4, deadline=5.0))
    st.run()
    # The first arrival starts alone (a group takes new work at chunk ends); then all four at once.
    assert [(0,), (1,), (2,), (3,)] in [sorted(p.ranks for p in run.parts) for run in st.runs]
    assert st.now == pytest.approx(6 * 0.155)  # 16 steps in the time of 6


def test_a_large_request_gives_up_ranks_to_urgent_small_ones_and_takes_them_back() -> None:
    st = stage("edf-best-fit")
    st.submit(0.0, request("l", L, steps=20, deadline=60.0))
    for i in range(2):
        st.submit(1.0, request(f"s{i}", S, steps=4, deadline=3.0))  # they wait for the chunk in flight
    out = st.run()
    seq = dops_of(st, "l")
    assert seq[0] == 4 and 2 in seq and seq[-1] == 4, seq  # alone: 4; beside the two small ones: 2; then 4
    assert all(out[f"s{i}"].end <= 3.0 for i in range(2))


def test_ddit_runs_each_shape_at_its_optimal_dop() -> None:
    st = stage("ddit")
    st.submit(0.0, request("m", M, steps=4))
    st.submit(0.0, request("s", S, steps=4))
    st.run()
    assert set(dops_of(st, "m")) == {4} or set(dops_of(st, "m")) == {2}  # 4 when the ranks are free
    assert set(dops_of(st, "s")) == {1}


def test_dop_blind_policies_run_every_batch_on_the_whole_group() -> None:
    st = stage("srtf")
    st.submit(0.0, request("s", S, steps=4))
    st.submit(0.0, request("m", M, steps=4))
    st.run()
    assert {len(p.ranks) for run in st.runs for p in run.parts} == {4}


def test_the_core_refuses_dops_a_group_does_not_offer_or_that_overlap() -> None:
    class Fixed(Policy):
        name = "fixed"

        def __init__(self, batches):
            self.batches = batches

        def plan(self, view: View) -> list[Batch]:
            return self.batches

    for batches, why in (([Batch("w0", ("a",), 1, 3)], "DoP 3"),
                         ([Batch("w0", ("a",), 1, 4), Batch("w0", ("b",), 1, 1)], "do not fit")):
        core = SchedCore(ScheduleSpec(policy="slo", max_batch=1), CostModel(TABLE), policy=Fixed(batches))
        core.worker_up("w0", 4)
        core.add(request("a", S, steps=2))
        core.add(request("b", S, steps=2))
        d = core.schedule(0.0)
        assert any(why in r for r in core.rejections), core.rejections
        assert len(d.commands) <= 1


def test_a_dop_never_measured_is_priced_from_another_as_perfect_scaling() -> None:
    costs = CostModel({at_dop(M, 4): {1: 0.2}})
    assert costs.step_s(M, 1) == pytest.approx(0.8)  # pessimistic below: tried when slack allows
    assert costs.step_s(at_dop(M, 2), 1) == pytest.approx(0.4)


def test_bench_dop_compares_static_and_elastic_on_a_published_table(tmp_path) -> None:
    import json

    from onepiece.cli import build_parser

    args = build_parser().parse_args(["bench", "dop", "--gpus", "4", "--loads", "0.5", "--requests", "30",
                                      "--out", str(tmp_path)])
    assert args.bench.run(args) == 0
    report = json.loads((tmp_path / "dop.json").read_text())
    configs = {r["config"] for r in report["rows"]}
    assert {"static DoP 1 edf", "static DoP 4 srtf", "elastic slo", "elastic edf-best-fit", "elastic ddit"} <= configs
    assert all(r["summary"]["all"]["n"] == 30 for r in report["rows"])
    (t,) = report["targets"]
    assert t["gpus"] == 4 and 0 <= t["static"] <= 1 and 0 <= t["elastic"] <= 1
