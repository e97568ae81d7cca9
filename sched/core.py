"""The scheduling core of a stage (DESIGN §6.1): request states, workers, and the decision, with
no sockets and no clock. The runtime's shell (stage/scheduler.py) feeds it what arrives and
what workers report and sends the commands it returns; a simulator drives the same object on a
virtual clock. The contract is vLLM's: ``add``, ``schedule``, update from the workers' output.

A request is *waiting* (no worker has its state), *resident* (a worker holds its state; a
request never leaves the worker that holds it) or *running* (in the step chunk that worker is
executing now). ``schedule(now)`` first drops what expired, then serves aged requests (so no
policy can starve one), then asks the policy for the other idle workers; it checks every batch
the policy returns and turns it into commands:

- ``Run(worker, uids, steps, admit, parts)``: admit the ``admit`` requests (send their
  messages; the worker prepares their state), then advance each part (a batch on a block of
  the worker's ranks) its ``steps`` steps, one forward pass each, the parts side by side (a
  collaboration group's worker has several ranks and may run several batches at once, each at
  its own degree of parallelism; any other worker runs one part on its one rank);
- ``Drop(worker, uids)``: free these states (cancelled or expired); a worker applies it at its
  next step boundary, even in the middle of a chunk;
- ``Cut(worker, every)``: end the run in flight at its next step boundary that ends a chunk
  of ``every`` steps counted from its start, and report, so that the core decides again there.

A run of one request on a one-rank worker starts *held*, with all of its steps, wherever
deciding again at each chunk's end would only go on with it: always when the decision leaves
nothing free (every request of the stage in a run: nothing else could advance), and, while
requests wait, for as long as the policy promises (``Policy.stable_until``) that a decision over
the same waiting requests would start the same request again, and no waiting request ages or
expires. A held run costs one decision and one round of IPC where chunks cost one a chunk, and
a simulator one event where it had one a step (under contention most decisions only go on
with the request a worker holds). Once anything the promise rests on changes (a request
arrives, leaves or is left free by another worker, the cost model's figures change, a worker
comes or goes, a state's size is measured, the promise runs out: ``Decision.wake``), the core
cuts the run where the chunk it was held from would have ended, and decides there again: a
policy sees the choices it would have seen at every chunk's end. (Exactly so where step times
are steady and nothing batches; a held run's steps reach the cost model only as it ends, so
where they move a later decision may read other figures than chunk by chunk, and a batch
size's retry once its figure goes stale may come a few steps later. Nothing is held on a stage
with a collaboration group, nor where a compatible request waits for a key whose batch figure
goes stale: ``CostModel.goes_stale``.)
"""

from __future__ import annotations

import collections
import itertools
import math
import operator
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from onepiece.sched.costs import CostModel
from onepiece.sched.keys import at_dop
from onepiece.sched.options import DEADLINE_ORDERED, ScheduleSpec
from onepiece.sched.policies import make_policy
from onepiece.sched.policy import Batch, Policy, RankedPolicy, Request, View, Worker, build_batches
from onepiece.sched.ranks import Ranks, dops, place

CHUNK_OVERHEAD = 0.03  # decision + IPC per chunk, at most this share of the chunk's compute
MAX_CHUNK = 64
OVERHEAD_WINDOW = 16  # chunks whose overhead's median is the figure
PASSED_MAX = 64  # requests a decision says it passed over (SchedCore.explain)
HOLD_MARGIN_S = 1e-9  # a held run's promise ends this much early: its thresholds are compared in floats
UNKNOWN_STANDALONE_S = 1.0  # what aging assumes of a request nothing comparable was measured for


@dataclass(frozen=True)
class Part:
    ranks: Ranks
    uids: tuple[str, ...]
    steps: int


@dataclass(frozen=True)
class Run:
    worker: str
    uids: tuple[str, ...]  # every part's
    steps: int  # the longest part's
    admit: tuple[str, ...] = ()
    parts: tuple[Part, ...] = ()


@dataclass(frozen=True)
class Drop:
    worker: str
    uids: tuple[str, ...]


@dataclass(frozen=True)
class Cut:
    worker: str
    every: int = 1  # the chunk the run was opened from: it ends after a multiple of these steps


