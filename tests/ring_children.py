"""Ring sender processes for the fault and soak tests (tests/test_ring_faults.py,
tests/test_ring_soak.py), run as ``python ring_children.py MODE ...`` in a fresh interpreter.

Each child attaches to the receiver's region by its address (nothing is pickled or inherited)
and runs the real protocol (``RingSender`` -> ``RingWriter``) with a short lock timeout.

``steps`` mode (fault tests): one JSON object a line on stdin and stdout.

    in:  {"op": "send", "uid": str, "size": int, "pause": step or null, "timeout": s}
         {"op": "go"}        resumes a child paused in its step hook
         {"op": "quit"}
    out: {"ev": "ready", "pid": ...}
         {"ev": "try", "uid": ..., "sha": ...}        before the send: what it is about to write
         {"ev": "at", "uid": ..., "step": n, "lock": word, "tails": word}
               the step hook reached step ``pause`` of this message, just BEFORE the step runs;
               the child then blocks reading stdin until "go" (or until the parent kills it)
         {"ev": "sent", "uid": ..., "takeovers": k, "repairs": r}
         {"ev": "error", "uid": ..., "error": "LostLock: ..."}

``soak`` mode (soak test): sends self-describing messages (see ``soak_payload``) as fast as it
can, keeping its progress in a small shared file (see ``soak``).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import struct
import sys
import time

import xxhash

from onepiece.transport import registry
from onepiece.transport.message import Message
from onepiece.transport.ring import layout


def payload_of(uid: str, size: int) -> bytes:
    """The bytes a steps-mode child sends for ``uid`` (deterministic, so runs repeat)."""
    return random.Random(uid).randbytes(size)


def sha(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


# --- soak messages ----------------------------------------------------------------------------
SOAK_HEAD = struct.Struct("<IQI")  # sender id, sequence number, body length
SOAK_POOL = random.Random(20260122).randbytes(1 << 16)
SOAK_MAX_BODY = 300


def soak_size(sender: int, seq: int) -> int:
    return (sender * 7919 + seq * 104729) % (SOAK_MAX_BODY + 1)


def soak_payload(sender: int, seq: int) -> bytes:
    """(sender, seq, n) + n bytes out of a fixed pool + xxh64 of everything before it."""
    n = soak_size(sender, seq)
    start = (seq * 131 + sender * 977) % (len(SOAK_POOL) - SOAK_MAX_BODY)
    body = SOAK_HEAD.pack(sender, seq, n) + SOAK_POOL[start: start + n]
    return body + xxhash.xxh64_digest(body)


def soak_check(data: bytes | memoryview) -> tuple[int, int]:
    """(sender, seq) of a delivered soak message; ValueError unless it is exactly what that
    sender wrote for that sequence number."""
    data = bytes(data)
    if len(data) < SOAK_HEAD.size + 8:
        raise ValueError(f"soak message of {len(data)} bytes is too short")
    sender, seq, _ = SOAK_HEAD.unpack_from(data)
    if data != soak_payload(sender, seq):
        raise ValueError(f"soak message from sender {sender} #{seq} differs from what it sent")
    return sender, seq


# --- modes ------------------------------------------------------------------------------------
def _emit(**ev) -> None:
    sys.stdout.write(json.dumps(ev) + "\n")
    sys.stdout.flush()


def steps(address: str, name: str, lock_timeout: float) -> None:
    sender = registry.connect(address)
    sender.lock_timeout = lock_timeout  # the writer is made on first use, with these
    current: dict = {}

    def hook(n: int) -> None:
        if current.get("pause") == n and not current.get("paused"):
            current["paused"] = True
            region = sender.writer.region
            lock, tails = region.read_words(layout.W_LOCK, 2)
            _emit(ev="at", uid=current["uid"], step=n, lock=lock, tails=tails)
            while json.loads(sys.stdin.readline() or '{"op": "go"}').get("op") != "go":
                pass

    sender.step_hook = hook
    _emit(ev="ready", pid=os.getpid(), name=name)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] != "send":
            continue
        data = payload_of(cmd["uid"], cmd["size"])
        current.clear()
        current.update(uid=cmd["uid"], pause=cmd.get("pause"))
        _emit(ev="try", uid=cmd["uid"], sha=sha(data))
        try:
            sender.send(Message({"uid": cmd["uid"], "sender": name}, {"data": data}), timeout=cmd.get("timeout", 5.0))
        except Exception as e:  # reported to the parent, which decides what is expected
            _emit(ev="error", uid=cmd["uid"], error=f"{type(e).__name__}: {e}")
        else:
            w = sender.writer
            _emit(ev="sent", uid=cmd["uid"], takeovers=w.takeovers, repairs=w.repairs)
    sender.close()


def soak(address: str, sender_id: int, lock_timeout: float, progress: str, limit: int) -> None:
    """Send soak messages 0, 1, 2... until ``limit``. The progress file holds five u64 words,
    updated in place: how many sends were started (stored before each send, so the last one
    started is that count - 1), how many were acknowledged, the writer's lock take-overs and
    tail repairs so far, and the high half of its lock tokens (so the killer can find the
    process that holds the lock); a send that raised is logged in ``progress + ".err"``."""
    fd = os.open(progress, os.O_RDWR)
    mem = mmap.mmap(fd, 40)
    os.close(fd)
    sender = registry.connect(address)
    sender.lock_timeout = lock_timeout
    pack_into = struct.Struct("<Q").pack_into
    acked = 0
    parent = os.getppid()
    with open(progress + ".err", "a") as errors:
        for seq in range(limit):
            if seq % 256 == 0 and os.getppid() != parent:
                return  # the test is gone: do not outlive it
            pack_into(mem, 0, seq + 1)
            try:
                sender.send_frames([soak_payload(sender_id, seq)], timeout=2.0)
            except Exception as e:  # Full while a dead holder wedges the lock, LostLock...
                errors.write(f"{seq} {type(e).__name__}: {e}\n")
                errors.flush()
                if os.getppid() != parent:
                    return
            else:
                acked += 1
                pack_into(mem, 8, acked)
                if acked == 1:
                    pack_into(mem, 32, sender.writer._token_base >> 32)
                if sender.writer.takeovers or sender.writer.repairs:
                    pack_into(mem, 16, sender.writer.takeovers)
                    pack_into(mem, 24, sender.writer.repairs)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and os.getppid() == parent:
        time.sleep(0.5)  # done: wait to be killed like the others


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "steps":
        steps(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    elif mode == "soak":
        soak(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
