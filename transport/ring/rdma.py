"""``rdma://host:port``: the ring protocol over RDMA verbs (pyverbs), for hosts with RDMA NICs.

The receiver maps its region, registers it as a memory region with local write and remote
read/write/atomic access, and runs the TCP backend's ``Agent`` at ``tcp://host:port`` as its
control channel: the same ``H`` hello (geometry, generation), plus ``Q``, the queue-pair
exchange, and ``B``, a sender's goodbye. Only connection setup goes through the agent; every
data-path operation of a sender (RDMA READ, RDMA WRITE, ATOMIC_CMP_AND_SWP) is executed by the
receiver's NIC, never by receiver code. The receiver polls its own memory as with ``shm://``.

Address options (query): ``slots`` and ``bytes`` set the ring's geometry (as for ``shm://``);
``dev`` (RDMA device, default the first), ``port`` (default 1) and ``gid`` (GID index, default
0) pick the local device and are also read from ``ONEPIECE_RDMA_DEV`` / ``_PORT`` / ``_GID``
when the address does not say, since a sender's device is its own host's business, not part of
the address a receiver announces. Example: ``rdma://10.0.0.5:7100?dev=mlx5_0&gid=3``.

``Q`` wire format (little-endian): request args = the sender's ``QpInfo`` (qp_num u32, psn u32,
lid u16, path mtu u8 as ``enum ibv_mtu``, gid 16 raw bytes); reply body = the receiver's
``QpInfo`` for a fresh RC queue pair connected to the sender's, then region address u64, rkey
u32, region length u64, probe address u64, probe rkey u32, nslots u64, buf_size u64,
generation u64 (``Grant``). ``B`` args = the receiver's qp_num from the grant, u64. Bad input
gets an ``E`` reply with the reason; the agent keeps serving.

The probe is an 8-byte word registered per sender, used once at connect to learn how the NIC
orders atomic operands and results: ConnectX NICs on little-endian hosts hand the value found by
an atomic back big-endian (NVIDIA MLNX_OFED docs, "Atomic Operations in mlx5 Driver"; libfabric
issue #10911), soft-RoCE and other vendors in host order. The ring's words are little-endian in
the receiver's memory, so a sender byte-swaps where the probe says it must.

Atomicity: with ``IBV_ATOMIC_HCA`` (most NICs) a NIC CAS is atomic against other NIC atomics
only, not against CPU atomics on the same word. The protocol is safe with that: senders change
the lock, the tails and size slots by CAS, all through the receiver's NIC; the receiver's CPU
only clears a slot that is busy (no sender CAS can write a busy slot) and writes the heads,
which senders only read. So the agent refuses ``W`` and ``C`` here: a ``ring+tcp://`` sender
doing CPU CAS beside NIC CAS would break that.

pyverbs API as in linux-rdma/rdma-core (checked against Debian bookworm's python3-pyverbs 44):
``pyverbs/device.pyx`` (get_device_list, Context(name=), query_device().atomic_caps,
query_port -> lid/state/active_mtu, query_gid -> GID), ``pyverbs/pd.pyx`` (PD),
``pyverbs/mr.pyx`` (MR(pd, length, access, address=) registers memory we own),
``pyverbs/cq.pyx`` (CQ(ctx, cqe), poll(n) -> (npolled, [WC])), ``pyverbs/qp.pyx`` (QPCap,
QPInitAttr, QPAttr, QP(pd, init_attr, qp_attr) -> an RC QP in INIT, to_rts() through RTR),
``pyverbs/addr.pyx`` (GID('xxxx:...'), GlobalRoute, AHAttr), ``pyverbs/wr.pyx`` (SGE, SendWR,
set_wr_rdma, set_wr_atomic); QP attribute values follow ``tests/base.py`` RCResources.to_rts
and the atomic work requests ``tests/utils.py`` get_atomic_send_elements / tests/test_atomic.py.
Enum names come from ``pyverbs.libibverbs_enums`` (newer rdma-core) or ``pyverbs.enums`` (44).
"""

from __future__ import annotations

import collections
import importlib
import logging
import mmap
import os
import random
import re
import struct
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterable
from urllib.parse import parse_qs, urlencode

