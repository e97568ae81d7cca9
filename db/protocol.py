"""What travels to and from a DB instance: the contract between stages, proxies and DBs.

Writes arrive on the DB's data address (any transport) as messages whose header ``kind`` is:

- ``status``: ``{uid, kind, status: queued|in_progress, stage, progress}`` (progress 0-100);
- ``result``: ``{uid, kind, trace, content_type}`` with part ``content`` (the artefact);
- ``failed``: ``{uid, kind, stage, error}``;
- ``replica``: ``{uid, kind, record}`` (+ ``content`` part if any): a peer's copy;
- ``purge``: ``{uid, kind}``: a peer dropped the record (deleted, or fetched with no grace);
- ``fetched``: ``{uid, kind, expires_at}``: a peer served the result; the copy expires by then;
- ``hello``: ``{uid, kind, control}``: a DB (re)started and found this one among its peers
  (``uid`` is its random incarnation, ``control`` its control address): this DB fills it with
  the records placement gives it (``db/server.py``), as ``replica`` messages.

Reads and the proxy's synchronous ``create`` go to the DB's control address (RPC ops, see
``db/server.py``): ``create``, ``get``, ``content``, ``delete``, ``list``, ``stats``, and ``state``
and ``running`` (where requests are, for the NM). Reads, deletes and lists may name an
``owner`` (the key tag the record was created with): a record of another owner is then "not
found", so its id leaks nothing.
Terminal transitions are published on the DB's events address as ``[b"done", json]``.

A record is a JSON object; ``merge`` makes replicas converge whatever order updates arrive in.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from onepiece.schema import Name, problem

QUEUED, IN_PROGRESS, COMPLETED, FAILED = "queued", "in_progress", "completed", "failed"
TERMINAL = frozenset({COMPLETED, FAILED})
_RANK = {QUEUED: 0, IN_PROGRESS: 1, COMPLETED: 2, FAILED: 2}

CONTENT = "content"  # the part name of a final artefact


# Fields that say where a request stands; every other field (app, set, deadline, params...)
# is identity, which may fill a gap even from an update that is otherwise stale.
STATUS_FIELDS = frozenset(
    {"uid", "status", "stage", "progress", "created_at", "updated_at", "completed_at",
     "expires_at", "error", "content_type", "bytes", "trace"}
)


# A time since the epoch: bounded (year 2286), so that no peer can make a record live for ever.
Seconds = Annotated[float, Field(ge=0, le=1e10, allow_inf_nan=False, strict=False)]


class RecordSchema(BaseModel):
    """What a record must look like before a DB stores it as a peer's copy: a replica carries
    timestamps this DB's timers compare (a string ``expires_at`` once broke every later sweep),
    so its types are checked, not trusted. Other fields (params, deadline...) pass through."""

    model_config = ConfigDict(extra="allow")

    uid: Name
    status: Literal["queued", "in_progress", "completed", "failed"]
    app: StrictStr | None = None
    set: StrictStr | None = None
    stage: StrictStr | None = None
    progress: Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)] | None = None
    created_at: Seconds | None = None
    updated_at: Seconds | None = None
    completed_at: Seconds | None = None
    expires_at: Seconds | None = None
    deadline: StrictInt | None = None  # ns since the epoch
    error: StrictStr | None = None
    content_type: StrictStr | None = Field(None, max_length=256)
    bytes: StrictInt = Field(0, ge=0)
    trace: list[dict[str, Any]] | None = Field(None, max_length=1024)
    owner: StrictStr | None = Field(None, max_length=64)  # the creator's key tag (proxy/keys.py)
    request_hash: StrictStr | None = Field(None, max_length=128)  # an idempotent create's body digest
    handed: StrictBool | None = None  # its proxy handed an idempotent create over (proxy/idempotency.py)


MAX_PAGE = 100  # records per list page, as the OpenAI API bounds its pages
Owner = Annotated[StrictStr, Field(min_length=1, max_length=64)]


class ListArgs(BaseModel):
    """The arguments of the ``list`` op, checked before any is used (a request is untrusted)."""

    model_config = ConfigDict(extra="forbid")

    owner: Owner | None = None  # None: every record of this DB
    after: tuple[Annotated[float, Field(strict=True, allow_inf_nan=False)],
                 Name] | None = None  # (created_at, uid)
    limit: Annotated[StrictInt, Field(ge=1, le=MAX_PAGE)] = 20
    order: Literal["asc", "desc"] = "desc"


# ---- what a DB accepts, checked before any field is used ------------------------------------

Uid = Name
Label = Annotated[StrictStr, Field(max_length=128)]  # an application, set or stage name


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NewRecord(RecordSchema):
    """A record as the proxy creates it: not finished, ``queued`` unless it says otherwise."""

    status: Literal["queued", "in_progress"] = QUEUED


class CreateArgs(_Args):
    """``create``: the record (checked again by the store, which fills its defaults) and ``if_absent``."""

    record: NewRecord
    if_absent: StrictBool = False


class UidArgs(_Args):
    """``get`` and ``content``."""

    uid: Uid
    owner: Owner | None = None


class DeleteArgs(UidArgs):
    forget: StrictBool = False


class NoArgs(_Args):
    """``stats`` and ``ping``."""


MAX_RUNNING = 4096  # records one ``running`` answer lists (the NM looks again soon)


class RunningArgs(_Args):
    """``running``: the records not finished yet that were created before ``before`` (seconds
    since the epoch), oldest first: what the NM's sweep for unheld requests reads (nm/orphans.py)."""

    before: Seconds
    limit: Annotated[StrictInt, Field(ge=1, le=MAX_RUNNING)] = MAX_RUNNING


