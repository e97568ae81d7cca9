"""The `onepiece` command: one subcommand per role, plus `up`, `generate`, `status`, `models`
and `bench`. Bad flags get argparse's usage error; bad files a ConfigError naming the key."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from onepiece.argtypes import PORT, between, count, positive
from onepiece.config import IDLE, ConfigError, deploy_dir

if TYPE_CHECKING:
    from onepiece.config import NmSpec
    from onepiece.nm.zk import ZkSettings

DEFAULT_TOPOLOGY = "local.yaml"
PROFILE_WORKFLOWS = {"tiny": "wan21.yaml", "scale": "wan21-scale.yaml"}  # the shipped workflow of each model profile
DEFAULT_NM = "tcp://127.0.0.1:7700"


def _topology(value: str | None) -> Path:
    return Path(value) if value else deploy_dir() / DEFAULT_TOPOLOGY


def cmd_up(args: argparse.Namespace) -> int:
    from onepiece.launcher import up

    topology = _topology(args.topology)
    _operator_key(None)  # a bad ONEPIECE_OPERATOR_KEY stops `up` here, not its NM in a restart loop
    return up(topology, Path(args.logs) if args.logs else None, args.ready_timeout)


def _zk(args: argparse.Namespace, spec: "NmSpec | None" = None) -> "ZkSettings | None":
    """ZooKeeper settings from the --zk* flags, over the topology's nm.zk* (None: no ZooKeeper)."""
    from onepiece.nm.zk import DEFAULT_ROOT, ZkSettings
    from onepiece.nm.zk_auth import CredentialsError, resolve_auth

    hosts = args.zk or (spec.zk if spec is not None else None)
    if not hosts:
        if args.zk_auth_file or args.zk_root:
            raise ConfigError("--zk-root and --zk-auth-file need --zk (the ZooKeeper address)")
        return None
    try:
        auth = resolve_auth(args.zk_auth_file, spec.zk_auth_file if spec is not None else None)
    except CredentialsError as e:
        raise ConfigError(str(e)) from None
    return ZkSettings(hosts, args.zk_root or (spec.zk_root if spec is not None else DEFAULT_ROOT), auth,
                      args.zk_session or (spec.zk_session_s if spec is not None else 4.0))


def _deployment(args: argparse.Namespace) -> str:
    """The deployment a role process belongs to: --deployment, else ONEPIECE_DEPLOYMENT, else none."""
    from onepiece.deployment import resolve

    try:
        return resolve(args.deployment)
    except ValueError as e:  # a bad ONEPIECE_DEPLOYMENT (the flag's own type catches a bad flag)
        raise ConfigError(str(e)) from None


def _curve(args: argparse.Namespace, addresses: list[str], mode: str | None = None, folder: str | None = None,
           pair: str | None = None) -> None:
    """This process's CURVE keys, as --auth (else ``mode``, else auto) decides for the addresses it
    binds and connects to: the keys folder from --curve-dir, else ONEPIECE_CURVE_DIR, else ``folder``."""
    import os

    from onepiece.curve_policy import AuthPolicyError, curve_on
    from onepiece.transport import curve

    folder = getattr(args, "curve_dir", None) or os.environ.get(curve.ENV) or folder
    try:
        on = curve_on(getattr(args, "auth", None) or mode or "auto", addresses, folder is not None)
        if on and folder is None:
            raise ConfigError(f"CURVE is on for {', '.join(addresses)} (beyond loopback, or --auth curve) and no keys "
                              f"folder was given: make one with `onepiece keys curve DIR` and pass --curve-dir DIR "
                              f"(or set {curve.ENV})")
        curve.use(curve.load(folder, pair or curve.NAME) if on else None)
    except (AuthPolicyError, curve.CurveKeysError) as e:
        raise ConfigError(str(e)) from None


def cmd_nm(args: argparse.Namespace) -> int:
    from onepiece.config import load_topology
    from onepiece.nm.server import serve
    from onepiece.supervise import setup_logging

    setup_logging("nm", args.log_level)
    topo, wf, base = load_topology(_topology(args.topology))
    _curve(args, [args.address or topo.nm.address], topo.auth, topo.curve_dir)
    serve(topo, wf, base, args.address, args.metrics_port, zk=_zk(args, topo.nm), advertise=args.advertise,
          deployment_id=_deployment(args) or topo.deployment or "", operator=_operator_key(args.operator_key_file))
    return 0


