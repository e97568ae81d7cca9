"""The trace-driven simulator's engine (DESIGN §12): workflow sets on a virtual clock, running
the runtime's own pieces, not copies of them:

- a request is checked and shaped by the proxy's own validation (``build_job``), its deadline
  split over the stages by the same rule (``sched.deadlines``);
- every stage instance is a ``SchedCore`` with the stage's policy and options from the workflow
  YAML, and its workers execute the core's plans step by step (``sched.virtual``), priced by a
  cost table;
- instances of a stage are sent to round-robin, as the ResultDeliver does, with a hop time per
  message between stages;
- with a set's request monitor on, every arrival goes through the proxy's own ``admit`` against
  the NM's own capacity view (``nm.capacity.estimate``), rebuilt every heartbeat from what each
  simulated instance measured (``ServiceTimes``, as the stage's scheduler records it, from a warm
  start: ``Simulation._warm``); a set that refuses passes the request to the next set, as the
  client does, and a request every set refuses is ``rejected``;
- with a topology's elastic policy, the NM's own state and policy move instances between stages
  (``sim/elastic.py``);
- with ``host_cores``, all of a set's workers share one host of that many cores
  (``sched.virtual.Host``): a step lasts longer while other stages compute beside it, as on one
  CPU host, or on one GPU that several stages use. Without it each worker is a device of its own.

A stage's per-request preparing and finishing is charged as its table's ``fixed`` says (a table
from a run has it, `onepiece profile`'s not). Not modelled: transports beyond a fixed hop time,
failures.

No I/O and no wall clock: the same inputs give the same result, so a test can pin it.
"""

from __future__ import annotations

import gc
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from onepiece.bench.trace import Trace, TraceRequest
from onepiece.config import STEPPED_FUNCTIONS, ProxySpec, Topology, Workflow
from onepiece.db.store import DEADLINE_GRACE_S
from onepiece.nm.capacity import estimate
from onepiece.proxy.admission import InflightTracker, admit
from onepiece.proxy.api import ProxyOptions
from onepiece.proxy.errors import ApiError
from onepiece.proxy.validation import VideoJob, build_job
from onepiece.sched.core import Run, SchedCore
from onepiece.sched.costs import MAX_STEP_CV
from onepiece.sched.deadlines import reserve, stage_request
from onepiece.sched.keys import at_dop, call_key, compat_key, shape_key
from onepiece.sched.policies import make_policy
from onepiece.sched.ranks import dops
from onepiece.sched.virtual import EventLoop, Host, VirtualInstance
from onepiece.sim.costs import CostTable
from onepiece.stage.service_times import ServiceTimes

HOP_S = 0.0015  # one message between stages on one host (bench e2e: hop p50 0.6-1.5 ms)
HEARTBEAT_S = 0.5  # how often an instance reports and the NM's view is rebuilt (bench sched's setting)
MOVE_S = 5.0  # a moved instance's workers exiting and loading the new stage (bench elastic: 6.6 s p50 on CPU)
OVERHEAD_S = 0.001  # decision + IPC per chunk (bench batching: 0.7-1.0 ms)
_NO_PIXELS = b"sim"  # an i2v request's image: validation only asks that there is one


class SimInputError(ValueError):
    """A trace, topology or cost table the simulator cannot run, saying where and why."""


def _lognormal(cv: float, rng: random.Random) -> Callable[[], float] | None:
    """Factors of mean 1 and coefficient of variation ``cv`` (None for 0): a step's time is
    skewed (a step can be slowed far more than sped up), which a lognormal keeps."""
    if cv <= 0:
        return None
    sigma = math.sqrt(math.log1p(cv * cv))
    mu = -sigma * sigma / 2
    return lambda: rng.lognormvariate(mu, sigma)


