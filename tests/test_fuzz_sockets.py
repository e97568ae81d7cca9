"""Malformed input on every socket of a running deployment (`onepiece up` over tcp: NM, a DB,
one instance of each stage of both applications, a proxy) must not stop any process or loop:
RPC requests to the NM and the DB, data messages to the DB and to every stage, and DB events to
the proxy and the stages (from a DB the test registers with the NM, as any member could).
Hypothesis draws the variants: fields of the declared schemas with values of every JSON type,
huge values, non-JSON, truncated frames, wrong frame counts. Then every process is the one that started (none died
and came back), each server answers, and a real request completes through HTTP."""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
import psutil
import pytest
import zmq
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from onepiece import deployment
from onepiece.client import Client
from onepiece.config import JobParams, Workflow
from onepiece.db.protocol import DATA_SCHEMAS, RPC_SCHEMAS, NewRecord
from onepiece.events import CANCEL, DONE, Event
from onepiece.launcher import free_tcp_address
from onepiece.nm.client import Membership
from onepiece.nm.protocol import SCHEMAS as NM_SCHEMAS
from onepiece.schema import problem
from onepiece.task_header import TaskHeader
from onepiece.transport.message import MAGIC, Message, encode, new_uid
from onepiece.transport.rpc import MAX_REQUEST_BYTES, RpcClient

from deployment import Up
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

FUZZ = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
STAGES = {"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1, "image_encode": 1, "vae_encode": 1, "denoise_i2v": 1}


@pytest.fixture(scope="module")
def up(tiny_models, tmp_path_factory, make_topology):
    folder = tmp_path_factory.mktemp("fuzz")
    nm = free_tcp_address()
    # Over tcp, as a multi-host deployment runs (its sockets reachable, not in a private folder).
    dep = Up(make_topology(folder, tiny_models, nm, dbs=1, stages=STAGES, transport="tcp", threads=1),
             folder / "logs", nm)
    try:
        dep.url = dep.wait_for(r"serves the API at (http://\S+)", timeout=240).group(1)
        routes = dep.routes()
        assert all(routes["stages"][s][0].startswith("tcp://") for s in STAGES) and routes["dbs"], routes
        dep.pids = _pids(dep)
        nm_client = RpcClient(nm, timeout=5)
        try:
            dep.workflow = Workflow.model_validate(nm_client.call("workflow")[0]["workflow"])
            dep.deployment = nm_client.call("status")[0]["nm"][deployment.FIELD]  # what a member must bring
        finally:
            nm_client.close()
        yield dep
    finally:
        dep.stop()


def _pids(up: Up) -> dict[int, str]:
    return {p.pid: " ".join(p.cmdline()[:8]) for p in psutil.Process(up.proc.pid).children(recursive=True)}


# ---- what is sent ------------------------------------------------------------------------------

SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=24))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
HUGE = st.sampled_from([10 ** 30, -(2 ** 63), 2 ** 64, 1e308, -1e308, "x" * 200_000, ["u"] * 20_000,
                        {f"k{i}": i for i in range(5_000)}, [[[[[[[[[[[[1]]]]]]]]]]]]])
VALUE = JSON | HUGE


def _fields(names: set[str], values: st.SearchStrategy = VALUE) -> st.SearchStrategy[dict[str, Any]]:
    """Some of a schema's fields (and some unknown ones), each with any value."""
    return st.dictionaries(st.sampled_from(sorted(names)) | st.text(max_size=8), values, max_size=len(names) + 2)


def _names(*models) -> set[str]:
    return {n for m in models for n in m.model_fields}


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except (TypeError, orjson.JSONEncodeError):  # ints beyond 64 bits: JSON anyway, as text
        import json

        return json.dumps(value, allow_nan=True).encode()


@st.composite
def mangled(draw, frames: list[bytes]) -> list[bytes]:
    """``frames`` as they are, or truncated, cut short, padded, or with a non-JSON frame."""
    # Mostly well framed, so that most variants reach the schemas behind the framing checks.
    how = draw(st.sampled_from(["as is"] * 4 + ["truncate", "fewer", "more", "garbage", "empty"]))
    frames = list(frames)
    if how == "truncate" and frames:
        i = draw(st.integers(0, len(frames) - 1))
        frames[i] = frames[i][:draw(st.integers(0, max(0, len(frames[i]) - 1)))]
    elif how == "fewer":
        frames = frames[:draw(st.integers(0, max(0, len(frames) - 1)))]
    elif how == "more":
        frames += draw(st.lists(st.binary(max_size=64), min_size=1, max_size=3))
    elif how == "garbage" and frames:
        frames[draw(st.integers(0, len(frames) - 1))] = draw(st.binary(max_size=256))
    elif how == "empty":
        frames = [b""]
    return frames or [b""]


def _socket(kind: int, address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 2000)  # a server that stopped reading fails the test, not hangs it
    sock.connect(address)
    return sock


