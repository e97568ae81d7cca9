"""What members report with their heartbeats, as the NM checks it before using it.

A stage instance's figures (``stats``): the stage side writes them (stage/stats.py,
stage/service_times.py); the NM computes capacity and the request monitor's view from them
(nm/capacity.py). A report that does not match is not stored: one malformed heartbeat must not
break every later capacity estimate. Only the fields the NM computes with are checked; the rest
(histograms, costs) is shown by `onepiece status` as it came.

What a stage instance or a proxy handed to which instance lately (``DELIVERED``, written by
nm/holdings.py's ``Deliveries``): the NM reports those failed too if their receiver dies before
its own heartbeat names them (nm/deliveries.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from onepiece.schema import problem

Count = Annotated[int, Field(ge=0, strict=True)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Shapes = Annotated[dict[Annotated[str, Field(max_length=256)], Seconds], Field(max_length=1024)]

DELIVERED = "delivered"  # heartbeat field: {receiver's data address: [[uid, seconds ago], ...]}
Delivered = TypeAdapter(Annotated[
    dict[Annotated[str, Field(max_length=512)],
         Annotated[list[tuple[Annotated[str, Field(min_length=1, max_length=128)],
                              Annotated[float, Field(ge=0, allow_inf_nan=False)]]], Field(max_length=1024)]],
    Field(max_length=1024)])  # as many receivers as deliveries: a report never holds more (nm/holdings.py)


class AppService(BaseModel):
    """Measured service times of one application (``ServiceTimes.report``)."""

    model_config = ConfigDict(extra="allow")

    mean_s: Seconds
    recent: Count = 0
    shapes: Shapes = Field(default_factory=dict)
    shares: Shapes = Field(default_factory=dict)


class StageStats(BaseModel):
    model_config = ConfigDict(extra="allow")

    ready: Count = 0
    queue: Count = 0
    workers: Count = 0
    policy: Annotated[str, Field(max_length=64)] = ""
    # Cumulative seconds workers ran and worker slots existed: the NM's utilization (nm/utilization.py).
    busy_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    slot_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    # Cumulative requests that left and, of those, late ones: the elastic policy's SLO risk.
    left: Count = 0
    late: Count = 0
    service: Annotated[dict[str, AppService], Field(max_length=256)] = Field(default_factory=dict)
    # The GPUs its workers run on (NVML UUIDs): stages that share one share its time.
    gpus: Annotated[list[Annotated[str, Field(min_length=1, max_length=96)]], Field(max_length=64)] = \
        Field(default_factory=list)


def stage_stats_problem(stats: Any) -> str | None:
    """None if a stage's heartbeat stats may be used, else the field and what is wrong."""
    return problem(StageStats, stats, "stats")


def delivered_of(value: Any) -> dict[str, list[tuple[str, float]]] | None:
    """A heartbeat's ``DELIVERED`` report as the NM uses it; None if it is malformed."""
    try:
        return Delivered.validate_python(value)
    except ValidationError:
        return None
