"""A proxy as a cluster member: learns the workflow and routes from the NM, registers its HTTP
address once bound, and reports its in-flight count and accepted/rejected totals with every
heartbeat."""

from __future__ import annotations

import logging

from onepiece.config import Workflow
from onepiece.nm.client import Membership, NmClient
from onepiece.proxy.server import ProxyServer

log = logging.getLogger(__name__)


class NmCluster:
    """The Cluster protocol (proxy/cluster.py) read from the NM's latest route table."""

    def __init__(self, workflow: Workflow, member: Membership) -> None:
        self.workflow, self.member, self.set_name = workflow, member, member.set

    def entrances(self, app: str) -> list[str]:
        first = self.workflow.applications[app].stages[0]
        return list(self.member.routes["stages"].get(first, []))

    def dbs(self) -> list[dict]:
        return list(self.member.routes["dbs"])


def serve(nm_address: str, set_name: str, host: str, port: int, max_inflight: int, max_body_bytes: int) -> None:
    nm = NmClient(nm_address, timeout=1.0, retries=0)
    workflow = nm.workflow()
    nm.close()
    server: ProxyServer | None = None

    def stats() -> dict:
        if server is None:
            return {"inflight": 0, "max_inflight": max_inflight, "accepted": 0, "rejected": 0}
        return server.app.state.proxy.stats()

    member = Membership(nm_address, "proxy", set_name, {}, stats=stats)
    server = ProxyServer(NmCluster(workflow, member), host, port, max_inflight, max_body_bytes, log_level="info")

    def on_bound(bound_host: str, bound_port: int) -> None:
        member.addresses = {"http": server.url}
        member.register()
        member.start()

    try:
        server.run(on_bound)
    finally:
        member.stop()
