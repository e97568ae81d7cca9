"""`onepiece plan`'s search (DESIGN §12): the fewest devices that meet an SLO target for a load,
judged by the simulator running the real policies.

- **Monolithic**: every device runs whole requests, one after another, each through every stage
  of its application (the paper's baseline: one instance holds the whole pipeline). Priced from
  the same table: a request's call is the sum of its stages' standalone times.
- **Disaggregated**: one device per stage instance, counts per stage first from the paper's
  Theorem 1 (each stage gets devices in proportion to the work it is offered, so none falls
  behind the others), then refined by simulation: add a device where the workers are busiest
  until the target is met, then take back any device the target does not need.
- **Disaggregated with elastic moves**: the same search with the NM's elastic policy running in
  every simulation (``sim/elastic.py``), so a load whose mix shifts over the day is met by
  moving instances rather than by holding each stage's peak at once.

Every plan is held to the target in each application (``Verdict.worst``), as a monolithic pool
of one application must be.

A device is one worker of one instance (``workers`` of a stage in the workflow YAML is kept at
what it says), and it holds ``gpus[stage]`` GPUs (1 unless said: e.g. a 14B transformer that
runs sequence-parallel on 2). A monolithic device holds what the largest of its stages needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from onepiece.bench.trace import Trace, summarize
from onepiece.config import MAX_INSTANCES, ElasticSpec, NmSpec, SetSpec, StageSpec, Topology, Workflow
from onepiece.sched.keys import call_key
from onepiece.sched.options import ScheduleSpec
from onepiece.sim.costs import CostTable
from onepiece.sim.engine import HOP_S, MOVE_S, Journey, SimInputError, Simulation

MAX_DEVICES = 100_000


@dataclass
class Verdict:
    devices: int
    counts: dict[str, int]
    attainment: float  # over all requests
    utilization: dict[str, float]
    summary: dict[str, Any] = field(repr=False, default_factory=dict)
    # What the search holds to the target: the least attainment of any application. A monolithic
    # pool serves one application, so each pool must meet it; a shared plan held only overall
    # could starve a small application and still count as meeting it.
    worst: float = 1.0


def attainment(wf: Workflow, counts: dict[str, int], costs: CostTable, trace: Trace, hop_s: float = HOP_S,
               gpus: dict[str, int] | None = None, elastic: ElasticSpec | None = None,
               move_s: float = MOVE_S) -> Verdict:
    """Simulate ``trace`` on one set of ``counts`` instances (with ``elastic``: the NM moving
    them); SLO attainment over all requests, and the GPUs the set holds."""
    topo = None
    if elastic is not None:
        if max(counts.values()) > MAX_INSTANCES:
            raise SimInputError(f"with elastic moves a set holds at most {MAX_INSTANCES} instances of a stage "
                                f"(asked for {counts}); plan several sets, or without --elastic")
        topo = Topology(workflow="(planned)", nm=NmSpec(elastic=elastic), sets=[SetSpec(name="set0", stages=counts)])
    sim = Simulation(wf, {"set0": counts}, costs, hop_s=hop_s, keep_chunks=False, elastic=topo, move_s=move_s,
                     gpus=gpus)
    sim.load(trace)
    records = sim.run()
    if any(not v.slo_s for v in trace.classes.values()):  # the CLI refuses such a trace; a caller must too
        raise SimInputError("every class needs an slo_s to plan for")
    slo = {c: v.slo_s for c, v in trace.classes.items()}
    summary = summarize(records, slo)
    worst = min(summarize([r for r in records if r["app"] == app], slo)["all"]["attainment"]
                for app in {r["app"] for r in records})
    devices = sum(n * wf.stages[s].workers * (gpus or {}).get(s, 1) for s, n in counts.items())
    return Verdict(devices, dict(counts), summary["all"]["attainment"], sim.utilization(), summary, worst)


# --- monolithic ---------------------------------------------------------------------------------
def priced(wf: Workflow, costs: CostTable, trace: Trace) -> list[Journey]:
    """The requests of ``trace`` as the simulator takes them, in order: checked as a proxy
    would, with their params and what each stage of their application takes for them alone
    (bad requests and missing rows are refused)."""
    stages = {s for app in {r.app for r in trace.requests} if app in wf.applications
              for s in wf.applications[app].stages}
    sim = Simulation(wf, {"set0": {s: 1 for s in stages}}, costs, keep_chunks=False)
    sim.load(trace)
    return sorted(sim.journeys.values(), key=lambda j: j.index)


def device_s(costs: CostTable, j: Journey) -> dict[str, float]:
    """Device-seconds each stage of ``j``'s spends on it alone: at DoP 1, a rank's (``j.alone``
    is at a collaboration group's fastest DoP, on all its ranks)."""
    return {s: costs.alone_s(s, key, steps) for s, (key, steps, _) in zip(j.stages, j.entries)}


def only(trace: Trace, app: str) -> Trace:
    """``trace``'s requests of ``app``."""
    return trace.model_copy(update={"requests": [r for r in trace.requests if r.app == app]})


def monolithic(wf: Workflow, costs: CostTable, trace: Trace,
               gpus: dict[str, int] | None = None) -> tuple[Workflow, CostTable, dict[str, int]]:
    """The workflow, table and GPUs of whole-pipeline devices: each application becomes one
    stage, ``pipeline(app)``, a call that costs the sum of its stages alone (no hops: one
    process), on as many GPUs as the largest of its stages takes. A device holds one
    application's pipeline, so each application has its own pool."""
    rows: dict[str, dict[str, float]] = {}
    for j in priced(wf, costs, trace):
        key, t = call_key(j.params), sum(device_s(costs, j).values())
        mine = rows.setdefault(pipeline(j.app), {})
        if key in mine and not math.isclose(mine[key], t):
            raise SimInputError(f"requests[{j.index}]: shape {key} of {j.app} comes with another cost too (other step "
                                f"counts?); a monolithic device is priced per shape, so give each shape one step count")
        mine[key] = t
    mono = wf.model_copy(deep=True)
    first = next(iter(mono.stages.values()))
    mono.stages = {stage: StageSpec(model=first.model, components=first.components, workers=1,
                                    schedule=ScheduleSpec(policy="fcfs")) for stage in rows}
    need = {}
    for app, spec in mono.applications.items():
        need[pipeline(app)] = max((gpus or {}).get(s, 1) for s in spec.stages)
        spec.stages = [pipeline(app)]
    table = CostTable({"version": 1, "stages": {stage: {"rows": [{"key": k, "batch": 1, "seconds": t}
                                                                 for k, t in by_key.items()]}
                                                for stage, by_key in rows.items()}},
                      f"{costs.source} (whole pipeline)")
    return mono, table, need


def pipeline(app: str) -> str:
    """The monolithic stage of ``app``."""
    return f"pipeline_{app}"


def fewest_monolithic(wf: Workflow, costs: CostTable, trace: Trace, target: float,
                      gpus: dict[str, int] | None = None) -> Verdict:
    """The fewest whole-pipeline devices: each application's pool, the fewest that meet
    ``target`` on that application's requests (the pools share nothing)."""
    mono_wf, mono_costs, mono_gpus = monolithic(wf, costs, trace, gpus)
    pools = []
    for app in sorted({r.app for r in trace.requests}):
        sub = only(trace, app)
        n = len(sub.requests)
        try:  # past a device for each request nothing waits: more cannot help
            v = fewest(lambda k: attainment(mono_wf, {pipeline(app): k}, mono_costs, sub, gpus=mono_gpus), target,
                       most=min(n, MAX_DEVICES))
        except Infeasible as e:
            raise Infeasible(f"no monolithic fleet meets {target:.1%} for {app}: with a device for each of its {n} "
                             f"request(s), {e.best:.1%} make their SLO (a whole pipeline on one device takes "
                             f"longer than the SLO allows)", e.best) from None
        pools.append((v, n))
    met = sum(v.attainment * n for v, n in pools) / len(trace.requests)
    return Verdict(sum(v.devices for v, _ in pools), {k: c for v, _ in pools for k, c in v.counts.items()}, met,
                   {k: u for v, _ in pools for k, u in v.utilization.items()}, worst=min(v.worst for v, _ in pools))


class Infeasible(SimInputError):
    """No fleet meets the target; ``best``: the attainment of the largest one tried."""

    def __init__(self, message: str, best: float) -> None:
        super().__init__(message)
        self.best = best


def fewest(verdict_of: Callable[[int], Verdict], target: float, most: int = MAX_DEVICES) -> Verdict:
    """The smallest n up to ``most`` whose verdict meets ``target`` (attainment grows with n:
    doubling, then bisection)."""
    lo, hi = 0, 1
    best = verdict_of(hi)
    while best.worst < target:
        if hi >= most:
            raise Infeasible(f"no fleet of up to {most} devices meets {target:.1%}", best.worst)
        lo, hi = hi, min(most, hi * 2)
        best = verdict_of(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        v = verdict_of(mid)
        if v.worst >= target:
            hi, best = mid, v
        else:
            lo = mid
    return best


# --- disaggregated ------------------------------------------------------------------------------
def arrival_span(trace: Trace) -> float:
    """Seconds from the trace's first arrival to its last (a trace need not start at 0)."""
    return trace.requests[-1].at - trace.requests[0].at


def arrival_rate(trace: Trace) -> float:
    """Requests per second over the trace's arrivals: its gaps over its span (n requests have
    n - 1 gaps; Theorem 1 refuses a trace of no span)."""
    span = arrival_span(trace)
    return (len(trace.requests) - 1) / span if span > 0 else 0.0


def theorem1(wf: Workflow, costs: CostTable, trace: Trace, utilization: float = 0.7,
             span: float | None = None) -> dict[str, int]:
    """Counts in proportion to each stage's offered work (device-seconds per second), each
    stage at ``utilization`` and at least one instance: Theorem 1's balance, so no stage falls
    behind the one before it. ``span``: the seconds the work is offered over (default: from the
    trace's first arrival to its last; a part of a trace, one application's requests, is
    offered over the whole trace's)."""
    span = arrival_span(trace) if span is None else span
    if span <= 0:
        raise SimInputError(f"the trace's {len(trace.requests)} request(s) all arrive at {trace.requests[0].at:g} s: "
                            f"a load is a rate, which needs arrivals spread over time (more requests, or a trace)")
    work: dict[str, float] = {}
    for j in priced(wf, costs, trace):
        for s, t in device_s(costs, j).items():
            work[s] = work.get(s, 0.0) + t
    counts = {s: max(1, math.ceil(w / span / utilization / wf.stages[s].workers)) for s, w in sorted(work.items())}
    if sum(counts.values()) > MAX_DEVICES:
        raise SimInputError(f"the load asks for {sum(counts.values()):,} instances ({counts}) by Theorem 1, more "
                            f"than the {MAX_DEVICES:,} devices a plan may have")
    return counts


def disaggregated(wf: Workflow, costs: CostTable, trace: Trace, target: float, hop_s: float = HOP_S,
                  gpus: dict[str, int] | None = None, elastic: ElasticSpec | None = None, move_s: float = MOVE_S,
                  max_runs: int = 200, start: dict[str, int] | None = None) -> Verdict:
    """Theorem 1's counts (or ``start``), then: add one instance to the busiest stage until
    ``target`` is met, then remove any instance the target does not need (the least busy stages
    first); with ``elastic``, every simulation runs the NM's moves."""
    counts = dict(start) if start else theorem1(wf, costs, trace)
    stages = list(counts)
    runs = 0

    def judge(c: dict[str, int]) -> Verdict:
        nonlocal runs
        runs += 1
        if runs > max_runs:
            raise SimInputError(f"no plan within {max_runs} simulations")
        return attainment(wf, c, costs, trace, hop_s, gpus, elastic, move_s)

    v = judge(counts)
    while v.worst < target:
        busiest = max(stages, key=lambda s: v.utilization.get(s, 0.0))
        counts = {**counts, busiest: counts[busiest] + 1}
        v = judge(counts)
    improved = True
    while improved:
        improved = False
        for s in sorted(stages, key=lambda s: v.utilization.get(s, 0.0)):
            if counts[s] > 1:
                trial = judge({**counts, s: counts[s] - 1})
                if trial.worst >= target:
                    counts, v, improved = trial.counts, trial, True
                    break
    return v
