"""The header of a workflow message (DESIGN §3) as a stage checks it before it trusts it: the
proxy writes it, every stage reads it, and a message that reaches a stage by any path (not only
through the proxy) is checked the same way. The application's own limits on ``params`` are
checked next, by the workflow (``Application.check_params``)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from onepiece.schema import Name

Ns = Annotated[StrictInt, Field(ge=0, le=1 << 63)]  # ns since the epoch


class Routed(BaseModel):
    """What it takes to pass a message on to another stage: the uid, the application, the stage
    it is going to and how often it was forwarded already."""

    model_config = ConfigDict(extra="allow")

    uid: Name
    app: Name
    stage: Name
    hops: Annotated[StrictInt, Field(ge=0, le=64)] = 0


class TaskHeader(Routed):
    """What the scheduler reads of a data message's header."""

    params: dict[str, Any]
    deadline: Ns | None = None  # where the request fails
    target: Ns | None = None  # its slo_s, what policies schedule for (default: deadline)
    priority: StrictInt = Field(0, ge=-1000, le=1000)
    # Per stage: seconds the stages after it need alone (the proxy's view): this stage aims to
    # be done that much before the request's deadline.
    reserve: dict[str, Annotated[float, Field(ge=0, le=86_400, allow_inf_nan=False)]] = Field(default_factory=dict,
                                                                                              max_length=64)
    # Each stage adds its points; the DB keeps at most 1024 (db.protocol.RecordSchema).
    trace: list[dict[str, Any]] = Field(default_factory=list, max_length=512)

    def held_to(self, now_ns: int, timeout_s: float) -> int:
        """The deadline a stage holds the request to: its own, but never later than the
        application's timeout from now, so that no request (one without a deadline, or one that
        reached the stage past the proxy with a far one) can hold a worker forever; the proxy's
        deadline is never later than that."""
        longest = now_ns + int(timeout_s * 1e9)
        return longest if self.deadline is None or self.deadline > longest else self.deadline
