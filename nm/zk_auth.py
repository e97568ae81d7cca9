"""Where ZooKeeper credentials (``user:password``) come from: a file only its owner can read, or
the environment; never a command line, which every user of the host can read in ``ps``.

Precedence: ``--zk-auth-file PATH``, then ``$ONEPIECE_ZK_AUTH``, then the topology's
``nm.zk_auth_file``. `onepiece up` hands the credentials it resolved to its children in their
environment (readable by the same user only, through /proc/PID/environ). No message here
echoes the secret.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Mapping

from onepiece.nm.zk import parse_auth

ENV = "ONEPIECE_ZK_AUTH"
MAX_FILE_BYTES = 4096
NO_COMMAND_LINE = (f"credentials on a command line are readable by every user of the host (ps); put user:password "
                   f"in a file of mode 0600 named by --zk-auth-file, or in the environment variable {ENV}")


class CredentialsError(ValueError):
    """Credentials given but unusable; the message names where they came from, not the secret."""


def read_auth_file(path: str | Path) -> str:
    """``user:password`` from ``path``: a regular file, owned by us, that no group or other user
    may read or write (mode 0600 or 0400)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        why = "a symbolic link; name the file itself" if e.errno == errno.ELOOP else e.strerror
        raise CredentialsError(f"ZooKeeper credentials file {path}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CredentialsError(f"ZooKeeper credentials file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise CredentialsError(f"ZooKeeper credentials file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets "
                                   f"others read it; run: chmod 600 {path}")
        if st.st_uid != os.geteuid():
            raise CredentialsError(f"ZooKeeper credentials file {path}: owned by another user (uid {st.st_uid})")
        data = os.read(fd, MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise CredentialsError(f"ZooKeeper credentials file {path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        return parse_auth(data.decode("utf-8").strip())
    except (UnicodeDecodeError, ValueError) as e:
        raise CredentialsError(f"ZooKeeper credentials file {path}: {e}") from None


def auth_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """``$ONEPIECE_ZK_AUTH`` if set and not empty."""
    value = environ.get(ENV, "").strip()
    if not value:
        return None
    try:
        return parse_auth(value)
    except ValueError as e:
        raise CredentialsError(f"environment variable {ENV}: {e}") from None


def resolve_auth(flag_file: str | Path | None, topology_file: str | Path | None,
                 environ: Mapping[str, str] = os.environ) -> str | None:
    """The credentials by the precedence in the module doc (None: none given)."""
    if flag_file:
        return read_auth_file(flag_file)
    from_env = auth_from_env(environ)
    if from_env is not None:
        return from_env
    return read_auth_file(topology_file) if topology_file else None


def child_env(auth: str | None, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment for a child process that should use ``auth`` (or none)."""
    env = {k: v for k, v in environ.items() if k != ENV}
    if auth:
        env[ENV] = auth
    return env
