"""`onepiece bench draws`: is a `bench sched` run's trace a typical draw? (DESIGN §12)

A run replays one draw of its trace generator per load: seeded Poisson arrivals, classes drawn
by the mix, stretched to offer exactly the load (`bench sched`'s ``at_load``). Sixty requests
are few, and what an order can do differs from draw to draw: the one-server order bound
(``order_bound``) of the 1.0× trace that the runs of 2026-11-27 replayed is 0.53, while 20 other
draws of its generator range from 0.35 to 0.60 (median 0.42). This replays ``--draws`` other
draws (seeds 1 to N, skipping the run's own; the run's settings otherwise) through the
simulator, for every policy the run measured, each priced as ``bench simval`` prices the run's
own trace (its run's cost table under that load, on the run's host where it saved its
schedule), and reports per policy the spread of its predicted mean latency against fcfs's and
of its SLO attainment, where the run's own trace stands among them, and in how many draws the
issue's targets at that load would be met. Saved as ``draws.json`` and ``draws.md`` under
``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from onepiece.argtypes import count, out_dir
from onepiece.bench import sharing
from onepiece.bench.common import T2V_STAGES, cpu_name, save_report
from onepiece.bench.sched import TARGETS, at_load, check_targets, offered, order_bound
from onepiece.bench.simval import run_workflow, sched_results, schedule_of, sent, table_of, trace_file, trace_of
from onepiece.bench.trace import Trace, load_trace, poisson_trace
from onepiece.cli import PROFILE_WORKFLOWS
from onepiece.config import ProxySpec, deploy_dir, load_workflow
from onepiece.sched.costs import read_table
from onepiece.sim.cli import simulate
from onepiece.sim.costs import CostTable
from onepiece.sim.engine import SimInputError

TARGET_KEYS = ("mean_ratio", "attainment", "attainment_ratio", "large_completed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", type=sched_results, default="bench/results",
                   help="folder of a bench sched run (sched.json, traces, costs)")
    p.add_argument("--draws", type=count(1, 1000), default=20, help="other draws of each trace (default %(default)s)")
    p.add_argument("--trace", type=trace_file, metavar="FILE",
                   help="the trace a run replayed (`bench sched --trace`), where it is now")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for draws.json and draws.md")


def _priced(results: Path, run: dict[str, Any], policy: str, load: str, shapes: dict[str, str]
            ) -> tuple[CostTable, int | None] | None:
    """``policy``'s table under ``load`` and the host cores it shares, as ``bench simval`` prices
    the cell by default: each step at what it cost alone, on the run's host, where the run saved
    its schedule; else the table as measured, each worker a device of its own. None without one."""
    path = table_of(results, policy, load)
    if not path.exists():
        return None
    table = read_table(path)
    events, classes = schedule_of(results, run, policy, load)
    cores = run.get("cpu_count") if events is not None else None
    if cores:
        table, _ = sharing.alone_table(table, sharing.alone_passes(events, classes, cores), shapes)
    return CostTable(table, str(path)), cores


def draws(results: Path, n: int, given: Path | None = None) -> dict[str, Any]:
    run = json.loads((results / "sched.json").read_text())
    settings = run["settings"]
    wf = load_workflow(deploy_dir() / PROFILE_WORKFLOWS[settings.get("profile", "scale")])
    classes, mix = run["classes"], run["mix"]
    shapes = {c: f"{v['size']}x{v['num_frames']}" for c, v in classes.items()}
    by_size = sorted(classes, key=lambda c: classes[c].get("standalone_s") or 0.0)
    proxy = {"set0": ProxySpec(count=1, port=0, max_inflight=1000, monitor=False)}  # as bench simval's
    policies = [p for p in run["rows"] if not p.endswith("(monitor on)")]
    loads = list(dict.fromkeys(load for p in policies for load in run["rows"][p]))
    out: dict[str, Any] = {}
    skipped: list[dict[str, str]] = []
    for load in loads:
        path = trace_of(results, settings, load, given)
        if path is None:
            skipped.append({"load": load, "why": "its trace is not beside sched.json (--trace names a replayed one)"})
            continue
        own = load_trace(path)
        try:
            nominal, cap = float(own.load), float(own.capacity_rps)  # (extra fields of a bench trace)
        except (AttributeError, TypeError, ValueError):
            skipped.append({"load": load, "why": f"{path} does not say its load and capacity_rps"})
            continue
        traces: dict[str, Trace] = {"run": own}
        for seed in [x for x in range(1, n + 2) if x != settings.get("seed")][:n]:  # (not the run's own)
            traces[str(seed)] = at_load(poisson_trace(classes, mix, nominal * cap, len(own.requests), seed,
                                                      timeout_s=settings.get("timeout") or None, capacity_rps=cap,
                                                      load=nominal, note="onepiece bench draws"), mix)
        priced = {p: x for p in policies if (x := _priced(results, run, p, load, shapes)) is not None}
        rows: dict[str, dict[str, Any]] = {}
        for name, tr in traces.items():
            tr = sent(tr, settings["max_duration"])
            summaries = {}
            for p, (costs, cores) in list(priced.items()):
                try:
                    result, _ = simulate(run_workflow(wf, p, settings), {"set0": dict(T2V_STAGES)}, costs,
                                         tr, chunks=False, proxies=proxy, host_cores=cores)
                except SimInputError as e:  # e.g. a DoP the policy picks that its run never measured
                    skipped.append({"load": load, "policy": p, "why": str(e)})
                    del priced[p]  # (not on the draws after this one either)
                    continue
                summaries[p] = result["summary"]
            fcfs = (summaries.get("fcfs") or {}).get("all", {}).get("mean_s")
            targets = check_targets({p: {load: s} for p, s in summaries.items()}, load, by_size)
            rows[name] = {"order_bound": order_bound(tr), "n": len(tr.requests),
                          "offered": (offered(tr, mix) or {}).get("load"),
                          "policies": {p: {"mean_s": s["all"]["mean_s"], "attainment": s["all"]["attainment"],
                                           "mean_ratio": s["all"]["mean_s"] / fcfs if fcfs and s["all"]["mean_s"]
                                           else None} for p, s in summaries.items()},
                          "targets": {k: targets[k]["met"] for k in TARGET_KEYS} if targets else None,
                          "best": targets.get("best")}
        out[load] = {"draws": rows, "summary": _summary(rows, list(priced))}
    return {"bench": "draws", "when": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(),
            "run": {"when": run.get("when"), "results": str(results)}, "n": n, "loads": out, "skipped": skipped}


def _spread(xs: list[float]) -> dict[str, float] | None:
    xs = sorted(x for x in xs if x is not None)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1]} if xs else None


def _summary(rows: dict[str, dict[str, Any]], policies: list[str]) -> dict[str, Any]:
    """Over the other draws: each policy's spread, and where the run's own trace stands (the
    share of other draws on which the policy's mean against fcfs's came out lower)."""
    others = [r for name, r in rows.items() if name != "run"]
    own = rows.get("run", {}).get("policies", {})
    out: dict[str, Any] = {"policies": {}, "order_bound": _spread([r["order_bound"] for r in others])}
    for p in policies:
        ratios = [r["policies"][p]["mean_ratio"] for r in others if p in r["policies"]]
        mine = (own.get(p) or {}).get("mean_ratio")
        out["policies"][p] = {
            "mean_ratio": _spread(ratios), "attainment": _spread([r["policies"][p]["attainment"] for r in others
                                                                  if p in r["policies"]]),
            "lower_elsewhere": (sum(1 for x in ratios if x is not None and x < mine) / len(ratios)
                                if mine is not None and ratios else None)}
    judged = [r["targets"] for r in others if r["targets"]]
    out["targets_met"] = {k: sum(1 for t in judged if t[k]) for k in TARGET_KEYS}
    out["targets_met"]["all"] = sum(1 for t in judged if all(t.values()))
    out["judged"] = len(judged)
    return out


def _fmt(s: dict[str, float] | None, pct: bool = False) -> str:
    if s is None:
        return "—"
    f = (lambda x: f"{x:.0%}") if pct else (lambda x: f"{x:.2f}×")
    return f"{f(s['median'])} ({f(s['min'])}–{f(s['max'])})"


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"`onepiece bench draws` — {doc['when']}: the `bench sched` run of {doc['run']['when']} "
             f"({doc['run']['results']}) against {doc['n']} other draws of each of its traces, in the simulator, "
             "each policy priced as `bench simval` prices the run's own trace."]
    for load, entry in doc["loads"].items():
        s, own = entry["summary"], entry["draws"].get("run", {})
        got = own.get("offered")
        lines += ["", f"**{load}** ({own.get('n')} requests a draw). The run's own trace"
                      + (f" offers {got:.2f}× its nominal load (the other draws exactly theirs)" if got else "")
                      + f"; its order bound {own.get('order_bound') or float('nan'):.2f}, the other draws' "
                      f"{_fmt(s['order_bound'])}.", "",
                  "| policy | run's trace: mean ×fcfs | attainment | draws: mean ×fcfs, median (range) "
                  "| attainment | draws with a lower mean ×fcfs |", "|---|---|---|---|---|---|"]
        for p, x in s["policies"].items():
            mine = own.get("policies", {}).get(p) or {}
            ratio, lower = mine.get("mean_ratio"), x["lower_elsewhere"]
            att = mine.get("attainment")
            lines.append(f"| {p} | {'—' if ratio is None else f'{ratio:.2f}×'} "
                         f"| {'—' if att is None else f'{att:.0%}'} | {_fmt(x['mean_ratio'])} "
                         f"| {_fmt(x['attainment'], True)} | {'—' if lower is None else f'{lower:.0%}'} |")
        if s["judged"]:
            t = s["targets_met"]
            lines += ["", f"The issue's targets at this load, judged on each draw as `bench sched` judges its run "
                          f"(the best policy, most SLOs met, against fcfs), met in: mean ≤ {TARGETS['mean_ratio_max']}× "
                          f"fcfs's {t['mean_ratio']}, attainment ≥ {TARGETS['attainment_min']:.0%} {t['attainment']}, "
                          f"≥ {TARGETS['attainment_ratio_min']}× fcfs's {t['attainment_ratio']}, every large request "
                          f"completed {t['large_completed']}; all of them {t['all']} of {s['judged']} draws."]
    for k in doc["skipped"]:
        lines.append(f"\nNot replayed: {k['load']}" + (f", {k['policy']}" if k.get("policy") else "") + f": {k['why']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    doc = draws(Path(args.results), args.draws, args.trace)
    if not doc["loads"]:
        raise SystemExit(f"{args.results}: nothing to replay: "
                         + "; ".join(f"{k['load']}: {k['why']}" for k in doc["skipped"]))
    save_report(Path(args.out), "draws", doc, markdown(doc))
    return 0
