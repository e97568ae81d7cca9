"""`onepiece bench simspeed`: how fast the simulator plans for a fleet (DESIGN §12).

``--requests`` requests (Poisson, two classes) through ``--sets`` copies of one set of
``--devices-per-set`` devices (text_encode 1, vae_decode 1, the rest denoise_t2v on ``slo``), at
``--load`` of the fleet's capacity, priced by a small synthetic table (a step and a call cost
whatever the table says: speed depends on events, not on their figures). Reports simulated
requests per second of wall time on one core, events, and where the time goes (cProfile's top
functions), and the run's CPU time beside its wall time (on a shared machine the CPU time is what
compares across runs). Target: 10^6 requests over 1,000 devices in at most 60 s. Saved as
``simspeed.json`` and ``simspeed.md`` under ``--out``.
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
from onepiece.sim.cli import simulate
from onepiece.sim.costs import CostTable

TARGET = {"requests": 1_000_000, "devices": 1000, "seconds": 60.0}
S, L = "64x64x9", "192x192x17"
TABLE = {"version": 1, "stages": {
    "text_encode": {"rows": [{"key": S, "batch": 1, "seconds": 0.01}, {"key": L, "batch": 1, "seconds": 0.01}]},
    "vae_decode": {"rows": [{"key": S, "batch": 1, "seconds": 0.02}, {"key": L, "batch": 1, "seconds": 0.08}]},
    "denoise_t2v": {"rows": [{"key": f"{S}/cfg/L64", "batch": b, "seconds": t} for b, t in ((1, 0.02), (2, 0.03), (4, 0.05))]
                    + [{"key": f"{L}/cfg/L64", "batch": b, "seconds": t} for b, t in ((1, 0.2), (2, 0.4))]}}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    # 10^7: ten times the target's 10^6, minutes of simulation; 1e23 would never end (or fill memory)
    p.add_argument("--requests", type=count(1, 10**7), default=100_000, help="requests simulated (default %(default)s)")
    p.add_argument("--sets", type=count(), default=100, help="workflow sets (default %(default)s)")
    p.add_argument("--devices-per-set", type=count(3), default=10, help="devices per set, at least 3 (default 10)")
    p.add_argument("--load", type=positive(), default=0.7, help="share of the fleet's denoise capacity (default 0.7)")
    p.add_argument("--profile", action="store_true", help="also profile (slower) and list where the time goes")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for simspeed.json and simspeed.md")


def run(args: argparse.Namespace) -> int:
    if args.devices_per_set < 3:
        raise SystemExit("--devices-per-set: a set needs text_encode, denoise_t2v and vae_decode (3 at least)")
    wf = load_workflow(deploy_dir() / "wan21-scale.yaml")
    denoise = args.devices_per_set - 2
    sets = {f"set{i}": {"text_encode": 1, "denoise_t2v": denoise, "vae_decode": 1} for i in range(args.sets)}
    classes = parse_classes("S=64x64x9:10,L=192x192x17:10")
    classes["S"]["slo_s"], classes["L"]["slo_s"] = 1.0, 8.0
    mix = {"S": 0.9, "L": 0.1}
    work = 0.9 * 10 * 0.02 + 0.1 * 10 * 0.2  # denoise seconds per request at batch 1
    rate = args.load * args.sets * denoise / work
    t0 = time.perf_counter()
    trace = poisson_trace(classes, mix, rate, args.requests, seed=0, timeout_s=60.0)
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
    rps = args.requests / wall
    projected = TARGET["requests"] / rps
    doc = {"bench": "simspeed", "when": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(),
           "requests": args.requests, "devices": devices, "sets": args.sets, "load": args.load,
           "simulated_s": result["simulated_s"], "wall_s": wall, "cpu_s": cpu, "trace_s": made, "requests_per_s": rps,
           "projected_s_for_1e6": projected, "attainment": result["summary"]["all"]["attainment"],
           "utilization": result["utilization"], "profiled": bool(prof)}
    top = ""
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(10)
        top = buf.getvalue()
        doc["profile_top"] = top
    md = [f"`onepiece bench simspeed` — {doc['when']}, {cpu_name()}, one core",
          "", f"{args.requests:,} requests over {devices:,} devices ({args.sets} sets) at {args.load:g} of capacity: "
              f"{result['simulated_s']:.0f} s simulated in {wall:.1f} s of wall time ({rps:,.0f} requests/s"
              f"{', profiled' if prof else ''}; {cpu:.1f} s of CPU time); SLO attainment {doc['attainment']:.1%}.",
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
