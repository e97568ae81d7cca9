"""Two workflow sets under one node manager, started by the real launcher (`Deployment`):

- set ``a``: the three T2V stages, one DB, and one proxy that admits one request at a time;
- set ``b``: the same stages and proxy, and three DBs that keep each result on two of them.

A client built from the NM that set ``a`` refuses completes on set ``b`` and says so; results
sit on the first two DBs of their placement order, survive one DB being SIGKILLed, and are
purged from both copies once fetched. Real processes and sockets throughout.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import imageio.v3 as iio
import psutil
import pytest

from onepiece import generate
from onepiece.client import Client
from onepiece.db.placement import order_dbs
from onepiece.launcher import Deployment, free_tcp_address, write_topology
from onepiece.nm.client import NmClient
from onepiece.transport.rpc import RpcClient, RpcError
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

SMALL = {"model": "t2v", "size": "32x32", "num_frames": 5, "steps": 2}



class TwoSets:
    def __init__(self, dep: Deployment, proxies: dict[str, list[str]]) -> None:
        self.dep, self.proxies, self.nm = dep, proxies, dep.nm_address
        self.stopped: list[int] = []  # pids we SIGSTOPped, resumed before the deployment stops

    def child(self, name: str) -> psutil.Process:
        (c,) = [c for c in self.dep.children if c.name == name]
        return psutil.Process(c.proc.pid)

    def freeze_worker(self, instance: str) -> None:
        """Stop (SIGSTOP) the worker process of a stage instance: the instance keeps
        heartbeating and stays routed to, but what reaches the worker stays there."""
        (worker,) = [p for p in self.child(instance).children()
                     if "onepiece.stage.worker" in " ".join(p.cmdline())]
        worker.send_signal(signal.SIGSTOP)
        self.stopped.append(worker.pid)

    def thaw_workers(self) -> None:
        while self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.stopped.pop(), signal.SIGCONT)

    def dbs(self, set_name: str) -> list[dict]:
        nm = NmClient(self.nm, timeout=2.0, retries=0)
        try:
            return nm.routes(set_name)["dbs"]
        finally:
            nm.close()


@pytest.fixture(scope="module")
def sets(tiny_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("two-sets")
    topology = write_topology(folder, tiny_models, free_tcp_address(), sets=[
        {"name": "a", "proxy": {"max_inflight": 1}, "db": {"count": 1}},
        {"name": "b", "db": {"count": 3, "replication": 2, "purge_after_fetch_s": 1.0}},
    ], stages={"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1})
    dep = Deployment(topology, folder / "logs")
    state = None
    try:
        dep.start()
        state = TwoSets(dep, dep.wait_ready(240))
        yield state
    finally:
        if state is not None:
            state.thaw_workers()  # a stopped process would hold up the shutdown
        dep.stop()


def get(control: str, uid: str) -> dict | None:
    """The record as one DB holds it, asked directly at its control address."""
    rpc = RpcClient(control, timeout=2.0, retries=0)
    try:
        return rpc.call("get", uid=uid)[0]["record"]
    except RpcError as e:
        if "not found" in str(e):
            return None
        raise
    finally:
        rpc.close()


def holders(sets: TwoSets, uid: str) -> list[bool]:
    """Per DB of set b in ``uid``'s placement order: whether it holds the completed result."""
    return [(r := get(d["control"], uid)) is not None and r["status"] == "completed"
            for d in order_dbs(uid, sets.dbs("b"))]


