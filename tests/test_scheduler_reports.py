"""A stage scheduler's shell (stage/scheduler.py) between its core and its workers: what it does
with a run's report, and when it takes a worker for hung. Driven in process, on its real
sockets, with no worker process: the workers' side is what the test says it did."""

from __future__ import annotations

import queue
import time

import pytest

from onepiece.config import ConfigError, deploy_dir, load_workflow
from onepiece.sched.core import Run
from onepiece.sched.deadlines import stage_request
from onepiece.stage import scheduler as scheduler_module
from onepiece.stage.reports import Idle
from onepiece.stage.scheduler import RequestScheduler
from onepiece.transport import registry
from onepiece.transport.message import Message, new_uid
from waiting import wait_for

KEY = "64x64x9/cfg/L64"
PARAMS = {"prompt": "a fox", "negative_prompt": "", "width": 64, "height": 64, "num_frames": 9, "steps": 4,
          "guidance": 5.0, "seed": 1, "fps": 16, "max_sequence_length": 64}


def scheduler(tmp_path, **schedule) -> RequestScheduler:
    wf = load_workflow(deploy_dir() / "wan21.yaml")
    spec = wf.stages["denoise_t2v"]
    wf.stages["denoise_t2v"] = spec.model_copy(update={"schedule": spec.schedule.model_copy(update=schedule)})
    receiver = registry.listen(f"ipc://{tmp_path}/data.sock")
    s = RequestScheduler("denoise_t2v", receiver, f"ipc://{tmp_path}/workers.sock", wf, queue.Queue(64))
    s.core.worker_up("w0", 1)
    s.known.add(b"w0")
    return s


def start_one(s: RequestScheduler, expires_in: float, steps: int = 10) -> tuple[str, Run]:
    """A request on worker w0, in the run the core starts it with."""
    now = time.monotonic()
    uid = new_uid()
    s.core.add(stage_request(uid, "t2v", KEY, steps, now, now + expires_in, None, 0.0))
    s.msgs[uid] = Message({"uid": uid, "app": "t2v", "params": {}}, {})
    d = s.core.schedule(now)
    runs = [c for c in d.commands if isinstance(c, Run)]
    assert [r.uids for r in runs] == [(uid,)]
    s._run(runs[0], 0.0, d.passed)  # as _decide hands it over
    return uid, runs[0]


def close(s: RequestScheduler) -> None:
    s.close()
    s.receiver.close()


@pytest.mark.parametrize("drop,measured", [(True, False), (False, False), (False, True)])
def test_a_worker_is_taken_for_hung_past_its_requests_deadlines_only_where_they_are_dropped(tmp_path, drop,
                                                                                            measured):
    """With ``drop_expired`` (the default) a request past its deadline is dropped and the worker
    should stop at its next step: a chunk that runs on well past every member's deadline is
    hung. Without it the request is kept, so its deadline says nothing about the chunk: before,
    such a worker was killed as hung, and every request it held failed with it. A kept chunk is
    hung once it has also outlasted its steps, where they were measured."""
    s = scheduler(tmp_path, drop_expired=drop)
    try:
        if measured:
            s.core.costs.observe(KEY, 1, 0.1)
        t0 = time.monotonic()
        uid, run = start_one(s, expires_in=0.05)
        if measured:  # its chunk's steps, 0.1 s each, from its start (between these two readings)
            assert t0 + run.steps * 0.1 <= s.running[b"w0"][3] <= time.monotonic() + run.steps * 0.1
        # past the deadline, the chunk's steps and the grace (the check is told the time)
        s._reclaim_hung(time.monotonic() + run.steps * 0.1 + scheduler_module.HUNG_GRACE_S + 1.0)
        hung = drop or measured
        assert (b"w0" in s.running) is not hung
        assert (uid in s.core.requests) is not hung  # failed with the worker, or still running
    finally:
        close(s)


