"""`onepiece bench moves`: a small run through the CLI writes every variant's cell (the
simulator is deterministic, so a rerun gives the same figures); bad flags are refused."""

from __future__ import annotations

import json

import pytest

from onepiece.bench.moves import VARIANTS
from onepiece.cli import main


def run(tmp_path, *flags: str) -> dict:
    with pytest.raises(SystemExit) as done:
        main(["bench", "moves", "--requests", "60", "--loads", "0.8", "--alphas", "1.5", "--out", str(tmp_path),
              *flags])
    assert done.value.code == 0
    return json.loads((tmp_path / "moves.json").read_text())


def test_a_small_run_writes_every_variant_and_repeats_itself(tmp_path):
    doc = run(tmp_path)
    (row,) = doc["rows"]
    assert list(row["variants"]) == list(VARIANTS)
    for v in row["variants"].values():
        assert v["n"] == 60 and 0 <= v["missed"] <= 60 and v["moves"] >= v["returns"] >= 0
    assert run(tmp_path)["rows"] == doc["rows"]
    assert "never return" in (tmp_path / "moves.md").read_text()


@pytest.mark.parametrize("flags", [["--loads", "0.5,x"], ["--alphas", "-1"], ["--denoise", "0"]])
def test_bad_flags_are_refused(tmp_path, flags, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "moves", "--out", str(tmp_path), *flags])
    assert flags[0] in str(e.value) + capsys.readouterr().err  # argparse's refusal, or the run's
