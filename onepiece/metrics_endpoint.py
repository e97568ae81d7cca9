"""Each role's Prometheus endpoint: prometheus_client's own server, stopped at once.

``HTTPServer.shutdown`` waits for the serving loop's next turn, up to half a second; every role
paid that on every stop, and a deployment's NM (stopped after its roles) paid it again. A
connection to the server wakes the loop, which then sees the request to stop.
"""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

WAKE_TRIES = 20  # connections at most, 50 ms apart: the loop may turn before shutdown() asks


def start(port: int, addr: str) -> WSGIServer:
    """Serve the default registry at ``addr:port`` (0: any free port; ``server_port`` says which)."""
    server, _ = start_http_server(port, addr=addr)
    return server


def stop(server: WSGIServer) -> None:
    """Stop serving and release the port, without waiting for the loop's next turn."""
    stopper = threading.Thread(target=server.shutdown, name="metrics-stop", daemon=True)
    stopper.start()
    host, port = server.server_address[:2]
    for _ in range(WAKE_TRIES):
        try:
            socket.create_connection((host, port), timeout=0.2).close()
        except OSError:
            pass
        stopper.join(0.05)
        if not stopper.is_alive():
            break
    stopper.join(1.0)
    server.server_close()
