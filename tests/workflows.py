"""The smallest workflow the config accepts: one T2V application on one model (what tests of
model folders need; a workflow must name real stage functions, in order)."""

from __future__ import annotations

from typing import Any


def t2v_only(models: dict[str, Any], model: str) -> dict[str, Any]:
    """A workflow document: ``models``, and text_encode, denoise and vae_decode on ``model``."""
    return {
        "models": models,
        "stages": {"text_encode": {"model": model, "components": ["text_encoder", "tokenizer"]},
                   "denoise": {"model": model, "components": ["transformer", "scheduler"]},
                   "vae_decode": {"model": model, "components": ["vae"]}},
        "applications": {"t2v": {"stages": ["text_encode", "denoise", "vae_decode"]}},
    }
