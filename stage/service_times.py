"""Measured service times of one stage instance, per application and request shape.

The request monitor (DESIGN §8) derives capacity from these, so they are measured, never
configured: the mean of a moving window of the last requests per application and per shape
(the mean, because throughput is workers / mean service time even when shapes are mixed; the
scheduler leaves out each worker's slow first request after a (re)start), and a count
of what arrived recently per application (the mix, for stages shared between applications).
Everything is bounded: the windows, the number of shapes kept, the recent-arrivals log.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import Any

WINDOW = 32  # requests per (app) and per (app, shape) window
MAX_SHAPES = 64  # shapes kept per app, least recently seen dropped first
MIX_WINDOW_S = 30.0
MAX_RECENT = 4096


def shape_key(params: dict[str, Any]) -> str:
    """What a request's cost depends on: ``WxHxFRAMES:STEPS``."""
    return f"{params.get('width')}x{params.get('height')}x{params.get('num_frames')}:{params.get('steps')}"


class ServiceTimes:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._app: dict[str, collections.deque[float]] = {}
        self._shape: dict[str, collections.OrderedDict[str, collections.deque[float]]] = {}
        self._recent: collections.deque[tuple[float, str]] = collections.deque(maxlen=MAX_RECENT)

    def add(self, app: str, shape: str, seconds: float) -> None:
        self._app.setdefault(app, collections.deque(maxlen=WINDOW)).append(seconds)
        shapes = self._shape.setdefault(app, collections.OrderedDict())
        window = shapes.pop(shape, None) or collections.deque(maxlen=WINDOW)
        window.append(seconds)
        shapes[shape] = window  # most recently seen last
        while len(shapes) > MAX_SHAPES:
            shapes.popitem(last=False)
        self._recent.append((self.clock(), app))

    def report(self) -> dict[str, dict[str, Any]]:
        """{app: {"mean_s", "recent" (count in the last MIX_WINDOW_S), "shapes": {shape: mean_s}}}"""
        horizon = self.clock() - MIX_WINDOW_S
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
        recent = collections.Counter(app for _, app in self._recent)
        return {
            app: {
                "mean_s": statistics.fmean(w),
                "recent": recent.get(app, 0),
                "shapes": {s: statistics.fmean(d) for s, d in self._shape[app].items()},
            }
            for app, w in self._app.items()
        }