RPC_SCHEMAS: dict[str, type[BaseModel]] = {
    "create": CreateArgs, "get": UidArgs, "content": UidArgs, "delete": DeleteArgs, "list": ListArgs,
    "state": UidArgs, "stats": NoArgs, "ping": NoArgs, "handed": UidArgs, "running": RunningArgs,
}
# What only the proxies of the DB's set may do (with CURVE, by the key a client proved;
# transport/rpc.py): users' records hold their prompts and results. Other members see where a
# request is (``state``: its app, status and stage, what the NM's reaper needs) and the figures.
PROXY_OPS = ("create", "get", "content", "delete", "list", "handed")


class _Report(BaseModel):
    """A data message's header. Stages send their whole header on (``result``), so unknown
    fields pass; identity that fills a record's gaps is typed."""

    model_config = ConfigDict(extra="allow", frozen=True)

    uid: Uid
    app: Label | None = None
    set: Label | None = None


class StatusReport(_Report):
    kind: Literal["status"]
    status: Literal["queued", "in_progress"]
    stage: Label | None = None
    progress: Annotated[StrictInt, Field(ge=0, le=100)] = 0  # whole percent, as progress_of gives
    deadline: StrictInt | None = None  # ns since the epoch


class ResultReport(_Report):
    kind: Literal["result"]
    content_type: StrictStr | None = Field(None, max_length=256)
    trace: list[dict[str, Any]] | None = Field(None, max_length=1024)


class FailedReport(_Report):
    kind: Literal["failed"]
    stage: Label | None = None
    # Any length a header holds (transport.message.MAX_HEADER_BYTES): a failure is never refused
    # for its text, which the store cuts to its first MAX_ERROR_CHARS.
    error: StrictStr | None = None


class ReplicaMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["replica"]
    uid: Uid
    record: RecordSchema

    @model_validator(mode="after")
    def _one_uid(self) -> "ReplicaMessage":
        if self.record.uid != self.uid:  # the header routes it, the record is stored: one request
            raise ValueError(f"record.uid {self.record.uid!r} is not the message's uid {self.uid!r}")
        return self


class PurgeMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["purge"]
    uid: Uid
    forget: StrictBool = False


class FetchedMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["fetched"]
    uid: Uid
    expires_at: Seconds


class HelloMessage(BaseModel):
    """A new DB process greets a peer. ``control`` only names it among the peers the NM gave this
    DB: records go to the data address that list holds, never to one a message names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["hello"]
    uid: Uid  # the sender's incarnation: every message has a uid
    control: StrictStr = Field(min_length=1, max_length=512)


DATA_SCHEMAS: dict[str, type[BaseModel]] = {
    "status": StatusReport, "result": ResultReport, "failed": FailedReport, "replica": ReplicaMessage,
    "purge": PurgeMessage, "fetched": FetchedMessage, "hello": HelloMessage,
}


def check_record(record: Any) -> str | None:
    """None if ``record`` may be stored, else what is wrong with it (field: reason)."""
    return problem(RecordSchema, record)


# What a failure sets, all of it from one of two failures (a local ``fail`` sets each of them).
FAILURE_FIELDS = ("stage", "error", "updated_at", "expires_at", "completed_at")


def _failure(rec: dict[str, Any]) -> tuple[float, str, str]:
    """What orders two failures of one request: when (a DB's clock), then the reason, then the stage."""
    at = rec.get("completed_at")
    return (at if isinstance(at, (int, float)) else math.inf, str(rec.get("error") or ""), str(rec.get("stage") or ""))


def _progress(rec: dict[str, Any]) -> int:
    p = rec.get("progress")
    return p if isinstance(p, int) else 0


def merge(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The record after applying update ``new`` to ``old`` (both JSON records).

    Replicas converge whatever order updates reach them in (a property test checks it):
    1. a record never moves back in status rank, and a report with the same non-terminal
       status but lower (progress, stage) is stale and ignored;
    2. ``completed`` beats ``failed``: if one replica's deadline sweep failed a request while
       another received its artefact, the artefact exists, so both end completed;
    3. identity fields fill gaps even from a stale update, and progress is the highest seen;
    4. of two failures, the earlier one (then the smaller text) holds, with its status fields:
       keeping whichever arrived first left a DB's own deadline verdict on one copy and the
       stage's reason on the other.
    """
    if new.get("status") not in _RANK:
        raise ValueError(f"unknown status {new.get('status')!r}")
    if old is None:
        return dict(new)
    both_failed = old["status"] == FAILED and new["status"] == FAILED
    if old["status"] == FAILED and new["status"] == COMPLETED:
        out = {**old, **{k: v for k, v in new.items() if v is not None}, "error": None}
    elif both_failed and _failure(new) < _failure(old):
        out = {**old, **{k: v for k, v in new.items() if v is not None}, **{k: new.get(k) for k in FAILURE_FIELDS}}
    elif (old["status"] in TERMINAL or _RANK[new["status"]] < _RANK[old["status"]]
          or (new["status"] == old["status"]
              and (_progress(new), new.get("stage") or "") < (_progress(old), old.get("stage") or ""))):
        out = dict(old)
    else:
        out = {**old, **{k: v for k, v in new.items() if v is not None}}
    # (Of two failures, the rest of the loser fills gaps too, as the winner's rest overrides:
    # the same whichever came first.)
    kept = FAILURE_FIELDS if both_failed else STATUS_FIELDS
    for k, v in new.items():
        if k not in kept and v is not None and out.get(k) is None:
            out[k] = v
    out["progress"] = max(_progress(old), _progress(new), _progress(out))
    return out


def progress_of(stage_index: int, n_stages: int, fraction: float) -> int:
    """Overall progress 0-99 while running: stage position plus the fraction done inside it."""
    fraction = min(max(fraction, 0.0), 1.0)
    return min(99, int(100 * (stage_index + fraction) / max(n_stages, 1)))
