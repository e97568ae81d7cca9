"""The Wan2.1 T2V / I2V pipelines of diffusers, split into stage functions (DESIGN §6).

Each function mirrors the corresponding part of ``WanPipeline.__call__`` /
``WanImageToVideoPipeline.__call__`` (diffusers 0.42.1) so that the split pipeline gives the
same output as the monolithic one for the same seed. Parts (payload names) per stage:

=============  ======  ==============================================  =====================================
stage          kinds   consumes                                        produces (plus pass-through)
=============  ======  ==============================================  =====================================
text_encode    both    params (prompt, negative_prompt, guidance,      prompt_embeds, negative_prompt_embeds
                       max_sequence_length)                            (only when guidance > 1)
image_encode   i2v     image (uint8 HxWx3 RGB)                         image_embeds
vae_encode     i2v     image, params (width, height, num_frames)       condition (mask + image latents);
                                                                       drops image
denoise        both    prompt_embeds, negative_prompt_embeds,          latents (only)
                       [i2v: image_embeds, condition], params
                       (width, height, num_frames, steps, guidance,
                       seed)
vae_decode     both    latents, params (fps)                           content (MP4 bytes, only)
=============  ======  ==============================================  =====================================

Every function returns all the parts later stages need: the runtime forwards exactly what is
returned. Inputs are read-only buffers: nothing here writes into them.
"""

from __future__ import annotations

import copy
import io
import json
import weakref
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from onepiece.config import MAX_IMAGE_ASPECT, MAX_IMAGE_PIXELS
from onepiece.stage.registry import Parts, StageContext, SteppedTask, stage_function
from onepiece.stage.wan.parallel import ParallelDenoiser
from onepiece.transport.message import Message

# Pipeline fallbacks (WanPipeline.__init__ uses these when it has no VAE).
_DEFAULT_SCALE_TEMPORAL = 4
_DEFAULT_SCALE_SPATIAL = 8


# --------------------------------------------------------------------------------------- helpers


def _params(msg: Message) -> dict[str, Any]:
    params = msg.header.get("params")
    if not isinstance(params, dict):
        raise ValueError("message header has no 'params' object")
    return params


def _param(params: dict[str, Any], key: str, typ: type) -> Any:
    if key not in params or params[key] is None:
        raise ValueError(f"missing parameter {key!r}")
    try:
        return typ(params[key])
    except (TypeError, ValueError):
        raise ValueError(f"parameter {key!r} must be {typ.__name__}, got {params[key]!r}") from None


def _component(ctx: StageContext, name: str) -> Any:
    try:
        return ctx.components[name]
    except KeyError:
        raise ValueError(f"stage has no component {name!r} loaded (has: {sorted(ctx.components)})") from None


# A loaded component's device and dtype, read once: diffusers and transformers derive both by
# walking the module tree (0.1 to 0.8 ms a read on the tiny models, some 25 reads a 64x64x9
# request before; WanPipeline reads them once a call). A stage never moves or casts its
# components after loading them.
_placements: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[torch.device, torch.dtype]]" = \
    weakref.WeakKeyDictionary()