def _send(sock: zmq.Socket, frames: list[bytes]) -> None:
    sock.send_multipart(frames)


# ---- RPC: the NM and the DB --------------------------------------------------------------------

def _rpc_fuzz(address: str, schemas: dict, guard) -> None:
    names = _names(*schemas.values())
    sock = _socket(zmq.DEALER, address)

    @FUZZ
    @given(data=st.data())
    def run(data) -> None:
        op = data.draw(st.sampled_from(sorted(schemas)) | JSON, label="op")
        args = data.draw(_fields(names), label="args")
        if isinstance(op, str) and op in schemas:
            guard(op, args)
        header = {**args, "id": data.draw(VALUE, label="id"), "op": op}
        _send(sock, data.draw(mangled([b"", _dumps(header)]), label="frames"))
        while sock.poll(0):  # replies are not looked at; only that the server goes on
            sock.recv_multipart()

    try:
        run()
        _send(sock, [b"", b"x" * (MAX_REQUEST_BYTES + 1)])  # over the bound: the server drops the connection
    finally:
        sock.close()


def _no_state_change(schemas: dict, ops: set[str]):
    """Guard for ops that change what the deployment is (a real registration, a move): those
    drawn must be malformed, or name no real instance."""
    def guard(op: str, args: dict) -> None:
        if op in ops:
            assume(problem(schemas[op], args) is not None)
    return guard


def test_nm_rpc_survives_malformed_requests(up):
    _rpc_fuzz(up.nm, NM_SCHEMAS, _no_state_change(NM_SCHEMAS, {"register", "move", "deregister", "heartbeat"}))
    rpc = RpcClient(up.nm, timeout=5, retries=0)
    try:
        assert rpc.call("routes", set="set0")[0]["routes"]["dbs"]
    finally:
        rpc.close()


def test_db_rpc_survives_malformed_requests(up):
    db = up.routes()["dbs"][0]
    _rpc_fuzz(db["control"], RPC_SCHEMAS, lambda op, args: None)  # a valid op on a random uid is harmless
    rpc = RpcClient(db["control"], timeout=5, retries=0)
    try:
        assert rpc.call("ping")[0]["name"]
    finally:
        rpc.close()


# ---- data messages: the DB and a stage ---------------------------------------------------------

@st.composite
def data_frames(draw, kinds: list[str], names: set[str], header_extra: dict | None = None) -> list[bytes]:
    header = draw(_fields(names), label="header")
    header["kind"] = draw(st.sampled_from(kinds) | JSON, label="kind")
    uids = st.uuids().map(lambda u: u.hex)
    header["uid"] = draw(st.one_of(uids, uids, uids, VALUE), label="uid")
    header.update(header_extra or {})
    if draw(st.booleans(), label="record-like"):
        header["record"] = draw(_fields(_names(NewRecord)), label="record")
    parts = draw(st.dictionaries(st.sampled_from(["content", "prompt_embeds", "x"]), st.binary(max_size=64),
                                 max_size=2), label="parts")
    frames = [bytes(f) for f in encode(Message({"uid": "u"}, parts))]  # well-described parts...
    described = orjson.loads(frames[1])["parts"]
    if draw(st.integers(0, 3), label="bad parts") == 0:  # ...or descriptions that do not match the frames
        described = draw(VALUE, label="parts header")
    frames[1] = _dumps({**header, "parts": described})
    return draw(mangled(frames), label="frames")


def _frames(header: dict) -> list[bytes]:
    return [bytes(f) for f in encode(Message(header))]


def _data_fuzz(address: str, frames_strategy, known: dict, guard=lambda frames: None) -> None:
    """Drawn variants, and ``known``: one well framed and malformed by its schema alone (so that
    every run reaches the schema check, whatever was drawn)."""
    sock = _socket(zmq.PUSH, address)

    @FUZZ
    @given(frames=frames_strategy)
    @example(frames=_frames(known))
    def run(frames) -> None:
        guard(frames)
        _send(sock, frames)

    try:
        run()
        _send(sock, [MAGIC, b"{" * 2_000_000])  # a header over the decoder's bound
    finally:
        sock.close(linger=2000)


def test_db_data_survives_malformed_messages(up):
    db = up.routes()["dbs"][0]
    _data_fuzz(db["data"], data_frames(sorted(DATA_SCHEMAS), _names(*DATA_SCHEMAS.values())),
               {"uid": new_uid(), "kind": "status", "status": "in_progress", "progress": "x"})


