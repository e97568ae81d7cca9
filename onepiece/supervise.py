"""Process hygiene shared by every role that starts children."""

from __future__ import annotations

import ctypes
import logging
import signal
import threading
import time
from typing import Callable

PR_SET_PDEATHSIG = 1


def child_preexec() -> None:
    """Run in a child between fork and exec: the kernel sends it SIGTERM when its parent dies,
    so a SIGKILLed parent leaves no orphans behind."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_on_signals(wake: Callable[[], object] | None = None) -> threading.Event:
    """An event set by SIGTERM or SIGINT, for a role's main loop to end on; ``wake`` (if given)
    runs too, for a loop that waits on something else."""
    stop = threading.Event()

    def handler(*_: object) -> None:
        stop.set()
        if wake is not None:
            wake()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return stop


def setup_logging(role: str, level: str = "INFO") -> None:
    logging.basicConfig(level=level, format=f"%(asctime)s {role} %(name)s %(levelname)s %(message)s")


class Backoff:
    """When to restart a child that died: exponential from ``base_s`` up to ``cap_s``, reset
    when it had run for ``stable_s`` (a crash after an hour is not a crash loop)."""

    def __init__(self, base_s: float = 0.25, cap_s: float = 10.0, stable_s: float = 60.0) -> None:
        self.base_s, self.cap_s, self.stable_s = base_s, cap_s, stable_s
        self.failures = 0
        self.started = time.monotonic()

    def started_now(self) -> None:
        self.started = time.monotonic()

    def next_start(self) -> float:
        """Record a death; the monotonic time at which to start again."""
        now = time.monotonic()
        self.failures = 1 if now - self.started > self.stable_s else self.failures + 1
        return now + min(self.cap_s, self.base_s * 2 ** min(self.failures - 1, 16))
