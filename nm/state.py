"""The node manager's picture of the cluster (DESIGN §9), held in memory.

Per workflow set: the instances with their roles and addresses, which stage each stage
instance serves, and the route table derived from them. Only live, ready instances are routed
to; an instance silent for longer than ``dead_after_s`` is dropped and the routes change
(embedded NM, nm/liveness.py), or one whose ZooKeeper member node vanished (NM on ZooKeeper). A stage instance
is routed only while it reports that it serves the stage it is assigned: moving it to another
stage (``assign``, nm/elastic.py) takes it out of the old stage's routes at once, and it joins
the new stage's once it has loaded that stage's models.

What a new primary needs to route exactly as the old one did is each instance's ``record()``
(identity, addresses, assignment, readiness) and ``version``; the sets whose records changed
are collected in ``dirty`` until the NM on ZooKeeper has written them (nm/zk_store.py). Stats,
the requests an instance last said it holds, and its last-seen time are soft: they come back
with the next heartbeat.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from onepiece.config import Topology, Workflow
from onepiece.nm.capacity import estimate
from onepiece.nm.identity import NAME_HELD

log = logging.getLogger(__name__)

# Names whose moves a set remembers; past it the oldest move is forgotten (names are an
# operator's choice, so a stream of fresh ones must not grow the state without bound).
MAX_MOVED_NAMES = 1024

# The addresses each role must register: what the route tables hand out for it.
ROLES = {"stage": ("data",), "db": ("data", "control", "events"), "proxy": ("http",)}
LEFT = "left"  # the reason an instance that said goodbye is dropped for (not a failure)


@dataclass
class Instance:
    id: str
    role: str
    set: str
    addresses: dict[str, str]
    pid: int = 0
    host: str = ""
    stage: str | None = None
    ready: bool = False
    routes_version: int = 0  # the route table version the instance last said it holds
    stats: dict[str, Any] = field(default_factory=dict)
    registered_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    # UIDs the instance held at its last heartbeat: what to report failed if it dies.
    holding: list[str] = field(default_factory=list)
    heard: bool = False  # heartbeated to this NM (a new primary has no stats until then)
    serving: str | None = None  # the stage the instance last said it serves (stage role)
    name: str = ""  # the name it was launched under (`--name`), which outlives its process
    process: str = ""  # the token its process drew at start (nm/identity.py): which process holds the id
    # What it proves itself with when it leaves (handed out with its registration, never shown).
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))

    PERSISTENT = ("id", "role", "set", "addresses", "pid", "host", "stage", "ready", "registered_at", "name",
                  "process", "token")

    def view(self, now: float) -> dict[str, Any]:
        return {
            "id": self.id, "role": self.role, "set": self.set, "stage": self.stage, "ready": self.ready,
            "serving": self.serving, "name": self.name,
            "addresses": self.addresses, "pid": self.pid, "host": self.host, "stats": self.stats,
            "routes_version": self.routes_version, "holding": len(self.holding),
            "age_s": round(time.time() - self.registered_at, 1), "silent_s": round(now - self.last_seen, 2),
        }

    def record(self) -> dict[str, Any]:
        """The fields a new primary needs (JSON-able)."""
        return {k: getattr(self, k) for k in self.PERSISTENT}

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> "Instance":
        return cls(**{k: rec[k] for k in cls.PERSISTENT if k in rec})


def fresh_version() -> int:
    """A first route version for a starting NM: milliseconds since the epoch, so that a
    restarted NM starts above every version its predecessor handed out. Counting from 1 again,
    its table could reach a version a member already held with other content, and the member
    (its heartbeat naming that version) would never be sent the new table."""
    return time.time_ns() // 1_000_000


class ClusterState:
    def __init__(self, topology: Topology, workflow: Workflow, first_version: int = 1,
                 incarnation: str | None = None) -> None:
        self.topology, self.workflow = topology, workflow
        self.sets = {s.name: s for s in topology.sets}
        self.instances: dict[str, Instance] = {}
        self.version = first_version  # bumped whenever any route table changes
        self._ids = itertools.count(1)
        # A member without a name (nm/identity.py) gets an id with this NM's incarnation: a
        # restarted NM never hands out an id that an instance of the one before still holds
        # (it would heartbeat as another instance and take over its assignment); such an
        # instance is unknown here and registers again. The start time in milliseconds differs
        # between incarnations where a random tag would collide now and then; the random byte
        # tells apart NMs started in the same ms.
        # (A simulation names its own, so that a replay gives the same ids.)
        self._incarnation = incarnation or f"{time.time_ns() // 1_000_000:x}{secrets.token_hex(1)}"
        self.events: list[str] = []  # recent decisions, shown by `onepiece status`
        # (set, role, stage) -> instances dropped since this NM became primary, other than by
        # leaving: the events scroll away, an operator's alert needs a counter (nm/server.py)
        self.drops: dict[tuple[str, str, str], int] = {}
        self.dirty: set[str] = set()  # sets whose instance records changed since last saved
        # Per set, named stage instances that were moved: name -> the stage (None: idle pool) they
        # were moved to. A restarted process of that name registers there, not at its pin.
        self.moved: dict[str, dict[str, str | None]] = {}

    def _changed(self, set_name: str) -> None:
        self.version += 1
        self.dirty.add(set_name)

    def restore(self, records: list[dict[str, Any]], version: int,
                moved: dict[str, dict[str, str | None]] | None = None) -> None:
        """Replace the instances (and the moves by name) with saved ones (a new primary taking over)."""
        self.instances = {}
        for rec in records:
            inst = Instance.from_record(rec)
            if inst.set in self.sets:
                self.instances[inst.id] = inst
        self.moved = {s: dict(m) for s, m in (moved or {}).items() if s in self.sets}
        self.version = max(self.version, version)
        self.dirty.clear()

    def export(self, set_name: str) -> dict[str, Any]:
        """A set's saved state: its instance records and its moves by name."""
        return {"instances": [i.record() for i in sorted(self.instances.values(), key=lambda i: i.id)
                              if i.set == set_name],
                "moved": dict(self.moved.get(set_name, {}))}

    def note(self, text: str) -> None:
        """An event for the log and `onepiece status`."""
        log.info(text)
        self.events = (self.events + [f"{time.strftime('%H:%M:%S')} {text}"])[-50:]

    def register(self, role: str, set_name: str, addresses: dict[str, str], pid: int = 0, host: str = "",
                 stage: str | None = None, inst_id: str | None = None, idle: bool = False,
                 name: str = "", serving: str | None = None, process: str = "") -> Instance:
        """A new instance, with the stage it serves (where an instance of its ``name`` was last
        moved, else its pin, else the idle pool if it asks for it, else the set's biggest deficit,
        else the idle pool). ``inst_id``: its id (its name, or its ZooKeeper member node; none:
        one is made up); the same process registering again under it (a retried request, or
        one the NM forgot) keeps its assignment, and another process may not (the NM drops the
        holder first, nm/identity.py). ``serving``: the stage it serves already (it registers
        again, to a restarted NM): routed at once if that is the stage it is given."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} (expected one of {sorted(ROLES)})")
        missing = [k for k in ROLES[role] if not addresses.get(k)]
        if missing:
            raise ValueError(f"a {role} must register its {', '.join(missing)} address")
        if set_name not in self.sets:
            raise ValueError(f"unknown set {set_name!r} (known: {sorted(self.sets)})")
        if role == "stage":
            if stage is not None and stage not in self.workflow.stages:
                raise ValueError(f"unknown stage {stage!r} (known: {sorted(self.workflow.stages)})")
        old = self.instances.get(inst_id) if inst_id else None
        if old is not None:
            if (old.role, old.set) != (role, set_name):
                raise ValueError(f"instance {inst_id} is already a {old.role} of set {old.set}")
            if old.process != process:
                raise ValueError(f"instance {inst_id} {NAME_HELD} (pid {old.pid} on {old.host or '?'})")
            if (old.addresses, old.pid, old.host) != (addresses, pid, host):
                old.addresses, old.pid, old.host = addresses, pid, host
                self._changed(set_name)
            return old
        moved = role == "stage" and name in self.moved.get(set_name, {})
        if moved:  # a restarted process of a moved instance: back where it was moved
            stage = self.moved[set_name][name]
            idle = stage is None
        if role == "stage" and not idle:
            stage = stage or self._stage_with_deficit(set_name)
        inst = Instance(inst_id or f"{role}-{self._incarnation}-{next(self._ids)}", role, set_name, addresses, pid,
                        host, stage, name=name, process=process)
        # DBs and proxies serve as soon as they registered; stages once their workers loaded
        # (which one that registers again has done already).
        inst.ready = role != "stage" or (serving is not None and serving == stage)
        inst.serving = serving if role == "stage" else None
        inst.heard = True
        self.instances[inst.id] = inst
        self._changed(set_name)
        self.note(f"registered {inst.id} ({role}{' ' + stage if stage else ''}{' ' + repr(name) if name else ''}) "
                    f"in {set_name} at {addresses}" + (", where it was moved before it restarted" if moved else ""))
        return inst

    def _stage_with_deficit(self, set_name: str) -> str | None:
        """The stage furthest below its desired instance count; None sends it to the idle pool."""
        want = self.sets[set_name].stages
        have = {s: 0 for s in want}
        for i in self.instances.values():
            if i.role == "stage" and i.set == set_name and i.stage in have:
                have[i.stage] += 1
        short = [(have[s] - n, s) for s, n in want.items() if have[s] < n]
        return min(short)[1] if short else None

    def stage_instances(self, set_name: str) -> list[Instance]:
        return [i for i in self.instances.values() if i.set == set_name and i.role == "stage"]

    def movable(self, inst_id: str, stage: str | None) -> Instance:
        """The stage instance ``inst_id``, if it can be assigned to ``stage``; else ValueError."""
        inst = self.instances.get(inst_id)
        if inst is None or inst.role != "stage":
            raise ValueError(f"no stage instance {inst_id!r}")
        if stage is not None and stage not in self.workflow.stages:
            raise ValueError(f"unknown stage {stage!r} (known: {sorted(self.workflow.stages)})")
        if stage == inst.stage:
            raise ValueError(f"{inst_id} is already assigned to {stage or 'the idle pool'}")
        return inst

    def assign(self, inst_id: str, stage: str | None, reason: str) -> Instance:
        """Move a stage instance to ``stage`` (None: the idle pool). It leaves its old stage's
        routes now and joins the new one's when it reports that it serves it."""
        inst = self.movable(inst_id, stage)
        old, inst.stage, inst.ready = inst.stage, stage, False
        if inst.name:
            moved = self.moved.setdefault(inst.set, {})
            moved.pop(inst.name, None)  # re-inserted last: the dict's order is the age of the move
            moved[inst.name] = stage
            while len(moved) > MAX_MOVED_NAMES:
                moved.pop(next(iter(moved)))
        self._changed(inst.set)
        self.note(f"moving {inst_id} from {old or 'the idle pool'} to {stage or 'the idle pool'}: {reason}")
        return inst

    def heartbeat(self, inst_id: str, ready: bool, stats: dict[str, Any], routes_version: int = 0,
                  holding: list[str] | None = None, serving: str | None = None, now: float | None = None,
                  process: str = "") -> Instance:
        """A sign of life from ``inst_id``'s process (``process``: its token; another process's
        heartbeat under the id, or one without a token for an instance that registered with one,
        is refused as unknown, so that it registers again)."""
        inst = self.instances.get(inst_id)
        if inst is None:
            raise LookupError(f"unknown instance {inst_id}")
        # Without a token, anyone who reaches the NM could speak for any member (say it is not
        # ready, and so take it out of the routes) although only its token may deregister it.
        if inst.process and process != inst.process:
            raise LookupError(f"unknown instance {inst_id} for this process: its name was taken over by "
                              f"pid {inst.pid} on {inst.host or '?'}")
        if inst.role == "stage":
            inst.serving = serving
            ready = ready and serving is not None and serving == inst.stage
        inst.last_seen = time.monotonic() if now is None else now  # a simulator passes its clock
        inst.stats = stats
        inst.routes_version = routes_version
        inst.holding = holding or []
        inst.heard = True
        if ready != inst.ready:
            inst.ready = ready
            self._changed(inst.set)
            self.note(f"{inst.id} is {'ready' if ready else 'not ready'}")
        return inst

    def republish(self, reason: str) -> None:
        """A new version of every set's routes, so that every member fetches them."""
        for name in self.sets:
            self._changed(name)
        self.note(f"routes republished: {reason}")

    def deregister(self, inst_id: str, reason: str) -> Instance | None:
        """Drop an instance from the routes; the dropped instance (None if unknown)."""
        inst = self.instances.pop(inst_id, None)
        if inst is not None:
            if reason != LEFT:
                key = (inst.set, inst.role, inst.stage or "")
                self.drops[key] = self.drops.get(key, 0) + 1
            self._changed(inst.set)
            self.note(f"dropped {inst.id} ({inst.role}{' ' + inst.stage if inst.stage else ''}): {reason}")
        return inst

    def routes(self, set_name: str) -> dict[str, Any]:
        """Where each stage's data goes in a set: the live, ready instances per stage, the DBs
        and the proxies. Senders pick among them (round-robin)."""
        live = sorted((i for i in self.instances.values() if i.set == set_name and i.ready), key=lambda i: i.id)
        stages: dict[str, list[str]] = {s: [] for s in self.workflow.stages}
        for i in live:
            if i.role == "stage" and i.stage:
                stages[i.stage].append(i.addresses["data"])
        return {
            "version": self.version,
            "set": set_name,
            "stages": stages,
            "dbs": [i.addresses for i in live if i.role == "db"],
            "proxies": [i.addresses["http"] for i in live if i.role == "proxy"],
        }

    def monitor(self, set_name: str) -> dict[str, Any]:
        """What a proxy's request monitor needs: the set's capacity per application (from the
        stages' measured service times) and how many proxies share it."""
        now = time.monotonic()
        members = [i.view(now) for i in self.instances.values() if i.set == set_name]
        return {"apps": estimate(self.workflow, members),
                "proxies": sum(1 for i in members if i["role"] == "proxy" and i["ready"]),
                "serves": self.sets[set_name].serves(self.workflow)}

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        out = {}
        for name, spec in self.sets.items():
            members = [i for i in self.instances.values() if i.set == name]
            out[name] = {
                "stages": {
                    s: {"want": spec.stages.get(s, 0),
                        "instances": [i.view(now) for i in members if i.role == "stage" and i.stage == s]}
                    for s in self.workflow.stages
                },
                "idle": [i.view(now) for i in members if i.role == "stage" and i.stage is None],
                "dbs": [i.view(now) for i in members if i.role == "db"],
                "proxies": [i.view(now) for i in members if i.role == "proxy"],
                "want": {"dbs": spec.db.count, "proxies": spec.proxy.count},  # what the topology starts
                "capacity": self.monitor(name)["apps"],
            }
        return {"sets": out, "version": self.version, "events": self.events[-20:]}
