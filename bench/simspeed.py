"""`onepiece bench simspeed`: how fast the simulator plans for a fleet (DESIGN §12).

``--requests`` requests (Poisson, two classes of ``--steps`` steps) through ``--sets`` copies of
one set of ``--devices-per-set`` devices (text_encode 1, vae_decode 1, the rest denoise_t2v on
``slo``), at ``--load`` of the fleet's capacity, priced by a small synthetic table whose figures
are real Wan2.1's order on an H100 (SGLang's baselines, as ``deploy/wan21-h100.costs.json``: a
1.3B step at 832x480x25 0.14 s, a 14B one on two GPUs 0.65 s, text encoding 0.17 s, VAE decode
0.36-0.56 s).
Speed depends on events, not on their figures, but the figures set the chunks: a step that
long is one chunk, as on a GPU (at a step of 20 ms the core chunks two steps); a request alone
in its stage runs open, and one that competes is held while the policy promises the same plan,
one decision for all its steps until something changes (sched/core.py). 50 steps is Wan2.1's
default. Reports simulated requests per second of wall
time on one core, and where the time goes (cProfile's top functions, ``--profile``), and the
run's CPU time beside its wall time (on a shared machine the CPU time is what compares across
runs). Target: 10^6 requests over 1,000 devices in at most 60 s. Saved as ``simspeed.json`` and
``simspeed.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

from onepiece.argtypes import count, out_dir, positive
from onepiece.bench.common import cpu_name
from onepiece.bench.trace import parse_classes, poisson_trace
from onepiece.config import deploy_dir, load_workflow
from onepiece.sim.cli import apply_schedule, simulate
from onepiece.sim.costs import CostTable

TARGET = {"requests": 1_000_000, "devices": 1000, "seconds": 60.0}
S, L = "64x64x9", "192x192x17"  # labels of the two classes' shapes (the table prices them)
STEP_S = {S: {1: 0.144, 2: 0.26, 4: 0.49}, L: {1: 0.654, 2: 1.31}}  # seconds a step, by batch size
CALL_S = {"text_encode": {S: 0.17, L: 0.17}, "vae_decode": {S: 0.36, L: 0.56}}  # seconds a call
TABLE = {"version": 1, "stages": {
    **{stage: {"rows": [{"key": k, "batch": 1, "seconds": t} for k, t in calls.items()]}
       for stage, calls in CALL_S.items()},
    "denoise_t2v": {"rows": [{"key": f"{k}/cfg/L64", "batch": b, "seconds": t}
                             for k, by in STEP_S.items() for b, t in by.items()]}}}
MIX = {"S": 0.9, "L": 0.1}
SLO_FACTOR = 4.0  # each class's SLO: this many times its standalone time


def add_arguments(p: argparse.ArgumentParser) -> None:
    # 10^7: ten times the target's 10^6, minutes of simulation; 1e23 would never end (or fill memory)
    p.add_argument("--requests", type=count(1, 10**7), default=100_000, help="requests simulated (default %(default)s)")
    p.add_argument("--steps", type=count(1, 1000), default=50, help="denoising steps of every request "
                   "(default %(default)s, Wan2.1's)")
    p.add_argument("--chunk-steps", type=count(1, 1000), help="the denoise stage's chunk_steps (default: the "
                   "workflow's, which the core sizes from its overhead); as many as --steps: every run whole, "
                   "competing requests too (no preemption inside a request's denoising)")
    p.add_argument("--sets", type=count(), default=100, help="workflow sets (default %(default)s)")
    p.add_argument("--devices-per-set", type=count(3), default=10, help="devices per set, at least 3 (default 10)")
    p.add_argument("--load", type=positive(), default=0.7, help="share of the fleet's denoise capacity (default 0.7)")
    p.add_argument("--profile", action="store_true", help="also profile (slower) and list where the time goes")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for simspeed.json and simspeed.md")


def run(args: argparse.Namespace) -> int:
    if args.devices_per_set < 3:
        raise SystemExit("--devices-per-set: a set needs text_encode, denoise_t2v and vae_decode (3 at least)")
    wf = load_workflow(deploy_dir() / "wan21-scale.yaml")
    if args.chunk_steps:
        wf = apply_schedule(wf, [f"denoise_t2v.chunk_steps={args.chunk_steps}"])
    denoise = args.devices_per_set - 2
    sets = {f"set{i}": {"text_encode": 1, "denoise_t2v": denoise, "vae_decode": 1} for i in range(args.sets)}
    classes = parse_classes(f"S={S}:{args.steps},L={L}:{args.steps}")
    shape = {"S": S, "L": L}
    for name, c in classes.items():
        alone = sum(CALL_S[stage][shape[name]] for stage in CALL_S) + args.steps * STEP_S[shape[name]][1]
        c["slo_s"] = SLO_FACTOR * alone
    # denoise seconds a request takes at batch 1
    work = sum(share * args.steps * STEP_S[shape[name]][1] for name, share in MIX.items())
    rate = args.load * args.sets * denoise / work
    t0 = time.perf_counter()
    trace = poisson_trace(classes, MIX, rate, args.requests, seed=0, timeout_s=600.0)
    made = time.perf_counter() - t0
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    cpu0 = time.process_time()
    result, sim = simulate(wf, sets, CostTable(TABLE, "simspeed"), trace, chunks=False)
    cpu = time.process_time() - cpu0
    if prof:
        prof.disable()
    wall = result["wall_s"]
    devices = args.sets * args.devices_per_set
    chunks = sum(vi.core.stats.batches for _, vi, _, _ in sim.lifetimes)  # each one decision that started it
    rps = args.requests / wall
    projected = TARGET["requests"] / rps
    doc = {"bench": "simspeed", "when": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(),
           "requests": args.requests, "steps": args.steps, "chunk_steps": args.chunk_steps, "devices": devices,
           "sets": args.sets, "load": args.load,
           "simulated_s": result["simulated_s"], "wall_s": wall, "cpu_s": cpu, "trace_s": made, "requests_per_s": rps,
           "projected_s_for_1e6": projected, "attainment": result["summary"]["all"]["attainment"],
           "utilization": result["utilization"], "chunks_per_request": chunks / args.requests,
           "profiled": bool(prof)}
    top = ""
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(10)
        top = buf.getvalue()
        doc["profile_top"] = top
    md = [f"`onepiece bench simspeed` — {doc['when']}, {cpu_name()}, one core",
          "", f"{args.requests:,} requests of {args.steps} steps"
              f"{f' (chunks of {args.chunk_steps})' if args.chunk_steps else ''} over {devices:,} devices "
              f"({args.sets} sets) at {args.load:g} of capacity: "
              f"{result['simulated_s']:.0f} s simulated in {wall:.1f} s of wall time ({rps:,.0f} requests/s"
              f"{', profiled' if prof else ''}; {cpu:.1f} s of CPU time); SLO attainment {doc['attainment']:.1%}; "
              f"{doc['chunks_per_request']:.1f} chunks a request, each started by a decision of its stage's core.",
          f"At that rate 10^6 requests take {projected:.0f} s (target ≤ {TARGET['seconds']:.0f} s: "
          f"{'met' if projected <= TARGET['seconds'] else 'not met'})."]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simspeed.json").write_text(json.dumps(doc, indent=1))
    (out / "simspeed.md").write_text("\n".join(md) + ("\n\n```\n" + top + "```\n" if top else "\n"))
    print("\n".join(md))
    if top:
        print(top)
    return 0
