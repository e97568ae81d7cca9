"""A stage's schedule log (stage/schedule_log.py) and what the benchmarks make of it: the real
schedule in the simulator's terms (bench/sched.py) and the steps that shared the host's cores
with another stage (bench/sharing.py). The stage writing it for real is checked end to end in
test_e2e.py."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

from onepiece.bench.sched import real_schedule, save_schedule
from onepiece.bench.sharing import step_times, summary
from onepiece.cli import main
from onepiece.logrotate import rotate
from onepiece.stage.schedule_log import ScheduleLog, read


def test_chunks_are_read_back_in_order_across_rotations_and_torn_lines(tmp_path):
    path = tmp_path / "s.schedule.jsonl"
    log = ScheduleLog(path, "set0-denoise0")
    log.chunk("denoise", "w0", 10.0, 10.5, [[[0], ["a"], 2]], 2)
    rotate(path, 0, keep=2)  # the launcher's copy-then-truncate: the next line lands in a fresh file
    log.chunk("denoise", "w0", 11.0, 11.2, [[[0], ["a", "b"], 1]], 1)
    with open(path, "ab") as f:
        f.write(b'{"stage": "denoise", "start": 12.0, "parts": [[0]]}\n')  # JSON, but not a chunk
        f.write(b'{"stage": "denoise", "start": 1')  # torn by a crash mid-line
    got = read(path)
    assert [(c["start"], c["passes"], c["instance"]) for c in got] == [(10.0, 2, "set0-denoise0"),
                                                                        (11.0, 1, "set0-denoise0")]
    assert [c["start"] for c in read(path, since=10.5)] == [11.0]


def test_a_log_that_cannot_be_written_costs_the_lines_not_the_stage(tmp_path, caplog):
    folder = tmp_path / "logs"
    folder.mkdir()
    log = ScheduleLog(folder / "s.schedule.jsonl")
    os.chmod(folder, 0o500)
    if os.access(folder, os.W_OK):  # root writes anyway: take the folder away instead
        os.chmod(folder, 0o700)
        (folder / "s.schedule.jsonl").unlink(missing_ok=True)
        folder.rmdir()
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(3):
                log.chunk("denoise", "w0", 1.0, 2.0, [], 0)
        assert sum("cannot write the schedule log" in r.message for r in caplog.records) == 1  # said once
        folder.mkdir(exist_ok=True)
        os.chmod(folder, 0o700)
        log.chunk("denoise", "w0", 3.0, 4.0, [], 0)
        assert [c["start"] for c in read(folder / "s.schedule.jsonl")] == [3.0]
    finally:
        if folder.exists():
            os.chmod(folder, 0o700)


def records(t0: float) -> list[dict]:
    """Two requests of a trace as bench sched's client records them (server uids, epoch sends)."""
    return [{"uid": "u-first", "class": "S", "at": 0.0, "t_send": t0},
            {"uid": "u-second", "class": "L", "at": 2.0, "t_send": t0 + 2.0}]


