"""Reports the requests a dead stage instance held as ``failed``, so clients see why their
request stopped instead of ``in_progress`` until its deadline.

Each stage instance lists the UIDs it holds (received, queued, at a worker, or finished but not
yet handed on) in every heartbeat (nm/holdings.py). When the NM decides the instance is dead
(its ZooKeeper member node vanished, or, embedded, it went silent), it hands that last list to
the reaper, with what its senders delivered to it after that heartbeat (nm/deliveries.py), less
what a live instance says it holds now; the reaper, for each UID:

1. reads the record from the set's DBs (placement order, as any reader does) and leaves it
   alone if it is terminal already, or has moved on to a later stage of its application (the
   instance handed it on after its last heartbeat);
2. otherwise sends the DB the same ``failed`` data message a stage sends when it fails a
   request itself (db/protocol.py), to the first DB in the UID's placement order that takes it;
   the DB replicates it like any other update.

A UID delivered to it that no sender reported (its sender died too) is still failed by the DB's
deadline sweep. If the request did get through after all, ``completed`` beats ``failed`` in the
DB's merge, so a late result still wins.

Runs on its own thread with a bounded job queue, so DB round trips never hold up the NM loop.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

from onepiece.config import Workflow
from onepiece.db import protocol
from onepiece.db.placement import order_dbs

log = logging.getLogger(__name__)

MAX_UIDS = 4096  # per dead instance: more than any scheduler queue + mailbox holds
READ_TRIES = 3  # reads of one record before its failure is left to the DB's deadline sweep


@dataclass
class Job:
    instance: str
    stage: str
    uids: list[str]
    dbs: list[dict[str, str]]
    reason: str
    error: str | None = None  # the failure's text, when not that of an instance's death


class Reaper:
    def __init__(self, workflow: Workflow, max_jobs: int = 256, timeout: float = 0.5) -> None:
        self.workflow, self.timeout = workflow, timeout
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_jobs)
        self.failed = 0  # UIDs reported failed (for tests and status)
        self._thread = threading.Thread(target=self._run, name="nm-reaper", daemon=True)
        self._thread.start()

    def submit(self, instance: str, stage: str | None, uids: list[str], dbs: list[dict[str, str]],
               reason: str, error: str | None = None) -> bool:
        """Queue a dead instance's last known UIDs; False if there is nothing to do or no room.
        ``error``: the failure's text (default: that ``instance`` died holding them)."""
        if not uids or not stage or not dbs:
            return False
        try:
            self._jobs.put_nowait(Job(instance, stage, list(uids)[:MAX_UIDS], list(dbs), reason, error))
            return True
        except queue.Full:
            log.error("reaper queue full: the %d requests %s held are left to the deadline sweep",
                      len(uids), instance)
            return False

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._reap(job)
            except Exception:  # one bad job must not end the reaper
                log.exception("reaping %s failed", job.instance)

    def _moved_on(self, rec: dict[str, Any], stage: str) -> bool:
        """Whether the record shows the request past ``stage`` (or done)."""
        if rec.get("status") in protocol.TERMINAL:
            return True
        app = self.workflow.applications.get(rec.get("app") or "")
        at = rec.get("stage") or ""
        if app is None or at not in app.stages or stage not in app.stages:
            return False
        return app.stages.index(at) > app.stages.index(stage)

    def _read(self, reader: Any, uid: str, instance: str) -> dict[str, Any] | None:
        """The UID's record, or None if no DB has it. A DB slow to answer is asked again (a
        loaded machine's DB may miss one short timeout); only when none answers after
        READ_TRIES does the request go to the deadline sweep."""
        from onepiece.db.client import DbError

        for attempt in range(READ_TRIES):
            try:
                return reader.state(uid)  # status and stage: the NM is no proxy (db/protocol.py PROXY_OPS)
            except DbError as e:
                log.warning("uid=%s: no DB answered while reaping %s (try %d of %d): %s",
                            uid, instance, attempt + 1, READ_TRIES, e)
        return None

    def _reap(self, job: Job) -> None:
        from onepiece.db.client import DbClient
        from onepiece.transport import registry
        from onepiece.transport.base import TransportError
        from onepiece.transport.message import Message

        reader = DbClient([d["control"] for d in job.dbs], timeout=self.timeout)
        senders: dict[str, Any] = {}
        done = 0
        try:
            for uid in job.uids:
                rec = self._read(reader, uid, job.instance)
                if rec is None or self._moved_on(rec, job.stage):
                    continue
                error = job.error or f"{job.reason}: instance {job.instance} of stage {job.stage} died while holding the request"
                msg = Message({"uid": uid, "kind": "failed", "stage": job.stage, "error": error})
                for db in order_dbs(uid, job.dbs):
                    try:
                        sender = senders.get(db["data"]) or senders.setdefault(db["data"], registry.connect(db["data"]))
                        sender.send(msg, timeout=self.timeout)
                        done += 1
                        log.info("uid=%s failed: %s", uid, error)
                        break
                    except (TransportError, ValueError) as e:
                        log.warning("uid=%s: DB %s did not take the failure: %s", uid, db["data"], e)
        finally:
            reader.close()
            for s in senders.values():
                s.close()
        self.failed += done
        log.info("reaped %s: %d of the %d requests it held reported failed", job.instance, done, len(job.uids))

    def close(self, timeout: float = 2.0) -> None:
        try:
            self._jobs.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)
