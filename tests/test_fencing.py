"""An instance the NM declared dead, whose requests it reported failed, drops them when it comes
back (nm/fencing.py); one that a restarted NM merely forgot keeps them. Terminal is final: a
reaped request stays `failed`, its progress does not move, and no work is spent on it.

The rule pieces directly (the NM's bounded memory, the NM's handlers, the member's stall watch,
the deliverer), then a real `onepiece up` whose denoiser process is stopped with SIGSTOP past the
dead limit while it holds requests, and continued."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time

import psutil
import pytest
import zmq

from onepiece.client import Client
from onepiece.config import deploy_dir, load_topology
from onepiece.db.client import DbClient
from onepiece.launcher import free_tcp_address
from onepiece.ports import free_port_run
from onepiece.nm.client import Membership, NmClient
from onepiece.nm.fencing import Fences
from onepiece.nm.holdings import Holdings, TrackingReceiver
from onepiece.nm.protocol import HeartbeatArgs, RegisterArgs
from onepiece.nm.reaper import MAX_UIDS
from onepiece.nm.server import NodeManager
from onepiece.nm.stall import StallWatch
from onepiece.proxy.api import uid_of
from onepiece.stage.deliver import ResultDeliver
from onepiece.transport.message import Message
from deployment import Up, serving
from waiting import wait_for

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

NAME = "set0-denoise_t2v0"
DB = {"data": "tcp://127.0.0.1:9991", "control": "tcp://127.0.0.1:9992", "events": "tcp://127.0.0.1:9993"}


# ---- the NM's memory --------------------------------------------------------------------------

def test_the_fence_memory_is_bounded_expires_and_holds_until_acknowledged():
    now = [0.0]
    fences = Fences(keep_s=10.0, limit=2, clock=lambda: now[0])
    assert fences.add("", "x", "why", ["u"]) is None  # no process token: nothing to tell it apart by
    assert fences.add("p1", "x", "why", []) is None  # nothing reaped: nothing to drop
    first = fences.add("p1", NAME, "no heartbeat", ["u1", "u2"])
    told = first.id
    grown = fences.add("p1", NAME, "no heartbeat", ["u2", "u3"])  # reaped late (a delivery)
    assert list(grown.uids) == ["u1", "u2", "u3"] and grown.id != told
    assert not fences.acknowledged("p1", told) and fences.of("p1") is grown  # it must hear the grown one
    assert fences.acknowledged("p1", grown.id) and fences.of("p1") is None
    for p in ("p2", "p3", "p4"):  # at most two processes: the oldest goes
        fences.add(p, p, "why", ["u"])
    assert len(fences) == 2 and fences.of("p2") is None and fences.of("p4") is not None
    now[0] = 10.5  # past keep_s: the instance has expired its requests itself by then
    assert fences.of("p4") is None and len(fences) == 0
    big = fences.add("p5", "x", "why", [f"u{i}" for i in range(MAX_UIDS + 10)])
    assert len(big.uids) == MAX_UIDS and "u0" not in big.uids  # bounded per process too


# ---- the NM, without processes ----------------------------------------------------------------

class Reaper:
    """Records what the NM reports failed instead of telling DBs."""

    def __init__(self) -> None:
        self.jobs: list[tuple[str, list[str], str]] = []
        self.stages: list[str] = []

    def submit(self, instance, stage, uids, dbs, reason, error=None) -> bool:
        if not (uids and stage and dbs):
            return False
        self.jobs.append((instance, list(uids), reason))
        self.stages.append(stage)
        return True

    def close(self, timeout: float = 2.0) -> None:
        pass


@pytest.fixture
def topology():
    topo, wf, base = load_topology(deploy_dir() / "local.yaml")
    topo.nm.heartbeat_s, topo.nm.dead_after_s = 0.2, 1.0
    topo.nm.elastic.enabled = False
    return topo, wf, base


def _nm(topology, address: str = "tcp://127.0.0.1:0") -> NodeManager:
    server = NodeManager(*topology, address)
    server.reaper.close()
    server.reaper = Reaper()
    server._register(RegisterArgs(role="db", set="set0", addresses=DB, name="set0-db0", process="db"), None)
    return server


def _register(server: NodeManager, process: str, serving: str | None = None) -> dict:
    return server._register(RegisterArgs(role="stage", set="set0", addresses={"data": "tcp://127.0.0.1:9901"},
                                         stage="denoise_t2v", name=NAME, process=process, serving=serving), None)


def _beat(server: NodeManager, process: str, holding: list[str] | None = None, fenced: str | None = None) -> dict:
    stats = {"holding": holding} if holding is not None else {}
    return server._heartbeat(HeartbeatArgs(instance=NAME, ready=True, stats=stats, serving="denoise_t2v",
                                           process=process, fenced=fenced), None)


def _silent(server: NodeManager) -> None:
    """The instance was not heard for long while the NM listened; the NM's next turn drops it."""
    past = time.monotonic() - 100.0
    server.state.instances[NAME].last_seen = past
    server.liveness.listening_since, server.liveness.previous_turn = past, time.monotonic()
    server._tick()
    assert NAME not in server.state.instances