from onepiece.transport import registry
from onepiece.transport.base import TransportError
from onepiece.transport.ring._atomics import ffi
from onepiece.transport.ring.agent import OP_TIMEOUT, Agent, AgentRegion
from onepiece.transport.ring.endpoints import RingReceiver, RingSender
from onepiece.transport.ring.region import MappedRegion, PeerGone, Region
from onepiece.transport.ring.shm import parse_address

log = logging.getLogger(__name__)

OP_CONNECT, OP_BYE = b"Q", b"B"
INSTALL_HINT = (
    "install Debian's python3-pyverbs (apt-get install python3-pyverbs) and run from a venv made "
    "with Debian's own python3.11: /usr/bin/python3.11 -m venv --system-site-packages .venv-rdma "
    "(PyPI's pyverbs does not import against Debian's libibverbs)")
DEVICE_HINT = ("an RDMA NIC, or soft-RoCE on a kernel with rdma_rxe: "
               "modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0")

MAX_PEERS = 256  # queue pairs a receiver keeps; past it the oldest is dropped (that sender re-attaches)
STAGING_MAX = 4 << 20  # a sender's registered bounce buffer; bigger writes go in chunks
MAX_BATCH = 32  # work requests in flight per sender (the send queue's depth)
RD_ATOMIC = 1  # outstanding RDMA READ / atomic per QP; every device supports 1
PROBE_OLD, PROBE_NEW = 0x0123456789ABCDEF, 0xFEDCBA9876543210  # no byte order maps one onto the other
_DEV_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_OPTIONS = ("dev", "port", "gid")


class RdmaError(TransportError):
    """A local verbs failure (device, registration, queue pair): not something a retry fixes."""


class RdmaUnavailable(RdmaError, ValueError):
    """pyverbs or an RDMA device is missing here."""


# --- availability --------------------------------------------------------------------------------
def rdma_available(dev: str | None = None) -> str | None:
    """None when pyverbs imports and an RDMA device (``dev`` if given) exists, else the reason."""
    try:
        import pyverbs.device as pv_device  # noqa: PLC0415 - optional, imported only when asked
        from pyverbs.pyverbs_error import PyverbsError  # noqa: PLC0415
    except ImportError as e:
        return f"pyverbs is not importable ({e}); {INSTALL_HINT}"
    try:
        # With no device, rdma-core's get_device_list() raises PyverbsRDMAError rather than
        # returning an empty list (checked on Debian bookworm, rdma-core 44).
        devices = pv_device.get_device_list()
    except PyverbsError as e:
        return f"no RDMA device: get_device_list() failed ({e}); needs {DEVICE_HINT}"
    names = [_name(d) for d in devices]
    if not names:
        return f"no RDMA device: get_device_list() is empty; needs {DEVICE_HINT}"
    if dev is not None and dev not in names:
        return f"no RDMA device named {dev!r} (found: {', '.join(names)})"
    return None


def _require(dev: str | None) -> None:
    reason = rdma_available(dev)
    if reason is not None:
        raise RdmaUnavailable(f"the rdma:// transport is not usable here: {reason}")


def _name(device) -> str:
    name = device.name
    return name.decode() if isinstance(name, bytes) else str(name)


# --- addresses -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    dev: str | None = None
    port: int = 1
    gid: int = 0


def parse_rdma_address(address: str):
    """(location, query-less address, geometry, Options) of an ``rdma://`` address."""
    scheme, _, rest = address.partition("://")
    where, _, query = rest.partition("?")
    params = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    unknown = set(params) - {"slots", "bytes", *_OPTIONS}
    if unknown:
        raise ValueError(f"{address!r}: unknown rdma option(s) {sorted(unknown)} "
                         f"(known: slots, bytes, dev, port, gid)")
    ring_query = urlencode({k: v for k, v in params.items() if k not in _OPTIONS}, doseq=True)
    where, plain, geometry = parse_address(f"{scheme}://{where}" + (f"?{ring_query}" if ring_query else ""))

    def option(name: str, default: str | None) -> str | None:
        return params.get(name, [os.environ.get(f"ONEPIECE_RDMA_{name.upper()}", default)])[-1]

    dev = option("dev", None) or None
    if dev is not None and not _DEV_NAME.fullmatch(dev):
        raise ValueError(f"{address!r}: RDMA device name {dev!r} must be 1-64 of A-Z a-z 0-9 _ . -")
    try:
        port, gid = int(option("port", "1")), int(option("gid", "0"))
    except ValueError:
        raise ValueError(f"{address!r}: RDMA port and gid must be integers") from None
    if not 1 <= port <= 255 or not 0 <= gid <= 4095:
        raise ValueError(f"{address!r}: RDMA port must be in [1, 255] and gid index in [0, 4095]")
    return where, plain, geometry, Options(dev, port, gid)


