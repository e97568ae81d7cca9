"""The tools around step scheduling: `onepiece profile` (a cost table from the real stage
functions, which a workflow's stage then starts from), the scale model profile, and request
traces (the format `bench sched` saves and `--trace` replays)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from onepiece.bench.trace import TraceError, load_trace, parse_classes, poisson_trace
from onepiece.cli import main as cli_main
from onepiece.config import deploy_dir, load_workflow
from onepiece.sched.costs import TableError, load_table


def _workflow(tmp_path: Path, models: dict[str, Path], **stage_schedule) -> Path:
    wf = yaml.safe_load((deploy_dir() / "wan21.yaml").read_text())
    for spec in wf["models"].values():
        spec["path"] = str(models[spec["tiny"]])
    for stage, sched in stage_schedule.items():
        wf["stages"][stage]["schedule"] = sched
    path = tmp_path / "wf.yaml"
    path.write_text(yaml.safe_dump(wf))
    return path


def test_profile_writes_a_table_a_stage_can_start_from(tiny_models, tmp_path, capsys):
    wf = _workflow(tmp_path, tiny_models)
    out = tmp_path / "costs.json"
    run = subprocess.run([sys.executable, "-m", "onepiece", "profile", "--workflow", str(wf), "--stage", "denoise_t2v",
                          "--stage", "vae_decode", "--shapes", "32x32x5,64x32x5", "--batch", "1,2", "--repeat", "2",
                          "--threads", "1", "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert doc["version"] == 1 and "seconds per step" in doc["units"]
    rows = load_table(out, "denoise_t2v")
    assert set(rows) == {"32x32x5/cfg/L64", "64x32x5/cfg/L64"} and all(set(r) == {1, 2} for r in rows.values())
    assert load_table(out, "vae_decode").keys() == {"32x32x5", "64x32x5"}
    assert all(t > 0 for r in rows.values() for t in r.values())
    # A workflow that names the table loads it (relative to itself) for that stage.
    (tmp_path / "tables").mkdir()
    out.rename(tmp_path / "tables" / "costs.json")
    wf2 = _workflow(tmp_path, tiny_models, denoise_t2v={"policy": "slo", "costs": "tables/costs.json"})
    assert load_workflow(wf2).cost_table("denoise_t2v", wf2.parent) == rows
    # Refused before any work: `onepiece`'s main in this process (a subprocess spent its
    # seconds importing torch for nothing but these lines)
    with pytest.raises(SystemExit) as bad:
        cli_main(["profile", "--workflow", str(wf), "--stage", "warp"])
    assert bad.value.code == 2 and "unknown stage(s) ['warp']" in capsys.readouterr().err
    # a grid value given twice wrote a second row for its cells: a table nothing loads
    with pytest.raises(SystemExit) as twice:
        cli_main(["profile", "--workflow", str(wf), "--stage", "vae_decode", "--shapes", "32x32x5,32x32x5",
                  "--batch", "1,2,1", "-o", str(tmp_path / "twice.json")])
    assert twice.value.code == 2 and not (tmp_path / "twice.json").exists()
    assert "--batch gives 1 twice; --shapes gives 32x32x5 twice" in capsys.readouterr().err


def test_profile_times_each_stage_at_its_own_threads(tiny_models, tmp_path, monkeypatch):
    """Building a stage's inputs runs the stages before it, each at its own threads; the stage
    was then timed at the last of theirs (text_encode's 1 for a denoise stage set to 2)."""
    import torch

    from onepiece.profile import Profiler
    from onepiece.stage.wan.functions import WanDenoise

    path = _workflow(tmp_path, tiny_models)
    wf = yaml.safe_load(path.read_text())
    wf["stages"]["text_encode"]["threads"], wf["stages"]["denoise_t2v"]["threads"] = 1, 2
    path.write_text(yaml.safe_dump(wf))
    seen = []
    step_batch = WanDenoise.step_batch

    def spy(tasks):
        seen.append(torch.get_num_threads())
        return step_batch(tasks)

    monkeypatch.setattr(WanDenoise, "step_batch", staticmethod(spy))
    before = torch.get_num_threads()
    try:
        rows = Profiler(load_workflow(path), path.parent, None, None).stage("denoise_t2v", [(32, 32, 5)], [1], 1)
    finally:
        torch.set_num_threads(before)
    assert rows and set(seen) == {2}


def test_profile_times_a_collaboration_group_per_dop_and_the_simulator_prices_it(tiny_models, tmp_path):
    from onepiece.sim.costs import CostTable

    wf = _workflow(tmp_path, tiny_models)
    out = tmp_path / "costs.json"
    run = subprocess.run([sys.executable, "-m", "onepiece", "profile", "--workflow", str(wf), "--stage", "denoise_t2v",
                          "--shapes", "32x32x5", "--batch", "1", "--dops", "1,2", "--repeat", "2", "--threads", "1",
                          "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = load_table(out, "denoise_t2v")
    assert set(rows) == {"32x32x5/cfg/L64", "32x32x5/cfg/L64@2"} and all(r[1] > 0 for r in rows.values())
    assert CostTable.load(out).step_s("denoise_t2v", "32x32x5/cfg/L64@2", 1) == rows["32x32x5/cfg/L64@2"][1]


def test_scale_profile_builds_the_real_classes_with_a_deeper_transformer(tmp_path):
    from diffusers import WanTransformer3DModel

    from onepiece.stage.wan.tiny import MARKER, build_tiny

    t2v = build_tiny("t2v", tmp_path / "t2v", profile="scale")
    i2v = build_tiny("i2v", tmp_path / "i2v", profile="scale")
    assert json.loads((t2v / MARKER).read_text())["profile"] == "scale"
    assert WanTransformer3DModel.load_config(t2v / "transformer")["num_layers"] == 24
    for shared in ("text_encoder", "vae"):  # the shared stages load them from the t2v build
        for f in (t2v / shared).iterdir():
            assert f.read_bytes() == (i2v / shared / f.name).read_bytes()
    with pytest.raises(ValueError, match="profile must be one of"):
        build_tiny("t2v", tmp_path / "x", profile="huge")
    assert load_workflow(deploy_dir() / "wan21-scale.yaml").models["wan-t2v"].profile == "scale"


def test_traces_round_trip_and_bad_ones_name_the_field(tmp_path):
    classes = parse_classes("S=64x64x9:50,L=128x128x17:50")
    classes["S"]["slo_s"], classes["L"]["slo_s"] = 2.0, 10.0
    slow = poisson_trace(classes, {"S": 0.7, "L": 0.3}, rate=1.0, n=20, seed=3)
    fast = poisson_trace(classes, {"S": 0.7, "L": 0.3}, rate=2.0, n=20, seed=3)
    assert [r.cls for r in slow.requests] == [r.cls for r in fast.requests]  # same sequence, stretched
    assert fast.requests[-1].at == pytest.approx(slow.requests[-1].at / 2, rel=1e-4)
    assert all(r.timeout_s == classes[r.cls]["slo_s"] and r.slo_s is None for r in slow.requests)
    soft = poisson_trace(classes, {"S": 0.7, "L": 0.3}, rate=1.0, n=20, seed=3, timeout_s=60.0)
    assert all(r.slo_s == classes[r.cls]["slo_s"] and r.timeout_s == 60.0 for r in soft.requests)
    assert soft.requests[0].body("p")["slo_s"] == classes[soft.requests[0].cls]["slo_s"]
    path = tmp_path / "t.json"
    path.write_bytes(slow.dump())
    again = load_trace(path)
    assert again.requests == slow.requests and again.classes == slow.classes
    doc = json.loads(path.read_text())
    for mutate, where in ((lambda d: d["requests"][3].update({"class": "XL"}), "requests[3].class"),
                          (lambda d: d["requests"][2].update({"at": -1}), "requests.2.at"),
                          (lambda d: d["requests"][1].update({"at": 1e7}), "requests[2].at"),
                          (lambda d: d["requests"][19].update({"at": 1e300}), "requests.19.at"),  # past MAX_AT_S
                          (lambda d: d.update(version=9), "version"),
                          (lambda d: d["requests"][0].update({"steps": "many"}), "requests.0.steps"),
                          (lambda d: d["requests"][4].update({"slo_s": 1e6}), "requests.4: slo_s")):
        bad = json.loads(json.dumps(doc))
        mutate(bad)
        path.write_text(json.dumps(bad))
        with pytest.raises(TraceError, match=f"t.json: {where}".replace("[", r"\[").replace("]", r"\]")):
            load_trace(path)
    path.write_text("{")
    with pytest.raises(TraceError, match="not JSON"):
        load_trace(path)


def test_the_calibration_mix_has_the_shares_exactly():
    from onepiece.bench.sched import exact_mix

    names = exact_mix({"S": 0.6, "M": 0.3, "L": 0.1}, 20)
    assert (names.count("S"), names.count("M"), names.count("L")) == (12, 6, 2)
    names = exact_mix({"S": 0.6, "M": 0.3, "L": 0.1}, 7)  # 4.2, 2.1, 0.7: largest remainder
    assert (names.count("S"), names.count("M"), names.count("L")) == (4, 2, 1)


def test_the_order_bound_is_srpt_against_fcfs_on_one_server():
    """A 10 s request at 0 and a 1 s one at 1: FCFS ends them at 10 and 11 (mean latency 10);
    SRPT runs the short one at once (latency 1) and the long one ends at 11 (mean 6)."""
    from onepiece.bench.sched import order_bound
    from onepiece.bench.trace import Trace

    classes = {"L": {"size": "8x8", "num_frames": 1, "steps": 1, "standalone_s": 10.0},
               "S": {"size": "8x8", "num_frames": 1, "steps": 1, "standalone_s": 1.0}}
    req = {"size": "8x8", "num_frames": 1, "steps": 1}
    trace = Trace.model_validate({"version": 1, "classes": classes,
                                  "requests": [{"at": 0.0, "class": "L", **req}, {"at": 1.0, "class": "S", **req}]})
    assert order_bound(trace) == pytest.approx(0.6)
    # Each alone (no overlap): no order can help.
    apart = trace.model_copy(update={"requests": [trace.requests[0], trace.requests[1].model_copy(update={"at": 20.0})]})
    assert order_bound(apart) == pytest.approx(1.0)
    # A trace without standalone times (one made by hand): no bound.
    del classes["S"]["standalone_s"]
    assert order_bound(Trace.model_validate({**trace.model_dump(by_alias=True), "classes": classes})) is None


def test_the_mean_latency_is_over_the_admitted_requests_only():
    """A request the proxy answered with an error at once was counted in the mean of the admitted
    ones at its deadline (a 2 s run read 46 s), and one the client gave up on without a deadline
    at 0 s (the same run read 1 s)."""
    from onepiece.bench.trace import summarize

    def rec(outcome: str, latency: float | None, timeout_s: float | None = 90.0) -> dict:
        return {"class": "S", "t_send": 0.0, "outcome": outcome, "latency_s": latency, "answer_s": 0.01,
                "timeout_s": timeout_s}

    done = rec("completed", 2.0)
    s = summarize([done, rec("error", None)], {"S": 5.0})["all"]
    assert s["mean_s"] == pytest.approx(2.0) and s["other"] == 1 and s["attainment"] == pytest.approx(0.5)
    assert summarize([done, rec("timeout", None, None)], {"S": 5.0})["all"]["mean_s"] == pytest.approx(2.0)
    # With a deadline, one never resolved counts at it; a failed one at its failure; a refusal not at all.
    s = summarize([done, rec("timeout", None), rec("failed", 4.0), rec("rejected", None)], {"S": 5.0})["all"]
    assert s["mean_s"] == pytest.approx((2.0 + 90.0 + 4.0) / 3)


def test_a_results_stages_come_from_its_own_trace_as_the_simulator_gives_them():
    from onepiece.bench.trace import stage_spans, stage_times

    t0 = 1000.0
    ns = lambda s: int((t0 + s) * 1e9)  # noqa: E731
    events = [{"stage": "proxy", "event": "leave", "t": ns(0.002)},
              {"stage": "text_encode", "event": "recv", "t": ns(0.003)},
              {"stage": "text_encode", "event": "start", "t": ns(0.004)},
              {"stage": "text_encode", "event": "end", "t": ns(0.010)},
              {"stage": "denoise_t2v", "event": "recv", "t": ns(0.011)},
              {"stage": "denoise_t2v", "event": "end", "t": ns(0.111)},
              {"stage": "vae_decode", "event": "recv", "t": ns(0.112)},  # no end: left out
              "not an event", {"stage": "x", "event": "end", "t": "soon"}]
    spans = stage_spans(events, t0)
    assert [(s["stage"], round(s["enter"], 6), round(s["leave"], 6)) for s in spans] == [
        ("text_encode", 0.003, 0.01), ("denoise_t2v", 0.011, 0.111)]
    assert stage_spans(None, t0) == [] and stage_spans({"t": 1}, t0) == []
    recs = [{"class": "S", "outcome": "completed", "latency_s": 0.2, "stages": spans},
            {"class": "S", "outcome": "failed", "latency_s": 9.0, "stages": spans},  # not counted
            {"class": "S", "outcome": "completed", "latency_s": 0.3}]  # no stages: not counted
    times = stage_times(recs)
    assert times["S"]["text_encode"] == pytest.approx(0.007) and times["S"]["denoise_t2v"] == pytest.approx(0.1)
    assert times["S"]["between"] == pytest.approx(0.2 - 0.107)


def test_a_runs_cost_table_charges_the_means_over_its_trace():
    from onepiece.bench.sched import cost_table
    from onepiece.sched.costs import table_figure, table_fixed, table_rows

    key = "64x64x9/cfg/L64"

    def stages(sums: dict, fixed: list, overhead: list) -> dict:
        stats = {"costs": {key: {"1": 0.010, "2": 0.015}}, "cost_totals": {"steps": {key: sums}, "fixed": {key: fixed}},
                 "overhead_total": overhead}
        return {"denoise_t2v": {"instances": [{"id": "a", "stats": stats}]},
                "vae_decode": {"instances": [{"id": "b", "stats": {"costs": {"64x64x9": {"1": 0.05}}}}]}}

    # [seconds, steps, squared seconds]: over the trace, batch 1's 100 steps average 15 ms with a
    # standard deviation of 3 ms (CV 0.2), batch 2's 20 steps are all 15 ms (CV 0)
    began = stages({"1": [1.0, 100, 0.011]}, [0.2, 10], [0.05, 50])
    ended = stages({"1": [2.5, 200, 0.011 + 100 * (0.003 ** 2 + 0.015 ** 2)], "2": [0.3, 20, 20 * 0.015 ** 2]},
                   [0.5, 20], [0.35, 110])
    doc = cost_table(ended, began)
    # the chunks' decision and IPC over the trace: 0.3 s over 60 chunks; none known at vae_decode
    assert table_figure(doc, "denoise_t2v", "overhead_s") == pytest.approx(0.005)
    assert table_figure(doc, "vae_decode", "overhead_s") is None
    # how much the steps varied, pooled by steps: sqrt((100 * 0.2^2 + 20 * 0) / 120)
    assert table_figure(doc, "denoise_t2v", "step_cv") == pytest.approx((100 * 0.04 / 120) ** 0.5, abs=1e-4)
    assert table_figure(doc, "vae_decode", "step_cv") is None  # no sums (a stage from before)
    doc["stages"]["denoise_t2v"]["step_cv"] = -0.1
    with pytest.raises(TableError, match=r"stages.denoise_t2v.step_cv: expected a number in \[0, 10\]"):
        table_figure(doc, "denoise_t2v", "step_cv")
    doc = cost_table(ended, began)
    # over the trace: 1.5 s over 100 steps at batch 1, 0.3 s over 20 at 2; 0.3 s over 10 requests
    assert table_rows(doc, "denoise_t2v") == {key: {1: pytest.approx(0.015), 2: pytest.approx(0.015)}}
    assert table_fixed(doc, "denoise_t2v") == {key: pytest.approx(0.03)} and table_fixed(doc, "vae_decode") == {}
    assert table_rows(doc, "vae_decode") == {"64x64x9": {1: 0.05}}  # no sums (a stage from before): its medians
    # Without a start: since the stage started. A size no step of the trace ran: its median.
    assert table_rows(cost_table(ended), "denoise_t2v")[key][1] == pytest.approx(2.5 / 200)
    assert table_rows(cost_table(began, began), "denoise_t2v") == {key: {1: 0.010, 2: 0.015}}


def test_a_runs_cost_table_pools_a_stages_instances():
    """Two instances of a stage measured the same key: a row each made a table that the simulator
    refuses ("a second row for key"); their sums are pooled, as the chunks and spreads were."""
    from onepiece.bench.sched import cost_table
    from onepiece.sim.costs import CostTable

    key = "64x64x9/cfg/L64"

    def instance(i: str, seconds: float, steps: int, fixed: list) -> dict:
        return {"id": i, "stats": {"costs": {key: {"1": seconds / steps, "2": 0.02}},
                                   "cost_totals": {"steps": {key: {"1": [seconds, steps]}}, "fixed": {key: fixed}}}}

    doc = cost_table({"denoise_t2v": {"instances": [instance("a", 1.0, 100, [0.1, 10]),
                                                    instance("b", 3.0, 100, [0.5, 10])]}})
    costs = CostTable(doc, "two instances")
    # 4 s over 200 steps; batch 2, run by neither over the trace: their medians' mean
    assert costs.rows["denoise_t2v"] == {key: {1: pytest.approx(0.02), 2: pytest.approx(0.02)}}
    assert costs.fixed["denoise_t2v"] == {key: pytest.approx(0.6 / 20)}


def test_simval_states_the_sampling_margin_of_a_measured_attainment():
    from onepiece.bench.simval import margin

    # 80% of 60 requests: about ±10 points at 95%; 5 points needs about four times the requests
    assert margin(0.8, 60) == pytest.approx(0.10, abs=0.005)
    assert margin(0.8, 240) < 0.055
    # all on time says little about a handful of requests, and never "exactly"
    assert margin(1.0, 5) > 0.2 and 0 < margin(1.0, 1000) < margin(1.0, 60)
    assert margin(0.5, 0) == 1.0


def test_simval_counts_the_requests_a_simulated_monitor_decided_as_the_run_did():
    from onepiece.bench.simval import admitted_alike

    def recs(outcomes: str) -> list[dict]:  # one letter per request in send order: c(ompleted), r(efused)
        return [{"at": float(i), "outcome": "rejected" if o == "r" else "completed"} for i, o in enumerate(outcomes)]

    run, sim = recs("crrcc"), recs("cccrc")
    assert admitted_alike(run, sim) == 2  # the 1st and the 5th
    assert admitted_alike(run, list(reversed(run))) == 5  # matched by send time, not by list order


def test_bench_sched_saves_what_has_run_as_each_policy_ends(tmp_path):
    """`bench sched` writes sched.json, .md and .png after each policy, so that a run stopped at
    a time limit keeps the policies it finished; its final report adds the monitor-on row
    without judging the targets on it."""
    import argparse
    import time

    from onepiece.bench.sched import report
    from onepiece.bench.trace import Trace

    classes = {"S": {"size": "8x8", "num_frames": 1, "steps": 1, "standalone_s": 1.0, "slo_s": 2.0},
               "L": {"size": "8x8", "num_frames": 1, "steps": 1, "standalone_s": 3.0, "slo_s": 9.0}}
    req = {"size": "8x8", "num_frames": 1, "steps": 1}
    trace = Trace.model_validate({"version": 1, "classes": classes,
                                  "requests": [{"at": 0.0, "class": "S", **req}, {"at": 0.5, "class": "L", **req}]})

    def recs(s_latency: float) -> list[dict]:
        return [{"class": "S", "outcome": "completed", "latency_s": s_latency, "t_send": 0.0},
                {"class": "L", "outcome": "completed", "latency_s": 4.0, "t_send": 0.5}]

    args = argparse.Namespace(mix="0.5,0.5", alpha="2,3", max_batch=4, device="cpu", profile="tiny")
    results: dict = {"fcfs": {"1x": recs(3.0)}}
    common = (tmp_path, args, time.monotonic(), classes, ["S", "L"], {"S": 0.5, "L": 0.5}, {}, {"1x": trace})
    report(*common, results, {"fcfs": None})
    saved = json.loads((tmp_path / "sched.json").read_text())
    assert list(saved["rows"]) == ["fcfs"] and (tmp_path / "sched.png").stat().st_size > 0
    assert "| fcfs | 1x | all | 2 |" in (tmp_path / "sched.md").read_text()
    results["srtf"] = {"1x": recs(1.0)}
    results["srtf (monitor on)"] = {"monitor on 1.2x": recs(0.5)}
    # what each part's steps cost (the cost tables bench sched saves under each trace): srtf's
    # part ran on a machine 30% slower, and the report says so beside the figures
    for policy, f in (("fcfs", 1.0), ("srtf", 1.3)):
        (tmp_path / f"sched-costs-{policy}-1x.json").write_text(json.dumps({"version": 1, "stages": {
            "denoise_t2v": {"rows": [{"key": "8x8x1/cfg/L64", "batch": 1, "seconds": 0.02 * f},
                                     {"key": "8x8x1/cfg/L64", "batch": 2, "seconds": 0.05}]},
            "vae_decode": {"rows": [{"key": "8x8x1", "batch": 1, "seconds": 0.1 * f}]}}}))
    targets = report(*common, results, {"fcfs": None, "srtf": None}, final=True)
    saved = json.loads((tmp_path / "sched.json").read_text())
    assert list(saved["rows"]) == ["fcfs", "srtf", "srtf (monitor on)"]
    assert targets["best"] == "srtf" and saved["targets"]["attainment"]["value"] == 1.0
    assert saved["pace"] == {"1x": {"fcfs": 1.0, "srtf": pytest.approx(1.3)}}
    assert "1x: fcfs 1.00×, srtf 1.30×" in (tmp_path / "sched.md").read_text()


def test_pace_is_what_a_parts_steps_cost_against_the_first_parts():
    """On the committed run on one worker in which `slo` met 38%: its part's batch-1 steps and
    calls cost 31% more than during fcfs's (srtf's 5%); in a run whose parts ran alike, ~1.
    Rows not every table has are left out; tables with none in common say nothing."""
    from onepiece.bench.pace import pace

    def tables(run: str) -> dict:
        d = Path(__file__).resolve().parents[1] / "bench" / "results" / "sched-repeat" / run
        order = list(json.loads((d / "sched.json").read_text())["rows"])
        return {p: json.loads((d / f"sched-costs-{p}-sched-trace-1x.json").read_text()) for p in order}

    slow = pace(tables("1x-1"))
    assert list(slow) == ["fcfs", "srtf", "slo"] and slow["fcfs"] == 1.0
    assert 1.25 < slow["slo"] < 1.4 and 1.0 < slow["srtf"] < 1.1
    alike = pace(tables("1x-3"))
    assert all(0.95 < x < 1.1 for x in alike.values())
    one = {"version": 1, "stages": {"vae_decode": {"rows": [{"key": "8x8x1", "batch": 1, "seconds": 0.1}]}}}
    other = {"version": 1, "stages": {"vae_decode": {"rows": [{"key": "16x16x1", "batch": 1, "seconds": 0.1}]}}}
    assert pace({"a": one, "b": other}) == {"a": None, "b": None} and pace({}) == {}


def test_bench_sched_refuses_a_trace_it_cannot_run_before_any_deployment(tmp_path, capsys):
    """A malformed trace, a class without slo_s (a KeyError after the whole run) or a request the
    deployment answers with a 400 (counted as nothing: n=1, completed/failed/refused 0) is a
    usage error naming --trace and what is wrong, before a deployment starts."""
    from onepiece.bench import sched
    from onepiece.cli import build_parser, main

    classes = parse_classes("S=64x64x9:2")
    classes["S"]["slo_s"] = 5.0
    doc = json.loads(poisson_trace(classes, {"S": 1.0}, rate=1.0, n=3, seed=0).dump())
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    args = build_parser().parse_args(["bench", "sched", "--trace", str(path), "--out", str(tmp_path)])
    assert sched.check_args(args) is None  # a trace it can run
    for mutate, said in ((lambda d: d["classes"]["S"].pop("slo_s"), "classes S have no slo_s"),
                         (lambda d: d["requests"][1].update(app="i2v"), "requests[1] (class S): application 'i2v' is not"),
                         (lambda d: d["requests"][2].update(size="1024x1024"), "exceeds the limit 512x512"),
                         (lambda d: d["requests"][0].update({"class": "X"}), "'X' is not in classes"),
                         (lambda d: d.clear(), "version")):
        bad = json.loads(json.dumps(doc))
        mutate(bad)
        path.write_text(json.dumps(bad))
        with pytest.raises(SystemExit) as done:
            main(["bench", "sched", "--trace", str(path), "--out", str(tmp_path)])
        err = capsys.readouterr().err
        assert done.value.code == 2 and f"argument --trace: {path}: " in err and said in err, err
        assert "Traceback" not in err


def test_sched_targets_with_fcfs_meeting_no_slo_are_null_and_not_met():
    """fcfs at 0% gave an attainment ratio of inf: `Infinity` in sched.json (not JSON) and "met"
    in sched.md while both policies met no SLO."""
    from onepiece.bench.sched import check_targets

    def cell(att: float, mean: float) -> dict:
        one = {"n": 4, "completed": 4, "attainment": att, "mean_s": mean}
        return {"all": one, "S": one}

    t = check_targets({"fcfs": {"1x": cell(0.0, 9.0)}, "edf": {"1x": cell(0.0, 8.0)}}, "1x", ["S"])
    assert t["attainment_ratio"]["value"] is None and t["attainment_ratio"]["met"] is False
    json.dumps(t, allow_nan=False)  # valid JSON: null, no Infinity
    # a trace that drew no large request does not show that every large one completes (0/0 was met)
    t = check_targets({"fcfs": {"1x": cell(0.5, 9.0)}, "edf": {"1x": cell(0.5, 8.0)}}, "1x", ["S", "L"])
    assert t["large_completed"] == {"value": "0/0 (L)", "target": "all", "met": False}


def test_overload_targets_that_cannot_be_formed_are_not_met():
    """With levels 1 and 5 run, nothing completed at 5x (no p99) or no goodput at 1x left the
    target out of the table, as if it had not been run, instead of not met."""
    from onepiece.bench.overload import check_targets

    def row(load: float, p99: float | None, goodput: float) -> dict:
        return {"run": "on", "load": load, "accepted_p99_s": p99, "goodput_rps": goodput}

    t = check_targets([row(1.0, 0.2, 0.0), row(5.0, None, 0.0)], [])
    assert t["p99_5x_over_1x"] == {"value": None, "target": "≤ 1.2", "met": False}
    assert t["goodput_5x_over_1x"]["value"] is None and t["goodput_5x_over_1x"]["met"] is False
    assert check_targets([row(1.0, 0.2, 2.0)], []) == {}  # no 5x level: nothing to judge


def test_bench_dop_and_parallel_tables_are_well_formed():
    """dop: a class that drew no request is "—", not 0.0% and a mean of 0.0; parallel: with DoP 1
    alone, the delimiter row has as many cells as the header."""
    from onepiece.bench.dop import markdown as dop_md
    from onepiece.bench.parallel import markdown as parallel_md

    one = {"n": 3, "attainment": 1.0, "mean_s": 2.0}
    md = dop_md({"when": "now", "costs": "c.json", "capacity_work_s": 1.0, "targets": [],
                 "classes": {c: {"size": "512x512", "num_frames": 1, "steps": 50, "slo_s": 1.0} for c in "SL"},
                 "rows": [{"gpus": 4, "load": 0.5, "config": "elastic slo", "summary": {"all": one, "S": one}}]})
    row = next(line for line in md.splitlines() if "elastic slo" in line)
    assert row.split(" | ")[4:] == ["100.0%", "—", "2.0", "2.0", "— |"], row
    md = parallel_md({"when": "now", "cpu": "x", "cores": 2, "device": "cpu", "threads_per_rank": 1, "steps": 1,
                      "model": "m", "dops": [1], "overhead": None,
                      "rows": [{"shape": "64x64x9", "cfg": True, "tokens": 10, "step_ms": {1: 1.0}, "speedup": {1: 1.0}}]})
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 3 and len({line.count("|") for line in table}) == 1, table


def test_bench_batching_judges_the_largest_batch_size_whatever_the_order_given():
    """`--batches 1,8,4` ran 8 before 4 and judged the targets at 4, the last given, in a table
    that calls it the max batch."""
    from onepiece.bench.batching import batch_sizes

    assert batch_sizes([1, 8, 4]) == [1, 4, 8]
    assert batch_sizes([4, 1, 4]) == [1, 4]
    with pytest.raises(SystemExit, match="include 1"):
        batch_sizes([2, 4])


def test_bench_parallel_measures_each_dop_once_smallest_first():
    """`--dops 2,1` took DoP 2 as the baseline: its "speedup 1" was DoP 2's time over DoP 1's."""
    import argparse

    from onepiece.bench.parallel import _dops

    assert _dops(argparse.Namespace(dops=[2, 1, 2], device="cpu")) == [1, 2]


def test_bench_batching_marks_a_throughput_that_only_the_arrivals_bounded():
    """The H200 run's batch 4 completed 1.163 req/s of a trace that let through at most 1.166
    (its last arrival plus its shortest latency): nothing queued, so that is a lower bound of
    what the stage sustains, not the figure (it was quoted as 'sustains 2.54x')."""
    from onepiece.bench.batching import summary

    def rec(at: float, latency: float) -> dict:
        return {"t_send": at, "latency_s": latency, "outcome": "completed"}

    free = summary([rec(float(i), 0.5) for i in range(10)])  # a request a second, each done in 0.5 s
    assert free["ceiling_rps"] == pytest.approx(10 / 9.5) and free["arrival_bound"]
    queued = summary([rec(0.1 * i, 0.5 + 0.4 * i) for i in range(10)])  # each waits behind the last
    assert queued["throughput_rps"] == pytest.approx(10 / (0.9 + 4.1)) and not queued["arrival_bound"]


def test_bench_sched_says_what_load_a_seeded_trace_really_offers():
    """Every 1.0x CPU trace was the same seed-0 draw, stretched: its arrivals 5.4% faster than
    the nominal rate and 5% more work than the mix, 1.107x C in all. sched.md now says so."""
    from onepiece.bench.sched import offered
    from onepiece.bench.trace import Trace

    classes = {"S": {"size": "64x64", "num_frames": 9, "steps": 5, "standalone_s": 1.0},
               "L": {"size": "64x64", "num_frames": 9, "steps": 5, "standalone_s": 3.0}}
    reqs = [{"at": 0.5 * i, "app": "t2v", "class": c, "size": "64x64", "num_frames": 9, "steps": 5}
            for i, c in enumerate("SSSL")]
    tr = Trace.model_validate({"version": 1, "classes": classes, "requests": reqs, "load": 1.0, "capacity_rps": 1.5})
    got = offered(tr, {"S": 0.5, "L": 0.5})  # 2 req/s against 1.5 nominal; 1.5 s of work against the mix's 2
    assert got == pytest.approx({"rate": 2 / 1.5, "work": 0.75, "load": 1.0})
    assert offered(Trace.model_validate({"version": 1, "classes": classes, "requests": reqs}), {"S": 1.0}) is None


def test_bench_sched_stretches_a_seeded_trace_to_offer_its_nominal_load():
    from onepiece.bench.sched import at_load, offered
    from onepiece.bench.trace import poisson_trace

    classes = {c: {"size": "64x64", "num_frames": 9, "steps": 5, "standalone_s": t}
               for c, t in (("S", 0.4), ("L", 3.5))}
    mix = {"S": 0.9, "L": 0.1}
    cap = 1 / (0.9 * 0.4 + 0.1 * 3.5)
    drawn = poisson_trace(classes, mix, cap, 60, 0, capacity_rps=cap, load=1.0)
    assert abs(offered(drawn, mix)["load"] - 1.0) > 0.05  # what the seed drew
    fixed = at_load(drawn, mix)
    assert offered(fixed, mix)["load"] == pytest.approx(1.0)
    assert [r.cls for r in fixed.requests] == [r.cls for r in drawn.requests]  # the same requests, stretched
    ratios = {round(b.at / a.at, 9) for a, b in zip(drawn.requests[1:], fixed.requests[1:])}
    assert len(ratios) == 1


def test_simval_replays_a_collaboration_group_run_on_its_group():
    """`bench sched --denoise-workers 2 --collaboration` ran the denoise stage as one group of
    two ranks; simval replays it so (it simulated one worker and refused the DoP-blind runs'
    tables, whose rows are all at DoP 2). The committed run of 2026-11-27: every policy
    replayed, each mean latency within the 10% target."""
    from onepiece.bench.simval import validate

    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    doc = validate(results / "sched-collab-2", seeds=1)
    assert list(doc["rows"]) == ["fcfs", "srtf", "slo", "edf-best-fit"]
    for by_load in doc["rows"].values():
        m, p = by_load["1x"]["measured"]["all"], by_load["1x"]["predicted"]["all"]
        assert abs(p["mean_s"] - m["mean_s"]) <= 0.10 * m["mean_s"], (m, p)
    # The same trace replayed (`--trace`) on two individual workers: the run names the path it
    # read, gone since; given where the trace is now, each policy is replayed on two workers
    # (fcfs's mean on one would be several times the measured).
    replayed = results / "sched-individual-2"
    doc = validate(replayed, seeds=1, replay=results / "sched-collab-2" / "sched-trace-1x.json")
    assert list(doc["rows"]) == ["fcfs", "srtf", "slo"]
    m, p = (doc["rows"]["fcfs"]["sched-trace-1x"][side]["all"] for side in ("measured", "predicted"))
    assert abs(p["mean_s"] - m["mean_s"]) <= 0.10 * m["mean_s"], (m, p)


def test_simval_reports_a_cell_it_cannot_price_and_replays_the_others():
    """`slo` on a group of two ran every step at DoP 2 (its knee for every shape there), so its
    run measured no DoP 1, which the simulator must price for a policy that picks DoPs: that
    cell is named with the reason, the others replayed, and the targets not called met."""
    from onepiece.bench.simval import markdown, validate

    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    doc = validate(results / "sched-collab-5-slo" / "0.8x", seeds=1,
                   replay=results / "sched-collab-5" / "sched-trace-0.8x.json")
    assert list(doc["rows"]) == ["srtf"]
    (skipped,) = doc["skipped"]
    assert skipped["policy"] == "slo" and "no row for key '64x64x9/cfg/L64'" in skipped["why"]
    assert not doc["targets"]["attainment_points"]["met"] and "Not replayed" in markdown(doc)


def test_simval_lays_the_simulated_schedule_beside_the_measured_one():
    """A run that saved its schedules (`bench sched` since 2026-11-27): simval measures from them
    how the steps slowed beside another stage's work, and keeps each cell's simulated schedule
    under the run's own names (r0, r1, ...), to open the two side by side. The committed run of
    the group of two at 1.0x: srtf replayed, `slo` not (no DoP 1 measured)."""
    from onepiece.bench.simval import validate

    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    doc = validate(results / "sched-collab-6" / "group-1x", seeds=1,
                   replay=results / "sched-collab-5" / "sched-trace-1x.json")
    (name,) = doc["schedules"]
    assert name == "sched-schedule-srtf-sched-trace-1x.json"
    measured = json.loads((results / "sched-collab-6" / "group-1x" / name).read_text())["traceEvents"]
    simulated = doc["schedules"][name]["traceEvents"]
    uids = lambda events: {u for e in events if e["ph"] == "X" for u in e["args"]["uids"]}  # noqa: E731
    assert uids(simulated) == uids(measured) == {f"r{i}" for i in range(60)}
    rows = {(r["class"], r["dop"], r["batch"]): r for r in doc["sharing"]}
    for cls in "SML":  # each class's steps at DoP 2 alone, and slower beside another stage's call
        r = rows[(cls, 2, 1)]
        assert r["alone_n"] >= 10 and r["beside_n"] >= 10 and r["ratio"] > 1.3, r


def test_a_runs_steps_alone_are_those_with_a_core_for_every_rank_and_price_its_table_alone():
    """`bench/sharing.py` on a schedule of two cores: a chunk counts as alone where its ranks and
    those of every chunk beside it fit the cores; a table row takes the mean of its alone chunks'
    passes, and a row without enough of them is scaled as its stage's other rows were."""
    from onepiece.bench.sharing import alone_passes, alone_table

    def chunk(stage: str, ts: float, dur: float, steps: int, dop: int, uid: str) -> dict:
        return {"ph": "X", "ts": ts * 1e6, "dur": dur * 1e6, "args": {"stage": stage, "uids": [uid], "steps": steps,
                                                                       "parts": [[dop, [uid]]]}}
    events = [chunk("denoise_t2v", 0.0, 0.1, 2, 2, "r0"), chunk("text_encode", 0.05, 0.02, 1, 1, "r1"),
              *(chunk("denoise_t2v", t, 0.08, 2, 2, "r0") for t in (0.2, 0.3, 0.4)),
              chunk("vae_decode", 0.6, 0.05, 1, 1, "r1")]
    passes = alone_passes(events, {"r0": "S", "r1": "M"}, cores=2)
    # the first denoise chunk and the text call overlapped: 3 ranks on 2 cores, neither alone
    assert passes == {("denoise_t2v", "S", 2, 1): [pytest.approx(0.04)] * 3, ("vae_decode", "M", 1, 1): [0.05]}
    doc = {"version": 1, "stages": {
        "denoise_t2v": {"rows": [{"key": "64x64x9/cfg/L64@2", "batch": 1, "seconds": 0.06},
                                 {"key": "128x128x17/cfg/L64@2", "batch": 1, "seconds": 0.2}]},
        "vae_decode": {"rows": [{"key": "128x128x17", "batch": 1, "seconds": 0.07}]}}}
    alone, taken = alone_table(doc, passes, {"S": "64x64x9", "M": "128x128x17"})
    rows = {(s, r["key"]): r["seconds"] for s, e in alone["stages"].items() for r in e["rows"]}
    assert rows[("denoise_t2v", "64x64x9/cfg/L64@2")] == pytest.approx(0.04)
    assert rows[("denoise_t2v", "128x128x17/cfg/L64@2")] == pytest.approx(0.2 * 0.04 / 0.06)  # scaled alike
    assert rows[("vae_decode", "128x128x17")] == 0.07  # one alone call is too few to say
    assert taken == {"denoise_t2v": 1, "vae_decode": 0} and doc["stages"]["denoise_t2v"]["rows"][0]["seconds"] == 0.06


def test_simval_replays_a_run_on_its_shared_host_and_keeps_the_device_each_prediction_beside():
    """The committed run of two individual workers at 1.0x (2026-11-27) saved its schedules: simval
    shares its 2 cores among the three stages' workers, each step priced alone, and keeps the
    prediction with a device per worker beside it. On that run the shared host predicts srtf's
    mean latency closer to the measured one (2.43 against 2.24 s over 5 seeds, measured 2.74;
    since the core holds runs, one seed alone puts the two within 0.03 s; `slo`'s depends on the
    seed more than on the model)."""
    from onepiece.bench.simval import markdown, validate

    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    doc = validate(results / "sched-collab-6" / "individual-1x", seeds=5,
                   replay=results / "sched-collab-5" / "sched-trace-1x.json")
    assert list(doc["rows"]) == ["srtf", "slo"]
    for by_load in doc["rows"].values():
        cell = by_load["sched-trace-1x"]
        m, host, apart = cell["measured"]["all"], cell["predicted"]["all"], cell["apart"]
        assert cell["host_cores"] == 2 and host != apart
    m, host, apart = (doc["rows"]["srtf"]["sched-trace-1x"][k] for k in ("measured", "predicted", "apart"))
    assert abs(host["all"]["mean_s"] - m["all"]["mean_s"]) < abs(apart["mean_s"] - m["all"]["mean_s"]) - 0.1
    assert "a device each" in markdown(doc)


def test_simval_says_why_when_no_cell_of_a_run_can_be_replayed(tmp_path):
    """A run of `slo` alone whose group ran every step at DoP 2 measured no DoP 1, which the
    simulator needs to price a policy that picks DoPs: simval names that, not a missing table."""
    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "simval", "--results", str(results / "sched-collab-7" / "slo-2"), "--out", str(tmp_path),
              "--trace", str(results / "sched-collab-5" / "sched-trace-1.3x.json")])
    assert "no cell could be replayed: slo at sched-trace-1.3x" in str(e.value)
    assert "no row for key '64x64x9/cfg/L64'" in str(e.value)


def test_simval_fills_what_a_runs_table_lacks_from_another_only_where_a_cell_needs_it(tmp_path):
    """The same `slo` run, with `--rows-from` another run's table of the same machine that has
    DoP 1: the cell is replayed, its source names the rows it took, and a cell that did not need
    them (srtf in a pair) is replayed on its own table alone."""
    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    trace, donor = results / "sched-collab-5" / "sched-trace-1.3x.json", \
        results / "sched-collab-7" / "slo-1" / "sched-costs-slo-sched-trace-1.3x.json"
    from onepiece.bench.simval import validate

    doc = validate(results / "sched-collab-7" / "slo-2", seeds=1, replay=trace, rows_from=donor)
    cell = doc["rows"]["slo"]["sched-trace-1.3x"]
    assert not doc["skipped"] and cell["rows_filled"] > 0 and cell["host_cores"] == 2
    pair = validate(results / "sched-collab-7" / "pair-1", seeds=1, replay=trace, rows_from=donor)
    assert pair["rows"]["srtf"]["sched-trace-1.3x"]["rows_filled"] == 0
    assert pair["rows"]["slo"]["sched-trace-1.3x"]["rows_filled"] > 0
    with pytest.raises(SystemExit):
        cli_main(["bench", "simval", "--results", str(results / "sched-collab-7" / "slo-2"), "--out", str(tmp_path),
                  "--rows-from", str(trace)])  # a trace is no cost table: refused before any work


def test_simpool_pools_repeated_runs_of_a_trace_by_policy_and_setup_and_pairs_each_run_with_its_prediction(
        tmp_path, capsys):
    """`bench simpool` on three committed runs of one trace on the group (each with the simval.json
    bench simval wrote for it): per policy and class, the runs' mean measured and predicted figures,
    the mean paired difference and its 95% interval; a run of another setup is a pool of its own;
    a folder without a simval.json is refused as it is read."""
    from onepiece.bench import simpool

    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    runs = [results / "sched-collab-7" / n for n in ("pair-1", "pair-2", "slo-3")] \
        + [results / "sched-collab-6" / "individual-1.3x"]
    doc = simpool.pool(runs)
    rows = {(r["policy"], r["setup"], r["class"]): r for r in doc["rows"]}
    group = "2 denoise workers, one group, max batch 4"
    slo = rows[("slo", group, "all")]
    cells = [json.loads((d / "simval.json").read_text())["rows"]["slo"]["sched-trace-1.3x"] for d in runs[:3]]
    m = [c["measured"]["all"]["attainment"] * 100 for c in cells]
    p = [c["predicted"]["all"]["attainment"] * 100 for c in cells]
    assert slo["runs"] == 3 and slo["attainment"]["measured"] == pytest.approx(sum(m) / 3)
    assert slo["attainment"]["diff"] == pytest.approx((sum(p) - sum(m)) / 3)
    diffs = [b - a for a, b in zip(m, p)]
    assert slo["attainment"]["diff_ci"] == pytest.approx(4.30 * statistics.stdev(diffs) / 3 ** 0.5)
    lat = [(c["predicted"]["all"]["mean_s"] - c["measured"]["all"]["mean_s"]) / c["measured"]["all"]["mean_s"]
           for c in cells]
    assert slo["mean_s"]["diff"] == pytest.approx(sum(lat) / 3)
    assert rows[("srtf", group, "all")]["runs"] == 2  # slo-3 ran slo alone
    assert {"S", "M", "L"} <= {c for (pol, where, c) in rows if pol == "slo" and where == group}
    alone = rows[("slo", "2 denoise workers, max batch 4", "all")]  # individual workers: a pool of its own
    assert alone["runs"] == 1 and alone["attainment"]["diff_ci"] is None  # (one run: no interval)
    text = simpool.markdown(doc)
    assert "over the pools of more than one run" in text
    verdict = "within" if abs(slo["attainment"]["diff"]) <= 5 and abs(slo["mean_s"]["diff"]) <= 0.1 else "not"
    assert f"slo at sched-trace-1.3x ({group}, 3 runs) {verdict}" in text
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "sched.json").write_text(json.dumps({"settings": {"max_duration": 60}, "rows": {},
                                                             "requests": {}}))
    with pytest.raises(SystemExit):
        cli_main(["bench", "simpool", str(tmp_path / "run"), "--out", str(tmp_path)])
    assert f"cannot read {tmp_path / 'run' / 'simval.json'}" in capsys.readouterr().err


