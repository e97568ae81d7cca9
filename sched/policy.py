"""The contract between the scheduling core and its policies (DESIGN §6.1).

A policy sees a ``View``: the requests it may advance (waiting ones, and resident ones that
are not in a step now), the workers that are idle, the cost model and the stage's bounds. It
returns ``Batch``es: which requests advance next, together in one forward pass, on which
worker, for how many steps. The core checks every batch (one worker, compatible keys, the
batch bound, memory, nothing twice) before anything runs, so a policy cannot corrupt state.

Most policies are an order plus the shared batch builder (``RankedPolicy``): the best-ranked
request leads, compatible ones join in rank order. Time is the core's clock (seconds).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

from onepiece.sched.costs import CostModel


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


@dataclass(frozen=True)
class Batch:
    worker: str
    uids: tuple[str, ...]
    steps: int


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
        self.by_uid = {r.uid: r for r in self.requests}

    def alone_s(self, r: Request, steps: int | None = None) -> float:
        """Seconds ``steps`` (default: all left) of ``r`` take alone; inf when unknown, so an
        unmeasured request ranks as long, never as free."""
        t = self.costs.step_s(r.key, 1)
        n = r.left if steps is None else steps
        return math.inf if t is None else t * n

    def slack(self, r: Request) -> float:
        """Seconds to spare if ``r`` ran alone from now on (inf without a deadline)."""
        return math.inf if r.deadline is None else r.deadline - self.now - self.alone_s(r)


class Policy(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def plan(self, view: View) -> list[Batch]:
        """The batches to start now, at most one per idle worker."""


class RankedPolicy(Policy):
    """Order the requests; the best-ranked leads a batch on an idle worker (its own, once it
    is resident), and compatible requests join in rank order up to the batch bound."""

    whole: bool = False  # run a batch to the end of its leader (non-preemptive)

    @abc.abstractmethod
    def rank(self, view: View) -> list[Request]:
        """The requests, best first."""

    def may_join(self, view: View, members: list[Request], r: Request) -> bool:
        return True

    def plan(self, view: View) -> list[Batch]:
        return build_batches(view, self.rank(view), self.may_join, self.whole)


def build_batches(view: View, order: Iterable[Request], may_join: Callable[[View, list[Request], Request], bool],
                  whole: bool = False, leaders: int | None = None) -> list[Batch]:
    """Batches over the idle workers: each of the first ``leaders`` requests of ``order`` (all
    by default) not yet placed leads one, joined by compatible requests in order that
    ``may_join`` admits; ``whole`` runs a batch until its longest member is done."""
    order = list(order)
    idle = {w.id: w for w in view.workers}
    free = {w.id: w.free_bytes for w in view.workers}
    taken: set[str] = set()
    out: list[Batch] = []

    def fits(r: Request, wid: str) -> bool:
        if r.worker is not None:
            return r.worker == wid
        # An empty worker takes any one request: a request never waits for memory it cannot get.
        return view.est_bytes(r) <= free[wid] or not idle[wid].resident and not any(
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
            wid = max(cands, key=lambda w: (any(getattr(view.by_uid.get(u), "key", None) == lead.key
                                                for u in idle[w].resident), free[w]), default=None)
        if wid is None:
            continue
        members = [lead]
        if lead.batchable:
            for r in order:
                if len(members) >= view.max_batch:
                    break
                if (r.uid in taken or r is lead or not r.batchable or r.key != lead.key
                        or not fits(r, wid) or not may_join(view, members, r)):
                    continue
                members.append(r)
                if r.worker is None:
                    free[wid] -= view.est_bytes(r)
        if lead.worker is None:
            free[wid] -= view.est_bytes(lead)
        steps = max(r.left for r in members) if whole else view.chunk(lead.key, len(members))
        out.append(Batch(wid, tuple(r.uid for r in members), max(1, min(steps, max(r.left for r in members)))))
        taken.update(r.uid for r in members)
        del idle[wid]
    return out

