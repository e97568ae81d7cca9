"""One stage on a virtual clock: the scheduling core and a policy driven by simulated workers
whose steps take what a cost function says. The tests of the policies run on it, and it is the
seed of the trace-driven simulator (DESIGN §12): the same core, no copy of it.

A worker executes a ``Run`` as the runtime's worker does: it admits the new requests, then
advances the batch step by step, members leaving as they finish (so later steps of a chunk
are cheaper) and dropped ones leaving at the next step boundary.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable

from onepiece.sched.core import Drop, Run, SchedCore
from onepiece.sched.policy import Request

StepCost = Callable[[str, int], float]  # (key, batch size) -> seconds of one step


@dataclass
class Outcome:
    uid: str
    arrival: float
    end: float
    status: str  # completed | expired | cancelled | failed
    first_step: float | None = None


@dataclass
class VirtualStage:
    core: SchedCore
    cost: StepCost
    workers: int = 1
    overhead_s: float = 0.0  # added to every chunk (decision + IPC)
    now: float = 0.0
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    trace: list[tuple[float, str, tuple[str, ...], int]] = field(default_factory=list)  # (start, worker, uids, steps)
    _events: list = field(default_factory=list)
    _seq: itertools.count = field(default_factory=itertools.count)
    _arrivals: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i in range(self.workers):
            self.core.worker_up(f"w{i}")

    def submit(self, at: float, r: Request) -> None:
        heapq.heappush(self._events, (at, next(self._seq), "arrive", r))

    def cancel_at(self, at: float, uid: str) -> None:
        heapq.heappush(self._events, (at, next(self._seq), "cancel", uid))

    def run(self, until: float = float("inf")) -> dict[str, Outcome]:
        """Process events until none is left or ``until``; returns the outcomes by uid."""
        self._decide()
        while self._events and self._events[0][0] <= until:
            self.now, _, kind, what = heapq.heappop(self._events)
            if kind == "arrive":
                what.arrival = self.now
                self._arrivals[what.uid] = self.now
                self.core.add(what)
            elif kind == "cancel" and what in self.core.requests:
                self.core.cancel(what)
                self._end(what, "cancelled")
            elif kind == "done":
                self._finish_chunk(*what)
            self._decide()
        return self.outcomes

    def _end(self, uid: str, status: str, first: float | None = None) -> None:
        if uid not in self.outcomes:
            self.outcomes[uid] = Outcome(uid, self._arrivals.get(uid, self.now), self.now, status, first)

    def _decide(self) -> None:
        d = self.core.schedule(self.now)
        for r in d.expired:
            self._end(r.uid, "expired")
        for cmd in d.commands:
            if isinstance(cmd, Run):
                self._execute(cmd)

    def _execute(self, run: Run) -> None:
        """Price the chunk now; its effects land when it ends (the core sees them then)."""
        self.trace.append((self.now, run.worker, run.uids, run.steps))
        left = {u: self.core.requests[u].left for u in run.uids}
        first = {u: self.core.requests[u].started for u in run.uids}
        t, steps = self.now + self.overhead_s, []
        for _ in range(run.steps):
            live = [u for u in run.uids if left[u] > 0]
            if not live:
                break
            key = self.core.requests[live[0]].key
            dt = self.cost(key, len(live))
            t += dt
            steps.append((live, dt, t))
            for u in live:
                left[u] -= 1
        heapq.heappush(self._events, (t, next(self._seq), "done", (run, steps, first)))

    def _finish_chunk(self, run: Run, steps: list, first: dict) -> None:
        for live, dt, _ in steps:
            live = [u for u in live if u in self.core.requests]  # cancelled or expired meanwhile
            self.core.stepped(live, dt)
            for u in live:
                r = self.core.requests[u]
                if r.left == 0:
                    self.core.finished(u)
                    self._end(u, "completed", first.get(u))
        self.core.idle(run.worker)
        if self.overhead_s:
            self.core.note_overhead(self.overhead_s)


def request(uid: str, key: str = "64x64x9/cfg/L64", steps: int = 10, deadline: float | None = None,
            priority: int = 0, app: str = "t2v", batchable: bool = True) -> Request:
    """A request for the virtual stage (its arrival is set when it arrives)."""
    return Request(uid, app, key, steps, 0.0, deadline, priority, batchable)
