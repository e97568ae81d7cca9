"""The Python client (onepiece.client) and `onepiece generate` against a real proxy and DB.

A fake worker thread stands in for the stages: it pulls each task from the real ZMQ entrance
socket and answers the way the last stage does, by writing ``status`` and ``result`` (or
``failed``) messages to the real DB's data socket. Prompts steer it: "fail..." makes it report
a failure, "hold..." makes it keep the request unanswered.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import httpx
import orjson
import pytest

from onepiece import generate
from onepiece.client import Client, RequestFailed, RequestRejected, Timeout


import proxy_harness as H  # noqa: E402  (tests/ is on pytest's pythonpath)


def fake_mp4(header: dict) -> bytes:
    """The worker's "video": the params it was given, so tests can check what travelled."""
    p = header["params"]
    return b"FAKEMP4" + orjson.dumps({"uid": header["uid"], "app": header["app"], "params": p,
                                      "deadline_s": (header["deadline"] - header["ts"]) / 1e9})


class FakeWorker:
    def __init__(self, h) -> None:
        self.h = h
        self.stop = threading.Event()
        self.images: dict[str, tuple] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            msg = self.h.entrance.recv(0.05)
            if msg is None:
                continue
            prompt = msg.header["params"]["prompt"]
            if "image" in msg.parts:
                self.images[msg.uid] = msg.parts["image"].shape
            if prompt.startswith("hold"):
                continue
            stages = H.WORKFLOW.applications[msg.header["app"]].stages
            self.h.db.progress(msg.uid, 30, stage=stages[0])
            if prompt.startswith("fail"):
                self.h.db.failed(msg.uid, "the denoiser ran out of memory", stage=stages[-2])
                continue
            self.h.db.progress(msg.uid, 80, stage=stages[-1])
            self.h.db.result(msg.uid, fake_mp4(msg.header), trace=msg.header["trace"])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


@pytest.fixture(scope="module")
def h():
    harness = H.Harness(max_inflight=1000)
    harness.worker = worker = FakeWorker(harness)
    yield harness
    worker.close()
    harness.close()


@pytest.fixture
def client(h):
    with Client(h.url, timeout=10) as c:
        yield c


def test_generate_end_to_end(client, tmp_path):
    seen = []
    out = client.generate("a cat surfing", tmp_path / "cat.mp4", model="t2v", size="96x64", seconds=1,
                          steps=4, seed=9, timeout=10, on_progress=lambda v: seen.append((v["status"], v["progress"])))
    data = out.read_bytes()
    assert data.startswith(b"FAKEMP4")
    info = orjson.loads(data[len(b"FAKEMP4"):])
    assert info["app"] == "t2v"
    assert info["params"]["width"] == 96 and info["params"]["height"] == 64
    assert info["params"]["num_frames"] == 17 and info["params"]["steps"] == 4 and info["params"]["seed"] == 9
    assert seen[0] == ("queued", 0) and seen[-1] == ("completed", 100)
    progress = [p for _, p in seen]
    assert progress == sorted(progress)
    assert not list(tmp_path.glob(".*.part"))


def test_submit_status_wait_download(client, tmp_path):
    v = client.submit("hello", model="t2v", num_frames=5)
    assert v["status"] == "queued" and v["id"].startswith("video_")
    assert client.status(v["id"])["id"] == v["id"]
    done = client.wait(v["id"], timeout=10)
    assert done["status"] == "completed" and done["progress"] == 100
    path = client.download(v["id"], tmp_path / "x.mp4")
    assert orjson.loads(path.read_bytes()[7:])["params"]["num_frames"] == 5
    assert client.download(v["id"], tmp_path / "again.mp4").read_bytes() == path.read_bytes()  # a retry works
    # A link is written through, not replaced; a FIFO (as /dev/null would be) is refused, not replaced.
    (tmp_path / "link.mp4").symlink_to(tmp_path / "again.mp4")
    assert client.download(v["id"], tmp_path / "link.mp4") == tmp_path / "again.mp4"
    assert (tmp_path / "link.mp4").is_symlink()
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(OSError, match="not a regular file"):
        client.download(v["id"], tmp_path / "pipe")
    assert stat.S_ISFIFO((tmp_path / "pipe").stat().st_mode)
    # ... until the DB purges the fetched result (0.3 s after the first fetch in this harness)
    def purged() -> bool:
        try:
            client.status(v["id"])
        except RequestFailed as e:
            return e.status_code == 404
        return False

    H.wait_for(purged, timeout=5, what="the fetched result purged")
    with pytest.raises(RequestFailed) as e:
        client.download(v["id"], tmp_path / "gone.mp4")
    assert e.value.status_code == 404 and not (tmp_path / "gone.mp4").exists()


