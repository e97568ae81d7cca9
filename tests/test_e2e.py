"""The whole pipeline on one machine, started by the real `onepiece up` command: NM, two DBs,
one process per stage (each with its worker process) and a proxy, talking over real sockets.
Requests go through HTTP and come back as MP4s. The last test stops the deployment with
SIGTERM and checks that nothing is left behind."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import zmq

from onepiece.client import Client, RequestFailed, RequestRejected
from onepiece.db.client import DbClient
from onepiece.launcher import free_tcp_address
from onepiece.stage.schedule_log import read as read_schedule
from onepiece.stage.task_manager import GOMP_SPINCOUNT
from onepiece.stage.threads import TRIALS
from onepiece.transport import registry
from onepiece.transport.message import Message, new_uid

from deployment import Up, decode_mp4, png
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]


@pytest.fixture(scope="module")
def up(tiny_models, tmp_path_factory, make_topology):
    folder = tmp_path_factory.mktemp("deployment")
    nm = free_tcp_address()
    topology = make_topology(folder, tiny_models, nm)
    dep = Up(topology, folder / "logs", nm)
    dep.topology = topology
    # What /readyz answers while the deployment starts: polled from the moment the proxy
    # listens (its log says where) until `onepiece up` says it is up.
    dep.readiness, started = [], threading.Event()

    def watch_readiness() -> None:
        url = None
        while not started.wait(0.05):
            log = folder / "logs" / "set0-proxy0.log"
            if url is None:
                m = re.search(r"proxy listening on (http://\S+)", log.read_text() if log.exists() else "")
                url = m and m.group(1)
                continue
            try:
                dep.readiness.append(httpx.get(f"{url}/readyz", timeout=1.0).status_code)
            except httpx.HTTPError:
                pass

    watch = threading.Thread(target=watch_readiness, daemon=True)
    watch.start()
    try:
        m = dep.wait_for(r"serves the API at (http://\S+)", timeout=240)
        started.set()
        watch.join(5)
        dep.url = m.group(1)
        yield dep
    finally:
        started.set()
        dep.stop()


def test_readyz_is_ready_only_once_every_application_can_be_served(up):
    """While the stages load, the proxy is alive and /readyz says 503 with what is missing; by
    the time `onepiece up` says it is up (every stage has a ready worker), it says 200."""
    first_ok = up.readiness.index(200) if 200 in up.readiness else len(up.readiness)
    assert 503 in up.readiness[:first_ok], up.readiness  # not ready before it was
    ready = wait_for(lambda: (r := httpx.get(f"{up.url}/readyz")).status_code == 200 and r, timeout=10,
                     what="/readyz answering 200 after `onepiece up` said it is up")
    assert ready.json()["missing"] == []


def test_text_to_video_through_http(up, tmp_path):
    with Client(up.url) as c:
        video = c.submit("a red fox in snow", model="t2v", size="64x48", num_frames=9, steps=4, seed=7)
        assert video["status"] == "queued"
        done = c.wait(video["id"], timeout=120)
        assert done["status"] == "completed" and done["progress"] == 100
        out = c.download(video["id"], tmp_path / "fox.mp4")
    frames = decode_mp4(out.read_bytes())
    assert frames.shape == (9, 48, 64, 3)
    # What each stage's worker ran for it, beside the stage's log (stage/schedule_log.py): one
    # call at each one-step stage, and its 4 denoising steps in the denoise stage's chunks.
    uid = video["id"].removeprefix("video_")
    ran = {path.name.removesuffix(".schedule.jsonl"): [c for c in read_schedule(path)
                                                       if any(uid in p[1] for p in c["parts"])]
           for path in up.logs.glob("*.schedule.jsonl")}
    assert [len(ran[f"set0-{s}0"]) for s in ("text_encode", "vae_decode")] == [1, 1], ran
    denoise = ran["set0-denoise_t2v0"]
    assert sum(c["passes"] for c in denoise) == 4 and all(c["start"] <= c["end"] for c in denoise), denoise
    # why others waited (none, unless an earlier test's request was still there): never itself
    assert all(isinstance(p, list) and p[0] != uid for c in denoise for p in c["passed"]), denoise
    assert denoise[0]["start"] >= ran["set0-text_encode0"][0]["end"] - 1.0


def test_image_to_video_through_http_multipart(up, tmp_path):
    with Client(up.url) as c:
        path = c.generate("the picture comes alive", tmp_path / "alive.mp4", model="i2v", image=png(80, 60),
                          size="32x32", seconds="1", steps=3, timeout=120)
    frames = decode_mp4(path.read_bytes())
    # 1 s at the workflow's 16 fps → 17 frames (4k+1)
    assert frames.shape == (17, 32, 32, 3)


def test_openai_package_works_unchanged(up, tmp_path):
    from openai import OpenAI

    client = OpenAI(base_url=f"{up.url}/v1", api_key="unused")
    video = client.videos.create(prompt="a lighthouse", model="t2v", size="64x64", seconds="1",
                                 extra_body={"steps": 2, "num_frames": 5})
    video = wait_for(lambda: (v := client.videos.retrieve(video.id)).status in ("completed", "failed") and v, 120,
                     "the video to end", interval=0.2)
    assert video.status == "completed", video
    content = client.videos.download_content(video.id)
    assert decode_mp4(content.read()).shape == (5, 64, 64, 3)


def test_status_command_shows_every_stage(up):
    # the command `onepiece up` prints reaches its NM: this topology's is not the default address,
    # where a plain `onepiece status` asks
    printed = up.wait_for(r"`(onepiece status[^`]*)` shows the cluster", timeout=30).group(1)
    assert printed == f"onepiece status --nm {up.nm}", printed

    def status() -> str:
        out = subprocess.run([sys.executable, "-m", *shlex.split(printed)], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout

    text = status()
    for stage in ("text_encode", "image_encode", "vae_encode", "denoise_t2v", "denoise_i2v", "vae_decode"):
        assert f"stage {stage}: 1/1 ready" in text
    assert "dbs:" in text and "proxies:" in text
    # two t2v requests ran above, so every t2v stage has a sample (each worker's first request
    # is left out), which reaches the NM with a heartbeat or two; the i2v-only stages have
    # served one request, so i2v is not measured yet
    def measured() -> str | None:
        text = status()
        return text if re.search(r"capacity t2v: [0-9.]+/s, bottleneck \w+", text) else None

    text = wait_for(measured, 10, "a t2v capacity in onepiece status", interval=0.5)
    assert re.search(r"capacity t2v: [0-9.]+/s, bottleneck \w+", text), text
    assert "capacity i2v: not measured yet" in text, text
    assert "falling behind" not in text, text  # an idle set raises no alarm


def test_a_second_up_on_the_same_ports_is_refused_and_the_first_is_untouched(up, tmp_path):
    before = up.routes()
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "onepiece", "up", "--topology", str(up.topology),
                          "--logs", str(tmp_path / "logs")], capture_output=True, text=True, timeout=60)
    port = up.nm.rsplit(":", 1)[1]
    assert out.returncode == 1, out.stdout + out.stderr
    m = re.search(rf"port {port} \(node manager 0\) is in use by pid (\d+) \(.*onepiece nm ", out.stderr)
    assert m and psutil.Process(int(m.group(1))).parent().pid == up.proc.pid, out.stderr  # the first one's NM
    assert time.monotonic() - t0 < 30  # refused before building or starting anything
    assert not list((tmp_path / "logs").glob("*.log"))  # nothing was started
    after = up.routes()
    assert after["stages"] == before["stages"] and after["dbs"] == before["dbs"]
    Client(up.url).generate("still here", tmp_path / "still.mp4", size="64x64", num_frames=5, steps=2)


def _db_client(up) -> DbClient:
    return DbClient([d["control"] for d in up.routes()["dbs"]])


def test_what_a_stage_cannot_use_fails_only_that_request(up):
    """Messages sent straight to the denoise stage's data address, past the proxy: each request
    fails with its reason, and the stage keeps serving. No text embeddings (the stage function
    raises); over the application's limits without a deadline (this once pinned a worker
    indefinitely: the stage holds every request to the limits itself); a header whose fields
    have the wrong types (one such message once killed the instance)."""
    r = up.routes()
    db = _db_client(up)
    params = {"prompt": "x", "negative_prompt": "", "width": 32, "height": 32, "num_frames": 5, "steps": 2,
              "guidance": 5.0, "seed": 1, "fps": 16, "max_sequence_length": 64}
    cases = [({"params": params, "trace": []}, "prompt_embeds"),
             ({"params": {**params, "steps": 1_000_000}, "trace": []},
              "params.steps: 1000000 exceeds the application's limit"),
             ({"params": [1], "trace": []}, "malformed request at stage denoise_t2v: params"),
             ({"params": params, "trace": 1}, "malformed request at stage denoise_t2v: trace")]
    tx = registry.connect(r["stages"]["denoise_t2v"][0])
    uids = []
    for header, _ in cases:
        uid = new_uid()
        uids.append(uid)
        db.create({"uid": uid, "app": "t2v", "set": "set0", "status": "queued", "progress": 0})
        tx.send(Message({"uid": uid, "app": "t2v", "stage": "denoise_t2v", "kind": "task", "ts": time.time_ns(),
                         **header}), timeout=5)
    tx.close()
    for uid, (_, why) in zip(uids, cases):
        rec = wait_for(lambda: (r := db.get(uid))["status"] == "failed" and r, 30, f"{uid} failed", interval=0.1)
        assert rec["status"] == "failed" and why in rec["error"], (why, rec)
    with Client(up.url) as c:  # the same stage still serves
        v = c.submit("still alive", model="t2v", size="32x32", num_frames=5, steps=2)
        assert c.wait(v["id"], timeout=60)["status"] == "completed"


def test_malformed_frames_into_a_stage_are_dropped_with_a_log_line(up):
    addr = up.routes()["stages"]["text_encode"][0]
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(addr)
    raw.send_multipart([b"OP1", b"{not json"])
    raw.send_multipart([b"\x00" * 10])
    # a header that parses but describes a part no frame can match
    raw.send_multipart([b"OP1", b'{"uid":"x","parts":[{"name":"a","dtype":"float32","shape":[true,0],"nbytes":0}]}', b""])
    raw.close(linger=2000)
    wait_for(lambda: up.log("set0-text_encode0").count("dropped malformed message") >= 3, 10,
             "three malformed messages logged", interval=0.1)
    assert up.log("set0-text_encode0").count("dropped malformed message") == 3
    with Client(up.url) as c:
        v = c.submit("after garbage", model="t2v", size="32x32", num_frames=5, steps=2)
        assert c.wait(v["id"], timeout=60)["status"] == "completed"


def _worker_pid(up, stage: str) -> int:
    stage_procs = [p for p in psutil.Process(up.proc.pid).children()
                   if f"--stage {stage} " in " ".join(p.cmdline()) + " "]
    assert len(stage_procs) == 1
    workers = [p for p in stage_procs[0].children() if "onepiece.stage.worker" in " ".join(p.cmdline())]
    assert len(workers) == 1
    return workers[0].pid


def test_cpu_workers_yield_to_the_control_plane(up):
    """On CPU the model compute is batch work: its workers run SCHED_IDLE (and niced), so a
    proxy, DB, NM or scheduler that wakes up gets a core at once."""
    worker = _worker_pid(up, "vae_decode")
    assert os.sched_getscheduler(worker) == os.SCHED_IDLE
    assert psutil.Process(worker).nice() == 10
    stage = psutil.Process(worker).parent()
    assert os.sched_getscheduler(stage.pid) == os.SCHED_OTHER and stage.nice() == 0
    # Its torch threads spin briefly after their work (not libgomp's default of milliseconds),
    # so a stage that just finished leaves the cores to the next one.
    assert psutil.Process(worker).environ().get("GOMP_SPINCOUNT") == os.environ.get("GOMP_SPINCOUNT", GOMP_SPINCOUNT)


def test_cpu_workers_choose_their_threads_per_shape(up):
    """Each CPU worker tries 1 thread and all cores on a shape's calls and steps and keeps the
    faster (stage/threads.py): after a warm-up and its tries of each, its log says which."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: nothing to choose")
    with Client(up.url) as c:
        for i in range(1 + 2 * TRIALS):
            v = c.submit(f"threads {i}", model="t2v", size="48x48", num_frames=5, steps=2)
            assert c.wait(v["id"], timeout=60)["status"] == "completed"
    choice = r"torch threads for {}: [12] \(median [\d.]+ ms at \d, [\d.]+ ms at \d\)"
    for stage, key in (("text_encode", "call/t2v/48x48x5"), ("denoise_t2v", r"step/48x48x5/cfg/L\d+/1"),
                       ("vae_decode", "call/t2v/48x48x5")):
        assert re.search(choice.format(key), up.log(f"set0-{stage}0")), stage


