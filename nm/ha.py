"""The node manager on ZooKeeper (DESIGN §9): several NM processes, one primary.

Every NM binds its RPC address and contends in kazoo's Election (nm/election.py). The winner
bumps the epoch, reads the state the previous primary left (nm/zk_store.py), drops the
instances whose member node vanished meanwhile, publishes itself in the ephemeral ``primary``
node, and serves. Backups answer every op with ``not primary; primary at <address>`` (or ``no
primary elected yet``), which ``NmClient`` follows (nm/client.py).

Only the primary writes. Every change of what routes derive from (an instance registered,
became ready, left or died) is written, fenced by the epoch, before the RPC that caused it is
answered, so a new primary starts from exactly the routes the old one handed out, with no
replay. Stats and heartbeats stay in memory: they are back one heartbeat after a takeover, and
until every ready stage instance of a set has reported to the new primary (or three heartbeats
passed) proxies get no new capacity view, so none is computed from empty stats.

Membership is ZooKeeper's: each instance holds an ephemeral member node (nm/ephemeral.py); the
primary watches ``members/`` and drops an instance the moment its node goes (its session
ended: a crash is seen after the session timeout), and reports the requests it held as failed
(nm/reaper.py). Heartbeat silence does not drop anyone here: during a failover instances
cannot reach any primary, and that must not cost them their place.

Connection states: SUSPENDED (the session may still live) stops writes but keeps answering
reads and heartbeats that change nothing, so instances ride through a ZooKeeper server's
restart; LOST (the session expired) ends the primacy at once, before the lock is even
released, and the NM contends again with a new session. A graceful stop closes the session
first thing, which hands the lock to the next contender within milliseconds.
"""

from __future__ import annotations

import logging
import queue
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from onepiece.config import Topology, Workflow
from onepiece.nm.client import NOT_PRIMARY
from onepiece.nm.elastic import Elastic
from onepiece.nm.election import PrimaryElection
from onepiece.nm.protocol import RegisterArgs
from onepiece.nm.server import NodeManager
from onepiece.nm.state import ClusterState
from onepiece.nm.zk import Paths, ZkSettings
from onepiece.nm.zk_store import Fenced, Snapshot, ZkStore, read_primary
from onepiece.transport.registry import with_host

log = logging.getLogger(__name__)

MEMBER_ID = re.compile(r"^(stage|db|proxy)-\d{10}$")
SAVE_RETRY_S = 0.2
AUDIT_S = 5.0  # how often the primary re-reads the member list, beside watching it


class NotPrimary(LookupError):
    """This NM cannot answer as primary (a LookupError: the RPC server logs it quietly, as an
    ordinary answer while clients find the primary)."""


def config_of(topology: Topology, workflow: Workflow, base_dir: Path) -> dict[str, Any]:
    # The credentials (and where a process reads them) stay out: each process's own, not cluster state.
    return {"topology": topology.model_dump(mode="json", exclude={"nm": {"zk_auth", "zk_auth_file"}}),
            "workflow": workflow.model_dump(mode="json"), "base_dir": str(base_dir)}


