"""The ring protocol's model, transport/ring/ring.pml, checked by spin (DESIGN §5, issue 3).

Each check builds the verifier in a temporary directory (``spin -a``, then gcc), runs it and
reads its report:

- safety: an exhaustive search with -DSAFETY (assertions S1-S4 of the model's header, and
  invalid end states), two lock take-overs per run;
- liveness: the LTL claim "live" (the ring never wedges: every write() of a sender that does
  not crash returns, and the receiver drains what the tails passed) with acceptance cycles
  (-a) under weak fairness (-f), one stall or crash per run;
- the checker must also FAIL where it should: deliberately broken variants of the model, and
  the two bugs it found in the first version of the code (commit bf44540: writer.py step 6
  wrote an entry twice, reader.py step 1 let the heads pass the tails), put back with
  -DOLD_*.  So passing is not vacuous.

Every pass must be complete: "errors: 0", no "max search depth too small", no memory bound
hit, every statement of the senders reached.  Skips when spin or a C compiler is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parents[1] / "transport" / "ring" / "ring.pml"
RING = MODEL.parent
SPIN = shutil.which("spin")
CC = shutil.which("gcc") or shutil.which("cc")

needs_spin = pytest.mark.skipif(
    SPIN is None or CC is None,
    reason="the ring model needs spin and a C compiler (Debian: apt-get install spin gcc)",
)

DEPTH = "-m100000"  # far above the deepest path (a few hundred steps); checked below anyway


@dataclass
class Run:
    out: str
    seconds: float

    @property
    def errors(self) -> int:
        m = re.search(r"errors: (\d+)", self.out)
        assert m, f"no verdict in pan's output:\n{self.out[-3000:]}"
        return int(m.group(1))

    @property
    def states(self) -> int:
        m = re.search(r"([\d.e+]+) states, stored", self.out)  # 2.1e+08 once it is big
        return int(float(m.group(1))) if m else -1

    def complete(self) -> None:
        """The search covered the whole state space (exhaustive, not cut short)."""
        for bad in ("max search depth too small", "reached -DMEMLIM bound", "out of memory",
                    "Search not completed", "-DBITSTATE"):
            assert bad not in self.out, f"{bad!r}:\n{self.out[-3000:]}"
        assert "Full statespace search" in self.out, self.out[-3000:]


def verify(tmp: Path, model_flags: list[str], cc_flags: list[str], pan_flags: list[str],
           opt: str = "-O2", timeout: float = 300) -> Run:
    shutil.copy(MODEL, tmp / "ring.pml")
    subprocess.run([SPIN, *model_flags, "-a", "ring.pml"], cwd=tmp, check=True,
                   capture_output=True, text=True, timeout=60)
    subprocess.run([CC, opt, "-w", *cc_flags, "-o", "pan", "pan.c"], cwd=tmp, check=True,
                   capture_output=True, text=True, timeout=120)
    t0 = time.monotonic()
    done = subprocess.run(["./pan", DEPTH, *pan_flags], cwd=tmp, capture_output=True,
                          text=True, timeout=timeout)
    run = Run(done.stdout + done.stderr, time.monotonic() - t0)
    print(f"\nspin {' '.join(model_flags)} -a | {CC} {opt} {' '.join(cc_flags)} | "
          f"pan {DEPTH} {' '.join(pan_flags)}: errors {run.errors}, {run.states} states, "
          f"{run.seconds:.1f}s")
    return run


# The safety search stores ~14M states in ~1.6 GB, close to pan's default bound of 2 GB, so
# the bound is raised explicitly (a search that hits it fails complete()).
SAFETY = dict(cc_flags=["-DSAFETY", "-DNOCLAIM", "-DMEMLIM=4096"], pan_flags=[])
LIVENESS = dict(cc_flags=["-DMEMLIM=4096"], pan_flags=["-a", "-f"])


def unreached_in_senders(out: str) -> str:
    m = re.search(r"unreached in proctype sender\n(.*?)\t\((\d+) of \d+ states\)", out, re.S)
    assert m, out[-3000:]
    return "" if m.group(2) == "0" else m.group(1)


# --- the model holds -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def main_runs(tmp_path_factory):
    """The two long searches, started together (one core each) the first time either is
    needed: {"safety": Future[Run], "liveness": Future[Run]}."""
    pool = ThreadPoolExecutor(2)
    runs = {
        "safety": pool.submit(verify, tmp_path_factory.mktemp("safety"),
                              ["-DSAFETY_RUN", "-DMAXF=2"], **SAFETY),
        "liveness": pool.submit(verify, tmp_path_factory.mktemp("liveness"),
                                ["-DLIVENESS_RUN", "-DMAXF=1"], **LIVENESS),
    }
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow  # the two long searches take a core each
@needs_spin
def test_safety(main_runs):
    """No corrupted or duplicated delivery, no busy slot overwritten, heads never past tails,
    no deadlock: every interleaving of 3 senders and the receiver, with up to two lock
    take-overs of stalled holders, each of which may wake up later with stale copies."""
    run = main_runs["safety"].result()
    run.complete()
    assert run.errors == 0, run.out[-3000:]
    assert "invalid end states\t+" in run.out  # deadlocks were looked for too
    assert unreached_in_senders(run.out) == "", "model steps never reached:\n" + run.out
    assert run.states > 1_000_000  # a real search, not a trivial one


@pytest.mark.slow  # the two long searches take a core each
@needs_spin
def test_liveness(main_runs):
    """Under weak fairness, with one stall or crash anywhere: the ring never wedges; every
    write() of a sender that does not crash returns, and the receiver drains the ring."""
    run = main_runs["liveness"].result()
    run.complete()
    assert "never claim         \t+ (live)" in run.out, run.out[-3000:]
    assert "acceptance   cycles \t+ (fairness enabled)" in run.out, run.out[-3000:]
    assert run.errors == 0, run.out[-3000:]
    assert unreached_in_senders(run.out) == "", "model steps never reached:\n" + run.out


@needs_spin
def test_resend_after_step2_lostlock_is_safe(tmp_path):
    """writer.py: a LostLock raised at step 2 means "nothing written", so a caller may send the
    message again: no duplicate (one take-over; the deep run below allows two)."""
    run = verify(tmp_path, ["-DSAFETY_RUN", "-DMAXF=1", "-DCALLER_RESENDS_2"], **SAFETY)
    run.complete()
    assert run.errors == 0, run.out[-3000:]


# --- and the checker finds what it should ----------------------------------------------------

# (flags, which run, what pan must report).  The assertion texts are spin's rendering of the
# model's S1..S5 expressions.
S1 = "wrote["                    # S1: the header names a real message with its length
S2 = "(delivered[w]&(1<<e))==0"  # S2: no duplicate
S3 = "!((sw>=128))"              # S3: no busy slot overwritten
S4 = "(tails/16)-(heads/16)"     # S4: heads never pass tails
S5 = "hold_n"                    # S5: no sender writes into an entry held as clean
CYCLE = "acceptance cycle"

BROKEN = {
    # deliberately broken models
    "broken-slot-store": (["-DBROKEN_SLOT"], SAFETY, S3),
    "broken-no-checksum": (["-DBROKEN_NOCHECK"], SAFETY, S1),
    "broken-no-takeover": (["-DBROKEN_NOTAKEOVER"], LIVENESS, CYCLE),
    "broken-no-taint": (["-DBROKEN_TAINT"], SAFETY, S5),
    # the first version of the code, commit bf44540 (see the FINDINGS of ring.pml)
    "bf44540-step6-writes-twice": (["-DOLD_RESEND"], SAFETY, S2),
    "bf44540-heads-pass-tails": (["-DOLD_RECEIVER"], SAFETY, S4),
    "bf44540-ring-wedges": (["-DOLD_RECEIVER", "-DNO_S4"], LIVENESS, CYCLE),
    # a LostLock raised at step 6 does not mean "not handed up": sending again duplicates
    "caller-resends-after-step6-lostlock": (["-DCALLER_RESENDS"], SAFETY, S2),
}


@needs_spin
@pytest.mark.parametrize("variant", list(BROKEN))
def test_checker_catches(tmp_path, variant):
    flags, mode, expect = BROKEN[variant]
    run_flags = ["-DLIVENESS_RUN"] if mode is LIVENESS else ["-DSAFETY_RUN"]
    run = verify(tmp_path, [*run_flags, "-DMAXF=1", *flags], opt="-O1", **mode)
    assert run.errors > 0, f"{variant}: the checker found nothing:\n{run.out[-3000:]}"
    found = re.search(r"pan:1: (.*)", run.out)
    assert found and expect in found.group(1), f"{variant}: expected {expect!r}:\n{run.out[-3000:]}"


# --- bigger configurations, on request (minutes each, GBs of memory) --------------------------

DEEP = {
    "safety-3-takeovers": (["-DSAFETY_RUN", "-DMAXF=3"], SAFETY),
    "safety-4-slots": (["-DSAFETY_RUN", "-DNS=4", "-DSMOD=16", "-DMAXF=2"], SAFETY),
    "liveness-2-faults": (["-DLIVENESS_RUN", "-DMAXF=2"], LIVENESS),
    "resend-after-step2-lostlock-2-takeovers": (["-DSAFETY_RUN", "-DCALLER_RESENDS_2",
                                                 "-DMAXF=2"], SAFETY),
    # two messages each, both counters wrapping, no faults (with a fault and a one-bit lap
    # the model finds the counter-wrap ABA that ring.pml's header describes)
    "safety-counters-wrap": (["-DSAFETY_RUN", "-DNE=2", "-DSMOD=4", "-DBMOD=8", "-DMAXF=0"],
                             SAFETY),
}


@needs_spin
@pytest.mark.skipif(not os.environ.get("ONEPIECE_RING_MODEL_DEEP"),
                    reason="set ONEPIECE_RING_MODEL_DEEP=1 for the bigger model configurations")
@pytest.mark.parametrize("config", list(DEEP))
def test_deep(tmp_path, config):
    flags, mode = DEEP[config]
    run = verify(tmp_path, flags, cc_flags=[*mode["cc_flags"], "-DCOLLAPSE", "-UMEMLIM",
                                            "-DMEMLIM=16000"],
                 pan_flags=mode["pan_flags"], timeout=3600)
    run.complete()
    assert run.errors == 0, run.out[-3000:]


# --- model and code name the same steps -------------------------------------------------------

def test_steps_named_in_model_and_code():
    model = MODEL.read_text()
    for n in range(1, 9):
        assert f"writer.py step {n}" in model, f"writer.py step {n} has no model step"
    for n in range(1, 6):
        assert f"reader.py step {n}" in model, f"reader.py step {n} has no model step"
    for code in ("writer.py", "reader.py"):
        doc = (RING / code).read_text().split('"""')[1]
        assert "ring.pml" in doc, f"{code}'s docstring does not point at the model"
