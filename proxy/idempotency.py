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
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Any

import orjson
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


def request_hash(fields: dict[str, Any], image: bytes | None) -> str:
    """A digest of what a create asks for (its parsed fields and image, so a multipart boundary
    or JSON spacing does not count)."""
    h = hashlib.sha256(orjson.dumps(fields, option=orjson.OPT_SORT_KEYS))
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
