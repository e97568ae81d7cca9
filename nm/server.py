"""The embedded node manager: one process, state in memory, served over ZMQ RPC.

Ops: ``register``, ``heartbeat``, ``deregister`` (instances); ``routes``, ``proxies``, ``dbs``,
``workflow`` (clients and instances); ``status`` and ``move`` (operators). Stage instances
report their utilization in their heartbeats and learn their assignment from the replies; the
NM moves them between stages (nm/elastic.py). Instances get the workflow and their
assignment in the ``register`` reply, so nothing but the NM address is configured on them.

Stage instances list the requests they hold in their heartbeats; when one is dropped without
leaving (silent for ``dead_after_s`` here, its ZooKeeper session gone in nm/ha.py) those
requests are reported failed to the set's DBs (nm/reaper.py). The NM on ZooKeeper
(``HaNodeManager``) subclasses this one through the ``_handlers``/``_saved``/``_tick`` hooks.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import GaugeMetricFamily

from onepiece.config import Topology, Workflow
from onepiece.heartbeat import stage_stats_problem
from onepiece.nm.elastic import Elastic, Move
from onepiece.nm.protocol import SCHEMAS, HeartbeatArgs, Holdings, InstanceArgs, MoveArgs, RegisterArgs, SetArgs
from onepiece.schema import problem as problem_of
from onepiece.nm.reaper import Reaper
from onepiece.nm.state import ClusterState, Instance
from onepiece.supervise import stop_on_signals
from onepiece.transport.rpc import RpcServer

if TYPE_CHECKING:
    from onepiece.nm.zk import ZkSettings

log = logging.getLogger(__name__)


class NodeManager:
    def __init__(self, topology: Topology, workflow: Workflow, base_dir: Path, address: str | None = None) -> None:
        self.topology, self.workflow, self.base_dir = topology, workflow, base_dir
        self.state = ClusterState(topology, workflow)
        self.reaper = Reaper(workflow)
        self.elastic = Elastic(topology.nm.elastic)
        self.rpc = RpcServer(address or topology.nm.address, self._handlers(), SCHEMAS)
        self.address = self.rpc.address

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
        return {"mode": "embedded", "address": self.address}

    # ---- hooks for the NM on ZooKeeper -------------------------------------------------------

    def _instance_id(self, req: RegisterArgs) -> str | None:
        """The id a registering instance brings (None: this NM names it)."""
        return None

    def _saved(self) -> None:
        """Called after the state changed, before the reply: the HA NM writes it to ZooKeeper."""
        self.state.dirty.clear()

    def _monitor_ready(self, set_name: str) -> bool:
        """Whether the capacity view of the set rests on fresh stats (see nm/ha.py)."""
        return True

    def _tick(self) -> None:
        """Periodic work of the loop: here, dropping silent instances and moving instances
        where the load is."""
        for inst in self.state.expire(self.topology.nm.dead_after_s):
            self._dropped(inst, f"no heartbeat for {self.topology.nm.dead_after_s:.1f}s")
        self.elastic.tick(self.state)
        self._saved()

    def _dropped(self, inst: Instance, reason: str) -> None:
        """An instance died (it did not leave): report what it held as failed."""
        if inst.role == "stage" and inst.holding:
            self.reaper.submit(inst.id, inst.stage, inst.holding, self.state.routes(inst.set)["dbs"], reason)

    def _set(self, req: SetArgs) -> str:
        if req.set not in self.state.sets:
            raise ValueError(f"unknown set {req.set!r} (known: {sorted(self.state.sets)})")
        return req.set

    def _all(self, key: str, req: SetArgs) -> dict[str, list]:
        names = [self._set(req)] if req.set else list(self.state.sets)
        return {n: self.state.routes(n)[key] for n in names}

    def _register(self, req: RegisterArgs, _: Any) -> dict:
        inst = self.state.register(req.role, req.set, dict(req.addresses), req.pid, req.host, req.stage,
                                   inst_id=self._instance_id(req), idle=req.idle, name=req.name)
        self._saved()
        return {
            "instance": inst.id,
            "stage": inst.stage,
            "workflow": self.workflow.model_dump(mode="json"),
            "base_dir": str(self.base_dir),
            "heartbeat_s": self.topology.nm.heartbeat_s,
            "drain_s": self.topology.nm.elastic.drain_s,
            "routes": self.state.routes(inst.set),
        }

    def _heartbeat(self, req: HeartbeatArgs, _: Any) -> dict:
        stats = dict(req.stats)
        holding = stats.pop("holding", None)  # kept apart: status shows only its length
        if holding is not None and (problem := problem_of(Holdings, {"holding": holding}, "stats")) is not None:
            log.warning("heartbeat of %s: holding dropped: %s", req.instance, problem)
            holding = None
        known = self.state.instances.get(req.instance)
        if known is not None and known.role == "stage" and (problem := stage_stats_problem(stats)) is not None:
            # Liveness still counts; the figures do not (they would break every capacity estimate).
            log.warning("heartbeat of %s: stats dropped: %s", known.id, problem)
            stats = known.stats
        inst = self.state.heartbeat(req.instance, req.ready, stats, req.version, holding, req.serving)
        if inst.role == "stage":
            self.elastic.observe(inst, time.monotonic())
        self._saved()
        reply: dict[str, Any] = {"version": self.state.version}
        if inst.role == "stage":
            reply["stage"] = inst.stage  # its assignment: the NM may have moved it
        if req.version != self.state.version:
            reply["routes"] = self.state.routes(inst.set)
        if inst.role == "proxy" and self._monitor_ready(inst.set):
            reply["monitor"] = self.state.monitor(inst.set)  # the request monitor's view, fresh every heartbeat
        return reply

    def _deregister(self, req: InstanceArgs, _: Any) -> dict:
        self.state.deregister(req.instance, "left")
        self._saved()
        return {}

    def _move(self, req: MoveArgs, _: Any) -> dict:
        """An operator's move: ``instance`` to ``stage`` (null: the idle pool)."""
        iid, stage = req.instance, req.stage
        inst = self.state.instances.get(iid)
        src = inst.stage if inst is not None else None
        self.elastic.apply(self.state, Move(iid, src, stage, "asked by an operator"), time.monotonic())
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