@pytest.mark.parametrize("stage", list(STAGES))
def test_stage_data_survives_malformed_messages(up, stage):
    wf: Workflow = up.workflow

    @st.composite
    def headers(draw) -> list[bytes]:
        params = draw(_fields(_names(JobParams)), label="params")
        extra = {"app": draw(st.sampled_from(["t2v", "i2v"]) | JSON, label="app"),
                 "stage": draw(st.sampled_from(list(STAGES)) | JSON, label="stage"),
                 "params": draw(st.just(params) | VALUE, label="params value")}
        return draw(data_frames(["task"], _names(TaskHeader), extra))

    def guard(frames: list[bytes]) -> None:
        """No fully valid request: it would run for real (its limits are the application's)."""
        try:
            h = orjson.loads(frames[1]) if len(frames) > 1 else None
        except orjson.JSONDecodeError:
            return
        if isinstance(h, dict) and problem(TaskHeader, h) is None and h["app"] in wf.applications:
            try:
                wf.applications[h["app"]].check_params(h["params"])
            except ValueError:
                return
            assume(False)

    _data_fuzz(up.routes()["stages"][stage][0], headers(),
               {"uid": new_uid(), "kind": "task", "app": "t2v", "stage": stage, "params": [1]}, guard)


# ---- events: the proxy's and the stages' subscriptions -------------------------------------------

def test_event_subscribers_survive_malformed_events(up):
    """A DB of the test's own joins the set: the proxy subscribes to its ``done`` events and the
    stages to its ``cancel`` events; what it publishes is drawn, then it leaves."""
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    sink = ctx.socket(zmq.PULL)  # its data address: what stages send it is taken and dropped
    sink.bind("tcp://127.0.0.1:*")
    control = ctx.socket(zmq.ROUTER)  # never answers: clients fail over to the real DB
    control.bind("tcp://127.0.0.1:*")
    addresses = {s: sock.getsockopt_string(zmq.LAST_ENDPOINT)
                 for s, sock in (("events", pub), ("data", sink), ("control", control))}
    member = Membership(up.nm, "db", "set0", addresses, deployment=up.deployment)
    member.register()
    member.start()
    try:
        subs: list[bytes] = []
        deadline = time.monotonic() + 30
        while (subs.count(b"\x01" + DONE) < 1 or subs.count(b"\x01" + CANCEL) < len(STAGES)) \
                and time.monotonic() < deadline:
            if pub.poll(200):
                subs.append(pub.recv())
        assert subs.count(b"\x01" + DONE) >= 1 and subs.count(b"\x01" + CANCEL) >= len(STAGES), subs

        @st.composite
        def events(draw) -> list[bytes]:
            # Within the subscribers' frame bound: a bigger one drops the connection (sent last).
            body = draw(_fields(_names(Event), JSON), label="body")
            topic = draw(st.sampled_from([DONE, CANCEL]), label="topic")
            return draw(mangled([topic, _dumps(body)]), label="frames")

        @FUZZ
        @given(frames=events())
        @example(frames=[DONE, b'{"uid": 7, "status": "completed"}'])
        @example(frames=[CANCEL, b'{"status": ""}'])
        def run(frames) -> None:
            pub.send_multipart(frames)  # (a topic nobody subscribed to goes nowhere)

        run()
        pub.send_multipart([DONE, b"x" * 100_000])  # over the subscribers' bound: they drop this publisher
    finally:
        member.stop()
        for sock in (pub, sink, control):
            sock.close()


# ---- and then ----------------------------------------------------------------------------------

def test_the_deployment_still_serves(up, tmp_path):
    """Every process is the one that started, and a real request completes."""
    assert up.proc.poll() is None
    assert _pids(up) == up.pids
    wait_for(lambda: len(up.routes()["dbs"]) == 1, timeout=30, what="the test's DB gone from the routes", interval=0.2)
    with Client(up.url) as c:
        v = c.submit("after the fuzz", model="t2v", size="32x32", num_frames=5, steps=2)
        # Not polled: only the DB's done event frees its slot, so the proxy's event watch still runs.
        wait_for(lambda: httpx.get(f"{up.url}/healthz").json()["inflight"] == 0, timeout=60,
                 what="the proxy's in-flight count back to 0", interval=0.2)
        assert c.wait(v["id"], timeout=10)["status"] == "completed"
    logs = {p.stem: p.read_text(errors="replace") for p in up.logs.glob("*.log")}
    assert any("refused a request from" in t for t in logs.values())  # the RPC checks answered
    assert any("dropped a malformed" in t for t in logs.values())  # the DB's data checks
    assert "'status' message from" in logs["set0-db0"]  # (its known example) the DB's data checks
    for stage in STAGES:  # its data checks and its events checks
        assert "malformed request at stage " + stage in logs[f"set0-{stage}0"]
        assert "ignored a cancel event from 127.0.0.1" in logs[f"set0-{stage}0"]
    assert "ignored a DB event from 127.0.0.1: event.uid" in logs["set0-proxy0"]
    broke = {name: t[t.index("Traceback"):][:2000] for name, t in logs.items() if "Traceback" in t}
    assert not broke, broke  # no guard of last resort was needed
