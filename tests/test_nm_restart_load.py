"""The NM SIGKILLed and restarted under load in a deployment of 10 stage instances (issue 15's
evidence): before, a restarted NM handed out ids from 1 again, so instances took over each
other's ids and assignments, and routes were partial for 1-2 s (503 and 429 although every
instance was alive). A real `onepiece up` serves a closed-loop stream of requests over HTTP
while its NM is killed; the launcher restarts the NM, every instance registers again, and:
every request completes (none failed, none refused but by the monitor's rate limit), every
instance is known under the id it had (its name) and serves the stage it served before, the new routes are
versioned above the old, and both DB copies end with every request completed."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from onepiece.client import Client, RequestRejected
from onepiece.db.client import DbClient
from onepiece.launcher import free_tcp_address
from onepiece.nm.client import NmClient

from deployment import Up
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.exclusive, pytest.mark.filterwarnings("ignore::ResourceWarning")]

STAGES = {"text_encode": 2, "denoise_t2v": 3, "vae_decode": 2, "image_encode": 1, "vae_encode": 1, "denoise_i2v": 1}
STREAMS = 3  # requests in flight at once: load, yet below what 10 tiny instances absorb
MAX_PER_STREAM = 60  # bounds the load loop


def _stage_instances(nm: str) -> dict[str, tuple[str, str | None]]:
    """name -> (id, stage) of every stage instance the NM knows, idle ones included."""
    client = NmClient(nm)
    try:
        st = client.status()["sets"]["set0"]
    finally:
        client.close()
    out = {i["name"]: (i["id"], i["stage"]) for s in st["stages"].values() for i in s["instances"]}
    out.update({i["name"]: (i["id"], None) for i in st["idle"]})
    return out


def _instances_or_none(nm: str) -> dict[str, tuple[str, str | None]]:
    """As _stage_instances, or {} while no NM answers."""
    from onepiece.transport.rpc import RpcError

    try:
        return _stage_instances(nm)
    except RpcError:
        return {}


def _nm_process(up: Up) -> psutil.Process:
    for p in psutil.Process(up.proc.pid).children(recursive=True):
        cmd = p.cmdline()
        if "onepiece" in cmd and "nm" in cmd:
            return p
    raise AssertionError("no NM process under onepiece up")


@pytest.fixture
def up(tiny_models, tmp_path, make_topology):
    """The deployment, serving (its start shares the machine; the test's body runs alone)."""
    nm = free_tcp_address()
    topology = make_topology(tmp_path, tiny_models, nm, stages=STAGES, heartbeat_s=0.25, threads=1,
                             nm={"elastic": {"enabled": False}})
    dep = Up(topology, tmp_path / "logs", nm)
    try:
        dep.url = dep.wait_for(r"serves the API at (http://\S+)", timeout=300).group(1)
        yield dep
    finally:
        dep.stop()


def test_the_nm_killed_under_load_leaves_every_request_served_and_every_instance_its_own(up):
    nm, url = up.nm, up.url
    before = _stage_instances(nm)
    assert len(before) == sum(STAGES.values())
    old_version = up.routes()["version"]

    done: list[str] = []
    videos: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def stream(k: int) -> None:
        with Client(url, rounds=1) as c:  # a refusal (429/503) is not retried by the client
            for i in range(MAX_PER_STREAM):
                if stop.is_set():
                    return
                try:
                    v = c.submit(f"stream {k} request {i}", model="t2v", size="32x32", num_frames=5, steps=2)
                except RequestRejected as e:
                    # The monitor's rate limit paces a closed loop of tiny requests; any other
                    # refusal (no entrance, no worker, no DB: what partial routes gave) fails.
                    if e.code != "over_capacity":
                        raise
                    if stop.wait(min(e.retry_after or 1.0, 1.0)):  # as told, unless the run ends
                        return
                    continue
                status = c.wait(v["id"], timeout=120)["status"]  # raises on a failure
                with lock:
                    done.append(status)
                    videos.append(v["id"])

    with ThreadPoolExecutor(STREAMS) as pool:
        streams = [pool.submit(stream, k) for k in range(STREAMS)]
        try:
            wait_for(lambda: len(done) >= 4, timeout=120, what="the stream under way")
            killed = _nm_process(up)
            killed.send_signal(signal.SIGKILL)
            killed.wait(10)
            # Requests go on while the NM is away, while it restarts and while every
            # instance registers again, and for a while after.
            wait_for(lambda: set(_instances_or_none(nm)) == set(before), timeout=120,
                     what="every instance registered again")
            after_rejoin = len(done)
            wait_for(lambda: len(done) >= after_rejoin + 2 * STREAMS, timeout=120, what="requests after the rejoin")
        finally:
            stop.set()
        for f in streams:
            f.result(timeout=240)  # what a stream raised (a refusal, a failed request) fails here
    assert done and set(done) == {"completed"}

    # The restarted NM knows every instance again, each under the id it had (its name), each
    # at the stage it served before the kill.
    after = _stage_instances(nm)
    assert after == before and all(i == n for n, (i, _) in after.items()), (before, after)
    assert up.routes()["version"] > old_version
    assert _nm_process(up).pid != killed.pid

    # Every DB copy of the set ends with the same status for every request (failures and
    # results replicate; copies that missed a change get it again).
    copies = [DbClient([d["control"]]) for d in up.routes()["dbs"]]
    try:
        assert len(copies) == 2
        uids = [v.removeprefix("video_") for v in videos]

        def agreed() -> bool:
            return all((c.get(u) or {}).get("status") == "completed" for u in uids for c in copies)
        wait_for(agreed, timeout=15, what="every DB copy holding every request as completed", interval=0.5)
    finally:
        for c in copies:
            c.close()