def test_killed_worker_fails_its_request_and_comes_back(up):
    before = _worker_pid(up, "denoise_t2v")
    with Client(up.url) as c:
        # long enough to be caught mid-denoise
        v = c.submit("a slow one", model="t2v", size="256x256", num_frames=17, steps=100)
        wait_for(lambda: (s := c.status(v["id"]))["status"] == "in_progress" and s["progress"] >= 35, 60,
                 "the request inside denoise (stage 2 of 3)", interval=0.05)
        os.kill(before, signal.SIGKILL)
        with pytest.raises(RequestFailed, match="died"):
            c.wait(v["id"], timeout=30)
        # the worker is restarted and the stage serves again
        def restarted() -> bool:
            try:
                return _worker_pid(up, "denoise_t2v") != before
            except (AssertionError, psutil.NoSuchProcess):
                return False

        wait_for(restarted, 60, "a new denoise_t2v worker", interval=0.2)

        # Until the new worker has loaded its model the stage has no worker, and the request
        # monitor refuses t2v at once (429 no_capacity) instead of queueing it.
        def submitted() -> dict | None:
            try:
                return c.submit("after the crash", model="t2v", size="32x32", num_frames=5, steps=2)
            except RequestRejected as e:
                if e.code != "no_capacity":
                    raise
                return None

        v2 = wait_for(submitted, 60, "t2v admitted again", interval=0.2)
        assert c.wait(v2["id"], timeout=90)["status"] == "completed"


