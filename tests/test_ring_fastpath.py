"""The ring's compiled fast path (transport/ring/_atomics_build.py: ``ring_send`` for sender steps
1-8, ``ring_recv``/``ring_release`` for receiver steps 1-5) against the Python reference
(writer.py, reader.py), and the zero-copy receive (``borrow``).

- RH64, the entry checksum: the same value from the AVX2 and the portable kernel, in any split
  into pieces, fused with a copy or not; seeded; position-sensitive.
- One randomized, single-threaded workload run in lockstep on three regions with the same
  generation: all compiled, all reference, and a mix (each send and receive picks a side at
  random). Interference is scripted at a sender step, through writer.py's step hook and the
  compiled code's test hook alike (lock taken over at step 2 or 6, a stale publish of the same
  or another length at step 6, a dead sender's publish or a consumed slot at step 4, tails
  moved at step 5, the receiver gone), and entries are corrupted in place (every reason the
  receiver drops one). After every operation the outcomes (frames, exception and its text,
  counters) and the three regions' bytes must be identical.
- Compiled and reference senders in threads on one shm ring, received by both readers and by
  borrow: FIFO per sender, nothing lost or twice, every byte as sent.
- borrow: views into the ring while borrowed (slot busy, heads unmoved, no other receive),
  slot freed after; bytes written over while borrowed are reported at release; an entry that
  wraps around the ring's end is copied and freed at once.
- Large pieces (the sender's non-temporal copy, hashed from the source) verify, wrapped or not.
"""

from __future__ import annotations

import mmap
import os
import random
import struct
import threading
import time
import uuid

import numpy as np
import pytest

from onepiece.transport import registry
from onepiece.transport.message import Message
from onepiece.transport.ring import entry, layout
from onepiece.transport.ring._atomics import ffi, lib
from onepiece.transport.ring.reader import RingReader
from onepiece.transport.ring.region import MappedRegion
from onepiece.transport.ring.writer import MAX_ROUNDS, RingWriter

GEN = 0x0123_4567_89AB_CDEF
OTHER = 0x7777_0000_0000_0001  # a lock token of no writer here


# --- RH64 ----------------------------------------------------------------------------------------

def rh(chunks, seed: int, copy: bool = False) -> int:
    h = ffi.new("ring_hash *")
    lib.ring_hash_init(h, seed)
    for c in chunks:
        if copy:
            out = bytearray(len(c))
            lib.ring_copy_hash(h, ffi.from_buffer(out), c, len(c))
            assert bytes(out) == bytes(c)
        else:
            lib.ring_hash_update(h, c, len(c))
    return lib.ring_hash_final(h)


