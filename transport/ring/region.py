"""The "remote region" interface the ring protocol is written against, and the mapped memory
every backend ends up touching.

A sender sees the receiver's region only through ``Region``: read and write bytes at an
offset, read aligned words, and 64-bit compare-and-swap, which returns the value it found (as
RDMA's ATOMIC_CMP_AND_SWP does). Shared memory does these on the mapping itself, the TCP agent
does them for a remote sender, an RDMA NIC does them in hardware. The receiver reads its own
memory through ``MappedRegion`` directly.
"""

from __future__ import annotations

import abc
import mmap
from typing import Iterable

from onepiece.transport.base import TransportError
from onepiece.transport.ring import layout
from onepiece.transport.ring._atomics import ffi, lib


class PeerGone(TransportError):
    """The region's receiver has gone or been replaced (a new generation): attach again."""


class Region(abc.ABC):
    """What a sender may do to a receiver's region: one-sided operations, nothing else."""

    geometry: layout.Geometry
    generation: int

    @abc.abstractmethod
    def read(self, off: int, n: int) -> bytes: ...

    @abc.abstractmethod
    def read_words(self, off: int, n: int) -> list[int]:
        """``n`` consecutive words from ``off``, each read atomically."""

    @abc.abstractmethod
    def write(self, pieces: Iterable[tuple[int, memoryview | bytes]]) -> None:
        """Write each (offset, bytes) piece; all are in place when this returns."""

    @abc.abstractmethod
    def cas(self, off: int, expected: int, desired: int) -> int:
        """Compare-and-swap the word at ``off``; returns the value found there."""

    def close(self) -> None:
        pass


class MappedRegion(Region):
    """A region mapped into this process: the receiver's own memory, or a same-host sender's
    mapping of it. Word operations are the C atomics, never Python-level locks."""

    def __init__(self, mem: mmap.mmap) -> None:
        self.mem = mem
        self.view = memoryview(mem)
        self.base = ffi.from_buffer(mem)  # keeps the mapping exported until close()
        self._words = (len(mem) // 8) * 8

    # --- geometry -------------------------------------------------------------------------
    def init(self, geometry: layout.Geometry, generation: int) -> None:
        """Lay out a fresh region (the receiver does this once, before anyone attaches)."""
        self.view[: geometry.buf_offset] = bytes(geometry.buf_offset)  # slots free, lap 0
        self.store(layout.W_GEN, generation)
        self.store(layout.W_NSLOTS, geometry.nslots)
        self.store(layout.W_BUFSIZE, geometry.buf_size)
        self.store(layout.W_STATE, layout.OPEN)
        self.store(layout.W_MAGIC, layout.MAGIC)  # last: a reader that sees it sees the rest
        self.geometry, self.generation = geometry, generation

    def attach(self) -> None:
        """Read the geometry a receiver laid out; PeerGone if there is no valid open region."""
        if len(self.mem) < layout.HEADER_BYTES or self.load(layout.W_MAGIC) != layout.MAGIC:
            raise PeerGone("no ring region here (bad magic)")
        if self.load(layout.W_STATE) != layout.OPEN:
            raise PeerGone("the ring's receiver has closed it")
        try:
            geometry = layout.Geometry(self.load(layout.W_NSLOTS), self.load(layout.W_BUFSIZE))
        except ValueError as e:
            raise PeerGone(f"ring header is invalid: {e}") from None
        if geometry.region_bytes > len(self.mem):
            raise PeerGone("ring header describes more memory than is mapped")
        self.geometry, self.generation = geometry, self.load(layout.W_GEN)

    # --- word operations ------------------------------------------------------------------
    def _check(self, off: int, n: int = 8) -> None:
        if off < 0 or off % 8 or off + n > self._words:
            raise IndexError(f"word offset {off} outside the region")

    def load(self, off: int) -> int:
        self._check(off)
        return lib.ring_load(self.base, off)

    def store(self, off: int, value: int) -> None:
        self._check(off)
        lib.ring_store(self.base, off, value)

    def cas(self, off: int, expected: int, desired: int) -> int:
        self._check(off)
        return lib.ring_cas(self.base, off, expected, desired)

    def read_words(self, off: int, n: int) -> list[int]:
        self._check(off, 8 * n)
        if n == 1:
            return [lib.ring_load(self.base, off)]
        out = ffi.new("uint64_t[]", n)
        lib.ring_load_n(self.base, off, out, n)  # each word atomically, in order, in one call
        return ffi.unpack(out, n)

    # --- bytes ----------------------------------------------------------------------------
    def read(self, off: int, n: int) -> bytes:
        return bytes(self.view[off: off + n])

    def read_into(self, off: int, out: memoryview) -> None:
        out[:] = self.view[off: off + len(out)]

    def write(self, pieces: Iterable[tuple[int, memoryview | bytes]]) -> None:
        for off, data in pieces:
            n = len(data) if not isinstance(data, memoryview) else data.nbytes
            if off < 0 or off + n > len(self.mem):
                raise IndexError(f"write of {n} bytes at {off} outside the region")
            self.view[off: off + n] = data

    def close(self) -> None:
        # Exports first, or the mapping refuses to close.
        if self.base is not None:
            ffi.release(self.base)
            self.base = None
        self.view.release()
        try:
            self.mem.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when it does
