"""The embedded node manager over real sockets: registration, assignment, routes, expiry."""

import logging
import os
import subprocess
import sys
import threading

import pytest

from onepiece.config import load_topology, deploy_dir
from onepiece.nm import state as nm_state
from onepiece.nm.client import Membership, NmClient
from onepiece.nm.server import NodeManager
from onepiece.transport.rpc import RpcError
from waiting import wait_for

KEY = os.environ["ONEPIECE_OPERATOR_KEY"]  # conftest's


@pytest.fixture
def nm():
    topo, wf, base = load_topology(deploy_dir() / "local.yaml")
    topo.nm.heartbeat_s = 0.1
    topo.nm.dead_after_s = 0.5
    # These tests assign by hand; the elastic policy would refill the empty stages from the
    # idle pool (its floors; tests/test_elastic_policy.py).
    topo.nm.elastic.enabled = False
    server = NodeManager(topo, wf, base, "tcp://127.0.0.1:0")
    stop = threading.Event()
    t = threading.Thread(target=server.run, args=(stop,))
    t.start()
    yield server
    stop.set()
    t.join()
    server.close()



def test_stage_instances_get_the_stage_with_the_biggest_deficit(nm):
    members = [Membership(nm.address, "stage", "set0", {"data": f"tcp://127.0.0.1:{9000 + i}"}) for i in range(7)]
    stages = [m.register()["stage"] for m in members]
    # the topology wants one of each of the six stages; the seventh goes to the idle pool
    assert sorted(s for s in stages if s) == sorted(nm.workflow.stages)
    assert stages[-1] is None


def test_register_reply_carries_workflow_and_pin(nm):
    m = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9100"}, stage="vae_decode")
    reply = m.register()
    assert reply["stage"] == "vae_decode"
    assert set(reply["workflow"]["applications"]) == {"t2v", "i2v"}
    with pytest.raises(RpcError, match="unknown stage"):
        Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:1"}, stage="nope").register(timeout=1)
    with pytest.raises(RpcError, match=r"addresses.data: String should match pattern"):  # no scheme://: no sender
        Membership(nm.address, "stage", "set0", {"data": "not an address"}, stage="vae_decode").register(timeout=1)
    with pytest.raises(RpcError, match="unknown set"):
        Membership(nm.address, "proxy", "set9", {"http": "http://127.0.0.1:1"}).register(timeout=1)
    # an instance that leaves out an address its peers need is refused, and the set's
    # route table stays intact for everyone else
    with pytest.raises(RpcError, match="a db must register its control, events address"):
        Membership(nm.address, "db", "set0", {"data": "tcp://127.0.0.1:1"}).register(timeout=1)
    client = NmClient(nm.address)
    assert client.routes("set0")["stages"]["vae_decode"] == []
    client.close()


def test_a_restarted_instance_returns_where_it_was_moved(nm):
    """A named instance that the NM moved, started again under its name (a new process, the same
    id: its name), registers at the stage it was moved to, not at its pin; other names keep their pins."""
    client = NmClient(nm.address)
    try:
        first = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9200"}, stage="vae_decode",
                           name="set0-vae_decode0")
        first.register()
        client.move(first.id, "denoise_t2v")
        client.call("deregister", instance=first.id, key=KEY)  # its process died (an operator says so)
        again = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9201"}, stage="vae_decode",
                           name="set0-vae_decode0")
        assert again.register()["stage"] == "denoise_t2v" and again.id == first.id == "set0-vae_decode0"
        assert any("where it was moved before it restarted" in e for e in client.status()["events"])
        other = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9202"}, stage="vae_decode",
                           name="set0-vae_decode1")
        assert other.register()["stage"] == "vae_decode"
        client.move(again.id, None)  # to the idle pool: a restart stays there
        client.call("deregister", instance=again.id, key=KEY)
        third = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9203"}, stage="vae_decode",
                           name="set0-vae_decode0")
        assert third.register()["stage"] is None
        # the remembered moves are bounded: the oldest go first
        for i in range(nm_state.MAX_MOVED_NAMES + 1):
            m = Membership(nm.address, "stage", "set0", {"data": f"tcp://127.0.0.1:{9300 + i}"}, stage="vae_decode",
                           name=f"n{i}")
            m.register()
            client.move(m.id, "vae_encode")
            client.call("deregister", instance=m.id, key=KEY)
        assert len(nm.state.moved["set0"]) == nm_state.MAX_MOVED_NAMES and "set0-vae_decode0" not in nm.state.moved["set0"]
        with pytest.raises(RpcError, match=r"register.name: Input should be a valid string"):
            client.call("register", role="stage", set="set0", addresses={"data": "tcp://127.0.0.1:1"}, name=7)
    finally:
        client.close()