@dataclass
class Journey:
    """One request through the simulation."""

    uid: str
    index: int  # in the trace
    req: TraceRequest
    job: VideoJob
    params: dict[str, Any]
    stages: list[str]
    deadline: float  # absolute, virtual seconds
    target: float | None
    alone: dict[str, float]  # seconds each stage takes for it alone (a collaboration group: at its fastest DoP)
    reserve: dict[str, float]  # per stage, what the stages after it need alone (sched.deadlines.reserve)
    # per stage, in order: its key there, its steps there, whether it batches there
    entries: list[tuple[str, int, bool]] = field(default_factory=list)
    shape: str = ""  # sched.keys.shape_key of its params
    set: str = ""
    at_stage: int = 0
    end: float | None = None
    outcome: str = ""  # completed | failed | rejected
    error: str | None = None  # why it failed, or the code of its last refusal
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)  # (stage, instance, enter, leave)

    @property
    def app(self) -> str:
        return self.job.app

    def record(self) -> dict[str, Any]:
        """What ``bench.trace.summarize`` reads, as the benchmark's client records it."""
        return {"uid": self.uid, "class": self.req.cls, "app": self.app, "at": self.req.at, "t_send": self.req.at,
                "outcome": self.outcome, "reason": self.error if self.outcome == "rejected" else None,
                "latency_s": None if self.end is None or self.outcome == "rejected" else self.end - self.req.at,
                "timeout_s": self.req.timeout_s, "slo_s": self.req.slo_s, "error": self.error,
                "set": self.set, "stages": [{"stage": s, "instance": i, "enter": a, "leave": b}
                                            for s, i, a, b in self.spans]}


@dataclass
class Chunk:
    """One chunk a worker ran: what the schedule trace draws."""

    stage: str
    instance: str
    worker: str
    start: float
    end: float
    uids: tuple[str, ...]
    steps: int
    parts: tuple[tuple[int, tuple[str, ...]], ...] = ()  # (DoP, uids) of each batch in it
    passed: tuple = ()  # the requests its decision passed over (sched.core.Passed)


