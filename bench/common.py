"""Helpers shared by the benchmarks: the tiny models, a one-set t2v deployment, percentiles."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

PROMPT = "a cat surfing a wave"
T2V_STAGES = {"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1}


def tiny_models(base: Path, profile: str = "tiny") -> dict[str, Path]:
    """The random-weight Wan2.1 pipelines (seed 0) of ``profile`` under ``base``, built where
    missing: {"t2v": dir, "i2v": dir} (the workflow names both, so both must exist)."""
    from onepiece.stage.loader import is_built
    from onepiece.stage.wan.tiny import build_tiny

    out = {}
    for kind in ("t2v", "i2v"):
        path = Path(base) / f"wan2.1-{kind}-{profile}"
        try:  # a folder it cannot write, or one holding something else: one line, not a traceback
            out[kind] = path if is_built(path) else build_tiny(kind, path, 0, overwrite=False, profile=profile)
        except OSError as e:
            where = f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)
            raise SystemExit(f"onepiece bench: cannot build the tiny models under {base}: {where}") from None
    return out


def model_dirs(base: Path | None, profile: str) -> dict[str, Path]:
    """``tiny_models`` under ``base``, or where `onepiece models build` puts them."""
    return tiny_models(base or Path("~/.cache/onepiece/models").expanduser(), profile)


def parse_shape(item: str) -> tuple[int, int, int, int]:
    """``WxHxFRAMES:STEPS`` -> (w, h, frames, steps), checked as the proxy checks a request
    (proxy/validation.py) against the shipped workflows' limits: a shape no deployment serves is
    refused as the flag is read, not after one started (ArgumentTypeError, for argparse)."""
    from onepiece.config import Limits

    lim = Limits()  # wan21.yaml and wan21-scale.yaml, what the benchmarks deploy, keep these defaults
    try:
        size, steps = item.split(":")
        w, h, f = (int(x) for x in size.lower().split("x"))
        s = int(steps)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad shape {item!r}: expected WxHxFRAMES:STEPS, e.g. 64x64x9:10") from None
    if not (0 < w <= lim.max_width and 0 < h <= lim.max_height) or w % 16 or h % 16:
        raise argparse.ArgumentTypeError(f"bad shape {item!r}: width and height must be multiples of 16 from 16 "
                                         f"to {lim.max_width}x{lim.max_height}")
    if not 1 <= f <= lim.max_frames or (f - 1) % 4:
        raise argparse.ArgumentTypeError(f"bad shape {item!r}: frames must be 4k+1 (1, 5, 9, ...) up to "
                                         f"{lim.max_frames}")
    if not 1 <= s <= lim.max_steps:
        raise argparse.ArgumentTypeError(f"bad shape {item!r}: steps must be between 1 and {lim.max_steps}")
    return w, h, f, s


def shape_flag(value: str) -> str:
    """An argparse type: one ``WxHxFRAMES:STEPS`` (``parse_shape``), kept as written (the results
    name it so)."""
    parse_shape(value)
    return value


def shapes_flag(value: str) -> str:
    """An argparse type: comma-separated ``WxHxFRAMES:STEPS``, each checked; kept as written."""
    for item in value.split(","):
        parse_shape(item.strip())
    return value


# torch's thread pools: `bench shares --threads 100000` crashed it (a segfault), and no machine
# the benchmarks run on has more cores than this.
MAX_THREADS = 1024


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default); None if empty."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def cpu_name() -> str:
    """The processor's model name (/proc/cpuinfo), else what the platform module says."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def save_report(out: Path, name: str, doc: dict, text: str) -> None:
    """``name``.json (``doc``) and ``name``.md (``text``) under ``out``, made if missing; the
    markdown printed, then where both went."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{name}.md").write_text(text + "\n")
    print(text)
    print(f"saved {out / name}.json and {name}.md")
