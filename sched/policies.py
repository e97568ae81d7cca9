"""The stage scheduling policies, by the name the workflow YAML uses (``make_policy``).

- ``fcfs``: each request alone, from its first step to its last, in arrival order: what the
  stages did before step scheduling, and the baseline;
- ``fcfs-batched``: continuous batching in arrival order: the oldest request leads and every
  compatible one joins, wherever it stands in the queue (an incompatible head blocks nothing);
- ``srtf``: least remaining work first (the cost model prices it), preemptive at chunk ends;
- ``edf``: earliest deadline first;
- ``slo``: this project's own: the most deadlines met (see ``Slo``): the largest set of
  requests that can all make their deadlines runs earliest deadline first, the rest in the
  time left; batches form only where they make no kept request late.

Ties go to the higher ``priority``, then to the earlier arrival (never to the uid: an order by
id starves whichever id keeps losing). None of them can starve a request: the core serves
aged requests (``ScheduleSpec.aging``) before asking the policy.
"""

from __future__ import annotations

import math

from onepiece.sched import options
from onepiece.sched.policy import Policy, RankedPolicy, Request, View


class Fcfs(RankedPolicy):
    name = "fcfs"
    whole = True

    def rank(self, view: View) -> list[Request]:
        return sorted(view.requests, key=lambda r: (r.started is None, r.arrival))


class FcfsBatched(RankedPolicy):
    name = "fcfs-batched"

    def rank(self, view: View) -> list[Request]:
        return sorted(view.requests, key=lambda r: r.arrival)


class Srtf(RankedPolicy):
    name = "srtf"

    def rank(self, view: View) -> list[Request]:
        return sorted(view.requests, key=lambda r: (-r.priority, view.alone_s(r), r.arrival))


class Edf(RankedPolicy):
    name = "edf"

    def rank(self, view: View) -> list[Request]:
        return sorted(view.requests, key=lambda r: (-r.priority, math.inf if r.deadline is None else r.deadline,
                                                    r.arrival))


class Slo(RankedPolicy):
    """Most deadlines met. Of the requests with a deadline that can still make it alone, keep
    the largest set that can all make it one after another in deadline order (Moore and
    Hodgson's rule for the fewest late jobs: walk them in deadline order and, whenever the
    running total overshoots a deadline, take out the one with the most work left, the lowest
    priority first) and run that set earliest deadline first: within a feasible set EDF loses
    none. Requests without a deadline come next, then the ones taken out, shortest first: they
    run in time nobody else needs, and expire where they wait. A request joins a batch only if
    no member that is in the kept set becomes late at the slower batched step. Re-decided at
    every chunk, so a burst that clears lets a request taken out back in."""

    name = "slo"

    def rank(self, view: View) -> list[Request]:
        timed = sorted((r for r in view.requests if r.deadline is not None),
                       key=lambda r: (r.deadline, -r.priority, r.arrival))
        kept: list[Request] = []
        out: list[Request] = []
        total = 0.0
        for r in timed:
            if view.slack(r) < 0:  # late even alone
                out.append(r)
                continue
            kept.append(r)
            total += view.alone_s(r)
            while kept and view.now + total > r.deadline:  # once, unless priorities keep the longest in
                drop = min(kept, key=lambda k: (k.priority, -view.alone_s(k), -k.arrival))
                kept.remove(drop)
                out.append(drop)
                total -= view.alone_s(drop)
        untimed = sorted((r for r in view.requests if r.deadline is None), key=lambda r: (-r.priority, r.arrival))
        out.sort(key=lambda r: (-r.priority, view.alone_s(r), r.arrival))
        return kept + untimed + out

    def may_join(self, view: View, members: list[Request], r: Request) -> bool:
        if len(members) + 1 > view.costs.reached(r.key, view.max_batch):
            return True  # a batch size not measured yet: try it (priced by extrapolation it never would be)
        step = view.costs.step_s(r.key, len(members) + 1)
        if step is None:
            return True
        for m in (*members, r):
            if m.deadline is not None and view.slack(m) >= 0 and view.now + m.left * step > m.deadline:
                return False
        return True


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Fcfs, FcfsBatched, Srtf, Edf, Slo)}
assert tuple(POLICIES) == options.POLICIES  # the names the YAML accepts


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r} (known: {', '.join(POLICIES)})") from None
