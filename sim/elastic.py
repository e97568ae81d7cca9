"""The NM's elastic assignment inside the simulation (DESIGN §9, §12).

Not a copy of it: the NM's own ``ClusterState`` and ``Elastic`` (its ``decide()``, and its
shell's utilization windows, one move at a time, cooldown and settling) run on the virtual
clock, fed every heartbeat with each simulated instance's counters. A move is carried out as the
instance's protocol does it (stage/instance.py): out of its old stage's routes at once; it
finishes what it holds and waits at least two heartbeats (so every sender has the new routes);
its workers exit and load the new stage's models (``move_s``); then it is routed to. An instance
keeps the devices it started with (its first stage's workers x GPUs), so the policy moves it only
to a stage that needs no more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onepiece.config import Topology
from onepiece.nm.elastic import Elastic, Move
from onepiece.nm.state import ClusterState
from onepiece.sched.virtual import VirtualInstance

if TYPE_CHECKING:
    from onepiece.sim.engine import Simulation


@dataclass
class Member:
    """One stage instance as the NM knows it, across its moves."""

    id: str
    set: str
    vi: VirtualInstance | None  # its workers now (None: in the idle pool, or loading)
    serving: str | None  # the stage it says it serves
    born: float = 0.0  # when its workers started: its counters' zero
    draining: tuple[float, str | None] | None = None  # (since, destination) while it drains


class SimElastic:
    def __init__(self, sim: "Simulation", topology: Topology, move_s: float, gpus: dict[str, int]) -> None:
        self.sim, self.move_s = sim, move_s
        self.state = ClusterState(topology, sim.wf, incarnation="sim")  # no clock: a replay gives the same ids
        self.policy = Elastic(topology.nm.elastic, {s: spec.workers * gpus.get(s, 1) for s, spec in sim.wf.stages.items()})
        self.members: dict[str, Member] = {}
        self.moves: list[dict[str, Any]] = []  # what `onepiece sim` reports
        for set_name, by_stage in sim.instances.items():
            for stage, vis in by_stage.items():
                for vi in vis:
                    inst = self.state.register("stage", set_name, {"data": f"sim://{vi.name}"}, stage=stage,
                                               name=vi.name)
                    self.members[inst.id] = Member(inst.id, set_name, vi, stage)
        for s in topology.sets:
            for k in range(s.idle if s.name in sim.instances else 0):
                inst = self.state.register("stage", s.name, {"data": f"sim://{s.name}-idle{k}"}, idle=True,
                                           name=f"{s.name}-idle{k}")
                self.members[inst.id] = Member(inst.id, s.name, None, None)

    def heartbeat(self, now: float) -> None:
        """Every member reports its counters; the NM's policy turns; moves under way go on."""
        for m in self.members.values():
            stats: dict[str, Any] = {}
            if m.vi is not None:
                c = m.vi.core.stats
                stats = {"busy_s": m.vi.busy_s, "slot_s": len(m.vi.core.workers) * (now - m.born),
                         "left": c.left, "late": c.late}
            inst = self.state.heartbeat(m.id, ready=m.vi is not None and m.draining is None, stats=stats,
                                        serving=m.serving, now=now)
            self.policy.observe(inst, now)
        for move in self.policy.tick(self.state, now):
            self._start(move, now)
        for m in self.members.values():
            if m.draining is not None:
                self._drain(m, now)

    def _start(self, move: Move, now: float) -> None:
        m = self.members[move.instance]
        self.moves.append({"at": now, "instance": m.id, "from": move.src, "to": move.dst, "reason": move.reason})
        if m.vi is None:  # from the idle pool: nothing to drain
            self.sim.loop.at(now + self.move_s, self._loaded, m, move.dst)
            return
        self.sim.instances[m.set][m.serving].remove(m.vi)  # out of the old stage's routes at once
        m.draining = (now, move.dst)

    def _drain(self, m: Member, now: float) -> None:
        since, dst = m.draining
        if now - since < 2 * self.sim.heartbeat_s or m.vi.core.requests:
            return  # it still holds requests, or a sender may still have the old routes
        self.sim.retire(m.vi)
        m.vi, m.serving, m.draining = None, None, None
        self.sim.loop.at(now + self.move_s, self._loaded, m, dst)

    def _loaded(self, m: Member, dst: str | None) -> None:
        if dst is None:
            return  # in the idle pool
        if self.state.instances[m.id].stage != dst:
            return  # the NM has moved it elsewhere meanwhile
        m.vi, m.serving, m.born = self.sim.new_instance(m.set, dst), dst, self.sim.loop.now
        self.sim.route(m.set, dst, m.vi)
        last = next(mv for mv in reversed(self.moves) if mv["instance"] == m.id)
        last["serving_at"] = self.sim.loop.now
