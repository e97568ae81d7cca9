"""`onepiece bench elastic`: how fast the NM moves an instance to a saturated stage.

A local deployment (`onepiece up`'s Deployment, embedded NM) on the tiny models: one set with
text_encode ×1, denoise_t2v ×1 and vae_decode ×2 (vae_decode keeps a minimum of 1), one DB,
one proxy with the request monitor off (so the load reaches denoise instead of being refused),
every stage worker on one torch thread. Requests are denoise-heavy (``--shape``), so a
closed-loop load of ``--clients`` saturates denoise_t2v while vae_decode idles.

Each round:

1. the cluster is quiet for 1.5 windows (no stage has a saturated window left over);
2. the load starts: *saturation begins* at the first request's submission;
3. the NM sees denoise_t2v above the threshold for a window and moves the least busy
   vae_decode instance there (the decision, with its inputs, is in `onepiece status`);
4. *reaction time* ends when the moved instance has received its first denoise_t2v request
   (its stats, polled from the NM every 50 ms);
5. the load stops, every request's outcome is checked, and the instance is moved back by an
   operator move (``move`` RPC) for the next round.

Reaction time = window (the evidence the policy needs) + the NM's next turn + drain (two
heartbeats at least, plus what the instance holds) + loading the new stage's models + the
route update reaching the senders. The report splits it into those parts. Throughput
(completions/s) before the move and after the moved instance serves is measured in the same
run. Results go to ``elastic.json`` and ``elastic.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onepiece.argtypes import SHARE, count, out_dir, positive
from onepiece.bench.common import PROMPT, parse_shape, percentile, shape_flag, tiny_models

STAGES = {"text_encode": 1, "denoise_t2v": 1, "vae_decode": 2}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=count(), default=3, help="saturate / move / move back rounds")
    p.add_argument("--window", type=positive(" seconds"), default=5.0, help="the NM's utilization window, seconds")
    p.add_argument("--threshold", type=SHARE, default=0.85, help="utilization that counts as saturated")
    p.add_argument("--heartbeat", type=positive(" seconds"), default=0.25, help="instances' heartbeat period, seconds")
    p.add_argument("--clients", type=count(), default=4, help="closed-loop clients")
    p.add_argument("--shape", type=shape_flag, default="32x32x5:100", help="the load's requests, WxHxFRAMES:STEPS")
    p.add_argument("--round-timeout", type=positive(" seconds"), default=120.0, help="bound on one round, seconds")
    p.add_argument("--models", help="folder for the tiny models (default: a temporary one)")
    p.add_argument("--logs", help="keep the deployment's logs in this folder (default: dropped with the run)")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for elastic.json and elastic.md")


def write_topology(folder: Path, models: dict[str, Path], nm_address: str, *, window_s: float,
                   cooldown_s: float, low: float = 0.0, threshold: float = 0.85, heartbeat_s: float = 0.25,
                   stages: dict[str, int] | None = None, idle: int = 0, cold_windows: int = 10) -> Path:
    """The elastic deployment (tests use it too): monitor off, one torch thread per worker
    (processes, not torch threads, share the cores), denoise scheduled fcfs (each request alone:
    what a move adds is then a second worker's rate, not a change in how batches fill)."""
    from onepiece.launcher import write_topology as base

    return base(folder, models, nm_address, dbs=1, stages=stages or dict(STAGES), heartbeat_s=heartbeat_s,
                proxy={"monitor": False, "port": 0}, idle=idle, threads=1,
                schedule={"denoise_t2v": {"policy": "fcfs"}},
                nm={"elastic": {"window_s": window_s, "cooldown_s": cooldown_s, "low": low, "threshold": threshold,
                                "cold_windows": cold_windows}})


def request_body(shape: str) -> dict[str, Any]:
    w, h, frames, steps = parse_shape(shape)
    return {"prompt": PROMPT, "model": "t2v", "size": f"{w}x{h}", "num_frames": frames, "steps": steps}


@dataclass
class Load:
    """Closed-loop clients: each submits, polls until its request is done, and goes again,
    until ``stop`` or ``deadline``. Every outcome is kept: (submitted, finished, status, error)."""

    url: str
    body: dict[str, Any]
    clients: int
    deadline: float  # monotonic; nothing runs past it
    outcomes: list[tuple[float, float, str, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> "Load":
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def _client(self) -> None:
        import httpx

        with httpx.Client(base_url=self.url, timeout=10) as http:
            while not self.stop.is_set() and time.monotonic() < self.deadline:
                t0 = time.monotonic()
                try:
                    r = http.post("/v1/videos", json=self.body)
                    if r.status_code != 200:
                        self.outcomes.append((t0, time.monotonic(), f"http {r.status_code}", r.text[:200]))
                        continue
                    vid = r.json()["id"]
                    while time.monotonic() < self.deadline:
                        v = http.get(f"/v1/videos/{vid}").json()
                        if v["status"] in ("completed", "failed"):
                            err = (v.get("error") or {}).get("message", "") if v["status"] == "failed" else ""
                            self.outcomes.append((t0, time.monotonic(), v["status"], err))
                            break
                        time.sleep(0.05)
                    else:
                        self.outcomes.append((t0, time.monotonic(), "unanswered", vid))
                except httpx.HTTPError as e:
                    self.outcomes.append((t0, time.monotonic(), "error", repr(e)))

    def finish(self, timeout: float) -> None:
        """Stop submitting; wait (bounded) for the requests in flight."""
        self.stop.set()
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.1, end - time.monotonic()))

    def rate(self, t0: float, t1: float) -> float:
        """Completions per second between two monotonic times."""
        done = sum(1 for _, t, s, _ in self.outcomes if s == "completed" and t0 <= t < t1)
        return done / (t1 - t0) if t1 > t0 else 0.0

    def bad(self) -> list[tuple[float, float, str, str]]:
        return [o for o in self.outcomes if o[2] != "completed"]


def instance(status: dict[str, Any], inst_id: str, set_name: str = "set0") -> dict[str, Any] | None:
    st = status["sets"][set_name]
    for i in [*st["idle"], *(x for v in st["stages"].values() for x in v["instances"])]:
        if i["id"] == inst_id:
            return i
    return None


def _round(nm, url: str, args: argparse.Namespace, body: dict[str, Any]) -> dict[str, Any]:
    seen = {d["at"] for d in nm.status()["elastic"]["decisions"]}
    load = Load(url, body, args.clients, time.monotonic() + args.round_timeout).start()
    t_start, t_start_wall = time.monotonic(), time.time()
    decision = moved_serving = None
    try:
        while time.monotonic() < load.deadline and moved_serving is None:
            status = nm.status()
            new = [d for d in status["elastic"]["decisions"] if d["at"] not in seen and d["to"] == "denoise_t2v"]
            if new and decision is None:
                decision = new[0]
            if decision is not None:
                inst = instance(status, decision["instance"])
                if inst and inst["serving"] == "denoise_t2v" and inst["stats"].get("received", 0) >= 1:
                    moved_serving = time.monotonic()
            time.sleep(0.05)
        if moved_serving is None:
            raise SystemExit(f"no instance moved to denoise_t2v and served within {args.round_timeout:.0f}s")
        time.sleep(max(3 * args.window, 8.0))  # the load goes on: throughput with two denoise instances
        t_after = time.monotonic()
    finally:
        load.finish(timeout=60)
    t_decided = t_start + (decision["at"] - t_start_wall)
    before = load.rate(t_start + args.window / 2, t_decided)
    after = load.rate(moved_serving + 1.0, t_after)
    return {"reaction_s": moved_serving - t_start, "decision_s": t_decided - t_start,
            "move_s": moved_serving - t_decided, "instance": decision["instance"], "holding": decision["holding"],
            "inputs": decision["inputs"], "rate_before": before, "rate_after": after,
            "requests": len(load.outcomes), "bad": [list(o) for o in load.bad()]}


def run(args: argparse.Namespace) -> int:
    from onepiece.launcher import Deployment, free_tcp_address
    from onepiece.nm.client import NmClient

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    body = request_body(args.shape)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="onepiece-bench-") as tmp:
        models = tiny_models(Path(args.models) if args.models else Path(tmp) / "models")
        folder = Path(tmp)
        address = free_tcp_address()
        topo = write_topology(folder, models, address, window_s=args.window, cooldown_s=args.window,
                              threshold=args.threshold, heartbeat_s=args.heartbeat)
        dep = Deployment(topo, Path(args.logs) if args.logs else folder / "logs")
        nm = NmClient(address, timeout=2.0)
        try:
            dep.start()
            url = dep.wait_ready(300)["set0"][0]
            for k in range(args.rounds):
                time.sleep(1.5 * args.window)  # quiet: no saturated window left over
                r = _round(nm, url, args, body)
                rounds.append(r)
                print(f"round {k + 1}: reaction {r['reaction_s']:.2f}s (decision {r['decision_s']:.2f}s + move "
                      f"{r['move_s']:.2f}s), {r['rate_before']:.2f} -> {r['rate_after']:.2f} req/s, "
                      f"{len(r['bad'])} not completed of {r['requests']}", flush=True)
                nm.move(r["instance"], "vae_decode")  # back, for the next round
                deadline = time.monotonic() + args.round_timeout
                while time.monotonic() < deadline:
                    inst = instance(nm.status(), r["instance"])
                    if inst and inst["stage"] == "vae_decode" and inst["ready"]:
                        break
                    time.sleep(0.2)
        finally:
            nm.close()
            dep.stop()
    return _report(args, rounds)


