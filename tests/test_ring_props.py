"""Property tests of the ring buffer (issue 3): random sizes (0-byte parts, entries that exactly
fill the ring), wrap-around of the buffer and of the counters, full rings, several senders
contending with real CAS (threads, each with its own RingSender) against one receiver; and
unit tests of the layout words, the geometry, entry checksums, address options and the TCP
agent's refusal of anything outside the protocol.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
import time
import uuid

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onepiece.transport import registry
from onepiece.transport.base import Full
from onepiece.transport.ring import entry, layout
from onepiece.transport.ring.reader import RingReader
from onepiece.transport.ring.writer import TooBig

def shm_address(slots: int, nbytes: int) -> str:
    return f"shm://op-props-{os.getpid()}-{uuid.uuid4().hex[:8]}?slots={slots}&bytes={nbytes}"


def frames_for(sender: int, i: int, sizes: list[int]) -> list[bytes]:
    """A message's frames: an 8-byte id, then parts of the given sizes (deterministic bytes)."""
    out = [struct.pack("<II", sender, i)]
    for k, n in enumerate(sizes):
        out.append(bytes((sender * 31 + i * 7 + k + j) & 0xFF for j in range(n)))
    return out


def entry_total(frames: list) -> int:
    return entry.padded(entry.ENTRY_HEADER + 8 * len(frames) + sum(len(f) for f in frames))


def fit(frames: list[bytes], buf_size: int) -> list[bytes]:
    """Cut the last parts so that the entry fits in the ring (the id frame always does)."""
    while entry_total(frames) > buf_size:
        room = buf_size - entry_total(frames[:-1]) - 8
        if room >= 0:
            frames[-1] = frames[-1][:room]
        else:
            frames.pop()
    return frames


def receive(receiver, n: int, bound: float = 20.0) -> list[list[bytes]]:
    """n messages' frames, polling the receiver's own memory."""
    out = []
    deadline = time.monotonic() + bound
    while len(out) < n:
        frames = receiver.reader.poll()
        if frames is None:
            assert time.monotonic() < deadline, f"only {len(out)} of {n} messages within {bound}s"
            time.sleep(20e-6)
            continue
        out.append([bytes(f) for f in frames])
    return out


