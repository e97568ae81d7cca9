"""`onepiece up`'s supervisor outlives a log folder it cannot write (onepiece/launcher.py):
a role whose log cannot be opened or rotated is tried again; the others go on being supervised.
Its death stopped the whole deployment."""

from __future__ import annotations

import logging
import shutil
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

from onepiece.config import LogSpec
from onepiece.launcher import Child, Deployment
from waiting import wait_for


def _supervise(children: list[Child], logs: LogSpec) -> tuple[threading.Thread, threading.Event, list[BaseException]]:
    dep = SimpleNamespace(topo=SimpleNamespace(logs=logs), children=children)
    stop, errors = threading.Event(), []

    def run() -> None:
        try:
            Deployment.supervise(dep, stop)  # type: ignore[arg-type]
        except BaseException as e:  # noqa: BLE001 - what killed the supervisor
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, stop, errors


def _child(log_path: Path, code: str) -> Child:
    return Child("set0-x", [sys.executable, "-c", code, "stage"], log_path)


def test_a_role_whose_log_folder_is_gone_is_restarted_once_it_is_back(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    flag = tmp_path / "go"
    # Exits until the flag exists, then stays up (a role that died and comes back).
    child = _child(logs / "x.log", f"import os, sys, time\nif not os.path.exists({str(flag)!r}): sys.exit(3)\n"
                                   f"print('up', flush=True)\ntime.sleep(60)")
    child.start()
    t, stop, errors = _supervise([child], LogSpec())
    try:
        shutil.rmtree(logs)  # the log folder's filesystem is gone (unmounted, say)
        wait_for(lambda: child.backoff.failures >= 3 or errors, timeout=30, what="restarts that cannot open the log")
        assert not errors and t.is_alive(), errors
        logs.mkdir()
        flag.touch()
        wait_for(lambda: (logs / "x.log").exists() and b"up" in (logs / "x.log").read_bytes(), timeout=60,
                 what="the role started again")
        assert not errors and t.is_alive(), errors
    finally:
        stop.set()
        t.join(10)
        if child.proc is not None:
            child.proc.kill()
            child.proc.wait()


def test_a_log_that_cannot_be_rotated_leaves_the_supervisor_running(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="onepiece.launcher")
    log_path = tmp_path / "x.log"
    (tmp_path / "x.log.1").mkdir()  # where the rotated part goes cannot be written
    child = _child(log_path, "import sys, time\nsys.stdout.write('x' * 4096)\nsys.stdout.flush()\ntime.sleep(60)")
    child.start()
    wait_for(lambda: log_path.stat().st_size >= 4096, timeout=30, what="the role's log past its bound")
    t, stop, errors = _supervise([child], LogSpec(max_mb=0.001, keep=1))
    try:
        wait_for(lambda: errors or any("cannot rotate" in r.getMessage() for r in caplog.records), timeout=30,
                 what="a rotation tried")
        assert not errors and t.is_alive(), errors
        assert child.proc.poll() is None
        (tmp_path / "x.log.1").rmdir()
        wait_for(lambda: (tmp_path / "x.log.1").is_file(), timeout=30, what="the rotation once it can be done")
        assert sum("cannot rotate" in r.getMessage() for r in caplog.records) == 1  # said once, not each round
    finally:
        stop.set()
        t.join(10)
        child.proc.kill()
        child.proc.wait()


def test_a_stages_schedule_log_is_kept_within_the_bound_of_its_log(tmp_path: Path) -> None:
    """A stage appends a line per chunk to ``<name>.schedule.jsonl`` beside its log: the
    supervisor rotates it as it does the log, and the lines written after a rotation land in the
    file of that name (stage/schedule_log.py opens it for each line)."""
    schedule = tmp_path / "x.schedule.jsonl"
    code = ("import sys, time\nfrom onepiece.stage.schedule_log import ScheduleLog\n"
            f"log = ScheduleLog({str(schedule)!r}, 'set0-x')\n"
            "for i in range(100000):\n"
            "    log.chunk('denoise', 'w0', float(i), float(i) + 0.5, [[[0], ['u%d' % i], 1]], 1)\n"
            "    time.sleep(0.02)\n")  # about 5 KB a second: a quarter of the bound per supervisor round
    child = Child("set0-x", [sys.executable, "-c", code, "stage"], tmp_path / "x.log", schedule_log=schedule)
    child.start()
    t, stop, errors = _supervise([child], LogSpec(max_mb=0.01, keep=1))
    try:
        wait_for(lambda: (tmp_path / "x.schedule.jsonl.1").is_file() and schedule.exists()
                 and schedule.stat().st_size > 0, timeout=60, what="the schedule log rotated, and written on")
        assert not errors and t.is_alive(), errors
        assert not (tmp_path / "x.schedule.jsonl.2").exists()  # keep=1: one old part
        for path in (schedule, tmp_path / "x.schedule.jsonl.1"):
            assert path.stat().st_size < 3 * 0.01 * 2**20  # within a round's writing of its bound
    finally:
        stop.set()
        t.join(10)
        child.proc.kill()
        child.proc.wait()
