"""`onepiece bench cpu`: where a deployment's CPU goes, per role, per request and at idle.

It starts the deployment `bench e2e` uses (text_encode, denoise_t2v, vae_decode, one DB, one
proxy, ipc transport, tiny models), warms it up, then reads every process's CPU time (its
process CPU clock) and its threads' scheduler counters (``/proc/PID/task/TID/schedstat``: the
times each was put on a core) over
``--idle-s`` seconds with nothing to do, and over ``--requests`` requests sent one after
another (each awaited through the DB's done event, as bench e2e does). Per role (each stage's
scheduler process and its worker, the DB, the proxy, the NM): CPU milliseconds and wake-ups per
request, and per second at idle. On a machine of few cores the control plane's CPU is taken
from the workers (they run SCHED_IDLE) and its wake-ups interrupt their parallel regions: this
is what the small case of bench e2e pays besides its hops. Linux only (``/proc``). Saved as
``cpu.json`` and ``cpu.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from onepiece.argtypes import count, out_dir, positive
from onepiece.bench.common import cpu_name, shape_flag, tiny_models

WARMUP = 15


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=count(), default=40, help="requests measured, one after another (default 40)")
    p.add_argument("--idle-s", type=positive(" seconds"), default=5.0, help="seconds measured at idle (default 5)")
    p.add_argument("--size", type=shape_flag, default="64x64x9:10", help="WxHxFRAMES:STEPS of every request (default %(default)s)")
    p.add_argument("--models", help="folder for the tiny models (default: a temporary one)")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for cpu.json and cpu.md")


def role_of(cmdline: list[str]) -> str:
    """A deployment process's role from its command line: ``stage <name>``, ``worker <stage>``,
    ``db``, ``proxy``, ``nm`` (else ``other``)."""
    if "onepiece.stage.worker" in cmdline:
        try:
            return f"worker {json.loads(cmdline[-1])['stage']}"
        except (ValueError, KeyError, TypeError, IndexError):
            return "worker"
    if "onepiece" in cmdline:
        args = cmdline[cmdline.index("onepiece") + 1:]
        if args and args[0] == "stage" and "--stage" in args:
            return f"stage {args[args.index('--stage') + 1]}"
        if args and args[0] in ("db", "proxy", "nm"):
            return args[0]
    return "other"


def descendants(pid: int) -> list[int]:
    """``pid``'s child processes, their children, and so on."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tasks:
        try:
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except FileNotFoundError:
            continue
        for c in map(int, children):
            out += [c, *descendants(c)]
    return out


def process_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid``, its threads that ended included (a VAE worker encodes
    each MP4 on a thread of its own, which a sum over the live threads' counters misses): its
    process CPU clock, the clock id ``clock_getcpuclockid(pid)`` gives on Linux."""
    return time.clock_gettime(((~pid) << 3) | 2)  # CPUCLOCK_SCHED of the whole thread group


def usage(pids: list[int]) -> dict[str, list[float]]:
    """Per role, [CPU seconds, times put on a core] of ``pids`` (a process that ended meanwhile
    is left out; so are the wake-ups of a thread that ended, whose counters go with it)."""
    out: dict[str, list[float]] = {}
    for pid in pids:
        try:
            role = role_of(Path(f"/proc/{pid}/cmdline").read_text().rstrip("\0").split("\0"))
            tasks = os.listdir(f"/proc/{pid}/task")
            cpu = process_cpu_s(pid)
        except (FileNotFoundError, ProcessLookupError, OSError):
            continue
        total = out.setdefault(role, [0.0, 0])
        total[0] += cpu
        for tid in tasks:
            try:
                total[1] += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[2])
            except (FileNotFoundError, ValueError, IndexError):
                continue
    return out


def per(before: dict[str, list[float]], after: dict[str, list[float]], n: float) -> dict[str, dict[str, float]]:
    """What each role added from ``before`` to ``after``, divided by ``n``: {role: {cpu_ms, wakeups}}."""
    return {role: {"cpu_ms": (t - before.get(role, [0.0, 0])[0]) * 1000 / n,
                   "wakeups": (k - before.get(role, [0.0, 0])[1]) / n}
            for role, (t, k) in sorted(after.items())}


def measure(models: dict[str, Path], folder: Path, shape: tuple[int, int, int, int], n: int,
            idle_s: float) -> dict[str, Any]:
    from onepiece.bench.e2e import generate, t2v_set
    from onepiece.client import Client

    with t2v_set(models, folder) as (url, db, events), Client(url) as c:
        for _ in range(WARMUP):
            generate(c, db, events, shape)
        pids = descendants(os.getpid())
        time.sleep(1.0)  # the last request's stragglers (progress, heartbeats) settle
        a = usage(pids)
        t0 = time.monotonic()
        time.sleep(idle_s)
        idle = per(a, usage(pids), time.monotonic() - t0)
        b = usage(pids)
        t0 = time.monotonic()
        for _ in range(n):
            generate(c, db, events, shape)
        wall = time.monotonic() - t0
        busy = per(b, usage(pids), n)
    return {"idle_per_s": idle, "per_request": busy, "request_wall_ms": wall * 1000 / n}


def run(args: argparse.Namespace) -> int:
    from onepiece.bench.common import parse_shape

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    shape = parse_shape(args.size)
    with tempfile.TemporaryDirectory(prefix="onepiece-bench-") as tmp:
        models = tiny_models(Path(args.models) if args.models else Path(tmp) / "models")
        print(f"measuring {args.idle_s:g} s at idle and {args.requests} requests of {args.size} ...", flush=True)
        res = measure(models, Path(tmp), shape, args.requests, args.idle_s)
    doc = {"bench": "cpu", "when": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
           "size": args.size, "requests": args.requests, "idle_s": args.idle_s, **res}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu.json").write_text(json.dumps(doc, indent=1))
    lines = [f"`onepiece bench cpu` — {doc['when']}, {doc['cpu']}, {doc['cpu_count']} cores: {args.requests} requests of "
             f"{args.size} one after another ({res['request_wall_ms']:.1f} ms each on average), and "
             f"{args.idle_s:g} s at idle. CPU time and wake-ups (times put on a core), summed over each role's "
             "threads.", "",
             "| role | CPU ms per request | wake-ups per request | CPU ms per second at idle | wake-ups per second at idle |",
             "|---|---:|---:|---:|---:|"]
    for role, r in res["per_request"].items():
        i = res["idle_per_s"].get(role, {"cpu_ms": 0.0, "wakeups": 0.0})
        lines.append(f"| {role} | {r['cpu_ms']:.2f} | {r['wakeups']:.1f} | {i['cpu_ms']:.2f} | {i['wakeups']:.1f} |")
    control = [r for role, r in res["per_request"].items() if not role.startswith("worker")]
    lines += ["", f"The control plane (every role but the workers): {sum(r['cpu_ms'] for r in control):.1f} ms of CPU "
                  f"and {sum(r['wakeups'] for r in control):.0f} wake-ups per request."]
    text = "\n".join(lines)
    (out / "cpu.md").write_text(text + "\n")
    print(text)
    print(f"saved {out / 'cpu.json'} and cpu.md")
    return 0
