"""HTTP limits of the proxy (proxy/http_limits.py, the body budget in proxy/api.py) against a real
proxy process on a real socket: huge and slow heads, slow bodies, too many buffered bodies, too
many connections. The proxy runs in its own process so its memory can be measured alone."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from onepiece.proxy.http_limits import HttpLimits
from waiting import wait_for

HEADER_BYTES = 16 * 1024
TIMEOUT_S = 1.0
MAX_BODY = 1 << 20
MAX_CONNECTIONS = 48

SCRIPT = f"""
from onepiece.config import deploy_dir, load_workflow
from onepiece.proxy.cluster import StaticCluster
from onepiece.proxy.http_limits import HttpLimits
from onepiece.proxy.server import ProxyServer

limits = HttpLimits(max_header_bytes={HEADER_BYTES}, header_timeout_s={TIMEOUT_S}, body_timeout_s={TIMEOUT_S},
                    write_timeout_s={TIMEOUT_S}, max_connections={MAX_CONNECTIONS})
server = ProxyServer(StaticCluster(load_workflow(deploy_dir() / "wan21.yaml")), max_body_bytes={MAX_BODY},
                     max_buffered_bytes={3 * MAX_BODY}, http_limits=limits, log_level="warning")
server.run(lambda host, port: print("PORT", port, flush=True))
"""


@contextlib.contextmanager
def proxy_process(script: str = SCRIPT, preexec_fn=None):
    """A proxy process running ``script``, and the port it serves on."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    watchdog = threading.Timer(60, proc.kill)  # bounds the readline below if the proxy hangs
    watchdog.start()
    try:
        try:
            line = proc.stdout.readline()
        finally:
            watchdog.cancel()  # (not at the end: it killed the proxy of a module that ran over 60 s)
        assert line.startswith("PORT "), line
        yield proc, int(line.split()[1])
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def proxy():
    with proxy_process() as running:
        yield running


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def healthy(port: int) -> bool:
    return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def answer(s: socket.socket, timeout: float = 5.0) -> bytes:
    """What the proxy sent until it closed the connection (b"" if it reset it)."""
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


class HealthPoller:
    """Asks /healthz every 50 ms on a thread; every answer must be a quick 200."""

    def __init__(self, port: int) -> None:
        self.port, self.results, self.stop = port, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(timeout=2) as c:
            while True:
                try:
                    self.results.append(c.get(f"http://127.0.0.1:{self.port}/healthz").status_code)
                except httpx.HTTPError as e:
                    self.results.append(repr(e))
                if self.stop.wait(0.05):
                    return

    def __enter__(self) -> "HealthPoller":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)
        assert self.results and all(r == 200 for r in self.results), self.results


