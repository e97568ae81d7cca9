"""The ResultDeliver (DESIGN §6): sends each finished request to an instance of its
application's next stage, round-robin over the NM's route table, and the last stage's artefact
to the set's DB. It also reports progress and failures to the DB, so a client polling by UID
always sees where its request is, or why it failed.

It also forwards messages that reached this instance for a stage it no longer serves (their
sender's route table predates a move) to an instance that does, at most ``MAX_HOPS`` times.

A request whose next stage has no live instance waits for one (a restart, a move), up to
``ROUTE_WAIT_S`` and its own deadline, at most ``MAX_PARKED`` of them; then it fails with the
reason. Failing it at once failed every request that reached the stage in the seconds a
killed instance took to come back, however long its deadline.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable, NamedTuple

from onepiece.config import Workflow
from onepiece.db import protocol
from onepiece.db.placement import order_dbs
from onepiece.schema import checked
from onepiece.task_header import Routed
from onepiece.transport import registry
from onepiece.transport.base import Sender, TransportError
from onepiece.transport.message import Message

log = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0  # a bound only: an item or wake() ends the mailbox wait

MAX_HOPS = 3  # forwards per message: route tables settle within a heartbeat, so more means a loop
ROUTE_WAIT_S = 30.0  # how long a request waits for an instance of its next stage (a restart loads its models)
MAX_PARKED = 256  # requests waiting so at once; beyond, one fails at once
PARK_RETRY_S = 0.25  # how often the waiting ones look for a route (the route table follows heartbeats)


class _Parked(NamedTuple):
    msg: Message
    stage: str
    since: float  # monotonic
    until: float  # monotonic: ROUTE_WAIT_S or its deadline, the earlier
    tried: frozenset[str] = frozenset()  # addresses that failed it: it waits for one it has not tried


class ResultDeliver:
    def __init__(self, stage: str, workflow: Workflow, mailbox: "queue.Queue", routes: Callable[[], dict],
                 send_timeout: float = 5.0, on_sent: Callable[[str, str], None] = lambda address, uid: None,
                 holding: tuple[Callable[[str], None], Callable[[str], None]] | None = None,
                 dropped: Callable[[str], bool] = lambda uid: False, settle: Callable[[], Any] = lambda: None,
                 cancelled: Callable[[dict[str, Any]], bool] = lambda header: False) -> None:
        self.stage, self.workflow, self.mailbox, self.send_timeout = stage, workflow, mailbox, send_timeout
        self._routes = routes  # the NM's latest route table for this set
        # (address, uid) of each request handed to a stage instance: the heartbeat reports them,
        # so the NM can fail them if that instance dies before it names them (nm/deliveries.py).
        self._on_sent = on_sent
        # (hold, release) of a UID in what the heartbeat says this instance holds: a request that
        # waits here for a route is still this instance's (nm/holdings.py)
        self._hold, self._release = holding or (lambda uid: None, lambda uid: None)
        self._parked: collections.deque[_Parked] = collections.deque()
        self._parked_uids: set[str] = set()  # theirs, held while they wait
        # Fencing (nm/fencing.py): ``dropped(uid)``, reported failed when the NM declared this
        # instance dead, is handed on no more; ``settle()``, before anything leaves, waits
        # (bounded) after this process stood still until it knows whether it was declared dead.
        self._dropped, self._settle = dropped, settle
        # ``cancelled(header)``: deleted by its client (the scheduler heard the DBs' cancel event).
        # The scheduler forgets it where it holds it; one that already left it and waits here
        # for a route is dropped here (it was held, and handed on once a route came back).
        self._cancelled = cancelled
        self.senders: dict[str, Sender] = {}
        self._rr: dict[str, itertools.count] = {}
        self._pruned_at: int | None = None
        self._last_progress: dict[str, int] = {}

    def run(self, stop: threading.Event) -> None:
        """Deliver until ``stop`` is set and the mailbox is empty (``wake()`` after setting it);
        then what still waits for a route fails."""
        while not stop.is_set() or not self.mailbox.empty():
            try:
                item = self.mailbox.get(timeout=PARK_RETRY_S if self._parked else IDLE_WAIT_S)
            except queue.Empty:
                item = None
            try:
                if item is not None:
                    self._handle(item)
                if self._parked:
                    self._retry_parked(time.monotonic())
            except Exception:  # one bad item must not stop delivery for everyone else
                log.exception("deliver failed on %s", item[0] if item else "the requests waiting for a route")
        self.give_up_waiting()

    # --- an instance in the idle pool forwards what still reaches it, without ``run`` ---------
    def hand_on(self, msg: Message) -> None:
        """Forward ``msg`` to its stage, held until handed on (or waiting for a route) as in ``run``."""
        self._handle(("forward", msg))

    def retry_waiting(self) -> None:
        if self._parked:
            self._retry_parked(time.monotonic())

    def give_up_waiting(self) -> None:
        """Fail what still waits for a route: this instance shuts down."""
        while self._parked:
            p = self._parked.popleft()
            self._fail_parked(p, f"stage {self.stage or 'idle pool'} instance shut down while the request waited "
                                 f"for an instance of stage {p.stage}")

    def wake(self) -> None:
        """End ``run``'s wait now (its stop flag was just set)."""
        try:
            self.mailbox.put_nowait(("wake",))
        except queue.Full:  # then it is not waiting
            pass

    def _handle(self, item: tuple) -> None:
        what = item[0]
        if what == "wake":
            return
        if what == "gone":  # forgotten where it was (cancelled): nothing to hand on
            self._last_progress.pop(item[1], None)
            self._release(item[1])
            return
        self._settle()
        uid = item[1] if what in ("progress", "failed") else item[1].uid
        if what == "progress":
            if not self._dropped(uid):
                self._progress(uid, item[2], item[3])
            return
        # The request stays this instance's (its heartbeat names it) until it is handed on, its
        # delivery recorded first, or reported failed, or waits here for a route: a send waits
        # up to send_timeout, and an instance that died during it would have held nothing to reap.
        try:
            if self._dropped(uid):
                log.info("uid=%s: %s not handed on: reported failed when this instance was declared dead", uid, what)
            elif what == "result":
                self._deliver(item[1])
            elif what == "forward":
                self.forward(item[1])
            elif what == "failed":
                _, uid, app, error = item
                self._last_progress.pop(uid, None)
                self._to_db(Message({"uid": uid, "kind": "failed", "stage": self.stage, "error": error}))
        finally:
            self._let_go(uid)

    def _let_go(self, uid: str) -> None:
        """``uid`` left this instance (handed on, failed, dropped), unless it waits here for a route."""
        if uid not in self._parked_uids:
            self._release(uid)

    # --- data -------------------------------------------------------------------------------
    def _deliver(self, msg: Message) -> None:
        app = msg.header["app"]
        self._last_progress.pop(msg.uid, None)
        nxt = self.workflow.next_stage(app, self.stage)
        if nxt is None:
            msg.header.update(kind="result", stage=None, content_type="video/mp4")
            if protocol.CONTENT not in msg.parts:
                self._fail(msg, f"stage {self.stage} produced no '{protocol.CONTENT}' part")
            elif not self._to_db(msg):
                log.error("uid=%s: no DB took the result", msg.uid)
            return
        msg.header["stage"] = nxt
        self._to_stage(msg, nxt)

    def forward(self, msg: Message) -> None:
        """Send on a message that reached this instance for another stage."""
        try:
            r = checked(Routed, msg.header)
        except ValueError as e:
            self._fail(msg, f"malformed message to forward (from {msg.sender or '?'}): {e}")
            return
        stage, hops = r.stage, r.hops
        if stage not in self.workflow.stages or r.app not in self.workflow.applications:
            self._fail(msg, f"message for unknown stage {stage!r} or application {r.app!r}")
        elif hops >= MAX_HOPS:
            self._fail(msg, f"forwarded {hops} times without reaching an instance of stage {stage}")
        else:
            msg.header["hops"] = hops + 1
            log.info("uid=%s: forwarding to stage %s (this instance serves %s)", msg.uid, stage, self.stage)
            self._to_stage(msg, stage)

    def _to_stage(self, msg: Message, stage: str) -> None:
        self._settle()  # (it may come from the requests waiting for a route)
        if self._dropped(msg.uid):  # fenced while it waited for a route
            log.info("uid=%s not handed on: reported failed when this instance was declared dead", msg.uid)
            return
        targets = list(self._routes()["stages"].get(stage, []))
        if not targets:
            self._park(msg, stage)
            return
        start = next(self._rr.setdefault(msg.header["app"], itertools.count()))
        errors = []
        for k in range(len(targets)):
            addr = targets[(start + k) % len(targets)]
            try:
                self._sender(addr).send(msg, timeout=self.send_timeout)
                self._on_sent(addr, msg.uid)
                return
            except TransportError as e:
                errors.append(str(e))
        # Every route failed: the instances may have just died, their restarts not routed yet
        # (over ring+tcp a restart listens on a new port). Wait for a route not tried yet.
        self._park(msg, stage, tried=frozenset(targets), why="; ".join(errors))

    def _fail(self, msg: Message, error: str) -> None:
        log.warning("uid=%s failed after %s: %s", msg.uid, self.stage, error)
        self._to_db(Message({"uid": msg.uid, "kind": "failed", "stage": self.stage, "error": error}))

    # --- waiting for a route ----------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Requests waiting for an instance of their next stage (read from other threads: a hint)."""
        return len(self._parked)

    def _park(self, msg: Message, stage: str, tried: frozenset[str] = frozenset(), why: str = "") -> None:
        now = time.monotonic()
        deadline = msg.header.get("deadline")
        left = (deadline - time.time_ns()) / 1e9 if isinstance(deadline, int) else ROUTE_WAIT_S
        if left <= 0 or len(self._parked) >= MAX_PARKED:
            full = "its deadline passed" if left <= 0 else f"{MAX_PARKED} requests already wait for one"
            self._fail(msg, f"no live instance of stage {stage} ({full})" + (f": {why}" if why else ""))
            return
        log.info("uid=%s waits for an instance of stage %s (up to %.0fs)%s", msg.uid, stage, min(left, ROUTE_WAIT_S),
                 f": {why}" if why else "")
        self._hold(msg.uid)
        self._parked_uids.add(msg.uid)
        self._parked.append(_Parked(msg, stage, now, now + min(left, ROUTE_WAIT_S), tried))

    def _retry_parked(self, now: float) -> None:
        """Send on the waiting requests whose stage has an instance now; fail those out of time."""
        stages = self._routes()["stages"]
        for _ in range(len(self._parked)):
            p = self._parked.popleft()
            uid = p.msg.uid
            if self._cancelled(p.msg.header):
                self._parked_uids.discard(uid)
                self._let_go(uid)
                log.info("uid=%s cancelled while it waited for an instance of stage %s: dropped", uid, p.stage)
            elif set(stages.get(p.stage) or ()) - p.tried:
                self._parked_uids.discard(uid)
                try:
                    self._to_stage(p.msg, p.stage)  # held until sent (or parked again)
                finally:
                    self._let_go(uid)
            elif now >= p.until:
                self._fail_parked(p, f"no live instance of stage {p.stage} within {now - p.since:.0f}s")
            else:
                self._parked.append(p)

    def _fail_parked(self, p: _Parked, error: str) -> None:
        self._parked_uids.discard(p.msg.uid)
        self._let_go(p.msg.uid)
        self._fail(p.msg, error)

    # --- DB ---------------------------------------------------------------------------------
    def _progress(self, uid: str, app: str, fraction: float) -> None:
        stages = self.workflow.applications[app].stages
        pct = protocol.progress_of(stages.index(self.stage), len(stages), fraction)
        if self._last_progress.get(uid) == pct:
            return
        self._last_progress[uid] = pct
        if len(self._last_progress) > 10_000:  # bounded: entries of lost requests age out
            self._last_progress.pop(next(iter(self._last_progress)))
        self._to_db(Message({"uid": uid, "kind": "status", "status": protocol.IN_PROGRESS,
                             "stage": self.stage, "progress": pct}), timeout=0.1)

    def _to_db(self, msg: Message, timeout: float | None = None) -> bool:
        """Send to the UID's DB, or the next one in placement order; False if none took it."""
        addrs = [d["data"] for d in order_dbs(msg.uid, self._routes().get("dbs", []))]
        for addr in addrs:
            try:
                self._sender(addr).send(msg, timeout=self.send_timeout if timeout is None else timeout)
                return True
            except TransportError as e:
                log.warning("uid=%s: DB %s did not take %s: %s", msg.uid, addr, msg.kind, e)
        if not addrs:
            log.error("uid=%s: no DB in the route table for %s", msg.uid, msg.kind)
        return False

    def _sender(self, addr: str) -> Sender:
        routes = self._routes()
        if routes.get("version") != self._pruned_at:
            self._prune(routes)
        sender = self.senders.get(addr)
        if sender is None:
            try:
                sender = self.senders[addr] = registry.connect(addr)
            except (ValueError, OSError) as e:  # a route to nowhere fails this send, not the deliverer
                raise TransportError(f"cannot connect to {addr!r}: {e}") from None
        return sender

    def _prune(self, routes: dict[str, Any]) -> None:
        """Close senders to addresses that left the route table (restarts bind new ones)."""
        self._pruned_at = routes.get("version")
        live = {a for addrs in routes["stages"].values() for a in addrs} | {d["data"] for d in routes["dbs"]}
        for addr in [a for a in self.senders if a not in live]:
            self.senders.pop(addr).close()

    def close(self) -> None:
        for s in self.senders.values():
            s.close()
        self.senders.clear()
