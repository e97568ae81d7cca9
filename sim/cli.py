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

from onepiece.argtypes import SEED, SHARE, between, count, non_negative, numbers, out_dir, positive
from onepiece.bench.trace import Trace, TraceError, load_trace, scaled, summarize
from onepiece.config import (MAX_INSTANCES, ConfigError, ElasticSpec, ProxySpec, Topology, Workflow, load_topology,
                              load_workflow)
from onepiece.sched.costs import MAX_STEP_CV, TableError
from onepiece.sched.options import ScheduleSpec
from onepiece.schema import checked, first_error
from onepiece.sim import report
from onepiece.sim.costs import CostTable
from onepiece.sim.engine import HOP_S, MOVE_S, OVERHEAD_S, SimInputError, Simulation


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="trace file (onepiece bench sched's format; README)")
    p.add_argument("--costs", required=True, help="cost table (onepiece profile's format, or a bench's sched-costs-*.json)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--topology", help="a topology YAML: its sets, their stage counts and its workflow")
    where.add_argument("--workflow", help="a workflow YAML, with --instances")
    p.add_argument("--instances", type=_counts, help="with --workflow: STAGE=N,... instances per set")
    p.add_argument("--sets", type=count(1, MAX_SETS), default=1,
                   help=f"with --workflow: how many such sets (default 1, at most {MAX_SETS})")
    p.add_argument("--monitor", action="store_true",
                   help="with --workflow: each set's proxy runs the request monitor (a topology says per set)")
    p.add_argument("--schedule", action="append", default=[], metavar="STAGE.OPTION=VALUE",
                   help="override a stage's schedule option, e.g. denoise_t2v.policy=edf (repeatable, in order; "
                        "a policy resets max_batch to its default)")
    p.add_argument("--move-s", type=non_negative(" seconds"), default=MOVE_S,
                   help="with --topology (its NM moves instances: nm.elastic): seconds a moved instance takes to "
                        "load its new stage, after its drain (default %(default)s)")
    p.add_argument("--hop-ms", type=non_negative(" ms"), default=HOP_S * 1000, help="time of one message between stages (ms)")
    p.add_argument("--overhead-ms", type=non_negative(" ms"), default=OVERHEAD_S * 1000,
                   help="decision and IPC per chunk of steps (ms), at the stages whose cost table does not "
                        "say (a table from bench sched has each stage's, measured over its trace)")
    p.add_argument("--step-cv", type=between(0, MAX_STEP_CV), default=0.0,
                   help="at the stages whose cost table has no step_cv: steps and calls vary around their "
                        "figures with this coefficient of variation (lognormal, mean kept; default 0: each costs "
                        "its figure)")
    p.add_argument("--seed", type=SEED, default=0, help="seed of --step-cv's draws (default 0)")
    p.add_argument("--host-cores", type=positive(" cores"), metavar="N",
                   help="every set's workers share one host of N cores (one CPU machine, or one GPU several "
                        "stages use): steps slow while more ranks compute than N; the table's figures are then "
                        "steps alone (default: each worker a device of its own)")
    p.add_argument("--out", type=out_dir, default="sim-out", help="folder for sim.json, .md, .png, .perfetto.json")
    p.add_argument("--name", default="sim", help="file name stem of the outputs (default sim)")


MAX_SETS = 10_000  # 100,000 devices at 10 a set: plan's own bound (sim/plan.py MAX_DEVICES)


