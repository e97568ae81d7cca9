"""ZeroMQ backend for ``tcp://`` and ``ipc://``: PUSH senders into one PULL receiver.

Sends are bounded: IMMEDIATE makes a send fail when no receiver is connected rather than
queue for a peer that may never come, a small high-water mark bounds what is queued, and a
poll with a timeout turns "full" into an error instead of a block. Parts go out zero-copy.
"""

from __future__ import annotations

import logging
import time

import zmq

from onepiece.droplog import log_dropped
from onepiece.transport import curve, message, registry
from onepiece.transport.base import Full, Receiver, Sender
from onepiece.transport.handshake import HandshakeWatch
from onepiece.transport.message import Message, MessageError, decode, encode

log = logging.getLogger(__name__)

SNDHWM = 16
RCVHWM = 64
CLOSE_LINGER_MS = 1000  # (at 200 ms, of 5 messages of 64 MB sent just before the process ended, 1-2 arrived)


def peer_of(frame: zmq.Frame) -> str:
    """The address a received frame came from (an IP for tcp, the process for ipc), to name
    the sender of a message that is dropped; "?" when the transport does not say."""
    try:
        return frame.get("Peer-Address") or "?"
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return "?"


def bind_address(address: str) -> str:
    """``tcp://host:0`` means any free port, which zmq spells ``*``."""
    if address.startswith("tcp://") and address.endswith(":0"):
        return address[:-2] + ":*"
    return address


class ZmqSender(Sender):
    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = zmq.Context.instance().socket(zmq.PUSH)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
        self.sock.setsockopt(zmq.LINGER, 0)
        self._watch = HandshakeWatch(self.sock)  # before the connect: a handshake can fail at once
        curve.client(self.sock).connect(address)

    def send(self, msg: Message, timeout: float = 5.0) -> None:
        frames = encode(msg)
        # With IMMEDIATE, "not writable" means full or nobody connected; both are failures.
        if self.sock.poll(int(timeout * 1000), zmq.POLLOUT):
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
        why = self._watch.reason()
        raise Full(f"receiver at {self.address} took nothing within {timeout:.1f}s ({why or 'full or not running'})")

    def close(self) -> None:
        self._watch.close()
        # A bounded linger: what send() reported as handed over still leaves the socket (a
        # process on its way out waits for it: transport/context.py).
        self.sock.close(linger=CLOSE_LINGER_MS)


class ZmqReceiver(Receiver):
    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM)
        self.sock.setsockopt(zmq.MAXMSGSIZE, message.MAX_PART_BYTES)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve.server(self.sock).bind(bind_address(address))
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.rejected = 0

    def recv(self, timeout: float) -> Message | None:
        # A dropped message does not end the wait: the caller asked for one good message in `timeout`.
        deadline = time.monotonic() + timeout
        while self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
            frames = self.sock.recv_multipart(copy=False)
            try:
                msg = decode(frames)
                msg.sender, msg.caller = peer_of(frames[0]), curve.caller(frames[0])
                return msg
            except MessageError as e:
                reason = str(e)
            except Exception as e:  # a decoder gap must not take the receiver down
                reason = f"undecodable ({type(e).__name__}: {e})"
            self.rejected += 1
            log_dropped(log, self.address, reason, "dropped malformed message on %s from %s: %s", self.address,
                        peer_of(frames[0]), reason)
        return None

    def close(self) -> None:
        self.sock.close(linger=0)


for _scheme in ("tcp", "ipc", "inproc"):
    registry.register(_scheme, ZmqSender, ZmqReceiver)