# A request a decision passed over: (uid, seconds to spare were it to run alone from then on at
# its fastest DoP, None without a deadline or a cost; steps left; aged)
Passed = tuple[str, "float | None", int, bool]


@dataclass
class Decision:
    commands: list[Run | Drop | Cut] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)  # dropped: their deadline passed
    # The earliest time a run it holds must be cut although nothing else happens (a promise runs
    # out): a shell that decides only when something happens asks again then.
    wake: float = math.inf
    # With ``SchedCore.explain``, where a chunk started: the requests that could have advanced and
    # did not, and how they stood (the "why" beside a schedule log's "what").
    passed: list[Passed] = field(default_factory=list)


@dataclass
class CoreStats:
    batches: int = 0  # Runs sent
    batched: int = 0  # requests over all Runs (mean batch size = batched / batches)
    steps: int = 0  # request-steps done
    preempted: int = 0  # times a resident request was passed over for another batch on its worker
    cancelled: int = 0
    expired: int = 0
    aged: int = 0  # requests served ahead of the policy because they waited too long
    rejected: int = 0  # batches a policy returned that the core refused
    # Requests that left (finished or expired; with the time given, ``finished(uid, now)``),
    # and of those the late ones: past their deadline here although they could have made it
    # alone when they arrived (one that came too late to make it is not this stage's miss).
    # The NM's elastic policy reads the share over a window as this stage's SLO risk.
    left: int = 0
    late: int = 0


@dataclass
class _Worker(Worker):
    previous: tuple[str, ...] = ()  # its last run's requests
    open: int = 0  # running a held run that no Cut has ended yet: the steps of the chunk it was held from
    # what holding it rests on: (the requests left free then, the cost model's version, the
    # per-chunk overhead, the core's epoch, until when the policy's promise lasts); None: that
    # nothing is free
    holds: tuple | None = None
    # each of them -> its part's cost key (at the part's DoP): steps are still reported after
    # members finished
    cost_keys: dict[str, str] = field(default_factory=dict)


_arrival = operator.attrgetter("arrival")


def chunk_steps(steps: Iterable[tuple[Sequence[str], float]]) -> Iterator[tuple[Sequence[str], float, bool, int]]:
    """A chunk's steps as ``SchedCore.stepped`` takes them: (uids, seconds, first, times),
    ``first`` for the first step of each batch in the chunk (what the cost model counts as a
    run), ``times`` the same batch at the same seconds that many steps in a row (told in one
    call: none of its members can finish before the last of them)."""
    seen: set[tuple[str, ...]] = set()
    for (uids, seconds), same in itertools.groupby(steps, key=lambda s: (tuple(s[0]), s[1])):
        yield uids, seconds, uids not in seen, sum(1 for _ in same)
        seen.add(uids)


