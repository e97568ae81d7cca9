"""A process that sends and then exits delivers what it sent (transport/context.py): every
role's exit (``onepiece.cli.main``) ends the ZeroMQ context first. Real processes and sockets."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from onepiece.cli import main
from onepiece.transport import registry
from onepiece.transport.message import Message

SEND_AND_EXIT = r'''
import sys
import numpy as np
from onepiece.transport import registry
from onepiece.transport.context import flush_before_exit
from onepiece.transport.message import Message

sender = registry.connect(sys.argv[1])
payload = np.full(4 << 20, 7, np.uint8)
for i in range(20):
    sender.send(Message({"uid": f"m{i}"}, {"p": payload}), timeout=30)
sender.close()
print("flushed" if flush_before_exit() else "left open", flush=True)
'''


def test_what_a_process_sent_before_it_exits_arrives(tmp_path):
    """20 messages of 4 MB, the sender closed, the process gone at once: without ending the
    context it delivered 7-10 of them and died of SIGABRT (libzmq's I/O thread still sending
    frames the exiting interpreter freed), every time it was tried."""
    rx = registry.listen(f"ipc://{tmp_path}/rx.sock")
    try:
        child = subprocess.run([sys.executable, "-c", SEND_AND_EXIT, rx.address], capture_output=True, text=True,
                               timeout=120)
        got = []
        while (msg := rx.recv(2.0)) is not None:
            part = msg.parts["p"]
            assert part.nbytes == 4 << 20 and part[0] == part[-1] == 7
            got.append(msg.uid)
        assert child.returncode == 0, child.stderr[-2000:]
        assert child.stdout.strip() == "flushed"
        assert got == [f"m{i}" for i in range(20)]
    finally:
        rx.close()


LEFT_OPEN = r'''
import time
import zmq
from onepiece.transport.context import flush_before_exit

sock = zmq.Context.instance().socket(zmq.PUSH)
sock.setsockopt(zmq.LINGER, -1)  # would wait forever for a peer
sock.connect("tcp://127.0.0.1:1")  # nobody there
sock.send(b"never delivered")
t0 = time.monotonic()
done = flush_before_exit(0.5)
print(done, round(time.monotonic() - t0, 1), flush=True)
'''


def test_a_socket_left_open_does_not_hold_the_exit():
    t0 = time.monotonic()
    child = subprocess.run([sys.executable, "-c", LEFT_OPEN], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr[-2000:]
    done, waited = child.stdout.split()
    assert done == "False" and 0.5 <= float(waited) < 5  # it waited its bound, then the process ended
    assert time.monotonic() - t0 < 30


def test_a_command_run_in_process_leaves_the_callers_context_alone(tmp_path):
    """Only the program's own entry ends the context: a caller of ``main`` in process (a test, a
    script) keeps its sockets (ended, every socket of the process failed with "Context was
    terminated")."""
    rx = registry.listen(f"ipc://{tmp_path}/rx.sock")
    tx = registry.connect(rx.address)
    try:
        with pytest.raises(SystemExit):
            main(["status", "--nm", "tcp://127.0.0.1:1"])  # nobody there: exit code 1
        tx.send(Message({"uid": "after"}, {}), timeout=5)
        assert rx.recv(5).uid == "after"
    finally:
        tx.close()
        rx.close()


WITH_CURVE = r'''
import logging
import sys
from onepiece.transport import curve, registry
from onepiece.transport.context import flush_before_exit

logging.basicConfig()
curve.use(curve.load(sys.argv[1]))  # starts the ZAP handler, a thread with sockets of its own
rx = registry.listen("tcp://127.0.0.1:0")
rx.close()
print(flush_before_exit(), flush=True)
'''


def test_a_process_with_curve_keys_ends_its_context_cleanly(tmp_path):
    """The CURVE handler's sockets close first: left open, the context could not end, and the
    handler's asyncio loop logged a traceback as it did (an NM's log, in test_netns)."""
    from onepiece.transport import curve

    folder = curve.make(tmp_path / "curve")
    child = subprocess.run([sys.executable, "-c", WITH_CURVE, str(folder)], capture_output=True, text=True,
                           timeout=60)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip() == "True" and "Traceback" not in child.stderr, child.stderr[-2000:]
