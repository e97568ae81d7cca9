"""Loops that sleep until there is something to do (transport/wake.py): an idle stage scheduler,
deliverer and DB replicator wait long, and what other threads tell them (a worker died, the
routes changed, stop) still reaches them at once. Each test stretches the loop's idle wait to a
minute, so only the wake-up can make it act within the test's bound."""

from __future__ import annotations

import queue
import threading
import time

import zmq

from onepiece.stage import deliver as deliver_module
from onepiece.stage import scheduler as scheduler_module
from onepiece.stage.deliver import ResultDeliver
from onepiece.stage.scheduler import RequestScheduler
from onepiece.transport import registry
from onepiece.transport.wake import Wake
from proxy_harness import WORKFLOW, DbThread
from waiting import wait_for


def test_a_wake_ends_a_poll_from_another_thread_and_is_cleared():
    wake = Wake()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PULL)
    sock.bind("inproc://wake-test")
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(wake.fd, zmq.POLLIN)
    try:
        threading.Timer(0.05, wake.set).start()
        events = dict(poller.poll(60_000))
        assert wake.fd in events and sock not in events
        wake.set()  # twice before the loop reads it: one wake-up, cleared by one read
        wake.clear()
        assert dict(poller.poll(0)) == {}
    finally:
        wake.close()
        wake.set()  # after close: nothing, no error
        sock.close(linger=0)


def test_an_idle_scheduler_hears_a_worker_death_and_stop_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(scheduler_module, "IDLE_TURN_MS", 60_000)
    receiver = registry.listen(f"ipc://{tmp_path}/data.sock")
    sched = RequestScheduler("text_encode", receiver, f"ipc://{tmp_path}/workers.sock", WORKFLOW, queue.Queue(8))
    sched.known.add(b"w0")
    stop = threading.Event()
    loop = threading.Thread(target=sched.run, args=(stop,), daemon=True)
    loop.start()
    try:
        # Whether the loop is already in its wait or not: its first poll waits a minute unless woken.
        sched.worker_died(b"w0", "killed by signal 9", time.monotonic())
        wait_for(lambda: b"w0" not in sched.known, timeout=10, what="the scheduler to drop the dead worker")
        stop.set()
        sched.wake.set()
        loop.join(10)
        assert not loop.is_alive()
    finally:
        stop.set()
        sched.wake.set()
        loop.join(10)
        sched.close()
        receiver.close()


def test_an_idle_deliverer_stops_when_woken(monkeypatch):
    monkeypatch.setattr(deliver_module, "IDLE_WAIT_S", 60.0)
    deliver = ResultDeliver("text_encode", WORKFLOW, queue.Queue(8), routes=lambda: {})
    stop = threading.Event()
    loop = threading.Thread(target=deliver.run, args=(stop,), daemon=True)
    loop.start()
    try:
        deliver.wake()  # an item it takes: then it is back in its wait (or on its way there)
        wait_for(deliver.mailbox.empty, timeout=10, what="the deliverer to take the item")
        stop.set()
        deliver.wake()
        loop.join(10)
        assert not loop.is_alive()
    finally:
        deliver.close()


def test_a_closing_db_wakes_its_idle_replicator(monkeypatch):
    from onepiece.db import server as db_server

    monkeypatch.setattr(db_server, "REPL_WAIT_S", 60.0)
    db = DbThread()
    replicator = wait_for(lambda: db.server._replicator, timeout=10, what="the replicator thread")
    db.server._outq.put(None)  # an item it takes: then it is back in its wait (or on its way there)
    wait_for(db.server._outq.empty, timeout=10, what="the replicator to take the item")
    db.close()
    assert not replicator.is_alive()