@pytest.fixture
def switchy():
    """Thread switches every 10 µs, so sender threads interleave inside the protocol."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


# --- layout -----------------------------------------------------------------------------------

@given(st.integers(0, 2 * layout.BUF_MOD), st.integers(0, 2 * layout.SEQ_MOD))
@settings(max_examples=200, deadline=None)
def test_pack_ptrs_wraps_both_counters(buf, seq):
    word = layout.pack_ptrs(buf, seq)
    assert 0 <= word < 1 << 64
    assert layout.unpack_ptrs(word) == (buf % layout.BUF_MOD, seq % layout.SEQ_MOD)


@given(st.integers(0, layout.BUF_MOD - 1), st.integers(0, 1 << 36),
       st.integers(0, layout.SEQ_MOD - 1), st.integers(0, 1 << 20))
@settings(max_examples=200, deadline=None)
def test_used_counts_survive_the_counter_wrap(bhead, bn, shead, sn):
    btail, stail = (bhead + bn) & layout.BUF_MASK, (shead + sn) & layout.SEQ_MASK
    assert layout.buf_used(btail, bhead) == bn
    assert layout.seq_used(stail, shead) == sn
    for nslots in (2, 64, layout.MAX_NSLOTS):
        # "counter mod ring size" is the same slot before and after the counter's own wrap
        assert (shead + layout.SEQ_MOD) % layout.SEQ_MOD % nslots == shead % nslots
        assert layout.lap_of(shead + layout.SEQ_MOD, nslots) == layout.lap_of(shead, nslots)


def test_counter_wrap_edges():
    assert layout.unpack_ptrs(layout.pack_ptrs(layout.BUF_MOD - 1 + 9, layout.SEQ_MOD - 1 + 2)) == (8, 1)
    assert layout.buf_used(3, layout.BUF_MOD - 5) == 8
    assert layout.seq_used(1, layout.SEQ_MOD - 1) == 2
    assert layout.lap_of(layout.SEQ_MOD - 1, 2) == (layout.SEQ_MOD // 2 - 1) & layout.LAP_MASK
    assert layout.lap_of(layout.SEQ_MOD, 2) == 0


@given(st.integers(0, layout.LAP_MASK), st.integers(0, layout.LEN_MASK))
@settings(max_examples=200, deadline=None)
def test_slot_words(lap, length):
    assert layout.slot_fields(layout.slot_busy(lap, length)) == (True, lap, length)
    assert layout.slot_fields(layout.slot_free(lap)) == (False, lap, 0)
    assert layout.slot_busy(lap, length) != layout.slot_free(lap)


@pytest.mark.parametrize("nslots,buf_size", [(0, 4096), (1, 4096), (3, 4096), (2 * layout.MAX_NSLOTS, 4096), (-4, 4096),
                                             (8, 0), (8, 32), (8, 100), (8, 2 * layout.MAX_BUF_SIZE), (8, -64)])
def test_geometry_rejects(nslots, buf_size):
    with pytest.raises(ValueError, match="power of two"):
        layout.Geometry(nslots, buf_size)


@given(st.sampled_from([2, 4, 16, 1024]), st.sampled_from([64, 256, 4096, 1 << 20]),
       st.integers(0, 2 * layout.BUF_MOD), st.data())
@settings(max_examples=100, deadline=None)
def test_geometry_spans(nslots, buf_size, counter, data):
    g = layout.Geometry(nslots, buf_size)
    assert g.slots_offset == layout.HEADER_BYTES and g.buf_offset % 64 == 0
    assert g.buf_offset >= g.slots_offset + 8 * nslots and g.region_bytes == g.buf_offset + buf_size
    length = data.draw(st.integers(0, buf_size))
    spans = g.spans(counter, length)
    assert sum(n for _, n in spans) == length and 1 <= len(spans) <= 2
    assert spans[0][0] == g.buf_offset + counter % buf_size
    for off, n in spans:
        assert g.buf_offset <= off and off + n <= g.region_bytes
    if len(spans) == 2:
        assert spans[0][0] + spans[0][1] == g.region_bytes and spans[1][0] == g.buf_offset


# --- entries ----------------------------------------------------------------------------------

def build_entry(frames: list, seq: int, gen: int) -> bytearray:
    prepared = entry.Prepared(frames)
    raw = bytearray(b"".join(bytes(p) for p in prepared.at(seq, gen)))
    raw += bytes(prepared.total - len(raw))  # the padding a ring slot holds
    return raw


parts = st.lists(st.binary(min_size=0, max_size=40), min_size=0, max_size=4)


@given(parts, st.integers(0, layout.SEQ_MASK), st.integers(1, 2**63), st.data())
@settings(max_examples=300, deadline=None)
def test_entry_rejects_every_single_byte_corruption(frames, seq, gen, data):
    raw = build_entry(frames, seq, gen)
    assert [bytes(f) for f in entry.parse(memoryview(raw), seq, gen)] == frames
    covered = entry.ENTRY_HEADER + 8 * len(frames) + sum(map(len, frames))  # header + payload
    pos = data.draw(st.integers(0, covered - 1), label="byte")
    bad = bytearray(raw)
    bad[pos] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(entry.EntryError):
        entry.parse(memoryview(bad), seq, gen)


@given(parts, st.integers(0, layout.SEQ_MASK - 1), st.integers(1, 2**62))
@settings(max_examples=100, deadline=None)
def test_entry_is_bound_to_its_counter_and_generation(frames, seq, gen):
    raw = memoryview(build_entry(frames, seq, gen))
    with pytest.raises(entry.EntryError):
        entry.parse(raw, seq + 1, gen)
    with pytest.raises(entry.EntryError):
        entry.parse(raw, seq, gen + 1)
    with pytest.raises(entry.EntryError):  # the slot says another length
        entry.parse(memoryview(bytes(raw) + bytes(8)), seq, gen)


# --- the protocol, through the shm backend ---------------------------------------------------

message = st.lists(st.sampled_from([0, 0, 1, 7, 8, 9, 63, 200, 700]), min_size=0, max_size=3)


@given(nslots=st.sampled_from([2, 4, 8]), buf_size=st.sampled_from([256, 512, 1024]),
       per_sender=st.lists(st.lists(message, min_size=0, max_size=25), min_size=1, max_size=4),
       fill=st.booleans())
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # switchy is stateless
def test_senders_interleave_fifo_no_loss_no_dup_exact_bytes(switchy, nslots, buf_size, per_sender, fill):
    """Several sender threads (each its own RingSender: real CAS contention on the lock, the
    tails and the slots) and one receiver, through a small ring that wraps and fills often.
    Parts too big for the ring are cut; with ``fill`` each sender's first message exactly
    fills the ring."""
    msgs = []
    for s, specs in enumerate(per_sender):
        mine = []
        for i, sizes in enumerate(specs):
            mine.append(fit(frames_for(s, i, sizes), buf_size))
        if fill:
            room = buf_size - entry.ENTRY_HEADER - 16 - 8
            mine.insert(0, [struct.pack("<II", s, 1 << 30), bytes([s]) * room])
            assert entry_total(mine[0]) == buf_size
        msgs.append(mine)
    receiver = registry.listen(shm_address(nslots, buf_size))
    errors: list[BaseException] = []

    def run(mine):
        sender = registry.connect(receiver.address)
        try:
            for frames in mine:
                sender.send_frames(frames, timeout=10.0)
        except BaseException as e:  # reported below
            errors.append(e)
        finally:
            sender.close()

    threads = [threading.Thread(target=run, args=(mine,), daemon=True) for mine in msgs]
    try:
        for t in threads:
            t.start()
        got = receive(receiver, sum(map(len, msgs)))
        for t in threads:
            t.join(timeout=10)
        assert not errors, errors
        assert receiver.reader.poll() is None and receiver.reader.dropped == 0
    finally:
        receiver.close()
    by_sender: dict[int, list[list[bytes]]] = {}
    for frames in got:
        s, _ = struct.unpack("<II", frames[0])
        by_sender.setdefault(s, []).append(frames)
    for s, mine in enumerate(msgs):
        # FIFO per sender, nothing lost, nothing twice, every byte as sent
        assert by_sender.get(s, []) == [[bytes(f) for f in frames] for frames in mine]


def test_entry_that_exactly_fills_the_ring_at_every_offset():
    receiver = registry.listen(shm_address(4, 256))
    sender = registry.connect(receiver.address)
    try:
        exact = [b"x" * (256 - entry.ENTRY_HEADER - 8)]
        assert entry_total(exact) == 256
        with pytest.raises(TooBig):
            sender.send_frames([b"x" * (257 - entry.ENTRY_HEADER - 8)], timeout=0.1)
        positions = []
        for shift in (0, 32, 40, 200, 248):  # move the start, so the full entry wraps
            if shift:
                small = [] if shift == 32 else [bytes(shift - entry.ENTRY_HEADER - 8)]
                assert entry_total(small) == shift
                sender.send_frames(small, timeout=1)
                assert receive(receiver, 1) == [small]
            positions.append(layout.unpack_ptrs(receiver.region.load(layout.W_TAILS))[0] % 256)
            sender.send_frames(exact, timeout=1)
            with pytest.raises(Full):  # not one byte more
                sender.send_frames([], timeout=0.05)
            assert receive(receiver, 1) == [exact]
        assert positions == [0, 32, 72, 16, 8], positions
        assert receiver.reader.dropped == 0
    finally:
        sender.close()
        receiver.close()


@given(sizes=st.lists(st.integers(0, 600), min_size=1, max_size=40), nslots=st.sampled_from([2, 4, 8]))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_full_reports_then_succeeds_after_draining(sizes, nslots):
    """A sender that finds no room reports Full within its short timeout; once the receiver
    has drained, the same send succeeds; nothing sent is lost or altered on the way."""
    receiver = registry.listen(shm_address(nslots, 1024))
    sender = registry.connect(receiver.address)
    sent, got = [], []
    try:
        for i, n in enumerate(sizes):
            frames = [struct.pack("<II", 0, i), bytes([i & 0xFF]) * n]
            t0 = time.monotonic()
            try:
                sender.send_frames(frames, timeout=0.05)
            except Full:
                assert time.monotonic() - t0 < 1.0
                bt, st_ = layout.unpack_ptrs(receiver.region.load(layout.W_TAILS))
                bh, sh = layout.unpack_ptrs(receiver.region.load(layout.W_HEADS))
                # really full: every slot taken, or not enough bytes left for this entry
                assert layout.seq_used(st_, sh) == nslots or layout.buf_used(bt, bh) + entry_total(frames) > 1024
                got += receive(receiver, len(sent) - len(got))  # drain everything
                sender.send_frames(frames, timeout=0.05)  # now it fits
            sent.append(frames)
        got += receive(receiver, len(sent) - len(got))
    finally:
        sender.close()
        receiver.close()
    assert got == sent


def test_full_on_slots_and_on_bytes():
    receiver = registry.listen(shm_address(4, 1024))
    sender = registry.connect(receiver.address)
    try:
        for _ in range(4):
            sender.send_frames([], timeout=0.1)
        with pytest.raises(Full):  # every size slot taken, bytes to spare
            sender.send_frames([], timeout=0.05)
        assert len(receive(receiver, 4)) == 4
        sender.send_frames([bytes(600)], timeout=0.1)
        with pytest.raises(Full):  # slots to spare, not the bytes
            sender.send_frames([bytes(600)], timeout=0.05)
        assert receive(receiver, 1) == [[bytes(600)]]
        sender.send_frames([bytes(600)], timeout=0.1)
        assert receive(receiver, 1) == [[bytes(600)]]
    finally:
        sender.close()
        receiver.close()


@given(sizes=st.lists(st.integers(0, 250), min_size=20, max_size=80))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_counters_wrap_in_use(sizes):
    """Start the ring's counters just below 2**40 (bytes) and 2**24 (entries): messages flow
    across both counters' wrap, as across the buffer's end."""
    nslots = 8
    receiver = registry.listen(shm_address(nslots, 1024))
    region = receiver.region
    btail, stail = layout.BUF_MOD - 700, layout.SEQ_MOD - 5
    for s in range(stail, stail + nslots):  # the slots a ring there would have: free, this lap
        region.store(region.geometry.slot_offset(s), layout.slot_free(layout.lap_of(s & layout.SEQ_MASK, nslots)))
    region.store(layout.W_TAILS, layout.pack_ptrs(btail, stail))
    region.store(layout.W_HEADS, layout.pack_ptrs(btail, stail))
    receiver.reader = RingReader(region)
    sender = registry.connect(receiver.address)
    try:
        sent = []
        for i, n in enumerate(sizes):
            frames = [struct.pack("<II", 0, i), bytes([i & 0xFF]) * n]
            sender.send_frames(frames, timeout=0.5)  # 3 entries of <= 312 bytes always fit
            sent.append(frames)
            if i % 3 == 2:
                assert receive(receiver, 3) == sent[-3:]
        rest = len(sent) % 3
        if rest:
            assert receive(receiver, rest) == sent[-rest:]
        tails = layout.unpack_ptrs(region.load(layout.W_TAILS))
        assert tails[1] == len(sizes) - 5 and tails[0] < btail, tails  # both counters wrapped
        assert tails == layout.unpack_ptrs(region.load(layout.W_HEADS))
        assert receiver.reader.dropped == 0
    finally:
        sender.close()
        receiver.close()


# --- addresses --------------------------------------------------------------------------------

@pytest.mark.parametrize("address,what", [
    ("shm://ok?slots=3", "power of two"),
    ("shm://ok?slots=0", "power of two"),
    ("shm://ok?bytes=100", "power of two"),
    ("shm://ok?bytes=32", "power of two"),
    ("shm://ok?slots=8&colour=red", "unknown ring option"),
    ("shm://ok?slots=eight", "invalid literal"),
    ("shm://ok?slots", "bad query field"),
    ("shm://ok?slots=", "slots"),
    ("shm://ok?slots=8&bytes=", "bytes"),
    ("shm://not/a/name?slots=8", "shm ring name"),
    ("ring+tcp://127.0.0.1:0?slots=5", "power of two"),
    ("ring+tcp://127.0.0.1:0?bytes=lots", "invalid literal"),
    ("ring+tcp://127.0.0.1:0?slot=8", "unknown ring option"),
])
def test_bad_address_options(address, what):
    for make in (registry.listen, registry.connect):
        with pytest.raises(ValueError, match=what):
            make(address)


# --- the TCP agent ----------------------------------------------------------------------------

U64 = struct.Struct("<Q")


def test_agent_refuses_what_the_protocol_does_not_allow():
    receiver = registry.listen("ring+tcp://127.0.0.1:0?slots=8&bytes=4096")
    g, gen = receiver.region.geometry, receiver.region.generation
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(receiver.address.replace("ring+tcp://", "tcp://"))
    rid = 0

    def call(*frames: bytes) -> tuple[bytes, bytes]:
        nonlocal rid
        rid += 1
        sock.send_multipart([U64.pack(rid), *frames])
        assert sock.poll(3000), f"no reply to {frames!r}"
        reply = sock.recv_multipart()
        assert reply[0] == U64.pack(rid) and len(reply) == 3, reply
        return reply[1], reply[2]

    def q(*words: int) -> bytes:
        return struct.pack(f"<{len(words)}Q", *words)

    slots_end = g.slots_offset + 8 * g.nslots
    refused = {
        "write into the header": (b"W", q(gen, 0), b"x" * 8),
        "write the lock word": (b"W", q(gen, layout.W_LOCK), q(1)),
        "write the tails word": (b"W", q(gen, layout.W_TAILS), q(1)),
        "write a size slot": (b"W", q(gen, g.slots_offset), q(layout.BUSY)),
        "write just before the buffer": (b"W", q(gen, g.buf_offset - 8), b"x" * 16),
        "write past the buffer's end": (b"W", q(gen, g.region_bytes - 8), b"x" * 16),
        "write far outside": (b"W", q(gen, 1 << 40), b"x"),
        "more offsets than frames": (b"W", q(gen, g.buf_offset, g.buf_offset + 8), b"x"),
        "write args not in words": (b"W", q(gen) + b"\x01\x02", b"x"),
        "CAS the magic": (b"C", q(gen, layout.W_MAGIC, layout.MAGIC, 0)),
        "CAS the generation": (b"C", q(gen, layout.W_GEN, gen, 1)),
        "CAS the state": (b"C", q(gen, layout.W_STATE, layout.OPEN, layout.CLOSED)),
        "CAS the geometry": (b"C", q(gen, layout.W_NSLOTS, g.nslots, 1 << 20)),
        "CAS the heads": (b"C", q(gen, layout.W_HEADS, 0, 5)),
        "CAS a misaligned slot": (b"C", q(gen, g.slots_offset + 4, 0, 1)),
        "CAS past the slots": (b"C", q(gen, slots_end, 0, 1)),
        "CAS in the buffer": (b"C", q(gen, g.buf_offset, 0, 1)),
        "CAS with short args": (b"C", q(gen, layout.W_LOCK, 0)),
        "load too many words": (b"L", q(gen, 0, 65)),
        "load past the region": (b"L", q(gen, g.region_bytes, 1)),
        "load misaligned": (b"L", q(gen, 4, 1)),
        "read past the region": (b"R", q(gen, g.region_bytes - 4, 8)),
        "read too much": (b"R", q(gen, 0, 1 << 40)),
        "unknown op": (b"Z", q(gen)),
        "empty op": (b"", q(gen)),
        "op without arguments": (b"L",),
        "nothing but an id": (),
        "args too short for the generation": (b"L", b"\x01"),
    }
    try:
        status, body = call(b"H", b"")
        assert status == b"K" and struct.unpack("<QQQ", body) == (g.nslots, g.buf_size, gen)
        before = bytes(receiver.region.view)
        for what, frames in refused.items():
            status, body = call(*frames)
            assert status == b"E" and body, f"{what}: {status!r} {body!r}"
            assert call(b"H", b"")[0] == b"K", f"the agent stopped serving after: {what}"
        assert bytes(receiver.region.view) == before, "a refused request changed the region"
        # a stale generation is told apart from a refusal
        assert call(b"L", q(gen + 1, 0, 1)) == (b"G", b"")
        # what the protocol does use still works: CAS of the lock / tails / a slot that does
        # not match changes nothing and returns the word; loads and writes in the buffer
        for off in (layout.W_LOCK, layout.W_TAILS, g.slots_offset, slots_end - 8):
            status, body = call(b"C", q(gen, off, 12345, 6789))
            assert status == b"K" and U64.unpack(body)[0] == receiver.region.load(off)
        assert call(b"W", q(gen, g.buf_offset, g.region_bytes - 3), b"abc", b"xyz") == (b"K", b"")
        assert call(b"R", q(gen, g.region_bytes - 3, 3)) == (b"K", b"xyz")
        assert call(b"L", q(gen, layout.W_MAGIC, 1)) == (b"K", q(layout.MAGIC))
        # and a real sender still gets through
        sender = registry.connect(receiver.address)
        try:
            sender.send_frames([b"after", b""], timeout=2)
        finally:
            sender.close()
        assert receive(receiver, 1) == [[b"after", b""]]
    finally:
        sock.close(linger=0)
        receiver.close()
