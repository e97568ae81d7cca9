"""Workflow and topology YAML (DESIGN §10), validated with pydantic.

A bad file raises :class:`ConfigError` naming the file, the key path and what was expected,
e.g. ``deploy/wan21.yaml: stages.denoise_t2v.workers: Input should be greater than 0 (got -1)``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from onepiece.argtypes import DEVICE
from onepiece.sched.options import ScheduleSpec
from onepiece.schema import SET_NAME, checked

if TYPE_CHECKING:
    from onepiece.nm.zk import ZkSettings
    from onepiece.proxy.keys import ApiKeys


def deploy_dir() -> Path:
    """The shipped deploy/ folder (workflow and topology YAML)."""
    import onepiece.deploy

    return Path(onepiece.deploy.__file__).resolve().parent


class ConfigError(ValueError):
    pass


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Strict):
    path: str = Field(description="a diffusers pipeline directory (model_index.json + components)")
    tiny: Literal["t2v", "i2v"] | None = Field(
        None, description="if the path is empty, `onepiece up` builds a tiny random-weight pipeline of this kind"
    )
    profile: Literal["tiny", "scale"] = Field(
        "tiny", description="size of that random-weight build: tiny (tests) or scale (stage costs in real Wan2.1's "
                            "proportions, for benchmarks)")
    seed: int = 0


class StageSpec(_Strict):
    function: str | None = Field(None, description="stage function name; defaults to the stage's name")
    model: str
    components: list[str] = Field(min_length=1)
    workers: int = Field(1, gt=0, le=64)
    device: str = Field("cpu", pattern=f"^({DEVICE})$",
                        description="torch device of its workers: cpu, cuda (several workers: cuda:0, cuda:1, ...) "
                                    "or cuda:N")
    mode: Literal["individual", "collaboration"] = Field(
        "individual", description="individual: each worker serves its own requests; collaboration: the workers form "
                                  "one torch.distributed group and compute each step together (denoise only)")
    queue: int = Field(64, gt=0, le=100_000, description="bounded queue of the instance's scheduler")
    threads: int = Field(0, ge=0, le=256, description="torch threads per worker (0: on CPU, 1 or all cores for each "
                                                       "shape, whichever runs it faster; elsewhere, all cores)")
    data: Literal["zmq", "ring"] = Field("zmq", description="how the stage receives its data: ZeroMQ, or the "
                                                             "one-sided ring buffer (shm on one host, TCP agent across)")
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec, description="step scheduling: policy, batching, "
                                                                             "chunking, resident memory, aging")


class Defaults(_Strict):
    width: int = Field(64, gt=0)
    height: int = Field(64, gt=0)
    num_frames: int = Field(9, gt=0)
    steps: int = Field(10, gt=0)
    guidance: float = Field(5.0, ge=0)
    fps: int = Field(16, gt=0, le=120)
    negative_prompt: str = ""
    max_sequence_length: int = Field(64, gt=0, le=4096)


class Limits(_Strict):
    max_width: int = Field(512, gt=0)
    max_height: int = Field(512, gt=0)
    max_frames: int = Field(81, gt=0)
    max_steps: int = Field(100, gt=0)
    max_prompt_chars: int = Field(4000, gt=0)
    timeout_s: float = Field(600.0, gt=0, description="deadline given to a request unless it asks for less")


# Stage functions whose steps a collaboration group can run in parallel (registered with
# ``parallel=`` in stage/registry.py; a test keeps the two in step).
PARALLEL_FUNCTIONS = frozenset({"denoise"})
# Stage functions that step (registered with ``stepped=True``; a test keeps the two in step):
# what the simulator prices per step, knowing it without importing the functions (torch).
STEPPED_FUNCTIONS = frozenset({"denoise"})

# The stage functions (stage/registry.py, a test keeps the two in step): per function, the
# application kinds it serves and the components it uses, so that a workflow naming another
# function, a component it lacks, or its stages out of order is refused before anything starts
# (each started, crash-looped its workers, and `onepiece up` waited out its ready timeout).
class Function(NamedTuple):
    kinds: frozenset[str]  # the application kinds it serves
    components: frozenset[str]  # what it loads


FUNCTIONS: dict[str, Function] = {
    "text_encode": Function(frozenset({"t2v", "i2v"}), frozenset({"text_encoder", "tokenizer"})),
    "image_encode": Function(frozenset({"i2v"}), frozenset({"image_encoder", "image_processor"})),
    "vae_encode": Function(frozenset({"i2v"}), frozenset({"vae"})),
    "denoise": Function(frozenset({"t2v", "i2v"}), frozenset({"transformer", "scheduler"})),
    "vae_decode": Function(frozenset({"t2v", "i2v"}), frozenset({"vae"})),
}
# What an application of a kind runs, by function: its encoders in any order, then denoise and
# vae_decode (each function reads what the ones before it added to the message).
PIPELINES = {"t2v": frozenset({"text_encode"}), "i2v": frozenset({"text_encode", "image_encode", "vae_encode"})}
LAST = ("denoise", "vae_decode")

MAX_GUIDANCE = 100.0
MAX_IMAGE_PIXELS = 4096 * 4096  # an input image's decoded size (48 MiB as RGB), at the proxy and at every stage
# Its longer side over its shorter, likewise: CLIP's processor scales the shorter side up to its
# input size and the longer by as much before it crops, so memory grows with the ratio, not the
# pixels (an 842-byte 1x262144 PNG took the tiny model's image_encode worker to 3 GB; 1x2048
# would take 1 GB at the real CLIP's 224).
MAX_IMAGE_ASPECT = 64
MAX_SEED = 2**32 - 1  # what numpy and torch generators both accept


class JobParams(BaseModel):
    """A request's ``params`` as every stage receives them (the proxy builds them from a create).
    Strict: a stage never coerces what another process sent it."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str
    negative_prompt: str = ""
    width: int = Field(gt=0, multiple_of=16)
    height: int = Field(gt=0, multiple_of=16)
    num_frames: int = Field(ge=1)
    steps: int = Field(ge=1)
    guidance: float = Field(ge=0, le=MAX_GUIDANCE)
    seed: int = Field(ge=0, le=MAX_SEED)
    fps: int = Field(gt=0, le=120)
    max_sequence_length: int = Field(gt=0, le=4096)


