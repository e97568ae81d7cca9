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

import bisect
import collections
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from onepiece.sched.core import Drop, Part, Run, SchedCore, chunk_steps
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
        self._cancelled: set[int] = set()  # events taken back, skipped without moving the clock

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> int:
        """Call ``fn(*args)`` at ``t``; returns the event's id (``cancel``)."""
        seq = next(self._seq)
        heapq.heappush(self._heap, (t, seq, fn, args))
        return seq

    def cancel(self, event: int) -> None:
        """Take back an event ``at`` gave that has not run yet. The clock does not move to it: a
        run's last time is that of its last event that happened."""
        self._cancelled.add(event)

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
        cancelled = self._cancelled
        while True:
            # (time, order given) is unique: a comparison never reaches the callables
            if queue and (not heap or queue[0] < heap[0]):
                if queue[0][0] > until:
                    return
                self.now, _, fn, args = first()
            elif heap:
                if heap[0][0] > until:
                    return
                if cancelled and heap[0][1] in cancelled:
                    cancelled.discard(pop(heap)[1])
                    continue
                self.now, _, fn, args = pop(heap)
            else:
                return
            fn(*args)


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
        # id -> [work left (alone seconds), ranks, when it started, its end's event, done(elapsed), work]
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
        loop = self.loop
        for cid, c in self._running.items():
            if c[3] is not None:
                loop.cancel(c[3])  # the end pushed before this change is stale now
            c[3] = loop.at(now + max(0.0, c[0]) / rate, self._end, cid)

    def start(self, work: float, ranks: int, done: Callable[[float], None]) -> int:
        """Run a chunk of ``work`` alone seconds on ``ranks`` ranks; ``done(elapsed)`` when it
        ends. Returns the chunk's id."""
        self._catch_up()
        cid = next(self._ids)
        self._running[cid] = [work, ranks, self.loop.now, None, done, work]
        self._ranks += ranks
        self._reschedule()
        return cid

    def done(self, cid: int) -> float:
        """Alone seconds of chunk ``cid``'s work done so far."""
        self._catch_up()
        c = self._running[cid]
        return c[5] - c[0]

    def resize(self, cid: int, work: float) -> None:
        """Chunk ``cid`` is ``work`` alone seconds in all now (it was cut short)."""
        self._catch_up()
        c = self._running[cid]
        c[0] += work - c[5]
        c[5] = work
        self._reschedule()

    def _end(self, cid: int) -> None:
        c = self._running[cid]
        self._catch_up()
        del self._running[cid]
        self._ranks -= c[1]
        self._reschedule()
        c[4](self.loop.now - c[2])


@dataclass
class _Flight:
    """A worker's run in flight, as priced: what a Cut or a Drop shortens."""

    run: Run
    passed: list
    first: dict  # uid -> when its first step started, before this run
    start: float  # when the run was sent
    t0: float  # when its first step starts, were it alone (after the decision's overhead, preparing admitted requests)
    steps: list  # (who advanced, alone seconds) per step
    key: str | None  # its one part's cost key (None: parts on a group's ranks, which a worker cuts short only at its next run)
    left: dict  # one part's uid -> steps it had left when the run was sent
    gone: set = field(default_factory=set)  # of those, the ones dropped since
    event: int | None = None  # its end's, on the loop (None: on a host); a cut takes it back
    chunk: int | None = None  # its chunk on the host
    longest: float | None = None  # alone seconds of its slowest part (several parts: they run side by side)
    end: float = 0.0  # ends() as last priced
    limit: int = 0  # the steps it may run: the run's, or where a Cut ends it

    def ends(self) -> float:
        """When it ends, were it alone (summed step by step from ``t0``: the same figure whatever
        the run's length)."""
        return self.t0 + self.longest if self.longest is not None else _summed(self.t0, self.steps)


