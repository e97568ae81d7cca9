"""Which DB of a set holds a UID first: rendezvous hashing, so every writer (proxy, stages)
and every reader agrees without coordination, and a DB leaving moves only its own UIDs."""

from __future__ import annotations

import hashlib


def order(uid: str, addresses: list[str]) -> list[str]:
    """``addresses`` ordered by preference for ``uid``: write to the first, read in order."""
    return sorted(addresses, key=lambda a: hashlib.blake2b(f"{a}|{uid}".encode(), digest_size=8).digest(), reverse=True)


def order_dbs(uid: str, dbs: list[dict[str, str]]) -> list[dict[str, str]]:
    """A set's DB address dicts in preference order for ``uid``, ranked by control address,
    the key readers use, so writers of data messages pick the same first DB."""
    by_control = {d["control"]: d for d in dbs}
    return [by_control[a] for a in order(uid, list(by_control))]
