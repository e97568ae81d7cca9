"""The workers of a collaboration instance as one ``torch.distributed`` world (issue 13).

Gloo on CPU, NCCL on CUDA, chosen by the device. Every sub-group a degree of parallelism (DoP)
can use is built once, at start, in the same order on every rank: creating a group is a
collective over the whole world (GF-DiT measured 778 ms for a new NCCL group against ~60 µs
for a collective on an existing one), so it must never happen between two steps. With 2 to 4
workers the groups are few: the aligned blocks of 2, 4, ... ranks (``blocks``), and the world.

Rank 0 talks to the instance's scheduler; ``share`` hands what it received to the others, as
bytes (nothing is pickled). A rank that dies makes every collective of the others fail at the
world's timeout: the group is then torn down and restarted as a unit by its instance.

Nothing of a world listens beyond this host: the ranks meet through a file in a private folder
(stage/rendezvous.py), and gloo's and NCCL's own sockets are kept on loopback (all ranks of a
world are on one host).
"""

from __future__ import annotations

import datetime
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

import torch
import torch.distributed as dist

from onepiece.sched.ranks import Ranks, blocks
from onepiece.stage.rendezvous import rendezvous

def pack(frames: list[bytes]) -> bytes:
    """Frames as one buffer (a count, then each frame's length and bytes), for ``share``."""
    return b"".join([struct.pack("<I", len(frames)), *(struct.pack("<Q", len(f)) + bytes(f) for f in frames)])


def unpack(data: bytes) -> list[bytes]:
    (count,), at, out = struct.unpack_from("<I", data), 4, []
    for _ in range(count):
        (n,) = struct.unpack_from("<Q", data, at)
        out.append(data[at + 8:at + 8 + n])
        at += 8 + n
    if at != len(data):
        raise ValueError(f"packed frames: {len(data) - at} bytes left over")
    return out


def backend(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


class Collective:
    """This process's rank in the instance's world, with the world's sub-groups and meshes."""

    def __init__(self, rank: int, size: int, address: str, device: str, timeout_s: float = 60.0) -> None:
        """``address``: the world's ``rendezvous``."""
        from torch.distributed.device_mesh import DeviceMesh

        if not address.startswith("file://"):
            raise ValueError(f"a world meets through a file (stage/rendezvous.py), not {address!r}")
        self.rank, self.size, self.device = rank, size, torch.device(device)
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(var, "lo")
        dist.init_process_group(backend(device), init_method=address, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        # Commands travel as CPU tensors whatever the compute backend (NCCL moves device memory only).
        self.cpu = dist.new_group(backend="gloo") if backend(device) == "nccl" else dist.group.WORLD
        self.groups: dict[Ranks, Any] = {}
        self.meshes: dict[Ranks, Any] = {}
        for ranks in blocks(size):
            if len(ranks) < 2:
                continue
            # ("ring", "ulysses") is the mesh diffusers' context parallelism expects; every rank
            # builds every mesh (and its flattened view) because each is a collective.
            mesh = DeviceMesh(self.device.type, torch.tensor([list(ranks)]), mesh_dim_names=("ring", "ulysses"))
            mesh["ring", "ulysses"]._flatten()
            self.meshes[ranks] = mesh
            self.groups[ranks] = mesh["ulysses"].get_group() if rank in ranks else None

    @property
    def world(self) -> Ranks:
        return tuple(range(self.size))

    def group(self, ranks: Ranks) -> Any:
        """The process group of ``ranks`` (built at start); this rank must be one of them."""
        if ranks == self.world and self.size > 1:
            return dist.group.WORLD
        g = self.groups.get(ranks)
        if g is None:
            raise ValueError(f"no group of ranks {ranks} on rank {self.rank} (groups: {sorted(self.groups)})")
        return g

    def share(self, payload: bytes | None) -> bytes:
        """Rank 0's ``payload``, on every rank (the others pass None)."""
        n = torch.tensor([len(payload) if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(n, 0, group=self.cpu)
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0 and n.item() else \
            torch.empty(int(n.item()), dtype=torch.uint8)
        if n.item():
            dist.broadcast(buf, 0, group=self.cpu)
        return bytes(buf.numpy()) if self.rank else payload

    def barrier(self) -> None:
        dist.barrier(group=self.cpu)

    def close(self) -> None:
        """Leave the world together: a rank that tore its connections down while a peer still
        received (a broadcast returns at its source first) would abort that peer."""
        if dist.is_initialized():
            self.barrier()
            dist.destroy_process_group()


def leave() -> None:
    """End a rank's process at once, after ``Collective.close``: the process groups' C++ objects
    outlive ``destroy_process_group`` while Python still holds them (meshes, hooks), and torn
    down at interpreter exit they may abort the process ("terminate called without an active
    exception", seen under load) after all its work was done."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def local_world(module: str, config: dict[str, Any], size: int, timeout_s: float = 1800.0) -> Any:
    """Run ``python -m module '<config>'`` as the ``size`` ranks of a world on this host (each
    config gets ``rank``, ``size``, ``address`` and an ``out`` folder) and return the JSON rank 0
    wrote to ``out/report.json``: how tools (profile, benchmarks) time a group's steps."""
    with tempfile.TemporaryDirectory() as tmp:
        address = rendezvous(tmp)
        procs = [subprocess.Popen([sys.executable, "-m", module, orjson.dumps(
            {**config, "rank": r, "size": size, "address": address, "out": tmp}).decode()]) for r in range(size)]
        try:
            codes = [p.wait(timeout=timeout_s) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            raise RuntimeError(f"a rank of the world of {size} ({module}) failed: exit codes {codes}")
        return json.loads((Path(tmp) / "report.json").read_text())
