"""Dead detection that tolerates a stalled NM (issue 15, item 4): under CPU contention the
embedded NM declared every instance dead at once, because it had not run to hear them. The
rule (nm/liveness.py ``decide``) directly, then a real NM process stopped with SIGSTOP (a real
stall, caused by the OS) beside real DB processes, one of them killed while the NM stood still."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from onepiece.config import deploy_dir
from onepiece.launcher import free_tcp_address
from onepiece.nm.client import NmClient
from onepiece.nm.liveness import MISSED, LivenessSpec, decide
from onepiece.transport.rpc import RpcError
from waiting import wait_for

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

SPEC = LivenessSpec(heartbeat_s=1.0, dead_after_s=4.0)


def test_an_instance_silent_beyond_the_limit_is_dead_and_one_just_heard_is_not():
    v = decide(SPEC, {"a": 100.0, "b": 95.5, "c": 96.5}, now=100.2, previous_turn=99.9, listening_since=0.0)
    assert v.dead == ["b"] and v.stalled_s is None and v.listening_since == 0.0


def test_the_limit_is_never_below_a_few_missed_heartbeats():
    """dead_after_s below a heartbeat or two would drop an instance for one late try."""
    spec = LivenessSpec(heartbeat_s=1.0, dead_after_s=1.2)
    assert spec.limit_s == MISSED * 1.0 > 2 * spec.heartbeat_s
    assert decide(spec, {"a": 0.0}, now=2.5, previous_turn=2.4, listening_since=0.0).dead == []
    assert decide(spec, {"a": 0.0}, now=3.1, previous_turn=3.0, listening_since=0.0).dead == ["a"]


def test_a_stalled_nm_drops_nobody_and_gives_everyone_a_fresh_grace_period():
    # The loop did not turn for 6 s (more than the 4 s limit): nobody could be heard meanwhile.
    seen = {"a": 10.0, "b": 10.5, "c": 11.0}
    v = decide(SPEC, seen, now=17.0, previous_turn=11.0, listening_since=0.0)
    assert v.dead == [] and v.stalled_s == pytest.approx(6.0) and v.listening_since == 17.0
    # Those that answer again live on; one that stays silent is dead a whole limit after the stall.
    assert decide(SPEC, {**seen, "a": 17.3, "b": 17.4}, now=20.9, previous_turn=20.8,
                  listening_since=17.0).dead == []
    assert decide(SPEC, {**seen, "a": 20.9, "b": 21.0}, now=21.1, previous_turn=21.0,
                  listening_since=17.0).dead == ["c"]


def test_a_short_pause_of_the_loop_is_no_stall():
    """Only a gap of half the limit counts: a busy turn must not keep dead instances alive."""
    v = decide(SPEC, {"a": 0.0}, now=5.0, previous_turn=3.5, listening_since=0.0)
    assert v.stalled_s is None and v.dead == ["a"]
    assert decide(SPEC, {"a": 0.0}, now=5.0, previous_turn=2.9, listening_since=0.0).dead == []


def _nm_topology(folder, address: str) -> str:
    topo = yaml.safe_load((deploy_dir() / "local.yaml").read_text())
    topo["workflow"] = str(deploy_dir() / "wan21.yaml")
    topo["nm"] = {"address": address, "heartbeat_s": 0.2, "dead_after_s": 1.0}
    path = folder / "topology.yaml"
    path.write_text(yaml.safe_dump(topo))
    return str(path)


def _start(args: list[str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "onepiece", *args], stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.exclusive
def test_a_real_nm_stopped_longer_than_the_timeout_keeps_its_members_and_drops_only_the_dead(tmp_path):
    address = free_tcp_address()
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("nm", "db0", "db1", "db2")}
    nm = _start(["nm", "--topology", _nm_topology(tmp_path, address), "--address", address], logs["nm"])
    dbs = [_start(["db", "--nm", address], logs[f"db{i}"]) for i in range(3)]
    client = NmClient(address, timeout=2.0, retries=0)

    def members() -> dict[int, str]:
        try:
            return {d["pid"]: d["id"] for d in client.status()["sets"]["set0"]["dbs"]}
        except RpcError:
            return {}

    try:
        before = wait_for(lambda: (m := members()) and len(m) == 3 and m, timeout=60, what="three DBs registered")
        # The NM stands still for 3 s, three times its 1 s limit; one DB dies meanwhile.
        os.kill(nm.pid, signal.SIGSTOP)
        try:
            dbs[2].kill()
            dbs[2].wait()
            time.sleep(3.0)
        finally:
            os.kill(nm.pid, signal.SIGCONT)
        # The two that live were never dropped (the same ids, no second registration) ...
        after = wait_for(lambda: (m := members()) and dbs[2].pid not in m and m, timeout=10,
                         what="the killed DB dropped")
        assert after == {p: i for p, i in before.items() if p != dbs[2].pid}
        events = client.status()["events"]
        assert [e for e in events if "dropped" in e] == [e for e in events if f"dropped {before[dbs[2].pid]}" in e]
        assert sum("registered" in e for e in events) == 3
        # ... and the NM said why it waited.
        assert "loop stalled" in (tmp_path / "nm.log").read_text()
    finally:
        client.close()
        for p in (*dbs, nm):
            if p.poll() is None:
                p.terminate()
        for p in (*dbs, nm):
            p.wait(15)
        for f in logs.values():
            f.close()
