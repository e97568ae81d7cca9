"""`onepiece bench sched`: the stage scheduling policies on one seeded trace of mixed requests.

One set (text_encode, denoise_t2v, vae_decode; one DB; one proxy, request monitor off) on the
``scale`` models (stage costs in real Wan2.1's proportions), every stage worker on one torch
thread. Requests come in three classes (``--classes``, small / medium / large, mixed by
``--mix``, 60/30/10 by count: GF-DiT's S/M/L pattern scaled to this machine). Each class's SLO
is α × its standalone time (``--alpha``, 2.0 / 2.5 / 3.5), and that SLO is each request's
target (``slo_s``): deadline-aware policies schedule for it, and a request that misses it still
completes, as in GF-DiT's and vLLM-Omni's measurements. Each request's deadline, where it fails,
is ``--timeout`` (90 s); ``--timeout 0`` makes the SLO the deadline too (a request that misses
it is dropped where it is and fails, the stages' default for a deadline).

1. Calibration, on a deployment with ``fcfs``: each class alone, one request after another
   (``--repeat`` after a warm-up): its standalone time, submit → completed. Then the capacity
   C under fcfs: the throughput of a closed loop (4 clients) of ``--calibrate`` requests whose
   classes are the mix's shares exactly (a random draw of 16 put 30% too few large requests in
   it once, and every "1.0×" trace above fcfs's real capacity), the NM's estimate beside it.
2. Traces: seeded Poisson arrivals of ``--requests`` requests at each load × C (``--loads``,
   0.5, 0.8, 1.0); the same class sequence and arrival pattern at every load, stretched. Each
   is saved (``sched-trace-<load>.json``, the format of bench/trace.py) so a simulator can
   replay it; ``--trace FILE`` replays a given trace instead (its classes and SLOs, one load).
3. Every policy (``--policies``) on its own deployment (denoise_t2v's ``schedule.policy``;
   ``--max-batch`` for the batching ones): a short warm-up of every class, then each trace,
   open loop, every request awaited; the set drains between traces. Then one more run with the
   request monitor on, at ``--monitor-load`` (1.2) × C, with the policy that met most SLOs at
   the highest load.

Per policy and load, per class and overall: mean latency (submit → resolved: completed, or
failed at its deadline), p50 / p99 of completed requests, SLO attainment (completed within the
class's SLO / sent), goodput (those / duration), completed, failed. Saved as ``sched.json``,
``sched.md`` and ``sched.png`` under ``--out``. Targets at 1.0×: the best policy's mean latency
≤ 0.5× fcfs's, overall SLO attainment ≥ 90% and ≥ 1.5× fcfs's, every large request completes.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from onepiece.argtypes import SEED, count, non_negative, numbers, out_dir, positive, torch_device
from onepiece.bench.common import MAX_THREADS, PROMPT, T2V_STAGES, cpu_name, model_dirs
from onepiece.bench.overload import SET, Target, _run_async
from onepiece.bench.pace import pace
from onepiece.bench.trace import (Trace, load_trace, parse_classes, parse_floats, poisson_trace, replay, scaled,
                                  summarize)
from onepiece.schedule_trace import chunks, logged
from onepiece.sim.engine import Chunk
from onepiece.sim.report import perfetto

DEFAULT_CLASSES = "S=64x64x9:25,M=128x128x17:25,L=192x192x17:25"
TARGETS = {"mean_ratio_max": 0.5, "attainment_min": 0.9, "attainment_ratio_min": 1.5}
HEARTBEAT_LAG_S = 1.5  # a stage's figures reach the NM within its 0.5 s refresh and a 0.5 s heartbeat


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", default="fcfs,fcfs-batched,srtf,edf,slo",
                   help="stage policies to compare, fcfs first (default %(default)s)")
    p.add_argument("--loads", type=numbers(positive()), default="0.5,0.8,1.0", help="multiples of the fcfs capacity (default %(default)s)")
    p.add_argument("--requests", type=count(), default=40, help="requests per trace (default %(default)s)")
    p.add_argument("--classes", default=DEFAULT_CLASSES, help="NAME=WxHxFRAMES:STEPS,... (default %(default)s)")
    p.add_argument("--mix", default="0.6,0.3,0.1", help="share of each class by count, in --classes order")
    p.add_argument("--alpha", default="2.0,2.5,3.5", help="SLO = alpha x standalone, per class in order")
    p.add_argument("--max-batch", type=count(), default=4, help="batch bound of the batching policies")
    p.add_argument("--timeout", type=non_negative(" seconds"), default=90.0,
                   help="each request's deadline (timeout_s), where it fails; its SLO is its target (slo_s). "
                        "0: the SLO is its deadline (default %(default)s)")
    p.add_argument("--monitor-load", type=non_negative(), default=1.2,
                   help="load of the run with the monitor on (0: none; with --trace: that trace again, monitor on)")
    p.add_argument("--trace", help="replay this trace (bench/trace.py format) instead of generating them")
    p.add_argument("--repeat", type=count(), default=3, help="standalone runs per class in the calibration")
    p.add_argument("--calibrate", type=count(), default=20,
                   help="closed-loop requests measuring the fcfs capacity, classes in the mix's shares exactly")
    p.add_argument("--capacity", type=positive(" requests/s"), help="C in requests/s (default: measured)")
    p.add_argument("--denoise-workers", type=count(), default=1, help="workers of the denoise stage (default 1)")
    p.add_argument("--collaboration", action="store_true",
                   help="the denoise workers form one collaboration group (DoP-aware policies pick each step's DoP)")
    session_arguments(p, request_timeout=120.0, out="sched.json, .md, .png and the traces")


def session_arguments(p: argparse.ArgumentParser, request_timeout: float, out: str) -> None:
    """The flags of a benchmark that replays traces on `Session` deployments."""
    p.add_argument("--max-duration", type=positive(" seconds"), default=180.0, help="bound on a trace's arrival window (s)")
    p.add_argument("--request-timeout", type=positive(" seconds"), default=request_timeout,
                   help="seconds a request is awaited at most (default %(default)s)")
    p.add_argument("--profile", choices=["tiny", "scale"], default="scale", help="model profile (default scale)")
    p.add_argument("--threads", type=count(1, MAX_THREADS), default=1, help="torch threads per stage worker")
    p.add_argument("--device", default="cpu", type=torch_device, help="torch device of every stage (cpu, cuda)")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--models", help="folder for the models (default: ~/.cache/onepiece/models)")
    p.add_argument("--logs", help="keep the deployments' logs here")
    p.add_argument("--out", type=out_dir, default="bench/results", help=f"folder for {out}")


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


# --- deployments ----------------------------------------------------------------------------------
class Session:
    """A deployment whose denoise stage runs ``schedule``, and its client side."""

    def __init__(self, name: str, models: dict[str, Path], folder: Path, cfg: argparse.Namespace,
                 schedule: dict[str, Any], monitor: bool = False) -> None:
        self.name, self.models, self.folder, self.cfg = name, models, folder, cfg
        self.schedule, self.monitor = schedule, monitor

    def __enter__(self) -> "Session":
        from onepiece.launcher import Deployment, free_tcp_address, write_topology

        self.folder.mkdir(parents=True, exist_ok=True)
        topo = write_topology(self.folder, self.models, free_tcp_address(), dbs=1, heartbeat_s=0.5,
                              stages=dict(T2V_STAGES), threads=self.cfg.threads, device=self.cfg.device,
                              proxy={"count": 1, "port": 0, "max_inflight": 1000, "monitor": self.monitor},
                              schedule={"denoise_t2v": self.schedule}, stage_options={"denoise_t2v": {
                                  "workers": getattr(self.cfg, "denoise_workers", 1),
                                  "mode": "collaboration" if getattr(self.cfg, "collaboration", False) else "individual"}})
        logs = Path(self.cfg.logs) / self.name if self.cfg.logs else self.folder / "logs"
        self.dep = Deployment(topo, logs)
        self.dep.start()
        try:
            self.url = self.dep.wait_ready(300)[SET][0]
        except BaseException:
            self.dep.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.dep.stop()

    def target(self) -> Target:
        return Target(self.url, self.dep.nm_address, (64, 64, 9, 1), self.cfg.request_timeout)


def _body(c: dict[str, Any], seed: int) -> bytes:
    return orjson.dumps({"prompt": f"{PROMPT} {seed}", "model": "t2v", "size": c["size"],
                         "num_frames": c["num_frames"], "steps": c["steps"], "seed": seed})


async def calibrate(t: Target, classes: dict[str, dict], mix: dict[str, float], repeat: int, n: int,
                    seed: int) -> dict[str, Any]:
    """Standalone time per class (sequential), then the closed-loop throughput of the mix."""
    async with t:
        alone = {}
        for name, c in classes.items():
            times = []
            for i in range(repeat + 1):  # the first of each is a warm-up
                rec = await t.request(_body(c, i))
                await t.finish([rec])
                if rec["outcome"] != "completed":
                    raise RuntimeError(f"calibration request of class {name} ended {rec['outcome']}: {rec}")
                times.append(rec["latency_s"])
            alone[name] = statistics.median(times[1:])
            log(f"[calibrate] class {name} ({c['size']}x{c['num_frames']}:{c['steps']}): standalone "
                f"{alone[name]:.3f} s (runs {', '.join(f'{x:.3f}' for x in times)})")
        names = exact_mix(mix, n)
        random.Random(seed).shuffle(names)
        bodies = [_body(classes[c], 1000 + i) for i, c in enumerate(names)]
        ends: list[float] = []

        async def client() -> None:
            while bodies:
                rec = await t.request(bodies.pop())
                if rec["outcome"] == "completed":
                    ends.append(rec["t_event"])

        t0 = time.time()
        await asyncio.gather(*(client() for _ in range(4)))
        # All of the mix's work over the whole run: the bottleneck stays busy from the first
        # request's arrival there to the last one's end (4 clients keep it queued); a window of
        # completions in the middle would weigh the classes by where they happened to fall.
        closed = len(ends) / (max(ends) - t0) if len(ends) == n else None
        await asyncio.sleep(1.5)
        est = await t.capacity()
        log(f"[calibrate] fcfs capacity: closed loop {closed or float('nan'):.3f} req/s over {time.time() - t0:.0f} s;"
            f" NM estimate {(est or {}).get('capacity') or float('nan'):.3f} req/s (bottleneck "
            f"{(est or {}).get('bottleneck')})")
        return {"standalone_s": alone, "closed_loop_rps": closed, "nm": est}


async def run_traces(t: Target, classes: dict[str, dict], traces: dict[str, Trace], cfg: argparse.Namespace,
                     name: str) -> dict[str, list[dict]]:
    async with t:
        for c in classes.values():  # the cost model learns every class before the traces
            for i in range(2):
                await t.request(_body(c, 500 + i))
        out = {}
        for load, trace in traces.items():
            await asyncio.sleep(HEARTBEAT_LAG_S)  # the stages' sums as the trace begins, reported
            began = (await t.status())["sets"][SET]["stages"]
            log(f"[{name}] trace at {load}: {len(trace.requests)} requests over {trace.requests[-1].at:.0f} s ...")
            recs = await replay(t, trace, PROMPT, cfg.max_duration)
            out[load] = recs
            # What the stages measured under this load (every request is resolved; their sums
            # reported): the table a simulator replays this very trace with.
            await asyncio.sleep(HEARTBEAT_LAG_S)
            out.setdefault("costs_by_load", {})[load] = cost_table((await t.status())["sets"][SET]["stages"], began)
            counts: dict[str, int] = {}
            for r in recs:
                counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
            log(f"[{name}] trace at {load}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
            await t.drain(cfg.request_timeout)
            await asyncio.sleep(1.0)
        stages = (await t.status())["sets"][SET]["stages"]
        st = stages["denoise_t2v"]["instances"][0]["stats"]
        out["stage"] = {k: st.get(k) for k in ("policy", "batches", "batched", "preempted", "expired", "aged",
                                               "overhead_ms", "costs")}
        out["costs"] = cost_table(stages)
        return out


def costs_name(policy: str, load: str | None = None) -> str:
    """The file of a policy's measured costs: at the end of its run, or under one load's trace
    (``1x``, ``monitor on 1.2x``), as `onepiece bench simval` finds them."""
    if load is None:
        return f"sched-costs-{policy}.json"
    return f"sched-costs-{policy}-{load.replace('monitor on ', 'monitor-')}.json"


def schedule_name(policy: str, load: str) -> str:
    """The file of what every stage's workers ran under one load's trace (``save_schedule``)."""
    return f"sched-schedule-{policy}-{load.replace('monitor on ', 'monitor-')}.json"


def real_schedule(log_dir: Path, recs: list[dict[str, Any]]) -> list[Chunk]:
    """The chunks the deployment's stages ran for one trace's requests (their schedule logs,
    stage/schedule_log.py), in the simulator's terms: seconds after the trace's start, each
    request named by its place in the trace (``r0``, ``r1``, ...: the simulator's names), and
    ``steps`` the forward passes the worker ran."""
    sent = [r for r in recs if isinstance(r.get("t_send"), (int, float))]
    if not sent:
        return []
    t0 = min(r["t_send"] - r["at"] for r in sent)
    return chunks(logged(log_dir, since=t0), t0, {r["uid"]: f"r{i}" for i, r in enumerate(recs) if r.get("uid")})


def save_schedule(path: Path, log_dir: Path, recs: list[dict[str, Any]]) -> None:
    """What every stage's workers ran under one trace, as the simulator draws its own (a
    Chrome/Perfetto trace, sim/report.py): the two can be opened side by side, and `onepiece
    bench simval` reads it."""
    ran = real_schedule(log_dir, recs)
    if ran:
        names = [{"uid": f"r{i}", "class": r["class"]} for i, r in enumerate(recs)]
        path.write_bytes(orjson.dumps(perfetto(ran, names)))


def cost_table(stages: dict[str, Any], since: dict[str, Any] | None = None) -> dict[str, Any]:
    """What every stage measured in this run (its instances' heartbeats), as a cost table
    (``onepiece profile``'s format) that a simulator replays this run's traces with: seconds per
    step or call by key and batch size, what a request costs besides its steps (``fixed``),
    each stage's decision and IPC per chunk (``overhead_s``) and how much its steps varied
    around their means (``step_cv``, pooled over keys and batch sizes). Each figure is a mean over the
    steps (requests, chunks) since ``since`` (the stages as a trace began: so, over
    exactly that trace), from the sums the stages keep, where there are such steps; else the
    median that prices the stage's decisions. Medians of the trace's last window had replays of
    the deadline policies 9-17% short: the median leaves out the slow steps a run still sums, and
    under those policies a trace's last window is its large requests, run alone at its end."""
    from onepiece.sched.costs import make_table

    began = {(name, i): stats for name, i, stats in _instances(since)}
    # Per stage, pooled over its instances (one row per key and batch size: a row per instance
    # made a table no simulator loads): [seconds, steps] of each (key, batch) over the trace,
    # the medians of those the trace did not run, and [seconds, requests] of each key's fixed.
    sums: dict[str, dict[tuple[str, str], list[float]]] = {}
    medians: dict[str, dict[tuple[str, str], list[float]]] = {}
    fixed_sums: dict[str, dict[str, list[float]]] = {}
    chunks: dict[str, list[float]] = {}  # per stage, its instances' [overhead seconds, chunks] over the trace
    spread: dict[str, list[float]] = {}  # per stage, [steps x their squared CV, steps] over the trace
    for name, i, stats in _instances(stages):
        then = began.get((name, i), {})
        now, was = stats.get("cost_totals") or {}, then.get("cost_totals") or {}
        if stats.get("overhead_total"):
            dt, dn = _added(stats["overhead_total"], then.get("overhead_total"))
            pooled = chunks.setdefault(name, [0.0, 0])
            pooled[0], pooled[1] = pooled[0] + dt, pooled[1] + dn
        mine = sums.setdefault(name, {})
        for key, by_batch in now.get("steps", {}).items():
            for b, total in by_batch.items():
                before = was.get("steps", {}).get(key, {}).get(b)
                dt, n = _added(total, before)
                if n > 0:
                    m = dt / n
                    pooled = mine.setdefault((key, b), [0.0, 0])
                    pooled[0], pooled[1] = pooled[0] + dt, pooled[1] + n
                    if len(total) > 2 and m > 0:  # squares summed too (stages since 2026-11-26)
                        var = max(0.0, (total[2] - (before[2] if before else 0.0)) / n - m * m)
                        pooled = spread.setdefault(name, [0.0, 0])
                        pooled[0], pooled[1] = pooled[0] + n * var / (m * m), pooled[1] + n
        for key, by_batch in (stats.get("costs") or {}).items():
            for b, t in by_batch.items():
                medians.setdefault(name, {}).setdefault((key, b), []).append(t)
        for key, total in now.get("fixed", {}).items():
            dt, dn = _added(total, was.get("fixed", {}).get(key))
            if dn > 0:
                pooled = fixed_sums.setdefault(name, {}).setdefault(key, [0.0, 0])
                pooled[0], pooled[1] = pooled[0] + dt, pooled[1] + dn
    rows: dict[str, list[dict[str, Any]]] = {}
    for name in dict.fromkeys([*sums, *medians]):  # (the stages in the order they came)
        over_trace = sums.get(name, {})
        rows[name] = [{"key": key, "batch": int(b), "seconds": t / n} for (key, b), (t, n) in over_trace.items()]
        # none in the trace: the instances' medians, averaged
        rows[name] += [{"key": key, "batch": int(b), "seconds": sum(ts) / len(ts)}
                       for (key, b), ts in medians.get(name, {}).items() if (key, b) not in over_trace]
    fixed = {name: {key: t / n for key, (t, n) in by_key.items() if t > 0} for name, by_key in fixed_sums.items()}
    figures: dict[str, dict[str, float]] = {}
    for name, (t, n) in chunks.items():
        if n > 0:
            figures.setdefault(name, {})["overhead_s"] = t / n
    for name, (q, n) in spread.items():
        if n > 1:
            figures.setdefault(name, {})["step_cv"] = round(math.sqrt(q / n), 4)
    return make_table(rows, fixed, figures, device="measured by onepiece bench sched", cpu=cpu_name())


def _instances(stages: dict[str, Any] | None) -> Any:
    """(stage, instance id, its heartbeat stats) of every instance in an NM status's stages."""
    for name, stage in (stages or {}).items():
        for inst in stage.get("instances", []):
            yield name, inst.get("id", ""), inst.get("stats") or {}


def _added(total: Any, before: Any) -> tuple[float, int]:
    """What a [seconds, count, ...] sum added since ``before`` (None: since the start)."""
    (t, n), (t0, n0) = total[:2], (before or (0.0, 0))[:2]
    return t - t0, n - n0


# --- figures --------------------------------------------------------------------------------------
def exact_mix(mix: dict[str, float], n: int) -> list[str]:
    """``n`` class names in ``mix``'s shares, rounded by largest remainder."""
    total = sum(mix.values())
    want = {c: n * w / total for c, w in mix.items()}
    counts = {c: int(v) for c, v in want.items()}
    for c in sorted(want, key=lambda c: counts[c] - want[c])[:n - sum(counts.values())]:
        counts[c] += 1
    return [c for c in mix for _ in range(counts[c])]


def check_targets(rows: dict[str, dict[str, dict]], top: str, classes: list[str]) -> dict[str, Any]:
    """At the highest load: the best policy (most SLOs met) against fcfs."""
    at = {p: r[top] for p, r in rows.items() if top in r}
    if "fcfs" not in at or len(at) < 2:
        return {}
    fcfs = at["fcfs"]["all"]
    best = max((p for p in at if p != "fcfs"),
               key=lambda p: (at[p]["all"]["attainment"] or 0.0, -(at[p]["all"]["mean_s"] or math.inf)))
    b = at[best]["all"]
    large = classes[-1]  # (the caller orders them by standalone time)
    out = {"best": best, "load": top}
    mean_ratio = b["mean_s"] / fcfs["mean_s"] if b["mean_s"] is not None and fcfs["mean_s"] else None
    out["mean_ratio"] = {"value": mean_ratio, "target": f"≤ {TARGETS['mean_ratio_max']}",
                         "met": mean_ratio is not None and mean_ratio <= TARGETS["mean_ratio_max"]}
    out["attainment"] = {"value": b["attainment"], "target": f"≥ {TARGETS['attainment_min']:.0%}",
                         "met": b["attainment"] >= TARGETS["attainment_min"]}
    # fcfs meeting no SLO leaves no ratio: None (JSON null, "n/a"), never met; an inf was written
    # as `Infinity` (not JSON) and called the target met at 0% against 0%.
    ratio = b["attainment"] / fcfs["attainment"] if fcfs["attainment"] else None
    out["attainment_ratio"] = {"value": ratio, "target": f"≥ {TARGETS['attainment_ratio_min']}",
                               "met": ratio is not None and ratio >= TARGETS["attainment_ratio_min"]}
    lc = at[best].get(large, {})
    # a trace that drew no large request cannot show that every one completes: not met
    out["large_completed"] = {"value": f"{lc.get('completed', 0)}/{lc.get('n', 0)} ({large})", "target": "all",
                              "met": bool(lc.get("n")) and lc.get("completed") == lc.get("n")}
    return out


def offered(trace: Trace, mix: dict[str, float]) -> dict[str, float] | None:
    """What ``trace`` offers against its nominal load (its ``load`` x ``capacity_rps``): a seeded
    draw arrives faster or slower than its rate and draws more or less work than the mix. Its
    arrivals' rate over the nominal one, its mean standalone time over the mix's, and the load
    the two make. None without the figures."""
    try:
        nominal, cap = float(trace.load), float(trace.capacity_rps)  # (extra fields of a bench trace)
        alone = {c: float(v.standalone_s) for c, v in trace.classes.items()}
        span = trace.requests[-1].at - trace.requests[0].at
        work = sum(alone[r.cls] for r in trace.requests) / len(trace.requests)
        expected = sum(m * alone[c] for c, m in mix.items()) / sum(mix.values())
        rate = (len(trace.requests) - 1) / span / (nominal * cap)
    except (AttributeError, TypeError, ValueError, KeyError, ZeroDivisionError):
        return None
    return {"rate": rate, "work": work / expected, "load": nominal * rate * work / expected}


def at_load(trace: Trace, mix: dict[str, float]) -> Trace:
    """``trace`` stretched in time to offer exactly its nominal load (``offered``): the seed-0
    draw of 60 requests offered 1.10x what it was named for, so every "1.0x" run was above C.
    The same requests, in the same order, each arrival time scaled alike."""
    got = offered(trace, mix)
    return trace if got is None else scaled(trace, float(trace.load) / got["load"])


def order_bound(trace: Trace) -> float | None:
    """How far an order alone can take the mean latency on ``trace``: the mean of preemptive
    SRPT (least remaining work first, the order with the least mean latency on one server)
    against FCFS's, both on one server that takes each request for its class's standalone time.
    Batching (more capacity) and the overlap of stages are outside it; so is any cost of
    preempting. None without standalone times."""
    try:
        jobs = sorted((r.at, float(getattr(trace.classes[r.cls], "standalone_s"))) for r in trace.requests)
    except (AttributeError, TypeError, ValueError):
        return None
    if not jobs:
        return None
    free, fcfs = 0.0, 0.0
    for at, s in jobs:
        free = max(free, at) + s
        fcfs += free - at
    now, i, left, srpt = 0.0, 0, [], 0.0  # left: a heap of [work left, arrival]
    while i < len(jobs) or left:
        if not left:
            now = max(now, jobs[i][0])
        while i < len(jobs) and jobs[i][0] <= now:
            heapq.heappush(left, [jobs[i][1], jobs[i][0]])
            i += 1
        nxt = jobs[i][0] if i < len(jobs) else math.inf
        if now + left[0][0] <= nxt:
            now += left[0][0]
            srpt += now - heapq.heappop(left)[1]
        else:
            left[0][0] -= nxt - now  # the head keeps the least work left: the heap holds
            now = nxt
    return srpt / fcfs if fcfs > 0 else None


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:.0f}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v * 100:.0f}%"


