"""What the node manager accepts: the arguments of each of its RPC ops, as pydantic schemas
that ``transport.rpc.RpcServer`` checks before a handler runs (one malformed registration or
heartbeat must not reach the cluster state, whose every later view would carry it).

Names and addresses are bounded strings; numbers have ranges; maps and lists have sizes. The
stage figures of a heartbeat are checked apart (``onepiece.heartbeat``): a bad one still
counts as a sign of life, only its figures are dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from onepiece.schema import Name

# scheme://rest (the scheme picks the transport, transport/registry.py): a member registered at
# "not an address" made every sender to it raise.
Address = Annotated[StrictStr, Field(max_length=512, pattern=r"^[A-Za-z][A-Za-z0-9+.-]*://\S+$")]
Uid = Name
# onepiece.deployment.FIELD; its format is checked where it is compared (deployment.refusal).
DeploymentId = Annotated[StrictStr, Field(max_length=64)]
# A member's name becomes its id (nm/identity.py): shown, typed into `onepiece move`, kept in ZooKeeper.
NAME_PATTERN = r"^([A-Za-z0-9][A-Za-z0-9_.-]*)?$"
ProcessToken = Annotated[StrictStr, Field(max_length=64)]  # drawn by each member process once


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RegisterArgs(_Args):
    role: Literal["stage", "db", "proxy"]
    set: Name
    addresses: Annotated[dict[Annotated[StrictStr, Field(max_length=64)], Address], Field(max_length=16)]
    pid: Annotated[StrictInt, Field(ge=0, le=1 << 31)] = 0
    host: Annotated[StrictStr, Field(max_length=256)] = ""
    stage: Name | None = None
    instance: Name | None = None  # on ZooKeeper: the member node it joined with
    idle: StrictBool = False
    name: Annotated[StrictStr, Field(max_length=128, pattern=NAME_PATTERN)] = ""  # its id, when given
    deployment: DeploymentId = ""
    serving: Name | None = None  # registering again: the stage it serves already
    process: ProcessToken = ""


class HeartbeatArgs(_Args):
    instance: Name
    ready: StrictBool = False
    # A role's own figures, shown by `onepiece status`; a stage's are checked further before use.
    # ``holding`` (a stage's uids in hand) is kept apart by the handler.
    stats: Annotated[dict[Annotated[StrictStr, Field(max_length=64)], Any], Field(max_length=128)] = {}
    version: Annotated[StrictInt, Field(ge=0, le=1 << 62)] = 0
    serving: Name | None = None
    deployment: DeploymentId = ""
    process: ProcessToken = ""
    # What it handed to which instance lately (onepiece.heartbeat.DELIVERED): checked by the
    # handler, which drops a malformed report and still counts the heartbeat.
    delivered: Any = None
    # The fence it applied (nm/fencing.py): the NM forgets it and stops answering with it.
    fenced: Name | None = None


class Holdings(BaseModel):
    """A stage heartbeat's ``stats.holding``: the uids it holds, failed for it if it dies."""

    holding: Annotated[list[Uid], Field(max_length=1 << 16)]


class FenceReply(BaseModel):
    """``fenced`` in a heartbeat or register reply (nm/fencing.py): the NM declared this process
    dead and reported ``uids`` failed; the member drops them, then acknowledges ``id``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: Name
    instance: Name
    reason: Annotated[StrictStr, Field(max_length=4096)]
    uids: Annotated[list[Uid], Field(max_length=1 << 16)]


Secret = Annotated[StrictStr, Field(max_length=256)]


class InstanceArgs(_Args):
    """``deregister``: the instance that leaves, with its own token (from its registration) or
    the operator key."""

    instance: Name
    token: Secret | None = None
    key: Secret | None = None


class SetArgs(_Args):
    """``routes`` (``set`` required by the handler), ``proxies``, ``dbs`` (all sets without one)."""

    set: Name | None = None


class NoArgs(_Args):
    """``status``, ``workflow``."""


class MoveArgs(_Args):
    """An operator's ``move``: ``instance`` to ``stage`` (None: the idle pool)."""

    instance: Name
    stage: Name | None = None
    key: Secret | None = None  # the operator key (onepiece/operator_key.py)


class Routes(BaseModel):
    """A set's route table as every member takes it (from a ``register`` or ``heartbeat`` reply,
    or from ZooKeeper) before it replaces the one its senders read."""

    model_config = ConfigDict(extra="allow")

    version: Annotated[StrictInt, Field(ge=0)]
    set: Name | None = None
    stages: Annotated[dict[Name, Annotated[list[Address], Field(max_length=4096)]], Field(max_length=256)] = {}
    dbs: Annotated[list[Annotated[dict[Annotated[StrictStr, Field(max_length=64)], Address], Field(max_length=16)]],
                   Field(max_length=4096)] = []
    proxies: Annotated[list[Address], Field(max_length=4096)] = []


SCHEMAS: dict[str, type[BaseModel]] = {
    "register": RegisterArgs, "heartbeat": HeartbeatArgs, "deregister": InstanceArgs, "routes": SetArgs,
    "proxies": SetArgs, "dbs": SetArgs, "status": NoArgs, "move": MoveArgs, "workflow": NoArgs,
}
