"""How instances and clients talk to the node manager.

``NmClient`` calls the primary NM. It is given one address (the embedded NM) or several
(``tcp://a:7700,tcp://b:7701``: NMs on ZooKeeper, one primary and backups); a backup answers
``not primary; primary at <address>``, which it follows, and an NM that does not answer is
passed over for the next. Optionally ``locate()`` names the primary first (an instance on
ZooKeeper watches the ``primary`` node). Every call is bounded: each address is tried at most
once per round, plus a few redirects.

``Membership`` registers an instance and keeps it alive with heartbeats from a background
thread, handing every new route table to a callback. The data path never waits on the NM:
if the NM is unreachable (or, on ZooKeeper, no primary is elected for a while) the instance
keeps its last routes and keeps trying. A stage instance also reports which stage it serves
right now, and learns from each reply which stage it is assigned (the NM moves instances:
nm/elastic.py); ``on_assign`` hears of a change. On ZooKeeper (``zk=ZkSettings``) it also holds the
instance's ephemeral member node (its liveness: nm/ephemeral.py), learns where the primary is
from the ``primary`` node, and takes route tables straight from the set's routes node as the
primary writes them, without waiting for the next heartbeat.

Every registration and heartbeat carries the deployment's id (onepiece/deployment.py): an NM of
another deployment refuses it (``Refused``), and the member stays out. A member that hands
requests to stage instances (a stage instance, a proxy) also reports its recent deliveries
(nm/holdings.py ``Deliveries``). Registering again to an NM that forgot it, a stage instance says
which stage it serves already; an NM that is still settling after its start says so, and the
member keeps the routes it holds.

An NM that declared this member's process dead and reported what it held failed answers its next
heartbeat or registration with that fence (nm/fencing.py): the member hands the UIDs to
``on_fenced`` (a stage instance drops them), then acknowledges, and only then is heard again. A
restarted NM fences nobody. Since a stopped process cannot know what the NM decided meanwhile,
``settle`` holds a hand-on after this process itself stood still near the NM's dead limit until a
heartbeat round has told it (nm/stall.py).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from onepiece.config import Workflow
    from onepiece.nm.holdings import Deliveries
    from onepiece.nm.zk import ZkSettings

from onepiece import deployment as deployments
from onepiece.heartbeat import DELIVERED
from onepiece.nm.identity import NAME_HELD
from onepiece.nm.protocol import FenceReply, Routes
from onepiece.nm.stall import TICK_S, StallWatch
from onepiece.schema import problem
from onepiece.transport.registry import ZMQ_SCHEMES, checked, with_host
from onepiece.transport.rpc import RpcClient, RpcError, RpcTimeout

log = logging.getLogger(__name__)

NOT_PRIMARY = "not primary"  # how a backup NM's refusal starts (nm/ha.py)
_REDIRECT = re.compile(r"primary at (\S+)")
MAX_REDIRECTS = 3
DOWN_S = 3.0  # an NM that did not answer is tried last for this long


class Patience:
    """A bounded wait for a node manager that does not answer yet (it may be starting): says
    once that it waits, and for how long, so a role started before its NM is not silent."""

    def __init__(self, address: str, timeout: float) -> None:
        self.address, self.timeout, self.deadline, self.said = address, timeout, time.monotonic() + timeout, False

    def again(self, pause: float) -> bool:
        """After a try without an answer: False once the time is up, else a pause, then True."""
        if time.monotonic() > self.deadline:
            return False
        if not self.said:
            log.warning("no answer from the node manager at %s yet; trying again for up to %.0f s", self.address,
                        self.timeout)
            self.said = True
        time.sleep(pause)
        return True


class Refused(RpcError):
    """The NM belongs to another deployment and refused this member: final, not retried."""


class NoPrimary(RpcTimeout):
    """No NM answered as primary (all down, or an election in progress): try again later."""


def split_addresses(value: str | Sequence[str] | None, allow_empty: bool = False) -> list[str]:
    """NM addresses from ``a,b,c`` (or a list), in order, without duplicates."""
    items = (value or "").split(",") if isinstance(value, str) or value is None else list(value)
    out = list(dict.fromkeys(a.strip() for a in items if a and a.strip()))
    if not out and not allow_empty:
        raise ValueError("no node manager address given (expected e.g. tcp://127.0.0.1:7700[,tcp://...])")
    for a in out:
        checked(a, ZMQ_SCHEMES)  # ValueError naming the address: no scheme, not ZeroMQ's, a bad port
    return out


class NmClient:
    def __init__(self, address: str | Sequence[str] | None, timeout: float = 2.0, retries: int = 2,
                 locate: Callable[[], str | None] | None = None) -> None:
        self.addresses = split_addresses(address, allow_empty=locate is not None)
        self.address = ",".join(self.addresses) or "(ZooKeeper)"
        self.timeout, self.retries, self.locate = timeout, retries, locate
        self._clients: dict[str, RpcClient] = {}
        self._current = self.addresses[0] if self.addresses else None
        self._down_until: dict[str, float] = {}

    def _client(self, address: str, retries: int) -> RpcClient:
        c = self._clients.get(address)
        if c is None:
            c = self._clients[address] = RpcClient(address, timeout=self.timeout, retries=retries)
        return c

    def call(self, op: str, blobs: Sequence[Any] = (), timeout: float | None = None,
             **args: Any) -> tuple[dict, list[bytes]]:
        if len(self.addresses) == 1 and self.locate is None:
            # One NM (the embedded default): exactly the plain RPC client's behaviour.
            return self._client(self.addresses[0], self.retries).call(op, blobs, timeout, **args)
        errors: list[str] = []
        for rnd in range(self.retries + 1):
            if rnd:
                time.sleep(0.05)  # bounded pause between rounds: an election may be under way
            located = self.locate() if self.locate else None
            todo = self._order([a for a in (located, self._current, *self.addresses) if a])
            tried: set[str] = set()
            hops = 0
            while todo:
                addr = todo.pop(0)
                if addr in tried:
                    continue
                tried.add(addr)
                try:
                    out = self._client(addr, 0).call(op, blobs, timeout, **args)
                except RpcError as e:
                    text = str(e)
                    if isinstance(e, RpcTimeout):
                        self._down_until[addr] = time.monotonic() + DOWN_S
                    elif NOT_PRIMARY in text:
                        m = _REDIRECT.search(text)
                        if m and hops < MAX_REDIRECTS and not self._down(m.group(1)):
                            todo.insert(0, m.group(1))  # a redirect to an NM that just timed out is stale
                            hops += 1
                    else:
                        self._current = addr
                        raise  # the primary answered, with an error: that is the answer
                    errors.append(f"{addr}: {text}")
                    continue
                self._current = addr
                self._down_until.pop(addr, None)
                return out
        raise NoPrimary(f"{op}: no primary node manager answered ({'; '.join(errors[-4:]) or 'none known'})")

    def move(self, instance: str, stage: str | None, key: str | None = None) -> dict:
        """An operator's move of ``instance`` to ``stage`` (None: the idle pool), with the
        operator key (``key``, else the environment's, else `onepiece up`'s file)."""
        from onepiece import operator_key

        key = key if key is not None else operator_key.resolve(None, fallback=True)
        return self.call("move", instance=instance, stage=stage, **({"key": key} if key else {}))[0]

    def _down(self, addr: str) -> bool:
        return self._down_until.get(addr, 0.0) > time.monotonic()

    def _order(self, addrs: list[str]) -> list[str]:
        """Candidates in order, those that recently did not answer last."""
        return [a for a in addrs if not self._down(a)] + [a for a in addrs if self._down(a)]

    @property
    def primary(self) -> str | None:
        """The NM that answered last (the primary, as far as this client knows)."""
        return self._current

    def routes(self, set_name: str) -> dict[str, Any]:
        return self.call("routes", set=set_name)[0]["routes"]

    def proxies(self, set_name: str | None = None) -> dict[str, list[str]]:
        return self.call("proxies", **({"set": set_name} if set_name else {}))[0]["proxies"]

    def dbs(self, set_name: str | None = None) -> dict[str, list[dict]]:
        return self.call("dbs", **({"set": set_name} if set_name else {}))[0]["dbs"]

    def status(self) -> dict[str, Any]:
        return self.call("status")[0]

    def workflow(self, timeout: float = 30.0) -> "Workflow":
        """The NM's workflow, waiting (bounded) for the NM to come up."""
        from onepiece.config import Workflow

        patience = Patience(self.address, timeout)
        while True:
            try:
                return Workflow.model_validate(self.call("workflow")[0]["workflow"])
            except RpcTimeout:
                if not patience.again(0.1):
                    raise

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()


