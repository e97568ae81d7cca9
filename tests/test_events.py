"""The DB events channel's check (onepiece/events.py): what its subscribers take, and what not."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onepiece.events import CANCEL, DONE, event_frames, read_event


def test_what_a_db_publishes_reads_back():
    assert read_event(event_frames(DONE, "u1", "completed"), DONE).uid == "u1"
    assert read_event(event_frames(CANCEL, "u2", ""), CANCEL).status == ""
    assert read_event(event_frames(DONE, "u1", "failed"), DONE).service_s is None
    assert read_event(event_frames(DONE, "u1", "completed", 0.25), DONE).service_s == 0.25


@pytest.mark.parametrize("frames, why", [
    ([DONE], "frames: expected"),
    ([DONE, b"{}", b"extra"], "frames: expected"),
    ([CANCEL, b'{"uid": "u", "status": ""}'], "frames: expected"),  # another topic
    ([DONE, b"{not json"], "body: not JSON"),
    ([DONE, b"[1]"], "event: Input should be"),
    ([DONE, b'{"uid": 7, "status": "failed"}'], "event.uid: Input should be a valid string"),
    ([DONE, b'{"uid": "u", "status": "done"}'], "event.status: Input should be"),
    ([DONE, b'{"uid": "u", "status": "completed", "service_s": -1}'], "event.service_s: Input should be greater"),
    ([DONE, b'{"uid": "u", "status": "completed", "service_s": "soon"}'], "event.service_s: Input should be a valid number"),
    ([DONE, orjson.dumps({"uid": "u" * 129, "status": "failed"})], "event.uid: String should have at most 128"),
])
def test_a_malformed_event_says_what_is_wrong(frames, why):
    with pytest.raises(ValueError, match=why):
        read_event(frames, DONE)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_any_frames_are_an_event_or_a_value_error(frames):
    try:
        read_event(frames, DONE)
    except ValueError:
        pass
