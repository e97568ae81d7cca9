"""Stages on a virtual clock: the scheduling core and a policy driven by simulated workers whose
steps take what a cost function says. The tests of the policies run on one (``VirtualStage``),
and the trace-driven simulator (``onepiece sim``, DESIGN §12) wires many (``VirtualInstance``)
into workflows on one ``EventLoop``: the same core, no copy of it.

A worker executes a ``Run`` as the runtime's worker does: it admits the new requests, then
advances each part (a batch on a block of its ranks) step by step, members leaving as they
finish (so later steps of a chunk are cheaper) and dropped ones leaving at the next step
boundary. A collaboration group's parts run side by side on their ranks, each its own steps:
the chunk lasts as long as its slowest part. Workers on one ``Host`` share its cores: a chunk
priced at its table's figures then lasts longer while more ranks compute than the host has cores.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from onepiece.sched.core import Run, SchedCore, chunk_steps
from onepiece.sched.keys import at_dop
from onepiece.sched.policy import Request

StepCost = Callable[[str, int], float]  # (key, batch size) -> seconds of one step
# (uid, status: completed | expired, the request as the core held it, the time its first step started)
OnEnd = Callable[[str, str, Request, "float | None"], None]
# (start, end, run, the requests its decision passed over): one chunk a worker ran, for a schedule trace
OnChunk = Callable[[float, float, Run, list], None]


class EventLoop:
    """A virtual clock and its pending events, run in time order (ties in the order pushed)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        # Events given in time order up front (a trace's arrivals): kept out of the heap, which
        # then holds only what is in flight, and merged with it by (time, order given).
        self._queue: collections.deque[tuple[float, int, Callable, tuple]] = collections.deque()
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def at_in_order(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """As ``at``, for an event no earlier than the last one given this way."""
        if self._queue and t < self._queue[-1][0]:
            raise ValueError(f"at_in_order: {t} is before the last event given so ({self._queue[-1][0]})")
        self._queue.append((t, next(self._seq), fn, args))

    def next_in_order(self) -> tuple[float, int] | None:
        """The time of the next event given by ``at_in_order``, and how many such are left."""
        return (self._queue[0][0], len(self._queue)) if self._queue else None

    def run(self, until: float = float("inf")) -> None:
        heap, queue, pop, first = self._heap, self._queue, heapq.heappop, self._queue.popleft
        while True:
            # (time, order given) is unique: a comparison never reaches the callables
            if queue and (not heap or queue[0] < heap[0]):
                if queue[0][0] > until:
                    return
                self.now, _, fn, args = first()
            elif heap:
                if heap[0][0] > until:
                    return
                self.now, _, fn, args = pop(heap)
            else:
                return
            fn(*args)

    def __len__(self) -> int:
        return len(self._heap) + len(self._queue)


class Host:
    """Cores that several workers share: a CPU host whose stages' processes all compute on it,
    or one GPU that several stages' workers use. The chunks running on it progress together, each
    at ``min(1, cores / ranks computing)`` of its alone speed (processor sharing: every rank a
    thread the cores serve in turn, and a collaboration group's ranks slowed alike, as they wait
    for each other at every step). A chunk's work is its alone duration; as chunks start and end
    the others' ends move."""

    def __init__(self, loop: EventLoop, cores: float) -> None:
        if not cores > 0:
            raise ValueError(f"a host needs cores > 0 (got {cores!r})")
        self.loop, self.cores = loop, cores
        # id -> [work left (alone seconds), ranks, when it started, its end's version, done(elapsed)]
        self._running: dict[int, list] = {}
        self._ids = itertools.count()
        self._ranks = 0
        self._since = 0.0  # when the running chunks' work left was last brought up to date

    def _rate(self) -> float:
        return min(1.0, self.cores / self._ranks) if self._ranks else 1.0

    def _catch_up(self) -> None:
        now = self.loop.now
        done = (now - self._since) * self._rate()
        if done > 0:
            for c in self._running.values():
                c[0] -= done
        self._since = now

    def _reschedule(self) -> None:
        rate, now = self._rate(), self.loop.now
        for cid, c in self._running.items():
            c[3] += 1  # the end pushed before this change is stale now
            self.loop.at(now + max(0.0, c[0]) / rate, self._end, cid, c[3])

    def start(self, work: float, ranks: int, done: Callable[[float], None]) -> None:
        """Run a chunk of ``work`` alone seconds on ``ranks`` ranks; ``done(elapsed)`` when it ends."""
        self._catch_up()
        self._running[next(self._ids)] = [work, ranks, self.loop.now, 0, done]
        self._ranks += ranks
        self._reschedule()

    def _end(self, cid: int, version: int) -> None:
        c = self._running.get(cid)
        if c is None or c[3] != version:
            return
        self._catch_up()
        del self._running[cid]
        self._ranks -= c[1]
        self._reschedule()
        c[4](self.loop.now - c[2])


class VirtualInstance:
    """One stage instance: a scheduling core and its workers, on ``loop``. ``on_end`` hears of
    every request that leaves it (completed or expired); a cancelled one leaves silently."""

    def __init__(self, loop: EventLoop, core: SchedCore, cost: StepCost, workers: int = 1,
                 overhead_s: float = 0.0, on_end: OnEnd | None = None, on_chunk: OnChunk | None = None,
                 name: str = "", ranks: int = 1, fixed: Callable[[str], float] | None = None,
                 jitter: Callable[[], float] | None = None, host: Host | None = None) -> None:
        self.loop, self.core, self.cost, self.overhead_s = loop, core, cost, overhead_s
        self.host = host  # cores shared with other instances' workers (None: each worker a device of its own)
        self.fixed = fixed  # key -> seconds a request costs besides its steps, paid as it is admitted
        self.jitter = jitter  # a factor on each step's cost (mean 1): steps that vary as measured ones do
        self.on_end = on_end or (lambda *a: None)
        self.on_chunk = on_chunk
        self.name = name
        self.busy_s = 0.0  # worker-seconds spent in chunks
        for i in range(workers):
            core.worker_up(f"w{i}", ranks)

    def add(self, r: Request) -> None:
        r.arrival = self.loop.now
        self.core.add(r)
        self.decide()

    def cancel(self, uid: str) -> bool:
        if uid not in self.core.requests:
            return False
        self.core.cancel(uid)
        self.decide()
        return True

    def decide(self) -> None:
        d = self.core.schedule(self.loop.now)
        for r in d.expired:
            self.on_end(r.uid, "expired", r, r.started)
        for cmd in d.commands:
            if isinstance(cmd, Run):
                self._execute(cmd, d.passed)

    def _execute(self, run: Run, passed: list) -> None:
        """Price the chunk now; its effects land when it ends (the core sees them then)."""
        reqs = self.core.requests
        now = self.loop.now
        first = {u: reqs[u].started for u in run.uids}
        start = t = now + self.overhead_s
        if self.fixed is not None and run.admit:
            start = t = start + sum(self.fixed(reqs[u].key) for u in run.admit)
        steps: list[tuple[Sequence[str], float]] = []  # (who advanced, seconds) per step
        for p in run.parts:
            # A batch is of one key (the core checks it): its step costs depend on how many are left.
            uids = p.uids
            key = at_dop(reqs[uids[0]].key, len(p.ranks))
            end = start
            if len(uids) == 1:
                n = min(p.steps, reqs[uids[0]].left)
                dt = self.cost(key, 1) if n > 0 else 0.0
                jitter = self.jitter
                for _ in range(n):
                    t_step = dt if jitter is None else dt * jitter()
                    end += t_step
                    steps.append((uids, t_step))
            else:
                left, dts = [reqs[u].left for u in uids], {}
                for _ in range(p.steps):
                    live = [u for u, n in zip(uids, left) if n > 0]
                    if not live:
                        break
                    dt = dts.get(len(live))
                    if dt is None:
                        dt = dts[len(live)] = self.cost(key, len(live))
                    if self.jitter is not None:
                        dt *= self.jitter()
                    end += dt
                    steps.append((live, dt))
                    left = [n - 1 for n in left]
            t = max(t, end)
        if self.host is not None:
            alone = t - now

            def done(elapsed: float) -> None:
                # each step took what it would alone, stretched as the whole chunk was: the
                # core's cost model measures the stretched steps, as a stage's does
                stretch = elapsed / alone if alone > 0 else 1.0
                self._ran(now, now + elapsed, run, passed)
                self._finish_chunk(run, [(live, dt * stretch) for live, dt in steps] if stretch != 1.0 else steps,
                                   first)
            self.host.start(alone, sum(len(p.ranks) for p in run.parts), done)
            return
        self._ran(now, t, run, passed)
        self.loop.at(t, self._finish_chunk, run, steps, first)

    def _ran(self, start: float, end: float, run: Run, passed: list) -> None:
        self.busy_s += end - start
        if self.on_chunk is not None:
            self.on_chunk(start, end, run, passed)

    def _finish_chunk(self, run: Run, steps: list, first: dict) -> None:
        core = self.core
        reqs = core.requests
        for live, dt, first_of_batch in chunk_steps(steps):
            if len(live) > 1 or live[0] not in reqs:
                live = [u for u in live if u in reqs]  # cancelled or expired meanwhile
            core.stepped(live, dt, first=first_of_batch)
            for u in live:
                r = reqs[u]
                if r.steps == r.done:
                    core.finished(u, self.loop.now)
                    self.on_end(u, "completed", r, first.get(u))
        core.idle(run.worker)
        if self.overhead_s:
            core.note_overhead(self.overhead_s)
        self.decide()


@dataclass
class Outcome:
    uid: str
    arrival: float
    end: float
    status: str  # completed | expired | cancelled | failed
    first_step: float | None = None


@dataclass
class VirtualStage:
    """One instance alone, requests submitted straight to it: what the policy tests drive."""

    core: SchedCore
    cost: StepCost
    workers: int = 1
    overhead_s: float = 0.0  # added to every chunk (decision + IPC)
    ranks: int = 1  # per worker: a collaboration group's size
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    trace: list[tuple[float, str, tuple[str, ...], int]] = field(default_factory=list)  # (start, worker, uids, steps)
    runs: list[Run] = field(default_factory=list)  # the same chunks as the core sent them (parts, DoPs)

    def __post_init__(self) -> None:
        self.loop = EventLoop()
        self.instance = VirtualInstance(self.loop, self.core, self.cost, self.workers, self.overhead_s,
                                        on_end=self._ended, on_chunk=self._chunk, ranks=self.ranks)
        self._arrivals: dict[str, float] = {}

    @property
    def now(self) -> float:
        return self.loop.now

    def submit(self, at: float, r: Request) -> None:
        self.loop.at(at, self._arrive, r)

    def cancel_at(self, at: float, uid: str) -> None:
        self.loop.at(at, self._cancel, uid)

    def run(self, until: float = float("inf")) -> dict[str, Outcome]:
        """Process events until none is left or ``until``; returns the outcomes by uid."""
        self.loop.run(until)
        return self.outcomes

    def _arrive(self, r: Request) -> None:
        self._arrivals[r.uid] = self.loop.now
        self.instance.add(r)

    def _cancel(self, uid: str) -> None:
        if self.instance.cancel(uid):
            self._end(uid, "cancelled")

    def _ended(self, uid: str, status: str, r: Request, first: float | None) -> None:
        self._end(uid, status, first)

    def _end(self, uid: str, status: str, first: float | None = None) -> None:
        if uid not in self.outcomes:
            self.outcomes[uid] = Outcome(uid, self._arrivals.get(uid, self.loop.now), self.loop.now, status, first)

    def _chunk(self, start: float, end: float, run: Run, passed: list) -> None:
        self.trace.append((start, run.worker, run.uids, run.steps))
        self.runs.append(run)


def request(uid: str, key: str = "64x64x9/cfg/L64", steps: int = 10, deadline: float | None = None,
            priority: int = 0, app: str = "t2v", batchable: bool = True) -> Request:
    """A request for the virtual stage (its arrival is set when it arrives)."""
    return Request(uid, app, key, steps, 0.0, deadline, priority, batchable)
