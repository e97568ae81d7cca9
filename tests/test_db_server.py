"""DB servers on real sockets (loopback tcp, ipc), in threads and one subprocess."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

import orjson
import pytest
import zmq
from prometheus_client import REGISTRY

from onepiece.db.client import AsyncDbClient, DbClient, DbFull, NotReady
from onepiece.config import deploy_dir, load_topology
from onepiece.db.placement import order
from onepiece.db.server import DbServer
from onepiece.nm.client import NmClient
from onepiece.nm.server import NodeManager
from onepiece.transport.message import Message, new_uid, now_ns
from onepiece.transport.rpc import RpcClient, RpcError
from db_harness import Running, close_senders, send  # noqa: F401 (close_senders: autouse)
from waiting import await_for, wait_for

FAST = {"sweep_interval_s": 0.05, "deadline_grace_s": 0.0, "replication_timeout_s": 0.2,
        "peer_backoff_s": 0.2, "purge_after_fetch_s": 0.0}



_names = iter(range(10**6))


@pytest.fixture
def start_dbs():
    running: list[Running] = []

    def start(n: int = 1, mesh: bool = True, **kw: Any) -> list[Running]:
        opts = {**FAST, **kw}
        group = []
        for _ in range(n):
            server = DbServer("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0",
                              name=f"db{next(_names)}", **opts)
            group.append(Running(server))
        if mesh:
            for r in group:
                r.server.set_peers([o.entry for o in group])
        running.extend(group)
        return group

    yield start
    for r in running:
        if r.thread.is_alive() or not r.server._closed:
            r.shutdown()




def get_from(db: Running, uid: str) -> dict | None:
    with DbClient([db.control], timeout=1.0) as c:
        return c.get(uid)


def test_create_status_result_fetch_roundtrip(start_dbs) -> None:
    (db,) = start_dbs(1)
    uid = new_uid()
    with DbClient([db.control]) as client:
        assert client.create({"uid": uid, "app": "t2v", "set": "s0"}) == db.control
        assert client.get(uid)["status"] == "queued"
        send(db.server.data_address, {"uid": uid, "kind": "status", "status": "in_progress",
                                      "stage": "dit", "progress": 40})
        rec = wait_for(lambda: (r := client.get(uid)) and r["status"] == "in_progress" and r, what="in_progress")
        assert rec["stage"] == "dit" and rec["progress"] == 40 and rec["app"] == "t2v"
        with pytest.raises(NotReady) as e:
            client.content(uid)
        assert e.value.record["status"] == "in_progress"
        send(db.server.data_address, {"uid": uid, "kind": "result", "content_type": "video/mp4",
                                      "trace": [{"stage": "vae", "event": "leave", "t": now_ns()}]},
             {"content": b"\x00mp4" * 1000})
        wait_for(lambda: client.get(uid)["status"] == "completed", what="completed")
        rec, data = client.content(uid)
        assert data == b"\x00mp4" * 1000 and rec["bytes"] == 4000 and rec["content_type"] == "video/mp4"
        assert client.get(uid) is None  # purged after fetch
        assert client.content(uid) is None
        stats = client.stats()[db.control]
        assert stats["records"] == 0 and stats["bytes"] == 0
    reads = REGISTRY.get_sample_value("onepiece_db_reads_total", {"db": db.server.name, "kind": "content"})
    assert reads >= 1


def test_write_to_any_db_is_readable_from_every_db_and_a_fetch_expires_every_copy(start_dbs) -> None:
    dbs = start_dbs(3, purge_after_fetch_s=0.5)
    uid = new_uid()
    controls = [d.control for d in dbs]
    by_control = {d.control: d for d in dbs}
    last = by_control[order(uid, controls)[-1]]  # a stage may write to any DB of the set
    for kind, header, parts in [
        ("status", {"status": "in_progress", "stage": "text", "progress": 10}, None),
        ("result", {"content_type": "video/mp4"}, {"content": b"artefact"}),
    ]:
        send(last.server.data_address, {"uid": uid, "kind": kind, **header}, parts)
    for d in dbs:
        wait_for(lambda d=d: (r := get_from(d, uid)) and r["status"] == "completed", what=f"replica on {d.server.name}")
    with DbClient(controls) as client:
        rec, data = client.content(uid)
        assert data == b"artefact"
        t0 = time.monotonic()
        assert client.get(uid)["status"] == "completed" and client.content(uid)[1] == b"artefact"  # a retry
    for d in dbs:  # the fetch's grace reaches every copy
        wait_for(lambda d=d: get_from(d, uid) is None, what=f"expiry on {d.server.name}")
    assert time.monotonic() - t0 > 0.3
    # two changes to two peers, plus the fetch to two peers
    wait_for(lambda: sum(d.server.counts["sent"] for d in dbs) >= 6, what="sends counted")


def ranked(dbs: list[Running], uid: str) -> list[Running]:
    """``dbs`` in ``uid``'s placement order (by control address, as readers and writers rank)."""
    by_control = {d.control: d for d in dbs}
    return [by_control[a] for a in order(uid, list(by_control))]


