"""How busy each stage instance's workers were over a window, and how many of its requests left
late (DESIGN §9).

Instances report cumulative counters with every heartbeat (stage/scheduler.py): the seconds
their workers held a request (``busy_s``, summed over workers) and worker slots times wall
seconds (``slot_s``); the requests that left and, of those, the late ones (``left``, ``late``).
Over a window a ratio of two counters' increases (utilization: busy over slots; the late
share: late over left), so a missed heartbeat costs precision, not correctness. A window
counts only once samples cover most of it; an instance that changed stage, or restarted its
counters, starts a new window.
"""

from __future__ import annotations

import collections
import math
from typing import Any

COVERED = 0.8  # a window is known once samples span this share of it
MAX_SAMPLES = 1024  # per instance: bounded whatever the heartbeat rate


class Utilization:
    """Per instance, ``part`` over ``whole`` (two of its counters) over the last window."""

    def __init__(self, window_s: float, part: str = "busy_s", whole: str = "slot_s") -> None:
        self.window_s, self.part, self.whole = window_s, part, whole
        self._samples: dict[str, tuple[str | None, collections.deque]] = {}

    def observe(self, inst_id: str, stage: str | None, stats: dict[str, Any], now: float) -> None:
        """Record a heartbeat's counters for the stage the instance serves (None: not serving,
        which ends its window)."""
        busy, slot = stats.get(self.part), stats.get(self.whole)
        if stage is None or not all(_number(v) for v in (busy, slot)):
            self._samples.pop(inst_id, None)
            return
        have = self._samples.get(inst_id)
        if have is None or have[0] != stage or (have[1] and (busy < have[1][-1][1] or slot < have[1][-1][2])):
            have = self._samples[inst_id] = (stage, collections.deque(maxlen=MAX_SAMPLES))
        samples = have[1]
        if len(samples) >= 2 and now - samples[-2][0] < self.window_s / (MAX_SAMPLES // 2):
            samples[-1] = (now, float(busy), float(slot))  # heartbeats denser than needed: the newest stands in
        else:
            samples.append((now, float(busy), float(slot)))
        # Keep one sample at or before the window's start: the base of the window's increase.
        while len(samples) > 2 and samples[1][0] <= now - self.window_s:
            samples.popleft()

    def of(self, inst_id: str, now: float) -> float | None:
        """The instance's ratio over the last window, or None if not covered yet (or nothing
        was added to ``whole`` in it)."""
        inc = self.increase(inst_id, now)
        return None if inc is None else min(1.0, max(0.0, inc[0] / inc[1]))

    def increase(self, inst_id: str, now: float) -> tuple[float, float] | None:
        """How much ``part`` and ``whole`` grew over the instance's last window (``whole`` > 0),
        or None as for ``of``: what a ratio over several instances sums."""
        have = self._samples.get(inst_id)
        if have is None or len(have[1]) < 2:
            return None
        samples = have[1]
        last = samples[-1]
        if now - last[0] > self.window_s / 2:  # silent meanwhile: stale
            return None
        base = samples[0]
        for s in samples:
            if s[0] > now - self.window_s:
                break
            base = s
        if last[0] - base[0] < COVERED * self.window_s or last[2] <= base[2]:
            return None
        whole = last[2] - base[2]
        return min(whole, max(0.0, last[1] - base[1])), whole

    def forget(self, inst_id: str) -> None:
        self._samples.pop(inst_id, None)

    def keep(self, inst_ids) -> None:
        """Forget every instance not among ``inst_ids`` (those no longer registered)."""
        for gone in self._samples.keys() - set(inst_ids):
            del self._samples[gone]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
