"""Requests that no live stage instance holds: those an instance took with it when it died while
no node manager heard it (the embedded NM was restarting, or no primary was elected on
ZooKeeper). The NM that knew its holdings is gone, the new one never heard of it, so its death
reported nothing (nm/reaper.py), and its requests stayed ``in_progress`` until their deadline.

Now and then the NM asks its DBs which requests are not finished yet (``running``, db/protocol.py)
and compares them with what its live stage instances say they hold. A request unheld at two
looks at least ``gap_s`` apart (wider than a heartbeat and a hand-over between stages, when a
request is in flight between two holders) is reported failed through the reaper, which reads
its record once more first.

The NM cannot see every request a live stage has: one handed to a stage whose queue is full
waits unheld in its transport's buffer (the stage reads on only as its queue drains; one that
still loads its workers reads nothing), and one received since a late heartbeat is in no list
yet. While a stage of the set is like that, the set is not looked at, and what earlier looks
found unheld starts over; so it does after a pause in the looks (no DB routes, no primacy). An
idempotent create that its proxy never marked handed over is left to the client's retry, which
hands it over (proxy/idempotency.py): its proxy died before the hand-over, nobody ever held it.

``Unheld`` is that decision, with no sockets and no clocks (nm/elastic.py's pattern);
``OrphanSweep`` is its thread, so DB round trips never hold up the NM's loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

REASON = "held by no live instance"


@dataclass
class Unheld:
    gap_s: float
    # uid -> when a look first found it running and unheld (only those of the latest look)
    since: dict[str, float] = field(default_factory=dict)
    last: float | None = None  # the latest look

    def look(self, now: float, running: Mapping[str, Mapping[str, Any]], held: Container[str]) -> list[str]:
        """``running``: the requests the DBs show unfinished, created before the holdings
        ``held`` were reported; returns those unheld at every look for ``gap_s`` or more (each
        once: it is forgotten then). Looks come every half gap: after a longer pause, two looks
        far apart would judge a request by two moments, and a request in a hand-over is briefly
        unheld at each, so what was found unheld starts over."""
        if self.last is not None and now - self.last > self.gap_s:
            self.since = {}
        self.last = now
        since, out = {}, []
        for uid, rec in running.items():
            if uid in held or awaits_retry(rec):
                continue
            first = self.since.get(uid, now)
            if now - first >= self.gap_s:
                out.append(uid)
            else:
                since[uid] = first
        self.since = since
        return out


def awaits_retry(rec: Mapping[str, Any]) -> bool:
    """An idempotent create stored but never handed over: a retry with its key hands it over."""
    return rec.get("status") == "queued" and bool(rec.get("idempotent")) and not rec.get("handed")


@dataclass
class Look:
    """What the NM's loop hands the sweep: a set's DBs and what its stage instances hold."""

    set: str
    dbs: list[dict[str, str]]
    held: set[str]
    created_before: float  # seconds since the epoch: younger requests may not be held yet
    blind: bool = False  # a stage's queue is full, or its holdings are late: do not judge now


class OrphanSweep:
    """Runs the looks on its own thread and hands what ``Unheld`` finds to ``report(set, dbs,
    {uid: record})`` (the NM's reaper)."""

    def __init__(self, gap_s: float, report: Any, timeout: float = 0.5) -> None:
        self.gap_s, self.report, self.timeout = gap_s, report, timeout
        self._unheld: dict[str, Unheld] = {}
        self._looks: queue.Queue[Look | None] = queue.Queue(maxsize=16)
        self._thread = threading.Thread(target=self._run, name="nm-orphans", daemon=True)
        self._thread.start()

    def submit(self, look: Look) -> None:
        try:
            self._looks.put_nowait(look)
        except queue.Full:  # the DBs are slow: this look is skipped, a later one comes
            pass

    def _run(self) -> None:
        while (look := self._looks.get()) is not None:
            try:
                self._look(look)
            except Exception:  # one failed look must not end the sweep
                log.exception("looking for unheld requests of set %s failed", look.set)

    def _look(self, look: Look) -> None:
        from onepiece.db.client import DbClient

        unheld = self._unheld.setdefault(look.set, Unheld(self.gap_s))
        if look.blind:
            unheld.since.clear()
            return
        reader = DbClient([d["control"] for d in look.dbs], timeout=self.timeout)
        try:
            running = reader.running(look.created_before)
        finally:
            reader.close()
        lost = unheld.look(time.monotonic(), running, look.held)
        if lost:
            log.warning("%d request(s) of set %s are running in the DBs but held by no live instance: "
                        "reporting them failed", len(lost), look.set)
            self.report(look.set, look.dbs, {u: running[u] for u in lost})

    def close(self, timeout: float = 2.0) -> None:
        try:
            self._looks.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)