def test_a_report_the_scheduler_cannot_learn_from_still_frees_its_worker(tmp_path, monkeypatch):
    """A fault in what a run's report teaches (a cost table whose step of 5e-324 s divided the
    chunk rule by zero did it; tables are checked now, so the fault is injected here) must not
    leave the worker marked busy until the hung killer fires."""
    s = scheduler(tmp_path)
    try:
        uid, _ = start_one(s, expires_in=60.0, steps=2)
        r = s.core.requests[uid]
        s.sample_later["w0"] = [r]

        def broken(_r):
            raise ZeroDivisionError("float division by zero")

        monkeypatch.setattr(s, "_sample", broken)
        with pytest.raises(ZeroDivisionError):
            s._report(b"w0", Idle(steps=[([uid], 0.01)], fixed={}, exec_s=0.01))
        assert b"w0" not in s.running and s.core.workers["w0"].idle
        assert [c.worker for c in s.core.schedule(time.monotonic()).commands] == ["w0"]  # it runs again
    finally:
        close(s)


def test_a_plan_the_core_refuses_is_shown_to_the_operator(tmp_path) -> None:
    """A policy's plan that the core refuses runs nothing (a policy bug: two such froze a stage
    until its requests expired, while `onepiece status` showed only an idle worker and a full
    queue). The stage's stats count it with the last reason, and `onepiece status` shows them."""
    from onepiece.sched.policy import Batch, Policy
    from onepiece.status import render

    class Bad(Policy):
        name = "bad"

        def plan(self, view):
            return [Batch("w0", ("nobody",), 1)]

    s = scheduler(tmp_path)
    try:
        s.core.policy = Bad()
        now = time.monotonic()
        s.core.add(stage_request(new_uid(), "t2v", KEY, 10, now, now + 60, None, 0.0))
        assert s.core.schedule(now).commands == []
        s._update_stats()
        assert s.stats.refused == 1 and "unknown" in s.stats.last_refused
        inst = {"id": "set0-denoise_t2v0", "role": "stage", "stage": "denoise_t2v", "serving": "denoise_t2v",
                "ready": True, "silent_s": 0.1, "addresses": {"data": "ipc://x"}, "stats": s.stats.report()}
        text = render({"sets": {"set0": {"stages": {"denoise_t2v": {"want": 1, "instances": [inst]}}, "idle": [],
                                          "dbs": [], "proxies": []}}})
        assert "refused 1 plan(s) of its policy, the last: bad:" in text, text
        assert "workers up" not in text  # its one worker is up
        inst["stats"] = {**inst["stats"], "workers": 1, "ready": 0}  # its worker restarting: still routed
        text = render({"sets": {"set0": {"stages": {"denoise_t2v": {"want": 1, "instances": [inst]}}, "idle": [],
                                          "dbs": [], "proxies": []}}})
        assert "busy 0/1 (workers up 0/1)" in text, text
    finally:
        close(s)


