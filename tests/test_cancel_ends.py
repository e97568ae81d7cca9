"""How a cancelled request ends, in a running deployment (real processes, sockets, HTTP): the
stages forget a cancel once its uid is created again, and free what they hold for it. The DBs
forget a deleted video after ``ttl_s``, here a second, so that a key can be reused in a test;
the denoise stage runs requests past their deadlines (``drop_expired: false``)."""

from __future__ import annotations

import time

import httpx
import pytest

from onepiece.launcher import free_tcp_address
from onepiece.nm.client import NmClient

from deployment import serving
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

SLOW = dict(size="256x256", num_frames=17, steps=100)  # seconds of denoising on the tiny model
TTL_S = 1.0


@pytest.fixture(scope="module")
def up(tiny_models, tmp_path_factory, make_topology):
    folder = tmp_path_factory.mktemp("cancel-ends")
    nm = free_tcp_address()
    topology = make_topology(folder, tiny_models, nm, stages={"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1},
                             proxy={"count": 1, "port": 0, "monitor": False}, db={"count": 2, "ttl_s": TTL_S},
                             threads=1, schedule={"denoise_t2v": {"policy": "slo", "max_batch": 4, "chunk_steps": 2,
                                                                  "drop_expired": False}})
    with serving(topology, folder / "logs", nm) as dep:
        yield dep


def denoise(up) -> dict:
    client = NmClient(up.nm)
    try:
        (inst,) = client.status()["sets"]["set0"]["stages"]["denoise_t2v"]["instances"]
        return inst
    finally:
        client.close()


def test_a_key_reused_after_its_deleted_video_is_forgotten_makes_a_video(up):
    """An Idempotency-Key whose video was deleted while it ran gets a 409 while the DBs remember
    it; once they forgot it, the key makes a new video under the same uid. The stages had heard
    the first one's cancel: they dropped the new one on arrival, and it stayed queued until the
    NM found it held by nobody (or its deadline)."""
    with httpx.Client(base_url=up.url, timeout=30.0) as http:
        def create(**body) -> httpx.Response:
            return http.post("/v1/videos", headers={"Idempotency-Key": "job-7"},
                             json={"prompt": "a fox", "model": "t2v", **body})

        first = create(**SLOW).json()
        wait_for(lambda: denoise(up)["stats"]["resident"] == 1, 60, "resident in the denoise worker")
        assert http.delete(f"/v1/videos/{first['id']}").status_code == 200
        wait_for(lambda: denoise(up)["stats"]["resident"] == 0, 10, "its state freed")
        again = wait_for(lambda: (r := create()).status_code != 409 and r, TTL_S + 30, "the DBs forgot it")
        assert again.status_code == 200 and again.json()["id"] == first["id"], again.text
        t0 = time.monotonic()
        done = wait_for(lambda: (v := http.get(f"/v1/videos/{first['id']}").json())["status"] != "queued"
                        and v["status"] != "in_progress" and v, 60, "the new video finished")
        assert done["status"] == "completed", (done, time.monotonic() - t0)


def test_a_delete_after_its_deadline_failed_it_stops_what_a_stage_still_runs(up):
    """With ``drop_expired: false`` a stage runs a request past its deadline (its record fails
    there, and turns completed if the video comes). A DELETE then cancels it: the DBs published
    a cancel only for a record not failed or completed, and the stage ran it to its end."""
    with httpx.Client(base_url=up.url, timeout=30.0) as http:
        v = http.post("/v1/videos", json={"prompt": "a fox", "model": "t2v", "timeout_s": 1, **SLOW}).json()
        wait_for(lambda: http.get(f"/v1/videos/{v['id']}").json()["status"] == "failed", 10, "failed at its deadline")
        before = wait_for(lambda: (st := denoise(up)["stats"]) and st["resident"] == 1 and st, 5, "still running")
        assert http.delete(f"/v1/videos/{v['id']}").status_code == 200
        after = wait_for(lambda: (st := denoise(up)["stats"]) and st["resident"] == 0 and st, 10, "its state freed")
        assert after["cancelled"] == before["cancelled"] + 1
        assert after["completed"] == before["completed"]
