"""``rdma://``: the ring over RDMA verbs.

Three kinds of test: (a) the scheme is registered and, where pyverbs or a device is missing,
listen/connect fail at once with a reason that says how to get one; (b) the queue-pair exchange
over the agent's real ZMQ control socket, with a stand-in for the verbs work, so everything but
the NIC runs here; (c) end to end between processes on a real device (or soft-RoCE), skipped
with ``rdma_available()``'s reason where there is none.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import subprocess
import sys
import textwrap
import time
import types

import pytest
import zmq

from onepiece.transport import registry
from onepiece.transport.base import TransportError
from onepiece.transport.ring import layout, rdma
from onepiece.transport.ring.agent import Agent, AgentRegion, Refused
from onepiece.transport.ring.region import MappedRegion, PeerGone
from waiting import wait_for

NO_RDMA = rdma.rdma_available()


# --- (a) registration and a clear failure without pyverbs or a device ------------------------------
def test_rdma_scheme_is_registered():
    registry._load_builtin()
    assert "rdma" in registry._senders and "rdma" in registry._receivers


@pytest.mark.skipif(NO_RDMA is None, reason="an RDMA device is present: listen/connect work here")
@pytest.mark.parametrize("call", [registry.listen, registry.connect])
def test_without_rdma_listen_and_connect_fail_with_the_reason(call):
    with pytest.raises(rdma.RdmaUnavailable) as err:
        call("rdma://127.0.0.1:0?slots=16&bytes=4096")
    assert isinstance(err.value, TransportError) and isinstance(err.value, ValueError)
    text = str(err.value)
    assert "rdma:// transport is not usable here" in text and NO_RDMA in text
    if "not importable" in NO_RDMA:  # how to install it is part of the message
        assert "python3-pyverbs" in text and "--system-site-packages" in text
    else:
        assert "RDMA device" in text


def _fake_pyverbs(monkeypatch, devices):
    """A stand-in ``pyverbs`` whose get_device_list() returns ``devices`` or raises it."""
    err = types.ModuleType("pyverbs.pyverbs_error")

    class PyverbsError(Exception):
        pass

    class PyverbsRDMAError(PyverbsError):
        pass

    err.PyverbsError, err.PyverbsRDMAError = PyverbsError, PyverbsRDMAError
    dev = types.ModuleType("pyverbs.device")

    def get_device_list():
        if devices is None:
            raise PyverbsRDMAError("Failed to get devices list")
        return [types.SimpleNamespace(name=n.encode()) for n in devices]

    dev.get_device_list = get_device_list
    pkg = types.ModuleType("pyverbs")
    pkg.__path__ = []
    pkg.device, pkg.pyverbs_error = dev, err
    for name, mod in (("pyverbs", pkg), ("pyverbs.device", dev), ("pyverbs.pyverbs_error", err)):
        monkeypatch.setitem(sys.modules, name, mod)


def test_rdma_available_reasons(monkeypatch):
    _fake_pyverbs(monkeypatch, None)  # what rdma-core does with no device
    assert "get_device_list() failed" in rdma.rdma_available()
    _fake_pyverbs(monkeypatch, [])
    assert "is empty" in rdma.rdma_available()
    _fake_pyverbs(monkeypatch, ["mlx5_0"])
    assert rdma.rdma_available() is None
    assert rdma.rdma_available("mlx5_0") is None
    assert "no RDMA device named 'mlx5_9'" in rdma.rdma_available("mlx5_9")
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # import fails
    monkeypatch.setitem(sys.modules, "pyverbs.device", None)
    assert "pyverbs is not importable" in rdma.rdma_available()


def test_address_options(monkeypatch):
    for var in ("DEV", "PORT", "GID"):
        monkeypatch.delenv(f"ONEPIECE_RDMA_{var}", raising=False)
    where, plain, g, opts = rdma.parse_rdma_address("rdma://10.0.0.5:7100?slots=16&bytes=4096&dev=mlx5_1&port=2&gid=3")
    assert (where, plain) == ("10.0.0.5:7100", "rdma://10.0.0.5:7100")
    assert (g.nslots, g.buf_size) == (16, 4096)
    assert opts == rdma.Options("mlx5_1", 2, 3)
    _, _, g, opts = rdma.parse_rdma_address("rdma://h:1")
    assert opts == rdma.Options(None, 1, 0) and g == rdma.parse_address("shm://x")[2]
    monkeypatch.setenv("ONEPIECE_RDMA_DEV", "rxe0")
    monkeypatch.setenv("ONEPIECE_RDMA_GID", "1")
    assert rdma.parse_rdma_address("rdma://h:1")[3] == rdma.Options("rxe0", 1, 1)
    assert rdma.parse_rdma_address("rdma://h:1?dev=mlx5_0")[3].dev == "mlx5_0"  # the address wins
    for bad, why in [("rdma://h:1?color=red", "unknown rdma option"), ("rdma://h:1?port=x", "integers"),
                     ("rdma://h:1?port=0", r"port must be in \[1, 255\]"), ("rdma://h:1?dev=a/b", "device name"),
                     ("rdma://h:1?slots=3", "power of two")]:
        with pytest.raises(ValueError, match=why):
            rdma.parse_rdma_address(bad)


# --- (b) the queue-pair exchange through the agent, no device -----------------------------------
GID = bytes.fromhex("fe800000000000000211223344556677")


class FakeResponder:
    """Stands in for the verbs work: hands out queue-pair numbers, records what it was asked."""

    addr, rkey = 0x7F0000001000, 0xABCD

    def __init__(self) -> None:
        self.accepted: list[rdma.QpInfo] = []
        self.dropped: list[int] = []
        self.fail: str | None = None

    def accept(self, peer):
        if self.fail:
            raise RuntimeError(self.fail)  # e.g. a PyverbsRDMAError from modify_qp
        self.accepted.append(peer)
        return rdma.QpInfo(0x100 + len(self.accepted), 0x123456, 7, 3, GID), 0x7F0000900000, 0x5151

    def drop(self, qp_num):
        self.dropped.append(qp_num)


@pytest.fixture
def served():
    geometry = layout.Geometry(16, 4096)
    region = MappedRegion(mmap.mmap(-1, geometry.region_bytes))
    region.init(geometry, time.time_ns())
    responder = FakeResponder()
    agent = Agent(region, "tcp://127.0.0.1:0", extra_ops=rdma.QpService(region, responder).ops())
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(agent.endpoint)
    rid = [0]

    def call(op: bytes, args: bytes) -> tuple[bytes, bytes]:
        rid[0] += 1
        sock.send_multipart([struct.pack("<Q", rid[0]), op, args])
        assert sock.poll(2000), "the agent stopped answering"
        got_rid, status, body = sock.recv_multipart()
        assert got_rid == struct.pack("<Q", rid[0])
        return status, body

    yield types.SimpleNamespace(region=region, responder=responder, agent=agent, call=call)
    sock.close(0)
    agent.close()
    region.close()


def test_qp_exchange_reply(served):
    mine = rdma.QpInfo(qp_num=0x4242, psn=0xABCDEF, lid=0, mtu=5, gid=GID)
    status, body = served.call(b"Q", mine.pack())
    assert status == b"K"
    grant = rdma.Grant.unpack(body)
    assert served.responder.accepted == [mine]
    g = served.region.geometry
    assert grant.qp == rdma.QpInfo(0x101, 0x123456, 7, 3, GID)
    assert (grant.addr, grant.rkey, grant.length) == (FakeResponder.addr, FakeResponder.rkey, g.region_bytes)
    assert (grant.probe_addr, grant.probe_rkey) == (0x7F0000900000, 0x5151)
    assert (grant.nslots, grant.buf_size, grant.generation) == (g.nslots, g.buf_size, served.region.generation)
    assert grant.qp.gid_str == "fe80:0000:0000:0000:0211:2233:4455:6677"
    assert served.call(b"B", struct.pack("<Q", 0x101)) == (b"K", b"")
    assert served.responder.dropped == [0x101]


@pytest.mark.parametrize("args, why", [
    (b"", "27 bytes, got 0"),
    (rdma.QpInfo(0x10, 1, 0, 3, GID).pack()[:-1], "27 bytes, got 26"),
    (rdma.QpInfo(0x10, 1, 0, 3, GID).pack() + b"x", "27 bytes, got 28"),
    (rdma.QpInfo(0, 1, 0, 3, GID).pack(), "qp_num 0"),
    (rdma.QpInfo(1, 1, 0, 3, GID).pack(), "qp_num 1"),
    (rdma.QpInfo(1 << 24, 1, 0, 3, GID).pack(), "24-bit"),
    (rdma.QpInfo(0x10, 1 << 24, 0, 3, GID).pack(), "psn"),
    (rdma.QpInfo(0x10, 1, 0, 0, GID).pack(), "path mtu 0"),
    (rdma.QpInfo(0x10, 1, 0, 6, GID).pack(), "path mtu 6"),
])
def test_bad_qp_details_are_refused_and_the_agent_keeps_serving(served, args, why):
    status, body = served.call(b"Q", args)
    assert status == b"E" and why in body.decode()
    assert served.responder.accepted == []
    status, body = served.call(b"H", b"")  # still serving: hello, then a good exchange
    assert status == b"K" and struct.unpack("<QQQ", body)[2] == served.region.generation
    assert served.call(b"Q", rdma.QpInfo(0x10, 1, 0, 3, GID).pack())[0] == b"K"


def test_a_verbs_failure_is_an_error_reply(served):
    served.responder.fail = "Failed to modify QP state to RTR. Errno: 22, Invalid argument"
    status, body = served.call(b"Q", rdma.QpInfo(0x10, 1, 0, 3, GID).pack())
    assert status == b"E" and b"queue-pair setup failed: Failed to modify QP state to RTR" in body
    served.responder.fail = None
    assert served.call(b"Q", rdma.QpInfo(0x10, 1, 0, 3, GID).pack())[0] == b"K"
    assert served.call(b"B", b"\x01")[0] == b"E"  # bye takes a u64


def test_cpu_writes_and_cas_are_refused_but_reads_are_served(served):
    control = AgentRegion(served.agent.endpoint, op_timeout=1.0)
    try:
        assert control.read_words(layout.W_MAGIC, 1) == [layout.MAGIC]
        with pytest.raises(Refused, match="over RDMA only"):
            control.cas(layout.W_LOCK, 0, 1)
        with pytest.raises(Refused, match="over RDMA only"):
            control.write([(served.region.geometry.buf_offset, b"x" * 8)])
        assert served.region.load(layout.W_LOCK) == 0
    finally:
        control.close()


def test_sender_side_of_the_exchange(served):
    """What RdmaRegion does before touching its NIC: hello, then Q, checked against the hello."""
    control = AgentRegion(served.agent.endpoint, op_timeout=1.0)
    try:
        mine = rdma.QpInfo(0x77, 5, 0, 3, GID)
        grant = rdma.request_grant(control, mine)
        assert grant.qp.qp_num == 0x101 and served.responder.accepted == [mine]
        control.generation += 1  # as if the receiver were replaced between hello and Q
        with pytest.raises(PeerGone, match="new receiver"):
            rdma.request_grant(control, mine)
        control.generation -= 1
        served.responder.fail = "no more QPs"
        with pytest.raises(PeerGone, match="no more QPs"):  # Refused: the sender retries, then Full
            rdma.request_grant(control, mine)
    finally:
        control.close()


# --- (b') the whole backend over a software NIC, no device -------------------------------------
class FakeNic:
    """A stand-in for pyverbs and the NIC behind it, in this process: work requests act on real
    memory at the addresses the backend registered (remote = the receiver's mapped region), with
    the checks a NIC makes (keys, bounds) and completions on the CQ. ``reply_be`` hands atomic
    results back big-endian (ConnectX on x86); ``swapped`` reads memory big-endian for atomics."""

    SUCCESS, REMOTE_ACCESS = 0, 10

    def __init__(self) -> None:
        self.mrs: dict[int, tuple[int, int]] = {}
        self.qps: dict[int, object] = {}
        self.keys = iter(range(0x100, 1 << 30))
        self.qpns = iter(range(0x10, 1 << 24))
        self.reply_be = self.swapped = self.stall = False
        self.fail_next: int | None = None
        self.posted = {"write": 0, "read": 0, "cas": 0}

    def pyverbs(self) -> types.SimpleNamespace:
        from onepiece.transport.ring._atomics import ffi, lib

        nic = self

        class Error(Exception):
            pass

        class Bag(types.SimpleNamespace):
            def close(self):
                pass

        class Context(Bag):
            def query_device(self):
                return Bag(atomic_caps=1)

            def query_port(self, port):
                return Bag(state=4, lid=0, active_mtu=5)

            def query_gid(self, port, index):
                return Bag(gid="fe80:0000:0000:0000:0211:2233:4455:6677")

        class MR:
            def __init__(self, pd, length, access, address=None):
                if address is None:
                    self._mem = mmap.mmap(-1, max(length, 8))
                    self._ptr = ffi.from_buffer(self._mem)
                    address = int(ffi.cast("uintptr_t", self._ptr))
                self.buf, self.length = address, length
                self.lkey = self.rkey = next(nic.keys)
                nic.mrs[self.lkey] = (address, length)

            def close(self):
                nic.mrs.pop(self.lkey, None)

        class CQ:
            def __init__(self, ctx, cqe):
                self.wcs: list = []

            def poll(self, n):
                out, self.wcs = self.wcs[:n], self.wcs[n:]
                return len(out), out

            def close(self):
                pass

        class SendWR:
            def __init__(self, opcode, num_sge, sg, send_flags):
                self.opcode, self.sge, self.send_flags = opcode, sg[0], send_flags

            def set_wr_rdma(self, rkey, addr):
                self.rkey, self.raddr = rkey, addr

            def set_wr_atomic(self, rkey, addr, compare_add, swap):
                self.rkey, self.raddr, self.compare, self.swap = rkey, addr, compare_add, swap

        def covers(key, addr, n):
            base, length = nic.mrs.get(key, (0, -1))
            return base <= addr and addr + n <= base + length

        class QP:
            def __init__(self, pd, init, attr):
                self.qp_num, self.cq = next(nic.qpns), init.scq
                nic.qps[self.qp_num] = self

            def to_rts(self, attr):
                self.dest = attr.dest_qp_num

            def post_send(self, wr):
                if nic.stall:
                    return
                status, n = nic.fail_next or nic.SUCCESS, wr.sge.length
                nic.fail_next = None
                if status == nic.SUCCESS and not (covers(wr.sge.lkey, wr.sge.addr, n) and covers(wr.rkey, wr.raddr, n)):
                    status = nic.REMOTE_ACCESS
                if status == nic.SUCCESS:
                    local, remote = ffi.cast("char *", wr.sge.addr), ffi.cast("char *", wr.raddr)
                    if wr.opcode == 0:  # IBV_WR_RDMA_WRITE
                        ffi.memmove(remote, local, n)
                        nic.posted["write"] += 1
                    elif wr.opcode == 4:  # IBV_WR_RDMA_READ
                        ffi.memmove(local, remote, n)
                        nic.posted["read"] += 1
                    else:  # IBV_WR_ATOMIC_CMP_AND_SWP
                        conv = rdma._bswap if nic.swapped else (lambda w: w)
                        found = conv(lib.ring_cas(remote, 0, conv(wr.compare), conv(wr.swap)))
                        ffi.memmove(local, found.to_bytes(8, "big" if nic.reply_be else "little"), 8)
                        nic.posted["cas"] += 1
                self.cq.wcs.append(Bag(status=status, vendor_err=0))

            def close(self):
                nic.qps.pop(self.qp_num, None)

        return types.SimpleNamespace(
            Context=Context, get_device_list=lambda: [Bag(name=b"fake0")], PD=lambda ctx: Bag(ctx=ctx), MR=MR, CQ=CQ, QP=QP,
            QPInitAttr=Bag, QPAttr=Bag, QPCap=Bag, SGE=lambda addr, length, lkey: Bag(addr=addr, length=length, lkey=lkey),
            SendWR=SendWR, GID=lambda s: Bag(gid=s), GlobalRoute=Bag, AHAttr=Bag, Error=Error,
            IBV_QPT_RC=2, IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_READ=4, IBV_ACCESS_REMOTE_WRITE=2,
            IBV_ACCESS_REMOTE_ATOMIC=8, IBV_WR_RDMA_WRITE=0, IBV_WR_RDMA_READ=4, IBV_WR_ATOMIC_CMP_AND_SWP=5,
            IBV_SEND_SIGNALED=2, IBV_WC_SUCCESS=0, IBV_PORT_ACTIVE=4, IBV_ATOMIC_NONE=0)


@pytest.fixture
def nic(monkeypatch):
    nic = FakeNic()
    monkeypatch.setattr(rdma, "_pv", nic.pyverbs())
    monkeypatch.setattr(rdma, "rdma_available", lambda dev=None: None)
    return nic


def _pump(tx, rx, count: int, size, batch: int = 5) -> None:
    """Send ``count`` messages in batches (so the ring fills and wraps), draining in between."""
    from onepiece.transport.message import Message

    sent = 0
    while sent < count:
        n = min(batch, count - sent)
        for i in range(sent, sent + n):
            tx.send(Message({"uid": f"m{i}", "i": i}, {"x": bytes([i % 251]) * size(i)}), timeout=5)
        for i in range(sent, sent + n):
            got = rx.recv(timeout=2)
            assert got is not None and got.header["i"] == i
            assert got.blob("x") == bytes([i % 251]) * size(i)
        sent += n


@pytest.mark.parametrize("mode", ["host", "reply_be", "swapped"])
def test_ring_over_a_software_nic(nic, mode):
    nic.reply_be, nic.swapped = mode == "reply_be", mode == "swapped"
    rx = registry.listen("rdma://127.0.0.1:0?slots=16&bytes=4096")
    tx = registry.connect(rx.address)
    try:
        assert rx.address.startswith("rdma://127.0.0.1:")
        _pump(tx, rx, 300, lambda i: 1 + (i * 389) % 700)
        region = tx.writer.region
        assert isinstance(region, rdma.RdmaRegion)
        # a NIC reading memory big-endian also hands back the value found in that reading
        assert (region._swap_operands, region._swap_reply) == (mode == "swapped", mode != "host")
        assert rx.reader.bhead > 20 * 4096 and rx.rejected == 0  # wrapped many times, nothing dropped
        assert set(rx.responder.peers) == {region._peer_qp}
        assert nic.posted["cas"] >= 3 * 300 and nic.posted["read"] >= 300
        wraps = rx.reader.bhead // 4096 + 1  # one work request per entry, two where it wraps, + the probe
        assert nic.posted["write"] <= 300 + wraps + 1
    finally:
        tx.close()
        wait_for(lambda: rx.responder.peers == {}, 5, "the sender's goodbye")  # its QP is gone
        rx.close()
    assert nic.mrs == {}  # every registration undone


def test_large_messages_go_through_a_small_staging_buffer(nic, monkeypatch):
    monkeypatch.setattr(rdma, "STAGING_MAX", mmap.PAGESIZE)
    rx = registry.listen("rdma://127.0.0.1:0?slots=16&bytes=65536")
    tx = registry.connect(rx.address)
    try:
        _pump(tx, rx, 20, lambda i: 9000 + 1000 * i, batch=2)
        assert nic.posted["write"] >= 20 * 9000 // mmap.PAGESIZE
    finally:
        tx.close()
        rx.close()


def test_a_failed_completion_reattaches_with_a_new_queue_pair(nic):
    rx = registry.listen("rdma://127.0.0.1:0?slots=16&bytes=4096")
    tx = registry.connect(rx.address)
    try:
        _pump(tx, rx, 3, lambda i: 100)
        first = tx.writer.region.qp.qp_num
        nic.fail_next = 12  # transport retry exceeded, on the lock CAS of the next send
        _pump(tx, rx, 3, lambda i: 100)  # delivered, each once, after attaching again
        assert tx.writer.region.qp.qp_num != first
        wait_for(lambda: set(rx.responder.peers) == {tx.writer.region._peer_qp}, 5,
                 "the broken queue pair's goodbye")
    finally:
        tx.close()
        rx.close()


def test_no_completion_is_peer_gone_within_the_op_timeout(nic):
    rx = registry.listen("rdma://127.0.0.1:0?slots=16&bytes=4096")
    region = rdma.RdmaRegion(rx.address.replace("rdma://", "tcp://"), op_timeout=0.2)
    try:
        assert region.read_words(layout.W_MAGIC, 2) == [layout.MAGIC, rx.region.generation]
        assert region.cas(layout.W_LOCK, 0, 5) == 0 and rx.region.load(layout.W_LOCK) == 5
        nic.stall = True
        t0 = time.monotonic()
        with pytest.raises(PeerGone, match="no completion within 0.2s"):
            region.cas(layout.W_LOCK, 5, 0)
        assert time.monotonic() - t0 < 1
        nic.stall = False
        with pytest.raises(PeerGone, match="no completion"):  # the QP stays unusable
            region.read_words(layout.W_MAGIC, 1)
        with pytest.raises(IndexError):
            region.cas(layout.W_LOCK + 1, 0, 0)
    finally:
        region.close()
        rx.close()


def test_a_bad_rkey_is_a_remote_access_error(nic):
    rx = registry.listen("rdma://127.0.0.1:0?slots=16&bytes=4096")
    region = rdma.RdmaRegion(rx.address.replace("rdma://", "tcp://"), op_timeout=0.5)
    try:
        region.rkey += 1
        with pytest.raises(PeerGone, match=r"status 10 \(remote access error"):
            region.read_words(layout.W_MAGIC, 1)
    finally:
        region.close()
        rx.close()


# --- (c) end to end on a real device -------------------------------------------------------------
RECEIVER = textwrap.dedent("""
    import hashlib, json, sys
    from onepiece.transport import registry
    rx = registry.listen(sys.argv[1])
    print(json.dumps({"address": rx.address}), flush=True)
    expected, got = int(sys.argv[2]), []
    while len(got) < expected:
        msg = rx.recv(timeout=20)
        if msg is None:
            break
        got.append([msg.header["sender"], msg.header["i"], hashlib.sha256(msg.blob("x")).hexdigest()])
    print(json.dumps({"got": got, "rejected": rx.rejected, "bytes": rx.reader.bhead}), flush=True)
    rx.close()
""")
SENDER = textwrap.dedent("""
    import sys
    from onepiece.transport import registry
    from onepiece.transport.message import Message
    tx = registry.connect(sys.argv[1])
    name, count = sys.argv[2], int(sys.argv[3])
    for i in range(count):
        size = 1 + (i * 389) % 1500
        tx.send(Message({"uid": f"{name}-{i}", "sender": name, "i": i}, {"x": bytes([i % 251]) * size}), timeout=10)
    tx.close()
""")


@pytest.mark.skipif(NO_RDMA is not None, reason=f"rdma: {NO_RDMA}")
def test_end_to_end_between_processes():
    import hashlib

    count, senders = 200, ("a", "b")
    env = dict(os.environ)
    rx = subprocess.Popen([sys.executable, "-c", RECEIVER, "rdma://127.0.0.1:0?slots=16&bytes=4096",
                           str(count * len(senders))], stdout=subprocess.PIPE, text=True, env=env)
    txs = []
    try:
        address = json.loads(rx.stdout.readline())["address"]
        assert address.startswith("rdma://127.0.0.1:")
        txs = [subprocess.Popen([sys.executable, "-c", SENDER, address, name, str(count)], env=env)
               for name in senders]
        for tx in txs:
            assert tx.wait(timeout=120) == 0
        result = json.loads(rx.stdout.readline())
        assert rx.wait(timeout=30) == 0
    finally:
        for p in (rx, *txs):
            if p.poll() is None:
                p.kill()
    assert result["rejected"] == 0
    assert len(result["got"]) == count * len(senders)
    assert result["bytes"] > 20 * 4096  # the 4 KiB buffer wrapped around many times
    for name in senders:  # each sender's messages arrive whole and in its order
        mine = [(i, h) for s, i, h in result["got"] if s == name]
        assert [i for i, _ in mine] == list(range(count))
        for i, h in mine:
            assert h == hashlib.sha256(bytes([i % 251]) * (1 + (i * 389) % 1500)).hexdigest()