def test_replication_factor_puts_copies_on_the_first_dbs_in_placement_order(start_dbs) -> None:
    dbs = start_dbs(3, replication=2)
    uid = new_uid()
    first, second, third = ranked(dbs, uid)
    assert [h["control"] for h in first.server.holders(uid)] == [first.control, second.control]
    send(first.server.data_address, {"uid": uid, "kind": "status", "status": "in_progress", "stage": "s",
                                     "progress": 5})
    send(first.server.data_address, {"uid": uid, "kind": "result"}, {"content": b"mp4"})
    wait_for(lambda: (r := get_from(second, uid)) and r["status"] == "completed", what="copy on the second DB")
    # Two changes, one copy each, all to the second DB: nothing was ever sent to the third.
    wait_for(lambda: first.server.counts["sent"] == 2, what="two sends")
    assert third.server.counts["sent"] == second.server.counts["sent"] == 0
    assert get_from(third, uid) is None and third.server.store.stats()["tombstones"] == 0
    assert first.server.counts["short"] == 0 and first.server.snapshot["replication"]["factor"] == 2
    with DbClient([d.control for d in dbs]) as client:
        rec, data = client.content(uid)  # read from the first, which purges its copies
    assert data == b"mp4"
    wait_for(lambda: get_from(second, uid) is None, what="purge on the second DB")
    assert get_from(first, uid) is None


def test_replication_passes_over_a_down_peer_for_the_next_in_order(start_dbs) -> None:
    dbs = start_dbs(3, mesh=False, replication=2)
    uid = new_uid()
    first, second, third = ranked(dbs, uid)
    # Down before the others connect to it, and still in their peer lists, as until the NM
    # notices. (Down after: a copy sent as its socket closes can go down with it, before the
    # sender's connection learns it is gone; 5 of 25 runs lost it so on two busy cores. The NM
    # then drops it from the routes, and the fill that follows gives the next DB its share.)
    second.shutdown()
    for r in (first, third):
        r.server.set_peers([o.entry for o in dbs])
    send(first.server.data_address, {"uid": uid, "kind": "result"}, {"content": b"kept"})
    wait_for(lambda: (r := get_from(third, uid)) and r["status"] == "completed", what="copy on the third DB")
    assert first.server.counts["dropped"] >= 1 and first.server.counts["short"] == 0
    with DbClient([d.control for d in dbs], timeout=0.3) as client:
        first.shutdown()  # and now the holder the reader asks first is gone too
        rec, data = client.content(uid)  # the reader asks the next, then the next
    assert data == b"kept"


def test_reader_asks_the_next_db_when_the_first_lacks_the_result(start_dbs) -> None:
    dbs = start_dbs(2, mesh=False)  # no replication: only the second in order will hold it
    uid = new_uid()
    first, second = ranked(dbs, uid)
    send(second.server.data_address, {"uid": uid, "kind": "result"}, {"content": b"late"})
    wait_for(lambda: get_from(second, uid) is not None, what="result on the second DB")
    with DbClient([d.control for d in dbs]) as client:
        assert get_from(first, uid) is None and client.get(uid)["status"] == "completed"
        assert client.content(uid)[1] == b"late"