def test_a_reaped_process_is_answered_with_the_fence_alone_then_registers_again(topology):
    server = _nm(topology)
    try:
        reply = _register(server, "p1")
        assert "fenced" not in reply and reply["dead_after_s"] == server.liveness.spec.limit_s
        _beat(server, "p1", holding=["u1", "u2"])
        _silent(server)
        (job,) = server.reaper.jobs
        assert job[:2] == (NAME, ["u1", "u2"]) and "no heartbeat" in job[2]
        # It runs again: its heartbeat is answered with the fence and nothing else (not counted).
        reply = _beat(server, "p1", holding=["u1", "u2", "u3"])
        assert set(reply) == {"fenced"} and reply["fenced"]["uids"] == ["u1", "u2"]
        assert reply["fenced"]["instance"] == NAME and "no heartbeat" in reply["fenced"]["reason"]
        assert NAME not in server.state.instances
        # Acknowledged: forgotten; then it is an instance the NM does not know, and registers again.
        with pytest.raises(LookupError, match="unknown instance"):
            _beat(server, "p1", fenced=reply["fenced"]["id"])
        assert len(server.fences) == 0
        assert "fenced" not in _register(server, "p1", serving="denoise_t2v")
        assert server.state.instances[NAME].ready and "fenced" not in _beat(server, "p1", holding=[])
    finally:
        server.close()


def test_what_a_moved_instance_held_is_failed_for_the_stage_it_served(topology):
    """An instance the NM moved still serves its old stage while it drains: what it held when
    it died was held for that stage, not for the one it was on its way to."""
    from onepiece.nm.elastic import Move

    server = _nm(topology)
    try:
        _register(server, "p1")
        _beat(server, "p1", holding=["u1"])
        server.elastic.apply(server.state, Move(NAME, "denoise_t2v", "denoise_i2v", "a test's move"),
                             time.monotonic())
        assert server.state.instances[NAME].stage == "denoise_i2v"
        _beat(server, "p1", holding=["u1"])  # draining: it still says it serves denoise_t2v
        _silent(server)
        assert server.reaper.jobs[0][1] == ["u1"] and server.reaper.stages == ["denoise_t2v"]
    finally:
        server.close()


def test_a_registration_before_the_acknowledgement_carries_the_fence(topology):
    """The heartbeat's answer lost, it registers (as on ZooKeeper after its session ended):
    registered, told the fence, and heartbeats carry it until it acknowledges."""
    server = _nm(topology)
    try:
        _register(server, "p1")
        _beat(server, "p1", holding=["u1"])
        _silent(server)
        reply = _register(server, "p1", serving="denoise_t2v")
        assert reply["fenced"]["uids"] == ["u1"] and NAME in server.state.instances
        assert set(_beat(server, "p1")) == {"fenced"}
        assert "fenced" not in _beat(server, "p1", fenced=reply["fenced"]["id"])
    finally:
        server.close()


