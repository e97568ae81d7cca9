"""One workflow instance (DESIGN §6): TaskManager, RequestScheduler, TaskWorkers and
ResultDeliver, wired together. The parts share no mutable state: the scheduler and the
deliverer talk through a bounded mailbox, the TaskManager reaches the scheduler through its
control queue, and routes reach the deliverer as whole-table swaps.
"""

from __future__ import annotations

import logging
import queue
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from onepiece.config import Workflow
from onepiece.nm.client import Membership
from onepiece.nm.holdings import Holdings, TrackingMailbox, TrackingReceiver
from onepiece.stage.deliver import ResultDeliver
from onepiece.stage.scheduler import RequestScheduler, SchedulerStats
from onepiece.stage.task_manager import TaskManager
from onepiece.supervise import stop_on_signals
from onepiece.transport import registry

if TYPE_CHECKING:
    from onepiece.nm.zk import ZkSettings

log = logging.getLogger(__name__)


class StageMetrics:
    """Prometheus view of the scheduler's counters, read at scrape time."""

    def __init__(self, stage: str, stats: SchedulerStats) -> None:
        self.stage, self.stats = stage, stats

    def collect(self):
        s, labels = self.stats, [self.stage]
        for name, doc, value in (("queue_length", "requests waiting for a worker", s.queue),
                                 ("busy_workers", "workers running a request", s.busy),
                                 ("ready_workers", "workers loaded and serving", s.ready)):
            g = GaugeMetricFamily(f"onepiece_stage_{name}", doc, labels=["stage"])
            g.add_metric(labels, value)
            yield g
        c = CounterMetricFamily("onepiece_stage_requests", "requests handled by this instance", labels=["stage", "outcome"])
        c.add_metric([self.stage, "received"], s.received)
        c.add_metric([self.stage, "completed"], s.completed)
        c.add_metric([self.stage, "failed"], s.failed)
        yield c
        g = GaugeMetricFamily("onepiece_stage_service_seconds", "mean service time over the recent window", labels=["stage", "app"])
        for app, t in s.service.items():
            g.add_metric([self.stage, app], t["mean_s"])
        yield g


def serve(nm_address: str, set_name: str, listen: str = "tcp://127.0.0.1:0", stage: str | None = None,
          runtime_dir: str | None = None, advertise: str | None = None, zk: "ZkSettings | None" = None) -> None:
    stop = stop_on_signals()
    rdir = Path(tempfile.mkdtemp(prefix="stage-", dir=runtime_dir))
    metrics, _ = start_http_server(0, addr=registry.host_of(listen))
    # What this instance holds goes out with every heartbeat: if it dies, the NM reports those
    # requests failed (nm/reaper.py).
    holdings = Holdings()
    receiver = TrackingReceiver(registry.listen(listen), holdings)
    stats = SchedulerStats()
    member = Membership(
        nm_address, "stage", set_name,
        {"data": receiver.address, "metrics": f"http://{registry.host_of(listen)}:{metrics.server_port}"},
        stage=stage, stats=lambda: {**vars(stats), "holding": holdings.snapshot()}, ready=lambda: stats.serving,
        advertise=advertise, zk=zk,
    )
    reply = member.register()
    workflow = Workflow.model_validate(reply["workflow"])
    my_stage = reply["stage"]
    if my_stage is not None:
        spec = workflow.stages[my_stage]
        member.set_capacity({"workers": spec.workers, "queue": spec.queue})
    member.start()
    try:
        if my_stage is None:
            log.info("%s joined the idle pool", member.id)
            stop.wait()
            return
        log.info("%s serves stage %s, data at %s", member.id, my_stage, receiver.address)
        _run_stage(member, my_stage, workflow, Path(reply["base_dir"]), receiver, rdir, stats, stop, holdings)
    finally:
        member.stop()
        receiver.close()
        metrics.shutdown()
        shutil.rmtree(rdir, ignore_errors=True)


def _run_stage(member: Membership, stage: str, workflow: Workflow, base_dir: Path, receiver, rdir: Path,
               stats: SchedulerStats, stop: threading.Event, holdings: Holdings | None = None) -> None:
    mailbox: queue.Queue = TrackingMailbox(1024, holdings) if holdings is not None else queue.Queue(maxsize=1024)
    scheduler = RequestScheduler(stage, receiver, f"ipc://{rdir}/workers.sock", workflow.stages[stage].queue,
                                 mailbox, stats)
    deliver = ResultDeliver(stage, workflow, mailbox, routes=lambda: member.routes)
    tm = TaskManager(member.id, stage, workflow, base_dir, scheduler)
    REGISTRY.register(StageMetrics(stage, stats))
    deliver_stop = threading.Event()

    def part(name: str, fn, until: threading.Event) -> threading.Thread:
        def run() -> None:
            try:
                fn(until)
            except Exception:
                # A part that died would leave the instance routed but deaf: stop the whole
                # instance instead, so the NM drops it and the launcher restarts it.
                log.exception("%s of %s died; stopping the instance", name, member.id)
                stop.set()
                deliver_stop.set()
        return threading.Thread(target=run, name=name)

    threads = {
        "scheduler": part("scheduler", scheduler.run, stop),
        "task-manager": part("task-manager", tm.supervise, stop),
        "deliver": part("deliver", deliver.run, deliver_stop),
    }
    tm.start()
    for t in threads.values():
        t.start()
    try:
        stop.wait()
    finally:
        log.info("%s (%s) shutting down", member.id, stage)
        member.stop()  # leave the routes first, so upstream stops sending here
        threads["scheduler"].join(timeout=10)
        threads["task-manager"].join(timeout=10)
        tm.stop()
        scheduler.close()  # fails what is still queued, through the deliverer
        deliver_stop.set()
        threads["deliver"].join(timeout=30)
        deliver.close()