def test_replication_factor_one_copies_nothing_and_a_factor_above_the_set_means_every_db(start_dbs) -> None:
    solo = start_dbs(2, replication=1)
    uid = new_uid()
    first, second = ranked(solo, uid)
    assert first.server.holders(uid) == [first.server._me]
    send(first.server.data_address, {"uid": uid, "kind": "result"}, {"content": b"one"})
    wait_for(lambda: get_from(first, uid) is not None, what="result stored")
    with DbClient([first.control]) as client:
        assert client.content(uid)[1] == b"one"
    wait_for(lambda: first.server.counts["sent"] == 1, what="the purge sent")  # purges still travel
    assert get_from(second, uid) is None and first.server.counts["short"] == 0

    every = start_dbs(3, replication=5)
    uid = new_uid()
    send(every[0].server.data_address, {"uid": uid, "kind": "result"}, {"content": b"all"})
    for d in every:
        wait_for(lambda d=d: get_from(d, uid) is not None, what=f"copy on {d.server.name}")
    assert every[0].server.counts["short"] == 0
    with pytest.raises(ValueError, match="replication"):
        DbServer("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", replication=0)


def test_failed_report_replicates_and_publishes_done(start_dbs) -> None:
    a, b = start_dbs(2)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"done")
    sub.connect(b.server.events_address)
    try:
        # A PUB drops what it sends before a subscription has reached it (the slow joiner),
        # so report failures of fresh requests until the peer's event for one arrives.
        deadline = time.monotonic() + 3
        sent, seen = [], set()
        while time.monotonic() < deadline and not seen & set(sent):
            uid = new_uid()
            sent.append(uid)
            send(a.server.data_address, {"uid": uid, "kind": "failed", "stage": "dit", "error": "worker died"})
            while sub.poll(50):
                topic, body = sub.recv_multipart()
                event = orjson.loads(body)
                assert topic == b"done" and event["status"] == "failed"
                seen.add(event["uid"])
        assert seen & set(sent), "no done event from the peer"
        rec = get_from(b, sent[0])
        assert rec["status"] == "failed" and rec["error"] == "worker died" and rec["stage"] == "dit"
    finally:
        sub.close()


def test_snapshot_is_refreshed_by_the_loop_and_never_mutated(start_dbs) -> None:
    (db,) = start_dbs(1)
    before = db.server.snapshot
    assert before["records"] == 0 and before["addresses"]["control"] == db.control
    uid = new_uid()
    send(db.server.data_address, {"uid": uid, "kind": "status", "status": "in_progress", "stage": "s", "progress": 1})
    after = wait_for(lambda: (s := db.server.snapshot)["records"] == 1 and s, what="snapshot refreshed")
    assert after["by_status"]["in_progress"] == 1 and after is not before
    assert before["records"] == 0 and before["by_status"]["in_progress"] == 0  # replaced, not updated


def test_ttl_expiry(start_dbs) -> None:
    (db,) = start_dbs(1, ttl_s=0.5)
    uid = new_uid()
    send(db.server.data_address, {"uid": uid, "kind": "result"}, {"content": b"x"})
    wait_for(lambda: get_from(db, uid) is not None, what="result stored")
    t0 = time.monotonic()
    wait_for(lambda: get_from(db, uid) is None, what="expiry")
    assert time.monotonic() - t0 < 4.0  # about the TTL and a sweep (room for a busy neighbour)
    assert REGISTRY.get_sample_value("onepiece_db_expired_total", {"db": db.server.name}) == 1


def test_deadline_sweep_fails_stuck_request_with_a_visible_error(start_dbs) -> None:
    (db,) = start_dbs(1)
    uid = new_uid()
    with DbClient([db.control]) as client:
        client.create({"uid": uid, "app": "t2v", "deadline": now_ns() + 300_000_000})
        send(db.server.data_address, {"uid": uid, "kind": "status", "status": "in_progress",
                                      "stage": "dit", "progress": 55})
        rec = wait_for(lambda: (r := client.get(uid)) and r["status"] == "failed" and r, what="deadline failure")
    assert rec["error"] == "deadline exceeded; last reported at stage dit" and rec["progress"] == 55
    assert REGISTRY.get_sample_value("onepiece_db_deadline_failed_total", {"db": db.server.name}) == 1


