"""The operator key: what `move` (and a `deregister` not made by the member itself) needs from
whoever asks the node manager to change a deployment's membership.

Never on a command line or in a log: it comes from a file only its owner can read
(``--operator-key-file``, checked by ``onepiece.secret_file``) or from ``ONEPIECE_OPERATOR_KEY``.
`onepiece up` makes one at ``default_path()`` if there is none and hands its NM the file, so that
`onepiece move` on the same machine finds it there. An NM without a key refuses operator
commands: nothing moves instances unasked.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path
from typing import Mapping

from onepiece.secret_file import read_secret_file, write_secret_file

ENV = "ONEPIECE_OPERATOR_KEY"
FLAG = "--operator-key-file"


def default_path() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "onepiece" / "operator.key"


def resolve(path: str | Path | None, environ: Mapping[str, str] = os.environ, fallback: bool = False) -> str | None:
    """The key: ``path``'s (a file of mode 0600), else the environment's, else with ``fallback``
    the default file's if it exists; None if there is none."""
    if path is None and environ.get(ENV):
        return environ[ENV].strip()
    if path is None and fallback and default_path().exists():
        path = default_path()
    return read_secret_file(path, "operator key").strip() if path is not None else None


def ensure_default() -> Path:
    """``default_path()``, made with a fresh key (mode 0600, its folder 0700) if missing."""
    path = default_path()
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_secret_file(path, secrets.token_urlsafe(32) + "\n")
    return path


def check(expected: str | None, given: str | None, what: str) -> None:
    """PermissionError unless ``given`` is the operator key (compared in constant time)."""
    if not expected:
        raise PermissionError(f"{what} needs the operator key, and this node manager has none: start it with "
                              f"{FLAG} FILE or {ENV}")
    if not given or not hmac.compare_digest(expected.encode(), given.encode()):
        raise PermissionError(f"{what} needs the operator key ({FLAG} FILE or {ENV}; `onepiece up` keeps it "
                              f"in {default_path()})")
