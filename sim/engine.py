"""The trace-driven simulator's engine (DESIGN §12): workflow sets on a virtual clock, running
the runtime's own pieces, not copies of them:

- a request is checked and shaped by the proxy's own validation (``build_job``), its deadline
  split over the stages by the same rule (``sched.deadlines``);
- every stage instance is a ``SchedCore`` with the stage's policy and options from the workflow
  YAML, and its workers execute the core's plans step by step (``sched.virtual``), priced by a
  cost table;
- instances of a stage are sent to round-robin, as the ResultDeliver does, with a hop time per
  message between stages.

No I/O and no wall clock: the same inputs give the same result, so a test can pin it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson

from onepiece.bench.trace import Trace, TraceRequest
from onepiece.config import Workflow
from onepiece.proxy.errors import ApiError
from onepiece.proxy.validation import build_job
from onepiece.sched.core import SchedCore
from onepiece.sched.deadlines import reserve, stage_request
from onepiece.sched.keys import call_key, compat_key
from onepiece.sched.virtual import EventLoop, VirtualInstance
from onepiece.sim.costs import CostTable

HOP_S = 0.0015  # one message between stages on one host (bench e2e: hop p50 0.6-1.5 ms)
OVERHEAD_S = 0.001  # decision + IPC per chunk (bench batching: 0.7-1.0 ms)
_NO_PIXELS = b"sim"  # an i2v request's image: validation only asks that there is one


class SimInputError(ValueError):
    """A trace, topology or cost table the simulator cannot run, saying where and why."""


@dataclass
class Journey:
    """One request through the simulation."""

    uid: str
    index: int  # in the trace
    req: TraceRequest
    app: str
    params: dict[str, Any]
    stages: list[str]
    deadline: float  # absolute, virtual seconds
    target: float | None
    alone: dict[str, float]  # seconds each stage takes for it alone
    set: str = ""
    at_stage: int = 0
    end: float | None = None
    outcome: str = ""  # completed | failed
    error: str | None = None
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)  # (stage, instance, enter, leave)

    def __post_init__(self) -> None:
        self.reserve = reserve(self.stages, self.alone.get)  # as the proxy splits the deadline

    def record(self) -> dict[str, Any]:
        """What ``bench.trace.summarize`` reads, as the benchmark's client records it."""
        return {"uid": self.uid, "class": self.req.cls, "app": self.app, "at": self.req.at, "t_send": self.req.at,
                "outcome": self.outcome, "latency_s": None if self.end is None else self.end - self.req.at,
                "timeout_s": self.req.timeout_s, "slo_s": self.req.slo_s, "error": self.error,
                "set": self.set, "stages": [{"stage": s, "instance": i, "enter": a, "leave": b}
                                            for s, i, a, b in self.spans]}


@dataclass
class Chunk:
    """One chunk a worker ran: what the schedule trace draws."""

    instance: str
    worker: str
    start: float
    end: float
    uids: tuple[str, ...]
    steps: int


