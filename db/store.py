"""The DB's in-memory result store (DESIGN §7): one record per UID plus its artefact.

A record is a JSON-able dict::

    uid, app, set, status, stage, progress (0-100), created_at, updated_at, completed_at,
    expires_at, error, content_type, bytes, trace   (+ whatever the proxy put in at create,
    e.g. ``deadline`` in ns since epoch, ``params``)

Times are seconds since the epoch (floats from ``clock``), except ``deadline`` which is ns
since the epoch as the proxy stamps it.

Every update goes through :func:`onepiece.db.protocol.merge`, whose rules make replicas
converge whatever order updates reach them in (a property test checks it).

Expiry: ``expires_at`` is *last update + ttl* while a request runs and *completion + ttl*
once it is terminal. Completion time, not creation time, because the TTL is how long an
unfetched result waits for its reader: a generation that took longer than the TTL must
still be fetchable, and a client should get the full TTL to come back for it. A running
record that nobody updates for a whole TTL is abandoned and dropped, unless its deadline is
still ahead: deadlines (set by the proxy) turn stuck requests into ``failed``, so a lost message
is visible, and a request served for longer than the TTL is not lost.

Memory: the store counts artefact bytes plus an estimate of each record (its JSON size plus
a fixed per-record overhead) and raises :class:`StoreFull` when a *new* record or an
artefact would not fit under ``max_bytes`` less a 5% headroom. The headroom is for updates
to records it already holds, which are refused only past ``max_bytes`` itself; a failure
is always recorded (its error text is capped), because it is what tells a client that its
request is lost, and refusing it would turn a visible failure into silence.

Not thread-safe: the DB server touches it from its one loop thread only.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson

from onepiece.db.listing import CreatedIndex, Key
from onepiece.db.protocol import COMPLETED, FAILED, IN_PROGRESS, QUEUED, TERMINAL, check_record, merge

STATUSES = (QUEUED, IN_PROGRESS, COMPLETED, FAILED)
MAX_ERROR_CHARS = 1000  # bounds what a failure adds to a record
DEADLINE_GRACE_S = 0.5  # a DB's verdict on a deadline waits this long (a peer's result gets here first)
RECORD_OVERHEAD = 512  # rough Python dict/str overhead per record, on top of its JSON size


class StoreError(RuntimeError):
    """Base of the store's refusals; its message is what RPC clients see."""


class StoreFull(StoreError):
    """A new record or artefact does not fit under ``max_bytes``: refused, store unharmed."""


class NotFound(StoreError, LookupError):
    """No record for the UID (never existed, fetched, deleted or expired)."""


class NotReady(StoreError, LookupError):
    """The record exists but has no artefact to hand out yet."""


class Gone(StoreError, LookupError):
    """A create-once for a UID that this DB dropped within a TTL, or that another owner holds."""


class InvalidUpdate(StoreError, ValueError):
    """An update that cannot be applied (bad status, progress, types...)."""


@dataclass
class Change:
    """What one applied update did: the server replicates ``record`` (+ ``content`` when the
    artefact was attached by this update) and publishes an event when ``terminal``."""

    record: dict[str, Any]
    content: bytes | None = None
    created: bool = False
    terminal: bool = False  # the status became completed/failed with this update


@dataclass
class Sweep:
    expired: list[str] = field(default_factory=list)
    failed: list[Change] = field(default_factory=list)


