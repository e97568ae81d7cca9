"""The same roles across two hosts: a network namespace of the test's own ("host B", holding
the stage instances) joined by a veth pair to this one ("host A": NM, DB, proxy). Stage data,
results and control traffic all cross the link over TCP, on addresses of the test's own
hosts. Needs root for `ip netns`; skipped with the reason where that is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import imageio.v3 as iio
import pytest

from onepiece.client import Client
from onepiece.nm.client import NmClient
from onepiece.proxy import keys
from onepiece.proxy.keys import new_key
from onepiece.supervise import child_preexec
from onepiece.transport import curve
from onepiece.transport.rpc import RpcError
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

STAGES = ("text_encode", "denoise_t2v", "vae_decode")


def ip(*args: str, ns: str | None = None) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=10)


@pytest.fixture
def two_hosts():
    """(host A address, host B address, namespace name)."""
    tag = os.getpid() % 250 + 1
    ns, a_if, b_if = f"onepiece-t{tag}", f"opa{tag}", f"opb{tag}"
    host_a, host_b = f"10.251.{tag}.1", f"10.251.{tag}.2"
    made = ip("netns", "add", ns)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
    try:
        steps = [
            (("link", "add", a_if, "type", "veth", "peer", "name", b_if), None),
            (("link", "set", b_if, "netns", ns), None),
            (("addr", "add", f"{host_a}/24", "dev", a_if), None),
            (("link", "set", a_if, "up"), None),
            (("addr", "add", f"{host_b}/24", "dev", b_if), ns),
            (("link", "set", b_if, "up"), ns),
            (("link", "set", "lo", "up"), ns),
        ]
        for args, where in steps:
            r = ip(*args, ns=where)
            assert r.returncode == 0, f"ip {' '.join(args)}: {r.stderr}"
        yield host_a, host_b, ns
    finally:
        ip("netns", "del", ns)  # takes the veth pair with it
        ip("link", "del", a_if)


@pytest.mark.parametrize("data", ["tcp", "ring+tcp"])
def test_stages_on_another_host_serve_through_proxy_and_db_on_this_one(data, two_hosts, tiny_models, make_topology,
                                                                      tmp_path):
    """``data``: how the stages and the DB receive their data, ZeroMQ or the ring buffer
    through its TCP agent (one-sided operations across the veth pair)."""
    host_a, host_b, ns = two_hosts
    nm = f"tcp://{host_a}:7791"
    topology = make_topology(tmp_path, tiny_models, nm, dbs=1, transport="tcp",
                             stages={s: 1 for s in STAGES})
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen] = []

    key = new_key()  # a proxy beyond loopback serves only with API keys
    folder = curve.make(tmp_path / "curve")  # and every role beyond loopback only with CURVE

    def start(name: str, *args: str, netns: str | None = None, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "onepiece", *args]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        with open(logs / f"{name}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=child_preexec,
                                          env={**os.environ, curve.ENV: str(folder), **(env or {})}))

    try:
        start("nm", "nm", "--topology", str(topology), "--address", nm)
        start("db", "db", "--nm", nm, "--listen", f"{data}://{host_a}:0", "--control", f"tcp://{host_a}:0",
              "--events", f"tcp://{host_a}:0", "--replication", "1")
        start("proxy", "proxy", "--nm", nm, "--host", host_a, "--port", "0", env={keys.ENV: key})
        for stage in STAGES:
            start(stage, "stage", "--nm", nm, "--stage", stage, "--listen", f"{data}://{host_b}:0", netns=ns)

        curve.use(curve.load(folder))  # this test asks the NM as a member would
        client = NmClient(nm, timeout=1.0, retries=0)
        def registered() -> dict | None:
            for p in procs:
                assert p.poll() is None, f"a role exited; logs: {sorted(x.name for x in logs.iterdir())}"
            try:
                routes = client.routes("set0")
            except RpcError:
                return None
            return routes if all(routes["stages"][s] for s in STAGES) and routes["proxies"] else None

        routes = wait_for(registered, 120, "every role registered", interval=0.2)
        client.close()
        for s in STAGES:  # the stages registered addresses on host B
            assert routes["stages"][s] and routes["stages"][s][0].startswith(f"{data}://{host_b}:"), routes
        assert routes["proxies"][0].startswith(f"http://{host_a}:")

        with Client(routes["proxies"], rounds=10, api_key=key) as c:
            path = c.generate("across two hosts", tmp_path / "x.mp4", model="t2v", size="32x32", num_frames=5,
                              steps=2, timeout=120)
        assert iio.imread(path.read_bytes(), extension=".mp4").shape == (5, 32, 32, 3)
    finally:
        curve.use(None)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for p in procs:
            # `ip netns exec` runs the role as its child: nothing may outlive the test
            assert p.returncode is not None
        for f in Path(logs).iterdir():
            text = f.read_text(errors="replace")
            assert "Traceback" not in text, f"{f.name}:\n{text[-2000:]}"