# --- the queue-pair exchange (no device needed to run it) -----------------------------------------
@dataclass(frozen=True)
class QpInfo:
    """What the other side needs to connect an RC queue pair to ours."""

    qp_num: int
    psn: int
    lid: int
    mtu: int  # enum ibv_mtu: 1 (256 bytes) .. 5 (4096 bytes)
    gid: bytes  # 16 raw bytes

    WIRE = struct.Struct("<IIHB16s")

    def pack(self) -> bytes:
        return self.WIRE.pack(self.qp_num, self.psn, self.lid, self.mtu, self.gid)

    @classmethod
    def unpack(cls, body: bytes) -> QpInfo:
        if len(body) != cls.WIRE.size:
            raise ValueError(f"queue-pair details are {cls.WIRE.size} bytes, got {len(body)}")
        info = cls(*cls.WIRE.unpack(body))
        if not 2 <= info.qp_num < 1 << 24:  # QPs 0 and 1 are the management QPs
            raise ValueError(f"qp_num {info.qp_num} is not a 24-bit RC queue pair number")
        if info.psn >= 1 << 24:
            raise ValueError(f"psn {info.psn} exceeds 24 bits")
        if not 1 <= info.mtu <= 5:
            raise ValueError(f"path mtu {info.mtu} is not an ibv_mtu (1..5)")
        return info

    @property
    def gid_str(self) -> str:
        """The GID as pyverbs spells it: 'xxxx:xxxx:xxxx:xxxx:xxxx:xxxx:xxxx:xxxx'."""
        return ":".join(self.gid[i:i + 2].hex() for i in range(0, 16, 2))


@dataclass(frozen=True)
class Grant:
    """The receiver's answer to ``Q``: its queue pair and where the region is."""

    qp: QpInfo
    addr: int
    rkey: int
    length: int
    probe_addr: int
    probe_rkey: int
    nslots: int
    buf_size: int
    generation: int

    TAIL = struct.Struct("<QIQQIQQQ")

    def pack(self) -> bytes:
        return self.qp.pack() + self.TAIL.pack(self.addr, self.rkey, self.length, self.probe_addr,
                                               self.probe_rkey, self.nslots, self.buf_size, self.generation)

    @classmethod
    def unpack(cls, body: bytes) -> Grant:
        n = QpInfo.WIRE.size
        if len(body) != n + cls.TAIL.size:
            raise ValueError(f"a grant is {n + cls.TAIL.size} bytes, got {len(body)}")
        return cls(QpInfo.unpack(body[:n]), *cls.TAIL.unpack(body[n:]))


class QpService:
    """The receiver's extra agent ops. ``responder`` does the verbs work (``_Responder`` on a
    device; tests pass a stand-in): ``accept(QpInfo) -> (QpInfo, probe_addr, probe_rkey)``,
    ``drop(qp_num)``, and the region's ``addr`` / ``rkey``."""

    def __init__(self, region: MappedRegion, responder) -> None:
        self.region = region
        self.responder = responder

    def ops(self) -> dict:
        return {OP_CONNECT: self._connect, OP_BYE: self._bye, b"W": self._refuse, b"C": self._refuse}

    def _connect(self, args: bytes, data: list) -> bytes:
        peer = QpInfo.unpack(args)
        try:
            local, probe_addr, probe_rkey = self.responder.accept(peer)
        except Exception as e:  # anything a driver raises: the agent thread must keep serving
            log.warning("rdma ring: queue pair for peer qp %d failed: %s", peer.qp_num, e)
            raise ValueError(f"queue-pair setup failed: {e}") from None
        g = self.region.geometry
        return Grant(local, self.responder.addr, self.responder.rkey, g.region_bytes, probe_addr, probe_rkey,
                     g.nslots, g.buf_size, self.region.generation).pack()

    def _bye(self, args: bytes, data: list) -> bytes:
        if len(args) != 8:
            raise ValueError("bye takes one u64 qp_num")
        try:
            self.responder.drop(struct.unpack("<Q", args)[0])
        except Exception as e:
            raise ValueError(f"dropping the queue pair failed: {e}") from None
        return b""

    def _refuse(self, args: bytes, data: list) -> bytes:
        raise ValueError("this ring takes writes and CAS over RDMA only (CPU and NIC atomics do not mix)")


