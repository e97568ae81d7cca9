"""ZeroMQ CURVE between the roles of a deployment: who may connect to a member's sockets.

A deployment has a key pair for its members and one for the proxies of each set (``onepiece
keys curve DIR``, in a folder of mode 0700; each secret half of mode 0600): ``deployment.key``
and ``deployment.key_secret``, ``proxy-SET.key`` and ``proxy-SET.key_secret``. A member (NM,
DB, stage) holds its pair: its server sockets present it as their server key and admit a client
only if the client's public key is one of the folder's ``*.key`` files (libzmq's ZAP, served by
pyzmq's ThreadAuthenticator); its client sockets prove the same pair. A proxy only connects: it
proves its set's pair and needs no member's secret. Without a secret nothing completes a
handshake, so no message from an outsider reaches a handler: a socket without CURVE, or with
another key, is dropped by libzmq before its first frame. The key a client proved names it on
the server (``caller``: the stem of its key file): what only the proxies of a set may do, like
reading a user's record with its prompt, no other key can (db/protocol.py ``PROXY_OPS``). More
public keys in the folder admit more clients (e.g. an operator's own pair) without sharing a
secret.

This process's keys are set once at start (``use``), like ``zmq.Context.instance()``, so that
every socket of the process, wherever it is made, is secured by the same two calls: ``server``
before a bind and ``client`` before a connect. Without keys both leave the socket as it is (a
deployment on loopback or a private ipc folder; see onepiece/curve_policy.py).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from onepiece.schema import SET_NAME
from onepiece.secret_file import SecretFileError, read_secret_file

log = logging.getLogger(__name__)

ENV = "ONEPIECE_CURVE_DIR"  # a folder's path (not a secret): where a process finds its keys
NAME = "deployment"
PUBLIC = f"{NAME}.key"
SECRET = f"{NAME}.key_secret"
DEFAULT_SETS = ("set0",)  # the set a deployment has when its topology names none
_MAX_LOGGED = 256  # refused client keys named in the log (each once): a reconnecting client would flood it


class CurveKeysError(SecretFileError):
    """A key folder that cannot be used; the message names the file, never a secret key."""


@dataclass(frozen=True)
class CurveKeys:
    public: bytes  # this process's pair, z85, 40 bytes
    secret: bytes = field(repr=False)  # never in a log line or a traceback's locals
    folder: Path
    server: bytes  # the members' public key: every server presents it, every client expects it
    names: dict[bytes, str] = field(hash=False)  # every admitted client's public key -> its file's stem

    @property
    def members(self) -> frozenset[bytes]:
        """The z85 public keys admitted as clients."""
        return frozenset(self.names)

    @property
    def serves(self) -> bool:
        """A member's pair: this process may bind server sockets."""
        return self.public == self.server


def proxy_pair(set_name: str) -> str:
    """The name of the key pair the proxies of ``set_name`` prove."""
    return f"proxy-{set_name}"


def make(folder: str | Path, sets: Iterable[str] = DEFAULT_SETS) -> Path:
    """The deployment's key pairs (the members' and one for the proxies of each of ``sets``) in
    ``folder``, those it lacks (made with mode 0700 if missing; an existing one must be closed
    to other users already, since the secrets are written before their chmod). Never replaces a
    pair, which would lock out every process that holds it: refuses when all are there, or half
    of one."""
    folder = Path(folder)
    sets = list(sets)
    bad = [s for s in sets if not re.match(SET_NAME, s)]
    if bad:  # checked before anything is written: "a/b" made a pair, then failed half-way
        raise CurveKeysError(f"set names {bad}: a set name is letters, digits, '_', '.', '-' (as a topology's)")
    files = {name: [n for n in (f"{name}.key", f"{name}.key_secret") if (folder / n).exists()]
             for name in (NAME, *map(proxy_pair, sets))}
    half = [n for held in files.values() if len(held) == 1 for n in held]
    if half or all(files.values()):
        raise CurveKeysError(f"CURVE keys folder {folder}: already holds {', '.join(half or sum(files.values(), []))}; "
                             f"remove {'it' if len(half) == 1 else 'them'} first to make new pairs")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.stat().st_mode & 0o077:
        raise CurveKeysError(f"CURVE keys folder {folder}: other users may open it (mode "
                             f"{folder.stat().st_mode & 0o777:04o}); name a new folder, or run: chmod 700 {folder}")
    for name in (n for n, held in files.items() if not held):
        zmq.auth.create_certificates(folder, name)
        os.chmod(folder / f"{name}.key_secret", 0o600)
        os.chmod(folder / f"{name}.key", 0o644)
    return folder


