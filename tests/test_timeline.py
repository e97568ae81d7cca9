"""tests/timeline.py's summary: busy and waiting seconds per test process, and what the waits
were behind (the records are what its plugin writes: test, asked, started, ended)."""

from __future__ import annotations

import json

import pytest

from timeline import summary


def row(test: str, kind: str, asked: float, started: float, ended: float, setup: float = 0.0, call: float = 0.0,
        teardown: float = 0.0, body: tuple[float, float] | None = None) -> dict:
    body_asked, body_started = body or (started + setup,) * 2
    return {"test": test, "kind": kind, "asked": asked, "started": started, "ended": ended, "setup": setup,
            "call": call, "teardown": teardown, "body_asked": body_asked, "body_started": body_started}


def test_the_summary_counts_waits_and_names_what_they_were_behind(tmp_path):
    (tmp_path / "gw0.json").write_text(json.dumps([row("a::slow", "slow", 100.0, 100.0, 110.0, 8.0, 2.0),
                                                   row("a::next", "rest", 110.0, 115.0, 116.0, 0.0, 1.0)]))
    # b::alone got its turn at 100.5, set up for 4 s beside a::slow, waited from 104.5 to 110 to
    # run its body alone (a::slow's end), ran it for 3.5 s and tore down for 1.5 s
    (tmp_path / "gw1.json").write_text(json.dumps([row("b::alone", "exclusive", 100.0, 100.5, 115.0, 4.0, 9.0, 1.5,
                                                       body=(104.5, 110.0))]))
    text = summary(tmp_path)
    assert text.splitlines()[:4] == [
        "16 s from the first test asking for its turn to the last one ending",
        "gw0: 2 tests, 11 s running, 5 s waiting for a turn",
        "gw1: 1 tests, 9 s running, 6 s waiting for a turn",
        "exclusive bodies 4 s; slow tests and exclusive set-ups 14 s; the rest and exclusive teardowns 2 s",
    ]
    # gw0's 5 s wait (110-115) was behind b::alone; gw1's waits (100-100.5 and 104.5-110) behind a::slow
    assert "     5.0  b::alone" in text and "     6.0  a::slow" in text


def test_no_timeline_is_an_error_that_says_how_to_make_one(tmp_path):
    with pytest.raises(SystemExit, match="-p timeline"):
        summary(tmp_path)
