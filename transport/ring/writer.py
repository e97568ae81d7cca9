"""The sender's side of the ring protocol (DESIGN §5), written once against ``Region``.

Steps, as numbered here, in ring.pml (the model checked by spin) and in the fault tests:

1. take the lock: CAS the lock word from free (0, or layout.LOCK_TAINT alone) to free | a token
   of this acquisition; a waiter that sees the same holder word for longer than the lock
   timeout, on its own clock, takes the lock over with CAS from that word to LOCK_TAINT | its
   token (the taint stays for the region's life: see layout.py);
2. read the header words (generation, state, lock, tails, heads) in one read; if the lock
   word is no longer our token, we stalled past the timeout and were taken over: write
   nothing (LostLock);
3. check room: an entry counter and enough bytes must be free, else release and report full;
4. if the size slot at the tail is already busy for this lap, a sender died after publishing
   but before moving the tail: move the tail past that entry (CAS on the tails word), go to 2;
   if it is free for a later lap, a stalled sender moved the tails past it after our step 2
   and the receiver consumed it: go to 2;
5. write the entry (checksummed header and payload) at the buffer tail, wrapping at the end;
6. publish: CAS the size slot from "free, this lap" to "busy, this lap, length"; it fails if
   a late sender published there first: if the lock is no longer ours, LostLock; if it is,
   go to 2 only when the slot is busy with another length (our bytes under it can never pass
   as an entry there), else raise Unconfirmed, since our entry may be handed up in that
   slot and writing it again could deliver it twice;
7. move both tails with one CAS from the value read in step 2; if it fails, a later sender
   already moved them past this entry (step 4), which is just as good;
8. release the lock with CAS from the word we hold to its taint bit alone, which does nothing if
   it was taken over.

Nothing here waits on the receiver, and every wait is bounded by the caller's deadline.

The Promela model of this protocol, ring.pml next to this file (checked by spin in
tests/test_ring_model.py), labels each of its steps "writer.py step N" with the numbers above;
its header lists what it abstracts and what it found.

Two implementations of the same steps: this Python code, the reference, which runs whenever a
step hook is set (the fault tests stop senders at a step through it) or the region is remote
(the TCP agent, RDMA); and ``ring_send`` in the compiled module (_atomics_build.py), which runs
steps 1-8 in one call on a region mapped here (shared memory) when no hook is set: step 1 there
is one CAS, and only when the lock is held does Python's bounded wait and take-over below run.
The C code mirrors this file step by step and returns a status that ``_FAST_ERRORS`` maps to the
same exceptions; tests/test_ring_fastpath.py runs both on the same workloads and compares.
"""

from __future__ import annotations

import os
import random
import time
from typing import Callable

from onepiece.transport.base import Full, TransportError
from onepiece.transport.ring import entry, layout
from onepiece.transport.ring._atomics import ffi, lib
from onepiece.transport.ring.region import MappedRegion, PeerGone, Region

# Re-reads of the header within one lock holding (steps 4 and 6 send us back to 2): each
# repair consumes one entry, so a small bound suffices; past it, report full and let go.
MAX_ROUNDS = 16


class LostLock(TransportError):
    """This sender stalled past the lock timeout and another took the lock: it did not publish
    its entry. If it had written it already (raised at step 6), its late write may have torn
    the entries published after the take-over, which the checksum catches, or, exactly as
    long as the one it overwrote, replaced it whole: then it is handed up in that one's place."""


class Unconfirmed(TransportError):
    """A stalled sender published its stale size slot over this sender's entry, of the same
    length: the entry may or may not be handed up; it is not written again (no duplicates)."""


class TooBig(TransportError):
    """The message can never fit in this ring."""


class _Full(Exception):
    """Internal: no room right now."""


_FAST_ERRORS = {
    lib.RS_PEER_GONE: (PeerGone, "the ring's receiver closed or replaced it"),
    lib.RS_LOST_LOCK_2: (LostLock, "lock taken over while this sender stalled; nothing written"),
    lib.RS_LOST_LOCK_6: (LostLock, "lock taken over while this sender stalled; its size slot not published"),
    lib.RS_UNCONFIRMED: (Unconfirmed, "a stalled sender published over this entry; it may or may not be delivered"),
}
assert lib.RING_MAX_ROUNDS == MAX_ROUNDS and lib.RING_MAX_FRAMES == entry.MAX_FRAMES

