"""The node manager on ZooKeeper, against real ZooKeeper servers (tests/zk_harness.py) and real
`onepiece nm` processes: election, redirects, state that survives a SIGKILLed or stopped
primary, fencing of a primary that was paused past its session, member nodes that vanish with
their process (and the requests it held reported failed to a real DB), digest ACLs, and the
configuration checks. The whole-deployment fault tests are in test_zk_failover.py.

Each test works under its own znode root, so one standalone server serves the module.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

import zk_harness
from onepiece.config import ConfigError, deploy_dir, load_topology
from onepiece.nm.client import Membership, NmClient
from onepiece.nm.zk import ZkSettings
from onepiece.nm.zk_auth import ENV
from onepiece.transport.rpc import RpcClient, RpcError
from proxy_harness import DbThread
from waiting import wait_for

SESSION_S = 2.0
TICK_S = 0.5  # the test ZooKeeper's tickTime: it expires sessions on tick boundaries, up to a tick late
HEARTBEAT_S = 0.25


@pytest.fixture(scope="module")
def zk():
    why = zk_harness.missing()
    if why:
        pytest.skip(f"needs a real ZooKeeper server: {why}")
    with zk_harness.ZkEnsemble(1) as ensemble:
        yield ensemble


@pytest.fixture
def root() -> str:
    return f"/t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def topology(tmp_path_factory) -> Path:
    """The shipped topology with short heartbeats (nothing here loads models)."""
    import yaml

    folder = tmp_path_factory.mktemp("topology")
    topo = yaml.safe_load((deploy_dir() / "local.yaml").read_text())
    topo["workflow"] = str(deploy_dir() / "wan21.yaml")
    topo["nm"]["heartbeat_s"] = HEARTBEAT_S
    path = folder / "topology.yaml"
    path.write_text(yaml.safe_dump(topo))
    return path


class Nms:
    """``n`` `onepiece nm` processes on one ZooKeeper root, each logging to its own file."""

    def __init__(self, hosts: str, root: str, topology: Path, logs: Path, n: int = 3, auth: str | None = None,
                 auth_via: str = "file") -> None:
        self.hosts, self.root, self.topology, self.logs, self.auth = hosts, root, topology, logs, auth
        self.auth_via = auth_via  # how the credentials reach the processes: "file" or "env"
        self.addresses = [f"tcp://127.0.0.1:{p}" for p in zk_harness.free_ports(n)]
        self.procs: dict[str, subprocess.Popen] = {}
        for a in self.addresses:
            self.start(a)
        self.client = NmClient(",".join(self.addresses), timeout=0.5, retries=0)

    def start(self, address: str) -> None:
        argv = [sys.executable, "-m", "onepiece", "nm", "--topology", str(self.topology), "--address", address,
                "--zk", self.hosts, "--zk-root", self.root, "--zk-session", str(SESSION_S)]
        env = {k: v for k, v in os.environ.items() if k != ENV}
        if self.auth and self.auth_via == "file":
            path = self.logs / "zk-auth"
            path.write_text(self.auth + "\n")
            path.chmod(0o600)
            argv += ["--zk-auth-file", str(path)]
        elif self.auth:
            env[ENV] = self.auth
        log = open(self.logs / f"nm-{address.rsplit(':', 1)[1]}.log", "ab")
        self.procs[address] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()

    def status(self) -> dict | None:
        try:
            return self.client.status()
        except RpcError:
            return None

    def primary(self, timeout: float = 15.0, other_than: str | None = None) -> str:
        def serving() -> str | None:
            st = self.status()
            return st["nm"]["address"] if st and st["nm"]["address"] != other_than else None
        return wait_for(serving, timeout, "a primary node manager", interval=0.02)

    def zk_settings(self) -> ZkSettings:
        return ZkSettings(self.hosts, self.root, self.auth, SESSION_S)

    def stop(self) -> None:
        self.client.close()
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


@pytest.fixture
def nms_factory(zk, root, topology, tmp_path):
    made: list[Nms] = []

    def make(n: int = 3, auth: str | None = None, auth_via: str = "file") -> Nms:
        nms = Nms(zk.hosts, root, topology, tmp_path, n, auth, auth_via)
        made.append(nms)
        return nms

    yield make
    for nms in made:
        nms.stop()


def member(nms: Nms, role: str, addresses: dict, **kw) -> Membership:
    m = Membership(",".join(nms.addresses), role, "set0", addresses, zk=nms.zk_settings(), **kw)
    m.register(timeout=20)
    m.start()
    return m


def db_addresses(n: int) -> dict[str, str]:
    return {"data": f"tcp://127.0.0.1:{n}", "control": f"tcp://127.0.0.1:{n + 1}", "events": f"tcp://127.0.0.1:{n + 2}"}


# ---- the harness itself ------------------------------------------------------------------------

@pytest.mark.exclusive
def test_harness_ensemble_keeps_serving_without_one_server(tmp_path):
    why = zk_harness.missing()
    if why:
        pytest.skip(f"needs a real ZooKeeper server: {why}")
    with zk_harness.ZkEnsemble(3, tmp_path / "zk") as ens:
        modes = sorted(s.mode() for s in ens.servers)
        assert modes == ["follower", "follower", "leader"]
        for s in ens.servers:  # loopback only, as configured
            assert "clientPortAddress=127.0.0.1" in (s.folder / "zoo.cfg").read_text()
        client = zk_harness.kazoo_client(ens.hosts)
        try:
            client.create("/before", b"1")
            assert client._session_timeout == 2000  # tickTime=500 + minSessionTimeout=1000 grant 2 s
            leader = ens.servers.index(ens.leader())
            ens.kill(leader)
            # Two of three keep the quorum: the session and the data survive, writes go on.
            wait_for(lambda: ens.leader() is not None, 15, "a new ZooKeeper leader", interval=0.1)
            client.create("/after", b"2")
            assert client.get("/before")[0] == b"1"
            ens.restart(leader)
            assert ens.servers[leader].mode() == "follower"
        finally:
            client.stop()
            client.close()


# ---- election, redirects, takeover -------------------------------------------------------------

@pytest.mark.exclusive
def test_backups_redirect_and_a_new_primary_keeps_the_state(nms_factory):
    nms = nms_factory(3)
    first = nms.primary()
    # Backups answer every op with where the primary is; the primary answers itself.
    for a in nms.addresses:
        rpc = RpcClient(a, timeout=2.0, retries=0)
        try:
            if a == first:
                assert rpc.call("status")[0]["nm"]["primary"] is True
            else:
                with pytest.raises(RpcError, match=f"not primary; primary at {first}"):
                    rpc.call("routes", set="set0")
        finally:
            rpc.close()

    db = member(nms, "db", db_addresses(9400), capacity={"max_bytes": 1 << 20})
    proxy = member(nms, "proxy", {"http": "http://127.0.0.1:8765"})
    stage = member(nms, "stage", {"data": "tcp://127.0.0.1:9410"}, stage="text_encode")
    look = zk_harness.kazoo_client(nms.hosts)
    try:
        assert db.id.startswith("db-") and stage.id.startswith("stage-")
        # Each instance's ephemeral member node says who it is, where, and what it can take.
        import orjson

        data, stat = look.get(f"{nms.root}/members/{db.id}")
        assert stat.ephemeralOwner == db.zk.client_id[0]
        assert {k: v for k, v in orjson.loads(data).items() if k not in ("pid", "host")} == {
            "role": "db", "set": "set0", "stage": None, "addresses": db_addresses(9400),
            "capacity": {"max_bytes": 1 << 20}}
        before = wait_for(lambda: (r := nms.client.routes("set0"))["stages"]["text_encode"] and r, 5,
                          "the stage to be routed")
        status = nms.client.status()
        ids = {i["id"] for st in status["sets"].values() for i in [*st["dbs"], *st["proxies"]]}
        assert ids == {db.id, proxy.id}

        # SIGKILL: the session expires after ~2 s, a backup takes over from the state in ZooKeeper.
        t0 = time.monotonic()
        nms.procs[first].kill()
        second = nms.primary(timeout=SESSION_S + 6, other_than=first)
        took = time.monotonic() - t0
        assert took < SESSION_S + 3, f"failover took {took:.1f}s"
        after = nms.client.routes("set0")
        assert after == before  # same instances, same addresses, same version: nothing replayed
        assert nms.client.status()["nm"]["epoch"] == status["nm"]["epoch"] + 1
        # Instances kept their ids and their routes, and now heartbeat to the new primary.
        assert stage.routes["stages"]["text_encode"] == ["tcp://127.0.0.1:9410"]
        wait_for(lambda: all(i["silent_s"] < 1 for i in nms.client.status()["sets"]["set0"]["dbs"]), 5,
                 "heartbeats to the new primary")

        # Graceful: the session closes first thing, the next contender takes over at once.
        t0 = time.monotonic()
        nms.procs[second].send_signal(signal.SIGTERM)
        third = nms.primary(timeout=5, other_than=second)
        assert time.monotonic() - t0 < 1.5
        assert third not in (first, second)
        assert nms.client.routes("set0") == before

        # The last NM standing takes a new instance and drops one that leaves.
        late = member(nms, "proxy", {"http": "http://127.0.0.1:8766"})
        assert set(nms.client.proxies()["set0"]) == {"http://127.0.0.1:8765", "http://127.0.0.1:8766"}
        late.stop()
        wait_for(lambda: nms.client.proxies()["set0"] == ["http://127.0.0.1:8765"], 5, "the proxy to leave")
    finally:
        look.stop()
        look.close()
        for m in (db, proxy, stage):
            m.stop()


@pytest.mark.exclusive
def test_a_paused_primary_is_replaced_and_steps_down(nms_factory):
    """SIGSTOP (a real pause, as a long GC or a frozen VM) outlasts the session: a backup takes
    over; when the old primary wakes up its session is gone, so it stops acting as primary and
    answers with a redirect to the new one."""
    nms = nms_factory(2)
    first = nms.primary()
    stage = member(nms, "stage", {"data": "tcp://127.0.0.1:9420"}, stage="vae_decode")
    try:
        nms.procs[first].send_signal(signal.SIGSTOP)
        try:
            second = nms.primary(timeout=SESSION_S + 6, other_than=first)
        finally:
            nms.procs[first].send_signal(signal.SIGCONT)
        rpc = RpcClient(first, timeout=2.0, retries=0)
        try:
            def redirects() -> bool:
                try:
                    rpc.call("status")
                    return False
                except RpcError as e:
                    return f"primary at {second}" in str(e)
            wait_for(redirects, 10, "the paused primary to step down", interval=0.1)
        finally:
            rpc.close()
        assert nms.client.status()["nm"]["address"] == second
        assert stage.id in {i["id"] for i in nms.client.status()["sets"]["set0"]["stages"]["vae_decode"]["instances"]}
    finally:
        stage.stop()


# ---- membership: a dead instance and the requests it held ---------------------------------------

INSTANCE = textwrap.dedent("""
    import sys, threading
    from onepiece.nm.client import Membership
    from onepiece.nm.zk import ZkSettings
    nm, hosts, root, data, uids = sys.argv[1:6]
    m = Membership(nm, "stage", "set0", {"data": data}, stage="denoise_t2v",
                   stats=lambda: {"holding": uids.split(",")}, zk=ZkSettings(hosts, root, session_s=2.0))
    m.register(timeout=20)
    m.start()
    print("registered", m.id, flush=True)
    threading.Event().wait()