class AppSpec(_Strict):
    kind: Literal["t2v", "i2v"] | None = Field(None, description="stage-function family; defaults to the app id")
    stages: list[str] = Field(min_length=1)
    defaults: Defaults = Defaults()
    limits: Limits = Limits()

    @model_validator(mode="after")
    def _defaults_fit(self) -> "AppSpec":
        """A request that leaves a field out gets the default: one the proxy would refuse blames
        the client for the YAML (``'size' 1024x64 exceeds the limit``)."""
        d, lim = self.defaults, self.limits
        for field, v, ok, want in (
                ("width", d.width, d.width % 16 == 0 and d.width <= lim.max_width, f"a multiple of 16 <= {lim.max_width}"),
                ("height", d.height, d.height % 16 == 0 and d.height <= lim.max_height,
                 f"a multiple of 16 <= {lim.max_height}"),
                ("num_frames", d.num_frames, d.num_frames <= lim.max_frames, f"<= limits.max_frames {lim.max_frames}"),
                ("steps", d.steps, d.steps <= lim.max_steps, f"<= limits.max_steps {lim.max_steps}"),
                ("guidance", d.guidance, d.guidance <= MAX_GUIDANCE, f"<= {MAX_GUIDANCE:g}"),
                ("negative_prompt", len(d.negative_prompt), len(d.negative_prompt) <= lim.max_prompt_chars,
                 f"at most limits.max_prompt_chars {lim.max_prompt_chars} characters")):
            if not ok:
                raise ValueError(f"defaults.{field}: {v!r} is what a request without it would ask for, and it "
                                 f"must be {want}")
        return self

    def check_params(self, params: Any) -> JobParams:
        """``params`` checked against their schema and this application's limits, so that a
        request that reaches a stage by any path obeys the limits the proxy enforces on create.
        Raises ValueError naming the field."""
        p = checked(JobParams, params, "params")  # validated once: this runs for every request at every stage
        lim = self.limits
        bounds = (("width", p.width, lim.max_width), ("height", p.height, lim.max_height),
                  ("num_frames", p.num_frames, lim.max_frames), ("steps", p.steps, lim.max_steps),
                  ("prompt", len(p.prompt), lim.max_prompt_chars),
                  ("negative_prompt", len(p.negative_prompt), lim.max_prompt_chars))
        over = [(f, v, m) for f, v, m in bounds if v > m]
        if over:
            f, v, m = over[0]
            raise ValueError(f"params.{f}: {v} exceeds the application's limit of {m}")
        if (p.num_frames - 1) % 4:
            raise ValueError(f"params.num_frames: must be 4k+1, got {p.num_frames}")
        return p