def test_only_ready_live_instances_are_routed(nm):
    ready = {"v": False}
    stage = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9200"}, stage="denoise_t2v",
                       ready=lambda: ready["v"])
    db = Membership(nm.address, "db", "set0", {"data": "tcp://127.0.0.1:9201", "control": "tcp://127.0.0.1:9202", "events": "tcp://127.0.0.1:9203"})
    proxy = Membership(nm.address, "proxy", "set0", {"http": "http://127.0.0.1:8123"})
    for m in (stage, db, proxy):
        m.register()
        m.start()
    client = NmClient(nm.address)
    try:
        routes = client.routes("set0")
        assert routes["stages"]["denoise_t2v"] == []  # not ready yet
        assert routes["dbs"][0]["data"] == "tcp://127.0.0.1:9201"
        assert client.proxies() == {"set0": ["http://127.0.0.1:8123"]}
        ready["v"] = True
        assert wait_for(lambda: client.routes("set0")["stages"]["denoise_t2v"] == ["tcp://127.0.0.1:9200"])
        # the instance's own copy of the routes follows through heartbeats
        assert wait_for(lambda: stage.routes["stages"]["denoise_t2v"] == ["tcp://127.0.0.1:9200"])
        # an instance that stops heartbeating is dropped from routes after dead_after_s
        stage._stop.set()
        stage._thread.join()
        assert wait_for(lambda: client.routes("set0")["stages"]["denoise_t2v"] == [], timeout=3)
        assert any("no heartbeat" in e for e in client.status()["events"])
    finally:
        for m in (db, proxy):
            m.stop()
        client.close()


def test_nm_forgetting_an_instance_makes_it_register_again(nm):
    m = Membership(nm.address, "db", "set0", {"data": "tcp://127.0.0.1:9300", "control": "tcp://127.0.0.1:9301", "events": "tcp://127.0.0.1:9302"})
    m.register()
    first = m.id
    nm.state.deregister(first, "test forgets it")
    m.start()
    client = NmClient(nm.address)
    try:
        assert wait_for(lambda: m.id != first and m.id in nm.state.instances)
    finally:
        m.stop()
        client.close()


def test_a_heartbeat_without_the_members_process_token_is_refused(nm):
    """Anyone who reaches the NM (on loopback, any local process; with CURVE, a proxies' key)
    could heartbeat for any stage instance without its process token: a stream of them saying
    "not ready" kept a healthy instance out of the routes, which only its own token (or the
    operator key) may take it out of."""
    m = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9550"}, stage="vae_decode")
    m.register()
    client = NmClient(nm.address)
    try:
        client.call("heartbeat", instance=m.id, ready=True, serving="vae_decode", process=m.process)
        assert nm.state.routes("set0")["stages"]["vae_decode"] == ["tcp://127.0.0.1:9550"]
        for forged in ({}, {"process": ""}):
            with pytest.raises(RpcError, match=f"unknown instance {m.id} for this process"):
                client.call("heartbeat", instance=m.id, ready=False, serving="vae_decode", **forged)
        assert nm.state.instances[m.id].ready
        assert nm.state.routes("set0")["stages"]["vae_decode"] == ["tcp://127.0.0.1:9550"]
    finally:
        client.close()


def test_a_malformed_stage_heartbeat_keeps_the_instance_alive_and_breaks_no_estimate(nm, caplog):
    """Stats the NM computes capacity from are checked: before, one heartbeat with a string
    where a count belongs broke every later estimate (the proxies' monitor views, status)."""
    caplog.set_level(logging.WARNING)
    m = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9500"}, stage="vae_decode")
    m.register()
    client = NmClient(nm.address)
    try:
        good = {"ready": 1, "queue": 0, "service": {"t2v": {"mean_s": 0.1, "recent": 3, "shapes": {"64x64x9:10": 0.1}}}}
        client.call("heartbeat", instance=m.id, ready=True, stats=good, serving="vae_decode", process=m.process)
        for bad in ({"ready": "x"}, {"queue": -1}, {"service": [1]}, {"service": {"t2v": {"mean_s": "fast"}}},
                    {"service": {"t2v": {"mean_s": 0.1, "shapes": {"64x64x9:10": -2}}}}, {"ready": True},
                    {"gpus": "GPU-a"}, {"gpus": [""]}, {"gpus": [7]}):
            client.call("heartbeat", instance=m.id, ready=True, stats=bad, serving="vae_decode", process=m.process)
        assert nm.state.instances[m.id].stats["service"] == good["service"]  # the last good figures stay
        assert nm.state.monitor("set0")["apps"]["t2v"]["stages"]["vae_decode"]["service_s"] == 0.1
        assert client.status()["sets"]["set0"]
        assert f"heartbeat of {m.id}: stats dropped: stats.ready" in caplog.text
    finally:
        client.close()


