"""How a request's deadline becomes each stage's: the proxy's reserve (what the stages after a
stage need alone) and the request a stage's core schedules. The runtime (proxy/api.py,
stage/scheduler.py) and the simulator (sim/) both call these, so they cannot drift apart.
"""

from __future__ import annotations

from typing import Callable, Sequence

from onepiece.sched.policy import Request

MAX_STAGE_S = 86_400.0  # a figure beyond this is not a measurement


def reserve(stages: Sequence[str], alone_s: Callable[[str], float | None]) -> dict[str, float]:
    """Per stage of an application (``stages`` in order), the seconds the stages after it take
    alone (``alone_s``; unknown ones count 0), for the stages that have any after them: each
    stage schedules to be done that much before the request's target."""
    out, after = {}, 0.0
    for stage in reversed(stages):
        if after > 0:
            out[stage] = round(after, 4)
        t = alone_s(stage)
        after += t if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < MAX_STAGE_S else 0.0
    return out


def stage_request(uid: str, app: str, key: str, steps: int, now: float, expires: float, target: float | None,
                  reserve_s: float, priority: int = 0, batchable: bool = True) -> Request:
    """The request a stage's core holds (times on the core's clock): scheduled for its target
    (its deadline when it has none) less ``reserve_s``, dropped at its deadline (``expires``)."""
    due = expires if target is None else min(target, expires)
    return Request(uid, app, key, steps, now, due - reserve_s, priority, batchable=batchable, expires=expires)
