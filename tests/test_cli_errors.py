"""What a command says when an address is wrong or its node manager does not answer: one line
naming the flag, the key or the address, and an exit code, never a traceback. Before: `onepiece
nm --address tcp://127.0.0.1:99999` served at port 34463 (ZeroMQ keeps the low 16 bits), `onepiece
stage --listen notanaddress` and `onepiece db --control foo://x` raised, and a role started
before its NM waited 30 s in silence and then raised."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest

from onepiece.launcher import free_tcp_address
from onepiece.nm.client import NmClient
from onepiece.transport.registry import checked
from onepiece.transport.rpc import RpcTimeout


def onepiece(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onepiece", *argv], capture_output=True, text=True, timeout=60,
                          cwd=cwd)


@pytest.mark.parametrize("address,why", [
    ("tcp://127.0.0.1:99999", "a port from 0 to 65535"),
    ("tcp://127.0.0.1", "a port from 0 to 65535"),
    ("notanaddress", "has no scheme"),
    ("foo://x", "scheme 'foo' is not one of"),
])
def test_an_address_that_cannot_be_bound_is_refused_saying_why(address, why):
    with pytest.raises(ValueError, match=why):
        checked(address)
    for ok in ("tcp://127.0.0.1:0", "tcp://0.0.0.0:7700", "ipc:///tmp/x.sock", "shm://ring", "tcp://[::1]:5"):
        assert checked(ok) == ok
    with pytest.raises(ValueError, match="not one of tcp, ipc"):
        checked("shm://ring", ("tcp", "ipc"))


@pytest.mark.parametrize("argv,flag", [
    (["nm", "--address", "tcp://127.0.0.1:99999"], "--address"),
    (["stage", "--listen", "notanaddress"], "--listen"),
    (["db", "--control", "foo://x"], "--control"),
    (["db", "--events", "shm://x"], "--events"),  # events are ZeroMQ's only
    (["status", "--nm", "tcp://127.0.0.1:70000"], "--nm"),
])
def test_a_role_refuses_a_bad_address_before_it_starts(argv, flag):
    out = onepiece(*argv)
    assert out.returncode == 2 and f"argument {flag}: " in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_topology_with_a_port_out_of_range_names_the_key(tmp_path):
    (tmp_path / "topo.yaml").write_text("workflow: wan21.yaml\nnm: {address: 'tcp://127.0.0.1:99999'}\n"
                                        "sets:\n  - {name: s, stages: {}}\n")
    out = onepiece("nm", "--topology", str(tmp_path / "topo.yaml"))
    assert out.returncode == 2 and "nm.address: " in out.stderr and "65535" in out.stderr, out.stderr


def test_a_node_manager_that_does_not_answer_is_one_line_not_a_traceback():
    out = onepiece("move", "some-instance", "idle", "--nm", free_tcp_address())  # nothing listens there
    assert out.returncode == 1 and out.stderr.startswith("onepiece move: move: no answer from"), out.stderr
    assert "Traceback" not in out.stderr


def test_a_client_waiting_for_its_node_manager_says_so_once_and_gives_up_in_time(caplog):
    client = NmClient(free_tcp_address(), timeout=0.2, retries=0)
    t0 = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="onepiece.nm.client"), pytest.raises(RpcTimeout):
            client.workflow(timeout=1.0)
    finally:
        client.close()
    assert 1.0 <= time.monotonic() - t0 < 5.0
    said = [r.getMessage() for r in caplog.records if "yet; trying again" in r.getMessage()]
    assert len(said) == 1 and "for up to 1 s" in said[0], said


def test_up_refuses_a_stage_whose_device_this_host_lacks_before_starting_anything(tmp_path):
    """Started anyway, the stage's workers fail at every start (here: "Torch not compiled with
    CUDA enabled", retried with backoff) and `up` waits out its ready timeout saying nothing. No
    host has 64 CUDA devices, so this is refused for real on a GPU host too."""
    from onepiece.config import deploy_dir

    (tmp_path / "wf.yaml").write_text((deploy_dir() / "wan21.yaml").read_text().replace(
        "    components: [transformer, scheduler]\n    schedule", "    components: [transformer, scheduler]\n"
        "    device: cuda:63\n    schedule", 1))
    (tmp_path / "topo.yaml").write_text(f"workflow: {tmp_path / 'wf.yaml'}\nnm: {{address: '{free_tcp_address()}'}}\n"
                                        "sets:\n  - {name: s, stages: {text_encode: 1, denoise_t2v: 1}, "
                                        "proxy: {port: 0}}\n")
    t0 = time.monotonic()
    out = onepiece("up", "--topology", str(tmp_path / "topo.yaml"), "--logs", str(tmp_path / "logs"))
    assert out.returncode == 1 and "onepiece up failed: stage denoise_t2v " in out.stderr, out.stderr
    assert "cuda" in out.stderr.lower() and "text_encode" not in out.stderr.split("failed:")[1], out.stderr
    assert time.monotonic() - t0 < 30 and not list((tmp_path / "logs").glob("*.log"))  # nothing started


def test_status_says_when_the_primary_cannot_reach_zookeeper():
    from onepiece.cli import ha_line

    nm = {"mode": "zookeeper", "address": "tcp://a:1", "epoch": 2, "zookeeper": "zk:2181", "root": "/op",
          "contenders": ["tcp://a:1", "tcp://b:1"]}
    assert ha_line(nm) == "node manager: primary tcp://a:1 (epoch 2) on ZooKeeper zk:2181/op; backups: tcp://b:1"
    assert ha_line({**nm, "suspended": True}).endswith("; ZooKeeper unreachable: serving what it holds, saving "
                                                       "nothing, moving nothing")