def test_a_head_over_the_bound_gets_431(proxy):
    _, port = proxy
    with connect(port) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (HEADER_BYTES + 100) + b"\r\n\r\n")
        got = answer(s)
    assert got.startswith(b"HTTP/1.1 431 "), got[:200]
    assert b'"code":"headers_too_large"' in got
    with connect(port) as s:  # many small headers count the same
        s.sendall(b"GET /healthz HTTP/1.1\r\n" + b"X-A: b\r\n" * (HEADER_BYTES // 8 + 10) + b"\r\n")
        assert answer(s).startswith(b"HTTP/1.1 431 ")
    # Within the bound, a large head is served.
    with connect(port) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: " + b"a" * (HEADER_BYTES - 200)
                  + b"\r\n\r\n")
        assert answer(s).startswith(b"HTTP/1.1 200 ")


def test_never_ending_headers_do_not_grow_the_proxy(proxy):
    """Four clients each stream a 64 MiB header (before the bound, the proxy grew by ~250 MB)."""
    proc, port = proxy
    for _ in range(20):
        assert healthy(port)
    before = rss_mb(proc.pid)
    sent: list[int] = []

    def stream() -> None:
        n = 0
        chunk = b"a" * 65536
        with connect(port) as s:
            try:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Endless: ")
                while n < 64 << 20:
                    s.sendall(chunk)
                    n += len(chunk)
            except (BrokenPipeError, ConnectionResetError, socket.timeout):
                pass
        sent.append(n)

    with HealthPoller(port):
        threads = [threading.Thread(target=stream) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    grown = rss_mb(proc.pid) - before
    assert len(sent) == 4 and all(n < 16 << 20 for n in sent), sent  # cut off, not read to the end
    assert grown < 20, f"the proxy grew by {grown:.0f} MB"
    assert healthy(port)


def test_slow_heads_and_idle_connections_are_cut_off(proxy):
    _, port = proxy
    with HealthPoller(port):
        with connect(port) as s:
            t0 = time.monotonic()
            s.sendall(b"GET /healthz HTTP/1.1\r\n")
            got, closed = b"", False
            for _ in range(40):  # one header line every 0.1 s: never complete
                try:
                    s.sendall(b"X-Slow: a\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
                time.sleep(0.1)
                s.settimeout(0.001)
                try:
                    got = s.recv(4096)
                except (socket.timeout, BlockingIOError):
                    continue
                except ConnectionResetError:
                    closed = True
                    break
                if got:
                    break
            took = time.monotonic() - t0
        assert got.startswith(b"HTTP/1.1 408 ") or closed, got
        assert TIMEOUT_S * 0.9 <= took < TIMEOUT_S + 2, took
        with connect(port) as s:  # a connection that never sends anything
            t0 = time.monotonic()
            assert answer(s) == b""
            assert time.monotonic() - t0 < TIMEOUT_S + 2


@pytest.mark.exclusive  # (40 connections cut off within 2 s of the timeout: a busy neighbour stretches that)
def test_many_slow_heads_at_once_are_all_cut_off_while_healthz_answers(proxy):
    """A slowloris: 40 connections (most of the bound) each send a header line every 0.2 s and
    never end their heads; each is cut off at the header timeout, and /healthz answers throughout."""
    _, port = proxy
    socks = [connect(port) for _ in range(40)]
    closed_at: dict[int, float] = {}
    try:
        with HealthPoller(port):
            t0 = time.monotonic()
            for s in socks:
                s.sendall(b"GET /healthz HTTP/1.1\r\n")
                s.setblocking(False)
            while len(closed_at) < len(socks) and time.monotonic() - t0 < TIMEOUT_S + 3:
                for i, s in enumerate(socks):
                    if i in closed_at:
                        continue
                    try:
                        if s.recv(4096) is not None:  # a 408, or b"" once closed: either way cut off
                            closed_at[i] = time.monotonic() - t0
                            continue
                    except BlockingIOError:
                        pass
                    except ConnectionResetError:
                        closed_at[i] = time.monotonic() - t0
                        continue
                    try:
                        s.sendall(b"X-Slow: a\r\n")
                    except (BrokenPipeError, ConnectionResetError, BlockingIOError):
                        closed_at[i] = time.monotonic() - t0
                time.sleep(0.2)
    finally:
        for s in socks:
            s.close()
    assert len(closed_at) == len(socks), f"{len(socks) - len(closed_at)} slow heads were never cut off"
    assert all(TIMEOUT_S * 0.9 <= t < TIMEOUT_S + 2 for t in closed_at.values()), sorted(closed_at.values())
    assert healthy(port)


def test_slow_bodies_are_cut_off(proxy):
    _, port = proxy
    with HealthPoller(port):
        with connect(port) as s:
            t0 = time.monotonic()
            s.sendall(b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
            got = b""
            s.settimeout(0.001)
            for _ in range(40):
                try:
                    s.sendall(b"a")
                    got = s.recv(4096)
                except (socket.timeout, BlockingIOError):
                    time.sleep(0.1)
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    break
                break
            took = time.monotonic() - t0
        assert got.startswith(b"HTTP/1.1 408 ") and b"body_timeout" in got, got
        assert TIMEOUT_S * 0.9 <= took < TIMEOUT_S + 2, took


def test_a_download_the_client_stops_reading_is_cut_off():
    """A 32 MiB result, and a client that reads none of it: once the proxy's write buffer has
    stayed full for the write timeout, the connection is aborted (it held the artefact and its
    handler for as long as the client liked). A real DB and proxy on threads (tests/proxy_harness.py)."""
    from proxy_harness import Harness

    size = 32 << 20
    h = Harness(http_limits=HttpLimits(write_timeout_s=TIMEOUT_S))
    try:
        uid = h.create(prompt="big", size="64x64").json()["id"]
        h.db.result(h.recv().uid, b"v" * size)
        wait_for(lambda: h.http.get(f"/v1/videos/{uid}").json()["status"] == "completed", timeout=10,
                 what="the result stored", interval=0.05)
        host, port = h.url.removeprefix("http://").split(":")
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        s.connect((host, int(port)))
        with s:
            s.sendall(f"GET /v1/videos/{uid}/content HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            time.sleep(TIMEOUT_S + 1.5)  # reads nothing meanwhile
            t0 = time.monotonic()
            got = answer(s, timeout=10)
            took = time.monotonic() - t0
        status, received = got[:13], len(got)
        assert status == b"HTTP/1.1 200 " and received < size, (status, received)
        assert took < 5, took  # aborted already: what was in flight, then the reset
        assert h.healthz()["status"] == "ok"
    finally:
        h.close()


def test_buffered_bodies_are_bounded_in_total(proxy):
    """Three requests each announce a 1 MiB body and hold it back: with a 3 MiB total, a fourth
    body is refused at once; once the three are cut off (body timeout), bodies are taken again."""
    _, port = proxy
    head = (b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % MAX_BODY)
    holders = [connect(port) for _ in range(3)]
    try:
        for s in holders:
            s.sendall(head + b"{")

        def fourth() -> httpx.Response | None:  # refused once the three reached the app and reserved their bodies
            r = httpx.post(f"http://127.0.0.1:{port}/v1/videos", content=b"{}", timeout=5,
                           headers={"content-type": "application/json"})
            return r if r.status_code != 400 else None  # 400: taken, the three not all reserved yet

        r = wait_for(fourth, 3, "the three bodies reserved")
        assert r.status_code == 503 and r.json()["error"]["code"] == "buffers_full", r.text
        assert r.headers["retry-after"]
        for s in holders:
            assert answer(s).startswith(b"HTTP/1.1 408 ")
    finally:
        for s in holders:
            s.close()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/videos", content=b"{}", timeout=5,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_connections_beyond_the_bound_get_503(proxy):
    _, port = proxy
    idle = []
    try:
        for _ in range(MAX_CONNECTIONS):
            idle.append(connect(port))

        def one_more() -> bytes | None:  # answered once the proxy has accepted all of them
            with connect(port) as s:
                try:
                    return answer(s, timeout=0.3) or None
                except TimeoutError:  # taken as an idle connection: they were not all accepted yet
                    return None

        got = wait_for(one_more, 5, "the proxy to accept the idle connections")
        assert got.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in got, got
    finally:
        for s in idle:
            s.close()
    assert healthy(port)


def test_connections_beyond_the_open_files_limit_get_503_not_a_reset():
    """Under `ulimit -n 256` the bound of 4096 connections was never reached: past the descriptors
    the proxy reset each new connection. It now bounds its connections within the limit."""
    import resource

    def low_nofile() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    script = SCRIPT.replace(f"max_connections={MAX_CONNECTIONS}", "max_connections=4096")
    idle = []
    with proxy_process(script, low_nofile) as (_, port):
        try:
            for _ in range(256):  # more than the proxy has descriptors for
                idle.append(connect(port))

            def one_more() -> bytes | None:
                with connect(port) as s:
                    try:
                        return answer(s, timeout=0.3) or None  # b"": reset
                    except TimeoutError:
                        return None

            got = wait_for(one_more, 5, "an answer to a connection past the bound")
            assert got.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in got, got
            for s in idle:
                s.close()
            idle.clear()
            wait_for(lambda: healthy(port), 10, "the proxy serving again")
        finally:
            for s in idle:
                s.close()
