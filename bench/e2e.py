"""`onepiece bench e2e`: end-to-end latency of the split pipeline against the monolithic one.

For each case (WxHxF / steps) it measures, at concurrency 1 and with the same tiny models and
seed:

- monolithic: ``WanPipeline(...)`` in this process, frames only, and frames + the same MP4
  encoding the deployment does (the like-for-like baseline: both end with an MP4);
- the deployment's own stage functions one after another in this process (what the stages
  compute with no process boundary, per stage);
- onepiece: a local deployment (`onepiece up`'s Deployment, every stage its own process),
  from just before the HTTP POST until the DB stored the result (the record's completed_at,
  same clock), with the per-stage breakdown from each result's own trace. Completion is
  learnt from the DB's completion event (a ZMQ SUB), not by polling HTTP, so the benchmark
  steals no CPU from the stages while they run (on 2 cores, polling every 20 ms raised the
  small case's ratio from 1.10 to 1.19 in one run here).

The ratio it reports is the median of each request's ratio to the monolithic call next to
it: the machine's speed drifts by tens of percent within a run, and a pair taken a second apart
sees the same machine (a ratio of the two medians mixes requests from different minutes).

It prints a table and saves JSON (and a Markdown table) under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zmq

from onepiece.argtypes import count, out_dir, torch_device
from onepiece.bench.common import (MAX_THREADS, PROMPT, T2V_STAGES, cpu_name, parse_shape, shapes_flag,
                                   tiny_models)
from onepiece.stage.threads import TRIALS
from onepiece.transport import curve

DEFAULT_CASES = "64x64x9:10,256x256x17:10"
SETTLE_S = 0.05
# Rounds before the measured ones: a worker's first call of a shape, then its tries of 1 thread
# and all cores on it (stage/threads.py; tried again every KEEP_FOR uses, not here).
WARMUP = 1 + 2 * TRIALS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", type=shapes_flag, default=DEFAULT_CASES, help="comma-separated WxHxFRAMES:STEPS")
    p.add_argument("--requests", type=count(), default=20, help="measured requests per case (after the warm-up rounds)")
    p.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    p.add_argument("--device", default="cpu", type=torch_device, help="torch device of every stage and of the monolithic pipeline (cpu, cuda)")
    p.add_argument("--threads", type=count(0, MAX_THREADS), default=0,
                   help="torch threads of every stage worker (default 0: the workflow's own, 1 or all cores per shape)")
    p.add_argument("--models", help="folder for the tiny models (default: a temporary one)")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for e2e.json and e2e.md")


def _cases(spec: str) -> list[tuple[int, int, int, int]]:
    return [parse_shape(item) for item in spec.split(",")]


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50": statistics.median(xs), "mean": statistics.fmean(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


class Monolithic:
    """The diffusers pipeline in this process, ending with the same MP4 encoding."""

    def __init__(self, model_dir: Path, device: str) -> None:
        from diffusers import WanPipeline

        self.pipe = WanPipeline.from_pretrained(model_dir).to(device)
        self.pipe.set_progress_bar_config(disable=True)

    def __call__(self, w: int, h: int, f: int, steps: int) -> tuple[float, float]:
        """Seconds to frames, and to frames + MP4."""
        import torch

        from onepiece.stage.wan.functions import encode_mp4

        t0 = time.perf_counter()
        frames = self.pipe(prompt=PROMPT, negative_prompt="", height=h, width=w, num_frames=f,
                           num_inference_steps=steps, guidance_scale=5.0, max_sequence_length=64,
                           generator=torch.Generator().manual_seed(0), output_type="np").frames[0]
        t1 = time.perf_counter()
        encode_mp4(frames, 16)
        return t1 - t0, time.perf_counter() - t0


class SplitInProcess:
    """The deployment's own stage functions one after another in this process, each message
    encoded and decoded between them as between processes: what the stages compute with no
    process boundary (components loaded as a worker loads them, by ``onepiece profile``'s
    Profiler)."""

    def __init__(self, folder: Path, device: str) -> None:
        from onepiece.config import load_workflow
        from onepiece.profile import Profiler

        self.wf = load_workflow(folder / "workflow.yaml")
        self.prof = Profiler(self.wf, folder, device, None)
        self.stages = list(self.wf.applications["t2v"].stages)
        for stage in self.stages:
            self.prof.context(stage)

    def __call__(self, w: int, h: int, f: int, steps: int) -> dict[str, float]:
        """Seconds per stage for one request."""
        import torch

        from onepiece.proxy.validation import build_job
        from onepiece.stage.registry import lookup
        from onepiece.stage.worker import run_task
        from onepiece.transport.message import Message, decode, encode, new_uid

        job = build_job(self.wf, {"prompt": PROMPT, "model": "t2v", "size": f"{w}x{h}", "num_frames": f,
                                  "steps": steps, "seed": 0, "guidance": 5.0}, None)
        msg = Message({"uid": new_uid(), "app": "t2v", "params": job.params()})
        out = {}
        for stage in self.stages:
            fn = lookup(self.wf.function_of(stage), "t2v")
            t0 = time.perf_counter()
            with torch.inference_mode():
                parts = run_task(fn, self.prof.context(stage), msg)
            out[stage] = time.perf_counter() - t0
            msg = decode(encode(Message(msg.header, parts)))
        return out


def _breakdown(trace: list[dict], sent: float, stored: float) -> dict[str, float]:
    """Seconds per stage (recv → end: queue wait + compute; and of that, until its worker
    started: queue wait, decision and the hand-over) and per hop between them, and at
    the ends: from the client's POST (``sent``) until the proxy sent the request on, and from the
    last stage's end until the DB held the result (``stored``)."""
    out: dict[str, float] = {}
    last = None
    for ev in trace:
        t = ev["t"] / 1e9
        if ev["stage"] == "proxy" and ev["event"] == "leave":
            out["client→proxy sent"] = t - sent
        if ev["event"] == "recv" and last is not None:
            out[f"hop→{ev['stage']}"] = out.get(f"hop→{ev['stage']}", 0.0) + t - last
            out.setdefault(f"_recv_{ev['stage']}", t)
        if ev["event"] == "start" and f"_recv_{ev['stage']}" in out:
            out.setdefault(f"{ev['stage']} until its worker starts", t - out[f"_recv_{ev['stage']}"])
        if ev["event"] == "end":
            out[ev["stage"]] = t - out.pop(f"_recv_{ev['stage']}", t)
        if ev["event"] in ("leave", "end"):
            last = t
    if last is not None:
        out["last stage→DB stored"] = stored - last
    return {k: v for k, v in out.items() if not k.startswith("_")}


