"""The ResultDeliver (DESIGN §6): sends each finished request to an instance of its
application's next stage, round-robin over the NM's route table, and the last stage's artefact
to the set's DB. It also reports progress and failures to the DB, so a client polling by UID
always sees where its request is, or why it failed.

It also forwards messages that reached this instance for a stage it no longer serves (their
sender's route table predates a move) to an instance that does, at most ``MAX_HOPS`` times.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Any, Callable

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


class ResultDeliver:
    def __init__(self, stage: str, workflow: Workflow, mailbox: "queue.Queue", routes: Callable[[], dict],
                 send_timeout: float = 5.0, on_sent: Callable[[str, str], None] = lambda address, uid: None) -> None:
        self.stage, self.workflow, self.mailbox, self.send_timeout = stage, workflow, mailbox, send_timeout
        self._routes = routes  # the NM's latest route table for this set
        # (address, uid) of each request handed to a stage instance: the heartbeat reports them,
        # so the NM can fail them if that instance dies before it names them (nm/deliveries.py).
        self._on_sent = on_sent
        self.senders: dict[str, Sender] = {}
        self._rr: dict[str, itertools.count] = {}
        self._pruned_at: int | None = None
        self._last_progress: dict[str, int] = {}

    def run(self, stop: threading.Event) -> None:
        """Deliver until ``stop`` is set and the mailbox is empty (``wake()`` after setting it)."""
        while not stop.is_set() or not self.mailbox.empty():
            try:
                item = self.mailbox.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
                continue
            try:
                self._handle(item)
            except Exception:  # one bad item must not stop delivery for everyone else
                log.exception("deliver failed on %s", item[0])

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
        if what == "result":
            self._deliver(item[1])
        elif what == "forward":
            self.forward(item[1])
        elif what == "progress":
            _, uid, app, fraction = item
            self._progress(uid, app, fraction)
        elif what == "failed":
            _, uid, app, error = item
            self._last_progress.pop(uid, None)
            self._to_db(Message({"uid": uid, "kind": "failed", "stage": self.stage, "error": error}))

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
        targets = list(self._routes()["stages"].get(stage, []))
        if not targets:
            self._fail(msg, f"no live instance of stage {stage}")
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
        self._fail(msg, f"no instance of stage {stage} took the request: {'; '.join(errors)}")

    def _fail(self, msg: Message, error: str) -> None:
        log.warning("uid=%s failed after %s: %s", msg.uid, self.stage, error)
        self._to_db(Message({"uid": msg.uid, "kind": "failed", "stage": self.stage, "error": error}))

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
            sender = self.senders[addr] = registry.connect(addr)
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
