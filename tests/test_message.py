"""The message format: round trips without pickle, and rejects what it cannot trust."""

import numpy as np
import orjson
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from onepiece.transport.message import MAGIC, Message, MessageError, decode, encode, new_uid, service_s


def frames_of(msg: Message) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


def test_round_trip_tensors_arrays_and_bytes():
    parts = {
        "f32": torch.randn(2, 3, 4),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "u8": np.arange(12, dtype=np.uint8).reshape(3, 4),
        "blob": b"\x00\x01mp4",
        "empty": torch.zeros(0, 7),
        "noncontig": torch.randn(4, 6).t(),
    }
    msg = Message({"uid": new_uid(), "app": "t2v", "params": {"prompt": "a cat"}}, parts)
    out = decode(frames_of(msg))
    assert out.header["params"] == {"prompt": "a cat"}
    for name in ("f32", "bf16", "empty", "noncontig"):
        assert torch.equal(out.tensor(name), parts[name].contiguous())
    assert np.array_equal(out.parts["u8"], parts["u8"])
    assert out.blob("blob") == b"\x00\x01mp4"


def test_header_describes_parts():
    frames = frames_of(Message({"uid": "u1"}, {"x": torch.ones(2, 2, dtype=torch.float16)}))
    header = orjson.loads(frames[1])
    assert header["parts"] == [{"name": "x", "dtype": "float16", "shape": [2, 2], "nbytes": 8}]


def test_uids_are_unique_and_long():
    uids = {new_uid() for _ in range(1000)}
    assert len(uids) == 1000 and all(len(u) == 32 for u in uids)


def _bad_header(frames, **changes):
    h = orjson.loads(frames[1])
    for k, v in changes.items():
        if k == "part0":
            h["parts"][0].update(v)
        else:
            h[k] = v
    return [frames[0], orjson.dumps(h), *frames[2:]]


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda f: f[:1], "at least 2 frames"),
        (lambda f: [b"NOPE", *f[1:]], "magic"),
        (lambda f: [f[0], b"{not json", *f[2:]], "not JSON"),
        (lambda f: [f[0], b"[1,2]", *f[2:]], "not a JSON object"),
        (lambda f: f[:-1], "describes 1 parts but 0 frames"),
        (lambda f: [*f[:-1], f[-1][:-3]], "header says"),
        (lambda f: _bad_header(f, uid=None), "no uid"),
        (lambda f: _bad_header(f, part0={"dtype": "complex512"}), "unknown dtype"),
        (lambda f: _bad_header(f, part0={"shape": [3, 3]}), "needs"),
        (lambda f: _bad_header(f, part0={"shape": "big"}), "bad shape"),
        (lambda f: _bad_header(f, parts="x"), "must be a list"),
    ],
)
def test_malformed_frames_are_rejected_with_reason(mutate, reason):
    frames = frames_of(Message({"uid": "u1"}, {"x": torch.ones(4)}))
    with pytest.raises(MessageError, match=reason):
        decode(mutate(frames))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_random_frames_never_crash_decode(frames):
    try:
        decode([MAGIC, *frames])
    except MessageError:
        pass


_json = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3), max_leaves=6)
_part = st.fixed_dictionaries({
    "name": st.one_of(st.sampled_from(["a", "b"]), _json),
    "dtype": st.one_of(st.sampled_from(["float32", "bfloat16", "uint8", "bytes", "int64", "complex64"]), _json),
    "shape": st.one_of(st.lists(st.one_of(st.integers(-2, 2**63 - 1), st.booleans(), st.floats()), max_size=9), _json),
    "nbytes": st.one_of(st.integers(-1, 64), st.booleans(), _json),
})


@settings(max_examples=500, deadline=None)
@given(st.lists(_part, max_size=3), st.lists(st.binary(max_size=64), max_size=4))
def test_well_formed_headers_with_hostile_part_descriptions_never_crash(descs, payloads):
    """Headers that parse, describing parts with any shape, dtype or size: decode either
    returns parts whose sizes match their frames or raises MessageError, nothing else."""
    frames = [MAGIC, orjson.dumps({"uid": "u", "parts": descs}), *payloads]
    try:
        msg = decode(frames)
    except MessageError:
        return
    for (name, part), payload in zip(msg.parts.items(), payloads):
        assert (part.nbytes if hasattr(part, "nbytes") else len(part)) == len(payload)


def test_the_stages_time_is_read_from_the_trace():
    """Each stage's start to its end; hops, queue waits and malformed points do not count."""
    msg = Message({"uid": "u1"}, {})
    trace = [{"stage": "proxy", "event": "leave", "t": 0},
             {"stage": "a", "event": "recv", "t": 10}, {"stage": "a", "event": "start", "t": 2 * 10**8},
             {"stage": "a", "event": "end", "t": 5 * 10**8},
             {"stage": "b", "event": "recv", "t": 6 * 10**8}, "junk", {"stage": "b", "event": "start", "t": 1.5},
             {"stage": "b", "event": "start", "t": 7 * 10**8}, {"stage": "b", "event": "end", "t": 8 * 10**8},
             {"stage": "c", "event": "end", "t": 9 * 10**8}]  # an end with no start: no span
    assert service_s(trace) == pytest.approx(0.4)
    assert service_s(trace[:3]) is None and service_s(None) is None and service_s({"t": 1}) is None
    for stage in ("a", "b"):  # what workers write
        msg.mark(stage, "start")
        msg.mark(stage, "end")
    assert 0 <= service_s(msg.header["trace"]) < 1
