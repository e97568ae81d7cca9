"""Control traffic (registration, heartbeats, assignments, DB reads): small request/reply RPC
over ZMQ ROUTER/DEALER with JSON headers and optional raw blob frames.

A request is ``[b"", header, *blobs]`` with header ``{"id", "op", ...}`` (both reserved); the reply echoes the
id with ``ok`` and either results or ``error``. A server declares a pydantic schema per op for
the other fields: a request that does not match is answered with an error naming the field and
logged once with its sender; its handler never sees it. Clients time out and retry a bounded number of
times; a late reply to an abandoned request is recognised by its id and discarded.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, Callable, Mapping

import orjson
import zmq
import zmq.asyncio
from pydantic import BaseModel

from onepiece.droplog import log_dropped
from onepiece.schema import checked
from onepiece.transport import curve
from onepiece.transport.handshake import HandshakeWatch
from onepiece.transport.zmq_transport import bind_address, peer_of

log = logging.getLogger(__name__)

Blobs = list[Any]
Handler = Callable[[Any, Blobs], "dict | tuple[dict, Blobs]"]
MAX_REQUEST_BYTES = 4 << 20  # per frame: requests are small JSON; a bigger one costs its sender the connection


class RpcError(RuntimeError):
    """The peer answered with an error, or did not answer in time."""


class RpcTimeout(RpcError):
    pass


def _dealer(ctx: zmq.Context) -> zmq.Socket:
    """A client socket, not connected yet."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 64)  # requests queued for an absent server stay few
    return curve.client(sock)


