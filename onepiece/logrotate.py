"""Bounded role logs: `onepiece up` sends each role's output to ``<logs>/<role>.log``, about
0.8 KB per request served; a deployment that runs for days filled its disk. Each file is rotated
when it outgrows its limit, copy-then-truncate (logrotate's ``copytruncate``): the roles keep
writing to the descriptor they hold, opened for appending, so after the truncation their lines
land at the new start of the same file. ``name.log.1`` is the newest old part, ``name.log.N`` the
oldest kept. Lines a role writes between the copy and the truncation are lost (milliseconds).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def rotate(path: Path, max_bytes: int, keep: int) -> bool:
    """Rotate ``path`` if it is larger than ``max_bytes``, keeping ``keep`` old parts (0: none,
    the file is only emptied). True if it was rotated."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except FileNotFoundError:
        return False
    if keep > 0:
        for i in range(keep - 1, 0, -1):
            older = path.with_name(f"{path.name}.{i}")
            if older.exists():
                os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
        shutil.copyfile(path, path.with_name(f"{path.name}.1"))
    os.truncate(path, 0)
    return True