def test_a_process_whose_name_was_taken_over_is_fenced(topology):
    server = _nm(topology)
    try:
        _register(server, "old")
        _beat(server, "old", holding=["u1"])
        server.state.instances[NAME].last_seen -= 10.0  # silent: a restarted process may claim the name
        _register(server, "new")
        assert server.state.instances[NAME].process == "new"
        assert _beat(server, "old")["fenced"]["uids"] == ["u1"]  # the old one, if it wakes, drops u1
        assert "fenced" not in _beat(server, "new")
    finally:
        server.close()


def test_a_restarted_nm_fences_nobody(topology):
    """It reaped nothing: what its members hold is live and must complete."""
    first = _nm(topology)
    _register(first, "p1")
    _beat(first, "p1", holding=["u1"])
    _silent(first)
    assert first.fences.of("p1") is not None
    first.close()
    restarted = _nm(topology)
    try:
        with pytest.raises(LookupError, match="unknown instance"):
            _beat(restarted, "p1", holding=["u1"])
        assert "fenced" not in _register(restarted, "p1", serving="denoise_t2v")
        assert "fenced" not in _beat(restarted, "p1", holding=["u1"]) and len(restarted.fences) == 0
    finally:
        restarted.close()


# ---- the member -------------------------------------------------------------------------------

def _serve(server: NodeManager):
    """Run the NM on a thread, with a DB member heartbeating to it (the reaper needs a DB)."""
    stop = threading.Event()
    t = threading.Thread(target=server.run, args=(stop,))
    t.start()
    db = Membership(server.address, "db", "set0", DB, name="set0-db1")
    db.register()
    db.start()

    def close() -> None:
        db.stop()
        stop.set()
        t.join()
        server.close()
    return close


def test_a_member_whose_heartbeats_stopped_past_the_limit_drops_what_was_reaped_then_is_heard_again(topology):
    server = _nm(topology)
    close = _serve(server)
    runs = threading.Event()
    runs.set()
    fenced: list[tuple[list[str], str]] = []

    def stats() -> dict:
        runs.wait()  # cleared: the heartbeat thread stands still here, as in a stopped process
        return {"holding": [] if fenced else ["u1", "u2"]}

    member = Membership(server.address, "stage", "set0", {"data": "tcp://127.0.0.1:9811"}, stage="denoise_t2v",
                        name=NAME, stats=stats, on_fenced=lambda uids, why: fenced.append((uids, why)))
    try:
        member.register()
        member.start()
        assert member.dead_after_s == server.liveness.spec.limit_s
        wait_for(lambda: server.state.instances[NAME].holding == ["u1", "u2"], timeout=10, what="holding reported")
        runs.clear()
        wait_for(lambda: NAME not in server.state.instances, timeout=10, what="the member dropped as dead")
        runs.set()
        wait_for(lambda: fenced, timeout=10, what="the fence applied")
        assert fenced[0][0] == ["u1", "u2"] and "no heartbeat" in fenced[0][1]
        wait_for(lambda: (i := server.state.instances.get(NAME)) is not None and i.process == member.process
                 and i.holding == [], timeout=10, what="registered again, holding nothing")
        assert len(fenced) == 1 and len(server.fences) == 0  # told once, acknowledged
    finally:
        member.stop()
        close()


def _rebind(topology, address: str) -> NodeManager | None:
    """A new NM at ``address``; None while the port is taken (a member reconnecting to a port
    in the ephemeral range can hold it a moment: TCP's self-connect)."""
    try:
        return _nm(topology, address)
    except zmq.ZMQError:
        return None


def test_a_member_of_a_restarted_nm_keeps_its_work(topology):
    server = _nm(topology, f"tcp://127.0.0.1:{free_port_run(1)}")  # (below the ephemeral range: _rebind)
    address = server.address
    close = _serve(server)
    fenced: list = []
    member = Membership(address, "stage", "set0", {"data": "tcp://127.0.0.1:9812"}, stage="denoise_t2v",
                        name=NAME, stats=lambda: {"holding": ["u1"]}, on_fenced=lambda *a: fenced.append(a))
    try:
        member.register()
        member.start()
        wait_for(lambda: server.state.instances[NAME].holding == ["u1"], timeout=10, what="holding reported")
        close()
        server = wait_for(lambda: _rebind(topology, address), timeout=10, what="the NM bound again")
        close = _serve(server)  # the same address, an empty memory
        wait_for(lambda: (i := server.state.instances.get(NAME)) is not None and i.holding == ["u1"], timeout=15,
                 what="registered again, holding its work")
        # It kept its work, and the NM's absence was no stall of its own: nothing was held back.
        assert fenced == [] and member.watch.stalled() is None and member.settle(timeout=5.0) == 0.0
    finally:
        member.stop()
        close()


