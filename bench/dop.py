"""`onepiece bench dop`: elastic DoP against static DoP on simulated GPU fleets (issue 13).

The simulator (``onepiece sim``'s engine: the real scheduling core and policies on a virtual
clock) prices denoising with a published cost table, by default GF-DiT's per-step figures for
Qwen-Image on H20 at SP1/SP2/SP4 (``deploy/gfdit-h20.costs.json``: small shapes gain nothing
from more GPUs, large ones a lot). A seeded Poisson trace mixes three classes (S 512², M
1024², L 1536², 60/30/10 by count, ``--steps`` steps), each aiming for SLO = α × its fastest
standalone time (α = 2.0 / 2.5 / 3.5), at ``--loads`` × the fleet's capacity (every request at
the DoP that uses GPUs best, here SP1).

For each fleet size of ``--gpus``:

- **static DoP k** (k = 1, 2, 4): the GPUs as instances of k GPUs each in collaboration mode,
  every step of every request on all k, with each DoP-blind policy of ``--static-policies``
  (edf and srtf by default: GF-DiT's baselines are fcfs and srtf per SP);
- **elastic**: the GPUs as groups of 2 or 4 (``--groups``) in collaboration mode, each step's
  DoP chosen by a DoP-aware policy (``--policies``: the project's ``slo``, GF-DiT's
  ``edf-best-fit``, DDiT's ``ddit``).

Reports mean latency and SLO attainment per class and overall; target: the best elastic policy
beats the best static DoP on overall attainment at every load. Saved as ``dop.json`` and
``dop.md`` under ``--out``. Text encoding and VAE decoding cost 1 ms in the table (not
published): the comparison is denoising's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from onepiece.argtypes import SEED, count, numbers, out_dir, positive
from onepiece.bench.common import cpu_name
from onepiece.bench.trace import parse_classes, parse_floats, poisson_trace
from onepiece.config import ProxySpec, deploy_dir, load_workflow
from onepiece.sched.costs import TableError
from onepiece.sched.keys import at_dop
from onepiece.sched.ranks import dops
from onepiece.sim.cli import apply_schedule, simulate
from onepiece.sim.costs import CostTable

GROUP = 4  # an elastic group's GPUs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costs", default=str(deploy_dir() / "gfdit-h20.costs.json"),
                   help="cost table with denoise_t2v rows at every DoP (default: GF-DiT's H20 figures)")
    p.add_argument("--classes", default="S=512x512x1:50,M=1024x1024x1:50,L=1536x1536x1:50",
                   help="NAME=WxHxFRAMES:STEPS,... (default %(default)s)")
    p.add_argument("--mix", default="0.6,0.3,0.1", help="share of each class by count (default %(default)s)")
    p.add_argument("--alpha", default="2.0,2.5,3.5", help="SLO = alpha x fastest standalone, per class")
    p.add_argument("--gpus", type=numbers(count()), default="8,64", help="fleet sizes, multiples of 4 (default %(default)s)")
    p.add_argument("--loads", type=numbers(positive()), default="0.5,0.8,1.0", help="multiples of the fleet's capacity (default %(default)s)")
    p.add_argument("--requests", type=count(0), default=0, help="requests per trace (default 25 per GPU)")
    p.add_argument("--policies", default="slo,edf-best-fit,ddit", help="DoP-aware policies on elastic groups")
    p.add_argument("--groups", type=numbers(count()), default="2,4", help="GPUs per elastic group, each size a configuration (default %(default)s)")
    p.add_argument("--static-policies", default="edf,srtf",
                   help="DoP-blind policies for static DoP, each a baseline (default %(default)s)")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for dop.json and dop.md")


def _workflow(policy: str, ranks: int, costs: CostTable, classes: dict[str, Any]) -> Any:
    """wan21-real's T2V set with denoise_t2v as a group of ``ranks`` GPUs on ``policy``; limits
    opened to the classes' shapes (the table's model is not Wan: only keys and times matter)."""
    wf = load_workflow(deploy_dir() / "wan21-real.yaml")
    wf = apply_schedule(wf, [f"denoise_t2v.policy={policy}", "denoise_t2v.max_batch=1"])
    st = wf.stages["denoise_t2v"]
    st.workers, st.mode = ranks, "collaboration" if ranks > 1 else "individual"
    lim = wf.applications["t2v"].limits
    lim.max_width = lim.max_height = max(max(int(x) for x in c["size"].split("x")) for c in classes.values())
    return wf


def check_args(args: argparse.Namespace) -> str | None:
    """Why the flags cannot run, naming the flag (cli.py's cmd_bench refuses it before any
    simulation), or None: a class or a group DoP the cost table has no row for was a KeyError
    or a SimInputError traceback, a fleet that is no multiple of a group refused after others ran."""
    try:
        costs = CostTable.load(args.costs)
    except TableError as e:
        return f"argument --costs: {e}"
    try:
        classes = parse_classes(args.classes)
        for flag in ("--mix", "--alpha"):
            parse_floats(getattr(args, flag[2:]), len(classes), flag)
    except SystemExit as e:  # what they say names no flag
        return f"argument --classes/--mix/--alpha: {e}"
    known = sorted(costs.rows.get("denoise_t2v", {}))
    for flag, sizes in (("--classes", [GROUP]), ("--groups", args.groups)):
        for size in sizes:
            for c, v in classes.items():
                for d in dops(size):
                    key = at_dop(f"{v['size']}x{v['num_frames']}/cfg/L512", d)
                    if key not in known:
                        return (f"argument {flag}: {c}={v['size']}x{v['num_frames']} at DoP {d} (groups of {size}): "
                                f"{args.costs} has no denoise_t2v row {key!r} (it has {', '.join(known)})")
    if bad := [g for g in args.gpus if g % GROUP]:
        return f"argument --gpus: {bad[0]} is no multiple of {GROUP} (the static DoPs' group)"
    return None


def run(args: argparse.Namespace) -> int:
    try:
        costs = CostTable.load(args.costs)
    except TableError as e:
        raise SystemExit(str(e)) from None
    classes = parse_classes(args.classes)
    names = list(classes)
    mix = dict(zip(names, parse_floats(args.mix, len(names), "--mix")))
    alpha = dict(zip(names, parse_floats(args.alpha, len(names), "--alpha")))
    loads = args.loads
    work = 0.0  # GPU-seconds a request takes on average, at the DoP that uses GPUs best
    for c, v in classes.items():
        key = f"{v['size']}x{v['num_frames']}/cfg/L512"
        step = {d: costs.step_s("denoise_t2v", at_dop(key, d), 1) for d in dops(GROUP)}
        v["standalone_s"] = min(step.values()) * v["steps"]
        v["alpha"], v["slo_s"] = alpha[c], alpha[c] * v["standalone_s"]
        work += mix[c] / sum(mix.values()) * min(t * d for d, t in step.items()) * v["steps"]
    configs = [(f"static DoP {k} {p}", p, k) for p in args.static_policies.split(",") for k in dops(GROUP)] + \
              [(f"elastic {p}" + (f" (groups of {g})" if g != GROUP else ""), p, g)
               for g in args.groups for p in args.policies.split(",")]
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    for gpus in args.gpus:
        if gpus % GROUP:
            raise SystemExit(f"--gpus {gpus}: must be a multiple of {GROUP}")
        n = args.requests or 25 * gpus
        for load in loads:
            trace = poisson_trace(classes, mix, load * gpus / work, n, seed=args.seed, timeout_s=3600.0)
            for name, policy, ranks in configs:
                wf = _workflow(policy, ranks, costs, classes)
                sets = {"set0": {"text_encode": 1, "denoise_t2v": gpus // ranks, "vae_decode": 1}}
                proxies = {"set0": ProxySpec(count=1, port=0, max_inflight=100_000, monitor=False)}
                result, _ = simulate(wf, sets, costs, trace, chunks=False, proxies=proxies)
                rows.append({"gpus": gpus, "load": load, "config": name, "summary": result["summary"],
                             "wall_s": result["wall_s"]})
                print(f"{gpus} GPUs, {load}x: {name}: {_att(result['summary']['all']):.1%} in SLO, "
                      f"mean {result['summary']['all'].get('mean_s') or 0:.1f} s", flush=True)
    report = {"when": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "costs": args.costs,
              "classes": classes, "mix": mix, "capacity_work_s": work, "rows": rows,
              "targets": targets(rows), "seconds": time.monotonic() - t0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dop.json").write_text(json.dumps(report, indent=1))
    (out / "dop.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def _att(s: dict[str, Any]) -> float:
    return s.get("attainment") or 0.0


def _pct(s: dict[str, Any]) -> str:
    # a class the trace drew no request of has no attainment: "—", not 0.0% (none missed)
    return f"{s['attainment']:.1%}" if s.get("n") and s.get("attainment") is not None else "—"


def _mean(s: dict[str, Any]) -> str:
    return f"{s['mean_s']:.1f}" if s.get("n") and s.get("mean_s") is not None else "—"


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (fleet, load): the best static and the best elastic configuration by attainment."""
    out = []
    for gpus, load in dict.fromkeys((r["gpus"], r["load"]) for r in rows):
        mine = [r for r in rows if (r["gpus"], r["load"]) == (gpus, load)]
        static = max((r for r in mine if r["config"].startswith("static")), key=lambda r: _att(r["summary"]["all"]))
        elastic = max((r for r in mine if r["config"].startswith("elastic")), key=lambda r: _att(r["summary"]["all"]))
        out.append({"gpus": gpus, "load": load, "best_static": static["config"],
                    "static": _att(static["summary"]["all"]), "best_elastic": elastic["config"],
                    "elastic": _att(elastic["summary"]["all"]),
                    "met": _att(elastic["summary"]["all"]) > _att(static["summary"]["all"])})
    return out


