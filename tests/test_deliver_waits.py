"""A finished request whose next stage has no live instance (one was killed and restarts, or
moved) waits for one in the deliverer, bounded by ``ROUTE_WAIT_S`` and its own deadline, and is
held in the instance's heartbeat meanwhile; what never finds one fails with the reason. Real
sockets: a DB server and the next stage's receiver; the route table is the test's."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from onepiece.nm.holdings import Holdings
from onepiece.stage import deliver as deliver_mod
from onepiece.stage.deliver import ResultDeliver
from onepiece.stage.scheduler import RequestScheduler
from onepiece.transport import registry
from onepiece.transport.message import Message, new_uid
from onepiece.transport.rpc import RpcClient, RpcError
from proxy_harness import WORKFLOW, DbThread
from waiting import wait_for


@pytest.fixture
def running():
    """A deliverer of text_encode on its thread, with a DB and a route table without denoise_t2v."""
    db = DbThread()
    routes = {"version": 1, "stages": {}, "dbs": [db.addresses]}
    holdings, mailbox, stop = Holdings(), queue.Queue(), threading.Event()
    d = ResultDeliver("text_encode", WORKFLOW, mailbox, routes=lambda: routes,
                      holding=(holdings.add, holdings.discard))
    thread = threading.Thread(target=d.run, args=(stop,), daemon=True)
    thread.start()
    rpc = RpcClient(db.server.control_address, timeout=1.0, retries=0)

    def record(uid: str) -> dict | None:
        try:
            return rpc.call("get", uid=uid)[0]["record"]
        except RpcError:  # not there yet
            return None

    def send(deadline_s: float = 60.0) -> str:
        uid = new_uid()
        rpc.call("create", record={"uid": uid, "created_at": time.time()})
        mailbox.put(("result", Message({"uid": uid, "app": "t2v", "stage": "text_encode",
                                        "deadline": time.time_ns() + int(deadline_s * 1e9)}, {})))
        return uid

    def finish() -> None:
        stop.set()
        d.wake()
        thread.join(10)

    yield routes, holdings, d, send, record, finish
    finish()
    d.close()
    rpc.close()
    db.close()


def test_a_request_waits_for_its_next_stage_to_come_back_and_goes_on(running):
    routes, holdings, d, send, record, _ = running
    uid = send()
    wait_for(lambda: d.waiting == 1, 5, "the request waiting for a route")
    assert holdings.snapshot() == [uid]  # still this instance's: the NM fails it if this one dies
    receiver = registry.listen("tcp://127.0.0.1:0")
    try:
        routes["stages"]["denoise_t2v"] = [receiver.address]  # the restarted instance registered
        msg = wait_for(lambda: receiver.recv(0.1), 5, "the request at the next stage")
        assert msg.uid == uid and msg.header["stage"] == "denoise_t2v"
        wait_for(lambda: holdings.snapshot() == [], 5, "it let go once its delivery was recorded")
        assert d.waiting == 0
        assert record(uid)["status"] != "failed"
    finally:
        receiver.close()


def test_a_request_that_finds_no_next_stage_in_time_fails_with_the_reason(running, monkeypatch):
    routes, holdings, d, send, record, finish = running
    monkeypatch.setattr(deliver_mod, "ROUTE_WAIT_S", 0.5)
    bounded = send()  # by the deliverer's bound
    due = send(deadline_s=0.3)  # by its own deadline, which comes first
    rec = wait_for(lambda: (r := record(bounded)) and r["status"] == "failed" and r, 5, "it failed")
    assert "no live instance of stage denoise_t2v within" in rec["error"], rec
    assert "no live instance of stage denoise_t2v within" in record(due)["error"]
    passed = send(deadline_s=-1.0)  # already past its deadline: no wait at all
    assert "its deadline passed" in wait_for(lambda: (r := record(passed)) and r["error"], 5, "it failed")
    monkeypatch.setattr(deliver_mod, "ROUTE_WAIT_S", 60.0)
    left = send()
    wait_for(lambda: d.waiting == 1, 5, "the request waiting for a route")
    finish()  # the instance shuts down: what waits fails, nothing is left held
    rec = wait_for(lambda: (r := record(left)) and r["status"] == "failed" and r, 5, "it failed")
    assert "shut down while the request waited for an instance of stage denoise_t2v" in rec["error"], rec
    assert d.waiting == 0 and holdings.snapshot() == []


def test_a_request_cancelled_while_it_waits_for_a_route_is_dropped_there(tmp_path):
    """A DELETE of a request that already left the stage's scheduler and waits in its deliverer
    for an instance of its next stage: it is held no more and never handed on (before, it stayed
    held in the heartbeat, and was sent on once the next stage came back, or failed after 30 s).
    The deliverer asks the scheduler, which heard the DBs' cancel event, as a stage wires them."""
    db = DbThread()
    routes = {"version": 1, "stages": {}, "dbs": [db.addresses]}
    holdings, mailbox, stop = Holdings(), queue.Queue(), threading.Event()
    inbox = registry.listen("tcp://127.0.0.1:0")
    sched = RequestScheduler("text_encode", inbox, f"ipc://{tmp_path}/workers.sock", WORKFLOW, mailbox)
    d = ResultDeliver("text_encode", WORKFLOW, mailbox, routes=lambda: routes,
                      holding=(holdings.add, holdings.discard), cancelled=sched.is_cancelled)
    thread = threading.Thread(target=d.run, args=(stop,), daemon=True)
    thread.start()
    receiver = registry.listen("tcp://127.0.0.1:0")
    rpc = RpcClient(db.server.control_address, timeout=1.0, retries=0)
    try:
        uids = [new_uid(), new_uid()]
        for uid in uids:
            rpc.call("create", record={"uid": uid, "created_at": time.time()})
            mailbox.put(("result", Message({"uid": uid, "app": "t2v", "stage": "text_encode",
                                            "deadline": time.time_ns() + int(60e9)}, {})))
        wait_for(lambda: d.waiting == 2, 5, "both waiting for a route")
        cancelled, kept = uids
        sched.cancel(cancelled)  # the DBs' cancel event, as the scheduler's loop hands it on
        wait_for(lambda: d.waiting == 1, 5, "the cancelled one dropped")
        assert holdings.snapshot() == [kept]
        routes["stages"]["denoise_t2v"], routes["version"] = [receiver.address], 2  # the next stage is back
        assert wait_for(lambda: receiver.recv(0.1), 5, "the other at the next stage").uid == kept
        wait_for(lambda: holdings.snapshot() == [], 5, "it let go once its delivery was recorded")
        assert receiver.recv(0) is None and d.waiting == 0
        assert rpc.call("get", uid=cancelled)[0]["record"]["status"] != "failed"  # dropped, not failed
    finally:
        stop.set()
        d.wake()
        thread.join(10)
        d.close()
        sched.close(None)
        receiver.close()
        inbox.close()
        rpc.close()
        db.close()


