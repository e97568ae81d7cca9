"""CURVE between roles (transport/curve.py, onepiece/curve_policy.py).

The policy is a pure function. Then real processes over tcp: a node manager and a DB started
with `--auth curve`, and a ring agent. An outsider without a key, or with a key pair that is not
the deployment's (knowing the deployment's public key, which is no secret), gets nothing through:
no register, RPC call, operator command, data message or event reaches the handler, which the
members see (no intruder registered, the record untouched). The members, whose messages are the
same, are served, and the processes keep serving. test_e2e_request_with_curve runs a request
through `onepiece up` with CURVE on."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import orjson
import pytest
import zmq

from onepiece.cli import build_parser
from onepiece.curve_policy import AuthPolicyError, beyond_host, curve_on
from onepiece.db.client import AsyncDbClient, DbClient, DbUnavailable, NotReady
from onepiece.db.protocol import CONTENT
from onepiece.launcher import free_tcp_address
from onepiece.transport import curve
from onepiece.transport.message import Message, encode, new_uid
from onepiece.transport.base import Full
from onepiece.transport.registry import connect
from onepiece.transport.rpc import RpcClient, RpcError, RpcTimeout
from onepiece.transport.ring.agent import AgentRegion, listen as ring_listen

from deployment import Up
from waiting import wait_for

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

REFUSED_WITHIN_S = 1.0  # loopback: a member's reply comes in milliseconds


# ---- the policy -----------------------------------------------------------------------------------

@pytest.mark.parametrize("address,wide", [
    ("tcp://127.0.0.1:7700", False), ("tcp://localhost:1", False), ("tcp://[::1]:1", False),
    ("ipc:///tmp/x/nm.sock", False), ("inproc://a", False), ("shm://r?slots=4&bytes=4096", False),
    ("ring+tcp://127.0.0.1:0?slots=4&bytes=4096", False),
    ("tcp://0.0.0.0:7700", True), ("tcp://*:7700", True), ("tcp://10.1.2.3:1", True), ("tcp://nm:7700", True),
    ("ring+tcp://0.0.0.0:0?slots=4&bytes=4096", True),
])
def test_which_addresses_reach_beyond_this_host(address, wide):
    assert beyond_host(address) is wide


LOCAL, WIDE = ["tcp://127.0.0.1:1", "ipc:///tmp/a.sock"], ["tcp://127.0.0.1:1", "tcp://0.0.0.0:2"]


@pytest.mark.parametrize("mode,addresses,keys,on", [
    ("auto", LOCAL, False, False), ("auto", LOCAL, True, True), ("auto", WIDE, False, True),
    ("curve", LOCAL, False, True), ("curve", WIDE, True, True), ("off", LOCAL, False, False),
    ("off", LOCAL, True, False),
])
def test_curve_on(mode, addresses, keys, on):
    assert curve_on(mode, addresses, keys) is on


def test_off_beyond_loopback_and_unknown_modes_are_refused():
    with pytest.raises(AuthPolicyError, match="tcp://0.0.0.0:2"):
        curve_on("off", WIDE, True)
    with pytest.raises(AuthPolicyError, match="auto, curve, off"):
        curve_on("none", LOCAL, False)


# ---- key files ------------------------------------------------------------------------------------

def test_keys_are_made_private_and_never_replaced(tmp_path):
    folder = curve.make(tmp_path / "k")
    assert (folder.stat().st_mode & 0o777, (folder / curve.SECRET).stat().st_mode & 0o777) == (0o700, 0o600)
    keys, proxy = curve.load(folder), curve.load(folder, "proxy-set0")
    assert keys.members == proxy.members == {keys.public, proxy.public} and keys.secret.decode() not in repr(keys)
    assert keys.serves and not proxy.serves and keys.server == proxy.server == keys.public
    assert keys.names == {keys.public: "deployment", proxy.public: "proxy-set0"}
    with pytest.raises(curve.CurveKeysError, match="already holds"):
        curve.make(folder)
    assert curve.load(folder) == keys
    # Another set's pair is added beside them; half a pair is refused.
    curve.make(folder, ["set0", "set1"])
    assert curve.load(folder).public == keys.public and curve.load(folder, "proxy-set0").public == proxy.public
    assert set(curve.load(folder).names.values()) == {"deployment", "proxy-set0", "proxy-set1"}
    (folder / "proxy-set1.key_secret").unlink()
    with pytest.raises(curve.CurveKeysError, match="already holds proxy-set1.key; remove it"):
        curve.make(folder, ["set1"])
    with pytest.raises(curve.CurveKeysError, match="proxy-set1.key_secret"):
        curve.load(folder, "proxy-set1")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    with pytest.raises(curve.CurveKeysError, match="chmod 700"):
        curve.make(shared)
    assert not list(shared.iterdir())


def test_unusable_key_folders_are_refused_by_name(tmp_path):
    folder = curve.make(tmp_path / "k")
    os.chmod(folder / curve.SECRET, 0o644)
    with pytest.raises(curve.CurveKeysError, match="chmod 600"):
        curve.load(folder)
    with pytest.raises(curve.CurveKeysError, match="onepiece keys curve"):
        curve.load(tmp_path / "missing")
    other = curve.make(tmp_path / "other")
    (folder / curve.SECRET).unlink()
    os.replace(other / curve.SECRET, folder / curve.SECRET)  # a secret that is not deployment.key's half
    with pytest.raises(curve.CurveKeysError, match="not the public half"):
        curve.load(folder)
    # Who is admitted is what the *.key files say: none of them, nor the folder, writable by others.
    fine = curve.make(tmp_path / "fine")
    os.chmod(fine / curve.PUBLIC, 0o666)
    with pytest.raises(curve.CurveKeysError, match="other users may write .*deployment.key"):
        curve.load(fine)
    os.chmod(fine / curve.PUBLIC, 0o644)
    os.chmod(fine, 0o777)
    with pytest.raises(curve.CurveKeysError, match="chmod go-w"):
        curve.load(fine)
    os.chmod(fine, 0o755)
    assert curve.load(fine).folder == fine
    if os.geteuid() == 0:  # (only root can give a file away) another user's key file, or folder
        extra = fine / "proxy-set9.key"
        os.replace(curve.make(tmp_path / "more", ["set9"]) / "proxy-set9.key", extra)
        os.chown(extra, 12345, -1)
        with pytest.raises(curve.CurveKeysError, match=r"owned by another user, who may admit their own keys: "
                                                       r".*proxy-set9.key \(uid 12345\)"):
            curve.load(fine)
        extra.unlink()
        os.chown(fine, 12345, -1)
        with pytest.raises(curve.CurveKeysError, match=r"owned by another user.*fine \(uid 12345\)"):
            curve.load(fine)
    with pytest.raises(curve.CurveKeysError, match=r"set names \['a/b'\]"):
        curve.make(tmp_path / "sets", ["a/b"])
    assert not (tmp_path / "sets").exists()  # refused before anything was written


def test_a_deployment_refused_for_its_keys_leaves_nothing_behind(tmp_path):
    import yaml

    from onepiece.config import ConfigError, deploy_dir
    from onepiece.launcher import Deployment

    folder = curve.make(tmp_path / "k")
    os.chmod(folder / curve.SECRET, 0o644)  # readable by others: refused
    topo = yaml.safe_load((deploy_dir() / "local.yaml").read_text())
    topo.update(workflow=str(deploy_dir() / "wan21.yaml"), auth="curve", curve_dir=str(folder))
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topo))
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ConfigError, match="chmod 600"):
        Deployment(tmp_path / "topo.yaml", tmp_path / "logs", runtime_dir=run)
    assert not list(run.iterdir())  # no runtime folder left


def test_a_role_beyond_loopback_without_keys_does_not_start(tmp_path):
    """Refused before it binds, with a message saying how to make keys."""
    env = {k: v for k, v in os.environ.items() if k != curve.ENV}
    out = subprocess.run([sys.executable, "-m", "onepiece", "db", "--listen", "tcp://0.0.0.0:0"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "onepiece keys curve" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "onepiece", "db", "--auth", "off", "--listen", "tcp://0.0.0.0:0"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "auth: off with tcp://0.0.0.0:0" in out.stderr, out.stderr


def test_keys_command_makes_the_members_pair_and_one_per_set(tmp_path):
    args = build_parser().parse_args(["keys", "curve", str(tmp_path / "k"), "--sets", "a,b"])
    assert args.fn(args) == 0 and curve.load(tmp_path / "k").public
    assert curve.load(tmp_path / "k", "proxy-a").public != curve.load(tmp_path / "k", "proxy-b").public


def test_a_proxy_s_pair_serves_nothing(tmp_path):
    """A proxy only connects; members would not take its key as their server's."""
    curve.use(curve.load(curve.make(tmp_path / "k"), curve.proxy_pair("set0")))
    try:
        with pytest.raises(curve.CurveKeysError, match="only connects"):
            curve.server(zmq.Context.instance().socket(zmq.ROUTER))
    finally:
        curve.use(None)


