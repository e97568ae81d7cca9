"""Elastic assignment (DESIGN §9; the paper's section 8): move instances to the busiest stage.

``decide`` is the policy, a pure function of per-stage utilization and SLO risk over a window:

- a stage with fewer instances than its minimum (its last one died and the NM dropped it, or
  was moved away) gets one from the idle pool at once, before any window, even during a
  cooldown; so does a stage of minimum 0 that had an instance and lost it (at 0 it fails every
  request of its application, and a stage with no instance reports no queue to judge by);
- the busiest saturated stage gets an instance from the idle pool, or else, if it is busy at or
  above ``threshold``, from the least busy stage that has more than its minimum, would stay
  below the threshold without it (so the move cannot simply shift the saturation) and is not
  late itself. Saturated: busy at or above ``threshold``, or late: more than ``late`` of the
  requests that left it over the window left past the deadline they could have made there
  (sched/core.py counts them). At a tight SLO a stage must run well below any busy threshold
  or its tail misses, so waiting for ``threshold`` moves only after the misses; the late share
  sees them as they begin. But a late stage may be paying for the slack its requests lost
  upstream, so lateness alone takes only from the idle pool (taking from a donor moved a
  denoiser to the VAE decoder, and the denoisers left fell late in turn: bench moves);
- with no stage saturated, the least busy stage below ``low`` over ``cold_windows`` windows
  that has more than its minimum and none of its requests late gives one instance back to the
  idle pool. Over one window of a few long requests a Poisson lull looks cold: returning on it
  sent a denoiser back and forth between its stage and the pool 31 times in 3,000 requests,
  each return a move's load time of one instance fewer (bench moves).

Only instances serving their stage now (ready, heard within three heartbeats) count: a dead one
not yet dropped, or a replacement still loading, never lets a healthy one leave, and the last
one serving a stage never leaves. An instance keeps the devices it started with, so it moves
only to a stage that needs no more than it holds (a 1-GPU text encoder never becomes a 2-GPU
denoiser); in a deployment every instance holds and needs one device (its workers share it), in
the planner's simulation a stage needs its workers x GPUs.

``Elastic`` runs it on the primary NM: it keeps the utilization windows (nm/utilization.py),
applies at most one move per set at a time, waits ``cooldown_s`` after each, and waits for a
moved instance to have served a whole window at its new stage before judging that stage
again. Every decision is logged with its inputs and kept for ``onepiece status``. The move
itself is the instance's protocol (stage/instance.py): the NM only changes the assignment,
which takes the instance out of its old stage's routes at once (nm/state.py routes an instance
only while it reports that it serves the stage assigned) and into the new stage's routes once
it reports that it serves it.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onepiece.config import ElasticSpec
from onepiece.nm.utilization import Utilization

if TYPE_CHECKING:
    from onepiece.nm.state import ClusterState, Instance

log = logging.getLogger(__name__)

MOVE_GRACE_S = 60.0  # beyond drain_s + a window, on top: loading models may take this long
TURN_S = 0.25  # the NM's loop turns after every RPC; the policy needs looking at only this often


@dataclass
class StageLoad:
    stage: str
    assigned: list[str]  # instances assigned to the stage (serving it or on their way)
    util: float | None  # mean over the instances whose window is known; None if none is
    min: int
    # Of those, the ones serving it now (ready, heartbeating): the only ones that count when a
    # move is judged, and the only donors (default: all assigned).
    live: list[str] | None = None
    had_min: bool = True  # it has had its floor since this NM started: it can fall below it
    needs: int = 1  # devices one instance of it holds
    late: float | None = None  # the share of its requests that left late over the window (None: none left)
    cold: float | None = None  # its utilization over cold_windows windows (None: not covered yet)

    def __post_init__(self) -> None:
        if self.live is None:
            self.live = list(self.assigned)

    def without_one(self) -> float:
        """The utilization the rest would see if one instance left (the same work, fewer workers)."""
        n = len(self.live)
        return float("inf") if n <= 1 or self.util is None else self.util * n / (n - 1)

    def can_spare(self) -> bool:
        """One of its live instances may leave: more than its minimum stay, never the last one."""
        return len(self.live) > self.floor

    @property
    def floor(self) -> int:
        """Its minimum, and never below one once it has had one."""
        return max(self.min, 1)

    def below_floor(self) -> bool:
        """Fewer instances than its floor, counting every one the NM still holds (serving,
        loading, or silent but not dropped yet): a late heartbeat under load is no reason to
        move an instance in, the NM dropping a dead one is."""
        return self.had_min and len(self.assigned) < self.floor


@dataclass
class Move:
    instance: str
    src: str | None  # None: the idle pool
    dst: str | None
    reason: str


def decide(spec: ElasticSpec, loads: dict[str, StageLoad], idle: list[str],
           inst_util: dict[str, float | None], floors_only: bool = False,
           holds: dict[str, int] | None = None) -> Move | None:
    """At most one move for a set, or None. A stage below its minimum is refilled from the idle
    pool first, with no utilization window needed (``floors_only``: that rule alone, which holds
    even during a cooldown or while another move settles). ``holds``: the devices each instance
    holds (default 1); an instance moves only to a stage that needs no more."""
    def fitting(ids: list[str], dst: StageLoad) -> list[str]:
        return sorted(i for i in ids if (holds or {}).get(i, 1) >= dst.needs)

    short = [l for l in loads.values() if l.below_floor() and fitting(idle, l)]
    if short:
        dst = min(short, key=lambda l: (len(l.assigned), l.stage))
        short_of = (f"has {len(dst.assigned)} instance(s), below its minimum {dst.min}" if dst.min
                    else "lost its last instance (min 0)")
        return Move(fitting(idle, dst)[0], None, dst.stage, f"{dst.stage} {short_of}; from the idle pool")
    if floors_only:
        return None
    known = [l for l in loads.values() if l.util is not None]

    def late(l: StageLoad) -> bool:
        return l.late is not None and l.late > spec.late

    hot = [l for l in known if l.util >= spec.threshold or late(l)]

    def least_busy(ids: list[str]) -> str:
        return min(ids, key=lambda i: (inst_util.get(i) if inst_util.get(i) is not None else 2.0, i))

    if hot:
        dst = max(hot, key=lambda l: l.util)
        why = (f"{dst.stage} {dst.late:.0%} of its requests late > {spec.late:.0%}, busy {dst.util:.0%}" if late(dst)
               else f"{dst.stage} busy {dst.util:.0%} >= {spec.threshold:.0%}") + f" with {len(dst.assigned)} instance(s)"
        if fitting(idle, dst):
            return Move(fitting(idle, dst)[0], None, dst.stage, f"{why}; from the idle pool")
        if dst.util < spec.threshold:
            return None  # lateness alone takes from the idle pool only: a donor's own requests would pay
        donors = [l for l in known if l is not dst and l.can_spare() and l.without_one() < spec.threshold
                  and not late(l) and fitting(l.live, dst)]
        if not donors:
            return None
        src = min(donors, key=lambda l: l.util)
        return Move(least_busy(fitting(src.live, dst)), src.stage, dst.stage,
                    f"{why}; {src.stage} busy {src.util:.0%} with {len(src.live)} (min {src.min}) can spare one")
    cold = [l for l in known if l.cold is not None and l.cold < spec.low and not l.late and l.can_spare()
            and l.without_one() < spec.threshold]
    if cold:
        src = min(cold, key=lambda l: l.cold)
        return Move(least_busy(src.live), src.stage, None,
                    f"{src.stage} busy {src.cold:.0%} < {spec.low:.0%} over {spec.cold_windows * spec.window_s:g}s "
                    f"with {len(src.live)} instance(s) (min {src.min}); one returns to the idle pool")
    return None


def _fresh_s(state: "ClusterState") -> float:
    """How long an instance may be silent and still count as there: three heartbeats (a busy
    process's heartbeat comes late under CPU contention), or half the NM's dead limit."""
    nm = state.topology.nm
    return max(3.0 * nm.heartbeat_s, nm.dead_after_s / 2)


class Elastic:
    def __init__(self, spec: ElasticSpec, needs: dict[str, int] | None = None) -> None:
        """``needs``: devices one instance of a stage holds (default 1 each)."""
        self.spec, self.needs = spec, needs or {}
        self.holds: dict[str, int] = {}  # instance -> devices, from the stage it was first seen at
        self.util = Utilization(spec.window_s)
        self.late = Utilization(spec.window_s, "late", "left")  # the share of requests that left late
        self.cold = Utilization(spec.window_s * spec.cold_windows)
        self._windows = (self.util, self.late, self.cold)
        self.last_move: dict[str, float] = {}  # set -> when its last move was decided
        self.moving: dict[str, float] = {}  # instance -> when it was moved (until it settled)
        # (set, stage) that had their floor once: only those can fall below it (a deployment
        # that is still starting, or a set that runs no instance of a stage, has empty stages
        # that nothing needs to fill)
        self.had_min: set[tuple[str, str]] = set()
        self.decisions: collections.deque[dict[str, Any]] = collections.deque(maxlen=50)
        self._next_turn = 0.0

    def observe(self, inst: "Instance", now: float) -> None:
        """A stage instance's heartbeat: its counters count for the stage it serves, if that is
        the one it is assigned."""
        serving = inst.serving if inst.serving == inst.stage else None
        for w in self._windows:
            w.observe(inst.id, serving, inst.stats, now)
        if self.needs:
            self.holds.setdefault(inst.id, self.needs.get(inst.stage, 1) if inst.stage else 1)

    def loads(self, state: "ClusterState", set_name: str, now: float) -> dict[str, StageLoad]:
        spec = state.sets[set_name]
        # An instance silent for a while may be dead (the NM drops it later, at dead_after_s)
        # and must not count as the one that lets its twin leave.
        fresh_s = _fresh_s(state)
        out = {}
        for stage in state.workflow.stages:
            mine = sorted((i for i in state.stage_instances(set_name) if i.stage == stage), key=lambda i: i.id)
            live = [i.id for i in mine if i.heard and now - i.last_seen <= fresh_s and i.ready and i.serving == stage]
            known = [u for i in mine if (u := self.util.of(i.id, now)) is not None]
            # Late over left summed over the instances: a mean of their shares made one late
            # request of an instance that saw one leave weigh as much as another's thousand.
            late = [x for i in mine if (x := self.late.increase(i.id, now)) is not None]
            cold = [x for i in mine if (x := self.cold.of(i.id, now)) is not None]
            if len(mine) >= max(spec.min_of(stage), 1):
                self.had_min.add((set_name, stage))
            out[stage] = StageLoad(stage, [i.id for i in mine], sum(known) / len(known) if known else None,
                                   spec.min_of(stage), live, (set_name, stage) in self.had_min,
                                   self.needs.get(stage, 1),
                                   sum(p for p, _ in late) / sum(w for _, w in late) if late else None,
                                   sum(cold) / len(cold) if cold else None)
        return out

    def tick(self, state: "ClusterState", now: float | None = None) -> list[Move]:
        """Decide and apply at most one move per set (the primary NM calls this every turn)."""
        now = time.monotonic() if now is None else now
        if now < self._next_turn:
            return []
        self._next_turn = now + TURN_S
        self._settle(state, now)
        if not self.spec.enabled:
            return []
        moves = []
        for set_name in state.sets:
            members = state.stage_instances(set_name)
            # One move at a time, and a cooldown after each: judge again once it settled. A
            # stage below its minimum is refilled all the same.
            waiting = now - self.last_move.get(set_name, float("-inf")) < self.spec.cooldown_s \
                or any(i.id in self.moving for i in members)
            loads = self.loads(state, set_name, now)
            idle = [i.id for i in members if i.stage is None and i.heard and now - i.last_seen <= _fresh_s(state)]
            move = decide(self.spec, loads, idle, {i.id: self.util.of(i.id, now) for i in members}, floors_only=waiting,
                          holds=self.holds)
            if move is not None:
                self.apply(state, move, now, loads)
                moves.append(move)
        return moves

    def apply(self, state: "ClusterState", move: Move, now: float, loads: dict[str, StageLoad] | None = None) -> None:
        inst = state.assign(move.instance, move.dst, move.reason)
        self.last_move[inst.set] = now
        self.moving[inst.id] = now
        for w in self._windows:
            w.forget(inst.id)
        inputs = loads or self.loads(state, inst.set, now)
        self.decisions.append({
            "at": time.time(), "set": inst.set, "instance": inst.id, "from": move.src, "to": move.dst,
            "reason": move.reason, "holding": len(inst.holding),
            "inputs": {s: {"util": None if l.util is None else round(l.util, 3),
                           "late": None if l.late is None else round(l.late, 3), "instances": len(l.assigned),
                           "min": l.min} for s, l in inputs.items()},
        })

    def _settle(self, state: "ClusterState", now: float) -> None:
        """A moved instance has settled once it served a whole window at its new stage (or
        drained into the idle pool); one that takes too long is reported and let go."""
        for w in self._windows:  # however an instance left, its samples go with it
            w.keep(state.instances)
        for iid in [i for i in self.holds if i not in state.instances]:
            del self.holds[iid]
        limit = self.spec.drain_s + self.spec.window_s + MOVE_GRACE_S
        for iid, since in list(self.moving.items()):
            inst = state.instances.get(iid)
            if inst is None:
                self.moving.pop(iid)
            elif (inst.stage is None and inst.serving is None and not inst.holding) or \
                    (inst.stage is not None and self.util.of(iid, now) is not None):
                self.moving.pop(iid)
            elif now - since > limit:
                self.moving.pop(iid)
                state.note(f"move of {iid} to {inst.stage or 'the idle pool'} has not completed after {now - since:.0f}s")

    def view(self, state: "ClusterState", now: float | None = None) -> dict[str, Any]:
        """What `onepiece status` shows: the policy, per-stage utilization, moves under way and
        the recent decisions with their inputs."""
        now = time.monotonic() if now is None else now
        loads = {s: self.loads(state, s, now) for s in state.sets}
        return {
            "policy": self.spec.model_dump(),
            "utilization": {s: {st: (None if l.util is None else round(l.util, 3)) for st, l in ls.items()}
                            for s, ls in loads.items()},
            "late": {s: {st: round(l.late, 3) for st, l in ls.items() if l.late is not None} for s, ls in loads.items()},
            "moving": sorted(self.moving),
            "decisions": list(self.decisions)[-10:],
        }