class RingSpec(_Strict):
    """Size of each ring a receiver creates: ``slots`` entries and ``bytes`` of buffer (both
    powers of two; a message must fit in ``bytes``)."""

    slots: int = Field(1024, ge=2, le=1 << 20)
    bytes: int = Field(64 << 20, ge=4096, le=1 << 34)

    @field_validator("slots", "bytes")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"expected a power of two, got {v}")
        return v


class DbDataSpec(_Strict):
    data: Literal["zmq", "ring"] = Field("zmq", description="how the DBs receive results and progress")


IDLE = "idle"  # what `onepiece move` calls the idle pool: no stage may be named so


class Workflow(_Strict):
    models: dict[str, ModelSpec]
    stages: dict[str, StageSpec]
    applications: dict[str, AppSpec] = Field(min_length=1)
    db: DbDataSpec = DbDataSpec()
    ring: RingSpec = RingSpec()

    @model_validator(mode="after")
    def _references(self) -> "Workflow":
        for name, st in self.stages.items():
            if name == IDLE:
                raise ValueError(f"stages.{IDLE}: the name is taken by the idle pool (`onepiece move X {IDLE}`)")
            if st.model not in self.models:
                raise ValueError(f"stages.{name}.model: unknown model {st.model!r} (known: {sorted(self.models)})")
            fn = self.function_of(name)
            if fn not in FUNCTIONS:
                raise ValueError(f"stages.{name}.function: unknown stage function {fn!r} (known: {sorted(FUNCTIONS)})"
                                 + ("" if st.function else f"; a stage named {name!r} needs its function: set"))
            lacking = FUNCTIONS[fn].components - set(st.components)
            if lacking:
                raise ValueError(f"stages.{name}.components: function {fn!r} needs {sorted(FUNCTIONS[fn].components)}, "
                                 f"lacks {sorted(lacking)}")
            if st.mode == "collaboration" and self.function_of(name) not in PARALLEL_FUNCTIONS:
                raise ValueError(f"stages.{name}.mode: collaboration needs a stage function that steps in parallel "
                                 f"({', '.join(sorted(PARALLEL_FUNCTIONS))}), not {self.function_of(name)!r}")
        for app, spec in self.applications.items():
            for i, st in enumerate(spec.stages):
                if st not in self.stages:
                    raise ValueError(f"applications.{app}.stages[{i}]: unknown stage {st!r} (known: {sorted(self.stages)})")
            if spec.kind is None:
                if app not in ("t2v", "i2v"):
                    raise ValueError(f"applications.{app}.kind: expected 't2v' or 'i2v' for an app named {app!r}")
                spec.kind = app  # type: ignore[assignment]
            if len(set(spec.stages)) < len(spec.stages):  # next_stage would send a request round for ever
                raise ValueError(f"applications.{app}.stages: a stage is listed twice ({spec.stages})")
            fns = [self.function_of(st) for st in spec.stages]
            for st, fn in zip(spec.stages, fns):
                if spec.kind not in FUNCTIONS[fn].kinds:
                    raise ValueError(f"applications.{app}.stages: stage {st!r} runs {fn!r}, which serves "
                                     f"{sorted(FUNCTIONS[fn].kinds)}, not {spec.kind}")
            if set(fns[:-2]) != PIPELINES[spec.kind] or tuple(fns[-2:]) != LAST or len(fns) != len(set(fns)):
                raise ValueError(f"applications.{app}.stages: a {spec.kind} application runs "
                                 f"{' and '.join(sorted(PIPELINES[spec.kind]))} (any order), then denoise, then "
                                 f"vae_decode, each once; its stages run {fns}")
        return self

    def function_of(self, stage: str) -> str:
        return self.stages[stage].function or stage

    def next_stage(self, app: str, stage: str) -> str | None:
        """The stage after ``stage`` in ``app``, or None when the DB comes next."""
        stages = self.applications[app].stages
        i = stages.index(stage)
        return stages[i + 1] if i + 1 < len(stages) else None

    def model_path(self, name: str, base: Path) -> Path:
        return resolve_path(self.models[name].path, base)

    def cost_table(self, stage: str, base: Path) -> dict[str, dict[int, float]] | None:
        """The rows of ``stage`` in its ``schedule.costs`` table (relative to ``base``), if any.
        A table that cannot price the stage is refused: one without its rows (written for a
        stage of another name) or with keys of the other kind (call keys for a stage that steps)
        was taken as no table, and the stage started from nothing without a word."""
        from onepiece.sched.costs import TableError, table_rows, wrong_kind

        if (table := self._costs_doc(stage, base)) is None:
            return None
        path, doc = table
        try:
            rows = table_rows(doc, stage)
        except TableError as e:
            raise TableError(f"{path}: {e}") from None
        if not rows:
            raise TableError(f"{path}: no rows for stage {stage!r} (stages: {', '.join(sorted(doc['stages'])) or 'none'})")
        why = wrong_kind(rows, stage, self.function_of(stage) in STEPPED_FUNCTIONS)
        if why is not None:
            raise TableError(f"{path}: {why}")
        return rows

    def cost_fixed(self, stage: str, base: Path) -> dict[str, float] | None:
        """What a request of each key costs ``stage`` besides its steps, from its ``schedule.costs``
        table (its ``fixed``), if any: the stage starts from it as from the rows."""
        from onepiece.sched.costs import TableError, table_fixed

        if (table := self._costs_doc(stage, base)) is None:
            return None
        path, doc = table
        try:
            return table_fixed(doc, stage)
        except TableError as e:
            raise TableError(f"{path}: {e}") from None

    def _costs_doc(self, stage: str, base: Path) -> tuple[Path, Any] | None:
        """``stage``'s ``schedule.costs`` table (relative to ``base``), read: its path and document."""
        from onepiece.sched.costs import read_table

        path = self.stages[stage].schedule.costs
        if path is None:
            return None
        path = resolve_path(path, base)
        return path, read_table(path)