class SchedCore:
    def __init__(self, spec: ScheduleSpec, costs: CostModel | None = None, policy: Policy | None = None) -> None:
        self.spec = spec
        self.max_batch = spec.max_batch or 1
        self.policy = policy or make_policy(spec.policy)
        self.costs = costs if costs is not None else CostModel()
        self.requests: dict[str, Request] = {}
        self.workers: dict[str, _Worker] = {}
        self.overhead_s = 0.0  # measured per chunk: decision + IPC, the median of the latest
        self._overheads: collections.deque[float] = collections.deque(maxlen=OVERHEAD_WINDOW)
        # [seconds, chunks] of that overhead since the start: what a benchmark differences over
        # one trace (the moving figure above is the quiet end of a run, not its busy middle)
        self.overhead_total = [0.0, 0]
        self.stats = CoreStats()
        self.rejections: collections.deque[str] = collections.deque(maxlen=32)  # why, for logs and tests
        self._bytes: collections.OrderedDict[str, int] = collections.OrderedDict()  # state size per key
        # bumped as a state's size is measured or a worker comes or goes: what memory and which
        # workers a plan counts with may have moved (a held run rests on it)
        self._epoch = 0
        self._offered = [1]  # the DoPs the workers offer (1 unless a worker is a collaboration group)
        # standalone_s and share_s per (key, steps[, batchable]), valid while the cost model's
        # version, the overhead and the DoPs offered stay what they were (the simulator asks at
        # every decision, for the same few shapes).
        self._memo: dict[tuple, float | None] = {}
        self._memo_stamp: tuple = ()
        self.explain = False  # fill each Decision's ``passed`` (a schedule log reads it; it costs a lookup each)

    # --- requests -------------------------------------------------------------------------------
    def add(self, r: Request) -> None:
        if r.uid in self.requests:
            raise ValueError(f"request {r.uid} is already in the stage")
        self.requests[r.uid] = r

    def waiting(self) -> int:
        return sum(1 for r in self.requests.values() if r.worker is None)

    def resident(self, worker: str | None = None) -> list[Request]:
        return [r for r in self.requests.values() if r.worker is not None and worker in (None, r.worker)]

    def cancel(self, uid: str) -> Drop | None:
        """Forget ``uid``; the command that frees its state, if a worker holds it."""
        r = self._remove(uid)
        if r is None:
            return None
        self.stats.cancelled += 1
        return Drop(r.worker, (uid,)) if r.worker is not None else None

    def _remove(self, uid: str) -> Request | None:
        r = self.requests.pop(uid, None)
        if r is not None and r.worker is not None:
            w = self.workers.get(r.worker)
            if w is not None:
                w.resident.discard(uid)
                w.free_bytes += r.nbytes
        return r

    # --- workers --------------------------------------------------------------------------------
    def worker_up(self, wid: str, ranks: int = 1) -> None:
        """A worker (re)started: empty and idle; ``ranks``: a collaboration group's size."""
        self.workers[wid] = _Worker(wid, idle=True, free_bytes=self.spec.resident_bytes, ranks=max(1, ranks))
        self._offered = dops(max(w.ranks for w in self.workers.values()))
        self._memo_stamp = ()
        self._epoch += 1

    def worker_gone(self, wid: str) -> list[Request]:
        """A worker died: the requests whose state it held, now forgotten (the shell fails them)."""
        self.workers.pop(wid, None)
        self._offered = dops(max((w.ranks for w in self.workers.values()), default=1))
        self._memo_stamp = ()
        self._epoch += 1
        lost = [r for r in self.requests.values() if r.worker == wid]
        for r in lost:
            del self.requests[r.uid]
        return lost

    # --- what workers report --------------------------------------------------------------------
    def admitted(self, wid: str, uid: str, nbytes: int) -> None:
        """The worker prepared ``uid``'s state, which takes ``nbytes``."""
        r = self.requests.get(uid)
        if r is None or r.worker != wid:
            return
        w = self.workers.get(wid)
        if w is not None:
            w.free_bytes += r.nbytes - nbytes
        r.nbytes = nbytes
        self._epoch += 1
        self._bytes.pop(r.key, None)
        self._bytes[r.key] = nbytes
        while len(self._bytes) > 256:
            self._bytes.popitem(last=False)

    def stepped(self, uids: Sequence[str], seconds: float, measure: bool = True, first: bool = True,
                times: int = 1) -> None:
        """One forward pass advanced ``uids`` (one batch, one key) by a step in ``seconds``
        (``times`` such passes in a row: what as many calls would leave); ``measure``: a sample
        for the cost model (not a warm-up); ``first``: the chunk's first step of this batch
        (``CostModel.observe``)."""
        if not uids:
            return
        head, n = uids[0], len(uids)
        key = None
        for w in self.workers.values():
            key = w.cost_keys.get(head)
            if key is not None:
                break
        if key is not None and measure:
            self.costs.observe(key, n, seconds, first, times)
        share = seconds / n
        requests = self.requests
        for u in uids:
            r = requests.get(u)
            if r is not None:
                done = r.done + times
                r.done = done if done < r.steps else r.steps
                for _ in range(times):
                    r.device_s += share
        self.stats.steps += n * times

    def finished(self, uid: str, now: float | None = None) -> Request | None:
        """``uid`` is done (its result left the worker), at ``now`` if known: then it counts as
        one that left, on time or late (``CoreStats``)."""
        r = self._remove(uid)
        if r is not None and now is not None:
            self._left(r, now)
        return r

    def _left(self, r: Request, now: float) -> None:
        self.stats.left += 1
        if r.deadline is not None and now > r.deadline and r.arrival + (self.standalone_s(r) or 0.0) <= r.deadline:
            self.stats.late += 1

    def failed(self, uid: str) -> Request | None:
        return self._remove(uid)

    def idle(self, wid: str) -> None:
        """The worker ended the command it was running."""
        w = self.workers.get(wid)
        if w is not None:
            w.idle, w.open, w.holds = True, 0, None
        for r in self.requests.values():
            if r.worker == wid:
                r.running = False

    def note_overhead(self, seconds: float) -> None:
        """Decision and IPC time a chunk cost beyond its compute (measured by the shell)."""
        if seconds >= 0:
            # A median, as for steps (sched/costs.py): one chunk that spanned a stall of the
            # process (a SIGSTOP of 12 s) put a moving average at 1.2 s for minutes, and the
            # chunks it sizes at the maximum. (Steady figures, as the simulator's: no sort.)
            window = self._overheads
            window.append(seconds)
            if seconds != self.overhead_s or window.count(seconds) != len(window):
                self.overhead_s = statistics.median(window)
            self.overhead_total[0] += seconds
            self.overhead_total[1] += 1

    # --- estimates ------------------------------------------------------------------------------
    def est_bytes(self, r: Request) -> int:
        b = self._bytes.get(r.key)
        if b is not None:
            return b
        return max(self._bytes.values()) if self._bytes else 0

    def chunk(self, key: str, batch: int) -> int:
        """Steps per chunk: as configured, else the fewest that keep the measured per-chunk
        overhead under CHUNK_OVERHEAD of the chunk's compute."""
        if self.spec.chunk_steps:
            return self.spec.chunk_steps
        t = self.costs.step_s(key, batch)
        if not t or not self.overhead_s:
            return 1
        return max(1, min(MAX_CHUNK, math.ceil(self.overhead_s / (CHUNK_OVERHEAD * t))))

    def _memo_valid(self) -> dict[tuple, float | None]:
        stamp = (self.costs, self.costs.version, self.overhead_s)
        if stamp != self._memo_stamp:
            self._memo.clear()
            self._memo_stamp = stamp
        return self._memo

    def _memoized(self, k: tuple, compute: Callable[[Request], float | None], r: Request) -> float | None:
        memo = self._memo_valid()
        try:
            return memo[k]
        except KeyError:
            t = memo[k] = compute(r)
            return t

    def standalone_s(self, r: Request) -> float | None:
        """Seconds ``r`` takes alone on an idle worker, at its fastest DoP: its steps, its
        preparing and finishing, and the decision and IPC of each chunk."""
        return self._memoized((r.key, r.steps), self._standalone_s, r)

    def _standalone_s(self, r: Request) -> float | None:
        offered = self._offered
        if len(offered) == 1:  # the common case, kept cheap: the simulator asks this at every decision
            t = self.costs.step_s(r.key, 1)
        else:
            t = min((t for d in offered if (t := self.costs.step_s(at_dop(r.key, d), 1)) is not None), default=None)
        if t is None:
            return None
        return t * r.steps + self.costs.fixed_s(r.key) + math.ceil(r.steps / self._chunk_of(r, 1)) * self.overhead_s

    def batches(self, r: Request) -> tuple[tuple[int, int], ...]:
        """(DoP, batch size) for each DoP the workers offer: the largest batch ``r``'s key sustains
        there now, what its share is priced at."""
        cap = self.max_batch if r.batchable else 1
        return tuple((d, self.policy.sustained(self.costs, at_dop(r.key, d), cap)) for d in self._offered)

    def share_s(self, r: Request, batches: tuple[tuple[int, int], ...] | None = None) -> float | None:
        """Worker seconds ``r`` takes at ``batches`` (default: the batch sizes its key sustains
        now), at the DoP that uses a group's ranks best (``d`` of a worker's ``n`` ranks for ``t``
        seconds is ``t·d/n`` of the worker): what the stage's sustained rate follows from."""
        at = self.batches(r) if batches is None else batches
        return self._memoized((r.key, r.steps, at), lambda r: self._share_s(r, at), r)

    def _share_s(self, r: Request, at: tuple[tuple[int, int], ...]) -> float | None:
        ranks = self._offered[-1]  # the largest group's size
        best = None
        for d, b in at:
            key = at_dop(r.key, d)
            t = self.costs.step_s(key, b)
            if t is not None:
                chunks = math.ceil(r.steps / self._chunk_of(r, b))
                share = (t * r.steps + chunks * self.overhead_s) / b * d / ranks
                best = share if best is None else min(best, share)
        return None if best is None else best + self.costs.fixed_s(r.key)

    def _chunk_of(self, r: Request, batch: int) -> int:
        return r.steps if self.policy.name == "fcfs" else self.chunk(r.key, batch)

    # --- the decision ---------------------------------------------------------------------------
    def schedule(self, now: float) -> Decision:
        out = Decision([], [])
        requests = self.requests
        if self.spec.drop_expired:
            for r in [r for r in requests.values()
                      if (e := r.deadline if r.expires is None else r.expires) is not None and e < now]:
                self._remove(r.uid)
                self.stats.expired += 1
                self._left(r, now)
                out.expired.append(r)
                if r.worker is not None:
                    out.commands.append(Drop(r.worker, (r.uid,)))
        aging, memo = self.spec.aging, self._memo_valid()
        # A deadline-first policy serves a request by its deadline (target) while it can still make
        # it: aged before then, a request with a far deadline overtook those with near ones, which
        # the request monitor had admitted against their deadlines (most of them then failed).
        by_deadline = self.policy.name in DEADLINE_ORDERED
        free = []  # what may advance: not in a chunk now
        for r in requests.values():
            if not r.aged:
                alone = memo.get((r.key, r.steps), memo)  # standalone_s(r), without a call when known
                if alone is memo:
                    alone = self.standalone_s(r)
                alone = alone or UNKNOWN_STANDALONE_S
                if now - r.arrival > aging * alone and not (
                        by_deadline and r.deadline is not None and now + alone <= r.deadline):
                    r.aged = True
                    self.stats.aged += 1
            if not r.running:
                free.append(r)
        idle = [w for w in self.workers.values() if w.idle]
        if not free or not idle:
            self._recheck(out, now, free)
            return out
        free.sort(key=_arrival)
        candidates = free
        aged = [r for r in free if r.aged]
        batches: list[Batch] = []
        if aged:
            view = self._view(now, free, idle)
            # The aged lead; who joins them is still the policy's call (a batch that saves no
            # device time would hold every other request back for nothing).
            join = self.policy.may_join if isinstance(self.policy, RankedPolicy) else lambda *_: True
            batches = build_batches(view, aged + [r for r in free if not r.aged], join,
                                    whole=getattr(self.policy, "whole", False), leaders=len(aged))
            used = {b.worker for b in batches} | {u for b in batches for u in b.uids}
            idle = [w for w in idle if w.id not in used]
            free = [r for r in free if r.uid not in used]
        if idle and free:
            batches += self.policy.plan(self._view(now, free, idle))
        per_worker: dict[str, list[Batch]] = {}
        for b in batches:
            per_worker.setdefault(b.worker, []).append(b)
        runs = []
        for wid, bs in per_worker.items():
            cmd = self._start(wid, bs, now)
            if cmd is not None:
                runs.append(cmd)
        left = [r for r in candidates if not r.running]
        self._recheck(out, now, left)
        if not getattr(self.policy, "whole", False):  # (a whole run is all its steps already)
            runs = [self._hold(c, now, left, out) for c in runs]
        out.commands += runs
        if self.explain and (started := {u for c in runs for u in c.uids}):
            out.passed = self._passed(now, candidates, started)
        return out

    def _recheck(self, out: Decision, now: float, left: list[Request]) -> None:
        """Cut the held runs whose ground moved: ``left`` are the requests free after this
        decision."""
        free = None
        for w in self.workers.values():
            if not w.open:
                continue
            h = w.holds
            if not left:  # nothing else could advance: it runs on open
                w.holds = None
                continue
            if h is not None:
                if free is None:
                    free = frozenset([r.uid for r in left])
                if (h[0] == free and h[1] == self.costs.version and h[2] == self.overhead_s and h[3] == self._epoch
                        and now < h[4]):
                    out.wake = min(out.wake, h[4])
                    continue
            out.commands.append(Cut(w.id, w.open))
            w.open, w.holds = 0, None

    def _hold(self, run: Run, now: float, left: list[Request], out: Decision) -> Run:
        """``run`` with all of its steps, held (module doc), if it is one request's on one rank
        and a decision at each of its chunk's ends would only go on with it."""
        w = self.workers[run.worker]
        if w.ranks != 1 or len(run.uids) != 1:
            # A batch is decided again at every chunk's end: its members' slack at the batched
            # step, and a batch size being tried, which its own steps judge, can split it. A
            # collaboration group's parts step in lockstep and are not cut.
            return run
        r = self.requests[run.uids[0]]
        steps = r.left
        if steps <= run.steps:
            return run
        holds = None
        if left:
            until = self._stable_until(w, r, run.steps, now, left)
            step = self.costs.step_s(r.key, 1)
            if step is None or until <= now + run.steps * step:  # nothing gained before its first chunk ends
                return run
            holds = (frozenset([x.uid for x in left]), self.costs.version, self.overhead_s, self._epoch, until)
            out.wake = min(out.wake, until)
        w.open, w.holds = run.steps, holds
        return Run(run.worker, run.uids, steps, run.admit, (Part(run.parts[0].ranks, run.uids, steps),))

    def _stable_until(self, w: _Worker, r: Request, chunk: int, now: float, left: list[Request]) -> float:
        """Until when a decision at ``w``'s chunk's end over the requests ``left`` free would
        start ``r`` again on ``w`` alone for a chunk of ``chunk`` steps (``now``: no promise)."""
        if len(self._offered) > 1:
            # a collaboration group going idle changes the DoPs every request is priced at, and
            # nothing that a hold rests on says so
            return now
        if self.max_batch > 1 and r.batchable and self.costs.goes_stale(r.key) and any(
                x.batchable and x.key == r.key for x in left):
            # a batch size measured for this key is tried again once enough steps ran alone, and
            # a held run's steps reach the cost model only as it ends
            return now
        rs = left + [r]
        if any(x.aged for x in rs):
            return now
        rs.sort(key=_arrival)
        view = View(now, rs, [Worker(w.id, True, w.free_bytes, set(w.resident), w.ranks)], self.costs,
                    self.max_batch, self.chunk, self.est_bytes, set(w.previous))
        until = self.policy.stable_until(view, r)  # (asked first: most promise nothing, or forever)
        if until <= now or self.policy.plan(view) != [Batch(w.id, (r.uid,), chunk)]:
            return now
        # ... and no request expires or, of those waiting, ages before then (the core's own
        # rules: an aged one is served first; ``r``, aged, would still lead on its worker)
        aging, by_deadline = self.spec.aging, self.policy.name in DEADLINE_ORDERED
        for x in rs:
            t = math.inf
            if x is not r:
                alone = self.standalone_s(x) or UNKNOWN_STANDALONE_S
                t = x.arrival + aging * alone
                if by_deadline and x.deadline is not None:
                    t = max(t, x.deadline - alone)
            if self.spec.drop_expired and (e := x.deadline if x.expires is None else x.expires) is not None:
                t = min(t, e)
            until = min(until, t)
        return until - HOLD_MARGIN_S

    def _passed(self, now: float, candidates: list[Request], started: set[str]) -> list[Passed]:
        # the longest-waiting ones (candidates come in arrival order): a decision's cost and a
        # log line stay bounded however long the queue
        rs = [r for r in candidates if r.uid not in started][:PASSED_MAX]
        view = View(now, rs, [Worker(w.id, ranks=w.ranks) for w in self.workers.values()], self.costs,
                    self.max_batch, self.chunk, self.est_bytes)
        return [(r.uid, round(slack, 4) if math.isfinite(slack := view.slack(r)) else None, r.left, r.aged)
                for r in rs]  # (no deadline, or a cost not known yet: None)

    def _view(self, now: float, free: list[Request], idle: list[_Worker]) -> View:
        workers = [Worker(w.id, True, w.free_bytes, set(w.resident), w.ranks) for w in idle]
        previous = {u for w in idle for u in w.previous}
        return View(now, free, workers, self.costs, self.max_batch, self.chunk, self.est_bytes, previous)

    def _check(self, b: Batch, free_bytes: int, taken: set[str]) -> str | None:
        w = self.workers.get(b.worker)
        if w is None or not w.idle:
            return f"worker {b.worker!r} is not idle"
        uids = b.uids
        if not uids or len(set(uids)) != len(uids) or not taken.isdisjoint(uids):
            return "empty batch or a request twice"
        if len(uids) > self.max_batch:
            return f"{len(uids)} requests over max_batch {self.max_batch}"
        if not isinstance(b.steps, int) or b.steps < 1:
            return f"steps must be a positive int, got {b.steps!r}"
        if b.dop != 1 and b.dop not in dops(w.ranks):  # every worker offers DoP 1
            return f"DoP {b.dop!r} is not one of worker {b.worker!r}'s ({dops(w.ranks)})"
        requests = self.requests
        rs = [requests.get(u) for u in uids]
        if any(r is None or r.running for r in rs):
            return "a request unknown or already running"
        if len(rs) > 1 and (len({r.key for r in rs}) > 1 or not all(r.batchable for r in rs)):
            return "requests of different keys, or a one-step call, in one batch"
        new = [r for r in rs if r.worker is None]
        if len(new) < len(rs) and any(r.worker is not None and r.worker != b.worker for r in rs):
            return "a request resident on another worker"
        need = sum(self.est_bytes(r) for r in new)
        # Only admitting takes memory: a worker over its bound (it took one request larger than
        # what was free, or a state came out larger than estimated) still runs what it holds.
        if new and need > free_bytes and (w.resident or taken or len(new) > 1):
            return f"admitting needs {need} bytes, worker has {free_bytes} free"
        return None

    def _reject(self, b: Batch, why: str) -> None:
        self.stats.rejected += 1
        self.rejections.append(f"{self.policy.name}: {b}: {why}")

    def _start(self, wid: str, batches: list[Batch], now: float) -> Run | None:
        """One Run of the batches a policy gave worker ``wid``: each checked, then laid onto
        disjoint blocks of its ranks (a batch that does not fit is refused, not shrunk)."""
        w = self.workers.get(wid)
        requests = self.requests
        ok: list[Batch] = []
        free, taken = (w.free_bytes if w else 0), set()
        for b in batches:
            why = self._check(b, free, taken)
            # One rank runs one batch (the common case, decided without placing anything).
            if why is None and ok and (w.ranks == 1 or place([x.dop for x in ok] + [b.dop], w.ranks) is None):
                why = f"DoPs {[x.dop for x in ok] + [b.dop]} do not fit {w.ranks} ranks"
            if why is not None:
                self._reject(b, why)
                continue
            ok.append(b)
            taken.update(b.uids)
            free -= sum(self.est_bytes(r) for u in b.uids if (r := requests[u]).worker is None)
        if not ok:
            return None
        blocks = place([b.dop for b in ok], w.ranks) if w.ranks > 1 else [(0,)]
        admit: list[str] = []
        cost_keys = w.cost_keys = {}
        resident = w.resident
        stats = self.stats
        for b in ok:
            rs = [requests[u] for u in b.uids]
            cost_key = at_dop(rs[0].key, b.dop)
            for r in rs:
                if r.worker is None:
                    r.worker, r.nbytes = wid, self.est_bytes(r)
                    resident.add(r.uid)
                    w.free_bytes -= r.nbytes
                    admit.append(r.uid)
                r.running = True
                if r.started is None:
                    r.started = now
                cost_keys[r.uid] = cost_key
            stats.batches += 1
            stats.batched += len(b.uids)
        uids = tuple(ok[0].uids) if len(ok) == 1 else tuple(u for b in ok for u in b.uids)
        # Passed over: in this worker's last run, still resident and unfinished, not in this one.
        if w.previous:
            stats.preempted += sum(1 for u in w.previous if u in resident and u not in uids)
        w.previous, w.idle = uids, False
        parts = tuple([Part(r, b.uids, b.steps) for r, b in zip(blocks, ok)])
        return Run(wid, uids, max(b.steps for b in ok), tuple(admit), parts)
