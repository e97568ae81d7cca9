"""Where everything lives in a ring region, and how its words pack (DESIGN §5).

All words are 8-byte little-endian and 8-byte aligned, so one-sided 64-bit reads, writes and
compare-and-swap work on them (shared memory, the TCP agent and RDMA alike)::

    0   magic          "OPRING01"
    8   generation     set by the receiver when it creates the region; never 0
    16  state          OPEN, or CLOSED once the receiver has gone (a restarted one closes the old)
    24  nslots         size slots, a power of two
    32  buf_size       bytes of the buffer region, a power of two
    40  lock           taint bit | the holder's token (0 when free); senders change it only with CAS
    48  tails          buffer tail (low 40 bits) and size tail (high 24 bits), one CAS moves both
    56  heads          the same packing; written by the receiver only
    64  size region    nslots words: busy bit | lap | entry length
    ..  buffer region  buf_size bytes of entries, which wrap around its end

The tails and heads are counters modulo 2**40 (bytes) and 2**24 (entries); both ring sizes
are powers of two that divide those moduli, so "counter mod ring size" stays right across the
counters' own wrap. A size slot carries the lap of the entry it describes (the entry counter
divided by nslots): a sender publishes with CAS from "free, this lap" to "busy, this lap,
length", so a late sender whose entry counter is stale can never publish into a slot that has
been reused (no ABA, unless a sender stalls across exactly a multiple of 2**24 entries, which
the spin model shows is the only way left), and only the receiver clears a busy slot, to
"free, next lap".

The lock word's top bit, LOCK_TAINT, is set by every take-over and never cleared (acquire and
release keep it): it says that a sender whose lock was taken over may still be running with a
stale tail and write into entries published since. Without it, only lock holders write, and
only past the tails, so no published entry is ever written over until the receiver consumes
it: the receiver then need not hash a borrowed entry again at its release (reader.py). It lasts
for the region's generation; a restarted receiver's new region starts clean.
"""

from __future__ import annotations

from dataclasses import dataclass

MAGIC = int.from_bytes(b"OPRING01", "little")
OPEN, CLOSED = 1, 2

W_MAGIC, W_GEN, W_STATE, W_NSLOTS, W_BUFSIZE, W_LOCK, W_TAILS, W_HEADS = range(0, 64, 8)
LOCK_TAINT = 1 << 63  # in the lock word: some lock was taken over in this region (see above)
HEADER_BYTES = 64

BUF_BITS, SEQ_BITS = 40, 24
BUF_MOD, SEQ_MOD = 1 << BUF_BITS, 1 << SEQ_BITS
BUF_MASK, SEQ_MASK = BUF_MOD - 1, SEQ_MOD - 1

BUSY = 1 << 63
LAP_SHIFT, LAP_BITS = 40, 23
LAP_MASK = (1 << LAP_BITS) - 1
LEN_MASK = (1 << 40) - 1

MAX_NSLOTS = 1 << 20
MAX_BUF_SIZE = 1 << 36  # 64 GiB: far above any region we map, far below the counter's 2**40


def pack_ptrs(buf: int, seq: int) -> int:
    """One word holding a buffer counter and an entry counter."""
    return ((seq & SEQ_MASK) << BUF_BITS) | (buf & BUF_MASK)


def unpack_ptrs(word: int) -> tuple[int, int]:
    """(buffer counter, entry counter) of a tails or heads word."""
    return word & BUF_MASK, (word >> BUF_BITS) & SEQ_MASK


def buf_used(tail: int, head: int) -> int:
    return (tail - head) & BUF_MASK


def seq_used(tail: int, head: int) -> int:
    return (tail - head) & SEQ_MASK


def lap_of(seq: int, nslots: int) -> int:
    return ((seq & SEQ_MASK) // nslots) & LAP_MASK


def slot_free(lap: int) -> int:
    return (lap & LAP_MASK) << LAP_SHIFT


def slot_busy(lap: int, length: int) -> int:
    return BUSY | ((lap & LAP_MASK) << LAP_SHIFT) | (length & LEN_MASK)


def slot_fields(word: int) -> tuple[bool, int, int]:
    """(busy, lap, length) of a size slot."""
    return bool(word & BUSY), (word >> LAP_SHIFT) & LAP_MASK, word & LEN_MASK


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class Geometry:
    nslots: int
    buf_size: int

    def __post_init__(self) -> None:
        if not _power_of_two(self.nslots) or not 2 <= self.nslots <= MAX_NSLOTS:
            raise ValueError(f"nslots must be a power of two in [2, {MAX_NSLOTS}], got {self.nslots}")
        if not _power_of_two(self.buf_size) or not 64 <= self.buf_size <= MAX_BUF_SIZE:
            raise ValueError(f"buf_size must be a power of two in [64, {MAX_BUF_SIZE}], got {self.buf_size}")

    @property
    def slots_offset(self) -> int:
        return HEADER_BYTES

    @property
    def buf_offset(self) -> int:
        end = HEADER_BYTES + 8 * self.nslots
        return (end + 63) & ~63

    @property
    def region_bytes(self) -> int:
        return self.buf_offset + self.buf_size

    def slot_offset(self, seq: int) -> int:
        return HEADER_BYTES + 8 * (seq & (self.nslots - 1))

    def spans(self, buf_counter: int, length: int) -> list[tuple[int, int]]:
        """(region offset, byte count) pieces of ``length`` bytes starting at a buffer counter:
        one piece, or two when the entry wraps around the buffer's end."""
        pos = buf_counter & (self.buf_size - 1)
        first = min(length, self.buf_size - pos)
        out = [(self.buf_offset + pos, first)]
        if first < length:
            out.append((self.buf_offset, length - first))
        return out
