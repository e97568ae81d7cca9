"""An instance's member node: ``members/<role>-<seq>``, EPHEMERAL_SEQUENTIAL, holding its role,
set, addresses, pid, host, stage and capacity (layout in nm/zk.py).

The node lives exactly as long as the instance's ZooKeeper session: a crashed instance's node
disappears by itself after the session timeout, and the primary drops it from the routes. The
node's name is the instance id. A session that expired (the process was paused, or cut off)
cannot get its node back: the instance makes a new one, under a new id, and registers again.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import orjson

from onepiece.nm.zk import Paths, wait

if TYPE_CHECKING:
    from kazoo.client import KazooClient

log = logging.getLogger(__name__)


class EphemeralMember:
    def __init__(self, zk: "KazooClient", paths: Paths, role: str, timeout: float = 2.0) -> None:
        self.zk, self.paths, self.role, self.timeout = zk, paths, role, timeout
        self.id: str | None = None
        self.data: dict[str, Any] = {}

    def create(self, data: dict[str, Any]) -> str:
        """A new node with ``data``; returns its id."""
        self.data = dict(data)
        path = wait(self.zk.create_async(f"{self.paths.members}/{self.role}-", orjson.dumps(self.data),
                                         ephemeral=True, sequence=True), self.timeout)
        self.id = path.rsplit("/", 1)[1]
        log.info("member node %s created", path)
        return self.id

    def exists(self) -> bool:
        return self.id is not None and wait(self.zk.exists_async(self.paths.member(self.id)), self.timeout) is not None

    def update(self, **fields: Any) -> None:
        """Rewrite the node's data with ``fields`` changed (e.g. its capacity once assigned)."""
        self.data.update(fields)
        if self.id is not None:
            wait(self.zk.set_async(self.paths.member(self.id), orjson.dumps(self.data)), self.timeout)

    def delete(self) -> None:
        from kazoo.exceptions import NoNodeError

        if self.id is None:
            return
        try:
            wait(self.zk.delete_async(self.paths.member(self.id)), self.timeout)
        except NoNodeError:
            pass
