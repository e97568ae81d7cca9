"""The stage scheduling policies, by the name the workflow YAML uses (``make_policy``).

- ``fcfs``: each request alone, from its first step to its last, in arrival order: what the
  stages did before step scheduling, and the baseline;
- ``fcfs-batched``: continuous batching in arrival order: the oldest request leads and every
  compatible one joins, wherever it stands in the queue (an incompatible head blocks nothing);
- ``srtf``: least remaining work first (the cost model prices it), preemptive at chunk ends;
- ``edf``: earliest deadline first;
- ``slack``: this project's own. Least slack first (deadline − now − remaining work), with
  three changes measured to matter: a request that can no longer make its deadline even alone
  goes last (it would only make others late too), shortest first among those; a request joins
  a batch only if no member that can still make its deadline stops making it at the slower
  batched step; and the requests of the batch that just ran keep one chunk's worth of slack
  in hand, so two requests with equal slack do not swap at every chunk.

Ties go to the higher ``priority``, then to the earlier arrival (never to the uid: an order by
id starves whichever id keeps losing). None of them can starve a request: the core serves
aged requests (``ScheduleSpec.aging``) before asking the policy.
"""

from __future__ import annotations

import math

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


class Slack(RankedPolicy):
    name = "slack"

    def rank(self, view: View) -> list[Request]:
        def key(r: Request) -> tuple:
            slack = view.slack(r)
            if slack < 0:  # hopeless: after every request that can still make it
                return (-r.priority, 1, view.alone_s(r), r.arrival)
            if r.uid in view.previous:
                slack -= view.alone_s(r, min(r.left, view.chunk(r.key, 1)))
            return (-r.priority, 0, slack, view.alone_s(r), r.arrival)

        return sorted(view.requests, key=key)

    def may_join(self, view: View, members: list[Request], r: Request) -> bool:
        step = view.costs.step_s(r.key, len(members) + 1)
        if step is None:
            return True
        for m in (*members, r):
            if m.deadline is not None and view.slack(m) >= 0 and view.now + m.left * step > m.deadline:
                return False
        return True


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Fcfs, FcfsBatched, Srtf, Edf, Slack)}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r} (known: {', '.join(POLICIES)})") from None