def test_a_downloaded_video_can_be_retrieved_and_downloaded_again_for_a_while(up, tmp_path):
    """As with the OpenAI API, a download does not make the video vanish: it is purged
    `purge_after_fetch_s` (60 s) after the first fetch (tests/test_db_*.py time that)."""
    with Client(up.url) as c:
        v = c.submit("fetch me twice", model="t2v", size="32x32", num_frames=5, steps=2)
        c.wait(v["id"], timeout=60)
        first = c.download(v["id"], tmp_path / "once.mp4").read_bytes()
        assert httpx.get(f"{up.url}/v1/videos/{v['id']}").json()["status"] == "completed"
        r = httpx.get(f"{up.url}/v1/videos/{v['id']}/content")
        assert r.status_code == 200 and r.content == first


def test_sigterm_stops_everything(up):
    """Last: SIGTERM to `onepiece up` stops every process, role by role, and removes its runtime
    folder; a request still denoising fails with the reason, which its DBs store before they stop."""
    descendants = psutil.Process(up.proc.pid).children(recursive=True)
    assert len(descendants) >= 1 + 2 + 6 * 2 + 1  # nm, dbs, stages and their workers, proxy
    runtime = Path(up.routes()["dbs"][0]["data"].removeprefix("ipc://")).parent
    assert runtime.is_dir()
    with Client(up.url) as c:
        v = c.submit("still denoising", model="t2v", size="256x256", num_frames=17, steps=100)
        wait_for(lambda: c.status(v["id"])["progress"] > 0, 60, "the request denoising")
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 0
    output = "".join(up.output)
    # The rest of what it printed: it has exited, so its output ends once no process holds it
    # (an orphan that does fails below).
    up.reader.join(10)
    with contextlib.suppress(queue.Empty):
        while True:
            output += up.lines.get_nowait()
    assert "killing it" not in output, output  # every role stopped within its grace ...
    assert "while stopping" not in output, output  # ... and cleanly (a crash on the way out lost what it sent)
    uid = v["id"].removeprefix("video_")
    stored = [i for i in range(2) if f"uid={uid} failed (stage denoise_t2v instance shut down)" in up.log(f"set0-db{i}")]
    assert stored, [up.log(f"set0-db{i}")[-2000:] for i in range(2)]
    gone, alive = psutil.wait_procs(descendants, timeout=10)
    assert not alive, f"orphans: {[p.pid for p in alive]}"
    assert not runtime.exists()
