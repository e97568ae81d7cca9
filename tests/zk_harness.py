"""Throwaway ZooKeeper servers for tests and benchmarks (no tests here).

Real servers, not fakes: Debian's ``zookeeper`` package (3.8) run in the foreground with
``java -cp /usr/share/java/zookeeper.jar ... QuorumPeerMain zoo.cfg``, standalone or as a
loopback ensemble, each server with its own ``zoo.cfg``, data folder and log under a temporary
folder, on free loopback ports. The jar's manifest names its own dependencies (netty, jute,
slf4j-api, ...), so the classpath is the jar plus an slf4j binding for readable logs.

Settings that matter for the tests: ``tickTime=500`` with ``minSessionTimeout=1000`` so a
client's 2 s session is granted as asked (the defaults would raise it to 4 s), and the server
expires a dead client's session within about one tick of its timeout;
``clientPortAddress=127.0.0.1`` and ``admin.enableServer=false`` so nothing listens beyond
loopback; ``4lw.commands.whitelist=*`` for the ``srvr`` readiness probe.

``kazoo.testing`` is not used: it needs extra packages and its ``expire_session`` only fakes
expiry on the client, where killing a real process (``ZkEnsemble.kill``) expires it for real.
Imported by name (pytest puts tests/ on the path); bench/failover.py imports it the same way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ZK_JAR = Path("/usr/share/java/zookeeper.jar")
SLF4J_BINDING = Path("/usr/share/java/slf4j-simple.jar")
MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"


def missing() -> str | None:
    """Why ZooKeeper servers cannot be started here (None when they can)."""
    if shutil.which("java") is None:
        return "no `java` on PATH (CI installs it with `apt-get install zookeeper`)"
    if not ZK_JAR.exists():
        return f"no {ZK_JAR} (CI installs it with `apt-get install --no-install-recommends zookeeper`)"
    return None


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports nobody listens on now (all held open together while
    picking, so they differ; a tiny race with other processes remains, as with any port 0)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def four_letter(port: int, word: str = "srvr", timeout: float = 1.0) -> str:
    """A four-letter-word command's answer ('' when the server does not answer)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(word.encode())
            chunks = []
            while chunk := s.recv(4096):
                chunks.append(chunk)
            return b"".join(chunks).decode(errors="replace")
    except OSError:
        return ""


@dataclass
class ZkServer:
    myid: int
    folder: Path
    client_port: int
    quorum_port: int
    election_port: int
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def log_path(self) -> Path:
        return self.folder / "server.log"

    def write_config(self, peers: list["ZkServer"]) -> Path:
        data = self.folder / "data"
        data.mkdir(parents=True, exist_ok=True)
        lines = [
            "tickTime=500", "initLimit=10", "syncLimit=5",
            f"dataDir={data}",
            f"clientPort={self.client_port}", "clientPortAddress=127.0.0.1",
            "admin.enableServer=false",
            "minSessionTimeout=1000", "maxSessionTimeout=60000",
            "4lw.commands.whitelist=*",
            "maxClientCnxns=0",
        ]
        if len(peers) > 1:
            (data / "myid").write_text(f"{self.myid}\n")
            lines += [f"server.{p.myid}=127.0.0.1:{p.quorum_port}:{p.election_port}" for p in peers]
        cfg = self.folder / "zoo.cfg"
        cfg.write_text("\n".join(lines) + "\n")
        return cfg

    def start(self) -> None:
        from onepiece.supervise import child_preexec

        classpath = ":".join(str(p) for p in (ZK_JAR, SLF4J_BINDING) if p.exists())
        argv = ["java", "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
                "-Djava.net.preferIPv4Stack=true", "-Dzookeeper.jmx.log4j.disable=true",
                "-cp", classpath, MAIN, str(self.folder / "zoo.cfg")]
        with open(self.log_path, "ab") as log:
            # PDEATHSIG: a test runner killed mid-test leaves no server behind.
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.folder, preexec_fn=child_preexec)

    def mode(self) -> str | None:
        """'standalone', 'leader' or 'follower' once serving, else None."""
        for line in four_letter(self.client_port).splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive:
            self.proc.send_signal(sig)
            self.proc.wait(10)

    def stop(self, grace_s: float = 5.0) -> None:
        if self.alive:
            self.proc.terminate()
            self.reap(grace_s)

    def reap(self, grace_s: float = 5.0) -> None:
        """Wait for a signalled server to exit; killed after ``grace_s``."""
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class ZkEnsemble:
    """``size`` ZooKeeper servers on loopback (1: standalone). ``hosts`` is the connect string
    for clients. Use as a context manager, or call ``start()`` and ``stop()``."""

    def __init__(self, size: int = 1, folder: Path | None = None) -> None:
        if size < 1:
            raise ValueError("an ensemble needs at least one server")
        self._own = folder is None
        self.folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="zk-"))
        ports = free_ports(3 * size)
        self.servers = [ZkServer(i + 1, self.folder / f"zk{i + 1}", *ports[3 * i:3 * i + 3]) for i in range(size)]

    @property
    def hosts(self) -> str:
        return ",".join(s.address for s in self.servers)

    def start(self, timeout: float = 30.0) -> "ZkEnsemble":
        for s in self.servers:
            s.write_config(self.servers)
        for s in self.servers:
            s.start()
        self.wait_serving(timeout)
        return self

    def wait_serving(self, timeout: float = 30.0, servers: list[ZkServer] | None = None) -> None:
        """Until every live server (or those given) serves clients; a quorum has a leader."""
        todo = [s for s in (servers or self.servers) if s.alive]
        deadline = time.monotonic() + timeout
        while todo:
            for s in list(todo):
                if not s.alive:
                    raise RuntimeError(f"ZooKeeper server {s.myid} exited with {s.proc.returncode}; "
                                       f"log:\n{s.log_path.read_text(errors='replace')[-3000:]}")
                if s.mode() is not None:
                    todo.remove(s)
            if not todo:
                break
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- zk{s.myid}\n{s.log_path.read_text(errors='replace')[-2000:]}" for s in todo)
                raise RuntimeError(f"ZooKeeper not serving after {timeout:.0f}s:\n{logs}")
            time.sleep(0.05)

    def leader(self) -> ZkServer | None:
        for s in self.servers:
            if s.alive and s.mode() in ("leader", "standalone"):
                return s
        return None

    def kill(self, index: int, sig: int = signal.SIGKILL) -> ZkServer:
        """SIGKILL one server (by position); the others keep the quorum if a majority is left."""
        s = self.servers[index]
        s.kill(sig)
        return s

    def restart(self, index: int, timeout: float = 30.0) -> None:
        s = self.servers[index]
        s.start()
        self.wait_serving(timeout, [s])

    def stop(self) -> None:
        # Signalled all at once, then waited for: each JVM takes a few hundred ms to exit.
        live = [s for s in self.servers if s.alive]
        for s in live:
            with contextlib.suppress(Exception):
                s.proc.terminate()
        for s in live:
            with contextlib.suppress(Exception):
                s.reap()
        if self._own:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "ZkEnsemble":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def kazoo_client(hosts: str, session_s: float = 2.0, auth: str | None = None):
    """A started kazoo client (for tests that look at znodes directly)."""
    from kazoo.client import KazooClient

    client = KazooClient(hosts=hosts, timeout=session_s,
                         auth_data=[("digest", auth)] if auth else None)
    client.start(timeout=10)
    return client


def pids_alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            out.append(pid)
        except ProcessLookupError:
            pass
    return out
