"""Measured service times of one stage instance, per application and request shape.

The request monitor (DESIGN §8) derives capacity from these, so they are measured, never
configured. Per finished request two figures: its *share* of the device (what the stage's
rate follows from: with batching, a step's time divided among the requests it advanced, at
the batch sizes the stage reaches) and its *standalone* time (alone on an idle worker: what
its latency is predicted from), both priced by the stage's cost model at every report. The
report has the mean share over a moving window of requests per application (the mean, because
throughput is workers / mean share even when shapes are mixed), the standalone time per shape
(the latest request of the shape stands for it), a count of what arrived recently per
application (the mix, for stages shared between applications), and the mean share per shape
(what admission charges a request of that shape).
Everything is bounded: the windows, the number of shapes kept, the recent-arrivals log.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from onepiece.sched.core import SchedCore
    from onepiece.sched.policy import Request

WINDOW = 32  # requests per (app) and per (app, shape) window
MAX_SHAPES = 64  # shapes kept per app, least recently seen dropped first
MIX_WINDOW_S = 30.0
MAX_RECENT = 4096

Window = collections.deque  # of _Priced shares, at most WINDOW long


class _Priced:
    """A request's figure from the stage's cost model, priced again at every report (the cost
    model's figures are memoized, so this is cheap), or a figure as given (``ServiceTimes.add``).
    Priced once, as requests finished, a window kept what the model said then: a worker's first,
    cold, steps for the standalone time, and for the share the step times of a burst that ran
    beside the other stages' work, which left a stage's rate below its batch-1 rate after it
    reached batch 2 (test_the_stage_rate_follows_the_batch_sizes_it_reaches failed so). A share
    keeps the batch sizes its key sustained when it left: priced at the batch sizes sustained at
    each report instead, the rate jumped by the whole batching gain whenever a quiet spell let
    them lapse (16.8 to 10.1 req/s in one test run, as if an instance had died)."""

    def __init__(self, seconds: float, price: "Callable[[], float | None] | None" = None) -> None:
        self.seconds, self.price = seconds, price

    def now(self) -> float:
        if self.price is not None:
            t = self.price()
            if t is not None:  # else the model lost the key: its last figure
                self.seconds = t
        return self.seconds


class ServiceTimes:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._app: dict[str, Window] = {}
        # per app and shape: the window of shares, and the standalone time
        self._shape: dict[str, collections.OrderedDict[str, tuple[Window, _Priced]]] = {}
        self._recent: collections.deque[tuple[float, str]] = collections.deque(maxlen=MAX_RECENT)

    def add(self, app: str, shape: str, share_s: float, alone_s: float | None = None) -> None:
        """One finished request: its share of the device and its standalone time (the same
        when it ran alone)."""
        self._record(app, shape, _Priced(share_s), _Priced(share_s if alone_s is None else alone_s))

    def _record(self, app: str, shape: str, share: _Priced, alone: _Priced) -> None:
        self._app.setdefault(app, collections.deque(maxlen=WINDOW)).append(share)
        shapes = self._shape.setdefault(app, collections.OrderedDict())
        entry = shapes.pop(shape, None)
        shares = entry[0] if entry is not None else collections.deque(maxlen=WINDOW)
        shares.append(share)
        shapes[shape] = (shares, alone)  # most recently seen last
        while len(shapes) > MAX_SHAPES:
            shapes.popitem(last=False)
        self._recent.append((self.clock(), app))

    def finished(self, core: "SchedCore", r: "Request", shape: str) -> None:
        """``r`` of ``shape`` left ``core``: its share at the batch sizes its key sustained then, and
        the shape's standalone time, priced by the core's cost model at every report (the stage's
        scheduler and the simulator both record them so)."""
        at = core.batches(r)  # the batch sizes its key sustained as it left: kept with its share
        alone, share = core.standalone_s(r), core.share_s(r, at)
        if alone is not None and share is not None:
            self._record(r.app, shape, _Priced(share, lambda: core.share_s(r, at)),
                         _Priced(alone, lambda: core.standalone_s(r)))

    def report(self) -> dict[str, dict[str, Any]]:
        """{app: {"mean_s" (share), "recent" (count in the last MIX_WINDOW_S), "shapes": {shape: standalone s},
        "shares": {shape: share s}}}"""
        horizon = self.clock() - MIX_WINDOW_S
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
        recent = collections.Counter(app for _, app in self._recent)
        return {
            app: {
                "mean_s": statistics.fmean(share.now() for share in w),
                "recent": recent.get(app, 0),
                "shapes": {s: alone.now() for s, (_, alone) in self._shape[app].items()},
                "shares": {s: statistics.fmean(share.now() for share in shares)
                           for s, (shares, _) in self._shape[app].items()},
            }
            for app, w in self._app.items()
        }