def test_a_stage_starts_from_its_tables_per_request_figures_too(tmp_path) -> None:
    """``schedule.costs`` gives rows and ``fixed`` (what a request costs besides its steps, as
    `bench sched` writes it): the stage took the rows alone, so until a request of a key had
    finished there, its standalone time (what the deadline split and the monitor read) left out
    what the table said, while the simulator, priced by the same table, charged it."""
    import orjson
    import yaml

    from onepiece.nm.holdings import Holdings
    from onepiece.sched.costs import make_table
    from onepiece.stage.runtime import StageRuntime

    table = make_table({"denoise_t2v": [{"key": KEY, "batch": 1, "seconds": 0.01}]}, {"denoise_t2v": {KEY: 0.25}})
    (tmp_path / "costs.json").write_bytes(orjson.dumps(table))
    doc = yaml.safe_load((deploy_dir() / "wan21.yaml").read_text())
    doc["stages"]["denoise_t2v"]["schedule"] = {"policy": "fcfs", "costs": "costs.json"}
    (tmp_path / "wf.yaml").write_text(yaml.safe_dump(doc))
    wf = load_workflow(tmp_path / "wf.yaml")
    receiver = registry.listen(f"ipc://{tmp_path}/data.sock")
    rt = StageRuntime("i0", "denoise_t2v", wf, tmp_path, receiver, tmp_path, Holdings(), lambda: {}, lambda: None)
    try:
        core = rt.scheduler.core
        assert core.costs.fixed_s(KEY) == 0.25
        assert core.standalone_s(stage_request("u", "t2v", KEY, 10, 0.0, 60.0, None, 0.0)) == pytest.approx(0.35)
    finally:
        close(rt.scheduler)
    # and a bad figure there is refused as the workflow loads, as a bad row is (not at the stage's start)
    table["stages"]["denoise_t2v"]["fixed"][0]["seconds"] = -1
    (tmp_path / "costs.json").write_bytes(orjson.dumps(table))
    with pytest.raises(ConfigError, match=r"schedule.costs: .*costs.json: stages.denoise_t2v.fixed\[0\]"):
        load_workflow(tmp_path / "wf.yaml")


def test_a_worker_notes_a_cut_for_its_run_and_refuses_a_malformed_one(caplog) -> None:
    """What a worker makes of a ``cut`` frame (stage/worker.py): the run it names and where; a
    malformed one is a scheduler bug, logged, and cuts nothing."""
    import orjson
    import zmq

    from onepiece.stage.worker import _cut

    cuts: dict[int, int] = {}
    _cut([zmq.Frame(b"cut"), zmq.Frame(orjson.dumps({"run": 7, "every": 2}))], cuts)
    assert cuts == {7: 2}
    for bad in (b"{", orjson.dumps({"run": 8}), orjson.dumps({"run": "8", "every": 2}),
                orjson.dumps({"run": 8, "every": 0}), orjson.dumps([1, 2])):
        _cut([zmq.Frame(b"cut"), zmq.Frame(bad)], cuts)
    _cut([zmq.Frame(b"cut")], cuts)  # no body at all
    assert cuts == {7: 2}
    assert caplog.text.count("malformed cut command") == 6


def test_an_idle_wait_that_a_request_ends_is_not_busy_time(tmp_path, monkeypatch) -> None:
    """Utilization (what the NM's elastic policy moves instances on) is the time workers run:
    the shell's loop counts the time since its last turn as it was *before* the turn (counted
    after it, the idle wait that a request's arrival ended was busy time, and made a nearly idle
    text_encode look nearly fully busy). The loop runs on its real sockets; its idle turn is
    stretched so that the wait is long and the check does not depend on the machine's speed."""
    import threading

    monkeypatch.setattr(scheduler_module, "IDLE_TURN_MS", 60_000)
    s = scheduler(tmp_path)
    s.stepped = {"t2v": True}  # as w0's ready report says
    s.stats.workers = 1  # as its TaskManager sets it
    stop = threading.Event()
    loop = threading.Thread(target=s.run, args=(stop,), daemon=True)
    sender = registry.connect(s.receiver.address)
    try:
        loop.start()
        time.sleep(2.0)  # (on purpose) the loop waits idle, for up to a minute: the wait measured below
        uid = new_uid()
        sender.send(Message({"uid": uid, "app": "t2v", "stage": "denoise_t2v", "params": PARAMS,
                             "deadline": time.time_ns() + int(60e9)}, {}))
        wait_for(lambda: b"w0" in s.running, 30, "its run sent to w0 (no process there)", interval=0.01)
        # Busy from the run's start on only: at most the moments since (not the 2 s wait before it).
        assert s.stats.busy_s < 1.0, s.stats.busy_s
        assert s.stats.slot_s >= 2.0  # the wait was counted, as idle
    finally:
        stop.set()
        s.wake.set()
        loop.join(10)
        sender.close()
        close(s)
