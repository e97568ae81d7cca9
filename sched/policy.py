"""The contract between the scheduling core and its policies (DESIGN §6.1).

A policy sees a ``View``: the requests it may advance (waiting ones, and resident ones that
are not in a step now), the workers that are idle, the cost model and the stage's bounds. It
returns ``Batch``es: which requests advance next, together in one forward pass, on which
worker, on how many of its ranks (the DoP: a collaboration group's worker has several, and
may run several batches at once on disjoint ranks), for how many steps. The core checks every
batch (one worker, compatible keys, the batch bound, memory, DoPs that fit, nothing twice)
before anything runs, so a policy cannot corrupt state.

Most policies are an order plus the shared batch builder (``RankedPolicy``): the best-ranked
request leads, compatible ones join in rank order. Time is the core's clock (seconds).
"""

from __future__ import annotations

import abc
import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

from onepiece.sched.costs import CostModel
from onepiece.sched.keys import at_dop
from onepiece.sched.ranks import dops, place


@dataclass(eq=False)
class Request:
    """One request in a stage, as the core and policies see it."""

    uid: str
    app: str
    key: str  # compatibility key (sched.keys), or the call key of a one-step request
    steps: int  # in total
    arrival: float  # entered this stage (core clock)
    deadline: float | None = None  # when this stage must be done (core clock): what policies schedule for
    priority: int = 0  # higher first, among requests a policy would otherwise tie
    batchable: bool = True  # False: a one-step call, always alone
    done: int = 0  # steps done
    worker: str | None = None  # the worker holding its state once admitted
    running: bool = False  # in the step chunk now in flight
    nbytes: int = 0  # its resident state, once admitted (the worker measures it)
    started: float | None = None  # first step sent
    device_s: float = 0.0  # device seconds attributed to it (a step's time over its batch)
    aged: bool = False  # set by the core: in the stage too long, served before the others
    expires: float | None = None  # the request's own deadline (default: ``deadline``), where it is dropped

    @property
    def left(self) -> int:
        return self.steps - self.done


@dataclass
class Worker:
    id: str
    idle: bool = True
    free_bytes: int = 0
    resident: set[str] = field(default_factory=set)
    ranks: int = 1  # a collaboration group's size: every rank holds every state of the worker


@dataclass(frozen=True)
class Batch:
    worker: str
    uids: tuple[str, ...]
    steps: int
    dop: int = 1  # ranks of the worker that run it together (sched.ranks.dops)


@dataclass
class View:
    now: float
    requests: list[Request]  # what may advance now, in arrival order
    workers: list[Worker]  # idle workers
    costs: CostModel
    max_batch: int
    chunk: Callable[[str, int], int]  # steps per chunk for (key, batch size)
    est_bytes: Callable[[Request], int]  # what admitting a waiting request will take
    previous: set[str] = field(default_factory=set)  # the uids of each worker's last batch

    def __post_init__(self) -> None:
        ranks = max([w.ranks for w in self.workers], default=1)
        self.dops = [1] if ranks == 1 else dops(ranks)  # what the idle workers offer

    @functools.cached_property
    def by_uid(self) -> dict[str, Request]:
        return {r.uid: r for r in self.requests}

    def alone_s(self, r: Request, steps: int | None = None, dop: int | None = None) -> float:
        """Seconds ``steps`` (default: all left) of ``r`` take alone on ``dop`` ranks (default:
        at the fastest DoP the workers offer); inf when unknown, so an unmeasured request ranks
        as long, never as free."""
        n = r.steps - r.done if steps is None else steps
        if dop or len(self.dops) == 1:  # one DoP to price (the common case: asked for at every decision)
            t = self.costs.step_s(at_dop(r.key, dop or self.dops[0]), 1)
            return math.inf if t is None else t * n
        ts = [t for d in self.dops if (t := self.costs.step_s(at_dop(r.key, d), 1)) is not None]
        return min(ts) * n if ts else math.inf

    def slack(self, r: Request, dop: int | None = None) -> float:
        """Seconds to spare if ``r`` ran alone from now on, on ``dop`` ranks (default: at its
        fastest); inf without a deadline."""
        return math.inf if r.deadline is None else r.deadline - self.now - self.alone_s(r, dop=dop)


