"""Cases 1-8 of the ring buffer's fault analysis (DESIGN §5, issue 3), each reproduced with
real sender processes that are killed (SIGKILL) or stalled (SIGSTOP, later SIGCONT) exactly at
a step of the sender protocol.

The paper's own text of its section 6.1 (OnePiece, arXiv 2601.20655, "Case 1".."Case 8") could
not be read here (the stored copy of the page holds only its beginning), so the cases follow
this enumeration of a lost or delayed lock holder, steps as numbered in writer.py:

    LOST (SIGKILL while holding the lock; another sender takes it over after the timeout)
    1. at step 2: before reading the header / writing anything;
    2. at step 6: entry written, size slot not published;
    3. at step 7: slot published, tails not moved (run both ways: the receiver polls before
       the take-over, or the next sender finds the busy slot first);
    4. at step 8: tails moved, lock not released;
    DELAYED (SIGSTOP past the lock timeout; another sender takes the lock over; then SIGCONT)
    5. at step 2: it wakes while the new holder is writing and reads a fresh header;
    6. at step 5, with a stale tail: it overwrites the entry published after the take-over,
       which the receiver must drop (checksum / length check), never deliver (variants: its
       entry smaller, larger, the same size, or the overwritten one already consumed);
    7. at step 6: its slot CAS fails on the busy/lap check; plus 7b, where it wakes between
       the new holder's write and publish (its stale publish lands first);
    8. at step 8: its release CAS must not free the new holder's lock;
    and, for completeness, a sender delayed at step 7 (slot published, tails not moved).
Every case runs over shm:// and over ring+tcp:// (the TCP agent).

A child (tests/ring_children.py) attaches to the ring by its address, announces each message
before sending it (uid and sha256 of its payload), and in its step hook, on reaching the chosen
step of the chosen message, tells the test and blocks; the test then kills or stops it there.
For every case: all that the receiver delivers equals exactly what some sender wrote, nothing
twice, losses only where the case allows them, and messages sent after the fault all arrive.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from onepiece.transport import registry
from onepiece.transport.ring import layout

from ring_children import sha

CHILD = Path(__file__).with_name("ring_children.py")
LOCK_TIMEOUT = 0.2
WAIT = 15.0  # bound on any one event from a child


class Child:
    """A sender process driven over its stdin/stdout (JSON lines)."""

    def __init__(self, address: str, name: str) -> None:
        self.name = name
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), "steps", address, name, str(LOCK_TIMEOUT)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True, bufsize=1)
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.tried: dict[str, str] = {}  # uid -> sha256 of the payload it was about to write
        self.sent: list[str] = []
        self.errors: dict[str, str] = {}

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put(None)

    def _cmd(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def send(self, uid: str, size: int, pause: int | None = None, timeout: float = 5.0) -> None:
        self._cmd(op="send", uid=uid, size=size, pause=pause, timeout=timeout)

    def go(self) -> None:
        self._cmd(op="go")

    def _one(self, deadline: float, what: str) -> dict:
        """The next event (recorded), or AssertionError past ``deadline``."""
        try:
            e = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"{self.name}: no {what} in time; stderr:\n{self.stderr()}") from None
        if e is None:
            raise AssertionError(f"{self.name} exited (rc {self.proc.poll()}) before {what}; stderr:\n{self.stderr()}")
        if e["ev"] == "try":
            self.tried[e["uid"]] = e["sha"]
        elif e["ev"] == "sent":
            self.sent.append(e["uid"])
        elif e["ev"] == "error":
            self.errors[e["uid"]] = e["error"]
        return e

    def wait(self, ev: str, uid: str | None = None, timeout: float = WAIT) -> dict:
        """The next event ``ev`` (for ``uid``), recording every event on the way."""
        deadline = time.monotonic() + timeout
        while True:
            e = self._one(deadline, f"{ev!r} for {uid}")
            if e["ev"] == ev and (uid is None or e.get("uid") == uid):
                return e
            if e["ev"] in ("sent", "error") and e["uid"] == uid:
                raise AssertionError(f"{self.name}: {uid} ended with {e} while waiting for {ev!r}")

    def result(self, uid: str, timeout: float = WAIT) -> dict:
        """The "sent" or "error" event of ``uid``."""
        deadline = time.monotonic() + timeout
        while uid not in self.sent and uid not in self.errors:
            self._one(deadline, f"the result of {uid}")
        if uid in self.sent:
            return {"ev": "sent", "uid": uid}
        return {"ev": "error", "uid": uid, "error": self.errors[uid]}

    def send_ok(self, uid: str, size: int, timeout: float = 5.0) -> None:
        self.send(uid, size, timeout=timeout)
        r = self.result(uid)
        assert r["ev"] == "sent", f"{self.name}: {uid} failed: {r}"

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=5)

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        finally:
            self.err.close()


@pytest.fixture(params=["shm", "ring+tcp"])
def backend(request) -> str:
    return request.param


@pytest.fixture
def ring(backend):
    if backend == "shm":
        address = f"shm://op-faults-{os.getpid()}-{uuid.uuid4().hex[:8]}?slots=16&bytes=65536"
    else:
        address = "ring+tcp://127.0.0.1:0?slots=16&bytes=65536"
    receiver = registry.listen(address)
    try:
        yield receiver
    finally:
        receiver.close()


@pytest.fixture
def spawn(ring):
    """spawn(*names) -> children attached to ``ring``, all killed at teardown."""
    children: list[Child] = []

    def _spawn(*names: str) -> list[Child]:
        new = [Child(ring.address, n) for n in names]
        children.extend(new)
        for c in new:
            c.wait("ready")
        return new

    try:
        yield _spawn
    finally:
        for c in children:
            c.close()


def drain(receiver, quiet: float = 0.15, bound: float = WAIT) -> list[tuple[str, str, str]]:
    """(uid, sender, sha256) of everything the receiver hands up until it is quiet."""
    out = []
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        msg = receiver.recv(quiet)
        if msg is None:
            return out
        out.append((msg.uid, msg.header["sender"], sha(bytes(msg.parts["data"]))))
    raise AssertionError("the receiver never went quiet")


def lock_word(receiver) -> int:
    return receiver.region.load(layout.W_LOCK)


def check(receiver, children: list[Child], delivered: list[tuple[str, str, str]], *,
          must: set[str], never: set[str] = frozenset(), dropped: int | None = None) -> str:
    """The safety and liveness checks every case shares; returns the counts line."""
    tried = {uid: (c.name, digest) for c in children for uid, digest in c.tried.items()}
    uids = [uid for uid, _, _ in delivered]
    lost = sorted(set(tried) - set(uids))
    acked_lost = sorted(uid for uid in lost if any(uid in c.sent for c in children))
    counts = (f"delivered={len(uids)} dropped={receiver.reader.dropped} lost={len(lost)} {lost} "
              f"(acknowledged but lost: {acked_lost}) sender errors={[c.errors for c in children]}")
    for uid, sender, digest in delivered:
        assert uid in tried, f"delivered {uid} that no sender wrote; {counts}"
        assert (sender, digest) == tried[uid], f"delivered {uid} differs from what {tried[uid][0]} wrote; {counts}"
    dups = sorted({u for u in uids if uids.count(u) > 1})
    assert not dups, f"delivered twice: {dups}; {counts}"
    missing = sorted(must - set(uids))
    assert not missing, f"not delivered: {missing}; {counts}"
    wrongly = sorted(never & set(uids))
    assert not wrongly, f"delivered {wrongly}, which must not be; {counts}"
    if dropped is not None:
        assert receiver.reader.dropped == dropped, f"expected {dropped} dropped entries; {counts}"
    # per-sender FIFO among the delivered
    for c in children:
        order = [u for u in uids if u in c.tried]
        assert order == [u for u in c.tried if u in order], f"{c.name} delivered out of order: {order}; {counts}"
    return counts


def after_fault(receiver, sender: Child, tag: str, n: int = 5) -> set[str]:
    """Entries published after the fault: all must be sent and delivered."""
    uids = {f"{tag}{i}" for i in range(n)}
    for i in range(n):
        sender.send_ok(f"{tag}{i}", 200 + 37 * i)
    return uids


# --- lost senders (SIGKILL) ---------------------------------------------------------------

@pytest.mark.parametrize("case,step", [(1, 2), (2, 6), (4, 8)], ids=["case1-step2", "case2-step6", "case4-step8"])
def test_lost_holder(ring, spawn, case, step):
    """Cases 1, 2, 4: the lock holder dies at step 2 (nothing written), step 6 (entry written,
    slot not published: the next holder writes over it) or step 8 (published and tails moved,
    lock still held). The next sender takes the lock over after the timeout and all flows."""
    a, b = spawn("A", "B")
    a.send_ok("a0", 300)
    before = drain(ring)
    a.send("a1", 500, pause=step)
    at = a.wait("at", "a1")
    assert at["lock"] != 0, "the child must hold the lock at the step it is killed at"
    a.signal(signal.SIGKILL)
    a.kill()
    assert lock_word(ring) == at["lock"], "a dead holder's lock stays until it is taken over"
    if case == 2:
        assert ring.recv(0.1) is None, "an entry whose size slot was never published is not handed up"
    t0 = time.monotonic()
    after = after_fault(ring, b, "b")
    took = time.monotonic() - t0
    delivered = before + drain(ring)
    published = {"a1"} if case == 4 else set()
    counts = check(ring, [a, b], delivered, must={"a0"} | published | after,
                   never=set() if case == 4 else {"a1"}, dropped=0)
    assert took >= LOCK_TIMEOUT * 0.9, f"took the dead holder's lock after {took:.3f}s, before the timeout"
    assert lock_word(ring) == layout.LOCK_TAINT, counts  # free; the take-over left its mark
    print(f"case {case} (lost at step {step}): {counts}")


@pytest.mark.parametrize("order", ["receiver-first", "sender-first"])
def test_case3_lost_after_publish(ring, spawn, order):
    """Case 3: the holder dies at step 7, after publishing its size slot but before moving the
    tails. Its entry is complete and is delivered once. "receiver-first": the receiver polls
    before anyone takes the lock over (consuming the entry then put the heads past the tails
    and wedged the ring: every later send reported Full; reader.py step 1 now waits for the
    tails to pass it); "sender-first": the next holder finds the busy slot at the tail and
    moves the tails past it (step 4) before the receiver looks."""
    a, b = spawn("A", "B")
    a.send_ok("a0", 300)
    before = drain(ring)
    a.send("a1", 500, pause=7)
    at = a.wait("at", "a1")
    a.signal(signal.SIGKILL)
    a.kill()
    early = []
    if order == "receiver-first":
        # The receiver polls before anyone takes the lock over. It may hand a1 up now, or (as
        # reader.py step 1 does) hold it back until the next sender's step-4 repair moves the
        # tails past it; either way the ring must not wedge and a1 must arrive exactly once.
        early = drain(ring)
        assert [u for u, _, _ in early] in (["a1"], []), early
        before += early
    after = after_fault(ring, b, "b")
    delivered = before + drain(ring)
    counts = check(ring, [a, b], delivered, must={"a0", "a1"} | after, dropped=0)
    assert lock_word(ring) == layout.LOCK_TAINT and at["lock"] != 0, counts
    print(f"case 3 (lost at step 7, {order}; a1 handed up before the take-over: {bool(early)}): {counts}")


# --- delayed senders (SIGSTOP past the lock timeout, then SIGCONT) --------------------------

def _stall(child: Child, uid: str, size: int, step: int) -> dict:
    child.send(uid, size, pause=step)
    at = child.wait("at", uid)
    child.signal(signal.SIGSTOP)
    return at


def _wake(child: Child) -> None:
    child.signal(signal.SIGCONT)
    child.go()


def test_case5_delayed_at_step2(ring, spawn):
    """Case 5: A stalls holding the lock before reading the header; B takes the lock over and is
    between reading the header and writing its entry when A wakes. A reads a fresh header, which
    shows the lock is no longer its own: it must write nothing (LostLock) and B's entry, of the
    same size, is delivered exactly once."""
    a, b = spawn("A", "B")
    a.send_ok("a0", 300)
    _stall(a, "a1", 700, step=2)
    b.send("b0", 700, pause=5)  # takes the lock over after LOCK_TIMEOUT, then holds at step 5
    bat = b.wait("at", "b0")
    assert bat["lock"] != 0 and lock_word(ring) == bat["lock"]
    _wake(a)
    ra = a.result("a1")
    b.go()
    rb = b.result("b0")
    after = after_fault(ring, b, "c") | after_fault(ring, a, "d", 2)
    delivered = drain(ring)
    counts = check(ring, [a, b], delivered, must={"a0", "b0"} | after, never={"a1"}, dropped=0)
    assert ra["ev"] == "error" and "LostLock" in ra["error"], f"A: {ra}; {counts}"
    assert rb["ev"] == "sent", f"B: {rb}; {counts}"
    print(f"case 5 (delayed at step 2): {counts}")


@pytest.mark.parametrize("variant", ["smaller", "larger", "same-size", "already-consumed"])
def test_case6_delayed_at_step5(ring, spawn, variant):
    """Case 6: A stalls at step 5 having read the tails; B takes over, publishes b0 where A would
    have written and b1 after it. A wakes and writes its entry at its stale tail, over b0; its
    own publish then fails (LostLock). "smaller": b0 is torn and the receiver must DROP it
    (length/checksum check), never deliver it. "larger": A's entry runs on over b1, which is
    dropped too (a late writer tears as many entries as its own length covers). "same-size":
    A's entry replaces b0 whole; it is intact and exactly what A wrote, so it is handed up in
    b0's place (b0 is lost, once; A was told LostLock). "already-consumed": the receiver has
    handed b0 and b1 up before A wakes, so A only scribbles over free space."""
    a, b = spawn("A", "B")
    a.send_ok("a0", 300)
    before = drain(ring)
    size = {"smaller": 100, "larger": 2300, "same-size": 2000, "already-consumed": 100}[variant]
    _stall(a, "a1", size, step=5)
    b.send_ok("b0", 2000)
    b.send_ok("b1", 400)
    if variant == "already-consumed":
        before += drain(ring)
    dropped0 = ring.reader.dropped
    _wake(a)
    ra = a.result("a1")
    after = after_fault(ring, b, "c") | after_fault(ring, a, "d", 2)
    delivered = before + drain(ring)
    common = {"a0"} | after
    if variant == "already-consumed":
        counts = check(ring, [a, b], delivered, must=common | {"b0", "b1"}, never={"a1"}, dropped=0)
    elif variant == "smaller":
        counts = check(ring, [a, b], delivered, must=common | {"b1"}, never={"a1", "b0"})
        assert ring.reader.dropped == dropped0 + 1 and ring.rejected == 1, f"the torn b0 must be dropped; {counts}"
    elif variant == "larger":
        counts = check(ring, [a, b], delivered, must=common, never={"a1", "b0", "b1"})
        assert ring.reader.dropped == dropped0 + 2 and ring.rejected == 2, f"b0 and b1 must be dropped; {counts}"
    else:
        counts = check(ring, [a, b], delivered, must=common | {"a1", "b1"}, never={"b0"}, dropped=0)
    assert ra["ev"] == "error" and "LostLock" in ra["error"], f"A: {ra}; {counts}"
    print(f"case 6 (delayed at step 5, {variant}): {counts}")


def test_case7_delayed_at_step6(ring, spawn):
    """Case 7: A stalls at step 6 with its entry written; B takes over and writes and publishes
    b0 at the same place. A wakes: its slot CAS fails on the busy/lap check and, the lock being
    B's, it gives up (LostLock). b0 and everything after are delivered, a1 never."""
    a, b = spawn("A", "B")
    a.send_ok("a0", 300)
    _stall(a, "a1", 900, step=6)
    b.send_ok("b0", 600)
    b.send_ok("b1", 100)
    _wake(a)
    ra = a.result("a1")
    after = after_fault(ring, b, "c") | after_fault(ring, a, "d", 2)
    delivered = drain(ring)
    counts = check(ring, [a, b], delivered, must={"a0", "b0", "b1"} | after, never={"a1"}, dropped=0)
    assert ra["ev"] == "error" and "LostLock" in ra["error"], f"A: {ra}; {counts}"
    print(f"case 7 (delayed at step 6): {counts}")


