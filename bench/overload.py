"""`onepiece bench overload`: open-loop load at multiples of a set's capacity, with the
request monitor on and then off (issue 5's benchmark).

One workflow set (text_encode, denoise_t2v, vae_decode; one DB; one proxy with an in-flight
bound of ``--max-inflight`` = 1000, so that only the monitor refuses) on the tiny models, each
stage worker on ``--threads`` = 1 torch thread (so that three busy workers do not oversubscribe
two cores, as they do with the workflow's default of all cores each), every request of one
shape (``--shape``, default 64x64x9:20: about 3 requests a second on two cores). Per run
(monitor on, then off: a second deployment whose topology says ``proxy.monitor: false``):

1. warm-up: 2 sequential requests, then ``--warmup`` requests closed-loop at
   ``--warmup-concurrency`` (a 429 is retried after 50 ms), which fills the pipeline so the
   stages' measured service times are those under load;
2. capacity: the NM's estimate, ``status["sets"]["set0"]["capacity"]["t2v"]["capacity"]``,
   read after the warm-up (the rate the proxies admit at), and the closed-loop throughput of
   the warm-up for comparison. The first run's figure (``--capacity-source``, or a fixed
   ``--capacity``) is the base C of every level of every run, so both runs see the same
   offered rates;
3. per level x (``--levels``, default 0.5,1,2,5): Poisson arrivals at x·C (exponential
   inter-arrival times from a seeded generator, the first at once, as in vLLM-Omni's
   diffusion serving benchmark), round(x·``--requests``) requests (so every level spans
   about the same arrival window, ``--requests``/C seconds, and sees as many accepted
   requests), arrivals bounded by ``--max-duration`` seconds. Every request is awaited:
   a 429 (or other error) ends it; an accepted one ends with its DB completion event (a ZMQ
   SUB to the DB's PUB; nothing polls) or after ``--request-timeout``. Between levels the
   set drains (every stage queue empty) and rests ``--pause`` seconds; after a run's last
   level the deployment just stops.

Figures per level (all requests = those sent at that level):

- offered rate: x·C, the rate the arrivals are drawn at; ``sent/s`` is what was sent
  ((n-1) / time between first and last send);
- duration: first send → last request resolved (completed, refused, failed or timed out);
- throughput: completed / duration;
- accepted p50 / p99: submit → completed, over completed requests: the DB record's
  ``completed_at`` minus the wall-clock time just before the POST (same machine clock);
  percentiles are linear between closest ranks;
- SLO attainment: fraction of ALL requests completed within the SLO. The SLO is
  ``--slo-factor`` (2) × the accepted p50 at 1× with the monitor on (the level nearest 1×,
  or the off run, when absent), unless ``--slo`` fixes it in seconds; the same SLO for both
  runs;
- reject rate: 429s / all requests; reject p50 / p99: client-observed time from just before
  the POST to the 429's answer;
- goodput: completed within the SLO / duration;
- failed (accepted, then failed in the pipeline), timed out (accepted, no completion within
  ``--request-timeout``), errors (any other HTTP status or connection error).

It prints a table and saves ``overload.json`` (settings, capacity, every level, every
request), ``overload.md`` and ``overload.png`` (latency and goodput vs load, both runs) under
``--out``. Targets (monitor on): at 5× accepted p99 ≤ 1.2× its value at 1×; reject p99 ≤ 5 ms;
goodput at 5× ≥ 0.9× goodput at 1×.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from onepiece.argtypes import SEED, count, non_negative, numbers, out_dir, positive, torch_device
from onepiece.bench.common import (MAX_THREADS, PROMPT, T2V_STAGES, cpu_name, parse_shape, percentile,
                                   shape_flag, tiny_models)
from onepiece.bench.trace import stage_spans
from onepiece.transport import curve

DEFAULT_LEVELS = "0.5,1,2,5"
DEFAULT_SHAPE = "64x64x9:20"
POST_TIMEOUT_S = 30.0
JSON = {"Content-Type": "application/json"}
SET = "set0"
APP = "t2v"

TARGETS = {
    "p99_ratio_max": 1.2,  # accepted p99 at 5x / at 1x
    "reject_p99_ms_max": 5.0,
    "goodput_ratio_min": 0.9,  # goodput at 5x / at 1x
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--levels", type=numbers(positive()), default=DEFAULT_LEVELS, help="load levels, multiples of the capacity (default %(default)s)")
    p.add_argument("--requests", type=count(), default=48,
                   help="requests at the 1x level; level x sends round(x*N), at least 1 (default %(default)s)")
    p.add_argument("--max-duration", type=positive(" seconds"), default=20.0,
                   help="bound on a level's arrival window in seconds; later arrivals are not sent (default %(default)s)")
    p.add_argument("--shape", type=shape_flag, default=DEFAULT_SHAPE, help="request WxHxFRAMES:STEPS (default %(default)s)")
    p.add_argument("--runs", default="on,off", help="monitor on, off, or both in that order (default %(default)s)")
    p.add_argument("--capacity", type=positive(" requests/s"), help="base rate C of the 1x level in requests/s (default: measured)")
    p.add_argument("--capacity-source", choices=["nm", "closed-loop"], default="nm",
                   help="what C is: the NM's estimate after the warm-up (what the proxies admit at) or the "
                        "warm-up's closed-loop throughput (default %(default)s)")
    p.add_argument("--warmup", type=count(0), default=40,
                   help="closed-loop warm-up requests per deployment; more than the stages' 32-request window of "
                        "service times, so the NM's estimate holds no cold start (default %(default)s)")
    p.add_argument("--warmup-concurrency", type=count(), default=4)
    p.add_argument("--slo", type=positive(" seconds"), help="SLO in seconds (default: --slo-factor x accepted p50 at 1x, monitor on)")
    p.add_argument("--slo-factor", type=positive(), default=2.0)
    p.add_argument("--request-timeout", type=positive(" seconds"), default=30.0,
                   help="seconds an accepted request is waited for (default %(default)s)")
    p.add_argument("--pause", type=non_negative(" seconds"), default=2.0, help="rest between levels, after the set drained (s)")
    p.add_argument("--max-inflight", type=count(), default=1000,
                   help="the proxy's in-flight bound, high so that only the monitor admits (default %(default)s)")
    p.add_argument("--threads", type=count(0, MAX_THREADS), default=1,
                   help="torch threads of every stage worker (0: the workflow's own, 1 or all cores per shape). 1 keeps the "
                        "three stage workers from oversubscribing a small machine's cores (default %(default)s)")
    p.add_argument("--heartbeat", type=positive(" seconds"), default=0.5, help="NM heartbeat (s)")
    p.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    p.add_argument("--device", default="cpu", type=torch_device, help="torch device of every stage (cpu, cuda)")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the arrival times")
    p.add_argument("--models", help="folder for the tiny models (default: a temporary one)")
    p.add_argument("--logs", help="keep the deployments' logs here (default: a temporary folder)")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for overload.json, .md and .png")


def monitor_switch() -> bool:
    """Whether the topology can switch the proxy's request monitor (``proxy.monitor``)."""
    from onepiece.config import ProxySpec

    return "monitor" in ProxySpec.model_fields


