"""``ring+tcp://host:port``: the ring protocol between hosts without RDMA.

An agent beside the receiver's region executes one-sided operations for remote senders (read,
atomic word loads, writes, compare-and-swap), as a NIC would: it never runs any of the
receiver's logic, and it only lets senders write where the protocol lets them (the buffer
region by ``write``; the lock, tails and size slots by CAS). The receiver polls its own memory
exactly as with ``shm://``.

Wire format (ZMQ DEALER -> ROUTER; numbers are little-endian u64 unless said otherwise):
request ``[id, op, args, *data]``, reply ``[id, status, body]``; status ``K`` ok, ``G`` the
region's generation is not the one the sender attached to (receiver replaced), ``E`` refused
with a reason. Ops: ``H`` hello -> (nslots, buf_size, generation); ``L`` (gen, off, n) -> n
words; ``R`` (gen, off, n) -> bytes; ``W`` (gen, off...) + one data frame per offset; ``C`` (gen,
off, expected, desired) -> the word found.
"""

from __future__ import annotations

import logging
import mmap
import struct
import threading
import time
from typing import Iterable

import zmq

from onepiece.transport import curve, registry
from onepiece.transport.ring import layout
from onepiece.transport.ring.endpoints import RingReceiver, RingSender
from onepiece.transport.ring.region import MappedRegion, PeerGone, Region
from onepiece.transport.ring.shm import parse_address
from onepiece.transport.zmq_transport import bind_address, peer_of

log = logging.getLogger(__name__)

OP_TIMEOUT = 2.0  # one remote operation; past it the sender treats the receiver as gone
MAX_READ = 64 << 20
_U64 = struct.Struct("<Q")


class Refused(PeerGone):
    """The agent refused an operation (a protocol bug or a version mismatch)."""


class Agent:
    """Serves one-sided operations on ``region`` at ``address`` from a thread of its own."""

    def __init__(self, region: MappedRegion, address: str, extra_ops: dict | None = None) -> None:
        self.region = region
        g = region.geometry
        self._cas_ok = (layout.W_LOCK, layout.W_TAILS)
        self._slots = (g.slots_offset, g.slots_offset + 8 * g.nslots)
        self._buf = (g.buf_offset, g.region_bytes)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 256)
        curve.server(self.sock).bind(bind_address(address))
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ops = {b"H": self._hello, b"L": self._load, b"R": self._read, b"W": self._write, b"C": self._cas,
                    **(extra_ops or {})}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ring-agent", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(100, zmq.POLLIN):
                continue
            frames = self.sock.recv_multipart(copy=False)
            peer, rid, rest = frames[0], frames[1:2], frames[2:]
            try:
                if len(rest) < 2:
                    raise ValueError("request needs an op and its arguments")
                status, body = b"K", self.ops[rest[0].bytes](rest[1].bytes, rest[2:])
            except KeyError:
                status, body = b"E", b"unknown op"
            except _Stale:
                status, body = b"G", b""
            except (ValueError, IndexError, struct.error) as e:
                status, body = b"E", str(e).encode()[:200]
            except Exception as e:  # one request must not end the agent every remote sender needs
                log.warning("ring agent: request from %s failed: %r", peer_of(peer), e)
                status, body = b"E", b"failed"
            self.sock.send_multipart([peer, *rid, status, body], copy=False)

    def _gen(self, args: bytes) -> None:
        if _U64.unpack_from(args)[0] != self.region.generation or self.region.base is None:
            raise _Stale()

    def _hello(self, args: bytes, data: list) -> bytes:
        g = self.region.geometry
        return struct.pack("<QQQ", g.nslots, g.buf_size, self.region.generation)

    def _load(self, args: bytes, data: list) -> bytes:
        self._gen(args)
        _, off, n = struct.unpack("<QQQ", args)
        if n > 64:
            raise ValueError("at most 64 words per load")
        return struct.pack(f"<{n}Q", *self.region.read_words(off, n))

    def _read(self, args: bytes, data: list) -> bytes:
        self._gen(args)
        _, off, n = struct.unpack("<QQQ", args)
        if n > MAX_READ or off + n > self.region.geometry.region_bytes:
            raise ValueError(f"read of {n} bytes at {off} outside the region")
        return self.region.read(off, n)

    def _write(self, args: bytes, data: list) -> bytes:
        self._gen(args)
        offs = struct.unpack(f"<{len(args) // 8}Q", args)[1:]
        if len(offs) != len(data):
            raise ValueError(f"{len(offs)} offsets for {len(data)} data frames")
        lo, hi = self._buf
        pieces = [(off, frame.buffer) for off, frame in zip(offs, data)]
        for off, buf in pieces:
            if off < lo or off + buf.nbytes > hi:
                raise ValueError(f"write of {buf.nbytes} bytes at {off} outside the buffer region")
        self.region.write(pieces)
        return b""

    def _cas(self, args: bytes, data: list) -> bytes:
        self._gen(args)
        _, off, expected, desired = struct.unpack("<QQQQ", args)
        lo, hi = self._slots
        if off not in self._cas_ok and not (lo <= off < hi and off % 8 == 0):
            raise ValueError(f"CAS at {off} is not the lock, the tails or a size slot")
        return _U64.pack(self.region.cas(off, expected, desired))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close(linger=0)


