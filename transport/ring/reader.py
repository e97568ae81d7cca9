"""The receiver's side of the ring protocol (DESIGN §5): wait-free, its own memory only.

1. load the size slot at the head; nothing to do unless it is busy for this lap and the
   tails' entry counter has moved past the head (a sender that published at step 6 but died
   before its step 7 leaves its entry to the next sender's step-4 repair; consuming it first
   would put the heads past the tails, and every later sender would find the ring "full"
   for ever);
2. copy the entry (the slot's length) out of the buffer at the buffer head, wrapping;
3. verify it (magic, entry counter, length, checksum); a failing entry is counted and dropped,
   never handed up;
4. clear the slot to "free, next lap" (only the receiver ever clears a busy bit);
5. advance both heads past the entry, after the slot is free, so a sender that sees the room
   also finds the slot free.

A dropped entry still moves the heads by the length its slot gave, exactly as far as the
senders moved the tails, so the two sides stay in step whatever was written into the bytes.

The Promela model of the protocol, ring.pml next to this file (checked by spin in
tests/test_ring_model.py), labels each of its receiver steps "reader.py step N" with the
numbers above.

Two implementations of the same steps: ``_step`` below, the reference, and ``ring_recv`` in the
compiled module (_atomics_build.py), one call for steps 1-5, used unless ``fast=False``. The
compiled one copies the entry into an uninitialised buffer and checksums it in the same pass.

Borrowing (``borrow``, compiled path): steps 1-3 run in place, with no copy, and the frames
handed up are read-only views into the ring; steps 4 and 5 wait for ``Loan.release()``, so the
senders cannot reuse those bytes meanwhile and no other receive proceeds. Only a sender that
stalled past its lock timeout with a stale tail (case 6) can write over a borrowed entry, and
only after a take-over, which taints the lock word for good (layout.LOCK_TAINT). So release
looks at the taint read at step 1: clean, it compares the entry's header with what was verified
(no sender can have written there: the payload is not read again); tainted, it hashes the entry
once more and compares it with the checksum verified at hand-up, and a late write is reported
(False; counted in ``torn``): what the consumer read may have been torn. An entry that wraps
around the buffer's end cannot be one view; it is copied out and consumed at once.
"""

from __future__ import annotations

import numpy as np

from onepiece.transport.ring import entry, layout
from onepiece.transport.ring._atomics import ffi, lib
from onepiece.transport.ring.region import MappedRegion
from onepiece.transport.ring.writer import FAST_DEFAULT, geometry_struct


class Loan:
    """A borrowed entry: ``frames`` are views into the ring (or, for an entry that wrapped,
    into a private copy), valid until ``release()``, which must come before the next receive.
    Also a context manager that releases on exit."""

    __slots__ = ("frames", "_reader", "_info", "intact")

    def __init__(self, frames: list[memoryview], reader: "RingReader | None", info=None) -> None:
        self.frames = frames
        self._reader = reader  # None: nothing to release (a copy, consumed already)
        self._info = info
        self.intact: bool | None = None if reader is not None else True

    @property
    def in_ring(self) -> bool:
        """Whether the frames are views into the ring, not yet released."""
        return self._reader is not None

    def release(self) -> bool:
        """Re-verify the entry where it is (see the module's doc), then free its slot and advance
        the heads. True if its bytes were still those verified at hand-up; False if a stale
        sender wrote over them meanwhile (the consumer may have read torn data). Releasing again
        does nothing."""
        reader, self._reader = self._reader, None
        if reader is not None:
            self.intact = reader._release(self)
        return bool(self.intact)

    def __enter__(self) -> "Loan":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


_WHY = {  # entry.parse's words for each reason the compiled code gives
    lib.RE_SHORT: lambda i, seq: f"entry of {i.length} bytes is shorter than its header",
    lib.RE_MAGIC: lambda i, seq: "bad entry magic",
    lib.RE_SEQ: lambda i, seq: f"entry written for #{i.eseq} found at #{seq}",
    lib.RE_LENGTH: lambda i, seq: f"entry says {i.elen} payload bytes but its slot holds {i.length}",
    lib.RE_CHECKSUM: lambda i, seq: "checksum mismatch",
    lib.RE_NFRAMES: lambda i, seq: f"bad frame count {i.nframes}",
    lib.RE_TABLE: lambda i, seq: "frame table does not add up to the payload",
    lib.RE_SLOT_LENGTH: lambda i, seq: f"slot length {i.length} exceeds the buffer",
}


