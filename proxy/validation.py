"""Validation of ``POST /v1/videos``: raw fields (JSON or form) -> a checked :class:`VideoJob`.

Every rejection is an :class:`ApiError` (400) naming the parameter and what was expected, so a
client can fix its request without reading the proxy's code. Field names follow the OpenAI
videos API (prompt, model, size, seconds, input_reference); the sampling extras keep the
diffusers names as aliases (num_inference_steps, guidance_scale).
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from onepiece.config import MAX_GUIDANCE, MAX_SEED, AppSpec, Workflow
from onepiece.proxy.errors import ApiError, bad_request

MAX_SECONDS = 3600.0
MAX_PRIORITY = 1000  # what the stages accept in a header
SIZE_RE = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$", re.ASCII)  # "６４x６４" is no size


class CreateFields(BaseModel):
    """The scalar fields of a create request. Lax types: form fields arrive as strings."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt: str
    model: str | None = None
    size: str | None = None
    seconds: float | None = None
    num_frames: int | None = None
    steps: int | None = None
    num_inference_steps: int | None = None
    guidance: float | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    negative_prompt: str | None = None
    timeout_s: float | None = None
    slo_s: float | None = None
    priority: int | None = None

    @field_validator("seconds", "guidance", "guidance_scale", "timeout_s", "slo_s", mode="before")
    @classmethod
    def _no_bool_float(cls, v: Any) -> Any:
        # JSON true would otherwise read as 1.0; a boolean is never a duration or a scale.
        if isinstance(v, bool):
            raise ValueError("expected a number, not a boolean")
        return v

    @field_validator("num_frames", "steps", "num_inference_steps", "seed", "priority", mode="before")
    @classmethod
    def _no_bool_int(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("expected an integer, not a boolean")
        if isinstance(v, float) and abs(v) >= 2**63:  # how orjson reads a JSON integer beyond 64 bits
            raise ValueError("integer too large")
        return v


@dataclass
class VideoJob:
    """A validated request, ready to become a workflow message."""

    app: str
    prompt: str
    negative_prompt: str
    width: int
    height: int
    num_frames: int
    steps: int
    guidance: float
    seed: int
    fps: int
    max_sequence_length: int
    timeout_s: float
    image_bytes: bytes | None = None
    timeout_given: bool = False  # the client set timeout_s (else: the app's limit, and admission's default)
    priority: int = 0  # higher first under srtf and edf; slo breaks ties with it (README, API)
    # The latency the client aims for, within timeout_s: what the stages schedule for and the
    # monitor admits against. A request that misses it still completes; timeout_s is where it fails.
    slo_s: float | None = None

    @property
    def target_s(self) -> float:
        """Seconds to the time the request is scheduled and admitted for."""
        return self.timeout_s if self.slo_s is None else self.slo_s

    @property
    def target_given(self) -> bool:
        return self.timeout_given or self.slo_s is not None

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def seconds(self) -> str:
        # Wan's convention: 4k+1 frames span 4k frame intervals, e.g. 81 frames @16 fps = "5".
        return f"{(self.num_frames - 1) / self.fps:g}"

    def params(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "negative_prompt": self.negative_prompt,
            "width": self.width,
            "height": self.height,
            "num_frames": self.num_frames,
            "steps": self.steps,
            "guidance": self.guidance,
            "seed": self.seed,
            "fps": self.fps,
            "max_sequence_length": self.max_sequence_length,
        }


def _explain(err: ValidationError) -> ApiError:
    e = err.errors()[0]
    param = ".".join(str(p) for p in e["loc"]) or None
    if e["type"] == "missing":
        return bad_request(f"'{param}' is required", param=param, code="missing_required_parameter")
    if e["type"] == "extra_forbidden":
        return bad_request(
            f"unknown parameter '{param}' (accepted: {', '.join(sorted(CreateFields.model_fields) + ['input_reference'])})",
            param=param,
            code="unknown_parameter",
        )
    got = e.get("input")
    shown = repr(got) if isinstance(got, (str, int, float, bool)) or got is None else type(got).__name__
    if isinstance(got, str) and len(got) > 64:
        shown = repr(got[:64] + "...")
    msg = e["msg"].removeprefix("Value error, ")
    return bad_request(f"'{param}': {msg} (got {shown})", param=param)


def _pick(fields: CreateFields, a: str, b: str) -> Any:
    va, vb = getattr(fields, a), getattr(fields, b)
    if va is not None and vb is not None and va != vb:
        raise bad_request(f"'{a}' and '{b}' are the same setting and disagree ({va} vs {vb})", param=b)
    return va if va is not None else vb


def _largest_4k1(n: int) -> int:
    """The largest 4k+1 frame count <= n (Wan's VAE packs 4 frames per latent after the first)."""
    return max(1, ((n - 1) // 4) * 4 + 1)


def resolve_app(workflow: Workflow, model: str | None, has_image: bool) -> str:
    """The application id; without one, the image decides between the default apps."""
    apps = workflow.applications
    if model is None or model == "":
        guess = "i2v" if has_image else "t2v"
        if guess in apps:
            return guess
        raise bad_request(f"'model' is required (available: {', '.join(sorted(apps))})", param="model",
                          code="missing_required_parameter")
    if model not in apps:
        raise ApiError(400, f"unknown model {model!r} (available: {', '.join(sorted(apps))})", code="model_not_found",
                       param="model")
    return model


def parse_fields(raw: dict[str, Any]) -> CreateFields:
    try:
        return CreateFields.model_validate(raw)
    except ValidationError as e:
        raise _explain(e) from None


def build_job(workflow: Workflow, raw: dict[str, Any], image_bytes: bytes | None) -> VideoJob:
    """Check every field of a create request against the application's limits."""
    fields = parse_fields(raw)
    app = resolve_app(workflow, fields.model, image_bytes is not None)
    spec: AppSpec = workflow.applications[app]
    d, lim = spec.defaults, spec.limits

    prompt = fields.prompt
    if not prompt.strip():
        raise bad_request("'prompt' must not be empty", param="prompt")
    if len(prompt) > lim.max_prompt_chars:
        raise bad_request(f"'prompt' has {len(prompt)} characters; at most {lim.max_prompt_chars} allowed",
                          param="prompt")
    negative = d.negative_prompt if fields.negative_prompt is None else fields.negative_prompt
    if len(negative) > lim.max_prompt_chars:
        raise bad_request(f"'negative_prompt' has {len(negative)} characters; at most {lim.max_prompt_chars} allowed",
                          param="negative_prompt")

    # The t2v pipeline has no image input; silently dropping an image would surprise the user.
    if spec.kind == "t2v" and image_bytes is not None:
        raise bad_request(f"model {app!r} is text-to-video and takes no 'input_reference'; "
                          f"use an image-to-video model", param="input_reference", code="unexpected_input_reference")
    if spec.kind == "i2v" and image_bytes is None:
        raise bad_request(f"model {app!r} is image-to-video and needs an 'input_reference' image",
                          param="input_reference", code="missing_input_reference")

    width, height = d.width, d.height
    if fields.size is not None:
        m = SIZE_RE.match(fields.size)
        if not m:
            raise bad_request(f"'size' must look like WIDTHxHEIGHT, e.g. '{d.width}x{d.height}' (got {fields.size[:32]!r})",
                              param="size")
        width, height = int(m.group(1)), int(m.group(2))
    if width <= 0 or height <= 0 or width % 16 or height % 16:
        raise bad_request(f"'size' {width}x{height}: width and height must be positive multiples of 16", param="size")
    if width > lim.max_width or height > lim.max_height:
        raise bad_request(f"'size' {width}x{height} exceeds the limit {lim.max_width}x{lim.max_height} of model {app!r}",
                          param="size")

    max_frames = _largest_4k1(lim.max_frames)
    if fields.seconds is not None and not 0 < fields.seconds <= MAX_SECONDS:  # even where num_frames wins
        raise bad_request(f"'seconds' must be in (0, {MAX_SECONDS:g}]; got {fields.seconds:g}", param="seconds")
    if fields.num_frames is not None:  # an explicit frame count wins over seconds
        n = fields.num_frames
        if n < 1 or (n - 1) % 4:
            raise bad_request(f"'num_frames' must be 4k+1 (1, 5, 9, ..., {max_frames}); got {n}", param="num_frames")
        if n > max_frames:
            raise bad_request(f"'num_frames' {n} exceeds the limit {max_frames} of model {app!r}", param="num_frames")
        num_frames = n
    elif fields.seconds is not None:
        num_frames = 4 * math.floor(fields.seconds * d.fps / 4 + 0.5) + 1
        if num_frames > max_frames:  # refused like an explicit frame count: a clip silently cut short surprises
            raise bad_request(f"'seconds' {fields.seconds:g} is {num_frames} frames at {d.fps} fps, beyond the limit "
                              f"{max_frames} of model {app!r} (at most {(max_frames - 1) / d.fps:g} s)", param="seconds")
    else:
        num_frames = min(_largest_4k1(d.num_frames), max_frames)

    steps = _pick(fields, "steps", "num_inference_steps")
    steps = d.steps if steps is None else steps
    if not 1 <= steps <= lim.max_steps:
        raise bad_request(f"'steps' must be between 1 and {lim.max_steps}; got {steps}", param="steps")

    guidance = _pick(fields, "guidance", "guidance_scale")
    guidance = d.guidance if guidance is None else guidance
    if not 0 <= guidance <= MAX_GUIDANCE:
        raise bad_request(f"'guidance' must be between 0 and {MAX_GUIDANCE:g}; got {guidance:g}", param="guidance")

    seed = fields.seed
    if seed is None:
        seed = secrets.randbits(31)
    elif not 0 <= seed <= MAX_SEED:
        raise bad_request(f"'seed' must be between 0 and {MAX_SEED}; got {seed}", param="seed")

    timeout_s = lim.timeout_s
    if fields.timeout_s is not None:
        if not 0 < fields.timeout_s <= lim.timeout_s:
            raise bad_request(f"'timeout_s' must be in (0, {lim.timeout_s:g}]; got {fields.timeout_s:g}",
                              param="timeout_s")
        timeout_s = fields.timeout_s
    if fields.slo_s is not None and not 0 < fields.slo_s <= timeout_s:
        raise bad_request(f"'slo_s' must be in (0, timeout_s = {timeout_s:g}]; got {fields.slo_s:g}", param="slo_s")

    priority = 0 if fields.priority is None else fields.priority
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise bad_request(f"'priority' must be between {-MAX_PRIORITY} and {MAX_PRIORITY}; got {priority}",
                          param="priority")

    return VideoJob(
        app=app, prompt=prompt, negative_prompt=negative, width=width, height=height, num_frames=num_frames,
        steps=steps, guidance=float(guidance), seed=seed, fps=d.fps, max_sequence_length=d.max_sequence_length,
        timeout_s=timeout_s, image_bytes=image_bytes, timeout_given=fields.timeout_s is not None, priority=priority,
        slo_s=fields.slo_s,
    )
