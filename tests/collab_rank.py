"""One rank of a collaboration group, for tests/test_collab.py: denoises the requests of a
message file on the tiny models following a per-step plan of groups, and (rank 0) saves the
latents. Started as a plain process per rank (nothing pickled), for one run or (``serve``)
for the runs its stdin hands it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import orjson


def read_messages(path: Path) -> list:
    from onepiece.stage.collective import unpack
    from onepiece.transport.message import decode

    return [decode(unpack(bytes.fromhex(line))) for line in path.read_text().split()]


def write_messages(path: Path, msgs: list) -> None:
    from onepiece.stage.collective import pack
    from onepiece.transport.message import encode

    path.write_text("\n".join(pack([bytes(x) for x in encode(m)]).hex() for m in msgs))


def run(c, cfg: dict) -> None:
    """Denoise the requests of ``cfg["messages"]`` following ``cfg["plan"]`` on the world ``c``,
    with models loaded for this run; write what the test reads into ``cfg["out"]``."""
    from onepiece.stage.loader import load_components
    from onepiece.stage.registry import StageContext, lookup
    from onepiece.stage.wan.parallel import ParallelDenoiser

    ctx = StageContext(load_components(Path(cfg["model_dir"]), ["transformer", "scheduler"]))
    msgs = read_messages(Path(cfg["messages"]))
    tasks = [lookup("denoise", m.header["app"])(ctx, m) for m in msgs]
    p = ParallelDenoiser(c)
    # plan: one entry per run, a list of [ranks, [request indices], steps] parts; cancel: per
    # run, {"step": k, "leave": [task index in part 0]}: what leave_out says before step k
    # (the same on every rank, as the worker's shared drops are)
    for run_index, parts in enumerate(cfg["plan"]):
        cancel = (cfg.get("cancel") or {}).get(str(run_index))
        asked = [0]

        def leave_out(i: int, cancel=cancel, asked=asked) -> set[int]:
            asked[0] += 1
            return set(cancel["leave"]) if cancel and asked[0] > cancel["step"] else set()

        p.run([(tuple(r), [tasks[i] for i in idx], n) for r, idx, n in parts], leave_out)
    (Path(cfg["out"]) / f"steps-{c.rank}.json").write_bytes(orjson.dumps([t.i for t in tasks]))
    if c.rank == 0 or cfg.get("all_save"):
        for i, t in enumerate(tasks):
            np.save(Path(cfg["out"]) / f"latents-{c.rank}-{i}.npy", t.latents.numpy())
    # What this rank listens on while the world is up (the test checks it is loopback only).
    import psutil

    listening = [f"{a.laddr.ip}:{a.laddr.port}" for a in psutil.Process().net_connections("inet")
                 if a.status == psutil.CONN_LISTEN]
    (Path(cfg["out"]) / f"listening-{c.rank}.json").write_bytes(orjson.dumps(listening))


def main(cfg: dict) -> None:
    import torch

    from onepiece.stage.collective import Collective, leave

    torch.set_num_threads(1)
    c = Collective(cfg["rank"], cfg["size"], cfg["address"], "cpu", timeout_s=60)
    if cfg.get("serve"):
        # Runs one after another on this one world, as a worker group keeps its world across
        # requests: each a JSON line on stdin (run's keys), answered "done" on stdout. A run
        # that fails ends the process (its peers' collectives then time out).
        for line in sys.stdin:
            run(c, {**cfg, **orjson.loads(line)})
            print("done", flush=True)
    else:
        run(c, cfg)
    c.close()
    leave()


if __name__ == "__main__":
    main(orjson.loads(sys.argv[1]))