def _counts(value: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in value.split(","):
        stage, _, n = (x.strip() for x in item.partition("="))
        try:
            k = int(n)
        except ValueError:
            k = None
        if not stage or k is None:
            raise argparse.ArgumentTypeError(f"bad {item!r}: expected STAGE=COUNT, e.g. denoise_t2v=2")
        if stage in out:
            raise argparse.ArgumentTypeError(f"{stage} is given twice in {value!r}")
        if not 1 <= k <= MAX_INSTANCES:
            raise argparse.ArgumentTypeError(f"bad {item!r}: between 1 and {MAX_INSTANCES} (as a topology allows)")
        out[stage] = k
    return out


def known_stages(wf: Workflow, counts: dict[str, int], flag: str) -> None:
    """ConfigError naming the stages of ``counts`` that ``wf`` does not have."""
    unknown = sorted(set(counts) - set(wf.stages))
    if unknown:
        raise ConfigError(f"{flag}: unknown stage(s) {unknown} (known: {sorted(wf.stages)})")


def _value(flag: str, item: str, value: str) -> Any:
    """A flag's VALUE as YAML reads it (a number, a bool, a list...), or ConfigError."""
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ConfigError(f"{flag} {item!r}: {value!r} is not a value ({str(e).splitlines()[0]})") from None


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
        if option == "policy":
            spec["max_batch"] = None  # the new policy's default, unless a later override sets it
        spec[option] = _value("--schedule", item, value)
        try:
            wf.stages[stage].schedule = checked(ScheduleSpec, spec)
        except ValueError as e:
            raise ConfigError(f"--schedule {item!r}: {e}") from None
    return wf


def simulate(wf: Workflow, sets: dict[str, dict[str, int]], costs: CostTable, trace: Trace,
             hop_s: float = HOP_S, overhead_s: float = OVERHEAD_S, chunks: bool = True,
             title: str = "", proxies: dict[str, ProxySpec] | None = None, elastic: Topology | None = None,
             move_s: float = MOVE_S, step_cv: float = 0.0, seed: int = 0,
             host_cores: float | None = None) -> tuple[dict[str, Any], Simulation]:
    """Run ``trace`` through ``sets``; the result document (summary per class, utilization,
    every request's record, the NM's moves) and the simulation (its chunks, for a schedule trace)."""
    t0 = time.perf_counter()
    sim = Simulation(wf, sets, costs, hop_s=hop_s, overhead_s=overhead_s, keep_chunks=chunks, proxies=proxies,
                     elastic=elastic, move_s=move_s, step_cv=step_cv, seed=seed, host_cores=host_cores)
    sim.load(trace)
    records = sim.run()
    slo = {c: (v.slo_s or 0.0) for c, v in trace.classes.items()}
    return {"title": title, "sets": sets, "costs": costs.source, "hop_s": hop_s, "overhead_s": overhead_s,
            # each stage's spread of its steps, as simulated (its table's, else step_cv)
            "step_cv": {st: cv for st in sorted({st for c in sets.values() for st in c})
                        if (cv := costs.step_cv(st, step_cv)) > 0}, "seed": seed,
            "simulated_s": sim.loop.now, "wall_s": time.perf_counter() - t0,
            "summary": summarize(records, slo), "utilization": sim.utilization(),
            "moves": sim.elastic.moves if sim.elastic is not None else [], "host_cores": host_cores,
            "requests": records}, sim


def run(args: argparse.Namespace) -> int:
    try:
        trace = load_trace(args.trace)
        costs = CostTable.load(args.costs)
    except (TraceError, TableError) as e:
        raise ConfigError(str(e)) from None
    if args.topology:
        given = [f for f, v in (("--instances", args.instances), ("--sets", args.sets != 1), ("--monitor", args.monitor))
                 if v]
        if given:
            raise ConfigError(f"{', '.join(given)}: with --topology, the topology gives the sets, their instances "
                              f"and monitors; use --workflow with them instead")
        topo, wf, _ = load_topology(args.topology)
        sets = {s.name: dict(s.stages) for s in topo.sets}
        proxies = {s.name: s.proxy for s in topo.sets}
        elastic = topo
    else:
        if not args.instances:
            raise ConfigError("--workflow needs --instances STAGE=N,... (how many instances of each stage a set runs)")
        wf = load_workflow(args.workflow)
        known_stages(wf, args.instances, "--instances")
        sets = {f"set{i}": dict(args.instances) for i in range(args.sets)}
        proxies = {s: ProxySpec(monitor=args.monitor, max_inflight=100_000) for s in sets}
        elastic = None
    wf = apply_schedule(wf, args.schedule)
    missing = [c for c, v in trace.classes.items() if not v.slo_s]
    if missing:
        raise ConfigError(f"{args.trace}: classes {missing} have no slo_s to judge attainment against")
    title = (f"{Path(args.trace).name} through {len(sets)} set(s) "
             f"{', '.join(f'{s}={n}' for s, n in next(iter(sets.values())).items())}; costs {Path(args.costs).name}; "
             + ", ".join(f"{s}: {wf.stages[s].schedule.policy}" for s in next(iter(sets.values()))))
    try:
        result, sim = simulate(wf, sets, costs, trace, args.hop_ms / 1000, args.overhead_ms / 1000, title=title,
                               proxies=proxies, elastic=elastic, move_s=args.move_s, step_cv=args.step_cv,
                               seed=args.seed, host_cores=args.host_cores)
    except SimInputError as e:
        raise ConfigError(f"{args.trace}: {e}") from None
    paths = report.write(Path(args.out), args.name, result, sim.chunks, sim.lifetimes)
    print(report.markdown(result))
    print("saved " + ", ".join(str(p) for p in paths))
    return 0


# --- onepiece plan ---------------------------------------------------------------------------------
def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workflow", required=True, help="workflow YAML: the stages, their policies and workers")
    p.add_argument("--costs", required=True, help="cost table of the hardware planned for (onepiece profile's format)")
    p.add_argument("--trace", help="the load (a trace file); or generate one with --rate, --classes, --mix, --alpha")
    p.add_argument("--app", default="t2v", help="application of generated requests (default t2v)")
    p.add_argument("--rate", type=positive(" requests/s"), help="requests per second of a generated trace")
    p.add_argument("--classes", default="S=832x480x25:50",
                   help="NAME=[APP/]WxHxFRAMES:STEPS,... (APP: the class's application, default --app)")
    p.add_argument("--mix", default="1", help="share of each class by count, in --classes order (one value: equal "
                                               "shares; default %(default)s)")
    p.add_argument("--day", metavar="MIX;MIX;...",
                   help="a load whose mix shifts: phases of equal length, each a --mix (e.g. '0.8,0.2;0.2,0.8')")
    p.add_argument("--elastic", nargs="?", const="", metavar="OPTION=VALUE,...",
                   help="also plan disaggregated stages with the NM's elastic moves: the topology's default policy, "
                        "or these nm.elastic options (e.g. 'threshold=0.7,low=0')")
    p.add_argument("--move-s", type=non_negative(" seconds"), default=MOVE_S,
                   help="with --elastic: seconds a moved instance takes to load its new stage (default %(default)s)")
    p.add_argument("--alpha", default="2", help="SLO = alpha x standalone (from the cost table), per class (one "
                                                 "value: every class; default %(default)s)")
    p.add_argument("--requests", type=count(), default=2000, help="requests in a generated trace (default %(default)s)")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--gpus", type=_counts, default={}, metavar="STAGE=N,...",
                   help="GPUs one device of a stage holds (default 1 each), e.g. denoise_i2v=2")
    p.add_argument("--target", type=SHARE, default=0.99, help="share of requests within their SLO (default 0.99)")
    p.add_argument("--loads", type=numbers(positive()), default="1", help="multiples of the load to plan for, for the curve (default 1)")
    p.add_argument("--out", type=out_dir, default="plan-out", help="folder for plan.json, .md, .png")


