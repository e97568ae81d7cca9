"""The embedded node manager: one process, state in memory, served over ZMQ RPC.

Ops: ``register``, ``heartbeat``, ``deregister`` (instances); ``routes``, ``proxies``, ``dbs``,
``workflow`` (clients and instances); ``status`` (operators). Instances get the workflow and their
assignment in the ``register`` reply, so nothing but the NM address is configured on them.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any

import zmq

from onepiece.config import Topology, Workflow
from onepiece.nm.state import ClusterState
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


def serve(topology: Topology, workflow: Workflow, base_dir: Path, address: str | None = None) -> None:
    nm = NodeManager(topology, workflow, base_dir, address)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("node manager serving at %s", nm.address)
    try:
        nm.run(stop)
    finally:
        nm.close()
