"""A wake-up a ``zmq.Poller`` waits on beside its sockets and that any thread can give: so that
a loop that must notice a stop flag or an in-memory queue sleeps until there is something to
do, instead of turning on a short timer (whose turns, on a machine with few cores, take their
CPU from the workers computing models: ``onepiece bench cpu`` counts them).
"""

from __future__ import annotations

import os
import threading


class Wake:
    """An eventfd: ``set`` from any thread, ``clear`` in the loop that polls ``fd``."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._closed = False
        self._lock = threading.Lock()  # a set() racing close() never writes to a reused fd number

    def set(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.eventfd_write(self.fd, 1)
            except OSError:  # the counter is full: a wake-up is pending anyway
                pass

    def clear(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def close(self) -> None:
        """``set`` does nothing after this."""
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self.fd)