def table(rows: dict[str, dict[str, dict]], classes: list[str]) -> str:
    head = ("| policy | load | class | n | completed | failed | refused | mean ms (resolved) | p50 ms | p99 ms "
            "| SLO attainment | goodput req/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p, by_load in rows.items():
        for load, s in by_load.items():
            for c in ["all", *classes]:
                if c not in s:
                    continue
                r = s[c]
                good = r.get("goodput_rps")
                lines.append(f"| {p} | {load} | {c} | {r['n']} | {r['completed']} | {r['failed']} | {r['refused']} "
                             f"| {_ms(r['mean_s'])} "
                             f"| {_ms(r['p50_s'])} | {_ms(r['p99_s'])} | {_pct(r['attainment'])} "
                             f"| {'' if c != 'all' or good is None else format(good, '.2f')} |")
    return "\n".join(lines)


def plot(rows: dict[str, dict[str, dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    for p, by_load in rows.items():
        loads = [x for x in by_load if not x.startswith("monitor")]
        try:
            xs = [float(x.rstrip("x")) for x in loads]
        except ValueError:  # a replayed trace (--trace) is named after its file
            xs = list(range(len(loads)))
        ax1.plot(xs, [by_load[x]["all"]["attainment"] * 100 for x in loads], marker="o", label=p)
        ax2.plot(xs, [by_load[x]["all"]["mean_s"] for x in loads], marker="o", label=p)
    ax1.set_ylabel("SLO attainment (%)")
    ax2.set_ylabel("mean latency, submit → resolved (s)")
    for ax in (ax1, ax2):
        ax.set_xlabel("load (× fcfs capacity)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the command ----------------------------------------------------------------------------------
def check_args(args: argparse.Namespace) -> str | None:
    """Why the classes or the trace cannot be run, naming the flag (cli.py's cmd_bench refuses it
    before any deployment starts), or None. A request the deployment answers with a 400 (an
    application it does not deploy, a size beyond its limits) was counted as neither completed,
    failed nor refused, and a trace class without ``slo_s`` failed after the whole run: each
    request is checked as the proxy checks it (``build_job``, as the simulator does)."""
    from onepiece.bench.trace import TraceError
    from onepiece.config import deploy_dir, load_workflow
    from onepiece.proxy.errors import ApiError
    from onepiece.proxy.validation import build_job

    wf = load_workflow(deploy_dir() / "wan21.yaml")  # the workflow write_topology deploys, T2V_STAGES only
    served = sorted(a for a, spec in wf.applications.items() if set(spec.stages) <= set(T2V_STAGES))

    def unserved(body: dict[str, Any]) -> str | None:
        if body["model"] not in served:
            return f"application {body['model']!r} is not deployed by this benchmark (only {', '.join(served)})"
        try:
            build_job(wf, body, None)
        except ApiError as e:
            return e.message
        return None

    if args.trace:
        try:
            trace = load_trace(args.trace)
        except TraceError as e:
            return f"argument --trace: {e}"
        if lacking := sorted(c for c, v in trace.classes.items() if v.slo_s is None):
            return f"argument --trace: {args.trace}: classes {', '.join(lacking)} have no slo_s (attainment is judged on it)"
        seen: set[bytes] = set()
        for i, r in enumerate(trace.requests):
            body = r.body(PROMPT)
            key = orjson.dumps({k: v for k, v in body.items() if k not in ("prompt", "seed")})
            if key not in seen and (why := unserved(body)):
                return f"argument --trace: {args.trace}: requests[{i}] (class {r.cls}): {why}"
            seen.add(key)
        return None
    try:
        classes = parse_classes(args.classes)
    except SystemExit as e:  # what it says names the class, not the flag
        return f"argument --classes: {e}"
    for name, c in classes.items():
        body = {"prompt": PROMPT, "model": c.get("app", "t2v"), "size": c["size"], "num_frames": c["num_frames"],
                "steps": c["steps"]}
        if why := unserved(body):
            return f"argument --classes: class {name} ({c['size']}x{c['num_frames']}:{c['steps']}): {why}"
    for flag in ("--mix", "--alpha"):
        try:
            parse_floats(getattr(args, flag[2:]), len(classes), flag)
        except SystemExit as e:
            return f"argument {flag}: {e}"
    return None


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    from onepiece.sched.options import POLICIES

    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise SystemExit(f"bad --policies {args.policies!r}: known policies are {', '.join(POLICIES)}")
    classes = parse_classes(args.classes)
    names = list(classes)
    mix = dict(zip(names, parse_floats(args.mix, len(names), "--mix")))
    alpha = dict(zip(names, parse_floats(args.alpha, len(names), "--alpha")))
    given = load_trace(args.trace) if args.trace else None
    if given is not None:
        classes = {k: v.model_dump(exclude_none=True) for k, v in given.classes.items()}
        names = list(classes)
    loads = sorted(args.loads)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    schedule = {p: ({"policy": p} if p == "fcfs" else {"policy": p, "max_batch": args.max_batch}) for p in policies}
    results: dict[str, dict[str, list[dict]]] = {}
    stage: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    cal: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="onepiece-bench-") as tmp:
        models = model_dirs(Path(args.models) if args.models else None, args.profile)
        traces: dict[str, Trace] = {}
        first = True
        for p in policies:
            log(f"[{p}] starting a deployment (denoise_t2v schedule {schedule[p]}) ...")
            with Session(p, models, Path(tmp) / p, args, schedule[p]) as s:
                if first and given is None:
                    if p != "fcfs":
                        raise SystemExit("the capacity is measured under fcfs: list fcfs first in --policies")
                    cal = _run_async(calibrate(s.target(), classes, mix, args.repeat, args.calibrate, args.seed))
                    cap = args.capacity or cal["closed_loop_rps"] or (cal["nm"] or {}).get("capacity")
                    if not cap:
                        raise RuntimeError("no capacity measured")
                    cal["capacity_rps"] = cap
                    for c in names:
                        classes[c].update(standalone_s=cal["standalone_s"][c], alpha=alpha[c],
                                          slo_s=alpha[c] * cal["standalone_s"][c])
                    for load in loads:
                        tr = at_load(poisson_trace(classes, mix, load * cap, args.requests, args.seed,
                                                   timeout_s=args.timeout or None, capacity_rps=cap, load=load,
                                                   note="onepiece bench sched"), mix)
                        traces[f"{load:g}x"] = tr
                        (outdir / f"sched-trace-{load:g}x.json").write_bytes(tr.dump())
                elif first:
                    traces[Path(args.trace).stem] = given
                first = False
                by = results[p] = _run_async(run_traces(s.target(), classes, traces, args, p))
                for load in traces:
                    save_schedule(outdir / schedule_name(p, load), s.dep.log_dir, by[load])
            stage[p] = by.pop("stage", None)  # the denoise stage's own counts
            # its measured costs, for a simulator to replay its traces with
            (outdir / costs_name(p)).write_text(json.dumps(by.pop("costs"), indent=1))
            for load, table in by.pop("costs_by_load").items():
                (outdir / costs_name(p, load)).write_text(json.dumps(table, indent=1))
            # What has run is saved at once: a run stopped at a time limit keeps it.
            targets = report(outdir, args, t_start, classes, names, mix, cal, traces, results, stage)
        if args.monitor_load and targets.get("best"):
            best = targets["best"]
            if given is None:
                cap = cal["capacity_rps"]
                tr = at_load(poisson_trace(classes, mix, args.monitor_load * cap, args.requests, args.seed,
                                           timeout_s=args.timeout or None, capacity_rps=cap,
                                           load=args.monitor_load, note="onepiece bench sched, monitor on"), mix)
                key = f"monitor on {args.monitor_load:g}x"
                (outdir / f"sched-trace-monitor-{args.monitor_load:g}x.json").write_bytes(tr.dump())
            else:  # the same trace again, admitted by the monitor
                tr, key = given, f"monitor on {list(traces)[-1]}"
            log(f"[{best}] with the request monitor on: {key} ...")
            with Session(f"{best}-monitor", models, Path(tmp) / "monitor", args, schedule[best], monitor=True) as s:
                out = _run_async(run_traces(s.target(), classes, {key: tr}, args, f"{best}, monitor on"))
                recs = out[key]
                save_schedule(outdir / schedule_name(best, key), s.dep.log_dir, recs)
                (outdir / costs_name(best, key)).write_text(json.dumps(out["costs_by_load"][key], indent=1))
                # (its stage counts are not kept: they mix the warm-up and one trace)
            results.setdefault(f"{best} (monitor on)", {})[key] = recs
    report(outdir, args, t_start, classes, names, mix, cal, traces, results, stage, final=True)
    return 0


def parts_pace(outdir: Path, traces: dict[str, Trace], results: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """Per trace, ``pace`` of the policies that ran it (their cost tables under it, as saved)."""
    out = {}
    for load in traces:
        tables = {p: json.loads(f.read_text()) for p in results
                  if "monitor" not in p and (f := outdir / costs_name(p, load)).exists()}
        if tables:
            out[load] = pace(tables)
    return out


def report(outdir: Path, args: argparse.Namespace, t_start: float, classes: dict[str, dict], names: list[str],
           mix: dict[str, float], cal: dict[str, Any], traces: dict[str, Trace], results: dict[str, dict],
           stage: dict[str, Any], final: bool = False) -> dict[str, Any]:
    """sched.json, sched.md and sched.png of the policies run so far (the monitor-on run a row of
    its own); the targets, judged without it. Printed when ``final``."""
    slo = {c: classes[c]["slo_s"] for c in names}
    rows = {p: {load: summarize(recs, slo) for load, recs in by.items()} for p, by in results.items()}
    top = list(traces)[-1]
    # the large class is the one that takes longest alone (--classes lists it last, a trace's
    # classes may come in any order)
    by_size = sorted(names, key=lambda c: classes[c].get("standalone_s") or 0.0)
    targets = check_targets({p: r for p, r in rows.items() if "monitor" not in p}, top, by_size)
    if targets:
        targets["order_bound"] = order_bound(traces[top])
    elapsed = time.monotonic() - t_start
    result = {"bench": "sched", "when": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(),
              "cpu_count": os.cpu_count(), "elapsed_s": elapsed,
              "settings": {k: v for k, v in vars(args).items() if k not in ("fn", "which")},
              "classes": classes, "mix": mix, "calibration": cal, "rows": rows, "targets": targets, "stage": stage,
              "offered": {k: offered(t, mix) for k, t in traces.items()},
              "pace": (paced := parts_pace(outdir, traces, results)),
              "requests": results}
    (outdir / "sched.json").write_text(json.dumps(result, indent=1, default=str))
    shapes = ", ".join(f"{c} {classes[c]['size']}x{classes[c]['num_frames']}" for c in names)
    title = f"onepiece bench sched: classes {shapes}, mix {args.mix}, SLO alpha {args.alpha}, max batch {args.max_batch}"
    plot({p: r for p, r in rows.items() if "monitor" not in p}, outdir / "sched.png", title)
    md = [f"`onepiece bench sched` — {result['when']}, {cpu_name()}, {os.cpu_count()} cores, device {args.device}, "
          f"{args.profile} models, "
          f"{'/'.join(sorted({str(len(t.requests)) for t in traces.values()}))} requests per trace, "
          f"{elapsed:.0f} s in all.", ""]
    if cal:
        md += ["Calibration (fcfs): " + "; ".join(
            f"{c} {classes[c]['size']}x{classes[c]['num_frames']}:{classes[c]['steps']} standalone "
            f"{cal['standalone_s'][c] * 1000:.0f} ms, SLO {classes[c]['slo_s'] * 1000:.0f} ms" for c in names)
            + f"; capacity C = {cal['capacity_rps']:.3f} req/s (closed loop; NM estimate "
              f"{((cal['nm'] or {}).get('capacity') or float('nan')):.3f}).", ""]
    md += [table(rows, names), ""]
    drawn = {k: o for k, t in traces.items() if (o := offered(t, mix)) is not None}
    if drawn:  # a seeded draw is not its nominal load
        md += ["What each trace offered: " + "; ".join(
            f"{k}: {o['load']:.2f}× C (arrivals {o['rate']:.2f}× the nominal rate, work {o['work']:.2f}× the mix's)"
            for k, o in drawn.items()) + ".", ""]
    if any(len(by) > 1 for by in paced.values()):
        md += ["What the machine's steps and calls cost during each policy's part of a trace, against the "
               "first's (`bench/pace.py`: the batch-1 rows every part measured; the policies ran one after "
               "another, and this machine's speed drifts): " + "; ".join(
                   f"{k}: " + ", ".join(f"{p} {x:.2f}×" if x is not None else f"{p} n/a" for p, x in by.items())
                   for k, by in paced.items()) + ". A part that ran slower had more to do; `bench simval "
               "--costs-of POLICY` replays every policy at one part's costs.", ""]
    if targets:
        md += [f"Targets at {targets['load']} (best policy: {targets['best']}):", "",
               "| target | value | wanted | met |", "|---|---|---|---|"]
        for k in ("mean_ratio", "attainment", "attainment_ratio", "large_completed"):
            v = targets[k]
            val = v["value"] if isinstance(v["value"], str) else "n/a" if v["value"] is None else f"{v['value']:.3f}"
            md.append(f"| {k.replace('_', ' ')} | {val} | {v['target']} | {'yes' if v['met'] else 'NO'} |")
        if targets.get("order_bound") is not None:
            md += ["", f"What an order alone can do on the {targets['load']} trace (`order_bound`): preemptive "
                       "SRPT on one server that takes each request for its class's standalone time has "
                       f"{targets['order_bound']:.3f}× the mean latency of FCFS on that server. Below it, only "
                       "more capacity (batching) lowers the mean."]
    soft = {r.timeout_s for tr in traces.values() for r in tr.requests if r.slo_s is not None}
    due = ("its class's SLO" if not soft else f"{', '.join(f'{x:g}' for x in sorted(soft))} s; its class's SLO is "
           "its target (slo_s), which a request may miss and still complete")
    md += ["", f"Each request's deadline: {due}. Latency: submit → the DB's completed_at (completed) or its failure "
               "(a request whose deadline passed is dropped where it is and fails); mean over all requests admitted, "
               "p50/p99 over completed ones. SLO attainment: completed within the class's SLO / sent. Goodput: those "
               "/ duration."]
    text = "\n".join(md)
    (outdir / "sched.md").write_text(text + "\n")
    if final:
        print()
        print(text)
        print(f"saved {outdir / 'sched.json'}, sched.md, sched.png and the traces under {outdir}")
    return targets