class ResultStore:
    def __init__(
        self,
        ttl_s: float,
        max_bytes: int,
        purge_after_fetch_s: float | None = 60.0,
        clock: Callable[[], float] = time.time,
        deadline_grace_s: float = 0.0,
        max_tombstones: int = 100_000,
    ) -> None:
        if ttl_s <= 0 or max_bytes <= 0:
            raise ValueError("ttl_s and max_bytes must be positive")
        self.ttl_s = float(ttl_s)
        self.max_bytes = int(max_bytes)
        # A fetched result goes this long after its first fetch (0: at once; None: at its TTL):
        # a retrieve after the download, or a retried download, still finds it meanwhile.
        self.purge_after_fetch_s = purge_after_fetch_s
        self.clock = clock
        # A deadline verdict waits this long past the deadline, so a result that reached a
        # peer in time has been replicated here before this replica declares it failed.
        self.deadline_grace_s = deadline_grace_s
        self.max_tombstones = max_tombstones
        self._admit_limit = self.max_bytes - self.max_bytes // 20  # new records and artefacts
        self._records: dict[str, dict[str, Any]] = {}
        self._content: dict[str, bytes] = {}
        self._sizes: dict[str, int] = {}
        self._bytes = 0
        # Recently purged/deleted/expired UIDs -> until when late updates for them are ignored,
        # so a slow replica or report cannot resurrect a fetched result as a zombie. Bounded.
        self._tombstones: OrderedDict[str, float] = OrderedDict()
        # Timers, so a sweep costs what is due rather than a scan of every record: one live
        # heap entry per record and kind, (time, uid); entries of dropped records or moved
        # times are recognised as stale when popped, and the heap is rebuilt when they pile up.
        self._expiry_heap: list[tuple[float, str]] = []
        self._expiry_at: dict[str, float] = {}
        self._deadline_heap: list[tuple[float, str]] = []
        self._deadline_at: dict[str, float] = {}
        self._index = CreatedIndex()  # the listing order (db/listing.py)
        # Room held for the videos of running requests, so that a create is refused at once
        # (the proxy answers 503 db_full) rather than accepted, served by every stage and then
        # failed because its video does not fit. Sized from the results held so far, in bytes
        # per pixel-second of video (an MP4's size follows its area and length); none is held
        # until one result has been seen.
        self._reserved: dict[str, int] = {}
        self._reserved_bytes = 0
        self._per_pixel_s: float | None = None

    # ---- reads -----------------------------------------------------------------------------

    def get(self, uid: str) -> dict[str, Any] | None:
        rec = self._records.get(uid)
        return dict(rec) if rec is not None else None

    def content(self, uid: str) -> bytes | None:
        """``uid``'s artefact, if it has one (a read: nothing expires because of it)."""
        return self._content.get(uid)

    def uids(self) -> list[str]:
        """The held uids, copied: a peer's fill walks them over many loop turns."""
        return list(self._records)

    def gone_uids(self) -> list[str]:
        """The uids dropped here within a TTL (their tombstones), copied: a peer's fill walks them
        too, so that a DB back empty from a restart does not take them again."""
        return list(self._tombstones)

    def gone(self, uid: str) -> bool:
        """Whether ``uid`` was held here and dropped (fetched, deleted, expired) within a TTL."""
        return uid in self._tombstones

    def page(self, owner: str | None, after: Key | None, limit: int,
             descending: bool) -> tuple[list[dict[str, Any]], bool]:
        """Up to ``limit`` records after ``after`` (a ``(created_at, uid)`` key) by creation
        time, only ``owner``'s unless it is None, without their traces; and whether more follow."""
        uids, more = self._index.page(owner, after, limit, descending)
        return [{k: v for k, v in self._records[uid].items() if k != "trace"} for uid in uids], more

    def running(self, before: float, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` records not finished yet and created before ``before``, oldest first:
        where each is (uid, app, status, stage), whether an ``Idempotency-Key`` made it and
        whether its proxy marked it handed over (proxy/idempotency.py), nothing of what it holds."""
        recs = sorted((r for r in self._records.values()
                       if r["status"] not in TERMINAL and (r.get("created_at") or 0.0) < before),
                      key=lambda r: r.get("created_at") or 0.0)
        return [{**{k: r.get(k) for k in ("uid", "app", "status", "stage")},
                 "idempotent": bool(r.get("request_hash")), "handed": bool(r.get("handed"))} for r in recs[:limit]]

    def __contains__(self, uid: object) -> bool:
        return uid in self._records

    def __len__(self) -> int:
        return len(self._records)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def stats(self) -> dict[str, Any]:
        by_status = dict.fromkeys(STATUSES, 0)
        for rec in self._records.values():
            by_status[rec["status"]] += 1
        return {
            "records": len(self._records),
            "bytes": self._bytes,
            "max_bytes": self.max_bytes,
            "content_bytes": sum(len(c) for c in self._content.values()),
            "by_status": by_status,
            "tombstones": len(self._tombstones),
        }

    def take_content(self, uid: str) -> tuple[dict[str, Any], bytes]:
        """The record and its artefact; the record then expires ``purge_after_fetch_s`` later."""
        rec = self._records.get(uid)
        if rec is None:
            raise NotFound(f"not found: {uid}")
        if rec["status"] != COMPLETED:
            raise NotReady(f"not ready: {uid} is {rec['status']}")
        data = self._content.get(uid, b"")
        out = dict(rec)
        if self.purge_after_fetch_s == 0:
            self._drop(uid, tombstone=True)
        elif self.purge_after_fetch_s is not None:
            self.expire_by(uid, self.clock() + self.purge_after_fetch_s)
        return out, data

    def expire_by(self, uid: str, at: float) -> bool:
        """Let ``uid`` expire at ``at`` at the latest (a fetch here or on a peer); True if that
        brought its expiry forward."""
        rec = self._records.get(uid)
        if rec is None or not rec["expires_at"] > at:
            return False
        rec["expires_at"] = at
        self._schedule(uid, rec)
        return True

    # ---- writes ----------------------------------------------------------------------------

    def create(self, record: dict[str, Any]) -> Change | None:
        """The proxy's record for a new request (status ``queued`` unless it says otherwise).
        An explicit create clears a tombstone: the proxy owns the UID."""
        if not isinstance(record, dict):
            raise InvalidUpdate("record must be an object")
        upd = dict(record)
        upd.setdefault("status", QUEUED)
        upd.setdefault("progress", 0)
        upd.setdefault("stage", "")
        uid = self._check(upd)
        if upd["status"] in TERMINAL:
            raise InvalidUpdate(f"create: {uid} cannot start {upd['status']}")
        problem = check_record(upd)  # its owner and times are indexed and compared: types checked
        if problem is not None:
            raise InvalidUpdate(f"create: {problem}")
        need = self._video_estimate(upd)
        if need and self._bytes + self._reserved_bytes + need > self._admit_limit:
            raise StoreFull(
                f"store full: {uid}'s video needs about {need} bytes (as the videos held so far), "
                f"{max(self._admit_limit - self._bytes - self._reserved_bytes, 0)} of {self.max_bytes} free "
                f"besides {self._reserved_bytes} held for the {len(self._reserved)} requests running")
        self._tombstones.pop(uid, None)
        return self._apply(upd, local=True)

    def set_status(self, uid: str, status: str, stage: str | None = None, progress: Any = 0,
                   **extra: Any) -> Change | None:
        """A stage's progress report (``status`` message)."""
        if status not in (QUEUED, IN_PROGRESS):
            raise InvalidUpdate(f"status message for {uid} with status {status!r}")
        upd = {**extra, "uid": uid, "status": status, "stage": stage or "", "progress": progress}
        self._check(upd)
        return self._apply(upd, local=True)

    def note(self, uid: str, **fields: Any) -> Change | None:
        """Fields a held, unfinished record gains, its status and progress unchanged (None: not
        held, or finished: its times stay as they are)."""
        rec = self.get(uid)
        if rec is None or rec["status"] in TERMINAL:
            return None
        upd = {**fields, "uid": uid, "status": rec["status"], "stage": rec.get("stage") or "",
               "progress": rec.get("progress") or 0}
        return self._apply(upd, local=True)

    def put_result(self, uid: str, content: bytes, content_type: str | None = None,
                   trace: list | None = None, stage: str | None = None, **extra: Any) -> Change | None:
        """The final artefact (``result`` message): the record becomes ``completed``."""
        content = bytes(content)
        if stage is None and trace and isinstance(trace[-1], dict) and isinstance(trace[-1].get("stage"), str):
            # The stage that produced the artefact: derived from the result itself, so every
            # replica shows the same stage whatever else it heard first.
            stage = trace[-1]["stage"]
        upd = {**extra, "uid": uid, "status": COMPLETED, "progress": 100, "error": None, "bytes": len(content),
               "content_type": content_type or "application/octet-stream", "trace": trace,
               "stage": stage or ""}
        self._check(upd)
        return self._apply(upd, local=True, content=content)

    def fail(self, uid: str, stage: str | None, error: str, **extra: Any) -> Change | None:
        """A failure report (``failed`` message, or the DB's own verdict)."""
        error = str(error) or "failed"
        if len(error) > MAX_ERROR_CHARS:
            error = error[: MAX_ERROR_CHARS - 3] + "..."
        upd = {**extra, "uid": uid, "status": FAILED, "stage": stage or "", "error": error}
        self._check(upd)
        return self._apply(upd, local=True)

    def apply_replica(self, record: dict[str, Any], content: bytes | None = None) -> Change | None:
        """A peer's copy of a record; applied as-is (its timestamps are the origin's)."""
        problem = check_record(record)
        if problem is not None:
            raise InvalidUpdate(f"replica record: {problem}")
        uid = self._check(record)
        if content is not None:
            content = bytes(content)
        if record["status"] == COMPLETED and content is None and record.get("bytes"):
            # Without its artefact a completed copy would promise what it cannot serve.
            raise InvalidUpdate(f"replica of completed {uid} arrived without its content")
        if content is not None and len(content) != record.get("bytes"):
            raise InvalidUpdate(f"replica of {uid}: content is {len(content)} bytes, record says {record.get('bytes')}")
        if uid in self._tombstones:
            return None
        return self._apply(dict(record), local=False, content=content)

    def purge(self, uid: str, tombstone: bool = True) -> bool:
        """Drop ``uid`` (deleted by a client, or fetched/deleted on a peer) and ignore late
        updates for it; True if it was held. Without ``tombstone`` the uid may be created again
        at once (a create that never reached the stages, forgotten so that a retry can)."""
        existed = uid in self._records
        self._drop(uid, tombstone=tombstone)
        return existed

    def sweep(self) -> Sweep:
        """Drop expired records and tombstones; fail running records past their deadline.
        Costs O(due · log n): only timers that are due are looked at."""
        now = self.clock()
        out = Sweep()
        while self._tombstones:  # ordered by insertion, and every tombstone lives ttl_s
            uid, until = next(iter(self._tombstones.items()))
            if until > now:
                break
            del self._tombstones[uid]
        heap = self._deadline_heap
        while heap and heap[0][0] < now:
            due, uid = heapq.heappop(heap)
            if self._deadline_at.get(uid) != due:
                continue  # stale entry
            del self._deadline_at[uid]
            rec = self._records[uid]
            if rec["status"] not in TERMINAL:
                # Where a stage last reported it: it may have left that stage since (a stage
                # reports a request as its worker takes it, not while it waits in the queue).
                stage = rec.get("stage")
                why = f"deadline exceeded; last reported at stage {stage}" if stage else \
                    "deadline exceeded before any stage reported it"
                change = self.fail(uid, stage, why)
                if change is not None:
                    out.failed.append(change)
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            due, uid = heapq.heappop(heap)
            if self._expiry_at.get(uid) != due:
                continue
            expires_at = self._records[uid]["expires_at"]
            verdict = self._deadline_at.get(uid)
            if expires_at <= now and verdict is not None and verdict > now:
                # Still running and its deadline ahead: a TTL shorter than the deadline must not
                # drop a request that is being served (its result would be lost, its proxy's slot
                # held). The deadline's verdict ends it; its result then gets the TTL.
                self._expiry_at[uid] = verdict
                heapq.heappush(heap, (verdict, uid))
            elif expires_at <= now:
                self._drop(uid, tombstone=True)
                out.expired.append(uid)
            else:  # the record was updated since: wait for its new expiry
                self._expiry_at[uid] = expires_at
                heapq.heappush(heap, (expires_at, uid))
        for heap, at in ((self._expiry_heap, self._expiry_at), (self._deadline_heap, self._deadline_at)):
            if len(heap) > 2 * len(at) + 1024:
                heap[:] = [(t, u) for u, t in at.items()]
                heapq.heapify(heap)
        return out

    def _schedule(self, uid: str, rec: dict[str, Any]) -> None:
        """Keep the record's timers no later than its expiry and deadline (both may only be
        postponed lazily; an earlier time, e.g. from a replica, gets a fresh entry)."""
        expires_at = rec["expires_at"]
        current = self._expiry_at.get(uid)
        if current is None or expires_at < current:
            self._expiry_at[uid] = expires_at
            heapq.heappush(self._expiry_heap, (expires_at, uid))
        deadline = rec.get("deadline")
        if (rec["status"] not in TERMINAL and isinstance(deadline, (int, float))
                and not isinstance(deadline, bool)):
            due = deadline / 1e9 + self.deadline_grace_s
            if self._deadline_at.get(uid) != due:
                self._deadline_at[uid] = due
                heapq.heappush(self._deadline_heap, (due, uid))
        elif uid in self._deadline_at:
            del self._deadline_at[uid]

    # ---- internals -------------------------------------------------------------------------

    def _check(self, upd: dict[str, Any]) -> str:
        uid = upd.get("uid")
        if not isinstance(uid, str) or not uid:
            raise InvalidUpdate("update has no uid")
        if upd.get("status") not in STATUSES:
            raise InvalidUpdate(f"{uid}: unknown status {upd.get('status')!r}")
        p = upd.get("progress", 0)
        if p is not None:
            if isinstance(p, bool) or not isinstance(p, (int, float)) or p != p:
                raise InvalidUpdate(f"{uid}: progress {p!r} is not a number")
            upd["progress"] = int(min(max(p, 0), 100))
        if upd["status"] == QUEUED:
            # Nothing has run yet. Keeping it 0 is what makes "stage follows the highest
            # progress" (rule 1) hold whatever order queued and running reports arrive in.
            upd["progress"] = 0
        stage = upd.get("stage")
        if stage is not None and not isinstance(stage, str):
            raise InvalidUpdate(f"{uid}: stage {stage!r} is not a string")
        if upd.get("trace") is not None and not isinstance(upd["trace"], list):
            raise InvalidUpdate(f"{uid}: trace is not a list")
        return uid

    def _blank(self, uid: str, now: float) -> dict[str, Any]:
        return {"uid": uid, "app": None, "set": None, "status": QUEUED, "stage": "", "progress": 0,
                "created_at": now, "updated_at": now, "completed_at": None, "expires_at": now + self.ttl_s,
                "error": None, "content_type": None, "bytes": 0, "trace": []}

    def _apply(self, upd: dict[str, Any], local: bool, content: bytes | None = None) -> Change | None:
        uid = upd["uid"]
        if local and uid in self._tombstones:
            return None  # a late report for a request already fetched/deleted/expired
        now = self.clock()
        if local:
            # Local updates carry this DB's clock; replicas keep their origin's timestamps.
            upd["updated_at"] = now
            upd["expires_at"] = now + self.ttl_s
            if upd["status"] in TERMINAL:
                upd["completed_at"] = now
        old = self._records.get(uid)
        if old is None:
            upd = {**self._blank(uid, now), **{k: v for k, v in upd.items() if v is not None}}
        out = merge(old, upd)
        try:
            size = len(orjson.dumps(out)) + RECORD_OVERHEAD
        except TypeError as e:
            raise InvalidUpdate(f"{uid}: record is not JSON-able: {e}") from None
        attach = (content is not None and out["status"] == COMPLETED
                  and (old is None or old["status"] != COMPLETED))
        if attach:
            size += len(content)
        else:
            size += len(self._content.get(uid, b""))
        grown = size - self._sizes.get(uid, 0)
        if old is None or attach:
            limit: int | None = self._admit_limit
        elif out["status"] == FAILED:
            limit = None
        else:
            limit = self.max_bytes
        if limit is not None and grown > 0 and self._bytes + grown > limit:
            raise StoreFull(
                f"store full: {uid} needs {size} bytes, {max(limit - self._bytes, 0)} of "
                f"{self.max_bytes} free"
            )
        if out == old and not attach:
            return None
        self._records[uid] = out
        self._index.put(uid, out.get("created_at"), out.get("owner"))
        self._schedule(uid, out)
        if attach:
            self._content[uid] = content
        self._sizes[uid] = size
        self._bytes += grown
        self._account(uid, out, content if attach else None)
        terminal = out["status"] in TERMINAL and (old is None or old["status"] != out["status"])
        return Change(dict(out), content if attach else None, created=old is None, terminal=terminal)

    @staticmethod
    def _pixel_s(rec: dict[str, Any]) -> float | None:
        """A video's area times its length (from the ``size`` and ``seconds`` the proxy records)."""
        size, seconds = rec.get("size"), rec.get("seconds")
        if isinstance(seconds, str):  # the proxy records the API's form, a string such as "0.5"
            try:
                seconds = float(seconds)
            except ValueError:
                return None
        if not isinstance(size, str) or not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
            return None
        w, _, h = size.partition("x")
        if not (w.isdigit() and h.isdigit()) or not 0 < seconds < math.inf:
            return None
        return int(w) * int(h) * float(seconds)

    def _video_estimate(self, rec: dict[str, Any]) -> int:
        px = self._pixel_s(rec)
        return 0 if px is None or self._per_pixel_s is None else int(px * self._per_pixel_s)

    def _account(self, uid: str, out: dict[str, Any], content: bytes | None) -> None:
        """Hold room for a running request's video; free it when it ends; learn from a result."""
        if out["status"] in TERMINAL:
            self._release(uid)
            px = self._pixel_s(out)
            if content is not None and px:
                seen = len(content) / px
                self._per_pixel_s = seen if self._per_pixel_s is None else 0.75 * self._per_pixel_s + 0.25 * seen
        elif uid not in self._reserved:
            need = self._video_estimate(out)
            if need:
                self._reserved[uid] = need
                self._reserved_bytes += need

    def _release(self, uid: str) -> None:
        self._reserved_bytes -= self._reserved.pop(uid, 0)

    def _drop(self, uid: str, tombstone: bool) -> None:
        self._release(uid)
        if self._records.pop(uid, None) is not None:
            self._content.pop(uid, None)
            self._bytes -= self._sizes.pop(uid, 0)
            self._expiry_at.pop(uid, None)  # their heap entries are now stale
            self._deadline_at.pop(uid, None)
            self._index.remove(uid)
        if tombstone:
            self._tombstones[uid] = self.clock() + self.ttl_s
            self._tombstones.move_to_end(uid)
            while len(self._tombstones) > self.max_tombstones:
                self._tombstones.popitem(last=False)
