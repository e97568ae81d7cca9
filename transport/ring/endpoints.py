"""Sender and Receiver (the transport interface every backend offers) over the ring protocol.

Backends differ only in how a sender reaches the region (``attach``) and how the receiver's
memory is made; the protocol itself is ``writer`` and ``reader``.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from onepiece.transport.base import Full, Receiver, Sender
from onepiece.transport.message import Message, MessageError, decode, encode
from onepiece.transport.ring import layout
from onepiece.transport.ring.reader import RingReader
from onepiece.transport.ring.region import MappedRegion, PeerGone, Region
from onepiece.transport.ring.writer import RingWriter

log = logging.getLogger(__name__)

# Longer than any healthy sender holds the lock (a 64 MB entry over the TCP agent takes well
# under a second), short enough that a dead holder stalls the ring only briefly.
LOCK_TIMEOUT = 2.0


class RingSender(Sender):
    """Attaches on first use; when the receiver closes or is replaced (a new generation), it
    attaches again instead of writing into a region nobody reads."""

    def __init__(self, address: str, attach: Callable[[], Region], lock_timeout: float = LOCK_TIMEOUT,
                 step_hook: Callable[[int], None] | None = None) -> None:
        self.address = address
        self._attach = attach
        self.lock_timeout = lock_timeout
        self.step_hook = step_hook
        self.writer: RingWriter | None = None

    def send(self, msg: Message, timeout: float = 5.0) -> None:
        self.send_frames(encode(msg), timeout)

    def send_frames(self, frames: list, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        pause = 1e-3
        while True:
            try:
                if self.writer is None:
                    self.writer = RingWriter(self._attach(), self.lock_timeout, self.step_hook)
                self.writer.write(frames, max(0.0, deadline - time.monotonic()))
                return
            except PeerGone as e:
                self._detach()
                if time.monotonic() >= deadline:
                    raise Full(f"no ring receiver at {self.address} within {timeout:.1f}s ({e})") from None
                time.sleep(pause)
                pause = min(pause * 2, 0.05)

    def _detach(self) -> None:
        if self.writer is not None:
            self.writer.region.close()
            self.writer = None

    def close(self) -> None:
        self._detach()


class RingReceiver(Receiver):
    """Polls its own memory; ``sock`` is None, so callers poll ``recv(0)`` on a short turn."""

    sock = None

    def __init__(self, address: str, region: MappedRegion, on_close: Callable[[], None] = lambda: None) -> None:
        self.address = address
        self.region = region
        self.reader = RingReader(region)
        self._on_close = on_close
        self._undecodable = 0
        self.rejected = 0

    def recv(self, timeout: float) -> Message | None:
        deadline = time.monotonic() + timeout
        pause = 20e-6
        while True:
            dropped = self.reader.dropped
            frames = self.reader.poll()
            if self.reader.dropped != dropped:
                log.warning("ring %s dropped %d invalid entr%s: %s", self.address, self.reader.dropped - dropped,
                            "y" if self.reader.dropped - dropped == 1 else "ies", self.reader.last_error)
            if frames is not None:
                try:
                    msg = decode(frames)
                    self.rejected = self.reader.dropped + self._undecodable
                    return msg
                except MessageError as e:
                    self._undecodable += 1
                    log.warning("ring %s dropped an undecodable message: %s", self.address, e)
                continue
            self.rejected = self.reader.dropped + self._undecodable
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 1e-3)

    def close(self) -> None:
        if self.region.base is None:
            return
        self.region.store(layout.W_STATE, layout.CLOSED)  # senders still attached notice and let go
        self._on_close()
        self.region.close()
