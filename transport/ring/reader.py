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
"""

from __future__ import annotations

from onepiece.transport.ring import entry, layout
from onepiece.transport.ring.region import MappedRegion


class RingReader:
    def __init__(self, region: MappedRegion) -> None:
        self.region = region
        self.geometry = region.geometry
        self.bhead, self.shead = layout.unpack_ptrs(region.load(layout.W_HEADS))
        self.delivered = 0
        self.dropped = 0
        self.last_error = ""

    def poll(self) -> list[memoryview] | None:
        """The frames of the next valid entry; None when there is none now. Invalid entries
        on the way are consumed and counted in ``dropped``."""
        while True:
            frames = self._step()
            if frames is not False:
                return frames

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
