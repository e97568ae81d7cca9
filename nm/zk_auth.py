"""Where ZooKeeper credentials (``user:password``) come from: a file only its owner can read, or
the environment; never a command line, which every user of the host can read in ``ps``.

Precedence: ``--zk-auth-file PATH``, then ``$ONEPIECE_ZK_AUTH``, then the topology's
``nm.zk_auth_file``. `onepiece up` hands the credentials it resolved to its children in their
environment (readable by the same user only, through /proc/PID/environ). No message here
echoes the secret.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from onepiece.nm.zk import parse_auth
from onepiece.secret_file import MAX_FILE_BYTES, SecretFileError, read_secret_file

ENV = "ONEPIECE_ZK_AUTH"
NO_COMMAND_LINE = (f"credentials on a command line are readable by every user of the host (ps); put user:password "
                   f"in a file of mode 0600 named by --zk-auth-file, or in the environment variable {ENV}")


class CredentialsError(SecretFileError):
    """Credentials given but unusable; the message names where they came from, not the secret."""


def read_auth_file(path: str | Path) -> str:
    """``user:password`` from ``path``: a regular file, owned by us, that no group or other user
    may read or write (mode 0600 or 0400; onepiece/secret_file.py)."""
    try:
        text = read_secret_file(path, "ZooKeeper credentials", MAX_FILE_BYTES)
    except SecretFileError as e:
        raise CredentialsError(str(e)) from None
    try:
        return parse_auth(text.strip())
    except ValueError as e:
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