def _wait_done(events: "zmq.Socket", uid: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if events.poll(int(left * 1000)) and json.loads(events.recv_multipart()[1])["uid"] == uid:
            return
    raise TimeoutError(f"{uid} not done in {timeout:.0f}s")


def generate(c: Any, db: Any, events: "zmq.Socket", shape: tuple[int, int, int, int],
             **extra: Any) -> tuple[dict, dict]:
    """One request through a ``t2v_set`` (``c`` a client of its proxy), awaited through the DB's
    done event: its video object and its completed record."""
    w, h, f, steps = shape
    v = c.submit(PROMPT, model="t2v", size=f"{w}x{h}", num_frames=f, steps=steps, seed=0, **extra)
    uid = v["id"].removeprefix("video_")
    _wait_done(events, uid, timeout=600)
    rec = db.get(uid)
    if rec["status"] != "completed":
        raise RuntimeError(f"request {uid} ended {rec['status']}: {rec.get('error')}")
    return v, rec


@contextlib.contextmanager
def t2v_set(models: dict[str, Path], folder: Path, transport: str = "ipc", device: str = "cpu",
            threads: int = 0) -> Iterator[tuple[str, Any, "zmq.Socket"]]:
    """The benchmarks' one-set t2v deployment (text_encode, denoise_t2v, vae_decode, one DB, one
    proxy), ready: its proxy's URL, a client of its DBs, and a socket on their done events
    (``generate``); stopped on the way out."""
    from onepiece.db.client import DbClient
    from onepiece.launcher import Deployment, free_tcp_address, write_topology
    from onepiece.nm.client import NmClient

    dep = Deployment(write_topology(folder, models, free_tcp_address(), dbs=1, transport=transport, heartbeat_s=1.0,
                                    stages=dict(T2V_STAGES), device=device, threads=threads),
                     folder / "logs")
    try:
        dep.start()
        url = dep.wait_ready(300)["set0"][0]
        nmc = NmClient(dep.nm_address)
        dbs = nmc.routes("set0")["dbs"]
        nmc.close()
        db = DbClient([d["control"] for d in dbs])
        events = zmq.Context.instance().socket(zmq.SUB)
        events.setsockopt(zmq.SUBSCRIBE, b"done")
        curve.client(events)
        for d in dbs:
            events.connect(d["events"])
        try:
            yield url, db, events
        finally:
            db.close()
            events.close(0)
    finally:
        dep.stop()


def measure(models: dict[str, Path], cases: list, n: int, transport: str, folder: Path, device: str,
            threads: int = 0) -> dict[str, Any]:
    """Monolithic and onepiece runs alternate, request by request, so that drift in the
    machine's speed (a shared VM) hits both alike."""
    from onepiece.client import Client

    out: dict[str, Any] = {}
    with t2v_set(models, folder, transport, device, threads) as (url, db, events):
        mono = Monolithic(models["t2v"], device)
        split = SplitInProcess(folder, device)
        with Client(url) as c:
            for w, h, f, steps in cases:
                frames_t, mp4_t, lat, stages, alone = [], [], [], [], []
                for i in range(WARMUP + n):
                    a, b = mono(w, h, f, steps)
                    one = split(w, h, f, steps)
                    # This process's torch threads spin for milliseconds after their last work (at
                    # libgomp's default), on the cores the stages are about to use: let them stop.
                    time.sleep(SETTLE_S)
                    t0 = time.time()
                    v, rec = generate(c, db, events, (w, h, f, steps), guidance=5.0)
                    c.download(v["id"], folder / "out.mp4")
                    if i >= WARMUP:
                        frames_t.append(a)
                        mp4_t.append(b)
                        lat.append(rec["completed_at"] - t0)
                        stages.append(_breakdown(rec.get("trace") or [], t0, rec["completed_at"]))
                        alone.append(one)
                keys = sorted({k for s in stages for k in s})
                out[f"{w}x{h}x{f}:{steps}"] = {
                    "monolithic_frames": _stats(frames_t),
                    "monolithic_mp4": _stats(mp4_t),
                    "onepiece": _stats(lat),
                    "paired_ratio_vs_mp4": _stats([x / y for x, y in zip(lat, mp4_t)]),
                    "paired_ratio_vs_frames": _stats([x / y for x, y in zip(lat, frames_t)]),
                    "onepiece_stages_p50": {k: statistics.median([s.get(k, 0.0) for s in stages]) for k in keys},
                    "in_process_stages_p50": {k: statistics.median([s[k] for s in alone]) for k in split.stages},
                }
    return out


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return cpu_name()


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cases = _cases(args.cases)
    with tempfile.TemporaryDirectory(prefix="onepiece-bench-") as tmp:
        models = tiny_models(Path(args.models) if args.models else Path(tmp) / "models")
        print(f"measuring {len(cases)} cases x {args.requests} requests (monolithic and onepiece alternate) ...",
              flush=True)
        res = measure(models, cases, args.requests, args.transport, Path(tmp), args.device, args.threads)
    rows = []
    for key, r in res.items():
        rows.append({
            "case": key,
            "monolithic_frames_p50_s": r["monolithic_frames"]["p50"],
            "monolithic_mp4_p50_s": r["monolithic_mp4"]["p50"],
            "onepiece_e2e_p50_s": r["onepiece"]["p50"],
            "ratio_vs_mp4": r["paired_ratio_vs_mp4"]["p50"],
            "ratio_vs_frames": r["paired_ratio_vs_frames"]["p50"],
            "stages_p50_s": r["onepiece_stages_p50"],
            "in_process_stages_p50_s": r["in_process_stages_p50"],
        })
    from onepiece.stage.task_manager import worker_env

    spin = worker_env()["GOMP_SPINCOUNT"]
    result = {"bench": "e2e", "when": time.strftime("%Y-%m-%d %H:%M"), "cpu_count": os.cpu_count(),
              "workers_gomp_spincount": spin, "requests": args.requests, "warmup": WARMUP, "threads": args.threads,
              "transport": args.transport, "device": args.device, "cases": res, "rows": rows}
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "e2e.json").write_text(json.dumps(result, indent=2))
    lines = [f"Device: {args.device} ({_device_name(args.device)}); {os.cpu_count()} CPUs; {args.requests} requests per case; "
             f"transport {args.transport}; the stage workers' GOMP_SPINCOUNT {spin}, torch threads "
             f"{args.threads or ('1 or all cores per shape' if args.device == 'cpu' else 'as torch sets them')}; "
             f"{WARMUP} warm-up rounds.", "",
             "| case (WxHxF:steps) | monolithic frames p50 | monolithic + MP4 p50 | onepiece e2e p50 "
             "| ratio vs +MP4 (paired p50) | ratio vs frames (paired p50) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['monolithic_frames_p50_s']*1000:.1f} ms | {r['monolithic_mp4_p50_s']*1000:.1f} ms "
                     f"| {r['onepiece_e2e_p50_s']*1000:.1f} ms | {r['ratio_vs_mp4']:.3f} | {r['ratio_vs_frames']:.3f} |")
    lines.append("")
    for r in rows:
        parts = ", ".join(f"{k} {v*1000:.1f} ms" for k, v in r["stages_p50_s"].items())
        lines.append(f"- {r['case']} per-stage p50: {parts}")
        alone = r["in_process_stages_p50_s"]
        lines.append(f"- {r['case']} the same stage functions in one process, p50: "
                     + ", ".join(f"{k} {v*1000:.1f} ms" for k, v in alone.items())
                     + f" (sum {sum(alone.values())*1000:.1f} ms)")
    table = "\n".join(lines)
    (outdir / "e2e.md").write_text(table + "\n")
    print(table)
    print(f"saved {outdir / 'e2e.json'} and {outdir / 'e2e.md'}")
    return 0