def splits(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.randrange(len(data) + 1) for _ in range(rng.randrange(6)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


def test_checksum_same_in_any_kernel_and_any_pieces():
    rng = random.Random(1)
    best = lib.ring_hash_kernel()
    cases = [rng.randbytes(n) for n in [0, 1, 7, 8, 63, 64, 65, 127, 128, 1023, 1024, 1025, 4096 + 17, 70000]]
    cases += [rng.randbytes(rng.randrange(3000)) for _ in range(150)]
    try:
        assert lib.ring_hash_use(1) == 1
        portable = [rh([d], GEN) for d in cases]
    finally:
        assert lib.ring_hash_use(2) == best
    for d, want in zip(cases, portable):
        assert rh([d], GEN) == want
        assert rh(splits(d, rng), GEN) == want
        assert rh(splits(d, rng), GEN, copy=True) == want
    print(f"kernel in use: {'AVX2' if best == 2 else 'portable C'}")


def test_checksum_seeded_and_position_sensitive():
    rng = random.Random(2)
    for n in (8, 64, 200, 1024, 1100, 5000):
        data = rng.randbytes(n)
        h = rh([data], GEN)
        assert rh([data], GEN + 1) != h and rh([data], 0) != h
        assert rh([data + b"\0"], GEN) != h and rh([b"\0" + data], GEN) != h  # zeros count
        words = [data[i:i + 8] for i in range(0, n - n % 8, 8)]
        for _ in range(20):  # two different words swapped: another checksum
            i, j = rng.sample(range(len(words)), 2) if len(words) > 1 else (0, 0)
            if words[i] != words[j]:
                w = list(words)
                w[i], w[j] = w[j], w[i]
                assert rh([b"".join(w) + data[len(words) * 8:]], GEN) != h
        if n > 8:
            assert rh([data[8:] + data[:8]], GEN) != h  # the same bytes, moved by a word
        for _ in range(50):  # one bit anywhere
            b = bytearray(data)
            b[rng.randrange(n)] ^= 1 << rng.randrange(8)
            assert rh([bytes(b)], GEN) != h
    # a Fletcher sum's blind spot: top bits of two words of one lane an even number apart
    data = bytearray(1024)
    data[7] ^= 0x80
    data[7 + 2 * 64] ^= 0x80
    assert rh([bytes(data)], GEN) != rh([bytes(1024)], GEN)


def test_entry_checksum_is_the_one_the_fast_path_writes():
    region = make_region(8, 1024)
    frames = [b"abc", b"", bytes(range(200))]
    RingWriter(region, fast=True).write(frames, 1.0)
    g = region.geometry
    raw = bytes(region.view[g.buf_offset: g.buf_offset + entry.padded(entry.ENTRY_HEADER + 24 + 203)])
    assert [bytes(f) for f in entry.parse(memoryview(raw), 0, GEN)] == frames
    want = b"".join(bytes(p) for p in entry.Prepared(frames).at(0, GEN))
    assert raw[:len(want)] == want


# --- lockstep: compiled, reference and mixed ------------------------------------------------------

def make_region(nslots: int, buf_size: int) -> MappedRegion:
    g = layout.Geometry(nslots, buf_size)
    region = MappedRegion(mmap.mmap(-1, g.region_bytes))
    region.init(g, GEN)
    return region


class Fault:
    """Something done to a region at a sender step (once), as a concurrent party would."""

    def __init__(self, step: int, what: str, arg: int = 0) -> None:
        self.step, self.what, self.arg, self.done = step, what, arg, False

    def apply(self, region: MappedRegion, total: int) -> None:
        g = region.geometry
        btail, stail = layout.unpack_ptrs(region.load(layout.W_TAILS))
        slot, lap = g.slot_offset(stail), layout.lap_of(stail, g.nslots)
        if self.what == "lock":  # taken over while we stalled
            region.store(layout.W_LOCK, layout.LOCK_TAINT | OTHER)
        elif self.what == "lock+same":  # taken over, and the new holder published here
            region.store(layout.W_LOCK, layout.LOCK_TAINT | OTHER)
            region.store(slot, layout.slot_busy(lap, total))
        elif self.what == "same":  # a stale sender's publish of the same length
            region.store(slot, layout.slot_busy(lap, total))
        elif self.what == "other":  # ... of another length
            region.store(slot, layout.slot_busy(lap, total + 8))
        elif self.what == "dead":  # a sender died after publishing (length arg), before step 7
            region.store(slot, layout.slot_busy(lap, self.arg))
        elif self.what == "consumed":  # the slot is free for a later lap
            region.store(slot, layout.slot_free(lap + 1))
        elif self.what == "tails":  # at step 7: a later sender's step 4 moved the tails past
            # our published entry already (so our CAS fails), as far as its slot says
            region.store(layout.W_TAILS, layout.pack_ptrs(btail + total, stail + 1))
        elif self.what == "closed":
            region.store(layout.W_STATE, layout.CLOSED)
        else:
            raise AssertionError(self.what)


class Side:
    """One region with a compiled and a reference writer and reader on it."""

    def __init__(self, name: str, nslots: int, buf_size: int) -> None:
        self.name = name
        self.region = make_region(nslots, buf_size)
        self.fault: Fault | None = None
        self.total = 0
        # One writer switched between the two paths per send, so that what a writer remembers
        # across sends (the lock word it watches, its counters) is shared, as in one process.
        self.writer = RingWriter(self.region, lock_timeout=0.0, fast=True)
        self.reader = RingReader(self.region)

    def hook(self, n: int) -> None:
        f = self.fault
        if f is not None and f.step == n and not f.done:
            f.done = True
            f.apply(self.region, self.total)

    def send(self, frames: list[bytes], compiled: bool, fault: Fault | None, timeout: float) -> str:
        self.fault, self.total = fault, entry.padded(entry.ENTRY_HEADER + 8 * len(frames) + sum(map(len, frames)))
        _HOOK[0] = self.hook
        w = self.writer
        w.fast, w.step = (True, _no_step) if compiled else (False, self.hook)
        try:
            w.write(frames, timeout)
            return "ok"
        except Exception as e:  # the outcome compared
            return f"{type(e).__name__}: {e}"
        finally:
            self.fault = None

    def receive(self, compiled: bool, borrow: bool) -> tuple:
        r = self.reader
        r.fast = compiled
        if borrow:
            loan = r.borrow()
            frames = None if loan is None else [bytes(f) for f in loan.frames]
            if loan is not None:
                assert loan.release()
        else:
            got = r.poll()
            frames = None if got is None else [bytes(f) for f in got]
        return frames, r.dropped, r.delivered, r.last_error, r.bhead, r.shead

    def corrupt(self, rng: random.Random, how: str) -> None:
        """Damage the entry at the heads (if one is published), as a late writer might."""
        g, region = self.region.geometry, self.region
        bhead, shead = layout.unpack_ptrs(region.load(layout.W_HEADS))
        slot = g.slot_offset(shead)
        busy, lap, length = layout.slot_fields(region.load(slot))
        if not busy:
            return
        def at(off: int) -> int:  # region offset of entry byte off (it may wrap)
            return g.buf_offset + (bhead + off) % g.buf_size

        if how == "byte":
            i = at(rng.randrange(length))
            region.view[i] ^= 1 + rng.randrange(255)
        elif how in ("magic", "seq", "len", "nframes"):
            word = {"magic": 0, "seq": 8, "len": 16, "nframes": 0}[how]
            off = at(word)
            old = int.from_bytes(region.view[off: off + 8], "little")
            new = {"magic": old ^ 1, "seq": old + 1, "len": old + 8, "nframes": old + (1 << 40)}[how]
            region.view[off: off + 8] = (new & ((1 << 64) - 1)).to_bytes(8, "little")
        else:  # the slot says another length than the entry's: only for the last entry, with
            # the tails moved to match, as a stale publish and the step-4 repair after it leave them
            btail, stail = layout.unpack_ptrs(region.load(layout.W_TAILS))
            if layout.seq_used(stail, shead) != 1:
                return
            new = {"slotlen": g.buf_size + 8, "short": 16, "slotother": length + 8}[how]
            region.store(slot, layout.slot_busy(lap, new))
            region.store(layout.W_TAILS, layout.pack_ptrs(btail + new - length, stail))


def _no_step(n: int) -> None:
    pass


_HOOK: list = [None]
_CALLBACK = ffi.callback("void(int)", lambda n: _HOOK[0](n) if _HOOK[0] is not None else None)


@pytest.fixture
def c_hook():
    lib.ring_set_hook(_CALLBACK)
    try:
        yield
    finally:
        lib.ring_set_hook(ffi.NULL)
        _HOOK[0] = None


FAULTS = [(2, "lock"), (2, "closed"), (6, "lock+same"), (6, "same"), (6, "other"), (4, "dead"),
          (4, "consumed"), (5, "other"), (6, "lock"), (7, "tails"), (8, "lock"), (3, "consumed")]


def frames_of(rng: random.Random, room: int) -> list[bytes]:
    sizes = [rng.choice([0, 1, 7, 8, 9, 64, 100, 333, 900]) for _ in range(rng.randrange(4))]
    if rng.random() < 0.1:
        sizes = [max(0, room - entry.ENTRY_HEADER - 8)]  # fills the ring exactly
    return [rng.randbytes(n) for n in sizes]


@pytest.mark.parametrize("seed", range(6))
def test_compiled_and_reference_in_lockstep(c_hook, seed):
    rng = random.Random(seed)
    nslots, buf_size = rng.choice([(4, 512), (8, 1024), (16, 2048), (2, 4096)])
    sides = [Side("compiled", nslots, buf_size), Side("reference", nslots, buf_size), Side("mixed", nslots, buf_size)]
    seen: dict[str, int] = {}
    try:
        for op in range(600):
            r = rng.random()
            if r < 0.4:
                frames = frames_of(rng, buf_size)
                fault = None
                if rng.random() < 0.25:
                    step, what = rng.choice(FAULTS)
                    fault = (step, what, rng.choice([32, 40, 64, 128]))
                timeout = 0.0  # one attempt: the outcome depends on the ring, not on timing
                pick = rng.random() < 0.5
                outs = [s.send(frames, c, Fault(*fault) if fault else None, timeout)
                        for s, c in zip(sides, (True, False, pick))]
                key = outs[0].split(":")[0] + ("" if fault is None else f" after {fault[1]}@{fault[0]}")
                seen[key] = seen.get(key, 0) + 1
                assert outs[0] == outs[1] == outs[2], (op, fault, outs)
            elif r < 0.9:
                borrow, pick = rng.random() < 0.5, rng.random() < 0.5
                outs = [s.receive(c, borrow and c) for s, c in zip(sides, (True, False, pick))]
                assert outs[0] == outs[1] == outs[2], (op, outs)
            else:
                how = rng.choice(["byte", "magic", "seq", "len", "nframes", "slotlen", "short", "slotother"])
                state = rng.getstate()
                for s in sides:
                    rng.setstate(state)
                    s.corrupt(rng, how)
            unlock = rng.random() < 0.5  # else the next send waits (0 s) and takes the lock over
            for s in sides:  # repair what a fault left behind, identically
                region = s.region
                if region.load(layout.W_STATE) != layout.OPEN:
                    region.store(layout.W_STATE, layout.OPEN)
                if region.load(layout.W_LOCK) == layout.LOCK_TAINT | OTHER and unlock:
                    region.store(layout.W_LOCK, layout.LOCK_TAINT)  # released: the taint stays
                _repair_consumed(region)
            base = bytes(sides[0].region.view)
            for s in sides[1:]:
                assert bytes(s.region.view) == base, f"op {op}: {s.name} region differs from the compiled one"
        assert seen.get("ok", 0) > 40, seen
        print(f"seed {seed}: {dict(sorted(seen.items()))}; dropped={sides[0].reader.dropped} "
              f"delivered={sides[0].reader.delivered}")
    finally:
        for s in sides:
            s.region.close()


def _repair_consumed(region: MappedRegion) -> None:
    """A "consumed" fault leaves the tail's slot free for the next lap while the tails stay: undo."""
    g = region.geometry
    btail, stail = layout.unpack_ptrs(region.load(layout.W_TAILS))
    bhead, shead = layout.unpack_ptrs(region.load(layout.W_HEADS))
    for seq in range(shead, shead + g.nslots):
        seq &= layout.SEQ_MASK
        busy, lap, _ = layout.slot_fields(region.load(g.slot_offset(seq)))
        if layout.seq_used(seq, shead) >= layout.seq_used(stail, shead) and not busy \
                and lap != layout.lap_of(seq, g.nslots):
            region.store(g.slot_offset(seq), layout.slot_free(layout.lap_of(seq, g.nslots)))


def test_step_outcomes_one_by_one(c_hook):
    """Each scripted fault, once, on a fresh pair: the outcome both sides report."""
    want = {
        (2, "lock"): "LostLock: lock taken over while this sender stalled; nothing written",
        (2, "closed"): "PeerGone: the ring's receiver closed or replaced it",
        (6, "lock+same"): "LostLock: lock taken over while this sender stalled; its size slot not published",
        (6, "same"): "Unconfirmed: a stalled sender published over this entry; it may or may not be delivered",
        (6, "other"): "ok",
        (4, "dead"): "ok",
        (7, "tails"): "ok",
        (5, "same"): "Unconfirmed: a stalled sender published over this entry; it may or may not be delivered",
        (4, "consumed"): "Full: ring full for 0.00s (8 slots, 1024 bytes)",
    }
    for (step, what), outcome in want.items():
        pair = [Side("compiled", 8, 1024), Side("reference", 8, 1024)]
        try:
            for s in pair:
                assert s.send([b"first"], s.name == "compiled", None, 1.0) == "ok"
            outs = [s.send([b"x" * 50], s.name == "compiled", Fault(step, what, 64), 0.001) for s in pair]
            assert outs == [outcome, outcome], (step, what, outs)
            assert bytes(pair[0].region.view) == bytes(pair[1].region.view), (step, what)
            if what == "dead":
                assert pair[0].writer.repairs == pair[1].writer.repairs == 1
        finally:
            for s in pair:
                s.region.close()
    assert MAX_ROUNDS == lib.RING_MAX_ROUNDS


def test_lock_held_then_taken_over_the_same_way():
    pair = [Side("compiled", 8, 1024), Side("reference", 8, 1024)]
    try:
        for s in pair:
            s.region.store(layout.W_LOCK, OTHER)
            w = s.writer
            w.lock_timeout = 0.05
            t0 = time.monotonic()
            assert s.send([b"a"], s.name == "compiled", None, 0.01).startswith("Full: ring lock held by another sender")
            assert s.send([b"b"], s.name == "compiled", None, 1.0) == "ok"  # takes it over past 0.05 s
            assert time.monotonic() - t0 >= 0.05 and w.takeovers == 1
            assert s.region.load(layout.W_LOCK) == layout.LOCK_TAINT  # released; the take-over stays marked
            assert s.send([b"c"], s.name == "compiled", None, 0.01) == "ok"  # acquired from the tainted free word
            assert s.region.load(layout.W_LOCK) == layout.LOCK_TAINT
        assert bytes(pair[0].region.view) == bytes(pair[1].region.view)
    finally:
        for s in pair:
            s.region.close()


# --- threads on one shm ring: compiled and reference senders, both readers, borrow ---------------

def shm_address(slots: int, nbytes: int) -> str:
    return f"shm://op-fast-{os.getpid()}-{uuid.uuid4().hex[:8]}?slots={slots}&bytes={nbytes}"


@pytest.mark.parametrize("slots,nbytes", [(4, 1024), (16, 8192)])
def test_compiled_and_reference_senders_share_a_ring(slots, nbytes):
    receiver = registry.listen(shm_address(slots, nbytes))
    rng = random.Random(slots)
    plans = []
    for s in range(4):
        plans.append([[struct.pack("<II", s, i), rng.randbytes(rng.choice([0, 5, 100, 300, 700]))]
                      for i in range(150)])
    errors: list[BaseException] = []

    def run(s: int) -> None:
        sender = registry.connect(receiver.address)
        if s % 2:
            sender.step_hook = lambda n: None  # a hook: the Python reference
        try:
            for frames in plans[s]:
                sender.send_frames(frames, timeout=10.0)
            assert sender.writer.fast == (s % 2 == 0)
        except BaseException as e:  # reported below
            errors.append(e)
        finally:
            sender.close()

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in range(4)]
    got: list[list[bytes]] = []
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        reader = receiver.reader
        while len(got) < 600 and time.monotonic() < deadline:
            reader.fast = rng.random() < 0.7
            if reader.fast and rng.random() < 0.5:
                loan = reader.borrow()
                if loan is not None:
                    got.append([bytes(f) for f in loan.frames])
                    assert loan.release()
                    continue
            else:
                frames = reader.poll()
                if frames is not None:
                    got.append([bytes(f) for f in frames])
                    continue
            time.sleep(20e-6)
        for t in threads:
            t.join(10)
        assert not errors, errors
        assert reader.dropped == 0 and reader.torn == 0
    finally:
        receiver.close()
    by: dict[int, list] = {}
    for frames in got:
        by.setdefault(struct.unpack("<II", frames[0])[0], []).append(frames)
    for s in range(4):
        assert by.get(s) == plans[s], f"sender {s}: FIFO, nothing lost or twice, exact bytes"


# --- borrow --------------------------------------------------------------------------------------

def test_borrow_hands_up_views_and_frees_the_slot_on_release():
    receiver = registry.listen(shm_address(4, 1 << 16))
    sender = registry.connect(receiver.address)
    try:
        payload = np.arange(1000, dtype=np.float32)
        sender.send(Message({"uid": "one"}, {"x": payload, "b": b"raw"}), timeout=1)
        sender.send(Message({"uid": "two"}, {"x": payload}), timeout=1)
        region, g = receiver.region, receiver.region.geometry
        heads = region.load(layout.W_HEADS)
        with receiver.borrow(1.0) as b:
            assert b.in_ring and b.intact is None
            x = b.message.parts["x"]
            assert b.message.uid == "one" and np.array_equal(x, payload) and bytes(b.message.parts["b"]) == b"raw"
            assert not x.flags.writeable
            # a view into the ring, not a copy
            addr = x.__array_interface__["data"][0]
            base = int(ffi.cast("uintptr_t", region.base))
            assert base + g.buf_offset <= addr < base + g.region_bytes
            # the entry is not consumed while borrowed; nothing else is received meanwhile
            assert region.load(layout.W_HEADS) == heads
            assert layout.slot_fields(region.load(g.slot_offset(0)))[0]
            with pytest.raises(RuntimeError, match="borrowed"):
                receiver.recv(0)
            with pytest.raises(RuntimeError, match="borrowed"):
                receiver.borrow(0)
        assert b.intact is True and receiver.torn == 0
        assert region.load(layout.W_HEADS) != heads
        assert not layout.slot_fields(region.load(g.slot_offset(0)))[0]  # freed
        m = receiver.recv(1.0)  # a copy
        assert m.uid == "two" and np.array_equal(m.parts["x"], payload)
        assert receiver.recv(0) is None and receiver.borrow(0) is None
    finally:
        sender.close()
        receiver.close()


def test_borrowed_bytes_written_over_are_reported_at_release():
    """As a sender that stalled past its lock timeout with a stale tail would: it writes over
    an entry the consumer is reading. Such a sender exists only after a take-over, which leaves
    its taint in the lock word (set here as it leaves it); release then hashes the entry again
    and says so."""
    receiver = registry.listen(shm_address(4, 1 << 16))
    sender = registry.connect(receiver.address)
    try:
        receiver.region.store(layout.W_LOCK, layout.LOCK_TAINT)
        for uid in ("a", "b"):
            sender.send(Message({"uid": uid}, {"p": bytes(range(256)) * 4}), timeout=1)
        b = receiver.borrow(1.0)
        p = b.message.parts["p"]
        assert bytes(p[:4]) == bytes(range(4))
        mv = receiver.region.view
        off = int(np.frombuffer(p, np.uint8).__array_interface__["data"][0]) - int(ffi.cast("uintptr_t", receiver.region.base))
        mv[off + 100] ^= 0xFF  # the late write, straight into the mapped memory
        assert p[100] == (100 ^ 0xFF)  # the consumer's view shows it: it is the ring
        assert b.release() is False and b.intact is False
        assert receiver.torn == 1 and receiver.reader.delivered == 1
        nxt = receiver.borrow(1.0)  # the ring goes on
        assert nxt.message.uid == "b" and nxt.release() is True
        # a whole other valid entry in its place is caught too (compared with what was verified)
        sender.send(Message({"uid": "c"}, {"p": b"x" * 300}), timeout=1)
        sender.send(Message({"uid": "d"}, {"p": b"y" * 300}), timeout=1)
        g = receiver.region.geometry
        b = receiver.borrow(1.0)
        start = g.buf_offset + receiver.reader.bhead % g.buf_size
        length = layout.slot_fields(receiver.region.load(g.slot_offset(receiver.reader.shead)))[2]
        other = entry.Prepared([b"OP1", b"{}", b"z" * 300])  # shorter than c's entry
        raw = b"".join(bytes(x) for x in other.at(receiver.reader.shead, receiver.region.generation))
        assert len(raw) <= length
        mv[start: start + len(raw)] = raw
        assert b.release() is False and receiver.torn == 2
    finally:
        sender.close()
        receiver.close()


def test_release_reads_only_the_header_while_no_lock_was_ever_taken_over():
    """No take-over, so no stale sender: nothing the protocol lets write can reach a published
    entry, and release does not hash the payload again. Shown by writing into it directly (a
    write no sender can make then): the payload change goes unread, a header change is caught.
    Once a take-over has tainted the lock word, the same write is caught."""
    receiver = registry.listen(shm_address(4, 1 << 16))
    sender = registry.connect(receiver.address)
    mv, base = receiver.region.view, int(ffi.cast("uintptr_t", receiver.region.base))
    g = receiver.region.geometry

    def borrow_and_flip(payload_byte: bool) -> bool:
        sender.send(Message({"uid": "x"}, {"p": bytes(range(256)) * 4}), timeout=1)
        b = receiver.borrow(1.0)
        if payload_byte:
            p = b.message.parts["p"]
            mv[int(np.frombuffer(p, np.uint8).__array_interface__["data"][0]) - base + 100] ^= 0xFF
        else:  # the entry header's checksum word
            mv[g.buf_offset + receiver.reader.bhead % g.buf_size + 24] ^= 0xFF
        return b.release()

    try:
        assert borrow_and_flip(payload_byte=True) is True and receiver.torn == 0
        assert borrow_and_flip(payload_byte=False) is False and receiver.torn == 1
        receiver.region.store(layout.W_LOCK, layout.LOCK_TAINT)  # a take-over happened
        assert borrow_and_flip(payload_byte=True) is False and receiver.torn == 2
    finally:
        sender.close()
        receiver.close()


def test_borrow_copies_an_entry_that_wraps_and_frees_it_at_once():
    receiver = registry.listen(shm_address(8, 4096))
    sender = registry.connect(receiver.address)
    try:
        sizes = [1500, 1500, 1500]  # the third wraps around the 4096-byte buffer's end
        for i, n in enumerate(sizes):
            sender.send_frames([struct.pack("<I", i), bytes([i]) * n], timeout=1)
            loan = receiver.reader.borrow()
            assert [bytes(f) for f in loan.frames] == [struct.pack("<I", i), bytes([i]) * n]
            if i == 2:
                assert not loan.in_ring and loan.intact is True  # copied, consumed already
                assert receiver.reader.borrow() is None  # no loan outstanding
            else:
                assert loan.in_ring
            assert loan.release()
        assert receiver.reader.dropped == 0 and receiver.reader.delivered == 3
    finally:
        sender.close()
        receiver.close()


def test_recv_copies_into_a_buffer_of_its_own():
    receiver = registry.listen(shm_address(8, 1 << 16))
    sender = registry.connect(receiver.address)
    try:
        sender.send_frames([b"abc", bytes(5000)], timeout=1)
        frames = receiver.reader.poll()
        g = receiver.region.geometry
        base = int(ffi.cast("uintptr_t", receiver.region.base))
        addr = int(ffi.cast("uintptr_t", ffi.from_buffer(frames[1])))
        assert not base <= addr < base + g.region_bytes
        sender.send_frames([b"def", b"\xff" * 5000], timeout=1)  # reuses the ring's bytes...
        assert bytes(frames[1]) == bytes(5000)  # ...not the copy's
    finally:
        sender.close()
        receiver.close()


def test_large_pieces_take_the_nontemporal_copy_and_still_verify():
    """Pieces of 8 MiB and more are copied with non-temporal stores and hashed from the source
    (see _atomics_build.py): the reference reader accepts every one, wrapped or not, whatever
    the alignment of source and destination."""
    region = make_region(8, 32 << 20)
    writer, reader = RingWriter(region, fast=True), RingReader(region, fast=False)
    big = np.random.default_rng(1).integers(0, 256, (9 << 20) + 77, dtype=np.uint8)
    try:
        size, wrapped = 32 << 20, 0
        for i in range(7):
            frames = [bytes([i]) * (i + 1), big[i:]]  # another alignment each time
            before = reader.bhead
            writer.write(frames, 1.0)
            got = reader.poll()
            assert got is not None, reader.last_error
            assert bytes(got[0]) == frames[0] and np.array_equal(np.frombuffer(got[1], np.uint8), frames[1])
            wrapped += before % size + (reader.bhead - before) > size  # this entry ran over the end
        assert reader.dropped == 0 and wrapped >= 1
    finally:
        region.close()