def _placement(module: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    got = _placements.get(module)
    if got is None:
        from diffusers.utils.torch_utils import get_module_execution_device

        got = _placements[module] = (get_module_execution_device(module), module.dtype)
    return got


def _module_device(module: torch.nn.Module) -> torch.device:
    return _placement(module)[0]


def _dtype(module: torch.nn.Module) -> torch.dtype:
    return _placement(module)[1]


def _shape(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else tuple(t.shape)


def _input(msg: Message, name: str, device: torch.device) -> torch.Tensor:
    """Tensor part ``name`` on ``device`` (moved once; may alias the read-only received buffer)."""
    if name not in msg.parts:
        raise ValueError(f"missing input part {name!r} (message has: {sorted(msg.parts)})")
    return msg.tensor(name).to(device)


def _image(msg: Message):
    """Part ``image`` (uint8 HxWx3 RGB) as the PIL image the pipeline would be given."""
    from PIL import Image

    if "image" not in msg.parts:
        raise ValueError(f"missing input part 'image' (message has: {sorted(msg.parts)})")
    part = msg.parts["image"]
    arr = part.numpy() if isinstance(part, torch.Tensor) else part
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        desc = f"{arr.dtype} {list(arr.shape)}" if isinstance(arr, np.ndarray) else type(arr).__name__
        raise ValueError(f"part 'image' must be a uint8 HxWx3 RGB array, got {desc}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError("part 'image' is empty")
    # the proxy's bounds, for what reaches a stage by any path
    if arr.shape[0] * arr.shape[1] > MAX_IMAGE_PIXELS:
        raise ValueError(f"part 'image' has {arr.shape[0]}x{arr.shape[1]} pixels, more than {MAX_IMAGE_PIXELS}")
    if max(arr.shape[:2]) > MAX_IMAGE_ASPECT * min(arr.shape[:2]):
        raise ValueError(f"part 'image' is {arr.shape[1]}x{arr.shape[0]}: its sides differ more than "
                         f"{MAX_IMAGE_ASPECT}:1")
    return Image.fromarray(np.ascontiguousarray(arr), mode="RGB")


def _passthrough(msg: Message, drop: tuple[str, ...] = ()) -> Parts:
    return {k: v for k, v in msg.parts.items() if k not in drop}


def _vae_scales(ctx: StageContext) -> tuple[int, int]:
    """(temporal, spatial) VAE scale factors, as the pipeline reads them from ``vae.config``.

    The denoise stage has no VAE loaded; it reads the VAE config beside its transformer (the
    same pipeline directory), else falls back to the pipeline's own defaults.
    """
    vae = ctx.components.get("vae")
    if vae is not None:
        return int(vae.config.scale_factor_temporal), int(vae.config.scale_factor_spatial)
    transformer = ctx.components.get("transformer")
    origin = getattr(getattr(transformer, "config", None), "_name_or_path", None)
    if origin:
        cfg_path = Path(origin).parent / "vae" / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text())
            return (
                int(cfg.get("scale_factor_temporal", _DEFAULT_SCALE_TEMPORAL)),
                int(cfg.get("scale_factor_spatial", _DEFAULT_SCALE_SPATIAL)),
            )
        except (OSError, ValueError):
            pass
    return _DEFAULT_SCALE_TEMPORAL, _DEFAULT_SCALE_SPATIAL


def _geometry(
    params: dict[str, Any], temporal: int, spatial: int, patch: tuple[int, ...] | None = None
) -> tuple[int, int, int]:
    """(height, width, num_frames) after the pipeline's own checks and adjustments."""
    height = _param(params, "height", int)
    width = _param(params, "width", int)
    num_frames = _param(params, "num_frames", int)
    if height <= 0 or width <= 0 or num_frames <= 0:
        raise ValueError(f"height, width and num_frames must be positive, got {height}, {width}, {num_frames}")
    # check_inputs
    if height % 16 != 0 or width % 16 != 0:
        raise ValueError(f"height and width have to be divisible by 16 but are {height} and {width}")
    # __call__: num_frames - 1 must be a multiple of the temporal factor (rounded, as the pipeline does)
    if num_frames % temporal != 1:
        num_frames = num_frames // temporal * temporal + 1
    num_frames = max(num_frames, 1)
    if patch is not None:
        h_mult, w_mult = spatial * patch[1], spatial * patch[2]
        height, width = height // h_mult * h_mult, width // w_mult * w_mult
    return height, width, num_frames


def _latents_norm(vae: Any, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents_mean, 1 / latents_std) shaped for broadcasting, as in the pipelines."""
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(device, dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(device, dtype)
    return mean, inv_std


# --------------------------------------------------------------------------------- text_encode


def _t5_embeds(text_encoder: Any, tokenizer: Any, prompt: str, max_len: int) -> torch.Tensor:
    """WanPipeline._get_t5_prompt_embeds for one prompt, one video."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    device = _module_device(text_encoder)
    inputs = tokenizer(
        [prompt_clean(prompt)],
        padding="max_length",
        max_length=max_len,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    ids, mask = inputs.input_ids, inputs.attention_mask
    seq_lens = mask.gt(0).sum(dim=1).long()
    embeds = text_encoder(ids.to(device), mask.to(device)).last_hidden_state
    embeds = embeds.to(dtype=_dtype(text_encoder), device=device)
    # Zero the padding positions, exactly as the pipeline does.
    embeds = [u[:v] for u, v in zip(embeds, seq_lens)]
    return torch.stack([torch.cat([u, u.new_zeros(max_len - u.size(0), u.size(1))]) for u in embeds], dim=0)


@stage_function("text_encode", "t2v")
@stage_function("text_encode", "i2v")
def text_encode(ctx: StageContext, msg: Message) -> Parts:
    params = _params(msg)
    prompt = params.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"parameter 'prompt' must be a string, got {type(prompt).__name__}")
    negative = params.get("negative_prompt") or ""
    if not isinstance(negative, str):
        raise ValueError(f"parameter 'negative_prompt' must be a string, got {type(negative).__name__}")
    max_len = _param(params, "max_sequence_length", int)
    guidance = _param(params, "guidance", float)
    text_encoder, tokenizer = _component(ctx, "text_encoder"), _component(ctx, "tokenizer")

    out = _passthrough(msg)
    with torch.inference_mode():
        out["prompt_embeds"] = _t5_embeds(text_encoder, tokenizer, prompt, max_len)
        if guidance > 1.0:  # do_classifier_free_guidance
            out["negative_prompt_embeds"] = _t5_embeds(text_encoder, tokenizer, negative, max_len)
        else:
            out.pop("negative_prompt_embeds", None)
    return out


# -------------------------------------------------------------------------------- image_encode


@stage_function("image_encode", "i2v")
def image_encode(ctx: StageContext, msg: Message) -> Parts:
    """WanImageToVideoPipeline.encode_image: CLIP penultimate hidden states."""
    image = _image(msg)
    encoder, processor = _component(ctx, "image_encoder"), _component(ctx, "image_processor")
    out = _passthrough(msg)
    with torch.inference_mode():
        pixels = processor(images=image, return_tensors="pt").to(_module_device(encoder))
        out["image_embeds"] = encoder(**pixels, output_hidden_states=True).hidden_states[-2]
    return out


# ---------------------------------------------------------------------------------- vae_encode


@stage_function("vae_encode", "i2v")
def vae_encode(ctx: StageContext, msg: Message) -> Parts:
    """The conditioning half of WanImageToVideoPipeline.prepare_latents (Wan2.1: no last image).

    Produces ``condition``: the first-frame mask (temporal-factor channels) concatenated with the
    normalised VAE latents of [image, zeros...], float32, shape (1, 4 + z_dim, F_lat, H/8, W/8).
    """
    from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents
    from diffusers.video_processor import VideoProcessor

    vae = _component(ctx, "vae")
    temporal, spatial = int(vae.config.scale_factor_temporal), int(vae.config.scale_factor_spatial)
    height, width, num_frames = _geometry(_params(msg), temporal, spatial)
    image = _image(msg)
    device = _module_device(vae)
    dtype = torch.float32  # the pipeline prepares latents in float32 whatever the model dtypes

    with torch.inference_mode():
        pixels = VideoProcessor(vae_scale_factor=spatial).preprocess(image, height=height, width=width)
        pixels = pixels.to(device, dtype=dtype).unsqueeze(2)  # [1, 3, 1, H, W]
        video_condition = torch.cat(
            [pixels, pixels.new_zeros(pixels.shape[0], pixels.shape[1], num_frames - 1, height, width)], dim=2
        ).to(device=device, dtype=_dtype(vae))
        latent = retrieve_latents(vae.encode(video_condition), sample_mode="argmax")
        latent = latent.to(device=device, dtype=dtype)
        mean, inv_std = _latents_norm(vae, device, dtype)
        latent = (latent - mean) * inv_std

        lat_h, lat_w = height // spatial, width // spatial
        mask = torch.ones(1, 1, num_frames, lat_h, lat_w)
        mask[:, :, list(range(1, num_frames))] = 0
        first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=temporal)
        mask = torch.concat([first, mask[:, :, 1:, :]], dim=2)
        mask = mask.view(1, -1, temporal, lat_h, lat_w).transpose(1, 2).to(latent.device)
        condition = torch.concat([mask, latent], dim=1)

    out = _passthrough(msg, drop=("image",))  # no later stage needs the pixels
    out["condition"] = condition
    return out


# ------------------------------------------------------------------------------------- denoise


class WanDenoise(SteppedTask):
    """The denoising loop of WanPipeline / WanImageToVideoPipeline as a request state: one
    step per ``step()``, or a step of several requests in one forward pass (``step_batch``).

    Classifier-free guidance runs the conditional and unconditional halves as one batch, not
    two calls. States batch when their tensors agree (``key``: application kind, latent and
    conditioning shapes, text length, CFG on or off, dtype, device); seeds, prompts, guidance
    scales, step counts and step indices may all differ. Each state owns a private copy of the
    diffusers scheduler: schedulers keep per-request state (step index, multistep history).
    """

    def __init__(
        self,
        *,
        kind: str,
        transformer: Any,
        scheduler: Any,
        latents: torch.Tensor,
        prompt_embeds: torch.Tensor,
        negative_prompt_embeds: torch.Tensor | None,
        guidance: float,
        steps: int,
        image_embeds: torch.Tensor | None = None,
        condition: torch.Tensor | None = None,
    ) -> None:
        self.kind = kind
        self.transformer = transformer
        self.scheduler = scheduler
        self.latents = latents
        self.prompt_embeds = prompt_embeds
        self.negative_prompt_embeds = negative_prompt_embeds
        self.guidance = guidance
        self.image_embeds = image_embeds
        self.condition = condition
        self.device = latents.device
        # Once, not at every step (a step read the dtype twice: 2 ms of a 64x64x9 request's
        # 13 ms of denoising).
        self.dtype = _dtype(transformer)
        self._key = (kind, id(transformer), _shape(latents), _shape(condition), _shape(prompt_embeds),
                    _shape(image_embeds), self.cfg, self.dtype, str(self.device))
        self.scheduler.set_timesteps(steps, device=self.device)
        self.timesteps = self.scheduler.timesteps
        if kind == "t2v":
            self.scheduler.set_begin_index(0)  # WanPipeline does; WanImageToVideoPipeline does not
        self.i = 0
        self.progress = 0.0

    @property
    def done(self) -> bool:
        return self.i >= len(self.timesteps)

    @property
    def cfg(self) -> bool:
        return self.guidance > 1.0

    @property
    def key(self) -> tuple:
        return self._key

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.latents, self.prompt_embeds,
                                                          self.negative_prompt_embeds, self.image_embeds,
                                                          self.condition) if t is not None)

    def _model_input(self) -> torch.Tensor:
        x = self.latents if self.kind == "t2v" else torch.cat([self.latents, self.condition], dim=1)
        return x.to(self.dtype)

    @classmethod
    def step_batch(cls, tasks: "list[WanDenoise]") -> None:
        if tasks:
            cls.advance(tasks, cls.predict(tasks))

    @staticmethod
    def predict(tasks: "list[WanDenoise]", forward: Any = None) -> torch.Tensor:
        """The guided noise prediction of each of ``tasks`` at its current step, from one
        forward pass: ``forward(model, cfg, **inputs)`` runs it (default: the model itself; a
        collaboration group passes its parallel forward). Inputs are ordered conditional
        batch first, then, with CFG, the unconditional batch."""
        model, cfg = tasks[0].transformer, tasks[0].cfg
        halves = 2 if cfg else 1
        with torch.inference_mode():
            x = torch.cat([t._model_input() for t in tasks])
            ts = torch.stack([t.timesteps[t.i] for t in tasks])
            text = [t.prompt_embeds for t in tasks]
            if cfg:  # the unconditional half: the same latents with the negative prompts
                x = torch.cat([x, x])
                ts = torch.cat([ts, ts])
                text += [t.negative_prompt_embeds for t in tasks]
            extra: dict[str, Any] = {}
            if tasks[0].image_embeds is not None:
                extra["encoder_hidden_states_image"] = torch.cat([t.image_embeds for t in tasks] * halves)
            inputs = dict(hidden_states=x, timestep=ts, encoder_hidden_states=torch.cat(text), **extra)
            out = forward(model, cfg, **inputs) if forward is not None else \
                model(**inputs, attention_kwargs=None, return_dict=False)[0]
            if not cfg:
                return out
            n = len(tasks)
            cond, uncond = out[:n], out[n:]
            guidance = torch.tensor([t.guidance for t in tasks], dtype=out.dtype, device=out.device)
            return uncond + guidance.view(-1, *([1] * (out.dim() - 1))) * (cond - uncond)

    @staticmethod
    def advance(tasks: "list[WanDenoise]", noise: torch.Tensor) -> None:
        """One scheduler step of each of ``tasks`` with its row of ``noise``."""
        with torch.inference_mode():
            for j, t in enumerate(tasks):
                t.latents = t.scheduler.step(noise[j:j + 1], t.timesteps[t.i], t.latents, return_dict=False)[0]
                t.i += 1
                t.progress = t.i / len(t.timesteps)

    def result(self) -> Parts:
        if not self.done:
            raise RuntimeError(f"denoising not finished ({self.i}/{len(self.timesteps)} steps)")
        return {"latents": self.latents}