class ElasticSpec(_Strict):
    """Elastic assignment (DESIGN §9, nm/elastic.py): when a stage's workers were busier than
    ``threshold`` over ``window_s``, or more than ``late`` of its requests left it past the
    deadline they could have made, an instance moves there from the idle pool, or else from the
    least busy stage above its minimum; a stage below ``low`` over ``cold_windows`` windows gives
    one instance back to the idle pool. After a move nothing else moves for ``cooldown_s``."""

    enabled: bool = True
    threshold: float = Field(0.85, gt=0, le=1, description="busy time over wall time that counts as saturated")
    late: float = Field(0.01, ge=0, le=1, description="the share of a stage's requests leaving it late (past the "
                                                      "deadline of their SLO they could have made there) over a "
                                                      "window that counts as saturated too (1: never)")
    low: float = Field(0.2, ge=0, lt=1, description="below this over cold_windows windows a stage returns an "
                                                    "instance to the idle pool (0: never)")
    window_s: float = Field(30.0, gt=0, le=3600, description="utilization is averaged over this window")
    cold_windows: int = Field(10, ge=1, le=1000, description="a stage returns an instance to the idle pool only "
                                                             "when below low over this many windows (one window of "
                                                             "a few requests is noise, and a returned instance takes "
                                                             "a move to come back)")
    cooldown_s: float = Field(60.0, ge=0, le=3600, description="no move for this long after the last one")
    drain_s: float = Field(120.0, gt=0, le=3600, description="bound on a moving instance finishing what it holds")

    @model_validator(mode="after")
    def _order(self) -> "ElasticSpec":
        if self.low >= self.threshold:
            raise ValueError(f"elastic.low ({self.low}) must be below elastic.threshold ({self.threshold})")
        return self


