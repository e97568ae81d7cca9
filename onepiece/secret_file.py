"""Reading a secret from a file that only its owner can read (ZooKeeper credentials, API keys).

One check for every secret file: a regular file (not a link, which could be swapped), owned by
this user, that no group or other user may read or write (mode 0600 or 0400), and small. The
messages name the file and what is wrong with it, never its content.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

MAX_FILE_BYTES = 4096


class SecretFileError(ValueError):
    """A secret file that may not or cannot be used; the message names the file, not the secret."""


def read_secret_file(path: str | Path, what: str, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The text of ``path`` (``what`` names it in errors, e.g. "API keys"), after the checks above."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO would otherwise wait for a writer for ever (the process
        # hung silently at start); the check below then refuses it as not a regular file.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        why = "a symbolic link; name the file itself" if e.errno == errno.ELOOP else e.strerror
        raise SecretFileError(f"{what} file {path}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretFileError(f"{what} file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise SecretFileError(f"{what} file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets others read it; "
                                  f"run: chmod 600 {path}")
        if st.st_uid != os.geteuid():
            raise SecretFileError(f"{what} file {path}: owned by another user (uid {st.st_uid})")
        data = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise SecretFileError(f"{what} file {path}: larger than {max_bytes} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise SecretFileError(f"{what} file {path}: not UTF-8 text") from None


def write_secret_file(path: str | Path, text: str) -> None:
    """Append ``text`` to ``path``, creating it with mode 0600; an existing file must pass the
    checks of :func:`read_secret_file` first (so a key is never added to a readable file)."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        read_secret_file(path, "secret", max_bytes=1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, text.encode("utf-8"))
    finally:
        os.close(fd)
