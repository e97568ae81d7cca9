"""The proxy's view of its set's DBs: an AsyncDbClient kept in step with the cluster's list.

When the list of control addresses changes, a new client is built; the old one is closed a
little later, so calls already in flight on it finish rather than break.

Errors are the DB client's own (onepiece.db.client): DbUnavailable when no DB answered (or none
is registered), DbFull when every DB refused for lack of memory, DbGone for a create-once whose
UID is gone, DbError when they refused otherwise, NotReady for content that is not completed yet.
A given ``owner`` (the caller's key tag) makes other owners' records look absent. They pass through unchanged.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from onepiece.db.client import AsyncDbClient, DbUnavailable

__all__ = ["DbAccess"]

log = logging.getLogger(__name__)

RETIRE_AFTER_S = 10.0


class DbAccess:
    def __init__(self, timeout: float = 1.0) -> None:
        self.timeout = timeout
        self._controls: tuple[str, ...] = ()
        self._client: AsyncDbClient | None = None
        self._retired: list[tuple[float, AsyncDbClient]] = []

    @property
    def count(self) -> int:
        return len(self._controls)

    def update(self, dbs: list[dict]) -> None:
        """Follow the cluster's DB list (call from the event loop)."""
        controls = tuple(sorted({d["control"] for d in dbs if isinstance(d, dict) and d.get("control")}))
        now = time.monotonic()
        if controls != self._controls:
            if self._client is not None:
                self._retired.append((now, self._client))
            self._controls = controls
            self._client = AsyncDbClient(list(controls), timeout=self.timeout) if controls else None
            log.info("DBs now: %s", ", ".join(controls) or "none")
        keep = []
        for t, c in self._retired:
            if now - t > RETIRE_AFTER_S:
                _close(c)
            else:
                keep.append((t, c))
        self._retired = keep

    def _require(self) -> AsyncDbClient:
        if self._client is None:
            raise DbUnavailable("no DB instance is registered for this set")
        return self._client

    async def create(self, record: dict[str, Any]) -> None:
        await self._require().create(record)

    async def create_once(self, record: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """(the record held under its UID, whether this call created it); DbGone if the UID
        was dropped within a TTL."""
        return await self._require().create_once(record)

    async def get(self, uid: str, owner: str | None = None) -> dict | None:
        return await self._require().get(uid, owner)

    async def handed(self, uid: str, owner: str | None = None) -> dict | None:
        return await self._require().handed(uid, owner)

    async def content(self, uid: str, owner: str | None = None) -> tuple[dict, bytes] | None:
        """(record, artefact), None when unknown; raises NotReady (with the record) when it
        exists but is not completed."""
        return await self._require().content(uid, owner)

    async def delete(self, uid: str, owner: str | None = None, forget: bool = False) -> bool:
        return await self._require().delete(uid, owner, forget)

    async def list(self, owner: str | None, after: tuple[float, str] | None, limit: int,
                   order: str) -> tuple[list[dict[str, Any]], bool]:
        return await self._require().list(owner, after, limit, order)

    def close(self) -> None:
        for _, c in self._retired:
            _close(c)
        self._retired = []
        if self._client is not None:
            _close(self._client)
            self._client = None


def _close(client: AsyncDbClient) -> None:
    try:
        client.close()
    except Exception:  # closing is best effort; sockets go away with the process anyway
        log.debug("closing a DB client failed", exc_info=True)