def test_moves_need_the_operator_key_and_leaving_needs_the_members_own_token(nm):
    m = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9300"}, stage="vae_decode")
    m.register()
    client = NmClient(nm.address)
    try:
        for key in ("", "not-the-key"):
            with pytest.raises(RpcError, match="move needs the operator key"):
                client.move(m.id, None, key=key)
        assert nm.state.instances[m.id].stage == "vae_decode"  # nothing moved
        assert client.move(m.id, "denoise_t2v", key=KEY)["to"] == "denoise_t2v"
        # Anyone else's deregister is refused; the member's own (its registration's token) is not.
        with pytest.raises(RpcError, match="needs that instance's own token"):
            client.call("deregister", instance=m.id)
        with pytest.raises(RpcError, match="needs that instance's own token"):
            client.call("deregister", instance=m.id, token="guess")
        assert m.id in nm.state.instances
        m.stop()
        assert m.id not in nm.state.instances
    finally:
        client.close()


def test_a_node_manager_without_an_operator_key_refuses_every_move(monkeypatch):
    monkeypatch.delenv("ONEPIECE_OPERATOR_KEY")
    topo, wf, base = load_topology(deploy_dir() / "local.yaml")
    server = NodeManager(topo, wf, base, "tcp://127.0.0.1:0")
    stop = threading.Event()
    t = threading.Thread(target=server.run, args=(stop,))
    t.start()
    client = NmClient(server.address)
    try:
        with pytest.raises(RpcError, match="this node manager has none"):
            client.move("stage-1", None, key="anything")
    finally:
        client.close()
        stop.set()
        t.join()
        server.close()


def test_onepiece_up_keeps_the_operator_key_in_a_private_file_never_on_a_command_line(tmp_path, monkeypatch):
    import stat

    from onepiece import operator_key
    from onepiece.launcher import Deployment

    monkeypatch.delenv("ONEPIECE_OPERATOR_KEY")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    (nm_child,) = [c for c in Deployment(deploy_dir() / "local.yaml", tmp_path / "logs").plan() if c.name == "nm"]
    path = operator_key.default_path()
    assert nm_child.argv[nm_child.argv.index(operator_key.FLAG) + 1] == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = operator_key.resolve(None, fallback=True)  # what `onepiece move` finds
    assert key and key not in " ".join(nm_child.argv)
    (again,) = [c for c in Deployment(deploy_dir() / "local.yaml", tmp_path / "logs").plan() if c.name == "nm"]
    assert operator_key.resolve(None, fallback=True) == key  # made once, then kept


def test_an_nm_that_cannot_bind_leaves_no_thread_behind(nm):
    """A second NM at a taken address fails to start, and takes its threads (the reaper, the
    sweep for unheld requests) with it."""
    import zmq

    topo, wf, base = load_topology(deploy_dir() / "local.yaml")

    def threads() -> int:
        return sum(t.name in ("nm-reaper", "nm-orphans") for t in threading.enumerate())
    before = threads()
    with pytest.raises(zmq.ZMQError):
        NodeManager(topo, wf, base, nm.address)
    wait_for(lambda: threads() == before, 5, "its threads gone")


def test_only_the_primary_exports_the_cluster_state(nm):
    """A backup NM's state is the last it saw as primary: exported too, a sum over the NMs
    counted every instance twice. It says it is no primary, and nothing else."""
    from onepiece.nm.server import NmMetrics

    names = lambda: {f.name for f in NmMetrics(nm).collect()}  # noqa: E731
    assert names() == {"onepiece_nm_primary", "onepiece_nm_instances", "onepiece_nm_dropped_instances",
                       "onepiece_nm_routes_version"}
    nm.primary = False  # as nm/ha.py's backups are
    assert names() == {"onepiece_nm_primary"}
    assert next(iter(NmMetrics(nm).collect())).samples[0].value == 0


