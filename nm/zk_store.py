"""The cluster state in ZooKeeper: what the primary writes and a new primary reads (layout in
nm/zk.py).

Every write is one ZooKeeper transaction that first checks the ``epoch`` node's version
against the epoch this primary claimed when it was elected. A primary that was replaced
without noticing (its session expired during a pause) therefore fails its writes with
:class:`Fenced` instead of overwriting the new primary's state. Reads happen once, on taking
over, issued together so a takeover costs about one round trip, not one per set.

All calls are bounded by ``timeout``; kazoo errors propagate (the caller decides whether to
retry or to step down).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from onepiece.nm.zk import Paths, wait

if TYPE_CHECKING:
    from kazoo.client import KazooClient

log = logging.getLogger(__name__)


class Fenced(RuntimeError):
    """Another NM claimed a newer epoch: this one is no longer primary."""


@dataclass
class Snapshot:
    """The state as the previous primary left it."""

    config: dict[str, Any] | None
    version: int
    records: list[dict[str, Any]] = field(default_factory=list)  # every set's instance records
    members: set[str] = field(default_factory=set)  # live member node names (= instance ids)
    moved: dict[str, dict[str, Any]] = field(default_factory=dict)  # per set: moves by instance name


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def _loads(data: bytes | None) -> Any:
    return orjson.loads(data) if data else None


class ZkStore:
    def __init__(self, zk: "KazooClient", paths: Paths, timeout: float = 2.0) -> None:
        self.zk, self.paths, self.timeout = zk, paths, timeout

    # ---- layout ------------------------------------------------------------------------------

    def ensure_layout(self, sets: list[str]) -> None:
        """Create the persistent nodes that writes expect (idempotent; any NM may run it)."""
        from kazoo.exceptions import NodeExistsError

        p = self.paths
        for path in (p.root, p.election, p.members, p.sets, p.routes):
            self.zk.ensure_path(path)
        empty = {p.epoch: b"", p.config: b"", p.version: b"0"}
        empty.update({p.set_state(s): b"" for s in sets})
        empty.update({p.set_routes(s): b"" for s in sets})
        for path, data in empty.items():
            try:
                wait(self.zk.create_async(path, data), self.timeout)
            except NodeExistsError:
                pass

    # ---- taking over -----------------------------------------------------------------------

    def claim(self, address: str) -> int:
        """Bump the epoch (only the election's winner calls this); returns the new epoch."""
        stat = wait(self.zk.set_async(self.paths.epoch, address.encode()), self.timeout)
        return stat.version

    def take_over(self, address: str) -> tuple[int, "Snapshot"]:
        """Claim the epoch, publish the ``primary`` node and read the state, in one round trip
        (one transaction for both writes: each write costs a quorum commit). Overlapping the
        reads is safe: the election's winner holds the lock only once the previous primary's
        session (and so every write it sent) is over, and ZooKeeper applies one session's
        requests in order. A ``primary`` node left by someone else falls back to separate steps."""
        from kazoo.exceptions import NodeExistsError, RolledBackError

        tx = self.zk.transaction()
        tx.set_data(self.paths.epoch, address.encode())
        tx.create(self.paths.primary, _dumps({"address": address}), ephemeral=True)
        committed = tx.commit_async()
        snap = self.load()
        results = wait(committed, self.timeout)
        if any(isinstance(r, (NodeExistsError, RolledBackError)) for r in results):
            epoch = self.claim(address)
            self.publish_primary(address, epoch)
            return epoch, snap
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise errors[0]
        return results[0].version, snap

    def load(self) -> Snapshot:
        """Config, version, every set's records and the live members, read in one go."""
        p = self.paths
        config_r = self.zk.get_async(p.config)
        version_r = self.zk.get_async(p.version)
        sets_r = self.zk.get_children_async(p.sets)
        members_r = self.zk.get_children_async(p.members)
        names = wait(sets_r, self.timeout)
        set_rs = [self.zk.get_async(p.set_state(n)) for n in names]
        config = _loads(wait(config_r, self.timeout)[0])
        version = _loads(wait(version_r, self.timeout)[0]) or 0
        records: list[dict[str, Any]] = []
        moved: dict[str, dict[str, Any]] = {}
        for name, r in zip(names, set_rs):
            doc = _loads(wait(r, self.timeout)[0]) or {}
            records += doc.get("instances", [])
            moved[name] = doc.get("moved", {})
        return Snapshot(config, int(version), records, set(wait(members_r, self.timeout)), moved)

    def members(self) -> set[str]:
        return set(wait(self.zk.get_children_async(self.paths.members), self.timeout))

    def member_exists(self, instance_id: str, fresh: bool = False) -> bool:
        """Whether the member node is there. ``fresh``: if this NM's server does not show it,
        sync with the leader and look again, since the instance may have created it through
        another server of the ensemble that this one lags behind."""
        path = self.paths.member(instance_id)
        if wait(self.zk.exists_async(path), self.timeout) is not None:
            return True
        if not fresh:
            return False
        wait(self.zk.sync_async(path), self.timeout)
        return wait(self.zk.exists_async(path), self.timeout) is not None

    # ---- writes (fenced) -----------------------------------------------------------------------

    def _commit(self, epoch: int, ops: list[tuple[str, bytes]]) -> None:
        from kazoo.exceptions import BadVersionError, RolledBackError

        tx = self.zk.transaction()
        tx.check(self.paths.epoch, epoch)
        for path, data in ops:
            tx.set_data(path, data)
        results = wait(tx.commit_async(), self.timeout)
        if isinstance(results[0], BadVersionError):
            raise Fenced(f"epoch {epoch} is over: another node manager took over")
        errors = [r for r in results if isinstance(r, Exception) and not isinstance(r, RolledBackError)]
        if errors:
            raise errors[0]

    def save(self, epoch: int, version: int, sets: dict[str, tuple[dict[str, Any], dict[str, Any]]]) -> None:
        """Write the given sets' state (ClusterState.export) and route tables, and the version,
        atomically."""
        ops = [(self.paths.version, _dumps(version))]
        for name, (state, routes) in sets.items():
            ops.append((self.paths.set_state(name), _dumps(state)))
            ops.append((self.paths.set_routes(name), _dumps(routes)))
        self._commit(epoch, ops)

    def save_config(self, epoch: int, config: dict[str, Any]) -> None:
        self._commit(epoch, [(self.paths.config, _dumps(config))])

    # ---- where the primary is --------------------------------------------------------------------

    def publish_primary(self, address: str, epoch: int) -> None:
        """The ephemeral ``primary`` node, replacing one a previous primary's session left."""
        from kazoo.exceptions import NodeExistsError, NoNodeError

        data = _dumps({"address": address, "epoch": epoch})
        for _ in range(3):  # bounded: each round removes one stale node
            try:
                wait(self.zk.create_async(self.paths.primary, data, ephemeral=True), self.timeout)
                return
            except NodeExistsError:
                try:
                    _, stat = wait(self.zk.get_async(self.paths.primary), self.timeout)
                    if stat.ephemeralOwner == self.zk.client_id[0]:
                        wait(self.zk.set_async(self.paths.primary, data), self.timeout)
                        return
                    wait(self.zk.delete_async(self.paths.primary, stat.version), self.timeout)
                except NoNodeError:
                    pass
        raise RuntimeError("could not publish the primary node")

    def withdraw_primary(self) -> None:
        """Delete the ``primary`` node if this session made it (never a successor's)."""
        from kazoo.exceptions import BadVersionError, NoNodeError

        try:
            _, stat = wait(self.zk.get_async(self.paths.primary), self.timeout)
            if stat.ephemeralOwner == self.zk.client_id[0]:
                wait(self.zk.delete_async(self.paths.primary, stat.version), self.timeout)
        except (NoNodeError, BadVersionError):
            pass


def read_primary(data: bytes | None) -> str | None:
    """The address in a ``primary`` node's data (None when absent or unreadable)."""
    try:
        value = _loads(data)
    except orjson.JSONDecodeError:
        return None
    return value.get("address") if isinstance(value, dict) else None


def read_routes(data: bytes | None) -> dict[str, Any] | None:
    """A ``state/routes/<set>`` node's route table (None when not written yet)."""
    try:
        value = _loads(data)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) and isinstance(value.get("version"), int) else None