def _report(args: argparse.Namespace, rounds: list[dict[str, Any]]) -> int:
    reaction = [r["reaction_s"] for r in rounds]
    summary = {
        "reaction_p50_s": percentile(reaction, 50), "reaction_max_s": max(reaction),
        "decision_p50_s": percentile([r["decision_s"] for r in rounds], 50),
        "move_p50_s": percentile([r["move_s"] for r in rounds], 50),
        "rate_before_p50": percentile([r["rate_before"] for r in rounds], 50),
        "rate_after_p50": percentile([r["rate_after"] for r in rounds], 50),
        "not_completed": sum(len(r["bad"]) for r in rounds), "requests": sum(r["requests"] for r in rounds),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in ("rounds", "window", "threshold", "heartbeat", "clients", "shape")}
    (out / "elastic.json").write_text(json.dumps({"settings": settings, "summary": summary, "rounds": rounds},
                                                 indent=2))
    lines = [f"# onepiece bench elastic ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"settings: {settings}", "",
             "| round | reaction s | decision s | move s | moved holding | req/s before | req/s after |",
             "|---|---|---|---|---|---|---|"]
    for k, r in enumerate(rounds, 1):
        lines.append(f"| {k} | {r['reaction_s']:.2f} | {r['decision_s']:.2f} | {r['move_s']:.2f} | {r['holding']} "
                     f"| {r['rate_before']:.2f} | {r['rate_after']:.2f} |")
    lines += ["", f"reaction p50 {summary['reaction_p50_s']:.2f} s, max {summary['reaction_max_s']:.2f} s; "
                  f"throughput p50 {summary['rate_before_p50']:.2f} -> {summary['rate_after_p50']:.2f} req/s; "
                  f"{summary['not_completed']} of {summary['requests']} requests not completed"]
    (out / "elastic.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if summary["not_completed"] == 0 else 1
