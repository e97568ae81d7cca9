"""`onepiece up`: a whole deployment from a topology file, as supervised local processes.

Starts the NM (or, with ``nm.zk`` and ``nm.count``, several NMs on ZooKeeper, one primary and
backups, each role then given all their addresses and the ZooKeeper settings), then per set the
DBs, the stage instances and the proxies, each with its log in the run's log folder; waits
until every instance is registered and ready; prints where the API listens; restarts a role
process that dies (bounded backoff); and on Ctrl-C or SIGTERM stops everything, role by role
(``STOP_ORDER``), leaving no processes, sockets or runtime files behind.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onepiece import deployment, operator_key
from onepiece.config import ConfigError, SetSpec, load_topology
from onepiece.curve_policy import AuthPolicyError, curve_on
from onepiece.logrotate import rotate
from onepiece.nm.client import NmClient
from onepiece.nm.zk_auth import child_env
from onepiece.proxy import keys as api_keys
from onepiece.ports import free_port
from onepiece.supervise import Backoff, child_preexec
from onepiece.transport import curve
from onepiece.transport.rpc import RpcError

log = logging.getLogger(__name__)


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = field(default=None, repr=False)  # None: ours; may hold credentials
    proc: subprocess.Popen | None = None
    next_start: float = 0.0
    backoff: Backoff = field(default_factory=lambda: Backoff(base_s=0.5, cap_s=30.0))
    schedule_log: Path | None = None  # a stage's (stage/schedule_log.py), rotated as its log is

    @property
    def logs(self) -> list[Path]:
        return [self.log_path] + ([self.schedule_log] if self.schedule_log else [])

    @property
    def role(self) -> str:
        """nm, db, stage or proxy: the subcommand it runs (``_cli``)."""
        return self.argv[3]

    def start(self) -> None:
        # The child holds its own descriptor of the log; ours is closed at once.
        with open(self.log_path, "ab", buffering=0) as log_file:
            self.proc = subprocess.Popen(
                self.argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=child_preexec, env=self.env,
            )
        self.backoff.started_now()


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "onepiece", *args]


# Each secret the environment may hold, to the one role that reads it: a stage, a DB and their
# model workers read neither (every child inherited both), and no server reads a client's key.
SECRET_FOR = {operator_key.ENV: "nm", api_keys.ENV: "proxy", api_keys.CLIENT_ENV: ""}


def for_role(env: dict[str, str], role: str) -> dict[str, str]:
    """``env`` without the secrets that ``role`` (nm, proxy, db, stage) does not read."""
    return {k: v for k, v in env.items() if SECRET_FOR.get(k, role) == role}


# Stopped in this order, each wave with its own grace: the proxies (no new work), the stages
# (what they still hold fails, with the reason, into the DBs), the DBs, and the NMs last (every
# role says goodbye to its NM on the way out; with the NM gone it would wait out a heartbeat's
# and a goodbye's timeouts). All at once, a stage waited 5 s on each DB that was gone before it
# could store its failures, and lost them, and the NM got what was left of one shared grace.
STOP_ORDER = ("proxy", "stage", "db", "nm")


class Deployment:
    def __init__(self, topology_path: Path, log_dir: Path | None = None, runtime_dir: Path | None = None) -> None:
        self.topology_path = Path(topology_path).resolve()
        self.topo, self.workflow, self.base_dir = load_topology(self.topology_path)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_dir = Path(log_dir or Path("runs") / stamp).resolve()
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"the log folder {self.log_dir}: cannot be made: {e.strerror}") from None
        self.children: list[Child] = []
        self.nm_addresses = self.topo.nm.addresses()
        self.nm_address = ",".join(self.nm_addresses)  # every role finds the primary among them
        self.zk = self.topo.nm.zk_settings()
        self.nm_count = len(self.nm_addresses)
        # Every process of this run carries it; the NM refuses members of another deployment.
        self.deployment = self.topo.deployment or deployment.new_id()
        # ipc socket paths must stay short (108 bytes), so the runtime folder lives in /tmp.
        self.runtime = Path(tempfile.mkdtemp(prefix="onepiece-", dir=runtime_dir))
        try:
            self.curve_keys = self._curve_keys()
        except BaseException:  # refused: nothing of this run is left behind
            shutil.rmtree(self.runtime, ignore_errors=True)
            raise
        self.curve_dir = None if self.curve_keys is None else self.curve_keys.folder

    def _curve_keys(self) -> curve.CurveKeys | None:
        """The CURVE keys every process of this run uses, None when the topology runs without
        CURVE; made (under ~/.config/onepiece) if the topology names no folder and it is missing."""
        given = self.topo.curve_dir or os.environ.get(curve.ENV)
        addresses = [*self.nm_addresses, self._address("probe"), self._data_address("probe", "ring")]
        try:
            if not curve_on(self.topo.auth, addresses, given is not None):
                return None
        except AuthPolicyError as e:
            raise ConfigError(f"{self.topology_path}: {e}") from None
        folder = Path(given) if given else default_curve_dir()
        try:
            sets = [s.name for s in self.topo.sets]
            pairs = [curve.NAME, *map(curve.proxy_pair, sets)]
            if given is None and not all((folder / f"{n}.key_secret").exists() for n in pairs):
                curve.make(folder, sets)
            for pair in pairs[1:]:  # refuse a bad folder here, not in every child
                curve.load(folder, pair)
            return curve.load(folder)
        except curve.CurveKeysError as e:
            raise ConfigError(str(e)) from None

    def _address(self, name: str) -> str:
        if self.topo.transport == "ipc":
            return f"ipc://{self.runtime}/{name}.sock"
        return "tcp://127.0.0.1:0"

    def _data_address(self, name: str, data: str) -> str:
        """Where a stage or DB receives its data: ZeroMQ, or a ring (shared memory when the
        topology is one host, the TCP agent otherwise)."""
        if data != "ring":
            return self._address(name)
        size = f"?slots={self.workflow.ring.slots}&bytes={self.workflow.ring.bytes}"
        if self.topo.transport == "ipc":
            return f"shm://{self.runtime.name}-{name}{size}"
        return f"ring+tcp://127.0.0.1:0{size}"

    def plan(self) -> list[Child]:
        """The processes of the topology, NMs first, each with the deployment's id. ZooKeeper
        credentials reach them by environment, never on their command lines (nm/zk_auth.py)."""
        common = (self.zk.args() if self.zk else []) + [deployment.FLAG, self.deployment]
        env = child_env(self.zk.auth if self.zk else None)
        # The keys folder by environment (a path, not a secret), so that every role finds it alike.
        env.pop(curve.ENV, None)
        common += ["--auth", "off" if self.curve_dir is None else "curve"]
        if self.curve_dir is not None:
            env[curve.ENV] = str(self.curve_dir)
        out = []
        for i, address in enumerate(self.nm_addresses):
            name = "nm" if self.nm_count == 1 else f"nm{i}"
            out.append(Child(name, _cli("nm", "--topology", str(self.topology_path), "--address", address, *common,
                                        *self._operator_args()), self.log_dir / f"{name}.log", for_role(env, "nm")))
        for s in self.topo.sets:
            out += [dataclasses.replace(c, argv=c.argv + common, env=for_role(env, c.argv[3]))
                    for c in self._set_children(s, self.nm_address)]
        return out

    @staticmethod
    def _operator_args() -> list[str]:
        """The NM's operator key: the environment's if set (the NM inherits it), else the file
        `onepiece move` also finds (made now if missing)."""
        if os.environ.get(operator_key.ENV):
            return []
        return [operator_key.FLAG, str(operator_key.ensure_default())]

    def _set_children(self, s: SetSpec, nm: str) -> list[Child]:
        out = []
        for i in range(s.db.count):
            name = f"{s.name}-db{i}"
            argv = _cli("db", "--nm", nm, "--set", s.name, "--name", name,
                        "--listen", self._data_address(name, self.workflow.db.data),
                        "--control", self._address(name + "-ctl"), "--events", self._address(name + "-ev"),
                        "--ttl", str(s.db.ttl_s), "--max-bytes", str(s.db.max_bytes),
                        "--replication", str(min(s.db.replication, s.db.count)))
            argv += ["--keep-after-fetch"] if s.db.purge_after_fetch_s is None else \
                ["--purge-after-fetch", str(s.db.purge_after_fetch_s)]
            out.append(Child(name, argv, self.log_dir / f"{name}.log"))
        for stage, n in s.stages.items():
            for i in range(n):
                name = f"{s.name}-{stage}{i}"
                out.append(self._stage_child(name, "--set", s.name, "--stage", stage, "--name", name, "--listen",
                                             self._data_address(name, self.workflow.stages[stage].data), nm=nm))
        for i in range(s.idle):  # the idle pool receives over ZeroMQ whatever stage it is given
            name = f"{s.name}-idle{i}"
            out.append(self._stage_child(name, "--set", s.name, "--idle", "--name", name,
                                         "--listen", self._address(name), nm=nm))
        for i in range(s.proxy.count):
            name = f"{s.name}-proxy{i}"
            port = s.proxy.port + i if s.proxy.port else 0
            argv = _cli("proxy", "--nm", nm, "--set", s.name, "--name", name, "--host", s.proxy.host,
                        "--port", str(port),
                        "--max-inflight", str(s.proxy.max_inflight), "--max-body-bytes", str(s.proxy.max_body_bytes),
                        "--deadline-factor", str(s.proxy.deadline_factor))
            if not s.proxy.monitor:
                argv.append("--no-monitor")
            if s.proxy.api_keys_file:  # the file's path; the keys themselves never travel by argv
                argv += ["--api-keys-file", s.proxy.api_keys_file]
            out.append(Child(name, argv, self.log_dir / f"{name}.log"))
        return out

    def _stage_child(self, name: str, *args: str, nm: str) -> Child:
        schedule = self.log_dir / f"{name}.schedule.jsonl"
        return Child(name, _cli("stage", "--nm", nm, *args, "--runtime-dir", str(self.runtime),
                                "--schedule-log", str(schedule)), self.log_dir / f"{name}.log", schedule_log=schedule)

    def fixed_ports(self) -> list[tuple[str, int, str]]:
        """(host, port, what) of every fixed TCP port the deployment will bind."""
        out = []
        for i, address in enumerate(self.nm_addresses):
            m = re.match(r"^tcp://([^:/]+):(\d+)$", address)
            if m and int(m.group(2)):
                out.append((m.group(1), int(m.group(2)), f"node manager {i}"))
        for s in self.topo.sets:
            if s.proxy.port:
                out += [(s.proxy.host, s.proxy.port + i, f"proxy {i} of set {s.name}") for i in range(s.proxy.count)]
        return out

    def check_ports(self) -> None:
        """Refuse to start when a fixed port is taken: started anyway, this deployment's roles
        would join whatever answers there (another deployment's NM) and disturb it."""
        from onepiece.ports import holder, in_use

        taken = [f"port {port} ({what}) is in use by {holder(port)}" for host, port, what in self.fixed_ports()
                 if in_use("0.0.0.0" if host in ("*", "0.0.0.0") else host, port)]
        if taken:
            raise RuntimeError("; ".join(taken) + ". Is another deployment running? Stop it, or give this "
                               "topology other ports (nm.address, proxy.port).")

    def _used_stages(self) -> set[str]:
        """The stages this deployment may run (an idle instance may serve any stage)."""
        if any(s.idle for s in self.topo.sets):
            return set(self.workflow.stages)
        return {stage for s in self.topo.sets for stage in s.stages}

    def check_models(self) -> None:
        """Refuse models a stage could not load (a missing component, a truncated weights file):
        its workers would crash-loop, with the cause only in a log, until the ready timeout."""
        from onepiece.stage.loader import model_problems

        used = self._used_stages()
        broken = [f"stage {stage}: {p}" for stage, spec in self.workflow.stages.items() if stage in used
                  for p in model_problems(self.workflow.model_path(spec.model, self.base_dir), spec.components)]
        if broken:
            raise RuntimeError("; ".join(broken) + " (`onepiece models list` shows the models, `onepiece models "
                               "build` rebuilds tiny ones)")

    def check_devices(self) -> None:
        """Refuse a stage whose device this host lacks (an idle instance may serve any stage)."""
        from onepiece.stage.gpu import lacking

        used = self._used_stages()
        missing = [f"stage {stage} runs on {spec.device}, but {why}" for stage, spec in self.workflow.stages.items()
                   if stage in used and (why := lacking(spec.device, spec.workers))]
        if missing:
            raise RuntimeError("; ".join(missing) + ". Set those stages' device (the workflow's stages.<name>.device) "
                               "to what this host has, e.g. cpu.")

    def start(self) -> None:
        from onepiece.stage.wan.tiny import ensure_models

        self.check_ports()
        self.check_devices()
        for s in self.topo.sets:
            s.proxy.keys()  # refuse now, not as a proxy that dies at every restart
        try:
            for path in ensure_models(self.workflow, self.base_dir):
                print(f"built tiny random-weight model at {path}", flush=True)
        except OSError as e:  # a folder it cannot write or that holds something else: `up` says so
            raise RuntimeError(f"cannot build the tiny models: {e.filename}: {e.strerror}"
                               if e.filename and e.strerror else str(e)) from None
        self.check_models()
        self.children = self.plan()
        if self.curve_keys is not None:  # this process asks the NM whether the deployment is ready
            curve.use(self.curve_keys)
        nms, rest = self.children[:self.nm_count], self.children[self.nm_count:]
        for nm in nms:
            nm.start()
        self._wait_nm()
        for c in rest:
            c.start()

    def _wait_nm(self, timeout: float = 30.0) -> None:
        client = NmClient(self.nm_address, timeout=0.5, retries=0)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                self._check_nm_alive()
                try:
                    client.status()
                    return
                except RpcError:
                    time.sleep(0.1)
        finally:
            client.close()
        raise RuntimeError(f"node manager did not answer at {self.nm_address} within {timeout:.0f}s")

    def _check_nm_alive(self) -> None:
        for nm in self.children[:self.nm_count]:
            if nm.proc is not None and nm.proc.poll() is not None:
                raise RuntimeError(f"node manager {nm.name} exited with {nm.proc.returncode}; see {nm.log_path}")

    def missing(self, status: dict) -> list[str]:
        """What the deployment still lacks before it can serve: empty when ready."""
        out = []
        for s in self.topo.sets:
            st = status["sets"].get(s.name, {})
            for stage, want in s.stages.items():
                instances = st.get("stages", {}).get(stage, {}).get("instances", [])
                ready = sum(1 for i in instances if i["ready"])
                if ready < want:
                    # A worker that cannot start says why (stage/worker.py): so does this.
                    why = {e for i in instances if (e := (i.get("stats") or {}).get("worker_error"))}
                    out.append(f"{s.name}/{stage} {ready}/{want}"
                               + "".join(f" (a worker fails to start: {e})" for e in sorted(why)))
            if len(st.get("idle", [])) < s.idle:
                out.append(f"{s.name}/idle pool {len(st.get('idle', []))}/{s.idle}")
            if len(st.get("dbs", [])) < s.db.count:
                out.append(f"{s.name}/db {len(st.get('dbs', []))}/{s.db.count}")
            if len(st.get("proxies", [])) < s.proxy.count:
                out.append(f"{s.name}/proxy {len(st.get('proxies', []))}/{s.proxy.count}")
        if not out:
            # Everyone must also hold the latest routes, or a first request could find none.
            members = [i for st in status["sets"].values() for i in
                       [*st["dbs"], *st["proxies"], *(x for v in st["stages"].values() for x in v["instances"])]]
            behind = [i["id"] for i in members if i["routes_version"] != status["version"]]
            out += [f"{i} (routes)" for i in behind]
        return out

    def wait_ready(self, timeout: float = 300.0, stop: threading.Event | None = None) -> dict[str, list[str]]:
        """Block until every instance is ready; return the proxies' URLs per set."""
        client = NmClient(self.nm_address, timeout=1.0, retries=0)
        deadline = time.monotonic() + timeout
        lacking: list[str] = ["node manager"]
        told: set[str] = set()
        try:
            while time.monotonic() < deadline and not (stop and stop.is_set()):
                for c in self.children:
                    if c.proc is not None and c.proc.poll() is not None:
                        raise RuntimeError(f"{c.name} exited with {c.proc.returncode} while starting; see {c.log_path}")
                try:
                    lacking = self.missing(client.status())
                    if not lacking:
                        return client.proxies()
                except RpcError:
                    pass
                # A cause known now is said now, not at the timeout (its worker keeps retrying).
                for line in lacking:
                    if "fails to start" in line and line not in told:
                        told.add(line)
                        print(f"onepiece: waiting for {line}; logs in {self.log_dir}", file=sys.stderr, flush=True)
                time.sleep(0.2)
        finally:
            client.close()
        if stop is not None and stop.is_set():
            return {}
        raise RuntimeError(f"not ready after {timeout:.0f}s; waiting for {', '.join(lacking)}; logs in {self.log_dir}")

    def supervise(self, stop: threading.Event) -> None:
        """Restart role processes that die, with bounded backoff, and keep their logs within
        their bound (onepiece/logrotate.py), until ``stop``."""
        logs = self.topo.logs
        unrotated: set[Path] = set()  # logs whose rotation failed: said once, not every round
        while not stop.wait(0.5):
            now = time.monotonic()
            for c in self.children:
                # A log folder that is full, read-only or gone, or no descriptor or process to
                # be had, costs the one role its log or its restart (tried again), never the
                # supervisor: its death stopped the whole deployment.
                for path in c.logs:
                    try:
                        if rotate(path, int(logs.max_mb * 2**20), logs.keep):
                            log.info("rotated %s (over %g MB)", path, logs.max_mb)
                            unrotated.discard(path)
                    except OSError as e:
                        if path not in unrotated:
                            unrotated.add(path)
                            log.warning("cannot rotate %s: %s (tried again each round, said again once it rotates)",
                                        path, e)
                if c.proc is not None and c.proc.poll() is not None:
                    log.warning("%s exited with %s; restarting (log: %s)", c.name, c.proc.returncode, c.log_path)
                    c.proc = None
                    c.next_start = c.backoff.next_start()
                if c.proc is None and now >= c.next_start:
                    try:
                        c.start()
                    except OSError as e:
                        c.next_start = c.backoff.next_start()
                        log.warning("%s cannot be started: %s; trying again in %.1fs", c.name, e,
                                    c.next_start - now)

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop everything, role by role (``STOP_ORDER``), each within ``grace_s`` of SIGTERM
        or killed; then the runtime folder."""
        for role in STOP_ORDER:
            group = [c for c in self.children if c.role == role and c.proc is not None and c.proc.poll() is None]
            for c in group:
                c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for c in group:
                try:
                    rc = c.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %.0fs; killing it", c.name, grace_s)
                    c.proc.kill()
                    c.proc.wait()
                    continue
                if rc != 0:  # (what it still had to send may be lost: a crash on the way out)
                    log.warning("%s exited with %s while stopping", c.name, rc)
        shutil.rmtree(self.runtime, ignore_errors=True)
        if self.curve_dir is not None:
            curve.use(None)
        # Rings of processes that were killed (a clean close removes its own).
        for ring in Path("/dev/shm").glob(f"{self.runtime.name}-*"):
            ring.unlink(missing_ok=True)


def default_curve_dir() -> Path:
    """Where `onepiece up` keeps the CURVE keys it makes (beside the operator key)."""
    return operator_key.default_path().parent / "curve"


def status_command(nm_address: str) -> str:
    """The `onepiece status` that reaches this deployment's NM: without --nm it asks the default
    address, which is another deployment's (or nobody's) under a topology with its own."""
    from onepiece.cli import DEFAULT_NM

    return "onepiece status" if nm_address == DEFAULT_NM else f"onepiece status --nm {nm_address}"


def up(topology: Path, log_dir: Path | None = None, ready_timeout: float = 300.0) -> int:
    from onepiece.supervise import stop_on_signals

    stop = stop_on_signals()
    dep = Deployment(topology, log_dir)
    print(f"onepiece: starting {topology} as deployment {dep.deployment} (logs in {dep.log_dir})", flush=True)
    if dep.curve_dir is not None:
        print(f"onepiece: CURVE between roles, keys in {dep.curve_dir} (`onepiece status`, `move` and "
              f"`generate --nm` need {curve.ENV}={dep.curve_dir})", flush=True)
    try:
        dep.start()
        proxies = dep.wait_ready(ready_timeout, stop)
        for set_name, urls in proxies.items():
            for url in urls:
                print(f"onepiece is up: set {set_name} serves the API at {url}", flush=True)
        print(f"node manager at {dep.nm_address}; `{status_command(dep.nm_address)}` shows the cluster; Ctrl-C stops",
              flush=True)
        dep.supervise(stop)
        return 0
    except RuntimeError as e:
        print(f"onepiece up failed: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("onepiece: stopping", flush=True)
        dep.stop()
        print("onepiece: stopped", flush=True)


def write_topology(folder: Path, models: dict[str, Path], nm_address: str, *, dbs: int = 2,
                   transport: str = "ipc", stages: dict[str, int] | None = None, heartbeat_s: float = 0.25,
                   sets: list[dict[str, Any]] | None = None, data: str = "zmq", nm: dict[str, Any] | None = None,
                   device: str = "cpu", threads: int | None = None,
                   schedule: dict[str, dict[str, Any]] | None = None,
                   stage_options: dict[str, dict[str, Any]] | None = None, **set_options: Any) -> Path:
    """A deployment of the shipped workflow with its models at ``models`` ({"t2v": dir,
    "i2v": dir}), written into ``folder`` (for tests and benchmarks). Returns the topology file.

    By default one set, ``set0``, with one proxy on any free port, ``dbs`` DBs, ``stages``
    (default: one instance of every stage) and ``set_options`` (more SetSpec keys; ``proxy``
    and ``db`` merged key by key over those defaults). ``sets``
    declares several instead: each entry's keys go over those defaults (``proxy`` and ``db``
    merged key by key), and an entry without a name is called ``set<i>``. E.g.
    ``sets=[{"name": "a", "proxy": {"max_inflight": 1}}, {"name": "b", "db": {"count": 3}}]``.
    The NM listens at ``nm_address``. ``data="ring"`` makes every stage and DB receive its
    data over the ring buffer instead of ZeroMQ; ``device`` is every stage's torch device, ``threads`` (if given) its
    torch threads, ``schedule`` per stage its scheduling options (e.g. ``{"denoise_t2v": {"policy": "slo"}}``).
    ``nm`` adds NmSpec keys, e.g. ``{"zk": hosts,
    "count": 3}`` for three NMs on ZooKeeper (at ``nm_address`` and the next two ports)."""
    import yaml

    from onepiece.config import deploy_dir

    wf = yaml.safe_load((deploy_dir() / "wan21.yaml").read_text())
    for spec in wf["models"].values():
        spec["path"] = str(models[spec["tiny"]])
    for spec in wf["stages"].values():
        spec["data"] = data
        spec["device"] = device
        if threads:
            spec["threads"] = threads
    for stage, options in (schedule or {}).items():
        wf["stages"][stage]["schedule"] = options
    for stage, options in (stage_options or {}).items():
        wf["stages"][stage].update(options)
    wf["db"] = {"data": data}
    (folder / "workflow.yaml").write_text(yaml.safe_dump(wf))
    base: dict[str, Any] = {"proxy": {"count": 1, "port": 0}, "db": {"count": dbs},
                            "stages": stages or {s: 1 for s in wf["stages"]}}
    for key in ("proxy", "db"):  # merged: {"monitor": False} keeps port 0 (else 8000, a user's own `up`'s)
        base[key] = {**base[key], **set_options.pop(key, {})}
    base.update(set_options)
    out_sets = []
    for i, over in enumerate(sets or [{"name": "set0"}]):
        spec = {**base, "name": f"set{i}", **over}
        for key in ("proxy", "db"):  # merged, so {"proxy": {"max_inflight": 1}} keeps port 0
            spec[key] = {**base.get(key, {}), **over.get(key, {})}
        out_sets.append(spec)
    topo = {
        "workflow": "workflow.yaml",
        "transport": transport,
        "nm": {"address": nm_address, "heartbeat_s": heartbeat_s, "dead_after_s": 6 * heartbeat_s, **(nm or {})},
        "sets": out_sets,
    }
    path = folder / "topology.yaml"
    path.write_text(yaml.safe_dump(topo, sort_keys=False))
    return path


def free_tcp_address() -> str:
    """A loopback TCP address with a port nobody listens on now (for tests and benches)."""
    return f"tcp://127.0.0.1:{free_port()}"

