"""Shared setup for the proxy and client tests (no tests here).

A real ``DbServer`` on a thread, a real ZMQ PULL receiver standing in for the entrance
instance, and the real proxy (uvicorn + uvloop) on a thread, all on 127.0.0.1 ephemeral
ports. Tests write ``status``/``result``/``failed`` messages to the DB's data address the way
a stage does. Imported by name (pytest puts tests/ on the path).
"""

from __future__ import annotations

import io
import threading
from typing import Any

import httpx
from PIL import Image

from onepiece.config import Workflow, deploy_dir, load_workflow
from onepiece.db.server import DbServer
from onepiece.proxy.cluster import StaticCluster
from onepiece.proxy.server import ProxyServer
from onepiece.transport import registry
from onepiece.transport.message import Message
from waiting import wait_for  # noqa: F401  (the proxy and client tests use it from here)

WORKFLOW: Workflow = load_workflow(deploy_dir() / "wan21.yaml")



def png(w: int = 40, h: int = 30, color: tuple[int, int, int] = (200, 10, 30)) -> bytes:
    img = Image.new("RGB", (w, h), color)
    img.putpixel((0, 0), (1, 2, 3))  # one distinct pixel, to check orientation and values
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


class DbThread:
    def __init__(self, name: str = "db0", max_bytes: int = 1 << 26) -> None:
        self.server = DbServer("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", ttl_s=60,
                               max_bytes=max_bytes, name=name, sweep_interval_s=0.05, deadline_grace_s=0.0,
                               purge_after_fetch_s=0.3)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.server.run, args=(self.stop,), daemon=True)
        self.thread.start()
        self.sender = registry.connect(self.server.data_address)
        self._lock = threading.Lock()

    @property
    def addresses(self) -> dict[str, str]:
        s = self.server
        return {"data": s.data_address, "control": s.control_address, "events": s.events_address}

    def send(self, header: dict, parts: dict | None = None) -> None:
        with self._lock:  # one zmq socket, used from test and worker threads
            self.sender.send(Message(header, parts or {}), timeout=2.0)

    # What a stage writes to the DB (db/protocol.py).
    def progress(self, uid: str, progress: int, stage: str = "denoise_t2v") -> None:
        self.send({"uid": uid, "kind": "status", "status": "in_progress", "stage": stage, "progress": progress})

    def result(self, uid: str, content: bytes, trace: list | None = None) -> None:
        self.send({"uid": uid, "kind": "result", "content_type": "video/mp4", "trace": trace or []},
                  {"content": content})

    def failed(self, uid: str, error: str, stage: str = "denoise_t2v") -> None:
        self.send({"uid": uid, "kind": "failed", "stage": stage, "error": error})

    def close(self) -> None:
        self.sender.close()
        self.stop.set()
        self.server.close()
        self.thread.join(5)


class Harness:
    """One DB, one entrance receiver (for both apps), one proxy."""

    def __init__(self, max_inflight: int = 8, max_body_bytes: int = 1 << 20, db_max_bytes: int = 1 << 26,
                 **proxy_opts: float) -> None:
        self.db = DbThread(max_bytes=db_max_bytes)
        self.entrance = registry.listen("tcp://127.0.0.1:0")
        self.cluster = StaticCluster(
            WORKFLOW, "set0",
            entrance_map={app: [self.entrance.address] for app in WORKFLOW.applications},
            db_list=[self.db.addresses],
        )
        proxy_opts.setdefault("refresh_s", 0.05)
        self.proxy = ProxyServer(self.cluster, max_inflight=max_inflight, max_body_bytes=max_body_bytes,
                                 **proxy_opts)
        self.proxy.start()
        self.url = self.proxy.url
        self.http = httpx.Client(base_url=self.url, timeout=10.0)

    def recv(self, timeout: float = 5.0) -> Message:
        msg = self.entrance.recv(timeout)
        assert msg is not None, "no message reached the entrance"
        return msg

    def create(self, **body: Any) -> httpx.Response:
        body.setdefault("prompt", "a cat")
        return self.http.post("/v1/videos", json=body)

    def healthz(self) -> dict:
        r = self.http.get("/healthz")
        assert r.status_code == 200
        return r.json()

    def close(self) -> None:
        self.http.close()
        self.proxy.stop()
        self.entrance.close()
        self.db.close()


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of ``name``'s sample with ``labels`` in a /metrics page (None: none)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None
