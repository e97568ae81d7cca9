"""The order a DB lists its records in: by creation time (then uid), overall and per owner.

Kept as sorted lists of ``(created_at, uid)`` beside the records, so a page costs a binary
search and at most ``limit`` steps, whoever else has records here (a scan would cost the whole
store per page, in the one loop thread that serves every DB request). Inserting shifts a list
(memmove), cheap next to the record it indexes; records mostly arrive in time order anyway.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

Key = tuple[float, str]


def created_key(uid: str, created_at: Any) -> Key:
    """A record's place in the order; a missing or odd time sorts first rather than failing."""
    if isinstance(created_at, bool) or not isinstance(created_at, (int, float)) or not math.isfinite(created_at):
        return (0.0, uid)
    return (float(created_at), uid)


class CreatedIndex:
    def __init__(self) -> None:
        self._all: list[Key] = []
        self._by_owner: dict[str, list[Key]] = {}
        self._of: dict[str, tuple[Key, str | None]] = {}  # uid -> (its key, its owner)

    def __len__(self) -> int:
        return len(self._all)

    def put(self, uid: str, created_at: Any, owner: str | None) -> None:
        """Index ``uid`` (again, if its time or owner changed)."""
        entry = (created_key(uid, created_at), owner if isinstance(owner, str) else None)
        if self._of.get(uid) == entry:
            return
        self.remove(uid)
        key, owner = entry
        self._of[uid] = entry
        bisect.insort(self._all, key)
        if owner is not None:
            bisect.insort(self._by_owner.setdefault(owner, []), key)

    def remove(self, uid: str) -> None:
        entry = self._of.pop(uid, None)
        if entry is None:
            return
        key, owner = entry
        _discard(self._all, key)
        if owner is not None:
            keys = self._by_owner[owner]
            _discard(keys, key)
            if not keys:
                del self._by_owner[owner]

    def page(self, owner: str | None, after: Key | None, limit: int, descending: bool) -> tuple[list[str], bool]:
        """Up to ``limit`` uids after ``after`` in the order asked for (every record's when
        ``owner`` is None, else that owner's), and whether more follow."""
        keys = self._all if owner is None else self._by_owner.get(owner, [])
        if descending:
            end = bisect.bisect_left(keys, after) if after is not None else len(keys)
            got = keys[max(0, end - limit - 1):end][::-1]
        else:
            start = bisect.bisect_right(keys, after) if after is not None else 0
            got = keys[start:start + limit + 1]
        return [uid for _, uid in got[:limit]], len(got) > limit


def _discard(keys: list[Key], key: Key) -> None:
    i = bisect.bisect_left(keys, key)
    if i < len(keys) and keys[i] == key:
        del keys[i]