# --- the client side ------------------------------------------------------------------------------

class Events:
    """Completion events of the set's DBs (``[b"done", {uid, status}]``), awaited by uid."""

    def __init__(self, addresses: list[str]) -> None:
        import zmq
        import zmq.asyncio

        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"done")
        curve.client(self.sock)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        for a in addresses:
            self.sock.connect(a)
        self.waiters: dict[str, asyncio.Future] = {}
        self.early: dict[str, tuple[str, float]] = {}
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        import orjson

        while True:
            frames = await self.sock.recv_multipart()
            t = time.time()
            try:
                ev = orjson.loads(frames[1])
                uid, status = ev["uid"], ev["status"]
            except Exception:
                continue
            fut = self.waiters.pop(uid, None)
            if fut is not None and not fut.done():
                fut.set_result((status, t))
            else:
                self.early[uid] = (status, t)  # the event beat the POST's answer

    async def wait(self, uid: str, timeout: float) -> tuple[str, float | None]:
        if uid in self.early:
            return self.early.pop(uid)
        fut = asyncio.get_running_loop().create_future()
        self.waiters[uid] = fut
        try:
            return await asyncio.wait_for(fut, max(timeout, 0.001))
        except asyncio.TimeoutError:
            return "timeout", None
        finally:
            self.waiters.pop(uid, None)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass
        self.sock.close(0)
        self.ctx.term()