def test_image_to_video_from_a_path_and_bytes(h, client, tmp_path):
    img = tmp_path / "ref.png"
    img.write_bytes(H.png(48, 32))
    out = client.generate("it moves", tmp_path / "i2v.mp4", model="i2v", image=img, timeout=10)
    uid = orjson.loads(out.read_bytes()[7:])["uid"]
    assert h.worker.images[uid] == (32, 48, 3)  # the image travelled as uploaded, HxWx3
    v = client.submit("it moves", model="i2v", image=H.png(16, 16))
    client.wait(v["id"], timeout=10)
    assert h.worker.images[v["id"].removeprefix("video_")] == (16, 16, 3)


def test_failure_and_bad_input_raise_request_failed(client):
    v = client.submit("fail please")
    with pytest.raises(RequestFailed) as e:
        client.wait(v["id"], timeout=10)
    assert "out of memory" in str(e.value) and e.value.video["status"] == "failed"
    assert e.value.code == "generation_failed"

    with pytest.raises(RequestFailed) as e:
        client.submit("x", size="30x30")
    assert e.value.status_code == 400 and e.value.param == "size" and "16" in e.value.message
    with pytest.raises(RequestFailed) as e:
        client.status("video_" + "a" * 32)
    assert e.value.status_code == 404


def test_wait_times_out(client):
    v = client.submit("hold this one")
    with pytest.raises(Timeout):
        client.wait(v["id"], timeout=0.3)


def test_rejection_and_failover_across_proxies(tmp_path):
    full = H.Harness(max_inflight=1)
    good = H.Harness(max_inflight=10)
    worker = FakeWorker(good)
    try:
        with Client(full.url, rounds=1) as c:
            c.submit("hold: takes the only slot")
            with pytest.raises(RequestRejected) as e:
                c.submit("refused")
            assert e.value.retry_after == 1 and e.value.code == "inflight_full"
        # The full set refuses, the client goes on to the next proxy, and later reads go there.
        with Client([full.url, good.url]) as c:
            for _ in range(2):  # whichever proxy the rotation starts at
                out = c.generate("elsewhere", tmp_path / "e.mp4", timeout=10)
                assert out.read_bytes().startswith(b"FAKEMP4")
        # A proxy that is not even up is skipped too.
        with Client(["http://127.0.0.1:9", good.url]) as c:
            assert c.submit("hello")["status"] == "queued"
    finally:
        worker.close()
        full.close()
        good.close()


DEAD = "http://127.0.0.1:9"  # nothing listens there: connection refused


def test_the_proxy_counts_how_its_requests_ended(h, client):
    """/metrics and the proxy's heartbeat stats (`onepiece status`) count each accepted request
    once as it leaves: completed or failed as the DB's done event says, cancelled when deleted."""
    def ended() -> dict[str, float]:
        text = h.http.get("/metrics").text
        return {how: H.metric(text, "onepiece_proxy_ended_total", app="t2v", outcome=how) or 0.0
                for how in ("completed", "failed", "cancelled", "expired")}

    before, stats_before = ended(), h.proxy.app.state.proxy.stats()["ended"]
    ok, bad, held = client.submit("a fox"), client.submit("fail on purpose"), client.submit("hold it")
    client.wait(ok["id"], timeout=10)
    with pytest.raises(RequestFailed):
        client.wait(bad["id"], timeout=10)
    client.delete(held["id"])
    want = {"completed": 1, "failed": 1, "cancelled": 1, "expired": 0}
    H.wait_for(lambda: {k: ended()[k] - before[k] for k in want} == want, what="the three outcomes counted")
    stats = h.proxy.app.state.proxy.stats()["ended"]
    assert {k: stats.get(k, 0) - stats_before.get(k, 0) for k in want} == want