def test_bench_draws_replays_a_runs_own_trace_as_simval_does_beside_other_draws_at_the_same_load(tmp_path, capsys):
    """The committed 1.0x run of fcfs, srtf and `slo` on one worker (2026-11-27), which replayed a
    saved trace: its own trace comes out exactly as `bench simval` predicts it (the same pricing:
    each step alone on the run's 2 cores), and the other draws are other requests and arrivals,
    each stretched to offer the same load, judged against the same targets."""
    from onepiece.bench.draws import draws, markdown
    from onepiece.bench.simval import validate

    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    trace = results / "sched-trace-1x.json"
    doc = draws(results / "sched-repeat" / "1x-2", 2, trace)
    entry = doc["loads"]["sched-trace-1x"]
    assert not doc["skipped"] and list(entry["draws"]) == ["run", "1", "2"]
    own = entry["draws"]["run"]
    val = validate(results / "sched-repeat" / "1x-2", seeds=1, replay=trace)
    for p in ("fcfs", "srtf", "slo"):
        predicted = val["rows"][p]["sched-trace-1x"]["predicted"]["all"]
        assert own["policies"][p]["mean_s"] == pytest.approx(predicted["mean_s"])
        assert own["policies"][p]["attainment"] == pytest.approx(predicted["attainment"])
    assert own["policies"]["fcfs"]["mean_ratio"] == 1.0
    # other draws: other classes and arrivals (seeds 1 and 2), each offering the run's load exactly
    for k in ("1", "2"):
        assert entry["draws"][k]["offered"] == pytest.approx(1.0)
        assert entry["draws"][k]["order_bound"] != own["order_bound"]
    s = entry["summary"]
    assert s["judged"] == 2 and set(s["policies"]) == {"fcfs", "srtf", "slo"}
    ratios = [entry["draws"][k]["policies"]["srtf"]["mean_ratio"] for k in ("1", "2")]
    assert s["policies"]["srtf"]["mean_ratio"] == {"median": statistics.median(ratios), "min": min(ratios),
                                                   "max": max(ratios)}
    assert 0 <= s["targets_met"]["all"] <= s["targets_met"]["mean_ratio"] <= 2
    assert "| srtf |" in markdown(doc)
    with pytest.raises(SystemExit) as done:
        cli_main(["bench", "draws", "--results", str(results / "sched-repeat" / "1x-2"), "--trace", str(trace),
                  "--draws", "1", "--out", str(tmp_path)])
    assert done.value.code == 0
    assert json.loads((tmp_path / "draws.json").read_text())["n"] == 1 and "draws.md" in capsys.readouterr().out
    # a run that drew its own trace (seed 1, saved beside sched.json): the other draws skip its seed
    own_seed = draws(results / "sched-draws" / "1x-s1", 2)
    assert list(own_seed["loads"]["1x"]["draws"]) == ["run", "2", "3"] and not own_seed["skipped"]
