"""Whether this member process itself stood still long enough that the NM may have declared it
dead meanwhile; and, after such a stall, waiting until a heartbeat round has told it (the member's
side of the fence, nm/fencing.py).

A stopped process (SIGSTOP, swapped out, starved) cannot know what the NM decided while it did not
run. When it runs again, all its threads go on at once: its deliverer may hand on a result its
worker finished meanwhile before its heartbeat thread has heard that the NM reported that request
failed, and in the DB ``completed`` beats ``failed``. So a tick on a thread of its own
(``Membership``) notes every ``TICK_S`` that the process runs; a gap longer than ``limit_s`` is a
stall, latched until a heartbeat round that began after it has ended (a fence it brought is then
applied), and ``settle`` waits for that, bounded.

A slow or absent NM is no stall: heartbeat rounds then take long, the ticks do not, so the data path
never waits on the NM unless the process itself stood still. The rule takes a clock (nm/liveness.py's
pattern), so it is tested without waiting.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

TICK_S = 0.5  # how often, at most, the process notes that it runs (Membership: a quarter of the limit if less)


class StallWatch:
    def __init__(self, clock: Callable[[], float] = time.monotonic, tick_s: float = TICK_S) -> None:
        self.limit_s: float | None = None  # no stall counts until the NM told its dead limit (Membership)
        self.tick_s, self._clock = tick_s, clock
        self._seen = clock()  # when the process was last seen running
        self._stalled_at: float | None = None  # the last sight before a stall no round has settled yet
        self._told: float | None = None  # the stall last logged
        self._cond = threading.Condition()

    def _observe(self) -> None:
        """The process runs now (called with the lock held)."""
        now = self._clock()
        if self._stalled_at is None and self.limit_s is not None and now - self._seen > self.limit_s:
            self._stalled_at = self._seen
        self._seen = now

    def tick(self) -> None:
        """From the watch's thread, every ``tick_s``."""
        with self._cond:
            self._observe()

    def stalled(self) -> float | None:
        """When the process was last seen before a stall that no heartbeat round settled yet (None:
        no such stall). Whoever asks runs now: it may latch a stall the tick has not seen yet."""
        with self._cond:
            self._observe()
            return self._stalled_at

    def began(self) -> float:
        """A heartbeat round (or a registration) begins: its mark for ``round_ended``."""
        with self._cond:
            self._observe()
            return self._seen

    def round_ended(self, started: float) -> None:
        """The round ``began`` marked ``started`` is over, answered or not: one that began after
        the stall settles it (a fence it brought was applied during it). One that began before
        (its answer was lost in the stall) does not: its mark is no later than the last sight."""
        with self._cond:
            self._observe()
            if self._stalled_at is not None and started > self._stalled_at:
                self._stalled_at = None
                self._cond.notify_all()

    def settle(self, timeout: float, who: str = "") -> float:
        """After a stall, wait until a heartbeat round settled it, at most ``timeout`` (then go on,
        as the data path does while the NM is away); the seconds waited. The usual case: a
        comparison under a lock."""
        with self._cond:
            self._observe()
            stalled_at = self._stalled_at
            if stalled_at is None:
                return 0.0
            t0 = self._clock()
            if self._told != stalled_at:
                self._told = stalled_at
                log.warning("%s stood still for %.1fs: handing nothing on until the node manager has said whether it "
                            "declared it dead meanwhile", who or "this process", t0 - stalled_at)
            if not self._cond.wait_for(lambda: self._stalled_at is None, timeout):
                log.warning("%s: no heartbeat round ended within %.1fs after the stall; handing on", who, timeout)
                self._stalled_at = None
                self._cond.notify_all()
            return self._clock() - t0
