"""The process's ZeroMQ context at exit.

libzmq writes what a socket was handed in its own I/O thread, after ``send`` returned, and a
closed socket keeps its messages for its linger. A process that exits without ending the
context cuts that short: it lost what was not written yet (a stage's last failure reports, a
result), and it could abort on the way out (SIGABRT, "Bad address (src/tcp.cpp)"), the I/O
thread still sending zero-copy frames whose memory the interpreter was freeing. Measured: a
process that sent 20 messages of 4 MB over ipc and exited delivered 7-10 of them and aborted,
every time; ending the context first, all 20 and exit code 0 (tests/test_exit_flush.py).
"""

from __future__ import annotations

import sys
import threading

EXIT_FLUSH_S = 2.0  # a closed socket's own linger bounds each (a sender's: 1 s)


def flush_before_exit(timeout_s: float = EXIT_FLUSH_S) -> bool:
    """End the process's ZeroMQ context, waiting at most ``timeout_s`` for what its closed
    sockets still hold to leave. False when a socket left open kept it from ending in time (the
    process may exit anyway: what that socket held is lost). Nothing to do where no ZeroMQ was
    used."""
    zmq = sys.modules.get("zmq")
    if zmq is None:
        return True
    from onepiece.transport import curve  # (here: it imports zmq, which a process may never have)

    def end() -> None:
        curve.stop_handler()  # (its sockets too: a process with CURVE keys runs one)
        zmq.Context.instance().term()

    ender = threading.Thread(target=end, name="zmq-term", daemon=True)
    ender.start()
    ender.join(timeout_s)
    return not ender.is_alive()
