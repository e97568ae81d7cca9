"""One stage instance (DESIGN §6, §9): a data receiver it keeps for life, its membership in
the NM, and the StageRuntime (scheduler, TaskManager and workers, deliverer) of the stage the
NM assigned it. The assignment can change: the NM moves instances between stages and the idle
pool (nm/elastic.py), and the instance follows in steps (``StageInstance.run``):

1. the NM takes it out of the upstream routes (it routes an instance only while the instance
   reports it serves the stage assigned);
2. the instance stops saying it serves, finishes what it holds, and waits at least two
   heartbeats so every sender has the new routes (bounded by ``drain_s``);
3. it retires the runtime (its workers exit, unloading the models) and starts the new stage's,
   whose workers load the new models;
4. once a worker is ready it reports that it serves the new stage, and the NM routes to it.

Anything that still arrives for the old stage is forwarded to an instance that serves it,
also while the instance waits in the idle pool.

An instance the NM declared dead (stopped past the dead limit) whose requests it reported failed
is fenced when it comes back (nm/fencing.py): ``fence`` drops those requests wherever they are
(queued, at a worker, awaiting hand-on, still in the socket) before it registers again; and after
such a stall its deliverer hands nothing on until it knows (``Membership.settle``).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from onepiece import metrics_endpoint
from onepiece.config import Workflow
from onepiece.nm.client import Membership
from onepiece.nm.holdings import Holdings, TrackingReceiver
from onepiece.stage.deliver import ResultDeliver
from onepiece.stage.runtime import StageRuntime
from onepiece.stage.schedule_log import ScheduleLog
from onepiece.supervise import stop_on_signals
from onepiece.transport import registry

if TYPE_CHECKING:
    from onepiece.nm.zk import ZkSettings

log = logging.getLogger(__name__)


class StageMetrics:
    """Prometheus view of the current runtime's scheduler counters, read at scrape time."""

    def __init__(self, runtime: Callable[[], StageRuntime | None]) -> None:
        self.runtime = runtime

    def collect(self):
        rt = self.runtime()
        if rt is None:  # in the idle pool
            return
        s, labels = rt.stats, [rt.stage]
        for name, doc, value in (("queue_length", "requests waiting for a worker", s.queue),
                                 ("busy_workers", "workers running a request", s.busy),
                                 ("ready_workers", "workers loaded and serving", s.ready)):
            g = GaugeMetricFamily(f"onepiece_stage_{name}", doc, labels=["stage"])
            g.add_metric(labels, value)
            yield g
        c = CounterMetricFamily("onepiece_stage_requests", "requests handled by this instance", labels=["stage", "outcome"])
        for outcome in ("received", "completed", "failed", "forwarded"):
            c.add_metric([rt.stage, outcome], getattr(s, outcome))
        yield c
        c = CounterMetricFamily("onepiece_stage_worker_busy_seconds", "seconds workers held a request (over "
                                "onepiece_stage_worker_slot_seconds: utilization)", labels=["stage"])
        c.add_metric(labels, s.busy_s)
        yield c
        c = CounterMetricFamily("onepiece_stage_worker_slot_seconds", "worker slots times wall seconds", labels=["stage"])
        c.add_metric(labels, s.slot_s)
        yield c
        c = CounterMetricFamily("onepiece_stage_worker_deaths", "workers (or collaboration groups) of this instance "
                                "that died and were restarted", labels=["stage"])
        c.add_metric(labels, s.worker_deaths)
        yield c
        g = GaugeMetricFamily("onepiece_stage_service_seconds", "device seconds per request over the recent window "
                              "(at the batch sizes the stage reaches)", labels=["stage", "app"])
        for app, t in s.service.items():
            g.add_metric([rt.stage, app], t["mean_s"])
        yield g
        g = GaugeMetricFamily("onepiece_stage_resident_requests", "request states held by workers (running or paused)",
                              labels=["stage"])
        g.add_metric(labels, s.resident)
        yield g
        g = GaugeMetricFamily("onepiece_stage_resident_bytes", "what the request states held by workers take "
                              "(bounded per worker by schedule.resident_bytes)", labels=["stage"])
        g.add_metric(labels, s.resident_bytes)
        yield g
        c = CounterMetricFamily("onepiece_stage_scheduling_events", "step scheduling: requests preempted (passed over "
                                "at a chunk boundary), cancelled, expired (deadline passed), aged (served first), "
                                "late (left past the deadline they could have made here)", labels=["stage", "event"])
        for event in ("preempted", "cancelled", "expired", "aged", "late"):
            c.add_metric([rt.stage, event], getattr(s, event))
        yield c
        c = CounterMetricFamily("onepiece_stage_left_requests", "requests that left the stage, finished or expired "
                                "(late / left over a window is the SLO risk the elastic policy reads)", labels=["stage"])
        c.add_metric(labels, s.left)
        yield c
        for name, doc, h in (("queue_wait_seconds", "arrival at the stage to its first step", s.queue_wait),
                             ("step_seconds", "one forward pass of a batch (or one call)", s.step_time),
                             ("batch_size", "requests per forward pass", s.batch_size)):
            m = HistogramMetricFamily(f"onepiece_stage_{name}", doc, labels=["stage"])
            m.add_metric(labels, h.buckets(), h.total)
            yield m


