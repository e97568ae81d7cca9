"""Which member processes the NM declared dead and whose requests it reported failed: the fence
that keeps a dead instance that comes back from finishing them.

A stage instance stopped (SIGSTOP, swapped out, starved) longer than the dead limit is dropped,
and the reaper reports what it held as ``failed`` (nm/reaper.py): the client is told, the proxy
frees the slot. The process itself does not know; when it runs again it registers again under
its name and, left alone, finishes that work, and ``completed`` beats ``failed`` in the DB
(db/protocol.py ``merge``): a terminal status that changes, work nobody waits for.

So the NM remembers, per process token (drawn once by each member process, nm/identity.py; it
lives as long as the process, also across a new ZooKeeper member id), the UIDs it reaped from
it. That process's heartbeats are answered with the fence alone (``{"fenced": ...}``, the
heartbeat not counted) until it acknowledges it (``fenced=<id>`` in a heartbeat); a registration
(on ZooKeeper it registers first) carries it too. The member drops those requests (queued, at a
worker, awaiting hand-on, still in its socket) and only then is heard again. Exact UIDs, not
"whatever it holds": what reached it after it registered again is live. A restarted NM
remembers nothing and fences nobody, which is right: it reaped nothing, so what its members
hold is still live and must complete.

Bounded: at most ``MAX_FENCES`` processes of ``MAX_UIDS`` each, each kept ``keep_s`` (the longest
deadline a request may have, so that by then the instance has expired whatever it still held;
nm/server.py), the oldest forgotten first.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from onepiece.nm.reaper import MAX_UIDS

MAX_FENCES = 256  # processes remembered: more than a set's instances dying at once


@dataclass
class Fence:
    id: str  # what the member acknowledges (a fence that grew is told again under a new id)
    instance: str  # the id it had when it was dropped
    reason: str  # why it was declared dead
    until: float  # forgotten then (the NM's monotonic clock)
    uids: dict[str, None] = field(default_factory=dict)  # reaped, in order, without duplicates

    def reply(self) -> dict[str, Any]:
        """What the member is told (nm/protocol.py ``FenceReply``)."""
        return {"id": self.id, "instance": self.instance, "reason": self.reason, "uids": list(self.uids)}


class Fences:
    def __init__(self, keep_s: float, limit: int = MAX_FENCES, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_s, self.limit, self._clock = keep_s, limit, clock
        self._fences: OrderedDict[str, Fence] = OrderedDict()  # process token -> fence, oldest first

    def add(self, process: str, instance: str, reason: str, uids: Iterable[str]) -> Fence | None:
        """Remember that ``process`` (as ``instance``) was reaped of ``uids``; one already fenced
        gains them. None when there is nothing to fence (no token: it cannot be told apart)."""
        uids = list(uids)
        if not process or not uids:
            return None
        self.prune()
        fence = self._fences.pop(process, None) or Fence("", instance, reason, 0.0)
        fence.uids.update(dict.fromkeys(uids))
        while len(fence.uids) > MAX_UIDS:
            fence.uids.pop(next(iter(fence.uids)))
        # A new id: a member that acknowledged the smaller fence is told the grown one.
        fence.id, fence.until = secrets.token_hex(8), self._clock() + self.keep_s
        self._fences[process] = fence  # re-inserted last: the dict's order is the age
        while len(self._fences) > self.limit:
            self._fences.popitem(last=False)
        return fence

    def of(self, process: str) -> Fence | None:
        """The fence ``process`` has not acknowledged yet, if any."""
        self.prune()
        return self._fences.get(process) if process else None

    def acknowledged(self, process: str, fence_id: str | None) -> bool:
        """``process`` dropped what fence ``fence_id`` named: forget it (True). An older id (the
        fence grew since) changes nothing."""
        fence = self._fences.get(process) if process else None
        if fence is None or fence_id != fence.id:
            return False
        del self._fences[process]
        return True

    def prune(self) -> None:
        now = self._clock()
        while self._fences and next(iter(self._fences.values())).until < now:
            self._fences.popitem(last=False)

    def __len__(self) -> int:
        return len(self._fences)
