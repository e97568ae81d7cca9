"""Helpers shared by the benchmarks: the tiny models, a one-set t2v deployment, percentiles."""

from __future__ import annotations

import math
from pathlib import Path

PROMPT = "a cat surfing a wave"
T2V_STAGES = {"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1}


def tiny_models(base: Path, profile: str = "tiny") -> dict[str, Path]:
    """The random-weight Wan2.1 pipelines (seed 0) of ``profile`` under ``base``, built where
    missing: {"t2v": dir, "i2v": dir} (the workflow names both, so both must exist)."""
    from onepiece.stage.wan.tiny import build_tiny

    out = {}
    for kind in ("t2v", "i2v"):
        path = Path(base) / f"wan2.1-{kind}-{profile}"
        out[kind] = path if (path / "model_index.json").exists() else build_tiny(kind, path, 0, profile=profile)
    return out


def model_dirs(base: Path | None, profile: str) -> dict[str, Path]:
    """``tiny_models`` under ``base``, or where `onepiece models build` puts them."""
    return tiny_models(base or Path("~/.cache/onepiece/models").expanduser(), profile)


def parse_shape(item: str) -> tuple[int, int, int, int]:
    """``WxHxFRAMES:STEPS`` -> (w, h, frames, steps)."""
    try:
        size, steps = item.split(":")
        w, h, f = (int(x) for x in size.lower().split("x"))
        return w, h, f, int(steps)
    except ValueError:
        raise SystemExit(f"bad shape {item!r}: expected WxHxFRAMES:STEPS, e.g. 64x64x9:10") from None


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
