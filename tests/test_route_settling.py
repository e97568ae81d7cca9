"""Routes are not narrowed while the instances of a restarted NM register again (issue 15, item
1): a restarted embedded NM knows nobody, and the members that registered again first got route
tables without those that had not yet (503 and 429 for 1-2 s although every instance was
alive). Now a stage instance that registers again while serving is routed at once, and for the
dead limit after its start the NM hands out no routes to members that hold some. A real NM
process is SIGKILLed and started again; the members are real Memberships over real sockets,
each recording every route table it applies."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest
import yaml

from onepiece.config import deploy_dir
from onepiece.launcher import free_tcp_address
from onepiece.nm.client import Membership, NmClient
from onepiece.transport.rpc import RpcError
from waiting import wait_for

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

HEARTBEAT_S = 0.2
STAGES = ["text_encode", "denoise_t2v", "vae_decode", "image_encode", "vae_encode", "denoise_i2v"]


def _nm(folder, address: str) -> subprocess.Popen:
    topo = yaml.safe_load((deploy_dir() / "local.yaml").read_text())
    topo["workflow"] = str(deploy_dir() / "wan21.yaml")
    # dead_after_s is also how long a restarted NM waits for members to register again before it
    # republishes (nm/server.py): 1 s (5 heartbeats) was short for 8 members on a busy machine.
    topo["nm"] = {"address": address, "heartbeat_s": HEARTBEAT_S, "dead_after_s": 5.0,
                  "elastic": {"enabled": False}}
    path = folder / "topology.yaml"
    path.write_text(yaml.safe_dump(topo))
    return subprocess.Popen([sys.executable, "-m", "onepiece", "nm", "--topology", str(path), "--address", address],
                            stdout=open(folder / "nm.log", "a"), stderr=subprocess.STDOUT)


def _served(routes: dict) -> dict[str, set]:
    """What a route table routes to: per stage, and the DBs and proxies."""
    return {**{s: set(a) for s, a in routes["stages"].items()},
            "dbs": {d["data"] for d in routes["dbs"]}, "proxies": set(routes["proxies"])}


def test_a_restarted_nm_narrows_no_members_routes_while_they_register_again(tmp_path):
    address = free_tcp_address()
    nm = _nm(tmp_path, address)
    lock = threading.Lock()
    tables: list[tuple[int, str, dict]] = []  # (NM incarnation, member, table applied)
    incarnation = [0]

    def recorder(name: str):
        def on_routes(routes: dict) -> None:
            with lock:
                tables.append((incarnation[0], name, routes))
        return on_routes

    members = [Membership(address, "stage", "set0", {"data": f"tcp://127.0.0.1:{9700 + i}"}, stage=s,
                          on_routes=recorder(s)) for i, s in enumerate(STAGES)]
    members.append(Membership(address, "db", "set0", {"data": "tcp://127.0.0.1:9710", "control": "tcp://127.0.0.1:9711",
                                                      "events": "tcp://127.0.0.1:9712"}, on_routes=recorder("db")))
    members.append(Membership(address, "proxy", "set0", {"http": "http://127.0.0.1:9713"}, on_routes=recorder("proxy")))
    client = NmClient(address, timeout=1.0, retries=0)

    def routes() -> dict | None:
        try:
            return client.routes("set0")
        except RpcError:
            return None

    try:
        for m in members:
            m.register(timeout=30)
            m.start()
        full = wait_for(lambda: (r := routes()) and all(r["stages"][s] for s in STAGES) and r["proxies"] and r,
                        timeout=30, what="every member routed")
        wait_for(lambda: all(_served(m.routes) == _served(full) for m in members), timeout=10,
                 what="every member holding the full routes")
        before = {m.id for m in members}

        nm.send_signal(signal.SIGKILL)
        nm.wait()
        with lock:
            incarnation[0] = 1
        nm = _nm(tmp_path, address)

        # Every member registers again (a new id), and ends with the new NM's full routes.
        wait_for(lambda: all(m.id not in before for m in members), timeout=30, what="every member registered again")
        wait_for(lambda: (r := routes()) and _served(r) == _served(full) and "routes republished" in
                 (tmp_path / "nm.log").read_text(), timeout=20, what="the new NM routing everyone, settled")
        wait_for(lambda: all(m.routes["version"] == routes()["version"] and _served(m.routes) == _served(full)
                             for m in members), timeout=10, what="every member holding the new NM's routes")
        # The new NM's versions start above the old one's: counting from 1 again, a table could
        # reach a version a member held with other content, and it would never be sent that table.
        assert routes()["version"] > full["version"] + 1000, (routes()["version"], full["version"])
        # Meanwhile no member applied a table that routes to less than before the restart.
        with lock:
            applied = [(name, _served(t)) for inc, name, t in tables if inc == 1]
        narrowed = [(name, {k: full_v - t[k] for k, full_v in _served(full).items() if full_v - t[k]})
                    for name, t in applied if any(not t[k] >= v for k, v in _served(full).items())]
        assert not narrowed, narrowed
        assert applied  # they did take the new NM's routes, once it had them all
    finally:
        for m in members:
            m.stop()
        client.close()
        nm.terminate()
        nm.wait(15)
