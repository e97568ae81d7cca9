"""What an instance runs for one stage assignment (DESIGN §6): its RequestScheduler, its
TaskManager with the workers (the stage's models), and its ResultDeliver, on their threads.

An instance keeps its data receiver for life and runs one StageRuntime at a time; when the NM
moves it (nm/elastic.py) the old runtime is retired once it drained and a new one loads the
new stage's models (stage/instance.py). The parts share no mutable state: the scheduler and
the deliverer talk through a bounded mailbox, the TaskManager reaches the scheduler through
its control queue, and routes reach the deliverer as whole-table swaps.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from pathlib import Path
from typing import Any, Callable

from onepiece.config import Workflow
from onepiece.nm.holdings import Holdings
from onepiece.stage.deliver import ResultDeliver
from onepiece.stage.schedule_log import ScheduleLog
from onepiece.stage.scheduler import RequestScheduler
from onepiece.stage.stats import SchedulerStats
from onepiece.stage.task_manager import TaskManager

log = logging.getLogger(__name__)

_sockets = itertools.count()  # each runtime binds its own worker socket


class StageRuntime:
    def __init__(self, instance: str, stage: str, workflow: Workflow, base_dir: Path, receiver: Any, rdir: Path,
                 holdings: Holdings, routes: Callable[[], dict], on_fatal: Callable[[], None],
                 settle: Callable[[], Any] = lambda: None, schedule_log: ScheduleLog | None = None) -> None:
        self.instance, self.stage = instance, stage
        self.stats = SchedulerStats()
        self.mailbox: queue.Queue = queue.Queue(1024)
        self.scheduler = RequestScheduler(stage, receiver, f"ipc://{rdir}/workers-{next(_sockets)}.sock",
                                          workflow, self.mailbox, self.stats, routes,
                                          costs=workflow.cost_table(stage, base_dir),
                                          fixed=workflow.cost_fixed(stage, base_dir), schedule_log=schedule_log)
        self.deliver = ResultDeliver(stage, workflow, self.mailbox, routes=routes, on_sent=holdings.deliveries.add,
                                     holding=(holdings.add, holdings.discard),
                                     dropped=holdings.fenced, settle=settle,  # fencing: nm/fencing.py
                                     cancelled=self.scheduler.is_cancelled)
        self.tm = TaskManager(instance, stage, workflow, base_dir, self.scheduler)
        self._on_fatal = on_fatal
        self._stop = threading.Event()  # scheduler and TaskManager
        self._deliver_stop = threading.Event()  # the deliverer stops last, once the mailbox is empty
        self._threads = {
            "scheduler": self._part("scheduler", self.scheduler.run, self._stop),
            "task-manager": self._part("task-manager", self.tm.supervise, self._stop),
            "deliver": self._part("deliver", self.deliver.run, self._deliver_stop),
        }

    def _part(self, name: str, fn: Callable[[threading.Event], None], until: threading.Event) -> threading.Thread:
        def run() -> None:
            try:
                fn(until)
            except Exception:
                # A part that died would leave the instance routed but deaf: stop the whole
                # instance instead, so the NM drops it and the launcher restarts it.
                log.exception("%s of %s (%s) died; stopping the instance", name, self.instance, self.stage)
                self._on_fatal()
        return threading.Thread(target=run, name=f"{name}-{self.stage}")

    def start(self) -> None:
        self.tm.start()
        for t in self._threads.values():
            t.start()

    @property
    def serving(self) -> bool:
        """A worker has loaded the stage's models (kept while workers restart)."""
        return self.stats.serving

    def drained(self) -> bool:
        """Nothing queued, at a worker, or waiting to be delivered (a hint: other threads run)."""
        return self.scheduler.idle_now and self.mailbox.empty() and not self.deliver.waiting

    def retire(self, moving_to: str | None = None) -> None:
        """Stop the workers (unloading the models) and the scheduler, then deliver what is
        left: on shutdown (``moving_to`` None) everything still here fails with the reason;
        on a move the queue is forwarded to the stage's other instances."""
        self._stop.set()
        self.scheduler.wake.set()
        self._threads["scheduler"].join(timeout=10)
        self._threads["task-manager"].join(timeout=10)
        self.tm.stop()
        self.scheduler.close(moving_to)
        self._deliver_stop.set()
        self.deliver.wake()
        self._threads["deliver"].join(timeout=30)
        self.deliver.close()
