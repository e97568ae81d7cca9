"""Unit tests of the DB's in-memory store (no sockets)."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onepiece.db.protocol import merge
from onepiece.db.store import (
    RECORD_OVERHEAD,
    InvalidUpdate,
    NotFound,
    NotReady,
    ResultStore,
    StoreFull,
)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(ttl: float = 60.0, max_bytes: int = 1 << 20, **kw) -> tuple[ResultStore, Clock]:
    clock = Clock()
    return ResultStore(ttl, max_bytes, clock=clock, **kw), clock


def test_create_fills_defaults_and_get_returns_copy() -> None:
    s, clock = make()
    ch = s.create({"uid": "u1", "app": "t2v", "set": "s0", "params": {"steps": 4}})
    assert ch is not None and ch.created and not ch.terminal
    rec = s.get("u1")
    assert rec["status"] == "queued" and rec["progress"] == 0
    assert rec["app"] == "t2v" and rec["set"] == "s0" and rec["params"] == {"steps": 4}
    assert rec["created_at"] == clock.t and rec["expires_at"] == clock.t + 60
    assert rec["completed_at"] is None and rec["error"] is None and rec["bytes"] == 0
    rec["status"] = "failed"
    assert s.get("u1")["status"] == "queued"
    assert s.get("nope") is None


def test_a_note_adds_fields_to_an_unfinished_record_only() -> None:
    s, clock = make()
    s.create({"uid": "u", "stage": "text_encode"})
    clock.t += 1
    assert s.note("u", handed=True) is not None
    rec = s.get("u")
    assert (rec["handed"], rec["status"], rec["stage"], rec["progress"]) == (True, "queued", "text_encode", 0)
    s.set_status("u", "in_progress", "denoise", 40)
    s.note("u", handed=True)
    assert (s.get("u")["status"], s.get("u")["progress"]) == ("in_progress", 40)
    s.fail("u", "denoise", "boom")
    finished = s.get("u")
    assert s.note("u", other=1) is None and s.get("u") == finished  # its times stay as they were
    assert s.note("nope", handed=True) is None and s.get("nope") is None


def test_progress_is_monotonic_and_terminal_is_final() -> None:
    s, clock = make()
    s.create({"uid": "u"})
    s.set_status("u", "in_progress", "text", 20)
    assert s.set_status("u", "in_progress", "vae", 10) is None  # stale report ignored
    assert s.get("u")["stage"] == "text" and s.get("u")["progress"] == 20
    s.set_status("u", "in_progress", "dit", 60)
    assert s.set_status("u", "queued", "", 0) is None
    clock.t += 5
    ch = s.put_result("u", b"mp4", "video/mp4", [{"stage": "vae_decode", "event": "leave", "t": 1}])
    assert ch.terminal and ch.content == b"mp4"
    rec = s.get("u")
    assert rec["status"] == "completed" and rec["progress"] == 100 and rec["stage"] == "vae_decode"
    assert rec["completed_at"] == clock.t and rec["expires_at"] == clock.t + 60  # completion + ttl
    assert rec["bytes"] == 3 and rec["content_type"] == "video/mp4"
    assert s.set_status("u", "in_progress", "dit", 99) is None
    assert s.fail("u", "dit", "late failure") is None
    assert s.get("u")["status"] == "completed" and s.get("u")["error"] is None


def test_completed_beats_failed_so_replicas_converge() -> None:
    s, _ = make()
    s.create({"uid": "u"})
    s.fail("u", "dit", "deadline exceeded at stage dit")
    ch = s.put_result("u", b"xyz")
    assert ch is not None and ch.terminal and ch.content == b"xyz"
    rec = s.get("u")
    assert rec["status"] == "completed" and rec["error"] is None
    assert s.take_content("u")[1] == b"xyz"


def test_take_content_purges_or_keeps() -> None:
    s, _ = make(purge_after_fetch_s=0)
    s.create({"uid": "u"})
    with pytest.raises(NotReady, match="not ready: u is queued"):
        s.take_content("u")
    s.put_result("u", b"data")
    rec, data = s.take_content("u")
    assert data == b"data" and rec["status"] == "completed"
    assert s.get("u") is None and s.bytes_used == 0
    with pytest.raises(NotFound, match="not found: u"):
        s.take_content("u")
    # A late report for a fetched request does not resurrect it.
    assert s.set_status("u", "in_progress", "dit", 50) is None and s.get("u") is None

    keep, _ = make(purge_after_fetch_s=None)
    keep.put_result("k", b"1")
    assert keep.take_content("k")[1] == b"1" and keep.take_content("k")[1] == b"1"


def test_a_fetched_result_stays_for_the_grace_then_goes() -> None:
    """The OpenAI API never loses a video on download: a retrieve after it, or a retried
    download, finds it for ``purge_after_fetch_s``; then it goes, and nothing brings it back."""
    s, clock = make(ttl=3600.0, purge_after_fetch_s=60.0)
    s.put_result("u", b"data")
    assert s.take_content("u")[1] == b"data"
    assert s.get("u")["expires_at"] == clock.t + 60.0
    clock.t += 30
    assert s.take_content("u")[1] == b"data" and s.get("u")["expires_at"] == clock.t - 30 + 60.0  # not extended
    assert s.sweep().expired == []
    clock.t += 31
    assert s.sweep().expired == ["u"] and s.get("u") is None and s.bytes_used == 0
    assert s.put_result("u", b"late") is None  # a late copy does not resurrect it
    # a peer's fetch brings the expiry forward, never back
    s.put_result("v", b"1")
    assert s.expire_by("v", clock.t + 5) and not s.expire_by("v", clock.t + 50)
    assert s.get("v")["expires_at"] == clock.t + 5


def test_ttl_expiry() -> None:
    s, clock = make(ttl=10)
    s.create({"uid": "running"})
    s.put_result("done", b"x")
    clock.t += 6
    s.set_status("running", "in_progress", "dit", 10)  # an update keeps a running record alive
    clock.t += 5
    assert s.sweep().expired == ["done"]
    assert s.get("running") is not None
    clock.t += 10
    assert s.sweep().expired == ["running"]
    assert len(s) == 0 and s.bytes_used == 0


def test_a_running_record_outlives_a_ttl_shorter_than_its_deadline() -> None:
    """TTL 6 s, deadline 120 s: a request still served at 10 s keeps its record (its result and
    its cancellation still reach it); the deadline's verdict ends it, and its failure then waits a
    TTL for its reader."""
    s, clock = make(ttl=6)
    now_ns = int(clock.t * 1e9)
    s.create({"uid": "long", "deadline": now_ns + 120_000_000_000})
    s.create({"uid": "open"})  # no deadline: abandoned after a TTL without updates
    s.set_status("long", "in_progress", "dit", 20)
    clock.t += 10
    assert s.sweep().expired == ["open"]
    assert s.get("long")["status"] == "in_progress"
    clock.t += 5
    assert s.put_result("long", b"mp4") is not None and s.get("long")["status"] == "completed"
    s.create({"uid": "stuck", "deadline": int(clock.t * 1e9) + 20_000_000_000})
    clock.t += 21
    assert "long" in s.sweep().expired  # a result waits its TTL, no more
    assert s.get("stuck")["status"] == "failed" and s.get("stuck")["error"].startswith("deadline exceeded")
    clock.t += 7
    assert s.sweep().expired == ["stuck"]


def test_deadline_sweep_fails_stuck_requests() -> None:
    s, clock = make(deadline_grace_s=1.0)
    now_ns = int(clock.t * 1e9)
    s.create({"uid": "stuck", "deadline": now_ns + 2_000_000_000})
    s.set_status("stuck", "in_progress", "dit", 40)
    s.create({"uid": "never", "deadline": now_ns + 2_000_000_000})
    s.create({"uid": "fine", "deadline": now_ns + 2_000_000_000})
    s.put_result("fine", b"ok")
    clock.t += 2.5  # past the deadline but inside the grace
    assert s.sweep().failed == []
    clock.t += 1
    failed = s.sweep().failed
    assert sorted(c.record["uid"] for c in failed) == ["never", "stuck"]
    assert all(c.terminal for c in failed)
    assert s.get("stuck")["error"] == "deadline exceeded; last reported at stage dit"
    assert s.get("stuck")["progress"] == 40
    assert s.get("never")["error"] == "deadline exceeded before any stage reported it"
    assert s.get("fine")["status"] == "completed"
    assert s.sweep().failed == []  # once


def test_a_create_is_refused_when_the_videos_running_would_not_fit() -> None:
    """Room is held for each running request's video, sized by the videos seen so far: the
    create that would not fit is refused at once, not failed after every stage served it."""
    s, _ = make(max_bytes=40_000)
    video = {"size": "64x64", "seconds": 1.0}
    s.create({"uid": "first", **video})  # nothing seen yet: nothing held
    s.put_result("first", b"v" * 8000)  # 8000 bytes for 64x64 over 1 s
    s.purge("first")
    for i in range(4):  # 4 x 8000 held, under 95% of 40000 with the records
        s.create({"uid": f"r{i}", **video})
    with pytest.raises(StoreFull, match="needs about 8000 bytes .* held for the 4 requests running"):
        s.create({"uid": "r4", **video})
    assert s.get("r4") is None
    s.create({"uid": "small", "size": "16x16", "seconds": 1.0})  # 500 bytes: still fits
    s.fail("r0", "dit", "boom")  # an end frees its room ...
    s.create({"uid": "r4", **video})
    s.put_result("r1", b"v" * 8000)  # ... and so does a result, which then holds its own bytes
    with pytest.raises(StoreFull):
        s.create({"uid": "r5", **video})
    s.purge("r1")
    s.create({"uid": "r5", **video})
    s.create({"uid": "other"})  # no size: nothing to hold


def test_memory_cap_refuses_visibly_and_recovers() -> None:
    probe, _ = make()
    probe.create({"uid": "a"})
    one = probe.bytes_used  # a fresh record's estimate
    assert one > RECORD_OVERHEAD
    s, _ = make(max_bytes=int((3 * one + 100) / 0.95) + 1)  # three records fit (5% headroom kept)
    s.create({"uid": "a"})
    s.create({"uid": "b"})
    used = s.bytes_used
    with pytest.raises(StoreFull, match="store full"):
        s.put_result("a", b"x" * 2000)
    assert s.get("a")["status"] == "queued" and s.bytes_used == used
    # Updates to held records still apply, even near the cap.
    s.set_status("b", "in_progress", "dit", 50)
    s.create({"uid": "c"})
    with pytest.raises(StoreFull):
        s.create({"uid": "d"})
    assert s.get("d") is None
    assert s.purge("c") and not s.purge("c")
    s.create({"uid": "d"})
    st_ = s.stats()
    assert st_["records"] == 3 and st_["by_status"] == {"queued": 2, "in_progress": 1, "completed": 0, "failed": 0}
    assert st_["bytes"] == s.bytes_used <= s.max_bytes
    # A failure is always recorded, even past the cap, with its error text bounded.
    s.fail("b", "dit", "x" * 100_000)
    assert s.get("b")["status"] == "failed" and len(s.get("b")["error"]) == 1000


def test_replica_applies_with_origin_timestamps_and_checks_content() -> None:
    origin, clock = make()
    origin.create({"uid": "u", "app": "t2v"})
    ch = origin.put_result("u", b"abc", "video/mp4")
    peer, peer_clock = make()
    peer_clock.t = clock.t + 100
    got = peer.apply_replica(ch.record, ch.content)
    assert got is not None and got.terminal and got.created
    assert peer.get("u") == origin.get("u")
    assert peer.apply_replica(ch.record, ch.content) is None  # duplicate: no change, no event
    with pytest.raises(InvalidUpdate):
        make()[0].apply_replica(ch.record, None)
    with pytest.raises(InvalidUpdate):
        make()[0].apply_replica(ch.record, b"abcd")
    assert peer.purge("u") and peer.apply_replica(ch.record, ch.content) is None


@pytest.mark.parametrize("bad", [
    {"status": "in_progress"},
    {"uid": "", "status": "queued"},
    {"uid": "u", "status": "paused"},
    {"uid": "u", "status": "queued", "progress": "ten"},
    {"uid": "u", "status": "queued", "progress": True},
    {"uid": "u", "status": "queued", "stage": 3},
    {"uid": "u", "status": "queued", "trace": "x"},
    # A replica's timestamps feed this DB's timers: a string there once broke every later sweep.
    {"uid": "u", "status": "queued", "expires_at": "tomorrow"},
    {"uid": "u", "status": "queued", "created_at": float("nan")},
    {"uid": "u", "status": "completed", "completed_at": [1]},
    {"uid": "u", "status": "queued", "deadline": "soon"},
    {"uid": "u", "status": "queued", "bytes": -1},
    {"uid": "u", "status": "failed", "error": {"x": 1}},
    {"uid": ["u"], "status": "queued"},
    "not a record",
])
def test_invalid_updates_are_refused(bad: dict | str) -> None:
    s, _ = make()
    with pytest.raises(InvalidUpdate):
        s.apply_replica(bad)
    assert len(s) == 0


def test_invalid_status_kinds() -> None:
    s, _ = make()
    with pytest.raises(InvalidUpdate):
        s.set_status("u", "completed", "x", 100)
    with pytest.raises(InvalidUpdate):
        s.create({"uid": "u", "status": "failed"})
    s.set_status("u", "in_progress", "dit", 250)
    assert s.get("u")["progress"] == 100  # clamped


# ---- order independence ------------------------------------------------------------------

STAGES = ["", "text", "dit", "vae"]


@st.composite
def updates(draw: st.DrawFn) -> list[tuple]:
    """One request's reports as a stage set would send them: progress reports in any stage,
    the proxy's create, the result and/or one failure, each possibly duplicated."""
    ups: list[tuple] = []
    if draw(st.booleans()):
        ups.append(("create", {"uid": "u", "app": "t2v", "set": "s0", "deadline": 10**19}))
    for _ in range(draw(st.integers(0, 6))):
        ups.append(("status", draw(st.sampled_from(["queued", "in_progress"])), draw(st.sampled_from(STAGES)),
                    draw(st.integers(0, 100))))
    # A result and a failure may both arrive (a replica's deadline verdict racing the result).
    for _ in range(draw(st.integers(0, 2))):
        ups.append(("result", b"video", [{"stage": "vae", "event": "leave", "t": 7}]))
    for _ in range(draw(st.integers(0, 2))):  # a stage's reason, or a DB's own deadline verdict
        ups.append(("failed", *draw(st.sampled_from([("dit", "boom"), ("", "deadline exceeded; last reported at dit")]))))
    if not ups:
        ups.append(("status", "in_progress", "dit", 5))
    return ups


