"""The request monitor with real processes: a deployment (NM, one DB, text_encode, two
denoise_t2v instances, vae_decode, one proxy) on the tiny models, where the proxy admits at
the capacity the NM measures.

1. SIGKILL one of the two denoise instances (the bottleneck): within a few seconds the NM
   drops it, and the proxy's capacity view and admitted rate fall to about half.
2. Open-loop load well above the remaining capacity: a steady share of 429s (with reason and
   Retry-After) all through the run, while every accepted request completes.

The shape is denoise-heavy (many steps at 32x32) so that denoise_t2v stays the bottleneck with
two instances, and every stage worker runs one torch thread so the processes do not fight
over the cores. Every loop here is bounded.
"""

from __future__ import annotations

import base64
import concurrent.futures
import math
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from onepiece.launcher import Deployment, free_tcp_address
from onepiece.nm.client import NmClient

import cores
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.exclusive, pytest.mark.filterwarnings("ignore::ResourceWarning")]

SHAPE = {"size": "32x32", "num_frames": 5, "steps": 100}


def healthz(url: str) -> dict:
    return httpx.get(f"{url}/healthz", timeout=5).json()


def t2v_admission(url: str) -> dict:
    return healthz(url)["admission"]["apps"]["t2v"]



def run_one(http: httpx.Client, prompt: str, timeout: float = 30.0) -> dict:
    """Submit and wait for the result (a sequential client)."""
    r = http.post("/v1/videos", json={"prompt": prompt, "model": "t2v", **SHAPE})
    assert r.status_code == 200, r.text
    vid = r.json()["id"]
    return wait_for(lambda: ended(http, vid), timeout, f"{vid} done")


def ended(http: httpx.Client, vid: str) -> dict | None:
    """The video object once it is completed or failed (None before)."""
    v = http.get(f"/v1/videos/{vid}").json()
    return v if v["status"] in ("completed", "failed") else None


POLL_S = 0.1  # what a latency measured by polling may overshoot by


def open_loop(url: str, n: int, rate: float, body: dict) -> list[dict]:
    """``n`` creates at ``rate`` a second, a thread each (open loop); an accepted one is polled
    every ``POLL_S`` until it is done (bounded by 60 s). Not faster: two dozen threads polling
    every 20 ms were over a thousand GETs a second, on the two cores the stages compute on."""
    http = httpx.Client(base_url=url, timeout=30, limits=httpx.Limits(max_connections=64))

    def send(i: int, at: float) -> dict:
        time.sleep(max(0.0, at - time.monotonic()))
        t0 = time.monotonic()
        r = http.post("/v1/videos", json={"prompt": f"load {i}", "model": "t2v", **body})
        out = {"i": i, "sent": t0, "answer_s": time.monotonic() - t0, "status": r.status_code}
        if r.status_code != 200:
            out["code"] = r.json()["error"]["code"]
            out["retry_after"] = r.headers.get("retry-after")
            return out
        vid = r.json()["id"]
        try:
            v = wait_for(lambda: ended(http, vid), t0 + 60 - time.monotonic(), f"{vid} done", interval=POLL_S)
        except AssertionError:
            return out  # not done within 60 s: no "done", which the tests assert on
        out.update(done=v["status"], latency=time.monotonic() - t0, error=v.get("error"))
        return out

    start = time.monotonic() + 0.2
    try:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            return list(pool.map(lambda i: send(i, start + i / rate), range(n)))
    finally:
        http.close()


