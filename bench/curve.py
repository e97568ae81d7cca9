"""What CURVE costs on the data path: ZeroMQ over tcp (loopback) with and without it.

The real transport classes (ZmqSender in this process, ZmqReceiver in a child process, so that
encryption and decryption run in two processes' I/O threads as between two stages) carry real
data messages (``encode``/``decode``) of 1 KB and 16 MB. Two receivers live for the whole run,
one a CURVE server of a fresh deployment key pair, one plain; each measurement sends a batch to
one of them and ends when the receiver has decoded the last message (its CLOCK_MONOTONIC time,
shared by the processes of one host). 1 KB messages also get one-way latencies: one message at a
time, sent once the receiver says it waits. The two are measured alternately, the order flipping
every round, and the result is each round's ratio, so that the drift of a shared VM cancels out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from onepiece.argtypes import count, numbers, out_dir
from onepiece.bench.common import cpu_name
from onepiece.bench.transport import size_label
from onepiece.transport import curve
from onepiece.transport.message import Message
from onepiece.transport.zmq_transport import ZmqReceiver, ZmqSender

MODES = ("plain", "curve")
MB = 1 << 20
DEFAULT_SIZES = "1024,16777216"
RECV_TIMEOUT_S = 30.0  # a batch that stalls this long is an error, not a wait
LATENCY_SAMPLES = 200  # per mode and round, of the smallest size


def add_arguments(p: argparse.ArgumentParser) -> None:
    # at most 1 GiB a message (bench transport's MAX_SIZE): 99999999999 was a MemoryError
    p.add_argument("--sizes", type=numbers(count(1, 1 << 30)), default=DEFAULT_SIZES, help="message sizes in bytes, comma-separated")
    p.add_argument("--rounds", type=count(), default=7, help="rounds; each measures both modes at every size")
    p.add_argument("--bytes-per-batch", type=count(), default=256 * MB,
                   help="bytes sent per measurement (at least 16 messages, at most 20,000)")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for curve.json and curve.md")


def _receiver(keys_folder: str | None, conn) -> None:
    """Child: a ZmqReceiver (a CURVE server when given keys) that counts what it decodes."""
    curve.use(curve.load(keys_folder) if keys_folder else None)
    rx = ZmqReceiver("tcp://127.0.0.1:0")
    conn.send(rx.address)
    while (n := conn.recv()) is not None:
        if n < 0:  # latencies: say "waiting" before each message, then the times each was decoded
            times = []
            for _ in range(-n):
                conn.send("waiting")
                times.append(time.monotonic() if rx.recv(RECV_TIMEOUT_S) is not None else float("nan"))
            conn.send(times)
            continue
        got = 0
        while got < n:
            msg = rx.recv(RECV_TIMEOUT_S)
            if msg is None:
                break
            got += 1
        conn.send((got, time.monotonic()))
    rx.close()


def _batch(tx: ZmqSender, conn, size: int, count: int) -> float:
    """Seconds from the first send to the receiver's decoding the last of ``count`` messages."""
    msg = Message({"uid": "bench", "kind": "data"}, {"x": bytes(size)})
    conn.send(count)
    t0 = time.monotonic()
    for _ in range(count):
        tx.send(msg, timeout=RECV_TIMEOUT_S)
    got, t_last = conn.recv()
    if got != count:
        raise RuntimeError(f"receiver decoded {got} of {count} messages of {size} B")
    return t_last - t0


def _latencies(tx: ZmqSender, conn, size: int, count: int) -> list[float]:
    """One-way seconds of ``count`` messages sent one at a time (NaN: one was lost)."""
    msg = Message({"uid": "bench", "kind": "data"}, {"x": bytes(size)})
    conn.send(-count)
    sent = []
    for _ in range(count):
        if not conn.poll(RECV_TIMEOUT_S):
            raise RuntimeError("the receiver stopped answering")
        conn.recv()
        sent.append(time.monotonic())
        tx.send(msg, timeout=RECV_TIMEOUT_S)
    return [t - s for s, t in zip(sent, conn.recv())]


