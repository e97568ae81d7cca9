"""The request monitor (DESIGN §8), for now a bounded in-flight count.

An accepted request holds a slot until its terminal event arrives from a DB (``done`` on the
DB's events socket) or its deadline passes, whichever comes first, so a lost event can never
leak capacity for longer than one request timeout. Everything here runs on the proxy's event
loop, so reserve-then-insert needs no lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import orjson
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)


class InflightTracker:
    """Accepted-but-not-terminal requests, each with its deadline (ns since epoch)."""

    def __init__(self, max_inflight: int) -> None:
        if max_inflight <= 0:
            raise ValueError("max_inflight must be positive")
        self.max_inflight = max_inflight
        self._deadlines: dict[str, int] = {}
        self._last_sweep_ns = 0

    def __len__(self) -> int:
        return len(self._deadlines)

    def __contains__(self, uid: str) -> bool:
        return uid in self._deadlines

    def try_admit(self, uid: str, deadline_ns: int) -> bool:
        """Reserve a slot for ``uid``; False when the set is full."""
        if len(self._deadlines) >= self.max_inflight:
            now = time.time_ns()
            # A slot may be free already, its deadline passed unseen. The sweep is O(n), so a
            # flood of requests against a full set sweeps at most every 10 ms.
            if now - self._last_sweep_ns > 10_000_000:
                self.sweep(now)
            if len(self._deadlines) >= self.max_inflight:
                return False
        self._deadlines[uid] = deadline_ns
        return True

    def release(self, uid: str) -> bool:
        return self._deadlines.pop(uid, None) is not None

    def sweep(self, now_ns: int | None = None) -> int:
        """Drop entries whose deadline passed; returns how many."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        self._last_sweep_ns = now_ns
        expired = [u for u, d in self._deadlines.items() if d <= now_ns]
        for u in expired:
            del self._deadlines[u]
        return len(expired)


class DoneWatcher:
    """Subscribes to every DB's events address and reports each terminal uid.

    One SUB socket connects to all of them; ``update`` connects new DBs and drops gone ones,
    so the set of DBs can change at runtime. Malformed events are ignored.
    """

    def __init__(self, on_done: Callable[[str, str], None]) -> None:
        self.on_done = on_done
        self.sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"done")
        self.connected: set[str] = set()
        self._task: asyncio.Task | None = None

    def update(self, addresses: list[str]) -> None:
        want = {a for a in addresses if a}
        for addr in want - self.connected:
            try:
                self.sock.connect(addr)
                self.connected.add(addr)
                log.info("subscribed to DB events at %s", addr)
            except zmq.ZMQError as e:
                log.warning("cannot subscribe to DB events at %s: %s", addr, e)
        for addr in self.connected - want:
            try:
                self.sock.disconnect(addr)
            except zmq.ZMQError:
                pass
            self.connected.discard(addr)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            try:
                frames = await self.sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                log.warning("DB events socket error: %s", e)
                await asyncio.sleep(0.1)
                continue
            if len(frames) < 2 or frames[0] != b"done":
                continue
            try:
                ev = orjson.loads(frames[1])
                uid, status = ev["uid"], ev.get("status", "")
            except (orjson.JSONDecodeError, KeyError, TypeError):
                log.warning("ignored malformed DB event")
                continue
            if isinstance(uid, str):
                self.on_done(uid, str(status))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self.sock.close(linger=0)
