"""Why a ZeroMQ client got no answer, when the cause is the handshake.

libzmq drops a peer whose handshake fails (a CURVE server and a client without keys, or with
another deployment's) without a word to either application: the client sees silence, and its
user "no answer" from a server that is running. The socket's monitor does report it, so a client
that got no answer asks its monitor why (``HandshakeWatch.reason``).
"""

from __future__ import annotations

import itertools

import zmq
from zmq.utils.monitor import recv_monitor_message

from onepiece.transport import curve

FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
MAX_EVENTS = 64  # read per question: a peer that keeps failing must not keep the caller reading
# Each watch's own inproc address: pyzmq's default names it by the socket's file descriptor, which
# a socket made right after another one closed may get again before libzmq has released the name.
_names = itertools.count()


class HandshakeWatch:
    """The handshake failures of one client socket (only those: nothing else is reported), a
    blocking socket or an asyncio one alike (its monitor is read without waiting either way)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        addr = f"inproc://onepiece-handshake-{next(_names)}"
        sock.monitor(addr, FAILED)
        # A blocking view of the socket's own context (an inproc name lives in one context), so
        # that an asyncio socket's monitor is read here as a blocking one's is.
        self.monitor = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        self.monitor.connect(addr)
        self.failed: int | None = None  # the last failure's event

    def reason(self) -> str | None:
        """Why handshakes with the server failed since the socket was made; None if none did."""
        for _ in range(0 if self.monitor.closed else MAX_EVENTS):
            if not self.monitor.poll(0):
                break
            self.failed = recv_monitor_message(self.monitor)["event"]
        if self.failed is None:
            return None
        if curve.active() is None:
            return (f"the server refused the ZeroMQ handshake: it asks for CURVE and this process has no keys "
                    f"(set {curve.ENV} to the deployment's key folder)")
        if self.failed == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return f"the server refused this process's CURVE key ({curve.active().folder}): not a member's"
        return (f"the ZeroMQ handshake failed: this process's CURVE keys ({curve.active().folder}) are not the "
                f"deployment's, or the server runs without CURVE")

    def close(self) -> None:
        """Stop watching (before the socket closes; again: nothing)."""
        if self.monitor.closed:
            return
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