""")


@pytest.mark.exclusive
def test_a_killed_instance_leaves_the_routes_and_its_requests_fail(nms_factory, tmp_path):
    """A real process holding a member node and heartbeating the UIDs it holds (what a stage's
    nm/holdings.py reports; here they are declared, the deployment test has real ones) is
    SIGKILLed: the primary drops it within the session timeout plus a heartbeat, and reports to
    the real DB that what it held failed, except a request that has moved on or completed."""
    nms = nms_factory(1)
    nms.primary()
    db = DbThread()
    dbm = member(nms, "db", db.addresses)
    held = {"at_stage": "a" * 32, "queued_before_it": "b" * 32, "moved_on": "c" * 32, "done": "d" * 32}
    db.send({"uid": held["at_stage"], "kind": "status", "status": "in_progress", "stage": "denoise_t2v",
             "progress": 40, "app": "t2v"})
    db.send({"uid": held["queued_before_it"], "kind": "status", "status": "in_progress", "stage": "text_encode",
             "progress": 30, "app": "t2v"})
    db.send({"uid": held["moved_on"], "kind": "status", "status": "in_progress", "stage": "vae_decode",
             "progress": 80, "app": "t2v"})
    db.send({"uid": held["done"], "kind": "status", "status": "in_progress", "stage": "denoise_t2v",
             "progress": 50, "app": "t2v"})
    db.result(held["done"], b"mp4")
    child = subprocess.Popen([sys.executable, "-c", INSTANCE, ",".join(nms.addresses), nms.hosts, nms.root,
                              "tcp://127.0.0.1:9430", ",".join(held.values())],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = child.stdout.readline()
        assert line.startswith("registered stage-"), line
        instance = line.split()[1]

        def stage_view() -> dict | None:
            insts = nms.client.status()["sets"]["set0"]["stages"]["denoise_t2v"]["instances"]
            return next((i for i in insts if i["id"] == instance), None)
        wait_for(lambda: (v := stage_view()) and v["holding"] == 4, 5, "a heartbeat listing what it holds")

        t0 = time.monotonic()
        child.kill()
        child.wait(5)
        wait_for(lambda: stage_view() is None, SESSION_S + 4, "the dead instance to be dropped", interval=0.05)
        gone_after = time.monotonic() - t0
        assert gone_after < SESSION_S + TICK_S + HEARTBEAT_S + 1.0, gone_after

        rpc = RpcClient(db.server.control_address, timeout=2, retries=0)

        def record(uid: str) -> dict:
            return rpc.call("get", uid=uid)[0]["record"]
        # the reaper fails them one by one: wait for both
        wait_for(lambda: all(record(held[k])["status"] == "failed" for k in ("at_stage", "queued_before_it")), 5,
                 "the held requests to fail")
        for key in ("at_stage", "queued_before_it"):
            rec = record(held[key])
            assert rec["status"] == "failed", rec
            assert f"instance {instance} of stage denoise_t2v died" in rec["error"]
            assert "ZooKeeper session ended" in rec["error"]
        assert record(held["moved_on"])["status"] == "in_progress"
        assert record(held["done"])["status"] == "completed"
        events = nms.client.status()["events"]
        assert any(f"dropped {instance}" in e and "ZooKeeper session ended" in e for e in events)
        rpc.close()
    finally:
        if child.poll() is None:
            child.kill()
        dbm.stop()
        db.close()


@pytest.mark.exclusive
def test_the_embedded_nm_also_fails_what_a_silent_instance_held():
    """Without ZooKeeper the NM drops an instance that stops heartbeating; what it held is
    reported failed the same way."""
    from onepiece.nm.server import NodeManager

    topo, wf, base = load_topology(deploy_dir() / "local.yaml")
    topo.nm.heartbeat_s, topo.nm.dead_after_s = 0.1, 0.5
    nm = NodeManager(topo, wf, base, "tcp://127.0.0.1:0")
    stop = threading.Event()
    loop = threading.Thread(target=nm.run, args=(stop,))
    loop.start()
    db = DbThread()
    dbm = Membership(nm.address, "db", "set0", db.addresses)
    uid = "e" * 32
    db.send({"uid": uid, "kind": "status", "status": "in_progress", "stage": "vae_decode", "progress": 90, "app": "t2v"})
    st = Membership(nm.address, "stage", "set0", {"data": "tcp://127.0.0.1:9440"}, stage="vae_decode",
                    stats=lambda: {"holding": [uid]})
    try:
        dbm.register()
        dbm.start()
        st.register()
        st.start()
        wait_for(lambda: nm.state.instances[st.id].holding == [uid], 3, "the holdings heartbeat")
        st._stop.set()  # silent from now on, as a hung or dead process
        st._thread.join()
        rpc = RpcClient(db.server.control_address, timeout=2, retries=0)
        wait_for(lambda: rpc.call("get", uid=uid)[0]["record"]["status"] == "failed", 5, "the request to fail")
        assert "no heartbeat" in rpc.call("get", uid=uid)[0]["record"]["error"]
        rpc.close()
    finally:
        dbm.stop()
        db.close()
        stop.set()
        loop.join()
        nm.close()


# ---- security ----------------------------------------------------------------------------------

@pytest.mark.parametrize("auth_via", ["file", "env"])
def test_digest_acls_keep_others_out(nms_factory, zk, auth_via):
    from kazoo.exceptions import NoAuthError

    nms = nms_factory(1, auth="onepiece:s3cret", auth_via=auth_via)
    nms.primary()
    for p in nms.procs.values():  # what `ps` shows every user of the host
        assert b"s3cret" not in Path(f"/proc/{p.pid}/cmdline").read_bytes()
    m = member(nms, "proxy", {"http": "http://127.0.0.1:8770"})  # an instance with the credentials joins
    outsiders = [zk_harness.kazoo_client(zk.hosts), zk_harness.kazoo_client(zk.hosts, auth="onepiece:wrong")]
    insider = zk_harness.kazoo_client(zk.hosts, auth="onepiece:s3cret")
    try:
        r = nms.root
        for c in outsiders:
            with pytest.raises(NoAuthError):
                c.get(f"{r}/config")
            with pytest.raises(NoAuthError):
                c.get_children(f"{r}/members")
            with pytest.raises(NoAuthError):
                c.get(f"{r}/state/routes/set0")
            with pytest.raises(NoAuthError):
                c.set(f"{r}/state/version", b"999")
            with pytest.raises(NoAuthError):
                c.create(f"{r}/members/stage-", b"{}", ephemeral=True, sequence=True)
            with pytest.raises(NoAuthError):
                c.delete(f"{r}/members/{m.id}")
        acl, _ = insider.get_acls(f"{r}/members/{m.id}")
        assert [(a.id.scheme, a.id.id.split(":")[0]) for a in acl] == [("digest", "onepiece")]
        assert insider.get_children(f"{r}/members") == [m.id]
        assert b"zk_auth" not in insider.get(f"{r}/config")[0]  # credentials are not cluster state
        # An instance without the credentials cannot join.
        stranger = Membership(",".join(nms.addresses), "proxy", "set0", {"http": "http://x:1"},
                              zk=ZkSettings(zk.hosts, r, None, SESSION_S))
        try:
            with pytest.raises(NoAuthError):
                stranger.register(timeout=5)
        finally:
            stranger.stop()
    finally:
        m.stop()
        for c in [*outsiders, insider]:
            c.stop()
            c.close()


# ---- configuration -----------------------------------------------------------------------------

@pytest.mark.parametrize("nm, error", [
    ({"count": 3}, "nm.count: 3 node managers need nm.zk"),
    ({"zk": "localhost"}, "nm.zk: 'localhost' is not host:port"),
    ({"zk": "h:2181/chroot"}, "put the znode root in zk_root"),
    ({"zk": "h:2181", "zk_root": "onepiece"}, "nm.zk_root: 'onepiece': expected an absolute znode path"),
    ({"zk": "h:2181", "zk_auth": "u:s3cret"}, "nm.zk_auth: credentials do not belong in the topology; put "
                                              "user:password in a file of mode 0600 named by nm.zk_auth_file"),
    ({"zk": "h:2181", "zk_session_s": 0.5}, "nm.zk_session_s: Input should be greater than or equal to 1"),
    ({"zk": "h:2181", "count": 2, "address": "ipc:///tmp/nm"}, "consecutive ports from nm.address"),
])
def test_bad_nm_settings_are_named(tmp_path, nm, error):
    import yaml

    topo = yaml.safe_load((deploy_dir() / "local.yaml").read_text())
    topo["workflow"] = str(deploy_dir() / "wan21.yaml")
    topo["nm"].update(nm)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(topo))
    with pytest.raises(ConfigError, match=error.replace("(", r"\(")) as e:
        load_topology(path)
    assert "s3cret" not in str(e.value)


def test_ha_topology_plans_three_nms_and_passes_zookeeper_to_every_role(tmp_path, monkeypatch):
    import yaml

    from onepiece.launcher import Deployment

    topo = yaml.safe_load((deploy_dir() / "local.yaml").read_text())
    topo["workflow"] = str(deploy_dir() / "wan21.yaml")
    topo["nm"] = {"address": "tcp://127.0.0.1:17700", "zk": "127.0.0.1:2181,127.0.0.1:2182", "count": 3,
                  "zk_auth_file": "zk-auth", "zk_session_s": 2}  # relative to the topology file
    (tmp_path / "zk-auth").write_text("u:s3cret\n")
    (tmp_path / "zk-auth").chmod(0o600)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(topo))
    monkeypatch.delenv(ENV, raising=False)
    dep = Deployment(path, tmp_path / "logs")
    try:
        plan = dep.plan()
        nms = [c for c in plan if c.name.startswith("nm")]
        assert [c.name for c in nms] == ["nm0", "nm1", "nm2"]
        assert [c.argv[c.argv.index("--address") + 1] for c in nms] == [
            "tcp://127.0.0.1:17700", "tcp://127.0.0.1:17701", "tcp://127.0.0.1:17702"]
        for c in plan:
            assert c.argv[c.argv.index("--zk") + 1] == "127.0.0.1:2181,127.0.0.1:2182"
            # The credentials reach every child by environment, never on its command line (ps).
            assert not any("s3cret" in a for a in c.argv) and "--zk-auth" not in c.argv, c.argv
            assert c.env is not None and c.env[ENV] == "u:s3cret"
            assert "s3cret" not in repr(c)
            if not c.name.startswith("nm"):
                assert c.argv[c.argv.index("--nm") + 1] == ",".join(nm.argv[nm.argv.index("--address") + 1] for nm in nms)
    finally:
        dep.stop()


@pytest.mark.parametrize("argv, error", [
    (["stage", "--zk", "nohost"], "argument --zk: ZooKeeper address: 'nohost' is not host:port"),
    (["db", "--zk", "h:1", "--zk-auth", "u:s3cret"], "argument --zk-auth: credentials on a command line are "
                                                     "readable by every user of the host (ps); put user:password in "
                                                     "a file of mode 0600 named by --zk-auth-file"),
    (["proxy", "--zk", "h:1", "--zk-root", "/a/../b"], "argument --zk-root: znode root"),
    (["nm", "--zk", "h:1", "--zk-session", "0.1"], "argument --zk-session: must be between 1 and 600"),
    (["stage", "--nm", "host:7700"], "argument --nm: address 'host:7700' has no scheme"),
    (["status", "--nm", ","], "argument --nm: no node manager address given"),
])
def test_bad_flags_get_usage_errors(argv, error, capsys):
    from onepiece.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert error in err and "s3cret" not in err


def test_credentials_come_from_a_private_file_or_the_environment(tmp_path, monkeypatch, capsys):
    from onepiece.cli import main
    from onepiece.nm.zk_auth import CredentialsError, child_env, resolve_auth

    monkeypatch.delenv(ENV, raising=False)
    private, shared, link = tmp_path / "private", tmp_path / "shared", tmp_path / "link"
    private.write_text("u:from-file\n")
    private.chmod(0o600)
    shared.write_text("u:s3cret\n")
    shared.chmod(0o644)
    link.symlink_to(private)
    assert resolve_auth(private, None) == "u:from-file"
    with pytest.raises(CredentialsError, match=f"{shared}: mode 0644 lets others read it; run: chmod 600"):
        resolve_auth(shared, None)
    with pytest.raises(CredentialsError, match="a symbolic link; name the file itself"):
        resolve_auth(link, None)
    with pytest.raises(CredentialsError, match="No such file"):
        resolve_auth(tmp_path / "missing", None)
    bad = tmp_path / "bad"
    bad.write_text("s3cret")
    bad.chmod(0o600)
    with pytest.raises(CredentialsError, match="expected user:password") as e:
        resolve_auth(bad, None)
    assert "s3cret" not in str(e.value)

    # The environment, between the flag's file and the topology's.
    monkeypatch.setenv(ENV, "u:from-env")
    assert resolve_auth(None, private) == "u:from-env"
    assert resolve_auth(private, None) == "u:from-file"
    monkeypatch.setenv(ENV, "s3cret")
    with pytest.raises(CredentialsError, match=f"environment variable {ENV}: expected user:password") as e:
        resolve_auth(None, None)
    assert "s3cret" not in str(e.value)
    monkeypatch.delenv(ENV)

    # Children get them by environment only, and none when there are none.
    assert child_env("u:p", {"PATH": "/bin"}) == {"PATH": "/bin", ENV: "u:p"}
    assert child_env(None, {"PATH": "/bin", ENV: "u:p"}) == {"PATH": "/bin"}

    # The command line says what is wrong with the file, without the secret.
    with pytest.raises(SystemExit) as e:
        main(["db", "--zk", "127.0.0.1:1", "--zk-auth-file", str(shared)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "mode 0644 lets others read it" in err and "s3cret" not in err


def test_zk_flags_without_an_address_are_refused(capsys):
    from onepiece.cli import main

    with pytest.raises(SystemExit) as e:
        main(["db", "--zk-root", "/x"])
    assert e.value.code == 2
    assert "--zk-root and --zk-auth-file need --zk" in capsys.readouterr().err


@pytest.mark.exclusive
def test_a_move_is_kept_in_zookeeper_across_a_failover(nms_factory):
    """An assignment is cluster state: a new primary routes a moving instance exactly as the
    old one did (nowhere until it serves its new stage), from ZooKeeper alone; and a restart of
    the moved instance under its name still returns to the stage it was moved to."""
    nms = nms_factory(2)
    first = nms.primary()
    serving = {"stage": "vae_decode"}
    st = member(nms, "stage", {"data": "tcp://127.0.0.1:9420"}, stage="vae_decode",
                ready=lambda: serving["stage"] is not None, serving=lambda: serving["stage"], name="set0-vae_decode0")
    # (a stage's last ready instance is not moved: a twin stays)
    twin = member(nms, "stage", {"data": "tcp://127.0.0.1:9422"}, stage="vae_decode", serving=lambda: "vae_decode",
                  name="set0-vae_decode1")
    try:
        stages = lambda: nms.client.routes("set0")["stages"]  # noqa: E731
        wait_for(lambda: len(stages()["vae_decode"]) == 2, 5, "the stage to be routed")
        nms.client.move(st.id, "denoise_t2v")
        wait_for(lambda: st.stage == "denoise_t2v", 5, "the instance to learn its new stage")
        nms.procs[first].kill()
        nms.primary(timeout=SESSION_S + 6, other_than=first)
        assert stages()["vae_decode"] == ["tcp://127.0.0.1:9422"] and stages()["denoise_t2v"] == []
        moved = nms.client.status()["sets"]["set0"]["stages"]["denoise_t2v"]["instances"]
        assert [i["id"] for i in moved] == [st.id]
        serving["stage"] = "denoise_t2v"
        wait_for(lambda: stages()["denoise_t2v"] == ["tcp://127.0.0.1:9420"], 5, "the moved instance to be routed")
        st.stop()
        again = member(nms, "stage", {"data": "tcp://127.0.0.1:9421"}, stage="vae_decode", name="set0-vae_decode0")
        try:
            assert again.stage == "denoise_t2v" and again.id != st.id
        finally:
            again.stop()
    finally:
        st.stop()
        twin.stop()


@pytest.mark.exclusive
def test_stop_signal_and_close_racing_end_cleanly(zk, root, topology):
    """SIGTERM hands over on a thread of its own while the main loop, seeing the same stop,
    closes the NM; close() must wait for the handover, since kazoo refuses to close a
    connection that is still stopping (once in a benchmark's ten SIGTERMs it did, and the NM
    exited with status 1). The session's stop is slowed down here to make the race certain:
    its timing cannot be caused on demand for real."""
    from onepiece.nm.ha import HaNodeManager

    nm = HaNodeManager(*load_topology(topology), ZkSettings(zk.hosts, root, None, SESSION_S), "tcp://127.0.0.1:0")
    stop = threading.Event()
    loop = threading.Thread(target=nm.run, args=(stop,), daemon=True)
    loop.start()
    try:
        wait_for(lambda: nm.primary, 15, "the only NM to become primary")
        real_stop = nm.zk.stop
        nm.zk.stop = lambda: (time.sleep(0.3), real_stop())
        stop.set()  # the run loop's handover thread starts stopping the session
        loop.join(5)
        assert not loop.is_alive()
        wait_for(lambda: nm._stopping, 5, "the handover to begin")
    finally:
        stop.set()
        nm.close()  # raised "Cannot close connection until it is stopped" before the fix
    assert nm.zk.connected is False and nm.primary is False