# ONEPIECE_RING_FAST=0 in a process's environment makes its senders and receivers run the
# Python reference even where the compiled path could (to compare, or to debug; the soak test
# runs two of every three sender processes so).
FAST_DEFAULT = os.environ.get("ONEPIECE_RING_FAST", "1") != "0"


def geometry_struct(region: MappedRegion):
    """The compiled code's view of a mapped region; valid until ``region.close()`` (callers
    check ``region.base`` first)."""
    g = region.geometry
    return ffi.new("ring_geom *", {"base": region.base, "nslots": g.nslots, "buf_size": g.buf_size,
                                   "buf_off": g.buf_offset, "generation": region.generation})


class RingWriter:
    def __init__(self, region: Region, lock_timeout: float = 2.0,
                 step_hook: Callable[[int], None] | None = None, fast: bool | None = None) -> None:
        """``fast``: use the compiled steps (None: whenever possible, i.e. no step hook and a
        region mapped here, unless ONEPIECE_RING_FAST=0; True insists, False never)."""
        self.region = region
        self.geometry = region.geometry
        self.lock_timeout = lock_timeout
        self.step = step_hook or (lambda n: None)
        possible = step_hook is None and isinstance(region, MappedRegion)
        if fast and not possible:
            raise ValueError("the compiled fast path needs a region mapped here and no step hook")
        self.fast = (possible and FAST_DEFAULT) if fast is None else fast
        if self.fast:
            self._g = geometry_struct(region)
            self._info = ffi.new("ring_send_info *")
        self._token_base = (random.getrandbits(31) | 1) << 32
        self._counter = 0
        # The lock value we have been watching and since when: kept across sends, so a dead
        # holder is taken over even when each send's own timeout is shorter than the lock's.
        self._seen, self._since = 0, 0.0
        self.takeovers = self.repairs = 0

    def write(self, frames: list, timeout: float) -> None:
        """Publish one entry holding ``frames`` or raise (Full, LostLock, Unconfirmed, PeerGone, TooBig)
        within ``timeout`` seconds."""
        if self.fast:
            return self._write_fast(frames, timeout)
        g = self.geometry
        deadline = time.monotonic() + timeout
        prepared = entry.Prepared(frames, self.region.generation)
        if prepared.total > g.buf_size:
            raise TooBig(f"entry of {prepared.total} bytes exceeds the ring's {g.buf_size}")
        pause = 20e-6
        while True:
            self.step(1)
            token = self._acquire(deadline)
            try:
                self._publish(prepared, token)
                return
            except _Full:
                pass
            finally:
                self.step(8)
                self.region.cas(layout.W_LOCK, token, token & layout.LOCK_TAINT)
            if time.monotonic() >= deadline:
                raise Full(f"ring full for {timeout:.2f}s ({g.nslots} slots, {g.buf_size} bytes)")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _write_fast(self, frames: list, timeout: float) -> None:
        """``write`` through the compiled steps 1-8 (``ring_send``); the same outcomes."""
        if len(frames) > entry.MAX_FRAMES:
            raise ValueError(f"{len(frames)} frames exceed {entry.MAX_FRAMES}")
        if self.region.base is None:
            raise PeerGone("the ring region was closed here")
        try:
            bufs = [ffi.from_buffer(f) for f in frames]
        except ValueError as e:  # not contiguous: the TypeError memoryview.cast raises there
            raise TypeError(str(e)) from None
        lens = [len(b) for b in bufs]
        total = (entry.ENTRY_HEADER + 8 * len(bufs) + sum(lens) + 7) & ~7
        g = self.geometry
        if total > g.buf_size:
            raise TooBig(f"entry of {total} bytes exceeds the ring's {g.buf_size}")
        deadline = time.monotonic() + timeout
        info = self._info
        pause = 20e-6
        while True:
            self._counter = (self._counter + 1) & 0xFFFFFFFF
            rc = lib.ring_send(self._g, self._token_base | self._counter, 1, len(bufs), bufs, lens, info)  # 1-8
            if rc == lib.RS_LOCKED:  # held: wait (bounded) and maybe take it over, then 2-8 as that word
                token = self._acquire(deadline)
                rc = lib.ring_send(self._g, token, 0, len(bufs), bufs, lens, info)
            if info.repairs:
                self.repairs += info.repairs
            if rc == lib.RS_OK:
                return
            if rc != lib.RS_FULL:
                kind, why = _FAST_ERRORS[rc]
                raise kind(why)
            if time.monotonic() >= deadline:
                raise Full(f"ring full for {timeout:.2f}s ({g.nslots} slots, {g.buf_size} bytes)")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    # --- step 1 -------------------------------------------------------------------------------
    def _acquire(self, deadline: float) -> int:
        """The lock word now held: the taint bit it carries, if any, and this acquisition's token."""
        self._counter = (self._counter + 1) & 0xFFFFFFFF
        token = self._token_base | self._counter
        free, pause = 0, 0.0
        while True:
            found = self.region.cas(layout.W_LOCK, free, free | token)
            if found == free:
                return free | token
            if found == layout.LOCK_TAINT and free == 0:
                free = found  # free, but tainted: CAS from that at once (as ring_send does)
                continue
            now = time.monotonic()
            if found != self._seen:
                self._seen, self._since = found, now
            elif now - self._since >= self.lock_timeout:
                if self.region.cas(layout.W_LOCK, found, layout.LOCK_TAINT | token) == found:
                    self.takeovers += 1
                    self._seen = 0
                    return layout.LOCK_TAINT | token
            if now >= deadline:
                raise Full(f"ring lock held by another sender (token {found:#x})")
            time.sleep(pause)
            pause = min(max(pause * 2, 10e-6), 1e-3)

    # --- steps 2 to 7 -------------------------------------------------------------------------
    def _publish(self, prepared: entry.Prepared, token: int) -> None:
        g, region = self.geometry, self.region
        for _ in range(MAX_ROUNDS):
            self.step(2)
            gen, state, _, _, lock, tails, heads = region.read_words(layout.W_GEN, 7)
            if state != layout.OPEN or gen != region.generation:
                raise PeerGone("the ring's receiver closed or replaced it")
            if lock != token:
                raise LostLock("lock taken over while this sender stalled; nothing written")
            btail, stail = layout.unpack_ptrs(tails)
            bhead, shead = layout.unpack_ptrs(heads)
            total = prepared.total

            self.step(3)
            if layout.seq_used(stail, shead) >= g.nslots:
                raise _Full()
            slot_off = g.slot_offset(stail)
            lap = layout.lap_of(stail, g.nslots)

            self.step(4)
            busy, slot_lap, length = layout.slot_fields(region.read_words(slot_off, 1)[0])
            if busy:
                if slot_lap != lap:
                    raise _Full()  # the receiver has not cleared it yet
                region.cas(layout.W_TAILS, tails, layout.pack_ptrs(btail + length, stail + 1))
                self.repairs += 1
                continue
            if slot_lap != lap:
                continue  # consumed already: the tails we read are stale, look again
            if layout.buf_used(btail, bhead) + total > g.buf_size:
                raise _Full()

            self.step(5)
            region.write(entry.split(prepared.at(stail, region.generation), g.spans(btail, total)))

            self.step(6)
            free = layout.slot_free(lap)
            found = region.cas(slot_off, free, layout.slot_busy(lap, total))
            if found != free:
                if region.read_words(layout.W_LOCK, 1)[0] != token:
                    raise LostLock("lock taken over while this sender stalled; its size slot not published")
                # A stalled sender with the same stale tail published here after step 4.
                fbusy, flap, flength = layout.slot_fields(found)
                if fbusy and flap == lap and flength != total:
                    continue  # the slot's length rules our bytes out as its entry: look again
                raise Unconfirmed("a stalled sender published over this entry; it may or may not be delivered")

            self.step(7)
            region.cas(layout.W_TAILS, tails, layout.pack_ptrs(btail + total, stail + 1))
            return
        raise _Full()