class Simulation:
    def __init__(self, workflow: Workflow, sets: dict[str, dict[str, int]], costs: CostTable,
                 hop_s: float = HOP_S, overhead_s: float = OVERHEAD_S, keep_chunks: bool = True,
                 proxies: dict[str, ProxySpec] | None = None, heartbeat_s: float = HEARTBEAT_S,
                 elastic: Topology | None = None, move_s: float = MOVE_S, gpus: dict[str, int] | None = None,
                 step_cv: float = 0.0, seed: int = 0, host_cores: float | None = None) -> None:
        """``sets``: per workflow set, the instances of each stage; ``proxies``: per set, its
        proxies' settings (the request monitor, the in-flight bound; default: no monitor);
        ``elastic``: a topology whose NM moves instances between stages (its ``nm.elastic``, its
        sets' minimums and idle pools; its heartbeat replaces ``heartbeat_s``), each move taking
        ``move_s`` beyond the drain to load the new stage's models; ``gpus``: GPUs one worker of a stage
        holds (default 1), so that a move never takes an instance to a stage that needs more;
        ``step_cv``: at the stages whose table does not say (its ``step_cv``), each step or call
        costs its figure times a factor of mean 1 and this coefficient of variation (lognormal,
        drawn from ``seed``), as measured steps vary; 0: the figure itself; ``host_cores``: each set's
        workers share one host of this many cores (a table's figures are then each step alone)."""
        if not 0 <= step_cv <= MAX_STEP_CV:  # (a CV past it collapses the steps' median: sched.costs)
            raise SimInputError(f"step_cv must be a number in [0, {MAX_STEP_CV:g}] (got {step_cv!r})")
        for stage in workflow.stages:  # the workflow says which stages step, not the table's keys
            why = costs.wrong_kind(stage, workflow.function_of(stage) in STEPPED_FUNCTIONS)
            if why:
                raise SimInputError(why)
        self.wf, self.costs, self.hop_s, self.overhead_s = workflow, costs, hop_s, overhead_s
        self.step_cv, self._rng = step_cv, random.Random(seed)
        self.heartbeat_s = heartbeat_s
        self.loop = EventLoop()
        if host_cores is not None and not host_cores > 0:
            raise SimInputError(f"host_cores must be a number above 0 (got {host_cores!r})")
        self.hosts = {s: Host(self.loop, host_cores) for s in sets} if host_cores else {}
        now = lambda: self.loop.now  # noqa: E731 - the proxies' clock is the virtual one
        self.admission, self.trackers, self.n_proxies, self.service = {}, {}, {}, {}
        for set_name in sets:
            spec = (proxies or {}).get(set_name) or ProxySpec(monitor=False, max_inflight=100_000)
            opts = ProxyOptions(max_inflight=spec.max_inflight, monitor=spec.monitor,
                                deadline_factor=spec.deadline_factor)
            self.admission[set_name] = opts.admission(clock=now)
            self.trackers[set_name] = InflightTracker(spec.max_inflight)
            self.n_proxies[set_name] = spec.count
        self.chunks: list[Chunk] | None = [] if keep_chunks else None
        self.journeys: dict[str, Journey] = {}
        self._open = 0  # journeys loaded and not resolved
        # The route table: per set and stage, the instances serving it now, sent to round-robin.
        self.instances: dict[str, dict[str, list[VirtualInstance]]] = {}
        self._rr: dict[tuple[str, str], int] = {}
        self._set_rr = itertools.cycle(list(sets))
        self._serving: dict[str, tuple[list[str], dict[str, int]]] = {}  # first stage -> sets with it, their places
        self.lifetimes: list[tuple[str, VirtualInstance, float, float | None]] = []  # stage, vi, born, retired
        self._names: dict[tuple[str, str], itertools.count] = {}  # instance numbers per set and stage
        for set_name, counts in sets.items():
            self.instances[set_name] = {}
            for stage, n in counts.items():
                if stage not in workflow.stages:
                    raise SimInputError(f"sets.{set_name}.{stage}: unknown stage (known: {sorted(workflow.stages)})")
                self.instances[set_name][stage] = [self.new_instance(set_name, stage) for _ in range(n)]
        self.elastic = None
        if elastic is not None and elastic.nm.elastic.enabled:
            from onepiece.sim.elastic import SimElastic

            self.heartbeat_s = elastic.nm.heartbeat_s
            self.elastic = SimElastic(self, elastic, move_s, gpus or {})

    # --- instances and routes -------------------------------------------------------------------
    def new_instance(self, set_name: str, stage: str) -> VirtualInstance:
        """A fresh instance of ``stage`` (empty, its models loaded), not routed yet."""
        spec = self.wf.stages[stage]
        name = f"{set_name}-{stage}{next(self._names.setdefault((set_name, stage), itertools.count()))}"
        core = SchedCore(spec.schedule, self.costs.model(stage))
        core.explain = self.chunks is not None  # the schedule trace says why, as a stage's schedule log does
        service = self.service[name] = ServiceTimes(clock=lambda: self.loop.now)

        monitored = self.admission.get(set_name) is not None  # the service times' only reader

        def ended(uid: str, status: str, r: Any, first: float | None) -> None:
            j = self.journeys[uid]
            if monitored and status == "completed":
                service.finished(core, r, j.shape)  # what its heartbeat will report
            self._left_stage(j, stage, name, status)

        chunk = None if self.chunks is None else self._chunk_hook(stage, name)
        ranks = self._ranks(stage)
        vi = VirtualInstance(self.loop, core, self.costs.pricer(stage), spec.workers // ranks,
                             self.costs.overhead_s(stage, self.overhead_s),
                             on_end=ended, on_chunk=chunk, name=name, ranks=ranks, fixed=self.costs.fixed_s(stage),
                             jitter=_lognormal(self.costs.step_cv(stage, self.step_cv), self._rng),
                             host=self.hosts.get(set_name))
        self.lifetimes.append((stage, vi, self.loop.now, None))
        return vi

    def route(self, set_name: str, stage: str, vi: VirtualInstance) -> None:
        """Send ``vi``'s set's requests for ``stage`` to it too."""
        self.instances[set_name].setdefault(stage, []).append(vi)
        self._serving.clear()  # a set may serve a stage it did not

    def retire(self, vi: VirtualInstance) -> None:
        """``vi`` stopped (its workers exited): its time ends here."""
        self.lifetimes = [(s, v, b, self.loop.now if v is vi else r) for s, v, b, r in self.lifetimes]

    def _pick(self, set_name: str, stage: str) -> VirtualInstance | None:
        insts = self.instances[set_name].get(stage) or []
        if not insts:
            return None
        i = self._rr[(set_name, stage)] = (self._rr.get((set_name, stage), -1) + 1) % len(insts)
        return insts[i]

    def _chunk_hook(self, stage: str, name: str) -> Callable:
        def hook(start: float, end: float, run: Run, passed: list) -> None:
            self.chunks.append(Chunk(stage, name, run.worker, start, end, run.uids, run.steps,
                                     tuple((len(p.ranks), p.uids) for p in run.parts), tuple(passed)))
        return hook

    # --- requests -----------------------------------------------------------------------------
    def load(self, trace: Trace) -> None:
        """Check every request of ``trace`` as a proxy would, and price every stage it needs;
        a request the simulation cannot run is refused with its index and the reason."""
        priced: dict[tuple, tuple[list[tuple[str, int, bool]], dict[str, float], dict[str, float]]] = {}  # shapes recur
        for i, tr in enumerate(trace.requests):
            try:
                job = build_job(self.wf, tr.body("simulated"), _NO_PIXELS if self._wants_image(tr.app) else None)
            except ApiError as e:
                raise SimInputError(f"requests[{i}]: {e.message}") from None
            params = job.params()
            stages = list(self.wf.applications[job.app].stages)
            entries = [(self._key(s, params), self._steps(s, params), self.costs.stepped(s)) for s in stages]
            known = priced.get((job.app, *entries))
            if known is None:
                for s, (key, _, _) in zip(stages, entries):
                    if not any(s in by_stage for by_stage in self.instances.values()):
                        raise SimInputError(f"requests[{i}]: application {job.app!r} needs stage {s!r}, which no set runs")
                    why = next(filter(None, (self.costs.missing(s, at_dop(key, d)) for d in self._run_dops(s))), None)
                    if why:
                        raise SimInputError(f"requests[{i}] ({tr.size}x{tr.num_frames}:{tr.steps}): {why}")
                if self.elastic is None:  # (elastic moves may fill a stage that starts empty)
                    self._complete_sets(i, job.app, stages)
                alone = {s: self.costs.alone_s(s, key, steps, self._ranks(s))
                         for s, (key, steps, _) in zip(stages, entries)}
                # the deadline split as the proxy splits it
                known = priced[(job.app, *entries)] = entries, alone, reserve(stages, alone.get)
            uid = f"r{i}"
            self.journeys[uid] = Journey(uid, i, tr, job, params, stages, tr.at + job.timeout_s,
                                         None if job.slo_s is None else tr.at + job.slo_s, known[1],
                                         known[2], known[0], shape_key(params))  # shared: read only
            self.loop.at_in_order(tr.at, self._arrive, self.journeys[uid])  # a trace is in time order
            self._open += 1
        self._warm()
        if (self.elastic is not None or any(a is not None for a in self.admission.values())) and self._open:
            self.loop.at(0.0, self._heartbeat)

    def _complete_sets(self, i: int, app: str, stages: list[str]) -> None:
        """SimInputError unless some set runs ``app``'s first stage and every such set runs all of
        its stages: otherwise every request of it would be refused or would fail."""
        serving = self._serving_sets(stages[0])[0]
        if not serving:
            raise SimInputError(f"requests[{i}]: no set has an instance of {stages[0]!r}, where application "
                                f"{app!r} starts")
        for set_name in serving:
            for s in stages:
                if not self.instances[set_name].get(s):
                    raise SimInputError(
                        f"requests[{i}]: set {set_name} takes application {app!r} (it runs {stages[0]}) but has "
                        f"no instance of {s!r}, so every such request it takes would fail: give it one, or let the "
                        f"NM's elastic moves fill it")

    def _warm(self) -> None:
        """A monitored set's instances start as a deployment that has served before (``bench
        sched`` warms up with every class): each has measured one request of every shape the
        trace brings it, so the NM's capacity view is measured from the first arrival, as the
        real one is. (Cold, it admitted all it was offered until the first requests finished.)"""
        firsts: dict[tuple[str, str], Journey] = {}
        for j in self.journeys.values():
            firsts.setdefault((j.app, j.shape), j)
        for set_name, adm in self.admission.items():
            if adm is None:
                continue
            for j in firsts.values():
                for stage, (key, steps, batchable) in zip(j.stages, j.entries):
                    for vi in self.instances[set_name].get(stage, []):
                        r = stage_request(j.uid, j.app, key, steps, 0.0, math.inf, None, 0.0, batchable=batchable)
                        self.service[vi.name].finished(vi.core, r, j.shape)

    def _wants_image(self, app: str) -> bool:
        spec = self.wf.applications.get(app)
        return spec is not None and spec.kind == "i2v"

    def _ranks(self, stage: str) -> int:
        """Ranks per worker: a collaboration stage's workers are one group (one worker)."""
        spec = self.wf.stages[stage]
        return spec.workers if spec.mode == "collaboration" else 1

    def _run_dops(self, stage: str) -> list[int]:
        """The DoPs ``stage``'s workers run batches at: a DoP-blind policy runs every batch on all
        of a group's ranks, so a table need not price the others (a run under it measured none)."""
        ranks = self._ranks(stage)
        return dops(ranks) if make_policy(self.wf.stages[stage].schedule.policy).picks_dop else [ranks]

    def _key(self, stage: str, params: dict[str, Any]) -> str:
        return compat_key(params) if self.costs.stepped(stage) else call_key(params)

    def _steps(self, stage: str, params: dict[str, Any]) -> int:
        return int(params["steps"]) if self.costs.stepped(stage) else 1

    def _arrive(self, j: Journey) -> None:
        """The client offers the request to the sets that serve it, from the next one round-robin,
        until one admits it (the proxy's own ``admit``)."""
        serving, place = self._serving_sets(j.stages[0])
        if not serving:  # every instance of its first stage moved away: no proxy has an entrance
            self._resolve(j, self.loop.now, "rejected", "no_entrance")
            return
        first = next(s for s in self._set_rr if s in place)
        start, n = place[first], len(serving)
        for k in range(n):
            set_name = serving[(start + k) % n]
            refusal = admit(self.admission[set_name], self.trackers[set_name], j.uid, j.app, j.shape,
                            int(self.loop.now * 1e9), j.job.timeout_s, j.job.target_s, j.job.target_given)
            if refusal is None:
                j.set = set_name
                self._enter(j)
                return
            j.error = refusal.code
        self._resolve(j, self.loop.now, "rejected", j.error)

    def _serving_sets(self, stage: str) -> tuple[list[str], dict[str, int]]:
        """The sets that run ``stage`` (in the sets' order), and each one's place among them."""
        got = self._serving.get(stage)
        if got is None:
            serving = [s for s in self.instances if self.instances[s].get(stage)]  # as a proxy with no entrance refuses
            got = self._serving[stage] = serving, {s: i for i, s in enumerate(serving)}
        return got

    def _heartbeat(self) -> None:
        """Every instance reports and the NM rebuilds each set's capacity view, which its proxies
        take (``nm.state.monitor``'s document), and runs its elastic policy."""
        if self.elastic is not None:
            self.elastic.heartbeat(self.loop.now)
        for set_name, adm in self.admission.items():
            if adm is None:
                continue
            members = [{"role": "stage", "stage": stage, "ready": True,
                        "stats": {"ready": len(inst.core.workers), "queue": inst.core.waiting(),
                                  "service": self.service[inst.name].report(), "policy": inst.core.policy.name}}
                       for stage, insts in self.instances[set_name].items() for inst in insts]
            adm.observe({"apps": estimate(self.wf, members), "proxies": self.n_proxies[set_name]})
        if self._open:
            beat = self.loop.now + self.heartbeat_s
            ahead = self.loop.next_in_order()  # the next arrival, and how many are still to come
            if self.elastic is None and ahead is not None and ahead[1] == self._open and ahead[0] > beat:
                # Nobody is in the sets, so nothing the view is built from changes until the next
                # arrival: of the beats in between, only the last before it counts (a trace may
                # be quiet for days, at two beats a second).
                beat = self.loop.now + math.floor((ahead[0] - self.loop.now) / self.heartbeat_s) * self.heartbeat_s
            self.loop.at(beat, self._heartbeat)

    def _enter(self, j: Journey) -> None:
        stage = j.stages[j.at_stage]
        inst = self._pick(j.set, stage)
        now = self.loop.now
        if inst is None:  # every instance of it moved away: the deliverer finds no route
            self._resolve(j, now, "failed", f"no instance of stage {stage} in set {j.set}")
            return
        key, steps, batchable = j.entries[j.at_stage]
        r = stage_request(j.uid, j.app, key, steps, now, j.deadline, j.target, j.reserve.get(stage, 0.0),
                          j.req.priority, batchable=batchable)
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
        verdict = j.deadline + DEADLINE_GRACE_S
        if t > verdict and outcome != "rejected":
            # The DB failed it at its deadline, and that is what its client saw: a stage that
            # noticed later, or a result that came later, finds the client gone. (Its proxy's slot
            # is freed here, as late as that: a small error, and only with drop_expired off.)
            at = next((s for s, _, enter, _ in reversed(j.spans) if enter <= j.deadline), j.stages[0])
            t, outcome, error = verdict, "failed", f"deadline exceeded at stage {at}"
        j.end, j.outcome, j.error = t, outcome, error
        self._open -= 1
        if j.set:
            self.trackers[j.set].release(j.uid)  # the DB's "done" event frees the proxy's slot
            adm = self.admission[j.set]
            if adm is not None:  # with the stages' time, as the trace gives it at the DB
                adm.done(j.uid, outcome, int(t * 1e9), sum(leave - enter for _, _, enter, leave in j.spans))

    # --- running ------------------------------------------------------------------------------
    def run(self, until: float = float("inf")) -> list[dict[str, Any]]:
        """Run to the end (or ``until``); one record per request, in trace order. A request
        still in flight at ``until`` is recorded as ``timeout``."""
        # Millions of objects made and dropped, next to every journey kept: the cyclic collector's
        # passes cost a tenth of a run and find next to nothing (a run makes few cycles).
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.loop.run(until)
            out = []
            for j in sorted(self.journeys.values(), key=lambda j: j.index):
                if not j.outcome:
                    j.outcome = "timeout"
                out.append(j.record())
            return out
        finally:
            if collecting:
                gc.enable()

    def utilization(self) -> dict[str, float]:
        """Per stage, the share of its workers' time spent in chunks over the run."""
        busy: dict[str, float] = {}
        slots: dict[str, float] = {}
        for stage, vi, born, retired in self.lifetimes:
            busy[stage] = busy.get(stage, 0.0) + vi.busy_s
            slots[stage] = slots.get(stage, 0.0) + len(vi.core.workers) * ((retired or self.loop.now) - born)
        return {s: busy[s] / slots[s] if slots[s] > 0 else 0.0 for s in busy}
