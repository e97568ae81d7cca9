"""Is a TCP port free, and if not, who holds it: `onepiece up` checks its fixed ports before it
starts anything, so that a second deployment on the same ports is refused instead of joining
the first one's node manager."""

from __future__ import annotations

import errno
import os
import random
import socket
from pathlib import Path


def in_use(host: str, port: int) -> bool:
    """Whether a process holds ``port`` on ``host`` (listens, or bound it). The connections of a
    deployment that just stopped linger in TIME_WAIT for a minute; its servers rebind over them
    (SO_REUSEADDR), so they are no holder: without it, `onepiece up` right after a stop was
    refused for "another deployment" that no longer existed."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def holder(port: int) -> str:
    """'pid N (command line)' of the process listening on ``port``, from /proc; or a plain
    'another process' where /proc does not tell (another user's process, another namespace)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{f[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc") if inodes else ()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                return f"pid {pid} ({cmd.strip()[:200]})"
        except OSError:
            continue
    return "another process"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (for a rendezvous that must name one up front)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_run(n: int, host: str = "127.0.0.1") -> int:
    """The first of ``n`` consecutive ports free on ``host`` now (several NMs of one topology
    listen on consecutive ports), taken below the kernel's ephemeral range: a run that starts at
    a free ephemeral port may hold an outgoing connection's port past its first, and one may be
    handed out before the listener binds."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(1000):
        base = random.randrange(10000, max(10001, low - n))
        if not any(in_use(host, p) for p in range(base, base + n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports on {host} between 10000 and {low}")
