"""The RequestScheduler (DESIGN §6), Individual mode: one bounded queue that idle workers pull
from. It owns the instance's data receiver and the socket its workers connect to, and it
alone knows which worker holds which request, so it is the one that turns a dead worker's
request into a failure.

When its queue is full it stops reading the receiver, so the transport's own bounds push back
on senders (they see ``Full`` within their send timeout) instead of memory growing here.

A message for another stage (sent on a route table from before this instance moved) is handed
to the deliverer to forward, not failed. The scheduler also keeps the instance's utilization:
worker-busy seconds and worker-wall seconds, both cumulative, which the NM turns into busy time
over wall time per window (nm/utilization.py).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import orjson
import zmq

from onepiece.stage.service_times import ServiceTimes, shape_key
from onepiece.transport.base import Receiver
from onepiece.transport.message import Message, MessageError, decode, encode, now_ns

log = logging.getLogger(__name__)


HUNG_GRACE_NS = 10_000_000_000  # past its request's deadline by this much, a worker is hung


@dataclass
class Held:
    uid: str
    app: str
    since: float
    shape: str
    deadline: int | None = None


@dataclass
class SchedulerStats:
    queue: int = 0
    capacity: int = 0
    workers: int = 0
    ready: int = 0
    busy: int = 0
    # Set once a worker first loaded, and kept while workers restart, so the NM keeps routing
    # here: requests wait in the bounded queue for the restart instead of failing upstream.
    serving: bool = False
    received: int = 0
    completed: int = 0
    failed: int = 0
    rejected_frames: int = 0
    forwarded: int = 0
    busy_s: float = 0.0  # cumulative seconds workers held a request, summed over workers
    slot_s: float = 0.0  # cumulative seconds of worker slots (workers x wall time)
    gpu_util: float | None = None  # NVML, where the workers run on GPUs (stage/gpu.py)
    # measured service times: {app: {"mean_s", "recent", "shapes": {shape: mean_s}}}
    service: dict[str, dict] = field(default_factory=dict)


class RequestScheduler:
    def __init__(self, stage: str, receiver: Receiver, worker_address: str, capacity: int, outbox: "queue.Queue",
                 stats: SchedulerStats | None = None) -> None:
        self.stage, self.receiver, self.capacity, self.outbox = stage, receiver, capacity, outbox
        self.workers = zmq.Context.instance().socket(zmq.ROUTER)
        self.workers.setsockopt(zmq.LINGER, 0)
        self.workers.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker reuses its identity
        self.workers.bind(worker_address)
        self.worker_address = self.workers.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pending: collections.deque[Message] = collections.deque()
        self.idle: collections.deque[bytes] = collections.deque()
        self.known: set[bytes] = set()  # workers that said ready at least once
        self.fresh: set[bytes] = set()  # workers whose first request (JIT, allocator warm-up) is not a sample
        self.held: dict[bytes, Held] = {}
        self.control: queue.Queue = queue.Queue(maxsize=256)  # ("died", identity, reason) from the TaskManager
        self.hung: queue.Queue = queue.Queue(maxsize=256)  # identities for the TaskManager to kill
        self.stats = stats or SchedulerStats()
        self.stats.capacity = capacity
        self._service = ServiceTimes()
        self._reported = 0.0
        self._clock = time.monotonic()

    # --- outcomes go to the ResultDeliver's mailbox ---------------------------------------
    def _emit(self, item: tuple) -> None:
        if item[0] == "progress":  # advisory: dropped rather than waited for
            try:
                self.outbox.put_nowait(item)
            except queue.Full:
                pass
            return
        try:
            self.outbox.put(item, timeout=30.0)
        except queue.Full:  # the deliverer is wedged; the DB's deadline sweep reports the request
            uid = item[1] if item[0] == "failed" else item[1].uid
            log.error("deliver mailbox full for 30s; dropped %s for uid=%s", item[0], uid)

    def _fail(self, uid: str, app: str, error: str) -> None:
        self.stats.failed += 1
        log.warning("uid=%s failed at %s: %s", uid, self.stage, error)
        self._emit(("failed", uid, app, error))

    # --- the loop ---------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(self.workers, zmq.POLLIN)
        handle = getattr(self.receiver, "sock", None)
        reading = False
        while not stop.is_set():
            want_read = len(self.pending) < self.capacity
            if handle is not None and want_read != reading:
                if want_read:
                    poller.register(handle, zmq.POLLIN)
                else:
                    poller.unregister(handle)
                reading = want_read
            # A receiver without a socket (the ring) is polled in memory, so the turn is short.
            events = dict(poller.poll(50 if handle is not None else 1))
            if self.workers in events:
                self._from_workers()
            if want_read and (handle is None or handle in events):
                self._intake()
            self._control()
            self._reclaim_hung()
            self._dispatch()
            self._update_stats()

    def _intake(self) -> None:
        while len(self.pending) < self.capacity:
            msg = self.receiver.recv(0)
            if msg is None:
                break
            self.stats.received += 1
            if msg.header.get("stage") != self.stage:
                self.stats.forwarded += 1
                self._emit(("forward", msg))
                continue
            msg.mark(self.stage, "recv")
            self.pending.append(msg)

    def _dispatch(self) -> None:
        while self.pending and self.idle:
            msg = self.pending.popleft()
            app = msg.header.get("app", "")
            deadline = msg.header.get("deadline")
            if isinstance(deadline, int) and now_ns() > deadline:
                self._fail(msg.uid, app, f"deadline exceeded before stage {self.stage}")
                continue
            ident = self.idle.popleft()
            self.held[ident] = Held(msg.uid, app, time.monotonic(), shape_key(msg.header.get("params") or {}),
                                    deadline if isinstance(deadline, int) else None)
            self.workers.send_multipart([ident, b"task", *encode(msg)], copy=False)
            self._emit(("progress", msg.uid, app, 0.0))

    def _from_workers(self) -> None:
        while True:
            try:
                frames = self.workers.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident, tag = frames[0].bytes, frames[1].bytes
            if tag == b"ready":
                self.known.add(ident)
                self.fresh.add(ident)
                self.stats.serving = True
                self._idle(ident)
            elif tag == b"progress":
                held = self.held.get(ident)
                if held is not None:
                    self._emit(("progress", held.uid, held.app, float(orjson.loads(frames[2].bytes)["fraction"])))
            elif tag in (b"done", b"failed"):
                held = self.held.pop(ident, None)
                self._idle(ident)
                if held is None:
                    continue
                if tag == b"failed":
                    self._fail(held.uid, held.app, orjson.loads(frames[2].bytes)["error"])
                    continue
                try:
                    msg = decode(frames[2:])
                except MessageError as e:  # a worker bug, not a client's: fail the request visibly
                    self._fail(held.uid, held.app, f"worker returned a malformed result: {e}")
                    continue
                self.stats.completed += 1
                if ident in self.fresh:
                    self.fresh.discard(ident)
                else:
                    self._service.add(held.app, held.shape, time.monotonic() - held.since)
                self._emit(("result", msg))

    def _idle(self, ident: bytes) -> None:
        if ident not in self.idle:
            self.idle.append(ident)

    def _control(self) -> None:
        while True:
            try:
                what, ident, reason = self.control.get_nowait()
            except queue.Empty:
                return
            if what == "died":
                self.known.discard(ident)
                if ident in self.idle:
                    self.idle.remove(ident)
                held = self.held.pop(ident, None)
                if held is not None:
                    self._fail(held.uid, held.app, f"worker {ident.decode()} of stage {self.stage} died ({reason})")

    def _reclaim_hung(self) -> None:
        """A worker still holding a request well past its deadline is stuck: fail the request
        and have the TaskManager kill it (its restart gives the slot back)."""
        now = now_ns()
        for ident, held in list(self.held.items()):
            if held.deadline is not None and now > held.deadline + HUNG_GRACE_NS:
                del self.held[ident]
                self._fail(held.uid, held.app, f"worker {ident.decode()} of stage {self.stage} hung past the deadline")
                try:
                    self.hung.put_nowait(ident)
                except queue.Full:
                    pass

    def _update_stats(self) -> None:
        s = self.stats
        now = time.monotonic()
        s.busy_s += len(self.held) * (now - self._clock)
        s.slot_s += s.workers * (now - self._clock)
        self._clock = now
        s.queue, s.ready, s.busy = len(self.pending), len(self.known), len(self.held)
        s.rejected_frames = getattr(self.receiver, "rejected", 0)
        if now - self._reported >= 0.5:  # the heartbeat reads it about once a second
            s.service = self._service.report()
            self._reported = now

    @property
    def idle_now(self) -> bool:
        """Nothing queued and no worker holding a request (read from another thread: a hint)."""
        return not self.pending and not self.held

    def close(self, moving_to: str | None = None) -> None:
        """Fail what workers still hold, so that nothing is lost silently. Shutting down also
        fails what is queued or waiting in the receiver; moving to another stage (``moving_to``)
        forwards the queue to this stage's other instances and leaves the receiver to the
        next stage's scheduler, which forwards anything that was meant for this one."""
        reason = (f"stage {self.stage} instance shut down" if moving_to is None
                  else f"stage {self.stage} instance moved to {moving_to} before the request finished")
        for held in self.held.values():
            self._fail(held.uid, held.app, reason)
        self.held.clear()
        if moving_to is None:
            while (msg := self.receiver.recv(0)) is not None:
                self.pending.append(msg)
        for msg in self.pending:
            if moving_to is None:
                self._fail(msg.uid, msg.header.get("app", ""), reason)
            else:
                self._emit(("forward", msg))
        self.pending.clear()
        self.workers.close(linger=0)
