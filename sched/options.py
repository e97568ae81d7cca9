"""A stage's scheduling options, as the workflow YAML gives them (``stages.<name>.schedule``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

POLICIES = ("fcfs", "fcfs-batched", "srtf", "edf", "slo", "edf-best-fit", "ddit")  # one class each in sched/policies.py
# Policies that serve earlier deadlines first: a new request waits only for the requests ahead of
# it with earlier deadlines (what the request monitor's deadline rule reads; proxy/admission.py).
DEADLINE_ORDERED = frozenset({"edf", "slo", "edf-best-fit"})


class ScheduleSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: Literal["fcfs", "fcfs-batched", "srtf", "edf", "slo", "edf-best-fit", "ddit"] = Field(
        "fcfs", description="fcfs: each request alone from first step to last (batch 1); fcfs-batched: continuous "
                            "batching in arrival order; srtf: least remaining work first; edf: earliest deadline "
                            "first; slo: the most deadlines met (the largest set that can all make theirs, earliest deadline "
                            "first; the rest in the time left), batches that keep deadlines, and on a collaboration "
                            "group the DoP of each; edf-best-fit: GF-DiT's EDF with the smallest DoP that meets a "
                            "deadline; ddit: DDiT's greedy DoP allocation with a starvation guard")
    max_batch: int | None = Field(None, ge=1, le=64, description="requests per forward pass (default 1 for fcfs, "
                                                                  "else 4)")
    chunk_steps: int = Field(0, ge=0, le=1000, description="steps a batch runs between two decisions (0: the "
                                                            "fewest that keep decision and IPC under 3% of a chunk)")
    resident_bytes: int = Field(1 << 30, gt=0, description="bound on the request states a worker keeps resident")
    # 10, not 4: aged requests go first in arrival order, so a bound that short requests reach
    # under an ordinary queue (4 x 0.7 s) turns every policy into fcfs exactly when it matters
    # (bench sched's 1.2x trace on the simulator: slo meets 90% of SLOs with 4, 97% with 10 or none).
    aging: float = Field(10.0, gt=0, le=1000, description="a request in the stage for longer than this many times "
                                                           "its standalone time runs before any that is not: no "
                                                           "policy can starve it")
    drop_expired: bool = Field(True, description="drop a request whose deadline passed and mark it failed")
    costs: str | None = Field(None, description="a cost table from `onepiece profile` to start from (measurements "
                                                "replace it key by key)")

    @model_validator(mode="after")
    def _batch(self) -> "ScheduleSpec":
        if self.policy == "fcfs":
            if self.max_batch not in (None, 1):
                raise ValueError("max_batch: fcfs runs every request alone (batch 1); use fcfs-batched to batch")
            self.max_batch = 1
        elif self.max_batch is None:
            self.max_batch = 4
        return self
