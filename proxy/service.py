"""A proxy as a cluster member: learns the workflow and routes from the NM, registers its HTTP
address once bound, and reports its in-flight count and accepted/rejected totals with every
heartbeat."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from onepiece.config import Workflow
from onepiece.nm.client import Membership
from onepiece.nm.holdings import Deliveries
from onepiece.proxy.keys import ApiKeys, check_bind
from onepiece.proxy.server import ProxyServer

if TYPE_CHECKING:
    from onepiece.nm.zk import ZkSettings

log = logging.getLogger(__name__)


class NmCluster:
    """The Cluster protocol (proxy/cluster.py) read from the NM's latest route table."""

    def __init__(self, workflow: Workflow, member: Membership) -> None:
        self.workflow, self.member, self.set_name = workflow, member, member.set
        self._view: dict[str, Any] | None = None
        self._seen = 0.0

    def entrances(self, app: str) -> list[str]:
        first = self.workflow.applications[app].stages[0]
        return list(self.member.routes["stages"].get(first, []))

    def dbs(self) -> list[dict]:
        return list(self.member.routes["dbs"])

    def delivered(self, address: str, uid: str) -> None:
        if self.member.deliveries is not None:
            self.member.deliveries.add(address, uid)

    def monitor(self) -> dict[str, Any] | None:
        """The NM's capacity view from the latest heartbeat. A view no heartbeat has renewed
        for a while (the NM unreachable) is dropped, so the proxy falls back to the in-flight
        cap instead of admitting forever at a rate that may no longer hold."""
        view = self.member.monitor
        now = time.monotonic()
        if view is not self._view:
            self._view, self._seen = view, now
        if view is not None and now - self._seen > max(5.0, 10 * self.member.heartbeat_s):
            return None
        return view


def serve(nm_address: str, set_name: str, host: str, port: int, max_inflight: int, max_body_bytes: int,
          monitor: bool = True, deadline_factor: float = 2.0, advertise: str | None = None,
          zk: "ZkSettings | None" = None, keys: ApiKeys | None = None, deployment_id: str = "",
          name: str = "") -> None:
    """Run a proxy of ``set_name`` until SIGTERM; ``monitor=False`` admits by the in-flight cap
    only (no capacity or deadline refusals). ``zk``: the NMs run on ZooKeeper. ``keys``: the
    client API keys (required when ``host`` is beyond loopback)."""
    check_bind(host, keys)  # before joining the cluster: a refused proxy never registers
    server: ProxyServer | None = None

    def stats() -> dict:
        if server is None:
            return {"inflight": 0, "max_inflight": max_inflight, "accepted": 0, "rejected": 0, "refused": 0}
        return server.app.state.proxy.stats()

    member = Membership(nm_address, "proxy", set_name, {}, stats=stats, advertise=advertise, zk=zk,
                        capacity={"max_inflight": max_inflight}, deployment=deployment_id, deliveries=Deliveries(),
                        name=name)
    workflow = member.workflow()
    server = ProxyServer(NmCluster(workflow, member), host, port, max_inflight, max_body_bytes, log_level="info",
                         monitor=monitor, deadline_factor=deadline_factor, keys=keys)

    def on_bound(bound_host: str, bound_port: int) -> None:
        member.addresses = {"http": server.url}
        member.register()
        member.start()

    try:
        server.run(on_bound)
    finally:
        member.stop()
