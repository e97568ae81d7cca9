"""Elastic assignment with real processes (DESIGN §9): `onepiece up`'s Deployment on the tiny
models, the embedded NM with a short window, a closed-loop load of denoise-heavy requests
(the proxy's request monitor off, so the load reaches denoise instead of being refused), every
stage worker on one torch thread.

1. text_encode ×1, denoise_t2v ×1, vae_decode ×2: denoise saturates while vae_decode idles;
   the NM moves a vae_decode instance to denoise_t2v, throughput rises (measured before and
   after in this run), and every request completes. Then an operator moves a denoise
   instance while it holds requests: they complete, nothing fails. Then an instance an
   operator moved dies, and its restarted process serves where it had been moved.
2. One instance of each stage plus one in the idle pool: the idle instance goes to denoise
   under load, and returns to the pool once the load is gone (low watermark); when the only
   vae_decode instance is killed, the idle instance refills it (its floor) at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from onepiece.bench.elastic import Load, instance, request_body, write_topology
from onepiece.launcher import Deployment, free_tcp_address
from onepiece.nm.client import NmClient
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

BODY = request_body("32x32x5:100")
WINDOW = 3.0


def start(folder: Path, models: dict[str, Path], window_s: float = WINDOW, **kw) -> tuple[Deployment, NmClient, str]:
    address = free_tcp_address()
    dep = Deployment(write_topology(folder, models, address, window_s=window_s, **kw), folder / "logs")
    dep.start()
    url = dep.wait_ready(180)["set0"][0]
    return dep, NmClient(address), url


def decisions(nm: NmClient) -> list[dict]:
    return nm.status()["elastic"]["decisions"]


def serving(nm: NmClient, inst_id: str, stage: str | None) -> dict | None:
    """The instance once it serves ``stage`` and took a request there (stage None: in the idle pool)."""
    i = instance(nm.status(), inst_id)
    if i is None:
        return None
    if stage is None:
        return i if i["stage"] is None and i["serving"] is None else None
    return i if i["serving"] == stage and i["ready"] and i["stats"].get("received", 0) >= 1 else None


@pytest.fixture(scope="module")
def donor_set(tiny_models, tmp_path_factory):
    # A longer window here: the throughput before the move is measured over it.
    dep, nm, url = start(tmp_path_factory.mktemp("elastic"), tiny_models, window_s=2 * WINDOW, cooldown_s=WINDOW,
                         low=0.0)
    try:
        yield dep, nm, url
    finally:
        nm.close()
        dep.stop()


@pytest.mark.exclusive
def test_saturated_denoise_takes_an_idle_stage_instance_and_throughput_rises(donor_set):
    dep, nm, url = donor_set
    load = Load(url, BODY, clients=4, deadline=time.monotonic() + 150).start()
    t0 = time.monotonic()
    try:
        move = wait_for(lambda: next((d for d in decisions(nm) if d["to"] == "denoise_t2v"), None), 60,
                        "the NM to move an instance to denoise_t2v")
        t_move = time.monotonic()
        wait_for(lambda: serving(nm, move["instance"], "denoise_t2v"), 60, "the moved instance to serve denoise_t2v")
        t_serving = time.monotonic()
        # Two denoise instances under the same load, over a window (6 s) at least as long as the
        # one before the move (the window_s of 6 s less the first second). The closed loop's rate
        # is steady: over these 6 s it was within 1.5% of the rate over 11 s (3 runs, 2026-11-27).
        time.sleep(7)
        t_end = time.monotonic()
    finally:
        load.finish(timeout=60)
    assert move["from"] == "vae_decode", move
    assert move["inputs"]["denoise_t2v"]["util"] >= 0.85 and move["inputs"]["vae_decode"]["util"] < 0.5, move
    assert "denoise_t2v busy" in move["reason"] and "can spare one" in move["reason"]
    before, after = load.rate(t0 + 1, t_move), load.rate(t_serving + 1, t_end)
    print(f"\nmove decided {t_move - t0:.1f}s after the load began, serving {t_serving - t_move:.1f}s later; "
          f"throughput {before:.2f} -> {after:.2f} req/s; {len(load.outcomes)} requests")
    # (a second denoise instance on 2 cores: 1.37x to 2.46x in bench elastic's rounds of
    # 2026-11-22, 1.45x to 1.67x on 2026-11-26; both rates are counts over windows of seconds,
    # so a margin below the least of them)
    assert after >= 1.15 * before, (before, after)
    assert load.bad() == [] and len(load.outcomes) >= 10
    # the decision and its inputs, as an operator sees them
    out = subprocess.run([sys.executable, "-m", "onepiece", "status", "--nm", nm.address],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{move['instance']} vae_decode -> denoise_t2v" in out.stdout and "elastic assignment: on" in out.stdout
    log = dep.log_dir / next(f.name for f in dep.log_dir.glob("set0-vae_decode*.log")
                             if f"{move['instance']} moving from vae_decode" in f.read_text())
    assert "drained vae_decode" in log.read_text() and "gave up" not in log.read_text()


def test_an_operator_moves_an_instance_while_it_holds_requests_and_none_is_lost(donor_set):
    dep, nm, url = donor_set
    load = Load(url, BODY, clients=4, deadline=time.monotonic() + 150).start()
    try:
        def busy_denoise():
            st = nm.status()["sets"]["set0"]["stages"]["denoise_t2v"]["instances"]
            return next((i for i in st if i["ready"] and i["holding"] >= 1 and i["stats"].get("busy", 0) >= 1), None)

        victim = wait_for(busy_denoise, 60, "a denoise_t2v instance working on a request")
        out = subprocess.run([sys.executable, "-m", "onepiece", "move", victim["id"], "vae_decode", "--nm", nm.address],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert f"moving {victim['id']} from denoise_t2v to vae_decode" in out.stdout
        d = next(d for d in reversed(decisions(nm)) if d["instance"] == victim["id"] and d["to"] == "vae_decode")
        assert d["reason"] == "asked by an operator" and d["holding"] >= 1, d
        wait_for(lambda: serving(nm, victim["id"], "vae_decode"), 90, "the moved instance to serve vae_decode")
    finally:
        load.finish(timeout=60)
    assert load.bad() == [] and len(load.outcomes) >= 4
    text = "".join(f.read_text() for f in dep.log_dir.glob("set0-*.log"))
    assert f"{victim['id']} drained denoise_t2v" in text and "gave up" not in text


def test_a_moved_instance_that_dies_comes_back_at_the_stage_it_was_moved_to(donor_set):
    """`onepiece up`'s supervisor restarts a dead stage process with its own --stage pin and
    --name; the NM puts the new process, under the same id, where the old one had been moved
    (here by an operator), not back at the pin. (On the first test's deployment, idle by now: no load, no moves.)"""
    dep, nm, url = donor_set
    stop = threading.Event()
    supervisor = threading.Thread(target=dep.supervise, args=(stop,), daemon=True)
    supervisor.start()
    try:
        st = next(i for i in nm.status()["sets"]["set0"]["stages"]["vae_decode"]["instances"]
                  if i["name"].startswith("set0-vae_decode") and i["ready"])
        nm.move(st["id"], "denoise_t2v")
        wait_for(lambda: (i := instance(nm.status(), st["id"])) and i["ready"] and i["serving"] == "denoise_t2v",
                 90, "the moved instance to serve denoise_t2v")
        os.kill(st["pid"], signal.SIGKILL)

        def named(stage: str) -> list[dict]:
            return [i for i in nm.status()["sets"]["set0"]["stages"][stage]["instances"] if i["name"] == st["name"]]

        again = wait_for(lambda: next((i for i in named("denoise_t2v") if i["pid"] != st["pid"] and i["ready"]
                                       and i["serving"] == "denoise_t2v"), None),
                         120, "the restarted process to serve denoise_t2v")
        # The same id (its name, nm/identity.py), one instance of the name, the new process.
        assert again["id"] == st["id"] == st["name"] and len(named("denoise_t2v")) == 1 and named("vae_decode") == []
        assert any("where it was moved before it restarted" in e for e in nm.status()["events"])
    finally:
        stop.set()
        supervisor.join(5)


@pytest.fixture
def pool_set(tiny_models, tmp_path):
    # cold over two windows: the load stops at once here, no lull to tell from its end. Windows
    # of 2 s, not the module's 3: no rate is measured over them here, and each decision is on a
    # stage plainly saturated (denoise under three clients), idle (no load) or below its minimum.
    dep, nm, url = start(tmp_path, tiny_models, window_s=2.0, cooldown_s=2.0, low=0.3, cold_windows=2,
                         stages={"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1}, idle=1)
    try:
        yield dep, nm, url
    finally:
        nm.close()
        dep.stop()


@pytest.mark.exclusive
def test_the_idle_pool_serves_under_load_and_takes_the_instance_back_when_load_is_gone(pool_set):
    _, nm, url = pool_set
    idle = nm.status()["sets"]["set0"]["idle"]
    assert len(idle) == 1 and idle[0]["stage"] is None
    pooled = idle[0]["id"]
    load = Load(url, BODY, clients=3, deadline=time.monotonic() + 120).start()
    try:
        move = wait_for(lambda: next((d for d in decisions(nm) if d["to"] == "denoise_t2v"), None), 60,
                        "the NM to give denoise_t2v the idle instance")
        assert (move["instance"], move["from"]) == (pooled, None) and "from the idle pool" in move["reason"]
        wait_for(lambda: serving(nm, pooled, "denoise_t2v"), 60, "the pooled instance to serve denoise_t2v")
    finally:
        load.finish(timeout=60)
    assert load.bad() == []
    back = wait_for(lambda: next((d for d in decisions(nm) if d["to"] is None), None), 60,
                    "an instance to return to the idle pool")
    assert back["from"] == "denoise_t2v" and "returns to the idle pool" in back["reason"], \
        [(d["instance"], d["from"], d["to"], d["reason"]) for d in decisions(nm)]
    wait_for(lambda: serving(nm, back["instance"], None), 30, "the returned instance to leave denoise_t2v")
    st = nm.status()["sets"]["set0"]
    assert [i["id"] for i in st["idle"]] == [back["instance"]]
    assert len(st["stages"]["denoise_t2v"]["instances"]) == 1

    # The only vae_decode instance is SIGKILLed (nothing restarts it here): once the NM finds
    # it dead the stage is below its minimum, and the idle instance refills it at once, with
    # no load and before any utilization window.
    (decoder,) = st["stages"]["vae_decode"]["instances"]
    os.kill(decoder["pid"], signal.SIGKILL)
    refill = wait_for(lambda: next((d for d in decisions(nm) if d["to"] == "vae_decode"), None), 60,
                      "the NM to refill vae_decode from the idle pool")
    assert (refill["instance"], refill["from"]) == (back["instance"], None), refill
    assert "below its minimum 1" in refill["reason"], refill["reason"]
    wait_for(lambda: (i := instance(nm.status(), back["instance"])) and i["ready"] and i["serving"] == "vae_decode",
             60, "the refilled vae_decode serving")