def test_the_stall_watch_holds_hand_ons_after_the_process_stood_still_until_a_later_round():
    now = [100.0]
    watch = StallWatch(clock=lambda: now[0])
    now[0] += 50.0
    assert watch.stalled() is None  # no limit told yet: nothing counts
    watch.limit_s = 2.0
    for _ in range(30):  # ticking: a process that runs
        now[0] += 0.1
        watch.tick()
    before = watch.began()  # a round in flight when the process stops
    now[0] += 12.0  # SIGSTOP ... SIGCONT
    assert watch.stalled() == before
    watch.round_ended(before)  # its answer was lost in the stall: it settles nothing
    assert watch.stalled() == before
    assert watch.settle(timeout=0.0) == 0.0 and watch.stalled() is None  # bounded: gives up, goes on
    now[0] += 12.0
    assert watch.stalled() is not None
    after = watch.began()  # the next round (it brings the fence)
    waited: list[float] = []
    t = threading.Thread(target=lambda: waited.append(watch.settle(timeout=30.0)))
    t.start()
    wait_for(lambda: watch._cond._waiters, what="settle waiting")  # (the condition's own list of waiters)
    assert not waited
    watch.round_ended(after)
    t.join(5)
    assert waited and watch.stalled() is None
    # A slow NM is no stall: rounds may take long while the process ticks.
    for _ in range(50):
        now[0] += 0.1
        watch.tick()
    assert watch.stalled() is None and watch.settle(timeout=5.0) == 0.0


# ---- the instance's edges ---------------------------------------------------------------------

class _Inbox:
    """A receiver handing out given messages."""

    def __init__(self, msgs: list[Message]) -> None:
        self.msgs = msgs

    def recv(self, timeout: float) -> Message | None:
        return self.msgs.pop(0) if self.msgs else None


def test_fenced_requests_are_not_held_are_dropped_on_arrival_and_not_handed_on():
    holdings = Holdings()
    holdings.add("u1")
    holdings.add("u2")
    assert holdings.fence(["u1", "u9"]) == 1 and holdings.snapshot() == ["u2"]
    holdings.add("u1")  # (a hand-on waiting for a route would add it again)
    assert holdings.snapshot() == ["u2"]
    receiver = TrackingReceiver(_Inbox([Message({"uid": "u9"}), Message({"uid": "u3"})]), holdings)
    assert receiver.recv(0) is None and receiver.recv(0).uid == "u3" and holdings.snapshot() == ["u2", "u3"]

    _, wf, _ = load_topology(deploy_dir() / "local.yaml")
    settled: list[str] = []
    routes: dict = {"version": 1, "stages": {}, "dbs": []}
    deliver = ResultDeliver("denoise_t2v", wf, queue.Queue(), routes=lambda: routes,
                            dropped=holdings.fenced, settle=lambda: settled.append("settled"))
    deliver._handle(("result", Message({"uid": "u1", "app": "t2v"})))
    deliver._handle(("progress", "u1", "t2v", 0.5))
    assert settled == ["settled", "settled"] and deliver.waiting == 0  # settled first, then dropped
    deliver._handle(("result", Message({"uid": "u3", "app": "t2v"})))
    assert deliver.waiting == 1  # not fenced: it waits for a route to vae_decode
    holdings.fence(["u3"])
    routes["stages"] = {"vae_decode": ["tcp://127.0.0.1:9"]}  # a route now
    deliver._retry_parked(time.monotonic())
    assert deliver.waiting == 0 and deliver.senders == {}  # fenced while it waited: dropped, not handed on


# ---- a real deployment ------------------------------------------------------------------------

HEARTBEAT_S = 0.25
DEAD_AFTER_S = 4.0


