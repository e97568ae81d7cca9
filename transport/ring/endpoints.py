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
from onepiece.transport.ring.reader import Loan, RingReader
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


class Borrowed:
    """A message received without a copy (``RingReceiver.borrow``): its parts are read-only
    views into the ring, valid until ``release()``, which frees the entry's slot. Until then no
    other receive proceeds and senders cannot reuse those bytes; release re-verifies them (after
    a lock take-over, by hashing them again: reader.py) and returns False if a stalled sender
    wrote over them meanwhile (then what was read may be torn;
    the receiver logs it and counts it in ``torn``). A context manager: ``with rx.borrow(t) as b:
    use(b.message)`` releases on exit (check ``b.intact`` after it)."""

    __slots__ = ("message", "_loan", "_receiver")

    def __init__(self, message: Message, loan: Loan, receiver: "RingReceiver") -> None:
        self.message = message
        self._loan = loan
        self._receiver = receiver

    @property
    def intact(self) -> bool | None:
        """None until released; then whether the bytes were still the verified ones."""
        return self._loan.intact

    @property
    def in_ring(self) -> bool:
        """Whether the parts are views into the ring (False: an entry that wrapped around the
        ring's end, copied out and freed at once)."""
        return self._loan.in_ring

    def release(self) -> bool:
        if not self._loan.in_ring:
            return bool(self._loan.intact)
        intact = self._loan.release()
        if not intact:
            log.warning("ring %s: a borrowed message (uid %s) was written over before its release; "
                        "what was read of it may be torn", self._receiver.address, self.message.header.get("uid"))
        return intact

    def __enter__(self) -> "Borrowed":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class RingReceiver(Receiver):
    """Polls its own memory; ``sock`` is None, so callers poll ``recv(0)`` on a short turn.
    ``recv`` copies each message out of the ring (fused with its checksum); ``borrow`` hands it
    up without a copy, for consumers that are done with it before the next receive."""

    sock = None

    def __init__(self, address: str, region: MappedRegion, on_close: Callable[[], None] = lambda: None) -> None:
        self.address = address
        self.region = region
        self.reader = RingReader(region)
        self._on_close = on_close
        self._undecodable = 0
        self.rejected = 0

    @property
    def torn(self) -> int:
        """Borrowed messages found written over at their release."""
        return self.reader.torn

    def recv(self, timeout: float) -> Message | None:
        return self._receive(timeout, False)

    def borrow(self, timeout: float) -> Borrowed | None:
        """The next valid message without a copy (see ``Borrowed``), or None after ``timeout``.
        Release it before the next ``recv`` or ``borrow`` (which raise RuntimeError until then)."""
        return self._receive(timeout, True)

    def _receive(self, timeout: float, borrow: bool):
        deadline = time.monotonic() + timeout
        pause = 20e-6
        reader = self.reader
        while True:
            dropped = reader.dropped
            if borrow:
                loan = reader.borrow()
                frames = None if loan is None else loan.frames
            else:
                frames = reader.poll()
            if reader.dropped != dropped:
                log.warning("ring %s dropped %d invalid entr%s: %s", self.address, reader.dropped - dropped,
                            "y" if reader.dropped - dropped == 1 else "ies", reader.last_error)
            if frames is not None:
                try:
                    msg = decode(frames)
                    msg.sender = "a ring sender"  # many write into one region; none is named
                    self.rejected = reader.dropped + self._undecodable
                    return Borrowed(msg, loan, self) if borrow else msg
                except MessageError as e:
                    if borrow:
                        loan.release()
                    self._undecodable += 1
                    log.warning("ring %s dropped an undecodable message: %s", self.address, e)
                continue
            self.rejected = reader.dropped + self._undecodable
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
