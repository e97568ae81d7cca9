"""Writing to a DB's data address in tests, as a stage does: one sender per address, kept open
for the test (``ZmqSender.close()`` uses linger 0, which may discard a message that ``send``
queued but the I/O thread has not written yet). A module that sends imports ``send`` and the
autouse fixture ``close_senders``, which closes them after each test."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

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