def run(args: argparse.Namespace) -> int:
    sizes = args.sizes
    t_start = time.monotonic()
    spawn = mp.get_context("spawn")
    children, senders, conns = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="onepiece-bench-curve-") as tmp:
        folder = curve.make(Path(tmp) / "keys")
        keys = curve.load(folder)
        try:
            for mode in MODES:
                parent, child = spawn.Pipe()
                proc = spawn.Process(target=_receiver, args=(str(folder) if mode == "curve" else None, child),
                                     daemon=True)
                proc.start()
                if not parent.poll(60):
                    raise RuntimeError(f"the {mode} receiver did not start within 60 s")
                address = parent.recv()
                curve.use(keys if mode == "curve" else None)  # the sender's socket takes the keys at creation
                senders[mode], conns[mode], children[mode] = ZmqSender(address), parent, proc
            curve.use(None)
            seconds: dict[tuple[str, int], list[float]] = {(m, s): [] for m in MODES for s in sizes}
            latency: dict[str, list[list[float]]] = {m: [] for m in MODES}  # per round, of min(sizes)
            counts = {s: max(16, min(20_000, args.bytes_per_batch // s)) for s in sizes}
            for s in sizes:  # warm-up: connections, handshakes, allocator
                for m in MODES:
                    _batch(senders[m], conns[m], s, min(counts[s], 64))
            for r in range(args.rounds):
                order = MODES if r % 2 == 0 else MODES[::-1]
                for s in sizes:
                    for m in order:
                        seconds[(m, s)].append(_batch(senders[m], conns[m], s, counts[s]))
                for m in order:
                    latency[m].append(_latencies(senders[m], conns[m], min(sizes), LATENCY_SAMPLES))
                print(f"{time.strftime('%H:%M:%S')} round {r + 1} of {args.rounds}", flush=True)
        finally:
            curve.use(None)
            for m, conn in conns.items():
                senders[m].close()
                conn.send(None)
            for proc in children.values():
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
    cells = []
    for s in sizes:
        n = counts[s]
        plain, secured = seconds[("plain", s)], seconds[("curve", s)]
        ratios = [c / p for p, c in zip(plain, secured)]
        cells.append({
            "size": s, "messages_per_batch": n,
            "plain_mb_per_s": n * s / statistics.median(plain) / 1e6,
            "curve_mb_per_s": n * s / statistics.median(secured) / 1e6,
            "plain_msgs_per_s": n / statistics.median(plain), "curve_msgs_per_s": n / statistics.median(secured),
            "time_ratio_median": statistics.median(ratios), "time_ratio_min": min(ratios),
            "time_ratio_max": max(ratios), "seconds": {"plain": plain, "curve": secured},
        })
    p50 = {m: [statistics.median(x) * 1e6 for x in latency[m]] for m in MODES}  # per round, µs
    lat_ratios = [c / p for p, c in zip(p50["plain"], p50["curve"])]
    latency_cell = {
        "size": min(sizes), "samples_per_round": LATENCY_SAMPLES,
        "plain_p50_us": statistics.median(p50["plain"]), "curve_p50_us": statistics.median(p50["curve"]),
        "ratio_median": statistics.median(lat_ratios), "ratio_min": min(lat_ratios), "ratio_max": max(lat_ratios),
        "p50_us_per_round": p50,
    }
    result = {
        "bench": "curve", "when": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cores": os.cpu_count(), "cpu": cpu_name(), "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "command": f"onepiece bench curve --sizes {','.join(map(str, sizes))} --rounds {args.rounds} "
                   f"--bytes-per-batch {args.bytes_per_batch}",
        "elapsed_s": time.monotonic() - t_start,
        "method": "ZmqSender (this process) -> ZmqReceiver (a child), tcp loopback; time from the first send to "
                  "the receiver decoding the last message of a batch; modes alternate, order flipped every round; "
                  "time_ratio = curve / plain of the same round (1.0: no cost)",
        "units": {"size": "bytes", "mb_per_s": "10^6 bytes/s"},
        "cells": cells,
        "latency": latency_cell,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "curve.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / "curve.md").write_text(text)
    print(text)
    print(f"saved {out / 'curve.json'} and {out / 'curve.md'} ({result['elapsed_s']:.0f} s)")
    return 0


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"# CURVE on the data path ({result['when']})", "",
        f"`{result['command']}` on {m['cores']} cores, {m['cpu']} (load at the end {m['loadavg_end']}).", "",
        result["method"] + ".", "",
        "| size | plain MB/s | CURVE MB/s | plain msg/s | CURVE msg/s | time ratio CURVE/plain (median, min-max) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for c in result["cells"]:
        lines.append(f"| {size_label(c['size'])} | {c['plain_mb_per_s']:.0f} | {c['curve_mb_per_s']:.0f} | "
                     f"{c['plain_msgs_per_s']:.0f} | {c['curve_msgs_per_s']:.0f} | {c['time_ratio_median']:.2f} "
                     f"({c['time_ratio_min']:.2f}-{c['time_ratio_max']:.2f}) |")
    lat = result["latency"]
    lines += ["", f"One-way latency of {size_label(lat['size'])} messages, one at a time ({lat['samples_per_round']} a round "
                  f"and mode; the median of the rounds' p50s): plain {lat['plain_p50_us']:.0f} µs, CURVE "
                  f"{lat['curve_p50_us']:.0f} µs, ratio {lat['ratio_median']:.2f} "
                  f"({lat['ratio_min']:.2f}-{lat['ratio_max']:.2f})."]
    return "\n".join(lines) + "\n"