class LateProxy:
    """The proxy of ``url`` reachable only ``after`` seconds from now, at ``self.url``: before,
    its port refuses connections, as while `onepiece up` restarts a killed proxy; then a relay
    pipes each connection to the real proxy."""

    def __init__(self, url: str, after: float) -> None:
        self.target = httpx.URL(url)
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()  # refused until the relay binds it
        self.url = f"http://127.0.0.1:{self.port}"
        self.up_at = time.monotonic() + after
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(after,), daemon=True)
        self.thread.start()

    def _serve(self, after: float) -> None:
        if self.stop.wait(after):
            return
        with socket.create_server(("127.0.0.1", self.port)) as server:
            server.settimeout(0.1)
            while not self.stop.is_set():
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                upstream = socket.create_connection((self.target.host, self.target.port))
                for a, b in ((conn, upstream), (upstream, conn)):
                    threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def test_a_submit_outlasts_a_proxy_restart_by_default_and_three_rounds_did_not(h):
    """`onepiece up` brings a killed proxy back in about 2 s: a submit sent meanwhile waits it
    out with the client's default rounds (their pauses add up to 4 to 8 s); with 3 rounds (the
    old default, under a second of pauses) it gave up, the proxy unreachable."""
    late = LateProxy(h.url, after=3.0)  # (2 s, as up does, left 1 s to a busy machine's 3 rounds)
    try:
        with Client(late.url, timeout=10, rounds=3) as c, pytest.raises(RequestFailed) as e:
            c.submit("too soon")
        assert e.value.code == "unreachable"
        assert time.monotonic() < late.up_at  # the next client starts while the proxy is still away
        with Client(late.url, timeout=10) as c:
            v = c.submit("patient")
            assert c.wait(v["id"], timeout=10)["status"] == "completed"
    finally:
        late.close()


def test_download_and_status_fall_back_when_the_home_proxy_is_unreachable(h, tmp_path):
    with Client([DEAD, h.url], timeout=10) as c:
        v = c.submit("moving house")  # the rotation skips the dead proxy
        c.wait(v["id"], timeout=10)
        c._home[v["id"]] = DEAD  # the proxy that took it has gone away since
        assert c.status(v["id"])["status"] == "completed"
        assert c._home[v["id"]] == h.url  # the one that answered is asked first from now on
        c._home[v["id"]] = DEAD
        out = c.download(v["id"], tmp_path / "moved.mp4")
        assert out.read_bytes().startswith(b"FAKEMP4")


def mock_client(urls, handler, **kw) -> Client:
    """A Client whose HTTP goes to ``handler(request) -> httpx.Response`` (or raises)."""
    c = Client(urls, **kw)
    c._http.close()
    c._http = httpx.Client(transport=httpx.MockTransport(handler))
    return c


VID = "video_" + "ab" * 16


def video(status: str, progress: int = 0, **extra) -> dict:
    return {"id": VID, "object": "video", "status": status, "progress": progress, **extra}