class StageInstance:
    def __init__(self, member: Membership, workflow: Workflow, base_dir: Path, receiver: Any, rdir: Path,
                 holdings: Holdings, stop: threading.Event, drain_s: float,
                 schedule_log: ScheduleLog | None = None) -> None:
        self.member, self.workflow, self.base_dir = member, workflow, base_dir
        self.schedule_log = schedule_log  # what its workers run, chunk by chunk (stage/schedule_log.py)
        self.receiver, self.rdir, self.holdings, self.stop = receiver, rdir, holdings, stop
        self.drain_s = drain_s
        self.runtime: StageRuntime | None = None
        self.draining = False
        self.moved = threading.Event()  # set by the membership thread when the assignment changes
        # Forwards what arrives while no runtime reads the receiver (the idle pool).
        self._forwarder = ResultDeliver("", workflow, None, routes=lambda: member.routes,  # type: ignore[arg-type]
                                        on_sent=holdings.deliveries.add, dropped=holdings.fenced,
                                        holding=(holdings.add, holdings.discard))

    def routes_changed(self) -> None:
        """From the membership thread: a route table came (its DBs may be new to the scheduler)."""
        rt = self.runtime
        if rt is not None:
            rt.scheduler.wake.set()

    def fence(self, uids: list[str], reason: str) -> None:
        """From the membership thread: the NM declared this instance dead (``reason``) and
        reported ``uids`` failed. From now on they are not held, are dropped on arrival and are not
        handed on (holdings); the scheduler drops the queued and resident ones as cancels, which
        frees their state at the workers."""
        held = self.holdings.fence(uids)
        rt = self.runtime
        if rt is not None:
            rt.scheduler.fence(uids, reason)
        log.warning("%s fenced: %d of the %d request(s) reported failed were still held here; dropping them",
                    self.member.id, held, len(uids))

    # ---- what the heartbeat reports ----------------------------------------------------------

    def serving(self) -> str | None:
        """The stage this instance serves right now: loaded, and not moving away."""
        rt = self.runtime
        return rt.stage if rt is not None and rt.serving and not self.draining else None

    def stats(self) -> dict[str, Any]:
        rt = self.runtime
        return {**(rt.stats.report() if rt is not None else {}), "holding": self.holdings.snapshot()}

    # ---- the assignment loop -----------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                target = self.member.stage
                if self.runtime is not None and self.runtime.stage != target:
                    self._drain_and_retire(target)
                    continue  # the target may have changed again while draining
                if self.runtime is None and target is not None:
                    self._start(target)
                if self.runtime is None:
                    self._forward_stray()
                elif self.moved.wait(0.5):
                    self.moved.clear()
                self._forwarder.retry_waiting()  # strays that found no route yet (a stage came back?)
        finally:
            log.info("%s (%s) shutting down", self.member.id, self.runtime.stage if self.runtime else "idle")
            self.member.stop()  # leave the routes first, so upstream stops sending here
            if self.runtime is not None:
                self.runtime.retire()
            self._forwarder.give_up_waiting()
            self._forwarder.close()

    def _start(self, stage: str) -> None:
        # Not "serves": its workers load the models first; the NM routes to it once one is ready.
        log.info("%s starts stage %s (loading its models), data at %s", self.member.id, stage, self.receiver.address)
        spec = self.workflow.stages[stage]
        self.runtime = StageRuntime(self.member.id, stage, self.workflow, self.base_dir, self.receiver, self.rdir,
                                    self.holdings, lambda: self.member.routes, self.stop.set,
                                    settle=self.member.settle, schedule_log=self.schedule_log)
        self.runtime.start()
        self.member.set_capacity({"workers": spec.workers, "queue": spec.queue})

    def _drain_and_retire(self, target: str | None) -> None:
        rt = self.runtime
        where = target or "the idle pool"
        log.info("%s moving from %s to %s: draining", self.member.id, rt.stage, where)
        self.draining = True
        t0 = time.monotonic()
        # Senders learn the new routes within a heartbeat; until then they may still send here.
        grace = 2 * self.member.heartbeat_s
        while not self.stop.is_set():
            if self.member.stage == rt.stage:  # the move was called off: serve on
                log.info("%s stays at %s", self.member.id, rt.stage)
                self.draining = False
                return
            waited = time.monotonic() - t0
            if (waited >= grace and rt.drained()) or waited >= self.drain_s:
                break
            time.sleep(0.05)
        if self.stop.is_set():
            return  # shutting down: run()'s finally retires it
        log.info("%s drained %s in %.1fs%s; unloading", self.member.id, rt.stage, time.monotonic() - t0,
                 "" if rt.drained() else f" (gave up after drain_s={self.drain_s:.0f}s)")
        rt.retire(moving_to=where)
        self.runtime, self.draining = None, False

    def _forward_stray(self) -> None:
        """In the idle pool: hand on whatever still arrives (sent on old routes)."""
        msg = self.receiver.recv(0.2)
        if msg is None:
            return
        try:
            self._forwarder.hand_on(msg)  # (checks the message's routing fields first)
        except Exception:  # one message must not end the instance's loop
            log.exception("uid=%s: could not forward a message from %s", msg.uid, msg.sender or "?")