class NmSpec(_Strict):
    address: str = Field("tcp://127.0.0.1:7700", description="the (first) NM's RPC address; with count > 1 the "
                                                             "others take the next ports")
    # At least 0.05: every instance reports at it and the NM re-decides at it; faster only burns
    # CPU (a simulated NM at 1 µs never finished a trace).
    heartbeat_s: float = Field(1.0, ge=0.05, le=60)
    dead_after_s: float = Field(4.0, gt=0, le=600, description="embedded NM: silence after which an instance is "
                                                              "dropped (at least 3 heartbeats; silence counts only "
                                                              "while the NM itself ran: nm/liveness.py)")
    # High availability (nm/ha.py): without zk, one NM keeps the state in memory (the default).
    zk: str | None = Field(None, description="ZooKeeper host:port[,host:port...]: the NMs elect a primary there "
                                             "and keep the cluster state in it; instances hold member nodes there")
    zk_root: str = Field("/onepiece", description="the znode under which everything of this cluster lives")
    zk_auth_file: str | None = Field(None, description="file (mode 0600) holding user:password: digest ACLs on "
                                                       "every znode, for this user only; relative to this file")
    zk_auth: str | None = Field(None, description="refused: credentials do not belong in a topology file")
    zk_session_s: float = Field(4.0, ge=1, le=600, description="ZooKeeper session timeout: how soon a dead NM or "
                                                               "instance is noticed (the server may bound it)")
    count: int = Field(1, ge=1, le=9, description="NM processes `onepiece up` starts: one primary, the rest backups")
    elastic: ElasticSpec = ElasticSpec()

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        from onepiece.transport.registry import ZMQ_SCHEMES, checked

        if re.match(r"^tcp://.*:0+$", v):  # every member is told this address: it must be the one bound
            raise ValueError(f"{v!r}: the node manager needs a fixed port (every member is pointed at it), not 0")
        return checked(v, ZMQ_SCHEMES)

    @field_validator("zk")
    @classmethod
    def _zk(cls, v: str | None) -> str | None:
        from onepiece.nm.zk import parse_hosts

        return None if v is None else parse_hosts(v)

    @field_validator("zk_root")
    @classmethod
    def _zk_root(cls, v: str) -> str:
        from onepiece.nm.zk import parse_root

        return parse_root(v)

    @field_validator("zk_auth")
    @classmethod
    def _zk_auth(cls, v: str | None) -> None:
        from onepiece.nm.zk_auth import ENV

        if v is not None:  # a topology file is shared and checked in; secrets live apart from it
            raise ValueError(f"credentials do not belong in the topology; put user:password in a file of mode 0600 "
                             f"named by nm.zk_auth_file (or --zk-auth-file), or in the environment variable {ENV}")
        return None

    @field_validator("count")
    @classmethod
    def _count(cls, v: int, info) -> int:
        if v > 1:
            if not info.data.get("zk"):
                raise ValueError(f"{v} node managers need nm.zk (a ZooKeeper address) to elect a primary")
            address = info.data.get("address", "")
            m = re.match(r"^tcp://([^:/]+):(\d+)$", address)
            if not m or not 0 < int(m.group(2)) <= 65536 - v:
                raise ValueError(f"{v} node managers take consecutive ports from nm.address, which must then be "
                                 f"tcp://host:port with a fixed port (got {address!r})")
        return v

    def addresses(self) -> list[str]:
        """Every NM's RPC address: ``address`` and, with count > 1, the next ports."""
        if self.count == 1:
            return [self.address]
        host, port = self.address.rsplit(":", 1)
        return [f"{host}:{int(port) + i}" for i in range(self.count)]

    def zk_settings(self) -> "ZkSettings | None":
        """The ZooKeeper settings, credentials from $ONEPIECE_ZK_AUTH or zk_auth_file (nm/zk_auth.py)."""
        from onepiece.nm.zk import ZkSettings
        from onepiece.nm.zk_auth import CredentialsError, resolve_auth

        if not self.zk:
            return None
        try:
            auth = resolve_auth(None, self.zk_auth_file)
        except CredentialsError as e:
            raise ConfigError(f"nm.zk_auth_file: {e}") from None
        return ZkSettings(self.zk, self.zk_root, auth, self.zk_session_s)


class DbSpec(_Strict):
    count: int = Field(2, gt=0, le=16)
    # Each result is copied to this many DBs of the set (the first ones in its placement
    # order, which readers ask first); more than `count` just means every DB.
    replication: int = Field(2, gt=0, le=16, description="DBs that hold each result (capped at count)")
    ttl_s: float = Field(3600.0, gt=0)
    max_bytes: int = Field(1 << 30, gt=0)
    purge_after_fetch_s: float | None = Field(60.0, ge=0, description="a fetched result is purged this long after its "
                                                                     "first fetch (0: at once; null: kept until its TTL)")