class Membership:
    def __init__(
        self,
        nm_address: str | Sequence[str] | None,
        role: str,
        set_name: str,
        addresses: dict[str, str],
        stage: str | None = None,
        on_routes: Callable[[dict], None] = lambda routes: None,
        stats: Callable[[], dict] = dict,
        ready: Callable[[], bool] = lambda: True,
        advertise: str | None = None,
        zk: "ZkSettings | None" = None,
        capacity: dict[str, Any] | None = None,
        serving: Callable[[], str | None] | None = None,
        on_assign: Callable[[str | None], None] = lambda stage: None,
        idle: bool = False,
        name: str = "",
        deployment: str | None = None,
        deliveries: "Deliveries | None" = None,
        on_fenced: Callable[[list[str], str], None] = lambda uids, reason: None,
    ) -> None:
        self.zk_settings = zk
        self._primary: str | None = None  # from the ZooKeeper ``primary`` node
        self.nm = NmClient(nm_address, timeout=1.0, retries=0, locate=(lambda: self._primary) if zk else None)
        self.role, self.set, self.addresses, self.stage = role, set_name, addresses, stage
        self.on_routes, self.stats, self.ready = on_routes, stats, ready
        # Which stage it serves now; by default the one assigned, while ready.
        self.serving = serving or (lambda: self.stage if self.ready() else None)
        self.on_assign = on_assign
        self.idle = idle  # a stage instance without a pin that asks for the idle pool
        self.name = name  # its id, which outlives this process (a restart keeps where it was moved)
        # Which process holds the name (nm/identity.py): drawn once, so that re-registering keeps our place.
        self.process = secrets.token_hex(8)
        # Sent with every registration and heartbeat: an NM of another deployment refuses us.
        self.deployment = deployments.resolve(deployment)
        self.deliveries = deliveries  # what this member handed to which instance lately, for the NM
        self.advertise = advertise  # the host peers reach this instance at, if not the bound one
        self.capacity = dict(capacity or {})
        self.id: str | None = None
        self._token: str | None = None  # from our registration: what deregistering ourselves takes
        self._joined = False  # registered once: a later registration is a return (the NM forgot us)
        # Fencing (nm/fencing.py): what to drop when the NM says it reaped us; the fence applied
        # last, acknowledged in heartbeats until a reply carries none.
        self.on_fenced = on_fenced
        self._fence_ack: str | None = None
        self.watch = StallWatch()  # whether this process stood still near the NM's dead limit
        self.dead_after_s: float | None = None  # the NM's dead limit, from its register reply
        self.routes: dict[str, Any] = {"version": 0, "stages": {}, "dbs": [], "proxies": []}
        self.monitor: dict[str, Any] | None = None  # proxies: the set's capacity view
        self.heartbeat_s = 1.0
        self.zk = None
        self.member = None  # EphemeralMember, on ZooKeeper
        self._session_lost = threading.Event()
        self._routes_lock = threading.Lock()  # heartbeat and ZooKeeper watch threads both apply
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- ZooKeeper ---------------------------------------------------------------------------

    def _connect(self, timeout: float) -> None:
        from onepiece.nm.zk import Paths
        from onepiece.nm.zk_store import read_primary, read_routes

        if self.zk is not None:
            return
        paths = Paths(self.zk_settings.root)
        self.zk = self.zk_settings.connect(timeout=max(1.0, timeout))
        self.zk.add_listener(self._on_zk_state)
        self.zk.DataWatch(paths.primary, lambda data, stat: setattr(self, "_primary", read_primary(data)))

        def on_routes(data: bytes | None, stat: Any) -> None:
            routes = read_routes(data)
            if routes is not None:
                self._apply(routes, newer_only=True)

        self.zk.DataWatch(paths.set_routes(self.set), on_routes)

    def _on_zk_state(self, state: str) -> None:
        from kazoo.protocol.states import KazooState

        if state == KazooState.LOST and not self._stop.is_set():
            # The member node went with the session: the primary has dropped this instance.
            log.warning("ZooKeeper session of %s lost; joining again with a new member node", self.id)
            self._session_lost.set()

    def _join_zk(self, timeout: float) -> None:
        """Connect (once), and hold a member node: the existing one while the session lives,
        else a new one (a new id)."""
        from onepiece.nm.ephemeral import EphemeralMember
        from onepiece.nm.zk import Paths

        self._connect(timeout)
        if self.member is not None and not self._session_lost.is_set() and self.member.exists():
            return
        self._session_lost.clear()
        self.member = EphemeralMember(self.zk, Paths(self.zk_settings.root), self.role)
        self.id = self.member.create(self._describe())

    def _describe(self) -> dict[str, Any]:
        return {"role": self.role, "set": self.set, "stage": self.stage, "capacity": self.capacity,
                "addresses": self._advertised(), "pid": os.getpid(), "host": socket.gethostname()}

    def _advertised(self) -> dict[str, str]:
        return {k: with_host(v, self.advertise) for k, v in self.addresses.items()}

    def set_capacity(self, capacity: dict[str, Any]) -> None:
        """What this instance can take (workers, queue...), shown in its member node."""
        self.capacity = dict(capacity)
        if self.member is not None:
            try:
                self.member.update(capacity=self.capacity, stage=self.stage)
            except Exception as e:  # advisory: never worth failing the instance for
                log.warning("could not update member node %s: %r", self.id, e)

    def workflow(self, timeout: float = 30.0) -> "Workflow":
        """The cluster's workflow: from ZooKeeper's config node on ZooKeeper (no primary needed),
        else from the NM; waits (bounded) for it to be there."""
        if self.zk_settings is None:
            return self.nm.workflow(timeout)
        import orjson

        from onepiece.config import Workflow
        from onepiece.nm.zk import Paths, wait

        deadline = time.monotonic() + timeout
        self._connect(timeout)
        path = Paths(self.zk_settings.root).config
        while True:
            try:
                data, _ = wait(self.zk.get_async(path), 2.0)
                if data:
                    return Workflow.model_validate(orjson.loads(data)["workflow"])
            except Exception as e:  # not written yet (no primary so far) or ZooKeeper busy
                if time.monotonic() > deadline:
                    raise RpcTimeout(f"no workflow in ZooKeeper at {path} after {timeout:.0f}s: {e!r}") from None
            if time.monotonic() > deadline:
                raise RpcTimeout(f"no workflow in ZooKeeper at {path} after {timeout:.0f}s")
            time.sleep(0.1)

    # ---- registration and heartbeats -----------------------------------------------------------

    def register(self, timeout: float = 30.0) -> dict[str, Any]:
        """Register, retrying until the NM answers or ``timeout`` passes; the reply carries the
        workflow, this instance's stage and the set's routes."""
        started = self.watch.began()
        patience = Patience(self.nm.address, timeout)
        deadline = patience.deadline
        if self.zk_settings is not None:
            self._join_zk(max(1.0, deadline - time.monotonic()))
        while True:
            try:
                args: dict[str, Any] = {"role": self.role, "set": self.set, "addresses": self._advertised(),
                                        "pid": os.getpid(), "host": socket.gethostname(), "stage": self.stage,
                                        deployments.FIELD: self.deployment, "process": self.process}
                if self.zk_settings is not None:
                    args["instance"] = self.id
                if self.idle:
                    args["idle"] = True
                if self.name:
                    args["name"] = self.name
                if self.role == "stage" and self._joined:
                    args["serving"] = self.serving()  # registering again: routed at once if it serves
                reply, _ = self.nm.call("register", **args)
                break
            except RpcTimeout:  # the NM is not up yet (or no primary yet); a refusal (RpcError) is final
                if not patience.again(0.2):
                    raise
            except RpcError as e:
                if NAME_HELD in str(e) and time.monotonic() < deadline:
                    # Our predecessor under this name (a process just killed) is not silent long
                    # enough yet; a live second process keeps us out until ``timeout``.
                    log.info("%s; retrying", e)
                    time.sleep(0.5)
                    continue
                if deployments.REFUSED not in str(e):
                    raise
                log.error("not joining %s: %s", self.nm.address, e)
                raise Refused(str(e)) from None
        self._fenced(reply)  # before it serves again: what the NM reported failed for it goes
        self.id = reply["instance"]
        self._token = reply.get("token")  # what deregistering ourselves takes
        self._joined = True
        self._assign(reply.get("stage"))
        self.heartbeat_s = float(reply.get("heartbeat_s", 1.0))
        if isinstance(reply.get("dead_after_s"), (int, float)):
            self.dead_after_s = float(reply["dead_after_s"])
            # A stall this long may cost our place: the NM may have last heard us a heartbeat and
            # a try before it stood still.
            self.watch.limit_s = max(self.dead_after_s - self.heartbeat_s - self.nm.timeout, self.heartbeat_s)
            # ticks well inside it, and no more often than that needs: an idle stage sleeps
            self.watch.tick_s = min(TICK_S, self.watch.limit_s / 4)
        if reply.get("settling") and self.routes.get("version"):
            # A restarted NM, which has not heard from everyone yet: our routes are the fuller.
            log.info("node manager still settling after its start; keeping the routes held")
        else:
            self._apply(reply["routes"], newer_only=self.zk_settings is not None)
        if self.member is not None and self.member.data.get("stage") != self.stage:
            self.set_capacity(self.capacity)  # the node says which stage it was given
        self.watch.round_ended(started)  # the NM answered: as good as a heartbeat round
        return reply

    def _assign(self, stage: str | None) -> None:
        if stage != self.stage:
            self.stage = stage
            self.on_assign(stage)

    def _apply(self, routes: Any, newer_only: bool = False) -> None:
        if (wrong := problem(Routes, routes, "routes")) is not None:  # senders index it without checks
            log.warning("%s: ignored a route table: %s", self.id, wrong)
            return
        with self._routes_lock:
            # On ZooKeeper versions only grow (they live there), and two paths deliver tables.
            if newer_only and routes.get("version", 0) < self.routes.get("version", 0):
                return
            self.routes = routes  # swapped whole: readers in other threads see old or new, never half
            self.on_routes(routes)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"membership-{self.id}", daemon=True)
        self._thread.start()
        if self.role == "stage":  # what the NM reaps, and fences (nm/fencing.py)
            threading.Thread(target=self._tick, name=f"stall-watch-{self.id}", daemon=True).start()

    def _tick(self) -> None:
        while not self._stop.wait(self.watch.tick_s):
            self.watch.tick()

    def _loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            started = self.watch.began()
            try:
                self._beat()
            finally:
                self.watch.round_ended(started)  # whatever it hit: a stall before it is settled

    def _beat(self) -> None:
        """One heartbeat round: join again if the session was lost, else a heartbeat."""
        if self._session_lost.is_set():
            try:
                self.register(timeout=max(self.heartbeat_s, 2.0))
                log.info("joined again as %s", self.id)
            except Exception as e:
                log.warning("re-joining failed: %r", e)
            return
        if self.zk_settings is not None and self._primary is None and not self.nm.addresses:
            return  # no primary right now; the routes we have stay in force
        try:
            stats = self.stats()
        except Exception as e:  # stats are advisory; the heartbeat itself must go on
            log.debug("stats unavailable: %s", e)
            stats = {}
        try:
            extra: dict[str, Any] = {"serving": self.serving()} if self.role == "stage" else {}
            # Every heartbeat repeats a few heartbeats' worth: one that fails loses nothing.
            window_s = 3 * self.heartbeat_s + self.nm.timeout
            if self.deliveries is not None and (sent := self.deliveries.report(window_s)):
                extra[DELIVERED] = sent
            if self._fence_ack is not None:
                extra["fenced"] = self._fence_ack
            reply, _ = self.nm.call("heartbeat", instance=self.id, ready=self.ready(), stats=stats,
                                    version=self.routes["version"], process=self.process,
                                    **{deployments.FIELD: self.deployment}, **extra)
            if self._fenced(reply):
                return  # a fence comes alone: acknowledged with the next heartbeat
            if self.role == "stage" and "stage" in reply:
                self._assign(reply["stage"])
            if "routes" in reply:
                self._apply(reply["routes"], newer_only=self.zk_settings is not None)
            if "monitor" in reply:
                self.monitor = reply["monitor"]
        except Exception as e:  # the heartbeat goes on whatever one round hit
            if not isinstance(e, RpcError):
                log.exception("heartbeat round failed")
                return
            if deployments.REFUSED in str(e):
                # Another deployment's NM answers at our NM's address: we stay out of it, on
                # the routes we have, and keep asking (our own NM may come back there).
                log.error("heartbeat refused: %s", e)
            elif "unknown instance" in str(e):
                # The NM dropped us (silent too long, or it restarted): join again.
                log.warning("node manager forgot %s; registering again", self.id)
                try:
                    self.register(timeout=self.heartbeat_s)
                except Exception as e2:
                    log.warning("re-registration failed: %s", e2)
            elif isinstance(e, NoPrimary):
                log.info("heartbeat: %s", e)  # an election: expected, and harmless here
            else:
                log.warning("heartbeat to node manager failed: %s", e)

    def _fenced(self, reply: dict[str, Any]) -> bool:
        """Apply the fence a reply carries, once (nm/fencing.py); True if it carried one."""
        if "fenced" not in reply:
            self._fence_ack = None  # the NM holds no fence for us (any more)
            return False
        if (wrong := problem(FenceReply, reply["fenced"], "fenced")) is not None:
            log.error("%s: ignored a malformed fence from the node manager: %s", self.id, wrong)
            return True
        fence = FenceReply.model_validate(reply["fenced"])
        if fence.id != self._fence_ack:
            log.warning("the node manager declared %s dead (%s) and reported the %d request(s) it held failed: "
                        "dropping them before serving again", fence.instance, fence.reason, len(fence.uids))
            self.on_fenced(list(fence.uids), fence.reason)  # raises: not acknowledged, told again
            self._fence_ack = fence.id
        return True

    def settle(self, timeout: float | None = None) -> float:
        """Before handing work on: after this process stood still (nm/stall.py), wait until a
        heartbeat round that began after it has ended, so that a fence the NM holds for us is
        applied first; bounded (by default a heartbeat and two tries). The seconds waited."""
        timeout = 2 * (self.heartbeat_s + self.nm.timeout) if timeout is None else timeout
        return self.watch.settle(timeout, self.id or "")

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            # A heartbeat round may try every NM (and follow redirects) before giving up.
            attempts = max(1, len(self.nm.addresses)) + (MAX_REDIRECTS + 1 if self.zk_settings else 0)
            self._thread.join(timeout=self.heartbeat_s + attempts * self.nm.timeout + 1)
        if self._thread is not None and self._thread.is_alive():
            # Its RPC sockets are not ours to touch from this thread (ZMQ sockets are not
            # thread-safe): skip the goodbye, the NM drops us anyway (our member node goes
            # with the session below, or, embedded, after the heartbeat timeout).
            log.warning("heartbeat thread of %s still busy; leaving without deregistering", self.id)
        elif self.id is not None:
            try:
                self.nm.call("deregister", instance=self.id, timeout=0.5,
                             **({"token": self._token} if self._token else {}))
            except RpcError:
                pass  # the NM drops us after the heartbeat timeout (or when our member node goes)
        if self.zk is not None:
            try:
                if self.member is not None:
                    self.member.delete()
                self.zk.stop()
                self.zk.close()
            except Exception as e:  # closing the session drops the node anyway
                log.debug("closing ZooKeeper: %r", e)
        if self._thread is None or not self._thread.is_alive():
            self.nm.close()
