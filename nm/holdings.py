"""What a stage instance holds right now, for its heartbeat: the UIDs it received and has not
yet handed on (queued, at a worker, finished and in the deliverer's mailbox or being sent on,
or waiting there for a route); and what a member (a stage instance, a proxy) handed to which
instance lately (``Deliveries``).

If an instance dies, the NM reports what it held as failed (nm/reaper.py), and with it what
its senders delivered to it after its last heartbeat, which its own list could not name yet.
``TrackingReceiver`` wraps the transport receiver (a UID enters when ``recv`` returns its
message); the deliverer (stage/deliver.py) lets it go once it is handed on, its delivery
recorded first, or reported failed, or dropped. A heartbeat reads what is held before what was
delivered, so a UID on its way out is in one or the other. Both sides run on other threads than
the heartbeat, hence the lock; the work under it is a dict operation.

``fence`` takes UIDs out for good: the NM declared this instance dead and reported them failed
(nm/fencing.py). They are no longer held, are dropped if they arrive (``TrackingReceiver``), and
the deliverer hands none of them on (``fenced``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Callable

from onepiece.schema import is_name
from onepiece.transport.message import Message

log = logging.getLogger(__name__)


MAX_FENCED = 65_536  # UIDs remembered as fenced: many fences' worth (nm/fencing.py keeps 4096 per fence)


class Holdings:
    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit  # bounded: a UID that never leaves (a bug) cannot grow it forever
        self.deliveries = Deliveries(limit)  # where the UIDs that left went (the deliverer adds them)
        self._uids: OrderedDict[str, None] = OrderedDict()
        self._fenced: OrderedDict[str, None] = OrderedDict()  # reported failed for us: never ours again
        self._lock = threading.Lock()

    def add(self, uid: str) -> None:
        with self._lock:
            if uid in self._fenced:
                return
            self._uids[uid] = None
            if len(self._uids) > self.limit:
                self._uids.popitem(last=False)

    def discard(self, uid: str) -> None:
        with self._lock:
            self._uids.pop(uid, None)

    def fence(self, uids: list[str]) -> int:
        """Give ``uids`` up for good (the NM reported them failed for us); how many were held."""
        with self._lock:
            held = sum(self._uids.pop(u, False) is None for u in uids)
            for u in uids:
                self._fenced[u] = None
                self._fenced.move_to_end(u)
            while len(self._fenced) > MAX_FENCED:
                self._fenced.popitem(last=False)
        return held

    def fenced(self, uid: str) -> bool:
        with self._lock:
            return uid in self._fenced

    def snapshot(self, cap: int = 1024) -> list[str]:
        """The newest ``cap`` UIDs held (what a heartbeat carries)."""
        with self._lock:
            uids = list(self._uids)
        return uids[-cap:]

    def __len__(self) -> int:
        return len(self._uids)


class Deliveries:
    """The UIDs this member handed to which instance (its data address) lately: each heartbeat
    reports those of the last ``window_s`` with their age, so a heartbeat or two that fail lose
    nothing; the NM keeps them for as long as it may take to notice a death."""

    def __init__(self, limit: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        self._sent: deque[tuple[float, str, str]] = deque(maxlen=limit)  # (when, address, uid), oldest first
        self._lock = threading.Lock()
        self._clock = clock

    def add(self, address: str, uid: str) -> None:
        with self._lock:
            self._sent.append((self._clock(), address, uid))

    def report(self, window_s: float, cap: int = 1024) -> dict[str, list[list[Any]]]:
        """``{address: [[uid, seconds ago], ...]}`` of the newest ``cap`` deliveries within ``window_s``."""
        now = self._clock()
        with self._lock:
            while self._sent and now - self._sent[0][0] > window_s:
                self._sent.popleft()
            recent = list(self._sent)[-cap:]
        out: dict[str, list[list[Any]]] = {}
        for when, address, uid in recent:
            out.setdefault(address, []).append([uid, round(now - when, 3)])
        return out


class TrackingReceiver:
    """A transport receiver that records each message's UID as held. Everything else (the
    ``sock`` the scheduler polls, ``address``, ``close``, counters) is the wrapped one's."""

    def __init__(self, inner: Any, holdings: Holdings) -> None:
        self._inner, self._holdings = inner, holdings

    def recv(self, timeout: float) -> Message | None:
        """The next message (None: none within ``timeout``, or one that was fenced and dropped)."""
        msg = self._inner.recv(timeout)
        # Only a uid the stage will take (it drops the others): one it never hands on would be
        # held for good, and poison every heartbeat's list.
        if msg is not None and is_name(msg.header.get("uid")):
            if self._holdings.fenced(msg.header["uid"]):
                # Sent before the NM declared us dead, and reported failed since: nobody waits for it.
                log.info("uid=%s dropped on arrival: reported failed when this instance was declared dead",
                         msg.header["uid"])
                return None
            self._holdings.add(msg.header["uid"])
        return msg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