class Simulation:
    def __init__(self, workflow: Workflow, sets: dict[str, dict[str, int]], costs: CostTable,
                 hop_s: float = HOP_S, overhead_s: float = OVERHEAD_S, keep_chunks: bool = True) -> None:
        """``sets``: per workflow set, the instances of each stage."""
        self.wf, self.costs, self.hop_s, self.overhead_s = workflow, costs, hop_s, overhead_s
        self.loop = EventLoop()
        self.chunks: list[Chunk] | None = [] if keep_chunks else None
        self.journeys: dict[str, Journey] = {}
        self.instances: dict[str, dict[str, list[VirtualInstance]]] = {}
        self._rr: dict[tuple[str, str], itertools.cycle] = {}
        self._set_rr = itertools.cycle(list(sets))
        for set_name, counts in sets.items():
            self.instances[set_name] = {}
            for stage, n in counts.items():
                if stage not in workflow.stages:
                    raise SimInputError(f"sets.{set_name}.{stage}: unknown stage (known: {sorted(workflow.stages)})")
                self.instances[set_name][stage] = [self._instance(set_name, stage, i) for i in range(n)]
                self._rr[(set_name, stage)] = itertools.cycle(self.instances[set_name][stage])

    def _instance(self, set_name: str, stage: str, i: int) -> VirtualInstance:
        spec = self.wf.stages[stage]
        name = f"{set_name}-{stage}{i}"
        core = SchedCore(spec.schedule, self.costs.model(stage))
        chunk = None if self.chunks is None else self._chunk_hook(name)
        return VirtualInstance(self.loop, core, self.costs.pricer(stage), spec.workers, self.overhead_s,
                               on_end=self._end_hook(set_name, stage, name), on_chunk=chunk, name=name)

    def _chunk_hook(self, name: str) -> Callable:
        def hook(start: float, end: float, worker: str, uids: tuple[str, ...], steps: int) -> None:
            self.chunks.append(Chunk(name, worker, start, end, uids, steps))
        return hook

    def _end_hook(self, set_name: str, stage: str, name: str) -> Callable:
        def hook(uid: str, status: str, r: Any, first: float | None) -> None:
            self._left_stage(self.journeys[uid], stage, name, status)
        return hook

    # --- requests -----------------------------------------------------------------------------
    def load(self, trace: Trace) -> None:
        """Check every request of ``trace`` as a proxy would, and price every stage it needs;
        a request the simulation cannot run is refused with its index and the reason."""
        for i, tr in enumerate(trace.requests):
            body = orjson.loads(orjson.dumps(tr.body("simulated")))
            try:
                job = build_job(self.wf, body, _NO_PIXELS if self._wants_image(tr.app) else None)
            except ApiError as e:
                raise SimInputError(f"requests[{i}]: {e.message}") from None
            params = job.params()
            stages = list(self.wf.applications[job.app].stages)
            for s in stages:
                if not any(s in by_stage for by_stage in self.instances.values()):
                    raise SimInputError(f"requests[{i}]: application {job.app!r} needs stage {s!r}, which no set runs")
                why = self.costs.missing(s, self._key(s, params))
                if why:
                    raise SimInputError(f"requests[{i}] ({tr.size}x{tr.num_frames}:{tr.steps}): {why}")
            alone = {s: self.costs.alone_s(s, self._key(s, params), self._steps(s, params)) for s in stages}
            uid = f"r{i}"
            self.journeys[uid] = Journey(uid, i, tr, job.app, params, stages, tr.at + job.timeout_s,
                                         None if job.slo_s is None else tr.at + job.slo_s, alone)
            self.loop.at(tr.at, self._arrive, self.journeys[uid])

    def _wants_image(self, app: str) -> bool:
        spec = self.wf.applications.get(app)
        return spec is not None and spec.kind == "i2v"

    def _key(self, stage: str, params: dict[str, Any]) -> str:
        return compat_key(params) if self.costs.stepped(stage) else call_key(params)

    def _steps(self, stage: str, params: dict[str, Any]) -> int:
        return int(params["steps"]) if self.costs.stepped(stage) else 1

    def _arrive(self, j: Journey) -> None:
        sets = [s for s in self.instances if j.stages[0] in self.instances[s]]
        j.set = next(s for s in self._set_rr if s in sets)  # round-robin over the sets that serve it
        self._enter(j)

    def _enter(self, j: Journey) -> None:
        stage = j.stages[j.at_stage]
        inst = next(self._rr[(j.set, stage)])
        now = self.loop.now
        r = stage_request(j.uid, j.app, self._key(stage, j.params), self._steps(stage, j.params), now, j.deadline,
                          j.target, j.reserve.get(stage, 0.0), j.req.priority, batchable=self.costs.stepped(stage))
        j.spans.append((stage, inst.name, now, now))
        inst.add(r)

    def _left_stage(self, j: Journey, stage: str, instance: str, status: str) -> None:
        now = self.loop.now
        s, i, enter, _ = j.spans[-1]
        j.spans[-1] = (s, i, enter, now)
        if status != "completed":
            self._resolve(j, now, "failed", f"deadline exceeded at stage {stage}")
        elif j.at_stage + 1 < len(j.stages):
            j.at_stage += 1
            self.loop.at(now + self.hop_s, self._enter, j)
        else:
            self._resolve(j, now + self.hop_s, "completed")  # delivered to the DB

    def _resolve(self, j: Journey, t: float, outcome: str, error: str | None = None) -> None:
        j.end, j.outcome, j.error = t, outcome, error

    # --- running ------------------------------------------------------------------------------
    def run(self, until: float = float("inf")) -> list[dict[str, Any]]:
        """Run to the end (or ``until``); one record per request, in trace order. A request
        still in flight at ``until`` is recorded as ``timeout``."""
        self.loop.run(until)
        out = []
        for j in sorted(self.journeys.values(), key=lambda j: j.index):
            if not j.outcome:
                j.outcome = "timeout"
            out.append(j.record())
        return out

    def utilization(self) -> dict[str, float]:
        """Per stage, the share of its workers' time spent in chunks over the run."""
        span = max(self.loop.now, 1e-9)
        busy: dict[str, float] = {}
        workers: dict[str, int] = {}
        for by_stage in self.instances.values():
            for stage, insts in by_stage.items():
                busy[stage] = busy.get(stage, 0.0) + sum(i.busy_s for i in insts)
                workers[stage] = workers.get(stage, 0) + sum(len(i.core.workers) for i in insts)
        return {s: busy[s] / (span * workers[s]) if workers[s] else 0.0 for s in busy}