def test_the_nm_serves_its_metrics_on_the_host_it_serves_on(tmp_path):
    """An NM bound beyond loopback (0.0.0.0 in a container, with --metrics-port for the scraper)
    served its metrics on 127.0.0.1 only: nobody else could scrape them. They follow the NM's
    address now; 127.0.0.2 stands for another address here (no socket on 127.0.0.1 takes it)."""
    import re
    import socket

    import httpx

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
            return s.getsockname()[1]

    port, metrics_port = free_port(), free_port()
    log_path = tmp_path / "nm.log"
    proc = subprocess.Popen([sys.executable, "-m", "onepiece", "nm", "--topology", str(deploy_dir() / "local.yaml"),
                             "--address", f"tcp://127.0.0.2:{port}", "--metrics-port", str(metrics_port)],
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    try:
        url = wait_for(lambda: (m := re.search(r"metrics at (\S+)", log_path.read_text())) and m.group(1), 60,
                       "the NM's start line")
        assert url == f"http://127.0.0.2:{metrics_port}/metrics"
        assert "onepiece_nm_primary 1.0" in httpx.get(url, timeout=5).text
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_nm_exports_a_stage_without_instances_at_zero(nm):
    """A stage whose last instance was dropped had no `onepiece_nm_instances` series, so an alert
    on its ready count being 0 never fired: every stage, DB and proxy of a set is exported, at 0."""
    from onepiece.nm.server import NmMetrics

    def count(stage: str, ready: str, role: str = "stage") -> float | None:
        (family,) = [f for f in NmMetrics(nm).collect() if f.name == "onepiece_nm_instances"]
        values = [s.value for s in family.samples
                  if s.labels == {"set": "set0", "role": role, "stage": stage, "ready": ready}]
        return values[0] if values else None

    assert count("text_encode", "true") == 0 and count("vae_decode", "false") == 0 and count("", "true", "db") == 0
    member = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9"}, stage="text_encode")
    member.register()
    try:
        assert count("text_encode", "false") == 1 and count("text_encode", "true") == 0
    finally:
        member.stop()


def test_the_nm_counts_instances_dropped_other_than_by_leaving(nm):
    """A dropped instance showed only in the last 20 events of `onepiece status`, which scroll
    away: the NM counts them per set, role and stage, for an alert. One that leaves is not counted."""
    from onepiece.nm.server import NmMetrics

    def dropped() -> dict[tuple, float]:
        (family,) = [f for f in NmMetrics(nm).collect() if f.name == "onepiece_nm_dropped_instances"]
        return {(s.labels["set"], s.labels["role"], s.labels["stage"]): s.value for s in family.samples
                if s.name.endswith("_total")}

    assert dropped() == {}
    leaving = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:8"}, stage="vae_decode")
    leaving.register()
    leaving.stop()  # says goodbye
    silent = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9"}, stage="text_encode")
    silent.register()  # and never heartbeats: dropped after the dead limit (0.5 s)
    try:
        wait_for(lambda: dropped() == {("set0", "stage", "text_encode"): 1.0}, 10, "the silent one counted")
    finally:
        silent.stop()


def test_a_bad_uid_in_a_holding_list_costs_only_itself(nm):
    """What a dead instance held is what the NM fails for it: a uid no DB takes (too long, a
    newline) must not make the NM drop the whole list."""
    from onepiece.nm.protocol import Holdings
    from onepiece.schema import problem

    assert "should match pattern" in problem(Holdings, {"holding": ["bad\nuid"]})  # a Name has no control characters
    good = ["a" * 32, "b" * 32]
    m = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9700"}, stage="vae_decode",
                   stats=lambda: {"holding": [good[0], "x" * 129, "bad\nuid", good[1]]})
    m.register()
    m.start()
    try:
        wait_for(lambda: nm.state.instances[m.id].holding == good, what="the good uids held")
    finally:
        m.stop()


def test_an_operator_key_shorter_than_a_client_s_api_key_is_refused_naming_where_it_came_from(tmp_path, monkeypatch):
    from onepiece import operator_key
    from onepiece.secret_file import SecretFileError, write_secret_file

    for bad in ("x", "k" * 31, "k" * 20 + " " + "k" * 20, "k" * 257, "ключ" * 10):
        with pytest.raises(SecretFileError, match=r"^ONEPIECE_OPERATOR_KEY: an operator key is 32 to 256 visible "
                                                  r"ASCII characters") as e:
            operator_key.resolve(None, {operator_key.ENV: bad})
        assert bad not in str(e.value)
    write_secret_file(tmp_path / "op.key", "short\n")
    with pytest.raises(SecretFileError, match=r"operator key file .*op.key: an operator key is 32 to 256"):
        operator_key.resolve(tmp_path / "op.key", {})
    assert operator_key.resolve(None, {operator_key.ENV: " " + "k" * 32 + "\n"}) == "k" * 32
    # `onepiece up` says so before it starts anything (its NM would fail in a restart loop)
    monkeypatch.setenv(operator_key.ENV, "x")
    out = subprocess.run([sys.executable, "-m", "onepiece", "up", "--logs", str(tmp_path / "logs")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "ONEPIECE_OPERATOR_KEY: an operator key is 32 to 256" in out.stderr, out.stderr
    assert not (tmp_path / "logs").exists()
