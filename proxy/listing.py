"""``GET /v1/videos``: the query of a list request, checked, and the OpenAI list object."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import QueryParams

from onepiece.db.listing import Key, created_key
from onepiece.db.protocol import MAX_PAGE
from onepiece.proxy.errors import bad_request

PARAMS = ("after", "limit", "order")
DEFAULT_LIMIT = 20


@dataclass(frozen=True)
class ListQuery:
    after: str | None  # a video id
    limit: int
    order: str  # "asc" | "desc" (by creation time)


def parse_query(params: QueryParams) -> ListQuery:
    """A 400 naming the parameter for anything but after, limit (1-100) and order (asc|desc)."""
    for name in params:
        if name not in PARAMS:
            raise bad_request(f"unknown parameter '{name}' (accepted: {', '.join(PARAMS)})", param=name,
                              code="unknown_parameter")
        if len(params.getlist(name)) > 1:
            raise bad_request(f"parameter '{name}' given more than once", param=name)
    raw = params.get("limit")
    limit = DEFAULT_LIMIT
    if raw is not None:
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 4) or not 1 <= int(raw) <= MAX_PAGE:
            raise bad_request(f"'limit' must be an integer from 1 to {MAX_PAGE} (got {raw[:32]!r})", param="limit")
        limit = int(raw)
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"'order' must be 'asc' or 'desc' (got {order[:32]!r})", param="order")
    after = params.get("after") or None
    return ListQuery(after, limit, order)


def list_object(videos: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": videos, "first_id": videos[0]["id"] if videos else None,
            "last_id": videos[-1]["id"] if videos else None, "has_more": has_more}


class Cursors:
    """The places in the order (``created_key``) of the videos this proxy listed lately, per
    caller: a client's ``after`` is the last id of a page it was given, and that video may be
    deleted or purged (60 s after its download) before the client asks for the next page. The
    DB then no longer knows where it stood, and the paging broke with a 400. Bounded: the
    latest ``limit``."""

    def __init__(self, limit: int = 8192) -> None:
        self.limit = limit
        self._keys: collections.OrderedDict[tuple[str | None, str], Key] = collections.OrderedDict()

    def remember(self, owner: str | None, records: list[dict[str, Any]]) -> None:
        for r in records:
            self._keys[owner, r["uid"]] = created_key(r["uid"], r.get("created_at"))
            self._keys.move_to_end((owner, r["uid"]))
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def get(self, owner: str | None, uid: str) -> Key | None:
        return self._keys.get((owner, uid))
