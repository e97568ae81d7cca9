"""`onepiece bench e2e`'s in-process column: the deployment's own stage functions one after
another in one process, on the workflow a deployment is written with (no processes started)."""

from __future__ import annotations

from onepiece.bench.common import T2V_STAGES
from onepiece.bench.e2e import SplitInProcess
from onepiece.launcher import write_topology


def test_the_stage_functions_run_one_after_another_in_this_process(tiny_models, tmp_path):
    write_topology(tmp_path, tiny_models, "tcp://127.0.0.1:1", dbs=1, stages=dict(T2V_STAGES))
    split = SplitInProcess(tmp_path, "cpu")
    assert split.stages == ["text_encode", "denoise_t2v", "vae_decode"]
    split(32, 32, 5, 1)  # the first forward passes warm up
    seconds = split(32, 32, 5, 2)
    assert list(seconds) == split.stages and all(0 < s < 60 for s in seconds.values()), seconds
    # More steps cost the stepped stage more: 2 against 100, the faster of three runs each (one
    # preemption of a run, ~15 ms on an idle machine, is as long as 16 steps; a busy neighbour's
    # longer).
    few = min(seconds["denoise_t2v"], *(split(32, 32, 5, 2)["denoise_t2v"] for _ in range(2)))
    more = min(split(32, 32, 5, 100)["denoise_t2v"] for _ in range(3))
    assert more > few, (few, more)