def test_memory_cap_refuses_visibly_and_keeps_serving(start_dbs) -> None:
    (db,) = start_dbs(1, max_bytes=4000)
    with DbClient([db.control]) as client:
        created = []
        with pytest.raises(DbFull, match="store full"):
            for _ in range(50):
                uid = new_uid()
                client.create({"uid": uid, "app": "t2v"})
                created.append(uid)
        assert 1 <= len(created) < 50
        # Still serving: reads, stats, and a too-big artefact turns into a visible failure.
        assert client.get(created[0])["status"] == "queued"
        send(db.server.data_address, {"uid": created[0], "kind": "result"}, {"content": b"z" * 10_000})
        rec = wait_for(lambda: (r := client.get(created[0])) and r["status"] == "failed" and r, what="store-full failure")
        assert rec["error"].startswith("store full")
        stats = client.stats()[db.control]
        assert stats["refused"] >= 2 and stats["bytes"] <= stats["max_bytes"]
        assert client.delete(created[1]) is True and client.delete(created[2]) is True
        client.create({"uid": new_uid()})  # room again
    assert REGISTRY.get_sample_value("onepiece_db_refused_total", {"db": db.server.name}) >= 2


def test_read_failover_when_first_db_is_stopped(start_dbs) -> None:
    dbs = start_dbs(2)
    controls = [d.control for d in dbs]
    by_control = {d.control: d for d in dbs}
    uid = new_uid()
    first, second = (by_control[a] for a in order(uid, controls))
    with DbClient(controls, timeout=0.3) as client:
        assert client.create({"uid": uid, "app": "i2v"}) == first.control
        send(first.server.data_address, {"uid": uid, "kind": "result"}, {"content": b"frames"})
        wait_for(lambda: (r := get_from(second, uid)) and r["status"] == "completed", what="replica")
        first.shutdown()
        assert client.get(uid)["status"] == "completed"
        # The dead DB is now tried last: the next read does not wait for it.
        assert client._order(uid) == [second.control, first.control]
        rec, data = client.content(uid)
        assert data == b"frames"
        assert client.get(uid) is None  # gone from the live DB; the dead one did not answer


def test_malformed_data_and_rpc_are_dropped_with_a_log_line(start_dbs, caplog) -> None:
    caplog.set_level(logging.WARNING)
    (db,) = start_dbs(1)
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(db.server.data_address)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(db.control)
    try:
        push.send_multipart([b"garbage"])
        push.send_multipart([b"OP1", b"{not json"])
        send(db.server.data_address, {"uid": "u1", "kind": "weird"})
        send(db.server.data_address, {"uid": "u2", "kind": "result"})  # no content part
        send(db.server.data_address, {"uid": "u3", "kind": "status", "status": "in_progress", "progress": "x"})
        send(db.server.data_address, {"uid": "u4", "kind": "replica", "record": [1, 2]})
        # Stored, this one broke every later expiry sweep and so the DB's loop.
        send(db.server.data_address, {"uid": "u5", "kind": "replica",
                                      "record": {"uid": "u5", "status": "queued", "expires_at": "x"}})
        # A peer is trusted no further: one request per message, and no record that lives for ever.
        send(db.server.data_address, {"uid": "u6", "kind": "replica",
                                      "record": {"uid": "u7", "status": "completed"}})
        send(db.server.data_address, {"uid": "u8", "kind": "replica",
                                      "record": {"uid": "u8", "status": "queued", "expires_at": 1e300}})
        dealer.send_multipart([b"", b"not json"])
        dealer.send_multipart([b"", b"[1, 2]"])
        dealer.send_multipart([b"only-one-frame"])
        uid = new_uid()
        send(db.server.data_address, {"uid": uid, "kind": "status", "status": "in_progress", "stage": "t", "progress": 1})
        wait_for(lambda: get_from(db, uid) is not None, what="valid message after malformed ones")
        rpc = RpcClient(db.control, timeout=1.0, retries=0)
        try:
            with pytest.raises(RpcError, match="get.uid: Field required"):
                rpc.call("get")
            with pytest.raises(RpcError, match="get.uid: Input should be a valid string"):
                rpc.call("get", uid=[1])
            with pytest.raises(RpcError, match="unknown op"):
                rpc.call("explode")
            with pytest.raises(RpcError, match="not found: nope"):
                rpc.call("get", uid="nope")
            assert rpc.call("ping")[0]["name"] == db.server.name
        finally:
            rpc.close()
        assert not dealer.poll(100)  # malformed requests got no reply
        # Each socket is its own connection: wait until every bad message has been seen.
        wait_for(lambda: db.server.counts["malformed"] == 7 and db.server.receiver.rejected == 2
                 and "dropped malformed request" in caplog.text, what="all malformed input seen")
    finally:
        push.close()
        dealer.close()
    text = caplog.text
    assert "dropped malformed message" in text  # transport-level rejects
    for u in ("u1", "u2", "u3", "u4", "u5", "u6", "u8"):
        assert f"uid={u} dropped a malformed" in text  # one line naming the field and the sender
    assert "'status' message from 127.0.0.1: status.progress:" in text
    assert "expires_at" in text and "record.uid 'u7' is not the message's uid 'u6'" in text
    assert get_from(db, "u7") is None and get_from(db, "u8") is None
    # Three sweeps past the bad replica (each replaces the server's snapshot): still serving.
    seen = [db.server.snapshot]
    wait_for(lambda: (s := db.server.snapshot) is not seen[-1] and seen.append(s) is None and len(seen) > 3,
             timeout=5, what="three sweeps")
    assert get_from(db, uid) is not None
    assert "dropped malformed request" in text


