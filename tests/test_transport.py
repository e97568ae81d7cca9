"""ZMQ transports through the scheme registry, with real sockets."""

import threading
import time

import pytest
import torch
import zmq
from pydantic import BaseModel, ConfigDict, Field

from onepiece.transport import registry
from onepiece.transport.base import Full
from onepiece.transport.message import MAGIC, Message, encode, new_uid
from onepiece.transport.rpc import MAX_REQUEST_BYTES, RpcClient, RpcError, RpcServer, RpcTimeout


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:0", "ipc://{tmp}/rx.sock"])
def test_send_and_receive_by_scheme(address, tmp_path):
    rx = registry.listen(address.format(tmp=tmp_path))
    tx = registry.connect(rx.address)
    try:
        msg = Message({"uid": new_uid(), "app": "t2v"}, {"x": torch.arange(1 << 16, dtype=torch.float32)})
        tx.send(msg, timeout=2)
        got = rx.recv(timeout=2)
        assert got is not None and got.uid == msg.uid
        assert torch.equal(got.tensor("x"), msg.parts["x"])
    finally:
        tx.close()
        rx.close()


def test_unknown_scheme_is_a_clear_error():
    with pytest.raises(ValueError, match="no transport for scheme 'carrier'"):
        registry.connect("carrier://pigeon")
    with pytest.raises(ValueError, match="has no scheme"):
        registry.connect("127.0.0.1:5555")


def test_send_to_nobody_fails_within_its_timeout():
    tx = registry.connect("tcp://127.0.0.1:1")  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(Full):
        tx.send(Message({"uid": "u"}), timeout=0.3)
    assert time.monotonic() - t0 < 2
    tx.close()


def test_send_to_a_receiver_that_stops_reading_fails_when_full():
    rx = registry.listen("tcp://127.0.0.1:0")
    tx = registry.connect(rx.address)
    big = torch.zeros(1 << 18)  # 1 MiB per message; the high-water marks bound what queues
    with pytest.raises(Full):
        for _ in range(1000):
            tx.send(Message({"uid": new_uid()}, {"x": big}), timeout=0.2)
    tx.close()
    rx.close()


def test_malformed_messages_are_dropped_and_counted(caplog):
    rx = registry.listen("tcp://127.0.0.1:0")
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(rx.address)
    raw.send_multipart([b"garbage"])
    raw.send_multipart([MAGIC, b'{"uid": "x", "parts": [{"name": "a", "dtype": "uint8", "shape": [9], "nbytes": 9}]}', b"short"])
    good = Message({"uid": "ok"}, {"a": b"123"})
    raw.send_multipart(encode(good))
    got = rx.recv(timeout=2)
    assert got is not None and got.uid == "ok"
    assert rx.rejected == 2
    assert "dropped malformed message" in caplog.text
    raw.close(0)
    rx.close()


def test_a_frame_over_the_bound_costs_its_sender_the_connection_not_the_receiver(monkeypatch):
    from onepiece.transport import message

    monkeypatch.setattr(message, "MAX_PART_BYTES", 1 << 20)  # read when the receiver's socket is made
    rx = registry.listen("tcp://127.0.0.1:0")
    big = zmq.Context.instance().socket(zmq.PUSH)
    big.connect(rx.address)
    big.send_multipart(encode(Message({"uid": "big"}, {"a": b"x" * (2 << 20)})))
    assert rx.recv(timeout=1) is None  # libzmq drops the frame and that connection
    tx = registry.connect(rx.address)
    tx.send(Message({"uid": "ok"}, {"a": b"x" * (512 << 10)}), timeout=2)
    got = rx.recv(timeout=2)
    assert got is not None and got.uid == "ok"
    big.close(0)
    tx.close()
    rx.close()


def _serve(server, stop):
    poller = zmq.Poller()
    poller.register(server.sock, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(50):
            server.handle()


class _Square(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = Field(ge=0, le=1000, strict=True)


def test_rpc_ops_with_a_schema_get_their_arguments_checked_first(caplog):
    """A request that does not match its op's schema never reaches the handler: the reply
    names the field, one log line names the field and the sender, and the server goes on."""
    seen = []

    def square(args, blobs):
        seen.append(args)
        return {"n": args.n * args.n}

    server = RpcServer("tcp://127.0.0.1:0", {"square": square}, {"square": _Square})
    stop = threading.Event()
    t = threading.Thread(target=_serve, args=(server, stop))
    t.start()
    client = RpcClient(server.address, timeout=1.0, retries=0)
    try:
        for args, why in (({}, "square.n: Field required"), ({"n": "3"}, "square.n: Input should be a valid integer"),
                          ({"n": 10 ** 6}, "square.n: Input should be less than or equal to 1000"),
                          ({"n": 2, "m": 1}, "square.m: Extra inputs are not permitted")):
            with pytest.raises(RpcError, match=why):
                client.call("square", **args)
            assert f"refused a request from 127.0.0.1: {why}" in caplog.text
        assert not seen
        assert client.call("square", n=12)[0]["n"] == 144
        assert seen == [_Square(n=12)]  # the handler gets the checked model
        # A request frame over the bound costs its sender the connection, not the server its loop.
        big = zmq.Context.instance().socket(zmq.DEALER)
        big.connect(server.address)
        big.send_multipart([b"", b"x" * (MAX_REQUEST_BYTES + 1)])
        assert not big.poll(300)
        big.close(0)
        assert client.call("square", n=3)[0]["n"] == 9
    finally:
        stop.set()
        t.join()
        server.close()
        client.close()


def test_rpc_round_trip_errors_and_timeouts():
    def boom(req, blobs):
        raise ValueError("no such thing")

    server = RpcServer("tcp://127.0.0.1:0", {"echo": lambda req, blobs: ({"x": req["x"]}, [b"blob"]), "boom": boom})
    stop = threading.Event()
    t = threading.Thread(target=_serve, args=(server, stop))
    t.start()
    client = RpcClient(server.address, timeout=1.0, retries=0)
    try:
        reply, blobs = client.call("echo", x=42)
        assert reply["x"] == 42 and blobs == [b"blob"]
        with pytest.raises(RpcError, match="no such thing"):
            client.call("boom")
        with pytest.raises(RpcError, match="unknown op"):
            client.call("nope")
        # malformed requests are dropped; the server keeps answering
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(server.address)
        raw.send_multipart([b"", b"{{{"])
        raw.send_multipart([b"only-one-frame"])
        # An op that is not a string (an unhashable list killed DBs and the NM) is an unknown op.
        for op in (b'[1]', b'{"a": 1}', b'null', b'7'):
            raw.send_multipart([b"", b'{"id": 7, "op": ' + op + b'}'])
            assert raw.poll(2000) and b"unknown op" in raw.recv_multipart()[1]
        assert client.call("echo", x=1)[0]["x"] == 1
        raw.close(0)
    finally:
        stop.set()
        t.join()
        server.close()
        client.close()
    dead = RpcClient("tcp://127.0.0.1:1", timeout=0.2, retries=1)
    t0 = time.monotonic()
    with pytest.raises(RpcTimeout):
        dead.call("echo", x=1)
    assert time.monotonic() - t0 < 2
    dead.close()