class ProxySpec(_Strict):
    count: int = Field(1, gt=0, le=16)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="first proxy's port; others take the next ones (0: any)")
    max_inflight: int = Field(64, gt=0, le=100_000)
    max_body_bytes: int = Field(16 << 20, gt=0)
    monitor: bool = Field(True, description="admit at the set's measured capacity and refuse requests predicted "
                                            "to miss their deadline (off: only the max_inflight bound)")
    deadline_factor: float = Field(2.0, ge=0, le=1000,
                                   description="a request without timeout_s must be predicted to finish within this "
                                               "many times its standalone time (0: only the app's limit)")
    api_keys_file: str | None = Field(None, description="file (mode 0600) with the client API keys, one a line; "
                                                        "relative to this file; required when host is beyond loopback "
                                                        "unless ONEPIECE_API_KEYS is set")

    def keys(self) -> "ApiKeys | None":
        """The client API keys: api_keys_file, else $ONEPIECE_API_KEYS; ConfigError if unusable,
        or missing while the proxies bind beyond loopback."""
        from onepiece.proxy.keys import check_bind, load_keys
        from onepiece.secret_file import SecretFileError

        try:
            keys = load_keys(self.api_keys_file)
            check_bind(self.host, keys)
        except SecretFileError as e:
            raise ConfigError(f"proxy: {e}") from None
        return keys


MAX_INSTANCES = 64  # of one stage in one set (and in its idle pool)


class SetSpec(_Strict):
    name: str = Field("set0", pattern=SET_NAME)
    proxy: ProxySpec = ProxySpec()
    db: DbSpec = DbSpec()
    stages: dict[str, int] = Field(description="instances per stage")
    idle: int = Field(0, ge=0, le=MAX_INSTANCES, description="instances started in the idle pool, for the NM to "
                                                             "assign")
    min: dict[str, int] = Field(default_factory=dict, description="instances a stage keeps when the NM moves "
                                                                   "some away (default 1 if it starts with any)")

    @field_validator("stages", "min")
    @classmethod
    def _counts(cls, v: dict[str, int]) -> dict[str, int]:
        for k, n in v.items():
            if not isinstance(n, int) or n < 0 or n > MAX_INSTANCES:
                raise ValueError(f"{k}: expected an instance count between 0 and {MAX_INSTANCES}, got {n!r}")
        return v

    @model_validator(mode="after")
    def _something(self) -> "SetSpec":
        if not any(self.stages.values()) and not self.idle:  # `up` said it served, and it refused every create
            raise ValueError(f"set {self.name!r} starts no instance: give its stages counts (or idle instances "
                             f"for the node manager to assign)")
        return self

    def min_of(self, stage: str) -> int:
        return self.min.get(stage, 1 if self.stages.get(stage, 0) > 0 else 0)

    def serves(self, workflow: "Workflow") -> list[str]:
        """The applications this set is laid out for: every stage of theirs starts with an
        instance or keeps a minimum. (None laid out, as a set of idle instances only: all.)"""
        apps = [a for a, spec in workflow.applications.items()
                if all(self.stages.get(s, 0) > 0 or self.min_of(s) > 0 for s in spec.stages)]
        return apps or list(workflow.applications)


class LogSpec(_Strict):
    """How large each role's log under `onepiece up` grows (onepiece/logrotate.py)."""

    max_mb: float = Field(32.0, gt=0, le=1_000_000, description="a role's log is rotated past this size")
    keep: int = Field(3, ge=0, le=100, description="rotated parts kept per role (name.log.1 the newest)")