# ---- outsiders against real processes ----------------------------------------------------------------

@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> curve.CurveKeys:
    # set0's proxies, and another set's (whose key every member admits, as in a deployment of two sets)
    return curve.load(curve.make(tmp_path_factory.mktemp("curve") / "keys", ["set0", "other"]))


@pytest.fixture
def member(keys):
    """This test process as a member of the deployment (its client sockets prove the keys)."""
    curve.use(keys)
    yield keys
    curve.use(None)


@pytest.fixture
def proxy(keys):
    """This test process as a proxy of the deployment (its client sockets prove the proxies' pair)."""
    curve.use(curve.load(keys.folder, curve.proxy_pair("set0")))
    yield curve.active()
    curve.use(None)


OPERATOR_KEY = "op-" + "k" * 40


@pytest.fixture(scope="module")
def servers(keys, tmp_path_factory):
    """A node manager and a DB, separate processes with CURVE on over tcp."""
    logs = tmp_path_factory.mktemp("curve-logs")
    nm = free_tcp_address()
    env = {**os.environ, curve.ENV: str(keys.folder), "ONEPIECE_OPERATOR_KEY": OPERATOR_KEY}
    flags = ["--auth", "curve", "--deployment", "curvetest"]
    procs = {
        "nm": ["nm", "--address", nm, *flags],
        "db": ["db", "--nm", nm, "--set", "set0", "--listen", "tcp://127.0.0.1:0", "--control", "tcp://127.0.0.1:0",
               "--events", "tcp://127.0.0.1:0", "--replication", "1", *flags],
    }
    started = {}
    try:
        for name, argv in procs.items():
            with open(logs / f"{name}.log", "w") as log:
                started[name] = subprocess.Popen([sys.executable, "-m", "onepiece", *argv], env=env, stdout=log,
                                                 stderr=subprocess.STDOUT)
        curve.use(keys)
        client = RpcClient(nm, timeout=2.0)
        try:
            dbs = wait_for(lambda: _dbs(client), timeout=60, what="the DB registered with the NM")
        finally:
            client.close()
            curve.use(None)
        yield {"nm": nm, "db": dbs[0], "procs": started, "logs": logs}
    finally:
        curve.use(None)
        for p in started.values():
            p.terminate()
        for p in started.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _dbs(client: RpcClient) -> list[dict]:
    """The set's DBs in the NM's routes; none while the NM is still starting."""
    try:
        return client.call("routes", set="set0")[0]["routes"]["dbs"]
    except RpcError:
        return []


