"""`onepiece bench failover`: how long the cluster is without a primary node manager.

A local deployment (`onepiece up`'s Deployment: three NMs on ZooKeeper, one set with
text_encode, denoise_t2v and vae_decode on the tiny models, one DB, one proxy) on a throwaway
3-server ZooKeeper ensemble (tests/zk_harness.py: real servers, ``tickTime=500``), or on
``--zk HOSTS``. Sessions last ``--session`` seconds (2 by default). While ``--load`` clients
send requests one after another (each waits for its result), the benchmark repeatedly:

- SIGKILLs the primary NM (``--kills`` times): failover time = the kill → the first RPC the
  new primary answers as primary. The new primary is learnt from a ZooKeeper watch on the
  ``primary`` node, then asked for the set's routes until it answers (a backup redirects);
  a watch fires within a few ms, so the figure is not padded by polling. The load runs in a
  process of its own, so its clients do not delay this process's watch. ZooKeeper expires
  the dead primary's session ``session`` to ``session`` + one tick after its last contact
  (a ping at most ``session``/3 before the kill); the election and the takeover (one
  transaction that claims the epoch and publishes the primary, and the state read) add
  milliseconds.
- SIGTERMs the primary (``--graceful`` times): graceful handover time, same measure. The NM
  closes its ZooKeeper session first thing on SIGTERM, which deletes its lock and primary
  nodes at once, waking the next contender.

Before each round it waits until the killed NM has been restarted (by the deployment's
supervisor) and contends again, so there are always two backups. Every request of the load
must complete: failed, refused (429) or unanswered requests are counted and reported.

Results (every round, p50 and max per kind, the load's outcomes, the settings) go to
``failover.json`` and ``failover.md`` under ``--out``. Targets (issue 4): SIGKILL failover
p50 ≤ 2.5 s and max ≤ 3.5 s at 2 s sessions; graceful ≤ 50 ms; zero failed requests.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from onepiece.argtypes import between, count, out_dir, positive
from onepiece.bench.common import (MAX_THREADS, T2V_STAGES, parse_shape, percentile, shape_flag,
                                   tiny_models)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kills", type=count(0), default=10, help="SIGKILLs of the primary NM")
    p.add_argument("--graceful", type=count(0), default=10, help="SIGTERMs of the primary NM")
    p.add_argument("--session", type=between(1, 600, " seconds"), default=2.0, help="ZooKeeper session timeout, seconds")
    p.add_argument("--heartbeat", type=positive(" seconds"), default=0.25, help="instances' heartbeat period, seconds")
    p.add_argument("--load", type=count(0), default=2, help="clients sending requests back to back (0: no load)")
    p.add_argument("--shape", type=shape_flag, default="32x32x5:2", help="the load's requests, WxHxFRAMES:STEPS")
    p.add_argument("--threads", type=count(0, MAX_THREADS), default=1,
                   help="torch threads of every stage worker (0: the workflow's own, 1 or all cores per shape)")
    p.add_argument("--zk", help="use this ZooKeeper (host:port,...) instead of starting three servers")
    p.add_argument("--models", help="folder for the tiny models (default: a temporary one)")
    p.add_argument("--logs", help="keep the deployment's logs in this folder (default: dropped with the run)")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for failover.json and failover.md")


def _zk_harness():
    """tests/zk_harness.py, which starts real throwaway ZooKeeper servers (the benchmark runs
    from a checkout, like the tests)."""
    tests = Path(__file__).resolve().parents[1] / "tests"
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    import zk_harness

    return zk_harness


class PrimaryWatch:
    """The ``primary`` node's address as ZooKeeper tells it, with the time each change arrived."""

    def __init__(self, zk, path: str) -> None:
        from onepiece.nm.zk_store import read_primary

        self._cond = threading.Condition()
        self.address: str | None = None
        self.changed_at = 0.0

        def on_change(data: bytes | None, stat: Any) -> None:
            with self._cond:
                self.address, self.changed_at = read_primary(data), time.monotonic()
                self._cond.notify_all()

        zk.DataWatch(path, on_change)

    def wait_other(self, old: str | None, timeout: float) -> tuple[str, float]:
        """The first primary other than ``old``, and when the watch saw it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.address is None or self.address == old:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no new primary within {timeout:.0f}s (still {self.address})")
                self._cond.wait(left)
            return self.address, self.changed_at


def _serving(address: str, timeout: float) -> float:
    """When ``address`` first answers as the primary: asked for the set's routes, the cheap
    question instances and clients ask (a backup answers it with a redirect)."""
    from onepiece.transport.rpc import RpcClient, RpcError

    rpc = RpcClient(address, timeout=0.2, retries=0)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                rpc.call("routes", set="set0")
                return time.monotonic()
            except RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} did not answer as primary within {timeout:.0f}s")
            time.sleep(0.001)
    finally:
        rpc.close()


class Load:
    """``n`` clients, each sending a request and waiting for its result, over and over."""

    def __init__(self, url: str, n: int, shape: tuple[int, int, int, int]) -> None:
        self.url, self.shape = url, shape
        self.outcomes: dict[str, int] = {"completed": 0, "failed": 0, "refused": 0, "hung": 0, "error": 0}
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _count(self, what: str, detail: str = "") -> None:
        with self._lock:
            self.outcomes[what] += 1
            if detail and len(self.errors) < 20:
                self.errors.append(detail)

    def _run(self) -> None:
        from onepiece.client import Client, RequestFailed, RequestRejected

        w, h, f, steps = self.shape
        with Client(self.url, rounds=1, timeout=10) as c:
            while not self._stop.is_set():
                try:
                    v = c.submit("a lighthouse in a storm", model="t2v", size=f"{w}x{h}", num_frames=f, steps=steps)
                except RequestRejected as e:
                    self._count("refused", str(e))
                    time.sleep(0.2)
                    continue
                except Exception as e:
                    self._count("error", repr(e))
                    time.sleep(0.2)
                    continue
                try:
                    c.wait(v["id"], timeout=60)
                    self._count("completed")
                except RequestFailed as e:
                    self._count("failed", str(e))
                except TimeoutError as e:
                    self._count("hung", str(e))
                except Exception as e:
                    self._count("error", repr(e))

    def stop(self) -> dict[str, int]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=70)
        return dict(self.outcomes)


def load_worker(argv: list[str] | None = None) -> None:
    """The load in a process of its own (``python -c``; see LoadProcess): URL, clients and shape
    in ``argv``; runs until its stdin closes, then prints its outcomes as JSON."""
    url, n, shape = argv or sys.argv[1:4]
    load = Load(url, int(n), parse_shape(shape))
    load.start()
    sys.stdin.read()  # returns when the benchmark closes our stdin
    outcomes = load.stop()
    print(json.dumps({"outcomes": outcomes, "errors": load.errors}), flush=True)


class LoadProcess:
    """``Load`` in a child process, so its HTTP polling does not compete for this process's GIL
    with the watch that times the handovers."""

    def __init__(self, url: str, n: int, shape: str) -> None:
        self.argv = [sys.executable, "-c", "from onepiece.bench.failover import load_worker; load_worker()",
                     url, str(n), shape]
        self.errors: list[str] = []
        self._proc = None

    def start(self) -> None:
        import subprocess

        self._proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def stop(self) -> dict[str, int]:
        import subprocess

        if self._proc is None:
            return {}
        try:
            out, _ = self._proc.communicate(input="", timeout=90)  # closes its stdin: it stops and reports
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
            raise RuntimeError("the load process did not report its outcomes within 90s") from None
        result = json.loads(out.strip().splitlines()[-1])
        self.errors = result["errors"]
        return result["outcomes"]


def _contenders(zk, path: str) -> int:
    return len(zk.get_children(path))


def measure(args: argparse.Namespace, models: dict[str, Path], hosts: str, folder: Path) -> dict[str, Any]:
    from onepiece.launcher import Deployment, write_topology
    from onepiece.nm.zk import Paths, ZkSettings
    from onepiece.ports import free_port_run

    root = f"/bench-failover-{os.getpid()}"
    nms = 3
    base = free_port_run(nms)  # the NMs listen on base, base + 1, base + 2
    topo = write_topology(folder, models, f"tcp://127.0.0.1:{base}", dbs=1, stages=dict(T2V_STAGES),
                          heartbeat_s=args.heartbeat, threads=args.threads,  # busy workers must not oversubscribe the cores
                          nm={"zk": hosts, "zk_root": root, "count": nms, "zk_session_s": args.session})
    dep = Deployment(topo, Path(args.logs) if args.logs else folder / "logs")
    paths = Paths(root)
    zk = ZkSettings(hosts, root, session_s=args.session).connect()
    stop = threading.Event()
    rounds: list[dict[str, Any]] = []
    load = None
    try:
        dep.start()
        url = dep.wait_ready(300)["set0"][0]
        supervisor = threading.Thread(target=dep.supervise, args=(stop,), daemon=True)
        supervisor.start()
        watch = PrimaryWatch(zk, paths.primary)
        if args.load:
            load = LoadProcess(url, args.load, args.shape)
            load.start()
            time.sleep(3.0)  # the load reaches a steady state before the first kill
        plan = [("sigkill", signal.SIGKILL)] * args.kills + [("graceful", signal.SIGTERM)] * args.graceful
        for i, (kind, sig) in enumerate(plan):
            deadline = time.monotonic() + 60
            while _contenders(zk, paths.election) < 3 or watch.address is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("the restarted node manager did not contend again within 60s")
                time.sleep(0.05)
            old = watch.address
            (child,) = [c for c in dep.children[:dep.nm_count] if old in c.argv]
            t0 = time.monotonic()
            os.kill(child.proc.pid, sig)
            new, seen = watch.wait_other(old, timeout=15)
            served = _serving(new, timeout=5)
            row = {"kind": kind, "round": i, "from": old, "to": new,
                   "watch_s": round(seen - t0, 4), "serving_s": round(served - t0, 4)}
            rounds.append(row)
            print(f"{kind:8s} {i:2d}: {old} -> {new} serving after {row['serving_s'] * 1000:.1f} ms", flush=True)
            time.sleep(0.5)
        outcomes = load.stop() if load else {}
        errors = load.errors if load else []
        load = None
    finally:
        if load is not None:
            load.stop()
        stop.set()
        zk.stop()
        zk.close()
        dep.stop()
    return {"rounds": rounds, "load": outcomes, "load_errors": errors}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    xs = [r["serving_s"] for r in rows]
    return {"n": len(xs), "p50_s": percentile(xs, 50), "max_s": max(xs) if xs else None,
            "min_s": min(xs) if xs else None}


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parse_shape(args.shape)  # a bad shape stops here, before anything starts
    if args.kills + args.graceful == 0:
        raise SystemExit("--kills and --graceful: some round must be asked for")
    zh = _zk_harness()
    ensemble = None
    with tempfile.TemporaryDirectory(prefix="onepiece-bench-") as tmp:
        models = tiny_models(Path(args.models) if args.models else Path(tmp) / "models")
        hosts = args.zk
        if hosts is None:
            why = zh.missing()
            if why:
                raise SystemExit(f"cannot start ZooKeeper: {why}")
            ensemble = zh.ZkEnsemble(3, Path(tmp) / "zk").start()
            hosts = ensemble.hosts
        try:
            print(f"ZooKeeper {hosts}; {args.kills} SIGKILLs and {args.graceful} SIGTERMs of the primary NM, "
                  f"{args.session:g} s sessions, load {args.load}", flush=True)
            load_before = os.getloadavg()
            res = measure(args, models, hosts, Path(tmp))
            res["machine_loadavg"] = {"before": load_before, "after": os.getloadavg()}
        finally:
            if ensemble is not None:
                ensemble.stop()
    kill = _summary([r for r in res["rounds"] if r["kind"] == "sigkill"])
    grace = _summary([r for r in res["rounds"] if r["kind"] == "graceful"])
    result = {"bench": "failover", "when": time.strftime("%Y-%m-%d %H:%M"), "cpu_count": os.cpu_count(),
              "settings": {"session_s": args.session, "tick_ms": 500 if args.zk is None else None,
                           "heartbeat_s": args.heartbeat, "ensemble": 3 if args.zk is None else args.zk,
                           "load_clients": args.load, "shape": args.shape},
              "sigkill": kill, "graceful": grace, **res,
              "targets": {"sigkill_p50_s": 2.5, "sigkill_max_s": 3.5, "graceful_s": 0.05, "failed_requests": 0}}
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "failover.json").write_text(json.dumps(result, indent=2))

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f} ms" if x >= 0.1 else f"{x * 1000:.1f} ms"

    load = res["load"]
    # the harness's servers tick every 500 ms; a given ensemble's tick is not known here
    tick = "tickTime 500 ms" if args.zk is None else f"the ensemble at {args.zk}"
    expiry = (f"between {args.session:g} and {args.session + 0.5:g} s" if args.zk is None
              else "at the session timeout, rounded up to its tickTime,")
    aim = "" if args.session == 2.0 else " (targets set for 2 s sessions)"
    lines = [
        f"Node manager failover, {args.session:g} s ZooKeeper sessions ({tick}), 3 NMs, "
        f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}",
        "",
        "| primary stopped by | rounds | p50 | max | min | target |",
        "|---|---|---|---|---|---|",
        f"| SIGKILL | {kill['n']} | {ms(kill['p50_s'])} | {ms(kill['max_s'])} | {ms(kill['min_s'])} "
        f"| p50 ≤ 2.5 s, max ≤ 3.5 s{aim} |",
        f"| SIGTERM (graceful) | {grace['n']} | {ms(grace['p50_s'])} | {ms(grace['max_s'])} | {ms(grace['min_s'])} "
        f"| ≤ 50 ms |",
        "",
        "Time = stop signal → the new primary's first answer as primary. After a SIGKILL it is mostly "
        f"ZooKeeper's: the server expires the dead NM's session {expiry} after its last contact "
        "(expiry runs on tickTime boundaries); the takeover itself (election wake-up, one transaction, "
        "reading the state) takes milliseconds, as the graceful row shows.",
        "",
        f"Machine load average (1 min) before / after: {res['machine_loadavg']['before'][0]:.1f} / "
        f"{res['machine_loadavg']['after'][0]:.1f} ({os.cpu_count()} CPUs, shared with other work).",
        "",
    ]
    if load:
        lines.append(f"Load during all rounds ({args.load} clients, {args.shape}): " +
                     ", ".join(f"{k} {v}" for k, v in load.items()))
    table = "\n".join(lines)
    (outdir / "failover.md").write_text(table + "\n")
    print(table)
    print(f"saved {outdir / 'failover.json'} and {outdir / 'failover.md'}")
    # A 429 is the request monitor doing its job (the client may try again), not a failure.
    bad = sum(v for k, v in load.items() if k not in ("completed", "refused"))
    return 1 if bad else 0
