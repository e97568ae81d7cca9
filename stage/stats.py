"""What a stage instance's scheduler counts: sent with every heartbeat (JSON), read by
`onepiece status`, the NM's capacity view and the instance's /metrics."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Histogram:
    """Cumulative counts per upper bound (Prometheus' shape), JSON-able."""

    bounds: list[float]
    counts: list[int] = field(default_factory=list)  # one per bound, then +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, x)] += 1
        self.total += x

    @property
    def n(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs, +Inf last."""
        out, run = [], 0
        for b, c in zip([*map(str, self.bounds), "+Inf"], self.counts):
            run += c
            out.append((b, run))
        return out


SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
BATCH = [1, 2, 3, 4, 6, 8, 12, 16, 32, 64]


@dataclass
class SchedulerStats:
    queue: int = 0  # requests waiting for a worker (no state anywhere yet)
    capacity: int = 0
    workers: int = 0
    ready: int = 0
    busy: int = 0  # workers executing a step chunk now
    resident: int = 0  # request states held by workers (running or paused)
    resident_bytes: int = 0  # what those states take, as the workers measured them (bound: schedule.resident_bytes)
    # Set once a worker first loaded, and kept while workers restart, so the NM keeps routing
    # here: requests wait in the bounded queue for the restart instead of failing upstream.
    serving: bool = False
    worker_error: str = ""  # why a worker last failed to start ("" once one is ready)
    worker_deaths: int = 0  # workers (or collaboration groups) that died and were restarted
    received: int = 0
    completed: int = 0
    failed: int = 0
    rejected_frames: int = 0
    forwarded: int = 0
    # Step scheduling (sched/core.py): its policy and what it did.
    policy: str = ""
    max_batch: int = 1
    preempted: int = 0
    cancelled: int = 0
    expired: int = 0
    aged: int = 0
    left: int = 0  # requests that left (finished or expired) and, of those, late ones (sched.core.CoreStats)
    late: int = 0
    refused: int = 0  # plans of its policy that the core refused (sched/core.py), and why the last one
    last_refused: str = ""
    batches: int = 0
    batched: int = 0  # requests over all batches: batched / batches is the mean batch size
    overhead_ms: float = 0.0  # decision + IPC per chunk (measured)
    overhead_total: list = field(default_factory=lambda: [0.0, 0])  # [seconds, chunks] of it since the start
    busy_s: float = 0.0  # cumulative seconds workers ran a chunk, summed over workers
    slot_s: float = 0.0  # cumulative seconds of worker slots (workers x wall time)
    gpu_util: float | None = None  # NVML, where the workers run on GPUs (stage/gpu.py)
    gpus: list[str] = field(default_factory=list)  # their NVML UUIDs: the NM sees which stages share one
    # measured service times: {app: {"mean_s", "recent", "shapes": {shape: standalone s}, "shares": {shape: share s}}}
    service: dict[str, dict] = field(default_factory=dict)
    costs: dict[str, dict[str, float]] = field(default_factory=dict)  # {key: {batch: seconds per step}}
    # sums since the start: {"steps": {key: {batch: [seconds, steps]}}, "fixed": {key: [seconds, requests]}}
    cost_totals: dict[str, dict] = field(default_factory=dict)
    queue_wait: Histogram = field(default_factory=lambda: Histogram(SECONDS))  # arrival -> first step
    step_time: Histogram = field(default_factory=lambda: Histogram(SECONDS))  # one forward pass
    batch_size: Histogram = field(default_factory=lambda: Histogram(BATCH))

    def report(self) -> dict[str, Any]:
        """The heartbeat's view (plain JSON)."""
        out = dict(vars(self))
        for k in ("queue_wait", "step_time", "batch_size"):
            h = out[k]
            out[k] = {"bounds": h.bounds, "counts": list(h.counts), "sum": h.total}
        return out
