"""The rate limit on dropped-message log lines (onepiece/droplog.py): pure, on a fake clock."""

from __future__ import annotations

import logging

import pytest

from onepiece import droplog
from onepiece.droplog import OTHER, DropLimiter, kind_of


def admit(lim: DropLimiter, receiver: str, reason: str) -> tuple[bool, int]:
    return lim.admit(receiver, reason)[:2]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_flood_logs_the_first_few_then_one_summary_per_interval():
    clock = Clock()
    lim = DropLimiter(burst=3, interval_s=10, clock=clock)
    got = [admit(lim, "db0", "steps: too large") for _ in range(1000)]
    assert got[:3] == [(True, 0)] * 3 and set(got[3:]) == {(False, 0)}
    clock.t = 9.9
    assert admit(lim, "db0", "steps: too large") == (False, 0)  # still the first interval
    clock.t = 10.0
    assert admit(lim, "db0", "steps: other words") == (True, 998)  # the summary rides on the next line
    assert [admit(lim, "db0", "steps: x") for _ in range(3)] == [(True, 0), (True, 0), (False, 0)]
    clock.t = 100.0
    assert admit(lim, "db0", "steps: x") == (True, 1)


def test_receivers_and_reasons_are_limited_apart():
    lim = DropLimiter(burst=1, interval_s=10, clock=Clock())
    assert admit(lim, "db0", "steps: a") == (True, 0)
    assert admit(lim, "db0", "steps: b") == (False, 0)  # same kind: the quoted values differ
    assert admit(lim, "db0", "seed: a") == (True, 0)
    assert admit(lim, "nm", "steps: a") == (True, 0)


def test_varied_reasons_cannot_grow_the_table_or_get_past_the_limit():
    clock = Clock()
    lim = DropLimiter(burst=1, interval_s=10, max_kinds=4, clock=clock)
    shown = sum(lim.admit("db0", f"field{chr(97 + i % 26)}{i // 26}x: bad")[0] for i in range(10_000))
    assert shown == 4 + 1  # four kinds, then everything else of db0 as one
    assert len(lim._windows) == 5 and lim.admit("db0", "fieldq9x: bad") == (False, 0, OTHER)
    assert admit(lim, "db1", "fieldz: bad") == (True, 0)  # another receiver has its own kinds
    # Windows that ended with nothing unlogged are forgotten when room is needed.
    lim2 = DropLimiter(burst=5, interval_s=10, max_kinds=2, clock=clock)
    admit(lim2, "a", "x"), admit(lim2, "a", "y")
    assert admit(lim2, "a", "z") == (True, 0) and ("a", "z") not in lim2._windows  # now: OTHER
    clock.t = 40.0
    assert admit(lim2, "a", "w") == (True, 0) and ("a", "w") in lim2._windows


def test_kind_of_keeps_the_field_path_only():
    assert kind_of("params.steps: Input should be less than 100") == "params.steps"
    assert kind_of("undecodable (ValueError: x)") == "undecodable (ValueError"
    assert len({kind_of(f"part {name!r} is bytes, not a tensor") for name in ("a'b", "zz", 'q"')}) == 1
    assert kind_of("expected at least 2 frames, got 1") == "expected at least _ frames, got _"
    assert kind_of('unknown op "x"') == "unknown op _"
    assert len(kind_of("a" * 1000)) == 64


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        DropLimiter(burst=0)


def test_log_dropped_writes_the_lines(monkeypatch, caplog):
    clock = Clock()
    monkeypatch.setattr(droplog, "_limiter", DropLimiter(burst=2, interval_s=5, clock=clock))
    log = logging.getLogger("test.droplog")
    with caplog.at_level(logging.WARNING, "test.droplog"):
        for i in range(50):
            droplog.log_dropped(log, "db0", "kind: bad", "db0 dropped #%d", i)
        clock.t = 6
        droplog.log_dropped(log, "db0", "kind: bad", "db0 dropped #%d", 50)
    assert [r.getMessage() for r in caplog.records] == [
        "db0 dropped #0", "db0 dropped #1",
        "db0: … and 48 more dropped for 'kind' (not logged: over 2 per 5 s)", "db0 dropped #50"]