class RingReader:
    def __init__(self, region: MappedRegion, fast: bool | None = None) -> None:
        """``fast``: the compiled steps (None: unless ONEPIECE_RING_FAST=0), else the reference."""
        self.region = region
        self.geometry = region.geometry
        self._heads = ffi.new("uint64_t[2]", layout.unpack_ptrs(region.load(layout.W_HEADS)))
        self.delivered = 0
        self.dropped = 0
        self.torn = 0  # borrowed entries found written over at their release
        self.last_error = ""
        self.fast = FAST_DEFAULT if fast is None else fast
        self._g = geometry_struct(region)
        self._info = ffi.new("ring_recv_info *")
        self._linfo = ffi.new("ring_recv_info *")  # the outstanding loan's (one at a time)
        self._table = ffi.new("uint64_t[]", entry.MAX_FRAMES)
        self._loan: Loan | None = None
        self._ro: memoryview | None = None

    # The heads live where the compiled code updates them in place.
    @property
    def bhead(self) -> int:
        return self._heads[0]

    @bhead.setter
    def bhead(self, value: int) -> None:
        self._heads[0] = value

    @property
    def shead(self) -> int:
        return self._heads[1]

    @shead.setter
    def shead(self, value: int) -> None:
        self._heads[1] = value

    def poll(self) -> list[memoryview] | None:
        """The frames of the next valid entry, copied out of the ring; None when there is none
        now. Invalid entries on the way are consumed and counted in ``dropped``."""
        self._check_free()
        if self.fast:
            return self._poll_fast()
        while True:
            frames = self._step()
            if frames is not False:
                return frames

    def borrow(self) -> Loan | None:
        """The next valid entry without copying it (see the module's doc), or None now."""
        self._check_free()
        if not self.fast:  # the reference receives by copy only: a loan with nothing to release
            frames = self.poll()
            return None if frames is None else Loan(frames, None)
        g, heads, info = self._g, self._heads, self._linfo
        while True:
            rc = lib.ring_recv(g, heads, ffi.NULL, 0, self._table, lib.RR_IN_PLACE, info)  # 1-3
            if rc == lib.RR_OK:
                self.delivered += 1
                if self._ro is None:
                    self._ro = self.region.view.toreadonly()
                start = self.geometry.buf_offset + (heads[0] & (self.geometry.buf_size - 1))
                self._loan = Loan(self._frames(self._ro, start, info.nframes), self, info)
                return self._loan
            if rc == lib.RR_NEED:  # it wraps around the buffer's end: copy it out
                frames = self._copy_out(info)
                if frames is not None:
                    return Loan(frames, None)
            elif rc == lib.RR_NONE:
                return None
            else:
                self._dropped(info)

    # --- the compiled path ------------------------------------------------------------------
    def _check_free(self) -> None:
        if self._loan is not None:
            raise RuntimeError("a borrowed ring entry has not been released")
        if self.region.base is None:
            raise ValueError("the ring region is closed")

    def _poll_fast(self) -> list[memoryview] | None:
        g, heads, info = self._g, self._heads, self._info
        while True:
            rc = lib.ring_recv(g, heads, ffi.NULL, 0, self._table, lib.RR_COPY, info)  # 1 (cap 0)
            if rc == lib.RR_NEED:
                frames = self._copy_out(info)
                if frames is not None:
                    return frames
            elif rc == lib.RR_NONE:
                return None
            else:
                self._dropped(info)

    def _copy_out(self, info) -> list[memoryview] | None:
        """Steps 1-5 into a fresh, uninitialised buffer of the entry's size (``info.length``,
        from step 1 just before); None if the entry was invalid (dropped)."""
        buf = np.empty(info.length, np.uint8)
        rc = lib.ring_recv(self._g, self._heads, ffi.from_buffer(buf), info.length, self._table,
                           lib.RR_COPY, info)
        if rc == lib.RR_OK:
            self.delivered += 1
            return self._frames(memoryview(buf), 0, info.nframes)
        if rc == lib.RR_DROPPED:
            self._dropped(info)
        return None  # (RR_NONE or RR_NEED cannot follow step 1: only this reader consumes)

    def _frames(self, mem: memoryview, start: int, nframes: int) -> list[memoryview]:
        out, pos = [], start + entry.ENTRY_HEADER + 8 * nframes
        for n in ffi.unpack(self._table, nframes):
            out.append(mem[pos: pos + n])
            pos += n
        return out

    def _dropped(self, info) -> None:
        self.dropped += 1
        self.last_error = _WHY[info.error](info, (self._heads[1] - 1) & layout.SEQ_MASK)

    def _release(self, loan: Loan) -> bool:
        self._loan = None
        if self.region.base is None:
            return False  # closed meanwhile: nothing to free
        if lib.ring_release(self._g, self._heads, loan._info):  # re-verify, then 4, 5
            return True
        self.torn += 1
        self.last_error = "a borrowed entry was written over before its release"
        return False

    # --- the reference ----------------------------------------------------------------------
    def _step(self) -> list[memoryview] | None | bool:
        g, region = self.geometry, self.region
        slot_off = g.slot_offset(self.shead)
        busy, lap, length = layout.slot_fields(region.load(slot_off))  # 1
        if not busy or lap != layout.lap_of(self.shead, g.nslots):
            return None
        if layout.unpack_ptrs(region.load(layout.W_TAILS))[1] == self.shead:
            return None  # published, but the tails have not passed it yet
        frames: list[memoryview] | bool = False
        if length <= g.buf_size:
            out = memoryview(bytearray(length))  # 2
            pos = 0
            for off, n in g.spans(self.bhead, length):
                region.read_into(off, out[pos: pos + n])
                pos += n
            try:
                frames = entry.parse(out, self.shead, region.generation)  # 3
            except entry.EntryError as e:
                self.last_error = str(e)
        else:
            self.last_error = f"slot length {length} exceeds the buffer"
        region.store(slot_off, layout.slot_free(layout.lap_of(self.shead + g.nslots, g.nslots)))  # 4
        self.bhead = (self.bhead + length) & layout.BUF_MASK
        self.shead = (self.shead + 1) & layout.SEQ_MASK
        region.store(layout.W_HEADS, layout.pack_ptrs(self.bhead, self.shead))  # 5
        if frames is False:
            self.dropped += 1
        else:
            self.delivered += 1
        return frames