class NmMetrics:
    """Prometheus view of the cluster state, read at scrape time."""

    def __init__(self, nm: "NodeManager") -> None:
        self.nm = nm

    @property
    def state(self) -> ClusterState:
        return self.nm.state  # a new primary restores into the same object, but read it fresh anyway

    def collect(self):
        g = GaugeMetricFamily("onepiece_nm_instances", "registered instances", labels=["set", "role", "stage", "ready"])
        counts: dict[tuple, int] = {}
        for i in list(self.state.instances.values()):
            key = (i.set, i.role, i.stage or "", str(i.ready).lower())
            counts[key] = counts.get(key, 0) + 1
        for key, n in counts.items():
            g.add_metric(list(key), n)
        yield g
        v = GaugeMetricFamily("onepiece_nm_routes_version", "route table version")
        v.add_metric([], self.state.version)
        yield v
        p = GaugeMetricFamily("onepiece_nm_primary", "1 while this NM serves as primary")
        p.add_metric([], 1 if getattr(self.nm, "primary", True) else 0)
        yield p


def serve(topology: Topology, workflow: Workflow, base_dir: Path, address: str | None = None,
          metrics_port: int = 0, zk: "ZkSettings | None" = None, advertise: str | None = None) -> None:
    """Run an NM until SIGTERM: embedded, or with ``zk`` one of several on ZooKeeper."""
    stop = stop_on_signals()
    if zk is None:
        nm = NodeManager(topology, workflow, base_dir, address)
    else:
        from onepiece.nm.ha import HaNodeManager

        nm = HaNodeManager(topology, workflow, base_dir, zk, address, advertise)
    REGISTRY.register(NmMetrics(nm))
    metrics, _ = start_http_server(metrics_port, addr="127.0.0.1")
    log.info("node manager serving at %s, metrics at http://127.0.0.1:%d/metrics", nm.address, metrics.server_port)
    try:
        nm.run(stop)
    finally:
        nm.close()
        metrics.shutdown()
