"""What travels to and from a DB instance: the contract between stages, proxies and DBs.

Writes arrive on the DB's data address (any transport) as messages whose header ``kind`` is:

- ``status``: ``{uid, kind, status: queued|in_progress, stage, progress}`` (progress 0-100);
- ``result``: ``{uid, kind, trace, content_type}`` with part ``content`` (the artefact);
- ``failed``: ``{uid, kind, stage, error}``;
- ``replica``: ``{uid, kind, record}`` (+ ``content`` part if any): a peer's copy;
- ``purge``: ``{uid, kind}``: a peer dropped the record (fetched or deleted).

Reads and the proxy's synchronous ``create`` go to the DB's control address (RPC ops, see
``db/server.py``): ``create``, ``get``, ``content``, ``delete``, ``stats``.
Terminal transitions are published on the DB's events address as ``[b"done", json]``.

A record is a JSON object; ``merge`` makes replicas converge whatever order updates arrive in:
a record never moves back from a terminal status, and progress never goes down.
"""

from __future__ import annotations

from typing import Any

QUEUED, IN_PROGRESS, COMPLETED, FAILED = "queued", "in_progress", "completed", "failed"
TERMINAL = frozenset({COMPLETED, FAILED})
_RANK = {QUEUED: 0, IN_PROGRESS: 1, COMPLETED: 2, FAILED: 2}

CONTENT = "content"  # the part name of a final artefact


def merge(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The record after applying update ``new`` to ``old`` (both JSON records)."""
    if old is None:
        return dict(new)
    if old["status"] in TERMINAL:
        return old
    if _RANK[new["status"]] < _RANK[old["status"]]:
        return old
    out = {**old, **{k: v for k, v in new.items() if v is not None}}
    if new["status"] == old["status"]:
        out["progress"] = max(old.get("progress", 0), new.get("progress", 0))
    return out


def progress_of(stage_index: int, n_stages: int, fraction: float) -> int:
    """Overall progress 0-99 while running: stage position plus the fraction done inside it."""
    fraction = min(max(fraction, 0.0), 1.0)
    return min(99, int(100 * (stage_index + fraction) / max(n_stages, 1)))
