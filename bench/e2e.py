"""`onepiece bench e2e`: end-to-end latency of the split pipeline against the monolithic one.

For each case (WxHxF / steps) it measures, at concurrency 1 and with the same tiny models and
seed:

- monolithic: ``WanPipeline(...)`` in this process, frames only, and frames + the same MP4
  encoding the deployment does (the like-for-like baseline: both end with an MP4);
- onepiece: a local deployment (`onepiece up`'s Deployment, every stage its own process),
  from submit (HTTP POST) until the status says completed (polled every 2 ms), with the
  per-stage breakdown from each result's own trace.

It prints a table and saves JSON (and a Markdown table) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_CASES = "64x64x9:10,256x256x17:10"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", choices=["e2e"], help="benchmark to run")
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated WxHxFRAMES:STEPS")
    p.add_argument("--requests", type=int, default=5, help="measured requests per case (after 1 warm-up)")
    p.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    p.add_argument("--models", help="folder for the tiny models (default: a temporary one)")
    p.add_argument("--out", default="bench/results", help="folder for e2e.json and e2e.md")


def _cases(spec: str) -> list[tuple[int, int, int, int]]:
    out = []
    for item in spec.split(","):
        try:
            size, steps = item.split(":")
            w, h, f = (int(x) for x in size.lower().split("x"))
            out.append((w, h, f, int(steps)))
        except ValueError:
            raise SystemExit(f"bad --cases entry {item!r}: expected WxHxFRAMES:STEPS, e.g. 64x64x9:10") from None
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50": statistics.median(xs), "mean": statistics.fmean(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


def monolithic(model_dir: Path, cases: list, n: int) -> dict[str, Any]:
    import torch
    from diffusers import WanPipeline

    from onepiece.stage.wan.functions import encode_mp4

    pipe = WanPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    out = {}
    for w, h, f, steps in cases:
        frames_t, mp4_t = [], []
        for i in range(n + 1):
            t0 = time.perf_counter()
            frames = pipe(prompt="a cat surfing a wave", negative_prompt="", height=h, width=w, num_frames=f,
                          num_inference_steps=steps, guidance_scale=5.0, max_sequence_length=64,
                          generator=torch.Generator().manual_seed(0), output_type="np").frames[0]
            t1 = time.perf_counter()
            encode_mp4(frames, 16)
            t2 = time.perf_counter()
            if i:  # the first run warms up
                frames_t.append(t1 - t0)
                mp4_t.append(t2 - t0)
        out[f"{w}x{h}x{f}:{steps}"] = {"frames": _stats(frames_t), "frames+mp4": _stats(mp4_t)}
    del pipe
    return out


def _breakdown(trace: list[dict]) -> dict[str, float]:
    """Seconds per stage (recv → end: queue wait + compute) and per hop between them."""
    out: dict[str, float] = {}
    last = None
    for ev in trace:
        t = ev["t"] / 1e9
        if ev["event"] == "recv" and last is not None:
            out[f"hop→{ev['stage']}"] = out.get(f"hop→{ev['stage']}", 0.0) + t - last
            out.setdefault(f"_recv_{ev['stage']}", t)
        if ev["event"] == "end":
            out[ev["stage"]] = t - out.pop(f"_recv_{ev['stage']}", t)
        if ev["event"] in ("leave", "end"):
            last = t
    return {k: v for k, v in out.items() if not k.startswith("_")}


def distributed(models: dict[str, Path], cases: list, n: int, transport: str, folder: Path) -> dict[str, Any]:
    import yaml

    from onepiece.client import Client
    from onepiece.config import deploy_dir
    from onepiece.db.client import DbClient
    from onepiece.launcher import Deployment, free_tcp_address
    from onepiece.nm.client import NmClient

    wf = yaml.safe_load((deploy_dir() / "wan21.yaml").read_text())
    for spec in wf["models"].values():
        spec["path"] = str(models[spec["tiny"]])
    (folder / "workflow.yaml").write_text(yaml.safe_dump(wf))
    nm = free_tcp_address()
    topo = {"workflow": "workflow.yaml", "transport": transport, "nm": {"address": nm},
            "sets": [{"name": "set0", "proxy": {"port": 0}, "db": {"count": 1},
                      "stages": {"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1}}]}
    (folder / "topology.yaml").write_text(yaml.safe_dump(topo))
    dep = Deployment(folder / "topology.yaml", folder / "logs")
    out: dict[str, Any] = {}
    try:
        dep.start()
        url = dep.wait_ready(300)["set0"][0]
        nmc = NmClient(nm)
        db = DbClient([d["control"] for d in nmc.routes("set0")["dbs"]])
        nmc.close()
        with Client(url) as c:
            for w, h, f, steps in cases:
                lat, stages = [], []
                for i in range(n + 1):
                    t0 = time.perf_counter()
                    v = c.submit("a cat surfing a wave", model="t2v", size=f"{w}x{h}", num_frames=f, steps=steps,
                                 seed=0, guidance=5.0)
                    c.wait(v["id"], timeout=600, interval=0.002, max_interval=0.002)
                    t1 = time.perf_counter()
                    rec = db.get(v["id"].removeprefix("video_"))
                    c.download(v["id"], folder / "out.mp4")
                    if i:
                        lat.append(t1 - t0)
                        stages.append(_breakdown(rec.get("trace") or []))
                keys = sorted({k for s in stages for k in s})
                out[f"{w}x{h}x{f}:{steps}"] = {
                    "e2e": _stats(lat),
                    "stages_p50": {k: statistics.median([s.get(k, 0.0) for s in stages]) for k in keys},
                }
        db.close()
    finally:
        dep.stop()
    return out


def run(args: argparse.Namespace) -> int:
    from onepiece.stage.wan.tiny import build_tiny

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cases = _cases(args.cases)
    with tempfile.TemporaryDirectory(prefix="onepiece-bench-") as tmp:
        base = Path(args.models) if args.models else Path(tmp) / "models"
        models = {}
        for kind in ("t2v", "i2v"):
            path = base / f"wan2.1-{kind}-tiny"
            models[kind] = path if (path / "model_index.json").exists() else build_tiny(kind, path, 0)
        print("monolithic diffusers pipeline ...", flush=True)
        mono = monolithic(models["t2v"], cases, args.requests)
        print("onepiece deployment ...", flush=True)
        dist = distributed(models, cases, args.requests, args.transport, Path(tmp))
    rows = []
    for key in mono:
        m, d = mono[key], dist[key]
        rows.append({
            "case": key,
            "monolithic_frames_p50_s": m["frames"]["p50"],
            "monolithic_mp4_p50_s": m["frames+mp4"]["p50"],
            "onepiece_e2e_p50_s": d["e2e"]["p50"],
            "ratio_vs_mp4": d["e2e"]["p50"] / m["frames+mp4"]["p50"],
            "ratio_vs_frames": d["e2e"]["p50"] / m["frames"]["p50"],
            "stages_p50_s": d["stages_p50"],
        })
    result = {"bench": "e2e", "when": time.strftime("%Y-%m-%d %H:%M"), "cpu_count": os.cpu_count(),
              "requests": args.requests, "transport": args.transport, "monolithic": mono, "onepiece": dist, "rows": rows}
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "e2e.json").write_text(json.dumps(result, indent=2))
    lines = ["| case (WxHxF:steps) | monolithic frames p50 | monolithic + MP4 p50 | onepiece e2e p50 | ratio vs +MP4 | ratio vs frames |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['monolithic_frames_p50_s']*1000:.1f} ms | {r['monolithic_mp4_p50_s']*1000:.1f} ms "
                     f"| {r['onepiece_e2e_p50_s']*1000:.1f} ms | {r['ratio_vs_mp4']:.3f} | {r['ratio_vs_frames']:.3f} |")
    lines.append("")
    for r in rows:
        parts = ", ".join(f"{k} {v*1000:.1f} ms" for k, v in r["stages_p50_s"].items())
        lines.append(f"- {r['case']} per-stage p50: {parts}")
    table = "\n".join(lines)
    (outdir / "e2e.md").write_text(table + "\n")
    print(table)
    print(f"saved {outdir / 'e2e.json'} and {outdir / 'e2e.md'}")
    return 0
