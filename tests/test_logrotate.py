"""A role's log stays within its bound while the role writes on (onepiece/logrotate.py): a real
process appending to its log as `onepiece up`'s children do, the file rotated under it."""

from __future__ import annotations

import subprocess
import sys

from onepiece.logrotate import rotate
from waiting import wait_for

WRITER = """
import sys, time
i = 0
while True:
    print(f"line {i:08d}", flush=True)
    i += 1
    time.sleep(0.0005)
"""


def test_a_log_written_on_is_rotated_within_its_bound_and_keeps_its_newest_parts(tmp_path) -> None:
    path = tmp_path / "stage.log"
    with open(path, "ab", buffering=0) as out:  # as onepiece/launcher.py's Child.start opens it
        writer = subprocess.Popen([sys.executable, "-c", WRITER], stdout=out, stderr=subprocess.STDOUT)
    try:
        rotations = 0
        for _ in range(5):
            wait_for(lambda: path.stat().st_size > 4000, timeout=30, what="the log past its bound")
            assert rotate(path, 4000, keep=2)
            rotations += 1
        wait_for(lambda: path.stat().st_size > 0, timeout=30, what="lines after the last rotation")
    finally:
        writer.kill()
        writer.wait()
    assert rotations == 5 and not rotate(tmp_path / "nothing.log", 1, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage.log", "stage.log.1", "stage.log.2"]
    numbers = []
    for name in ("stage.log.2", "stage.log.1", "stage.log"):
        data = (tmp_path / name).read_bytes()
        assert b"\0" not in data  # the writer went on at the start of the emptied file, not past a hole
        lines = [ln for ln in data.decode().splitlines() if ln.startswith("line ")]
        numbers.append([int(ln.split()[1]) for ln in lines])
    # Oldest part first, each in order, and each part's lines after the previous part's.
    assert all(ns == sorted(ns) and ns for ns in numbers)
    assert numbers[0][-1] < numbers[1][0] and numbers[1][-1] < numbers[2][0]
    assert not rotate(path, 1 << 30, keep=2)  # within its bound: left alone