def _denoise(ctx: StageContext, msg: Message, kind: str) -> WanDenoise:
    from diffusers.utils.torch_utils import randn_tensor

    params = _params(msg)
    transformer, scheduler = _component(ctx, "transformer"), _component(ctx, "scheduler")
    cfg = transformer.config
    temporal, spatial = _vae_scales(ctx)
    height, width, num_frames = _geometry(params, temporal, spatial, tuple(cfg.patch_size))
    steps = _param(params, "steps", int)
    guidance = _param(params, "guidance", float)
    seed = _param(params, "seed", int)
    if steps <= 0:
        raise ValueError(f"parameter 'steps' must be positive, got {steps}")
    device = _module_device(transformer)
    dtype = _dtype(transformer)

    with torch.inference_mode():
        prompt_embeds = _input(msg, "prompt_embeds", device).to(dtype)
        negative = None
        if guidance > 1.0:
            negative = _input(msg, "negative_prompt_embeds", device).to(dtype)

        image_embeds = condition = None
        if kind == "t2v":
            channels = cfg.in_channels
        else:
            condition = _input(msg, "condition", device).to(torch.float32)
            # Wan2.1 I2V: the transformer predicts z_dim channels and sees latents + condition.
            channels = cfg.out_channels
            if channels + condition.shape[1] != cfg.in_channels:
                raise ValueError(
                    f"part 'condition' has {condition.shape[1]} channels; the transformer expects "
                    f"{cfg.in_channels - channels}"
                )
            if cfg.image_dim is not None:  # only the Wan2.1 I2V transformer takes image embeddings
                image_embeds = _input(msg, "image_embeds", device).repeat(1, 1, 1).to(dtype)

        shape = (1, channels, (num_frames - 1) // temporal + 1, height // spatial, width // spatial)
        if condition is not None and tuple(condition.shape[2:]) != shape[2:]:
            raise ValueError(
                f"part 'condition' has latent shape {list(condition.shape[2:])}, but width/height/num_frames "
                f"give {list(shape[2:])}"
            )
        # Same draw as the pipeline's prepare_latents with generator=torch.Generator().manual_seed(seed).
        generator = torch.Generator().manual_seed(seed)
        latents = randn_tensor(shape, generator=generator, device=device, dtype=torch.float32)

    return WanDenoise(
        kind=kind,
        transformer=transformer,
        scheduler=copy.deepcopy(scheduler),
        latents=latents,
        prompt_embeds=prompt_embeds,
        negative_prompt_embeds=negative,
        guidance=guidance,
        steps=steps,
        image_embeds=image_embeds,
        condition=condition,
    )


@stage_function("denoise", "t2v", stepped=True, parallel=ParallelDenoiser)
def denoise_t2v(ctx: StageContext, msg: Message) -> WanDenoise:
    return _denoise(ctx, msg, "t2v")


@stage_function("denoise", "i2v", stepped=True, parallel=ParallelDenoiser)
def denoise_i2v(ctx: StageContext, msg: Message) -> WanDenoise:
    return _denoise(ctx, msg, "i2v")


# ---------------------------------------------------------------------------------- vae_decode


def _decoded(vae: Any, latents: torch.Tensor) -> Iterator[torch.Tensor]:
    """Decoded video (batch, 3, frames, H, W) in [-1, 1], a latent frame at a time (its first
    frame, then 4 frames per latent frame), exactly as ``AutoencoderKLWan._decode`` makes it
    (the same loop over its causal cache), so that frames can be encoded while the rest
    decodes. Where tiling or patching is on, or the class is not the one known, all at once."""
    if vae.use_tiling or getattr(vae.config, "patch_size", None) is not None or not hasattr(vae, "_feat_map"):
        yield vae.decode(latents, return_dict=False)[0]
        return
    vae.clear_cache()
    try:
        x = vae.post_quant_conv(latents)
        for i in range(x.shape[2]):
            vae._conv_idx = [0]
            out = vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0)
            yield torch.clamp(out, min=-1.0, max=1.0)
    finally:
        vae.clear_cache()