def apply(s: ResultStore, up: tuple) -> list:
    kind = up[0]
    if kind == "create":
        ch = s.create(dict(up[1]))
    elif kind == "status":
        ch = s.set_status("u", up[1], up[2], up[3])
    elif kind == "result":
        ch = s.put_result("u", up[1], "video/mp4", up[2])
    else:
        ch = s.fail("u", up[1], up[2])
    return [ch] if ch is not None else []


def final(s: ResultStore) -> tuple:
    rec = s.get("u")
    return rec, s._content.get("u")


@settings(max_examples=300, deadline=None)
@given(updates(), st.randoms(use_true_random=False))
def test_merge_order_does_not_matter(ups: list[tuple], rnd: random.Random) -> None:
    """Any order of the same updates gives the same final record (and artefact)."""
    a, _ = make()
    b, _ = make()
    for up in ups:
        apply(a, up)
    shuffled = list(ups)
    rnd.shuffle(shuffled)
    for up in shuffled:
        apply(b, up)
    assert final(a) == final(b)


@settings(max_examples=200, deadline=None)
@given(updates(), st.randoms(use_true_random=False))
def test_replicas_converge(ups: list[tuple], rnd: random.Random) -> None:
    """Two DBs each get some of the reports (any order), then each other's replicas in any
    order: they end with the same record, as one DB that got everything would."""
    a, _ = make()
    b, _ = make()
    whole, _ = make()
    to_a, to_b = [], []
    for up in ups:
        apply(whole, up)
        (to_a if rnd.random() < 0.5 else to_b).append(up)
    changes_a = [c for up in to_a for c in apply(a, up)]
    changes_b = [c for up in to_b for c in apply(b, up)]
    rnd.shuffle(changes_a)
    rnd.shuffle(changes_b)
    for c in changes_b:
        a.apply_replica(dict(c.record), c.content)
    for c in changes_a:
        b.apply_replica(dict(c.record), c.content)
    assert final(a) == final(b) == final(whole)


