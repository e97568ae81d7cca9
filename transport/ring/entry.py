"""One ring entry: a message's frames behind a checksummed header.

    0   magic     u32 "ENT1"
    4   nframes   u32
    8   seq       u64  the entry counter it was written for
    16  length    u64  payload bytes (frame table + frames)
    24  checksum  u64  xxh3-64 of bytes 0..24 and the payload's own xxh3-64, seeded with the
                       region generation (the payload is hashed once, before the lock is taken)
    32  frame table: nframes u64 lengths, then the frames back to back; padded to 8 bytes

The checksum covers the header, so a length or counter torn by a late writer fails it too, and
the seed makes an entry left over from an earlier incarnation of the region invalid in a new one.
"""

from __future__ import annotations

import struct

import xxhash

ENTRY_MAGIC = int.from_bytes(b"ENT1", "little")
HEAD = struct.Struct("<IIQQ")
ENTRY_HEADER = 32
MAX_FRAMES = 1024


class EntryError(ValueError):
    """An entry that must not be handed up (torn, overwritten, or not an entry at all)."""


def padded(n: int) -> int:
    return (n + 7) & ~7


class Prepared:
    """A message's payload, hashed once outside the lock; only the header depends on where
    the entry lands."""

    __slots__ = ("nframes", "pieces", "length", "digest")

    def __init__(self, frames: list) -> None:
        if len(frames) > MAX_FRAMES:
            raise ValueError(f"{len(frames)} frames exceed {MAX_FRAMES}")
        views = [memoryview(f).cast("B") for f in frames]
        table = struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views))
        h = xxhash.xxh3_64(table)
        for v in views:
            h.update(v)
        self.nframes, self.pieces = len(views), [table, *views]
        self.length = len(table) + sum(v.nbytes for v in views)
        self.digest = h.intdigest()

    @property
    def total(self) -> int:
        return padded(ENTRY_HEADER + self.length)

    def at(self, seq: int, generation: int) -> list:
        """The pieces to write back to back for entry counter ``seq``."""
        head = HEAD.pack(ENTRY_MAGIC, self.nframes, seq, self.length)
        return [head + _checksum(head, self.digest, generation).to_bytes(8, "little"), *self.pieces]


def _checksum(head: bytes | memoryview, payload_digest: int, generation: int) -> int:
    return xxhash.xxh3_64_intdigest(bytes(head) + payload_digest.to_bytes(8, "little"), seed=generation)


def parse(entry: memoryview, seq: int, generation: int) -> list[memoryview]:
    """The frames of a whole entry copied out of the ring, or EntryError."""
    if entry.nbytes < ENTRY_HEADER:
        raise EntryError(f"entry of {entry.nbytes} bytes is shorter than its header")
    magic, nframes, eseq, length = HEAD.unpack_from(entry)
    if magic != ENTRY_MAGIC:
        raise EntryError("bad entry magic")
    if eseq != seq:
        raise EntryError(f"entry written for #{eseq} found at #{seq}")
    if padded(ENTRY_HEADER + length) != entry.nbytes:
        raise EntryError(f"entry says {length} payload bytes but its slot holds {entry.nbytes}")
    payload = entry[ENTRY_HEADER: ENTRY_HEADER + length]
    if _checksum(entry[:24], xxhash.xxh3_64_intdigest(payload), generation) != int.from_bytes(entry[24:32], "little"):
        raise EntryError("checksum mismatch")
    # The checksum passed, so the table is what the sender wrote; still check it fits.
    if nframes > MAX_FRAMES or 8 * nframes > length:
        raise EntryError(f"bad frame count {nframes}")
    sizes = struct.unpack_from(f"<{nframes}Q", payload)
    if 8 * nframes + sum(sizes) != length:
        raise EntryError("frame table does not add up to the payload")
    out, pos = [], 8 * nframes
    for n in sizes:
        out.append(payload[pos: pos + n])
        pos += n
    return out


def split(pieces: list, spans: list[tuple[int, int]]) -> list[tuple[int, memoryview]]:
    """Lay pieces written back to back onto the region spans they occupy (the entry may wrap)."""
    out: list[tuple[int, memoryview]] = []
    spans = list(spans)
    off, room = spans.pop(0)
    for piece in pieces:
        v = memoryview(piece).cast("B")
        while v.nbytes:
            if room == 0:
                off, room = spans.pop(0)
            n = min(room, v.nbytes)
            out.append((off, v[:n]))
            v, off, room = v[n:], off + n, room - n
    return out
