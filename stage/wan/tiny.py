"""Tiny random-weight Wan2.1 pipelines, built locally with the real classes (DESIGN §6).

They let the whole system run and be tested on a CPU with no download: the same diffusers /
transformers classes as Wan2.1-T2V / Wan2.1-I2V, just small. Two size profiles:

- ``tiny`` (the default): a few thousand parameters each, sized as diffusers' own Wan pipeline
  tests; fast enough for every test, but its stage costs are upside down (the VAE decode costs
  more than the whole denoising loop);
- ``scale``: the same VAE and image encoder, with a deeper transformer and a larger text
  encoder, so that the stages' shares of a request's standalone time match real Wan2.1 serving
  at the benchmark shapes (denoising about 89%, text encoding about 6%, VAE decode about 5%;
  the README says where those shares come from). Schedulers and benchmarks are judged on it.
  The transformer is deep and narrow: like a GPU at small shapes, a step is dominated by
  per-layer work that does not grow with the batch, which is what batching recovers.

The text encoder, tokenizer and VAE of the t2v and i2v builds of one profile are identical for
the same seed: the shared stages (text_encode, vae_decode) load them from the t2v directory and
also serve i2v requests, which must match the monolithic i2v pipeline.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from onepiece.config import Workflow

# Each component is initialised under its own seed (seed + offset), so that a component's
# weights do not depend on what else is built or in which order: this is what makes the shared
# components of the t2v and i2v builds identical.
_OFFSETS = {"vae": 0, "text_encoder": 1, "transformer_t2v": 2, "transformer_i2v": 3, "image_encoder": 4}

IMAGE_DIM = 16  # CLIP hidden_size == the i2v transformer's image_dim
PROFILES = ("tiny", "scale")
# The real Wan2.1 architectures with random weights: T2V-1.3B (UMT5-XXL encoder, the 1.3B
# transformer, the Wan VAE) and I2V-14B-480P (the same encoder and VAE, CLIP ViT-H/14, the 14B
# transformer). Built in memory on a device to time real-size stages (`onepiece bench shares`),
# never saved (7 and 23 B parameters: 14 and 46 GB in bfloat16).
REAL = "wan2.1"
# Per size: the UMT5 text encoder and the transformer (its text_dim is the encoder's d_model).
_TEXT = {
    "tiny": dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                 relative_attention_num_buckets=8, relative_attention_max_distance=16),
    "scale": dict(d_model=256, d_kv=32, d_ff=1024, num_layers=8, num_heads=8,
                  relative_attention_num_buckets=8, relative_attention_max_distance=16),
    REAL: dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, vocab_size=256384,
               feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
               relative_attention_max_distance=128),
}
_TRANSFORMER = {
    "tiny": dict(num_attention_heads=2, attention_head_dim=12, ffn_dim=32, num_layers=2, rope_max_seq_len=32),
    "scale": dict(num_attention_heads=4, attention_head_dim=16, ffn_dim=256, num_layers=24, rope_max_seq_len=32),
    REAL: dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30, rope_max_seq_len=1024,
               eps=1e-6),
}
# Wan2.1-I2V exists at 14B only; its image context comes from CLIP ViT-H/14's 1280 features.
_REAL_I2V = dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40, rope_max_seq_len=1024,
                 eps=1e-6, added_kv_proj_dim=5120)
_IMAGE = {"small": dict(hidden_size=IMAGE_DIM, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        image_size=32, patch_size=4),
          REAL: dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                     image_size=224, patch_size=14)}
# Both built profiles share one small VAE; the real size is diffusers' default (the Wan2.1 VAE).
_SMALL_VAE = dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
_VAE = {"tiny": _SMALL_VAE, "scale": _SMALL_VAE, REAL: {}}


def _vae(seed: int, profile: str = "tiny"):
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + _OFFSETS["vae"])
        return AutoencoderKLWan(**_VAE[profile]).eval()


def _text(seed: int, profile: str):
    from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    # A byte-level tokenizer needs no vocabulary file, so nothing is downloaded; the encoder's
    # vocabulary covers all of its ids (256 bytes + 3 specials + 125 extra ids). The real size
    # keeps umt5-xxl's vocabulary (its embedding is about a fifth of the encoder).
    tokenizer = ByT5Tokenizer()
    config = UMT5Config(
        **{"vocab_size": len(tokenizer), **_TEXT[profile]},
        dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + _OFFSETS["text_encoder"])
        encoder = UMT5EncoderModel(config).eval()
    return tokenizer, encoder


def _transformer(seed: int, kind: str, profile: str):
    from diffusers import WanTransformer3DModel

    if kind == "t2v":
        config = {**_TRANSFORMER[profile], "in_channels": 16}
    elif profile == REAL:
        config = {**_REAL_I2V, "in_channels": 36, "image_dim": _IMAGE[REAL]["hidden_size"]}
    else:
        config = {**_TRANSFORMER[profile], "in_channels": 36, "image_dim": IMAGE_DIM}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + _OFFSETS[f"transformer_{kind}"])
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            **config,
            out_channels=16,
            text_dim=_TEXT[profile]["d_model"],
            freq_dim=256,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
        ).eval()


def _image(seed: int, profile: str = "tiny"):
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(**_IMAGE[REAL if profile == REAL else "small"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + _OFFSETS["image_encoder"])
        encoder = CLIPVisionModel(config).eval()
    side = config.image_size
    processor = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return encoder, processor


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # What diffusers' Wan pipeline tests use; real Wan2.1 repos ship UniPCMultistepScheduler
    # (flow_prediction, use_flow_sigmas, flow_shift), which the stage functions handle the same way.
    return FlowMatchEulerDiscreteScheduler(shift=7.0)


def _pipeline(kind: str, seed: int, profile: str):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    tokenizer, text_encoder = _text(seed, profile)
    common = dict(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=_vae(seed, profile),
        scheduler=_scheduler(),
        transformer=_transformer(seed, kind, profile),
    )
    if kind == "t2v":
        return WanPipeline(**common)
    image_encoder, image_processor = _image(seed, profile)
    return WanImageToVideoPipeline(**common, image_encoder=image_encoder, image_processor=image_processor)


def components(kind: Literal["t2v", "i2v"], size: str, device: str = "cpu", seed: int = 0) -> dict:
    """The ``kind`` pipeline's components of ``size`` (a profile or ``REAL``) built in memory on
    ``device``, in the dtypes a worker loads them in there (``stage.loader``'s rule: on a GPU
    bfloat16, the VAE in float32). Each is cast as it is built, so that the real I2V's float32
    weights are never all on the device at once."""
    from onepiece.stage.loader import default_dtype

    def cast(m: torch.nn.Module) -> torch.nn.Module:
        return _cast(m, default_dtype(type(m), device))

    with torch.device(device):  # random init on the device: the real sizes' billions of parameters
        tokenizer, text_encoder = _text(seed, size)
        out = {"tokenizer": tokenizer, "text_encoder": cast(text_encoder), "vae": cast(_vae(seed, size)),
               "transformer": cast(_transformer(seed, kind, size)), "scheduler": _scheduler()}
        if kind == "i2v":
            image_encoder, out["image_processor"] = _image(seed, size)
            out["image_encoder"] = cast(image_encoder)
        return out


def _cast(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` in ``dtype`` except what ``from_pretrained(..., torch_dtype=dtype)`` keeps in
    float32: a diffusers model's ``_keep_in_fp32_modules`` (Wan's norms, time embedding and
    rotary tables); a transformers model's only in float16, its ``_strict`` ones in bfloat16 too."""
    from diffusers import ModelMixin

    if model.dtype == dtype:
        return model
    model.to(dtype)
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if isinstance(model, ModelMixin) or dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if keep & set(name.split(".")):
            t.data = t.data.float()
    return model