def test_protocol_merge_contract() -> None:
    """The shared merge itself: never back from terminal, progress never down within a status."""
    rec = merge(None, {"uid": "u", "status": "in_progress", "progress": 50})
    assert merge(rec, {"uid": "u", "status": "in_progress", "progress": 30})["progress"] == 50
    assert merge(rec, {"uid": "u", "status": "queued", "progress": 0}) == rec
    done = merge(rec, {"uid": "u", "status": "completed", "progress": 100})
    assert merge(done, {"uid": "u", "status": "failed", "error": "x"}) == done
    with pytest.raises(ValueError, match="unknown status"):
        merge(done, {"uid": "u", "status": "exploded"})


def test_sweep_costs_what_is_due_and_timers_stay_bounded() -> None:
    s, clock = make(ttl=100, max_bytes=1 << 30)
    deadline = int((clock.t + 50) * 1e9)
    for i in range(20_000):
        s.create({"uid": f"u{i}", "deadline": deadline})
    for step in range(5):  # updates postpone expiry without piling up timers
        clock.t += 1
        for i in range(0, 20_000, 2):
            s.set_status(f"u{i}", "in_progress", "dit", step * 10)
    assert s.sweep().expired == []
    assert len(s._expiry_heap) <= 20_000 and len(s._deadline_heap) <= 20_000
    for i in range(0, 20_000, 4):
        s.purge(f"u{i}")
    clock.t += 50  # past the deadline: the 15000 still running fail, once
    assert len(s.sweep().failed) == 15_000
    assert s.sweep().failed == []
    clock.t += 100  # the failed ones expire 100 s after failing
    assert len(s.sweep().expired) == 15_000 and len(s) == 0
    assert len(s._expiry_heap) <= 1024 + 2 * len(s._expiry_at)