CLOSED_CLIENT_CALL = """
import asyncio, tempfile
from onepiece.transport.rpc import AsyncRpcClient, RpcTimeout

async def main():
    client = AsyncRpcClient(f"ipc://{tempfile.mkdtemp()}/db-ctl.sock", timeout=0.2, retries=0)
    client.close()
    try:
        await client.call("get", uid="u1")
    except RpcTimeout as e:
        print("no answer:", e)
    await asyncio.sleep(0.1)  # a reader left on the closed socket runs now
    print("loop free")

asyncio.run(main())
"""


def test_a_call_on_a_closed_db_rpc_client_is_no_answer_and_leaves_the_loop_free() -> None:
    """The proxy's AsyncDbClient closes the RPC client of a DB whose call timed out while another
    request may be about to call it. That call is no answer (the DB client fails over), and no
    reader is left on the closed socket: its recv failed at once without yielding, so it spun
    forever, froze the proxy's event loop and wrote a warning per turn (3.4 GB in 4 minutes)."""
    try:
        run = subprocess.run([sys.executable, "-c", CLOSED_CLIENT_CALL], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        raise AssertionError("the event loop never got back from the closed client's reader") from None
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("no answer:") and run.stdout.splitlines()[-1] == "loop free"
    assert "malformed reply" not in run.stderr


@pytest.mark.exclusive  # (its calls' order rests on 0.3-0.4 s between their timeouts and the handler)
def test_a_timed_out_call_closes_its_own_rpc_client_not_the_one_that_replaced_it(tmp_path) -> None:
    """Two calls shared one DB's RPC client; the first timed out and replaced it; the second,
    timing out later, closed the replacement under a third call that was being answered."""
    import asyncio

    from onepiece.db.client import AsyncDbClient
    from onepiece.transport.rpc import RpcServer

    address = f"ipc://{tmp_path}/db-ctl.sock"  # nobody there at first: the first two calls time out

    def slow_stats(req, blobs):
        time.sleep(0.6)  # the third call is still waiting when the second one times out
        return {"stats": {"records": 7}}

    async def scenario() -> list:
        client = AsyncDbClient([address], timeout=1.0)
        try:
            first = asyncio.create_task(client.stats())  # t = 0: times out at 1.0
            await asyncio.sleep(0.3)
            second = asyncio.create_task(client.stats())  # same RPC client: times out at 1.3
            await first
            server = RpcServer(address, {"stats": slow_stats})
            stop = threading.Event()

            def serve() -> None:
                while not stop.is_set():
                    if server.sock.poll(50):
                        server.handle()
            serving = threading.Thread(target=serve, daemon=True)
            serving.start()
            try:
                third = await client.stats()  # a fresh RPC client, answered at about 1.7
                return [(await second)[address], third[address]]
            finally:
                stop.set()
                serving.join(5)
                server.close()
        finally:
            client.close()

    second, third = asyncio.run(scenario())
    assert "error" in second and third == {"records": 7}, (second, third)


def test_replication_to_a_dead_peer_is_dropped_and_counted(start_dbs) -> None:
    (db,) = start_dbs(1, mesh=False)
    db.server.set_peers([{"data": "tcp://127.0.0.1:1", "control": "tcp://127.0.0.1:2"}])  # nobody listens there
    with DbClient([db.control]) as client:
        t0 = time.monotonic()
        for _ in range(20):
            client.create({"uid": new_uid()})
        assert time.monotonic() - t0 < 3.0  # the loop never waits for the peer
    wait_for(lambda: db.server.counts["dropped"] >= 20, what="drops counted")
    assert db.server.counts["sent"] == 0
    assert REGISTRY.get_sample_value("onepiece_db_replication_dropped_total", {"db": db.server.name}) >= 20


def test_a_change_that_fell_short_reaches_the_peers_once_they_are_known(start_dbs) -> None:
    """A failure written while a DB knew no peers (as while a restarted NM hands out routes
    again) and a result a down peer did not take are owed, and sent again, as they stand now,
    once the peers are back: the copies reconcile."""
    a, b = start_dbs(2, mesh=False)
    failed, done = new_uid(), new_uid()
    send(a.server.data_address, {"uid": failed, "kind": "failed", "stage": "s", "error": "instance died"})
    wait_for(lambda: failed in a.server._owed, what="the failure owed")
    a.server.set_peers([{"data": "tcp://127.0.0.1:1", "control": "tcp://127.0.0.1:2"}])  # down
    send(a.server.data_address, {"uid": done, "kind": "result"}, {"content": b"video"})
    wait_for(lambda: done in a.server._owed, what="the result owed: its peer did not take it")
    assert get_from(b, failed) is None and get_from(b, done) is None
    a.server.set_peers([b.entry])  # the routes are back
    wait_for(lambda: (r := get_from(b, failed)) and r["status"] == "failed" and r["error"] == "instance died",
             what="the failure on the peer")
    wait_for(lambda: (r := get_from(b, done)) and r["status"] == "completed", what="the result on the peer")
    assert b.server.store.content(done) == b"video"
    wait_for(lambda: not a.server._owed, what="nothing owed")


def test_late_joining_peer_and_replicas_are_not_forwarded(start_dbs) -> None:
    a, b = start_dbs(2, mesh=False)
    a.server.set_peers([b.entry, a.entry, b.entry, {"data": "tcp://127.0.0.1:1"}, "tcp://127.0.0.1:3"])
    # itself, duplicates and entries without a data and a control address are ignored
    assert a.server.peers == [{"data": b.server.data_address, "control": b.control}]
    b.server.set_peers([a.entry])  # from another thread, while b serves
    replicated: list[Message] = []  # what b hands to replication, recorded on b's loop thread
    b_replicate = b.server._replicate
    b.server._replicate = lambda msg: (replicated.append(msg), b_replicate(msg))
    uid = new_uid()
    send(a.server.data_address, {"uid": uid, "kind": "status", "status": "in_progress", "stage": "s", "progress": 3})
    send(a.server.data_address, {"uid": uid, "kind": "failed", "stage": "s", "error": "x"})
    wait_for(lambda: (r := get_from(b, uid)) and r["status"] == "failed", what="replica from a")
    wait_for(lambda: a.server.counts["sent"] == 2, what="a's two sends counted")
    # Replicas are never forwarded: b applied both, and a forward would have been handed to
    # replication in the same loop turn as the apply, before b answered the read above.
    assert replicated == []
    assert a.server.counts["sent"] == 2


def test_async_client_with_failover(start_dbs) -> None:
    dbs = start_dbs(2)
    controls = [d.control for d in dbs]
    by_control = {d.control: d for d in dbs}

    async def scenario() -> None:
        client = AsyncDbClient(controls, timeout=0.3)
        try:
            uid = new_uid()
            first = await client.create({"uid": uid, "app": "t2v"})
            assert first == order(uid, controls)[0]
            assert (await client.get(uid))["status"] == "queued"
            assert await client.get(new_uid()) is None
            send(by_control[first].server.data_address, {"uid": uid, "kind": "result"}, {"content": b"v"})
            second = by_control[order(uid, controls)[1]]
            await await_for(lambda: (r := get_from(second, uid)) and r["status"] == "completed", timeout=3,
                            what="the result replicated to the second DB of the UID's order")
            by_control[first].shutdown()
            rec, data = await client.content(uid)
            assert data == b"v" and rec["status"] == "completed"
            assert await client.delete(uid) is False
            stats = await client.stats()
            assert "error" in stats[first] and stats[second.control]["records"] == 0
        finally:
            client.close()

    asyncio.run(scenario())


def test_serve_in_a_subprocess_stops_on_sigterm_and_leaves_no_ipc_files() -> None:
    tmp = tempfile.mkdtemp(prefix="opdb", dir="/tmp")
    addrs = [f"ipc://{tmp}/{n}.sock" for n in ("data", "control", "events")]
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO);"
        "from onepiece.db.server import serve;"
        f"serve(*{addrs!r}, ttl_s=60, max_bytes=1<<20, name='sub');"
        # what makes a process slow to start: a DB needs none of it
        "print('heavy:', [m for m in sys.modules if m.split('.')[0] in ('torch', 'diffusers', 'transformers')])"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        rpc = RpcClient(addrs[1], timeout=0.2, retries=0)
        try:
            def ping() -> bool:
                try:
                    return rpc.call("ping")[0]["name"] == "sub"
                except RpcError:
                    return False
            wait_for(ping, timeout=30, what="subprocess DB up")
            uid = new_uid()
            send(addrs[0], {"uid": uid, "kind": "result"}, {"content": b"ipc"})
            with DbClient([addrs[1]]) as client:
                wait_for(lambda: client.get(uid) is not None, what="ipc write")
        finally:
            rpc.close()
        assert all(os.path.exists(a[len("ipc://"):]) for a in addrs)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        out = proc.stdout.read().decode()
        assert "stopping" in out
        assert not any(os.path.exists(a[len("ipc://"):]) for a in addrs)
        assert "heavy: []" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)


