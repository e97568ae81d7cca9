"""`onepiece bench mp4`: a small run through the CLI writes every setting's row, with files that
decode to the frames it encoded; bad shapes are refused. Figures are not asserted."""

from __future__ import annotations

import json

import pytest

from onepiece.bench.mp4 import SETTINGS
from onepiece.cli import main


def test_a_small_run_writes_every_setting(tmp_path):
    with pytest.raises(SystemExit) as done:
        main(["bench", "mp4", "--shapes", "64x48x5", "--repeats", "1", "--out", str(tmp_path)])
    assert done.value.code == 0
    rows = json.loads((tmp_path / "mp4.json").read_text())["rows"]
    assert [r["setting"] for r in rows] == list(SETTINGS)
    for r in rows:
        assert r["shape"] == "64x48x5" and r["cpu_ms"] > 0 and r["kib"] > 0
        assert 25 < r["psnr_db"] < 80  # lossy, and of the frames it was given (another video is far lower)
    assert "shipped" in (tmp_path / "mp4.md").read_text()


# 100000x100000x1 asked for 149 GiB of frames: shapes stay within the largest a workflow serves
@pytest.mark.parametrize("shapes", ["64x64", "65x64x5", "64x64x0", "axbxc", "100000x100000x1", "64x64x82"])
def test_bad_shapes_are_refused(tmp_path, capsys, shapes):
    with pytest.raises(SystemExit) as done:
        main(["bench", "mp4", "--shapes", shapes, "--out", str(tmp_path)])
    assert done.value.code == 2 and "argument --shapes: " in capsys.readouterr().err
