"""One ring entry: a message's frames behind a checksummed header.

    0   magic     u32 "ENT1"
    4   nframes   u32
    8   seq       u64  the entry counter it was written for
    16  length    u64  payload bytes (frame table + frames)
    24  checksum  u64  RH64 (the compiled module's ``ring_hash_*``, see _atomics_build.py) seeded
                       with the region generation, of the payload (bytes 32 .. 32+length) followed
                       by bytes 0..24 of this header
    32  frame table: nframes u64 lengths, then the frames back to back; padded to 8 bytes

The checksum covers the header, so a length or counter torn by a late writer fails it too, and
the seed makes an entry left over from an earlier incarnation of the region invalid in a new one.
The payload comes first in the hashed stream so that it can be hashed once, before the lock is
taken (``Prepared``) or in the same pass that copies it into the ring (the compiled fast path),
and the header, known only once the entry's place is, last. The padding is not covered.
"""

from __future__ import annotations

import struct

from onepiece.transport.ring._atomics import ffi, lib

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

    __slots__ = ("nframes", "pieces", "length", "_state", "_generation")

    def __init__(self, frames: list, generation: int | None = None) -> None:
        if len(frames) > MAX_FRAMES:
            raise ValueError(f"{len(frames)} frames exceed {MAX_FRAMES}")
        views = [memoryview(f).cast("B") for f in frames]
        table = struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views))
        self.nframes, self.pieces = len(views), [table, *views]
        self.length = len(table) + sum(v.nbytes for v in views)
        self._state = self._generation = None
        if generation is not None:
            self._hash(generation)

    def _hash(self, generation: int):
        if self._generation != generation:
            self._state = _payload_state(self.pieces, generation)
            self._generation = generation
        return self._state

    @property
    def total(self) -> int:
        return padded(ENTRY_HEADER + self.length)

    def at(self, seq: int, generation: int) -> list:
        """The pieces to write back to back for entry counter ``seq``."""
        head = HEAD.pack(ENTRY_MAGIC, self.nframes, seq, self.length)
        return [head + _finish(self._hash(generation), head).to_bytes(8, "little"), *self.pieces]


def _payload_state(pieces, generation: int):
    """RH64's state after the payload pieces."""
    state = ffi.new("ring_hash *")
    lib.ring_hash_init(state, generation)
    for piece in pieces:
        if len(piece):
            lib.ring_hash_update(state, ffi.from_buffer(piece), len(piece))
    return state


def _finish(state, head: bytes | memoryview) -> int:
    """The checksum: the payload's state, then header bytes 0..24 (the state is not changed)."""
    h = ffi.new("ring_hash *", state[0])
    lib.ring_hash_update(h, ffi.from_buffer(head), 24)
    return lib.ring_hash_final(h)


def checksum(payload: bytes | memoryview, head: bytes | memoryview, generation: int) -> int:
    """The checksum of an entry with this payload and header (its bytes 0..24)."""
    return _finish(_payload_state([memoryview(payload).cast("B")], generation), head)


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
    if checksum(payload, entry[:24], generation) != int.from_bytes(entry[24:32], "little"):
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
