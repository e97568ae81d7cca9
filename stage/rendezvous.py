"""Where the ranks of a collaboration world meet (stage/collective.py).

A file in the instance's private folder (mode 0700), not torch's TCP store: that store's server
listens on every interface whatever host it is given, and anyone who reaches it can write the
world's keys. This module stays free of torch: the instance process that starts the ranks
never loads it.
"""

from __future__ import annotations

import secrets
from pathlib import Path


def rendezvous(folder: str | Path) -> str:
    """A ``torch.distributed`` init method for a new world: a fresh file in ``folder`` (fresh,
    because a world that was killed leaves its file behind)."""
    return f"file://{Path(folder) / f'world-{secrets.token_hex(8)}.store'}"
