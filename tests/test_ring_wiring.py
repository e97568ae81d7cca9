"""A ring receiver that goes away or comes back is noticed by its senders.

The receiver runs in a real process that the test SIGKILLs; a new receiver process at the same
address starts a new generation of the region, and a sender still attached to the old one
attaches again instead of writing into memory nobody reads."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from onepiece.launcher import free_tcp_address
from onepiece.transport import registry
from onepiece.transport.base import Full
from onepiece.transport.message import Message

RECEIVER = textwrap.dedent("""
    import sys
    from onepiece.transport import registry
    r = registry.listen(sys.argv[1])
    print("ready", r.address, flush=True)
    while True:
        m = r.recv(1.0)
        if m is not None:
            print("got", m.uid, flush=True)
""")


class ReceiverProcess:
    def __init__(self, address: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", RECEIVER, address], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("ready"), line
        self.address = line.split()[1]

    def next_uid(self, timeout: float = 10.0) -> str:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout), "receiver printed nothing"
        line = self.proc.stdout.readline()
        assert line.startswith("got"), line
        return line.split()[1]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def _msg(uid: str) -> Message:
    return Message({"uid": uid, "kind": "t"}, {"x": b"payload" * 10})


@pytest.fixture(params=["shm", "ring+tcp"])
def address(request, tmp_path: Path) -> str:
    if request.param == "shm":
        return f"shm://onepiece-test-{tmp_path.name}?slots=16&bytes=65536"
    return free_tcp_address().replace("tcp://", "ring+tcp://") + "?slots=16&bytes=65536"


def test_a_restarted_receiver_gets_the_next_message(address):
    first = ReceiverProcess(address)
    sender = registry.connect(first.address)
    second = None
    try:
        sender.send(_msg("before"), timeout=5)
        assert first.next_uid() == "before"
        gen = sender.writer.region.generation
        first.kill()
        second = ReceiverProcess(address)
        sender.send(_msg("after"), timeout=5)
        assert second.next_uid() == "after"
        assert sender.writer.region.generation != gen
    finally:
        sender.close()
        for r in (first, second):
            if r is not None and r.proc.poll() is None:
                r.kill()
        if address.startswith("shm://"):
            Path("/dev/shm", address[len("shm://"):].split("?")[0]).unlink(missing_ok=True)


def test_a_closed_receiver_makes_sends_fail_visibly(address):
    receiver = registry.listen(address)
    sender = registry.connect(receiver.address)
    try:
        sender.send(_msg("one"), timeout=2)
        assert receiver.recv(2).uid == "one"
        receiver.close()
        t0 = time.monotonic()
        with pytest.raises(Full, match="no ring receiver"):
            sender.send(_msg("two"), timeout=0.5)
        assert time.monotonic() - t0 < 5  # bounded: the send timeout plus one agent operation
    finally:
        sender.close()
        receiver.close()


def test_bad_ring_addresses_are_refused_clearly():
    with pytest.raises(ValueError, match="power of two"):
        registry.listen("shm://onepiece-bad?slots=3")
    with pytest.raises(ValueError, match="unknown ring option"):
        registry.listen("shm://onepiece-bad?colour=red")
    with pytest.raises(ValueError, match="shm ring name"):
        registry.listen("shm://../etc/passwd")


FULL_SHM = textwrap.dedent("""
    import sys
    from onepiece.transport import registry
    from onepiece.transport.message import Message
    try:
        r = registry.listen("shm://onepiece-test-full?slots=16&bytes=4194304")
    except OSError as e:
        print("refused", e, flush=True)
        sys.exit(0)
    s = registry.connect(r.address)
    s.send(Message({"uid": "u1", "kind": "t"}, {"x": b"x" * (3 << 20)}), 5.0)
    print("sent", flush=True)
""")


def _can_mount_private_tmpfs() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                               "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_a_ring_that_does_not_fit_in_dev_shm_is_refused_where_it_is_created():
    """On a /dev/shm with less room than the ring, creating it fails with ENOSPC; a sparse ring
    was created and then killed its first sender with SIGBUS (the real /dev/shm is untouched:
    a 1 MiB tmpfs is mounted over it in a private mount namespace)."""
    if not _can_mount_private_tmpfs():
        pytest.skip("needs unshare -m and mount (root)")
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$0" -c "$1"', sys.executable, FULL_SHM],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout.startswith("refused"), proc.stdout
    assert "No space left on device" in proc.stdout and "/dev/shm/onepiece-test-full" in proc.stdout


def test_a_shm_ring_holds_all_its_pages_from_the_start(tmp_path: Path):
    receiver = registry.listen(f"shm://onepiece-test-{tmp_path.name}?slots=16&bytes=1048576")
    try:
        st = Path(f"/dev/shm/onepiece-test-{tmp_path.name}").stat()
        assert st.st_blocks * 512 >= st.st_size
    finally:
        receiver.close()