class Topology(_Strict):
    workflow: str = Field(description="workflow YAML, relative to this file")
    logs: LogSpec = LogSpec()
    deployment: str | None = Field(None, description="the deployment's id, which every member carries and the NM "
                                                     "checks (default: onepiece up makes a fresh one per run)")
    nm: NmSpec = NmSpec()
    sets: list[SetSpec] = Field(min_length=1)
    transport: Literal["tcp", "ipc"] = "ipc"
    auth: Literal["auto", "curve", "off"] = Field(
        "auto", description="CURVE between the roles (onepiece/curve_policy.py): auto turns it on when an address is "
                            "beyond loopback; off is refused then")
    curve_dir: str | None = Field(None, description="folder with the deployment's CURVE key pair (onepiece keys curve "
                                                    "DIR); default: onepiece up makes one under ~/.config/onepiece")

    @field_validator("deployment")
    @classmethod
    def _deployment(cls, v: str | None) -> str | None:
        from onepiece.deployment import check_id

        return None if v is None else check_id(v)

    @model_validator(mode="after")
    def _sets_apart(self) -> "Topology":
        """Set names are unique (the NM and clients know sets by name) and fixed proxy ports do
        not collide, with each other or with the NMs': a set's proxies take ``port`` ..
        ``port + count - 1`` (port 0: any free)."""
        seen: dict[str, int] = {}
        taken: dict[int, str] = {}  # port -> the set whose proxy takes it
        nm_ports = {int(m.group(1)): a for a in self.nm.addresses() if (m := re.match(r"^tcp://.*:(\d+)$", a))}
        for i, s in enumerate(self.sets):
            if s.name in seen:
                raise ValueError(f"sets.{i}.name: set name {s.name!r} is already used by sets.{seen[s.name]}")
            seen[s.name] = i
            if s.proxy.port == 0:
                continue
            last = s.proxy.port + s.proxy.count - 1
            if last > 65535:
                raise ValueError(f"sets.{s.name}.proxy.port: {s.proxy.count} proxies from port {s.proxy.port} "
                                 f"run past 65535")
            for port in range(s.proxy.port, last + 1):
                if port in taken:
                    raise ValueError(f"sets.{s.name}.proxy.port: proxy port {port} (ports {s.proxy.port}-{last}) "
                                     f"is also taken by set {taken[port]!r}; give each set its own ports or 0")
                if port in nm_ports:
                    raise ValueError(f"sets.{s.name}.proxy.port: proxy port {port} (ports {s.proxy.port}-{last}) "
                                     f"is the node manager's ({nm_ports[port]}); give the proxy other ports or 0")
                taken[port] = s.name
        return self


def resolve_path(p: str, base: Path) -> Path:
    path = Path(os.path.expandvars(os.path.expanduser(p)))
    return path if path.is_absolute() else (base / path).resolve()


def _read_yaml(path: Path) -> object:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return yaml.load(text, Loader=_UniqueKeys)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None


class _UniqueKeys(yaml.SafeLoader):
    """safe_load, refusing a key given twice in one mapping (YAML takes the last, silently:
    ``denoise_t2v: 1`` then ``denoise_t2v: 0`` started none)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_SECRET_KEYS = {"zk_auth"}


def _explain(path: Path, err: ValidationError) -> ConfigError:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        if e["loc"] and e["loc"][-1] in _SECRET_KEYS:
            got = ""  # an error message must not carry the secret into logs
        msg = e["msg"].removeprefix("Value error, ")
        if not e["loc"] and e["type"] == "value_error":
            # A model-level check names its own key ("sets.b.proxy.port: ..."): show just that.
            key, msg, got = "", msg.removeprefix("Value error, "), ""
        lines.append(f"{path}: {key + ': ' if key else ''}{msg}{got}")
    return ConfigError("\n".join(lines))


def load_workflow(path: str | Path) -> Workflow:
    from onepiece.sched.costs import TableError

    path = Path(path)
    try:
        wf = Workflow.model_validate(_read_yaml(path))
    except ValidationError as e:
        raise _explain(path, e) from None
    for stage in wf.stages:
        try:
            wf.cost_table(stage, path.parent)
            wf.cost_fixed(stage, path.parent)
        except TableError as e:
            raise ConfigError(f"{path}: stages.{stage}.schedule.costs: {e}") from None
    return wf


def load_topology(path: str | Path) -> tuple[Topology, Workflow, Path]:
    """The topology, its workflow, and the workflow file's directory (base of model paths)."""
    path = Path(path)
    try:
        topo = Topology.model_validate(_read_yaml(path))
    except ValidationError as e:
        raise _explain(path, e) from None
    wf_path = resolve_path(topo.workflow, path.parent)
    if topo.nm.zk_auth_file:
        topo.nm.zk_auth_file = str(resolve_path(topo.nm.zk_auth_file, path.parent))
    if topo.curve_dir:
        topo.curve_dir = str(resolve_path(topo.curve_dir, path.parent))
    wf = load_workflow(wf_path)
    for s in topo.sets:
        if s.proxy.api_keys_file:
            s.proxy.api_keys_file = str(resolve_path(s.proxy.api_keys_file, path.parent))
        for key in ("stages", "min"):
            for stage in getattr(s, key):
                if stage not in wf.stages:
                    raise ConfigError(f"{path}: sets.{s.name}.{key}.{stage}: unknown stage (known: {sorted(wf.stages)})")
    return topo, wf, wf_path.parent
