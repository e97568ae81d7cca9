"""Which DB of a set holds a UID first: rendezvous hashing, so every writer (proxy, stages)
and every reader agrees without coordination, and a DB leaving moves only its own UIDs."""

from __future__ import annotations

import hashlib


def order(uid: str, addresses: list[str]) -> list[str]:
    """``addresses`` ordered by preference for ``uid``: write to the first, read in order."""
    return sorted(addresses, key=lambda a: hashlib.blake2b(f"{a}|{uid}".encode(), digest_size=8).digest(), reverse=True)
