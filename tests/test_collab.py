"""Collaboration groups (issue 13): the Wan2.1 transformer denoised across 2 ranks (gloo, real
processes) gives what one worker gives, whatever the degree of parallelism of each step."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pytest

from collab_rank import write_messages
from deployment import serving
from waiting import wait_for
from onepiece.client import Client, RequestFailed
from onepiece.launcher import free_tcp_address
from onepiece.nm.client import NmClient
from onepiece.stage.rendezvous import rendezvous
from onepiece.stage.task_manager import group_down_reason, proc_state
from onepiece.sched.ranks import blocks, dops, place
from onepiece.stage.collective import pack, unpack
from onepiece.stage.registry import StageContext
from onepiece.stage.wan.functions import decode_frames
from onepiece.stage.wan.parallel import layout
from onepiece.transport.message import Message, new_uid
from test_wan_split import DECODE, STAGES, comps, image, params, run, wire  # noqa: F401  (fixtures)

HERE = Path(__file__).parent


def denoise_input(app: str, comps, image, **over) -> Message:
    """The message as the denoise stage receives it."""
    parts = {"image": image} if app == "i2v" else {}
    msg = wire(Message({"uid": new_uid(), "app": app, "params": params(**over)}, parts))
    for name, model, names in STAGES[app][:-1]:
        msg = run(name, app, comps(model, names), msg)
    return msg


def alone(app: str, comps, msg: Message) -> np.ndarray:
    out = run("denoise", app, comps(app, ["transformer", "scheduler"]), msg)
    return decode_frames(StageContext(comps(DECODE[1], DECODE[2])), out)


class Ranks:
    """``size`` rank processes (collab_rank.py, ``serve``) kept for the module: each ``run`` is
    one collaborate() on the same world, as a worker group serves request after request. The
    models are loaded again for every run. A run that fails ends the processes; the next run
    starts new ones."""

    def __init__(self, folder: Path, size: int = 2) -> None:
        self.folder, self.size = folder, size
        self.procs: list[subprocess.Popen] = []
        self.worlds = 0

    def _start(self) -> None:
        self.worlds += 1
        folder = self.folder / f"world{self.worlds}"
        folder.mkdir()
        address = rendezvous(folder)
        self.procs = [subprocess.Popen([sys.executable, str(HERE / "collab_rank.py"), orjson.dumps({
            "rank": r, "size": self.size, "address": address, "serve": True}).decode()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE) for r in range(self.size)]
        self._read = {p.pid: b"" for p in self.procs}

    def _line(self, p: subprocess.Popen, deadline: float) -> bytes:
        """The next line ``p`` writes (b"" at its end or past the deadline)."""
        while b"\n" not in self._read[p.pid]:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([p.stdout], [], [], left)[0]:
                return b""
            chunk = os.read(p.stdout.fileno(), 4096)
            if not chunk:
                return b""
            self._read[p.pid] += chunk
        line, _, self._read[p.pid] = self._read[p.pid].partition(b"\n")
        return line

    def run(self, job: dict, timeout: float = 240.0) -> None:
        if not self.procs or any(p.poll() is not None for p in self.procs):
            self.close()
            self._start()
        for p in self.procs:
            p.stdin.write(orjson.dumps(job) + b"\n")
            p.stdin.flush()
        deadline = time.monotonic() + timeout
        answers = [self._line(p, deadline) for p in self.procs]
        if answers != [b"done"] * self.size:
            self.close()
            raise AssertionError(f"the ranks answered {answers} (exit codes {[p.poll() for p in self.procs]})")

    def close(self) -> None:
        """End of input: every rank leaves the world and exits."""
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Two ranks for the module's runs (starting a rank imports torch and diffusers: seconds)."""
    pool = Ranks(tmp_path_factory.mktemp("ranks"))
    yield pool
    pool.close()


def collaborate(tmp_path: Path, model_dir: Path, msgs: list[Message], plan: list, size: int = 2,
                all_save: bool = False, cancel: dict | None = None, ranks: Ranks | None = None) -> list[np.ndarray]:
    """Run ``plan`` on ``size`` rank processes (``ranks``' if given, else new ones); rank 0's
    latents per request."""
    write_messages(tmp_path / "msgs.bin", msgs)
    job = {"model_dir": str(model_dir), "messages": str(tmp_path / "msgs.bin"), "plan": plan, "out": str(tmp_path),
           "all_save": all_save, "cancel": cancel}
    if ranks is not None:
        assert ranks.size == size
        ranks.run(job)
    else:
        address = rendezvous(tmp_path)
        procs = [subprocess.Popen([sys.executable, str(HERE / "collab_rank.py"), orjson.dumps({
            "rank": r, "size": size, "address": address, **job}).decode()]) for r in range(size)]
        for p in procs:
            assert p.wait(timeout=240) == 0
    return [np.load(tmp_path / f"latents-0-{i}.npy") for i in range(len(msgs))]


