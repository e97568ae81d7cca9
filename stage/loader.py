"""Load the components a stage needs from a diffusers pipeline directory (DESIGN §6).

A stage loads only its own components (e.g. just the VAE), each with its library's own
``from_pretrained``, as ``DiffusionPipeline.from_pretrained`` would, but without building the
whole pipeline.
"""

from __future__ import annotations

import importlib
import json
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

# model_index.json names a library per component; only these are imported, so a model
# directory cannot make a stage import arbitrary modules.
_LIBRARIES = ("diffusers", "transformers")


def is_built(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a complete diffusers pipeline (see ``model_problems``)."""
    return not model_problems(model_dir)


def _entry_ok(entry: Any) -> bool:
    return isinstance(entry, list) and len(entry) == 2 and None not in entry


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with the safetensors file ``path``, or None when it is whole.

    Reads the header only: 8 bytes of little-endian header length N, N bytes of JSON whose
    tensors have "data_offsets": [begin, end], then the data, so the file must be exactly
    8 + N + max(end) bytes. A truncated copy or an interrupted download fails this, where
    loading it would fail later, in a worker, without naming the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path}: {size} bytes, shorter than a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return f"{path}: truncated ({size} bytes, its header alone says {8 + n})"
            header = json.loads(f.read(n))
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except OSError as e:
        return f"{path}: cannot read: {e.strerror or e}"
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:  # bad JSON or entries
        return f"{path}: not a valid safetensors header ({type(e).__name__}: {e})"
    if size != 8 + n + end:
        return f"{path}: {'truncated' if size < 8 + n + end else 'longer than its header says'} " \
               f"({size} bytes, its header says {8 + n + end})"
    return None


def component_problem(model_dir: Path, name: str) -> str | None:
    """What keeps component ``name`` of ``model_dir`` from loading, as far as files can tell
    without loading weights: its directory, the shards its *.safetensors.index.json names, and
    that every *.safetensors file in it is whole. None when it looks complete."""
    sub = Path(model_dir) / name
    if not sub.is_dir():
        return f"component {name!r}: its directory {sub} is missing"
    for index in sorted(sub.glob("*.safetensors.index.json")):  # sharded weights (real models)
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"component {name!r}: {index}: cannot read its weight map ({type(e).__name__})"
        missing = sorted(s for s in shards if not (sub / s).is_file())
        if missing:
            return f"component {name!r}: {index.name} names missing shards {missing}"
    for f in sorted(sub.glob("*.safetensors")):
        if why := safetensors_problem(f):
            return f"component {name!r}: {why}"
    return None


def model_problems(model_dir: Path, components: Iterable[str] | None = None) -> list[str]:
    """Why ``model_dir`` is not a complete pipeline, one line each; empty when it is.

    Checks ``components`` (default: every one model_index.json names) with
    ``component_problem``: cheap (headers only), so `models list`/`build` and a starting
    deployment can tell a broken copy from a good one before a worker fails to load it."""
    try:
        index = read_index(model_dir)
    except ValueError as e:
        return [str(e)]
    names = [k for k, v in index.items() if not k.startswith("_") and _entry_ok(v)] if components is None \
        else list(components)
    out = []
    for name in names:
        if name.startswith("_") or not _entry_ok(index.get(name)):
            known = sorted(k for k, v in index.items() if not k.startswith("_") and _entry_ok(v))
            out.append(f"no component {name!r} in model_index.json (has: {known})")
        elif why := component_problem(model_dir, name):
            out.append(why)
    return out


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
        if name.startswith("_") or not _entry_ok(entry):
            known = sorted(k for k, v in index.items() if not k.startswith("_") and _entry_ok(v))
            raise ValueError(f"{model_dir}: no component {name!r} in model_index.json (has: {known})")
        library, class_name = entry
        if library not in _LIBRARIES:
            raise ValueError(f"{model_dir}: component {name!r} comes from unsupported library {library!r}")
        sub = model_dir / name
        # A missing directory or a truncated weights file: say which, not a loader's own error.
        if why := component_problem(model_dir, name):
            raise ValueError(f"{model_dir}: {why}")
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