def _status(client: RpcClient) -> dict:
    return client.call("status")[0]


OUTSIDERS = ["no key", "wrong key"]


def _outsider(kind: int, address: str, who: str, keys: curve.CurveKeys, ctx: zmq.Context) -> zmq.Socket:
    """A socket of someone outside the deployment: no CURVE, or its own pair (and the
    deployment's public key as the server's, which it may well know)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if who == "wrong key":
        public, secret = zmq.curve_keypair()
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, keys.public
    sock.connect(address)
    return sock


def _send(sock: zmq.Socket, frames: list) -> None:
    """Hand ``frames`` to ``sock``; once libzmq has dropped a refused connection, it has no peer
    to queue them for (Again), which is a refusal too."""
    try:
        sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
    except zmq.Again:
        pass


def _rpc(sock: zmq.Socket, op: str, **args) -> bytes | None:
    _send(sock, [b"", orjson.dumps({"id": 1, "op": op, **args})])
    return sock.recv_multipart()[1] if sock.poll(int(REFUSED_WITHIN_S * 1000)) else None


def _answers(sock: zmq.Socket, calls: list[tuple[str, dict]]) -> list[bytes]:
    """Send every call, then collect what comes back within the refusal time (all at once: a
    member gets each answer in milliseconds)."""
    for i, (op, args) in enumerate(calls):
        _send(sock, [b"", orjson.dumps({"id": i, "op": op, **args})])
    got = []
    while sock.poll(int(REFUSED_WITHIN_S * 1000)):
        got.append(sock.recv_multipart()[1])
    return got


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.mark.parametrize("who", OUTSIDERS)
def test_nm_refuses_outsiders_register_rpc_and_operator_commands(servers, keys, who, ctx):
    sock = _outsider(zmq.DEALER, servers["nm"], who, keys, ctx)
    registration = {"role": "db", "set": "set0", "name": "intruder", "deployment": "curvetest",
                    "addresses": {"data": "tcp://127.0.0.1:9", "control": "tcp://127.0.0.1:9",
                                  "events": "tcp://127.0.0.1:9"}}
    curve.use(keys)
    client = RpcClient(servers["nm"], timeout=2.0)
    try:
        (victim,) = [d["id"] for d in _status(client)["sets"]["set0"]["dbs"]]
        assert _answers(sock, [("register", registration), ("status", {}),
                               # even with the operator key
                               ("deregister", {"instance": victim, "key": OPERATOR_KEY}),
                               ("move", {"instance": victim, "stage": None, "key": OPERATOR_KEY})]) == []
        # The members' view: nothing of the above happened.
        assert [d["id"] for d in _status(client)["sets"]["set0"]["dbs"]] == [victim]
        assert "intruder" not in orjson.dumps(_status(client)).decode()
    finally:
        client.close()
        curve.use(None)
    assert all(p.poll() is None for p in servers["procs"].values())


def test_a_member_without_the_deployment_s_keys_is_told_why_nothing_answers(servers, tmp_path):
    """libzmq drops a failed handshake silently; the client's socket monitor hears of it, so a
    CLI or a role without keys (or with another deployment's) says so instead of "no answer"."""
    # (2 s timeouts: the monitor's event must come within one, from a server in another process)
    client = RpcClient(servers["nm"], timeout=2.0, retries=0)
    try:
        with pytest.raises(RpcTimeout, match=f"asks for CURVE and this process has no keys \\(set {curve.ENV}"):
            client.call("status")
    finally:
        client.close()
    sender = connect(servers["db"]["data"])
    try:
        with pytest.raises(Full, match="asks for CURVE"):
            sender.send(Message({"uid": new_uid()}, {}), timeout=2.0)
    finally:
        sender.close()
    curve.use(curve.load(curve.make(tmp_path / "other")))
    client = RpcClient(servers["nm"], timeout=2.0, retries=1)
    try:
        with pytest.raises(RpcTimeout, match="are not the deployment's"):
            client.call("status")
    finally:
        client.close()
        curve.use(None)
    # The proxy's asyncio client says so too, in the error its 503 carries.
    async def get() -> None:
        dbs = AsyncDbClient([servers["db"]["control"]], timeout=2.0)
        try:
            await dbs.get(new_uid())
        finally:
            dbs.close()

    with pytest.raises(DbUnavailable, match="asks for CURVE and this process has no keys"):
        asyncio.run(get())
    env = {k: v for k, v in os.environ.items() if k != curve.ENV}
    out = subprocess.run([sys.executable, "-m", "onepiece", "status", "--nm", servers["nm"]], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"set {curve.ENV}" in out.stderr, out.stderr
    assert all(p.poll() is None for p in servers["procs"].values())


@pytest.mark.parametrize("who", OUTSIDERS)
def test_db_refuses_outsiders_reads_deletes_data_and_events(servers, keys, who, ctx, proxy):
    db = servers["db"]
    members = DbClient([db["control"]])
    uid = new_uid()
    members.create({"uid": uid, "app": "t2v", "set": "set0"})
    try:
        rpc = _outsider(zmq.DEALER, db["control"], who, keys, ctx)
        assert _answers(rpc, [("get", {"uid": uid}), ("delete", {"uid": uid})]) == []
        data = _outsider(zmq.PUSH, db["data"], who, keys, ctx)
        forged = {"uid": uid, "kind": "status", "status": "in_progress", "stage": "forged", "progress": 99}
        _send(data, encode(Message(forged)))
        # A forged result (the attacker's bytes as the user's video) is refused the same way.
        _send(data, encode(Message({"uid": uid, "kind": "result", "content_type": "video/mp4"},
                                   {CONTENT: b"the attacker's bytes"})))
        events = _outsider(zmq.SUB, db["events"], who, keys, ctx)
        events.setsockopt(zmq.SUBSCRIBE, b"")
        mine = curve.client(zmq.Context.instance().socket(zmq.SUB))
        mine.setsockopt(zmq.SUBSCRIBE, b"")
        mine.setsockopt(zmq.LINGER, 0)
        mine.connect(db["events"])
        try:
            # A member deletes a record still queued: the DB publishes its cancellation. PUB drops
            # what no one has asked for yet, so records are deleted until the member's
            # subscription has arrived and it hears one (the outsider had as long to subscribe).
            def cancelled() -> bool:
                victim = new_uid()
                members.create({"uid": victim, "app": "t2v", "set": "set0"})
                members.delete(victim)
                return bool(mine.poll(100)) and victim.encode() in b"".join(mine.recv_multipart())
            wait_for(cancelled, timeout=5, what="a member hearing a cancellation")
            assert not events.poll(int(REFUSED_WITHIN_S * 1000))
        finally:
            mine.close(linger=0)
        rec = members.get(uid)
        assert rec["status"] == "queued" and rec.get("stage") != "forged", rec
        with pytest.raises(NotReady):  # nothing a client could download
            members.content(uid)
        # The same message from a holder of the deployment's keys goes through: what stopped the
        # outsider was CURVE. (A member's pair: this process proves the proxies', whose data a
        # DB refuses.)
        sender = zmq.Context.instance().socket(zmq.PUSH)
        sender.curve_secretkey, sender.curve_publickey, sender.curve_serverkey = keys.secret, keys.public, keys.server
        sender.connect(db["data"])
        try:
            sender.send_multipart(encode(Message(forged)), copy=False)
            wait_for(lambda: members.get(uid).get("stage") == "forged", timeout=5, what="the member's status")
        finally:
            sender.close(linger=500)
    finally:
        members.close()
    assert all(p.poll() is None for p in servers["procs"].values())
    assert "refused a connection from a client key" in (servers["logs"] / "db.log").read_text() or who == "no key"


def test_only_proxies_read_and_delete_users_records(servers, keys):
    """Records hold users' prompts: a member's key (any stage, the NM) may ask where a request
    is, not read, list, download or delete it; the key of the set's proxies may, and no other
    set's proxies."""
    db = servers["db"]["control"]
    uid = new_uid()
    curve.use(curve.load(keys.folder, curve.proxy_pair("set0")))
    proxies = DbClient([db])
    try:
        proxies.create({"uid": uid, "app": "t2v", "set": "set0", "prompt": "my secret idea"})
        assert proxies.get(uid)["prompt"] == "my secret idea"
        curve.use(keys)
        member = RpcClient(db, timeout=2.0)
        try:
            for op, args in (("get", {"uid": uid}), ("content", {"uid": uid}), ("list", {}),
                             ("delete", {"uid": uid}), ("create", {"record": {"uid": new_uid()}}),
                             ("handed", {"uid": uid})):
                with pytest.raises(RpcError, match=f"op '{op}' is served to the proxy-set0 key only, not to the "
                                                   f"deployment key"):
                    member.call(op, **args)
            state, _ = member.call("state", uid=uid)
            assert state["record"] == {"uid": uid, "app": "t2v", "status": "queued", "stage": ""}  # no prompt
            assert member.call("stats")[0]["stats"]
        finally:
            member.close()
        assert DbClient([db]).state(uid)["status"] == "queued"  # what the NM's reaper reads
        curve.use(curve.load(keys.folder, "proxy-other"))
        other = RpcClient(db, timeout=2.0)
        try:
            with pytest.raises(RpcError, match="served to the proxy-set0 key only, not to the proxy-other key"):
                other.call("get", uid=uid)
        finally:
            other.close()
        assert proxies.delete(uid)  # its sockets still prove set0's proxies' pair
    finally:
        proxies.close()
        curve.use(None)
    assert "is served to the proxy-set0 key only" in (servers["logs"] / "db.log").read_text()


@pytest.mark.parametrize("who", OUTSIDERS)
def test_ring_agent_refuses_outsiders(keys, who, ctx, member):
    receiver = ring_listen("ring+tcp://127.0.0.1:0?slots=4&bytes=65536")
    endpoint = receiver.agent.endpoint
    try:
        sock = _outsider(zmq.DEALER, endpoint, who, keys, ctx)
        _send(sock, [b"\x01" * 8, b"H", b""])
        assert not sock.poll(int(REFUSED_WITHIN_S * 1000))
        region = AgentRegion(endpoint)  # a member attaches (its hello answered)
        try:
            assert region.geometry.nslots == 4
        finally:
            region.close()
    finally:
        receiver.close()


# ---- one request through a deployment with CURVE on ---------------------------------------------------

@pytest.mark.slow
def test_a_deployment_open_to_other_hosts_serves_with_api_keys_and_curve(tiny_models, tmp_path, make_topology, keys,
                                                                        ctx):
    """What a user does to open a deployment to other hosts: a client key file and a proxy on
    0.0.0.0 that names it, CURVE between the roles over tcp, `onepiece up`, and `onepiece
    generate --api-key-file`. Without the key the client is refused; the key is in no log; an
    outsider's socket gets nothing from the NM."""
    import yaml

    from test_api_keys import run_cli

    api_keys = tmp_path / "keys"
    assert run_cli("keys", "new", "--file", str(api_keys)).returncode == 0
    nm = free_tcp_address()
    path = make_topology(tmp_path, tiny_models, nm, dbs=1, transport="tcp", threads=1,
                         stages={"text_encode": 1, "denoise_t2v": 1, "vae_decode": 1},
                         sets=[{"proxy": {"host": "0.0.0.0", "api_keys_file": "keys"}}])
    topo = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**topo, "auth": "curve", "curve_dir": str(keys.folder)}))
    dep = Up(path, tmp_path / "logs", nm)
    try:
        assert dep.wait_for(r"CURVE between roles, keys in (\S+)", timeout=60).group(1) == str(keys.folder)
        url = dep.wait_for(r"serves the API at (http://\S+)", timeout=240).group(1)
        out = run_cli("generate", "--url", url, "--prompt", "a fox", "--size", "32x32", "--frames", "5", "--steps",
                      "2", "--quiet", "-o", str(tmp_path / "fox.mp4"), "--api-key-file", str(api_keys))
        assert out.returncode == 0, out.stderr
        assert (tmp_path / "fox.mp4").stat().st_size > 0
        out = run_cli("generate", "--url", url, "--prompt", "a fox", "--quiet", "-o", str(tmp_path / "no.mp4"),
                      env={k: v for k, v in os.environ.items() if k != "ONEPIECE_API_KEY"})
        assert out.returncode == 1 and "API key" in out.stderr
        key = api_keys.read_text().strip()
        assert not any(key in (tmp_path / "logs" / f).read_text() for f in ("set0-proxy0.log", "nm.log"))
        assert _rpc(_outsider(zmq.DEALER, nm, "no key", keys, ctx), "status") is None
        # Data straight to a stage: an outsider's task never arrives; the same from a member
        # does (the stage fails it for its malformed params and logs its uid).
        curve.use(keys)
        try:
            stage = dep.routes()["stages"]["text_encode"][0]
            theirs, ours = new_uid(), new_uid()
            task = {"app": "t2v", "stage": "text_encode", "kind": "task", "params": [1], "trace": []}
            for who in OUTSIDERS:
                _send(_outsider(zmq.PUSH, stage, who, keys, ctx), encode(Message({"uid": theirs, **task})))
            sender = connect(stage)
            sender.send(Message({"uid": ours, **task, "params": {"prompt": 1}}), timeout=5)
            sender.close()
        finally:
            curve.use(None)
        wait_for(lambda: ours in dep.log("set0-text_encode0"), timeout=10, what="the member's task at the stage")
        assert theirs not in dep.log("set0-text_encode0")
    finally:
        dep.stop()


