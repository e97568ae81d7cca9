"""What a SIGKILL in the middle of a hand-over leaves behind still ends (issue 15, item 4).

- A request that reached an instance after its last heartbeat is reported `failed` with
  "instance died" within the NM's dead limit plus a heartbeat, not at its deadline: its sender
  reported the delivery with its own heartbeat (nm/holdings.py ``Deliveries``), and the NM reaps
  it with what the instance held (nm/deliveries.py). The ledger directly, then a real `onepiece
  up` whose denoiser is stopped (SIGSTOP: it heartbeats no more and reads nothing), handed a
  request, and killed; its restart takes its place under its name.
- A proxy killed after it stored a create and before it handed it over: the client's retry with
  the same Idempotency-Key, at the restarted proxy, gets the same video, handed over by that
  proxy (proxy/idempotency.py), and it completes."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from onepiece.client import Client, RequestFailed
from onepiece.db.client import DbClient
from onepiece.launcher import free_tcp_address
from onepiece.nm.client import NmClient
from onepiece.nm.deliveries import DeliveryLedger, Grave
from onepiece.nm.holdings import Deliveries
from onepiece.nm.liveness import LivenessSpec
from onepiece.proxy.idempotency import handing, idempotent_uid
from onepiece.proxy.keys import ANYONE
from deployment import Up, serving
from waiting import wait_for

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

HEARTBEAT_S = 0.25
DEAD_AFTER_S = 4.0  # room for the request to reach the stopped denoiser before the NM drops it


def test_a_senders_report_dates_each_delivery_and_stays_within_its_window():
    now = [100.0]
    sent = Deliveries(clock=lambda: now[0])  # a clock the test moves: no waiting
    sent.add("ipc://a", "u1")
    sent.add("ipc://b", "u2")
    report = sent.report(window_s=10.0)
    assert set(report) == {"ipc://a", "ipc://b"} and report["ipc://a"][0][0] == "u1"
    assert 0 <= report["ipc://a"][0][1] < 1.0
    now[0] += 0.05
    assert sent.report(window_s=0.01) == {}  # older than the window: no longer repeated


def test_the_ledger_names_what_reached_an_address_since_a_time_until_another_instance_took_it():
    ledger = DeliveryLedger(horizon_s=20.0)
    ledger.record({"ipc://b": [("old", 5.0), ("new", 0.5)]}, now=100.0)  # delivered at 95.0 and 99.5
    assert ledger.sent_to("ipc://b", since=98.0) == ["new"]
    ledger.revive("ipc://b", now=101.0)  # a restarted instance bound the same address
    ledger.record({"ipc://b": [("newcomers", 0.0)]}, now=102.0)
    assert ledger.sent_to("ipc://b", since=98.0) == ["new"]
    assert ledger.sent_to("ipc://b", since=101.5) == ["newcomers"]
    ledger.prune(now=116.0)  # past the horizon: forgotten
    assert ledger.sent_to("ipc://b", since=0.0) == ["new"]
    ledger.prune(now=125.0)
    assert ledger.sent_to("ipc://b", since=0.0) == []


def test_a_delivery_reported_after_the_death_is_reaped_once_and_not_after_a_newcomer_registered():
    ledger = DeliveryLedger(horizon_s=20.0)
    grave = Grave("stage-x-3", "denoise_t2v", "set0", since=99.0, until=120.0, reason="silent", reaped={"held"})
    ledger.bury("ipc://b", grave)
    # The sender had not heard of the death: its next heartbeat names two deliveries there.
    late = ledger.record({"ipc://b": [("held", 0.2), ("lost", 0.3), ("before", 3.0)]}, now=101.0)
    assert late == [(grave, ["lost"])]  # not the one already reaped, nor one from before it was last heard
    assert ledger.record({"ipc://b": [("lost", 0.5)]}, now=101.2) == []  # repeated: reaped once
    ledger.revive("ipc://b", now=102.0)
    assert ledger.record({"ipc://b": [("fresh", 0.0)]}, now=103.0) == []


@pytest.fixture(scope="module")
def up(tiny_models, tmp_path_factory, make_topology):
    folder = tmp_path_factory.mktemp("deliveries")
    nm = free_tcp_address()
    # Over TCP a restarted instance binds a new port: what was sent to the killed one is lost
    # with it (over ipc the restarted one takes its socket path, and ZeroMQ hands it what its
    # sender still queued, which the NM then sees held there and leaves alone).
    topology = make_topology(folder, tiny_models, nm, dbs=1, transport="tcp", heartbeat_s=HEARTBEAT_S,
                             nm={"dead_after_s": DEAD_AFTER_S},
                             stages={"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1})
    with serving(topology, folder / "logs", nm) as dep:
        yield dep


def _stage_process(up: Up, stage: str) -> psutil.Process:
    (proc,) = [p for p in psutil.Process(up.proc.pid).children() if f"--stage {stage} " in " ".join(p.cmdline()) + " "]
    return proc


@pytest.mark.exclusive
def test_a_request_delivered_after_the_last_heartbeat_fails_as_instance_died_within_the_bound(up):
    nm = NmClient(up.nm)
    denoiser = _stage_process(up, "denoise_t2v")

    def text_encoder() -> dict:
        (inst,) = nm.status()["sets"]["set0"]["stages"]["text_encode"]["instances"]
        return inst

    try:
        with Client(up.url) as c:
            # A first request warms every stage up (a cold one may outlast the dead limit).
            warm = c.submit("warm up", model="t2v", size="32x32", num_frames=5, steps=2)
            assert c.wait(warm["id"], timeout=120)["status"] == "completed"
            # Stopped, the denoiser heartbeats no more and reads nothing: whatever reaches it
            # now reached it after its last heartbeat.
            done = wait_for(lambda: text_encoder()["stats"].get("completed"), timeout=10, what="the warm-up counted")
            denoiser.suspend()
            v = c.submit("lost in the socket", model="t2v", size="32x32", num_frames=5, steps=2, timeout_s=300)
            # The text encoder did its part and handed the request on: it holds it no more, which it
            # does until the delivery is recorded (the record's stage says text_encode from the
            # start, and a kill before the hand-over let the request wait for the restart).
            wait_for(lambda: (te := text_encoder())["stats"].get("completed", 0) > done and te["holding"] == 0
                     and te["silent_s"] < HEARTBEAT_S, timeout=30, what="the request handed to the denoiser")
            handed = time.monotonic()  # the sender's next heartbeat names the delivery
            wait_for(lambda: text_encoder()["silent_s"] < time.monotonic() - handed, timeout=10,
                     what="a heartbeat of the text encoder after the hand-over")
            os.kill(denoiser.pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(RequestFailed) as e:
                c.wait(v["id"], timeout=60)
            took = time.monotonic() - killed
        error = e.value.video["error"]["message"]
        print(f"\nfailed {took:.1f}s after the kill: {error}")
        assert "died" in error and "deadline" not in error, error
        limit = LivenessSpec(HEARTBEAT_S, DEAD_AFTER_S).limit_s
        # Within the dead limit and a heartbeat (plus the client's polling and a loaded machine).
        assert took < limit + HEARTBEAT_S + 3.0, (took, error)

        # The launcher restarts it; the new process takes the dead one's place under the same id
        # (its name, nm/identity.py): one instance of the stage, the new process, ready.
        def restarted() -> bool:
            insts = nm.status()["sets"]["set0"]["stages"]["denoise_t2v"]["instances"]
            seen = [(i["id"], i["ready"], i["pid"] != denoiser.pid) for i in insts]
            return seen == [("set0-denoise_t2v0", True, True)]
        wait_for(restarted, timeout=120, what="the restarted denoiser ready under its name")
    finally:
        nm.close()
        if denoiser.is_running():
            denoiser.kill()


def _exited(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _proxy_process(up: Up) -> psutil.Process:
    (proc,) = [p for p in psutil.Process(up.proc.pid).children() if " proxy " in " ".join(p.cmdline())]
    return proc


def test_the_handing_rule():
    queued = {"status": "queued", "progress": 0, "created_at": 100.0}
    assert handing({**queued, "handed": True}, now_s=100.5, handover_s=3.0) == ("replay", 0.0)
    assert handing({**queued, "status": "in_progress", "progress": 10}, now_s=100.5, handover_s=3.0)[0] == "replay"
    assert handing({**queued, "status": "completed"}, now_s=200.0, handover_s=3.0)[0] == "replay"
    what, left = handing(queued, now_s=101.0, handover_s=3.0)
    assert what == "wait" and 0 < left < 6  # its first proxy may still be handing it over
    assert handing(queued, now_s=110.0, handover_s=3.0) == ("resend", 0.0)


@pytest.mark.exclusive
def test_a_create_stored_by_a_proxy_killed_before_the_hand_over_is_handed_over_by_the_retry(up):
    key = "proxy-killed-mid-post"
    uid = idempotent_uid(ANYONE, key)  # no API keys here: every caller is one
    db = DbClient([d["control"] for d in up.routes()["dbs"]])
    entrance, proxy = _stage_process(up, "text_encode"), _proxy_process(up)
    old_url = up.routes()["proxies"][0]
    body = {"prompt": "stored, never handed over", "model": "t2v", "size": "32x32", "num_frames": 5, "steps": 2}
    first: list = []
    try:
        # t2v can be served (the denoiser the test before killed is back, in the proxy's view too).
        wait_for(lambda: _ready(old_url), timeout=120, interval=0.2, what="t2v ready")
        # With its only entrance gone (killed, still routed until the NM notices), the proxy's
        # hand-over waits for a receiver: the create is stored and not handed over yet.
        entrance.kill()
        # Until the kernel has closed its sockets (a zombie, or gone), a send can still land in
        # them and count as handed over (one run here: marked handed, the request lost).
        wait_for(lambda: _exited(entrance), timeout=10, interval=0.005, what="the killed entrance's exit")
        post = threading.Thread(target=lambda: first.append(_post(old_url, body, key)), daemon=True)
        post.start()
        wait_for(lambda: db.get(uid), timeout=10, interval=0.01, what="the create stored")
        proxy.suspend()  # at once, mid-hand-over
        proxy.kill()
        post.join(15)
        assert first and isinstance(first[0], httpx.HTTPError), first  # the client got no answer
        assert (db.get(uid)["status"], db.get(uid).get("handed")) == ("queued", None)

        # The launcher restarts both; the client retries with the same key at the new proxy.
        url = wait_for(lambda: next((u for u in up.routes()["proxies"] if u != old_url), None), timeout=60,
                       what="the restarted proxy routed")

        def accepted() -> httpx.Response | None:
            r = _post(url, body, key)
            if isinstance(r, httpx.Response) and r.status_code == 200:
                return r
            # 409 (its first proxy might still be handing it over), 429 or 503 (the restarted
            # entrance not serving yet): a retry later, as told
            assert isinstance(r, httpx.HTTPError) or r.status_code in (409, 429, 503), r.text
            return None
        r = wait_for(accepted, timeout=60, interval=1.0, what="the retry accepted")
        assert r.json()["id"] == f"video_{uid}" and r.headers["idempotent-replayed"] == "true"
        with Client(url) as c:
            assert c.wait(r.json()["id"], timeout=60)["status"] == "completed"
        assert db.get(uid)["handed"] is True
    finally:
        db.close()
        for p in (entrance, proxy):
            if p.is_running():
                p.kill()


def _post(url: str, body: dict, key: str) -> "httpx.Response | httpx.HTTPError":
    try:
        return httpx.post(f"{url}/v1/videos", json=body, headers={"Idempotency-Key": key}, timeout=10)
    except httpx.HTTPError as e:
        return e


def _ready(url: str) -> bool:
    """Whether t2v can be served (this set has no i2v stages, so /readyz as a whole never is)."""
    try:
        missing = httpx.get(f"{url}/readyz", timeout=5).json()["missing"]
    except httpx.HTTPError:
        return False
    return not [m for m in missing if not m.startswith("i2v:")]