@pytest.fixture
def nm():
    topo, wf, base = load_topology(deploy_dir() / "local.yaml")
    topo.nm.heartbeat_s = 0.1
    server = NodeManager(topo, wf, base, "tcp://127.0.0.1:0")
    stop = threading.Event()
    t = threading.Thread(target=server.run, args=(stop,), daemon=True)
    t.start()
    yield server
    stop.set()
    t.join(timeout=5)
    server.close()


def test_db_service_registers_metrics_and_heartbeats_a_snapshot(nm) -> None:
    code = (
        "import logging; logging.basicConfig(level=logging.INFO);"
        "from onepiece.db.service import serve;"
        f"serve({nm.address!r}, 'set0', 'tcp://127.0.0.1:0', 'tcp://127.0.0.1:0', 'tcp://127.0.0.1:0',"
        " 60.0, 1 << 20, True, name='set0-db7')"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    status = NmClient(nm.address, timeout=1.0, retries=0)
    try:
        def dbs() -> list[dict]:
            return status.status()["sets"]["set0"]["dbs"]

        (inst,) = wait_for(dbs, timeout=10, what="the DB registered")
        addresses = inst["addresses"]
        assert addresses["metrics"].startswith("http://127.0.0.1:")
        uid = new_uid()
        send(addresses["data"], {"uid": uid, "kind": "status", "status": "in_progress", "stage": "s", "progress": 1})
        (inst,) = wait_for(lambda: [i for i in dbs() if i["stats"].get("records") == 1], what="stats in a heartbeat")
        assert inst["stats"]["addresses"]["control"] == addresses["control"]
        with urllib.request.urlopen(addresses["metrics"], timeout=5) as resp:
            body = resp.read().decode()
        assert 'onepiece_db_records{db="set0-db7"} 1.0' in body  # its name: a set's DBs are told apart
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert dbs() == []  # deregistered on the way out
    finally:
        status.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out = proc.stdout.read().decode()
        proc.stdout.close()
    assert "stopping" in out, out


def test_db_does_not_import_torch() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, onepiece.db.server, onepiece.db.client;"
                          "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "False", out.stderr


def test_replication_peers_are_logged_when_they_change_not_at_every_route_update(start_dbs, caplog) -> None:
    (db,) = start_dbs(1, mesh=False)
    peer = {"data": "tcp://127.0.0.1:1", "control": "tcp://127.0.0.1:2"}
    with caplog.at_level(logging.INFO, logger="onepiece.db"):
        for _ in range(3):  # as every route update hands them over again
            db.server.set_peers([peer])
        db.server.set_peers([])
    assert caplog.text.count("replication peers") == 2, caplog.text