# Written into every directory build_tiny makes: it may replace those, never anything else
# (e.g. real weights someone pointed a model path at).
MARKER = "onepiece-tiny.json"


# The temporary folders build_tiny makes beside ``path``: ``.{name}.building-*`` (the new build)
# and ``.{name}.old-*`` (the build it replaces). A killed build leaves them; a later build of the
# same path removes those that nothing has written to for STALE_S. By age, not by the builder's
# pid: the models folder may be shared by hosts or containers whose pids mean nothing here, and a
# live build writes into its folder within seconds of making it.
BUILDING, ASIDE = "building", "old"
STALE_S = 3600.0


def remove_stale(path: Path, now: float | None = None, stale_s: float = STALE_S) -> list[Path]:
    """Remove the temporary folders of killed builds of ``path``; return those removed."""
    now = time.time() if now is None else now
    removed = []
    try:
        entries = list(Path(path).parent.iterdir())
    except OSError:
        return removed
    prefixes = tuple(f".{Path(path).name}.{tag}-" for tag in (BUILDING, ASIDE))
    for d in entries:
        if d.name.startswith(prefixes) and d.is_dir() and not d.is_symlink() and now - _last_write(d) > stale_s:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _last_write(root: Path) -> float:
    """The latest mtime of ``root`` and anything in it (a build writes files deep in it)."""
    latest = 0.0
    for d, _dirs, files in os.walk(root):
        for p in (d, *(os.path.join(d, f) for f in files)):
            try:
                latest = max(latest, os.lstat(p).st_mtime)
            except OSError:  # removed meanwhile
                pass
    return latest


