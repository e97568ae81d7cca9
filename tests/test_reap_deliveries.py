"""A request that reached an instance after its last heartbeat, before a SIGKILL, is reported
`failed` with "instance died" within the NM's dead limit plus a heartbeat, not at its deadline
(issue 15, item 4): its sender reported the delivery with its own heartbeat (nm/holdings.py
``Deliveries``), and the NM reaps it with what the instance held (nm/deliveries.py). The ledger
directly, then a real `onepiece up` whose denoiser is stopped (SIGSTOP: it heartbeats no more
and reads nothing), handed a request, and killed."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from onepiece.client import Client, RequestFailed
from onepiece.db.client import DbClient
from onepiece.launcher import free_tcp_address
from onepiece.nm.client import NmClient
from onepiece.nm.deliveries import DeliveryLedger, Grave
from onepiece.nm.holdings import Deliveries
from onepiece.nm.liveness import LivenessSpec
from onepiece.proxy.api import uid_of
from deployment import Up
from waiting import wait_for

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

HEARTBEAT_S = 0.25
DEAD_AFTER_S = 4.0  # room for the request to reach the stopped denoiser before the NM drops it


def test_a_senders_report_dates_each_delivery_and_stays_within_its_window():
    sent = Deliveries()
    sent.add("ipc://a", "u1")
    sent.add("ipc://b", "u2")
    report = sent.report(window_s=10.0)
    assert set(report) == {"ipc://a", "ipc://b"} and report["ipc://a"][0][0] == "u1"
    assert 0 <= report["ipc://a"][0][1] < 1.0
    time.sleep(0.05)
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
    dep = Up(topology, folder / "logs", nm)
    try:
        dep.url = dep.wait_for(r"serves the API at (http://\S+)", timeout=240).group(1)
        yield dep
    finally:
        dep.stop()


def _stage_process(up: Up, stage: str) -> psutil.Process:
    (proc,) = [p for p in psutil.Process(up.proc.pid).children() if f"--stage {stage} " in " ".join(p.cmdline()) + " "]
    return proc


def test_a_request_delivered_after_the_last_heartbeat_fails_as_instance_died_within_the_bound(up):
    nm = NmClient(up.nm)
    db = DbClient([d["control"] for d in up.routes()["dbs"]])
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
            denoiser.suspend()
            v = c.submit("lost in the socket", model="t2v", size="32x32", num_frames=5, steps=2, timeout_s=300)
            # The text encoder did its part and handed the request on (it holds it no more).
            uid = uid_of(v["id"])
            wait_for(lambda: db.get(uid)["stage"] == "text_encode" and text_encoder()["holding"] == 0
                     and text_encoder()["silent_s"] < HEARTBEAT_S, timeout=30,
                     what="the request handed to the denoiser")
            time.sleep(HEARTBEAT_S)  # the sender's next heartbeat names the delivery
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
    finally:
        nm.close()
        db.close()
        if denoiser.is_running():
            denoiser.kill()
