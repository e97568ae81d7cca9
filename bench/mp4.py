"""`onepiece bench mp4`: what the vae_decode stage's MP4 encoder costs, with the shipped x264
settings against others, on a synthetic moving video (smooth colour fields, a moving disc, a
little noise for texture: the tiny models' frames are noise, which no encoder treats like video).

Per shape and setting, through the stage's own encoder (``stream_mp4``): the CPU time of the
whole encode (every thread of this process; the encoder runs beside the VAE decode, which has
the cores, so its CPU time is what it takes from the decode), its wall time, the file's size and
its PSNR against the frames. The median of ``--repeats`` runs. Saved as ``mp4.json`` and
``mp4.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from onepiece.argtypes import VideoShapes, count, out_dir
from onepiece.bench.common import cpu_name

# None: the stage's own settings (X264_OPTIONS), read when the benchmark runs: every `onepiece`
# command builds its parser from this module, and the stage functions would load torch for it.
SETTINGS: dict[str, dict[str, str] | None] = {
    "shipped": None,
    "veryfast, x264's threads": {"preset": "veryfast", "tune": "zerolatency"},
    "superfast, 1 thread": {"preset": "superfast", "tune": "zerolatency", "threads": "1"},
    "superfast, x264's threads": {"preset": "superfast", "tune": "zerolatency"},
    "ultrafast, 1 thread": {"preset": "ultrafast", "tune": "zerolatency", "threads": "1"},
}
SHAPES = "256x256x17,832x480x81"  # bench e2e's larger case; Wan2.1 480p, 5 s at 16 fps


def add_arguments(p: argparse.ArgumentParser) -> None:
    # even sides: what yuv420p takes (x264's 4:2:0)
    p.add_argument("--shapes", type=VideoShapes(2, requests=False), default=SHAPES,
                   help="WxHxFRAMES, comma-separated (default %(default)s)")
    p.add_argument("--repeats", type=count(), default=3, help="runs per shape and setting, the median kept (default 3)")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for mp4.json and mp4.md")


def synthetic(w: int, h: int, frames: int, seed: int = 0) -> np.ndarray:
    """(frames, h, w, 3) uint8: moving colour fields, a disc crossing the frame, mild noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    out = np.empty((frames, h, w, 3), np.uint8)
    for t in range(frames):
        disc = ((x - 0.2 - 0.6 * t / frames) ** 2 + (y - 0.5) ** 2 < 0.02).astype(float)
        rgb = np.stack([0.5 + 0.5 * np.sin(6 * x + 0.3 * t), 0.5 + 0.5 * np.cos(5 * y - 0.2 * t),
                        0.3 + 0.6 * disc], -1) + rng.normal(0, 0.02, (h, w, 3))
        out[t] = np.clip(np.rint(rgb * 255), 0, 255)
    return out


def psnr(frames: np.ndarray, mp4: bytes) -> float:
    import av

    with av.open(io.BytesIO(mp4)) as c:
        got = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    mse = float(((got.astype(np.float64) - frames) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def measure(frames: np.ndarray, options: dict[str, str] | None, repeats: int) -> dict[str, Any]:
    from onepiece.stage.wan.functions import stream_mp4

    cpu, wall, mp4 = [], [], b""
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        # 4 frames a latent frame, as the VAE hands them over
        mp4 = stream_mp4((frames[i:i + 4] for i in range(0, len(frames), 4)), 16, options)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {"cpu_ms": 1e3 * statistics.median(cpu), "wall_ms": 1e3 * statistics.median(wall),
            "kib": len(mp4) / 1024, "psnr_db": psnr(frames, mp4)}


def run(args: argparse.Namespace) -> int:
    from onepiece.stage.wan.functions import X264_OPTIONS, stream_mp4

    shapes = args.shapes
    stream_mp4([synthetic(16, 16, 1)], 16)  # loads PyAV and x264 once, outside every timing
    rows = []
    for w, h, f in shapes:
        frames = synthetic(w, h, f)
        for name, options in SETTINGS.items():
            rows.append({"shape": f"{w}x{h}x{f}", "setting": name, "options": options or X264_OPTIONS,
                         **measure(frames, options, args.repeats)})
    doc = {"bench": "mp4", "when": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "repeats": args.repeats,
           "rows": rows}
    md = [f"`onepiece bench mp4` — {doc['when']}, {cpu_name()}; median of {args.repeats}", "",
          "| shape | x264 setting | CPU ms | wall ms | KiB | PSNR dB | CPU vs shipped |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        shipped = next(x for x in rows if x["shape"] == r["shape"] and x["setting"] == "shipped")
        md.append(f"| {r['shape']} | {r['setting']} | {r['cpu_ms']:.1f} | {r['wall_ms']:.1f} | {r['kib']:.1f} "
                  f"| {r['psnr_db']:.2f} | {r['cpu_ms'] / shipped['cpu_ms']:.2f}× |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mp4.json").write_text(json.dumps(doc, indent=1))
    (out / "mp4.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0