class RpcServer:
    """Serves ``op`` handlers on a ROUTER socket. Owners poll ``sock`` and call ``handle()``,
    so one thread can serve control and data sockets without locks.

    An op named in ``schemas`` has its arguments (the request less ``id`` and ``op``) checked
    against its model first, and its handler gets the model instance, not the raw request. An op
    named in ``access`` is served only to the client that proved that key (``curve.caller``: the
    name of its key file), when the process runs with CURVE; a handler that decides by who asks
    reads ``caller``, that name for the request it is handling (None without CURVE)."""

    def __init__(self, address: str, handlers: Mapping[str, Handler],
                 schemas: Mapping[str, type[BaseModel]] | None = None,
                 access: Mapping[str, str] | None = None) -> None:
        self.handlers = handlers
        self.schemas = dict(schemas or {})
        self.access = dict(access or {})
        self.caller: str | None = None
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self.sock.setsockopt(zmq.RCVHWM, 1000)
        self.sock.setsockopt(zmq.SNDHWM, 1000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        curve.server(self.sock).bind(bind_address(address))
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def handle(self) -> None:
        """Answer every request waiting on the socket."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._handle_one(frames)
            except Exception:  # no request may stop the loop that serves the others
                log.exception("rpc %s: dropped a request that broke its handling", self.address)

    def _handle_one(self, frames: list) -> None:
        if len(frames) < 3 or frames[1].bytes != b"":
            log_dropped(log, self.address, "frames", "rpc %s: dropped request from %s with %d frames", self.address,
                        peer_of(frames[0]),
                        len(frames))
            return
        ident = frames[0].bytes
        try:
            req = orjson.loads(frames[2].buffer)
            if not isinstance(req, dict):
                raise ValueError("request is not a JSON object")
        except (orjson.JSONDecodeError, ValueError) as e:
            log_dropped(log, self.address, "not JSON", "rpc %s: dropped malformed request from %s: %s", self.address,
                        peer_of(frames[0]), e)
            return
        rid, op = req.get("id"), req.get("op")
        if not (isinstance(rid, int) and -(1 << 63) <= rid < 1 << 63 or isinstance(rid, str) and len(rid) <= 128):
            rid = None  # echoed back: only an id a client could have sent
        handler = self.handlers.get(op) if isinstance(op, str) else None  # an op may be any JSON value
        blobs: Blobs = []
        refused = None
        self.caller = who = curve.caller(frames[2])
        if handler is None:
            refused = f"unknown op {str(op)[:80]!r}"
        elif op in self.access and who not in (None, self.access[op]):
            refused = f"op {op!r} is served to the {self.access[op]} key only, not to the {who} key"
        elif op in self.schemas:
            try:
                req = checked(self.schemas[op], {k: v for k, v in req.items() if k not in RESERVED}, op)
            except ValueError as e:
                refused = str(e)
        if refused is not None:
            log_dropped(log, self.address, refused, "rpc %s: refused a request from %s: %s", self.address,
                        peer_of(frames[0]), refused)
            reply: dict = {"ok": False, "error": refused}
        else:
            try:
                out = handler(req, frames[3:])
                reply, blobs = out if isinstance(out, tuple) else (out, [])
                if any(k in reply for k in RESERVED):
                    raise TypeError(f"handler reply uses a reserved key {RESERVED}")
                reply = {"ok": True, **reply}
            except Exception as e:  # a bad request fails alone; the server keeps serving
                # Look-up misses ("not found") are ordinary answers while clients fail over.
                level = logging.DEBUG if isinstance(e, LookupError) else logging.WARNING
                log.log(level, "rpc %s: op %s failed: %s", self.address, op, e)
                reply = {"ok": False, "error": str(e)}
        reply["id"] = rid
        try:
            self.sock.send_multipart([ident, b"", orjson.dumps(reply), *blobs], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.warning("rpc %s: reply dropped, client not reading", self.address)

    def close(self) -> None:
        self.sock.close(linger=0)


RESERVED = ("id", "op", "ok")


def _request(rid: int, op: str, args: dict) -> bytes:
    clash = [k for k in RESERVED if k in args]
    if clash:
        raise TypeError(f"rpc {op}: argument names {clash} are reserved by the protocol")
    return orjson.dumps({"id": rid, "op": op, **args})


def _check(reply: dict, op: str) -> dict:
    if not reply.get("ok"):
        raise RpcError(f"{op}: {reply.get('error', 'failed')}")
    return reply


class RpcClient:
    """Blocking client for one server; one request at a time (use one per thread)."""

    def __init__(self, address: str, timeout: float = 2.0, retries: int = 2) -> None:
        self.address, self.timeout, self.retries = address, timeout, retries
        self._ids = itertools.count(1)
        self._why: str | None = None  # a failed handshake seen by an earlier try's socket
        self._open()

    def _open(self) -> None:
        self.sock = _dealer(zmq.Context.instance())
        self._watch = HandshakeWatch(self.sock)  # before the connect: a handshake can fail at once
        self.sock.connect(self.address)

    def call(self, op: str, blobs: Blobs = (), timeout: float | None = None, **args: Any) -> tuple[dict, list[bytes]]:
        timeout = self.timeout if timeout is None else timeout
        for _ in range(self.retries + 1):
            rid = next(self._ids)
            deadline = time.monotonic() + timeout
            try:
                self.sock.send_multipart([b"", _request(rid, op, args), *blobs], zmq.NOBLOCK, copy=False)
            except zmq.Again:  # nothing connected and the (small) queue is full: a dead server
                self._reset()
                time.sleep(min(timeout, 0.05))
                continue
            while self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
                frames = self.sock.recv_multipart()
                try:
                    reply = orjson.loads(frames[1])
                except (orjson.JSONDecodeError, IndexError):
                    continue
                if isinstance(reply, dict) and reply.get("id") == rid:  # else a late reply to an abandoned try
                    return _check(reply, op), frames[2:]
            self._reset()  # drop what is queued for a server that did not answer
        why, self._why = self._why, None
        raise RpcTimeout(f"{op}: no answer from {self.address} after {self.retries + 1} tries of {timeout:.1f}s"
                         + (f"; {why}" if why else ""))

    def _reset(self) -> None:
        self.close()
        self._open()

    def close(self) -> None:
        self._why = self._watch.reason() or self._why
        self._watch.close()
        self.sock.close(linger=0)


class AsyncRpcClient:
    """The asyncio twin of RpcClient, for the proxy's event loop."""

    def __init__(self, address: str, timeout: float = 2.0, retries: int = 1) -> None:
        self.address, self.timeout, self.retries = address, timeout, retries
        self._ids = itertools.count(1)
        self.sock = _dealer(zmq.asyncio.Context.instance())
        self._watch = HandshakeWatch(self.sock)  # before the connect: a handshake can fail at once
        self.sock.connect(address)
        self._pending: dict[int, Any] = {}
        self._reader = None

    async def call(self, op: str, blobs: Blobs = (), timeout: float | None = None, **args: Any) -> tuple[dict, list[bytes]]:
        timeout = self.timeout if timeout is None else timeout
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read_loop())
        for _ in range(self.retries + 1):
            if self.sock.closed:  # closed by another caller meanwhile (AsyncDbClient drops one that timed out)
                break
            rid = next(self._ids)
            fut = asyncio.get_running_loop().create_future()
            self._pending[rid] = fut
            try:
                try:
                    await self.sock.send_multipart([b"", _request(rid, op, args), *blobs], zmq.NOBLOCK)
                except zmq.Again:  # a dead server with a full queue: that try failed
                    await asyncio.sleep(min(timeout, 0.05))
                    continue
                reply, rest = await asyncio.wait_for(fut, timeout)
                return _check(reply, op), rest
            except asyncio.TimeoutError:
                continue
            finally:
                self._pending.pop(rid, None)
        why = self._watch.reason()
        raise RpcTimeout(f"{op}: no answer from {self.address} after {self.retries + 1} tries of {timeout:.1f}s"
                         + (f"; {why}" if why else ""))

    async def _read_loop(self) -> None:
        while True:
            try:
                frames = await self.sock.recv_multipart()
                reply = orjson.loads(frames[1])
                fut = self._pending.get(reply.get("id")) if isinstance(reply, dict) else None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # one bad reply must not end every later call
                if self.sock.closed:  # nothing more can come, and each recv fails at once without yielding
                    return
                log.warning("rpc client %s: ignored a malformed reply: %r", self.address, e)
                continue
            if fut is not None and not fut.done():
                fut.set_result((reply, frames[2:]))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._watch.close()
        self.sock.close(linger=0)
