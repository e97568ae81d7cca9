"""The workflow message (DESIGN §3): a small JSON header plus named raw payload parts.

Header times (``ts``, ``deadline``, trace ``t``) are integers, ns since the epoch.

Wire form is a list of frames: ``[MAGIC, header_json, part_0, part_1, ...]``. The header
describes every part (name, dtype, shape, nbytes) so tensors travel as raw buffers and are
rebuilt without a copy and without pickle. ``decode`` checks everything it can before it hands
a message up: a malformed or truncated message raises :class:`MessageError`, never more.
"""

from __future__ import annotations

import math
import sys
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence, Union

import numpy as np
import orjson

if TYPE_CHECKING:
    import torch

MAGIC = b"OP1"
MAX_HEADER_BYTES = 1 << 20
MAX_PARTS = 64
# Per frame on a receiving socket: above any part a request within the workflow's limits makes
# (81 raw float32 frames at 1280x720 are 0.9 GB; latents and embeddings are tens of MB), so a
# peer cannot make a receiver allocate without end; a bigger frame costs its sender the connection.
MAX_PART_BYTES = 1 << 30

# Wire dtype names. Parts decode to numpy arrays (so the proxy and the DB never import torch),
# except bfloat16, which numpy lacks and only stage processes (which have torch) receive.
NUMPY_DTYPES = {
    n: np.dtype(n)
    for n in ("float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}
ITEMSIZE = {**{n: d.itemsize for n, d in NUMPY_DTYPES.items()}, "bfloat16": 2}
# dtype -> wire name by lookup: ``ndarray.dtype.name`` builds its string anew on every call
# (microseconds); dtypes that miss (another byte order) fall back to it as before.
_WIRE_NAME = {d: n for n, d in NUMPY_DTYPES.items()}

Part = Union[bytes, bytearray, memoryview, np.ndarray, "torch.Tensor"]


class MessageError(ValueError):
    """A message that cannot be trusted: wrong framing, header or part sizes."""


def new_uid() -> str:
    """An unguessable request id: uuid4 carries 122 random bits from os.urandom."""
    return uuid.uuid4().hex


def now_ns() -> int:
    return time.time_ns()


@dataclass
class Message:
    """A header (JSON-able dict) and named parts (bytes or tensors)."""

    header: dict[str, Any]
    parts: dict[str, Part] = field(default_factory=dict)
    # Where it came from, as the receiving transport saw it (never sent): for log lines about it.
    sender: str = field(default="", compare=False, repr=False)
    # The CURVE key it came with (``curve.caller``: a key file's stem) on a socket with CURVE;
    # None otherwise (never sent): what a receiver admits only from members checks it.
    caller: str | None = field(default=None, compare=False, repr=False)

    @property
    def uid(self) -> str:
        return self.header["uid"]

    @property
    def kind(self) -> str:
        return self.header.get("kind", "task")

    def tensor(self, name: str) -> "torch.Tensor":
        """Part ``name`` as a torch tensor, sharing memory with the received frame."""
        import torch

        part = self.parts[name]
        if isinstance(part, np.ndarray):
            with warnings.catch_warnings():
                # Received frames are read-only; stage functions never write into inputs.
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(part)
        if _is_torch(part):
            return part
        raise MessageError(f"part {name!r} is bytes, not a tensor")

    def blob(self, name: str) -> bytes:
        part = self.parts[name]
        if isinstance(part, np.ndarray) or _is_torch(part):
            raise MessageError(f"part {name!r} is a tensor, not bytes")
        return bytes(part)

    def mark(self, stage: str, event: str, instance: str = "") -> None:
        """Append a trace point so every result carries its own latency breakdown."""
        self.header.setdefault("trace", []).append(
            {"stage": stage, "event": event, "t": now_ns(), "instance": instance}
        )


def service_s(trace: Any) -> float | None:
    """Seconds the stages' workers spent on a request, from its trace: each stage's ``start``
    to its ``end`` (not the waits and hops between); None when the trace pairs none."""
    spans, opened = [], {}
    for ev in trace if isinstance(trace, list) else ():
        if not isinstance(ev, dict) or not isinstance(ev.get("t"), int):
            continue
        if ev.get("event") == "start":
            opened[ev.get("stage")] = ev["t"]
        elif ev.get("event") == "end" and ev.get("stage") in opened:
            spans.append(max(0, ev["t"] - opened.pop(ev.get("stage"))))
    return sum(spans) / 1e9 if spans else None


def _is_torch(part: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(part, torch.Tensor)


def _tensor_desc(t: "torch.Tensor") -> tuple[str, list[int], memoryview]:
    import torch

    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in ITEMSIZE:
        raise MessageError(f"dtype {t.dtype} cannot travel")
    t = t.detach().cpu().contiguous()
    # A uint8 view exposes the raw bytes of any dtype (bfloat16 included) without a copy.
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
    return dtype, list(t.shape), memoryview(raw).cast("B")


def encode(msg: Message) -> list[Any]:
    """Frames for ``msg``; tensors are exposed as buffers, not copied."""
    descs = []
    frames: list[Any] = []
    for name, part in msg.parts.items():
        if isinstance(part, np.ndarray):
            dtype = _WIRE_NAME.get(part.dtype)
            if dtype is None:
                dtype = part.dtype.name
                if dtype not in NUMPY_DTYPES:
                    raise MessageError(f"part {name!r}: dtype {dtype} cannot travel")
            arr = np.ascontiguousarray(part)
            if not arr.size:
                buf = memoryview(b"")
            else:
                try:  # the raw bytes, no copy (contiguous now)
                    buf = memoryview(arr).cast("B")
                except (TypeError, ValueError):  # a format memoryview cannot cast (non-native order)
                    buf = memoryview(arr.reshape(-1).view(np.uint8))
            descs.append({"name": name, "dtype": dtype, "shape": list(arr.shape), "nbytes": buf.nbytes})
        elif _is_torch(part):
            dtype, shape, buf = _tensor_desc(part)
            descs.append({"name": name, "dtype": dtype, "shape": shape, "nbytes": buf.nbytes})
        else:
            buf = memoryview(part).cast("B")
            descs.append({"name": name, "dtype": "bytes", "shape": [buf.nbytes], "nbytes": buf.nbytes})
        frames.append(buf)
    header = dict(msg.header)
    header["parts"] = descs
    return [MAGIC, orjson.dumps(header), *frames]


def _frame_bytes(frame: Any) -> memoryview:
    # zmq.Frame exposes .buffer; bytes/memoryview are buffers already.
    buf = getattr(frame, "buffer", frame)
    return memoryview(buf).cast("B") if not isinstance(buf, memoryview) or buf.format != "B" else buf


def decode(frames: Sequence[Any]) -> Message:
    """Rebuild a message from frames, or raise MessageError saying why it is rejected."""
    if len(frames) < 2:
        raise MessageError(f"expected at least 2 frames, got {len(frames)}")
    if _frame_bytes(frames[0]) != MAGIC:  # (a memoryview compares with bytes by content)
        raise MessageError("bad magic frame")
    raw = _frame_bytes(frames[1])
    if raw.nbytes > MAX_HEADER_BYTES:
        raise MessageError(f"header of {raw.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise MessageError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise MessageError("header is not a JSON object")
    uid = header.get("uid")
    if not isinstance(uid, str) or not uid:
        raise MessageError("header has no uid")
    descs = header.pop("parts", [])
    if not isinstance(descs, list) or len(descs) > MAX_PARTS:
        raise MessageError("header 'parts' must be a list of at most %d entries" % MAX_PARTS)
    if len(descs) != len(frames) - 2:
        raise MessageError(f"header describes {len(descs)} parts but {len(frames) - 2} frames arrived")
    parts: dict[str, Part] = {}
    for desc, frame in zip(descs, frames[2:]):
        parts_name, part = _decode_part(desc, _frame_bytes(frame))
        if parts_name in parts:
            raise MessageError(f"duplicate part {parts_name!r}")
        parts[parts_name] = part
    return Message(header, parts)


def _decode_part(desc: Any, buf: memoryview) -> tuple[str, Part]:
    if not isinstance(desc, dict):
        raise MessageError("part description is not an object")
    name, dtype, shape, nbytes = desc.get("name"), desc.get("dtype"), desc.get("shape"), desc.get("nbytes")
    if not isinstance(name, str) or not name:
        raise MessageError("part has no name")
    if type(nbytes) is not int or nbytes != buf.nbytes:
        raise MessageError(f"part {name!r}: header says {nbytes} bytes, frame has {buf.nbytes}")
    if dtype == "bytes":
        return name, buf
    itemsize = ITEMSIZE.get(dtype) if isinstance(dtype, str) else None
    if itemsize is None:
        raise MessageError(f"part {name!r}: unknown dtype {dtype!r}")
    # bool is an int to Python; a shape of booleans is malformed, not a shape.
    if type(shape) is list and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0:
        count = shape[0]  # the common 1-D case, checked without a generator
    elif (not isinstance(shape, list) or len(shape) > 8
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise MessageError(f"part {name!r}: bad shape {shape!r}")
    else:
        count = math.prod(shape)  # Python ints: no overflow to wrap a huge shape to 0 bytes
    if count * itemsize != nbytes:
        raise MessageError(f"part {name!r}: shape {shape} of {dtype} needs {count * itemsize} bytes, got {nbytes}")
    if dtype == "bfloat16":
        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only frame, see Message.tensor
            raw = torch.from_numpy(np.frombuffer(buf, dtype=np.int16))
        return name, raw.view(torch.bfloat16).reshape(shape)
    arr = np.frombuffer(buf, NUMPY_DTYPES[dtype])  # (positional: twice as fast as dtype=)
    return name, arr if len(shape) == 1 else arr.reshape(shape)  # 1-D: frombuffer's shape already
