"""A DB that joins, or comes back empty from a restart, is filled from its peers: real DbServers
on real sockets (ipc, so that a restarted DB binds the very addresses its peers list)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from onepiece.db import server as db_server
from onepiece.db.client import DbClient, DbGone
from onepiece.db.placement import order_dbs
from onepiece.db.server import DbServer
from onepiece.transport.message import new_uid
from db_harness import Running, close_senders, send  # noqa: F401 (close_senders: autouse)
from waiting import wait_for

FAST = {"sweep_interval_s": 0.05, "deadline_grace_s": 0.0, "replication_timeout_s": 0.2,
        "peer_backoff_s": 0.2, "purge_after_fetch_s": 0.0, "replication": 2}


class Db(Running):
    def __init__(self, addresses: tuple[str, str, str], name: str, **kw: Any) -> None:
        super().__init__(DbServer(*addresses, name=name, **{**FAST, **kw}))

    def record(self, uid: str) -> dict | None:
        with DbClient([self.server.control_address], timeout=1.0) as c:
            return c.get(uid)


@pytest.fixture
def dbs() -> Iterator[list[Db]]:
    running: list[Db] = []
    yield running
    for d in running:
        if not d.server._closed:
            d.shutdown()


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="opfill", dir="/tmp") as d:  # short: ipc paths are bounded
        yield Path(d)


def ipc(folder: Path, name: str) -> tuple[str, str, str]:
    return tuple(f"ipc://{folder}/{name}-{kind}.sock" for kind in ("data", "ctl", "ev"))  # type: ignore[return-value]


TCP = ("tcp://127.0.0.1:0",) * 3




def result(db: Db, uid: str) -> bytes:
    """Write ``uid``'s completed result to ``db``, as the last stage does; its content."""
    content = f"video {uid}".encode()
    send(db.server.data_address, {"uid": uid, "kind": "result", "content_type": "video/mp4"}, {"content": content})
    return content


def holds(db: Db, uid: str, content: bytes | None = None, status: str = "completed") -> bool:
    """Whether ``db`` holds ``uid`` in ``status`` (and with ``content``). Reads the store from the
    test thread, as test_db_server does: dict lookups, nothing iterated."""
    rec = db.server.store.get(uid)
    return rec is not None and rec["status"] == status and (content is None or db.server.store.content(uid) == content)


def test_a_db_restarted_at_the_same_addresses_is_filled_from_its_peer(dbs, ipc_dir, caplog, monkeypatch) -> None:
    """The defect: a SIGKILLed DB restarted by the launcher came back empty and its peer, whose
    route table never changed (same name, same addresses), never sent it what it held, so one
    more failure lost results. Now the new process greets its peers, and they fill it."""
    caplog.set_level(logging.INFO, logger="onepiece.db")
    monkeypatch.setattr(db_server, "FILL_BATCH", 8)  # several slices, and the bound is checked below
    a = Db(ipc(ipc_dir, "a"), "fill-a")
    b = Db(ipc(ipc_dir, "b"), "fill-b")
    dbs += [a, b]
    for d in (a, b):
        d.server.set_peers([a.entry, b.entry])
    videos = {new_uid(): b"" for _ in range(40)}
    for i, uid in enumerate(videos):
        videos[uid] = result(a if i % 2 else b, uid)
    running = new_uid()  # still generating when b dies; completed on a meanwhile
    send(a.server.data_address, {"uid": running, "kind": "status", "status": "in_progress", "stage": "dit",
                                 "progress": 30})
    wait_for(lambda: all(holds(d, u, c) for d in (a, b) for u, c in videos.items()) and holds(b, running, None,
             "in_progress"), what="every result on both DBs")

    b.shutdown()  # a still lists b: the NM replaces a restarted name at once
    later = {new_uid(): b"" for _ in range(4)}
    for uid in later:
        later[uid] = result(a, uid)
    videos.update(later)
    videos[running] = result(a, running)
    wait_for(lambda: all(holds(a, u, c) for u, c in videos.items()), what="a holds the later results")
    mine = new_uid()  # a stage writes to the new b first: a holds only an older state of it
    send(a.server.data_address, {"uid": mine, "kind": "status", "status": "in_progress", "stage": "vae",
                                 "progress": 80})
    wait_for(lambda: holds(a, mine, None, "in_progress"), what="a holds the running request")

    queued: list[int] = []  # the replication queue's length each time a fill message is put on it
    put = a.server._outq.put_nowait

    def counted_put(item: Any) -> None:  # called on a's loop thread, the only one that puts
        if isinstance(item, db_server._Directed):
            queued.append(a.server._outq.qsize())
        put(item)

    a.server._outq.put_nowait = counted_put
    b2 = Db(ipc(ipc_dir, "b"), "fill-b2")  # the launcher's restart: same addresses, empty
    dbs.append(b2)
    assert b2.entry == b.entry and len(b2.server.store) == 0
    videos[mine] = result(b2, mine)
    wait_for(lambda: holds(b2, mine, videos[mine]), what="the new b holds the result written to it")
    b2.server.set_peers([a.entry, b2.entry])  # its routes; a's routes are the same as before
    a.server.set_peers([a.entry, b2.entry])

    wait_for(lambda: all(holds(b2, u, c) for u, c in videos.items()), timeout=5,
             what="the restarted DB filled with every result, with its content")
    assert holds(b2, mine, videos[mine])  # not regressed by a's older copy
    wait_for(lambda: holds(a, mine, videos[mine]), what="b2's result on a (owed while b2 knew no peers)")
    wait_for(lambda: a.server.snapshot["replication"]["filling"] == 0, what="a's fill done")
    assert a.server.counts["filled"] >= len(videos) - 1
    assert "peer %s (re)started" % b2.server.data_address in caplog.text
    assert "filled peer %s" % b2.server.data_address in caplog.text
    assert queued and max(queued) < 8  # never more than FILL_BATCH queued for the fill

    assert len(b2.server.store) == len(videos)
    a.shutdown()  # the two failures never overlapped: nothing is lost
    with DbClient([a.server.control_address, b2.server.control_address], timeout=0.3) as client:
        for uid, content in list(videos.items())[:5]:
            assert client.content(uid)[1] == content


