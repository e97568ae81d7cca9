"""Measured service times of one stage instance, per application and request shape.

The request monitor (DESIGN §8) derives capacity from these, so they are measured, never
configured. Per finished request two figures: its *share* of the device (what the stage's
rate follows from: with batching, a step's time divided among the requests it advanced, at
the batch sizes the stage reaches) and its *standalone* time (alone on an idle worker: what
its latency is predicted from). The report has the mean share over a moving window per
application (the mean, because throughput is workers / mean share even when shapes are
mixed), the mean standalone time per shape, and a count of what arrived recently per
application (the mix, for stages shared between applications), and the mean share per shape
(what admission charges a request of that shape). Everything is bounded: the
windows, the number of shapes kept, the recent-arrivals log.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from onepiece.sched.core import SchedCore
    from onepiece.sched.policy import Request

WINDOW = 32  # requests per (app) and per (app, shape) window
MAX_SHAPES = 64  # shapes kept per app, least recently seen dropped first
MIX_WINDOW_S = 30.0
MAX_RECENT = 4096

Window = collections.deque  # of seconds, at most WINDOW long


class ServiceTimes:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._app: dict[str, collections.deque[float]] = {}
        # per app and shape: (share, standalone) windows
        self._shape: dict[str, collections.OrderedDict[str, tuple[Window, Window]]] = {}
        self._recent: collections.deque[tuple[float, str]] = collections.deque(maxlen=MAX_RECENT)

    def add(self, app: str, shape: str, share_s: float, alone_s: float | None = None) -> None:
        """One finished request: its share of the device and its standalone time (the same
        when it ran alone)."""
        self._app.setdefault(app, collections.deque(maxlen=WINDOW)).append(share_s)
        shapes = self._shape.setdefault(app, collections.OrderedDict())
        windows = shapes.get(shape)
        if windows is None:
            windows = shapes[shape] = collections.deque(maxlen=WINDOW), collections.deque(maxlen=WINDOW)
            while len(shapes) > MAX_SHAPES:
                shapes.popitem(last=False)
        else:
            shapes.move_to_end(shape)  # most recently seen last
        shares, alone = windows
        shares.append(share_s)
        alone.append(share_s if alone_s is None else alone_s)
        self._recent.append((self.clock(), app))

    def finished(self, core: "SchedCore", r: "Request", shape: str) -> None:
        """``r`` of ``shape`` left ``core``: its times from the core's cost model (the stage's
        scheduler and the simulator both record them so)."""
        alone, share = core.standalone_s(r), core.share_s(r)
        if alone is not None and share is not None:
            self.add(r.app, shape, share, alone)

    def report(self) -> dict[str, dict[str, Any]]:
        """{app: {"mean_s" (share), "recent" (count in the last MIX_WINDOW_S), "shapes": {shape: standalone s},
        "shares": {shape: share s}}}"""
        horizon = self.clock() - MIX_WINDOW_S
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
        recent = collections.Counter(app for _, app in self._recent)
        return {
            app: {
                "mean_s": statistics.fmean(w),
                "recent": recent.get(app, 0),
                "shapes": {s: statistics.fmean(alone) for s, (_, alone) in self._shape[app].items()},
                "shares": {s: statistics.fmean(shares) for s, (shares, _) in self._shape[app].items()},
            }
            for app, w in self._app.items()
        }
