"""Elastic assignment's parts, without a deployment: the utilization window, the policy, and
how an assignment changes the routes of a real embedded NM (ZMQ RPC, Membership threads)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from onepiece.config import ConfigError, ElasticSpec, NmSpec, Topology, deploy_dir, load_topology
from onepiece.nm.client import Membership, NmClient
from onepiece.nm.elastic import Elastic, StageLoad, decide
from onepiece.nm.utilization import Utilization
from onepiece.operator_key import ENV as OPERATOR_ENV
from onepiece.transport.rpc import RpcError
from waiting import wait_for

SPEC = ElasticSpec(threshold=0.85, low=0.2, window_s=10, cooldown_s=5)


def test_utilization_is_the_ratio_of_counter_increases_over_the_window():
    u = Utilization(window_s=10)
    for t in range(0, 21):  # two workers, busy 3/4 of the time for 20 s
        u.observe("a", "denoise", {"busy_s": 1.5 * t, "slot_s": 2.0 * t}, now=float(t))
    assert u.of("a", now=20.0) == pytest.approx(0.75)
    # a busier second half shows in the window, not diluted by the first half
    for t in range(21, 31):
        u.observe("a", "denoise", {"busy_s": 30 + 2.0 * (t - 20), "slot_s": 2.0 * t}, now=float(t))
    assert u.of("a", now=30.0) == pytest.approx(1.0)


def test_a_window_counts_only_once_covered_and_restarts_on_a_new_stage_or_counters():
    u = Utilization(window_s=10)
    for t in range(0, 5):
        u.observe("a", "denoise", {"busy_s": t, "slot_s": t}, now=float(t))
    assert u.of("a", now=4.0) is None  # 4 s of a 10 s window
    for t in range(5, 12):
        u.observe("a", "denoise", {"busy_s": t, "slot_s": t}, now=float(t))
    assert u.of("a", now=11.0) == pytest.approx(1.0)
    assert u.of("a", now=30.0) is None  # silent since: stale
    u.observe("a", "vae_decode", {"busy_s": 12, "slot_s": 12}, now=12.0)  # moved: a new window
    assert u.of("a", now=12.0) is None
    u.observe("b", "denoise", {"busy_s": 5, "slot_s": 5}, now=0.0)
    u.observe("b", "denoise", {"busy_s": 0, "slot_s": 1}, now=9.0)  # restarted counters
    assert u.of("b", now=9.0) is None
    for bad in ({"busy_s": "x", "slot_s": 1}, {"busy_s": float("nan"), "slot_s": 1}, {"busy_s": True, "slot_s": 1},
                {"busy_s": -1, "slot_s": 1}, {}):
        u.observe("c", "denoise", bad, now=1.0)  # a malformed heartbeat is ignored
        assert u.of("c", now=1.0) is None


def loads(**stages: tuple[float | None, int, int]) -> dict[str, StageLoad]:
    """stage=(util, instances, min), as busy over the longer cold span as over the window;
    instance ids are <stage>-<k>."""
    return {s: StageLoad(s, [f"{s}-{k}" for k in range(n)], u, m, cold=u) for s, (u, n, m) in stages.items()}


def test_the_busiest_saturated_stage_takes_from_the_idle_pool_first():
    move = decide(SPEC, loads(denoise=(0.95, 1, 1), decode=(0.1, 2, 1), encode=(0.9, 1, 1)), ["idle-1"], {})
    assert (move.instance, move.src, move.dst) == ("idle-1", None, "denoise")
    assert "denoise busy 95% >= 85%" in move.reason and "idle pool" in move.reason


def test_else_the_least_busy_stage_above_its_minimum_gives_its_least_busy_instance():
    ls = loads(denoise=(0.97, 1, 1), decode=(0.30, 3, 1), encode=(0.10, 1, 1), vae=(0.2, 2, 2))
    move = decide(SPEC, ls, [], {"decode-0": 0.4, "decode-1": 0.1, "decode-2": 0.4})
    assert (move.instance, move.src, move.dst) == ("decode-1", "decode", "denoise")
    # encode is less busy but at its minimum, vae at its minimum too


def test_no_donor_that_would_saturate_without_the_instance():
    # decode at 50% on 2 instances would run at 100% on one: moving it just shifts the problem
    assert decide(SPEC, loads(denoise=(0.99, 1, 1), decode=(0.5, 2, 1)), [], {}) is None
    assert decide(SPEC, loads(denoise=(0.99, 1, 1), decode=(0.4, 2, 1)), [], {}).src == "decode"


def test_unmeasured_stages_are_neither_judged_nor_donors():
    assert decide(SPEC, loads(denoise=(None, 1, 1), decode=(0.0, 2, 1)), [], {}).dst is None  # only a return
    assert decide(SPEC, loads(denoise=(0.99, 1, 1), decode=(None, 2, 1)), [], {}) is None


def test_a_cold_stage_returns_an_instance_to_the_idle_pool_and_low_zero_never_does():
    move = decide(SPEC, loads(denoise=(0.5, 1, 1), decode=(0.05, 3, 1)), [], {})
    assert (move.src, move.dst) == ("decode", None) and "idle pool" in move.reason
    assert decide(ElasticSpec(low=0.0), loads(denoise=(0.5, 1, 1), decode=(0.0, 3, 1)), [], {}) is None
    assert decide(SPEC, loads(denoise=(0.5, 1, 1), decode=(0.05, 1, 1)), [], {}) is None  # at its minimum


def test_the_late_share_is_a_window_over_the_late_and_left_counters():
    u = Utilization(window_s=10, part="late", whole="left")
    for t in range(0, 11):  # 4 requests a second, none late
        u.observe("a", "denoise", {"late": 0, "left": 4 * t}, now=float(t))
    assert u.of("a", now=10.0) == 0.0
    for t in range(11, 21):  # then one in ten late
        u.observe("a", "denoise", {"late": 0.4 * (t - 10), "left": 4 * t}, now=float(t))
    assert u.of("a", now=20.0) == pytest.approx(0.1)
    for t in range(21, 32):  # nothing left the stage for a window: no share to judge
        u.observe("a", "denoise", {"late": 4, "left": 80}, now=float(t))
    assert u.of("a", now=31.0) is None


def test_a_stages_late_share_counts_every_request_that_left_it_not_a_mean_of_its_instances():
    """Two instances of vae_decode: 1,000 requests left one on time, one left the other late. Of
    the stage's requests 0.1% were late (under the 1% allowance); a mean of the instances'
    shares said 50%, so the stage read as late, took an instance and could not give one."""
    from onepiece.nm.state import ClusterState

    topo, wf, _ = load_topology(deploy_dir() / "local.yaml")
    state, el = ClusterState(topo, wf), Elastic(SPEC)
    busy = state.register("stage", "set0", {"data": "tcp://a:1"}, stage="vae_decode")
    quiet = state.register("stage", "set0", {"data": "tcp://a:2"}, stage="vae_decode")
    for t in range(0, 11):
        now = 1000.0 + t
        for inst, left, late in ((busy, 100 * t, 0), (quiet, t // 10, t // 10)):
            state.heartbeat(inst.id, True, {"busy_s": 0.5 * t, "slot_s": 1.0 * t, "left": left, "late": late},
                            serving="vae_decode", now=now)
            el.observe(inst, now)
    assert el.late.of(busy.id, now) == 0.0 and el.late.of(quiet.id, now) == 1.0
    load = el.loads(state, "set0", now)["vae_decode"]
    assert load.late == pytest.approx(1 / 1001)
    assert decide(SPEC, {"vae_decode": load}, ["idle-1"], {}) is None
    assert el.view(state, now)["late"]["set0"]["vae_decode"] == 0.001  # what `onepiece status` prints


def late_loads(**stages: tuple[float, float | None, int, int]) -> dict[str, StageLoad]:
    """stage=(util, late share, instances, min)."""
    return {s: StageLoad(s, [f"{s}-{k}" for k in range(n)], u, m, late=x, cold=u) for s, (u, x, n, m) in stages.items()}


def test_a_stage_whose_requests_leave_late_is_saturated_below_the_busy_threshold():
    # denoise at 60% meets the busy threshold nowhere, but 5% of its requests missed their SLO there
    move = decide(SPEC, late_loads(denoise=(0.6, 0.05, 1, 1), decode=(0.3, 0.0, 1, 1)), ["idle-1"], {})
    assert (move.instance, move.dst) == ("idle-1", "denoise")
    assert "denoise 5% of its requests late > 1%, busy 60%" in move.reason
    # at or under the share it is not (1% of 100 requests is the SLO's allowance, not a risk)
    assert decide(SPEC, late_loads(denoise=(0.6, 0.01, 1, 1), decode=(0.3, 0.0, 1, 1)), ["idle-1"], {}) is None
    assert decide(SPEC, late_loads(denoise=(0.6, None, 1, 1), decode=(0.3, None, 1, 1)), ["idle-1"], {}) is None
    # late = 1 turns the rule off
    off = ElasticSpec(threshold=0.85, low=0.2, late=1.0)
    assert decide(off, late_loads(denoise=(0.6, 0.9, 1, 1), decode=(0.3, 0.0, 1, 1)), ["idle-1"], {}) is None


def test_lateness_alone_takes_only_from_the_idle_pool_and_late_stages_neither_give_nor_return():
    ls = late_loads(encode=(0.95, 0.0, 1, 1), denoise=(0.7, 0.2, 1, 1), decode=(0.8, 0.03, 1, 1))
    assert decide(SPEC, ls, ["idle-1"], {}).dst == "encode"  # the busiest saturated stage first
    assert decide(SPEC, late_loads(denoise=(0.7, 0.2, 1, 1), decode=(0.8, 0.03, 1, 1)), ["idle-1"], {}).dst == "decode"
    # with nobody idle, a stage late below the busy threshold takes nobody else's instance
    assert decide(SPEC, late_loads(denoise=(0.6, 0.2, 1, 1), vae=(0.1, 0.0, 3, 1)), [], {}) is None
    # a busy one does, but not from decode, the least busy stage that could spare one: its own requests are late
    ls = late_loads(denoise=(0.9, 0.2, 1, 1), decode=(0.3, 0.05, 3, 1), vae=(0.35, 0.0, 3, 1))
    assert decide(SPEC, ls, [], {}).src == "vae"
    # a cold stage with a late request keeps its instances
    assert decide(SPEC, late_loads(denoise=(0.5, 0.0, 1, 1), decode=(0.05, 0.005, 3, 1)), [], {}) is None
    assert decide(SPEC, late_loads(denoise=(0.5, 0.0, 1, 1), decode=(0.05, 0.0, 3, 1)), [], {}).src == "decode"


def test_a_stage_returns_an_instance_only_when_cold_over_the_longer_span():
    quiet_lull = {"denoise": StageLoad("denoise", ["d-0", "d-1", "d-2"], 0.1, 1, cold=0.45)}
    assert decide(SPEC, quiet_lull, [], {}) is None  # a lull of one window: busy 45% over the longer span
    assert decide(SPEC, {"denoise": StageLoad("denoise", ["d-0", "d-1", "d-2"], 0.1, 1)}, [], {}) is None  # unknown yet
    move = decide(SPEC, {"denoise": StageLoad("denoise", ["d-0", "d-1", "d-2"], 0.1, 1, cold=0.15)}, [], {})
    assert (move.src, move.dst) == ("denoise", None) and "busy 15% < 20% over 100s" in move.reason


def test_dense_heartbeats_are_thinned_so_a_long_span_stays_covered():
    u = Utilization(window_s=300)
    for k in range(3001):  # every 0.1 s for 300 s: more heartbeats than the samples kept
        t = 0.1 * k
        u.observe("a", "denoise", {"busy_s": 0.5 * t, "slot_s": t}, now=t)
    assert len(u._samples["a"][1]) <= 1024 and u.of("a", now=300.0) == pytest.approx(0.5)


def test_a_stage_below_its_minimum_is_refilled_from_the_idle_pool_at_once():
    # decode's only instance died and the NM dropped it; nothing is measured yet, and a cooldown
    # runs: it is refilled all the same
    ls = {"denoise": StageLoad("denoise", ["d-0"], None, 1), "decode": StageLoad("decode", [], None, 1)}
    move = decide(SPEC, ls, ["idle-1"], {}, floors_only=True)
    assert (move.instance, move.src, move.dst) == ("idle-1", None, "decode") and "below its minimum 1" in move.reason
    assert decide(SPEC, ls, [], {}) is None  # nobody idle: nothing to move (and nobody taken from denoise)
    # a stage that never had its minimum is starting up, not short: nothing to refill
    starting = {**ls, "decode": StageLoad("decode", [], None, 1, had_min=False)}
    assert decide(SPEC, starting, ["idle-1"], {}, floors_only=True) is None
    # one the NM still holds counts (loading, or a heartbeat late under load): no refill on a guess
    ls["decode"] = StageLoad("decode", ["x-1"], None, 1, live=[])
    assert decide(SPEC, ls, ["idle-1"], {}, floors_only=True) is None


def test_only_live_instances_count_and_the_last_one_never_leaves():
    # decode has a dead instance and a replacement loading besides its one healthy instance:
    # three assigned, one serving. It is cold, and denoise is hot, but the healthy one stays.
    decode = StageLoad("decode", ["x-dead", "x-new", "x-ok"], 0.05, 1, live=["x-ok"], cold=0.05)
    assert decide(SPEC, {"decode": decode, "denoise": StageLoad("denoise", ["d-0"], 0.99, 1)}, [], {}) is None
    assert decide(SPEC, {"decode": decode}, [], {}) is None  # no return to the idle pool either
    # min 0 does not make the last one movable
    lone = StageLoad("decode", ["x-ok"], 0.0, 0, cold=0.0)
    assert decide(SPEC, {"decode": lone, "denoise": StageLoad("denoise", ["d-0"], 0.99, 1)}, [], {}) is None
    # two serving: one may go, and it is a serving one that goes
    two = StageLoad("decode", ["x-dead", "x-a", "x-b"], 0.05, 1, live=["x-a", "x-b"], cold=0.05)
    move = decide(SPEC, {"decode": two}, [], {"x-dead": 0.0})
    assert move.src == "decode" and move.instance in ("x-a", "x-b")


def test_loads_count_serving_instances_of_a_real_state():
    from onepiece.nm.state import ClusterState

    topo, wf, _ = load_topology(deploy_dir() / "local.yaml")
    state, el = ClusterState(topo, wf), Elastic(SPEC)
    ok = state.register("stage", "set0", {"data": "tcp://a:1"}, stage="vae_decode")
    dead = state.register("stage", "set0", {"data": "tcp://a:2"}, stage="vae_decode")
    new = state.register("stage", "set0", {"data": "tcp://a:3"}, stage="vae_decode")
    now = 1000.0
    for inst, ready, seen in ((ok, True, now), (dead, True, now - 10 * topo.nm.heartbeat_s), (new, False, now)):
        inst.ready, inst.serving, inst.last_seen = ready, "vae_decode" if ready else None, seen
    load = el.loads(state, "set0", now)["vae_decode"]
    assert load.live == [ok.id] and len(load.assigned) == 3 and not load.can_spare() and not load.below_floor()
    # the deployment is still coming up for vae_encode: no instance yet, and none ever
    assert not el.loads(state, "set0", now)["vae_encode"].had_min


def test_a_stage_of_minimum_zero_that_lost_its_last_instance_is_refilled():
    # min 0: its instance may not leave (the last one never does), but it can die. At 0 the
    # stage fails every request of its application, so it gets one back from the idle pool.
    lost = {"denoise": StageLoad("denoise", ["d-0"], 0.5, 1), "decode": StageLoad("decode", [], None, 0)}
    move = decide(SPEC, lost, ["idle-1"], {}, floors_only=True)
    assert (move.instance, move.dst) == ("idle-1", "decode") and "lost its last instance (min 0)" in move.reason
    # a set that never ran an instance of it (min 0, none configured) is left as it is
    never = {**lost, "decode": StageLoad("decode", [], None, 0, had_min=False)}
    assert decide(SPEC, never, ["idle-1"], {}, floors_only=True) is None

    from onepiece.nm.state import ClusterState

    topo, wf, _ = load_topology(deploy_dir() / "local.yaml")
    topo.sets[0].min["vae_decode"] = 0
    state, el = ClusterState(topo, wf), Elastic(SPEC)
    now = 1000.0
    assert not el.loads(state, "set0", now)["vae_decode"].had_min  # none yet: min 0 is no floor to hold
    inst = state.register("stage", "set0", {"data": "tcp://a:1"}, stage="vae_decode")
    inst.ready, inst.serving, inst.last_seen = True, "vae_decode", now
    assert el.loads(state, "set0", now)["vae_decode"].had_min  # it had one: from now on its floor is 1


def test_config_rejects_a_low_watermark_above_the_threshold_and_unknown_min_stages(tmp_path, tiny_models):
    with pytest.raises(ValueError, match="must be below elastic.threshold"):
        NmSpec(elastic={"threshold": 0.5, "low": 0.6})
    with pytest.raises(ValueError):
        NmSpec(elastic={"window_s": 0})
    from onepiece.launcher import write_topology

    path = write_topology(tmp_path, tiny_models, "tcp://127.0.0.1:7799", min={"nope": 1})
    with pytest.raises(ConfigError, match=r"sets.set0.min.nope: unknown stage"):
        load_topology(path)
    topo = Topology.model_validate({"workflow": "w.yaml", "sets": [{"stages": {"a": 2, "b": 0}, "min": {"a": 2}}]})
    assert topo.sets[0].min_of("a") == 2 and topo.sets[0].min_of("b") == 0


@pytest.fixture
def nm(tmp_path, tiny_models):
    from onepiece.config import load_topology
    from onepiece.launcher import free_tcp_address, write_topology
    from onepiece.nm.server import NodeManager

    topo, wf, base = load_topology(write_topology(tmp_path, tiny_models, free_tcp_address(), heartbeat_s=0.1,
                                                  nm={"elastic": {"enabled": False}}))
    nm = NodeManager(topo, wf, base)
    stop = threading.Event()
    t = threading.Thread(target=nm.run, args=(stop,), daemon=True)
    t.start()
    yield nm
    stop.set()
    t.join(5)
    nm.close()


def test_a_moved_instance_leaves_the_old_routes_at_once_and_joins_the_new_once_it_serves(nm):
    serving: dict[str, str | None] = {"stage": "vae_decode"}
    told: list[str | None] = []
    m = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9400"}, stage="vae_decode",
                   ready=lambda: serving["stage"] is not None, serving=lambda: serving["stage"], on_assign=told.append)
    twin = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9401"}, stage="vae_decode",
                      serving=lambda: "vae_decode")
    other = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9402"}, stage="denoise_t2v",
                       serving=lambda: "denoise_t2v")
    m.register()
    m.start()
    client = NmClient(nm.address)
    try:
        stages = lambda: client.routes("set0")["stages"]  # noqa: E731
        assert wait_for(lambda: stages()["vae_decode"] == ["tcp://127.0.0.1:9400"])
        # the last ready instance of a stage stays: the application would be down until one came back
        with pytest.raises(RpcError, match=f"moving {m.id} would leave stage vae_decode 0 ready instance"):
            client.move(m.id, "denoise_t2v")
        twin.register()
        twin.start()
        assert wait_for(lambda: sorted(stages()["vae_decode"]) == ["tcp://127.0.0.1:9400", "tcp://127.0.0.1:9401"])
        reply = client.move(m.id, "denoise_t2v")
        assert (reply["instance"], reply["from"], reply["to"]) == (m.id, "vae_decode", "denoise_t2v")
        # out of the old stage's routes before the instance even heard of it
        assert stages()["vae_decode"] == ["tcp://127.0.0.1:9401"] and stages()["denoise_t2v"] == []
        wait_for(lambda: told == ["denoise_t2v"], what="the instance to learn its new stage")
        # still saying it serves vae_decode (draining): routed nowhere
        assert stages()["denoise_t2v"] == [] and stages()["vae_decode"] == ["tcp://127.0.0.1:9401"]
        serving["stage"] = "denoise_t2v"
        assert wait_for(lambda: stages()["denoise_t2v"] == ["tcp://127.0.0.1:9400"])
        status = client.status()
        d = status["elastic"]["decisions"][-1]
        assert (d["instance"], d["from"], d["to"], d["reason"]) == (m.id, "vae_decode", "denoise_t2v", "asked by an operator")
        assert any("moving " + m.id in e for e in status["events"])
        # the idle pool: no route at all, and the status lists it there (once another instance
        # serves denoise_t2v: its only one stays where it is)
        with pytest.raises(RpcError, match="would leave stage denoise_t2v 0 ready instance"):
            client.move(m.id, None)
        other.register()
        other.start()
        assert wait_for(lambda: len(stages()["denoise_t2v"]) == 2)
        client.move(m.id, None)
        serving["stage"] = None
        wait_for(lambda: [i["id"] for i in client.status()["sets"]["set0"]["idle"]] == [m.id])
        assert stages()["denoise_t2v"] == ["tcp://127.0.0.1:9402"]
    finally:
        for member in (m, twin, other):
            member.stop()
        client.close()


def test_a_real_nm_refills_a_stage_that_lost_its_last_instance_from_the_idle_pool(tmp_path, tiny_models):
    """The embedded NM with its elastic policy on and a long cooldown and window: when
    vae_decode's only instance leaves, the instance waiting in the idle pool is moved there at
    once, with nothing measured."""
    from onepiece.launcher import free_tcp_address, write_topology
    from onepiece.nm.server import NodeManager

    topo, wf, base = load_topology(write_topology(
        tmp_path, tiny_models, free_tcp_address(), heartbeat_s=0.1, stages={"vae_decode": 1},
        nm={"elastic": {"enabled": True, "cooldown_s": 600, "window_s": 600}}))
    server = NodeManager(topo, wf, base)
    stop = threading.Event()
    t = threading.Thread(target=server.run, args=(stop,), daemon=True)
    t.start()
    serving = {"a": "vae_decode", "b": None}
    a = Membership(server.address, "stage", "set0", {"data": "tcp://127.0.0.1:9410"}, stage="vae_decode",
                   ready=lambda: True, serving=lambda: serving["a"])
    b = Membership(server.address, "stage", "set0", {"data": "tcp://127.0.0.1:9411"}, idle=True,
                   ready=lambda: True, serving=lambda: serving["b"], on_assign=lambda st: serving.update(b=st))
    client = NmClient(server.address)
    try:
        a.register()
        b.register()
        a.start()
        b.start()
        stages = lambda: client.routes("set0")["stages"]  # noqa: E731
        wait_for(lambda: stages()["vae_decode"] == ["tcp://127.0.0.1:9410"], what="a serves vae_decode")
        assert b.stage is None
        with pytest.raises(RpcError, match="unknown stage 'nope'"):  # named as such, whatever the floor
            client.move(a.id, "nope")
        a.stop()  # leaves: vae_decode has nobody
        wait_for(lambda: stages()["vae_decode"] == ["tcp://127.0.0.1:9411"], timeout=10, what="b moved in")
        d = client.status()["elastic"]["decisions"][-1]
        assert d["instance"] == b.id and d["to"] == "vae_decode" and "below its minimum 1" in d["reason"]
    finally:
        b.stop()
        client.close()
        stop.set()
        t.join(5)
        server.close()


@pytest.mark.exclusive
def test_an_operator_cannot_take_a_stages_only_instance_while_its_heartbeat_is_late(tmp_path, tiny_models):
    """Ready by its last heartbeat is ready however late that came (the NM routes it until it
    drops it): a heartbeat late under load, past the policy's freshness but within the dead
    limit, let `onepiece move` take a stage's only instance and leave the stage empty."""
    from onepiece.launcher import free_tcp_address, write_topology
    from onepiece.nm.server import NodeManager

    # Live to the policy: heard within half the dead limit (3 s); dropped after 6 s of silence.
    topo, wf, base = load_topology(write_topology(tmp_path, tiny_models, free_tcp_address(), heartbeat_s=0.1,
                                                  nm={"elastic": {"enabled": False}, "dead_after_s": 6}))
    nm = NodeManager(topo, wf, base)
    stop = threading.Event()
    t = threading.Thread(target=nm.run, args=(stop,), daemon=True)
    t.start()
    only = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9410"}, stage="vae_decode",
                      serving=lambda: "vae_decode")
    twin = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9411"}, stage="vae_decode",
                      serving=lambda: "vae_decode")
    client = NmClient(nm.address)
    try:
        only.register()
        only._beat()  # one heartbeat says it serves (ready); no other follows: a stalled process
        assert nm.state.instances[only.id].ready
        def silent_s() -> float:
            (inst,) = [i for i in client.status()["sets"]["set0"]["stages"]["vae_decode"]["instances"]
                       if i["id"] == only.id]
            return inst["silent_s"]
        wait_for(lambda: silent_s() > 3.2, timeout=10, interval=0.1, what="late past the policy's freshness")
        with pytest.raises(RpcError, match=f"moving {only.id} would leave stage vae_decode 0 ready instance"):
            client.move(only.id, None)
        assert nm.state.instances[only.id].stage == "vae_decode"
        # with a twin that serves, the late one may go
        twin.register()
        twin.start()
        wait_for(lambda: nm.state.instances[twin.id].ready, what="the twin to serve")
        assert client.move(only.id, None)["to"] is None
    finally:
        client.close()
        twin.stop()
        stop.set()
        t.join(5)
        nm.close()