def frames_of(comps, msg: Message, latents: np.ndarray) -> np.ndarray:
    import torch

    return decode_frames(StageContext(comps(DECODE[1], DECODE[2])), Message(msg.header, {"latents": torch.from_numpy(latents)}))


@pytest.mark.parametrize("app", ["t2v", "i2v"])
def test_collaborative_output_equals_one_worker(app, tiny_models, comps, image, tmp_path, ranks) -> None:
    """Every step on both ranks: CFG-parallel (guided), then sequence-parallel (unguided), one
    run each on the same two rank processes."""
    guidances = (5.0, 1.0)
    msgs = [denoise_input(app, comps, image, guidance=g) for g in guidances]
    lats = collaborate(tmp_path, tiny_models[app], msgs, [[[[0, 1], [0], 4]], [[[0, 1], [1], 4]]], ranks=ranks)
    for guidance, msg, lat in zip(guidances, msgs, lats):
        ref = alone(app, comps, msg)
        got = frames_of(comps, msg, lat)
        assert float(np.abs(got - ref).max()) <= 1e-4, (app, guidance)
        assert float(ref.std()) > 0.01


def test_a_request_changes_its_degree_of_parallelism_between_steps(tiny_models, comps, image, tmp_path, ranks) -> None:
    """DoP 1 on rank 0, DoP 2, DoP 1 on rank 1, DoP 2 (a step each): the same result as one
    worker, and every rank's replica of the state is the same."""
    msg = denoise_input("t2v", comps, image)
    ref = alone("t2v", comps, msg)
    plan = [[[[0], [0], 1]], [[[0, 1], [0], 1]], [[[1], [0], 1]], [[[0, 1], [0], 1]]]
    (lat,) = collaborate(tmp_path, tiny_models["t2v"], [msg], plan, all_save=True, ranks=ranks)
    assert float(np.abs(frames_of(comps, msg, lat) - ref).max()) <= 1e-4
    assert np.array_equal(lat, np.load(tmp_path / "latents-1-0.npy"))


def test_two_requests_at_dop_1_on_two_ranks_at_once(tiny_models, comps, image, tmp_path, ranks) -> None:
    """Disjoint groups in one run: each rank advances its own request (3 steps and 1), and both
    replicas learn both results; then the two run batched together at DoP 2 to their ends."""
    msgs = [denoise_input("t2v", comps, image, seed=s, steps=4) for s in (1, 2)]
    refs = [alone("t2v", comps, m) for m in msgs]
    plan = [[[[0], [0], 3], [[1], [1], 1]], [[[0, 1], [0, 1], 3]]]
    lats = collaborate(tmp_path, tiny_models["t2v"], msgs, plan, ranks=ranks)
    for m, lat, ref in zip(msgs, lats, refs):
        assert float(np.abs(frames_of(comps, m, lat) - ref).max()) <= 1e-4
    # The world listened on loopback only: its ranks met through a file in a private folder
    # (torch's TCP store would have listened on every interface).
    for rank in (0, 1):
        listening = orjson.loads((tmp_path / f"listening-{rank}.json").read_bytes())
        assert all(a.startswith("127.") for a in listening), listening


def test_a_request_cancelled_mid_run_steps_no_more_on_the_whole_group(tiny_models, comps, image, tmp_path, ranks) -> None:
    """Two requests in one run of 4 steps on both ranks; before its third step the second is
    cancelled (what the worker's shared drops say): it stops after 2 steps on every rank,
    and the first goes on to its end, equal to one worker's frames."""
    msgs = [denoise_input("t2v", comps, image, seed=s, steps=4) for s in (1, 2)]
    ref = alone("t2v", comps, msgs[0])
    lat, _ = collaborate(tmp_path, tiny_models["t2v"], msgs, [[[[0, 1], [0, 1], 4]]],
                         cancel={"0": {"step": 2, "leave": [1]}}, ranks=ranks)
    assert float(np.abs(frames_of(comps, msgs[0], lat) - ref).max()) <= 1e-4
    for rank in (0, 1):
        assert orjson.loads((tmp_path / f"steps-{rank}.json").read_bytes()) == [4, 2]


