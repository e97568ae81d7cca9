"""``shm://name``: the ring in a POSIX shared-memory file, for senders on the same host.

The receiver creates ``/dev/shm/<name>``; a sender maps it and runs the protocol with real
CAS on the mapping. A receiver that starts where an older one left a region (it was killed)
closes the old one first, so senders still mapped to it attach again instead of writing into
memory nobody reads. Geometry comes in the address: ``shm://name?slots=1024&bytes=67108864``.
"""

from __future__ import annotations

import mmap
import os
import re
import time
from pathlib import Path
from urllib.parse import parse_qs

from onepiece.transport import registry
from onepiece.transport.ring import layout
from onepiece.transport.ring.endpoints import RingReceiver, RingSender
from onepiece.transport.ring.region import MappedRegion, PeerGone

SHM_DIR = Path("/dev/shm")
DEFAULT_GEOMETRY = layout.Geometry(nslots=1024, buf_size=64 << 20)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


def parse_address(address: str, default: layout.Geometry = DEFAULT_GEOMETRY) -> tuple[str, str, layout.Geometry]:
    """(scheme-less location, query-less address, geometry) of a ring address. The location is
    what follows ``scheme://``; ``slots`` and ``bytes`` in the query set the geometry."""
    scheme, _, rest = address.partition("://")
    where, _, query = rest.partition("?")
    # keep_blank_values: "slots=" is an error, not silently the default geometry
    params = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    unknown = set(params) - {"slots", "bytes"}
    if unknown:
        raise ValueError(f"{address!r}: unknown ring option(s) {sorted(unknown)} (known: slots, bytes)")
    try:
        geometry = layout.Geometry(int(params.get("slots", [default.nslots])[-1]),
                                   int(params.get("bytes", [default.buf_size])[-1]))
    except ValueError as e:
        raise ValueError(f"{address!r}: {e}") from None
    return where, f"{scheme}://{where}", geometry


def _path(name: str) -> Path:
    if not _NAME.fullmatch(name):
        raise ValueError(f"shm ring name {name!r} must be 1-200 of A-Z a-z 0-9 _ . -")
    return SHM_DIR / name


def _map(path: Path) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _retire(path: Path) -> None:
    """Close a region an earlier receiver left behind, then remove its name."""
    try:
        mem = _map(path)
    except (FileNotFoundError, ValueError):
        pass
    else:
        region = MappedRegion(mem)
        if len(mem) >= layout.HEADER_BYTES and region.load(layout.W_MAGIC) == layout.MAGIC:
            region.store(layout.W_STATE, layout.CLOSED)
        region.close()
    path.unlink(missing_ok=True)


def create_region(path: Path, geometry: layout.Geometry) -> MappedRegion:
    _retire(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # Allocate every page now: a sparse file (ftruncate) maps fine on a full /dev/shm and
        # then kills whichever process first touches a page it cannot get (SIGBUS), a sender
        # as often as this receiver. Here a full /dev/shm is an error this receiver reports.
        os.posix_fallocate(fd, 0, geometry.region_bytes)
        mem = mmap.mmap(fd, geometry.region_bytes)
    except OSError as e:
        path.unlink(missing_ok=True)
        raise OSError(e.errno, f"cannot create the ring {path} ({geometry.region_bytes} bytes): "
                               f"{e.strerror}") from None
    finally:
        os.close(fd)
    region = MappedRegion(mem)
    region.init(geometry, time.time_ns())
    return region


def attach_region(path: Path) -> MappedRegion:
    try:
        mem = _map(path)
    except (FileNotFoundError, ValueError) as e:
        raise PeerGone(f"no ring at {path} ({e})") from None
    region = MappedRegion(mem)
    try:
        region.attach()
    except PeerGone:
        region.close()
        raise
    return region


def listen(address: str) -> RingReceiver:
    name, plain, geometry = parse_address(address)
    path = _path(name)
    return RingReceiver(plain, create_region(path, geometry), on_close=lambda: path.unlink(missing_ok=True))


def connect(address: str) -> RingSender:
    name, plain, _ = parse_address(address)
    path = _path(name)
    return RingSender(plain, lambda: attach_region(path))


registry.register("shm", connect, listen)
