"""A DB as a cluster member: registers its addresses (and its Prometheus endpoint) with the NM
once bound, and keeps its replication peers equal to the other live DBs of its set as the NM's
routes change (each result goes to ``replication`` of them, see ``db/server.py``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from onepiece import metrics_endpoint
from onepiece.db.server import DbServer
from onepiece.db.server import serve as serve_db
from onepiece.nm.client import Membership
from onepiece.transport.registry import host_of, with_host

if TYPE_CHECKING:
    from onepiece.nm.zk import ZkSettings

log = logging.getLogger(__name__)


def serve(nm_address: str, set_name: str, data: str, control: str, events: str, ttl_s: float, max_bytes: int,
          purge_after_fetch_s: float | None, replication: int = 2, advertise: str | None = None,
          zk: "ZkSettings | None" = None, deployment_id: str = "", name: str = "") -> None:
    metrics = metrics_endpoint.start(0, host_of(data))
    member: Membership | None = None

    def on_ready(server: DbServer) -> None:
        nonlocal member
        server.advertise_as(with_host(server.data_address, advertise), with_host(server.control_address, advertise))

        def on_routes(routes: dict) -> None:
            # Whole address dicts: replication ranks DBs by their control address, as readers do.
            server.set_peers(routes["dbs"])

        member = Membership(
            nm_address, "db", set_name,
            {"data": server.data_address, "control": server.control_address, "events": server.events_address,
             "metrics": f"http://{host_of(data)}:{metrics.server_port}"}, advertise=advertise,
            # The heartbeat thread must not read the store, which only the DB loop touches:
            # it sends the snapshot the loop takes every sweep.
            on_routes=on_routes, stats=lambda: server.snapshot,
            zk=zk, capacity={"max_bytes": max_bytes, "replication": replication}, deployment=deployment_id,
            name=name,
        )
        member.register()
        member.start()

    try:
        # Its metrics' `db` label: the instance's name where it has one (every DB of a set was
        # "db@SET", and a set holds several, at metrics ports that change with each restart).
        serve_db(data, control, events, ttl_s, max_bytes, purge_after_fetch_s, name=name or f"db@{set_name}",
                 on_ready=on_ready, replication=replication, set_name=set_name)
    finally:
        if member is not None:
            member.stop()
        metrics_endpoint.stop(metrics)