def test_a_client_refused_by_one_set_completes_on_another(sets, tmp_path, capsys, monkeypatch):
    (a_url,), (b_url,) = sets.proxies["a"], sets.proxies["b"]
    monkeypatch.setattr("onepiece.client.random.randrange", lambda n: 0)  # offer it to set a first
    # Set a's one slot is taken by a request that cannot finish: its entrance worker is stopped.
    sets.freeze_worker("a-text_encode0")
    hold = httpx.post(f"{a_url}/v1/videos", json={"prompt": "hold the only slot", **SMALL}, timeout=10)
    assert hold.status_code == 200, hold.text
    assert hold.json()["set"] == "a"
    refused = httpx.post(f"{a_url}/v1/videos", json={"prompt": "no room", **SMALL}, timeout=10)
    assert refused.status_code == 429 and "retry-after" in refused.headers

    with Client.from_nm(sets.nm, timeout=30) as c:
        assert c.urls == [a_url, b_url]  # sets in the NM's order: set a is offered it first
        video = c.submit("a fox in the snow", **SMALL)
        assert video["set"] == "b" and c.set_of(video["id"]) == "b"
        assert len(c.last_refusals) == 1 and "(set a)" in c.last_refusals[0]
        assert c.wait(video["id"], timeout=120)["set"] == "b"
        out = c.download(video["id"], tmp_path / "fox.mp4")
    assert iio.imread(out.read_bytes(), extension=".mp4").shape == (5, 32, 32, 3)

    # `onepiece generate --nm` does the same and says which set served it.
    assert generate.main(["--nm", sets.nm, "--prompt", "a hare", "--size", "32x32", "--frames", "5",
                          "--steps", "2", "--quiet", "-o", str(tmp_path / "hare.mp4")]) == 0
    assert "(set b)" in capsys.readouterr().out
    assert (tmp_path / "hare.mp4").stat().st_size > 0

    # Set a's worker resumes: the request it held completes there, and set a admits again.
    sets.thaw_workers()
    with Client(a_url, timeout=30) as c:
        assert c.wait(hold.json()["id"], timeout=60)["set"] == "a"
        again = c.submit("room again", **SMALL)
        assert again["set"] == "a" and c.wait(again["id"], timeout=60)["status"] == "completed"


def test_status_shows_both_sets(sets):
    out = subprocess.run([sys.executable, "-m", "onepiece", "status", "--nm", sets.nm], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    text = out.stdout.split("recent events:")[0]
    assert "set a" in text and "set b" in text
    a, b = text.split("set b")
    for stage in ("text_encode", "denoise_t2v", "vae_decode"):
        assert f"stage {stage}: 1/1 ready" in a and f"stage {stage}: 1/1 ready" in b
    assert "stage denoise_i2v: 0/0 ready" in a
    # Instance ids (each line's first word): the names `onepiece up` gives (nm/identity.py).
    ids = [re.findall(r"^ {4}(\S+) ", part, re.M) for part in (a, b)]
    assert sorted(i for i in ids[0] if "-db" in i or "-proxy" in i) == ["a-db0", "a-proxy0"], ids
    assert sorted(i for i in ids[1] if "-db" in i or "-proxy" in i) == ["b-db0", "b-db1", "b-db2", "b-proxy0"], ids


def test_a_result_is_on_the_first_two_dbs_of_its_order_and_purged_from_both(sets, tmp_path):
    with Client(sets.proxies["b"], timeout=30) as c:
        video = c.submit("two copies", **SMALL)
        c.wait(video["id"], timeout=120)
        uid = video["id"].removeprefix("video_")
        # The copy lands on the second DB shortly after the first has it; never on the third.
        wait_for(lambda: holders(sets, uid)[:2] == [True, True], 10, "copies on the first two DBs")
        assert get(order_dbs(uid, sets.dbs("b"))[2]["control"], uid) is None
        c.download(video["id"], tmp_path / "once.mp4")
        c.download(video["id"], tmp_path / "twice.mp4")  # within purge_after_fetch_s (1 s): still there
    wait_for(lambda: holders(sets, uid) == [False, False, False], 10, "purged from both copies")


def test_killing_one_db_loses_no_completed_result(sets, tmp_path):
    """Last in the module: it leaves set b with two DBs."""
    with Client(sets.proxies["b"], timeout=30) as c:
        videos = [c.submit(f"keep me {i}", **SMALL) for i in range(3)]
        uids = [v["id"].removeprefix("video_") for v in videos]
        for v, uid in zip(videos, uids):
            c.wait(v["id"], timeout=120)
            wait_for(lambda uid=uid: holders(sets, uid)[:2] == [True, True], 10, f"two copies of {uid}")
        # Kill the DB that readers ask first for the first result, with no chance to hand over.
        victim = order_dbs(uids[0], sets.dbs("b"))[0]["control"]
        name = Path(victim.removeprefix("ipc://")).name.removesuffix("-ctl.sock")  # b-db<i>
        sets.child(name).send_signal(signal.SIGKILL)
        for v in videos:
            assert c.status(v["id"])["status"] == "completed"
            out = c.download(v["id"], tmp_path / f"{v['id']}.mp4")
            assert iio.imread(out.read_bytes(), extension=".mp4").shape == (5, 32, 32, 3)
