"""`onepiece bench failover` runs end to end and writes sane files: one SIGKILL and one SIGTERM
of the primary NM of a real deployment on a real 3-server ZooKeeper ensemble, under load. The
figures themselves come from the full run (bench/results/failover.md)."""

from __future__ import annotations

import argparse
import json

import pytest

import zk_harness
from onepiece.bench import failover

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]


@pytest.mark.exclusive
def test_smoke_run_writes_sane_files(tiny_models, tmp_path):
    why = zk_harness.missing()
    if why:
        pytest.skip(f"needs a real ZooKeeper ensemble: {why}")
    p = argparse.ArgumentParser()
    failover.add_arguments(p)
    args = p.parse_args(["--kills", "1", "--graceful", "1", "--load", "1", "--models", str(tiny_models["t2v"].parent),
                         "--out", str(tmp_path / "out")])
    assert failover.run(args) == 0  # nonzero when a request of the load failed or hung
    result = json.loads((tmp_path / "out" / "failover.json").read_text())
    kinds = [r["kind"] for r in result["rounds"]]
    assert kinds == ["sigkill", "graceful"]
    kill, grace = result["rounds"]
    assert kill["from"] != kill["to"] and grace["from"] != grace["to"]
    assert 1.0 < kill["serving_s"] < 2.0 + 2.5  # a 2 s session expires on the server, then the takeover
    assert grace["serving_s"] < 1.0
    assert result["load"]["failed"] == result["load"]["hung"] == result["load"]["error"] == 0
    md = (tmp_path / "out" / "failover.md").read_text()
    assert "| SIGKILL | 1 |" in md and "| SIGTERM (graceful) | 1 |" in md


def test_bad_arguments_stop_before_anything_starts(tmp_path, capsys):
    p = argparse.ArgumentParser()
    failover.add_arguments(p)
    with pytest.raises(SystemExit, match="some round"):
        failover.run(p.parse_args(["--kills", "0", "--graceful", "0", "--out", str(tmp_path)]))
    for argv, error in ((["--session", "0.2"], "argument --session: must be between 1 and 600 seconds"),
                        (["--shape", "64x64"], "argument --shape: bad shape '64x64'")):
        with pytest.raises(SystemExit):  # refused as it is read
            p.parse_args(argv)
        assert error in capsys.readouterr().err
