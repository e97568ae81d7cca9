"""Process hygiene shared by every role that starts children."""

from __future__ import annotations

import ctypes
import logging
import signal
import threading

PR_SET_PDEATHSIG = 1


def child_preexec() -> None:
    """Run in a child between fork and exec: the kernel sends it SIGTERM when its parent dies,
    so a SIGKILLed parent leaves no orphans behind."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT, for a role's main loop to end on."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def setup_logging(role: str, level: str = "INFO") -> None:
    logging.basicConfig(level=level, format=f"%(asctime)s {role} %(name)s %(levelname)s %(message)s")
