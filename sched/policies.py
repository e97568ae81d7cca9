"""The stage scheduling policies, by the name the workflow YAML uses (``make_policy``).

- ``fcfs``: each request alone, from its first step to its last, in arrival order: what the
  stages did before step scheduling, and the baseline;
- ``fcfs-batched``: continuous batching in arrival order: the oldest request leads and every
  compatible one joins, wherever it stands in the queue (an incompatible head blocks nothing);
- ``srtf``: least remaining work first (the cost model prices it), preemptive at chunk ends;
- ``edf``: earliest deadline first;
- ``slo``: this project's own: the most deadlines met (see ``Slo``): the largest set of
  requests that can all make their deadlines runs earliest deadline first, the rest in the
  time left; batches form only where they save device time and make no kept request late. On
  a collaboration group it also picks each batch's degree of parallelism (DoP): the smallest
  within 10% of the fastest (the most frugal for a request no DoP gets in time), spare ranks to
  the most urgent batch while they make it faster;
- ``edf-best-fit``: GF-DiT's: earliest deadline first, each request alone at the smallest DoP
  whose estimated finish meets its deadline (else its fastest), then spare ranks to the most
  urgent while that makes it faster;
- ``ddit``: DDiT's greedy step-granularity allocation: requests starving (waiting longer than
  they take alone) first, oldest first, then shortest first; each alone at its optimal DoP
  (the smallest within 10% of its fastest), or the largest that still fits.

The DoP-blind policies (``fcfs`` to ``edf``) run each batch on all of a group's ranks: a
static DoP, the group's size.

Ties go to the higher ``priority``, then to the earlier arrival (never to the uid: an order by
id starves whichever id keeps losing). None of them can starve a request: the core serves
aged requests (``ScheduleSpec.aging``) before asking the policy.
"""

from __future__ import annotations

import math

from onepiece.sched import options
from onepiece.sched.costs import CostModel
from onepiece.sched.keys import at_dop
from onepiece.sched.policy import Batch, Policy, RankedPolicy, Request, View, build_dop_batches
from onepiece.sched.ranks import dops


class Fcfs(RankedPolicy):
    name = "fcfs"
    whole = True

    def rank(self, view: View) -> list[Request]:
        return sorted(view.requests, key=lambda r: (r.started is None, r.arrival))


class FcfsBatched(RankedPolicy):
    name = "fcfs-batched"
    static = True

    def rank(self, view: View) -> list[Request]:
        return sorted(view.requests, key=lambda r: r.arrival)


class Srtf(RankedPolicy):
    """Least remaining work first; a request joins a batch only where the batched step saves
    device time (``worth_batching``): a join that saves nothing is processor sharing, which
    delays the leader, the request with the least work left, for nothing (joining every
    compatible request put srtf's mean latency at 0.84x fcfs's on bench sched's 1.0x trace in
    the simulator, 0.63x with the rule)."""

    name = "srtf"
    static = True  # (the work left of a request that advances only falls)

    def rank(self, view: View) -> list[Request]:
        return sorted(view.requests, key=lambda r: (-r.priority, view.alone_s(r), r.arrival))

    def may_join(self, view: View, members: list[Request], r: Request) -> bool:
        return worth_batching(view.costs, r.key, len(members) + 1, view.max_batch)

    def sustained(self, costs: CostModel, key: str, cap: int) -> int:
        return saving_size(costs, key, cap)