def planning_trace(args: argparse.Namespace, wf: Workflow, costs: CostTable) -> Trace:
    """The trace to plan for: ``--trace``, or seeded Poisson arrivals of the classes at
    ``--rate`` with SLO = alpha x each class's standalone time on the cost table."""
    from onepiece.bench.trace import parse_classes, parse_floats, poisson_trace
    from onepiece.sim.plan import priced

    if args.trace:
        if args.rate:
            raise ConfigError("--rate: a --trace brings its own arrivals (scale them with --loads)")
        return load_trace(args.trace)
    if not args.rate or args.rate <= 0:
        raise ConfigError("plan needs --trace, or --rate (requests per second) for a generated trace")
    classes = parse_classes(args.classes)
    names = list(classes)
    alpha = dict(zip(names, parse_floats(args.alpha, len(names), "--alpha")))
    phases = [dict(zip(names, parse_floats(m, len(names), "--day phase" if args.day else "--mix")))
              for m in (args.day or args.mix).split(";")]
    one = Trace.model_validate({"version": 1, "classes": classes, "requests": [
        {"at": 0, "app": v.get("app", args.app), "class": c, "size": v["size"], "num_frames": v["num_frames"],
         "steps": v["steps"]} for c, v in classes.items()]})
    try:
        journeys = priced(wf, costs, one)
    except SimInputError as e:
        raise ConfigError(f"--classes: {e}") from None
    for (c, v), j in zip(classes.items(), journeys):
        v["standalone_s"] = sum(j.alone.values()) + HOP_S * len(j.alone)
        v["alpha"], v["slo_s"] = alpha[c], alpha[c] * v["standalone_s"]
    # A missed SLO still completes: the deadline only bounds the run. Each phase of a --day is
    # its own seeded Poisson stretch, one after another.
    requests, t0 = [], 0.0
    for i, mix in enumerate(phases):
        part = poisson_trace(classes, mix, args.rate, args.requests // len(phases), args.seed + i, app=args.app,
                             timeout_s=10 * max(v["slo_s"] for v in classes.values()))
        requests += [r.model_copy(update={"at": round(t0 + r.at, 6)}) for r in part.requests]
        t0 = requests[-1].at + 1 / args.rate
    return part.model_copy(update={"requests": requests})