def test_four_ranks_combine_cfg_and_sequence_parallel_and_split_into_smaller_groups(tiny_models, comps, image,
                                                                                 tmp_path) -> None:
    """A group of 4 (gloo, 4 processes): guided at DoP 4 is CFG-parallel over two halves, each
    half sequence-parallel (Ulysses over 2); then the same request at DoP 2 on ranks 2-3 and at
    DoP 1 on rank 3, while the other request runs on ranks 0-1. Both give one worker's frames."""
    msgs = [denoise_input("t2v", comps, image, guidance=5.0, seed=s, steps=4) for s in (1, 2)]
    refs = [alone("t2v", comps, m) for m in msgs]
    plan = [[[[0, 1, 2, 3], [0, 1], 1]], [[[2, 3], [0], 2], [[0, 1], [1], 3]], [[[3], [0], 1]]]
    lats = collaborate(tmp_path, tiny_models["t2v"], msgs, plan, size=4)
    for m, lat, ref in zip(msgs, lats, refs):
        assert float(np.abs(frames_of(comps, m, lat) - ref).max()) <= 1e-4


def test_groups_and_layouts() -> None:
    assert blocks(1) == [(0,)]
    assert blocks(2) == [(0,), (1,), (0, 1)]
    assert blocks(3) == [(0,), (1,), (2,), (0, 1), (0, 1, 2)]
    assert blocks(4) == [(0,), (1,), (2,), (3,), (0, 1), (2, 3), (0, 1, 2, 3)]
    assert dops(4) == [1, 2, 4] and dops(3) == [1, 2, 3] and dops(1) == [1]
    assert place([1, 2, 1], 4) == [(2,), (0, 1), (3,)]
    assert place([2, 2], 4) == [(0, 1), (2, 3)] and place([4, 1], 4) is None and place([3], 3) == [(0, 1, 2)]
    assert layout((0, 1), cfg=True).cfg == 2 and layout((0, 1), cfg=True).sp == 1
    assert layout((0, 1), cfg=False).sp == 2
    four = layout((0, 1, 2, 3), cfg=True)
    assert (four.cfg, four.sp, four.half(3)) == (2, 2, (2, 3))


def test_packed_frames_round_trip() -> None:
    frames = [b"", b"run", bytes(range(256)) * 3]
    assert unpack(pack(frames)) == frames
    with pytest.raises(ValueError):
        unpack(pack(frames) + b"x")


def test_collaboration_needs_a_parallel_stage_function(tiny_models, tmp_path, make_topology) -> None:
    import yaml

    from onepiece.config import PARALLEL_FUNCTIONS, load_topology
    from onepiece.stage.registry import parallel_of

    for fn in PARALLEL_FUNCTIONS:  # what the YAML accepts, the registry can run
        parallel_of(fn, "t2v")
    topo = make_topology(tmp_path, tiny_models, free_tcp_address(), stage_options={"vae_decode": {"mode": "collaboration"}})
    with pytest.raises(ValueError, match="stages.vae_decode.mode: collaboration needs"):
        load_topology(topo)
    assert yaml.safe_load((tmp_path / "workflow.yaml").read_text())["stages"]["vae_decode"]["mode"] == "collaboration"


SLOW = dict(size="256x256", num_frames=17, steps=100)  # seconds of denoising on the tiny model


