"""``Idempotency-Key`` on ``POST /v1/videos``: a retried create returns the video the first one
made, on whichever proxy of the set it lands.

The proxies keep nothing: the video's UID is derived from the key and the caller's API key
(an HMAC under a secret of that API key, so nobody else can compute it or collide with it), and
the record the DBs hold under that UID carries a digest of the request. A retry finds the record
by the UID alone, as any read does; two concurrent creates meet at the first DB of the UID's
placement order, whose one loop thread lets only one of them create (``create`` with
``if_absent``, db/server.py). The window is the record's life (its TTL, or the purge after its
download) and then its tombstone's (a TTL, bounded in number): a retry then gets a 409 saying
the video is gone, not a second video.

A proxy killed between storing a record and handing the request to the pipeline leaves a
``queued`` record that no stage will ever touch, and a retry that replayed it would wait for it
until its deadline. So a proxy marks the record ``handed`` once it handed an idempotent create
over (before it answers), and ``handing`` tells a retry what to do with a held record: handed,
or moved on, it gets the video; not handed and younger than a hand-over and its mark may take
(its proxy may be sending it now), it is asked to come back; not handed and older, its proxy
died before the mark, and the retry's proxy hands it over. (A proxy that died between the
hand-over and the mark makes it go twice; an entrance instance that holds it drops the copy.)
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Any, Literal

import orjson
from pydantic import BaseModel
from starlette.requests import Request

from onepiece.proxy.errors import ApiError, bad_request
from onepiece.proxy.keys import Caller

HEADER = "Idempotency-Key"
KEY_RE = re.compile(r"^[\x21-\x7e]{1,255}$")  # visible ASCII, as Stripe's and OpenAI's keys are


def idempotency_key(request: Request) -> str | None:
    """The request's Idempotency-Key, checked; None without one."""
    values = request.headers.getlist(HEADER)
    if not values:
        return None
    if len(values) > 1:
        raise bad_request(f"'{HEADER}' given more than once", param=HEADER, code="invalid_idempotency_key")
    if not KEY_RE.match(values[0]):
        raise bad_request(f"'{HEADER}' must be 1 to 255 visible ASCII characters without spaces",
                          param=HEADER, code="invalid_idempotency_key")
    return values[0]


def idempotent_uid(caller: Caller, key: str) -> str:
    """The UID a create with ``key`` gets: the same on every proxy, different for every API key."""
    return hmac.new(caller.secret, b"onepiece-idempotency\0" + key.encode(), hashlib.sha256).hexdigest()[:32]


def request_hash(fields: BaseModel, image: bytes | None) -> str:
    """A digest of what a create asks for: its fields as parsed and its image, so that neither a
    multipart boundary, JSON spacing, ``120`` for ``120.0``, an explicit ``null``, nor a form
    for JSON makes a retry a different request."""
    h = hashlib.sha256(orjson.dumps(fields.model_dump(mode="json", exclude_none=True), option=orjson.OPT_SORT_KEYS))
    h.update(b"\0")
    h.update(image or b"")
    return h.hexdigest()


def check_same(record: dict[str, Any], digest: str) -> None:
    """A 409 when the record under the key was created by a different request."""
    if record.get("request_hash") != digest:
        raise ApiError(409, f"this '{HEADER}' was used for a different request (video_{record['uid']}); "
                            f"send a new key for a new request", code="idempotency_key_reused", param=HEADER)


def gone() -> ApiError:
    return ApiError(409, f"the video created with this '{HEADER}' is gone (downloaded, deleted or expired); "
                         f"send a new key for a new request", code="idempotency_key_reused", param=HEADER)


MARK_S = 3.0  # beyond the hand-over's own bound: the mark's own DB call


Handing = Literal["replay", "wait", "resend"]


def handing(record: dict[str, Any], now_s: float, handover_s: float) -> tuple[Handing, float]:
    """What a retried create does with the record its key made: ``replay`` it, ask the client
    to ``wait`` (its first proxy may still be handing it over), or ``resend`` it (that proxy
    died before it handed it over); and for ``wait``, the seconds until a retry would resend.
    ``handover_s``: the longest a proxy takes to hand a request over."""
    if record.get("handed") or record.get("status") != "queued" or record.get("progress"):
        return "replay", 0.0
    created = record.get("created_at")
    if not isinstance(created, (int, float)):
        return "replay", 0.0
    left = created + handover_s + MARK_S - now_s
    return ("wait", left) if left > 0 else ("resend", 0.0)
