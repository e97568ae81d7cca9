"""Picking free ports for topologies that name them up front (several NMs on consecutive ports)."""

from __future__ import annotations

import socket
from pathlib import Path

from onepiece.ports import free_port_run, in_use


def test_a_run_of_free_ports_is_bindable_and_below_the_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    base = free_port_run(3)
    assert 10000 <= base and base + 3 <= low  # no outgoing connection is handed one of them
    socks = []
    try:
        for port in range(base, base + 3):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", port))
        assert all(in_use("127.0.0.1", p) for p in range(base, base + 3))
    finally:
        for s in socks:
            s.close()
