"""Load the components a stage needs from a diffusers pipeline directory (DESIGN §6).

A stage loads only its own components (e.g. just the VAE), each with its library's own
``from_pretrained``, as ``DiffusionPipeline.from_pretrained`` would, but without building the
whole pipeline.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

# model_index.json names a library per component; only these are imported, so a model
# directory cannot make a stage import arbitrary modules.
_LIBRARIES = ("diffusers", "transformers")


def is_built(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a diffusers pipeline (its model_index.json exists)."""
    return (Path(model_dir) / "model_index.json").is_file()


def read_index(model_dir: Path) -> dict[str, Any]:
    """The pipeline's model_index.json, or ValueError saying what is wrong."""
    model_dir = Path(model_dir)
    index_path = model_dir / "model_index.json"
    if not model_dir.is_dir():
        raise ValueError(f"model directory {model_dir} does not exist")
    if not index_path.is_file():
        raise ValueError(f"{model_dir}: no model_index.json (not a diffusers pipeline directory)")
    try:
        index = json.loads(index_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{index_path}: cannot read: {e}") from None
    if not isinstance(index, dict):
        raise ValueError(f"{index_path}: expected a JSON object")
    return index


def default_dtype(cls: type, device: str) -> torch.dtype:
    # float32 on CPU (bf16 matmuls are slow there, and it keeps the split bit-comparable with the
    # monolithic pipeline). On accelerators, bf16 as the Wan2.1 model cards recommend, except the
    # VAE, which they keep in float32.
    if torch.device(device).type == "cpu" or cls.__name__.startswith("AutoencoderKL"):
        return torch.float32
    return torch.bfloat16


def load_components(
    model_dir: Path, components: list[str], device: str = "cpu", *, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """Load the named components of the pipeline in ``model_dir``.

    Each model_index.json entry is ``[library, class_name]``; the class comes from that library
    and loads with its own ``from_pretrained(model_dir / name)``. Torch modules are put in eval
    mode on ``device``, in ``dtype`` (default: float32 on CPU, see ``default_dtype``).
    Raises ValueError naming the directory and the component when something is missing.
    """
    model_dir = Path(model_dir)
    index = read_index(model_dir)
    out: dict[str, Any] = {}
    for name in components:
        entry = index.get(name)
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or None in entry:
            known = sorted(k for k, v in index.items() if isinstance(v, list) and len(v) == 2 and None not in v)
            raise ValueError(f"{model_dir}: no component {name!r} in model_index.json (has: {known})")
        library, class_name = entry
        if library not in _LIBRARIES:
            raise ValueError(f"{model_dir}: component {name!r} comes from unsupported library {library!r}")
        sub = model_dir / name
        if not sub.is_dir():
            raise ValueError(f"{model_dir}: component {name!r} is listed but its directory {sub} is missing")
        try:
            cls = getattr(importlib.import_module(library), class_name)
        except AttributeError:
            raise ValueError(f"{model_dir}: component {name!r}: {library} has no class {class_name!r}") from None

        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            want = dtype or default_dtype(cls, device)
            # diffusers models take torch_dtype; transformers 5 models take dtype.
            kw = {"torch_dtype": want} if library == "diffusers" else {"dtype": want}
            obj = cls.from_pretrained(sub, **kw)
            obj = obj.to(device).eval()
        else:  # tokenizer, image processor, scheduler: no weights, no device
            obj = cls.from_pretrained(sub)
        out[name] = obj
    return out
