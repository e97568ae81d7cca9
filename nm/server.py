"""The embedded node manager: one process, state in memory, served over ZMQ RPC.

Ops: ``register``, ``heartbeat``, ``deregister`` (instances); ``routes``, ``proxies``, ``dbs``,
``workflow`` (clients and instances); ``status`` and ``move`` (operators). Stage instances
report their utilization in their heartbeats and learn their assignment from the replies; the
NM moves them between stages (nm/elastic.py). Instances get the workflow and their
assignment in the ``register`` reply, so nothing but the NM address is configured on them.

Stage instances list the requests they hold in their heartbeats; when one is dropped without
leaving (silent too long here, nm/liveness.py; its ZooKeeper session gone in nm/ha.py) those
requests are reported failed to the set's DBs (nm/reaper.py), and the NM fences its process: if
it comes back, it is told to drop them before it is heard again (nm/fencing.py). The NM on ZooKeeper
(``HaNodeManager``) subclasses this one through the ``_handlers``/``_saved``/``_tick`` hooks.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from onepiece import deployment, metrics_endpoint, operator_key
from onepiece.config import Topology, Workflow
from onepiece.droplog import log_dropped
from onepiece.heartbeat import DELIVERED, delivered_of, stage_stats_problem
from onepiece.nm.deliveries import DeliveryLedger, Grave
from onepiece.nm.fencing import Fences
from onepiece.nm import identity
from onepiece.nm.elastic import Elastic, Move
from onepiece.nm.liveness import Liveness, LivenessSpec
from onepiece.nm.orphans import REASON as UNHELD, Look, OrphanSweep
from onepiece.nm.protocol import SCHEMAS, HeartbeatArgs, Holdings, InstanceArgs, MoveArgs, RegisterArgs, SetArgs
from onepiece.nm.reaper import MAX_UIDS, Reaper
from onepiece.schema import is_name, problem as problem_of
from onepiece.nm.state import LEFT, ClusterState, Instance, fresh_version
from onepiece.supervise import stop_on_signals
from onepiece.transport import curve
from onepiece.transport.registry import host_of
from onepiece.transport.rpc import RpcServer

if TYPE_CHECKING:
    from onepiece.nm.zk import ZkSettings

log = logging.getLogger(__name__)



class NodeManager:
    def __init__(self, topology: Topology, workflow: Workflow, base_dir: Path, address: str | None = None,
                 deployment_id: str = "") -> None:
        self.topology, self.workflow, self.base_dir = topology, workflow, base_dir
        self.deployment = deployment_id  # members of another deployment are refused (onepiece/deployment.py)
        # What `move` needs (onepiece/operator_key.py): the environment's, unless serve() is given a file's.
        self.operator_key = operator_key.resolve(None)
        self.state = ClusterState(topology, workflow, self.first_version())
        self.reaper = Reaper(workflow)
        self.elastic = Elastic(topology.nm.elastic)
        self.liveness = Liveness(LivenessSpec(topology.nm.heartbeat_s, topology.nm.dead_after_s))
        # What members delivered where, kept for longer than a death takes to notice (silence
        # here, a ZooKeeper session on ZooKeeper), with room for a stall.
        nm = topology.nm
        self.deliveries = DeliveryLedger(2 * (max(self.liveness.spec.limit_s, nm.zk_session_s) + 2 * nm.heartbeat_s))
        # The processes it reaped, until they came back and dropped that work (nm/fencing.py);
        # kept as long as a request may live, after which the instance has expired it itself.
        self.fences = Fences(max((a.limits.timeout_s for a in workflow.applications.values()), default=600.0)
                             + self.liveness.spec.limit_s)
        # After it starts, the embedded NM hands out no narrowed routes for the dead limit: a
        # restarted NM knows nobody until each instance has heard "unknown instance" and
        # registered again, those that did first must not lose the routes to those that did not
        # yet, and a live instance is heard within that limit (two heartbeats were too short for
        # a member backing off after failed heartbeats on a loaded machine). Until then members
        # keep the routes they hold, and proxies get no capacity view.
        self._settle_until: float | None = time.monotonic() + self.liveness.spec.limit_s
        # Requests that a stage took with it while no NM heard it (nm/orphans.py): two looks
        # this far apart, much wider than a heartbeat and a hand-over between stages.
        self.orphans = OrphanSweep(self.liveness.spec.limit_s, self._orphaned)
        self._next_look = 0.0
        try:
            self.rpc = RpcServer(address or topology.nm.address, self._handlers(), SCHEMAS)
        except BaseException:  # (the address is taken): no reaper thread left behind
            self.reaper.close()
            self.orphans.close()
            raise
        self.address = self.rpc.address

    def first_version(self) -> int:
        """The route version this NM starts at: above any its predecessor handed out (this
        embedded NM keeps no state across a restart)."""
        return fresh_version()

    def _handlers(self) -> dict:
        """Op -> handler; each gets its arguments checked against ``nm.protocol.SCHEMAS``."""
        return {
            "register": self._register,
            "heartbeat": self._heartbeat,
            "deregister": self._deregister,
            "routes": lambda req, _: {"routes": self.state.routes(self._set(req))},
            "proxies": lambda req, _: {"proxies": self._all("proxies", req)},
            "dbs": lambda req, _: {"dbs": self._all("dbs", req)},
            "status": lambda req, _: {**self.state.status(), "nm": self._nm_status(),
                                      "elastic": self.elastic.view(self.state)},
            "move": self._move,
            "workflow": lambda req, _: {"workflow": self.workflow.model_dump(mode="json"), "base_dir": str(self.base_dir)},
        }

    def _nm_status(self) -> dict[str, Any]:
        # fenced: processes declared dead that have not come back and dropped their work yet
        return {"mode": "embedded", "address": self.address, deployment.FIELD: self.deployment,
                "fenced": len(self.fences)}

    def _check_deployment(self, theirs: str) -> None:
        """Refuse a member of another deployment before it touches the state (the RPC server
        logs the refusal; the member logs it too)."""
        why = deployment.refusal(self.deployment, theirs)
        if why is not None:
            raise PermissionError(why)

    # ---- hooks for the NM on ZooKeeper -------------------------------------------------------

    def _instance_id(self, req: RegisterArgs) -> str | None:
        """The id a registering instance brings: its name (nm/identity.py; None: this NM makes
        one up)."""
        return req.name or None

    def _saved(self) -> None:
        """Called after the state changed, before the reply: the HA NM writes it to ZooKeeper."""
        self.state.dirty.clear()

    def _dead_after_s(self) -> float:
        """How long a member may go unheard before it is dropped (told to members: a member that
        stood still that long holds its hand-overs until it hears whether it was fenced)."""
        return self.liveness.spec.limit_s

    def _monitor_ready(self, set_name: str) -> bool:
        """Whether the capacity view of the set rests on fresh stats (see nm/ha.py): not while
        instances are still registering again."""
        return not self._settling()

    def _settling(self) -> bool:
        """Whether the NM just started and its routes may still lack instances that serve (the
        NM on ZooKeeper restores them instead)."""
        return self._settle_until is not None

    def _tick(self) -> None:
        """Periodic work of the loop: here, dropping silent instances (nm/liveness.py) and moving
        instances where the load is."""
        if self._settle_until is not None and time.monotonic() >= self._settle_until:
            self._settle_until = None
            self.state.republish(f"every live instance had {self.liveness.spec.limit_s:.1f}s to register after the start")
        why = f"no heartbeat for {self.liveness.spec.limit_s:.1f}s"
        for iid in self.liveness.dead({i.id: i.last_seen for i in self.state.instances.values()}):
            if (inst := self.state.deregister(iid, why)) is not None:
                self._dropped(inst, why)
        self.elastic.tick(self.state)
        self._saved()
        if not self._settling():
            self._look_for_orphans()

    def _look_for_orphans(self) -> None:
        """Hand the sweep each set's DBs and holdings now and then (nm/orphans.py), once every
        live member could have registered and while every stage instance has reported what it
        holds to this NM (not one that has yet to heartbeat after a restart or a takeover)."""
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + self.orphans.gap_s / 2
        fresh_s = 2 * self.topology.nm.heartbeat_s
        for set_name in self.state.sets:
            stages = self.state.stage_instances(set_name)
            dbs = self.state.routes(set_name)["dbs"]
            if dbs and all(i.heard for i in stages):
                # A stage instance that does not serve its stage yet (its workers load, after a
                # restart or a move) reads nothing either: what reached its address on the routes
                # of before (`onepiece up` restarts it at the same one) waits in its buffer.
                blind = any(_queue_full(i.stats) or now - i.last_seen > fresh_s
                            or (i.stage is not None and not i.ready) for i in stages)
                # Only requests old enough to be held by now (a proxy's hand-over retries last seconds).
                self.orphans.submit(Look(set_name, dbs, {u for i in stages for u in i.holding},
                                         time.time() - 2 * self.orphans.gap_s, blind=blind))

    def _orphaned(self, set_name: str, dbs: list[dict[str, str]], records: dict[str, dict]) -> None:
        """(The sweep's thread.) Report failed, through the reaper, requests no live instance held."""
        by_stage: dict[str, list[str]] = {}
        for uid, rec in records.items():
            app = self.workflow.applications.get(rec.get("app") or "")
            stage = rec.get("stage") or (app.stages[0] if app is not None else "")
            by_stage.setdefault(stage, []).append(uid)
        for stage, uids in by_stage.items():
            # Where a stage last reported it (db/store.py's deadline verdict says the same): a
            # request waiting in the next stage's queue has not been reported there yet.
            error = (f"{UNHELD}: last reported at stage {stage}; the instance that held it was lost "
                     "while no node manager heard it")
            self.reaper.submit("(unknown)", stage, uids, dbs, UNHELD, error)

    def _dropped(self, inst: Instance, reason: str) -> None:
        """An instance died (it did not leave): report as failed what it held at its last
        heartbeat and what its senders delivered to it since (nm/deliveries.py), except what a
        live instance says it holds now (handed on before the death)."""
        if inst.role != "stage":
            return
        now, address = time.monotonic(), inst.addresses["data"]
        # A delivery reported a heartbeat before the last one may still have been in its socket.
        since = inst.last_seen - self.topology.nm.heartbeat_s
        held = {u for i in self.state.stage_instances(inst.set) for u in i.holding}
        uids = [u for u in dict.fromkeys([*inst.holding, *self.deliveries.sent_to(address, since)]) if u not in held]
        uids = uids[:MAX_UIDS]  # what the reaper takes
        # The stage it held them for: the one it served, even when a move had reassigned it.
        stage = inst.serving or inst.stage
        if self.reaper.submit(inst.id, stage, uids, self.state.routes(inst.set)["dbs"], reason):
            self._fence(inst.process, inst.id, reason, uids)
        if not any(i.addresses.get("data") == address for i in self.state.instances.values()):
            # Nobody took its address over yet: a delivery there reported later was lost with it.
            self.deliveries.bury(address, Grave(inst.id, stage, inst.set, since,
                                                now + self.deliveries.horizon_s, reason, set(uids), inst.process))

    def _fence(self, process: str, instance: str, reason: str, uids: list[str]) -> None:
        """``process`` was reaped of ``uids``: if it comes back it must drop them (nm/fencing.py)."""
        fence = self.fences.add(process, instance, reason, uids)
        if fence is not None:
            log.info("fenced the process of %s: %d request(s) reported failed must not be finished by it if it "
                     "comes back", instance, len(fence.uids))

    def _delivered(self, report: Any, sender: str) -> None:
        """A member's recent deliveries; those to an instance that died meanwhile are reaped now."""
        delivered = delivered_of(report)
        if delivered is None:
            log_dropped(log, f"nm at {self.rpc.address}", DELIVERED, "heartbeat of %s: malformed %r report dropped",
                        sender, DELIVERED)
            return
        for grave, uids in self.deliveries.record(delivered, time.monotonic()):
            log.info("%d request(s) were delivered to %s after it was last heard; reporting them failed",
                     len(uids), grave.instance)
            if self.reaper.submit(grave.instance, grave.stage, uids, self.state.routes(grave.set)["dbs"], grave.reason):
                self._fence(grave.process, grave.instance, grave.reason, uids)

    def _set(self, req: SetArgs) -> str:
        if req.set not in self.state.sets:
            raise ValueError(f"unknown set {req.set!r} (known: {sorted(self.state.sets)})")
        return req.set

    def _all(self, key: str, req: SetArgs) -> dict[str, list]:
        names = [self._set(req)] if req.set else list(self.state.sets)
        return {n: self.state.routes(n)[key] for n in names}

    def _register(self, req: RegisterArgs, _: Any) -> dict:
        self._check_deployment(req.deployment)
        iid = self._instance_id(req)
        holder = self.state.instances.get(iid) if iid is not None else None
        self._check_key(req, holder)
        if holder is not None:
            self._claim(holder, req)
        inst = self.state.register(req.role, req.set, dict(req.addresses), req.pid, req.host, req.stage,
                                   inst_id=iid, idle=req.idle, name=req.name, serving=req.serving,
                                   process=req.process)
        if inst.role == "stage":
            self.deliveries.revive(inst.addresses["data"], time.monotonic())
        self._saved()
        fence = self.fences.of(req.process)
        return {
            **({"fenced": fence.reply()} if fence is not None else {}),  # drop those first (nm/fencing.py)
            "instance": inst.id,
            "token": inst.token,  # what it deregisters itself with
            "settling": self._settling(),  # the routes may lack some: one that holds routes keeps them
            "stage": inst.stage,
            "workflow": self.workflow.model_dump(mode="json"),
            "base_dir": str(self.base_dir),
            "heartbeat_s": self.topology.nm.heartbeat_s,
            "dead_after_s": self._dead_after_s(),
            "drain_s": self.topology.nm.elastic.drain_s,
            "routes": self.state.routes(inst.set),
        }

    def _check_key(self, req: RegisterArgs, holder: Instance | None) -> None:
        """With CURVE, a set's proxies' key registers that set's proxies only. The proxies face
        the clients: one taken over must not join as a stage or a DB (and be handed requests or
        results), nor take over the name of a member of another role."""
        who = self.rpc.caller
        if who is None or who == curve.NAME:  # no CURVE (loopback, ipc), or the members' own key
            return
        if req.role != "proxy" or who != curve.proxy_pair(req.set):
            raise PermissionError(f"the {who} key registers only proxies of the set it names, not a {req.role} "
                                  f"of set {req.set!r}")
        if holder is not None and holder.role != "proxy":
            raise PermissionError(f"the {who} key may not take the name of {holder.role} {holder.id}")

    def _claim(self, holder: Instance, req: RegisterArgs) -> None:
        """A registration under an id that ``holder`` has: refused while the holder is alive,
        else the holder is dropped as dead first (nm/identity.py)."""
        silent = time.monotonic() - holder.last_seen
        verdict = identity.claim(holder.process, silent, req.process, identity.held_s(self.topology.nm.heartbeat_s))
        if verdict == "held":
            raise ValueError(f"instance {holder.id} {identity.NAME_HELD} (pid {holder.pid} on {holder.host or '?'}, "
                             f"heard {silent:.1f}s ago): a second process under one name is refused")
        if verdict == "replace":
            why = (f"its process was replaced (a new one, pid {req.pid} on {req.host or '?'}, registered under its "
                   f"name after {silent:.1f}s of silence)")
            self.state.deregister(holder.id, why)
            self._dropped(holder, why)

    def _heartbeat(self, req: HeartbeatArgs, _: Any) -> dict:
        self._check_deployment(req.deployment)  # before the lookup: a foreign member is not told to register again
        if req.fenced is not None:
            self.fences.acknowledged(req.process, req.fenced)
        if (fence := self.fences.of(req.process)) is not None:
            # Declared dead and reaped: it drops that work before anything else (not even its
            # liveness counts), then acknowledges, and only then registers again (nm/fencing.py).
            return {"fenced": fence.reply()}
        stats = dict(req.stats)
        holding = stats.pop("holding", None)  # kept apart: status shows only its length
        if isinstance(holding, list) and not all(map(is_name, holding)):
            # One bad entry must not cost the others: they are what the NM fails if the instance dies.
            log_dropped(log, f"nm at {self.rpc.address}", "holding entry", "heartbeat of %s: %d bad uid(s) "
                        "dropped from its holding", req.instance, sum(not is_name(u) for u in holding))
            holding = [u for u in holding if is_name(u)]
        if holding is not None and (problem := problem_of(Holdings, {"holding": holding}, "stats")) is not None:
            log_dropped(log, f"nm at {self.rpc.address}", f"holding {problem}", "heartbeat of %s: holding dropped: %s",
                        req.instance, problem)
            holding = None
        known = self.state.instances.get(req.instance)
        if known is not None and known.role == "stage" and (problem := stage_stats_problem(stats)) is not None:
            # Liveness still counts; the figures do not (they would break every capacity estimate).
            log_dropped(log, f"nm at {self.rpc.address}", f"stats {problem}", "heartbeat of %s: stats dropped: %s",
                        known.id, problem)
            stats = known.stats
        inst = self.state.heartbeat(req.instance, req.ready, stats, req.version, holding, req.serving,
                                    process=req.process)
        if inst.role == "stage":
            self.elastic.observe(inst, time.monotonic())
        if req.delivered:
            self._delivered(req.delivered, req.instance)
        self._saved()
        reply: dict[str, Any] = {"version": self.state.version}
        if inst.role == "stage":
            reply["stage"] = inst.stage  # its assignment: the NM may have moved it
        if req.version != self.state.version and not self._settling():
            reply["routes"] = self.state.routes(inst.set)
        if inst.role == "proxy" and self._monitor_ready(inst.set):
            reply["monitor"] = self.state.monitor(inst.set)  # the request monitor's view, fresh every heartbeat
        return reply

    def _deregister(self, req: InstanceArgs, _: Any) -> dict:
        """An instance that leaves (with its own token), or one an operator takes out (the key)."""
        if req.key is not None:
            operator_key.check(self.operator_key, req.key, "deregister")
        else:
            inst = self.state.instances.get(req.instance)
            if inst is None:
                return {}  # gone already: leaving twice is no error
            if not req.token or not hmac.compare_digest(inst.token.encode(), req.token.encode()):
                raise PermissionError(f"deregister of {req.instance}: needs that instance's own token (from its "
                                      f"registration) or the operator key")
        self.state.deregister(req.instance, LEFT)
        self._saved()
        return {}

    def _move(self, req: MoveArgs, _: Any) -> dict:
        """An operator's move: ``instance`` to ``stage`` (null: the idle pool)."""
        operator_key.check(self.operator_key, req.key, "move")
        iid, stage = req.instance, req.stage
        inst = self.state.movable(iid, stage)  # an unknown instance or stage is named as such
        src = inst.stage
        now = time.monotonic()
        if src is not None:
            # The elastic policy's own rule (nm/elastic.py ``can_spare``): an operator who moved a
            # stage's last instance took its application down until someone moved one back
            # (the floor rule refills from the idle pool only, and undid a move there at once).
            # Ready by its last heartbeat is ready however late that came (it is routed until it is
            # dropped): a heartbeat late under load let an operator take a stage's only instance.
            load = self.elastic.loads(self.state, inst.set, now)[src]
            stay = [i for i in load.live if i != iid]
            if inst.ready and len(stay) < load.floor:
                raise ValueError(f"moving {iid} would leave stage {src} {len(stay)} ready instance(s), "
                                 f"below its minimum {load.floor}: move another instance to {src} first")
        self.elastic.apply(self.state, Move(iid, src, stage, "asked by an operator"), now)
        self._saved()
        return {"instance": iid, "from": src, "to": stage}

    def run(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(self.rpc.sock, zmq.POLLIN)
        tick_ms = int(min(self.topology.nm.heartbeat_s, 0.5) * 1000)
        while not stop.is_set():
            if poller.poll(tick_ms):
                self.rpc.handle()  # (guarded per request)
            try:
                self._tick()
            except Exception:  # the last guard: an embedded NM that died would take the whole state with it
                log.exception("node manager: a periodic turn failed; serving on")

    def close(self) -> None:
        self.rpc.close()
        self.reaper.close()
        self.orphans.close()


def _queue_full(stats: dict[str, Any]) -> bool:
    """Whether a stage's last heartbeat reported its queue full (it then reads no more messages)."""
    q, cap = stats.get("queue"), stats.get("capacity")
    return isinstance(q, int) and isinstance(cap, int) and q >= cap


class NmMetrics:
    """Prometheus view of the cluster state, read at scrape time."""

    def __init__(self, nm: "NodeManager") -> None:
        self.nm = nm

    @property
    def state(self) -> ClusterState:
        return self.nm.state  # a new primary restores into the same object, but read it fresh anyway

    def collect(self):
        primary = getattr(self.nm, "primary", True)  # (an embedded NM always is)
        p = GaugeMetricFamily("onepiece_nm_primary", "1 while this NM serves as primary")
        p.add_metric([], 1 if primary else 0)
        yield p
        if not primary:  # a backup's state is the last it saw: summed over NMs it counted twice
            return
        g = GaugeMetricFamily("onepiece_nm_instances", "registered instances", labels=["set", "role", "stage", "ready"])
        # Every set's roles and stages, ready or not, at 0 too: a stage whose last instance was
        # dropped had no series at all, so `onepiece_nm_instances{ready="true"} == 0` never fired.
        counts: dict[tuple, int] = {(name, role, stage, ready): 0 for name in self.state.sets
                                    for role, stage in [("db", ""), ("proxy", ""),
                                                        *(("stage", s) for s in self.state.workflow.stages)]
                                    for ready in ("true", "false")}
        for i in list(self.state.instances.values()):
            key = (i.set, i.role, i.stage or "", str(i.ready).lower())
            counts[key] = counts.get(key, 0) + 1
        for key, n in counts.items():
            g.add_metric(list(key), n)
        yield g
        d = CounterMetricFamily("onepiece_nm_dropped_instances", "instances dropped from the routes other than by "
                                "leaving (silent, killed, replaced by their restart), since this NM became primary",
                                labels=["set", "role", "stage"])
        for key, n in list(self.state.drops.items()):
            d.add_metric(list(key), n)
        yield d
        v = GaugeMetricFamily("onepiece_nm_routes_version", "route table version")
        v.add_metric([], self.state.version)
        yield v


def serve(topology: Topology, workflow: Workflow, base_dir: Path, address: str | None = None,
          metrics_port: int = 0, zk: "ZkSettings | None" = None, advertise: str | None = None,
          deployment_id: str = "", operator: str | None = None) -> None:
    """Run an NM until SIGTERM: embedded, or with ``zk`` one of several on ZooKeeper. It admits
    members of ``deployment_id`` only; ``operator``: the operator key (default: the environment's)."""
    stop = stop_on_signals()
    if zk is None:
        nm = NodeManager(topology, workflow, base_dir, address, deployment_id)
    else:
        from onepiece.nm.ha import HaNodeManager

        nm = HaNodeManager(topology, workflow, base_dir, zk, address, advertise, deployment_id)
    if operator:
        nm.operator_key = operator
    if not nm.operator_key:
        log.warning("no operator key (%s FILE or %s): `move` and operators' `deregister` are refused",
                    operator_key.FLAG, operator_key.ENV)
    REGISTRY.register(NmMetrics(nm))
    # On the NM's own host, as every other role's: bound to loopback, an NM serving on 0.0.0.0
    # (a container) could not be scraped from anywhere else, whatever --metrics-port said.
    host = host_of(nm.address).strip("[]")
    metrics = metrics_endpoint.start(metrics_port, host)
    log.info("node manager of deployment %s serving at %s, metrics at http://%s:%d/metrics",
             deployment_id or "none", nm.address, host, metrics.server_port)
    try:
        nm.run(stop)
    finally:
        nm.close()
        metrics_endpoint.stop(metrics)
