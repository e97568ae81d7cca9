"""How instances and clients talk to the node manager.

``Membership`` registers an instance and keeps it alive with heartbeats from a background
thread, handing every new route table to a callback. The data path never waits on the NM:
if the NM is unreachable the instance keeps its last routes and keeps trying.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from onepiece.config import Workflow

from onepiece.transport.registry import with_host
from onepiece.transport.rpc import RpcClient, RpcError, RpcTimeout

log = logging.getLogger(__name__)


class NmClient(RpcClient):
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

        deadline = time.monotonic() + timeout
        while True:
            try:
                return Workflow.model_validate(self.call("workflow")[0]["workflow"])
            except RpcTimeout:
                if time.monotonic() > deadline:
                    raise


class Membership:
    def __init__(
        self,
        nm_address: str,
        role: str,
        set_name: str,
        addresses: dict[str, str],
        stage: str | None = None,
        on_routes: Callable[[dict], None] = lambda routes: None,
        stats: Callable[[], dict] = dict,
        ready: Callable[[], bool] = lambda: True,
        advertise: str | None = None,
    ) -> None:
        self.nm = NmClient(nm_address, timeout=1.0, retries=0)
        self.role, self.set, self.addresses, self.stage = role, set_name, addresses, stage
        self.on_routes, self.stats, self.ready = on_routes, stats, ready
        self.advertise = advertise  # the host peers reach this instance at, if not the bound one
        self.id: str | None = None
        self.routes: dict[str, Any] = {"version": 0, "stages": {}, "dbs": [], "proxies": []}
        self.monitor: dict[str, Any] | None = None  # proxies: the set's capacity view
        self.heartbeat_s = 1.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self, timeout: float = 30.0) -> dict[str, Any]:
        """Register, retrying until the NM answers or ``timeout`` passes; the reply carries the
        workflow, this instance's stage and the set's routes."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                addresses = {k: with_host(v, self.advertise) for k, v in self.addresses.items()}
                reply, _ = self.nm.call(
                    "register", role=self.role, set=self.set, addresses=addresses, pid=os.getpid(),
                    host=socket.gethostname(), stage=self.stage,
                )
                break
            except RpcTimeout:  # the NM is not up yet; a refusal (RpcError) is final
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.id, self.stage = reply["instance"], reply.get("stage")
        self.heartbeat_s = float(reply.get("heartbeat_s", 1.0))
        self._apply(reply["routes"])
        return reply

    def _apply(self, routes: dict) -> None:
        self.routes = routes  # swapped whole: readers in other threads see old or new, never half
        self.on_routes(routes)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"membership-{self.id}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                stats = self.stats()
            except Exception as e:  # stats are advisory; the heartbeat itself must go on
                log.debug("stats unavailable: %s", e)
                stats = {}
            try:
                reply, _ = self.nm.call("heartbeat", instance=self.id, ready=self.ready(), stats=stats,
                                        version=self.routes["version"])
                if "routes" in reply:
                    self._apply(reply["routes"])
                if "monitor" in reply:
                    self.monitor = reply["monitor"]
            except Exception as e:  # the heartbeat goes on whatever one round hit
                if not isinstance(e, RpcError):
                    log.exception("heartbeat round failed")
                    continue
                if "unknown instance" in str(e):
                    # The NM dropped us (silent too long, or it restarted): join again.
                    log.warning("node manager forgot %s; registering again", self.id)
                    try:
                        self.register(timeout=self.heartbeat_s)
                    except Exception as e2:
                        log.warning("re-registration failed: %s", e2)
                else:
                    log.warning("heartbeat to node manager failed: %s", e)

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.heartbeat_s + 1)
        if self.id is not None:
            try:
                self.nm.call("deregister", instance=self.id, timeout=0.5)
            except RpcError:
                pass  # the NM drops us after the heartbeat timeout anyway
        self.nm.close()
