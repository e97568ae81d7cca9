"""Runs the proxy: uvicorn (uvloop) in this process, with the bound port reported back.

``serve(...)`` blocks until SIGTERM/SIGINT (uvicorn's own handlers, main thread only) and then
shuts down cleanly: in-flight HTTP requests finish, the background tasks stop, sockets close.
``ProxyServer.start()`` runs the same server on a background thread (tests, in-process use).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import resource
import signal
import threading
from typing import Callable, Iterator

import uvicorn
import uvloop

from onepiece.proxy.api import ProxyOptions, create_app
from onepiece.proxy.cluster import Cluster
from onepiece.proxy.http_limits import HttpLimits, protocol_factory
from onepiece.proxy.keys import ApiKeys, check_bind

log = logging.getLogger(__name__)

OnBound = Callable[[str, int], None]


class _Server(uvicorn.Server):
    """uvicorn, but a signal stops it and ``serve`` returns normally.

    uvicorn's own handlers re-raise the signal once shut down, so a clean SIGTERM stop would
    still end the process as "killed by SIGTERM"; supervisors should see exit status 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only; threaded servers are stopped by stop()
            return
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM)
        for sig in sigs:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in sigs:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        log.info("proxy: signal %d, shutting down", sig)
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for open requests
        self.should_exit = True


def within_open_files(limits: HttpLimits) -> HttpLimits:
    """``limits`` with ``max_connections`` lowered to what the open-files limit leaves beside the
    proxy's own sockets (256 of them, or half a smaller limit). Past the limit uvloop accepts
    and resets each new connection, without an answer or a log line; within it the client gets
    the bound's 503."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits
    room = max(soft // 2, soft - 256)
    if room >= limits.max_connections:
        return limits
    log.warning("open-files limit %d: at most %d connections at once (not %d); raise `ulimit -n` for more",
                soft, room, limits.max_connections)
    return dataclasses.replace(limits, max_connections=room)


class ProxyServer:
    def __init__(
        self,
        cluster: Cluster,
        host: str = "127.0.0.1",
        port: int = 0,
        max_inflight: int = 64,
        max_body_bytes: int = 16 << 20,
        log_level: str = "warning",
        http_limits: HttpLimits | None = None,
        keys: ApiKeys | None = None,
        **options: float | bool,
    ) -> None:
        check_bind(host, keys)  # beyond loopback, no keys: refused before anything binds
        self.host = host
        self.opts = ProxyOptions(max_inflight=max_inflight, max_body_bytes=max_body_bytes, **options)  # type: ignore[arg-type]
        self.limits = within_open_files(http_limits or HttpLimits())
        self.app = create_app(cluster, self.opts, keys)
        self.config = uvicorn.Config(
            # httptools (C) parses HTTP several times faster than h11, which matters for the
            # time a refused client waits for its 429; proxy/http_limits.py bounds what uvicorn
            # leaves open with it (head size, slow heads and bodies, open connections).
            self.app, host=host, port=port, loop="uvloop", http=protocol_factory(self.limits), lifespan="on",
            log_level=log_level, access_log=False, timeout_graceful_shutdown=5,
            limit_concurrency=self.limits.max_connections,
        )
        self.server = _Server(self.config)
        self.port: int | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def serve(self, on_bound: OnBound | None = None) -> None:
        """Serve until told to stop; ``on_bound(host, port)`` once it accepts connections."""
        task = asyncio.ensure_future(self.server.serve())
        while not self.server.started:
            if task.done():
                await task  # startup failed: surface uvicorn's error (or SystemExit)
                raise RuntimeError(f"proxy on {self.host}:{self.config.port} stopped during startup")
            await asyncio.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        log.info("proxy listening on %s", self.url)
        if on_bound is not None:
            try:
                on_bound(self.host, self.port)
            except BaseException:
                # (refused by the NM, say): uvicorn stops as on SIGTERM, not cancelled mid-serve,
                # which logged a traceback above the refusal's one clear line
                self.server.should_exit = True
                with contextlib.suppress(Exception):
                    await task
                raise
        await task

    def run(self, on_bound: OnBound | None = None) -> None:
        """Blocking: serve on a fresh uvloop event loop until SIGTERM/SIGINT."""
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(self.serve(on_bound))

    def start(self, timeout: float = 10.0) -> int:
        """Serve on a daemon thread; returns the bound port once it accepts connections."""
        bound = threading.Event()
        errors: list[BaseException] = []

        def target() -> None:
            try:
                self.run(lambda host, port: bound.set())
            except BaseException as e:  # reported to start()'s caller below
                errors.append(e)
                bound.set()

        self._thread = threading.Thread(target=target, name="proxy", daemon=True)
        self._thread.start()
        if not bound.wait(timeout):
            self.stop()
            raise RuntimeError(f"proxy did not start within {timeout:.0f}s")
        if errors:
            raise RuntimeError(f"proxy failed to start: {errors[0]!r}") from errors[0]
        assert self.port is not None
        return self.port

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None


def serve(
    cluster: Cluster,
    host: str = "127.0.0.1",
    port: int = 0,
    max_inflight: int = 64,
    max_body_bytes: int = 16 << 20,
    on_bound: OnBound | None = None,
    log_level: str = "info",
    keys: ApiKeys | None = None,
) -> None:
    """Run a proxy for ``cluster`` until SIGTERM/SIGINT. ``port=0`` binds any free port; the
    actual one is passed to ``on_bound(host, port)`` (e.g. to register with the NM)."""
    ProxyServer(cluster, host, port, max_inflight, max_body_bytes, log_level=log_level, keys=keys).run(on_bound)
