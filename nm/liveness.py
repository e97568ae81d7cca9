"""When the embedded NM declares a silent instance dead, without blaming instances for the NM's
own stalls.

Under CPU contention the NM process itself may not run for seconds. Its heartbeats then go
unread (the members' tries time out and are dropped), and on waking it found every instance
silent beyond ``dead_after_s`` and dropped all of them at once; they registered again under new
ids. Two rules keep that from happening:

- silence counts only while the NM was listening: a turn of the NM's loop that comes longer
  than ``stall_s`` after the one before means it was not (stopped, starved, swapped out), and
  every instance's silence starts again from the end of that stall (a fresh grace period);
- the limit is never below ``MISSED`` heartbeats, so one late or lost try never costs an
  instance its place, whatever ``dead_after_s`` says.

``decide`` is the rule, a pure function of clock readings (nm/elastic.py's pattern: no sockets,
no clock of its own); ``Liveness`` is the shell the NM calls once a loop turn.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Mapping

log = logging.getLogger(__name__)

MISSED = 3  # heartbeats an instance must miss, at the least, before it is dead


@dataclass(frozen=True)
class LivenessSpec:
    heartbeat_s: float
    dead_after_s: float

    @property
    def limit_s(self) -> float:
        """Silence (while the NM listened) after which an instance is dead."""
        return max(self.dead_after_s, MISSED * self.heartbeat_s)

    @property
    def stall_s(self) -> float:
        """A gap between two turns of the NM's loop this long means the NM was not listening:
        half the limit, far above a turn's usual length (a poll of at most 0.5 s plus the work)."""
        return self.limit_s / 2


@dataclass(frozen=True)
class Verdict:
    dead: list[str]  # ids silent beyond the limit, sorted
    listening_since: float  # from when silence counts now
    stalled_s: float | None  # how long the NM's loop stalled before this turn (None: it did not)


def decide(spec: LivenessSpec, last_seen: Mapping[str, float], now: float, previous_turn: float,
           listening_since: float) -> Verdict:
    """Which instances are dead at ``now``, given when each was last heard (``last_seen``), when the
    NM's loop last turned and since when it has been listening without a stall."""
    stalled = now - previous_turn if now - previous_turn > spec.stall_s else None
    since = now if stalled is not None else listening_since
    dead = sorted(i for i, seen in last_seen.items() if now - max(seen, since) > spec.limit_s)
    return Verdict(dead, since, stalled)


class Liveness:
    """The NM's memory for ``decide``: when its loop last turned and since when it listens."""

    def __init__(self, spec: LivenessSpec, now: float | None = None) -> None:
        self.spec = spec
        now = time.monotonic() if now is None else now
        self.previous_turn = self.listening_since = now

    def dead(self, last_seen: Mapping[str, float], now: float | None = None) -> list[str]:
        """The ids to drop at this turn of the loop."""
        now = time.monotonic() if now is None else now
        verdict = decide(self.spec, last_seen, now, self.previous_turn, self.listening_since)
        if verdict.stalled_s is not None:
            log.warning("the node manager's loop stalled for %.1fs (more than %.1fs): heartbeats went unheard, so "
                        "every instance gets a fresh %.1fs before it counts as dead", verdict.stalled_s,
                        self.spec.stall_s, self.spec.limit_s)
        self.previous_turn, self.listening_since = now, verdict.listening_since
        return verdict.dead