@pytest.fixture(scope="module")
def deployment(tiny_models, tmp_path_factory, make_topology):
    folder = tmp_path_factory.mktemp("monitor")
    nm = free_tcp_address()
    topology = make_topology(folder, tiny_models, nm, dbs=1,
                             stages={"text_encode": 1, "denoise_t2v": 2, "vae_decode": 1},
                             nm={"elastic": {"enabled": False}}, threads=1,  # capacity changes here by kills only
                             # a looser default deadline, so that the load below meets the rate
                             # limit (over_capacity) before the deadline rule refuses it
                             proxy={"deadline_factor": 4.0},
                             # a first-come bottleneck: the rate limit holds (behind slo or edf the
                             # deadline rule alone admits; tests/test_admission.py, bench sched)
                             schedule={"denoise_t2v": {"policy": "fcfs-batched", "max_batch": 4}})
    dep = Deployment(Path(topology), folder / "logs")
    dep.nm = nm
    try:
        dep.start()
        dep.url = dep.wait_ready(120)["set0"][0]
        cores.alone()  # what the warm-up measures, the tests rely on
        with httpx.Client(base_url=dep.url, timeout=30) as http:
            # Measure every stage (both denoise instances take turns) so the capacity is known.
            alone = []
            for i in range(6):
                t0 = time.monotonic()
                assert run_one(http, f"warm-up {i}")["status"] == "completed"
                alone.append(time.monotonic() - t0)
            dep.alone_s = sorted(alone[2:])[2]  # one at a time, past the first (slow) requests
        wait_for(lambda: t2v_admission(dep.url)["capacity"], 10, "a capacity estimate at the proxy")
        yield dep
    finally:
        dep.stop()


def test_the_proxy_measures_the_path_between_stages_on_requests_into_an_idle_set(deployment):
    """Latency beyond the stages' service times (HTTP, hops, the DB), from the proxy's own
    admissions and the DB's done events; the default deadline allows for it."""
    url = deployment.url
    with httpx.Client(base_url=url, timeout=30) as http:
        for i in range(5):  # one at a time: each admitted with nothing ahead, every stage measured
            assert run_one(http, f"path {i}")["status"] == "completed"
    wait_for(lambda: t2v_admission(url)["path_s"] is not None, 10, "a path measured at the proxy")
    path = t2v_admission(url)["path_s"]
    assert 0 < path < deployment.alone_s  # part of what a request takes through the idle set
    metrics = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text)
    gauge = [s.value for f in metrics if f.name == "onepiece_proxy_path_seconds" for s in f.samples
             if s.labels == {"set": "set0", "app": "t2v"}]
    assert gauge == [pytest.approx(path)]  # nothing in flight: the same samples