@pytest.mark.parametrize("same_size", [True, False], ids=["same-size", "other-size"])
def test_case7b_stale_publish_between_write_and_publish(ring, spawn, same_size):
    """Case 7, other interleaving: A stalls at step 6 (entry written at tail t); B takes over,
    writes b0 at t over A's entry and holds at step 6; A wakes and its stale publish of slot t
    succeeds (the slot is free), so slot t now holds A's length over B's bytes. B's publish then
    fails although it holds the lock. B's entry bytes at t may be handed up (same size): B must
    not publish b0 a second time. Nothing is delivered twice, nothing torn handed up."""
    a, b = spawn("A", "B")
    a.send_ok("a0", 300)
    _stall(a, "a1", 800, step=6)
    b.send("b0", 800 if same_size else 1500, pause=6)
    b.wait("at", "b0")
    _wake(a)
    ra = a.result("a1")
    b.go()
    rb = b.result("b0")
    after = after_fault(ring, b, "c") | after_fault(ring, a, "d", 2)
    delivered = drain(ring)
    counts = check(ring, [a, b], delivered, must={"a0"} | after)
    assert ra["ev"] == "sent", f"A's stale publish went through: {ra}; {counts}"
    uids = [u for u, _, _ in delivered]
    assert "a1" not in uids, f"A's bytes at t were overwritten by B's before A published; {counts}"
    if same_size:
        # slot t says A's length over B's whole entry, which is handed up there: B must not
        # write b0 again (that was a duplicate), and says it cannot confirm the send
        assert uids.count("b0") == 1 and ring.reader.dropped == 0, counts
        assert rb["ev"] == "error" and "Unconfirmed" in rb["error"], f"B: {rb}; {counts}"
    else:
        # slot t says A's length, t holds B's header: dropped; B published b0 again after it
        assert ring.reader.dropped == 1 and "b0" in uids and rb["ev"] == "sent", f"B: {rb}; {counts}"
    print(f"case 7b ({'same' if same_size else 'other'} size): B {rb}; {counts}")