def frame_chunks(ctx: StageContext, msg: Message) -> Iterator[np.ndarray]:
    """Latents → frames as the pipelines' output_type="np" gives them ((frames, H, W, 3) in
    [0, 1]), a few frames at a time, as the VAE decodes them."""
    from diffusers.video_processor import VideoProcessor

    vae = _component(ctx, "vae")
    device = _module_device(vae)
    processor = VideoProcessor(vae_scale_factor=int(vae.config.scale_factor_spatial))
    with torch.inference_mode():
        latents = _input(msg, "latents", device).to(dtype=_dtype(vae))
        if latents.ndim != 5 or latents.shape[1] != vae.config.z_dim:
            raise ValueError(
                f"part 'latents' must be (batch, {vae.config.z_dim}, frames, h, w), got {list(latents.shape)}"
            )
        mean, inv_std = _latents_norm(vae, latents.device, latents.dtype)
        for video in _decoded(vae, latents / inv_std + mean):
            yield np.asarray(processor.postprocess_video(video, output_type="np")[0])


def decode_frames(ctx: StageContext, msg: Message) -> np.ndarray:
    """Latents → all frames, as the pipelines' output_type="np": (frames, H, W, 3) in [0, 1]."""
    return np.concatenate(list(frame_chunks(ctx, msg)))


