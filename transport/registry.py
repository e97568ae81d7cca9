"""Transport backends chosen by the address scheme, as in dask/distributed's comm registry."""

from __future__ import annotations

from typing import Callable

from onepiece.transport.base import Receiver, Sender

_senders: dict[str, Callable[[str], Sender]] = {}
_receivers: dict[str, Callable[[str], Receiver]] = {}


def register(scheme: str, sender: Callable[[str], Sender], receiver: Callable[[str], Receiver]) -> None:
    _senders[scheme] = sender
    _receivers[scheme] = receiver


def scheme_of(address: str) -> str:
    scheme, sep, rest = address.partition("://")
    if not sep or not rest:
        raise ValueError(f"address {address!r} has no scheme (expected e.g. tcp://host:port)")
    return scheme


def _backend(table: dict, address: str):
    _load_builtin()
    scheme = scheme_of(address)
    try:
        return table[scheme]
    except KeyError:
        raise ValueError(f"no transport for scheme {scheme!r} (known: {sorted(table)})") from None


def connect(address: str) -> Sender:
    """A sender to the receiver listening at ``address``."""
    return _backend(_senders, address)(address)


def listen(address: str) -> Receiver:
    """A receiver bound at ``address``; its ``address`` attribute holds the bound address."""
    return _backend(_receivers, address)(address)


def _load_builtin() -> None:
    # Importing a backend module registers its schemes.
    from onepiece.transport import zmq_transport  # noqa: F401