def request_grant(control: AgentRegion, mine: QpInfo) -> Grant:
    """The sender's half of ``Q`` over an attached control channel, checked against its hello."""
    try:
        grant = Grant.unpack(control.call(OP_CONNECT, mine.pack()))
    except ValueError as e:
        raise PeerGone(f"rdma ring at {control.endpoint} sent a malformed grant: {e}") from None
    g = control.geometry
    if grant.generation != control.generation:
        raise PeerGone(f"rdma ring at {control.endpoint} has a new receiver")
    if (grant.nslots, grant.buf_size) != (g.nslots, g.buf_size) or grant.length < g.region_bytes:
        raise PeerGone(f"rdma ring at {control.endpoint} granted a region that does not match its geometry")
    return grant


# --- pyverbs, imported lazily ----------------------------------------------------------------------
_ENUMS = ("IBV_QPT_RC", "IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_READ", "IBV_ACCESS_REMOTE_WRITE",
          "IBV_ACCESS_REMOTE_ATOMIC", "IBV_WR_RDMA_WRITE", "IBV_WR_RDMA_READ", "IBV_WR_ATOMIC_CMP_AND_SWP",
          "IBV_SEND_SIGNALED", "IBV_WC_SUCCESS", "IBV_PORT_ACTIVE", "IBV_ATOMIC_NONE")
_WC_STATUS = {1: "local length error", 2: "local QP operation error", 4: "local protection error",
              5: "flushed (the QP went to error)", 7: "bad response", 8: "local access error",
              9: "remote invalid request", 10: "remote access error (bad rkey or address)",
              11: "remote operation error", 12: "transport retry exceeded (peer gone?)",
              13: "RNR retry exceeded", 20: "response timeout", 21: "general error"}
_pv: SimpleNamespace | None = None
_pv_lock = threading.Lock()


def _enum(name: str) -> int:
    for modname in ("pyverbs.libibverbs_enums", "pyverbs.enums"):
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        if hasattr(mod, name):
            return int(getattr(mod, name))
        for member in vars(mod).values():  # enum classes only (ibv_access_flags.IBV_...)
            if isinstance(member, type) and hasattr(member, name):
                return int(getattr(member, name))
    raise RdmaUnavailable(f"this pyverbs has no {name} in pyverbs.libibverbs_enums or pyverbs.enums")


def _pyverbs() -> SimpleNamespace:
    global _pv
    with _pv_lock:
        if _pv is None:
            try:
                from pyverbs import addr, cq, device, mr, pd, qp, wr  # noqa: PLC0415
                from pyverbs.pyverbs_error import PyverbsError  # noqa: PLC0415
            except ImportError as e:
                raise RdmaUnavailable(f"pyverbs is not importable ({e}); {INSTALL_HINT}") from None
            try:
                # Keep registered memory out of fork()ed children (a no-op on kernels that no
                # longer need it); it must come before the first registration, so do it once here.
                from pyverbs.fork import fork_init  # noqa: PLC0415
                fork_init()
            except Exception:  # noqa: BLE001 - older pyverbs, or too late: neither is fatal
                pass
            _pv = SimpleNamespace(
                Context=device.Context, get_device_list=device.get_device_list, PD=pd.PD, MR=mr.MR, CQ=cq.CQ,
                QP=qp.QP, QPInitAttr=qp.QPInitAttr, QPAttr=qp.QPAttr, QPCap=qp.QPCap, SGE=wr.SGE,
                SendWR=wr.SendWR, GID=addr.GID, GlobalRoute=addr.GlobalRoute, AHAttr=addr.AHAttr,
                Error=PyverbsError, **{n: _enum(n) for n in _ENUMS})
        return _pv


def _bswap(word: int) -> int:
    return int.from_bytes(word.to_bytes(8, "little"), "big")