def _rgb24(frames: np.ndarray) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] == 0:
        raise ValueError(f"frames must be (frames, H, W, 3), got {list(frames.shape)}")
    if frames.dtype != np.uint8:
        # diffusers' export_to_video scales by 255; round rather than truncate.
        frames = np.clip(np.rint(frames * 255.0), 0, 255).astype(np.uint8)
    h, w = frames.shape[1:3]
    if h % 2 or w % 2:  # yuv420p (what players expect) needs even sizes
        raise ValueError(f"frames must have an even height and width for H.264, got {w}x{h}")
    return frames


# A serving encoder's settings (`onepiece bench mp4` compares them): x264's default (medium, with
# lookahead and B-frames that hold frames back until the end) cannot stream; zerolatency emits
# each frame as it comes. One thread: the encoder runs beside the VAE decode, which has the
# cores, so the CPU it takes from them is what it costs, and x264's own threads spent as much or
# more of it for the same file; superfast saved CPU only on small frames, and its files were up
# to 1.5x larger.
X264_OPTIONS = {"preset": "veryfast", "tune": "zerolatency", "threads": "1"}


class Mp4Writer:
    """H.264 MP4 encoded in this process by PyAV (an ffmpeg subprocess cost ≈ 45-65 ms a video,
    as long as a small video's denoising), on its own thread: chunks of frames go in as the VAE
    decodes them, through a bounded queue, and the encoder (which leaves the GIL) works
    meanwhile. ``content`` is the file once closed."""

    def __init__(self, fps: int, queued: int = 4, options: dict[str, str] | None = None) -> None:
        import queue
        import threading

        self.fps, self.content = int(fps), b""
        self.options = X264_OPTIONS if options is None else options
        self._q: queue.Queue = queue.Queue(maxsize=queued)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._encode, name="mp4-encoder", daemon=True)
        self._thread.start()

    def add(self, frames: np.ndarray) -> None:
        if self._error is not None:
            raise self._error
        self._q.put(_rgb24(frames))

    def close(self, discard: bool = False) -> bytes:
        """The MP4; with ``discard`` (the decode failed) just stop the encoder."""
        self._q.put(None)
        self._thread.join()
        if self._error is not None and not discard:
            raise self._error
        return self.content

    def _encode(self) -> None:
        import av

        out, container, stream, ended = io.BytesIO(), None, None, False
        try:
            while (frames := self._q.get()) is not None:
                if container is None:
                    container = av.open(out, mode="w", format="mp4")
                    stream = container.add_stream("libx264", rate=self.fps, options=self.options)
                    stream.height, stream.width = frames.shape[1:3]
                    stream.pix_fmt = "yuv420p"
                for frame in frames:
                    container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame),
                                                                           format="rgb24")))
            ended = True
            if container is None:
                raise ValueError("no frames to encode")
            container.mux(stream.encode(None))  # flush the encoder's delayed frames
            container.close()
            self.content = out.getvalue()
        except BaseException as e:  # handed to the caller; the queue is drained (to its end) so it never blocks
            self._error = e
            while not ended and self._q.get() is not None:
                pass


