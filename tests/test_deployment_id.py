"""A deployment cannot join another by accident: every member carries its deployment's id, and
an NM refuses members of another deployment (issue 15, item 2). Real processes: an `onepiece
nm` of one deployment, a DB of it, and a DB, a stage and a proxy of another deployment pointed
at that NM."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from onepiece import deployment
from onepiece.config import deploy_dir
from onepiece.launcher import Deployment, free_tcp_address
from onepiece.nm.client import NmClient
from onepiece.transport.rpc import RpcError
from waiting import wait_for

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


def _role(*args: str, deployment_id: str | None) -> subprocess.Popen:
    flag = [deployment.FLAG, deployment_id] if deployment_id is not None else []
    return subprocess.Popen([sys.executable, "-m", "onepiece", *args, *flag],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _db(nm: str, deployment_id: str | None) -> subprocess.Popen:
    return _role("db", "--nm", nm, "--set", "set0", deployment_id=deployment_id)


def test_an_nm_refuses_members_of_another_deployment_and_keeps_its_own():
    address = free_tcp_address()
    nm = _role("nm", "--topology", str(deploy_dir() / "local.yaml"), "--address", address, "--metrics-port", "0",
               deployment_id="first")
    own = _db(address, "first")
    client = NmClient(address, timeout=1.0, retries=0)
    foreign: list[subprocess.Popen] = []
    try:
        def own_db() -> list:
            try:
                return client.status()["sets"]["set0"]["dbs"]
            except RpcError:
                return []

        (before,) = wait_for(own_db, timeout=60, what="the first deployment's DB registered")
        routes = {k: v for k, v in client.routes("set0").items() if k != "version"}
        foreign = [_db(address, "second"), _db(address, None),
                   _role("stage", "--nm", address, "--set", "set0", "--stage", "text_encode", deployment_id="second"),
                   _role("proxy", "--nm", address, "--set", "set0", "--port", "0", deployment_id="second")]
        outputs = []
        for p in foreign:
            out, _ = p.communicate(timeout=90)
            outputs.append(out)
            # It does not join: it says why, and exits.
            assert p.returncode == 1, out
            assert deployment.REFUSED in out and "serves deployment 'first'" in out, out
            assert "Traceback" not in out, out  # one clear line (a proxy's uvicorn logged one above it)
        assert "the member belongs to 'second'" in outputs[0] and "the member belongs to none" in outputs[1]
        assert "--deployment first" in outputs[0]  # how to join this one, if that was meant

        # A heartbeat that names the first deployment's DB but carries another deployment is
        # refused too, and does not count for that DB (nor tell the sender to register again).
        with pytest.raises(RpcError, match=deployment.REFUSED):
            client.call("heartbeat", instance=before["id"], ready=False, stats={}, deployment="second")

        # The first deployment is untouched: the same members, the same routes, its DB alive.
        status = client.status()
        assert status["nm"][deployment.FIELD] == "first"
        dbs = status["sets"]["set0"]["dbs"]
        assert [d["id"] for d in dbs] == [before["id"]] and dbs[0]["ready"]
        assert not any(status["sets"]["set0"]["stages"][s]["instances"] for s in status["sets"]["set0"]["stages"])
        assert not status["sets"]["set0"]["proxies"]
        assert {k: v for k, v in client.routes("set0").items() if k != "version"} == routes
        # it still heartbeats (its own ones are accepted): one arrives after this point
        since = time.monotonic()

        def heard_since() -> bool:
            elapsed = time.monotonic() - since  # read before the NM's answer: silent less than it is after `since`
            return client.status()["sets"]["set0"]["dbs"][0]["silent_s"] < elapsed

        wait_for(heard_since, 10, "a heartbeat of the first deployment's DB")
        assert own.poll() is None and nm.poll() is None
    finally:
        client.close()
        _stop(*foreign, own, nm)


def test_onepiece_up_gives_every_process_one_id_per_run(tmp_path):
    topology = deploy_dir() / "local.yaml"

    def ids(dep: Deployment) -> set[str]:
        out = set()
        for child in dep.plan():
            i = child.argv.index(deployment.FLAG)
            out.add(child.argv[i + 1])
        return out

    a = Deployment(topology, tmp_path / "a", runtime_dir=tmp_path)
    b = Deployment(topology, tmp_path / "b", runtime_dir=tmp_path)
    assert ids(a) == {a.deployment} and ids(b) == {b.deployment}
    assert a.deployment != b.deployment  # two runs of one topology are two deployments
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(topology.read_text().replace("workflow: wan21.yaml", f"workflow: {deploy_dir() / 'wan21.yaml'}\n"
                                                  "deployment: prod-eu1"))
    assert ids(Deployment(fixed, tmp_path / "c", runtime_dir=tmp_path)) == {"prod-eu1"}


def test_deployment_ids_are_checked():
    assert deployment.resolve(None, {}) == "" and deployment.resolve(None, {deployment.ENV: "x1"}) == "x1"
    assert deployment.resolve("flag", {deployment.ENV: "env"}) == "flag"
    for bad in ("-x", "a b", "x" * 65, "a/b"):
        with pytest.raises(ValueError, match="not a deployment id"):
            deployment.check_id(bad)
    assert deployment.refusal("a", "a") is None and deployment.refusal("", "") is None
    assert deployment.refusal("a", None) is not None and deployment.refusal("", "b") is not None
