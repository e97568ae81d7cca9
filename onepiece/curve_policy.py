"""Whether a process secures its ZeroMQ sockets with CURVE: the topology's (or the flag's)
``auth`` and the addresses it binds and connects to, decided without touching a socket.

- ``curve``: always (keys required).
- ``auto`` (the default): on when any address reaches beyond this host (a tcp or ring+tcp host
  that is not loopback, e.g. 0.0.0.0 or a service name), or when keys were given anyway; off
  for a deployment on loopback and ipc only.
- ``off``: only for loopback and ipc; refused with an address beyond this host, since then
  anyone who reaches its ports could register, send data, read results and issue NM commands.

ipc counts as this host's: its socket files live in a folder of mode 0700 (`onepiece up`'s
runtime folder, a stage's worker folder), and connecting needs write permission on the file,
which the default umask gives its owner alone.
"""

from __future__ import annotations

from typing import Iterable, Literal

from onepiece.proxy.keys import beyond_loopback
from onepiece.transport.registry import host_of, scheme_of

Mode = Literal["auto", "curve", "off"]
MODES: tuple[Mode, ...] = ("auto", "curve", "off")
_HOST_SCHEMES = ("tcp", "ring+tcp")


class AuthPolicyError(ValueError):
    """An ``auth`` setting that would leave sockets reachable from other hosts open to anyone."""


def beyond_host(address: str) -> bool:
    """Whether binding or reaching ``address`` involves another host (``*`` is every interface)."""
    if scheme_of(address) not in _HOST_SCHEMES:
        return False  # ipc://, inproc://, shm://: this host's
    host = host_of(address, default="*")  # a tcp address without a port names no host: assume any
    return host == "*" or beyond_loopback(host)


def curve_on(mode: str, addresses: Iterable[str], keys_given: bool) -> bool:
    """True when sockets must use CURVE; AuthPolicyError for a mode that is unknown or ``off``
    with an address beyond this host."""
    if mode not in MODES:
        raise AuthPolicyError(f"auth must be one of {', '.join(MODES)} (got {mode!r})")
    wide = [a for a in addresses if beyond_host(a)]
    if mode == "curve":
        return True
    if mode == "off":
        if wide:
            raise AuthPolicyError(f"auth: off with {wide[0]}, which other hosts can reach: anyone there could "
                                  f"join this deployment. Use auth: auto or curve with a keys folder "
                                  f"(onepiece keys curve DIR), or bind loopback or ipc only")
        return False
    return bool(wide) or keys_given
