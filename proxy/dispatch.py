"""Hands workflow messages to the entrance instances of an application.

Round-robin over the app's entrance addresses as the cluster lists them now; on a failed send
the next instance is tried, within a bounded total time. Transport sends are synchronous and
bounded, so they run on a small thread pool and never stall the event loop. A ZMQ socket is
not thread-safe, hence one lock per cached sender.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from onepiece.transport import registry
from onepiece.transport.base import Sender, TransportError
from onepiece.transport.message import Message, MessageError

log = logging.getLogger(__name__)


class NoEntrance(RuntimeError):
    """No instance of the app's first stage is known."""


class SendFailed(RuntimeError):
    """Every entrance tried refused or did not take the message in time."""


class _Slot:
    def __init__(self, sender: Sender) -> None:
        self.sender = sender
        self.lock = threading.Lock()


class Dispatcher:
    def __init__(
        self,
        entrances: Callable[[str], list[str]],
        send_timeout: float = 1.0,
        total_timeout: float = 3.0,
        threads: int = 8,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.entrances = entrances
        self.send_timeout = send_timeout
        self.total_timeout = total_timeout
        self.on_failure = on_failure or (lambda addr: None)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="proxy-send")
        self._senders: dict[str, _Slot] = {}
        self._senders_lock = threading.Lock()
        self._rr: dict[str, itertools.count] = {}

    def _slot(self, address: str) -> _Slot:
        with self._senders_lock:
            slot = self._senders.get(address)
            if slot is None:
                slot = self._senders[address] = _Slot(registry.connect(address))
            return slot

    def _send_sync(self, address: str, msg: Message, timeout: float) -> None:
        slot = self._slot(address)
        if not slot.lock.acquire(timeout=timeout):
            raise TransportError(f"sender to {address} busy for {timeout:.1f}s")
        try:
            slot.sender.send(msg, timeout=timeout)
        finally:
            slot.lock.release()

    async def send(self, app: str, msg: Message) -> str:
        """Send ``msg`` to one entrance of ``app``; the address that took it.

        Raises NoEntrance when none is known, SendFailed when none took it in time."""
        addrs = self.entrances(app)
        if not addrs:
            raise NoEntrance(app)
        start = next(self._rr.setdefault(app, itertools.count()))
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.total_timeout
        errors = []
        for i in range(len(addrs)):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            addr = addrs[(start + i) % len(addrs)]
            try:
                await loop.run_in_executor(self._pool, self._send_sync, addr, msg, min(self.send_timeout, left))
                return addr
            except MessageError:
                raise  # the message itself cannot travel: no other instance would take it either
            except (TransportError, ValueError, OSError) as e:
                # ValueError: an address with an unknown scheme; the next instance may be fine.
                log.warning("uid=%s send to %s failed: %s", msg.uid, addr, e)
                self.on_failure(addr)
                errors.append(f"{addr}: {e}")
        raise SendFailed("; ".join(errors) or "no time left to send")

    def prune(self, keep: set[str]) -> None:
        """Close cached senders to addresses no longer listed (instances that left)."""
        with self._senders_lock:
            gone = [a for a in self._senders if a not in keep]
            slots = [self._senders.pop(a) for a in gone]
        for slot in slots:
            # Closing under the slot lock: a send in progress finishes (bounded) first.
            if slot.lock.acquire(timeout=self.send_timeout + 1):
                try:
                    slot.sender.close()
                finally:
                    slot.lock.release()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._senders_lock:
            slots = list(self._senders.values())
            self._senders.clear()
        for slot in slots:
            slot.sender.close()