def test_the_requests_waiting_for_a_route_are_bounded(running, monkeypatch):
    routes, holdings, d, send, record, _ = running
    monkeypatch.setattr(deliver_mod, "MAX_PARKED", 2)
    first = [send(), send()]
    wait_for(lambda: d.waiting == 2, 5, "two waiting")
    third = send()
    rec = wait_for(lambda: (r := record(third)) and r["status"] == "failed" and r, 5, "the third failed")
    assert "2 requests already wait for one" in rec["error"]
    assert d.waiting == 2 and sorted(holdings.snapshot()) == sorted(first)


def test_a_route_that_cannot_be_reached_fails_the_send_not_the_deliverer(running, monkeypatch):
    """An address with a scheme no transport has (the NM refuses one without any), or an instance
    that just died: the send fails over to the next instance; when every route failed, the
    request waits for a route it has not tried (a restart over ring+tcp listens on a new port),
    and fails with the reason only if none comes in time."""
    routes, holdings, d, send, record, _ = running
    receiver = registry.listen("tcp://127.0.0.1:0")
    try:
        routes["stages"]["denoise_t2v"] = ["nope://somewhere", receiver.address]
        routes["version"] = 2
        uids = [send(), send()]  # round-robin: one of them is tried at the bad one first
        got = {wait_for(lambda: receiver.recv(0.1), 5, "a request at the next stage").uid for _ in uids}
        assert got == set(uids)
        routes["stages"]["denoise_t2v"], routes["version"] = ["nope://somewhere"], 3
        waits = send()
        wait_for(lambda: d.waiting == 1, 5, "the request waiting for a route it has not tried")
        assert holdings.snapshot() == [waits]
        routes["stages"]["denoise_t2v"], routes["version"] = ["nope://somewhere", receiver.address], 4  # restarted
        assert wait_for(lambda: receiver.recv(0.1), 5, "it went on to the new route").uid == waits
        monkeypatch.setattr(deliver_mod, "ROUTE_WAIT_S", 0.5)
        routes["stages"]["denoise_t2v"], routes["version"] = ["nope://somewhere"], 5
        alone = send()
        rec = wait_for(lambda: (r := record(alone)) and r["status"] == "failed" and r, 5, "it failed")
        assert "no live instance of stage denoise_t2v within" in rec["error"], rec
        assert holdings.snapshot() == []
    finally:
        receiver.close()


