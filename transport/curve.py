"""ZeroMQ CURVE between the roles of a deployment: who may connect to a member's sockets.

A deployment has one key pair (``onepiece keys curve DIR``: ``deployment.key`` public,
``deployment.key_secret`` secret, mode 0600, in a folder of mode 0700). Every member holds both:
its server sockets present the pair as their server key and admit a client only if the client's
public key is one of the folder's ``*.key`` files (libzmq's ZAP, served by pyzmq's
ThreadAuthenticator); its client sockets prove the same pair. Without the secret nothing
completes a handshake, so no message from an outsider reaches a handler: a socket without CURVE,
or with another key, is dropped by libzmq before its first frame. More public keys in the folder
admit more clients (e.g. an operator's own pair) without sharing the deployment's secret.

This process's keys are set once at start (``use``), like ``zmq.Context.instance()``, so that
every socket of the process, wherever it is made, is secured by the same two calls: ``server``
before a bind and ``client`` before a connect. Without keys both leave the socket as it is (a
deployment on loopback or a private ipc folder; see onepiece/curve_policy.py).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from onepiece.secret_file import SecretFileError, read_secret_file

log = logging.getLogger(__name__)

ENV = "ONEPIECE_CURVE_DIR"  # a folder's path (not a secret): where a process finds its keys
NAME = "deployment"
PUBLIC = f"{NAME}.key"
SECRET = f"{NAME}.key_secret"
_MAX_LOGGED = 256  # refused client keys named in the log (each once): a reconnecting client would flood it


class CurveKeysError(SecretFileError):
    """A key folder that cannot be used; the message names the file, never a secret key."""


@dataclass(frozen=True)
class CurveKeys:
    public: bytes  # z85, 40 bytes
    secret: bytes = field(repr=False)  # never in a log line or a traceback's locals
    members: frozenset[bytes]  # z85 public keys admitted as clients
    folder: Path


def make(folder: str | Path) -> Path:
    """A new deployment key pair in ``folder`` (made with mode 0700 if missing; an existing one
    must be closed to other users already, since the secret is written before its chmod). Refuses
    to replace an existing pair, which would lock out every member that holds it."""
    folder = Path(folder)
    if (folder / SECRET).exists() or (folder / PUBLIC).exists():
        raise CurveKeysError(f"CURVE keys folder {folder}: already holds a key pair ({PUBLIC}); remove it first "
                             f"to make a new one")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.stat().st_mode & 0o077:
        raise CurveKeysError(f"CURVE keys folder {folder}: other users may open it (mode "
                             f"{folder.stat().st_mode & 0o777:04o}); name a new folder, or run: chmod 700 {folder}")
    zmq.auth.create_certificates(folder, NAME)
    os.chmod(folder / SECRET, 0o600)
    os.chmod(folder / PUBLIC, 0o644)
    return folder


def load(folder: str | Path) -> CurveKeys:
    """The key pair and admitted keys of ``folder``; CurveKeysError naming what is wrong."""
    folder = Path(folder)
    secret_path = folder / SECRET
    try:
        read_secret_file(secret_path, "CURVE secret key")  # mode 0600, owner, not a link
    except SecretFileError as e:
        raise CurveKeysError(f"{e} (make a pair with: onepiece keys curve {folder})") from None
    try:
        public, secret = zmq.auth.load_certificate(secret_path)
        members = frozenset(zmq.auth.load_certificates(folder))
    except (OSError, ValueError) as e:
        raise CurveKeysError(f"CURVE keys folder {folder}: {e}") from None
    if secret is None or len(public) != 40 or len(secret) != 40:
        raise CurveKeysError(f"CURVE secret key file {secret_path}: no valid key pair in it")
    if public not in members:
        raise CurveKeysError(f"CURVE keys folder {folder}: {PUBLIC} is missing or not the public half of {SECRET}")
    return CurveKeys(public, secret, members, folder)


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


def active() -> CurveKeys | None:
    return _keys


def server(sock: zmq.Socket) -> zmq.Socket:
    """``sock`` (not yet bound) as a CURVE server of this process's keys, if it has any."""
    keys = _keys
    if keys is not None:
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
        sock.curve_serverkey = keys.public
    return sock