def serve(nm_address: str, set_name: str, listen: str = "tcp://127.0.0.1:0", stage: str | None = None,
          runtime_dir: str | None = None, advertise: str | None = None, zk: "ZkSettings | None" = None,
          idle: bool = False, name: str = "", deployment_id: str = "", schedule_log: str | None = None) -> None:
    """Run a stage instance until SIGTERM: ``stage`` is its first assignment (None: what the NM
    assigns, or with ``idle`` the idle pool); the NM may move it later. ``name``, if given,
    outlives the process: registering again under it (a restart) returns to where the NM last
    moved an instance of that name."""
    inst: StageInstance | None = None
    stop = stop_on_signals(lambda: inst and inst.moved.set())  # wakes the assignment loop at once
    rdir = Path(tempfile.mkdtemp(prefix="stage-", dir=runtime_dir))
    metrics = metrics_endpoint.start(0, registry.host_of(listen))
    # What this instance holds goes out with every heartbeat: if it dies, the NM reports those
    # requests failed (nm/reaper.py).
    holdings = Holdings()
    receiver = TrackingReceiver(registry.listen(listen), holdings)
    member = Membership(
        nm_address, "stage", set_name,
        {"data": receiver.address, "metrics": f"http://{registry.host_of(listen)}:{metrics.server_port}"},
        stage=stage, stats=lambda: inst.stats() if inst else {}, ready=lambda: bool(inst and inst.serving()),
        serving=lambda: inst.serving() if inst else None, on_assign=lambda _: inst and inst.moved.set(),
        on_routes=lambda _: inst and inst.routes_changed(),
        on_fenced=lambda uids, reason: inst.fence(uids, reason) if inst else holdings.fence(uids),
        advertise=advertise, zk=zk, idle=idle, name=name, deployment=deployment_id, deliveries=holdings.deliveries,
    )
    try:
        reply = member.register()
        inst = StageInstance(member, Workflow.model_validate(reply["workflow"]), Path(reply["base_dir"]), receiver,
                             rdir, holdings, stop, float(reply.get("drain_s", 120.0)),
                             ScheduleLog(schedule_log, member.id) if schedule_log else None)
        REGISTRY.register(StageMetrics(lambda: inst.runtime))
        if member.stage is None:
            log.info("%s joined the idle pool", member.id)
        member.start()
        inst.run()
    finally:
        member.stop()
        receiver.close()
        metrics_endpoint.stop(metrics)
        shutil.rmtree(rdir, ignore_errors=True)
