"""What a stage's workers report to its scheduler (the protocol in stage/worker.py), as the
scheduler checks it: the channel is a private ipc socket, but a report that does not match (a
worker bug) is dropped with its reason rather than trusted."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from onepiece.schema import Name

Uid = Name
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class _Report(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Ready(_Report):
    stepped: Annotated[dict[Annotated[StrictStr, Field(max_length=128)], StrictBool], Field(max_length=256)]
    ranks: Annotated[int, Field(ge=1, le=1024, strict=True)] = 1  # a collaboration group's size


class Broken(_Report):
    error: Annotated[StrictStr, Field(max_length=1 << 16)]  # why it cannot start (it exits)


class Admitted(_Report):
    uid: Uid
    nbytes: Annotated[int, Field(ge=0, strict=True)]


class Progress(_Report):
    uid: Uid
    fraction: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]


class Failed(_Report):
    uid: Uid
    error: Annotated[StrictStr, Field(max_length=1 << 16)]


class Idle(_Report):
    steps: list[tuple[list[Uid], Seconds]]  # each step of the chunk: its batch and its time
    fixed: dict[Uid, Seconds]  # seconds preparing and finishing, per request
    exec_s: Seconds


REPORTS: dict[bytes, type[_Report]] = {b"ready": Ready, b"broken": Broken, b"admitted": Admitted,
                                       b"progress": Progress, b"failed": Failed, b"idle": Idle}