def test_killing_a_bottleneck_instance_lowers_the_admitted_rate(deployment):
    url = deployment.url
    # What the instance left alone sustains: its own measured share of a request. Not half the
    # pair's: on 2 shared cores one instance's cost model can measure its steps about 2x faster than
    # the other's (9.10 -> 6.80 req/s in a CI run, where half would be 4.55).
    seen = []

    def consistent():
        before = t2v_admission(url)
        shares = [_share_s(deployment.nm, f"set0-denoise_t2v{i}") for i in (0, 1)]
        seen.append((before, shares))
        # the pair's capacity: two workers at a (weighted) mean of their shares (the proxy's view
        # and the NM's status are read a moment apart, and a heartbeat between them moves the
        # shares: 9.22 req/s against shares of 0.158 and 0.202 s in a CI run)
        return 2 / max(shares) * 0.95 <= before["capacity"] <= 2 / min(shares) * 1.05 and (before, *shares)

    try:
        before, survivor, other = wait_for(consistent, 10, "the proxy's capacity to follow the NM's shares")
    except AssertionError as e:
        raise AssertionError(f"{e}: last {seen[-1]}") from None
    assert before["bottleneck"] == "denoise_t2v", before
    assert before["rate"] == pytest.approx(0.9 * before["capacity"])  # one proxy: the whole rate, less the headroom
    # No i2v stage runs in this set: the monitor refuses i2v at once (no stage, no DB touched).
    png = base64.b64encode(_png()).decode()
    r = httpx.post(f"{url}/v1/videos", json={"prompt": "x", "model": "i2v", "input_reference": png}, timeout=5)
    assert r.status_code == 429 and r.json()["error"]["code"] == "no_capacity" and r.headers["retry-after"]

    victim = next(c for c in deployment.children if c.name == "set0-denoise_t2v1")
    os.kill(victim.proc.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    seen_after = []

    def dropped():
        # once the proxy counts one denoise worker: the survivor's share as the NM has it then (a
        # stage reprices its shares at every report; one moved 0.153 -> 0.254 s after a kill)
        a, share, workers = t2v_admission(url), _share_s(deployment.nm, "set0-denoise_t2v0"), _denoise_workers(url)
        seen_after.append((a, share, workers))
        return (workers == 1 and a["rate"] is not None and a["rate"] < before["rate"]
                and a["capacity"] == pytest.approx(1 / share, rel=0.2) and (a, share))

    try:
        after, survivor = wait_for(dropped, 8, "the admitted rate to drop")
    except AssertionError as e:
        raise AssertionError(f"{e}: {before} {survivor} {other} -> last {seen_after[-1]}") from None
    took = time.monotonic() - t_kill
    print(f"\ncapacity {before['capacity']:.2f} -> {after['capacity']:.2f} req/s (the survivor alone: "
          f"{1 / survivor:.2f}), seen by the proxy {took:.1f}s after the kill")
    assert after["bottleneck"] == "denoise_t2v"
    assert after["rate"] == pytest.approx(0.9 * after["capacity"])
    assert took < 5.0
    text = httpx.get(f"{url}/metrics", timeout=5).text
    line = next(ln for ln in text.splitlines() if ln.startswith('onepiece_proxy_admit_rate{app="t2v"'))
    assert float(line.split()[-1]) < before["rate"]


def _denoise_workers(url: str) -> float:
    """The denoise_t2v workers the proxy's view counts for t2v (its metrics)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return float(next(ln for ln in text.splitlines() if ln.startswith("onepiece_proxy_stage_workers")
                      and 'stage="denoise_t2v"' in ln and 't2v"' in ln).split()[-1])


def _share_s(nm: str, name: str) -> float:
    """The t2v share of a request (seconds) that stage instance ``name`` reported with its last
    heartbeat: what its rate is (workers / share)."""
    client = NmClient(nm)
    try:
        stages = client.status()["sets"]["set0"]["stages"]
    finally:
        client.close()
    inst = next(i for s in stages.values() for i in s["instances"] if i["name"] == name)
    return inst["stats"]["service"]["t2v"]["mean_s"]


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 20, 30)).save(buf, "PNG")
    return buf.getvalue()


def test_load_above_capacity_gets_a_steady_share_of_429s_and_accepted_requests_complete(deployment):
    url = deployment.url
    capacity = t2v_admission(url)["capacity"]
    # Open loop at 3x the capacity, bounded: 12 to 40 requests, over at most 4 s. (A cap on the
    # rate made it 1.2x the capacity once the machine ran fast enough: nothing had to be refused.)
    rate = 3.0 * capacity
    n = max(12, min(40, int(rate * 4)))
    results = open_loop(url, n, rate, SHAPE)
    accepted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] != 200]
    latency = sorted(r["latency"] for r in accepted if "latency" in r)
    duration = results[-1]["sent"] - results[0]["sent"]
    reject_ms = sorted(r["answer_s"] * 1e3 for r in refused)
    print(f"\nalone {deployment.alone_s:.2f} s; {n} requests at {rate:.2f}/s over {duration:.1f}s "
          f"(capacity {capacity:.2f}/s): "
          f"{len(accepted)} accepted, {len(refused)} refused "
          f"({', '.join(sorted({r['code'] for r in refused}))}); reject answer p50 "
          f"{reject_ms[len(reject_ms) // 2] if reject_ms else float('nan'):.1f} ms; accepted latency p50 "
          f"{latency[len(latency) // 2] if latency else float('nan'):.2f} s, "
          f"max {latency[-1] if latency else float('nan'):.2f} s")
    # Every accepted request completes.
    assert all(r.get("done") == "completed" for r in accepted), [r for r in accepted if r.get("done") != "completed"]

    # A steady share of 429s, with the reason and when to come back.
    assert len(refused) >= 0.25 * n and len(accepted) >= 3, (len(accepted), len(refused))
    # Either rule may refuse first: the burst lets the stage batch, its rate rises as the batch
    # sizes settle, and then the deadline rule binds before the token bucket (test_proxy's
    # test_over_capacity_gets_a_steady_share_of_429s_with_retry_after holds the bucket alone).
    for r in refused:
        assert r["status"] == 429 and r["code"] in ("over_capacity", "deadline"), r
        assert int(r["retry_after"]) >= 1
    # All through the run, not a burst then a wall: each half both admits and refuses.
    half = results[0]["sent"] + duration / 2
    for part in ([r for r in results if r["sent"] < half], [r for r in results if r["sent"] >= half]):
        assert any(r["status"] == 200 for r in part) and any(r["status"] == 429 for r in part)
    # Accepted requests did not queue up: their latency stays near a lone request's (the
    # deadline rule would refuse past 5x; on a quiet machine it is about 1x).
    assert latency[-1] <= 5 * deployment.alone_s + 1.0, (latency, deployment.alone_s)
    # Admitted no faster than the capacity allows (plus the burst and re-rating slack): the
    # capacity the monitor had at the start, or the one it reached as the burst let the stage
    # batch (its rate is priced at the batch sizes the stage sustains, at every heartbeat).
    after = t2v_admission(url)["capacity"]
    print(f"capacity {capacity:.2f}/s before the burst, {after:.2f}/s after")
    assert len(accepted) <= max(capacity, after) * duration * 1.5 + 3, (len(accepted), capacity, after, duration)


@pytest.fixture
def slo_set(tiny_models, tmp_path, make_topology):
    """The URL of a set on the shipped schedule (denoise on slo) with one denoise instance."""
    topology = make_topology(tmp_path, tiny_models, free_tcp_address(), dbs=1,
                             stages={"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1},
                             nm={"elastic": {"enabled": False}}, threads=1)
    dep = Deployment(Path(topology), tmp_path / "logs")
    try:
        dep.start()
        yield dep.wait_ready(120)["set0"][0]
    finally:
        dep.stop()


def test_behind_a_deadline_first_stage_admission_keeps_each_admitted_deadline(slo_set):
    """A burst at about 3x the capacity, every request with its own deadline of 3x its standalone
    time. The monitor admits by the deadline rule alone (the work ahead with earlier deadlines),
    so what it refuses it refuses as `deadline`, and what it admits completes within its
    deadline."""
    url = slo_set
    with httpx.Client(base_url=url, timeout=30) as http:
        alone = []
        for i in range(4):
            t0 = time.monotonic()
            assert run_one(http, f"warm-up {i}")["status"] == "completed"
            alone.append(time.monotonic() - t0)
    alone_s = sorted(alone[1:])[1]
    capacity = wait_for(lambda: t2v_admission(url)["capacity"], 10, "a capacity estimate at the proxy")
    rate = 3.0 * capacity  # uncapped: a fast machine's capacity makes a capped rate no burst at all
    timeout_s = round(3 * alone_s, 2)
    results = open_loop(url, 24, rate, {**SHAPE, "timeout_s": timeout_s})
    accepted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] != 200]
    print(f"\nalone {alone_s:.2f} s, deadline {timeout_s} s, 24 at {rate:.2f}/s (capacity {capacity:.2f}/s): "
          f"{len(accepted)} accepted, {len(refused)} refused; latencies "
          f"{sorted(round(r['latency'], 2) for r in accepted if 'latency' in r)}")
    assert refused and {r["code"] for r in refused} == {"deadline"}, refused
    assert len(accepted) >= 3
    # Every admitted request ended; the admission's prediction is conservative (no batching gain
    # counted), so at most one in ten (at least one) may miss by this VM's noise, and is then
    # failed with the reason. (Late: past its deadline by more than the polling's overshoot.)
    assert all(r.get("done") in ("completed", "failed") for r in accepted), accepted
    late = [r for r in accepted if r["done"] != "completed" or r["latency"] > timeout_s + 0.25 + POLL_S]
    assert len(late) <= max(1, math.ceil(len(accepted) / 10)), late
    assert all("deadline exceeded" in (r.get("error") or "") for r in accepted if r["done"] == "failed")