class _Stale(Exception):
    pass


class AgentRegion(Region):
    """A remote region reached through its agent; every operation is bounded by OP_TIMEOUT."""

    def __init__(self, endpoint: str, op_timeout: float = OP_TIMEOUT) -> None:
        self.endpoint = endpoint
        self.op_timeout = op_timeout
        self._rid = 0
        self.sock = self._socket()
        self.generation = 0
        try:
            nslots, buf_size, gen = struct.unpack("<QQQ", self.call(b"H", b""))
            self.geometry = layout.Geometry(nslots, buf_size)
        except (ValueError, struct.error) as e:
            self.close()
            raise Refused(f"agent at {endpoint} describes an invalid ring: {e}") from None
        except PeerGone:
            self.close()
            raise
        self.generation = gen

    def _socket(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        curve.client(sock).connect(self.endpoint)
        return sock

    def call(self, op: bytes, args: bytes, data: Iterable = ()) -> bytes:
        """One operation (also the rdma backend's queue-pair exchange); bounded by op_timeout."""
        self._rid += 1
        rid = _U64.pack(self._rid)
        deadline = time.monotonic() + self.op_timeout
        # IMMEDIATE: not writable until connected, so a missing agent fails within the bound.
        try:
            if not self.sock.poll(int(self.op_timeout * 1000), zmq.POLLOUT):
                raise zmq.Again()
            self.sock.send_multipart([rid, op, args, *data], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise PeerGone(f"ring agent at {self.endpoint} is not reachable") from None
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                break
            reply = self.sock.recv_multipart()
            if len(reply) == 3 and reply[0] == rid:
                status, body = reply[1], reply[2]
                if status == b"K":
                    return body
                if status == b"G":
                    raise PeerGone(f"ring at {self.endpoint} has a new receiver")
                raise Refused(f"ring agent at {self.endpoint} refused {op!r}: {body.decode(errors='replace')}")
            # a late reply to an operation that timed out earlier: skip it
        # Whether the operation ran is unknown; a fresh socket keeps late replies out.
        self.sock.close(linger=0)
        self.sock = self._socket()
        raise PeerGone(f"ring agent at {self.endpoint} did not answer within {self.op_timeout:.1f}s")

    def read(self, off: int, n: int) -> bytes:
        return self.call(b"R", struct.pack("<QQQ", self.generation, off, n))

    def read_words(self, off: int, n: int) -> list[int]:
        body = self.call(b"L", struct.pack("<QQQ", self.generation, off, n))
        return list(struct.unpack(f"<{n}Q", body))

    def write(self, pieces: Iterable[tuple[int, memoryview | bytes]]) -> None:
        pieces = list(pieces)
        args = struct.pack(f"<{1 + len(pieces)}Q", self.generation, *(off for off, _ in pieces))
        self.call(b"W", args, [data for _, data in pieces])

    def cas(self, off: int, expected: int, desired: int) -> int:
        return _U64.unpack(self.call(b"C", struct.pack("<QQQQ", self.generation, off, expected, desired)))[0]

    def close(self) -> None:
        self.sock.close(linger=0)


def listen(address: str) -> RingReceiver:
    where, _, geometry = parse_address(address)
    mem = mmap.mmap(-1, geometry.region_bytes)
    region = MappedRegion(mem)
    region.init(geometry, time.time_ns())
    agent = Agent(region, f"tcp://{where}")
    endpoint = agent.endpoint.replace("tcp://", "ring+tcp://", 1)
    receiver = RingReceiver(endpoint, region, on_close=agent.close)
    receiver.agent = agent
    return receiver


def connect(address: str) -> RingSender:
    where, plain, _ = parse_address(address)
    return RingSender(plain, lambda: AgentRegion(f"tcp://{where}"))


registry.register("ring+tcp", connect, listen)
