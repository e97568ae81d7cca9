"""The DB role (DESIGN §7): a :class:`ResultStore` behind three sockets, served by one thread.

- data address (any transport, ``transport.registry.listen``): ``status`` / ``result`` /
  ``failed`` reports from stages, ``replica`` / ``purge`` / ``fetched`` from peers (see
  ``db/protocol.py``);
- control address (``transport.rpc.RpcServer``): the ops below;
- events address (ZMQ PUB): ``[b"done", {"uid", "status", "service_s"?}]`` on every terminal
  transition (``service_s``: the stages' workers' seconds by the trace, where it pairs any), and
  ``[b"cancel", {"uid"}]`` when a request that is not completed is deleted (stages drop it).

RPC ops (request fields -> reply fields; errors come back as ``{"ok": false, "error": ...}``):

- ``create`` ``{record, if_absent?}`` -> ``{record, created}``; error ``"store full: ..."`` when
  it does not fit. With ``if_absent`` (an idempotent create, whose UID is derived from its
  key) a record already held is answered as it is (``created: false``), and a UID dropped here
  within a TTL, or held for another owner, is refused with ``"gone: <uid>"``: one DB loop
  thread decides, so two concurrent retries cannot both create;
- ``get`` ``{uid, owner?}`` -> ``{record}``; error ``"not found: <uid>"``;
- ``content`` ``{uid, owner?}`` -> ``{record}`` + one blob frame, the artefact; it then expires
  here and on the peers ``purge_after_fetch_s`` later (0: purged at once; None: at its TTL);
  errors ``"not found: <uid>"``, ``"not ready: <uid> is <status>"``;
- ``delete`` ``{uid, owner?, forget?}`` -> ``{deleted: bool}`` (peers are told to purge too);
  with ``owner``, a DB that does not hold the record leaves its peers alone (the client asks
  every DB, and one that holds it checks the owner); ``forget`` leaves no tombstone and sends
  no cancel (a create that never reached a stage, so that a retry may create it again);
- ``list`` ``{owner?, after?, limit, order}`` (``db.protocol.ListArgs``) -> ``{records,
  has_more}``: a page of records by creation time, without their traces;
- a given ``owner`` that differs from the record's makes it "not found";
- ``stats`` -> ``{stats: {records, bytes, max_bytes, content_bytes, by_status, tombstones,
  name, addresses, peers, replication: {factor, queued, sent, dropped, short, filled, filling},
  refused, malformed}}``;
- ``ping`` -> ``{name, data_address, control_address, events_address}``.

Replication peers are set in-process with :meth:`DbServer.set_peers`, as the set's DB address
dicts (``{"data", "control", ...}``; ``db/service.py`` keeps them equal to the NM's route table).

``DbServer.snapshot`` is the ``stats`` dict as of the last sweep, taken on the loop thread:
other threads (the NM heartbeat) read that, never the store, which only the loop touches.

Replication has no consensus: every local change (and purge) is put on a bounded queue that a
separate thread sends to peers' data addresses with a short timeout. A change to a UID goes to
the first ``replication`` DBs of the set in the UID's placement order
(``db.placement.order_dbs``, ranked by control address), this DB counting as one holder where
it ranks: readers ask in that same order, so the DBs they ask first are the ones that hold it,
and the traffic per change is ``replication - 1`` messages, not one per DB. A peer that is down
is passed over for the next one in order, so a result still reaches ``replication`` live DBs
while the NM has not yet dropped the dead one. A purge (fetched or deleted) goes to every peer:
it is header-only, and a record may sit on a DB outside the current first ``replication``
(a substitute while a peer was down, a write that fell over to a later DB, a set that changed
since), where the purge's tombstone also stops late copies from bringing it back.

A full queue or a peer that does not take a message drops it (counted, logged); a peer that
failed is skipped for ``peer_backoff_s`` so one dead peer cannot slow replication to the live
ones; a change that reached fewer than ``replication`` holders is counted as ``short``. What
arrives as ``replica``/``purge`` is applied and never forwarded, so there are no loops; the
merge rules of ``db/store.py`` make peers converge whatever order copies arrive in.

Copies reconcile: a change that fell short (no peers known yet, as while a restarted NM hands
out routes again, or a peer that did not take it) is owed. The DB sends the record as it holds
it now again when its peers change and every ``REPAY_S`` while anything is owed (bounded:
``OWED_MAX`` uids, the oldest forgotten first), so a failure written to one copy reaches the
others in the end.

Peers are filled: a change reaches only the DBs listed when it is made, so a DB that joins,
or comes back from a restart empty, would otherwise hold only what changes after. When a DB
learns of a peer it did not list (``set_peers``), it sends that peer every live record that
placement gives it, with its content, as ``replica`` messages (the merge rules keep whatever
the peer holds that is newer), and first a ``purge`` for each of those UIDs it dropped within a
TTL (its tombstones, which stop late copies and an idempotent create from bringing them back);
when its list changes otherwise (a DB left), each peer gets the
records whose holders moved to it. A restarted DB at the same addresses may never leave its
peers' lists (the NM replaces it at once), so a DB greets every peer it has not greeted yet
(``hello``) and a greeted DB fills the greeter. A fill is walked a bounded slice per loop turn
and handed to the replicator only while its queue is short, so it goes at the peers' pace and
never crowds out live changes; a peer that does not take it is retried from where it failed,
backing off, ``FILL_TRIES`` times, then given up with a log line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import zmq
from prometheus_client import Counter, Gauge

from onepiece.db.placement import order_dbs
from onepiece.db.protocol import (COMPLETED, CONTENT, DATA_SCHEMAS, PROXY_OPS, RPC_SCHEMAS, CreateArgs, DeleteArgs,
                                  FailedReport, HelloMessage, ListArgs, PurgeMessage, ReplicaMessage, ResultReport,
                                  RunningArgs, StatusReport, UidArgs)
from onepiece.db.store import DEADLINE_GRACE_S, Change, Gone, InvalidUpdate, NotFound, ResultStore, StoreFull
from onepiece.droplog import log_dropped
from onepiece.events import CANCEL, DONE, event_frames
from onepiece.schema import checked
from onepiece.supervise import stop_on_signals
from onepiece.transport import curve, registry
from onepiece.transport.base import Receiver, Sender, TransportError
from onepiece.transport.message import Message, MessageError, new_uid, service_s
from onepiece.transport.rpc import RpcServer
from onepiece.transport.zmq_transport import bind_address

EVERY_PEER = frozenset({"purge", "fetched"})  # sent to every peer: any may hold a copy
log = logging.getLogger("onepiece.db")

# Module-level metrics labelled by DB name: several DBs may share a process (tests, `up`),
# and the default registry refuses a metric name registered twice.
RECORDS = Gauge("onepiece_db_records", "Records held by the DB", ["db"])
BYTES = Gauge("onepiece_db_bytes", "Bytes held: artefacts plus record estimates", ["db"])
WRITES = Counter("onepiece_db_writes", "Writes applied, by kind", ["db", "kind"])
READS = Counter("onepiece_db_reads", "Reads served, by kind", ["db", "kind"])
REFUSED = Counter("onepiece_db_refused", "Writes refused because the store is full", ["db"])
MALFORMED = Counter("onepiece_db_malformed", "Data messages dropped as malformed", ["db"])
EXPIRED = Counter("onepiece_db_expired", "Records dropped when their TTL ran out", ["db"])
DEADLINE_FAILED = Counter("onepiece_db_deadline_failed", "Requests failed by the deadline sweep", ["db"])
REPL_SENT = Counter("onepiece_db_replication_sent", "Replication messages handed to a peer", ["db"])
REPL_DROPPED = Counter("onepiece_db_replication_dropped",
                       "Replication messages dropped (queue full, peer down)", ["db"])
REPL_SHORT = Counter("onepiece_db_replication_short",
                     "Changes that reached fewer DBs than the replication factor", ["db"])
REPL_FILLED = Counter("onepiece_db_replication_filled",
                      "Records handed to a peer that joined (or whose share grew)", ["db"])

DRAIN_S = 1.0  # how long a stopping DB keeps sending queued replication messages
TURN_MS = 250  # the longest a loop turn waits for a message (stop and close are noticed within it)
REPL_WAIT_S = 1.0  # a bound only: a change to replicate or _stop_replicator's None ends the wait
REPAY_S = 5.0  # how often changes that fell short are sent again (and at once when peers change)
OWED_MAX = 10_000
REPAY_BATCH = 256
DATA_BATCH = 256  # data messages handled per loop turn before the control socket is looked at
FILL_BATCH = 128  # fill messages queued per loop turn, and only while the queue holds fewer
FILL_SCAN = 512  # records a fill looks at per loop turn (placement: ~3 ms in all): a turn stays short
FILL_TURN_MS = 10  # the loop's longest wait while a fill can go on
FILL_TRIES = 4  # failures in a row (no record taken between) before a peer's fill is given up
GREETED_MAX = 1024  # peers this process has greeted, the oldest forgotten first


@dataclass(eq=False)
class _Fill:
    """Filling one peer with the records placement gives it. The loop thread owns it, except
    ``gen``, ``queued``, ``acked`` and ``failed_at``, shared with the replicator under
    ``DbServer._fill_lock``."""

    peer: dict[str, str]
    peers: list[dict[str, str]]  # the peer list placement is computed with
    since: list[dict[str, str]] | None  # the list it has held its share as of; None: nothing held
    uids: list[str]  # this DB's uids when the fill (re)started
    pos: int = 0  # the next uid to look at; -1: the hello first
    tries: int = 0  # failures in a row
    not_before: float = 0.0  # monotonic: a retry waits until then
    gen: int = 0  # bumped on a rewind or cancel: queued messages of an older gen are skipped
    queued: int = 0  # messages of this gen queued...
    acked: int = 0  # ...and taken by the peer
    failed_at: int | None = None  # the first position of this gen the peer did not take
    sent: int = 0  # records taken, in all


@dataclass(frozen=True)
class _Directed:
    """A fill's message: for its fill's peer only, not placed by its UID like a change."""

    msg: Message
    fill: _Fill
    gen: int
    pos: int


class DbServer:
    def __init__(
        self,
        data_address: str,
        control_address: str,
        events_address: str,
        ttl_s: float = 3600.0,
        max_bytes: int = 1 << 30,
        purge_after_fetch_s: float | None = 60.0,
        name: str = "db",
        *,
        peers: Iterable[Mapping[str, str]] = (),
        replication: int = 2,
        sweep_interval_s: float = 0.25,
        deadline_grace_s: float = DEADLINE_GRACE_S,
        replication_queue: int = 10_000,
        replication_timeout_s: float = 0.25,
        peer_backoff_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        set_name: str = "set0",
    ) -> None:
        if not isinstance(replication, int) or replication < 1:
            raise ValueError(f"replication must be a positive int (got {replication!r})")
        readers = curve.proxy_pair(set_name)  # with CURVE, the only key that reads users' records here
        keys = curve.active()
        if keys is not None and readers not in keys.names.values():
            raise curve.CurveKeysError(f"CURVE keys folder {keys.folder}: no {readers}.key, so no proxy of set "
                                       f"{set_name} could read its records (make it: onepiece keys curve "
                                       f"{keys.folder} --sets {set_name})")
        self.name = name
        self.replication = replication  # holders per result, this DB included
        self.store = ResultStore(ttl_s, max_bytes, purge_after_fetch_s, clock=clock,
                                 deadline_grace_s=deadline_grace_s)
        self.sweep_interval_s = sweep_interval_s
        self.replication_timeout_s = replication_timeout_s
        self.peer_backoff_s = peer_backoff_s
        # None: wake up; _Directed: a fill's message for one peer
        self._outq: queue.Queue[Message | _Directed | None] = queue.Queue(maxsize=replication_queue)
        self._peers: list[dict[str, str]] = []
        self._peers_lock = threading.Lock()
        self._owed: dict[str, None] = {}  # uids whose last change fell short, oldest first
        self._owed_lock = threading.Lock()  # the loop and the replicator both owe
        self._peers_changed = threading.Event()
        # Filling peers (loop thread): the fill per peer, by control address; the peer list each
        # peer has held its share as of (its fill done); the list last planned against.
        self._fills: dict[str, _Fill] = {}
        self._bases: dict[str, tuple[dict[str, str], list[dict[str, str]]]] = {}
        self._planned: frozenset[tuple[str, str]] = frozenset()
        self._fill_lock = threading.Lock()  # _Fill's shared fields and _greeted: loop and replicator
        self._greeted: dict[str, None] = {}  # control addresses this process has said hello to
        self._incarnation = new_uid()  # this process, as its hellos name it
        self._closing = threading.Event()
        self._idle = threading.Event()  # set while run() is not executing
        self._idle.set()
        self._closed = False
        self._replicator: threading.Thread | None = None
        self._repl_stop = threading.Event()
        self.counts = {"sent": 0, "dropped": 0, "short": 0, "filled": 0, "refused": 0, "malformed": 0}
        self._counts_lock = threading.Lock()  # the loop and the replicator both count
        self._last_drop_log = float("-inf")
        self._ipc_paths: list[str] = []
        self.receiver: Receiver | None = None
        self.rpc: RpcServer | None = None
        self.pub: zmq.Socket | None = None
        try:
            self.receiver = registry.listen(data_address)
            self.data_address = self.receiver.address
            self.rpc = RpcServer(control_address, {
                "create": self._op_create, "get": self._op_get, "content": self._op_content, "handed": self._op_handed,
                "delete": self._op_delete, "list": self._op_list, "state": self._op_state, "stats": self._op_stats,
                "ping": self._op_ping, "running": self._op_running,
            }, RPC_SCHEMAS, {op: readers for op in PROXY_OPS})
            self.control_address = self.rpc.address
            self.pub = zmq.Context.instance().socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.setsockopt(zmq.SNDHWM, 10_000)  # PUB drops beyond this; it never blocks
            curve.server(self.pub).bind(bind_address(events_address))
            self.events_address = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            self._release()
            raise
        self._ipc_paths = [a[len("ipc://"):] for a in (self.data_address, self.control_address,
                                                        self.events_address) if a.startswith("ipc://")]
        # This DB as a placement entry: it ranks among its peers by its control address.
        self._me = {"data": self.data_address, "control": self.control_address}
        self.set_peers(peers)
        self.snapshot: dict[str, Any] = self.stats()

    # ---- peers (callable from any thread) --------------------------------------------------

    def set_peers(self, peers: Iterable[Mapping[str, str]]) -> None:
        """Replace the set's other DBs, as address dicts with at least ``data`` (where copies
        go) and ``control`` (the placement key). This DB itself, duplicates and entries
        lacking either address are left out, so the NM's whole DB list may be passed."""
        out: dict[str, dict[str, str]] = {}  # by control address: the placement key
        for p in peers:
            if not isinstance(p, Mapping):
                continue
            data, control = p.get("data"), p.get("control")
            if not (isinstance(data, str) and data and isinstance(control, str) and control):
                continue
            if data == self._me["data"] or control == self._me["control"]:
                continue
            out.setdefault(control, {"data": data, "control": control})
        with self._peers_lock:
            before, self._peers = self._peers, list(out.values())
        self._peers_changed.set()
        if self._peers != before:  # every route update brings the list: said when it changes
            log.info("db %s: replication peers %s (factor %d)", self.name, [p["data"] for p in out.values()],
                     self.replication)

    def advertise_as(self, data: str, control: str) -> None:
        """The addresses peers know this DB by, when not the bound ones (a DB bound to 0.0.0.0
        in a container is reached by its service name): its placement key and self-check."""
        self._me = {"data": data, "control": control}

    @property
    def peers(self) -> list[dict[str, str]]:
        """The other DBs of the set (``{"data", "control"}`` each)."""
        with self._peers_lock:
            return [dict(p) for p in self._peers]

    def holders(self, uid: str) -> list[dict[str, str]]:
        """The DBs of the set (this one included) that should hold ``uid`` when all are up:
        the first ``replication`` in its placement order."""
        return order_dbs(uid, [self._me, *self.peers])[:self.replication]

    # ---- the loop ----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set (or ``close()`` is called)."""
        if self._closed:
            raise RuntimeError(f"db {self.name} is closed")
        self._idle.clear()
        try:
            self._start_replicator()
            poller = zmq.Poller()
            poller.register(self.rpc.sock, zmq.POLLIN)
            # A ZMQ receiver exposes its socket, so one poll waits on data and control. Other
            # backends (ring buffer) are polled with recv(0) every turn, and the turn is short.
            data_sock = getattr(self.receiver, "sock", None)
            if isinstance(data_sock, zmq.Socket):
                poller.register(data_sock, zmq.POLLIN)
            else:
                data_sock = None
            next_sweep = time.monotonic() + self.sweep_interval_s
            next_repay = time.monotonic() + REPAY_S
            self.snapshot = self.stats()
            log.info("db %s serving data=%s control=%s events=%s", self.name, self.data_address,
                     self.control_address, self.events_address)
            while not stop.is_set() and not self._closing.is_set():
                # Sockets wake it; with nothing arriving it turns for the next sweep (which also
                # notices stop and close). The ring has no socket: polled every millisecond.
                wait_ms = 1 if data_sock is None else max(1, min(TURN_MS, int((next_sweep - time.monotonic()) * 1000),
                                                                 self._fill_wait_ms()))
                events = dict(poller.poll(wait_ms))
                if data_sock is None or data_sock in events:
                    self._drain_data()
                if self.rpc.sock in events:
                    self.rpc.handle()
                if self._peers_changed.is_set() or time.monotonic() >= next_repay:
                    self._peers_changed.clear()
                    self._plan_fills()
                    self._repay()
                    next_repay = time.monotonic() + REPAY_S
                self._fill_step()
                if time.monotonic() >= next_sweep:
                    try:
                        self._sweep()
                    except Exception:  # (a stored string expires_at once ended the loop here)
                        log.exception("db %s: a sweep failed; serving on", self.name)
                    self.snapshot = self.stats()  # replaced whole, never mutated: safe to read anywhere
                    next_sweep = time.monotonic() + self.sweep_interval_s
                RECORDS.labels(self.name).set(len(self.store))
                BYTES.labels(self.name).set(self.store.bytes_used)
        finally:
            self._stop_replicator()
            self._idle.set()

    def _drain_data(self) -> None:
        for _ in range(DATA_BATCH):
            msg = self.receiver.recv(0)
            if msg is None:
                return
            try:
                self._on_data(msg)
            except Exception:  # the last guard: a DB loop that died would lose every record
                log.exception("db %s: uid=%s a message from %s broke its handling; dropped", self.name,
                              msg.header.get("uid"), msg.sender or "?")

    def _on_data(self, msg: Message) -> None:
        h = msg.header
        kind = h.get("kind")
        if msg.caller not in (None, curve.NAME):
            # Stages and the other DBs send here, never a proxy: a proxy host (the one facing the
            # clients) taken over must not write statuses or results into users' records.
            self._malformed(msg, ValueError(f"sent with the {msg.caller} key: a DB takes data from members only"))
            return
        try:
            schema = DATA_SCHEMAS.get(kind) if isinstance(kind, str) else None
            if schema is None:
                raise InvalidUpdate(f"kind: unknown data message kind {str(kind)[:80]!r}")
            m = checked(schema, h, kind)
        except ValueError as e:  # (InvalidUpdate is one)
            self._malformed(msg, e)
            return
        uid = m.uid
        # Identity a stage's message may carry: fills a record this DB has not seen created.
        extra = {k: v for k in ("app", "set") if (v := getattr(m, k, None)) is not None}
        try:
            if isinstance(m, StatusReport):
                if m.deadline is not None:
                    extra["deadline"] = m.deadline
                change = self.store.set_status(uid, m.status, m.stage, m.progress, **extra)
            elif isinstance(m, ResultReport):
                change = self.store.put_result(uid, _content_of(msg, required=True), m.content_type, m.trace, **extra)
            elif isinstance(m, FailedReport):
                change = self.store.fail(uid, m.stage, m.error or f"failed at stage {m.stage}", **extra)
            elif isinstance(m, ReplicaMessage):
                change = self.store.apply_replica(h["record"], _content_of(msg, required=False))
                WRITES.labels(self.name, kind).inc()
                if change is not None:
                    self._on_change(change, replicate=False)  # never forwarded: no loops
                return
            elif isinstance(m, HelloMessage):
                self._on_hello(m.control)
                return
            elif isinstance(m, PurgeMessage):
                self.store.purge(uid, tombstone=not m.forget)
                WRITES.labels(self.name, kind).inc()
                log.debug("db %s: uid=%s purged by a peer", self.name, uid)
                return
            else:  # FetchedMessage: the schemas name no other kind
                self.store.expire_by(uid, m.expires_at)
                WRITES.labels(self.name, kind).inc()
                return
        except StoreFull as e:
            self._refused(uid, str(e))
            if kind == "result":
                # The artefact does not fit: say so in the record rather than leave the client
                # waiting for a result that will never come.
                try:
                    change = self.store.fail(uid, None, str(e))
                except (StoreFull, InvalidUpdate):
                    return
            else:
                return
        except (MessageError, KeyError, TypeError, ValueError) as e:  # (InvalidUpdate is a ValueError)
            self._malformed(msg, e)
            return
        WRITES.labels(self.name, kind).inc()
        if change is not None:
            self._on_change(change, replicate=True)

    def _malformed(self, msg: Message, e: Exception) -> None:
        self._count("malformed")
        MALFORMED.labels(self.name).inc()
        log_dropped(log, f"db {self.name} at {self.data_address}", str(e),
                    "db %s: uid=%s dropped a malformed %r message from %s: %s", self.name, msg.header.get("uid"),
                    str(msg.header.get("kind"))[:80], msg.sender or "?", e)

    def _on_change(self, change: Change, replicate: bool) -> None:
        rec = change.record
        if change.terminal:
            log.info("db %s: uid=%s %s%s", self.name, rec["uid"], rec["status"],
                     f" ({rec['error']})" if rec.get("error") else "")
            self._publish(rec)
        if replicate:
            parts = {CONTENT: change.content} if change.content is not None else {}
            self._replicate(Message({"uid": rec["uid"], "kind": "replica", "record": rec}, parts))

    def _publish(self, rec: dict[str, Any]) -> None:
        self._event(DONE, rec["uid"], rec["status"], service_s(rec.get("trace")))

    def _event(self, topic: bytes, uid: str, status: str, spent_s: float | None = None) -> None:
        try:
            self.pub.send_multipart(event_frames(topic, uid, status, spent_s), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("db %s: uid=%s %s event dropped (subscribers not reading)", self.name, uid, topic.decode())

    def _count(self, what: str, n: int = 1) -> None:
        with self._counts_lock:
            self.counts[what] += n

    def _refused(self, uid: Any, why: str) -> None:
        self._count("refused")
        REFUSED.labels(self.name).inc()
        log.warning("db %s: uid=%s refused: %s", self.name, uid, why)

    def _sweep(self) -> None:
        swept = self.store.sweep()
        for uid in swept.expired:
            EXPIRED.labels(self.name).inc()
            log.info("db %s: uid=%s expired", self.name, uid)
        for change in swept.failed:
            DEADLINE_FAILED.labels(self.name).inc()
            self._on_change(change, replicate=True)

    # ---- RPC ops (run on the loop thread, inside RpcServer.handle) ---------------------------

    def _op_create(self, req: CreateArgs, blobs: list) -> dict:
        record = req.record.model_dump(exclude_unset=True)  # as sent: no defaults added
        if req.if_absent:
            uid = req.record.uid
            held = self.store.get(uid)
            if held is not None and held.get("owner") == record.get("owner"):
                return {"record": held, "created": False}
            if held is not None or self.store.gone(uid):
                raise Gone(f"gone: {uid} was created before and is not available to create again")
        try:
            change = self.store.create(record)
        except StoreFull as e:
            self._refused(record.get("uid"), str(e))
            raise
        WRITES.labels(self.name, "create").inc()
        if change is not None:
            log.info("db %s: uid=%s created", self.name, change.record["uid"])
            self._on_change(change, replicate=True)
        return {"record": self.store.get(record["uid"]), "created": True}

    def _owned(self, req: UidArgs) -> tuple[str, dict[str, Any] | None]:
        """The request's uid and its record here, None when absent or another owner's."""
        uid = req.uid
        rec = self.store.get(uid)
        if rec is not None and req.owner is not None and rec.get("owner") != req.owner:
            rec = None
        return uid, rec

    def _op_get(self, req: UidArgs, blobs: list) -> dict:
        uid, rec = self._owned(req)
        READS.labels(self.name, "get").inc()
        if rec is None:
            raise NotFound(f"not found: {uid}")
        return {"record": rec}

    def _op_handed(self, req: UidArgs, blobs: list) -> dict:
        """The proxy handed the request over (proxy/idempotency.py): the record says so, here
        and on its copies."""
        uid, rec = self._owned(req)
        if rec is None:
            raise NotFound(f"not found: {uid}")
        change = self.store.note(uid, handed=True)
        WRITES.labels(self.name, "handed").inc()
        if change is not None:
            self._on_change(change, replicate=True)
        return {"record": self.store.get(uid)}

    def _op_state(self, req: UidArgs, blobs: list) -> dict:
        """Where a request is, without what it holds (any member may ask: protocol.PROXY_OPS)."""
        rec = self.store.get(req.uid)
        READS.labels(self.name, "state").inc()
        if rec is None:
            raise NotFound(f"not found: {req.uid}")
        return {"record": {k: rec.get(k) for k in ("uid", "app", "status", "stage")}}

    def _op_running(self, req: RunningArgs, blobs: list) -> dict:
        """The requests not finished yet, where they are (any member may ask, as for ``state``)."""
        READS.labels(self.name, "running").inc()
        return {"records": self.store.running(req.before, req.limit)}

    def _op_content(self, req: UidArgs, blobs: list) -> tuple[dict, list]:
        uid, rec = self._owned(req)
        READS.labels(self.name, "content").inc()
        if rec is None:
            raise NotFound(f"not found: {uid}")
        rec, data = self.store.take_content(uid)
        grace = self.store.purge_after_fetch_s
        log.info("db %s: uid=%s fetched (%d bytes)%s", self.name, uid, len(data),
                 "" if grace is None else ", purged" if grace == 0 else f", purged in {grace:g}s")
        if grace == 0:
            self._replicate(Message({"uid": uid, "kind": "purge"}))
        elif grace is not None:  # the copies go when this one does
            self._replicate(Message({"uid": uid, "kind": "fetched", "expires_at": self.store.clock() + grace}))
        return {"record": rec}, [data]

    def _op_delete(self, req: DeleteArgs, blobs: list) -> dict:
        uid, rec = self._owned(req)
        forget = req.forget
        if rec is None and req.owner is not None:
            if uid in self.store:
                raise NotFound(f"not found: {uid}")  # another owner's: nothing to say about it
            return {"deleted": False}  # a DB that holds it checks the owner and tells its peers
        if rec is not None and rec.get("status") != COMPLETED and not forget:
            # May still be generated: stages subscribe to this and drop it where it is. A failed
            # one too: failed at its deadline here, a stage with drop_expired: false still runs it.
            self._event(CANCEL, uid, "")
        existed = self.store.purge(uid, tombstone=not forget)
        WRITES.labels(self.name, "delete").inc()
        log.info("db %s: uid=%s %s (%s)", self.name, uid, "forgotten" if forget else "deleted",
                 "held" if existed else "not held")
        # Peers may hold it even if we do not.
        self._replicate(Message({"uid": uid, "kind": "purge", **({"forget": True} if forget else {})}))
        return {"deleted": existed}

    def _op_list(self, args: ListArgs, blobs: list) -> dict:
        READS.labels(self.name, "list").inc()
        records, more = self.store.page(args.owner, args.after, args.limit, args.order == "desc")
        return {"records": records, "has_more": more}

    def _op_stats(self, req: Any, blobs: list) -> dict:
        READS.labels(self.name, "stats").inc()
        return {"stats": self.stats()}

    def _op_ping(self, req: Any, blobs: list) -> dict:
        return {"name": self.name, "data_address": self.data_address,
                "control_address": self.control_address, "events_address": self.events_address}

    def stats(self) -> dict[str, Any]:
        """Current stats, built fresh. Reads the store: call on the loop thread only (other
        threads read :attr:`snapshot`)."""
        with self._counts_lock:
            counts = dict(self.counts)
        return {
            **self.store.stats(),
            "name": self.name,
            "addresses": {"data": self.data_address, "control": self.control_address,
                          "events": self.events_address},
            "peers": [p["data"] for p in self.peers],
            "replication": {"factor": self.replication, "queued": self._outq.qsize(), "sent": counts["sent"],
                            "dropped": counts["dropped"], "short": counts["short"], "filled": counts["filled"],
                            "filling": len(self._fills)},
            "refused": counts["refused"],
            "malformed": counts["malformed"],
        }

    # ---- replication (its own thread; owns the peer senders) ---------------------------------

    def _replicate(self, msg: Message) -> None:
        # With a factor of 1 only purges (and fetches) travel: nobody else should hold copies,
        # but a DB that got one while the set was configured differently must still drop it.
        if self.replication < 2 and msg.kind not in EVERY_PEER:
            return
        if not self.peers:
            self._owe(msg)
            return
        try:
            self._outq.put_nowait(msg)
        except queue.Full:
            self._dropped(msg.uid, "replication queue full")

    def _owe(self, msg: Message) -> None:
        if msg.kind != "replica":
            return  # purges go to every peer there is; a later copy meets their tombstone
        with self._owed_lock:
            self._owed.pop(msg.uid, None)
            self._owed[msg.uid] = None
            while len(self._owed) > OWED_MAX:
                del self._owed[next(iter(self._owed))]

    def _repay(self) -> None:
        """Send what fell short again, as the record stands now (on the loop thread, which owns
        the store): a record gone meanwhile is owed to nobody."""
        if not self.peers:
            return
        with self._owed_lock:
            uids = list(self._owed)[:REPAY_BATCH]
            for uid in uids:
                del self._owed[uid]
        for uid in uids:
            rec = self.store.get(uid)
            if rec is not None:
                content = self.store.content(uid)
                self._replicate(Message({"uid": uid, "kind": "replica", "record": rec},
                                        {CONTENT: content} if content is not None else {}))

    # ---- filling peers (on the loop thread, which owns the store) ---------------------------

    @staticmethod
    def _key(peers: list[dict[str, str]]) -> frozenset[tuple[str, str]]:
        return frozenset((p["control"], p["data"]) for p in peers)

    def _holds(self, uid: str, peers: list[dict[str, str]]) -> set[str]:
        """The control addresses of the DBs placement gives ``uid`` among this one and ``peers``."""
        return {d["control"] for d in order_dbs(uid, [self._me, *peers])[:self.replication]}

    def _plan_fills(self) -> None:
        """Start filling the peers whose share the new peer list gives them records they may lack:
        everything placement gives a peer not listed before, and to one listed before the
        records whose holders moved to it (a DB left)."""
        peers = self.peers
        key = self._key(peers)
        if self.replication < 2 or key == self._planned:
            return
        self._planned = key
        current = {p["control"]: p for p in peers}
        for control in [c for c in self._fills if current.get(c) != self._fills[c].peer]:
            self._retire(self._fills.pop(control))  # gone from the routes (or moved)
        for control in [c for c in self._bases if current.get(c) != self._bases[c][0]]:
            del self._bases[control]  # if it comes back, it is filled as a new peer
        for control, peer in current.items():
            fill = self._fills.pop(control, None)
            if fill is not None:
                self._retire(fill)  # placed by the list before: started again below, if needed
            since = fill.since if fill is not None else self._bases.get(control, (peer, None))[1]
            if since is not None and self._key(since) == key:
                self._bases[control] = (peer, since)  # nothing moved to it
            else:
                self._start_fill(peer, peers, since)

    def _on_hello(self, control: str) -> None:
        """A DB (re)started and greeted this one: fill it with everything placement gives it,
        if the NM lists it here (else it is filled as a new peer once it does)."""
        peer = next((p for p in self.peers if p["control"] == control), None)
        if peer is None or self.replication < 2:
            log.debug("db %s: hello from %s, not a peer here (yet)", self.name, control[:200])
            return
        log.info("db %s: peer %s (re)started: filling it", self.name, peer["data"])
        self._bases.pop(control, None)
        self._start_fill(peer, self.peers, None)

    def _start_fill(self, peer: dict[str, str], peers: list[dict[str, str]],
                    since: list[dict[str, str]] | None) -> None:
        """(Re)start filling ``peer`` from the first record: what a fill it replaces queued may
        have gone to a process that is gone, or been placed by an older list."""
        old = self._fills.get(peer["control"])
        if old is not None:
            self._retire(old)
        with self._fill_lock:
            hello = since is None and peer["control"] not in self._greeted
        # Tombstones first: a DB back empty from a restart would otherwise create again a UID its
        # peers dropped (an Idempotency-Key retry of a downloaded video made it a second time,
        # on that copy alone, since its peers' tombstones refuse its replicas).
        fill = _Fill(dict(peer), peers, since, self.store.gone_uids() + self.store.uids(), pos=-1 if hello else 0)
        self._fills[peer["control"]] = fill
        log.info("db %s: filling peer %s with %s of %d records%s", self.name, peer["data"],
                 "its share" if since is None else "what moved to it", len(fill.uids),
                 ", after a hello" if hello else "")

    def _retire(self, fill: _Fill) -> None:
        with self._fill_lock:
            fill.gen += 1  # what it queued is skipped by the replicator

    def _fill_wait_ms(self) -> int:
        """How long the loop may wait for a message with the fills in mind."""
        if not self._fills:
            return TURN_MS
        soonest = min(f.not_before for f in self._fills.values())
        return max(FILL_TURN_MS, min(TURN_MS, int((soonest - time.monotonic()) * 1000)))

    def _fill_step(self) -> None:
        """One bounded slice of every fill that can go on; a fill's end or failure is handled here."""
        now = time.monotonic()
        for control, fill in list(self._fills.items()):
            with self._fill_lock:
                failed_at, acked, settled = fill.failed_at, fill.acked, fill.acked == fill.queued
            if failed_at is not None:
                self._fill_failed(control, fill, failed_at, acked, now)
            elif fill.pos >= len(fill.uids):
                if settled:
                    self._fill_done(control, fill)
            elif now >= fill.not_before:
                self._fill_slice(fill)

    def _fill_slice(self, fill: _Fill) -> None:
        room = FILL_BATCH - self._outq.qsize()  # the replicator's pace: it never waits behind a fill
        scanned, now = 0, self.store.clock()
        while room > 0 and scanned < FILL_SCAN and fill.pos < len(fill.uids):
            pos = fill.pos
            if pos < 0:
                msg: Message | None = Message({"uid": self._incarnation, "kind": "hello",
                                               "control": self._me["control"]})
            else:
                scanned += 1
                msg = self._fill_message(fill, fill.uids[pos], now)
            if msg is not None:
                with self._fill_lock:
                    fill.queued += 1
                try:
                    self._outq.put_nowait(_Directed(msg, fill, fill.gen, pos))
                except queue.Full:
                    with self._fill_lock:
                        fill.queued -= 1
                    return  # this record again next turn
                room -= 1
            fill.pos = pos + 1

    def _fill_message(self, fill: _Fill, uid: str, now: float) -> Message | None:
        """The replica of ``uid`` as it stands now, if it is live and newly the peer's to hold;
        its purge if it was dropped here."""
        control = fill.peer["control"]
        if control not in self._holds(uid, fill.peers):
            return None
        if fill.since is not None and control in self._holds(uid, fill.since):
            return None  # its share before: replicated to it then (or owed)
        rec = self.store.get(uid)
        if rec is None and self.store.gone(uid):
            return Message({"uid": uid, "kind": "purge"})
        if rec is None or not rec["expires_at"] > now:
            return None  # gone, or expired and not swept yet
        content = self.store.content(uid)
        return Message({"uid": uid, "kind": "replica", "record": rec},
                       {CONTENT: content} if content is not None else {})

    def _fill_failed(self, control: str, fill: _Fill, failed_at: int, acked: int, now: float) -> None:
        """The peer did not take a message: go on from there after a backoff, or give up."""
        fill.tries = 1 if acked else fill.tries + 1  # a record taken since the last failure: progress
        if fill.tries > FILL_TRIES:
            self._retire(self._fills.pop(control))
            log.warning("db %s: gave up filling peer %s after %d failed tries (%d records taken); it is filled "
                        "again when it says hello or the peer list changes", self.name, fill.peer["data"],
                        FILL_TRIES, fill.sent)
            return
        with self._fill_lock:
            fill.gen += 1
            fill.queued = fill.acked = 0
            fill.failed_at = None
        fill.pos = failed_at
        delay = self.peer_backoff_s * 2 ** (fill.tries - 1)  # the replicator skips it that long anyway
        fill.not_before = now + delay
        log.info("db %s: peer %s did not take its fill; again in %.1fs (try %d of %d)", self.name,
                 fill.peer["data"], delay, fill.tries + 1, FILL_TRIES + 1)

    def _fill_done(self, control: str, fill: _Fill) -> None:
        del self._fills[control]
        self._bases[control] = (fill.peer, fill.peers)
        log.info("db %s: filled peer %s (%d records taken)", self.name, fill.peer["data"], fill.sent)

    def _dropped(self, uid: str, why: str, loud: bool = True) -> None:
        self._count("dropped")
        REPL_DROPPED.labels(self.name).inc()
        # A dead peer or a full queue drops every message: log once a second, not each one.
        now = time.monotonic()
        with self._counts_lock:
            quiet = now - self._last_drop_log < 1.0
            if not quiet:
                self._last_drop_log = now
        if loud and not quiet:
            log.warning("db %s: uid=%s replication dropped: %s (%d dropped so far)", self.name, uid, why,
                        self.counts["dropped"])
        else:
            log.debug("db %s: uid=%s replication dropped: %s", self.name, uid, why)

    def _start_replicator(self) -> None:
        self._repl_stop.clear()
        self._replicator = threading.Thread(target=self._replicate_loop, name=f"{self.name}-replicator",
                                            daemon=True)
        self._replicator.start()

    def _stop_replicator(self) -> None:
        self._repl_stop.set()
        with contextlib.suppress(queue.Full):  # ends its wait at once (a full queue is not waited on)
            self._outq.put_nowait(None)
        if self._replicator is not None:
            # Bounded: the drain stops after DRAIN_S, each send waits replication_timeout_s.
            self._replicator.join(timeout=DRAIN_S + self.replication_timeout_s + 1.0)
            self._replicator = None

    def _replicate_loop(self) -> None:
        senders: dict[str, Sender] = {}
        down_until: dict[str, float] = {}
        drain_until: float | None = None

        def send(peer: str, msg: Message, what: str | None = "sent") -> bool:
            """Hand ``msg`` to ``peer`` (a data address); False if it is down or did not take it.
            ``what``: the count it adds to (None: none, as for a hello)."""
            if down_until.get(peer, 0.0) > time.monotonic():
                self._dropped(msg.uid, f"peer {peer} is down", loud=False)
                return False
            try:
                sender = senders.get(peer)
                if sender is None:
                    sender = senders[peer] = registry.connect(peer)
                sender.send(msg, timeout=self.replication_timeout_s)
            except (TransportError, ValueError, zmq.ZMQError) as e:
                down_until[peer] = time.monotonic() + self.peer_backoff_s
                self._dropped(msg.uid, f"peer {peer}: {e}")
                return False
            if what is not None:
                self._count(what)
                (REPL_SENT if what == "sent" else REPL_FILLED).labels(self.name).inc()
            return True

        try:
            while True:
                if self._repl_stop.is_set():
                    # Stopping: still hand over what is queued (the latest changes are what a
                    # peer needs most when this DB goes away), for a bounded time.
                    if drain_until is None:
                        drain_until = time.monotonic() + DRAIN_S
                    if time.monotonic() > drain_until:
                        break
                try:
                    msg = self._outq.get(timeout=REPL_WAIT_S) if drain_until is None else self._outq.get_nowait()
                except queue.Empty:
                    if drain_until is not None:
                        break
                    continue
                if msg is None:  # _stop_replicator's wake-up
                    continue
                if isinstance(msg, _Directed):
                    if drain_until is None:  # stopping: the latest changes matter more than a fill
                        self._send_fill(msg, send)
                    continue
                peers = self.peers
                for gone in set(senders) - {p["data"] for p in peers}:
                    senders.pop(gone).close()
                if msg.kind in EVERY_PEER:
                    for peer in peers:
                        send(peer["data"], msg)
                    continue
                # The UID's placement order; this DB counts as a holder where it ranks, and a
                # peer that is down is passed over for the next one (see the module doc).
                have = 0
                for db in order_dbs(msg.uid, [self._me, *peers]):
                    if have >= self.replication:
                        break
                    if db["control"] == self._me["control"] or send(db["data"], msg):
                        have += 1
                # Short only of the DBs listed now. A DB missing from the list is not owed the
                # change: listed again, it is filled with every live record it should hold, as
                # it stands then (_plan_fills); and owing would resend forever in a set that
                # has fewer DBs than the factor.
                if have < min(self.replication, len(peers) + 1):
                    self._count("short")
                    REPL_SHORT.labels(self.name).inc()
                    self._owe(msg)
        finally:
            for sender in senders.values():
                sender.close()

    def _send_fill(self, item: _Directed, send: Callable[[str, Message, str | None], bool]) -> None:
        """Hand a fill's message to its peer (replicator thread) and report back to the fill."""
        fill = item.fill
        with self._fill_lock:
            if item.gen != fill.gen or fill.failed_at is not None:
                return  # retired, or failed before it: the loop sends again from the failure
        record = item.pos >= 0 and item.msg.kind == "replica"  # not the hello or a tombstone
        ok = send(fill.peer["data"], item.msg, "filled" if record else None)
        with self._fill_lock:
            if item.gen != fill.gen:
                return
            if not ok:
                fill.failed_at = item.pos
                return
            fill.acked += 1
            if record:
                fill.sent += 1
            elif item.pos < 0:
                self._greeted.pop(fill.peer["control"], None)
                self._greeted[fill.peer["control"]] = None
                while len(self._greeted) > GREETED_MAX:
                    del self._greeted[next(iter(self._greeted))]

    # ---- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving (waits for ``run`` to return) and release sockets and ipc files."""
        if self._closed:
            return
        self._closing.set()
        if not self._idle.wait(timeout=5.0):
            log.warning("db %s: loop did not stop within 5s; closing anyway", self.name)
        self._closed = True
        self._release()

    def _release(self) -> None:
        for sock in (self.receiver, self.rpc, self.pub):
            if sock is not None:
                try:
                    sock.close()
                except Exception as e:  # releasing must go on for the others
                    log.warning("db %s: close failed: %s", self.name, e)
        # libzmq leaves ipc socket files behind on close; remove the ones we bound.
        for path in self._ipc_paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("db %s: could not remove %s: %s", self.name, path, e)

    def __enter__(self) -> "DbServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _content_of(msg: Message, required: bool) -> bytes | None:
    part = msg.parts.get(CONTENT)
    if part is None:
        if required:
            raise InvalidUpdate(f"result for {msg.uid} has no {CONTENT!r} part")
        return None
    if isinstance(part, np.ndarray):
        return part.tobytes()  # a stage may ship the artefact as a uint8 array
    return msg.blob(CONTENT)


def serve(
    data_address: str,
    control_address: str,
    events_address: str,
    ttl_s: float = 3600.0,
    max_bytes: int = 1 << 30,
    purge_after_fetch_s: float | None = 60.0,
    name: str = "db",
    peers: Iterable[Mapping[str, str]] = (),
    on_ready: Callable[[DbServer], None] | None = None,
    **options: Any,
) -> None:
    """Run a DB until SIGTERM/SIGINT. ``on_ready(server)`` runs once the sockets are bound
    (``server.data_address`` etc. hold the real addresses), e.g. to register with the NM and
    start a thread that keeps ``server.set_peers`` current; other threads read its stats from
    ``server.snapshot``. Call from the main thread of a role process."""
    stop = stop_on_signals()
    server = DbServer(data_address, control_address, events_address, ttl_s, max_bytes,
                      purge_after_fetch_s, name, peers=peers, **options)
    try:
        if on_ready is not None:
            on_ready(server)
        server.run(stop)
        if stop.is_set():
            log.info("db %s: signalled, stopping", name)
    finally:
        server.close()
