"""The trace-driven simulator (sim/): the engine on hand-made cost tables where the answer can
be worked out by hand, bad inputs refused with where and why, the command's outputs, and the
validation against a saved benchmark run. No processes: the simulator has no I/O."""

from __future__ import annotations

import json

import pytest
import yaml

from onepiece.bench.trace import Trace, parse_classes, poisson_trace
from onepiece.cli import main
from onepiece.config import ConfigError, deploy_dir, load_workflow
from onepiece.sched.costs import TableError
from onepiece.sim.cli import apply_schedule, simulate
from onepiece.sim.costs import CostTable
from onepiece.sched.virtual import EventLoop, Host
from onepiece.sim.engine import SimInputError, Simulation

WF = load_workflow(deploy_dir() / "wan21-scale.yaml")
SET = {"set0": {"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1}}
S, L = "64x64x9", "192x192x17"


def table(denoise: dict[str, dict[int, float]] | None = None) -> CostTable:
    denoise = denoise or {f"{S}/cfg/L64": {1: 0.02, 2: 0.03, 4: 0.05}, f"{L}/cfg/L64": {1: 0.2, 2: 0.4}}
    rows = {"text_encode": [{"key": k, "batch": 1, "seconds": 0.01} for k in (S, L)],
            "vae_decode": [{"key": S, "batch": 1, "seconds": 0.05}, {"key": L, "batch": 1, "seconds": 0.3}],
            "denoise_t2v": [{"key": k, "batch": b, "seconds": t} for k, row in denoise.items() for b, t in row.items()]}
    return CostTable({"version": 1, "stages": {s: {"rows": r} for s, r in rows.items()}}, "t.json")


def trace(reqs: list[dict], classes: dict | None = None) -> Trace:
    classes = classes or {"S": {"size": "64x64", "num_frames": 9, "steps": 10, "slo_s": 1.0},
                          "L": {"size": "192x192", "num_frames": 17, "steps": 10, "slo_s": 8.0}}
    full = [{"app": "t2v", "size": classes[r["class"]]["size"], "num_frames": classes[r["class"]]["num_frames"],
             "steps": classes[r["class"]]["steps"], **r} for r in reqs]
    return Trace.model_validate({"version": 1, "classes": classes, "requests": full})


def group_of_two(text_s: float, dop1_s: float, dop2_s: float, vae_s: float) -> tuple:
    """The workflow with denoise_t2v on a collaboration group of 2 ranks, and a table with its
    step at DoP 1 and 2 and one call at each other stage: (workflow, table document)."""
    wf = WF.model_copy(deep=True)
    wf.stages["denoise_t2v"].workers, wf.stages["denoise_t2v"].mode = 2, "collaboration"
    return wf, {"version": 1, "stages": {
        "text_encode": {"rows": [{"key": S, "batch": 1, "seconds": text_s}]},
        "denoise_t2v": {"rows": [{"key": f"{S}/cfg/L64", "batch": 1, "seconds": dop1_s},
                                 {"key": f"{S}/cfg/L64@2", "batch": 1, "seconds": dop2_s}]},
        "vae_decode": {"rows": [{"key": S, "batch": 1, "seconds": vae_s}]}}}


def test_one_request_takes_its_stages_and_hops_exactly():
    sim = Simulation(WF, SET, table(), hop_s=0.002, overhead_s=0.001)
    sim.load(trace([{"at": 1.0, "class": "S"}]))
    (rec,) = sim.run()
    # text 0.01 + overhead; hop; 10 denoise steps in chunks of 1 step (overhead each); hop; vae 0.05 + overhead; hop
    chunks = [c for c in sim.chunks if "denoise" in c.instance]
    want = (0.01 + 0.001) + 0.002 + 10 * 0.02 + len(chunks) * 0.001 + 0.002 + (0.05 + 0.001) + 0.002
    assert rec["outcome"] == "completed"
    assert rec["latency_s"] == pytest.approx(want, abs=1e-9)
    assert [s["stage"] for s in rec["stages"]] == ["text_encode", "denoise_t2v", "vae_decode"]


def test_a_request_pays_its_tables_preparing_and_finishing_once_at_each_stage_that_has_it():
    doc = {"version": 1, "stages": {s: {"rows": r} for s, r in (
        ("text_encode", [{"key": S, "batch": 1, "seconds": 0.01}]),
        ("vae_decode", [{"key": S, "batch": 1, "seconds": 0.05}]),
        ("denoise_t2v", [{"key": f"{S}/cfg/L64", "batch": 1, "seconds": 0.02}]))}}
    plain = Simulation(WF, SET, CostTable(doc, "t.json"), hop_s=0.002, overhead_s=0.001)
    plain.load(trace([{"at": 1.0, "class": "S"}]))
    doc["stages"]["denoise_t2v"]["fixed"] = [{"key": f"{S}/cfg/L64", "seconds": 0.03}]
    fixed = Simulation(WF, SET, CostTable(doc, "t.json"), hop_s=0.002, overhead_s=0.001)
    fixed.load(trace([{"at": 1.0, "class": "S"}]))
    ((a,), (b,)) = plain.run(), fixed.run()
    assert b["latency_s"] - a["latency_s"] == pytest.approx(0.03, abs=1e-9)  # once, not per chunk
    # and the stage's core knows it: its standalone time includes it, as a running stage's does
    core = fixed.costs.model("denoise_t2v")
    assert core.fixed_s(f"{S}/cfg/L64") == 0.03 and core.fixed_s("other") == 0.0
    doc["stages"]["denoise_t2v"]["fixed"] = [{"key": f"{S}/cfg/L64", "seconds": -1}]
    with pytest.raises(TableError, match=r"stages.denoise_t2v.fixed\[0\]"):
        CostTable(doc, "t.json")


def test_a_stage_whose_table_says_its_chunk_overhead_pays_that_per_chunk():
    """A table from a run carries each stage's decision and IPC per chunk, measured over its
    trace; the simulator charges it there and the default elsewhere. (The second S, alone at
    first, gets an open run that L's arrival cuts where a chunk ends; then S is held to its end,
    as L cannot pass it.)"""
    doc = {"version": 1, "stages": {s: {"rows": r} for s, r in (
        ("text_encode", [{"key": k, "batch": 1, "seconds": 0.01} for k in (S, L)]),
        ("vae_decode", [{"key": k, "batch": 1, "seconds": 0.05} for k in (S, L)]),
        ("denoise_t2v", [{"key": f"{k}/cfg/L64", "batch": 1, "seconds": 0.02} for k in (S, L)]))}}
    runs = {}
    for ov in (None, 0.004):
        if ov is not None:
            doc["stages"]["denoise_t2v"]["overhead_s"] = ov
        sim = Simulation(WF, SET, CostTable(doc, "t.json"), hop_s=0.002, overhead_s=0.001)
        # (the first request alone: the stage has measured its overhead when the second comes)
        sim.load(trace([{"at": 0.0, "class": "S"}, {"at": 1.0, "class": "S"}, {"at": 1.03, "class": "L"}]))
        rec = sim.run()[1]
        runs[ov] = rec["latency_s"], [c.steps for c in sim.chunks if "denoise" in c.instance and c.uids == ("r1",)]
    (plain, chunks_before), (dear, chunks_after) = runs[None], runs[0.004]
    assert sum(chunks_before) == sum(chunks_after) == 10
    # a dearer overhead makes chunks longer (fewer of them keep it under 3% of their compute):
    # the cut comes where a longer chunk ends
    assert (chunks_before, chunks_after) == ([2, 8], [7, 3]), (chunks_before, chunks_after)
    assert dear - plain == pytest.approx(len(chunks_after) * 0.004 - len(chunks_before) * 0.001, abs=1e-9)
    for bad in (-0.001, "1ms", True, float("inf")):
        doc["stages"]["denoise_t2v"]["overhead_s"] = bad
        with pytest.raises(TableError, match=r"stages.denoise_t2v.overhead_s"):
            CostTable(doc, "t.json")


def test_compatible_requests_share_forward_passes_and_a_long_one_is_passed():
    """Four small requests arriving while a large one denoises: slo batches them and runs them
    before the large one's remaining steps (its deadline is far), so they all meet 1 s."""
    reqs = [{"at": 0.0, "class": "L", "slo_s": 8.0, "timeout_s": 60}] + [
        {"at": 0.3 + 0.01 * i, "class": "S", "slo_s": 1.0, "timeout_s": 60} for i in range(4)]
    result, sim = simulate(WF, SET, table(), trace(reqs))
    recs = result["requests"]
    assert all(r["outcome"] == "completed" for r in recs)
    assert all(r["latency_s"] <= 1.0 for r in recs if r["class"] == "S")
    assert max(len(c.uids) for c in sim.chunks if "denoise" in c.instance) >= 2
    assert result["summary"]["all"]["attainment"] == 1.0
    # the schedule says why the large one waited: each small batch's decision passed it over with
    # seconds to spare (as a stage's schedule log does)
    large = next(r["uid"] for r in recs if r["class"] == "L")
    small = [c for c in sim.chunks if "denoise" in c.instance and large not in c.uids]
    waits = [p for c in small for p in c.passed if p[0] == large]
    assert waits and all(slack > 0 and left > 0 for _, slack, left, _ in waits), small
    # fcfs runs the large one to its end first: the small ones miss
    fcfs, _ = simulate(apply_schedule(WF, ["denoise_t2v.policy=fcfs"]), SET, table(), trace(reqs))
    assert fcfs["summary"]["S"]["attainment"] == 0.0


def test_a_request_past_its_deadline_fails_where_it_waits_and_a_missed_slo_still_completes():
    reqs = [{"at": 0.0, "class": "L", "timeout_s": 60}, {"at": 0.0, "class": "L", "timeout_s": 60},
            {"at": 0.01, "class": "S", "timeout_s": 0.3}, {"at": 0.01, "class": "S", "slo_s": 0.3, "timeout_s": 60}]
    result, _ = simulate(apply_schedule(WF, ["denoise_t2v.policy=fcfs"]), SET, table(), trace(reqs))
    by = {r["uid"]: r for r in result["requests"]}
    assert by["r2"]["outcome"] == "failed" and by["r2"]["error"] == "deadline exceeded at stage denoise_t2v"
    assert by["r3"]["outcome"] == "completed" and by["r3"]["latency_s"] > 0.3


def test_the_same_inputs_give_the_same_result():
    classes = parse_classes("S=64x64x9:10,L=192x192x17:10")
    classes["S"]["slo_s"], classes["L"]["slo_s"] = 1.0, 8.0
    tr = poisson_trace(classes, {"S": 0.8, "L": 0.2}, rate=3.0, n=200, seed=1, timeout_s=60)
    a, _ = simulate(WF, SET, table(), tr, chunks=False)
    b, _ = simulate(WF, SET, table(), tr, chunks=False)
    assert a["requests"] == b["requests"]
    two, _ = simulate(WF, {"a": SET["set0"], "b": SET["set0"]}, table(), tr, chunks=False)
    assert two["summary"]["all"]["mean_s"] < a["summary"]["all"]["mean_s"]  # two sets share the load
    assert {r["set"] for r in two["requests"]} == {"a", "b"}


def test_a_shared_host_serves_the_ranks_computing_on_it_in_turn():
    """Processor sharing: chunks progress at min(1, cores / ranks computing) of their speed alone,
    and as one ends the others speed up."""
    loop = EventLoop()
    host, ends = Host(loop, cores=1), {}
    loop.at(0.0, host.start, 1.0, 1, lambda el: ends.setdefault("long", (loop.now, el)))
    loop.at(0.0, host.start, 0.5, 1, lambda el: ends.setdefault("short", (loop.now, el)))
    loop.run()
    # both at half speed until the short one's 0.5 s of work is done at 1.0; the long one's last 0.5 s alone
    assert ends["short"] == pytest.approx((1.0, 1.0)) and ends["long"] == pytest.approx((1.5, 1.5))
    loop = EventLoop()
    host, ends = Host(loop, cores=2), {}
    loop.at(0.0, host.start, 1.0, 2, lambda el: ends.setdefault("group", loop.now))  # a group of two ranks
    loop.at(0.5, host.start, 0.2, 1, lambda el: ends.setdefault("call", loop.now))  # a third rank beside it
    loop.run()
    # three ranks on two cores from 0.5: both at 2/3 speed; the call's 0.2 s take 0.3 s
    assert ends["call"] == pytest.approx(0.8) and ends["group"] == pytest.approx(0.8 + (1.0 - 0.5 - 0.2))
    with pytest.raises(ValueError, match="cores > 0"):
        Host(EventLoop(), 0)


def test_a_host_with_a_core_for_every_rank_changes_nothing_and_fewer_cores_slow_the_set():
    classes = parse_classes("S=64x64x9:10,L=192x192x17:10")
    classes["S"]["slo_s"], classes["L"]["slo_s"] = 1.0, 8.0
    tr = poisson_trace(classes, {"S": 0.8, "L": 0.2}, rate=3.0, n=200, seed=1, timeout_s=60)
    apart, _ = simulate(WF, SET, table(), tr, chunks=False)
    roomy, _ = simulate(WF, SET, table(), tr, chunks=False, host_cores=3)  # a core for each stage's worker
    # (the same times but for rounding: a host prices a run cut short by the work it has left)
    assert [(r["outcome"], r["latency_s"]) for r in roomy["requests"]] == [
        (r["outcome"], pytest.approx(r["latency_s"], abs=1e-9)) for r in apart["requests"]]
    assert roomy["host_cores"] == 3
    one, sim = simulate(WF, SET, table(), tr, chunks=False, host_cores=1)
    assert one["summary"]["all"]["mean_s"] > 1.2 * apart["summary"]["all"]["mean_s"]
    # the denoise stage's own cost model measured its steps slowed, as a stage on a shared host does
    (vi,) = sim.instances["set0"]["denoise_t2v"]
    assert vi.core.costs.step_s(f"{S}/cfg/L64", 1) > 0.02 * 1.05
    with pytest.raises(SimInputError, match="host_cores"):
        Simulation(WF, SET, table(), host_cores=-1)


def test_bad_inputs_are_refused_with_where_and_why():
    sim = Simulation(WF, SET, table({f"{S}/cfg/L64": {1: 0.02}}))
    with pytest.raises(SimInputError, match=r"requests\[1\] \(192x192x17:10\): t.json: stage 'denoise_t2v' has no "
                                            r"row for key '192x192x17/cfg/L64'"):
        sim.load(trace([{"at": 0, "class": "S"}, {"at": 1, "class": "L"}]))
    with pytest.raises(SimInputError, match=r"requests\[0\]: unknown model 'v2v'"):
        Simulation(WF, SET, table()).load(trace([{"at": 0, "class": "S", "app": "v2v"}]))
    with pytest.raises(SimInputError, match=r"requests\[0\]: 'steps' must be between 1 and 100"):
        Simulation(WF, SET, table()).load(trace([{"at": 0, "class": "S", "steps": 500}]))
    with pytest.raises(SimInputError, match="application 'i2v' needs stage 'image_encode', which no set runs"):
        Simulation(WF, SET, table()).load(trace([{"at": 0, "class": "S", "app": "i2v"}]))
    with pytest.raises(SimInputError, match=r"sets.set0.denoise: unknown stage"):
        Simulation(WF, {"set0": {"denoise": 1}}, table())
    with pytest.raises(TableError, match=r"t.json: stages.vae_decode.rows\[0\]: expected \{key, batch, seconds\}"):
        CostTable({"version": 1, "stages": {"vae_decode": {"rows": [{"key": S}]}}}, "t.json")
    with pytest.raises(TableError, match="mixes step keys"):
        CostTable({"version": 1, "stages": {"x": {"rows": [{"key": S, "batch": 1, "seconds": 1},
                                                           {"key": S + "/cfg/L64", "batch": 1, "seconds": 1}]}}})
    with pytest.raises(ConfigError, match=r"denoise_t2v.max_batch=0.*max_batch: Input should be greater"):
        apply_schedule(WF, ["denoise_t2v.max_batch=0"])
    with pytest.raises(ConfigError, match="expected STAGE.OPTION=VALUE"):
        apply_schedule(WF, ["policy=edf"])


def test_the_command_writes_its_figures_and_a_schedule_trace(tmp_path, capsys):
    (tmp_path / "t.json").write_bytes(trace([{"at": 0.1 * i, "class": "SL"[i % 2], "slo_s": [1.0, 8.0][i % 2],
                                              "timeout_s": 30} for i in range(12)]).dump())
    (tmp_path / "c.json").write_text(json.dumps({"version": 1, "stages": {
        s: {"rows": [{"key": k, "batch": b, "seconds": t} for k, row in rows.items() for b, t in row.items()]}
        for s, rows in table().rows.items()}}))
    with pytest.raises(SystemExit) as e:
        main(["sim", "--trace", str(tmp_path / "t.json"), "--costs", str(tmp_path / "c.json"),
              "--workflow", str(deploy_dir() / "wan21-scale.yaml"), "--instances", "text_encode=1,denoise_t2v=2,vae_decode=1",
              "--schedule", "denoise_t2v.policy=edf", "--out", str(tmp_path / "out")])
    assert e.value.code == 0, capsys.readouterr()
    doc = json.loads((tmp_path / "out" / "sim.json").read_text())
    assert doc["summary"]["all"]["n"] == 12 and "denoise_t2v: edf" in doc["title"]
    events = json.loads((tmp_path / "out" / "sim.perfetto.json").read_text())["traceEvents"]
    slices = [ev for ev in events if ev["ph"] == "X"]
    assert slices and all(ev["dur"] > 0 for ev in slices)
    assert {ev["args"]["name"] for ev in events if ev["ph"] == "M"} >= {"set0-denoise_t2v0", "set0-denoise_t2v1"}
    assert (tmp_path / "out" / "sim.png").stat().st_size > 1000
    with pytest.raises(SystemExit) as e:  # a cost table without a shape the trace needs
        main(["sim", "--trace", str(tmp_path / "t.json"), "--costs", str(tmp_path / "t.json"),
              "--workflow", str(deploy_dir() / "wan21-scale.yaml"), "--instances", "denoise_t2v=1"])
    assert e.value.code == 2 and "not a version-1 cost table" in capsys.readouterr().err


def test_the_planner_finds_the_fewest_devices_that_meet_the_target():
    from onepiece.sim import plan

    classes = parse_classes("S=64x64x9:10,L=192x192x17:10")
    classes["S"]["slo_s"], classes["L"]["slo_s"] = 0.8, 6.0
    tr = poisson_trace(classes, {"S": 0.8, "L": 0.2}, rate=10.0, n=300, seed=4, timeout_s=60)
    mono_wf, mono_costs, mono_gpus = plan.monolithic(WF, table(), tr, {"denoise_t2v": 2})
    P = plan.pipeline("t2v")
    assert mono_gpus[P] == 2  # a whole pipeline holds what its largest stage needs
    # a whole S request is its three stages alone: 0.01 + 10 x 0.02 + 0.05
    assert mono_costs.step_s(P, S, 1) == pytest.approx(0.26)
    best = plan.fewest(lambda n: plan.attainment(mono_wf, {P: n}, mono_costs, tr), 0.95)
    assert plan.fewest_monolithic(WF, table(), tr, 0.95).devices == best.devices
    assert best.attainment >= 0.95
    assert plan.attainment(mono_wf, {P: best.devices - 1}, mono_costs, tr).attainment < 0.95
    assert plan.attainment(mono_wf, {P: 3}, mono_costs, tr, gpus=mono_gpus).devices == 6
    dis = plan.disaggregated(WF, table(), tr, 0.95)
    assert dis.attainment >= 0.95 and dis.devices == sum(dis.counts.values())
    for stage, n in dis.counts.items():  # none of them can give one back
        if n > 1:
            assert plan.attainment(WF, {**dis.counts, stage: n - 1}, table(), tr).attainment < 0.95
    # Theorem 1's start: the denoise stage is offered most of the work, so it gets most devices
    start = plan.theorem1(WF, table(), tr)
    assert start["denoise_t2v"] == max(start.values()) and min(start.values()) >= 1
    # From a given start (the elastic plan starts from the plan without moves): pruned from there
    generous = {s: n + 2 for s, n in dis.counts.items()}
    again = plan.disaggregated(WF, table(), tr, 0.95, start=generous)
    assert again.attainment >= 0.95 and again.devices <= sum(generous.values()) - 2
    mixed = tr.model_copy(update={"requests": [*tr.requests[:2], tr.requests[2].model_copy(update={"steps": 20})]})
    with pytest.raises(SimInputError, match="give each shape one step count"):
        plan.monolithic(WF, table(), mixed)


def test_a_plan_prices_a_request_alone_with_its_tables_preparing_and_finishing():
    """A table's ``fixed`` seconds are a request's as surely as its steps: a whole-pipeline
    device spends them too, Theorem 1 counts them as work, and the standalone time an SLO is
    set from includes them (without, a monolithic device cost 4 s where its stages cost 14 s,
    and --alpha 2 set an SLO that no request could make even alone)."""
    from onepiece.sim import plan

    doc = {"version": 1, "stages": {
        "text_encode": {"rows": [{"key": S, "batch": 1, "seconds": 1.0}]},
        "denoise_t2v": {"rows": [{"key": f"{S}/cfg/L64", "batch": 1, "seconds": 1.0}],
                        "fixed": [{"key": f"{S}/cfg/L64", "seconds": 10.0}]},
        "vae_decode": {"rows": [{"key": S, "batch": 1, "seconds": 1.0}]}}}
    costs = CostTable(doc, "t.json")
    tr = trace([{"at": 2.0 * i, "class": "S", "steps": 2} for i in range(10)],
               {"S": {"size": "64x64", "num_frames": 9, "steps": 2, "slo_s": 30.0}})
    (j, *_) = plan.priced(WF, costs, tr)
    assert j.alone == {"text_encode": 1.0, "denoise_t2v": 12.0, "vae_decode": 1.0}
    assert j.reserve == {"text_encode": 13.0, "denoise_t2v": 1.0}  # as the proxy splits a deadline
    _, mono, _ = plan.monolithic(WF, costs, tr)
    assert mono.step_s(plan.pipeline("t2v"), S, 1) == pytest.approx(14.0)
    # 10 x 12 s of denoising over the trace's 18 s, at 70% busy: 9.5, so 10 instances
    assert plan.theorem1(WF, costs, tr)["denoise_t2v"] == 10


def test_a_collaboration_group_s_standalone_time_is_at_its_fastest_dop():
    """A request alone on a group of 2 ranks runs its steps at DoP 2 (a DoP-blind policy on
    all its ranks, a DoP-aware one at its fastest), as a running stage's standalone time says:
    so its SLO can be met where DoP 1 alone would miss it, and plan must not call such a load
    hopeless (it priced every stage at DoP 1 and refused a load that `onepiece sim` met in
    full). A monolithic device and Theorem 1's work stay at DoP 1: one rank's device-seconds."""
    from onepiece.sim import plan
    from onepiece.sim.cli import hopeless

    wf, doc = group_of_two(0.01, 0.02, 0.012, 0.05)
    costs = CostTable(doc, "t.json")
    # alone: 0.01 + 10 x 0.012 + 0.05 and 3 hops = 0.1845 s at DoP 2; 0.2645 s at DoP 1
    tr = trace([{"at": 1.0 * i, "class": "S"} for i in range(10)],
               {"S": {"size": "64x64", "num_frames": 9, "steps": 10, "slo_s": 0.25}})
    (j, *_) = plan.priced(wf, costs, tr)
    assert j.alone["denoise_t2v"] == pytest.approx(0.12)
    assert j.reserve["text_encode"] == pytest.approx(0.17)  # as the proxy splits it, from the stages' standalone
    hopeless(wf, costs, tr, 0.99)  # no error: every request makes it alone
    result, _ = simulate(wf, {"set0": {"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1}}, costs, tr)
    assert result["summary"]["all"]["attainment"] == 1.0
    _, mono, _ = plan.monolithic(wf, costs, tr)
    assert mono.step_s(plan.pipeline("t2v"), S, 1) == pytest.approx(0.26)


def test_a_dop_blind_policy_on_a_group_needs_only_the_group_s_own_dop_priced():
    """A DoP-blind policy runs every batch on all of a group's ranks, so a run under it measures
    DoP 2 alone: its table prices that DoP and the simulator replays it (it refused the table of
    `bench sched --collaboration`'s fcfs run for lacking DoP 1). A policy that picks DoPs still
    needs every one it may pick, and is told which key is missing."""
    wf, doc = group_of_two(0.01, 0.02, 0.012, 0.05)
    rows = doc["stages"]["denoise_t2v"]["rows"]
    rows[:] = [r for r in rows if r["key"].endswith("@2")]
    tr = trace([{"at": 1.0 * i, "class": "S"} for i in range(3)],
               {"S": {"size": "64x64", "num_frames": 9, "steps": 10, "slo_s": 0.25}})
    sets = {"set0": {"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1}}
    srtf = apply_schedule(wf, ["denoise_t2v.policy=srtf"])
    result, _ = simulate(srtf, sets, CostTable(doc, "t.json"), tr)
    assert result["summary"]["all"]["attainment"] == 1.0  # at DoP 2: 0.27 s at DoP 1 would miss 0.25
    with pytest.raises(SimInputError, match=r"no row for key '64x64x9/cfg/L64' "):
        simulate(apply_schedule(wf, ["denoise_t2v.policy=slo"]), sets, CostTable(doc, "t.json"), tr)


def test_a_shared_plan_meets_the_target_for_each_application_as_a_monolithic_pool_must():
    """Two i2v requests at once among 50 t2v ones: one denoise_i2v instance makes the second
    wait past its SLO, which overall is still 98% (51 of 52). A monolithic i2v pool must meet
    98% of its own requests, so the shared plan is held to the same (it reported one instance,
    and so a saving that starved the small application)."""
    from onepiece.sim import plan

    calls = ("text_encode", "image_encode", "vae_encode", "vae_decode")
    costs = CostTable({"version": 1, "stages": {
        **{s: {"rows": [{"key": S, "batch": 1, "seconds": 0.1}]} for s in calls},
        **{s: {"rows": [{"key": f"{S}/cfg/L64", "batch": 1, "seconds": 0.1}]} for s in ("denoise_t2v", "denoise_i2v")}}})
    reqs = [{"at": 2.0 * i, "class": "S"} for i in range(50)]
    reqs[21:21] = [{"at": 41.0, "class": "I", "app": "i2v"}, {"at": 41.0, "class": "I", "app": "i2v"}]
    tr = trace(reqs, {"S": {"size": "64x64", "num_frames": 9, "steps": 10, "slo_s": 40.0},
                      "I": {"size": "64x64", "num_frames": 9, "steps": 10, "slo_s": 2.0}})
    one = plan.attainment(WF, {s: 1 for s in (*calls, "denoise_t2v", "denoise_i2v")}, costs, tr)
    assert one.attainment == pytest.approx(51 / 52) and one.worst == 0.5
    v = plan.disaggregated(WF, costs, tr, 0.98)
    assert v.counts["denoise_i2v"] == 2 and v.worst == 1.0


def test_plan_answers_for_the_stages_where_no_monolithic_fleet_meets_the_target(tmp_path):
    """A denoise group of 2 ranks at DoP 2 makes an SLO that the whole pipeline on one device
    (DoP 1) misses even alone: plan says so in the monolithic column, and still plans the
    stages (it searched up to 100,000 devices, then stopped with no answer at all)."""
    wf, doc = group_of_two(0.01, 0.02, 0.012, 0.05)
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(wf.model_dump(mode="json", exclude_none=True)))
    (tmp_path / "c.json").write_text(json.dumps(doc))
    tr = trace([{"at": 1.0 * i, "class": "S"} for i in range(10)],
               {"S": {"size": "64x64", "num_frames": 9, "steps": 10, "slo_s": 0.25}})
    (tmp_path / "t.json").write_bytes(tr.dump())
    with pytest.raises(SystemExit) as done:
        main(["plan", "--workflow", str(tmp_path / "w.yaml"), "--costs", str(tmp_path / "c.json"),
              "--trace", str(tmp_path / "t.json"), "--out", str(tmp_path / "out")])
    assert done.value.code == 0
    (row,) = json.loads((tmp_path / "out" / "plan.json").read_text())["rows"]
    assert row["monolithic"] is None and row["mono_attainment"] == 0.0
    assert "no monolithic fleet meets 99.0% for t2v: with a device for each of its 10" in row["monolithic_why"]
    assert row["disaggregated"] == 4 and row["dis_attainment"] == 1.0  # a group of 2 and a device each side
    assert "| none meets it |" in (tmp_path / "out" / "plan.md").read_text()


def test_the_request_monitor_refuses_what_the_set_cannot_absorb_and_the_client_tries_the_next_set():
    """Three times what one set can do: with the proxy's own monitor on (against the NM's own
    capacity view of the simulated stages), requests are refused at once and what is admitted
    meets its SLO; without it, everything is admitted and most are late. With two sets the
    client takes a refusal to the other set."""
    from onepiece.config import ProxySpec

    classes = parse_classes("S=64x64x9:10")
    classes["S"]["slo_s"] = 1.0
    tr = poisson_trace(classes, {"S": 1.0}, rate=15.0, n=600, seed=5, timeout_s=1.0)  # the SLO is the deadline
    on = {"set0": ProxySpec(monitor=True, max_inflight=1000)}
    mon, _ = simulate(WF, SET, table(), tr, chunks=False, proxies=on)
    off, _ = simulate(WF, SET, table(), tr, chunks=False)
    m, o = mon["summary"]["all"], off["summary"]["all"]
    assert m["refused"] > 100 and o["refused"] == 0
    assert m["slo_met"] / (m["n"] - m["refused"]) > 0.9 > o["attainment"]
    assert {r["reason"] for r in mon["requests"] if r["outcome"] == "rejected"} <= {"deadline", "over_capacity"}
    two = {"a": SET["set0"], "b": SET["set0"]}
    both, _ = simulate(WF, two, table(), tr, chunks=False,
                       proxies={s: ProxySpec(monitor=True, max_inflight=1000) for s in two})
    assert both["summary"]["all"]["refused"] < m["refused"] / 2


def test_the_monitor_measures_the_simulated_path_the_hops():
    """The proxy's own measure of the path between the stages (``CapacityAdmission.probe``), on
    requests that come one at a time: three hops (two between the stages, one to the DB)."""
    from onepiece.config import ProxySpec

    tr = trace([{"at": 2.0 * i, "class": "S", "slo_s": 1.0, "timeout_s": 60} for i in range(8)])
    _, sim = simulate(WF, SET, table(), tr, hop_s=0.004, proxies={"set0": ProxySpec(monitor=True, max_inflight=100)})
    assert sim.admission["set0"].path_s("t2v") == pytest.approx(3 * 0.004)


def test_steps_vary_as_a_run_measured_them_and_keep_their_mean():
    """``step_cv`` (a table's per stage, or the simulation's for the others): each step costs its
    figure times a lognormal factor of mean 1, drawn from the seed, so a run repeats exactly and
    another seed differs; a stage whose table gives none is priced as before."""
    import statistics

    tr = trace([{"at": 1.0 * i, "class": "S"} for i in range(300)])  # one at a time: no queueing

    def denoise_times(sim: Simulation) -> list[float]:
        sim.load(tr)
        recs = sim.run()[1:]  # (the first request's chunks differ: no chunk overhead measured yet)
        return [next(s["leave"] - s["enter"] for s in r["stages"] if s["stage"] == "denoise_t2v") for r in recs]

    def vae_times(recs: list[dict]) -> set[float]:
        return {round(next(s["leave"] - s["enter"] for s in r["stages"] if s["stage"] == "vae_decode"), 9) for r in recs}

    exact = denoise_times(Simulation(WF, SET, table()))
    assert len({round(t, 9) for t in exact}) == 1
    varied = denoise_times(Simulation(WF, SET, table(), step_cv=0.3, seed=1))
    assert denoise_times(Simulation(WF, SET, table(), step_cv=0.3, seed=1)) == varied
    assert denoise_times(Simulation(WF, SET, table(), step_cv=0.3, seed=2)) != varied
    # 10 steps of 20 ms each per request: the mean kept, the spread of a sum of 10 independent steps
    assert statistics.fmean(varied) == pytest.approx(exact[0], rel=0.03)
    assert statistics.stdev(varied) / statistics.fmean(varied) == pytest.approx(0.3 / 10 ** 0.5, rel=0.25)
    # from the table, for the stage it names only
    doc = {"version": 1, "stages": {s: {"rows": [{"key": k, "batch": b, "seconds": t} for k, row in rows.items()
                                                  for b, t in row.items()]} for s, rows in table().rows.items()}}
    doc["stages"]["denoise_t2v"]["step_cv"] = 0.3
    sim = Simulation(WF, SET, CostTable(doc, "t.json"), seed=1)
    sim.load(tr)
    recs = sim.run()
    assert len(vae_times(recs)) == 1  # vae_decode: no figure in the table, none by default
    assert len({r["latency_s"] for r in recs}) > 100
    with pytest.raises(SimInputError, match="step_cv"):
        Simulation(WF, SET, table(), step_cv=-0.1)


def test_a_step_cv_past_any_measured_spread_is_refused():
    """At 1e10 a lognormal of mean 1 has a median of ~1e-10: every step cost ~0."""
    Simulation(WF, SET, table(), step_cv=10)
    for bad in (1e10, float("inf"), float("nan")):
        with pytest.raises(SimInputError, match=r"step_cv must be a number in \[0, 10\]"):
            Simulation(WF, SET, table(), step_cv=bad)


def test_the_workflow_not_the_tables_keys_says_which_stages_step():
    """Denoise rows keyed by call keys priced 10 denoising steps as one call; text_encode rows
    keyed by step keys charged text encoding per step."""
    with pytest.raises(SimInputError, match=r"t.json: stages.denoise_t2v: the workflow's stage steps, so its rows "
                                            r"need step keys, not call keys such as '64x64x9' \(step keys WxHxF/cfg\|"
                                            r"nocfg/L<text length>, e.g. '64x64x9/cfg/L64'; call keys WxHxF, e.g. '64x64x9'\)"):
        Simulation(WF, SET, table({S: {1: 0.02}}))
    doc = {"version": 1, "stages": {s: {"rows": [{"key": k, "batch": b, "seconds": t} for k, row in rows.items()
                                                  for b, t in row.items()]} for s, rows in table().rows.items()}}
    doc["stages"]["text_encode"]["rows"] = [{"key": f"{S}/cfg/L64", "batch": 1, "seconds": 0.01}]
    with pytest.raises(SimInputError, match=r"stages.text_encode: the workflow's stage is called once, so its rows "
                                            r"need call keys, not step keys .*e.g. '64x64x9/cfg/L64'.*e.g. '64x64x9'"):
        Simulation(WF, SET, CostTable(doc, "t.json"))


def test_the_stepped_functions_the_simulator_knows_are_the_registrys():
    from onepiece.config import STEPPED_FUNCTIONS
    from onepiece.stage import registry

    registry.is_stepped("denoise", "t2v")  # (loads the built-in functions)
    assert {name for name, kind in registry._functions if registry.is_stepped(name, kind)} == STEPPED_FUNCTIONS


def test_a_monitored_set_starts_measured_as_a_deployment_that_has_served_before():
    """bench sched warms its deployment up with every class before a trace, so the real NM
    knows each shape's service time at the first arrival; the simulated one must too. Two
    requests at once whose SLO fits one alone: the second is refused (it cannot make it behind
    the first), where a cold view (nothing finished yet) admitted both and the second was late."""
    from onepiece.config import ProxySpec

    tr = trace([{"at": 1.0, "class": "S", "slo_s": 0.4, "timeout_s": 60},
                {"at": 1.001, "class": "S", "slo_s": 0.4, "timeout_s": 60}])
    sim = Simulation(WF, SET, table(), proxies={"set0": ProxySpec(monitor=True, max_inflight=100)})
    sim.load(tr)
    for name, service in sim.service.items():  # before anything ran: the shape measured at every stage
        assert list(service.report()["t2v"]["shapes"]) == [f"{S}:10"], name
    first, second = sim.run()
    assert first["outcome"] == "completed" and first["latency_s"] < 0.4
    assert (second["outcome"], second["reason"]) == ("rejected", "deadline")


def saturated_denoise(n: int):
    """bench elastic's scenario: a topology whose NM moves instances, its sets, and a trace of
    ``n`` large requests that saturates denoise_t2v while one of two vae_decode instances idles."""
    from onepiece.config import Topology

    topo = Topology.model_validate({
        "workflow": "wan21-scale.yaml",
        "nm": {"heartbeat_s": 0.25, "elastic": {"window_s": 5, "cooldown_s": 5, "threshold": 0.85, "low": 0.0}},
        "sets": [{"name": "set0", "stages": {"text_encode": 1, "denoise_t2v": 1, "vae_decode": 2},
                  "min": {"vae_decode": 1}}]})
    classes = parse_classes("L=192x192x17:10")
    classes["L"]["slo_s"] = 60.0
    tr = poisson_trace(classes, {"L": 1.0}, rate=6.0, n=n, seed=2, timeout_s=600)
    return topo, {"set0": {"text_encode": 1, "denoise_t2v": 1, "vae_decode": 2}}, tr


def test_the_nm_moves_an_idle_stage_s_instance_to_the_saturated_one():
    """bench elastic's scenario on the virtual clock: denoise saturates while one of two
    vae_decode instances idles; the NM's own elastic policy moves it, the move drains and loads,
    and the stage then completes requests faster. Nothing is lost on the way."""
    topo, sets, tr = saturated_denoise(300)
    sim = Simulation(WF, sets, table(), keep_chunks=False, elastic=topo, move_s=3.0)
    sim.load(tr)
    recs = sim.run()
    moves = sim.elastic.moves
    assert moves and moves[0]["from"] == "vae_decode" and moves[0]["to"] == "denoise_t2v", moves
    assert moves[0]["serving_at"] - moves[0]["at"] >= 3.0  # drained, then loaded
    assert len(sim.instances["set0"]["denoise_t2v"]) == 2 and len(sim.instances["set0"]["vae_decode"]) == 1
    assert all(r["outcome"] == "completed" for r in recs)
    again = Simulation(WF, sets, table(), keep_chunks=False, elastic=topo, move_s=3.0)
    again.load(tr)
    again.run()
    assert again.elastic.moves == moves  # the same, ids too: the simulated NM reads no clock
    static = Simulation(WF, sets, table(), keep_chunks=False)
    static.load(tr)
    mean = lambda rs: sum(r["latency_s"] for r in rs) / len(rs)  # noqa: E731
    assert mean(recs) < mean(static.run())


def test_the_plot_s_busy_share_is_of_the_workers_a_stage_has_then():
    """sim.png's workers busy per stage: a collaboration group busy is one worker busy (100%,
    as sim.json's utilization says, not 1 of its 2 ranks' 50%), and a stage that gained
    instances by elastic moves is busy over all of them (its share was of its starting count:
    up to 140% on the pinned elastic scenario)."""
    from onepiece.sim.report import utilization_over_time

    wf, doc = group_of_two(1.0, 1.0, 0.5, 1.0)
    sim = Simulation(wf, SET, CostTable(doc, "t.json"), hop_s=0.0, overhead_s=0.0)
    sim.load(trace([{"at": 0.0, "class": "S", "steps": 4}],
                   {"S": {"size": "64x64", "num_frames": 9, "steps": 4, "slo_s": 10.0}}))
    sim.run()  # text 0-1 s, denoise 1-3 s at DoP 2, vae 3-4 s
    assert utilization_over_time(sim.chunks, sim.lifetimes, 1.0)["denoise_t2v"] == [0.0, 1.0, 1.0, 0.0, 0.0]
    topo, sets, tr = saturated_denoise(300)
    moved = Simulation(WF, sets, table(), elastic=topo, move_s=3.0)
    moved.load(tr)
    moved.run()
    assert moved.elastic.moves
    busy = utilization_over_time(moved.chunks, moved.lifetimes, 1.0)
    assert max(busy["denoise_t2v"]) == pytest.approx(1.0)  # saturated: both instances busy, not 200%


def test_a_move_never_takes_an_instance_to_a_stage_that_needs_more_gpus_than_it_holds():
    """The same saturation with denoise_t2v on 2 GPUs per worker: a 1-GPU vae_decode instance
    must stay (the planner counts the devices a set starts with, so a move that grew an instance
    would make its count a lie); with vae_decode on 2 GPUs too, the move happens."""
    topo, sets, tr = saturated_denoise(150)
    moves = {}
    for name, gpus in (("apart", {"denoise_t2v": 2}), ("alike", {"denoise_t2v": 2, "vae_decode": 2})):
        sim = Simulation(WF, sets, table(), keep_chunks=False, elastic=topo, move_s=3.0, gpus=gpus)
        sim.load(tr)
        assert all(r["outcome"] == "completed" for r in sim.run())
        moves[name] = [(m["from"], m["to"]) for m in sim.elastic.moves]
    assert ("vae_decode", "denoise_t2v") not in moves["apart"], moves
    assert ("vae_decode", "denoise_t2v") in moves["alike"], moves


def test_plan_with_one_class_runs_on_its_defaults(tmp_path):
    """`onepiece plan` with only --workflow, --costs, --classes and --rate: --mix and --alpha
    default to one value for every class (their old defaults named two classes, so a one-class
    plan was refused for an --alpha it was never given)."""
    from onepiece.bench.trace import parse_floats

    assert parse_floats("2", 3, "--alpha") == [2.0, 2.0, 2.0]
    with pytest.raises(SystemExit, match="expected 3 positive numbers"):
        parse_floats("2,3", 3, "--alpha")
    with pytest.raises(SystemExit) as done:
        main(["plan", "--workflow", str(deploy_dir() / "wan21-real.yaml"),
              "--costs", str(deploy_dir() / "wan21-h100.costs.json"), "--classes", "I=i2v/832x480x25:50",
              "--rate", "0.25", "--requests", "60", "--gpus", "denoise_i2v=2", "--out", str(tmp_path)])
    assert done.value.code == 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["rows"][0]["disaggregated"] >= 5


def test_plan_reports_the_traces_own_rate_wherever_it_starts(tmp_path):
    """A request every 2 s is 0.5 requests/s in plan's table and curve, whether the trace starts
    at 0 or 1000 s into a day (it printed 40 / 78 s = 0.513, and 40 / 1078 s = 0.037)."""
    doc = {"version": 1, "stages": {
        "text_encode": {"rows": [{"key": S, "batch": 1, "seconds": 0.01}]},
        "denoise_t2v": {"rows": [{"key": f"{S}/cfg/L64", "batch": 1, "seconds": 0.02}]},
        "vae_decode": {"rows": [{"key": S, "batch": 1, "seconds": 0.05}]}}}
    (tmp_path / "c.json").write_text(json.dumps(doc))
    for start in (0.0, 1000.0):
        tr = trace([{"at": start + 2.0 * i, "class": "S"} for i in range(40)])
        (tmp_path / "t.json").write_bytes(tr.dump())
        with pytest.raises(SystemExit) as done:
            main(["plan", "--workflow", str(deploy_dir() / "wan21-scale.yaml"), "--costs", str(tmp_path / "c.json"),
                  "--trace", str(tmp_path / "t.json"), "--loads", "1,2", "--out", str(tmp_path / "out")])
        assert done.value.code == 0
        rows = json.loads((tmp_path / "out" / "plan.json").read_text())["rows"]
        assert [r["rate_rps"] for r in rows] == [pytest.approx(0.5), pytest.approx(1.0)]


def test_plan_takes_a_trace_with_one_request_of_an_application(tmp_path):
    """The deployment per application is planned from Theorem 1 on that application's
    requests over the whole trace: one i2v request among 40 t2v ones spans no time alone, and
    plan refused the whole trace for it ("the trace's 1 request(s) all arrive at 41 s")."""
    from onepiece.sim import plan

    calls = ("text_encode", "image_encode", "vae_encode", "vae_decode")
    doc = {"version": 1, "stages": {
        **{s: {"rows": [{"key": S, "batch": 1, "seconds": 0.1}]} for s in calls},
        **{s: {"rows": [{"key": f"{S}/cfg/L64", "batch": 1, "seconds": 0.1}]} for s in ("denoise_t2v", "denoise_i2v")}}}
    (tmp_path / "c.json").write_text(json.dumps(doc))
    reqs = [{"at": 2.0 * i, "class": "S"} for i in range(40)]
    reqs.insert(21, {"at": 41.0, "class": "S", "app": "i2v"})
    tr = trace(reqs, {"S": {"size": "64x64", "num_frames": 9, "steps": 10, "slo_s": 40.0}})
    (tmp_path / "t.json").write_bytes(tr.dump())
    with pytest.raises(SystemExit) as done:
        main(["plan", "--workflow", str(deploy_dir() / "wan21-scale.yaml"), "--costs", str(tmp_path / "c.json"),
              "--trace", str(tmp_path / "t.json"), "--out", str(tmp_path / "out")])
    assert done.value.code == 0
    (row,) = json.loads((tmp_path / "out" / "plan.json").read_text())["rows"]
    assert row["separate"] == 3 + 5  # a stage of each, for each application
    # 1 s of denoising over the trace's 78 s: one instance
    assert plan.theorem1(WF, CostTable(doc), plan.only(tr, "i2v"), span=78.0)["denoise_i2v"] == 1
    with pytest.raises(SimInputError, match="all arrive at 41 s"):
        plan.theorem1(WF, CostTable(doc), plan.only(tr, "i2v"))


def test_a_late_result_or_a_late_drop_fails_at_the_dbs_deadline_verdict():
    """The DB fails a request at its deadline (+ its grace), and that is what the client sees:
    a stage that keeps it (drop_expired off) and finishes later does not make it completed."""
    from onepiece.db.store import DEADLINE_GRACE_S

    reqs = [{"at": 0.0, "class": "L", "timeout_s": 60}, {"at": 0.01, "class": "S", "timeout_s": 0.5}]
    wf = apply_schedule(WF, ["denoise_t2v.policy=fcfs", "denoise_t2v.drop_expired=false",
                             "vae_decode.drop_expired=false"])
    result, sim = simulate(wf, SET, table(), trace(reqs))
    late = result["requests"][1]
    assert late["outcome"] == "failed" and late["error"] == "deadline exceeded at stage denoise_t2v"
    assert late["latency_s"] == pytest.approx(0.5 + DEADLINE_GRACE_S)
    assert sim.journeys["r1"].spans[-1][0] == "vae_decode"  # the stages still served it to the end


def test_a_set_that_cannot_serve_what_it_takes_is_refused_and_quiet_time_costs_no_beats():
    reqs = [{"at": 0.0, "class": "S"}]
    with pytest.raises(SimInputError, match="set b takes application 't2v' .* no instance of 'vae_decode'"):
        Simulation(WF, {**SET, "b": {"text_encode": 1, "denoise_t2v": 1}}, table()).load(trace(reqs))
    with pytest.raises(SimInputError, match="no set has an instance of 'text_encode'"):
        Simulation(WF, {"set0": {**SET["set0"], "text_encode": 0}}, table()).load(trace(reqs))
    # A set without the entrance takes nothing, as a proxy with no entrance refuses.
    ok, _ = simulate(WF, {**SET, "b": {"text_encode": 0, "vae_decode": 1}}, table(), trace(reqs))
    assert ok["requests"][0]["set"] == "set0"
    # A month of quiet between two requests, with the request monitor's heartbeats: a few beats.
    from onepiece.config import ProxySpec

    sim = Simulation(WF, SET, table(), proxies={"set0": ProxySpec(monitor=True, max_inflight=10)})
    beats = []
    heartbeat = sim._heartbeat
    sim._heartbeat = lambda: (beats.append(sim.loop.now), heartbeat())
    sim.load(trace([{"at": 0.0, "class": "S"}, {"at": 30 * 86400.0, "class": "S"}]))
    records = sim.run()
    assert [r["outcome"] for r in records] == ["completed", "completed"] and len(beats) < 20


def test_sim_and_plan_flags_are_checked_before_any_work(tmp_path, capsys):
    tr = tmp_path / "t.json"
    tr.write_bytes(trace([{"at": 0.1 * i, "class": "S", "timeout_s": 30} for i in range(4)]).dump())
    costs = tmp_path / "c.json"
    costs.write_text(json.dumps({"version": 1, "stages": {
        s: {"rows": [{"key": k, "batch": b, "seconds": t} for k, row in rows.items() for b, t in row.items()]}
        for s, rows in table().rows.items()}}))
    sim = ["sim", "--trace", str(tr), "--costs", str(costs), "--workflow", str(deploy_dir() / "wan21-scale.yaml")]
    plan = ["plan", "--workflow", str(deploy_dir() / "wan21-scale.yaml"), "--costs", str(costs),
            "--classes", "S=64x64x9:10", "--out", str(tmp_path / "p")]
    for argv, says in (
            (sim + ["--instances", "text_encode=1,denoise_t2vv=1,vae_decode=1"], "unknown stage(s) ['denoise_t2vv']"),
            (sim + ["--instances", "denoise_t2v=1,denoise_t2v=3"], "denoise_t2v is given twice"),
            (sim + ["--instances", "denoise_t2v=1000000000"], "between 1 and 64"),
            (sim + ["--instances", "=1"], "expected STAGE=COUNT"),
            (sim + ["--instances", "denoise_t2v=1", "--sets", "1000000000"], "--sets: must be an integer between"),
            (sim + ["--instances", "denoise_t2v=1", "--schedule", "denoise_t2v.policy={"], "'{' is not a value"),
            (sim + ["--instances", "denoise_t2v=1", "--out", "/dev/null/x"], "cannot write to folder"),
            (sim + ["--instances", "denoise_t2v=1", "--host-cores", "0"], "--host-cores: must be"),
            (plan + ["--rate", "1", "--requests", "1"], "all arrive at 0 s"),
            (plan + ["--rate", "1", "--alpha", "0.9"], "miss their SLO even alone"),
            (plan + ["--rate", "1", "--gpus", "denoise_t2vv=2"], "--gpus: unknown stage(s)"),
            (plan + ["--rate", "1", "--elastic", "threshold={"], "'{' is not a value"),
            (plan + ["--trace", str(tr), "--rate", "1"], "a --trace brings its own arrivals"),
            (plan + ["--rate", "1", "--classes", "S=64x64x9:0"], "classes.S.steps: Input should be greater")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err, (argv, err)  # a usage or configuration error
    assert not (tmp_path / "p").exists() or not list((tmp_path / "p").iterdir())


def test_bench_simspeed_decides_a_step_at_a_time_only_while_requests_compete(tmp_path, capsys):
    """`bench simspeed` prices its requests at real Wan2.1 step times (0.14 s and more), so the
    core chunks one step at a time; a request alone in its stage gets an open run, and one that
    competes a held run (no decision at its chunks' ends while nothing changes), so a request
    costs few more runs than its three stages (3.3 at 0.7 of capacity, where chunk by chunk it
    was 9.4 of 20 steps); with `--chunk-steps` as long as a request, one run a stage."""
    out = []
    for extra in ([], ["--chunk-steps", "20"]):
        with pytest.raises(SystemExit) as e:
            main(["bench", "simspeed", "--requests", "300", "--sets", "2", "--steps", "20",
                  "--out", str(tmp_path / str(len(extra))), *extra])
        assert e.value.code == 0
        doc = json.loads((tmp_path / str(len(extra)) / "simspeed.json").read_text())
        assert doc["requests"] == 300 and doc["devices"] == 20 and doc["steps"] == 20
        assert doc["attainment"] > 0.9  # at 0.7 of capacity, SLOs of 4x standalone
        out.append(doc["chunks_per_request"])
    capsys.readouterr()
    assert 3.0 < out[0] <= 4.5  # a run a stage, and some cut where requests arrive
    assert out[1] == pytest.approx(3.0, abs=0.1)


def test_where_steps_vary_held_runs_serve_as_chunk_by_chunk_does(monkeypatch):
    """Held runs are exact where step times are steady (tests/test_sched_core.py); where they
    vary (each step's cost jittered, or stages sharing a host's cores) a held run's steps reach
    the cost model only as it ends. The same traces through `slo`, held and decided at every
    chunk's end, serve alike: SLO attainment within 2 points, mean latency within 3%, over three
    seeds of 300 requests at 1.1x the denoisers' capacity."""
    from onepiece.sched.policies import Slo

    sets = {s: {"text_encode": 1, "denoise_t2v": 2, "vae_decode": 1} for s in ("a", "b")}
    classes = parse_classes("S=64x64x9:10,M=128x128x9:12,L=192x192x17:10")
    for c, slo_s in (("S", 1.0), ("M", 3.0), ("L", 8.0)):
        classes[c]["slo_s"] = slo_s
    rows = [{"key": f"{k}/cfg/L64", "batch": 1, "seconds": t}
            for k, t in (("64x64x9", 0.02), ("128x128x9", 0.06), ("192x192x17", 0.2))]
    costs = CostTable({"version": 1, "stages": {
        "text_encode": {"rows": [{"key": k, "batch": 1, "seconds": 0.01} for k in ("64x64x9", "128x128x9", "192x192x17")]},
        "vae_decode": {"rows": [{"key": k, "batch": 1, "seconds": 0.02} for k in ("64x64x9", "128x128x9", "192x192x17")]},
        "denoise_t2v": {"rows": rows}}}, "t.json")
    capacity = 4 / (0.6 * 10 * 0.02 + 0.25 * 12 * 0.06 + 0.15 * 10 * 0.2)
    wf = apply_schedule(WF, ["denoise_t2v.policy=slo"])
    for step_cv, host in ((0.1, None), (0.0, 2.0)):
        got = {}
        for held in (True, False):
            if not held:
                monkeypatch.setattr(Slo, "stable_until", lambda self, view, r: view.now)
            out = []
            for seed in range(3):
                tr = poisson_trace(classes, {"S": 0.6, "M": 0.25, "L": 0.15}, 1.1 * capacity, 300, seed=seed)
                result, sim = simulate(wf, sets, costs, tr, chunks=False, step_cv=step_cv, seed=seed, host_cores=host)
                out.append((result["summary"]["all"]["attainment"], result["summary"]["all"]["mean_s"],
                            sum(vi.core.stats.batches for _, vi, _, _ in sim.lifetimes)))
            monkeypatch.undo()
            got[held] = [sum(x) / len(out) for x in zip(*out)]
        (a_held, m_held, n_held), (a_apart, m_apart, n_apart) = got[True], got[False]
        assert abs(a_held - a_apart) <= 0.02 and abs(m_held / m_apart - 1) <= 0.03, (step_cv, host, got)
        assert n_held < 0.8 * n_apart, (step_cv, host, got)  # (and it held: far fewer runs)