@pytest.fixture(scope="module")
def up(tiny_models, tmp_path_factory, make_topology):
    folder = tmp_path_factory.mktemp("fencing")
    nm = free_tcp_address()
    topology = make_topology(folder, tiny_models, nm, dbs=1, heartbeat_s=HEARTBEAT_S,
                             nm={"dead_after_s": DEAD_AFTER_S},
                             stages={"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1})
    with serving(topology, folder / "logs", nm) as dep:
        yield dep


def _denoiser(up: Up) -> psutil.Process:
    (proc,) = [p for p in psutil.Process(up.proc.pid).children() if f"--name {NAME} " in " ".join(p.cmdline()) + " "]
    return proc


@pytest.mark.exclusive
def test_an_instance_stopped_past_the_dead_limit_drops_what_was_reported_failed_and_serves_on(up):
    nm = NmClient(up.nm)
    db = DbClient([d["control"] for d in up.routes()["dbs"]])
    denoiser = _denoiser(up)

    def me(stage: str = "denoise_t2v") -> dict:
        """The stage's instance as the NM shows it ({} while the NM does not know it)."""
        insts = nm.status()["sets"]["set0"]["stages"][stage]["instances"]
        return insts[0] if insts else {}

    def counts() -> tuple[int, int]:
        """Requests the denoiser finished, and the decoder received."""
        return me()["stats"]["completed"], me("vae_decode")["stats"]["received"]

    try:
        with Client(up.url) as c:
            # A first request warms every stage up (a cold one may outlast the dead limit).
            warm = c.submit("warm up", model="t2v", size="32x32", num_frames=5, steps=2)
            assert c.wait(warm["id"], timeout=120)["status"] == "completed"
            before = wait_for(lambda: (n := counts()) and n[0] and n[1] and n, timeout=10, what="the warm-up counted")
            long = [uid_of(c.submit(f"long {i}", model="t2v", size="256x256", num_frames=17, steps=100)["id"])
                    for i in range(5)]
            wait_for(lambda: (i := me()) and i["holding"] == 5 and i["stats"].get("resident", 0) > 0, timeout=30,
                     what="the denoiser holding the five, running some")
            os.kill(denoiser.pid, signal.SIGSTOP)
            try:
                records = wait_for(lambda: (rs := [db.get(u) for u in long]) and all(
                    r["status"] == "failed" for r in rs) and rs, timeout=30, what="the five reported failed")
            finally:
                os.kill(denoiser.pid, signal.SIGCONT)
            for r in records:
                assert "no heartbeat" in r["error"] and "died while holding the request" in r["error"], r
            # Back under its name, after it dropped them: nothing resident, nothing held.
            wait_for(lambda: (i := me()) and i["ready"] and i["silent_s"] < 1.0 and i["holding"] == 0
                     and i["stats"].get("resident") == 0 and i["stats"].get("queue") == 0, timeout=30,
                     what="the denoiser registered again with nothing resident")
            assert me()["id"] == NAME and me()["pid"] == denoiser.pid  # the same process, not a restart
            # It serves on: a new request completes.
            fresh = c.submit("after the fence", model="t2v", size="32x32", num_frames=5, steps=2)
            assert c.wait(fresh["id"], timeout=60)["status"] == "completed"
        # No work went on downstream: of all that, only the new request left the denoiser.
        wait_for(lambda: all(n > b for n, b in zip(counts(), before)), timeout=10,
                 what="the new request counted (the figures come with heartbeats)")
        assert counts() == (before[0] + 1, before[1] + 1), (before, counts())
        # Terminal stayed final: still failed, with the reaper's reason, progress where it stood.
        after = [db.get(u) for u in long]
        assert [r["status"] for r in after] == ["failed"] * 5, after
        assert [(r["error"], r["progress"]) for r in after] == [(r["error"], r["progress"]) for r in records]
        log = up.log(NAME)
        assert "declared set0-denoise_t2v0 dead" in log and "dropped" in log, log[-3000:]
        assert "fenced the process of set0-denoise_t2v0" in up.log("nm")
    finally:
        nm.close()
        db.close()
        if denoiser.status() == psutil.STATUS_STOPPED:
            os.kill(denoiser.pid, signal.SIGCONT)