@pytest.fixture
def group_set(tiny_models, tmp_path, make_topology):
    """A set whose denoise instance's 2 workers form one group, serving."""
    nm = free_tcp_address()
    topo = make_topology(tmp_path, tiny_models, nm, stages={"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1},
                         proxy={"count": 1, "port": 0, "monitor": False}, threads=1,
                         stage_options={"denoise_t2v": {"mode": "collaboration", "workers": 2}},
                         schedule={"denoise_t2v": {"policy": "slo", "max_batch": 2}})  # DoP-aware
    with serving(topo, tmp_path / "logs", nm) as dep:
        yield dep


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.exclusive
def test_a_collaboration_instance_serves_and_a_dead_rank_restarts_its_group(group_set, tmp_path) -> None:
    """A denoise instance whose 2 workers form one group: requests complete; SIGKILL of rank 1
    fails what the group held with the reason, and the group comes back as a unit."""
    import psutil

    nm = group_set.nm

    def denoise() -> dict:
        client = NmClient(nm)
        try:
            (inst,) = client.status()["sets"]["set0"]["stages"]["denoise_t2v"]["instances"]
            return inst
        finally:
            client.close()

    def ranks() -> list:
        stage = psutil.Process(denoise()["pid"])
        return sorted((p for p in stage.children() if "onepiece.stage.worker" in " ".join(p.cmdline())),
                      key=lambda p: '"rank":1' in " ".join(p.cmdline()))

    c = Client(group_set.url)
    for i in range(2):
        c.generate("together", tmp_path / "a.mp4", size="64x64", num_frames=5, steps=8, seed=i)
    assert denoise()["stats"]["workers"] == 1  # the scheduler sees the group as one worker
    # slo picks each batch's DoP: alone, a request takes both ranks (measured at DoP 2; the
    # figures reach the NM with a later heartbeat)
    wait_for(lambda: any(k.endswith("@2") for k in denoise()["stats"].get("costs", {})), 30,
             "a cost measured at DoP 2", interval=0.2)
    assert len(ranks()) == 2
    vids = [c.submit(f"held {i}", model="t2v", seed=i, **SLOW) for i in range(2)]
    wait_for(lambda: denoise()["stats"]["resident"] >= 2, 60, "both requests resident", interval=0.1)
    old = ranks()
    old[1].kill()
    for v in vids:
        with pytest.raises(RequestFailed) as e:
            c.wait(v["id"], timeout=30)
        assert "collaboration group down: rank 1 killed by signal 9" in e.value.video["error"]["message"]
    wait_for(lambda: denoise()["stats"]["ready"] == 1 and len(ranks()) == 2 and
             not {p.pid for p in ranks()} & {p.pid for p in old}, 90, "the group back, both ranks new",
             interval=0.2)
    c.generate("after the restart", tmp_path / "b.mp4", size="64x64", num_frames=5, steps=4)
    # A request cancelled while the group steps it stops there and frees its state on every
    # rank (test_a_request_cancelled_mid_run_steps_no_more_on_the_whole_group: mid-chunk).
    v = c.submit("a long one", model="t2v", **SLOW)
    wait_for(lambda: denoise()["stats"]["busy"] >= 1 and denoise()["stats"]["resident"] == 1, 60,
             "the long one stepping in the group", interval=0.1)
    before = denoise()["stats"]
    t0 = time.monotonic()
    c.delete(v["id"])
    after = wait_for(lambda: (st := denoise()["stats"]) and st["resident"] == 0 and st["busy"] == 0 and st, 10,
                     "its state freed and the group idle", interval=0.05)
    counts = ("cancelled", "completed", "expired", "failed", "worker_deaths")
    assert after["cancelled"] == before["cancelled"] + 1 and after["completed"] == before["completed"], (
        {k: before[k] for k in counts}, {k: after[k] for k in counts})
    assert time.monotonic() - t0 < 3.0  # a chunk and a few heartbeats; its 100 steps take seconds more
    c.close()


@pytest.mark.exclusive
def test_bench_parallel_times_steps_per_dop_and_what_a_switch_costs(tiny_models, tmp_path) -> None:
    import json

    from onepiece.cli import build_parser

    args = build_parser().parse_args(["bench", "parallel", "--model", str(tiny_models["t2v"]), "--shapes", "32x32x5",
                                      "--steps", "1", "--dops", "1,2", "--out", str(tmp_path)])
    assert args.bench.run(args) == 0
    report = json.loads((tmp_path / "parallel.json").read_text())
    assert [(r["shape"], r["cfg"]) for r in report["rows"]] == [("32x32x5", True), ("32x32x5", False)]
    assert all(r["step_ms"]["1"] > 0 and r["step_ms"]["2"] > 0 for r in report["rows"])
    assert {"group_ms", "switch_us", "broadcast_us", "share_us"} <= set(report["overhead"])


def test_a_group_down_names_a_signalled_rank_first_or_else_the_rank_that_stopped_answering():
    # The reason comes from real processes' states; a collective's 60 s timeout is too slow to
    # wait for in a test, so the dead ranks' return codes are given.
    stopped = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        wait_for(lambda: proc_state(stopped.pid) == "stopped", 10, "the process never stopped")
        # rank 1 stopped: rank 0's collective timed out and it exited 1
        assert group_down_reason([(0, 1)], {1: proc_state(stopped.pid)}) == (
            "collaboration group down: rank 0 exit code 1; still running, not answering its peers: rank 1 (stopped)")
    finally:
        stopped.kill()
        stopped.wait()
    # rank 1 killed: the cause, named first, whatever its peers are doing meanwhile
    assert group_down_reason([(0, 1), (1, -9)], {}) == \
        "collaboration group down: rank 1 killed by signal 9, rank 0 exit code 1"
    assert group_down_reason([(1, -9)], {0: "sleeping"}) == "collaboration group down: rank 1 killed by signal 9"
    assert proc_state(2 ** 22 + 12345) == ""