def test_only_a_uid_the_stage_takes_is_held():
    """A message whose uid no DB takes is dropped by the stage: held, it would stay for good."""
    from onepiece.nm.holdings import TrackingReceiver

    holdings = Holdings()
    receiver = TrackingReceiver(registry.listen("tcp://127.0.0.1:0"), holdings)
    sender = registry.connect(receiver.address)
    try:
        good = new_uid()
        for uid in ("x" * 129, "bad\nuid", good):
            sender.send(Message({"uid": uid, "kind": "task"}), timeout=5)
        for _ in range(3):
            assert wait_for(lambda: receiver.recv(0.1), 5, "a message") is not None
        assert holdings.snapshot() == [good]
    finally:
        sender.close()
        receiver.close()


def test_a_request_is_held_until_its_delivery_is_recorded(tmp_path):
    """The heartbeat names what an instance holds, then what it delivered where: a request on
    its way out must be in one or the other at every moment, or an instance that died during a
    send (which waits up to its timeout for a receiver) left nothing for the NM to reap. It was
    released as the deliverer took it from the mailbox: a loaded run showed it held by nobody
    for the whole 5 s send to a next stage that had just been killed. Now it is released after
    its delivery is recorded, or once it failed; while a send waits, and while it waits for a
    route, it is held."""
    db = DbThread()
    dead_address = f"ipc://{tmp_path}/nobody.sock"  # nobody listens there: a send waits for its timeout
    live = registry.listen("tcp://127.0.0.1:0")
    routes = {"version": 1, "stages": {"denoise_t2v": [dead_address]}, "dbs": [db.addresses]}
    holdings, mailbox, stop = Holdings(), queue.Queue(), threading.Event()
    events: list[tuple[str, str]] = []

    def delivered(address: str, uid: str) -> None:
        events.append(("delivered", uid))
        holdings.deliveries.add(address, uid)

    def released(uid: str) -> None:
        events.append(("released", uid))
        holdings.discard(uid)

    d = ResultDeliver("text_encode", WORKFLOW, mailbox, routes=lambda: routes, send_timeout=1.0,
                      on_sent=delivered, holding=(holdings.add, released))
    thread = threading.Thread(target=d.run, args=(stop,), daemon=True)
    thread.start()
    try:
        def result(uid: str) -> tuple:
            holdings.add(uid)  # as the instance's receiver took it
            return ("result", Message({"uid": uid, "app": "t2v", "stage": "text_encode",
                                       "deadline": time.time_ns() + int(60e9)}, {}))

        first = new_uid()
        mailbox.put(result(first))
        wait_for(lambda: mailbox.empty(), 5, "the deliverer took it")
        time.sleep(0.3)  # inside the 1 s send to nobody
        assert holdings.snapshot() == [first] and events == []
        wait_for(lambda: d.waiting == 1, 5, "it waits for a route")
        assert holdings.snapshot() == [first] and events == []
        routes["stages"]["denoise_t2v"], routes["version"] = [dead_address, live.address], 2
        assert wait_for(lambda: live.recv(0.1), 5, "it went on").uid == first
        wait_for(lambda: events == [("delivered", first), ("released", first)], 5, "delivered, then released")
        routes["stages"]["denoise_t2v"], routes["version"] = [live.address], 3
        second = new_uid()
        mailbox.put(result(second))
        assert wait_for(lambda: live.recv(0.1), 5, "the next one went straight on").uid == second
        wait_for(lambda: events[2:] == [("delivered", second), ("released", second)], 5, "delivered, then released")
        assert holdings.snapshot() == [] and set(holdings.deliveries.report(60.0)[live.address][i][0]
                                                 for i in range(2)) == {first, second}
    finally:
        stop.set()
        d.wake()
        thread.join(10)
        d.close()
        live.close()
        db.close()


