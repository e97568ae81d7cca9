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


def test_a_port_that_only_lingers_in_time_wait_is_free_but_a_listener_holds_it():
    """A deployment that just stopped leaves its served connections in TIME_WAIT (the server
    closed first); `onepiece up` must start again at once on the same ports."""
    port = free_port_run(1)
    server = socket.create_server(("127.0.0.1", port))
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    assert in_use("127.0.0.1", port)  # listening
    conn.close()  # the server side closes first: its end lingers in TIME_WAIT
    client.recv(1)
    client.close()
    server.close()
    states = [ln.split()[3] for t in ("/proc/net/tcp",) for ln in Path(t).read_text().splitlines()[1:]
              if int(ln.split()[1].rsplit(":", 1)[1], 16) == port]
    assert "06" in states, states  # 06: TIME_WAIT, on this port
    assert not in_use("127.0.0.1", port)