def error(status: int, code: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": f"{code}!", "code": code}})


def test_wait_rides_out_transient_errors():
    answers = iter(["refused", 503, "in_progress", 502, "refused", "timeout", "completed"])
    polls = []

    def handler(request: httpx.Request) -> httpx.Response:
        a = next(answers)
        polls.append(a)
        if a == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        if a == "timeout":
            raise httpx.ReadTimeout("no answer", request=request)
        if isinstance(a, int):
            return error(a, "db_unavailable")
        return httpx.Response(200, json=video(a, 100 if a == "completed" else 40))

    seen = []
    with mock_client("http://p", handler) as c:
        done = c.wait(VID, timeout=10, interval=0.001, on_progress=lambda v: seen.append(v["status"]))
    assert done["status"] == "completed" and len(polls) == 7
    assert seen == ["in_progress", "completed"]  # failed polls report nothing


@pytest.mark.parametrize("answer", ["not_found", "failed", "bad_request"])
def test_wait_raises_at_once_on_404_failure_and_4xx(answer):
    polls = []

    def handler(request: httpx.Request) -> httpx.Response:
        polls.append(request.url)
        if answer == "failed":
            return httpx.Response(200, json=video("failed", error={"code": "generation_failed", "message": "oom"}))
        return error(404, "video_not_found") if answer == "not_found" else error(400, "invalid_request")

    with mock_client("http://p", handler) as c, pytest.raises(RequestFailed) as e:
        c.wait(VID, timeout=10, interval=0.001)
    assert len(polls) == 1
    if answer == "failed":
        assert e.value.code == "generation_failed" and "oom" in e.value.message
    else:
        assert e.value.status_code == {"not_found": 404, "bad_request": 400}[answer]


def test_wait_gives_up_after_max_errors_in_a_row_or_at_the_timeout():
    polls = []

    def down(request: httpx.Request) -> httpx.Response:
        polls.append(1)
        raise httpx.ConnectError("connection refused", request=request)

    with mock_client("http://p", down) as c:
        with pytest.raises(RequestFailed) as e:
            c.wait(VID, timeout=10, interval=0.001, max_interval=0.001, max_errors=5)
        assert e.value.code == "unreachable" and len(polls) == 6
        polls.clear()
        with pytest.raises(Timeout) as t:
            c.wait(VID, timeout=0.2, interval=0.01, max_interval=0.02, max_errors=10_000)
        assert "refused" in str(t.value) and isinstance(t.value.__cause__, RequestFailed) and len(polls) > 2


def test_another_sets_404_is_not_final_while_the_home_proxy_is_unreachable(tmp_path):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "home":
            raise httpx.ConnectError("connection refused", request=request)
        return error(404, "video_not_found")

    with mock_client(["http://home", "http://other"], handler) as c:
        c._home[VID] = "http://home"
        for call in (lambda: c.status(VID), lambda: c.download(VID, tmp_path / "x.mp4")):
            with pytest.raises(RequestFailed) as e:
                call()
            assert e.value.code == "unreachable" and "do not know" in e.value.message
        # Without a home, every proxy answering 404 is a real 404.
        del c._home[VID]
        c.urls = ["http://other", "http://other2"]
        with pytest.raises(RequestFailed) as e:
            c.status(VID)
        assert e.value.status_code == 404
    assert not (tmp_path / "x.mp4").exists()


def test_proxies_of_several_sets_are_tried_alternately():
    c = Client({"a": ["http://a1/", "http://a2"], "b": ["http://b1"], "c": []})
    assert c.urls == ["http://a1", "http://b1", "http://a2"]
    c.close()


def refusing(plan: dict[str, list], posts: list[str]) -> Callable[[httpx.Request], httpx.Response]:
    """A handler whose proxy ``host`` answers POSTs with ``plan[host]`` in turn: an int is an
    error status (with Retry-After from ``plan["retry_after"]``), "ok" the video object."""
    answers = {host: iter(a) for host, a in plan.items() if host != "retry_after"}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method != "POST":
            return httpx.Response(200, json=video("queued"))
        posts.append(request.url.host)
        a = next(answers[request.url.host])
        if a == "ok":
            return httpx.Response(200, json=video("queued"))
        return httpx.Response(a, headers={"Retry-After": plan["retry_after"]},
                              json={"error": {"message": "full", "code": "inflight_full"}})
    return handler


def test_submit_goes_round_again_after_a_jittered_pause_of_at_least_retry_after(monkeypatch):
    pauses: list[float] = []
    monkeypatch.setattr("onepiece.client.time.sleep", pauses.append)
    monkeypatch.setattr("onepiece.client.random.randrange", lambda n: 0)  # start at the first proxy
    posts: list[str] = []
    handler = refusing({"a": [429, 429, 429], "b": [503, 429, "ok"], "retry_after": "0.3"}, posts)
    with mock_client({"a": ["http://a"], "b": ["http://b"]}, handler, backoff_s=0.2, backoff_cap_s=2.0) as c:
        v = c.submit("x")
        assert v["set"] == "b" and c.set_of(VID) == "b"  # the proxy did not say; the NM's listing does
        assert posts == ["a", "b", "b", "a", "a", "b"]  # each round starts at the next proxy
        assert len(c.last_refusals) == 5 and "(set a)" in c.last_refusals[0]
        # round 1: 0.1-0.2 s of backoff, but Retry-After asks for 0.3; round 2: 0.2-0.4 s, at least 0.3
        assert pauses[0] == 0.3 and 0.3 <= pauses[1] <= 0.4


def test_submit_gives_up_after_the_rounds_with_the_smallest_retry_after(monkeypatch):
    pauses: list[float] = []
    monkeypatch.setattr("onepiece.client.time.sleep", pauses.append)
    posts: list[str] = []
    handler = refusing({"a": [429] * 4, "b": [429] * 4, "retry_after": "30"}, posts)
    with mock_client(["http://a", "http://b"], handler, rounds=4, backoff_cap_s=1.5) as c:
        with pytest.raises(RequestRejected) as e:
            c.submit("x")
    assert len(posts) == 8 and pauses == [1.5, 1.5, 1.5]  # Retry-After honoured, but capped
    assert e.value.retry_after == 30 and e.value.code == "inflight_full" and "after 4 rounds" in e.value.message


def test_reads_stay_within_the_set_that_accepted_the_video(tmp_path):
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.method == "POST":
            return httpx.Response(200, json=video("queued", set="a"))
        asked.append(host)
        if host == "a1":  # the proxy that accepted it went away
            raise httpx.ConnectError("connection refused", request=request)
        if host == "a2":
            return httpx.Response(200, json=video("completed", 100, set="a"))
        return error(404, "video_not_found")  # set b never saw it

    with mock_client({"b": ["http://b1"], "a": ["http://a1", "http://a2"]}, handler) as c:
        c._rr = iter([1])  # start the rotation at a1
        assert c.submit("x")["set"] == "a"
        assert c.status(VID)["status"] == "completed"
        assert asked == ["a1", "a2"]  # the other proxy of set a, before set b's
        assert c._home[VID] == "http://a2"


def test_a_video_this_client_did_not_submit_is_deleted_on_whichever_set_holds_it():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a1":
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.host == "b1":  # set b holds it; set a never saw it
            return httpx.Response(200, json={"id": VID, "object": "video.deleted", "deleted": True})
        return error(404, "video_not_found")

    with mock_client({"a": ["http://a2"], "b": ["http://b1"]}, handler) as c:
        assert c.delete(VID) is True  # (before: only the first proxy, of set a, was asked: False)
    with mock_client({"a": ["http://a2"], "c": ["http://c1"]}, handler) as c:
        assert c.delete(VID) is False  # every set answered that it does not know it
    with mock_client({"a": ["http://a1"], "c": ["http://c1"]}, handler) as c:
        with pytest.raises(RequestFailed) as e:
            c.delete(VID)  # the set that did not answer may hold it
        assert e.value.code == "unreachable"


def test_from_nm_without_a_node_manager_says_so():
    with pytest.raises(RequestFailed) as e:
        Client.from_nm("tcp://127.0.0.1:9", nm_timeout=0.2)
    assert e.value.code == "nm_unreachable"


def test_generate_command(h, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    out = tmp_path / "cli.mp4"
    args = parser.parse_args(["--model", "t2v", "--prompt", "a dog", "--size", "64x64", "--frames", "9",
                              "--steps", "3", "--seed", "4", "--url", h.url, "-o", str(out)])
    assert generate.run(args) == 0
    params = orjson.loads(out.read_bytes()[7:])["params"]
    assert (params["num_frames"], params["steps"], params["seed"]) == (9, 3, 4)
    assert str(out) in capsys.readouterr().out
    assert generate.main(["--prompt", "patient", "--deadline", "42", "--url", h.url, "-o", str(out), "--quiet"]) == 0
    assert orjson.loads(out.read_bytes()[7:])["deadline_s"] == pytest.approx(42)
    assert generate.main(["--prompt", "x", "--deadline", "1e9", "--url", h.url, "-o", str(out), "--quiet"]) == 1
    assert "timeout_s" in capsys.readouterr().err  # the proxy's 400 names the field

    img = tmp_path / "in.png"
    img.write_bytes(H.png())
    assert generate.main(["--model", "i2v", "--prompt", "x", "--image", str(img), "--seconds", "0.5",
                          "--url", h.url, "-o", str(tmp_path / "i.mp4"), "--quiet"]) == 0
    # without --model the image makes it i2v, as the API infers it (t2v refused the image)
    assert generate.main(["--prompt", "x", "--image", str(img), "--url", h.url, "-o", str(tmp_path / "j.mp4"),
                          "--quiet"]) == 0, capsys.readouterr().err
    assert generate.main(["--model", "t2v", "--prompt", "fail now", "--url", h.url, "-o", str(tmp_path / "f.mp4"),
                          "--quiet"]) == 1
    assert "out of memory" in capsys.readouterr().err
    assert generate.main(["--prompt", "x", "--size", "7x7", "--url", h.url, "-o", str(tmp_path / "b.mp4"),
                          "--quiet"]) == 1
    with pytest.raises(SystemExit):  # argparse: --seconds and --frames exclude each other
        parser.parse_args(["--prompt", "x", "--seconds", "1", "--frames", "9", "-o", "y"])


def test_the_client_remembers_a_bounded_number_of_videos(monkeypatch):
    from onepiece.client import _Bounded

    monkeypatch.setattr(_Bounded, "limit", 3)
    m = _Bounded()
    for i in range(5):
        m[f"v{i}"] = "http://a"
    assert list(m) == ["v2", "v3", "v4"]


def test_generate_refuses_an_unwritable_output_before_submitting(tmp_path, capsys):
    from onepiece import generate

    # No proxy listens on port 1: had the request been sent first, the error would be the connection's.
    nowhere = ["--prompt", "x", "--url", "http://127.0.0.1:1", "--rounds", "1", "--quiet"]
    assert generate.main(nowhere + ["-o", str(tmp_path / "missing" / "v.mp4")]) == 1
    assert "cannot write there" in capsys.readouterr().err
    assert generate.main(nowhere + ["-o", str(tmp_path)]) == 1
    assert "is a directory" in capsys.readouterr().err
    os.mkfifo(tmp_path / "pipe")  # a device or a FIFO: the MP4 would replace it
    assert generate.main(nowhere + ["-o", str(tmp_path / "pipe")]) == 1
    assert "not a regular file" in capsys.readouterr().err
    (tmp_path / "pipe").unlink()
    assert not list(tmp_path.iterdir())  # the probe left nothing behind


def test_a_set_that_refuses_the_key_is_passed_over_and_alone_it_fails_at_once(monkeypatch):
    """Real proxies of two sets with their own key files: the caller's key is the second's."""
    from onepiece.proxy.keys import ApiKeys, new_key

    mine, theirs = new_key(), new_key()
    a, b = H.Harness(keys=ApiKeys([theirs])), H.Harness(keys=ApiKeys([mine]))
    pauses: list[float] = []
    monkeypatch.setattr("onepiece.client.time.sleep", pauses.append)
    try:
        with Client({"a": [a.url], "b": [b.url]}, api_key=mine) as c:
            for i in range(4):  # whichever the rotation tries first
                c.submit(f"p{i}")
                assert b.recv().uid  # b took it
        with Client({"a": [a.url]}, api_key=mine) as c:
            with pytest.raises(RequestFailed) as e:
                c.submit("x")
        assert e.value.status_code == 401 and pauses == []  # no rounds of retries: a key does not change
    finally:
        a.close()
        b.close()


def test_a_create_whose_answer_was_lost_is_offered_only_to_that_set_again(monkeypatch):
    """A proxy that takes the POST and never answers (stalled: the request may be in its set) and
    a healthy set: the client tries the stalled set's proxies only, so no second video is made
    elsewhere. A proxy that refuses the connection is passed over as before."""
    import socket

    stalled = socket.create_server(("127.0.0.1", 0))
    good = H.Harness()
    url = f"http://127.0.0.1:{stalled.getsockname()[1]}"
    monkeypatch.setattr("onepiece.client.random.randrange", lambda n: 0)  # the first round starts at the stalled one
    try:
        with Client({"a": [url], "set0": [good.url]}, timeout=0.5, rounds=2, backoff_s=0.0) as c:
            with pytest.raises(RequestFailed) as e:
                c.submit("x")
            assert e.value.code == "unreachable" and any("trying only set a" in r for r in c.last_refusals)
        assert good.entrance.recv(0.5) is None  # the healthy set never got it
        with Client({"a": [DEAD], "set0": [good.url]}, rounds=1) as c:
            assert c.submit("y")["set"] == "set0"  # refused outright: it never reached set a
    finally:
        stalled.close()
        good.close()


class _Answering:
    """A real HTTP server (stdlib, a thread) that answers every request with ``answer``:
    (status, content type, body[, Content-Length larger than the body, to cut it off]), or
    with ``fn(path) -> answer``."""

    def __init__(self, answer) -> None:
        import http.server

        fn = answer if callable(answer) else (lambda path: answer)

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                status, ctype, body, *length = fn(self.path)  # a length over the body's: cut off
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(length[0] if length else len(body)))
                self.close_connection = bool(length)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("answer", [
    (200, "text/html", b"<html>a web server, not a proxy</html>"),
    (200, "application/json", b'{"object": "video", "status": "queued"}'),  # no id
    (200, "application/json", b"[1, 2]"),
    (200, "application/json", b"null"),
])
def test_an_answer_that_is_not_a_video_object_is_a_clear_error(answer, tmp_path, capsys):
    s = _Answering(answer)
    try:
        with Client(s.url, rounds=1) as c:
            with pytest.raises(RequestFailed) as e:
                c.submit("x")
            assert e.value.code == "bad_response" and "not a video object" in e.value.message
            with pytest.raises(RequestFailed) as e:
                c.status(VID)
            assert e.value.code == "bad_response" and answer[1] in e.value.message
        assert generate.main(["--prompt", "x", "--url", s.url, "-o", str(tmp_path / "v.mp4"), "--quiet"]) == 1
        assert "not a video object" in capsys.readouterr().err
    finally:
        s.close()


def test_a_failed_video_whose_error_is_a_bare_message_says_it():
    body = orjson.dumps(video("failed", error="the gateway says no"))
    s = _Answering((200, "application/json", body))
    try:
        with Client(s.url) as c, pytest.raises(RequestFailed) as e:
            c.wait(VID, timeout=10)
        assert "the gateway says no" in e.value.message
    finally:
        s.close()


def test_ctrl_c_while_waiting_names_the_video_it_leaves(tmp_path):
    """SIGINT to a real `onepiece generate` polling a video that never finishes: it exits at
    once with 130, naming the video (its only handle on it), and writes no MP4."""
    import signal
    import subprocess

    from waiting import wait_for

    polls: list[str] = []

    def answer(path: str):
        if path.startswith(f"/v1/videos/{VID}"):
            polls.append(path)
        return 200, "application/json", orjson.dumps(video("in_progress", 40, set="s1"))

    s = _Answering(answer)
    out = tmp_path / "v.mp4"
    p = subprocess.Popen([sys.executable, "-m", "onepiece", "generate", "--prompt", "x", "--url", s.url,
                          "-o", str(out), "--quiet"], stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: polls, timeout=60, what="generate polling the video")
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=20)
    finally:
        p.kill()
        s.close()
    assert p.returncode == 130
    assert f"interrupted: video {VID} on set s1" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_a_download_cut_off_or_refused_for_a_while_starts_again(tmp_path):
    """A proxy restarting under a download (the transfer broken off, then 503s) costs a retry,
    not the finished video; a download that keeps failing gives up after its tries."""
    answers = iter([(200, "video/mp4", b"FAKEMP4 partial", 10_000), (503, "application/json", b"{}"),
                    (200, "video/mp4", b"FAKEMP4 whole")])
    s = _Answering(lambda path: next(answers))
    out = tmp_path / "v.mp4"
    try:
        with Client(s.url, backoff_s=0.01) as c:
            assert c.download(VID, out).read_bytes() == b"FAKEMP4 whole"
    finally:
        s.close()
    cuts: list[str] = []
    s = _Answering(lambda path: cuts.append(path) or (200, "video/mp4", b"FAKEMP4", 10_000))
    try:
        with Client(s.url, backoff_s=0.01) as c, pytest.raises(RequestFailed) as e:
            c.download(VID, tmp_path / "w.mp4", tries=3)
        assert e.value.code == "download_failed" and len(cuts) == 3
    finally:
        s.close()
    assert [p.name for p in tmp_path.iterdir()] == ["v.mp4"]  # no partial file left


def test_a_proxy_that_never_answers_does_not_hold_wait_past_its_timeout():
    """A proxy that takes the connection and never answers (hung, or a host gone without a
    reset): wait(timeout=1) gives up about then, not after the client's 30 s per proxy."""
    import time

    release = threading.Event()
    s = _Answering(lambda path: release.wait(60) and (503, "application/json", b"{}"))
    try:
        with Client(s.url, timeout=30) as c:
            t = time.monotonic()
            with pytest.raises(Timeout):
                c.wait(VID, timeout=1)
            assert time.monotonic() - t < 10
    finally:
        release.set()
        s.close()


def test_generate_refuses_a_node_manager_address_that_is_not_one(tmp_path, capsys):
    """--nm http://... (a proxy's URL) is a usage error, as for `onepiece status`, not a traceback."""
    with pytest.raises(SystemExit) as e:
        generate.main(["--prompt", "x", "--nm", "http://127.0.0.1:1", "-o", str(tmp_path / "v.mp4")])
    assert e.value.code == 2 and "scheme 'http' is not one of" in capsys.readouterr().err
