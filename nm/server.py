"""The embedded node manager: one process, state in memory, served over ZMQ RPC.

Ops: ``register``, ``heartbeat``, ``deregister`` (instances); ``routes``, ``proxies``, ``dbs``,
``workflow`` (clients and instances); ``status`` (operators). Instances get the workflow and their
assignment in the ``register`` reply, so nothing but the NM address is configured on them.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import zmq
from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import GaugeMetricFamily

from onepiece.config import Topology, Workflow
from onepiece.nm.state import ClusterState
from onepiece.supervise import stop_on_signals
from onepiece.transport.rpc import RpcServer

log = logging.getLogger(__name__)


class NodeManager:
    def __init__(self, topology: Topology, workflow: Workflow, base_dir: Path, address: str | None = None) -> None:
        self.topology, self.workflow, self.base_dir = topology, workflow, base_dir
        self.state = ClusterState(topology, workflow)
        self.rpc = RpcServer(address or topology.nm.address, {
            "register": self._register,
            "heartbeat": self._heartbeat,
            "deregister": self._deregister,
            "routes": lambda req, _: {"routes": self.state.routes(self._set(req))},
            "proxies": lambda req, _: {"proxies": self._all("proxies", req)},
            "dbs": lambda req, _: {"dbs": self._all("dbs", req)},
            "status": lambda req, _: self.state.status(),
            "workflow": lambda req, _: {"workflow": self.workflow.model_dump(mode="json"), "base_dir": str(self.base_dir)},
        })
        self.address = self.rpc.address

    def _set(self, req: dict) -> str:
        name = req.get("set")
        if name not in self.state.sets:
            raise ValueError(f"unknown set {name!r} (known: {sorted(self.state.sets)})")
        return name

    def _all(self, key: str, req: dict) -> dict[str, list]:
        names = [self._set(req)] if req.get("set") else list(self.state.sets)
        return {n: self.state.routes(n)[key] for n in names}

    def _register(self, req: dict, _: Any) -> dict:
        addresses = req.get("addresses")
        if not isinstance(addresses, dict) or not all(isinstance(v, str) for v in addresses.values()):
            raise ValueError("register: 'addresses' must map names to address strings")
        inst = self.state.register(str(req.get("role")), str(req.get("set")), addresses,
                                   int(req.get("pid", 0)), str(req.get("host", "")), req.get("stage"))
        return {
            "instance": inst.id,
            "stage": inst.stage,
            "workflow": self.workflow.model_dump(mode="json"),
            "base_dir": str(self.base_dir),
            "heartbeat_s": self.topology.nm.heartbeat_s,
            "routes": self.state.routes(inst.set),
        }

    def _heartbeat(self, req: dict, _: Any) -> dict:
        version = req.get("version")
        inst = self.state.heartbeat(str(req.get("instance")), bool(req.get("ready")), req.get("stats") or {},
                                    version if isinstance(version, int) else 0)
        reply: dict[str, Any] = {"version": self.state.version}
        if version != self.state.version:
            reply["routes"] = self.state.routes(inst.set)
        if inst.role == "proxy":  # the request monitor's view, fresh every heartbeat
            reply["monitor"] = self.state.monitor(inst.set)
        return reply

    def _deregister(self, req: dict, _: Any) -> dict:
        self.state.deregister(str(req.get("instance")), "left")
        return {}

    def run(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(self.rpc.sock, zmq.POLLIN)
        tick_ms = int(min(self.topology.nm.heartbeat_s, 0.5) * 1000)
        while not stop.is_set():
            if poller.poll(tick_ms):
                self.rpc.handle()
            self.state.expire(self.topology.nm.dead_after_s)

    def close(self) -> None:
        self.rpc.close()


class NmMetrics:
    """Prometheus view of the cluster state, read at scrape time."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state

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


def serve(topology: Topology, workflow: Workflow, base_dir: Path, address: str | None = None,
          metrics_port: int = 0) -> None:
    stop = stop_on_signals()
    nm = NodeManager(topology, workflow, base_dir, address)
    REGISTRY.register(NmMetrics(nm.state))
    metrics, _ = start_http_server(metrics_port, addr="127.0.0.1")
    log.info("node manager serving at %s, metrics at http://127.0.0.1:%d/metrics", nm.address, metrics.server_port)
    try:
        nm.run(stop)
    finally:
        nm.close()
        metrics.shutdown()