def _operator_key(path: str | None, fallback: bool = False) -> str | None:
    from onepiece import operator_key
    from onepiece.secret_file import SecretFileError

    try:
        return operator_key.resolve(path, fallback=fallback)
    except SecretFileError as e:
        raise ConfigError(str(e)) from None


def cmd_stage(args: argparse.Namespace) -> int:
    from onepiece.stage.instance import serve
    from onepiece.supervise import setup_logging

    if args.idle and args.stage:
        print("onepiece stage: --idle and --stage exclude each other", file=sys.stderr)
        return 2
    setup_logging(f"stage[{args.stage or ('idle' if args.idle else '?')}]", args.log_level)
    _curve(args, [args.listen, *args.nm.split(",")])
    serve(args.nm, args.set, args.listen, args.stage, args.runtime_dir, args.advertise, zk=_zk(args), idle=args.idle,
          name=args.name, deployment_id=_deployment(args), schedule_log=args.schedule_log)
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    from onepiece.db.service import serve
    from onepiece.supervise import setup_logging

    setup_logging("db", args.log_level)
    _curve(args, [args.listen, args.control, args.events, *args.nm.split(",")])
    serve(args.nm, args.set, args.listen, args.control, args.events, args.ttl, args.max_bytes,
          None if args.keep_after_fetch else args.purge_after_fetch, replication=args.replication,
          advertise=args.advertise, zk=_zk(args), deployment_id=_deployment(args), name=args.name)
    return 0


def cmd_proxy(args: argparse.Namespace) -> int:
    from onepiece.proxy.keys import check_bind, load_keys
    from onepiece.proxy.service import serve
    from onepiece.secret_file import SecretFileError
    from onepiece.supervise import setup_logging
    from onepiece.transport.curve import proxy_pair

    try:
        keys = load_keys(args.api_keys_file)
        check_bind(args.host, keys)
    except SecretFileError as e:
        raise ConfigError(str(e)) from None
    setup_logging("proxy", args.log_level)
    # Its HTTP side has API keys; its ZeroMQ sockets are all clients, proving its set's proxies' pair.
    _curve(args, args.nm.split(","), pair=proxy_pair(args.set))
    serve(args.nm, args.set, args.host, args.port, args.max_inflight, args.max_body_bytes, monitor=args.monitor,
          deadline_factor=args.deadline_factor, advertise=args.advertise, zk=_zk(args), keys=keys,
          deployment_id=_deployment(args), name=args.name)
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from onepiece.proxy.keys import new_key
    from onepiece.secret_file import SecretFileError, write_secret_file

    if args.action == "curve":
        return _curve_keys(args.folder, args.sets)
    if args.folder:
        print("onepiece keys new: takes no folder (a client key goes to --file, or is printed)", file=sys.stderr)
        return 2
    key = new_key()
    if not args.file:
        print(key)
        return 0
    try:
        write_secret_file(args.file, key + "\n")
    except (SecretFileError, OSError) as e:
        print(f"onepiece keys: {e}", file=sys.stderr)
        return 1
    # Not printed: a terminal's scrollback or a CI log would keep it. It is the file's last line.
    print(f"added a key to {args.file} (mode 0600); a client sends it with "
          f"ONEPIECE_API_KEY=\"$(tail -n 1 {args.file})\" or, from a file holding it alone, --api-key-file",
          file=sys.stderr)
    return 0