def stream_mp4(chunks: Iterable[np.ndarray], fps: int, options: dict[str, str] | None = None) -> bytes:
    """H.264 MP4 of the frames of ``chunks`` ((frames, H, W, 3) floats in [0, 1], or uint8),
    each encoded as it comes (while the next one is made); x264 ``options`` (default: X264_OPTIONS)."""
    mp4 = Mp4Writer(fps, options=options)
    try:
        for frames in chunks:
            mp4.add(frames)
    except BaseException:
        mp4.close(discard=True)
        raise
    return mp4.close()


def encode_mp4(frames: np.ndarray, fps: int) -> bytes:
    """H.264 MP4 of ``frames``."""
    return stream_mp4([frames], fps)


@stage_function("vae_decode", "t2v")
@stage_function("vae_decode", "i2v")
def vae_decode(ctx: StageContext, msg: Message) -> Parts:
    fps = _param(_params(msg), "fps", int)
    if fps <= 0:
        raise ValueError(f"parameter 'fps' must be positive, got {fps}")
    # Streaming hides the encoding behind a device's decode. On the CPU the two share the cores:
    # the encoder's thread stalls torch's, which cost more than encoding afterwards (bench e2e's
    # vae_decode at 64x64x9: 54.5 ms p50 streaming, 47.0 ms after).
    on_cpu = _module_device(_component(ctx, "vae")).type == "cpu"
    return {"content": stream_mp4([decode_frames(ctx, msg)] if on_cpu else frame_chunks(ctx, msg), fps)}