def markdown(r: dict[str, Any]) -> str:
    names = list(r["classes"])
    lines = [f"`onepiece bench dop` — {r['when']}, simulated; costs `{Path(r['costs']).name}`; classes "
             + ", ".join(f"{c} {v['size']}x{v['num_frames']}:{v['steps']} (SLO {v['slo_s']:.1f} s)"
                         for c, v in r["classes"].items())
             + f"; load 1.0 = fleet GPUs / {r['capacity_work_s']:.1f} GPU-s per request.", "",
             "| GPUs | load | configuration | SLO all | " + " | ".join(f"SLO {c}" for c in names)
             + " | mean s all | " + " | ".join(f"mean s {c}" for c in names) + " |",
             "|---|---|---|---|" + "---|" * (2 * len(names) + 1)]
    for row in r["rows"]:
        s = row["summary"]
        lines.append(f"| {row['gpus']} | {row['load']} | {row['config']} | {_pct(s['all'])} | "
                     + " | ".join(_pct(s.get(c, {})) for c in names)
                     + f" | {_mean(s['all'])} | " + " | ".join(_mean(s.get(c, {})) for c in names) + " |")
    lines += ["", "Target: the best elastic policy beats the best static DoP on overall SLO attainment at every "
              "load.", "", "| GPUs | load | best static | attainment | best elastic | attainment | met |",
              "|---|---|---|---|---|---|---|"]
    for t in r["targets"]:
        lines.append(f"| {t['gpus']} | {t['load']} | {t['best_static']} | {t['static']:.1%} | {t['best_elastic']} | "
                     f"{t['elastic']:.1%} | {'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines) + "\n"
