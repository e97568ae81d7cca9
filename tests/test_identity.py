"""An instance is known by its stable name (nm/identity.py): one process holds a name at a time; a
restarted process takes its dead predecessor's place, under the same id, where the name was; a
restarted NM knows every instance under the id it had."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from onepiece.config import deploy_dir, load_topology
from onepiece.nm.client import Membership, NmClient
from onepiece.nm.identity import NAME_HELD, claim, held_s
from onepiece.nm.server import NodeManager
from onepiece.ports import free_port_run
from onepiece.transport.rpc import RpcError
from waiting import wait_for

KEY = os.environ["ONEPIECE_OPERATOR_KEY"]  # conftest's
HEARTBEAT_S = 0.2


def test_the_claim_rule():
    assert claim("p1", silent_s=0.0, process="p1", held_for_s=0.4) == "same"
    assert claim("p1", silent_s=99.0, process="p1", held_for_s=0.4) == "same"  # the NM forgot nothing
    assert claim("p1", silent_s=0.1, process="p2", held_for_s=0.4) == "held"
    assert claim("p1", silent_s=0.4, process="p2", held_for_s=0.4) == "replace"
    assert held_s(1.0) == 2.0


def _serve(topo, wf, base, address: str = "tcp://127.0.0.1:0"):
    server = NodeManager(topo, wf, base, address)
    stop = threading.Event()
    t = threading.Thread(target=server.run, args=(stop,))
    t.start()

    def close() -> None:
        stop.set()
        t.join()
        server.close()
    return server, close


@pytest.fixture
def topology():
    topo, wf, base = load_topology(deploy_dir() / "local.yaml")
    topo.nm.heartbeat_s = HEARTBEAT_S
    # Far beyond the test: a dead holder is found by its successor's claim, not by the silence limit.
    topo.nm.dead_after_s = 60.0
    topo.nm.elastic.enabled = False
    return topo, wf, base


CHILD = textwrap.dedent("""
    import sys, time
    from onepiece.nm.client import Membership
    m = Membership(sys.argv[1], "stage", "set0", {"data": "tcp://127.0.0.1:9801"}, stage="vae_decode",
                   name="set0-vae_decode0", stats=lambda: {"holding": ["held-by-the-first"]})
    m.register()
    m.start()
    print(m.id, m.process, flush=True)
    time.sleep(120)
""")


def test_one_process_holds_a_name_and_its_restart_takes_the_place_of_the_dead_one(topology):
    server, close = _serve(*topology)
    client = NmClient(server.address)
    # A real process holds the name, heartbeating, until it is SIGKILLed.
    first = subprocess.Popen([sys.executable, "-c", CHILD, server.address], stdout=subprocess.PIPE, text=True)
    try:
        first_id, first_process = first.stdout.readline().split()
        assert first_id == "set0-vae_decode0"
        client.move(first_id, "denoise_t2v", key=KEY)  # where the name now belongs

        # A second process under the live name is refused, and the holder keeps its place.
        second = Membership(server.address, "stage", "set0", {"data": "tcp://127.0.0.1:9802"}, stage="vae_decode",
                            name="set0-vae_decode0")
        with pytest.raises(RpcError, match=NAME_HELD):
            second.register(timeout=1.5)
        inst = server.state.instances[first_id]
        assert (inst.process, inst.pid, inst.addresses["data"]) == (first_process, first.pid, "tcp://127.0.0.1:9801")
        assert wait_for(lambda: server.state.instances[first_id].holding == ["held-by-the-first"], timeout=10)

        # The holder is SIGKILLed; its restart registers (retrying while the dead one's silence
        # is still short) and gets the same id, at the stage the name was moved to.
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        killed = time.monotonic()
        restarted = Membership(server.address, "stage", "set0", {"data": "tcp://127.0.0.1:9803"}, stage="vae_decode",
                               name="set0-vae_decode0")
        reply = restarted.register(timeout=10)
        took = time.monotonic() - killed
        assert (restarted.id, reply["stage"]) == ("set0-vae_decode0", "denoise_t2v")
        # Long before the silence limit (60 s): the claim found the holder dead.
        assert took < 5.0, took
        (only,) = [i for i in server.state.instances.values() if i.name == "set0-vae_decode0"]
        assert (only.process, only.addresses["data"], only.holding) == (restarted.process, "tcp://127.0.0.1:9803", [])
        events = client.status()["events"]
        assert any("dropped set0-vae_decode0" in e and "its process was replaced" in e for e in events), events

        # The dead process's token is no longer the name's: a heartbeat with it is an unknown
        # instance's (which would register again, and be refused while the restart lives).
        with pytest.raises(RpcError, match="unknown instance set0-vae_decode0 for this process"):
            client.call("heartbeat", instance=first_id, ready=True, process=first_process)
        # The holder's own heartbeats go on.
        client.call("heartbeat", instance=first_id, ready=False, process=restarted.process)
    finally:
        if first.poll() is None:
            first.kill()
        first.wait()
        client.close()
        close()


def test_a_restarted_nm_knows_every_instance_under_the_id_it_had(topology):
    """Ids came from a counter in the NM's memory: after a restart the first instance to
    register again got "stage-1", and the one that held "stage-1" before heartbeated as it and
    took over its stage. Named, every instance comes back under its own name, at its stage."""
    # below the ephemeral range: a member reconnecting to a port in it may be handed that very
    # port as its own (TCP's self-connect) and hold it when the NM binds it again
    server, close = _serve(*topology, f"tcp://127.0.0.1:{free_port_run(1)}")
    address = server.address
    pins = ["text_encode", "denoise_t2v", "vae_decode", "denoise_i2v"]
    members = [Membership(address, "stage", "set0", {"data": f"tcp://127.0.0.1:{9400 + i}"}, stage=s,
                          name=f"set0-{s}0") for i, s in enumerate(pins)]
    unnamed = Membership(address, "db", "set0", {"data": "tcp://127.0.0.1:9500", "control": "tcp://127.0.0.1:9501", "events": "tcp://127.0.0.1:9502"})
    assigned: dict[int, list] = {i: [] for i in range(len(members))}
    try:
        for i, m in enumerate(members):
            m.on_assign = assigned[i].append
            m.register()
            m.start()
        unnamed.register()
        unnamed.start()
        before = {m.id: m.stage for m in members}
        assert set(before) == {f"set0-{s}0" for s in pins}
        old_unnamed = unnamed.id
        close()
        server, close = _serve(*topology, address)  # the same address, an empty memory
        wait_for(lambda: len(server.state.instances) == len(members) + 1, timeout=15,
                 what="every instance registered again")
        assert {i.id: i.stage for i in server.state.instances.values() if i.role == "stage"} == before
        assert [m.stage for m in members] == pins and not any(assigned.values())
        # A member without a name gets an id that no predecessor handed out.
        assert unnamed.id != old_unnamed and unnamed.id in server.state.instances
    finally:
        for m in [*members, unnamed]:
            m.stop()
        close()
