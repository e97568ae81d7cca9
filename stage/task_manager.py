"""The TaskManager (DESIGN §6): starts and supervises one TaskWorker process per worker slot of
its stage, and restarts a worker that dies (its request is failed by the scheduler, with the
reason). Where the workers run on GPUs it samples their utilization (stage/gpu.py). Restarts back off (onepiece.supervise.Backoff), so a worker
that cannot start does not spin.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from onepiece.config import Workflow
from onepiece.stage.gpu import GpuUtilization, cuda_indices, worker_device
from onepiece.stage.rendezvous import rendezvous
from onepiece.stage.scheduler import RequestScheduler
from onepiece.supervise import Backoff, child_preexec

log = logging.getLogger(__name__)

# libgomp's threads (torch's CPU pool) spin this many turns after a parallel region before they
# sleep. Its default (300,000, milliseconds of spinning) suits one process that owns the cores;
# here every stage's worker has its own pool, and a stage that just finished kept spinning
# while the next stage computed on the same cores. A short spin still bridges the regions of one
# forward pass. `onepiece bench e2e` measured both (README); a user's own setting wins.
GOMP_SPINCOUNT = "30000"


def worker_env() -> dict[str, str]:
    return {"GOMP_SPINCOUNT": GOMP_SPINCOUNT, **os.environ}


def group_down_reason(dead: list[tuple[int, int]], alive: dict[int, str]) -> str:
    """Why a collaboration group went down: its ranks that exited (``(rank, return code)``), a
    rank killed by a signal first (the cause: its peers then fail their collectives and exit).
    When none was killed, the ranks still running (``alive``: rank -> process state) are the
    likely cause: a rank that stops answering (stopped, hung) makes its peers' collectives time
    out, and they exit with an error while it lives on."""
    dead = sorted(dead, key=lambda d: (d[1] >= 0, d[0]))
    reason = "collaboration group down: " + ", ".join(
        f"rank {i} " + (f"exit code {code}" if code >= 0 else f"killed by signal {-code}") for i, code in dead)
    if alive and all(code >= 0 for _, code in dead):
        reason += "; still running, not answering its peers: " + ", ".join(
            f"rank {i}" + (f" ({state})" if state else "") for i, state in sorted(alive.items()))
    return reason


def proc_state(pid: int) -> str:
    """A process's state as ``/proc`` names it ("stopped", "sleeping", ...); "" if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return PROC_STATES.get(stat[stat.rindex(")") + 2], "")
    except (OSError, ValueError, IndexError):
        return ""


PROC_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible wait", "T": "stopped", "t": "stopped by a tracer",
               "Z": "exited, not reaped"}


@dataclass
class WorkerSlot:
    identity: str
    proc: subprocess.Popen | None = None
    next_start: float = 0.0
    backoff: Backoff = field(default_factory=Backoff)


class TaskManager:
    def __init__(self, instance: str, stage: str, workflow: Workflow, base_dir: Path, scheduler: RequestScheduler) -> None:
        spec = workflow.stages[stage]
        self.instance, self.stage, self.scheduler = instance, stage, scheduler
        kinds = {app: a.kind for app, a in workflow.applications.items() if stage in a.stages}
        self.config = {
            "instance": instance, "stage": stage, "function": workflow.function_of(stage), "kinds": kinds,
            "model_dir": str(workflow.model_path(spec.model, base_dir)), "components": spec.components,
            "device": spec.device, "threads": spec.threads, "scheduler": scheduler.worker_address,
        }
        self.slots = [WorkerSlot(f"w{i}") for i in range(spec.workers)]
        # Collaboration: the workers are the ranks of one group, which the scheduler sees as one
        # worker (rank 0's "w0"); a rank that dies takes the whole group down and back up.
        self.group = spec.mode == "collaboration" and spec.workers > 1
        scheduler.stats.workers = 1 if self.group else spec.workers
        self.gpu = GpuUtilization(cuda_indices(spec.device, spec.workers))
        scheduler.stats.gpus = self.gpu.uuids

    def _start(self, slot: WorkerSlot, group: dict | None = None) -> None:
        config = dict(self.config, identity=slot.identity, group=group,
                      device=worker_device(self.config["device"], self.slots.index(slot), len(self.slots)))
        slot.backoff.started_now()
        slot.proc = subprocess.Popen(
            [sys.executable, "-m", "onepiece.stage.worker", orjson.dumps(config).decode()],
            preexec_fn=child_preexec, env=worker_env(),
        )
        log.info("started worker %s (pid %d) for stage %s", slot.identity, slot.proc.pid, self.stage)

    def start(self) -> None:
        if self.group:
            self._start_group()
            return
        for slot in self.slots:
            self._start(slot)

    def _start_group(self) -> None:
        # Beside the workers' socket, in the instance's private folder.
        address = rendezvous(Path(self.scheduler.worker_address.removeprefix("ipc://")).parent)
        for rank, slot in enumerate(self.slots):
            self._start(slot, {"rank": rank, "size": len(self.slots), "address": address})

    def _supervise_group(self, now: float) -> None:
        lead = self.slots[0]
        dead = [(i, s.proc.returncode) for i, s in enumerate(self.slots) if s.proc is not None and s.proc.poll() is not None]
        if dead:
            reason = group_down_reason(dead, {i: proc_state(s.proc.pid) for i, s in enumerate(self.slots)
                                              if s.proc is not None and s.proc.poll() is None})
            log.warning("worker group of stage %s is down (%s); restarting it", self.stage, reason)
            self._stop_procs([s.proc for s in self.slots if s.proc is not None and s.proc.poll() is None], 0.0)
            for s in self.slots:
                s.proc = None
            self.scheduler.worker_died(lead.identity.encode(), reason, now)
            lead.next_start = lead.backoff.next_start()
        if lead.proc is None and now >= lead.next_start:
            self._start_group()

    def supervise(self, stop: threading.Event) -> None:
        sampled = 0.0
        while not stop.wait(0.2):
            now = time.monotonic()
            if now - sampled >= 1.0:
                self.scheduler.stats.gpu_util = self.gpu.sample()
                sampled = now
            self._kill_hung()
            if self.group:
                self._supervise_group(now)
                continue
            for slot in self.slots:
                if slot.proc is not None and slot.proc.poll() is not None:
                    code = slot.proc.returncode
                    reason = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
                    log.warning("worker %s of stage %s died (%s); restarting", slot.identity, self.stage, reason)
                    self.scheduler.worker_died(slot.identity.encode(), reason, time.monotonic())
                    slot.proc = None
                    slot.next_start = slot.backoff.next_start()
                if slot.proc is None and now >= slot.next_start:
                    self._start(slot)

    def _kill_hung(self) -> None:
        while True:
            try:
                ident = self.scheduler.hung.get_nowait().decode()
            except queue.Empty:
                return
            for slot in self.slots:
                if (slot.identity == ident or self.group) and slot.proc is not None:
                    log.warning("killing hung worker %s of stage %s", slot.identity, self.stage)
                    slot.proc.kill()

    def stop(self, grace_s: float = 5.0) -> None:
        self._stop_procs([s.proc for s in self.slots if s.proc is not None], grace_s)

    @staticmethod
    def _stop_procs(procs: list[subprocess.Popen], grace_s: float) -> None:
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
