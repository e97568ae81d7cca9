"""The DB's events channel (ZMQ PUB/SUB), as its publisher writes it and its subscribers check it.

An event is two frames, ``[topic, body]``: topic ``done`` when a request ends (``status``
``completed`` or ``failed``; the proxy's in-flight count and the request monitor follow it),
``cancel`` when a request that is not completed is deleted (``status`` empty; stages drop it, and
every proxy frees the slot it held for it).
A completed request's ``done`` also says how long the stages' workers spent on it
(``service_s``, from its trace): the request monitor times the path between the stages by it.
A subscriber takes nothing on trust: an event that is not exactly this is dropped.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import orjson
from pydantic import BaseModel, ConfigDict, Field

from onepiece.schema import Name, checked

DONE, CANCEL = b"done", b"cancel"
MAX_EVENT_BYTES = 4096  # per frame, set on subscribers: a bigger one costs the publisher its connection


class Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    uid: Name
    status: Literal["", "completed", "failed"]
    service_s: float | None = Field(None, ge=0, allow_inf_nan=False)


def event_frames(topic: bytes, uid: str, status: str, service_s: float | None = None) -> list[bytes]:
    """What a DB publishes."""
    body = {"uid": uid, "status": status}
    if service_s is not None:
        body["service_s"] = service_s
    return [topic, orjson.dumps(body)]


def read_event(frames: Sequence[Any], topic: bytes) -> Event:
    """The event in ``frames`` (bytes or zmq frames) on ``topic``; ValueError saying what is wrong."""
    raw = [bytes(getattr(f, "buffer", f)) for f in frames]
    if len(raw) != 2 or raw[0] != topic:
        raise ValueError(f"frames: expected [{topic.decode()!r}, body], got {len(raw)} frames")
    try:
        body = orjson.loads(raw[1])
    except orjson.JSONDecodeError as e:
        raise ValueError(f"body: not JSON ({e})") from None
    return checked(Event, body, "event")
