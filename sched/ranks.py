"""Which ranks of a collaboration group a step may run on, and how batches are laid onto them.

Pure: shared by the scheduling core (which places a policy's batches), the worker's group
(stage/collective.py builds one process group per block, once, at start) and the simulator.
"""

from __future__ import annotations

import functools

Ranks = tuple[int, ...]


def blocks(size: int) -> list[Ranks]:
    """Every group of ranks a step may run on, for a group of ``size`` ranks: single ranks,
    the aligned blocks of 2, 4, 8, ... ranks that fit, and the whole group."""
    return list(_blocks(size))


def dops(size: int) -> list[int]:
    """The degrees of parallelism a group of ``size`` ranks offers, smallest first."""
    return list(_dops(size))


def place(wanted: list[int], size: int) -> list[Ranks] | None:
    """Disjoint blocks of ``size`` ranks for batches of DoPs ``wanted`` (in that order), or
    None if they do not fit. Largest first, each on the lowest free block of its size: smaller
    ones then pack into what is left instead of splitting the group."""
    got = _place(tuple(wanted), size)
    return None if got is None else list(got)


# Cached: the scheduler asks these at every decision, always for the same few group sizes.
@functools.lru_cache(maxsize=64)
def _blocks(size: int) -> tuple[Ranks, ...]:
    out: list[Ranks] = [(r,) for r in range(size)]
    d = 2
    while d <= size:
        out += [tuple(range(i, i + d)) for i in range(0, size - d + 1, d)]
        d *= 2
    if size > 1 and tuple(range(size)) not in out:
        out.append(tuple(range(size)))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _dops(size: int) -> tuple[int, ...]:
    return tuple(sorted({len(b) for b in _blocks(size)}))


@functools.lru_cache(maxsize=4096)
def _place(wanted: tuple[int, ...], size: int) -> tuple[Ranks, ...] | None:
    free: set[int] = set(range(size))
    got: dict[int, Ranks] = {}
    for i in sorted(range(len(wanted)), key=lambda i: -wanted[i]):
        block = next((b for b in _blocks(size) if len(b) == wanted[i] and free.issuperset(b)), None)
        if block is None:
            return None
        free -= set(block)
        got[i] = block
    return tuple(got[i] for i in range(len(wanted)))
