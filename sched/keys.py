"""How requests are named by shape: the vocabulary stages, the NM, the proxy and the simulator
share.

- ``shape_key``: what a whole request costs depends on (``WxHxFRAMES:STEPS``), for service
  times and the monitor;
- ``compat_key``: what a denoising step's tensors require; requests with the same key can share
  one forward pass whatever their step counts, step indices, seeds, prompts or guidance scales.
  Model, dtype and device are fixed per stage, so the key carries the rest: the latent shape
  (from width, height, frames), classifier-free guidance on or off, and the text length;
- ``call_key``: what a one-step call (text or VAE encoding, VAE decoding) costs depends on.
"""

from __future__ import annotations

import re
from typing import Any

_SHAPE = re.compile(r"^(\d+)x(\d+)x(\d+)")


def shape_key(params: dict[str, Any]) -> str:
    """``WxHxFRAMES:STEPS``."""
    return f"{params.get('width')}x{params.get('height')}x{params.get('num_frames')}:{params.get('steps')}"


def call_key(params: dict[str, Any]) -> str:
    """``WxHxFRAMES``: a one-step call's cost does not depend on a step count."""
    return f"{params.get('width')}x{params.get('height')}x{params.get('num_frames')}"


def compat_key(params: dict[str, Any]) -> str:
    """``WxHxFRAMES/cfg|nocfg/L<text length>``."""
    try:
        cfg = float(params.get("guidance", 0.0)) > 1.0
    except (TypeError, ValueError):
        cfg = False
    return f"{call_key(params)}/{'cfg' if cfg else 'nocfg'}/L{params.get('max_sequence_length')}"


def volume(key: str) -> int | None:
    """Pixels times frames of a key's shape (what a step's work grows with), None if unparsable."""
    m = _SHAPE.match(key)
    return int(m.group(1)) * int(m.group(2)) * int(m.group(3)) if m else None


def variant(key: str) -> str:
    """What a key says beyond its shape (``/cfg/L64``): keys compared by volume must agree on it."""
    m = _SHAPE.match(key)
    return key[m.end():] if m else key


def at_dop(key: str, dop: int) -> str:
    """The cost key of ``key``'s steps run by ``dop`` ranks together (``…@2``); DoP 1 is the
    key itself. Its variant carries the DoP, so costs scale by volume only within one DoP."""
    return key if dop == 1 else f"{key}@{dop}"


def split_dop(key: str) -> tuple[str, int]:
    """``at_dop``'s inverse: (the key, its DoP)."""
    base, _, d = key.partition("@")
    return base, int(d) if d.isdigit() else 1
