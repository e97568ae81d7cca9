"""`onepiece bench transport`: throughput and one-way latency of the data transports, against
the machine's memcpy bandwidth (issue 3's benchmark).

Transports (``--transports``, default all, in this order):

- ``shm``: the ring over shared memory (``shm://name?slots=N&bytes=M``);
- ``ipc``: ZMQ over a Unix socket (``ipc://``);
- ``tcp``: ZMQ over loopback TCP (``tcp://127.0.0.1``);
- ``ring+tcp``: the ring over the software one-sided TCP agent (``ring+tcp://127.0.0.1``).

Each is used only through the registry (``registry.listen`` / ``registry.connect``) and the
workflow ``Message``, so what is measured is what a stage sees: encode, send, receive, decode.
The ring's geometry is ``--ring-slots`` slots and ``--ring-bytes`` bytes (default: the next
power of two above twice the largest size, at least 16 MiB: 256 MiB for 64 MB messages).

Processes. The receiver runs in this process; senders are separate processes
(``python -m onepiece.bench.transport --sender``), started once, ``max(--senders)`` of them,
and told over a ZMQ control channel (ROUTER here, one DEALER per sender) which address to
connect to (each child connects by address; nothing is pickled) and what to send. A cell with
n senders uses the first n. Children are killed in a ``finally``; a child whose parent has gone
exits on its own.

Per cell (transport x senders x size), three phases, each started by a command carrying a
start time 50 ms ahead (CLOCK_MONOTONIC) so that the senders start together:

1. warm-up, not counted: connections up, and as many messages as the throughput phase will
   put through the ring (one lap at most; at most 1.5 s), so no ring page is first touched
   while measuring;
2. throughput: every sender sends as fast as it can, at most ``--budget`` bytes and
   ``--max-messages`` messages per cell (split between the senders, at least 4 each) and for at
   most ``--seconds`` (past it, a sender still sends its first); a send that raises ``Full``
   (ring full, ZMQ high-water mark) is retried and counted. Any other send error is counted and
   NOT retried: after the ring's ``Unconfirmed`` or a step-6 ``LostLock`` the message may have
   been delivered already, so sending it again could deliver it twice. Throughput = payload bytes
   received / (last receive - earliest send start); messages/s likewise;
3. latency: each sender sends one message, waits for the receiver's ack on the control channel
   (its DEALER), then sends the next, so no message queues behind its own predecessor; at most
   ``--latency-messages`` per sender (fewer for large sizes: at most ``--latency-budget`` bytes
   per sender, at least 10) and ``--latency-seconds`` (its first even past it). One-way latency =
   time.monotonic_ns() right after ``recv`` returned the message in the receiver -
   time.monotonic_ns() just before ``send`` in the sender (stamped in the header).
   CLOCK_MONOTONIC is one system-wide clock on Linux, so the two processes' readings are
   comparable on one host. With 2 senders both pace themselves concurrently, so a message may
   wait behind the other sender's.

Each sender ends a phase with an end marker through the transport itself (FIFO behind its own
messages), carrying how many it sent; the receiver stops when it has every end marker, so
messages sent = received is checked ("lost"). Payload bytes are checked (length, fill byte).

The receiver: ZMQ blocks in its poll (``recv(timeout)``); the ring over shm is polled with
``borrow(0)`` in a loop (a busy poller, as the paper's receiver; ``os.sched_yield`` between empty
polls): the message's parts are views into the ring, verified in place (no copy), and the
entry is released (re-verified, its slot freed) once the payload has been checked; the ring
over the TCP agent is polled with ``recv(timeout)`` (its backoff sleeps, and a copy out),
since a spinning receiver would starve the agent's thread, which shares this process's GIL.

memcpy: ``np.copyto`` of a warm source into a preallocated, warm destination of the same size,
timed over batches (at least 64 MiB or 1 copy per batch), ``--memcpy-repeats`` batches; the
best batch is the bound (the median is reported too). At small sizes both buffers stay in
cache and the figure includes numpy's per-call overhead.

Rounds (``--rounds N``): memcpy and the whole grid are measured N times, one round after
another; the tables show each cell's median round and the targets are judged on the median of
the rounds' own ratios (a shared machine's speed drifts by tens of percent over minutes, so one
round can land on either side of a target).

Units: sizes are binary (1 KB = 1024 bytes, 1 MB = 2**20); rates are decimal (MB/s = 10**6
bytes/s). Writes ``transport.json`` (settings, machine, every cell with its samples' summary)
and ``transport.md`` (one table per metric) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from onepiece.argtypes import count, out_dir, positive
from onepiece.bench.common import cpu_name, percentile

TRANSPORTS = {
    "shm": "ring over shm",
    "ipc": "ZMQ ipc",
    "tcp": "ZMQ tcp (loopback)",
    "ring+tcp": "ring over TCP agent",
}
DEFAULT_SIZES = "1K,64K,1M,16M,64M"
QUICK_SIZES = "1K,64K"
DEFAULT_TRANSPORTS = ",".join(TRANSPORTS)
DEFAULT_SENDERS = "1,2"
MAX_SENDERS = 16
MAX_SIZE = 1 << 30
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}

# Full-run and --quick defaults of the knobs that --quick shrinks (None in argparse = "pick").
FULL = {"seconds": 3.0, "budget": 2 << 30, "max_messages": 20000, "latency_messages": 200,
        "latency_budget": 1 << 30, "latency_seconds": 3.0, "memcpy_repeats": 9, "warmup_seconds": 1.5,
        "rounds": 1}
QUICK = {"seconds": 0.25, "budget": 4 << 20, "max_messages": 400, "latency_messages": 20,
         "latency_budget": 16 << 20, "latency_seconds": 0.5, "memcpy_repeats": 3, "warmup_seconds": 0.2,
         "rounds": 1}

SYNC_S = 0.05  # a phase starts this far after its command, so that all senders start together
SEND_TIMEOUT = 0.2  # one send's bound; Full past it is retried (and counted) by the sender
ACK_TIMEOUT = 30.0
HELLO_TIMEOUT = 60.0
IDLE_EXIT_S = 600.0  # a sender that hears nothing for this long exits


# --- flags ----------------------------------------------------------------------------------------

def parse_size(item: str, most: int = MAX_SIZE) -> int:
    """``1K``, ``64KB``, ``16M``, ``1MiB``, ``4096`` -> bytes (binary units), 1 to ``most``."""
    s = item.strip().upper().replace(" ", "")
    num = s.rstrip("KMGIB")
    unit = s[len(num):]
    try:
        n = int(num) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"bad size {item!r}: expected e.g. 1K, 64K, 1M, 16M, 64M or bytes") from None
    if not 1 <= n <= most:
        raise argparse.ArgumentTypeError(f"size {item!r} must be between 1 byte and {size_label(most).replace(' ', '')}")
    return n


def size_label(n: int) -> str:
    for unit, name in ((1 << 30, "GB"), (1 << 20, "MB"), (1 << 10, "KB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def _sizes(value: str) -> list[int]:
    items = [x for x in value.split(",")]
    if not all(x.strip() for x in items):  # `1K,,2K` is a typo, not two sizes
        raise argparse.ArgumentTypeError(f"expected comma-separated sizes, e.g. 1K,64K,1M (got {value!r})")
    return sorted({parse_size(x) for x in items})


def _transports(value: str) -> list[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    unknown = [x for x in items if x not in TRANSPORTS]
    if not items or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown transport(s) {unknown or value!r}: choose from {', '.join(TRANSPORTS)}")
    return [t for t in TRANSPORTS if t in items]  # canonical order, no duplicates


def _senders(value: str) -> list[int]:
    try:
        ns = sorted({int(x) for x in value.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad --senders {value!r}: expected counts, e.g. 1,2") from None
    if not ns or not all(1 <= n <= MAX_SENDERS for n in ns):
        raise argparse.ArgumentTypeError(f"bad --senders {value!r}: each count between 1 and {MAX_SENDERS}")
    return ns


def _bytes_flag(value: str) -> int:
    return parse_size(value, 1 << 40)


def _power_of_two(conv):
    def check(value: str) -> int:
        n = conv(value)
        if n < 2 or n & (n - 1):
            raise argparse.ArgumentTypeError(f"{value!r} is not a power of two (e.g. 1024, 256M)")
        return n
    return check


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=_sizes, default=None,
                   help=f"message payload sizes, binary units (default {DEFAULT_SIZES}; --quick: {QUICK_SIZES})")
    p.add_argument("--transports", type=_transports, default=_transports(DEFAULT_TRANSPORTS),
                   help=f"subset of {DEFAULT_TRANSPORTS} (default: all)")
    p.add_argument("--senders", type=_senders, default=_senders(DEFAULT_SENDERS),
                   help=f"sender process counts (default {DEFAULT_SENDERS})")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: small sizes, short phases, few messages (figures are not meaningful)")
    p.add_argument("--seconds", type=positive(), help=f"time bound of a throughput cell (default {FULL['seconds']:g}; quick {QUICK['seconds']:g})")
    p.add_argument("--budget", type=_bytes_flag, help="payload bytes per throughput cell, split between senders (default 2G; quick 4M)")
    p.add_argument("--max-messages", type=count(), help=f"messages per throughput cell (default {FULL['max_messages']}; quick {QUICK['max_messages']})")
    p.add_argument("--latency-messages", type=count(), help=f"paced messages per sender per cell (default {FULL['latency_messages']}; quick {QUICK['latency_messages']})")
    p.add_argument("--latency-budget", type=_bytes_flag, help="payload bytes per sender in a latency cell (default 1G; quick 16M); at least 10 messages")
    p.add_argument("--latency-seconds", type=positive(), help=f"time bound of a latency cell (default {FULL['latency_seconds']:g}; quick {QUICK['latency_seconds']:g})")
    p.add_argument("--memcpy-repeats", type=count(), help=f"timed memcpy batches per size (default {FULL['memcpy_repeats']}; quick {QUICK['memcpy_repeats']})")
    p.add_argument("--rounds", type=count(),
                   help="measure memcpy and the whole grid this many times, one round after another; each "
                        "table shows a cell's median round, the targets the median of the rounds' ratios "
                        "(default 1; on a noisy machine, 3 or 5)")
    p.add_argument("--ring-bytes", type=_power_of_two(_bytes_flag), help="ring buffer bytes, a power of two (default: > 2x the largest size, at least 16M)")
    p.add_argument("--ring-slots", type=_power_of_two(count()), default=1024, help="ring size slots, a power of two (default %(default)s)")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for transport.json and transport.md")


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The effective settings: --quick's or the full run's defaults where a flag was not given."""
    base = QUICK if args.quick else FULL
    s = {k: (getattr(args, k, None) if getattr(args, k, None) is not None else v) for k, v in base.items()}
    sizes = args.sizes if args.sizes is not None else _sizes(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    ring = args.ring_bytes
    if ring is None:
        ring = 16 << 20
        while ring < 2 * max(sizes) + (1 << 16):
            ring *= 2
    if ring < max(sizes) + (1 << 16):
        raise SystemExit(f"--ring-bytes {size_label(ring)} cannot hold a {size_label(max(sizes))} message "
                         "(it needs the size plus 64 KB at least; twice that lets two be in flight)")
    s.update(sizes=sizes, transports=list(args.transports), senders=list(args.senders), quick=bool(args.quick),
             ring_bytes=ring, ring_slots=args.ring_slots, out=str(args.out))
    return s


def command_line(s: dict[str, Any]) -> str:
    """The command that repeats this run exactly (every effective setting spelled out)."""
    def sz(n: int) -> str:
        return size_label(n).replace(" KB", "K").replace(" MB", "M").replace(" GB", "G").replace(" B", "")
    parts = ["onepiece", "bench", "transport"] + (["--quick"] if s["quick"] else []) + [
        "--sizes", ",".join(sz(n) for n in s["sizes"]), "--transports", ",".join(s["transports"]),
        "--senders", ",".join(map(str, s["senders"])), "--seconds", f"{s['seconds']:g}",
        "--budget", sz(s["budget"]), "--max-messages", str(s["max_messages"]),
        "--latency-messages", str(s["latency_messages"]), "--latency-budget", sz(s["latency_budget"]),
        "--latency-seconds", f"{s['latency_seconds']:g}", "--memcpy-repeats", str(s["memcpy_repeats"]),
        "--rounds", str(s["rounds"]), "--ring-bytes", sz(s["ring_bytes"]), "--ring-slots", str(s["ring_slots"]), "--out", s["out"]]
    return shlex.join(parts)


# --- memcpy ---------------------------------------------------------------------------------------

def memcpy_bandwidth(size: int, repeats: int) -> dict[str, Any]:
    import numpy as np

    src = np.full(size, 1, np.uint8)
    dst = np.empty(size, np.uint8)
    copies = max(1, (64 << 20) // size)
    for _ in range(min(copies, 64) + 1):  # warm: pages of both touched, caches filled
        np.copyto(dst, src)
    rates = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        for _ in range(copies):
            np.copyto(dst, src)
        dt = max(time.perf_counter_ns() - t, 1)
        rates.append(copies * size / dt)  # bytes/ns = GB/s
    return {"bytes": size, "copies_per_batch": copies, "repeats": repeats, "best_gbps": max(rates),
            "median_gbps": statistics.median(rates), "best_mb_per_s": max(rates) * 1000}


# --- the sender process ---------------------------------------------------------------------------

def sender_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m onepiece.bench.transport --sender")
    p.add_argument("--sender", action="store_true", required=True)
    p.add_argument("--control", required=True, help="the benchmark's control ROUTER address")
    p.add_argument("--id", type=count(0), required=True)
    a = p.parse_args(argv)

    import numpy as np
    import zmq

    from onepiece.transport import registry
    from onepiece.transport.base import Full, TransportError
    from onepiece.transport.message import Message

    ctl = zmq.Context.instance().socket(zmq.DEALER)
    ctl.setsockopt(zmq.IDENTITY, f"s{a.id}".encode())
    ctl.setsockopt(zmq.LINGER, 1000)
    ctl.connect(a.control)
    ctl.send_multipart([b"hello", json.dumps({"pid": os.getpid()}).encode()])
    parent = os.getppid()
    fill = (a.id + 1) & 0xFF
    tx = None
    payload = np.empty(0, np.uint8)
    idle_since = time.monotonic()

    def reply(kind: bytes, body: dict) -> None:
        ctl.send_multipart([kind, json.dumps(body).encode()])

    def run_phase(cmd: dict) -> dict:
        nonlocal payload
        size, count, phase, paced = cmd["size"], cmd["count"], cmd["phase"], cmd["kind"] == "latency"
        if payload.nbytes != size:
            payload = np.empty(0, np.uint8)  # let the old one go first
            payload = np.full(size, fill, np.uint8)
        start, end = cmd["start_ns"], cmd["start_ns"] + int(cmd["seconds"] * 1e9)
        while (left := start - time.monotonic_ns()) > 0:
            time.sleep((left - 1_000_000) / 1e9 if left > 2_000_000 else 0)
        sent = retries = errors = 0
        first = None
        last_error = ""
        while sent + errors < count:
            t0 = time.monotonic_ns()
            # Past the bound a sender the machine kept from the CPU still sends one (for 10 s more).
            if t0 >= end and (sent or errors or t0 >= end + 10_000_000_000):
                break
            if first is None:
                first = t0
            msg = Message({"uid": f"s{a.id}-{phase}-{sent + errors}", "ph": phase, "s": a.id, "t0": t0},
                          {"p": payload})
            try:
                tx.send(msg, timeout=SEND_TIMEOUT)
            except Full:  # not handed over: send it again
                retries += 1
                continue
            except TransportError as e:  # e.g. the ring's Unconfirmed: maybe delivered, never resent
                errors += 1
                last_error = f"{type(e).__name__}: {e}"
                if errors > 100:
                    break
                continue
            sent += 1
            if paced:
                if not ctl.poll(int(ACK_TIMEOUT * 1000)):
                    errors += 1
                    last_error = f"no ack within {ACK_TIMEOUT:g}s"
                    break
                ctl.recv_multipart()
        # End marker, FIFO behind this sender's messages: how many it sent. Sent again after
        # Full only, like the messages (a second copy would be harmless: the receiver keeps one).
        marker = Message({"uid": f"s{a.id}-{phase}-end", "ph": phase, "s": a.id, "end": sent, "first": first}, {})
        give_up = time.monotonic() + 30.0
        while True:
            try:
                tx.send(marker, timeout=SEND_TIMEOUT)
                break
            except Full as e:
                if time.monotonic() > give_up:
                    errors += 1
                    last_error = f"end marker not sent: {e}"
                    break
            except TransportError as e:
                errors += 1
                last_error = f"end marker: {type(e).__name__}: {e}"
                break
        return {"phase": phase, "sent": sent, "retries": retries, "errors": errors, "first_ns": first,
                "last_error": last_error}

    try:
        while True:
            if not ctl.poll(1000):
                if os.getppid() != parent or time.monotonic() - idle_since > IDLE_EXIT_S:
                    return 1
                continue
            idle_since = time.monotonic()
            frames = ctl.recv_multipart()
            kind = frames[0]
            cmd = json.loads(frames[1]) if len(frames) > 1 else {}
            if kind == b"quit":
                return 0
            try:
                if kind == b"connect":
                    if tx is not None:
                        tx.close()
                    tx = registry.connect(cmd["address"])
                    reply(b"ok", {})
                elif kind == b"close":
                    if tx is not None:
                        tx.close()
                        tx = None
                    reply(b"ok", {})
                elif kind == b"run":
                    reply(b"done", run_phase(cmd))
                # anything else (a late ack) is ignored
            except Exception as e:  # report, never hang the benchmark
                reply(b"fail", {"error": f"{type(e).__name__}: {e}"})
    finally:
        if tx is not None:
            tx.close()
        ctl.close(linger=1000)


# --- the benchmark process ------------------------------------------------------------------------

class Senders:
    """The sender processes and their control channel."""

    def __init__(self, n: int, logdir: Path) -> None:
        import zmq

        self.ctl = zmq.Context.instance().socket(zmq.ROUTER)
        self.ctl.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.ctl.setsockopt(zmq.LINGER, 0)
        self.ctl.bind("tcp://127.0.0.1:*")
        address = self.ctl.getsockopt_string(zmq.LAST_ENDPOINT)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.procs: list[subprocess.Popen] = []
        self.logs = [logdir / f"sender-{k}.log" for k in range(n)]
        try:
            for k in range(n):
                with open(self.logs[k], "wb") as log:
                    self.procs.append(subprocess.Popen(
                        [sys.executable, "-m", "onepiece.bench.transport", "--sender", "--control", address,
                         "--id", str(k)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env))
            self.collect(b"hello", range(n), HELLO_TIMEOUT)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def ident(k: int) -> bytes:
        return f"s{k}".encode()

    def send(self, k: int, kind: bytes, body: dict | None = None) -> None:
        self._send([self.ident(k), kind, json.dumps(body or {}).encode()])

    def ack(self, k: int) -> None:
        self._send([self.ident(k), b"ack"])

    def _send(self, frames: list[bytes]) -> None:
        import zmq

        try:
            self.ctl.send_multipart(frames)
        except zmq.ZMQError as e:  # ROUTER_MANDATORY: that sender is not connected (it died)
            raise RuntimeError(f"sender {frames[0].decode()} unreachable: {e}") from None

    def collect(self, kind: bytes, which, timeout: float, phase: int | None = None) -> dict[int, dict]:
        """One ``kind`` reply from each sender in ``which`` (for ``phase``, when given: a late reply
        to an earlier, failed phase is skipped); RuntimeError on a failure or timeout."""
        want = set(which)
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        while want - set(got):
            left = deadline - time.monotonic()
            if left <= 0 or not self.ctl.poll(int(min(left, 0.5) * 1000) + 1):
                dead = [k for k in want if self.procs[k].poll() is not None]
                if dead:
                    raise RuntimeError(f"sender(s) {dead} exited: {self._tail(dead[0])}")
                if left <= 0:
                    raise RuntimeError(f"no {kind.decode()!r} from sender(s) {sorted(want - set(got))} "
                                       f"within {timeout:g}s")
                continue
            frames = self.ctl.recv_multipart()
            k = int(frames[0][1:])
            body = json.loads(frames[2]) if len(frames) > 2 else {}
            if frames[1] == b"fail":
                raise RuntimeError(f"sender {k} failed: {body.get('error')}")
            if frames[1] == kind and k in want and (phase is None or body.get("phase") == phase):
                got[k] = body
        return got

    def alive(self, which) -> bool:
        return all(self.procs[k].poll() is None for k in which)

    def _tail(self, k: int) -> str:
        try:
            return self.logs[k].read_text(errors="replace")[-800:].strip() or "(no output)"
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        for k, p in enumerate(self.procs):
            if p.poll() is None:
                try:
                    self.send(k, b"quit")
                except Exception:  # noqa: BLE001 - it is killed below anyway
                    pass
        deadline = time.monotonic() + 3.0
        for p in self.procs:
            try:
                p.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.ctl.close(linger=0)


def _address(transport: str, tmp: Path, s: dict[str, Any]) -> str:
    geometry = f"?slots={s['ring_slots']}&bytes={s['ring_bytes']}"
    return {"shm": f"shm://onepiece-bench-{os.getpid()}{geometry}",
            "ipc": f"ipc://{tmp}/transport.ipc",
            "tcp": "tcp://127.0.0.1:0",
            "ring+tcp": f"ring+tcp://127.0.0.1:0{geometry}"}[transport]


RECV_MODE = {"shm": "spin: borrow(0) + sched_yield; parts are views into the ring", "ipc": "recv(timeout): zmq poll",
             "tcp": "recv(timeout): zmq poll", "ring+tcp": "recv(timeout): backoff sleeps"}


class Phase:
    """The receiver's side of one phase: counts, last receive, latencies."""

    def __init__(self) -> None:
        self.got = self.bad = self.stale = 0
        self.last_rx: int | None = None
        self.ends: dict[int, dict] = {}
        self.lat_ns: list[int] = []
        self.timed_out = False

    def receive(self, rx, senders: Senders, active: list[int], phase: int, size: int, paced: bool,
                spin: bool, deadline: float) -> "Phase":
        """Receive until every active sender's end marker came (or ``deadline``, or a sender died).
        ``spin`` (the ring over shm): busy-poll ``borrow(0)``, check the payload where it lies in
        the ring, then release it (which re-verifies it; torn meanwhile counts as bad)."""
        yield_ = os.sched_yield
        want = len(active)
        check_at = time.monotonic() + 0.5
        loan = None
        while len(self.ends) < want:
            if spin:
                loan = rx.borrow(0)
                msg = None if loan is None else loan.message
            else:
                msg = rx.recv(0.05)
            if msg is None:
                if spin:
                    yield_()
                now = time.monotonic()
                if now >= check_at:
                    check_at = now + 0.5
                    if now >= deadline or not senders.alive(active):
                        self.timed_out = True
                        break
                continue
            t1 = time.monotonic_ns()
            h = msg.header
            if h.get("ph") != phase:
                self.stale += 1
            elif "end" in h:
                self.ends[h["s"]] = h
            else:
                if paced:
                    self.lat_ns.append(t1 - h["t0"])
                    senders.ack(h["s"])
                self.got += 1
                self.last_rx = t1
                part = msg.parts.get("p")
                if part is None or part.nbytes != size or part[0] != ((h["s"] + 1) & 0xFF) or part[-1] != part[0]:
                    self.bad += 1
                del part
            del msg
            if loan is not None and not loan.release():
                self.bad += 1  # written over while we looked at it
        return self


def run_cell(rx, senders: Senders, active: list[int], size: int, s: dict[str, Any], spin: bool,
             phase_counter: list[int]) -> dict[str, Any]:
    n = len(active)

    def phase(kind: str, count: int, seconds: float) -> tuple[Phase, dict[int, dict]]:
        phase_counter[0] += 1
        ph = phase_counter[0]
        start = time.monotonic_ns() + int(SYNC_S * 1e9)
        for k in active:
            senders.send(k, b"run", {"kind": kind, "phase": ph, "size": size, "count": count, "seconds": seconds,
                                     "start_ns": start})
        grace = 30.0 + 8 * size / 100e6  # even a slow path moves 100 MB/s
        res = Phase().receive(rx, senders, active, ph, size, kind == "latency", spin,
                              time.monotonic() + seconds + grace)
        done = senders.collect(b"done", active, 60.0, ph)
        return res, done

    per_sender = max(4, min(s["budget"] // size, s["max_messages"]) // n)
    # Warm-up: as many messages as the throughput phase will use of the ring (a whole lap at
    # most), so that no page of the region is first touched (faulted in) while measuring.
    warm = max(2, min(per_sender, s["ring_bytes"] // size // n + 1))
    phase("warmup", warm, s["warmup_seconds"])

    tp, done = phase("throughput", per_sender, s["seconds"])
    sent = sum(d["sent"] for d in done.values())
    first = min((d["first_ns"] for d in done.values() if d["first_ns"] is not None), default=None)
    dur_ns = (tp.last_rx - first) if (tp.last_rx is not None and first is not None) else None
    throughput = {
        "messages": tp.got, "bytes": tp.got * size, "sent": sent, "lost": sent - tp.got, "bad": tp.bad,
        "per_sender_cap": per_sender, "seconds": dur_ns / 1e9 if dur_ns else None,
        "mb_per_s": tp.got * size / dur_ns * 1e3 if dur_ns else None,
        "msgs_per_s": tp.got / dur_ns * 1e9 if dur_ns else None,
        "retries": sum(d["retries"] for d in done.values()), "errors": sum(d["errors"] for d in done.values()),
        "timed_out": tp.timed_out,
        "last_error": next((d["last_error"] for d in done.values() if d["last_error"]), ""),
    }

    lat_count = max(10, min(s["latency_messages"], s["latency_budget"] // size))
    lp, ldone = phase("latency", lat_count, s["latency_seconds"])
    us = [x / 1e3 for x in lp.lat_ns]
    lsent = sum(d["sent"] for d in ldone.values())
    # A paced cell stops at its time bound too, so fewer than the cap is not a loss; lost is.
    latency = {
        "messages": len(us), "sent": lsent, "lost": lsent - len(us), "per_sender_cap": lat_count, "bad": lp.bad,
        "timed_out": lp.timed_out,
        "p50_us": percentile(us, 50), "p99_us": percentile(us, 99), "min_us": min(us, default=None),
        "max_us": max(us, default=None), "mean_us": statistics.fmean(us) if us else None,
        "retries": sum(d["retries"] for d in ldone.values()), "errors": sum(d["errors"] for d in ldone.values()),
    }
    return {"throughput": throughput, "latency": latency}


def machine() -> dict[str, Any]:
    return {"cores": os.cpu_count(), "cpu": cpu_name(),
            "kernel": platform.release(), "python": platform.python_version(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()]}


def check_targets(cells: list[dict], memcpy: dict[int, dict]) -> dict[str, Any]:
    """Issue 3's targets, where this run has the cells to judge them (1 sender)."""
    def tp(transport: str, size: int, key: str = "mb_per_s") -> float | None:
        for c in cells:
            if (c["transport"], c["senders"], c["size"]) == (transport, 1, size) and c.get("throughput"):
                return c["throughput"].get(key)
        return None

    out: dict[str, Any] = {}
    big, small = 16 << 20, 1 << 10
    shm16, ipc16, shm1k, ipc1k = tp("shm", big), tp("ipc", big), tp("shm", small, "msgs_per_s"), tp("ipc", small, "msgs_per_s")
    if shm16 and big in memcpy:
        out["shm_16M_vs_memcpy"] = _target(shm16 / memcpy[big]["best_mb_per_s"], 0.7)
    if shm16 and ipc16:
        out["shm_16M_vs_zmq_ipc"] = _target(shm16 / ipc16, 2)
    if shm1k and ipc1k:
        out["shm_1K_msgs_vs_zmq_ipc"] = _target(shm1k / ipc1k, 1)
    return out


def _target(value: float, wanted: float) -> dict[str, Any]:
    return {"value": value, "wanted": wanted, "target": f">= {wanted:g}", "met": value >= wanted}


def combine_rounds(rounds: list[dict[str, Any]]) -> tuple[dict[int, dict], list[dict], dict[str, Any]]:
    """(memcpy, cells, targets) over the rounds: each size's and cell's median round (the whole
    round's figures, so they stay consistent with each other), with every round's throughput
    beside it; each target judged on the median of its per-round values (ring and memcpy of one
    round were measured minutes apart, not a whole run apart)."""
    def median_round(items: list[dict], key: Callable[[dict], float | None]) -> dict:
        ok = [x for x in items if key(x) is not None]
        if not ok:
            return items[0]
        return sorted(ok, key=key)[(len(ok) - 1) // 2]  # the lower median, as for the targets

    memcpy = {}
    for size in rounds[0]["memcpy"]:
        per = [r["memcpy"][size] for r in rounds]
        memcpy[size] = dict(median_round(per, lambda m: m["best_mb_per_s"]),
                            rounds_best_mb_per_s=[m["best_mb_per_s"] for m in per])
    cells = []
    for i in range(len(rounds[0]["cells"])):
        per = [r["cells"][i] for r in rounds]
        mb = [None if c.get("error") else c["throughput"]["mb_per_s"] for c in per]
        pick = median_round(per, lambda c: None if c.get("error") else c["throughput"]["mb_per_s"])
        cells.append(dict(pick, rounds_mb_per_s=mb))
    targets = {}
    for key, t in rounds[0]["targets"].items():
        values = [r["targets"][key]["value"] for r in rounds if key in r["targets"]]
        targets[key] = dict(_target(statistics.median_low(values), t["wanted"]), rounds=values)
    return memcpy, cells, targets


def _fmt(x: float | None, spec: str = ",.0f") -> str:
    return "—" if x is None else format(x, spec)


def _fmt_us(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _span(xs: list[int]) -> str:
    if not xs:
        return "0"
    return str(min(xs)) if min(xs) == max(xs) else f"{min(xs)}–{max(xs)}"


def _span_f(xs: list[float]) -> str:
    return "—" if not xs else f"{min(xs):.2f}–{max(xs):.2f}"


def markdown(res: dict[str, Any]) -> str:
    s = res["settings"]
    sizes, cells = s["sizes"], res["cells"]
    memcpy = {int(k): v for k, v in res["memcpy"].items()}
    by = {(c["transport"], c["senders"], c["size"]): c for c in cells}
    m = res["machine"]
    head = "| transport | senders | " + " | ".join(size_label(n) for n in sizes) + " |"
    rule = "|---|---|" + "---:|" * len(sizes)

    def table(get, memcpy_row=None) -> list[str]:
        lines = [head, rule]
        if memcpy_row:
            lines.append("| memcpy (bound) | — | " + " | ".join(memcpy_row(n) for n in sizes) + " |")
        for t in s["transports"]:
            for n in s["senders"]:
                row = []
                for size in sizes:
                    c = by.get((t, n, size))
                    row.append("—" if c is None or c.get("error") else get(c, size))
                lines.append(f"| {TRANSPORTS[t]} | {n} | " + " | ".join(row) + " |")
        return lines

    def tpv(key, spec=",.0f"):
        return lambda c, size: _fmt(c["throughput"][key], spec)

    def ratio(c, size):
        v, b = c["throughput"]["mb_per_s"], memcpy.get(size, {}).get("best_mb_per_s")
        return "—" if v is None or not b else f"{v / b:.3f}"

    md = [
        f"# `onepiece bench transport` — {res['when']}",
        "",
        f"Machine: {m['cores']} cores, {m['cpu']} (/proc/cpuinfo), Linux {m['kernel']}, Python {m['python']}; "
        f"1-minute load average {m['loadavg_start'][0]:.2f} at the start, {m['loadavg_end'][0]:.2f} at the end, "
        f"{_span_f([c['loadavg_1m'] for c in cells if 'loadavg_1m' in c])} at the cells' starts (above the core "
        f"count, other work shared the CPUs and the figures are noisy); {res['elapsed_s']:.0f} s in all.",
        "",
        f"Command: `{res['command']}`",
        "",
        *([f"Rounds: {s['rounds']}, one after another. Each table shows a cell's median round (by throughput; "
           "memcpy likewise), the JSON every round's throughput; the targets are the medians of the rounds' "
           "ratios.", ""] if s["rounds"] > 1 else []),
        f"Ring geometry: {s['ring_slots']} slots, {size_label(s['ring_bytes'])} buffer. Per throughput cell at most "
        f"{size_label(s['budget'])} and {s['max_messages']} messages (split between the senders, at least 4 each) "
        f"and {s['seconds']:g} s; per latency cell at most {s['latency_messages']} paced messages per sender "
        f"(at most {size_label(s['latency_budget'])} per sender, at least 10) and {s['latency_seconds']:g} s."
        + (" **--quick: smoke-test settings, the figures mean nothing.**" if s["quick"] else ""),
        "",
        "Sizes are payload bytes in binary units (1 KB = 1024 B); rates are decimal (1 MB/s = 10^6 B/s). "
        "Senders are separate processes; the receiver is the benchmark process "
        "(ring over shm: busy-polls borrow(0), which hands the message up without a copy, its parts read-only "
        "views into the ring verified in place, and releases it (re-verified, slot freed) after checking the "
        "payload; ZMQ: blocks in recv(timeout); ring over TCP agent: recv(timeout), a copy out, whose backoff "
        "sleeps leave the GIL to the agent thread). Any send error but Full is counted, never resent (after the "
        "ring's Unconfirmed or a late LostLock the message may already be delivered).",
        "",
        "## Throughput, MB/s",
        "",
        "Payload bytes received / (last receive − earliest send start), senders blasting; memcpy is the best "
        "batch of `np.copyto` into a warm preallocated buffer of the same size (at 1 KB that is numpy's per-call "
        "overhead, not the memory system: the bound of one Python-level copy per message; up to 1 MB both "
        "buffers stay in cache).",
        "",
        *table(tpv("mb_per_s"), lambda n: _fmt(memcpy[n]["best_mb_per_s"]) if n in memcpy else "—"),
        "",
        "## Throughput relative to memcpy",
        "",
        *table(ratio, lambda n: "1.000" if n in memcpy else "—"),
        "",
        "## Messages/s",
        "",
        "Same runs as the throughput table (the 1 KB column is the per-message rate).",
        "",
        *table(tpv("msgs_per_s"), lambda n: _fmt(memcpy[n]["best_mb_per_s"] * 1e6 / n) if n in memcpy else "—"),
        "",
        "## One-way latency p50, µs",
        "",
        "time.monotonic_ns() after recv() returned, in the receiver − time.monotonic_ns() before send(), in the "
        "sender (stamped in the header). CLOCK_MONOTONIC is one system-wide clock on Linux, so readings of "
        "different processes on one host compare. Each sender waits for an ack (ZMQ, control channel) before its "
        "next message, so this is not queueing behind its own messages; with 2 senders both run at once.",
        "",
        *table(lambda c, size: _fmt_us(c["latency"]["p50_us"])),
        "",
        "## One-way latency p99, µs",
        "",
        *table(lambda c, size: _fmt_us(c["latency"]["p99_us"])),
        "",
        "Latency samples per cell (all its senders together), fewest–most over the cells: " + ", ".join(
            f"{size_label(n)}: {_span([c['latency']['messages'] for c in cells if c['size'] == n and c.get('latency')])}"
            for n in sizes) + ".",
        "",
    ]
    problems = []
    for c in cells:
        name = f"{TRANSPORTS[c['transport']]}, {c['senders']} sender(s), {size_label(c['size'])}"
        if c.get("error"):
            problems.append(f"- {name}: failed: {c['error']}")
            continue
        t, l = c["throughput"], c["latency"]
        notes = []
        if t["retries"]:
            notes.append(f"{t['retries']} Full retries (throughput)")
        if t["lost"] or t["bad"] or l["bad"]:
            notes.append(f"lost {t['lost']}, bad {t['bad'] + l['bad']}")
        if t["errors"] or l["errors"]:
            notes.append(f"{t['errors'] + l['errors']} send errors ({t['last_error']})")
        if t["timed_out"] or l["timed_out"]:
            notes.append("a phase timed out")
        if notes:
            problems.append(f"- {name}: " + "; ".join(notes))
    md += ["## Notes per cell", "", *(problems or ["- no retries, losses, bad payloads or errors"]), ""]
    if res["targets"]:
        names = {"shm_16M_vs_memcpy": "ring over shm at 16 MB / memcpy (1 sender)",
                 "shm_16M_vs_zmq_ipc": "ring over shm at 16 MB / ZMQ ipc (1 sender)",
                 "shm_1K_msgs_vs_zmq_ipc": "ring over shm msgs/s at 1 KB / ZMQ ipc (1 sender)"}
        md += ["## Issue 3 targets", "", "| target | value | wanted | met | rounds |", "|---|---|---|---|---|"]
        md += [f"| {names[k]} | {v['value']:.3f} | {v['target']} | {'yes' if v['met'] else 'NO'} "
               f"| {', '.join(f'{x:.2f}' for x in v['rounds'])} |" for k, v in res["targets"].items()]
        md.append("")
    return "\n".join(md)


def measure_round(s: dict[str, Any], senders: "Senders", tmp: Path, phase_counter: list[int],
                  log: Callable[[str], None]) -> tuple[dict[int, dict], list[dict]]:
    """One round: memcpy at every size, then every (transport, senders, size) cell."""
    from onepiece.transport import registry

    memcpy = {}
    for size in s["sizes"]:
        memcpy[size] = memcpy_bandwidth(size, s["memcpy_repeats"])
        log(f"memcpy {size_label(size):>6}: best {memcpy[size]['best_gbps']:.2f} GB/s, "
            f"median {memcpy[size]['median_gbps']:.2f} GB/s")
    cells: list[dict[str, Any]] = []
    for transport in s["transports"]:
        rx = registry.listen(_address(transport, tmp, s))
        spin = transport == "shm"
        try:
            for n in s["senders"]:
                active = list(range(n))
                try:
                    for k in active:
                        senders.send(k, b"connect", {"address": rx.address})
                    senders.collect(b"ok", active, 30.0)
                except RuntimeError as e:
                    for size in s["sizes"]:
                        cells.append({"transport": transport, "senders": n, "size": size, "error": str(e)})
                    log(f"{transport} x{n}: FAILED to connect: {e}")
                    continue
                for size in s["sizes"]:
                    cell = {"transport": transport, "label": TRANSPORTS[transport], "senders": n,
                            "size": size, "size_label": size_label(size), "recv_mode": RECV_MODE[transport],
                            "loadavg_1m": round(os.getloadavg()[0], 2)}
                    try:
                        cell.update(run_cell(rx, senders, active, size, s, spin, phase_counter))
                        t, lt = cell["throughput"], cell["latency"]
                        ratio = (t["mb_per_s"] / memcpy[size]["best_mb_per_s"]) if t["mb_per_s"] else None
                        t["vs_memcpy"] = ratio
                        log(f"{transport:>8} x{n} {size_label(size):>6}: {_fmt(t['mb_per_s'])} MB/s "
                            f"({_fmt(ratio, '.2f')} of memcpy), {_fmt(t['msgs_per_s'])} msg/s, "
                            f"{t['retries']} retries, lost {t['lost']}; latency p50 "
                            f"{_fmt_us(lt['p50_us'])} µs, p99 {_fmt_us(lt['p99_us'])} µs "
                            f"({lt['messages']} msgs)")
                    except RuntimeError as e:
                        cell["error"] = str(e)
                        log(f"{transport:>8} x{n} {size_label(size):>6}: FAILED: {e}")
                    cells.append(cell)
                for k in active:
                    senders.send(k, b"close")
                try:
                    senders.collect(b"ok", active, 30.0)
                except RuntimeError as e:
                    log(f"{transport} x{n}: close: {e}")
        finally:
            rx.close()
    return memcpy, cells


def run(args: argparse.Namespace) -> int:
    s = settings_of(args)
    if "shm" in s["transports"]:
        free = shutil.disk_usage("/dev/shm").free
        if free < s["ring_bytes"] + (64 << 20):
            raise SystemExit(f"/dev/shm has {free >> 20} MiB free; the shm ring needs {s['ring_bytes'] >> 20} MiB "
                             "(use --ring-bytes, or leave shm out of --transports)")

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    t_start = time.monotonic()
    info = machine()
    command = command_line(s)
    log(f"{command}\n         {info['cores']} cores, {info['cpu']}, load {info['loadavg_start']}")
    rounds: list[dict[str, Any]] = []
    phase_counter = [0]
    with tempfile.TemporaryDirectory(prefix="onepiece-bench-transport-") as tmpdir:
        tmp = Path(tmpdir)
        senders = Senders(max(s["senders"]), tmp)
        try:
            for r in range(s["rounds"]):
                if s["rounds"] > 1:
                    log(f"round {r + 1} of {s['rounds']}")
                memcpy, cells = measure_round(s, senders, tmp, phase_counter, log)
                rounds.append({"memcpy": memcpy, "cells": cells, "targets": check_targets(cells, memcpy)})
        finally:
            senders.stop()
    memcpy, cells, targets = combine_rounds(rounds)

    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    elapsed = time.monotonic() - t_start
    result = {
        "bench": "transport", "when": time.strftime("%Y-%m-%d %H:%M"), "machine": info, "command": command,
        "elapsed_s": elapsed, "settings": s,
        "clock": "one-way latency = receiver's time.monotonic_ns() after recv - sender's before send; "
                 "CLOCK_MONOTONIC is system-wide on Linux, so comparable across processes on one host",
        "units": {"size": "binary (1 KB = 1024 B)", "mb_per_s": "10^6 bytes/s", "gbps": "10^9 bytes/s",
                  "latency": "microseconds"},
        "recv_mode": {t: RECV_MODE[t] for t in s["transports"]},
        "memcpy": {str(k): v for k, v in memcpy.items()},
        "cells": cells,
        "targets": targets,
    }
    outdir = Path(s["out"])
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "transport.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (outdir / "transport.md").write_text(text)
    print()
    print(text)
    print(f"saved {outdir / 'transport.json'} and {outdir / 'transport.md'} ({elapsed:.0f} s)")
    failed = [c for r in rounds for c in r["cells"] if c.get("error")]  # in any round
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--sender" in argv:
        return sender_main(argv)
    p = argparse.ArgumentParser(prog="python -m onepiece.bench.transport", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