@pytest.mark.parametrize("holder", ["repairs", "reads-late"])
def test_delayed_at_step7(ring, spawn, holder):
    """Not one of the eight, for completeness: A stalls at step 7 (slot published, tails not
    moved). "repairs": B takes over, finds the busy slot at the tail and moves the tails past
    it (step 4), publishes b0; A wakes and its tails CAS from the stale value fails.
    "reads-late": B takes over and read the old tails (step 2) when A wakes and moves them;
    the receiver consumes a1; B then finds the slot at its stale tail free for the next lap
    and must look again (not write there and give b0 up)."""
    a, b = spawn("A", "B")
    a.send_ok("a0", 300)
    _stall(a, "a1", 500, step=7)
    if holder == "repairs":
        b.send_ok("b0", 600)
        _wake(a)
        ra = a.result("a1")
        rb = b.result("b0")
    else:
        b.send("b0", 600, pause=4)
        b.wait("at", "b0")
        _wake(a)
        ra = a.result("a1")
        early = drain(ring)
        assert [u for u, _, _ in early] == ["a0", "a1"], early
        b.go()
        rb = b.result("b0")
    after = after_fault(ring, b, "c") | after_fault(ring, a, "d", 2)
    delivered = (early if holder == "reads-late" else []) + drain(ring)
    counts = check(ring, [a, b], delivered, must={"a0", "a1", "b0"} | after, dropped=0)
    assert ra["ev"] == "sent" and rb["ev"] == "sent", f"A: {ra} B: {rb}; {counts}"
    print(f"delayed at step 7 ({holder}): {counts}")


def test_case8_delayed_at_step8(ring, spawn):
    """Case 8: A stalls at step 8, its entry published and the tails moved, the lock not yet
    released; B takes over and holds the lock (at step 5) when A wakes. A's release CAS must
    leave B's lock alone; then B finishes and all flows."""
    a, b = spawn("A", "B")
    a.send_ok("a0", 300)
    at = _stall(a, "a1", 500, step=8)
    b.send("b0", 600, pause=5)
    bat = b.wait("at", "b0")
    assert bat["lock"] not in (0, at["lock"])
    _wake(a)
    ra = a.result("a1")
    assert ra["ev"] == "sent", ra
    assert lock_word(ring) == bat["lock"], "the late release freed the new holder's lock"
    b.go()
    rb = b.result("b0")
    assert rb["ev"] == "sent", rb
    assert lock_word(ring) == layout.LOCK_TAINT
    after = after_fault(ring, b, "c") | after_fault(ring, a, "d", 2)
    delivered = drain(ring)
    counts = check(ring, [a, b], delivered, must={"a0", "a1", "b0"} | after, dropped=0)
    print(f"case 8 (delayed at step 8): {counts}")
