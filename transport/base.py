"""The one small interface every data transport offers (DESIGN §4).

A sender either hands a message over or raises within a bounded time; a receiver returns the
next valid message or None when its wait runs out. Neither ever blocks forever. Neither is
thread-safe (a ZMQ socket belongs to one thread): share one behind a lock, or keep one per thread.
"""

from __future__ import annotations

import abc

from onepiece.transport.message import Message


class TransportError(RuntimeError):
    """A send that could not hand the message over."""


class Full(TransportError):
    """The receiver has no room, or is not there, within the send timeout."""


class Sender(abc.ABC):
    address: str

    @abc.abstractmethod
    def send(self, msg: Message, timeout: float = 5.0) -> None:
        """Hand ``msg`` over or raise TransportError within ``timeout`` seconds."""

    @abc.abstractmethod
    def close(self) -> None: ...


class Receiver(abc.ABC):
    address: str

    @abc.abstractmethod
    def recv(self, timeout: float) -> Message | None:
        """The next valid message, or None after ``timeout`` seconds. Invalid ones are dropped
        with a log line and counted in ``rejected``."""

    @abc.abstractmethod
    def close(self) -> None: ...

    rejected: int = 0
    # A zmq socket (or fd) that turns readable when ``recv`` may have something, so a caller can
    # multiplex it with other sockets in one poller; None means "call recv with a timeout".
    sock: object = None