def test_a_db_restarted_empty_is_told_what_its_peer_dropped(dbs, ipc_dir) -> None:
    """The defect: a DB back empty from a restart had lost its tombstones, so an
    Idempotency-Key retry of a video already downloaded created it again there (the proxy
    answers 409 gone while a DB remembers it), on that copy alone, as its peer's tombstone
    refused the copies. Now the fill carries the peer's tombstones too."""
    a = Db(ipc(ipc_dir, "a"), "tomb-a")
    b = Db(ipc(ipc_dir, "b"), "tomb-b")
    dbs += [a, b]
    for d in (a, b):
        d.server.set_peers([a.entry, b.entry])
    uid, kept = new_uid(), new_uid()
    content = result(a, uid)
    kept_content = result(a, kept)
    wait_for(lambda: holds(b, uid, content) and holds(b, kept, kept_content), what="both results on b")
    with DbClient([a.server.control_address], timeout=1.0) as c:
        assert c.content(uid)[1] == content  # downloaded: purged at once here, and on b
    wait_for(lambda: b.server.store.gone(uid), what="b's tombstone")

    b.shutdown()
    b2 = Db(ipc(ipc_dir, "b"), "tomb-b2")  # the launcher's restart: same addresses, empty
    dbs.append(b2)
    assert not b2.server.store.gone(uid)
    b2.server.set_peers([a.entry, b2.entry])
    a.server.set_peers([a.entry, b2.entry])
    wait_for(lambda: holds(b2, kept, kept_content) and not a.server._fills, what="a's fill of b2 done")
    assert b2.server.store.gone(uid) and b2.server.store.get(uid) is None
    record = {"uid": uid, "status": "queued", "created_at": 1.0, "request_hash": "h"}
    with DbClient([b2.server.control_address], timeout=1.0) as c, pytest.raises(DbGone):
        c.create_once(record)  # an idempotent retry is told it is gone, not made again


def test_a_new_db_gets_its_share_and_records_move_off_the_one_that_left(dbs) -> None:
    """Three DBs, two copies each: one dies and a new one (new addresses) takes its place. The
    new one gets exactly what placement gives it; records whose holders moved to a DB that
    stayed reach it too, so every result is back to two copies."""
    old = [Db(TCP, f"move-{i}") for i in range(3)]
    dbs += old
    for d in old:
        d.server.set_peers([o.entry for o in old])
    videos = {new_uid(): b"" for _ in range(60)}
    for i, uid in enumerate(videos):
        videos[uid] = result(old[i % 3], uid)

    def on_holders(group: list[Db]) -> bool:
        by_control = {d.server.control_address: d for d in group}
        return all(holds(by_control[h["control"]], uid, content)
                   for uid, content in videos.items() for h in order_dbs(uid, [d.entry for d in group])[:2])

    wait_for(lambda: on_holders(old), what="two copies of every result")
    old[2].shutdown()
    new = Db(TCP, "move-new")
    dbs.append(new)
    group = [old[0], old[1], new]
    for d in group:
        d.server.set_peers([g.entry for g in group])
    wait_for(lambda: on_holders(group), timeout=5, what="two copies of every result among the DBs that are up")
    mine = {u for u in videos if new.server.control_address in
            {h["control"] for h in order_dbs(u, [g.entry for g in group])[:2]}}
    assert mine and set(new.server.store.uids()) == mine  # its share, and nothing else


