"""`onepiece bench moves`: the NM's elastic policy (DESIGN §9) with its defaults against the rules
it had before, in the simulator (DESIGN §12), on real-size costs.

One set of Wan2.1 T2V (``deploy/wan21-real.yaml`` priced by ``deploy/wan21-h100.costs.json``:
832x480x25, 50 steps, 7.9 s alone on an H100): text_encode 1, ``--denoise`` denoise_t2v
instances, vae_decode 1, and ``--idle`` instances in the idle pool. Seeded Poisson arrivals at
``--loads`` x the denoise instances' capacity, each request aiming for α x its standalone time
(``--alphas``). Every simulation runs the NM's policy with its defaults (busy threshold 85%,
window 30 s, cooldown 60 s, low 20%) except what each variant sets:

- ``before``: a stage returns an instance when below low over one window, and saturation is
  utilization alone (``cold_windows=1, late=1``): the policy before the late rule;
- ``late rule``: also saturated when more than 1% of its requests leave it late (``cold_windows=1``);
- ``defaults``: the late rule, and a return only when below low over 10 windows;
- ``never return``: ``low=0``, the reference where nothing goes back to the pool.

A move loads the new stage's models in ``--move-s``. Per load and α: misses of the SLO out of the
requests, and the moves. Deterministic: the same code and inputs give the same figures. Saved
as ``moves.json`` and ``moves.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from onepiece.argtypes import count, non_negative, numbers, out_dir, positive
from onepiece.bench.trace import Trace, parse_classes, poisson_trace
from onepiece.config import ElasticSpec, Topology, Workflow, deploy_dir, load_workflow
from onepiece.sim.costs import CostTable

SHAPE = "832x480x25:50"
VARIANTS: dict[str, dict[str, Any]] = {
    "before": {"cold_windows": 1, "late": 1.0},
    "late rule": {"cold_windows": 1},
    "defaults": {},
    "never return": {"low": 0.0},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--loads", type=numbers(positive()), default="0.6,0.7,0.8", help="shares of the denoise capacity (default %(default)s)")
    p.add_argument("--alphas", type=numbers(positive()), default="1.5,2", help="SLO = alpha x standalone time (default %(default)s)")
    p.add_argument("--denoise", type=count(), default=4, help="denoise_t2v instances at the start (default 4)")
    p.add_argument("--idle", type=count(0), default=2, help="instances in the idle pool (default 2)")
    p.add_argument("--requests", type=count(), default=3000, help="requests per simulation (default %(default)s)")
    p.add_argument("--move-s", type=non_negative(" seconds"), default=60.0, help="seconds a move takes to load models (default 60)")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for moves.json and moves.md")


def one(wf: Workflow, costs: CostTable, trace: Trace, elastic: ElasticSpec, args: argparse.Namespace) -> dict[str, Any]:
    """One simulation: SLO attainment, misses and moves."""
    from onepiece.sim.cli import simulate

    sets = {"set0": {"text_encode": 1, "denoise_t2v": args.denoise, "vae_decode": 1}}
    topo = Topology.model_validate({"workflow": "wan21-real.yaml", "nm": {"elastic": elastic.model_dump()},
                                    "sets": [{"name": "set0", "stages": sets["set0"], "idle": args.idle,
                                              "proxy": {"port": 0}}]})
    result, _ = simulate(wf, sets, costs, trace, chunks=False, elastic=topo, move_s=args.move_s)
    s = result["summary"]["all"]
    return {"attainment": s["attainment"], "missed": round((1 - s["attainment"]) * s["n"]), "n": s["n"],
            "moves": len(result["moves"]), "returns": sum(1 for m in result["moves"] if m["to"] is None)}


def run(args: argparse.Namespace) -> int:
    loads, alphas = args.loads, args.alphas
    from onepiece.sim.plan import priced

    wf = load_workflow(deploy_dir() / "wan21-real.yaml")
    costs = CostTable.load(deploy_dir() / "wan21-h100.costs.json")
    classes = parse_classes(f"T={SHAPE}")
    (j,) = priced(wf, costs, poisson_trace(classes, {"T": 1.0}, 1.0, 1, seed=0))
    standalone = sum(j.alone.values())
    rows = []
    for alpha in alphas:
        classes["T"]["slo_s"] = alpha * standalone
        for load in loads:
            rate = load * args.denoise / j.alone["denoise_t2v"]
            trace = poisson_trace(classes, {"T": 1.0}, rate, args.requests, seed=11, timeout_s=20 * standalone)
            row = {"alpha": alpha, "load": load, "variants": {
                name: one(wf, costs, trace, ElasticSpec(**over), args) for name, over in VARIANTS.items()}}
            rows.append(row)
            print(f"alpha {alpha:g} load {load:g}: " + ", ".join(
                f"{n} {v['missed']} missed ({v['moves']} moves)" for n, v in row["variants"].items()), flush=True)
    doc = {"bench": "moves", "when": time.strftime("%Y-%m-%d %H:%M"), "shape": SHAPE, "denoise": args.denoise,
           "idle": args.idle, "requests": args.requests, "move_s": args.move_s, "variants": VARIANTS, "rows": rows}
    md = [f"`onepiece bench moves` — {doc['when']}; T2V {SHAPE} on the H100 table, text_encode 1, denoise_t2v "
          f"{args.denoise}, vae_decode 1, idle pool {args.idle}; {args.requests} requests per cell; a move takes "
          f"{args.move_s:g} s. SLO misses (moves, of them returns to the pool):", "",
          "| α | load | " + " | ".join(VARIANTS) + " |", "|---|---|" + "---:|" * len(VARIANTS)]
    for r in rows:
        md.append(f"| {r['alpha']:g} | {r['load']:g} | " + " | ".join(
            f"{v['missed']} ({v['moves']}, {v['returns']})" for v in r["variants"].values()) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moves.json").write_text(json.dumps(doc, indent=1))
    (out / "moves.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0
