"""T2V and I2V end to end with every stage and DB receiving its data over the ring buffer in
shared memory (one host, ipc topology). Real `onepiece up`, real HTTP, real MP4s. The ring's TCP
agent end to end (every stage on another host) is tests/test_netns.py's ring+tcp case."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from onepiece.client import Client
from onepiece.launcher import free_tcp_address

from deployment import decode_mp4, png, serving

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]


@pytest.fixture(scope="module")
def up(tiny_models, tmp_path_factory, make_topology):
    folder = tmp_path_factory.mktemp("ring")
    nm = free_tcp_address()
    topology = make_topology(folder, tiny_models, nm, transport="ipc", data="ring", dbs=2)
    with serving(topology, folder / "logs", nm) as dep:
        yield dep


def test_every_data_address_is_a_ring(up):
    r = up.routes()
    addresses = [a for addrs in r["stages"].values() for a in addrs] + [d["data"] for d in r["dbs"]]
    assert len(addresses) == 6 + 2
    assert all(a.startswith("shm://") for a in addresses), addresses


def test_text_to_video_over_the_ring(up, tmp_path):
    with Client(up.url) as c:
        path = c.generate("a red fox in snow", tmp_path / "fox.mp4", model="t2v", size="64x48",
                          num_frames=9, steps=3, timeout=120)
    assert decode_mp4(path.read_bytes()).shape == (9, 48, 64, 3)


def test_image_to_video_over_the_ring(up, tmp_path):
    with Client(up.url) as c:
        path = c.generate("the picture comes alive", tmp_path / "alive.mp4", model="i2v", image=png(80, 60),
                          size="32x32", num_frames=9, steps=3, timeout=120)
    assert decode_mp4(path.read_bytes()).shape == (9, 32, 32, 3)


def test_sigterm_removes_the_rings(up):
    # This deployment's rings (another deployment on the machine has its own)
    r = up.routes()
    names = {a.removeprefix("shm://").split("?")[0] for a in [*(a for v in r["stages"].values() for a in v),
                                                             *(d["data"] for d in r["dbs"])]}
    shm = sorted(p for p in Path("/dev/shm").glob("onepiece-*") if p.name in names)
    assert len(shm) == len(names) == 8, (names, shm)  # they exist while the deployment runs
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 0
    left = [p for p in shm if p.exists()]
    assert not left, f"rings left behind: {left}"