def load(folder: str | Path, pair: str = NAME) -> CurveKeys:
    """The keys of ``folder`` for a process that proves ``pair`` (``NAME``, a member's, or a
    ``proxy_pair``); CurveKeysError naming what is wrong. Only that pair's secret half is read,
    so a proxy's host needs no member's secret."""
    folder = Path(folder)
    secret_path = folder / f"{pair}.key_secret"
    try:
        read_secret_file(secret_path, "CURVE secret key")  # mode 0600, owner, not a link
    except SecretFileError as e:
        raise CurveKeysError(f"{e} (make the pairs with: onepiece keys curve {folder})") from None
    # The *.key files say who is admitted (as a member, or as a proxy that reads users' records):
    # one anybody may write to, or add to the folder of, admits anybody.
    admitting = (folder, *sorted(folder.glob("*.key")))
    open_to = [p for p in admitting if p.stat().st_mode & 0o022]
    if open_to:
        raise CurveKeysError(f"CURVE keys folder {folder}: other users may write {', '.join(map(str, open_to))}, "
                             f"and so admit their own keys; run: chmod go-w {' '.join(map(str, open_to))}")
    # ... and so may their owner: another user's folder or key file is refused, as a secret file is.
    theirs = [f"{p} (uid {p.stat().st_uid})" for p in admitting if p.stat().st_uid != os.geteuid()]
    if theirs:
        raise CurveKeysError(f"CURVE keys folder {folder}: owned by another user, who may admit their own keys: "
                             f"{', '.join(theirs)}")
    try:
        public, secret = zmq.auth.load_certificate(secret_path)
        server, _ = zmq.auth.load_certificate(folder / PUBLIC)
        names = {zmq.auth.load_certificate(f)[0]: f.stem for f in sorted(folder.glob("*.key"))}
    except (OSError, ValueError) as e:
        raise CurveKeysError(f"CURVE keys folder {folder}: {e} (make the pairs with: onepiece keys curve "
                             f"{folder})") from None
    if secret is None or len(public) != 40 or len(secret) != 40:
        raise CurveKeysError(f"CURVE secret key file {secret_path}: no valid key pair in it")
    if names.get(public) != pair:
        raise CurveKeysError(f"CURVE keys folder {folder}: {pair}.key is missing or not the public half of "
                             f"{pair}.key_secret")
    return CurveKeys(public, secret, folder, server, names)


class _Members:
    """pyzmq's ZAP callback: admits the deployment's keys, logs each refused key once."""

    def __init__(self, members: frozenset[bytes]) -> None:
        self.members = members
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.members:
            return True
        if len(self.refused) < _MAX_LOGGED and key not in self.refused:
            self.refused.add(key)
            log.warning("CURVE: refused a connection from a client key that is not a member's: %s",
                        key.decode(errors="replace"))
        return False


_lock = threading.Lock()
_keys: CurveKeys | None = None
_auth: ThreadAuthenticator | None = None


def use(keys: CurveKeys | None) -> None:
    """Secure this process's sockets made from now on with ``keys`` (None: without CURVE).
    The ZAP handler on the shared context that every server socket uses is started once and
    kept: later calls only change whom it admits. (Stopping and starting it again raced libzmq's
    release of its inproc address: EADDRINUSE.)"""
    global _keys, _auth
    with _lock:
        _keys = keys
        if keys is not None:
            if _auth is None:
                _auth = ThreadAuthenticator(zmq.Context.instance(), log=logging.getLogger("zmq.auth"))
                _auth.start()
            _auth.configure_curve_callback("*", _Members(keys.members))
            log.info("CURVE: every socket uses the key pair in %s (%d member key(s) admitted)", keys.folder,
                     len(keys.members))


def stop_handler() -> None:
    """Stop the ZAP handler for good: a process on its way out, whose context can end only once
    every socket closed, the handler's too (left running, it met the end of the context with a
    traceback in its asyncio loop)."""
    global _auth
    with _lock:
        if _auth is not None:
            _auth.stop()
            _auth = None


def active() -> CurveKeys | None:
    return _keys


def server(sock: zmq.Socket) -> zmq.Socket:
    """``sock`` (not yet bound) as a CURVE server of this process's keys, if it has any."""
    keys = _keys
    if keys is not None:
        if not keys.serves:  # a proxy's pair: members would not recognise it as their server
            raise CurveKeysError(f"this process holds a proxies' pair, which only connects; a server needs {SECRET}")
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_server = True
    return sock


def client(sock: zmq.Socket) -> zmq.Socket:
    """``sock`` (not yet connected) as a CURVE client proving this process's keys, if it has any;
    the only server it accepts is the deployment's."""
    keys = _keys
    if keys is not None:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_serverkey = keys.server
    return sock


def caller(frame: zmq.Frame) -> str | None:
    """Who sent ``frame`` to one of this process's server sockets: the stem of the key file it
    proved (``NAME`` for a member, ``proxy_pair(set)`` for a set's proxies); None without CURVE
    (a deployment on loopback or ipc, where every process is the deployment's)."""
    keys = _keys
    if keys is None:
        return None
    try:
        user = frame.get("User-Id")  # the z85 public key, as pyzmq's ZAP handler names a CURVE client
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return "?"
    return keys.names.get(user.encode(), "?") if isinstance(user, str) else "?"
