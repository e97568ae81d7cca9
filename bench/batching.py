"""`onepiece bench batching`: what step-level batching buys the denoise stage.

One set (text_encode, denoise_t2v, vae_decode; one DB; one proxy, request monitor off) on the
``scale`` models, every stage worker on one torch thread, every request of one small shape
(``--shape``). The denoise stage runs ``fcfs-batched`` (continuous batching in arrival order)
with ``max_batch`` = each of ``--batches`` in turn, a deployment each. Batch 1 comes first:
its capacity C1 is the closed-loop throughput of 4 clients (after a warm-up). Two seeded
Poisson traces, the same for every batch size: ``--saturate`` × C1 (3×: batch 1 cannot keep
up, so what completes per second is what the stage sustains) and 1.0 × C1 (batch 1's
capacity: latency). No deadlines: every request is awaited.

Per batch size: throughput at saturation (completed / first send → last completion), p50 /
p99 latency (submit → completed) at both loads, the stage's mean batch and step times. Saved
as ``batching.json`` and ``batching.md`` under ``--out``, with the traces. Target: at the
largest batch size, throughput ≥ 1.5× batch 1's, and p99 at C1 no worse than batch 1's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from onepiece.argtypes import count, numbers, positive
from onepiece.bench.common import PROMPT, cpu_name, model_dirs, parse_shape, percentile, shape_flag
from onepiece.bench.overload import SET, Target, _run_async
from onepiece.bench.sched import Session, _body, log, session_arguments
from onepiece.bench.trace import poisson_trace, replay

TARGETS = {"throughput_ratio_min": 1.5}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=numbers(count()), default="1,2,4,8", help="max_batch values, 1 among them: the baseline (default %(default)s)")
    p.add_argument("--shape", type=shape_flag, default="64x64x9:50", help="every request's WxHxFRAMES:STEPS (default %(default)s)")
    p.add_argument("--requests", type=count(), default=40, help="requests per trace (default %(default)s)")
    p.add_argument("--saturate", type=positive(), default=3.0, help="the saturating load, x C1 (default %(default)s)")
    # closed_loop skips the pipeline's filling and needs two completions after it: 3 at least
    p.add_argument("--calibrate", type=count(3), default=16, help="closed-loop requests measuring C1, at least 3")
    session_arguments(p, request_timeout=300.0, out="batching.json, .md and the traces")


async def closed_loop(t: Target, body: bytes, n: int, clients: int = 4) -> float | None:
    ends: list[float] = []
    left = [body] * n

    async def client() -> None:
        while left:
            left.pop()
            rec = await t.request(body)
            if rec["outcome"] == "completed":
                ends.append(rec["t_event"])

    await asyncio.gather(*(client() for _ in range(clients)))
    ends.sort()
    skip = min(clients, len(ends) // 2)
    return (len(ends) - 1 - skip) / (ends[-1] - ends[skip]) if len(ends) - skip >= 2 else None


async def measure(t: Target, body: bytes, traces: dict[str, Any], cfg: argparse.Namespace, c1_n: int | None,
                  name: str) -> dict[str, Any]:
    async with t:
        for i in range(3):  # warm-up: the first requests through fresh workers are slow
            await t.request(body)
        out: dict[str, Any] = {}
        if c1_n:
            out["c1_rps"] = await closed_loop(t, body, c1_n)
            log(f"[{name}] closed-loop throughput {out['c1_rps'] or float('nan'):.3f} req/s")
            await t.drain(cfg.request_timeout)
        for load, trace in traces.items():
            if trace is None:
                continue
            log(f"[{name}] trace at {load}: {len(trace.requests)} requests over {trace.requests[-1].at:.1f} s ...")
            recs = await replay(t, trace, PROMPT, cfg.max_duration)
            out[load] = recs
            await t.drain(cfg.request_timeout)
            await asyncio.sleep(1.0)
        st = (await t.status())["sets"][SET]["stages"]["denoise_t2v"]["instances"][0]["stats"]
        out["stage"] = {k: st.get(k) for k in ("batches", "batched", "costs", "overhead_ms", "preempted")}
        return out


def summary(recs: list[dict]) -> dict[str, Any]:
    lat = [r["latency_s"] for r in recs if r["outcome"] == "completed" and r.get("latency_s") is not None]
    t0 = min(r["t_send"] for r in recs)
    end = max(r["t_send"] + r["latency_s"] for r in recs if r.get("latency_s") is not None)
    return {"n": len(recs), "completed": len(lat), "throughput_rps": len(lat) / (end - t0) if end > t0 else None,
            "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99), "mean_s": sum(lat) / len(lat) if lat else None}


def batch_sizes(given: list[int]) -> list[int]:
    """The ``--batches`` to run: each once, smallest first, so that batch 1 (the baseline) runs
    first and the targets judge the largest (``--batches 1,8,4`` judged 4, labelled max batch)."""
    out = sorted(set(given))
    if out[0] != 1:
        raise SystemExit("--batches must include 1 (the baseline)")
    return out


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    batches = batch_sizes(args.batches)
    w, h, f, steps = parse_shape(args.shape)
    cls = {"size": f"{w}x{h}", "num_frames": f, "steps": steps}
    body = _body(cls, 0)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    runs: dict[int, dict[str, Any]] = {}
    traces: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="onepiece-bench-") as tmp:
        models = model_dirs(Path(args.models) if args.models else None, args.profile)
        for b in batches:
            sched = {"policy": "fcfs-batched", "max_batch": b}
            log(f"[batch {b}] starting a deployment (denoise_t2v {sched}) ...")
            with Session(f"batch{b}", models, Path(tmp) / f"b{b}", args, sched) as s:
                if b == 1:
                    res = _run_async(measure(s.target(), body, {}, args, args.calibrate, "batch 1"))
                    c1 = res["c1_rps"]
                    if not c1:
                        raise RuntimeError("batch 1 completed nothing in the closed loop")
                    for name, load in (("saturate", args.saturate), ("c1", 1.0)):
                        traces[name] = poisson_trace({"S": cls}, {"S": 1.0}, load * c1, args.requests, args.seed,
                                                     deadlines=False, capacity_rps=c1, load=load,
                                                     note="onepiece bench batching")
                        (outdir / f"batching-trace-{name}.json").write_bytes(traces[name].dump())
                    more = _run_async(measure(s.target(), body, traces, args, None, "batch 1"))
                    res.update(more)
                else:
                    res = _run_async(measure(s.target(), body, traces, args, None, f"batch {b}"))
                runs[b] = res
    c1 = runs[1]["c1_rps"]
    rows = {b: {"saturate": summary(r["saturate"]), "c1": summary(r["c1"]), "stage": r["stage"]}
            for b, r in runs.items()}
    base = rows[1]
    top = rows[batches[-1]]
    tr = (top["saturate"]["throughput_rps"] or 0) / base["saturate"]["throughput_rps"]
    targets = {"throughput_ratio": {"value": tr, "target": f"≥ {TARGETS['throughput_ratio_min']}",
                                    "met": tr >= TARGETS["throughput_ratio_min"]},
               "p99_at_c1_ratio": {"value": top["c1"]["p99_s"] / base["c1"]["p99_s"], "target": "≤ 1",
                                   "met": top["c1"]["p99_s"] <= base["c1"]["p99_s"]}}
    elapsed = time.monotonic() - t_start
    result = {"bench": "batching", "when": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(),
              "cpu_count": os.cpu_count(), "elapsed_s": elapsed, "c1_rps": c1, "rows": rows, "targets": targets,
              "settings": {k: v for k, v in vars(args).items() if k not in ("fn", "which")},
              "requests": {str(b): {k: r[k] for k in ("saturate", "c1")} for b, r in runs.items()}}
    (outdir / "batching.json").write_text(json.dumps(result, indent=1, default=str))

    def ms(v: float | None) -> str:
        return "—" if v is None else f"{v * 1000:.0f}"

    md = [f"`onepiece bench batching` — {result['when']}, {cpu_name()}, {os.cpu_count()} cores, device {args.device}, "
          f"{args.profile} models, "
          f"t2v {args.shape}, fcfs-batched, {args.requests} requests per trace; C1 = {c1:.3f} req/s (batch 1, "
          f"closed loop); {elapsed:.0f} s in all.", "",
          f"| max batch | throughput at {args.saturate:g}×C1 (req/s) | × batch 1 | p50 / p99 at {args.saturate:g}×C1 (ms) "
          "| p50 / p99 at C1 (ms) | mean batch | chunk overhead ms | step ms by batch size |",
          "|---|---|---|---|---|---|---|---|"]
    for b, r in rows.items():
        st = r["stage"]
        mean_b = st["batched"] / st["batches"] if st.get("batches") else None
        key = f"{w}x{h}x{f}/cfg/L64"
        steps_ms = ", ".join(f"{k}: {v * 1000:.1f}" for k, v in (st.get("costs") or {}).get(key, {}).items())
        thr = r["saturate"]["throughput_rps"]
        md.append(f"| {b} | {thr:.3f} | {thr / base['saturate']['throughput_rps']:.2f} "
                  f"| {ms(r['saturate']['p50_s'])} / {ms(r['saturate']['p99_s'])} "
                  f"| {ms(r['c1']['p50_s'])} / {ms(r['c1']['p99_s'])} | {'—' if mean_b is None else f'{mean_b:.2f}'} "
                  f"| {st.get('overhead_ms') or 0:.2f} | {steps_ms} |")
    md += ["", f"Targets (max batch {batches[-1]} against batch 1):", "", "| target | value | wanted | met |",
           "|---|---|---|---|"]
    for k, v in targets.items():
        md.append(f"| {k.replace('_', ' ')} | {v['value']:.3f} | {v['target']} | {'yes' if v['met'] else 'NO'} |")
    text = "\n".join(md)
    (outdir / "batching.md").write_text(text + "\n")
    print()
    print(text)
    print(f"saved {outdir / 'batching.json'} and batching.md")
    return 0
