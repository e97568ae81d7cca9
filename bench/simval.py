"""`onepiece bench simval`: the simulator against real runs (DESIGN §12).

It replays the exact traces a `onepiece bench sched` run saved (``sched-trace-<load>.json``),
for every policy that run measured, through `onepiece sim`'s engine with the cost table that
policy's own run measured under that trace (``sched-costs-<policy>-<load>.json``: every stage's
heartbeat figures as the trace ended; a run from before those were saved: ``sched-costs-<policy>.json``,
as its last trace drained), on the topology the benchmark ran (one set: text_encode, denoise_t2v
and vae_decode, one instance each, denoise_t2v on the policy with the run's max batch and its
workers, one collaboration group where the run had one), and
puts predicted beside measured: SLO attainment and mean latency, per class and overall; the run
with the request monitor on is replayed with the simulator's monitor on (the proxy's own rule).
Target (GF-DiT validates its simulator the same way): within 5 points of attainment and 10% of
mean latency at every level. Saved as ``simval.json`` and ``simval.md`` under ``--out``.

Where the run saved what its stages ran (``sched-schedule-<policy>-<load>.json``), the replay
shares the run's host among the stages as the run did (its cores: ``sched.virtual.Host``), each
step priced at what it cost alone there (``bench/sharing.py``); the prediction with every worker
a device of its own is kept beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import orjson

from onepiece.argtypes import between, count, out_dir
from onepiece.bench.common import T2V_STAGES, cpu_name
from onepiece.bench import sharing
from onepiece.bench.sched import costs_name, schedule_name
from onepiece.bench.trace import Trace, TraceError, load_trace, stage_times, summarize
from onepiece.cli import PROFILE_WORKFLOWS
from onepiece.config import ProxySpec, Workflow, deploy_dir, load_workflow
from onepiece.sched.costs import MAX_STEP_CV, read_table
from onepiece.sim.cli import apply_schedule, simulate
from onepiece.sim.costs import CostTable
from onepiece.sim.engine import SimInputError
from onepiece.sim.report import perfetto

TARGETS = {"attainment_points": 5.0, "mean_rel": 0.10}


def sched_results(value: str) -> str:
    """An argparse type: a folder whose sched.json a `bench sched` run wrote (a missing or
    malformed one was a traceback)."""
    path = Path(value) / "sched.json"
    try:
        run = json.loads(path.read_text())
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # not JSON, or not text
        raise argparse.ArgumentTypeError(f"{path} is not JSON: {e}") from None
    shapes = {"settings": dict, "rows": dict, "requests": dict}
    if not isinstance(run, dict) or (bad := [k for k, t in shapes.items() if not isinstance(run.get(k), t)]):
        raise argparse.ArgumentTypeError(f"{path} is not a `bench sched` result: "
                                         f"{'no object' if not isinstance(run, dict) else 'no ' + ', '.join(bad)}")
    if "max_duration" not in run["settings"]:
        raise argparse.ArgumentTypeError(f"{path} is not a `bench sched` result: its settings lack max_duration")
    return value


def trace_file(value: str) -> Path:
    """An argparse type: a trace file (`bench sched`'s format), checked now, not mid-run."""
    try:
        load_trace(value)
    except TraceError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return Path(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", type=sched_results, default="bench/results", help="folder of a bench sched run (sched.json, traces, costs)")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for simval.json and simval.md")
    p.add_argument("--costs-of", metavar="POLICY",
                   help="price every policy with the costs this policy's run measured under each trace "
                        "(default: each its own)")
    p.add_argument("--step-cv", type=between(0, MAX_STEP_CV), default=0.0,
                   help="steps vary with this coefficient of variation where a run's table does not say how much "
                        "they varied (its step_cv; onepiece sim --step-cv); default 0: each step its figure")
    p.add_argument("--trace", type=trace_file, metavar="FILE",
                   help="the trace a run replayed (`bench sched --trace`), where it is now: the run names "
                        "the path it read, which may be gone")
    p.add_argument("--seeds", type=count(), default=5,
                   help="runs averaged where steps vary (default %(default)s)")
    p.add_argument("--rows-from", type=table_file, metavar="FILE",
                   help="a cost table (e.g. another run's sched-costs-*.json on the same machine) whose rows fill "
                        "what a run's own tables lack: a DoP-picking policy whose run never ran a DoP it may pick")


def validate(results: Path, costs_of: str | None = None, step_cv: float = 0.0, seeds: int = 1,
             replay: Path | None = None, rows_from: Path | None = None) -> dict[str, Any]:
    """Predicted and measured figures for every (policy, load) of the run in ``results``, each
    policy priced by its own run's costs, or every one by ``costs_of``'s. Where steps vary (a
    table's ``step_cv``, else ``step_cv``), each prediction is the mean of ``seeds`` runs: one run
    is one draw, as the measured run is."""
    run = json.loads((results / "sched.json").read_text())
    settings = run["settings"]
    wf = load_workflow(deploy_dir() / PROFILE_WORKFLOWS[settings.get("profile", "scale")])
    shapes = {c: f"{v['size']}x{v['num_frames']}" for c, v in run["classes"].items()}
    rows: dict[str, dict[str, Any]] = {}
    skipped: list[dict[str, str]] = []  # cells the simulator cannot price, and why
    shared = []  # per cell with a saved schedule: the denoise steps alone and beside other stages' work
    schedules: dict[str, Any] = {}  # per cell, its first simulation's schedule (a Perfetto trace)
    for row, by_load in run["rows"].items():
        policy, monitor = row.removesuffix(" (monitor on)"), row.endswith("(monitor on)")
        priced_by = costs_of or policy
        if not (results / costs_name(priced_by)).exists():
            continue  # a run from before the benchmark saved its costs
        pwf = run_workflow(wf, policy, settings)
        # as bench sched's Session: one proxy, the in-flight bound at 1000, the monitor on or off
        proxy = {"set0": ProxySpec(count=1, port=0, max_inflight=1000, monitor=monitor)}
        for load in by_load:
            path = trace_of(results, settings, load, replay, monitor)
            if path is None:
                continue
            trace = sent(load_trace(path), settings["max_duration"])
            at_load = table_of(results, priced_by, load)
            table = read_table(at_load)
            events, classes = schedule_of(results, run, row, load)
            if events is not None:  # (read whether or not the simulator can price the cell)
                shared.append(sharing.step_times(events, classes, "denoise_t2v"))
            cores = run.get("cpu_count") if events is not None and costs_of is None else None  # (another
            # policy's table does not say what this run's steps cost alone)
            passes = sharing.alone_passes(events, classes, cores) if cores else {}  # (once, for every table tried)

            def predict(table: dict[str, Any], source: str) -> tuple[list, list, bool]:
                """(the replays on a device per worker; those on the run's host where its schedule
                says what its steps cost alone, else the same; whether they were on the host)"""
                costs = CostTable(table, source)
                varied = step_cv > 0 or any(costs.step_cv(s, 0.0) > 0 for s in T2V_STAGES)

                def on(costs: CostTable, cores: int | None = None) -> list:
                    return [simulate(pwf, {"set0": dict(T2V_STAGES)}, costs, trace, chunks=seed == 0, proxies=proxy,
                                     step_cv=step_cv, seed=seed, host_cores=cores)
                            for seed in range(seeds if varied else 1)]
                apart = on(costs)
                if not cores:
                    return apart, apart, False
                alone, _ = sharing.alone_table(table, passes, shapes)
                return apart, on(CostTable(alone, f"{source}, steps alone"), cores), True
            filled, why = 0, None
            try:
                apart, sims, hosted = predict(table, str(at_load))
            except SimInputError as e:  # e.g. a DoP the policy picks that its run never measured
                why = str(e)
            if why and rows_from is not None and (filled := fill_rows(table, read_table(rows_from))):
                try:
                    apart, sims, hosted = predict(table, f"{at_load} + {filled} rows of {rows_from}")
                    why = None
                except SimInputError as e:
                    why = str(e)
            if why:
                skipped.append({"policy": row, "load": load, "why": why})
                continue
            runs = [r for r, _ in sims]
            if events is not None:  # what the simulated workers ran, beside the run's own (the same names)
                schedules[schedule_name(policy, load)] = perfetto(sims[0][1].chunks or [], runs[0]["requests"])
            # both sides summarized by the same function, from the run's own records
            recs = run["requests"][row][load]
            measured = summarize(recs, {c: v["slo_s"] for c, v in run["classes"].items()})
            rows.setdefault(row, {})[load] = {
                "measured": measured, "predicted": mean_of([r["summary"] for r in runs]),
                # the prediction with every worker a device of its own, where the host's was replayed
                "apart": mean_of([r["summary"]["all"] for r, _ in apart]) if hosted else None,
                "host_cores": cores if hosted else None,
                "rows_filled": filled,
                "wall_s": sum(r["wall_s"] for r in runs),
                "admitted_alike": mean_of([admitted_alike(recs, r["requests"]) for r in runs]),
                # where the time goes (runs that kept each result's stages)
                "stages": {"measured": stage_times(recs),
                           "predicted": mean_of([stage_times(r["requests"]) for r in runs])}}
    return {"bench": "simval", "when": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(),
            "run": {"when": run.get("when"), "results": str(results)}, "costs_of": costs_of,
            "rows_from": str(rows_from) if rows_from else None,
            "step_cv": step_cv, "seeds": seeds, "rows": rows, "skipped": skipped,
            "sharing": sharing.summary(sharing.merge(shared)), "schedules": schedules,
            "targets": _targets(rows, not skipped)}


def table_file(value: str) -> Path:
    """``--rows-from``: a cost table that reads (checked as the simulator reads one)."""
    try:
        CostTable.load(value)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{value}: {e}") from None
    return Path(value)


def fill_rows(table: dict[str, Any], donor: dict[str, Any]) -> int:
    """Add to ``table``'s stages the step and call rows of ``donor`` (by key and batch) it lacks;
    how many. A run prices what it ran: a DoP-picking policy whose run never ran DoP 1 leaves a
    table the simulator cannot replay it with, where another run of the same machine has them.
    Only a cell that cannot be replayed otherwise is filled."""
    added = 0
    for stage, entry in table.get("stages", {}).items():
        rows = entry.setdefault("rows", [])
        have = {(r["key"], r["batch"]) for r in rows}
        for r in (donor.get("stages", {}).get(stage) or {}).get("rows") or []:
            if (r["key"], r["batch"]) not in have:
                rows.append(dict(r))
                added += 1
    return added


def trace_of(results: Path, settings: dict[str, Any], load: str, given: Path | None = None,
             monitor: bool = False) -> Path | None:
    """The trace a run ran at ``load``: the one it saved beside sched.json, else the ``--trace``
    it replayed (whose load is the file's name; at ``given`` where it is now); None if neither."""
    path = results / f"sched-trace-{load.replace('monitor on ', 'monitor-') if monitor else load}.json"
    replayed = Path(settings["trace"]) if settings.get("trace") else None
    if not path.exists() and replayed is not None and load == replayed.stem:
        path = given or replayed
    return path if path.exists() else None


def table_of(results: Path, policy: str, load: str) -> Path:
    """The cost table ``policy``'s part measured under ``load``'s trace, where the run saved
    one; else its part's last."""
    path = results / costs_name(policy, load)
    return path if path.exists() else results / costs_name(policy)


def schedule_of(results: Path, run: dict[str, Any], row: str, load: str) -> tuple[list | None, dict[str, str]]:
    """What the stages ran for ``row`` under ``load`` (its schedule's events; None where the run
    saved none), and each request's class by the name the schedule gives it."""
    schedule = results / schedule_name(row.removesuffix(" (monitor on)"), load)
    classes = {f"r{i}": r["class"] for i, r in enumerate(run["requests"][row][load])}
    return (json.loads(schedule.read_text()).get("traceEvents", []) if schedule.exists() else None), classes


def run_workflow(wf: Workflow, policy: str, settings: dict[str, Any]) -> Workflow:
    """``wf`` as a run's part under ``policy`` ran it: the policy, the run's max batch (fcfs runs
    each request alone) and its denoise workers (``as_run``)."""
    opts = [f"denoise_t2v.policy={policy}"] + ([] if policy == "fcfs" else
                                               [f"denoise_t2v.max_batch={settings['max_batch']}"])
    return as_run(apply_schedule(wf, opts), settings)


def as_run(wf: Workflow, settings: dict[str, Any]) -> Workflow:
    """``wf`` with the denoise stage's workers and mode the run had (``--denoise-workers``,
    ``--collaboration``): a group's table prices DoPs that one worker does not have."""
    wf = wf.model_copy(deep=True)
    stage = wf.stages["denoise_t2v"]
    stage.workers = int(settings.get("denoise_workers") or 1)
    stage.mode = "collaboration" if settings.get("collaboration") else "individual"
    return wf


def mean_of(docs: list[Any]) -> Any:
    """The mean of documents of one shape, number by number (a number missing or None in any of
    them: None; anything else: the first's)."""
    first = docs[0]
    if isinstance(first, dict):
        return {k: mean_of([d.get(k) if isinstance(d, dict) else None for d in docs]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        if any(not isinstance(d, (int, float)) or isinstance(d, bool) for d in docs):
            return None
        return first if len(docs) == 1 else sum(docs) / len(docs)
    return first


def admitted_alike(measured: list[dict], predicted: list[dict]) -> int:
    """Requests of one trace that both sides admitted, or both refused (records in trace order,
    matched by send time)."""
    def order(recs: list[dict]) -> list[bool]:
        return [r["outcome"] == "rejected" for r in sorted(recs, key=lambda r: r["at"])]
    return sum(a == b for a, b in zip(order(measured), order(predicted)))


def margin(share: float, n: int) -> float:
    """Half-width of the 95% interval of a share measured over ``n`` requests (Agresti–Coull:
    not zero at 0% or 100%, where a few requests say little)."""
    if n <= 0:
        return 1.0
    p = (share * n + 2) / (n + 4)
    return 1.96 * math.sqrt(p * (1 - p) / (n + 4))


def sent(trace: Trace, max_duration: float) -> Trace:
    """The requests the benchmark sent: those within its arrival window."""
    return trace.model_copy(update={"requests": [r for r in trace.requests if r.at <= max_duration]})


def _targets(rows: dict[str, dict[str, Any]], complete: bool = True) -> dict[str, Any]:
    """The worst cell against the targets; not met where a cell could not be replayed."""
    worst_points, worst_rel = 0.0, 0.0
    for by_load in rows.values():
        for cell in by_load.values():
            m, p = cell["measured"]["all"], cell["predicted"]["all"]
            worst_points = max(worst_points, abs(p["attainment"] - m["attainment"]) * 100)
            worst_rel = max(worst_rel, abs(p["mean_s"] - m["mean_s"]) / m["mean_s"])
    return {"attainment_points": {"value": worst_points,
                                  "met": complete and worst_points <= TARGETS["attainment_points"]},
            "mean_rel": {"value": worst_rel, "met": complete and worst_rel <= TARGETS["mean_rel"]}}


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"`onepiece bench simval` — {doc['when']}: the simulator against the `bench sched` run of "
             f"{doc['run']['when']} ({doc['run']['results']}), "
             + (f"every policy priced by the costs {doc['costs_of']}'s run measured." if doc.get("costs_of")
                else "each policy priced by the costs its own run measured.")
             + (f" Steps vary with CV {doc['step_cv']:g} where a table does not say how much they varied."
                if doc.get("step_cv") else "")
             + (f" Where steps vary (a table's `step_cv`), each prediction is the mean of {doc['seeds']} runs."
                if doc.get("seeds") else "")
             + (f" Rows a run's table lacked came from {doc['rows_from']}." if doc.get("rows_from") else ""),
             "", "The measured attainment's ± is its own sampling margin (95%, Agresti–Coull): how far a "
                 "rerun of the same trace on the same machine could land from it by chance alone.",
             "", "| policy | load | class | n | refused measured / predicted | attainment measured | predicted "
                 "| Δ points | mean ms measured | predicted | Δ |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for policy, by_load in doc["rows"].items():
        for load, cell in by_load.items():
            for c, m in cell["measured"].items():
                p = cell["predicted"].get(c)
                if p is None:
                    continue
                lines.append(f"| {policy} | {load} | {c} | {m['n']} | {m['refused']} / {p['refused']:.3g} "
                             f"| {m['attainment']:.0%} ± {margin(m['attainment'], m['n']) * 100:.0f} "
                             f"| {p['attainment']:.0%} "
                             f"| {(p['attainment'] - m['attainment']) * 100:+.0f} | {m['mean_s'] * 1000:.0f} "
                             f"| {p['mean_s'] * 1000:.0f} | {(p['mean_s'] - m['mean_s']) / m['mean_s']:+.0%} |")
    hosted = [(policy, load, cell) for policy, by_load in doc["rows"].items() for load, cell in by_load.items()
              if cell.get("apart")]
    if hosted:
        lines += ["", "The host's cores: where the run saved its schedule, the prediction above runs every stage's "
                      "workers on one host of the run's cores (`onepiece sim --host-cores`) and prices each step "
                      "and call at what it cost alone (`bench/sharing.py`: the mean of the run's chunks during "
                      "which the host had a core for every rank computing). Beside it, the prediction with every "
                      "worker a device of its own at the table's figures, which average the slowed steps in. "
                      "All classes:", "",
                  "| policy | load | cores | attainment measured | shared host | Δ | a device each | Δ "
                  "| mean ms measured | shared host | Δ | a device each | Δ |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        def against(m: dict[str, Any], x: dict[str, Any]) -> tuple[str, str]:  # a prediction: attainment, mean
            return (f"{x['attainment']:.0%} | {(x['attainment'] - m['attainment']) * 100:+.0f}",
                    f"{x['mean_s'] * 1000:.0f} | {(x['mean_s'] - m['mean_s']) / m['mean_s']:+.0%}")

        for policy, load, cell in hosted:
            m = cell["measured"]["all"]
            (p_att, p_mean), (a_att, a_mean) = against(m, cell["predicted"]["all"]), against(m, cell["apart"])
            lines.append(f"| {policy} | {load} | {cell['host_cores']} | {m['attainment']:.0%} | {p_att} | {a_att} "
                         f"| {m['mean_s'] * 1000:.0f} | {p_mean} | {a_mean} |")
    differ = [(policy, load, cell["measured"]["all"]["n"], cell["admitted_alike"])
              for policy, by_load in doc["rows"].items() for load, cell in by_load.items()
              if cell.get("admitted_alike") is not None
              and (cell["measured"]["all"]["refused"] or cell["predicted"]["all"]["refused"])]
    if differ:
        lines += ["", "Where requests were refused, the simulator admitted or refused each as the run did: "
                  + "; ".join(f"{policy} at {load.removeprefix('monitor on ')}, {alike:.3g} of {n}"
                            for policy, load, n, alike in differ) + "."]
    where = [(policy, load, c, stage, m, cell["stages"]["predicted"].get(c, {}).get(stage))
             for policy, by_load in doc["rows"].items() for load, cell in by_load.items()
             for c, per in (cell.get("stages") or {}).get("measured", {}).items() for stage, m in per.items()]
    if where:
        lines += ["", "Where the time goes: per class, mean seconds of a completed request in each stage (its "
                      "queue, decision and compute, from its receipt to its worker's end) and between them (the "
                      "rest of its latency: the proxy, the hops, the DB's store), measured / predicted:", "",
                  "| policy | load | class | stage | measured s | predicted s | Δ |", "|---|---|---|---|---|---|---|"]
        for policy, load, c, stage, m, p in where:
            lines.append(f"| {policy} | {load} | {c} | {stage} | {m:.3f} | "
                         + ("— | — |" if p is None else f"{p:.3f} | {p - m:+.3f} |"))
    if doc.get("sharing"):
        lines += ["", "The host's cores, shared (from the run's schedules, `sched-schedule-<policy>-<load>.json`): "
                      "denoise_t2v's seconds per forward pass, median, in the chunks during which no other stage's "
                      "worker ran (alone) and in those during most of which one did (beside).", "",
                  "| class | DoP | batch | alone ms (chunks) | beside ms (chunks) | beside / alone |",
                  "|---|---|---|---|---|---|"]
        for r in doc["sharing"]:
            ms = lambda s, n: "—" if s is None else f"{s * 1000:.1f} ({n})"  # noqa: E731
            lines.append(f"| {r['class']} | {r['dop']} | {r['batch']} | {ms(r['alone_s'], r['alone_n'])} "
                         f"| {ms(r['beside_s'], r['beside_n'])} | "
                         + ("—" if r["ratio"] is None else f"{r['ratio']:.2f}") + " |")
    if doc.get("skipped"):
        lines += ["", "Not replayed (the simulator prices only what a table has; the targets below leave these "
                      "out): " + "; ".join(f"{k['policy']} at {k['load']}: {k['why']}" for k in doc["skipped"]) + "."]
    t = doc["targets"]
    if t:
        lines += ["", ("Worst over every policy and load replayed" if doc.get("skipped") else
                       "Worst over every policy and load") + ", all classes together: "
                      f"{t['attainment_points']['value']:.1f} points of attainment (target ≤ "
                      f"{TARGETS['attainment_points']:g}: {'met' if t['attainment_points']['met'] else 'not met'}), "
                      f"{t['mean_rel']['value']:.0%} of mean latency (target ≤ {TARGETS['mean_rel']:.0%}: "
                      f"{'met' if t['mean_rel']['met'] else 'not met'})."]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    doc = validate(Path(args.results), args.costs_of, args.step_cv, args.seeds, args.trace, args.rows_from)
    if not doc["rows"]:
        if doc["skipped"]:  # e.g. a DoP-picking policy whose run never ran a DoP it may pick
            raise SystemExit(f"{args.results}: no cell could be replayed: "
                             + "; ".join(f"{k['policy']} at {k['load']}: {k['why']}" for k in doc["skipped"]))
        raise SystemExit(f"{args.results}: no policy with a sched-costs-<policy>.json beside sched.json "
                         f"(rerun `onepiece bench sched`, which saves them)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    schedules = doc.pop("schedules")
    for name, trace in schedules.items():  # beside the run's own, under the same names
        (out / f"simval-{name}").write_bytes(orjson.dumps(trace))
    (out / "simval.json").write_text(json.dumps(doc, indent=1))
    text = markdown(doc)
    (out / "simval.md").write_text(text + "\n")
    print(text)
    print(f"saved {out / 'simval.json'}, simval.md" + (f" and the simulated schedules (simval-sched-schedule-*.json)"
                                                      if schedules else ""))
    return 0
