"""`onepiece bench cpu`'s pieces: naming a deployment's processes by role and reading their
scheduler counters from /proc (the benchmark itself starts a deployment: bench/cpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from onepiece.bench.cpu import per, role_of, usage


def test_bench_cpu_names_each_process_by_role_and_reads_its_counters():
    assert role_of(["python", "-m", "onepiece", "stage", "--nm", "tcp://x", "--stage", "vae_decode"]) == "stage vae_decode"
    assert role_of(["python", "-m", "onepiece.stage.worker", '{"stage": "text_encode", "identity": "w0"}']) == \
        "worker text_encode"
    assert role_of(["python", "-m", "onepiece.stage.worker", "not json"]) == "worker"
    assert [role_of(["python", "-m", "onepiece", r, "--nm", "x"]) for r in ("db", "proxy", "nm")] == ["db", "proxy", "nm"]
    assert role_of(["bash", "-c", "true"]) == "other" and role_of([]) == "other"
    # This very process's counters, read from /proc: they grow while it computes.
    before = usage([os.getpid()])
    t = time.process_time()
    while time.process_time() - t < 0.05:
        pass
    used = per(before, usage([os.getpid()]), 1)["other"]
    assert used["cpu_ms"] >= 40 and used["wakeups"] >= 0
    assert usage([2 ** 22 + 12345]) == {}  # a process that is gone is left out


def test_bench_cpu_counts_the_cpu_of_a_thread_that_ended_between_readings():
    # A VAE worker encodes each MP4 on a thread that ends with the request: its CPU must count.
    # The child burns on a thread when told (a line on stdin), says so, and waits to be killed.
    child = subprocess.Popen([sys.executable, "-c", """
import sys, threading, time
sys.stdin.readline()
def burn():
    t = time.thread_time()
    while time.thread_time() - t < 0.3:
        pass
th = threading.Thread(target=burn)
th.start()
th.join()
print("done", flush=True)
sys.stdin.read()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = usage([child.pid])
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"  # (the thread has ended)
        used = per(before, usage([child.pid]), 1)["other"]
        assert used["cpu_ms"] >= 250, used  # the ended thread's 300 ms (its live threads' counters show ~0)
    finally:
        child.kill()
        child.wait()