def _summed(t: float, steps: list) -> float:
    """``t`` plus each step's seconds, one at a time (as a worker's clock runs)."""
    for _, dt in steps:
        t += dt
    return t


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
        self._busy = 0.0  # worker-seconds of the runs that ended
        self._flights: dict[str, _Flight] = {}
        self._wake = math.inf  # when a decision is due that nothing else would cause (Decision.wake)
        self._wake_event: int | None = None
        self._expiry: dict[str, int] = {}  # uid -> the event that decides as its deadline passes
        for i in range(workers):
            core.worker_up(f"w{i}", ranks)

    @property
    def busy_s(self) -> float:
        """Worker-seconds spent in runs so far (those in flight up to now)."""
        now = self.loop.now
        return self._busy + sum(now - f.start for f in self._flights.values())

    def add(self, r: Request) -> None:
        r.arrival = self.loop.now
        self.core.add(r)
        e = r.deadline if r.expires is None else r.expires
        if e is not None and self.core.spec.drop_expired:
            # its deadline passes: decide then (the core drops it where it is, a worker at its
            # next step boundary), as a stage's shell, which decides every turn, does within one
            self._expiry[r.uid] = self.loop.at(math.nextafter(e, math.inf), self._expire, r.uid)
        self.decide()

    def _expire(self, uid: str) -> None:
        del self._expiry[uid]
        self.decide()

    def _left(self, uid: str) -> None:
        event = self._expiry.pop(uid, None)
        if event is not None:
            self.loop.cancel(event)

    def cancel(self, uid: str) -> bool:
        if uid not in self.core.requests:
            return False
        drop = self.core.cancel(uid)
        self._left(uid)
        if drop is not None:
            self._shorten(drop.worker, set(drop.uids))
        self.decide()
        return True

    def decide(self) -> None:
        d = self.core.schedule(self.loop.now)
        if d.wake != self._wake:  # a held run's promise runs out then: cut it there
            if self._wake_event is not None:
                self.loop.cancel(self._wake_event)
            self._wake, self._wake_event = d.wake, None if d.wake == math.inf else self.loop.at(d.wake, self._woken)
        for r in d.expired:
            self._left(r.uid)
            self.on_end(r.uid, "expired", r, r.started)
        for cmd in d.commands:
            if isinstance(cmd, Run):
                self._execute(cmd, d.passed)
            elif isinstance(cmd, Drop):
                self._shorten(cmd.worker, set(cmd.uids))
            else:
                self._shorten(cmd.worker, every=cmd.every)

    def _woken(self) -> None:
        self._wake, self._wake_event = math.inf, None
        self.decide()

    def _price(self, key: str, left: Sequence[tuple[str, int]], steps: int) -> list[tuple[Sequence[str], float]]:
        """(who advanced, seconds) of each of ``steps`` steps of a batch of ``key`` whose members
        have ``left`` steps to go: members leave as they finish, so later steps cost less."""
        out: list[tuple[Sequence[str], float]] = []
        jitter = self.jitter
        if len(left) == 1:
            uids, n = (left[0][0],), min(steps, left[0][1])
            dt = self.cost(key, 1) if n > 0 else 0.0
            if jitter is None:
                return [(uids, dt)] * n
            for _ in range(n):
                out.append((uids, dt * jitter()))
            return out
        todo, dts = [n for _, n in left], {}
        for _ in range(steps):
            live = [u for (u, _), n in zip(left, todo) if n > 0]
            if not live:
                break
            dt = dts.get(len(live))
            if dt is None:
                dt = dts[len(live)] = self.cost(key, len(live))
            out.append((live, dt if jitter is None else dt * jitter()))
            todo = [n - 1 for n in todo]
        return out

    def _execute(self, run: Run, passed: list) -> None:
        """Price the run now; its effects land when it ends (the core sees them then)."""
        reqs = self.core.requests
        now = self.loop.now
        first = {u: reqs[u].started for u in run.uids}
        t0 = now + self.overhead_s
        if self.fixed is not None and run.admit:
            t0 += sum(self.fixed(reqs[u].key) for u in run.admit)
        if len(run.parts) == 1 and len(run.parts[0].ranks) == self.core.workers[run.worker].ranks:
            p = run.parts[0]
            key = at_dop(reqs[p.uids[0]].key, len(p.ranks))
            left = {u: reqs[u].left for u in p.uids}
            f = _Flight(run, passed, first, now, t0, self._price(key, list(left.items()), p.steps), key, left,
                        limit=p.steps)
        else:  # parts side by side, the run as long as its slowest (a worker drops from them at the next run)
            steps: list[tuple[Sequence[str], float]] = []
            end = t0
            for p in run.parts:
                mine = self._price(at_dop(reqs[p.uids[0]].key, len(p.ranks)), [(u, reqs[u].left) for u in p.uids],
                                   p.steps)
                steps += mine
                end = max(end, _summed(t0, mine))
            f = _Flight(run, passed, first, now, t0, steps, None, {}, longest=end - t0)
        self._flights[run.worker] = f
        self._launch(f)  # (sets f.end)

    def _launch(self, f: _Flight) -> None:
        end = f.end = f.ends()
        if self.host is None:
            if f.event is not None:
                self.loop.cancel(f.event)
            f.event = self.loop.at(end, self._landed, f, end - f.start)
        elif f.chunk is None:
            f.chunk = self.host.start(end - f.start, sum(len(p.ranks) for p in f.run.parts),
                                      lambda elapsed: self._landed(f, elapsed))
        else:
            self.host.resize(f.chunk, end - f.start)

    def _shorten(self, wid: str, dropped: set[str] | None = None, every: int = 1) -> None:
        """Cut (``dropped`` None) or drop ``dropped`` from ``wid``'s run at its next step
        boundary, as a worker does: a cut where a chunk of ``every`` steps ends, a drop before the
        next step starts; the rest of the run is priced again without the dropped ones."""
        f = self._flights.get(wid)
        if f is None or f.key is None:  # (a group's parts: dropped ones leave at the run's end)
            return
        done = self.loop.now - f.start if self.host is None else self.host.done(f.chunk)
        k, t = 0, f.t0 - f.start
        while k < len(f.steps) and (t < done - 1e-9 or (dropped is None and (k == 0 or k % every))):
            t += f.steps[k][1]
            k += 1
        if k >= len(f.steps):
            return
        kept = f.steps[:k]
        if dropped is None:
            f.limit = k
        else:
            f.gone |= dropped
            ran = collections.Counter(u for live, _ in kept for u in live)
            left = [(u, n - ran[u]) for u, n in f.left.items() if u not in f.gone and n - ran[u] > 0]
            kept += self._price(f.key, left, f.limit - k) if left else []
        if kept == f.steps:
            return
        f.steps = kept
        self._launch(f)

    def _landed(self, f: _Flight, elapsed: float) -> None:
        del self._flights[f.run.worker]
        run, steps = f.run, f.steps
        alone = f.end - f.start
        if self.host is not None and alone > 0 and elapsed != alone:
            # each step took what it would alone, stretched as the whole run was: the core's cost
            # model measures the stretched steps, as a stage's does
            stretch = elapsed / alone
            steps = [(live, dt * stretch) for live, dt in steps]
        if f.key is not None and len(steps) != run.steps:  # cut short, or priced again after a drop
            run = Run(run.worker, run.uids, len(steps), run.admit, (Part(run.parts[0].ranks, run.uids, len(steps)),))
        self._busy += elapsed
        if self.on_chunk is not None:
            self.on_chunk(f.start, self.loop.now if self.host is None else f.start + elapsed, run, f.passed)
        self._finish_chunk(run, steps, f.first)

    def _finish_chunk(self, run: Run, steps: list, first: dict) -> None:
        core = self.core
        reqs = core.requests
        for live, dt, first_of_batch, times in chunk_steps(steps):
            if len(live) > 1 or live[0] not in reqs:
                live = [u for u in live if u in reqs]  # cancelled or expired meanwhile
            core.stepped(live, dt, first=first_of_batch, times=times)
            for u in live:
                r = reqs[u]
                if r.steps == r.done:
                    core.finished(u, self.loop.now)
                    self._left(u)
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
        # heard of as they end (a cut ends a run early): kept in the order they started
        i = bisect.bisect_right(self.trace, start, key=lambda c: c[0])
        self.trace.insert(i, (start, run.worker, run.uids, run.steps))
        self.runs.insert(i, run)


def request(uid: str, key: str = "64x64x9/cfg/L64", steps: int = 10, deadline: float | None = None,
            priority: int = 0, app: str = "t2v", batchable: bool = True) -> Request:
    """A request for the virtual stage (its arrival is set when it arrives)."""
    return Request(uid, app, key, steps, 0.0, deadline, priority, batchable)
