"""ZooKeeper settings, the project's znode layout, and a bounded way to wait on kazoo calls.

Layout under the root (``/onepiece`` by default)::

    config                  the workflow + topology the cluster runs (JSON), written by the
                            first primary; a later primary starts from it
    epoch                   data: the primary's address; its znode version is the epoch, bumped
                            by every new primary, and every state write checks it (fencing: a
                            primary that lost its session without noticing cannot write)
    primary                 EPHEMERAL {address, epoch}: where the serving primary is
    election/               kazoo's Election (Lock) contenders, identified by NM address
    members/<role>-<seq>    EPHEMERAL_SEQUENTIAL, one per live instance: {role, set, addresses,
                            pid, host, stage, capacity}; the node name is the instance id
    state/version           the route-table version (JSON int)
    state/sets/<set>        the set's instances as the primary assigned them (stage or the idle
                            pool, ready, addresses): what a new primary needs to route as before
    state/routes/<set>      the set's route table, as instances apply it (watched by them)

Only the primary writes under ``state/`` and ``config``; instances write only their own member
node. With credentials (``user:password``, from a file or the environment: nm/zk_auth.py) every
node gets a digest ACL for that user alone.

Nothing here imports kazoo at module level: the embedded NM and the config schema use the
validators without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kazoo.client import KazooClient

DEFAULT_ROOT = "/onepiece"
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
_NODE = re.compile(r"^[A-Za-z0-9_.-]+$")


def parse_hosts(text: str) -> str:
    """``host:port[,host:port...]`` as kazoo takes it; ValueError naming the bad part."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("expected host:port[,host:port...] (e.g. 127.0.0.1:2181)")
    hosts = [h.strip() for h in text.split(",")]
    for h in hosts:
        if "/" in h:
            raise ValueError(f"{h!r}: put the znode root in zk_root / --zk-root, not in the address")
        m = _HOST.match(h)
        if not m or not 0 < int(m.group(2)) < 65536:
            raise ValueError(f"{h!r} is not host:port with a port in 1-65535")
    return ",".join(hosts)


def parse_root(text: str) -> str:
    """An absolute znode path like ``/onepiece`` or ``/team/onepiece``."""
    if not isinstance(text, str) or not text.startswith("/") or text == "/":
        raise ValueError(f"{text!r}: expected an absolute znode path below / (e.g. /onepiece)")
    parts = text[1:].split("/")
    if any(not _NODE.match(p) or p in (".", "..", "zookeeper") for p in parts):
        raise ValueError(f"{text!r}: path parts may use letters, digits, '_', '.', '-' (and not 'zookeeper')")
    return text


def parse_auth(text: str) -> str:
    """``user:password`` for ZooKeeper's digest scheme."""
    user, sep, password = (text or "").partition(":")
    if not sep or not user or not password:
        raise ValueError("expected user:password (both non-empty)")
    return text


class ZkUnavailable(ConnectionError):
    """No ZooKeeper server of the ensemble answered in time."""


@dataclass(frozen=True)
class ZkSettings:
    hosts: str
    root: str = DEFAULT_ROOT
    # "user:password": digest ACLs on every node, and the client authenticates. Kept out of repr
    # (logs) and out of args(): children get it by environment (nm/zk_auth.py).
    auth: str | None = field(default=None, repr=False)
    session_s: float = 4.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", parse_hosts(self.hosts))
        parse_root(self.root)
        if self.auth is not None:
            parse_auth(self.auth)
        if not 1.0 <= self.session_s <= 600:
            raise ValueError(f"ZooKeeper session timeout {self.session_s}s is outside 1-600 s")

    def client(self) -> "KazooClient":
        """A kazoo client (not started). Commands fail rather than retry forever: every caller
        here bounds its own waits and decides what a failure means."""
        from kazoo.client import KazooClient
        from kazoo.retry import KazooRetry
        from kazoo.security import make_digest_acl

        acl = auth = None
        if self.auth:
            user, _, password = self.auth.partition(":")
            acl = [make_digest_acl(user, password, all=True)]
            auth = [("digest", self.auth)]
        return KazooClient(
            hosts=self.hosts, timeout=self.session_s, default_acl=acl, auth_data=auth,
            # Reconnecting keeps trying (the session outlives short outages), quickly at first.
            connection_retry=KazooRetry(max_tries=-1, delay=0.05, backoff=2, max_delay=1.0),
            command_retry=KazooRetry(max_tries=3, delay=0.05, backoff=2, max_delay=0.5),
        )

    def connect(self, timeout: float = 15.0) -> "KazooClient":
        """A started client; raises (kazoo's timeout) if no server answers within ``timeout``."""
        zk = self.client()
        try:
            zk.start(timeout=timeout)
        except Exception as e:
            zk.stop()
            zk.close()
            raise ZkUnavailable(f"no ZooKeeper server answered at {self.hosts} within {timeout:.0f}s ({e!r})") from None
        return zk

    def args(self) -> list[str]:
        """The same settings as `onepiece` command-line flags (for the launcher), but for the
        credentials: they never go on a command line (nm/zk_auth.py)."""
        return ["--zk", self.hosts, "--zk-root", self.root, "--zk-session", str(self.session_s)]


class Paths:
    """Where each thing lives under the root (see the module doc)."""

    def __init__(self, root: str) -> None:
        self.root = parse_root(root)
        self.config = f"{root}/config"
        self.epoch = f"{root}/epoch"
        self.primary = f"{root}/primary"
        self.election = f"{root}/election"
        self.members = f"{root}/members"
        self.state = f"{root}/state"
        self.version = f"{root}/state/version"
        self.sets = f"{root}/state/sets"
        self.routes = f"{root}/state/routes"

    def member(self, instance_id: str) -> str:
        return f"{self.members}/{instance_id}"

    def set_state(self, name: str) -> str:
        return f"{self.sets}/{name}"

    def set_routes(self, name: str) -> str:
        return f"{self.routes}/{name}"


def wait(async_result: Any, timeout: float) -> Any:
    """The result of a kazoo ``*_async`` call, waiting at most ``timeout`` seconds (kazoo's
    own synchronous calls have no bound of their own beyond a connection loss). Running out
    of time raises the builtin TimeoutError (kazoo's own timeout error derives from neither
    it nor KazooException)."""
    from kazoo.handlers.threading import KazooTimeoutError

    try:
        return async_result.get(timeout=timeout)
    except KazooTimeoutError:
        raise TimeoutError(f"ZooKeeper did not answer within {timeout:.1f}s") from None