class Edf(RankedPolicy):
    name = "edf"
    static = True

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
    the batched step saves device time (``GAIN``: on a shape that fills the device alone a
    batch is processor sharing, which makes its members later than one after the other would)
    and no member that is in the kept set becomes late at the slower batched step. Re-decided
    at every chunk, so a burst that clears lets a request taken out back in."""

    name = "slo"
    picks_dop = True

    def rank(self, view: View) -> list[Request]:
        timed = sorted((r for r in view.requests if r.deadline is not None),
                       key=lambda r: (r.deadline, -r.priority, r.arrival))
        kept: list[Request] = []
        out: list[Request] = []
        total = 0.0
        need = {r.uid: self._need(view, r) for r in timed}
        for r in timed:
            if view.slack(r) < 0:  # late even alone
                out.append(r)
                continue
            kept.append(r)
            total += need[r.uid]
            while kept and view.now + total > r.deadline:  # once, unless priorities keep the longest in
                drop = min(kept, key=lambda k: (k.priority, -need[k.uid], -k.arrival))
                kept.remove(drop)
                out.append(drop)
                total -= need[drop.uid]
        untimed = sorted((r for r in view.requests if r.deadline is None), key=lambda r: (-r.priority, r.arrival))
        out.sort(key=lambda r: (-r.priority, view.alone_s(r), r.arrival))
        return kept + untimed + out

    @staticmethod
    def _need(view: View, r: Request) -> float:
        """The share of the workers' time ``r`` takes: alone on one worker; on a group of ``n``
        ranks, ``d·t(d)/n`` at the DoP ``frugal_fit`` would give it (small requests share a
        group's ranks, they do not take it all)."""
        n = view.dops[-1]
        if n == 1:
            return view.alone_s(r)
        d = frugal_fit(view, r, view.dops)
        return view.alone_s(r, dop=d) * d / n

    def may_join(self, view: View, members: list[Request], r: Request, dop: int = 1) -> bool:
        key, size, costs = at_dop(r.key, dop), len(members) + 1, view.costs
        if not worth_batching(costs, key, size, view.max_batch):
            return False
        if size > costs.reached(key, view.max_batch) or costs.unsettled(key, size):
            return True  # a size being tried
        step = costs.step_s(key, size)
        if step is None:
            return True
        for m in (*members, r):
            if m.deadline is not None and view.slack(m, dop) >= 0 and view.now + m.left * step > m.deadline:
                return False
        return True

    def sustained(self, costs: CostModel, key: str, cap: int) -> int:
        return saving_size(costs, key, cap)

    def stable_until(self, view: View, r: Request) -> float:
        """While the walk of ``rank`` keeps every request it can run in time and takes none out,
        the same requests stay kept in the same order: a request's margin there (its deadline,
        less now and the work of the kept ones up to it) only shrinks as time passes (one that
        advances only takes work off), and a request late even alone stays late while it waits.
        So the plan holds until the smallest margin is spent. No promise where the walk takes a
        request out (one that advances could let it back in), for ``r`` late even alone, or
        where a compatible request could join ``r`` (the join rule reads slack, which moves)."""
        now = view.now
        if len(view.dops) > 1 or r.deadline is not None and view.slack(r) < 0:
            return now
        if view.max_batch > 1 and r.batchable and worth_batching(view.costs, r.key, 2, view.max_batch) and any(
                x is not r and x.batchable and x.key == r.key for x in view.requests):
            return now
        until, total = math.inf, 0.0
        for x in sorted((x for x in view.requests if x.deadline is not None),
                        key=lambda x: (x.deadline, -x.priority, x.arrival)):
            if view.slack(x) < 0:
                continue
            total += self._need(view, x)
            margin = x.deadline - now - total
            if margin < 0:
                return now
            until = min(until, now + margin)
        return until

    def plan(self, view: View) -> list[Batch]:
        if len(view.dops) == 1:  # no idle worker is a group: no DoP to pick
            return super().plan(view)
        return build_dop_batches(view, self.rank(view), frugal_fit, self.may_join)


GAIN = 0.9  # a request joins a batch only if the batch step costs at most this share of running it apart


def worth_batching(costs: CostModel, key: str, size: int, max_batch: int) -> bool:
    """Whether a batch of ``key`` may grow to ``size``: a size that saves device time
    (``_saves``), or one to try. A size not measured yet is tried (priced by extrapolation it
    never would be), one beyond the largest measured at a time, and only beyond a size that
    saves, so a size that saves nothing is paid for once (going to max_batch at once ran four
    large requests at 4.4x a step); a size measured too few times, or too long ago, runs again
    until it can be judged."""
    reached = costs.reached(key, max_batch)
    if size > reached:
        return size == reached + 1 and (size == 2 or not costs.unsettled(key, reached)
                                        and _saves(costs, key, reached))
    return costs.unsettled(key, size) or _saves(costs, key, size)


def saving_size(costs: CostModel, key: str, cap: int) -> int:
    """The largest batch size the stage sustains that a policy joining by ``worth_batching``
    grows a batch to: every size up to it saves device time. One beyond that it stops, so the
    stage's rate is not priced at a size it no longer forms (a batch of 3 measured at 6x a step
    alone, beside the other stages' burst, priced the rate below batch 1's)."""
    size, top = 1, costs.reached(key, cap, sustained=True)
    while size < top and _saves(costs, key, size + 1):
        size += 1
    return size


def _saves(costs: CostModel, key: str, size: int) -> bool:
    """Whether a step at batch ``size`` costs at most ``GAIN`` x a step at ``size - 1`` plus one
    alone (unknown: assumed so). On a shape that fills the device alone a batch saves nothing
    and only slows its members down."""
    step, now, one = costs.step_s(key, size), costs.step_s(key, size - 1), costs.step_s(key, 1)
    return step is None or now is None or one is None or step <= GAIN * (now + one)


def best_fit(view: View, r: Request, dops: list[int]) -> int | None:
    """The smallest DoP whose estimated finish meets ``r``'s deadline; else the fastest; the
    largest when nothing is known (no deadline, or no cost)."""
    times = {d: view.alone_s(r, dop=d) for d in dops}
    if r.deadline is None or all(math.isinf(t) for t in times.values()):
        return max(dops)
    meets = [d for d in dops if view.now + times[d] <= r.deadline]
    return min(meets) if meets else min(dops, key=lambda d: (times[d], d))


def frugal_fit(view: View, r: Request, dops: list[int]) -> int | None:
    """The DoP ``slo`` runs ``r`` at: its ``knee`` (the smallest within 10% of its fastest, where
    more ranks stop paying), except for a request that no DoP gets in time: the DoP that spends
    the fewest rank-seconds on it (GF-DiT's fastest burns ranks the others need, so under load
    the group's capacity shrinks exactly when it is short; spare ranks still speed it up later).

    Not ``best_fit``'s smallest DoP that meets the deadline alone: that leaves a request only the
    slack it has alone, which the requests that pass it then take. On a CPU group of two it ran
    M at DoP 1 (2.0 s of a 3.1 s SLO, 1.3 s at DoP 2), and ``slo`` met fewer SLOs than srtf
    running every step at DoP 2 (README, "Elastic against static DoP")."""
    times = {d: view.alone_s(r, dop=d) for d in dops}
    if r.deadline is not None and not any(view.now + t <= r.deadline for t in times.values()) \
            and not all(math.isinf(t) for t in times.values()):
        return min(dops, key=lambda d: (d * times[d], d))
    return _knee(times)


class EdfBestFit(Policy):
    """GF-DiT's ``edf_best_fit`` (its runtime_v2 policies): EDF order, best-fit DoP, spare
    ranks to the most urgent while faster. No batching: GF-DiT runs one request per group."""

    name = "edf-best-fit"
    picks_dop = True

    def sustained(self, costs: CostModel, key: str, cap: int) -> int:
        return 1  # each request alone

    def plan(self, view: View) -> list[Batch]:
        return build_dop_batches(view, Edf().rank(view), best_fit)


class Ddit(Policy):
    """DDiT's greedy allocation at step granularity with its starvation guard (arXiv
    2506.13497; no public code: built from the paper's description)."""

    name = "ddit"
    picks_dop = True

    def sustained(self, costs: CostModel, key: str, cap: int) -> int:
        return 1  # each request alone

    def plan(self, view: View) -> list[Batch]:
        offered = dops(max(w.ranks for w in view.workers))

        def starving(r: Request) -> bool:
            return view.now - r.arrival > min(view.alone_s(r, dop=d) for d in offered)

        order = sorted(view.requests, key=lambda r: (not starving(r), r.arrival if starving(r) else view.alone_s(r),
                                                     r.arrival))
        return build_dop_batches(view, order, knee, promote=False)


def knee(view: View, r: Request, dops: list[int]) -> int:
    """The smallest DoP within 10% of the fastest of ``dops`` (the largest when unknown)."""
    return _knee({d: view.alone_s(r, dop=d) for d in dops})


def _knee(times: dict[int, float]) -> int:
    dops = list(times)
    best = min(times.values())
    if math.isinf(best):
        return max(dops)
    return min(d for d in dops if times[d] <= 1.1 * best)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Fcfs, FcfsBatched, Srtf, Edf, Slo, EdfBestFit, Ddit)}
assert tuple(POLICIES) == options.POLICIES  # the names the YAML accepts


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r} (known: {', '.join(POLICIES)})") from None
