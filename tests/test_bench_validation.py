"""`onepiece bench validation`: a small run through the CLI writes both files with every
message kind; each message it times passes its receiver's checks (else the bench would time
the error path), and a broken one does not. Figures are not asserted."""

from __future__ import annotations

import json

import pytest

from onepiece.bench.validation import NAMES, messages, validators
from onepiece.cli import main


def test_a_small_run_writes_every_kind(tmp_path):
    with pytest.raises(SystemExit) as done:
        main(["bench", "validation", "--n", "50", "--repeats", "1", "--out", str(tmp_path)])
    assert done.value.code == 0
    doc = json.loads((tmp_path / "validation.json").read_text())
    assert set(doc["messages"]) == set(NAMES)
    for row in doc["messages"].values():
        assert row["validation_us"] > 0 and row["transport_us"] > 0
        assert row["share"] == pytest.approx(row["validation_us"] / row["transport_us"])
    assert all(name in (tmp_path / "validation.md").read_text() for name in NAMES.values())


def test_the_checks_timed_are_the_real_ones():
    msgs, checks = messages(), validators()
    for kind, msg in msgs.items():
        checks[kind](msg)
    broken = {"task": {**msgs["task"], "params": {**msgs["task"]["params"], "steps": 10**6}},
              "rpc": {"uid": 7}, "heartbeat": {**msgs["heartbeat"], "stats": {"queue": -1}},
              "db_status": {**msgs["db_status"], "progress": 101}}
    for kind, msg in broken.items():
        with pytest.raises(ValueError):
            checks[kind](msg)


def test_bad_flags_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "validation", "--n", "0", "--out", str(tmp_path)])
    assert "argument --n: must be an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "validation.json").exists()