# ---- the benchmark ------------------------------------------------------------------------------------

def test_bench_curve_measures_both_modes_side_by_side(tmp_path):
    """`onepiece bench curve`, small: both modes at both sizes, ratios and files written."""
    out = tmp_path / "results"
    args = build_parser().parse_args(["bench", "curve", "--rounds", "2", "--sizes", "1024,65536",
                                      "--bytes-per-batch", "1048576", "--out", str(out)])
    assert args.fn(args) == 0
    result = orjson.loads((out / "curve.json").read_bytes())
    assert [c["size"] for c in result["cells"]] == [1024, 65536]
    for c in result["cells"]:
        assert len(c["seconds"]["plain"]) == len(c["seconds"]["curve"]) == 2
        assert c["time_ratio_min"] <= c["time_ratio_median"] <= c["time_ratio_max"] and c["curve_mb_per_s"] > 0
    assert result["latency"]["plain_p50_us"] > 0 and result["latency"]["curve_p50_us"] > 0
    assert "| 64 KB |" in (out / "curve.md").read_text()
    assert curve.active() is None  # the benchmark leaves this process as it found it


def test_a_set_s_proxies_key_registers_only_that_set_s_proxies_and_writes_no_db_data(servers, keys, proxy):
    """The proxies face the clients: a proxy host taken over must not join the deployment as a
    stage or a DB (and be handed users' requests or results), take a member's name, or write
    statuses and results into users' records."""
    db = servers["db"]
    client = RpcClient(servers["nm"], timeout=2.0)
    try:
        (victim,) = [d["id"] for d in _status(client)["sets"]["set0"]["dbs"]]
        join = {"deployment": "curvetest", "process": "p" * 16}
        stage = {"data": "tcp://127.0.0.1:9"}
        for role, set_name, name, addresses, extra in (
                ("stage", "set0", "evil-stage", stage, {"stage": "denoise_t2v"}),
                ("db", "set0", "evil-db", {**stage, "control": "tcp://127.0.0.1:9", "events": "tcp://127.0.0.1:9"}, {}),
                ("proxy", "set1", "evil-proxy", {}, {})):
            with pytest.raises(RpcError, match=f"the proxy-set0 key registers only proxies of the set it names, "
                                               f"not a {role} of set '{set_name}'"):
                client.call("register", role=role, set=set_name, name=name, addresses=addresses, **join, **extra)
        with pytest.raises(RpcError, match=f"the proxy-set0 key may not take the name of db {victim}"):
            client.call("register", role="proxy", set="set0", name=victim, addresses={}, **join)
        # What it is for: registering its set's proxies.
        reply = client.call("register", role="proxy", set="set0", name="a-proxy",
                            addresses={"http": "http://127.0.0.1:9"}, **join)[0]
        assert reply["instance"] == "a-proxy"
        client.call("deregister", instance="a-proxy", token=reply["token"])
        members_now = orjson.dumps(_status(client)["sets"]).decode()
        assert "evil" not in members_now and "a-proxy" not in members_now
        assert [d["id"] for d in _status(client)["sets"]["set0"]["dbs"]] == [victim]
    finally:
        client.close()
    records = DbClient([db["control"]])  # the proxy's own client: it makes and reads records
    sender = connect(db["data"])  # with the proxies' key (the fixture's)
    try:
        uid = new_uid()
        records.create({"uid": uid, "app": "t2v", "set": "set0"})
        sender.send(Message({"uid": uid, "kind": "status", "status": "in_progress", "stage": "forged", "progress": 99}),
                    timeout=5)
        wait_for(lambda: "sent with the proxy-set0 key: a DB takes data from members only"
                 in (servers["logs"] / "db.log").read_text(), timeout=10, what="the DB dropping the proxy's message")
        assert records.get(uid)["status"] == "queued" and records.get(uid).get("stage") != "forged"
    finally:
        sender.close()
        records.close()
    assert all(p.poll() is None for p in servers["procs"].values())
