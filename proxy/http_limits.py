"""HTTP limits below the ASGI app: uvicorn's httptools protocol with bounded heads, timed reads and a
cap on open connections.

uvicorn 0.54 has none of these for httptools: ``h11_max_incomplete_event_size`` is h11's alone,
``timeout_keep_alive`` runs only between requests (a connection that never sends, or trickles,
stays open), and ``limit_concurrency`` answers 503 only once a request's head is complete, so
every connection may first feed the parser a head of any length, which llhttp accumulates in
memory. Here, per connection:

- the head (request line and headers) must fit in ``max_header_bytes`` (else 431) and arrive
  within ``header_timeout_s`` of its first byte, or of the connection opening (else 408);
- the body must arrive within ``body_timeout_s`` of the head (else 408 and the app sees a
  disconnect);
- a response the client stops reading (the transport's write buffer stays above its high-water
  mark, so the app waits to send more) is cut off after ``write_timeout_s`` without progress:
  the connection is aborted and the app sees a disconnect, so a client that never reads cannot
  hold a response's buffers and its handler forever;
- beyond ``max_connections`` open connections a new one gets 503 and is closed at once.

Bodies are bounded in size by the app (GuardMiddleware); uvicorn itself pauses reading once 64
KiB of body wait unread, so with these limits every connection holds a bounded number of bytes.
"""

from __future__ import annotations

import asyncio
from asyncio.events import TimerHandle
from dataclasses import dataclass
from typing import Any, Callable

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from onepiece.proxy.errors import ApiError


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 32 * 1024  # request line + headers; nginx takes 4 x 8 KiB by default
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0  # 16 MiB in 60 s needs 280 KB/s from the client
    write_timeout_s: float = 60.0  # a response of which the client reads nothing for this long
    max_connections: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "header_timeout_s", "body_timeout_s", "write_timeout_s", "max_connections"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HTTP limit {name} must be positive (got {getattr(self, name)!r})")


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`HttpLimits` (see the module doc)."""

    def __init__(self, *args: Any, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._in_head = True  # bytes fed now belong to a request line or headers
        self._head_bytes = 0
        self._timer: TimerHandle | None = None
        self._write_timer: TimerHandle | None = None  # runs while writing is paused

    # --- connection -------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        full = len(self.connections) >= self.limits.max_connections
        super().connection_made(transport)
        if full:
            self._refuse(503, "too many open connections; retry later", "too_many_connections")
            return
        self._arm(self.limits.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._writing()
        super().connection_lost(exc)

    # --- flow control: the transport says when the client stops reading --------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._writing()

    def _writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def data_received(self, data: bytes) -> None:
        if not self._in_head:
            super().data_received(data)
            return
        room = self.limits.max_header_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            return
        # Only what fits the bound reaches the parser: it buffers a head in memory until complete.
        self._head_bytes += room
        super().data_received(data[:room])
        if self.transport.is_closing():
            return
        if self._in_head:
            self._refuse(431, f"request line and headers exceed {self.limits.max_header_bytes} bytes",
                         "headers_too_large")
            return
        super().data_received(data[room:])

    # --- parser callbacks ---------------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.limits.body_timeout_s, self._body_timed_out)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()
        self._in_head, self._head_bytes = True, 0  # a pipelined request may follow

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._in_head and not self.transport.is_closing():
            self._arm(self.limits.header_timeout_s, self._head_timed_out)  # the next request's head

    # --- timers ---------------------------------------------------------------------------------
    def _arm(self, seconds: float, fire: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, fire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served; the next head's clock starts when it is answered
        if self._head_bytes == 0:
            self.transport.close()  # an idle connection: nothing to answer
            return
        self._refuse(408, f"request headers not received within {self.limits.header_timeout_s:g} s",
                     "header_timeout")

    def _write_timed_out(self) -> None:
        self._write_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's next send is dropped
        # abort(), not close(): close() would wait to flush what the client is not reading.
        self.transport.abort()

    def _body_timed_out(self) -> None:
        self._timer = None
        self._refuse(408, f"request body not received within {self.limits.body_timeout_s:g} s", "body_timeout")

    # --- refusing -------------------------------------------------------------------------------
    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` (unless a response already started) and close the connection."""
        self._disarm()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            body = orjson.dumps(ApiError(status, message, code=code).body())
            self.transport.write(b"".join([
                STATUS_LINE[status], b"content-type: application/json\r\n",
                b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body), body]))
        if cycle is not None and not cycle.response_complete:
            # The app, if it waits for the body, now reads a disconnect; its sends are dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def protocol_factory(limits: HttpLimits) -> Callable[..., LimitedHttpToolsProtocol]:
    """What uvicorn's ``Config(http=...)`` takes: it calls this per connection with its own arguments."""

    def make(*args: Any, **kwargs: Any) -> LimitedHttpToolsProtocol:
        return LimitedHttpToolsProtocol(*args, limits=limits, **kwargs)

    return make
