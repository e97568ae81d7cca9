"""Log lines for dropped (malformed, refused) messages, rate-limited per (receiver, reason).

A flood of bad messages must not fill the logs: of each (receiver, reason), the first ``burst``
drops of an interval are logged; the rest are counted, and the next drop after the interval
logs one summary line "… and K more" before its own. Reasons are reduced to their kind (what
comes before the first ':', quoted names and numbers blanked), and each receiver keeps at most
``max_kinds`` of them, so varied junk can neither grow the table nor get around the limit.
:class:`DropLimiter` is the pure core; :func:`log_dropped` is the one call the receivers make.
A flood that stops has its last count reported with the next drop of its kind, not before.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

BURST = 5
INTERVAL_S = 10.0
MAX_KINDS = 16  # per receiver
OTHER = "(other reasons)"  # the kind every further reason of a receiver shares


@dataclass
class _Window:
    start: float
    logged: int = 0
    suppressed: int = 0


class DropLimiter:
    """Which drops to log. Not thread-safe (:func:`log_dropped` holds a lock)."""

    def __init__(self, burst: int = BURST, interval_s: float = INTERVAL_S, max_kinds: int = MAX_KINDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 1 or interval_s <= 0 or max_kinds < 1:
            raise ValueError("burst and max_kinds must be >= 1 and interval_s > 0")
        self.burst, self.interval_s, self.max_kinds, self.clock = burst, interval_s, max_kinds, clock
        self._windows: dict[tuple[str, str], _Window] = {}
        self._kinds: dict[str, int] = {}  # per receiver, its kinds in the table (OTHER aside)

    def admit(self, receiver: str, reason: str) -> tuple[bool, int, str]:
        """For one drop: (log it?, how many drops of its kind went unlogged in the interval
        that just ended, > 0 only on a logged drop, whose caller reports them first; the kind
        it was counted under)."""
        now = self.clock()
        key = (receiver, kind_of(reason))
        w = self._windows.get(key)
        if w is None:
            if self._kinds.get(receiver, 0) >= self.max_kinds:
                self._expire(receiver, now)
            if self._kinds.get(receiver, 0) >= self.max_kinds:
                key = (receiver, OTHER)
                w = self._windows.get(key)
            else:
                self._kinds[receiver] = self._kinds.get(receiver, 0) + 1
        if w is None:
            w = self._windows[key] = _Window(now)
        missed = 0
        if now - w.start >= self.interval_s:
            missed, w.start, w.logged, w.suppressed = w.suppressed, now, 0, 0
        if w.logged < self.burst:
            w.logged += 1
            return True, missed, key[1]
        w.suppressed += 1
        return False, 0, key[1]

    def _expire(self, receiver: str, now: float) -> None:
        """Forget ``receiver``'s windows that ended with nothing unlogged (their next drop
        starts afresh)."""
        for key in [k for k, w in self._windows.items() if k[0] == receiver and k[1] != OTHER
                    and now - w.start >= self.interval_s and not w.suppressed]:
            del self._windows[key]
            self._kinds[receiver] -= 1


_VALUES = re.compile(r"'[^']*'|\"[^\"]*\"|\d+")


def kind_of(reason: str) -> str:
    """What a reason is about, without the values it quotes: ``"params.steps: Input should be
    ..."`` -> ``"params.steps"``, ``"part 'x' is bytes"`` -> ``"part _ is bytes"``."""
    return _VALUES.sub("_", reason.split(":", 1)[0]).strip()[:64]


_limiter = DropLimiter()
_lock = threading.Lock()


def log_dropped(logger: logging.Logger, receiver: str, reason: str, fmt: str, *args: object,
                level: int = logging.WARNING) -> None:
    """``logger.log(level, fmt, *args)`` unless drops of (``receiver``, ``reason``) are over
    their rate; then counted, and reported in one line with the next one logged."""
    with _lock:
        show, missed, kind = _limiter.admit(receiver, reason)
    if missed:
        logger.log(level, "%s: … and %d more dropped for %r (not logged: over %d per %g s)", receiver, missed,
                   kind, _limiter.burst, _limiter.interval_s)
    if show:
        logger.log(level, fmt, *args)
