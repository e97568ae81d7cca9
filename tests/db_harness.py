"""DB servers in tests: one serving on a thread (``Running``), and writing to a DB's data address
as a stage does: one sender per address, kept open for the test (``ZmqSender.close()`` uses
linger 0, which may discard a message that ``send`` queued but the I/O thread has not written
yet). A module that sends imports ``send`` and the autouse fixture ``close_senders``, which
closes them after each test."""

from __future__ import annotations

import threading
from typing import Any, Iterator

import pytest

from onepiece.db.server import DbServer
from onepiece.transport import registry
from onepiece.transport.message import Message

_senders: dict[str, Any] = {}


@pytest.fixture(autouse=True)
def close_senders() -> Iterator[None]:
    yield
    while _senders:
        _senders.popitem()[1].close()


def send(address: str, header: dict, parts: dict | None = None) -> None:
    sender = _senders.get(address)
    if sender is None:
        sender = _senders[address] = registry.connect(address)
    sender.send(Message(header, parts or {}), timeout=2.0)


class Running:
    """A DbServer serving on a thread."""

    def __init__(self, server: DbServer) -> None:
        self.server = server
        self.stop = threading.Event()
        self.thread = threading.Thread(target=server.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def shutdown(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        assert not self.thread.is_alive()
        self.server.close()

    @property
    def control(self) -> str:
        return self.server.control_address

    @property
    def entry(self) -> dict[str, str]:
        """This DB as the NM's route table lists it (what ``set_peers`` takes)."""
        return {"data": self.server.data_address, "control": self.server.control_address,
                "events": self.server.events_address}