def test_a_stray_in_the_idle_pool_waits_for_a_route_held_and_goes_on_or_fails_at_shutdown():
    """An instance in the idle pool forwards what still reaches it (sent on old routes) without
    the deliverer's loop: a stray whose stage had no instance waited in it for good, held by
    nobody (its uid was let go at once) and never retried. Now it is held while it waits, goes on
    once a route comes (the instance's loop retries), and fails with the reason at shutdown."""
    db = DbThread()
    rpc = RpcClient(db.server.control_address, timeout=1.0, retries=0)
    decode = registry.listen("tcp://127.0.0.1:0")
    routes = {"version": 1, "stages": {}, "dbs": [db.addresses]}
    holdings = Holdings()
    pool = ResultDeliver("", WORKFLOW, None, routes=lambda: routes,  # type: ignore[arg-type]
                         on_sent=holdings.deliveries.add, holding=(holdings.add, holdings.discard))
    try:
        def stray() -> str:
            uid = new_uid()
            rpc.call("create", record={"uid": uid, "created_at": time.time()})
            holdings.add(uid)  # as the instance's receiver took it
            pool.hand_on(Message({"uid": uid, "app": "t2v", "stage": "vae_decode",
                                  "deadline": time.time_ns() + int(60e9)}, {}))
            return uid

        first = stray()
        assert pool.waiting == 1 and holdings.snapshot() == [first]
        pool.retry_waiting()  # no route yet: it waits on
        assert pool.waiting == 1 and holdings.snapshot() == [first]
        routes["stages"]["vae_decode"], routes["version"] = [decode.address], 2
        pool.retry_waiting()
        assert wait_for(lambda: decode.recv(0.1), 5, "the stray at vae_decode").uid == first
        assert pool.waiting == 0 and holdings.snapshot() == [] and decode.address in holdings.deliveries.report(60.0)
        routes["stages"], routes["version"] = {}, 3
        second = stray()
        pool.give_up_waiting()
        rec = wait_for(lambda: rpc.call("get", uid=second)[0]["record"].get("status") == "failed"
                       and rpc.call("get", uid=second)[0]["record"], 5, "the stray failed")
        assert "idle pool instance shut down while the request waited for an instance of stage vae_decode" \
            in rec["error"], rec
        assert pool.waiting == 0 and holdings.snapshot() == []
    finally:
        pool.close()
        decode.close()
        rpc.close()
        db.close()