def test_bad_moves_get_clear_errors_and_the_nm_keeps_serving(nm):
    client = NmClient(nm.address)
    try:
        m = Membership(nm.address, "db", "set0", {"data": "tcp://127.0.0.1:9401", "control": "tcp://127.0.0.1:9402",
                                                      "events": "tcp://127.0.0.1:9403"})
        m.register()
        for args, match in (({"instance": "stage-99", "stage": "vae_decode"}, "no stage instance 'stage-99'"),
                            ({"instance": m.id, "stage": "vae_decode"}, f"no stage instance '{m.id}'"),
                            ({"instance": 7, "stage": "x"}, "move.instance: Input should be a valid string"),
                            ({"instance": "stage-1", "stage": ["x"]}, "move.stage: Input should be a valid string")):
            with pytest.raises(RpcError, match=match):
                client.call("move", key=os.environ[OPERATOR_ENV], **args)
        s = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9402"}, stage="vae_decode")
        s.register()
        with pytest.raises(RpcError, match="unknown stage 'nope'"):
            client.move(s.id, "nope")
        with pytest.raises(RpcError, match="already assigned to vae_decode"):
            client.move(s.id, "vae_decode")
        out = subprocess.run([sys.executable, "-m", "onepiece", "move", "stage-99", "idle", "--nm", nm.address],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "no stage instance 'stage-99'" in out.stderr
        assert client.routes("set0")["version"] >= 1  # still answering
    finally:
        client.close()


def test_gpu_utilization_is_absent_without_a_gpu_and_devices_map_like_the_task_manager():
    from onepiece.stage.gpu import GpuUtilization, cuda_indices

    assert cuda_indices("cpu", 4) == [] and cuda_indices("cuda", 1) == [0]
    assert cuda_indices("cuda:3", 1) == [3] and cuda_indices("cuda", 2) == [0, 1]
    assert GpuUtilization([]).sample() is None and GpuUtilization([]).uuids == []
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no NVIDIA driver here: the figures are absent, not an error
        assert GpuUtilization([0]).sample() is None and GpuUtilization([0]).uuids == []
    else:
        gpu = GpuUtilization([0])
        assert 0.0 <= gpu.sample() <= 1.0
        assert [u[:4] for u in gpu.uuids] == ["GPU-"]  # what the NM tells shared cards apart by


def test_a_message_for_a_stage_this_instance_left_is_forwarded_with_a_hop_bound(tiny_models, tmp_path):
    """What a moved instance does with a message sent on old routes: hand it to an instance
    that serves its stage (real ZMQ sockets), and fail it visibly once it has gone round."""
    from onepiece.config import load_topology
    from onepiece.launcher import write_topology
    from onepiece.stage.deliver import MAX_HOPS, ResultDeliver
    from onepiece.transport import registry
    from onepiece.transport.message import Message

    _, wf, _ = load_topology(write_topology(tmp_path, tiny_models, "tcp://127.0.0.1:7799"))
    decode, db = registry.listen("tcp://127.0.0.1:0"), registry.listen("tcp://127.0.0.1:0")
    routes = {"version": 1, "stages": {"vae_decode": [decode.address]},
              "dbs": [{"data": db.address, "control": "c", "events": "e"}]}
    deliver = ResultDeliver("denoise_t2v", wf, None, routes=lambda: routes)  # type: ignore[arg-type]
    try:
        deliver.forward(Message({"uid": "u1", "app": "t2v", "stage": "vae_decode"}, {"x": b"payload"}))
        got = decode.recv(5.0)
        assert got.uid == "u1" and got.header["hops"] == 1 and bytes(got.parts["x"]) == b"payload"
        deliver.forward(Message({"uid": "u2", "app": "t2v", "stage": "vae_decode", "hops": MAX_HOPS}))
        failed = db.recv(5.0)
        assert (failed.uid, failed.kind) == ("u2", "failed") and "forwarded 3 times" in failed.header["error"]
        deliver.forward(Message({"uid": "u3", "app": "t2v", "stage": "nope"}))
        failed = db.recv(5.0)
        assert failed.uid == "u3" and "unknown stage 'nope'" in failed.header["error"]
        assert decode.recv(0.2) is None
    finally:
        deliver.close()
        decode.close()
        db.close()


def test_an_instance_moves_only_to_a_stage_that_needs_no_more_devices_than_it_holds():
    ls = loads(denoise=(0.95, 1, 1), decode=(0.1, 2, 1))
    ls["denoise"].needs = 2
    # The idle one and both decoders hold 1 device: nothing can go to denoise.
    assert decide(SPEC, ls, ["idle-1"], {}, holds={"idle-1": 1}) is None
    assert decide(SPEC, ls, [], {}) is None
    # A decoder on 2 devices can; the one on 1 stays even though it is the least busy.
    move = decide(SPEC, ls, [], {"decode-0": 0.0, "decode-1": 0.3}, holds={"decode-1": 2})
    assert (move.instance, move.src, move.dst) == ("decode-1", "decode", "denoise")
    # A stage below its minimum is refilled only by an idle instance that fits it.
    short = {"denoise": StageLoad("denoise", [], None, 1, needs=2)}
    assert decide(SPEC, short, ["idle-1"], {}, floors_only=True) is None
    assert decide(SPEC, short, ["idle-1", "idle-2"], {}, floors_only=True, holds={"idle-2": 2}).instance == "idle-2"


def test_status_shows_an_idle_pool_instance_standing_by_not_starting():
    from onepiece.status import render

    idle = {"id": "set0-idle0", "role": "stage", "ready": False, "silent_s": 0.1, "stage": None, "serving": None,
            "stats": {}, "addresses": {"data": "tcp://127.0.0.1:9"}}
    loading = {**idle, "id": "set0-vae_decode0", "stage": "vae_decode"}
    text = render({"sets": {"set0": {"stages": {"vae_decode": {"want": 1, "instances": [loading]}},
                                     "idle": [idle], "dbs": [], "proxies": []}}})
    assert "set0-idle0 standing by" in text and "set0-vae_decode0 starting" in text, text