class Policy(abc.ABC):
    name: str = ""
    # Picks each batch's DoP on a collaboration group; a DoP-blind policy runs every batch on
    # all of the group's ranks (a static DoP), so only that DoP's costs matter to it.
    picks_dop: bool = False

    @abc.abstractmethod
    def plan(self, view: View) -> list[Batch]:
        """The batches to start now, at most one per idle worker."""

    def sustained(self, costs: CostModel, key: str, cap: int) -> int:
        """The batch size this policy runs ``key`` at while the stage is busy, up to ``cap``: what
        the stage's rate is priced at. By default the largest the stage sustains."""
        return costs.reached(key, cap, sustained=True)

    def stable_until(self, view: View, r: Request) -> float:
        """``plan(view)`` starts ``r`` alone on the view's one idle worker, which holds it; until
        when (core clock) would a plan of the same requests still do that, however far ``r``
        has advanced meanwhile (its steps left only fall) and with the same cost model? The
        core then holds ``r``'s run instead of deciding at each chunk's end (module doc of
        sched/core.py); it sees to aging, expiry and anything that changes. ``view.now``
        (the default): no promise, decide at every chunk's end."""
        return view.now


class RankedPolicy(Policy):
    """Order the requests; the best-ranked leads a batch on an idle worker (its own, once it
    is resident), and compatible requests join in rank order up to the batch bound."""

    whole: bool = False  # run a batch to the end of its leader (non-preemptive)
    # Its order of the waiting requests does not change with time, and a request that advances
    # only moves up in it, nor does whether one may join another's batch: a plan that starts a
    # request stays the plan as long as the requests and costs stay what they were.
    static: bool = False

    def stable_until(self, view: View, r: Request) -> float:
        return math.inf if self.static else view.now

    @abc.abstractmethod
    def rank(self, view: View) -> list[Request]:
        """The requests, best first."""

    def may_join(self, view: View, members: list[Request], r: Request) -> bool:
        return True

    def plan(self, view: View) -> list[Batch]:
        # One request ranks first whatever the order (rank has no side effects): skip ranking it.
        order = view.requests if len(view.requests) == 1 else self.rank(view)
        return build_batches(view, order, self.may_join, self.whole)


def _gather(view: View, order: Iterable[Request], lead: Request, taken: set[str], fits: Callable[[Request], bool],
            accept: Callable[[list[Request], Request], bool], admit: Callable[[Request], None]) -> list[Request]:
    """``lead`` and the compatible requests of ``order`` that join it (not taken, fitting the
    worker, accepted) up to the batch bound; ``admit`` hears of each joining request not yet
    resident (its memory is then spoken for)."""
    members = [lead]
    for r in order if lead.batchable and view.max_batch > 1 else ():
        if len(members) >= view.max_batch:
            break
        if (r.uid in taken or r is lead or not r.batchable or r.key != lead.key or not fits(r)
                or not accept(members, r)):
            continue
        members.append(r)
        if r.worker is None:
            admit(r)
    return members


def build_batches(view: View, order: Iterable[Request], may_join: Callable[[View, list[Request], Request], bool],
                  whole: bool = False, leaders: int | None = None) -> list[Batch]:
    """Batches over the idle workers: each of the first ``leaders`` requests of ``order`` (all
    by default) not yet placed leads one, joined by compatible requests in order that
    ``may_join`` admits; ``whole`` runs a batch until its longest member is done. A batch takes
    all of its worker's ranks (a collaboration group computes it together)."""
    order = list(order)
    idle = {w.id: w for w in view.workers}
    free = {w.id: w.free_bytes for w in view.workers}
    taken: set[str] = set()
    out: list[Batch] = []

    def fits(r: Request, wid: str, joining: bool = False) -> bool:
        if r.worker is not None:
            return r.worker == wid
        # An empty worker takes any one request: a request never waits for memory it cannot get.
        # Those joining it take only what is left (else the core refuses the batch at every turn,
        # and the stage runs nothing until the requests expire).
        return view.est_bytes(r) <= free[wid] or not joining and not idle[wid].resident and not any(
            b.worker == wid for b in out)

    for lead in order[:leaders]:
        if not idle:
            break
        if lead.uid in taken:
            continue
        if lead.worker is not None:
            wid = lead.worker if lead.worker in idle else None
        else:
            # Prefer a worker already holding requests it could batch with, then the emptiest.
            cands = [w for w in idle if fits(lead, w)]
            wid = cands[0] if len(cands) == 1 else max(
                cands, key=lambda w: (any(getattr(view.by_uid.get(u), "key", None) == lead.key
                                          for u in idle[w].resident), free[w]), default=None)
        if wid is None:
            continue
        if lead.worker is None:
            free[wid] -= view.est_bytes(lead)
        members = _gather(view, order, lead, taken, lambda r: fits(r, wid, joining=True),
                          lambda ms, r: may_join(view, ms, r),
                          lambda r: free.__setitem__(wid, free[wid] - view.est_bytes(r)))
        dop = idle[wid].ranks
        left = max(r.left for r in members) if len(members) > 1 else lead.left
        steps = left if whole else view.chunk(at_dop(lead.key, dop), len(members))
        uids = tuple([r.uid for r in members])
        out.append(Batch(wid, uids, max(1, min(steps, left)), dop))
        taken.update(uids)
        del idle[wid]
    return out