class Target:
    """One deployment as the load generator sees it: its proxy, DB events, DB reads, NM."""

    def __init__(self, url: str, nm_address: str, shape: tuple[int, int, int, int], request_timeout: float) -> None:
        self.url, self.nm_address, self.request_timeout = url, nm_address, request_timeout
        w, h, f, steps = shape
        self.body = {"prompt": PROMPT, "model": APP, "size": f"{w}x{h}", "num_frames": f, "steps": steps, "seed": 0}

    async def __aenter__(self) -> "Target":
        import aiohttp

        from onepiece.db.client import AsyncDbClient
        from onepiece.nm.client import NmClient

        self.nm = NmClient(self.nm_address, timeout=2.0, retries=1)
        dbs = (await asyncio.to_thread(self.nm.routes, SET))["dbs"]
        self.db = AsyncDbClient([d["control"] for d in dbs], timeout=5.0)
        self.events = Events([d["events"] for d in dbs])
        self.events.start()
        # aiohttp, as vLLM-Omni's serving benchmark: a refusal's round trip is the proxy's
        # time plus this client's, and httpx's own Python costs about 0.8 ms a request more.
        # No client-side queueing: enough connections for every request of a level at once.
        self.http = aiohttp.ClientSession(self.url, timeout=aiohttp.ClientTimeout(total=POST_TIMEOUT_S),
                                          connector=aiohttp.TCPConnector(limit=2000))
        self.post_body = orjson.dumps(self.body)
        await asyncio.sleep(0.3)  # let the SUB connect before the first event can come
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.http.close()
        await self.events.close()
        self.db.close()
        self.nm.close()

    async def status(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.nm.status)

    async def path_s(self) -> float | None:
        """The path between the stages that the proxy's deadline rule allows for (None: monitor
        off, not measured yet, or the read failed: a figure, not a reason to stop the run)."""
        import aiohttp

        try:
            async with self.http.get("/healthz") as r:
                doc = await r.json()
            return ((doc.get("admission") or {}).get("apps") or {}).get(APP, {}).get("path_s")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return None

    async def refusal_times(self) -> dict[float, float]:
        """The proxy's own histogram of its time per refusal: {bucket bound s: count ≤ it}."""
        from prometheus_client.parser import text_string_to_metric_families

        async with self.http.get("/metrics") as r:
            text = await r.text()
        return {float(s.labels["le"]): s.value for fam in text_string_to_metric_families(text)
                if fam.name == "onepiece_proxy_refusal_seconds" for s in fam.samples
                if s.name.endswith("_bucket")}

    async def request(self, body: bytes | None = None) -> dict[str, Any]:
        """One request (``body``, default the benchmark's shape), from just before the POST
        until it is resolved."""
        import aiohttp

        rec: dict[str, Any] = {"t_send": time.time()}
        p0 = time.perf_counter()
        try:
            async with self.http.post("/v1/videos", data=body or self.post_body, headers=JSON) as r:
                status, body = r.status, await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            rec.update(outcome="error", error=type(e).__name__, answer_s=time.perf_counter() - p0)
            return rec
        rec["answer_s"] = time.perf_counter() - p0
        if status == 429 or status >= 300:
            try:
                code = orjson.loads(body)["error"].get("code")
            except Exception:
                code = None
            if status == 429:
                rec.update(outcome="rejected", reason=code or "429")
            else:
                rec.update(outcome="error", error=f"http {status} {code or ''}".strip())
            return rec
        uid = orjson.loads(body)["id"].removeprefix("video_")
        rec["uid"] = uid
        status, t_event = await self.events.wait(uid, self.request_timeout - rec["answer_s"])
        rec["outcome"] = status if status in ("completed", "failed", "timeout") else f"status {status}"
        rec["t_event"] = t_event
        return rec

    async def finish(self, recs: list[dict[str, Any]]) -> None:
        """Latencies from the DB records (completed_at, the DB's clock = ours), after the level."""
        for rec in recs:
            if rec.get("outcome") not in ("completed", "failed"):
                continue
            try:
                db_rec = await self.db.get(rec["uid"])
            except Exception as e:  # noqa: BLE001 - the event's time stands in
                db_rec, rec["db_error"] = None, str(e)
            end = (db_rec or {}).get("completed_at") or rec["t_event"]
            rec["latency_s"] = end - rec["t_send"]
            rec["stages"] = stage_spans((db_rec or {}).get("trace"), rec["t_send"])
            if rec["outcome"] == "failed":
                rec["error"] = (db_rec or {}).get("error")

    async def busy(self) -> int:
        """Requests queued at or held by the set's stages (as of their last heartbeats)."""
        st = await self.status()
        n = 0
        for stage in st["sets"][SET]["stages"].values():
            for inst in stage["instances"]:
                n += int(inst["stats"].get("queue", 0)) + int(inst["stats"].get("busy", 0))
        return n

    async def drain(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self.busy() == 0:
                return True
            await asyncio.sleep(0.25)
        return False

    async def capacity(self) -> dict[str, Any] | None:
        """The NM's capacity estimate for t2v: {capacity, bottleneck, stages: {rate, service_s}}."""
        est = ((await self.status())["sets"][SET].get("capacity") or {}).get(APP)
        if not est:
            return None
        return {"capacity": est.get("capacity"), "bottleneck": est.get("bottleneck"),
                "stages": {s: {"rate": v.get("rate"), "service_s": v.get("service_s")}
                           for s, v in (est.get("stages") or {}).items()}}


async def warm_up(t: Target, n: int, concurrency: int, heartbeat: float, timeout: float = 180.0) -> dict[str, Any]:
    """2 sequential requests, then ``n`` closed-loop at ``concurrency``; then the NM's estimate."""
    deadline = time.monotonic() + timeout
    counts = {"completed": 0, "rejected": 0, "other": 0}
    done_at: list[float] = []

    async def one(record: bool) -> None:
        while time.monotonic() < deadline:
            rec = await t.request()
            if rec["outcome"] == "rejected":
                counts["rejected"] += 1
                await asyncio.sleep(0.05)
                continue
            if rec["outcome"] == "completed":
                counts["completed"] += 1
                if record:
                    done_at.append(rec["t_event"])
            else:
                counts["other"] += 1
            return
        raise RuntimeError(f"warm-up did not finish within {timeout:.0f}s ({counts})")

    for _ in range(2):
        await one(False)
    left = list(range(n))

    async def worker() -> None:
        while left:
            left.pop()
            await one(True)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    if counts["completed"] == 0:
        raise RuntimeError(f"no warm-up request completed ({counts}); see the deployment's logs")
    done_at.sort()
    skip = min(concurrency, len(done_at) // 2)  # the pipeline filling up
    closed = (len(done_at) - 1 - skip) / (done_at[-1] - done_at[skip]) if len(done_at) - skip >= 2 else None
    # The NM sees the last service times after a report (0.5 s) and a heartbeat.
    await asyncio.sleep(max(1.0, 3 * heartbeat))
    est = None
    until = min(deadline, time.monotonic() + 10.0)  # the first heartbeats after the warm-up bring it
    while time.monotonic() < until:
        est = await t.capacity()
        if est and est["capacity"]:
            break
        await asyncio.sleep(heartbeat)
    return {"closed_loop_rps": closed, "nm": est, "counts": counts}


async def run_level(t: Target, rate: float, n: int, max_duration: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    offsets, at = [], 0.0
    for i in range(n):
        if i:
            at += rng.expovariate(rate)
        if at > max_duration:
            break
        offsets.append(at)
    cap_start = await t.capacity()
    loop = asyncio.get_running_loop()
    start = loop.time()
    wall0 = time.time()
    tasks, lags = [], []
    for off in offsets:
        delay = start + off - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        lags.append(loop.time() - start - off)
        tasks.append(asyncio.create_task(t.request()))
    span = loop.time() - start
    recs = list(await asyncio.gather(*tasks))
    await t.finish(recs)
    ends = []
    for r in recs:
        if r.get("latency_s") is not None:
            ends.append(r["t_send"] + r["latency_s"])
        elif r["outcome"] == "timeout":
            ends.append(r["t_send"] + t.request_timeout)
        else:
            ends.append(r["t_send"] + r.get("answer_s", 0.0))
    for r in recs:
        r["t_send"] -= wall0  # seconds since the level's first send
    return {"offered_rps": rate, "planned": n, "sent": len(recs),
            "sent_rps": (len(recs) - 1) / span if len(recs) > 1 and span > 0 else None,
            "max_send_lag_ms": max(lags) * 1000 if lags else 0.0,
            "duration_s": max(ends) - wall0 if ends else 0.0,
            "nm_capacity_start": (cap_start or {}).get("capacity"), "records": recs}


async def session(t: Target, mode: str, cfg: argparse.Namespace, levels: list[float], base: float | None,
                  log: Any) -> dict[str, Any]:
    async with t:
        log(f"[monitor {mode}] warming up ({2 + cfg.warmup} requests) ...")
        wu = await warm_up(t, cfg.warmup, cfg.warmup_concurrency, cfg.heartbeat)
        nm_cap = (wu["nm"] or {}).get("capacity")
        log(f"[monitor {mode}] NM capacity estimate {_f(nm_cap)} req/s (bottleneck "
            f"{(wu['nm'] or {}).get('bottleneck')}), closed-loop throughput {_f(wu['closed_loop_rps'])} req/s")
        source = "given (--capacity)"
        if base is None:
            if cfg.capacity_source == "nm" and nm_cap:
                base, source = nm_cap, "nm"
            elif wu["closed_loop_rps"]:
                base = wu["closed_loop_rps"]
                source = "closed-loop" if cfg.capacity_source == "closed-loop" else \
                    "closed-loop (the NM had no estimate)"
            else:
                # A fact of this run, not a bad flag: one line, not a traceback (the deployment still stops).
                raise SystemExit(f"onepiece bench overload: no capacity: the NM has no estimate after {2 + cfg.warmup} "
                                 "warm-up requests and the warm-up measured no throughput; give --capacity, "
                                 "or --warmup 3 or more")
            log(f"[monitor {mode}] base capacity C = {base:.2f} req/s ({source})")
        else:
            source = None  # set by an earlier run
        out: dict[str, Any] = {"mode": mode, "warmup": wu, "base_capacity": base, "base_source": source, "levels": []}
        for i, x in enumerate(levels):
            n = max(1, round(x * cfg.requests))
            log(f"[monitor {mode}] level {x:g}x: {n} requests at {x * base:.2f} req/s ...")
            before = await t.refusal_times()
            lv = await run_level(t, x * base, n, cfg.max_duration, cfg.seed * 1000 + i)
            after = await t.refusal_times()
            lv["proxy_refusal_buckets"] = {str(le): after[le] - before.get(le, 0.0) for le in after}
            lv["load"] = x
            last = i + 1 == len(levels)
            # The last level need not drain: the deployment stops after it.
            drained = True if last else await t.drain(cfg.request_timeout)
            lv["drained"] = drained
            lv["nm_capacity_end"] = (await t.capacity() or {}).get("capacity")
            lv["path_s_end"] = await t.path_s()
            out["levels"].append(lv)
            oc = _outcomes(lv["records"])
            log(f"[monitor {mode}] level {x:g}x: sent {lv['sent']}, " + ", ".join(f"{k} {v}" for k, v in oc.items())
                + ("" if drained else "; the set did not drain")
                + (f"; the generator fell {lv['max_send_lag_ms']:.0f} ms behind its schedule at worst"
                   if lv["max_send_lag_ms"] > 50 else ""))
            if not last:
                await asyncio.sleep(cfg.pause)
        return out


def _run_async(coro: Any) -> Any:
    """On uvloop where installed (the proxy's loop too): less of the 2 cores for the client."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _outcomes(recs: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in recs:
        out[r["outcome"]] = out.get(r["outcome"], 0) + 1
    return out


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "—" if v is None else format(v, fmt)


# --- deployments ----------------------------------------------------------------------------------

def start_deployment(mode: str, models: dict[str, Path], folder: Path, cfg: argparse.Namespace):
    from onepiece.launcher import Deployment, free_tcp_address, write_topology

    folder.mkdir(parents=True, exist_ok=True)
    proxy: dict[str, Any] = {"count": 1, "port": 0, "max_inflight": cfg.max_inflight}
    if monitor_switch():
        proxy["monitor"] = mode == "on"
    elif mode == "off":  # checked before anything starts; kept here so it can never be faked
        raise RuntimeError("proxy.monitor is not a topology field: the monitor cannot be switched off")
    topo = write_topology(folder, models, free_tcp_address(), dbs=1, transport=cfg.transport,
                          heartbeat_s=cfg.heartbeat, stages=dict(T2V_STAGES), proxy=proxy, threads=cfg.threads,
                          device=cfg.device)
    logs = Path(cfg.logs) / f"monitor-{mode}" if cfg.logs else folder / "logs"
    dep = Deployment(topo, logs)
    dep.start()
    try:
        url = dep.wait_ready(300)[SET][0]
        healthz = _healthz(url)
    except BaseException:
        dep.stop()
        raise
    says = healthz.get("monitor", (healthz.get("admission") or {}).get("enabled"))
    if says is not None and bool(says) != (mode == "on"):
        dep.stop()
        raise RuntimeError(f"asked for monitor {mode}, but the proxy's /healthz says monitor={says!r}")
    return dep, url, healthz


def _healthz(url: str) -> dict[str, Any]:
    import httpx

    try:
        return httpx.get(url + "/healthz", timeout=5.0).json()
    except Exception as e:  # noqa: BLE001 - informational only
        return {"error": str(e)}


# --- figures --------------------------------------------------------------------------------------

def summarize(lv: dict[str, Any], slo: float | None) -> dict[str, Any]:
    recs = lv["records"]
    n = len(recs)
    lat = [r["latency_s"] for r in recs if r["outcome"] == "completed" and r.get("latency_s") is not None]
    rej = [r["answer_s"] for r in recs if r["outcome"] == "rejected"]
    dur = lv["duration_s"] or float("nan")
    good = sum(1 for x in lat if slo is not None and x <= slo)
    reasons: dict[str, int] = {}
    for r in recs:
        if r["outcome"] == "rejected":
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    errors: dict[str, int] = {}
    for r in recs:
        if r["outcome"] in ("error", "failed"):
            key = f"{r['outcome']}: {(r.get('error') or '')[:80]}"
            errors[key] = errors.get(key, 0) + 1
    oc = _outcomes(recs)
    return {
        "load": lv["load"], "offered_rps": lv["offered_rps"], "sent": n, "sent_rps": lv["sent_rps"],
        "duration_s": lv["duration_s"], "completed": len(lat), "accepted": n - oc.get("rejected", 0) - oc.get("error", 0),
        "rejected": oc.get("rejected", 0), "failed": oc.get("failed", 0), "timed_out": oc.get("timeout", 0),
        "errors": oc.get("error", 0),
        "throughput_rps": len(lat) / dur if n else None,
        "accepted_p50_s": percentile(lat, 50), "accepted_p99_s": percentile(lat, 99),
        "accepted_mean_s": sum(lat) / len(lat) if lat else None,
        "slo_attainment": good / n if n and slo is not None else None,
        "goodput_rps": good / dur if n and slo is not None else None,
        "reject_rate": oc.get("rejected", 0) / n if n else None,
        "reject_p50_ms": None if not rej else percentile(rej, 50) * 1000,
        "reject_p99_ms": None if not rej else percentile(rej, 99) * 1000,
        "reject_reasons": reasons, "error_kinds": errors,
        "max_send_lag_ms": lv["max_send_lag_ms"], "drained": lv["drained"],
        "proxy_refusals_within_ms": within(lv.get("proxy_refusal_buckets") or {}),
        "nm_capacity_start": lv["nm_capacity_start"], "nm_capacity_end": lv["nm_capacity_end"],
        "path_s_end": lv.get("path_s_end"),
    }


def within(buckets: dict[str, float]) -> dict[str, float]:
    """Share of the proxy's refusals that took at most 0.25, 0.5, 1 and 5 ms of its time."""
    total = buckets.get("inf", 0.0)
    return {f"{le * 1000:g}": buckets[str(le)] / total for le in (0.00025, 0.0005, 0.001, 0.005)
            if total and str(le) in buckets}


def choose_slo(runs: list[dict[str, Any]], cfg: argparse.Namespace) -> tuple[float | None, str]:
    if cfg.slo is not None:
        return cfg.slo, f"{cfg.slo:.3f} s (given with --slo)"
    for run in sorted(runs, key=lambda r: r["mode"] != "on"):  # the monitored run first
        lvs = [lv for lv in run["levels"] if any(r["outcome"] == "completed" for r in lv["records"])]
        if not lvs:
            continue
        lv = min(lvs, key=lambda lv: abs(lv["load"] - 1.0))
        p50 = percentile([r["latency_s"] for r in lv["records"] if r["outcome"] == "completed"], 50)
        return cfg.slo_factor * p50, (f"{cfg.slo_factor:g} × the accepted p50 at {lv['load']:g}× with the monitor "
                                      f"{run['mode']} ({p50 * 1000:.0f} ms) = {cfg.slo_factor * p50 * 1000:.0f} ms")
    return None, "none (no request completed)"


def check_targets(rows: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    on = [r for r in rows if r["run"] == "on"]
    at = {r["load"]: r for r in on}
    out: dict[str, Any] = {}
    one, five = at.get(1.0), at.get(5.0)
    # With both levels run, a figure that cannot be formed (nothing completed at 5x, no goodput
    # at 1x) is a target not met, not one left out.
    if one and five:
        ratio = (five["accepted_p99_s"] / one["accepted_p99_s"]
                 if one["accepted_p99_s"] and five["accepted_p99_s"] else None)
        out["p99_5x_over_1x"] = {"value": ratio, "target": f"≤ {TARGETS['p99_ratio_max']}",
                                 "met": ratio is not None and ratio <= TARGETS["p99_ratio_max"]}
    rej = [x["answer_s"] * 1000 for run in runs if run["mode"] == "on" for lv in run["levels"]
           for x in lv["records"] if x["outcome"] == "rejected"]
    if rej:
        p99 = percentile(rej, 99)
        out["reject_p99_ms"] = {"value": p99, "target": f"≤ {TARGETS['reject_p99_ms_max']}",
                                "met": p99 <= TARGETS["reject_p99_ms_max"], "n": len(rej)}
    if one and five:
        ratio = five["goodput_rps"] / one["goodput_rps"] if one["goodput_rps"] else None
        out["goodput_5x_over_1x"] = {"value": ratio, "target": f"≥ {TARGETS['goodput_ratio_min']}",
                                     "met": ratio is not None and ratio >= TARGETS["goodput_ratio_min"]}
    return out


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v * 100:.0f}%"


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| monitor | load | offered req/s | sent | completed | throughput req/s | accepted p50 ms | "
            "accepted p99 ms | SLO attainment | reject rate | reject p50 ms | reject p99 ms | goodput req/s | "
            "failed / timed out / errors |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['load']:g}× | {r['offered_rps']:.2f} | {r['sent']} | {r['completed']} "
            f"| {_f(r['throughput_rps'])} | {_ms(r['accepted_p50_s'])} | {_ms(r['accepted_p99_s'])} "
            f"| {_pct(r['slo_attainment'])} | {_pct(r['reject_rate'])} "
            f"| {_f(r['reject_p50_ms'], '.1f')} | {_f(r['reject_p99_ms'], '.1f')} | {_f(r['goodput_rps'])} "
            f"| {r['failed']} / {r['timed_out']} / {r['errors']} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], slo: float | None, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {"on": ("tab:blue", "-"), "off": ("tab:red", "--")}
    for run in ("on", "off"):
        rs = [r for r in rows if r["run"] == run]
        if not rs:
            continue
        color, ls = styles[run]
        x = [r["load"] for r in rs]
        for key, marker, label in (("accepted_p50_s", "o", "p50"), ("accepted_p99_s", "^", "p99")):
            pts = [(a, r[key]) for a, r in zip(x, rs) if r[key] is not None]
            if pts:
                ax1.plot(*zip(*pts), ls, marker=marker, color=color, label=f"monitor {run}: accepted {label}")
        ax2.plot(x, [r["goodput_rps"] or 0.0 for r in rs], ls, marker="o", color=color, label=f"monitor {run}: goodput")
        ax2.plot(x, [r["throughput_rps"] or 0.0 for r in rs], ls, marker="x", color=color, alpha=0.45,
                 label=f"monitor {run}: throughput")
    if slo is not None:
        ax1.axhline(slo, color="gray", lw=1, ls=":", label=f"SLO {slo:.2f} s")
    loads = sorted({r["load"] for r in rows})
    ax2.plot(loads, [next(r["offered_rps"] for r in rows if r["load"] == x) for x in loads], ":", color="gray",
             label="offered")
    from matplotlib.ticker import NullLocator

    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(loads)
        ax.set_xticklabels([f"{x:g}×" for x in loads])
        ax.set_xlabel("offered load (× capacity)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_yscale("log")
    ax1.set_ylabel("accepted latency, submit → completed (s)")
    ax1.set_title("latency of accepted requests")
    ax2.set_ylabel("requests / s")
    ax2.set_title("goodput (completed within SLO) and throughput")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the command ----------------------------------------------------------------------------------

def check_args(args: argparse.Namespace) -> str | None:
    """Flags bad together (cli.py's cmd_bench refuses them before any work), or None."""
    # warm_up's closed-loop throughput skips the pipeline's filling and needs two completions
    # after it: fewer than 3 warm-up requests measure none, and a closed-loop C has nothing to be.
    if args.capacity is None and args.capacity_source == "closed-loop" and args.warmup < 3:
        return (f"argument --warmup: {args.warmup} warm-up requests measure no closed-loop throughput; "
                "--capacity-source closed-loop needs --warmup 3 or more (or give --capacity)")
    return None


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    levels = sorted(set(args.levels))
    modes = [m.strip() for m in args.runs.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes) or len(set(modes)) != len(modes):
        raise SystemExit(f"bad --runs {args.runs!r}: expected on, off or on,off")
    modes.sort(key=lambda m: m != "on")
    shape = parse_shape(args.shape)
    if "off" in modes and not monitor_switch():
        print("onepiece bench overload: the run without the request monitor needs the topology field "
              "`proxy.monitor` (onepiece/config.py ProxySpec), which this build does not have, so the proxy's "
              "admission cannot be switched off. Not faking it: use `--runs on` to measure the monitored run only.",
              file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    t_start = time.monotonic()
    runs: list[dict[str, Any]] = []
    base = args.capacity
    with tempfile.TemporaryDirectory(prefix="onepiece-bench-") as tmp:
        models = tiny_models(Path(args.models) if args.models else Path(tmp) / "models")
        for mode in modes:
            log(f"[monitor {mode}] starting the deployment (text_encode, denoise_t2v, vae_decode, 1 DB, 1 proxy) ...")
            dep, url, healthz = start_deployment(mode, models, Path(tmp) / f"monitor-{mode}", args)
            try:
                target = Target(url, dep.nm_address, shape, args.request_timeout)
                res = _run_async(session(target, mode, args, levels, base, log))
            finally:
                dep.stop()
            res["proxy_healthz"] = healthz
            base = res["base_capacity"]
            runs.append(res)
    base_source = next((r["base_source"] for r in runs if r["base_source"]), "given (--capacity)")
    slo, slo_text = choose_slo(runs, args)
    rows = [{"run": run["mode"], **summarize(lv, slo)} for run in runs for lv in run["levels"]]
    targets = check_targets(rows, runs)
    elapsed = time.monotonic() - t_start

    result = {
        "bench": "overload", "when": time.strftime("%Y-%m-%d %H:%M"), "cpu_count": os.cpu_count(),
        "elapsed_s": elapsed,
        "settings": {k: v for k, v in vars(args).items() if k not in ("fn", "which")},
        "monitor_switch": monitor_switch(),
        "capacity": {"base_rps": base, "source": base_source,
                     "per_run": {r["mode"]: {"nm": r["warmup"]["nm"], "closed_loop_rps": r["warmup"]["closed_loop_rps"],
                                             "warmup_counts": r["warmup"]["counts"]} for r in runs}},
        "slo_s": slo, "slo": slo_text, "rows": rows, "targets": targets,
        "proxy_healthz": {r["mode"]: r["proxy_healthz"] for r in runs},
        "requests": {f"{r['mode']}@{lv['load']:g}x": lv["records"] for r in runs for lv in r["levels"]},
    }
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "overload.json").write_text(json.dumps(result, indent=1, default=str))
    title = (f"onepiece bench overload: t2v {args.shape}, C = {base:.2f} req/s ({base_source}), "
             f"{args.requests} requests at 1×, SLO {slo_text.split(' = ')[-1] if slo else '—'}")
    plot(rows, slo, outdir / "overload.png", title)

    md = [f"`onepiece bench overload` — {result['when']}, {cpu_name()}, {os.cpu_count()} cores, device {args.device}, "
          f"shape {args.shape}, "
          f"levels {','.join(f'{x:g}' for x in levels)}, {args.requests} requests at 1× (round(x·{args.requests}) at x×), "
          f"runs: monitor {', '.join(modes)}; {elapsed:.0f} s in all.", "",
          f"- capacity C = {base:.2f} req/s, source: {base_source}; " + "; ".join(
              f"monitor {r['mode']}: NM estimate {_f((r['warmup']['nm'] or {}).get('capacity'))} req/s "
              f"(bottleneck {(r['warmup']['nm'] or {}).get('bottleneck')}), closed-loop "
              f"{_f(r['warmup']['closed_loop_rps'])} req/s" for r in runs),
          "- the path between the stages the proxy allowed for at the end of each level (monitor on): " + ", ".join(
              f"{lv['load']:g}×: {_ms(lv.get('path_s_end'))} ms" for r in runs if r["mode"] == "on" for lv in r["levels"]),
          f"- SLO: {slo_text}", "", table(rows), ""]
    shares = [(r, r["proxy_refusals_within_ms"]) for r in rows if r["run"] == "on" and r["proxy_refusals_within_ms"]]
    if shares:
        md += ["Proxy time per refusal (its `onepiece_proxy_refusal_seconds` histogram: the create handler's start "
               "→ the 429), share within 0.25 / 0.5 / 1 / 5 ms: " + "; ".join(
                   f"{r['load']:g}×: " + " / ".join(_pct(s.get(k)) for k in ("0.25", "0.5", "1", "5"))
                   for r, s in shares), ""]
    names = {"p99_5x_over_1x": "accepted p99 at 5× / at 1× (monitor on)",
             "reject_p99_ms": "reject p99, ms (monitor on, all levels)",
             "goodput_5x_over_1x": "goodput at 5× / at 1× (monitor on)"}
    if targets:
        md += ["| target | value | wanted | met |", "|---|---|---|---|"]
        md += [f"| {names[k]} | {'n/a' if v['value'] is None else format(v['value'], '.3f')} | {v['target']} "
               f"| {'yes' if v['met'] else 'NO'} |" for k, v in targets.items()]
    else:
        md.append("(targets need levels 1 and 5 with the monitor on)")
    md += ["", "Per level: offered = the Poisson arrival rate (load × C); throughput = completed / duration "
           "(first send → last request resolved); accepted p50/p99 = submit → the DB's completed_at, over completed "
           "requests; SLO attainment = completed within the SLO / all requests sent; reject rate = 429s / all "
           "requests; reject p50/p99 = client-observed time to the 429; goodput = completed within the SLO / "
           "duration; failed = accepted then failed in the pipeline, timed out = accepted and not completed within "
           f"{args.request_timeout:g} s, errors = other HTTP statuses or connection errors.", ""]
    text = "\n".join(md)
    (outdir / "overload.md").write_text(text)
    print()
    print(text)
    print(f"saved {outdir / 'overload.json'}, {outdir / 'overload.md'} and {outdir / 'overload.png'}")
    return 0