def _umask_modes(root: Path) -> None:
    """Give ``root``'s folders and files the modes the umask gives (MARKER's, just written, with
    x on folders): not mkdtemp's 0700 nor the 0600 the weights are saved with, which no other
    user could read (so a models folder could not be shared)."""
    file_mode = (root / MARKER).stat().st_mode & 0o666
    dir_mode = file_mode | (file_mode & 0o444) >> 2
    for d, _dirs, files in os.walk(root):
        os.chmod(d, dir_mode)
        for f in files:
            os.chmod(os.path.join(d, f), file_mode)


def build_tiny(kind: Literal["t2v", "i2v"], path: Path, seed: int = 0, *, overwrite: bool = True,
               profile: str = "tiny") -> Path:
    """Build a small random-weight Wan2.1 ``kind`` pipeline of size ``profile`` at ``path``
    and return the path.

    Deterministic: the same seed gives byte-identical files. The directory appears atomically
    (built beside ``path``, then renamed), so a half-built one is never mistaken for a model.
    An existing tiny build (one with ``MARKER``) is replaced when ``overwrite`` or incomplete
    (``loader.model_problems``), else returned as is; any other non-empty ``path`` (real weights,
    unrelated files) raises FileExistsError. Folders and files get the umask's modes.
    """
    if kind not in ("t2v", "i2v"):
        raise ValueError(f"tiny pipeline kind must be 't2v' or 'i2v', got {kind!r}")
    if profile not in PROFILES:
        raise ValueError(f"model profile must be one of {PROFILES}, got {profile!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path)
    if path.exists() and any(path.iterdir()):
        from onepiece.stage.loader import model_problems

        problems = model_problems(path)
        if not problems and not overwrite:
            return path
        if not (path / MARKER).is_file():  # not ours: never replaced, even when broken
            if not (path / "model_index.json").is_file():
                what = "not empty and not a diffusers pipeline"
            elif problems:
                what = f"an incomplete pipeline not built by build_tiny ({problems[0]}); remove or repair it"
            else:
                what = "a pipeline not built by build_tiny"
            raise FileExistsError(f"{path}: {what}; refusing to build a tiny model there")
        # Our own tiny build: replaced when asked to, or when broken (a truncated copy, a lost file).

    pipe = _pipeline(kind, seed, profile)  # before the temp folder: it is written to from the start
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{BUILDING}-", dir=path.parent))
    aside: Path | None = None
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        (tmp / MARKER).write_text(json.dumps({"kind": kind, "seed": seed, "profile": profile}, sort_keys=True) + "\n")
        _umask_modes(tmp)
        try:
            if path.exists() and any(path.iterdir()):
                # Replacing an older tiny build: move it aside first (rename cannot replace a
                # non-empty directory), then swap the new one in.
                aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.{ASIDE}-", dir=path.parent))
                os.rename(path, aside / "old")
            elif path.exists():
                path.rmdir()
            os.rename(tmp, path)
        except OSError:
            if (path / "model_index.json").is_file():
                return path  # lost a race with another builder: theirs is as good as ours
            if aside is not None and (aside / "old").exists() and not path.exists():
                os.rename(aside / "old", path)  # put the previous build back
            raise
    finally:
        for leftover in (tmp, aside):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
    return path


def ensure_models(workflow: "Workflow", base_dir: Path) -> list[Path]:
    """Build the tiny pipelines a workflow asks for whose directories are not built yet or broken.

    ``base_dir`` resolves relative model paths (the workflow file's directory). Returns the
    paths that were built (empty when everything was already there).
    """
    from onepiece.stage.loader import is_built

    built: list[Path] = []
    for name, spec in workflow.models.items():
        if spec.tiny is None:
            continue
        path = workflow.model_path(name, Path(base_dir))
        if not is_built(path):  # never replace a concurrent build
            build_tiny(spec.tiny, path, spec.seed, overwrite=False, profile=spec.profile)
            built.append(path)
    return built