def _curve_keys(folder: str | None, sets: str) -> int:
    from onepiece.transport import curve

    if not folder:
        print("onepiece keys curve: name the folder to make the deployment's key pairs in", file=sys.stderr)
        return 2
    try:
        names = [s.strip() for s in sets.split(",") if s.strip()]
        curve.make(folder, names)
    except (curve.CurveKeysError, OSError) as e:
        print(f"onepiece keys curve: {e}", file=sys.stderr)
        return 1
    proxies = ", ".join(curve.proxy_pair(s) for s in names)
    print(f"made the deployment's CURVE key pairs in {folder} (what it lacked of {curve.NAME}, {proxies}; secret "
          f"halves of mode 0600). Give every role the folder (--curve-dir {folder} or {curve.ENV}); across hosts, a "
          f"proxy's host needs the *.key files and its set's proxy-SET.key_secret, a member's the *.key files and "
          f"{curve.SECRET}", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import orjson

    from onepiece.nm.client import NmClient
    from onepiece.status import render
    from onepiece.transport.rpc import RpcError

    _curve(args, args.nm.split(","))
    client = NmClient(args.nm, timeout=2.0, retries=0)
    try:
        status = client.status()
    except RpcError as e:
        print(f"no node manager answers at {args.nm}: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(orjson.dumps(status, option=orjson.OPT_INDENT_2).decode() if args.json else render(status))
    nm = status.get("nm") or {}
    if not args.json and nm.get("mode") == "zookeeper":
        print(ha_line(nm))
    return 0


def ha_line(nm: dict) -> str:
    """`onepiece status`'s line on the node managers of an HA deployment."""
    backups = [c for c in nm.get("contenders", []) if c != nm.get("address")]
    return (f"node manager: primary {nm.get('address')} (epoch {nm.get('epoch')}) on ZooKeeper "
            f"{nm.get('zookeeper')}{nm.get('root')}; backups: {', '.join(backups) or 'none'}"
            + ("; ZooKeeper unreachable: serving what it holds, saving nothing, moving nothing"
               if nm.get("suspended") else ""))


def cmd_move(args: argparse.Namespace) -> int:
    from onepiece.nm.client import NmClient

    key = _operator_key(args.operator_key_file, fallback=True)
    _curve(args, args.nm.split(","))
    client = NmClient(args.nm, timeout=2.0, retries=0)
    try:  # an NM's refusal or silence: one line from main
        reply = client.move(args.instance, None if args.stage == IDLE else args.stage, key=key or "")
    finally:
        client.close()
    print(f"moving {reply['instance']} from {reply['from'] or 'the idle pool'} to {reply['to'] or 'the idle pool'}")
    return 0


def _os_error(e: OSError) -> str:
    """One line for an OSError: the path and what is wrong with it, else its message."""
    return f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)


def cmd_models(args: argparse.Namespace) -> int:
    from onepiece.config import load_workflow
    from onepiece.stage.loader import model_problems
    from onepiece.stage.wan.tiny import MARKER, build_tiny, ensure_models

    wf_path = Path(args.workflow) if args.workflow else deploy_dir() / PROFILE_WORKFLOWS[args.profile]
    wf = load_workflow(wf_path)
    paths = {name: wf.model_path(name, wf_path.parent) for name in wf.models}
    if args.action == "list":
        # Exit 1 when a model is not whole: a script can check with it before `onepiece up`.
        whole = True
        for name, spec in wf.models.items():
            problems = model_problems(paths[name])
            state = "present" if not problems else \
                "broken" if (paths[name] / "model_index.json").is_file() else "missing"
            print(f"{name:12s} {state:8s} {paths[name]}"
                  + (f"  ({spec.profile} {spec.tiny}, seed {spec.seed})" if spec.tiny else ""))
            if state == "broken":  # which component, which file
                for p in problems:
                    print(f"{'':12s}   {p}")
            whole = whole and not problems
        return 0 if whole else 1
    try:  # a folder it cannot write, or one holding something else: one line, not a traceback
        for name, spec in wf.models.items():
            if spec.tiny and (paths[name] / MARKER).is_file() and (why := model_problems(paths[name])):
                print(f"{paths[name]}: incomplete ({why[0]}); rebuilding it")
        if args.force:
            built = [build_tiny(spec.tiny, paths[name], spec.seed, profile=spec.profile)
                     for name, spec in wf.models.items() if spec.tiny]
        else:
            built = ensure_models(wf, wf_path.parent)
    except OSError as e:
        print(f"onepiece models build: {_os_error(e)}", file=sys.stderr)
        return 1
    for p in built:
        print(f"built {p}")
    # Models without `tiny` are never built here: say which of them cannot be loaded.
    bad = [f"{name}: {p}" for name in wf.models for p in model_problems(paths[name])]
    for line in bad:
        print(f"onepiece models build: {line}; put the complete model there (remove the broken copy first)",
              file=sys.stderr)
    if not built and not bad:
        print("all models present (use --force to rebuild the tiny ones)")
    return 1 if bad else 0


def cmd_generate(args: argparse.Namespace) -> int:
    from onepiece.generate import run

    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    # Flags that are bad only together (`bench overload --warmup 0 --capacity-source closed-loop`)
    # are refused as a usage error before any work, like a bad flag alone: the benchmark's
    # ``check_args`` says why, naming the flags, or None.
    check = getattr(args.bench, "check_args", None)
    why = check(args) if check is not None else None
    if why:
        args.bench_parser.error(why)
    return args.bench.run(args)


def _checked(parse, what: str):
    """An argparse type from a validator that raises ValueError (usage error naming the flag)."""
    def check(value: str) -> str:
        try:
            return parse(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{what}: {e}") from None
    check.__name__ = what
    return check


def _member_name(value: str) -> str:
    from onepiece.nm.protocol import NAME_PATTERN

    if not re.fullmatch(NAME_PATTERN, value) or len(value) > 128:
        raise argparse.ArgumentTypeError(f"{value[:140]!r}: up to 128 letters, digits, '_', '.' or '-', "
                                         f"starting with a letter or digit")
    return value


def _refused(why: str):
    """An argparse type for a flag that is gone: any value is a usage error saying ``why`` (and not
    echoing the value)."""
    def refuse(value: str) -> str:
        raise argparse.ArgumentTypeError(why)
    refuse.__name__ = "refused"
    return refuse


def _zk_flags(sp: argparse.ArgumentParser) -> None:
    from onepiece.nm.zk import parse_hosts, parse_root
    from onepiece.nm.zk_auth import ENV, NO_COMMAND_LINE

    g = sp.add_argument_group("ZooKeeper (highly available node managers)")
    g.add_argument("--zk", metavar="HOST:PORT[,...]", type=_checked(parse_hosts, "ZooKeeper address"),
                   help="ZooKeeper ensemble the node managers run on")
    g.add_argument("--zk-root", metavar="PATH", type=_checked(parse_root, "znode root"),
                   help="znode under which the cluster lives (default /onepiece)")
    g.add_argument("--zk-auth-file", metavar="PATH",
                   help=f"file of mode 0600 holding user:password (or set {ENV}): the cluster's znodes get digest "
                        f"ACLs for this user only")
    g.add_argument("--zk-auth", help=argparse.SUPPRESS, type=_refused(NO_COMMAND_LINE))
    g.add_argument("--zk-session", metavar="S", type=between(1, 600, " seconds"),
                   help="ZooKeeper session timeout in seconds (default 4): how soon a dead process is noticed")


def _api_keys_flags(sp: argparse.ArgumentParser) -> None:
    from onepiece.proxy.keys import ENV

    sp.add_argument("--api-keys-file", metavar="PATH",
                    help=f"file of mode 0600 with the client API keys, one a line (or set {ENV}); required when "
                         f"--host is beyond loopback")
    sp.add_argument("--api-keys", "--api-key", help=argparse.SUPPRESS, type=_refused(
        f"keys on a command line are readable by every user of the host (ps); put them in a file of mode 0600 "
        f"named by --api-keys-file, or in the environment variable {ENV}"))


def _address(zmq: bool = False):
    """An argparse type: an address this process can bind (a scheme it has a transport for, only
    ZeroMQ's with ``zmq``; a port from 0 to 65535)."""
    def parse(value: str) -> str:
        from onepiece.transport.registry import ZMQ_SCHEMES, checked  # (numpy: not for every command)

        return checked(value, ZMQ_SCHEMES if zmq else None)
    return _checked(parse, "bind address")


def _nm_addresses(value: str) -> str:
    from onepiece.nm.client import split_addresses

    try:
        return ",".join(split_addresses(value))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _curve_flags(sp: argparse.ArgumentParser, auth: bool = True) -> None:
    from onepiece.curve_policy import MODES
    from onepiece.transport.curve import ENV

    g = sp.add_argument_group("CURVE between roles (see onepiece keys curve)")
    g.add_argument("--curve-dir", metavar="DIR",
                   help=f"folder with the deployment's CURVE keys (default: {ENV}; see onepiece keys curve); "
                        f"secret files of mode 0600")
    if auth:
        g.add_argument("--auth", choices=MODES,
                       help="curve: always; off: without CURVE, refused for an address beyond loopback; auto (the "
                            "default, or the topology's auth): CURVE when an address is beyond loopback or keys "
                            "are given")


def _operator_flag(sp: argparse.ArgumentParser, help: str) -> None:
    from onepiece.operator_key import FLAG

    sp.add_argument(FLAG, metavar="FILE", help=f"file (mode 0600) with {help}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="onepiece", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def role(name: str, help: str) -> argparse.ArgumentParser:
        from onepiece.deployment import ENV, FLAG, check_id

        sp = sub.add_parser(name, help=help)
        sp.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
        sp.add_argument(FLAG, metavar="ID", type=_checked(check_id, "deployment id"),
                        help=f"the deployment this process belongs to (default: {ENV}, else none; onepiece up "
                             f"gives one): a node manager refuses members of another deployment")
        _curve_flags(sp)
        return sp

    sp = sub.add_parser("up", help="start a whole local deployment from a topology file")
    sp.add_argument("--topology", help=f"topology YAML (default: the shipped {DEFAULT_TOPOLOGY})")
    sp.add_argument("--logs", help="folder for the processes' logs (default: runs/<time>)")
    sp.add_argument("--ready-timeout", type=positive(" seconds"), default=300.0, help="seconds to wait for readiness")
    sp.set_defaults(fn=cmd_up)

    sp = role("nm", "run the node manager")
    sp.add_argument("--topology", help="topology YAML")
    sp.add_argument("--address", type=_address(zmq=True), help="bind address (default: the topology's)")
    sp.add_argument("--metrics-port", type=PORT, default=0, help="Prometheus port (default: any free one)")
    sp.add_argument("--advertise", metavar="HOST", help="host that clients reach this NM at (default: the bound one)")
    _zk_flags(sp)
    _operator_flag(sp, "the operator key that `move` needs (default: ONEPIECE_OPERATOR_KEY; none: moves refused)")
    sp.set_defaults(fn=cmd_nm)

    for name, help in (("stage", "run one workflow instance"), ("db", "run one result store"),
                       ("proxy", "run one HTTP proxy")):
        sp = role(name, help)
        sp.add_argument("--nm", default=DEFAULT_NM, type=_nm_addresses,
                        help="node manager address, or several (a,b,c: the primary is found among them)")
        sp.add_argument("--set", default="set0", help="workflow set to join")
        _zk_flags(sp)
        sp.add_argument("--advertise", metavar="HOST",
                        help="host that peers reach this instance at (default: the bound one), e.g. a "
                             "container's service name when binding 0.0.0.0")
        sp.add_argument("--name", default="", type=_member_name,
                        help="its id in the deployment, which outlives this process (onepiece up names every "
                             "member): started again under it, it takes its dead predecessor's place (a stage "
                             "returns to where the NM last moved it); a second live process under it is refused")
        if name == "stage":
            sp.add_argument("--stage", help="serve this stage first (default: whatever the NM assigns); the NM "
                                            "may move the instance later")
            sp.add_argument("--idle", action="store_true", help="start in the idle pool, for the NM to assign")
            sp.add_argument("--listen", type=_address(), default="tcp://127.0.0.1:0",
                            help="data address to receive on")
            sp.add_argument("--runtime-dir", help="folder for worker sockets")
            sp.add_argument("--schedule-log", metavar="FILE",
                            help="append what each worker runs, a JSON line per chunk (onepiece up writes "
                                 "<logs>/<name>.schedule.jsonl beside the role's log)")
            sp.set_defaults(fn=cmd_stage)
        elif name == "db":
            sp.add_argument("--listen", type=_address(), default="tcp://127.0.0.1:0",
                            help="data address (results, status)")
            sp.add_argument("--control", type=_address(zmq=True), default="tcp://127.0.0.1:0", help="read/RPC address")
            sp.add_argument("--events", type=_address(zmq=True), default="tcp://127.0.0.1:0",
                            help="completion events (PUB) address")
            sp.add_argument("--ttl", type=positive(" seconds"), default=3600.0, help="seconds a result is kept")
            sp.add_argument("--max-bytes", type=count(), default=1 << 30, help="memory cap of the store")
            sp.add_argument("--purge-after-fetch", type=between(0, 86_400, " seconds"), default=60.0,
                            metavar="SECONDS",
                            help="purge a result this long after its first fetch (0: at once; default 60)")
            sp.add_argument("--keep-after-fetch", action="store_true", help="keep a fetched result until its TTL")
            sp.add_argument("--replication", type=count(), default=2,
                            help="DBs of the set that hold each result, this one included (default 2)")
            sp.set_defaults(fn=cmd_db)
        else:
            sp.add_argument("--host", default="127.0.0.1")
            sp.add_argument("--port", type=PORT, default=8000, help="0 picks a free port")
            sp.add_argument("--max-inflight", type=count(), default=64)
            sp.add_argument("--max-body-bytes", type=count(), default=16 << 20)
            sp.add_argument("--no-monitor", dest="monitor", action="store_false",
                            help="admit by the in-flight bound only: no capacity or deadline refusals")
            sp.add_argument("--deadline-factor", type=between(0, 1000), default=2.0,
                            help="refuse a request without timeout_s that is predicted to take more than this many "
                                 "times its standalone time (0: only the app's limit; default %(default)s)")
            _api_keys_flags(sp)
            sp.set_defaults(fn=cmd_proxy)

    sp = sub.add_parser("status", help="print sets, stages, instances, health and queues")
    sp.add_argument("--nm", default=DEFAULT_NM, type=_nm_addresses, help="node manager address(es), a,b,c")
    sp.add_argument("--json", action="store_true")
    _curve_flags(sp, auth=False)
    sp.set_defaults(fn=cmd_status)

    sp = sub.add_parser("keys", help="make a client API key for the proxies (new), or the deployment's CURVE key "
                                     "pairs (curve DIR)")
    sp.add_argument("action", choices=["new", "curve"])
    sp.add_argument("folder", nargs="?", help="curve: the folder to make the key pairs in (mode 0700)")
    sp.add_argument("--sets", default="set0", metavar="A,B",
                    help="curve: the sets whose proxies get a pair of their own (default set0)")
    sp.add_argument("--file", metavar="PATH",
                    help="append it to this keys file (created with mode 0600) instead of printing it")
    sp.set_defaults(fn=cmd_keys)

    sp = sub.add_parser("move", help="move a stage instance to another stage, or to the idle pool")
    sp.add_argument("instance", help="instance id, as `onepiece status` shows it")
    sp.add_argument("stage", help="stage name, or 'idle' for the idle pool")
    sp.add_argument("--nm", default=DEFAULT_NM, type=_nm_addresses, help="node manager address(es), a,b,c")
    _operator_flag(sp, "the operator key (default: ONEPIECE_OPERATOR_KEY, else the file `onepiece up` keeps)")
    _curve_flags(sp, auth=False)
    sp.set_defaults(fn=cmd_move)

    sp = sub.add_parser("models", help="build or list the models of a workflow (list exits 1 if one is not whole)")
    sp.add_argument("action", choices=["build", "list"])
    sp.add_argument("--workflow", help="workflow YAML (default: the shipped one of --profile)")
    sp.add_argument("--profile", choices=sorted(PROFILE_WORKFLOWS), default="tiny",
                    help="without --workflow: tiny (wan21.yaml, the default) or scale (wan21-scale.yaml: stage costs "
                         "in real Wan2.1's proportions, for benchmarks)")
    sp.add_argument("--force", action="store_true", help="rebuild tiny models even if present")
    sp.set_defaults(fn=cmd_models)

    sp = sub.add_parser("profile", help="time the stage functions over shapes and batch sizes: a cost table")
    from onepiece.profile import add_arguments as profile_arguments, run as profile_run

    profile_arguments(sp)
    sp.set_defaults(fn=profile_run)

    sp = sub.add_parser("sim", help="replay a trace through workflow sets on a virtual clock (the real policies)")
    from onepiece.sim.cli import add_arguments as sim_arguments, run as sim_run

    sim_arguments(sp)
    sp.set_defaults(fn=sim_run)

    sp = sub.add_parser("schedule", help="what a deployment's workers ran, from its schedule logs: a Perfetto trace")
    from onepiece.schedule_trace import add_arguments as schedule_arguments, run as schedule_run

    schedule_arguments(sp)
    sp.set_defaults(fn=schedule_run)

    sp = sub.add_parser("plan", help="the fewest devices that meet an SLO for a load: monolithic vs disaggregated")
    from onepiece.sim.cli import add_plan_arguments, run_plan

    add_plan_arguments(sp)
    sp.set_defaults(fn=run_plan)

    sp = sub.add_parser("generate", help="generate a video through a running deployment")
    from onepiece.generate import add_arguments

    add_arguments(sp)
    sp.set_defaults(fn=cmd_generate)

    sp = sub.add_parser("bench", help="benchmarks (see bench/)")
    benches = sp.add_subparsers(dest="which", required=True, metavar="BENCHMARK")
    from onepiece.bench import (batching, cpu, curve, dop, draws, e2e, elastic, failover, moves, mp4, overload,
                                 parallel, sched, shares, simpool, simspeed, simval, transport, validation)

    for module, help_text in (
        (e2e, "end-to-end latency against the monolithic pipeline"),
        (cpu, "CPU time and wake-ups of each role of a deployment, per request and at idle"),
        (mp4, "the MP4 encoder's CPU time, size and quality: the shipped x264 settings against others"),
        (batching, "denoise throughput and latency at max batch 1, 2, 4, 8 (scale models)"),
        (dop, "elastic DoP against static DoP 1, 2, 4 on simulated GPU fleets (published cost table)"),
        (parallel, "one denoising step at DoP 1, 2 (4): CFG- and sequence-parallel, and what a switch costs"),
        (sched, "the stage scheduling policies on a seeded trace of mixed requests (scale models)"),
        (shares, "each stage's share of a request's device time and a step's cost by batch size (up to real Wan2.1 size)"),
        (simspeed, "simulated requests per second for a fleet (target: 10^6 requests over 1,000 devices in 60 s)"),
        (simval, "the simulator against a bench sched run: predicted vs measured, every policy and load"),
        (simpool, "the simulator against the mean of repeated bench sched runs of one trace (their simval.json)"),
        (draws, "a bench sched run's traces against other draws of them, in the simulator: how typical they are"),
        (moves, "the NM's elastic policy, its defaults against its earlier rules, in the simulator (real-size costs)"),
        (overload, "open-loop load at multiples of capacity, request monitor on and off"),
        (transport, "transport throughput and one-way latency against memcpy"),
        (validation, "the receivers' schema checks per message, against sending it over zmq"),
        (curve, "the cost of CURVE on the data path: ZeroMQ tcp with and without it, 1 KB and 16 MB"),
        (failover, "node manager failover on ZooKeeper: SIGKILL and graceful handover times"),
        (elastic, "elastic assignment: saturation begins -> a moved instance serves the busy stage"),
    ):
        bp = benches.add_parser(module.__name__.rsplit(".", 1)[1], help=help_text)
        module.add_arguments(bp)
        bp.set_defaults(fn=cmd_bench, bench=module, bench_parser=bp)
    return p


def main(argv: list[str] | None = None) -> None:
    from onepiece.nm.zk import ZkUnavailable
    from onepiece.transport.context import flush_before_exit
    from onepiece.transport.rpc import RpcError

    args = build_parser().parse_args(argv)
    try:
        code = args.fn(args)
    except ConfigError as e:
        print(f"configuration error:\n{e}", file=sys.stderr)
        code = 2
    except (ZkUnavailable, RpcError) as e:  # what is unreachable, or who refused us, without a traceback
        print(f"onepiece {args.command}: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    finally:
        # The process's own entry (the program's arguments; a caller in process keeps its
        # context): what it sent leaves before it exits.
        if argv is None and not flush_before_exit():
            print(f"onepiece {args.command}: a ZeroMQ socket was left open at exit; what it held may be lost",
                  file=sys.stderr)
    sys.exit(code)