def hopeless(wf: Workflow, costs: CostTable, trace: Trace, target: float) -> None:
    """ConfigError if no fleet can meet ``target``: classes without an SLO, or more requests than
    the target spares that miss their SLO even alone on an idle fleet (known before any search)."""
    from onepiece.sim.plan import priced

    missing = [c for c, v in trace.classes.items() if not v.slo_s]
    if missing:
        raise ConfigError(f"plan: classes {missing} have no slo_s to plan for")
    try:
        journeys = priced(wf, costs, trace)
    except SimInputError as e:
        raise ConfigError(f"plan: {e}") from None
    # each application is held to the target (plan.Verdict.worst)
    for app in sorted({j.app for j in journeys}):
        mine = [j for j in journeys if j.app == app]
        late: dict[str, tuple[int, float]] = {}
        for j in mine:
            alone = sum(j.alone.values()) + HOP_S * len(j.alone)
            slo = trace.classes[j.req.cls].slo_s
            if alone > slo:
                n, worst = late.get(j.req.cls, (0, 0.0))
                late[j.req.cls] = (n + 1, max(worst, alone))
        n = sum(k for k, _ in late.values())
        if n > (1 - target) * len(mine):
            which = "; ".join(f"class {c}: {k} requests take {t:.3g} s alone against an SLO of "
                              f"{trace.classes[c].slo_s:.3g} s" for c, (k, t) in late.items())
            raise ConfigError(f"plan: {n} of {len(mine)} {app} requests miss their SLO even alone on an idle fleet "
                              f"({which}): no fleet meets {target:.1%} (raise --alpha, or the trace's slo_s)")


