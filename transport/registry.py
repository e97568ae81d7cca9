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


ZMQ_SCHEMES = ("tcp", "ipc")  # what RPC, events and a node manager use: always ZeroMQ


def checked(address: str, schemes: tuple[str, ...] | None = None) -> str:
    """``address`` if it can be bound or reached: a scheme this process has a transport for (or
    one of ``schemes``) and, where it names a host, a port from 0 to 65535 (0: any free one);
    else ValueError saying what is wrong. (ZeroMQ binds tcp://host:99999 at port 34463.)"""
    scheme = scheme_of(address)
    _load_builtin()
    known = tuple(schemes or sorted(_receivers))
    if scheme not in known:
        raise ValueError(f"address {address!r}: scheme {scheme!r} is not one of {', '.join(known)}")
    parts = _split_host(address)
    if scheme in ("tcp", "ring+tcp"):
        port = parts[2].split("?")[0] if parts else ""
        if not (port == "*" or port.isdigit() and int(port) <= 65535):
            raise ValueError(f"address {address!r}: expected {scheme}://host:port with a port from 0 to 65535")
    return address


def _split_host(address: str) -> tuple[str, str, str] | None:
    """(scheme, host, port) of a host:port address (tcp://, http://...), else None (ipc://...)."""
    scheme, _, rest = address.partition("://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or "/" in port:
        return None
    return scheme, host, port


def host_of(address: str, default: str = "127.0.0.1") -> str:
    """The host an address binds to (``default`` for addresses without one, like ipc://)."""
    parts = _split_host(address)
    return parts[1] if parts else default


def with_host(address: str, host: str | None) -> str:
    """``address`` as peers should reach it: its host replaced by ``host`` (an instance bound to
    0.0.0.0 inside a container advertises its service name). ipc:// addresses stay as they are."""
    parts = _split_host(address)
    if host is None or parts is None:
        return address
    return f"{parts[0]}://{host}:{parts[2]}"


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
    # rdma imports pyverbs only when used, so it registers here even where pyverbs is missing.
    from onepiece.transport.ring import agent, rdma, shm  # noqa: F401
