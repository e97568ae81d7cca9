"""What the proxy knows about its workflow set, behind a small protocol.

The NM-fed implementation lives elsewhere; the proxy only reads these members and re-reads
them often, so the lists may change at runtime (instances come and go).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from onepiece.config import Workflow


@runtime_checkable
class Cluster(Protocol):
    workflow: Workflow
    set_name: str

    def entrances(self, app: str) -> list[str]:
        """Data addresses of the instances of ``app``'s first stage."""
        ...

    def dbs(self) -> list[dict]:
        """The set's DB instances, each ``{"data": addr, "control": addr, "events": addr}``."""
        ...

    def monitor(self) -> dict | None:
        """The NM's capacity view of the set (``{"apps": {app: {"capacity", "bottleneck",
        "stages"}}, "proxies": n}``, see nm/capacity.py), or None when there is none."""
        ...

    def delivered(self, address: str, uid: str) -> None:
        """``uid`` was handed to the entrance instance at ``address`` (told to the NM, which fails
        it if that instance dies before naming it: nm/deliveries.py)."""
        ...


@dataclass
class StaticCluster:
    """A fixed (but mutable by its owner) view, for tests and single-host setups.

    ``entrance_map`` maps an application id to its entrance addresses; ``db_list`` holds the
    DB address dicts; ``monitor_view`` is what ``monitor()`` returns (None: no capacity view,
    admission by the in-flight cap only). Tests mutate them to simulate instances coming and
    going, or the set's capacity changing (assign a new view: admission re-rates on a new
    object, as it does on each heartbeat's fresh view from the NM).
    """

    workflow: Workflow
    set_name: str = "set0"
    entrance_map: dict[str, list[str]] = field(default_factory=dict)
    db_list: list[dict] = field(default_factory=list)
    monitor_view: dict | None = None

    def entrances(self, app: str) -> list[str]:
        return list(self.entrance_map.get(app, []))

    def dbs(self) -> list[dict]:
        return [dict(d) for d in self.db_list]

    def monitor(self) -> dict | None:
        return self.monitor_view

    def delivered(self, address: str, uid: str) -> None:
        pass  # no NM to tell
