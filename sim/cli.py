"""`onepiece sim`: replay a trace through workflow sets on a virtual clock (DESIGN §12).

    onepiece sim --trace bench/results/sched-trace-1x.json --costs bench/results/sched-costs-slo.json \\
        --workflow deploy/wan21-scale.yaml --instances text_encode=1,denoise_t2v=1,vae_decode=1

The sets come from a topology (``--topology``: its sets and their stage counts, its workflow) or
from ``--workflow`` with ``--instances`` (``--sets`` copies of it). ``--schedule`` changes a
stage's scheduling options without editing the YAML (``denoise_t2v.policy=edf``). Writes
``sim.json``, ``sim.md``, ``sim.png`` and ``sim.perfetto.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from onepiece.bench.trace import Trace, TraceError, load_trace, summarize
from onepiece.config import ConfigError, Workflow, load_topology, load_workflow
from onepiece.sched.costs import TableError
from onepiece.sched.options import ScheduleSpec
from onepiece.sim import report
from onepiece.sim.costs import CostTable
from onepiece.sim.engine import HOP_S, OVERHEAD_S, SimInputError, Simulation


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="trace file (onepiece bench sched's format; README)")
    p.add_argument("--costs", required=True, help="cost table (onepiece profile's format, or a bench's sched-costs-*.json)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--topology", help="a topology YAML: its sets, their stage counts and its workflow")
    where.add_argument("--workflow", help="a workflow YAML, with --instances")
    p.add_argument("--instances", type=_counts, help="with --workflow: STAGE=N,... instances per set")
    p.add_argument("--sets", type=int, default=1, help="with --workflow: how many such sets (default 1)")
    p.add_argument("--schedule", action="append", default=[], metavar="STAGE.OPTION=VALUE",
                   help="override a stage's schedule option, e.g. denoise_t2v.policy=edf (repeatable)")
    p.add_argument("--hop-ms", type=float, default=HOP_S * 1000, help="time of one message between stages (ms)")
    p.add_argument("--overhead-ms", type=float, default=OVERHEAD_S * 1000,
                   help="decision and IPC per chunk of steps (ms)")
    p.add_argument("--out", default="sim-out", help="folder for sim.json, .md, .png, .perfetto.json")
    p.add_argument("--name", default="sim", help="file name stem of the outputs (default sim)")


def _counts(value: str) -> dict[str, int]:
    out = {}
    for item in value.split(","):
        stage, _, n = item.partition("=")
        try:
            out[stage.strip()] = int(n)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad {item!r}: expected STAGE=COUNT, e.g. denoise_t2v=2") from None
        if out[stage.strip()] < 1:
            raise argparse.ArgumentTypeError(f"bad {item!r}: a stage needs at least one instance")
    return out


def apply_schedule(wf: Workflow, overrides: list[str]) -> Workflow:
    """``STAGE.OPTION=VALUE`` overrides, checked by the workflow's own schedule schema."""
    wf = wf.model_copy(deep=True)
    for item in overrides:
        lhs, sep, value = item.partition("=")
        stage, dot, option = lhs.partition(".")
        if not sep or not dot:
            raise ConfigError(f"--schedule {item!r}: expected STAGE.OPTION=VALUE, e.g. denoise_t2v.policy=edf")
        if stage not in wf.stages:
            raise ConfigError(f"--schedule {item!r}: unknown stage {stage!r} (known: {sorted(wf.stages)})")
        spec = wf.stages[stage].schedule.model_dump()
        if option == "policy" and spec["policy"] == "fcfs" and value != "fcfs":
            spec["max_batch"] = None  # fcfs pinned it to 1; the new policy takes its own default
        spec[option] = yaml.safe_load(value)
        try:
            wf.stages[stage].schedule = ScheduleSpec.model_validate(spec)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"]) or option
            raise ConfigError(f"--schedule {item!r}: {where}: {err['msg'].removeprefix('Value error, ')}") from None
    return wf


def simulate(wf: Workflow, sets: dict[str, dict[str, int]], costs: CostTable, trace: Trace,
             hop_s: float = HOP_S, overhead_s: float = OVERHEAD_S, chunks: bool = True,
             title: str = "") -> tuple[dict[str, Any], Simulation]:
    """Run ``trace`` through ``sets``; the result document (summary per class, utilization,
    every request's record) and the simulation (its chunks, for a schedule trace)."""
    t0 = time.perf_counter()
    sim = Simulation(wf, sets, costs, hop_s=hop_s, overhead_s=overhead_s, keep_chunks=chunks)
    sim.load(trace)
    records = sim.run()
    slo = {c: (v.slo_s or 0.0) for c, v in trace.classes.items()}
    return {"title": title, "sets": sets, "costs": costs.source, "hop_s": hop_s, "overhead_s": overhead_s,
            "simulated_s": sim.loop.now, "wall_s": time.perf_counter() - t0,
            "summary": summarize(records, slo), "utilization": sim.utilization(),
            "requests": records}, sim


def run(args: argparse.Namespace) -> int:
    try:
        trace = load_trace(args.trace)
        costs = CostTable.load(args.costs)
    except (TraceError, TableError) as e:
        raise ConfigError(str(e)) from None
    if args.topology:
        topo, wf, _ = load_topology(args.topology)
        sets = {s.name: dict(s.stages) for s in topo.sets}
    else:
        if not args.instances:
            raise ConfigError("--workflow needs --instances STAGE=N,... (how many instances of each stage a set runs)")
        wf = load_workflow(args.workflow)
        sets = {f"set{i}": dict(args.instances) for i in range(args.sets)}
    wf = apply_schedule(wf, args.schedule)
    missing = [c for c, v in trace.classes.items() if not v.slo_s]
    if missing:
        raise ConfigError(f"{args.trace}: classes {missing} have no slo_s to judge attainment against")
    title = (f"{Path(args.trace).name} through {len(sets)} set(s) "
             f"{', '.join(f'{s}={n}' for s, n in next(iter(sets.values())).items())}; costs {Path(args.costs).name}; "
             + ", ".join(f"{s}: {wf.stages[s].schedule.policy}" for s in next(iter(sets.values()))))
    try:
        result, sim = simulate(wf, sets, costs, trace, args.hop_ms / 1000, args.overhead_ms / 1000, title=title)
    except SimInputError as e:
        raise ConfigError(f"{args.trace}: {e}") from None
    workers: dict[str, int] = {}
    for by_stage in sets.values():
        for stage, n in by_stage.items():
            workers[stage] = workers.get(stage, 0) + n * wf.stages[stage].workers
    paths = report.write(Path(args.out), args.name, result, sim.chunks, workers)
    print(report.markdown(result))
    print("saved " + ", ".join(str(p) for p in paths))
    return 0
