"""`onepiece bench shares`: where a request's device time goes, stage by stage.

Builds the Wan2.1 components of ``--app`` (T2V or I2V) at ``--size`` in memory with random
weights (no download): ``tiny`` and ``scale`` are the profiles `onepiece models build` makes;
``wan2.1`` is the real architecture (T2V-1.3B: the UMT5-XXL encoder, the 1.3B transformer, the
Wan VAE; I2V-14B-480P: the same encoder and VAE, CLIP ViT-H/14 and the 14B transformer), meant
for a GPU. On ``--device`` it times the real stage functions, per shape (``--shapes``): each
stage before denoising (text encoding with CFG's negative prompt; for I2V, image and VAE
encoding), one denoising step of a batch of prepared requests per batch size (``--batch``, one
forward pass), and the VAE decode with its MP4 encoding (the whole ``vae_decode`` stage). Each
figure is the median of ``--repeat`` runs after ``--warmup``, the device synchronised around
each run (a CUDA call returns before its kernels finish).

A request's standalone time is those calls + ``--steps`` × a step at batch 1; the shares are
the stages' parts of it (what issue 11's scale profile is built to match: denoising ≥ 80%), and
the per-step time by batch size says whether batching saves device time at that shape. Saved as
``shares.json`` and ``shares.md`` under ``--out``, with the cost table (``costs.json``, the
format of ``schedule.costs``, `onepiece sim` and `onepiece plan`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from onepiece.argtypes import VideoShapes, count, numbers, out_dir, torch_device
from onepiece.bench.common import MAX_THREADS

SIZES = ("tiny", "scale", "wan2.1")  # stage/wan/tiny.py's PROFILES and REAL


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--app", choices=["t2v", "i2v"], default="t2v", help="the application timed (default %(default)s)")
    p.add_argument("--size", choices=SIZES, default="scale", help="model size (default %(default)s; wan2.1: the real "
                   "T2V-1.3B or I2V-14B-480P architecture, for a GPU)")
    p.add_argument("--shapes", type=VideoShapes(), default="64x64x9", help="comma-separated WxHxFRAMES (default %(default)s)")
    p.add_argument("--steps", type=count(), default=50, help="denoising steps of a request (default %(default)s)")
    # the workflow's bound on max_sequence_length (onepiece/config.py); 1e8 would fill memory
    p.add_argument("--text-length", type=count(1, 4096), default=512, help="max_sequence_length (default %(default)s, Wan2.1's)")
    p.add_argument("--batch", type=numbers(count()), default="1,2,4",
                   help="batch sizes of a step; 1 is always timed (default %(default)s)")
    p.add_argument("--repeat", type=count(), default=3, help="timed runs per figure (median taken)")
    p.add_argument("--warmup", type=count(0), default=1, help="untimed runs before them")
    p.add_argument("--device", default="cpu", type=torch_device, help="torch device (cpu, cuda)")
    p.add_argument("--threads", type=count(1, MAX_THREADS), help="torch threads (default: torch's)")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for shares.json, .md and costs.json")


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import orjson
    import torch

    from onepiece.bench.common import PROMPT, cpu_name
    from onepiece.profile import timed
    from onepiece.sched.costs import make_table
    from onepiece.sched.keys import call_key, compat_key
    from onepiece.stage.gpu import lacking, synchronizer
    from onepiece.stage.registry import StageContext
    from onepiece.stage.wan import functions as wan
    from onepiece.stage.wan.tiny import REAL, components
    from onepiece.transport.message import Message, new_uid

    shapes = args.shapes
    if args.size == REAL and args.device == "cpu":
        raise SystemExit(f"--size {REAL} is for a GPU (--device cuda): its billions of parameters in float32 are "
                         f"29 GB (T2V) and 91 GB (I2V)")
    if why := lacking(args.device):
        raise SystemExit(f"--device {args.device}: {why}")
    if args.threads:
        torch.set_num_threads(args.threads)
    app, dev, sync = args.app, torch.device(args.device), synchronizer(args.device)
    batches = sorted({1, *args.batch})  # a request's standalone time is its steps at batch 1
    t0 = time.perf_counter()
    comps = components(app, args.size, args.device)
    sync()
    built_s = time.perf_counter() - t0
    params_b = {k: sum(p.numel() for p in v.parameters()) / 1e9 for k, v in comps.items() if hasattr(v, "parameters")}
    print(f"built {app} {args.size} on {args.device} in {built_s:.1f} s: "
          + ", ".join(f"{k} {n:.3g} B params" for k, n in params_b.items()), flush=True)
    ctx = StageContext(comps, args.device)
    # the application's stages before denoising, each one call, their outputs passed on
    before = [wan.text_encode] + ([wan.image_encode, wan.vae_encode] if app == "i2v" else [])
    denoise = wan.denoise_t2v if app == "t2v" else wan.denoise_i2v
    wu, rep = args.warmup, args.repeat
    rows: list[dict[str, Any]] = []
    table: dict[str, list[dict[str, Any]]] = {f.__name__: [] for f in before}
    table[f"denoise_{app}"], table["vae_decode"] = [], []
    for w, h, f in shapes:
        params = {"prompt": PROMPT, "negative_prompt": "", "width": w, "height": h, "num_frames": f,
                  "steps": args.steps, "guidance": 5.0, "seed": 0, "fps": 16, "max_sequence_length": args.text_length}

        def msg(parts: dict, seed: int = 0, steps: int = args.steps) -> Message:
            return Message({"uid": new_uid(), "app": app, "params": {**params, "seed": seed, "steps": steps}}, parts)

        calls_s: dict[str, float] = {}
        parts: dict[str, Any] = {}
        if app == "i2v":
            parts["image"] = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
        with torch.inference_mode():
            for fn in before:
                given = dict(parts)
                calls_s[fn.__name__] = timed(lambda: fn(ctx, msg(given)), sync, wu, rep)
                parts = fn(ctx, msg(given))
            step_s = {}
            for b in batches:
                # every state keeps steps to spare: a finished one would leave the batch
                tasks = [denoise(ctx, msg(parts, seed, wu + rep + 1)) for seed in range(b)]
                step_s[b] = timed(lambda: wan.WanDenoise.step_batch(tasks), sync, wu, rep)
                latents = tasks[0].latents
                del tasks
            calls_s["vae_decode"] = timed(lambda: wan.vae_decode(ctx, msg({"latents": latents})), sync, wu, rep)
        denoise_s = args.steps * step_s[1]
        total = sum(calls_s.values()) + denoise_s
        row = {"shape": f"{w}x{h}x{f}", "calls_s": calls_s, "step_s": step_s, "denoise_s": denoise_s,
               "standalone_s": total, "shares": {**{k: t / total for k, t in calls_s.items()}, "denoise": denoise_s / total},
               "step_per_request_vs_batch1": {b: t / b / step_s[1] for b, t in step_s.items()}}
        if dev.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
            torch.cuda.reset_peak_memory_stats(dev)
        rows.append(row)
        print(f"{row['shape']}: " + ", ".join(f"{k} {t * 1000:.1f} ms" for k, t in calls_s.items()) + ", step " +
              ", ".join(f"b{b} {t * 1000:.1f} ms" for b, t in step_s.items()) +
              f"; denoise {row['shares']['denoise']:.1%} of {total:.2f} s", flush=True)
        for k, t in calls_s.items():
            table[k].append({"key": call_key(params), "batch": 1, "seconds": t, "samples": rep})
        table[f"denoise_{app}"] += [{"key": compat_key(params), "batch": b, "stepped": True, "seconds": t,
                                     "samples": rep} for b, t in step_s.items()]

    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    meta = {"device": device_name, "cpu": cpu_name(), "app": app, "size": args.size, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "steps": args.steps, "warmup": wu, "repeat": rep,
            "build_s": built_s, "params_billions": params_b, "created": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "shares.json").write_bytes(orjson.dumps({**meta, "rows": rows}, option=orjson.OPT_INDENT_2
                                                   | orjson.OPT_NON_STR_KEYS))
    doc = make_table(table, **meta, units="seconds per step of a batch (denoise) or per call, median of the timed "
                     "runs", source="onepiece bench shares (random weights, real architectures)")
    (out / "costs.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    (out / "shares.md").write_text(_markdown(meta, rows, batches))
    print(f"wrote {out / 'shares.json'}, shares.md, costs.json")
    return 0


def _markdown(meta: dict[str, Any], rows: list[dict[str, Any]], batches: list[int]) -> str:
    calls = list(rows[0]["calls_s"])
    more = [b for b in batches if b > 1]  # compared with batch 1
    head = ["shape", *calls, "step b1", "denoise", "standalone", "denoise share",
            *(f"step b{b} per request" for b in more)]
    lines = [f"`onepiece bench shares`, {meta['app']} at size {meta['size']} on {meta['device']} ({meta['cpu']}, torch "
             f"{meta['torch']}), {meta['created']}; a request = {', '.join(calls[:-1])}, {meta['steps']} denoising "
             f"steps, then VAE decode and MP4; medians of {meta['repeat']} runs after {meta['warmup']}.", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        cells = [r["shape"], *(f"{r['calls_s'][k] * 1000:.1f} ms" for k in calls),
                 f"{r['step_s'][1] * 1000:.1f} ms", f"{r['denoise_s']:.2f} s", f"{r['standalone_s']:.2f} s",
                 f"{r['shares']['denoise']:.1%}", *(f"{r['step_per_request_vs_batch1'][b]:.2f}×" for b in more)]
        lines.append("| " + " | ".join(cells) + " |")
    if more:
        lines += ["", "\"step bN per request\": a batched step's time over N, against a step at batch 1 (below 1×: "
                  "batching saves device time at that shape)."]
    return "\n".join(lines) + "\n"