def elastic_spec(options: str) -> ElasticSpec:
    """``threshold=0.7,low=0`` over the NM's defaults, checked by the topology's own schema."""
    fields = {}
    for item in filter(None, (x.strip() for x in options.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--elastic {options!r}: expected OPTION=VALUE,... (options: {', '.join(ElasticSpec.model_fields)})")
        fields[key.strip()] = _value("--elastic", item, value)
    try:
        return checked(ElasticSpec, fields)
    except ValueError as e:
        raise ConfigError(f"--elastic {options!r}: {e}") from None


def run_plan(args: argparse.Namespace) -> int:
    import json

    from onepiece.sim import plan

    try:
        costs = CostTable.load(args.costs)
    except TableError as e:
        raise ConfigError(str(e)) from None
    wf = load_workflow(args.workflow)
    known_stages(wf, args.gpus, "--gpus")
    try:
        base = planning_trace(args, wf, costs)
        loads = sorted(args.loads)
    except ValidationError as e:  # of the trace made from the flags
        raise ConfigError(f"plan: the trace made from --classes, --mix/--day, --rate and --requests: "
                          f"{first_error(e)}") from None
    except (TraceError, ValueError) as e:
        raise ConfigError(f"plan: {e}") from None
    if not 0 < args.target <= 1:
        raise ConfigError(f"--target {args.target}: expected a share in (0, 1]")
    hopeless(wf, costs, base, args.target)
    rows = []
    for load in loads:
        trace = scaled(base, load)
        try:
            try:  # a whole pipeline may miss SLOs that its stages apart make: the rest still answers
                mono = plan.fewest_monolithic(wf, costs, trace, args.target, args.gpus)
                row = {"monolithic": mono.devices, "mono_counts": mono.counts, "mono_attainment": mono.attainment}
            except plan.Infeasible as e:
                row = {"monolithic": None, "mono_counts": None, "mono_attainment": e.best, "monolithic_why": str(e)}
            dis = plan.disaggregated(wf, costs, trace, args.target, gpus=args.gpus)
            row = {"load": load, "rate_rps": plan.arrival_rate(trace), **row,
                   "disaggregated": dis.devices, "counts": dis.counts, "dis_attainment": dis.attainment}
            if args.elastic is not None:
                # From the plan without moves: what moves can take away from it. (From Theorem 1's
                # counts the search went another way, and stopped at more devices than this.)
                el = plan.disaggregated(wf, costs, trace, args.target, gpus=args.gpus,
                                        elastic=elastic_spec(args.elastic), move_s=args.move_s, start=dis.counts)
                row.update(elastic=el.devices, elastic_counts=el.counts, elastic_attainment=el.attainment)
            apps = sorted({r.app for r in trace.requests})
            if len(apps) > 1:  # the stages shared by the applications, against a deployment of each
                # (each application's requests come over the whole trace's span: one of them may
                # have a single request, which alone spans no time)
                span = plan.arrival_span(trace)
                row["separate"] = sum(plan.disaggregated(wf, costs, sub, args.target, gpus=args.gpus,
                                                         start=plan.theorem1(wf, costs, sub, span=span)).devices
                                      for sub in (plan.only(trace, a) for a in apps))
        except SimInputError as e:
            raise ConfigError(f"plan: {e}") from None
        rows.append(row)
        mono_says = row.get("monolithic_why") or f"{row['monolithic']} GPUs"
        print(f"load {load:g}x ({row['rate_rps']:.3g} req/s): monolithic {mono_says}; disaggregated "
              f"{dis.devices} {dis.counts}" + (f"; with elastic moves {row['elastic']}" if "elastic" in row else "")
              + (f"; separate deployments per application {row['separate']}" if "separate" in row else ""),
              flush=True)
    doc = {"costs": costs.source, "costs_meta": costs.meta, "workflow": args.workflow, "target": args.target,
           "gpus": args.gpus, "elastic": None if args.elastic is None else elastic_spec(args.elastic).model_dump(),
           "move_s": args.move_s, "day": args.day,
           "classes": {c: v.model_dump(exclude_none=True) for c, v in base.classes.items()},
           "requests": len(base.requests), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(doc, indent=1))
    extra = [c for c in ("elastic", "separate") if c in rows[0]]
    names = {"elastic": "with elastic moves", "separate": "a deployment per application"}
    md = [f"`onepiece plan` — {len(base.requests)} requests, {args.target:.1%} within SLO; costs {costs.source}", "",
          "| load | req/s | monolithic GPUs | disaggregated GPUs | instances per stage | saved | "
          + "".join(f" {names[c]} |" for c in extra), "|---|---|---|---|---|---|" + "---|" * len(extra)]
    md += [f"| {r['load']:g}x | {r['rate_rps']:.3g} | {r['monolithic'] or 'none meets it'} | {r['disaggregated']} | "
           f"{', '.join(f'{s} {n}' for s, n in r['counts'].items())} | "
           f"{'—' if not r['monolithic'] else format(1 - r['disaggregated'] / r['monolithic'], '.0%')} | "
           + "".join(f" {r[c]} |" for c in extra) for r in rows]
    (out / "plan.md").write_text("\n".join(md) + "\n")
    _plot_plan(out / "plan.png", rows, f"GPUs for {args.target:.0%} within SLO")
    print("\n".join(md))
    print(f"saved {out / 'plan.json'}, plan.md, plan.png")
    return 0


def _plot_plan(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["rate_rps"] for r in rows]
    ax.plot(xs, [r["monolithic"] for r in rows], marker="o", label="monolithic")  # None: not drawn
    ax.plot(xs, [r["disaggregated"] for r in rows], marker="o", label="disaggregated")
    if "elastic" in rows[0]:
        ax.plot(xs, [r["elastic"] for r in rows], marker="o", label="disaggregated, elastic moves")
    if "separate" in rows[0]:
        ax.plot(xs, [r["separate"] for r in rows], marker="o", label="a deployment per application")
    ax.set_xlabel("load (requests/s)")
    ax.set_ylabel("GPUs")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
