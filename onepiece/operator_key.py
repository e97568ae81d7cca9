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
import re
import secrets
from pathlib import Path
from typing import Mapping

from onepiece.secret_file import SecretFileError, read_secret_file, write_secret_file

ENV = "ONEPIECE_OPERATOR_KEY"
FLAG = "--operator-key-file"
KEY_RE = re.compile(r"^[\x21-\x7e]{32,256}$")  # as a client's API key: one character was accepted


def default_path() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "onepiece" / "operator.key"


def resolve(path: str | Path | None, environ: Mapping[str, str] = os.environ, fallback: bool = False) -> str | None:
    """The key: ``path``'s (a file of mode 0600), else the environment's, else with ``fallback``
    the default file's if it exists; None if there is none. SecretFileError if it is not 32 to
    256 visible ASCII characters (the error never holds the key)."""
    if path is None and environ.get(ENV):
        key, where = environ[ENV].strip(), ENV
    else:
        if path is None and fallback and default_path().exists():
            path = default_path()
        if path is None:
            return None
        key, where = read_secret_file(path, "operator key").strip(), f"operator key file {path}"
    if not KEY_RE.match(key):
        raise SecretFileError(f"{where}: an operator key is 32 to 256 visible ASCII characters "
                              f"(`onepiece up` makes one in {default_path()})")
    return key


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