ChooseDop = Callable[[View, Request, list[int]], "int | None"]
JoinAtDop = Callable[[View, list[Request], Request, int], bool]


def build_dop_batches(view: View, order: Iterable[Request], choose: ChooseDop, may_join: JoinAtDop | None = None,
                      promote: bool = True) -> list[Batch]:
    """Batches over the idle workers' ranks, each at its own DoP (a collaboration group runs
    them side by side). Each request of ``order`` not yet placed leads a batch on its worker
    (the one holding its state, else the idle one with the most free ranks) at the DoP
    ``choose`` picks among those that still fit there (None: not now); compatible requests
    join it in order while ``may_join`` admits them (None: no batching). With ``promote``,
    ranks left over then go to the placed batches, most urgent first, one DoP step up at a
    time while the cost model says that makes the batch faster (GF-DiT's best-fit second pass)."""
    workers = {w.id: w for w in view.workers}
    free_ranks = {w.id: w.ranks for w in view.workers}
    free = {w.id: w.free_bytes for w in view.workers}
    placed: list[list] = []  # [worker, members, dop], most urgent first
    taken: set[str] = set()

    def fits(r: Request, wid: str, joining: bool = False) -> bool:
        if r.worker is not None:
            return r.worker == wid
        return view.est_bytes(r) <= free[wid] or not joining and not workers[wid].resident and not any(
            p[0] == wid for p in placed)

    def usable(wid: str, extra: list[int] = ()) -> list[int]:
        have = [p[2] for p in placed if p[0] == wid] + list(extra)
        return [d for d in dops(workers[wid].ranks) if place(have + [d], workers[wid].ranks) is not None]

    for lead in order:
        if not any(free_ranks.values()):
            break
        if lead.uid in taken:
            continue
        cands = [w for w in ([lead.worker] if lead.worker else workers)
                 if free_ranks.get(w) and fits(lead, w) and usable(w)]
        if not cands:
            continue
        wid = max(cands, key=lambda w: free_ranks[w])
        d = choose(view, lead, usable(wid))
        if d is None:
            continue
        if lead.worker is None:
            free[wid] -= view.est_bytes(lead)
        members = [lead] if may_join is None else _gather(
            view, order, lead, taken, lambda r: fits(r, wid, joining=True), lambda ms, r: may_join(view, ms, r, d),
            lambda r: free.__setitem__(wid, free[wid] - view.est_bytes(r)))
        placed.append([wid, members, d])
        free_ranks[wid] -= d
        taken.update(r.uid for r in members)
    if promote:
        for p in placed:
            wid, members, d = p
            others = [q[2] for q in placed if q is not p and q[0] == wid]
            for bigger in (x for x in dops(workers[wid].ranks) if x > d):
                if place(others + [bigger], workers[wid].ranks) is None:
                    break
                now_s = view.costs.step_s(at_dop(members[0].key, p[2]), len(members))
                then_s = view.costs.step_s(at_dop(members[0].key, bigger), len(members))
                if now_s is None or then_s is None or then_s >= now_s:
                    break
                p[2] = bigger
    # A group's batches step in lockstep, so a run lasts as long as its slowest: each batch
    # gets the steps that fit in the most urgent batch's chunk (at least one step of every one).
    out = []
    for wid in dict.fromkeys(p[0] for p in placed):
        mine = [p for p in placed if p[0] == wid]
        step = [view.costs.step_s(at_dop(m[0].key, d), len(m)) for _, m, d in mine]
        chunks = [max(1, min(max(r.left for r in m), view.chunk(at_dop(m[0].key, d), len(m)))) for _, m, d in mine]
        span = None if None in step else max(step[0] * chunks[0], *step)
        for (_, members, d), t, n in zip(mine, step, chunks):
            if span is not None:
                n = max(1, min(max(r.left for r in members), int(span / t + 1e-9)))
            out.append(Batch(wid, tuple(r.uid for r in members), n, d))
    return out
