"""Client API keys on real proxies (uvicorn on real ports, a real DbServer): 401s shaped like
OpenAI's, a video readable, downloadable and deletable only with the key that created it (404
for any other), keys from a 0600 file or the environment and never from a command line, and a
proxy that binds beyond loopback refusing to start without them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings

import httpx
import pytest

import proxy_harness as H
from onepiece.client import Client, RequestFailed
from onepiece.proxy.cluster import StaticCluster
from onepiece.proxy.keys import (ENV, ApiKeyError, ApiKeys, beyond_loopback, check_bind, client_key, load_keys,
                                 new_key, owner_tag)
from onepiece.proxy.server import ProxyServer
from onepiece.secret_file import SecretFileError

ALICE, BOB, EVE = new_key(), new_key(), new_key()


@pytest.fixture(scope="module")
def h():
    harness = H.Harness(max_inflight=1000, keys=ApiKeys([ALICE, BOB]))
    yield harness
    harness.close()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def create(h, key: str, **body) -> dict:
    r = h.http.post("/v1/videos", json={"prompt": "a cat", **body}, headers=bearer(key))
    assert r.status_code == 200, r.text
    return r.json()


def test_keys_come_from_a_private_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    private = tmp_path / "keys"
    private.write_text(f"# the team's keys\n{ALICE}\n\n{BOB}, {ALICE}  # twice is once\n")
    private.chmod(0o600)
    keys = load_keys(private)
    assert len(keys) == 2 and ALICE not in repr(keys)
    assert keys.caller(ALICE).owner == owner_tag(ALICE) and keys.caller(BOB).owner == owner_tag(BOB)
    assert keys.caller(EVE) is None and keys.caller("") is None
    assert ALICE not in owner_tag(ALICE) and owner_tag(ALICE) != owner_tag(BOB)

    # The very check ZooKeeper credentials get (onepiece/secret_file.py).
    private.chmod(0o644)
    with pytest.raises(SecretFileError, match="mode 0644 lets others read it; run: chmod 600"):
        load_keys(private)
    private.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(private)
    with pytest.raises(SecretFileError, match="a symbolic link"):
        load_keys(link)

    bad = tmp_path / "bad"
    bad.write_text(f"{ALICE}\nshort-s3cret\n")
    bad.chmod(0o600)
    with pytest.raises(ApiKeyError, match="line 2: a key is 32 to 256") as e:
        load_keys(bad)
    assert "s3cret" not in str(e.value)

    assert load_keys(None) is None
    monkeypatch.setenv(ENV, f"{ALICE},{BOB}")
    assert len(load_keys(None)) == 2
    monkeypatch.setenv(ENV, "s3cret")
    with pytest.raises(ApiKeyError, match=f"environment variable {ENV}") as e:
        load_keys(None)
    assert "s3cret" not in str(e.value)

    # A client's key: its file (same check) or ONEPIECE_API_KEY.
    mine = tmp_path / "mine"
    mine.write_text(ALICE + "\n")
    mine.chmod(0o600)
    assert client_key(mine, {}) == ALICE
    assert client_key(None, {"ONEPIECE_API_KEY": BOB}) == BOB and client_key(None, {}) is None


def test_a_fifo_named_as_a_secret_file_is_refused_not_waited_on(tmp_path):
    # Opening a FIFO for reading waits for a writer: a proxy (or NM) named one hung at start
    # without a word. It is refused as any other file that is not a regular one.
    fifo = tmp_path / "keys"
    os.mkfifo(fifo, 0o600)
    out: list[BaseException] = []
    reader = threading.Thread(target=lambda: out.append(pytest.raises(SecretFileError, load_keys, fifo).value),
                              daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock the open, so the thread ends with the test
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a FIFO as a secret file waited for a writer")
    assert "not a regular file" in str(out[0]) and str(fifo) in str(out[0])


def test_binding_beyond_loopback_needs_keys():
    assert not any(map(beyond_loopback, ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"]))
    assert all(map(beyond_loopback, ["0.0.0.0", "::", "10.0.0.5", "proxy.example"]))
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", ApiKeys([ALICE]))
    with pytest.raises(ApiKeyError, match="needs client API keys: .*--api-keys-file.*ONEPIECE_API_KEYS.*127.0.0.1"):
        ProxyServer(StaticCluster(H.WORKFLOW), host="0.0.0.0")


def test_a_proxy_on_all_interfaces_serves_only_callers_with_a_key():
    db = H.DbThread()
    cluster = StaticCluster(H.WORKFLOW, db_list=[db.addresses], entrance_map={"t2v": ["tcp://127.0.0.1:1"]})
    proxy = ProxyServer(cluster, host="0.0.0.0", keys=ApiKeys([ALICE]))
    try:
        port = proxy.start()
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=bearer(ALICE)).status_code == 200
        assert httpx.get(f"{url}/healthz").status_code == 200  # probes need no key
    finally:
        proxy.stop()
        db.close()


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onepiece", *args], capture_output=True, text=True, timeout=60,
                          env=env)


def test_the_cli_refuses_keys_on_its_command_line_and_an_open_proxy_without_keys(tmp_path):
    out = run_cli("proxy", "--host", "0.0.0.0", "--nm", "tcp://127.0.0.1:1", env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and "needs client API keys" in out.stderr, out.stderr
    for argv in (["proxy", "--api-keys", ALICE], ["generate", "--prompt", "x", "-o", "x.mp4", "--api-key", ALICE]):
        out = run_cli(*argv)
        assert out.returncode == 2 and "readable by every user of the host" in out.stderr
        assert ALICE not in out.stderr + out.stdout
    # `onepiece keys new --file` makes a 0600 file that a proxy accepts.
    path = tmp_path / "keys"
    out = run_cli("keys", "new", "--file", str(path))
    assert out.returncode == 0 and out.stdout == "", out.stderr  # the key is not shown
    key = path.read_text().splitlines()[-1]
    assert path.stat().st_mode & 0o777 == 0o600 and load_keys(path).caller(key) is not None
    assert key not in out.stderr and client_key(path) == key
    assert run_cli("keys", "new", "--file", str(path)).returncode == 0
    assert len(load_keys(path)) == 2
    path.chmod(0o644)  # a key is never added to a file others can read
    out = run_cli("keys", "new", "--file", str(path))
    assert out.returncode == 1 and "lets others read it" in out.stderr and len(path.read_text().split()) == 2
    key = run_cli("keys", "new").stdout.strip()
    assert load_keys(None, {ENV: key}).caller(key) is not None


def test_missing_or_wrong_keys_get_an_openai_shaped_401(h):
    for headers, code in (({}, "missing_api_key"), (bearer(EVE), "invalid_api_key"),
                          ({"Authorization": f"Basic {ALICE}"}, "invalid_api_key"),
                          ({"Authorization": "Bearer"}, "invalid_api_key")):
        for method, path in (("POST", "/v1/videos"), ("GET", "/v1/videos"), ("GET", "/v1/models"),
                             ("GET", "/v1/videos/video_" + "a" * 32), ("DELETE", "/v1/videos/video_" + "a" * 32)):
            r = h.http.request(method, path, headers=headers, json={"prompt": "x"} if method == "POST" else None)
            assert r.status_code == 401, (method, path, r.text)
            err = r.json()["error"]
            assert err["code"] == code and err["type"] == "invalid_request_error" and err["param"] == "Authorization"
            assert r.headers["www-authenticate"] == "Bearer"
            assert EVE not in r.text and ALICE not in r.text
    assert h.http.get("/healthz").status_code == 200 and h.http.get("/metrics").status_code == 200
    # The served schema says so: a bearer scheme on every /v1 operation, none on the probes.
    schema = h.http.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["apiKey"] == {**schema["components"]["securitySchemes"]["apiKey"],
                                                                 "type": "http", "scheme": "bearer"}
    ops = [(path, op) for path, item in schema["paths"].items() for op in item.values()]
    assert all((op.get("security") == [{"apiKey": []}]) == path.startswith("/v1") for path, op in ops), ops


def test_a_video_is_only_its_creators(h):
    video = create(h, ALICE, model="t2v")
    vid, uid = video["id"], video["id"].removeprefix("video_")
    assert "owner" not in video
    record = h.db.server.store.get(uid)
    assert record["owner"] == owner_tag(ALICE) and ALICE not in str(record)

    h.db.result(uid, b"alice's video")
    H.wait_for(lambda: h.http.get(f"/v1/videos/{vid}", headers=bearer(ALICE)).json()["status"] == "completed",
               what="completed")
    # Bob sees nothing: 404, as for an id that never existed, on every route.
    for method, path in (("GET", f"/v1/videos/{vid}"), ("GET", f"/v1/videos/{vid}/content"),
                         ("DELETE", f"/v1/videos/{vid}")):
        r = h.http.request(method, path, headers=bearer(BOB))
        assert r.status_code == 404 and r.json()["error"]["code"] == "video_not_found", (method, r.text)
    # ... and changed nothing: Alice downloads it, then deletes it.
    assert h.db.server.store.get(uid)["status"] == "completed"
    r = h.http.get(f"/v1/videos/{vid}/content", headers=bearer(ALICE))
    assert r.status_code == 200 and r.content == b"alice's video"
    assert h.http.delete(f"/v1/videos/{vid}", headers=bearer(ALICE)).json()["deleted"] is True


def test_bobs_delete_of_a_running_video_cancels_nothing(h):
    video = create(h, ALICE, model="t2v")
    vid = video["id"]
    assert h.http.delete(f"/v1/videos/{vid}", headers=bearer(BOB)).status_code == 404
    assert h.http.get(f"/v1/videos/{vid}", headers=bearer(ALICE)).json()["status"] == "queued"


def test_the_openai_package_and_the_client_send_the_key(h, monkeypatch):
    openai = pytest.importorskip("openai")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        alice = openai.OpenAI(base_url=f"{h.url}/v1", api_key=ALICE, max_retries=0)
        video = alice.videos.create(prompt="a whale", model="t2v", size="64x64")
        assert alice.videos.retrieve(video.id).status == "queued"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{h.url}/v1", api_key=EVE, max_retries=0).videos.retrieve(video.id)
        with pytest.raises(openai.NotFoundError):
            openai.OpenAI(base_url=f"{h.url}/v1", api_key=BOB, max_retries=0).videos.retrieve(video.id)

    monkeypatch.setenv("ONEPIECE_API_KEY", BOB)
    with Client(h.url) as c:
        v = c.submit("from the environment's key", model="t2v")
        assert c.status(v["id"])["status"] == "queued"
        with pytest.raises(RequestFailed) as e:
            c.status(video.id)
        assert e.value.status_code == 404
    with Client(h.url, api_key=EVE) as c:
        with pytest.raises(RequestFailed) as e:
            c.submit("x", model="t2v")
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


def test_onepiece_up_refuses_an_open_proxy_without_keys_and_passes_only_the_files_path(tmp_path, monkeypatch):
    from onepiece.config import ConfigError
    from onepiece.launcher import Deployment, free_tcp_address, write_topology

    monkeypatch.delenv(ENV, raising=False)
    models = {"t2v": tmp_path / "t2v", "i2v": tmp_path / "i2v"}
    topology = write_topology(tmp_path, models, free_tcp_address(), sets=[{"proxy": {"host": "0.0.0.0"}}])
    dep = Deployment(topology, tmp_path / "logs")
    try:
        with pytest.raises(ConfigError, match="needs client API keys"):
            dep.start()  # before any process or model build
        assert dep.children == []
    finally:
        dep.stop()

    keys = tmp_path / "keys"
    keys.write_text(ALICE + "\n")
    keys.chmod(0o600)
    text = topology.read_text().replace("host: 0.0.0.0", "host: 0.0.0.0\n    api_keys_file: keys")
    topology.write_text(text)
    dep = Deployment(topology, tmp_path / "logs")
    try:
        (proxy,) = [c for c in dep.plan() if c.name.endswith("proxy0")]
        assert proxy.argv[proxy.argv.index("--api-keys-file") + 1] == str(keys)
        assert not any(ALICE in arg for c in dep.plan() for arg in c.argv)
    finally:
        dep.stop()


def test_a_proxy_process_takes_its_keys_from_a_file_or_the_environment(tmp_path):
    """`onepiece proxy` as its own process on 0.0.0.0, beside a real NM: keys from its file or
    from ONEPIECE_API_KEYS, never on its command line."""
    import os
    import socket

    from onepiece.launcher import free_tcp_address, write_topology

    nm = free_tcp_address()
    topology = write_topology(tmp_path, {"t2v": tmp_path, "i2v": tmp_path}, nm)
    keys = tmp_path / "keys"
    keys.write_text(f"{ALICE}\n")
    keys.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != ENV}
    log = open(tmp_path / "roles.log", "ab")
    nm_proc = subprocess.Popen([sys.executable, "-m", "onepiece", "nm", "--topology", str(topology), "--address", nm],
                               stdout=log, stderr=log, env=env)
    try:
        for key, extra, extra_env in ((ALICE, ["--api-keys-file", str(keys)], {}), (BOB, [], {ENV: BOB})):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            proc = subprocess.Popen([sys.executable, "-m", "onepiece", "proxy", "--nm", nm, "--host", "0.0.0.0",
                                     "--port", str(port), *extra], stdout=log, stderr=log, env={**env, **extra_env})
            try:
                url = f"http://127.0.0.1:{port}"
                def up() -> bool:
                    assert proc.poll() is None, (tmp_path / "roles.log").read_text()
                    try:
                        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
                    except httpx.TransportError:
                        return False

                H.wait_for(up, 60, f"the proxy at {url}", interval=0.2)
                assert httpx.get(f"{url}/v1/models").status_code == 401
                assert httpx.get(f"{url}/v1/models", headers=bearer(EVE)).status_code == 401
                assert httpx.get(f"{url}/v1/models", headers=bearer(key)).status_code == 200
                cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read().decode()
                assert key not in cmdline
            finally:
                proc.terminate()
                proc.wait(20)
        assert ALICE not in (tmp_path / "roles.log").read_text() and BOB not in (tmp_path / "roles.log").read_text()
    finally:
        nm_proc.terminate()
        nm_proc.wait(20)
        log.close()



# `onepiece up` with a key file and a proxy on 0.0.0.0 is tested with CURVE on, in tests/test_curve.py.


def test_onepiece_up_hands_each_secret_of_its_environment_only_to_the_role_that_reads_it(tmp_path, monkeypatch):
    from onepiece.launcher import Deployment, free_tcp_address, write_topology
    from onepiece.operator_key import ENV as OPERATOR_ENV

    operator = "o" * 40
    monkeypatch.setenv(ENV, ALICE)
    monkeypatch.setenv(OPERATOR_ENV, operator)
    monkeypatch.setenv("ONEPIECE_API_KEY", ALICE)  # a client's, in the shell that runs `up`
    models = {"t2v": tmp_path / "t2v", "i2v": tmp_path / "i2v"}
    dep = Deployment(write_topology(tmp_path, models, free_tcp_address()), tmp_path / "logs")
    try:
        roles = {c.name: c.argv[3] for c in dep.plan()}
        assert sorted(set(roles.values())) == ["db", "nm", "proxy", "stage"]
        for child in dep.plan():
            env = child.env
            assert env is not None and env.get("PATH") == os.environ["PATH"]  # the rest is kept
            assert (env.get(ENV) == ALICE) == (roles[child.name] == "proxy"), child.name
            assert (env.get(OPERATOR_ENV) == operator) == (roles[child.name] == "nm"), child.name
            assert "ONEPIECE_API_KEY" not in env, child.name
    finally:
        dep.stop()