def test_the_real_schedule_is_told_in_the_simulators_terms(tmp_path):
    t0 = 1_700_000_000.0
    den = ScheduleLog(tmp_path / "set0-denoise_t2v0.schedule.jsonl", "set0-denoise_t2v0")
    vae = ScheduleLog(tmp_path / "set0-vae_decode0.schedule.jsonl", "set0-vae_decode0")
    den.chunk("denoise_t2v", "w0", t0 - 5, t0 - 4, [[[0, 1], ["warm-up"], 3]], 3)  # before the trace: left out
    den.chunk("denoise_t2v", "w0", t0 + 0.1, t0 + 0.4, [[[0], ["u-first"], 4], [[1], ["u-second"], 1]], 4)
    vae.chunk("vae_decode", "w0", t0 + 0.5, t0 + 0.6, [[[0], ["u-first"], 1]], 1)
    den.chunk("denoise_t2v", "w0", t0 + 0.5, t0 + 1.0, [[[0, 1], ["u-second"], 5]], 3,
              [["u-first", -0.25, 6, False], ["someone-else", 1.0, 5, False]])  # passed over at its decision
    chunks = real_schedule(tmp_path, records(t0))
    assert [(c.stage, c.uids, c.steps, c.parts) for c in chunks] == [
        ("denoise_t2v", ("r0", "r1"), 4, ((1, ("r0",)), (1, ("r1",)))),
        ("denoise_t2v", ("r1",), 3, ((2, ("r1",)),)),  # the passes it ran, not the 5 planned
        ("vae_decode", ("r0",), 1, ((1, ("r0",)),))]
    assert chunks[0].start == pytest.approx(0.1) and chunks[1].end == pytest.approx(1.0)
    assert chunks[0].passed == () and chunks[1].passed == (("r0", -0.25, 6, False),)  # in the trace's names
    out = tmp_path / "sched-schedule-slo-1x.json"
    save_schedule(out, tmp_path, records(t0))
    events = json.loads(out.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {"set0-denoise_t2v0", "set0-vae_decode0"}
    assert [e["name"] for e in events if e["ph"] == "X"] == ["2x L+S (4 steps)", "1x L (3 steps)", "1x S (1 step)"]
    assert [e["args"].get("passed") for e in events if e["ph"] == "X"] == [None, [["r0", -0.25, 6, False]], None]


def test_steps_beside_another_stages_work_are_told_apart_from_steps_alone():
    def chunk(stage: str, start_ms: float, dur_ms: float, parts: list, steps: int) -> dict:
        return {"ph": "X", "ts": start_ms * 1000, "dur": dur_ms * 1000,
                "args": {"stage": stage, "steps": steps, "parts": parts, "uids": [u for _, us in parts for u in us]}}

    classes = {"r0": "S", "r1": "S", "r2": "M"}
    events = [chunk("denoise", 0, 40, [[2, ["r0"]]], 4),  # alone: 10 ms a pass
              chunk("denoise", 100, 40, [[2, ["r0"]]], 2),  # beside the VAE's call for all of it: 20 ms
              chunk("vae_decode", 90, 100, [[1, ["r2"]]], 1),
              chunk("denoise", 185, 20, [[2, ["r1"]]], 1),  # a quarter beside: neither side
              chunk("denoise", 300, 30, [[1, ["r0"]], [1, ["r2"]]], 1),  # two parts: left out
              chunk("denoise", 400, 60, [[2, ["r0", "r1"]]], 4)]  # alone, batch 2: 15 ms
    table = step_times(events, classes, "denoise")
    assert table == {("S", 2, 1): {"alone": [0.01], "beside": [0.02]}, ("S", 2, 2): {"alone": [0.015], "beside": []}}
    rows = {(r["class"], r["dop"], r["batch"]): r for r in summary(table)}
    assert rows[("S", 2, 1)]["ratio"] == pytest.approx(2.0) and rows[("S", 2, 2)]["ratio"] is None


def test_onepiece_schedule_draws_a_deployments_recent_chunks(tmp_path, capsys):
    """`onepiece schedule LOGS` turns the stages' logs into a Perfetto trace of the last minutes,
    each slice named by its batch's size and key; a folder without logs is refused, saying why."""
    now = time.time()
    den = ScheduleLog(tmp_path / "set0-denoise_t2v0.schedule.jsonl", "set0-denoise_t2v0")
    den.chunk("denoise_t2v", "w0", now - 3600, now - 3599, [[[0], ["old"], 2, "64x64x9/cfg/L64"]], 2)
    den.chunk("denoise_t2v", "w0", now - 2.0, now - 1.5, [[[0, 1], ["a", "b"], 3, "64x64x9/cfg/L64"]], 3)
    out = tmp_path / "s.json"
    with pytest.raises(SystemExit) as e:
        main(["schedule", str(tmp_path), "--last", "60", "--out", str(out)])
    assert e.value.code == 0
    slices = [ev for ev in json.loads(out.read_text())["traceEvents"] if ev["ph"] == "X"]
    assert [(s["name"], s["args"]["uids"], s["tid"]) for s in slices] == [("2x 64x64x9/cfg/L64 (3 steps)", ["a", "b"],
                                                                          "w0")]
    assert 57_000_000 < slices[0]["ts"] < 59_000_000  # 2 s before the end of the minute asked for
    quiet = tmp_path / "quiet"  # a deployment whose stages ran nothing yet: an empty trace
    quiet.mkdir()
    (quiet / "nm.log").write_text("")
    with pytest.raises(SystemExit) as e:
        main(["schedule", str(quiet), "--out", str(out)])
    assert e.value.code == 0 and not [ev for ev in json.loads(out.read_text())["traceEvents"] if ev["ph"] == "X"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as e:
        main(["schedule", str(empty)])
    assert e.value.code == 2 and "neither role logs nor *.schedule.jsonl here" in capsys.readouterr().err