def test_a_hello_fills_only_a_listed_peer(dbs) -> None:
    """A hello names a control address; records go only to a peer the NM's list holds, at the
    data address that list gives, never to one a message names."""
    a, b = Db(TCP, "hello-a"), Db(TCP, "hello-b")
    dbs += [a, b]
    uid = new_uid()
    content = result(a, uid)
    wait_for(lambda: holds(a, uid, content), what="a holds the result")
    send(a.server.data_address, {"uid": new_uid(), "kind": "hello", "control": b.server.control_address})
    send(a.server.data_address, {"uid": new_uid(), "kind": "hello", "control": ["tcp://127.0.0.1:9"]})
    send(a.server.data_address, {"uid": new_uid(), "kind": "hello", "control": "x" * 513})
    after = new_uid()  # on the same connection, so handled after the hellos
    send(a.server.data_address, {"uid": after, "kind": "status", "status": "in_progress", "stage": "s", "progress": 1})
    wait_for(lambda: holds(a, after, None, "in_progress"), what="the message after the hello")
    assert not a.server._fills and a.server.counts["filled"] == 0 and not holds(b, uid)  # b is not a's peer
    assert a.server.counts["malformed"] == 2  # the two that are not hellos: dropped, and a serves on
    a.server.set_peers([b.entry])  # a new peer: filled without a hello from it
    wait_for(lambda: holds(b, uid, content) and holds(b, after, None, "in_progress"), what="b filled as a's new peer")
    wait_for(lambda: a.server.counts["filled"] == 2, what="two records filled")
    send(a.server.data_address, {"uid": new_uid(), "kind": "hello", "control": b.server.control_address})
    wait_for(lambda: a.server.counts["filled"] == 4, what="filled again after b's hello, its list unchanged")


def test_a_fill_never_regresses_a_newer_copy(dbs) -> None:
    """The filling DB holds an older state of a request than the peer it fills (a stage wrote
    the result to the peer): the peer keeps the result, and the rest arrive."""
    a, b = Db(TCP, "newer-a"), Db(TCP, "newer-b")
    dbs += [a, b]
    uid, other = new_uid(), new_uid()
    send(a.server.data_address, {"uid": uid, "kind": "status", "status": "in_progress", "stage": "vae", "progress": 80})
    other_content = result(a, other)
    content = result(b, uid)  # b knows no peers: it keeps this to itself (owed)
    wait_for(lambda: holds(a, uid, None, "in_progress") and holds(a, other) and holds(b, uid, content),
             what="both states written")
    a.server.set_peers([b.entry])  # only a learns of b: a's fill carries the older state
    wait_for(lambda: a.server.counts["filled"] == 2 and not a.server._fills, what="a's fill done")
    assert holds(b, other, other_content)
    assert holds(b, uid, content) and b.server.store.get(uid)["progress"] == 100


def test_a_peer_that_never_takes_its_fill_is_given_up_with_a_log_line(dbs, caplog) -> None:
    caplog.set_level(logging.INFO, logger="onepiece.db")
    a = Db(TCP, "dead-peer", peer_backoff_s=0.05, replication_timeout_s=0.05)
    dbs.append(a)
    uids = [new_uid() for _ in range(3)]
    for uid in uids:
        result(a, uid)
    wait_for(lambda: all(holds(a, u) for u in uids), what="a holds its results")
    a.server.set_peers([{"data": "tcp://127.0.0.1:1", "control": "tcp://127.0.0.1:2"}])  # nobody listens
    wait_for(lambda: "gave up filling peer tcp://127.0.0.1:1" in caplog.text, timeout=5, what="the give-up")
    assert caplog.text.count("did not take its fill") == db_server.FILL_TRIES
    assert a.server.counts["filled"] == 0
    wait_for(lambda: a.server.snapshot["replication"]["filling"] == 0, what="no fill left")
    assert a.record(uids[0])["status"] == "completed"  # serving all along