class _Device:
    """An opened device, port and GID with a protection domain; makes and connects RC QPs."""

    def __init__(self, opts: Options) -> None:
        pv = self.pv = _pyverbs()
        self.port, self.gid_index = opts.port, opts.gid
        try:
            name = opts.dev or _name(pv.get_device_list()[0])
            self.name = name
            self.ctx = pv.Context(name=name)
        except (pv.Error, IndexError) as e:
            raise RdmaUnavailable(f"cannot open RDMA device {opts.dev or '(first)'}: {e}") from None
        try:
            if self.ctx.query_device().atomic_caps == pv.IBV_ATOMIC_NONE:
                raise RdmaUnavailable(f"RDMA device {name} has no atomic operations (the ring needs CAS)")
            self.port_attr = self.ctx.query_port(opts.port)
            if self.port_attr.state != pv.IBV_PORT_ACTIVE:
                raise RdmaUnavailable(f"RDMA device {name} port {opts.port} is not active")
            self.gid = bytes.fromhex(self.ctx.query_gid(opts.port, opts.gid).gid.replace(":", ""))
            self.pd = pv.PD(self.ctx)
        except BaseException as e:
            self.ctx.close()
            if isinstance(e, pv.Error):
                raise RdmaError(f"RDMA device {name} port {opts.port} gid {opts.gid}: {e}") from None
            raise

    def info(self, qp, psn: int) -> QpInfo:
        return QpInfo(qp.qp_num, psn, self.port_attr.lid, int(self.port_attr.active_mtu), self.gid)

    def create_qp(self, cq, access: int, send_wr: int):
        """An RC QP in INIT (pyverbs' QP() with a QPAttr goes RESET -> INIT for RC)."""
        pv = self.pv
        cap = pv.QPCap(max_send_wr=send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = pv.QPInitAttr(qp_type=pv.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)
        attr = pv.QPAttr(port_num=self.port)
        attr.qp_access_flags = access
        return pv.QP(self.pd, init, attr)

    def connect_qp(self, qp, access: int, local_psn: int, peer: QpInfo) -> None:
        """INIT -> RTR -> RTS towards ``peer`` (values as rdma-core tests/base.py RCResources)."""
        pv = self.pv
        attr = pv.QPAttr(port_num=self.port)
        attr.qp_access_flags = access
        attr.path_mtu = min(int(self.port_attr.active_mtu), peer.mtu)
        attr.dest_qp_num = peer.qp_num
        attr.rq_psn = peer.psn  # what the peer sends starts at its psn ...
        attr.sq_psn = local_psn  # ... and ours at the psn we told it
        attr.max_dest_rd_atomic = RD_ATOMIC
        attr.max_rd_atomic = RD_ATOMIC
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        gr = pv.GlobalRoute(dgid=pv.GID(peer.gid_str), sgid_index=self.gid_index)
        attr.ah_attr = pv.AHAttr(port_num=self.port, is_global=1, gr=gr, dlid=peer.lid)
        qp.to_rts(attr)

    def close(self) -> None:
        _close_all(getattr(self, "pd", None), self.ctx)


def _close_all(*objs) -> None:
    for obj in objs:
        if obj is not None:
            try:
                obj.close()
            except Exception as e:  # noqa: BLE001 - teardown goes on
                log.debug("rdma: closing %s failed: %s", type(obj).__name__, e)


# --- the receiver's side ----------------------------------------------------------------------------
class _Responder:
    """The receiver's verbs state: the registered region and one RC QP (plus its probe word)
    per sender. ``accept`` runs on the agent's thread; ``close`` after the agent has stopped."""

    def __init__(self, region: MappedRegion, opts: Options) -> None:
        self.dev = _Device(opts)
        pv = self.dev.pv
        self.access = (pv.IBV_ACCESS_LOCAL_WRITE | pv.IBV_ACCESS_REMOTE_READ | pv.IBV_ACCESS_REMOTE_WRITE
                       | pv.IBV_ACCESS_REMOTE_ATOMIC)
        self._lock = threading.Lock()
        self.peers: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self.mr = self.cq = None
        try:
            self.addr = int(ffi.cast("uintptr_t", region.base))
            self.mr = pv.MR(self.dev.pd, region.geometry.region_bytes, self.access, address=self.addr)
            self.rkey = self.mr.rkey
            self.cq = pv.CQ(self.dev.ctx, 16)  # a responder posts nothing; RC QPs still need a CQ
        except pv.Error as e:
            self.close()
            raise RdmaError(f"registering the ring region on {self.dev.name}: {e}") from None
        except BaseException:
            self.close()
            raise

    def accept(self, peer: QpInfo) -> tuple[QpInfo, int, int]:
        pv = self.dev.pv
        with self._lock:
            qp = probe = None
            try:
                qp = self.dev.create_qp(self.cq, self.access, 1)
                psn = random.getrandbits(24)
                self.dev.connect_qp(qp, self.access, psn, peer)
                probe = pv.MR(self.dev.pd, 8, self.access)  # pyverbs allocates and zeroes it
            except BaseException:
                _close_all(probe, qp)
                raise
            self.peers[qp.qp_num] = (qp, probe)
            while len(self.peers) > MAX_PEERS:
                _, old = self.peers.popitem(last=False)
                _close_all(*reversed(old))
            return self.dev.info(qp, psn), probe.buf, probe.rkey

    def drop(self, qp_num: int) -> None:
        with self._lock:
            pair = self.peers.pop(qp_num, None)
        if pair is not None:
            _close_all(pair[1], pair[0])

    def close(self) -> None:
        with self._lock:
            pairs, self.peers = list(self.peers.values()), collections.OrderedDict()
        for qp, probe in pairs:
            _close_all(probe, qp)
        _close_all(self.mr, self.cq)  # before the region's memory goes
        self.mr = self.cq = None
        self.dev.close()


# --- the sender's side -------------------------------------------------------------------------------
class RdmaRegion(Region):
    """A receiver's region reached with one-sided verbs on an RC queue pair. Every operation
    waits for its signaled completion, bounded by ``op_timeout``; a timeout or a bad completion
    leaves the QP unusable and raises PeerGone (the sender attaches again)."""

    def __init__(self, endpoint: str, opts: Options = Options(), op_timeout: float = OP_TIMEOUT) -> None:
        self.endpoint = endpoint
        self.op_timeout = op_timeout
        self._broken: str | None = None
        self.dev = self.mr = self.cq = self.qp = self._mem = self._buf = self._view = None
        self._peer_qp: int | None = None  # the receiver's QP for us: what ``B`` names
        self.control = AgentRegion(endpoint, op_timeout)  # H hello: geometry, generation
        self.geometry, self.generation = self.control.geometry, self.control.generation
        try:
            self._setup(opts)
        except BaseException:
            self.close()
            raise

    def _setup(self, opts: Options) -> None:
        self.dev = _Device(opts)
        pv = self.dev.pv
        self.pv = pv
        size = max(mmap.PAGESIZE, min(STAGING_MAX, self.geometry.buf_size))
        self._mem = mmap.mmap(-1, size)  # page-aligned, ours: registered with address=
        self._view = memoryview(self._mem)
        self._buf = ffi.from_buffer(self._mem)
        self._addr = int(ffi.cast("uintptr_t", self._buf))
        try:
            self.mr = pv.MR(self.dev.pd, size, pv.IBV_ACCESS_LOCAL_WRITE, address=self._addr)
            self.lkey = self.mr.lkey
            self.cq = pv.CQ(self.dev.ctx, 2 * MAX_BATCH)
            self.qp = self.dev.create_qp(self.cq, 0, MAX_BATCH)
            psn = random.getrandbits(24)
            grant = request_grant(self.control, self.dev.info(self.qp, psn))
            self._peer_qp = grant.qp.qp_num
            self.dev.connect_qp(self.qp, 0, psn, grant.qp)
        except pv.Error as e:
            raise RdmaError(f"rdma ring at {self.endpoint}: setting up the queue pair failed: {e}") from None
        self.raddr, self.rkey = grant.addr, grant.rkey
        self._swap_operands = self._swap_reply = False
        self._calibrate(grant.probe_addr, grant.probe_rkey)

    # --- work requests ---------------------------------------------------------------------------
    def _wr(self, opcode: int, local: int, n: int):
        pv = self.pv
        return pv.SendWR(opcode=opcode, num_sge=1, sg=[pv.SGE(self._addr + local, n, self.lkey)],
                         send_flags=pv.IBV_SEND_SIGNALED)

    def _fail(self, reason: str):
        self._broken = reason
        raise PeerGone(f"rdma ring at {self.endpoint}: {reason}")

    def _run(self, wrs: list) -> None:
        """Post ``wrs`` and wait for all their completions."""
        if self._broken is not None:
            raise PeerGone(f"rdma ring at {self.endpoint}: {self._broken}")
        try:
            for wr in wrs:
                self.qp.post_send(wr)
        except self.pv.Error as e:
            self._fail(f"post_send failed: {e}")
        deadline = time.monotonic() + self.op_timeout
        left, spins = len(wrs), 0
        while left:
            try:
                n, wcs = self.cq.poll(left)
            except self.pv.Error as e:
                self._fail(f"polling the completion queue failed: {e}")
            for wc in wcs:
                if wc.status != self.pv.IBV_WC_SUCCESS:
                    self._fail(f"work request failed: status {wc.status} "
                               f"({_WC_STATUS.get(wc.status, 'see ibv_wc_status')}), vendor error {wc.vendor_err}")
            left -= n
            if n == 0:
                if time.monotonic() >= deadline:
                    self._fail(f"no completion within {self.op_timeout:.1f}s")
                spins += 1
                if spins > 100:  # spin first (completions take microseconds), then back off
                    time.sleep(20e-6 if spins < 1000 else 200e-6)

    def _cas_raw(self, raddr: int, rkey: int, compare: int, swap: int) -> int:
        """ATOMIC_CMP_AND_SWP as the NIC takes it; the 8 bytes it returns, read little-endian."""
        wr = self._wr(self.pv.IBV_WR_ATOMIC_CMP_AND_SWP, 0, 8)
        wr.set_wr_atomic(rkey=rkey, addr=raddr, compare_add=compare, swap=swap)
        self._run([wr])
        return int.from_bytes(self._view[:8], "little")

    def _read_raw(self, raddr: int, rkey: int, n: int) -> bytes:
        wr = self._wr(self.pv.IBV_WR_RDMA_READ, 0, n)
        wr.set_wr_rdma(rkey, raddr)
        self._run([wr])
        return bytes(self._view[:n])

    def _calibrate(self, probe: int, rkey: int) -> None:
        """Learn the NIC's byte order for atomics on this sender's own probe word."""
        self._view[:8] = PROBE_OLD.to_bytes(8, "little")
        wr = self._wr(self.pv.IBV_WR_RDMA_WRITE, 0, 8)
        wr.set_wr_rdma(rkey, probe)
        self._run([wr])
        for swap_operands in (False, True):
            conv = _bswap if swap_operands else (lambda w: w)
            found = self._cas_raw(probe, rkey, conv(PROBE_OLD), conv(PROBE_NEW))
            now = int.from_bytes(self._read_raw(probe, rkey, 8), "little")
            if now == PROBE_NEW and PROBE_OLD in (found, _bswap(found)):
                self._swap_operands, self._swap_reply = swap_operands, found != PROBE_OLD
                if swap_operands or self._swap_reply:
                    log.info("rdma ring at %s: NIC atomics %s", self.endpoint,
                             "take byte-swapped operands" if swap_operands else "reply big-endian")
                return
            if now != PROBE_OLD:
                break
        raise RdmaError(f"rdma ring at {self.endpoint}: the NIC's compare-and-swap does not behave as a "
                        f"64-bit CAS in either byte order (probe found {found:#x}, now {now:#x})")

    # --- Region --------------------------------------------------------------------------------
    def _check(self, off: int, n: int, aligned: bool = False) -> None:
        if off < 0 or n < 0 or off + n > self.geometry.region_bytes or (aligned and off % 8):
            raise IndexError(f"{n} bytes at {off} outside the region" + (" or not 8-byte aligned" if aligned else ""))

    def read(self, off: int, n: int) -> bytes:
        self._check(off, n)
        out, cap = bytearray(), len(self._mem)
        while len(out) < n:
            k = min(cap, n - len(out))
            out += self._read_raw(self.raddr + off + len(out), self.rkey, k)
        return bytes(out)

    def read_words(self, off: int, n: int) -> list[int]:
        # One RDMA READ of n aligned words. The protocol needs each 8-byte aligned word
        # untorn, not the words consistent with each other (as the TCP agent's loads): a NIC
        # reads naturally aligned 8-byte words from host memory whole on the hosts we run on,
        # though the IB spec itself promises nothing about READ atomicity.
        self._check(off, 8 * n, aligned=True)
        if 8 * n > len(self._mem):
            raise ValueError(f"at most {len(self._mem) // 8} words per read")
        return list(struct.unpack(f"<{n}Q", self._read_raw(self.raddr + off, self.rkey, 8 * n)))

    def write(self, pieces: Iterable[tuple[int, memoryview | bytes]]) -> None:
        """Copy pieces into the registered staging buffer and RDMA WRITE them; pieces that are
        adjacent in the region go as one work request. All are in place when this returns: the
        writer publishes (CAS on the size slot) only after that, on the same RC QP, whose
        requests the receiver's NIC executes in order, so a published slot never shows before
        its entry's bytes."""
        cap = len(self._mem)
        runs: list[list[int]] = []  # [staging offset, region offset, length]
        pos = 0

        def flush() -> None:
            nonlocal pos
            wrs = []
            for local, remote, n in runs:
                wr = self._wr(self.pv.IBV_WR_RDMA_WRITE, local, n)
                wr.set_wr_rdma(self.rkey, self.raddr + remote)
                wrs.append(wr)
            if wrs:
                self._run(wrs)
            runs.clear()
            pos = 0

        for off, data in pieces:
            src = memoryview(data).cast("B")
            self._check(off, src.nbytes)
            done = 0
            while done < src.nbytes:
                if pos == cap or (len(runs) == MAX_BATCH and runs[-1][1] + runs[-1][2] != off + done):
                    flush()
                k = min(src.nbytes - done, cap - pos)
                self._view[pos:pos + k] = src[done:done + k]
                if runs and runs[-1][0] + runs[-1][2] == pos and runs[-1][1] + runs[-1][2] == off + done:
                    runs[-1][2] += k
                else:
                    runs.append([pos, off + done, k])
                pos += k
                done += k
        flush()

    def cas(self, off: int, expected: int, desired: int) -> int:
        self._check(off, 8, aligned=True)
        if self._swap_operands:
            expected, desired = _bswap(expected), _bswap(desired)
        found = self._cas_raw(self.raddr + off, self.rkey, expected, desired)
        return _bswap(found) if self._swap_reply else found

    def close(self) -> None:
        qp, self.qp = self.qp, None
        if self._peer_qp is not None:
            try:  # best effort (the agent may be gone): lets the receiver free its QP for us now
                self.control.op_timeout = 0.2
                self.control.call(OP_BYE, struct.pack("<Q", self._peer_qp))
            except PeerGone:
                pass
            self._peer_qp = None
        _close_all(qp, self.cq, self.mr)
        self.cq = self.mr = None
        if self.dev is not None:
            self.dev.close()
            self.dev = None
        if self._buf is not None:
            ffi.release(self._buf)
            self._buf = None
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._mem is not None:
            self._mem.close()
            self._mem = None
        self.control.close()


# --- the transport -------------------------------------------------------------------------------------
def listen(address: str) -> RingReceiver:
    where, _, geometry, opts = parse_rdma_address(address)
    _require(opts.dev)
    region = MappedRegion(mmap.mmap(-1, geometry.region_bytes))
    region.init(geometry, time.time_ns())
    try:
        responder = _Responder(region, opts)
    except BaseException:
        region.close()
        raise
    try:
        agent = Agent(region, f"tcp://{where}", extra_ops=QpService(region, responder).ops())
    except BaseException:
        responder.close()
        region.close()
        raise

    def on_close() -> None:
        agent.close()  # no more QP exchanges, then the QPs and the registration go
        responder.close()

    receiver = RingReceiver(agent.endpoint.replace("tcp://", "rdma://", 1), region, on_close=on_close)
    receiver.agent, receiver.responder = agent, responder
    return receiver


def connect(address: str) -> RingSender:
    where, plain, _, opts = parse_rdma_address(address)
    _require(opts.dev)
    return RingSender(plain, lambda: RdmaRegion(f"tcp://{where}", opts))


registry.register("rdma", connect, listen)