class HaNodeManager(NodeManager):
    def __init__(self, topology: Topology, workflow: Workflow, base_dir: Path, zk: ZkSettings,
                 address: str | None = None, advertise: str | None = None, deployment_id: str = "") -> None:
        super().__init__(topology, workflow, base_dir, address, deployment_id)
        self.identity = with_host(self.address, advertise)  # what clients are told to reach
        self.settings = zk
        self.paths = Paths(zk.root)
        self.primary = False  # serving as primary now (read by handlers on every request)
        self.suspended = False  # connection to ZooKeeper down (the session may live): no writes
        self.epoch = 0
        self.elected_at = 0.0
        self.primary_address: str | None = None  # the ``primary`` node's address, for redirects
        self._stopping = False
        self._handover_lock = threading.Lock()
        self._events: queue.Queue[tuple] = queue.Queue(maxsize=10_000)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._next_save = 0.0
        self._next_audit = 0.0
        self._lead_token: object | None = None  # set while this NM holds the election's lock
        self._config = config_of(topology, workflow, base_dir)  # computed once: takeovers compare it
        self.zk = None
        self.store: ZkStore | None = None
        self.election: PrimaryElection | None = None

    # ---- RPC: only the primary answers -------------------------------------------------------

    def first_version(self) -> int:
        """Versions live in ZooKeeper: a new primary goes on from the saved one (restore)."""
        return 1

    def _handlers(self) -> dict:
        return {op: self._guard(fn) for op, fn in super()._handlers().items()}

    def _guard(self, fn):
        def handler(req: Any, blobs: list) -> Any:
            if not self.primary:
                raise NotPrimary(self._redirect())
            return fn(req, blobs)
        return handler

    def _redirect(self) -> str:
        where = self.primary_address
        if where and where != self.identity:
            return f"{NOT_PRIMARY}; primary at {where}"
        return f"{NOT_PRIMARY}; no primary elected yet"

    def _instance_id(self, req: RegisterArgs) -> str | None:
        iid = req.instance
        if iid is None or not MEMBER_ID.match(iid):
            raise ValueError("this node manager runs on ZooKeeper; an instance joins with its member node "
                             "(start it with --zk HOSTS, as the node managers)")
        from kazoo.exceptions import KazooException

        try:
            exists = self.store.member_exists(iid, fresh=True)
        except (KazooException, TimeoutError) as e:  # the instance retries, as with any NM hiccup
            raise NotPrimary(f"{NOT_PRIMARY}; ZooKeeper busy: {e!r}") from None
        if not exists:
            raise ValueError(f"no member node {iid} in ZooKeeper (its session ended?)")
        return iid

    def _nm_status(self) -> dict[str, Any]:
        try:
            contenders = self.election.contenders() if self.election else []
        except Exception as e:  # status is for operators: say what failed rather than fail
            contenders = [f"unknown: {e!r}"]
        return {**super()._nm_status(), "mode": "zookeeper", "address": self.identity, "primary": self.primary, "epoch": self.epoch,
                "contenders": contenders, "zookeeper": self.settings.hosts, "root": self.settings.root,
                "suspended": self.suspended}

    def _settling(self) -> bool:
        return False  # a new primary restores the routes from ZooKeeper

    def _dead_after_s(self) -> float:
        return self.settings.session_s  # here an instance is dropped when its session ends

    def _monitor_ready(self, set_name: str) -> bool:
        if time.monotonic() - self.elected_at > 3 * self.topology.nm.heartbeat_s:
            return True
        return all(i.heard for i in self.state.instances.values()
                   if i.set == set_name and i.role == "stage" and i.ready)

    # ---- writes ----------------------------------------------------------------------------------

    def _saved(self) -> None:
        """Write the changed sets (fenced); raise NotPrimary when it cannot be written now, so
        the caller's client retries (the change stays pending in ``state.dirty``)."""
        from kazoo.exceptions import KazooException

        if not self.state.dirty:
            return
        if not self.primary or self.suspended:
            raise NotPrimary(f"{NOT_PRIMARY}; ZooKeeper connection suspended, state not saved")
        dirty = set(self.state.dirty)
        try:
            self.store.save(self.epoch, self.state.version,
                            {s: (self.state.export(s), self.state.routes(s)) for s in dirty if s in self.state.sets})
        except Fenced as e:
            self._lose(str(e))
            raise NotPrimary(f"{NOT_PRIMARY}; {e}") from None
        except (KazooException, TimeoutError) as e:
            self._next_save = time.monotonic() + SAVE_RETRY_S
            raise NotPrimary(f"{NOT_PRIMARY}; state not saved to ZooKeeper: {e!r}") from None
        self.state.dirty -= dirty

    def _tick(self) -> None:
        moved = self.primary and not self.suspended and self.elastic.tick(self.state)
        if self.primary and self.state.dirty and (moved or time.monotonic() >= self._next_save):
            try:  # a move is saved at once, other changes when the retry pause allows
                self._saved()
            except NotPrimary as e:  # what is unsaved stays in state.dirty; saved on a later turn
                log.warning("%s", e)
        if self.primary and not self.suspended:
            self._look_for_orphans()  # once every stage instance has heartbeated to this primary
        if self.primary and not self.suspended and time.monotonic() >= self._next_audit:
            # A safety net under the members watch: compare with the member nodes now and then.
            self._next_audit = time.monotonic() + AUDIT_S
            self._post(("audit",))

    # ---- events from kazoo's threads -------------------------------------------------------------

    def _post(self, event: tuple) -> None:
        try:
            self._events.put_nowait(event)
        except queue.Full:
            log.error("event queue full; dropped %s", event[0])
            return
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # the loop is awake already (the pipe is full) or closing

    def _on_state(self, state: str) -> None:
        from kazoo.protocol.states import KazooState

        if state == KazooState.LOST:
            # The session expired: the lock is gone and another NM may lead already.
            self.suspended = True
            if self.primary:
                self.primary = False
                log.error("ZooKeeper session lost: no longer primary")
            if self.election is not None:
                self.election.step_down()
        elif state == KazooState.SUSPENDED:
            self.suspended = True
            log.warning("ZooKeeper connection suspended: %s", "no writes until it is back" if self.primary else "waiting")
        else:
            self.suspended = False
            self._post(("connected",))

    def _lead(self, resign: threading.Event) -> None:
        """On the election thread: this NM won. Claim the epoch, read the state, hand both to
        the loop, then hold the leadership until told to resign."""
        log.info("won the election; taking over")
        token = self._lead_token = object()
        try:
            try:
                epoch, snap = self.store.take_over(self.identity)
            except Exception:
                self.store.withdraw_primary()  # if the primary node went up, clients must not be sent here
                raise
            # The loop applies it only while this token is current: a takeover that arrives
            # after the leadership was lost again (session expired meanwhile) is stale.
            self._post(("elected", epoch, snap, token))
            resign.wait()
        finally:
            self._lead_token = None
            self.primary = False  # every path that resigns has cleared it already; make sure

    # ---- the loop --------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        """Connect, lay out the nodes, start watching and contending."""
        self.zk = self.settings.connect(timeout)  # ZkUnavailable names the servers it tried
        self.store = ZkStore(self.zk, self.paths, timeout=max(1.0, self.settings.session_s))
        self.store.ensure_layout([s.name for s in self.topology.sets])
        self.zk.add_listener(self._on_state)
        self.zk.DataWatch(self.paths.primary, self._on_primary_node)
        self.zk.ChildrenWatch(self.paths.members, lambda children: self._post(("members", set(children))))
        self.election = PrimaryElection(self.zk, self.paths.election, self.identity, self._lead)
        self.election.start()
        log.info("node manager %s contending at %s%s", self.identity, self.settings.hosts, self.settings.root)

    def _on_primary_node(self, data: bytes | None, stat: Any) -> None:
        self.primary_address = read_primary(data)

    def run(self, stop: threading.Event) -> None:
        if self.zk is None:
            self.start()
        # A stop (SIGTERM) hands over at once, not at the loop's next turn.
        threading.Thread(target=lambda: (stop.wait(), self.handover()), name="nm-handover", daemon=True).start()
        poller = zmq.Poller()
        poller.register(self.rpc.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not stop.is_set():
            events = dict(poller.poll(100))
            if self.rpc.sock in events:
                self.rpc.handle()
            if self._wake_r.fileno() in events or self._wake_r in events:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            self._drain()
            self._tick()

    def _drain(self) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            try:
                if event[0] == "elected":
                    self._take_over(event[1], event[2], event[3])
                elif event[0] == "members" and self.primary:
                    self._members(event[1])
                elif event[0] in ("connected", "audit") and self.primary:
                    self._members(self.store.members())  # what a watch may have missed
            except Fenced as e:
                self._lose(str(e))
            except Exception as e:
                if event[0] == "elected":
                    log.exception("taking over failed; giving the primacy up")
                    self._lose(f"taking over failed: {e!r}")
                else:  # ZooKeeper busy for a moment: the next event or audit looks again
                    log.warning("%s: %r; will look again", event[0], e)
                    self._next_audit = min(self._next_audit, time.monotonic() + 0.5)

    def _take_over(self, epoch: int, snap: Snapshot, token: object) -> None:
        if self._stopping or token is not self._lead_token:
            log.info("ignoring a stale takeover (epoch %d)", epoch)
            return
        self._adopt_config(epoch, snap)
        self.state.restore(snap.records, snap.version, snap.moved)
        gone = [i for i in self.state.instances if i not in snap.members]
        for iid in gone:  # died while no primary watched: what they held is failed by nm/orphans.py
            self.state.deregister(iid, "its ZooKeeper session ended while no primary was serving")
        # Utilization is soft state: the new primary judges moves on windows of its own, and
        # not before a cooldown (a move the old primary started may still be under way).
        self.elastic = Elastic(self.topology.nm.elastic)
        self.elastic.last_move = {s: time.monotonic() for s in self.state.sets}
        self.epoch, self.primary, self.elected_at = epoch, True, time.monotonic()
        if token is not self._lead_token:  # lost between the check above and now
            self.primary = False
            return
        self.primary_address = self.identity  # the primary node went up with the epoch (ZkStore.take_over)
        self._saved()
        self.state.note(f"{self.identity} is primary (epoch {epoch}): {len(self.state.instances)} instances, "
                          f"routes version {self.state.version}")

    def _adopt_config(self, epoch: int, snap: Snapshot) -> None:
        """Serve ZooKeeper's configuration if the cluster runs on it; write ours if there is
        none, or if nothing is running on the old one (a fresh deployment on an old root)."""
        mine = self._config
        if snap.config == mine:
            return
        if snap.config is None or not snap.members:
            if snap.config is not None:
                log.warning("replacing the configuration in ZooKeeper (no instance runs on it) with this NM's")
            self.store.save_config(epoch, mine)
            return
        log.warning("ZooKeeper holds a different configuration than this NM was started with, and instances run "
                    "on it: serving ZooKeeper's (stop every instance, or use another --zk-root, to change it)")
        self.topology = Topology.model_validate(snap.config["topology"])
        self.workflow = Workflow.model_validate(snap.config["workflow"])
        self.base_dir = Path(snap.config["base_dir"])
        self.state = ClusterState(self.topology, self.workflow)
        self.reaper.workflow = self.workflow

    def _members(self, children: set[str]) -> None:
        """Drop the instances whose member node is gone (confirmed by a fresh read: a listing
        taken before an instance registered may arrive after it did)."""
        for iid in [i for i in self.state.instances if i not in children]:
            if self.store.member_exists(iid):
                continue
            inst = self.state.deregister(iid, "its ZooKeeper session ended")
            if inst is not None:
                self._dropped(inst, "its ZooKeeper session ended")
        try:
            self._saved()
        except NotPrimary as e:
            log.warning("%s", e)

    def _lose(self, why: str) -> None:
        if self.primary:
            log.error("giving up the primacy: %s", why)
        self.primary = False
        if not self.suspended and self.store is not None:
            try:  # clients stop being sent here at once, not when the session ends
                self.store.withdraw_primary()
            except Exception as e:
                log.warning("could not withdraw the primary node: %r", e)
        if self.election is not None:
            self.election.step_down()

    # ---- stopping -------------------------------------------------------------------------------

    def handover(self) -> None:
        """Stop being primary and let a backup take over now: closing the session deletes the
        lock and ``primary`` nodes in one step, which wakes the next contender."""
        # The handover thread (on SIGTERM) and close() both call this: the second waits for
        # the first, since kazoo refuses to close a connection that is still stopping.
        with self._handover_lock:
            if self._stopping:
                return
            self._stopping = True
            if self.zk is not None:
                log.info("stopping: %s", "handing the primacy over" if self.primary else "leaving the election")
            self.primary = False
            if self.election is not None:
                self.election.stop(timeout=0)
            if self.zk is not None:
                try:
                    self.zk.stop()
                except Exception as e:
                    log.warning("closing the ZooKeeper session: %r", e)

    def close(self) -> None:
        self.handover()
        if self.election is not None:
            self.election.stop(timeout=2.0)
        if self.zk is not None:
            self.zk.close()
        self._wake_r.close()
        self._wake_w.close()
        super().close()
