"""`onepiece bench parallel`: what a collaboration group buys one denoising step (issue 13).

The ``scale`` Wan2.1 transformer (or ``--models``), one torch thread per rank, per shape of
``--shapes``: the time of one denoising step of one request at DoP 1, 2 (and 4 where the
machine has the cores or GPUs), with CFG (CFG-parallel at DoP 2; CFG × sequence at 4) and
without (sequence-parallel: Ulysses through diffusers' context parallelism), through the very
code a collaboration instance runs (``ParallelDenoiser.step``). Each DoP is a world of its
own, started as plain processes (nothing pickled).

Also, in a world of 2: what it costs to build the group and its meshes (once, at start), to
switch a model between layouts (the hooks a DoP change attaches and detaches, per step), to
hand a DoP-1 step's noise to the other rank (what keeps the replicas equal), and to share a
command (what rank 0 does for every command, and for the drops at every run).

Saved as ``parallel.json`` and ``parallel.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from onepiece.argtypes import VideoShapes, count, numbers, out_dir, torch_device
from onepiece.bench.common import cpu_name, model_dirs

MAX_DOP = 8

TEXT_LEN = 64  # the workflow's default max_sequence_length


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", type=VideoShapes(), default="64x64x9,128x128x17,192x192x17",
                   help="WxHxFRAMES per request, comma-separated (default %(default)s: bench sched's S, M, L)")
    # one rank a process (a GPU each with cuda): a collaboration group is 2, 4 or 8 at most
    p.add_argument("--dops", type=numbers(count(1, MAX_DOP)), help="degrees of parallelism (default: 1, 2, and 4 where the machine has "
                                              "4 cores or GPUs)")
    p.add_argument("--steps", type=count(), default=6, help="timed steps per point, after 2 untimed (default 6)")
    p.add_argument("--device", default="cpu", type=torch_device, help="cpu or cuda (one GPU per rank)")
    p.add_argument("--model", type=Path, default=None, help="a Wan2.1 T2V pipeline folder (default: the scale "
                                                            "models, built where missing)")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for parallel.json and parallel.md")


def _dops(args: argparse.Namespace) -> list[int]:
    if args.dops:  # each once, smallest first: the speedups are against the first (`2,1` inverted them)
        return sorted(set(args.dops))
    if args.device.startswith("cuda"):
        import torch

        units = torch.cuda.device_count()
    else:
        units = os.cpu_count() or 1
    return [d for d in (1, 2, 4) if d <= max(units, 1)]


def _world(config: dict[str, Any], size: int) -> dict[str, Any]:
    from onepiece.stage.collective import local_world

    try:
        return local_world("onepiece.bench.parallel", config, size)
    except RuntimeError as e:
        raise SystemExit(f"bench parallel: {e}") from None


def run(args: argparse.Namespace) -> int:
    shapes = args.shapes
    dops = _dops(args)
    model_dir = args.model or model_dirs(None, "scale")["t2v"]
    base = {"model_dir": str(model_dir), "device": args.device, "shapes": shapes, "steps": args.steps}
    t0 = time.monotonic()
    steps: dict[int, Any] = {d: _world({**base, "mode": "steps"}, d) for d in dops}
    overhead = _world({**base, "mode": "overhead"}, 2) if 2 in dops else None
    rows = []
    for w, h, f in shapes:
        for cfg in (True, False):
            key = f"{w}x{h}x{f}/{'cfg' if cfg else 'nocfg'}"
            one = steps[dops[0]]["steps"][key]
            rows.append({"shape": f"{w}x{h}x{f}", "cfg": cfg, "tokens": one["tokens"],
                         "step_ms": {d: steps[d]["steps"][key]["ms"] for d in dops},
                         "speedup": {d: one["ms"] / steps[d]["steps"][key]["ms"] for d in dops}})
    import torch

    report = {"when": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "cores": os.cpu_count(),
              "device": args.device, "torch": torch.__version__, "model": str(model_dir), "dops": dops,
              "threads_per_rank": 1, "steps": args.steps, "rows": rows, "overhead": overhead,
              "seconds": time.monotonic() - t0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parallel.json").write_text(json.dumps(report, indent=1))
    (out / "parallel.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def markdown(r: dict[str, Any]) -> str:
    dops = r["dops"]
    lines = [f"`onepiece bench parallel` — {r['when']}, {r['cpu']}, {r['cores']} cores, device {r['device']}, "
             f"{r['threads_per_rank']} torch thread per rank, {r['steps']} timed steps per point, transformer of `{Path(r['model']).name}`.",
             ""]
    # Rows built as lists of cells: with DoP 1 alone (no speedup column) a joined "" left an
    # empty header cell that the delimiter row lacked.
    head = ["shape", "CFG", "tokens", *(f"DoP {d} ms" for d in dops), *(f"speedup {d}" for d in dops[1:])]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in r["rows"]:
        cells = [row["shape"], "on" if row["cfg"] else "off", row["tokens"], *(f"{row['step_ms'][d]:.1f}" for d in dops),
                 *(f"{row['speedup'][d]:.2f}×" for d in dops[1:])]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    o = r["overhead"]
    if o:
        lines += ["", "In a world of 2:", "",
                  f"- building the group and its meshes (once, at start): {o['group_ms']:.1f} ms;",
                  f"- switching the model between DoP 1 and sequence-parallel DoP 2, each way (half of an "
                  f"attach and a detach): {o['switch_us']:.0f} µs;",
                  f"- handing a DoP-1 step's noise to the other rank ({o['noise_shape']}): {o['broadcast_us']:.0f} µs;",
                  f"- sharing a command (rank 0 to the others: every command, and the drops at every run): "
                  f"{o['share_us']:.0f} µs."]
    lines += ["", "CFG on: DoP 2 runs the conditional and unconditional halves on one rank each (no communication "
              "inside the forward pass); DoP 4 adds sequence parallelism inside each half. CFG off: sequence "
              "parallelism (Ulysses all-to-all). On CPU the ranks share the machine's cores and memory bandwidth."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- one rank


def _task(model: Any, scheduler: Any, w: int, h: int, f: int, cfg: bool, device: str) -> Any:
    import copy

    import torch

    from onepiece.stage.wan.functions import WanDenoise

    g = torch.Generator().manual_seed(0)
    c = model.config
    latents = torch.randn(1, c.in_channels, (f - 1) // 4 + 1, h // 8, w // 8, generator=g).to(device)
    text = torch.randn(1, TEXT_LEN, c.text_dim, generator=g).to(device, model.dtype)
    return WanDenoise(kind="t2v", transformer=model, scheduler=copy.deepcopy(scheduler), latents=latents,
                      prompt_embeds=text, negative_prompt_embeds=text.clone() if cfg else None,
                      guidance=5.0 if cfg else 1.0, steps=1000)


def _timed(fn: Any, reps: int) -> float:
    """Median seconds of ``fn()``."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def rank_main(cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from onepiece.stage.collective import Collective, leave
    from onepiece.stage.gpu import synchronizer, worker_device
    from onepiece.stage.loader import load_components
    from onepiece.stage.wan.parallel import ParallelDenoiser

    torch.set_num_threads(1)
    device = cfg["device"] = worker_device(cfg["device"], cfg["rank"], cfg["size"])  # one GPU per rank
    t0 = time.perf_counter()
    c = Collective(cfg["rank"], cfg["size"], cfg["address"], device, timeout_s=600)
    c.barrier()
    group_s = time.perf_counter() - t0
    comps = load_components(Path(cfg["model_dir"]), ["transformer", "scheduler"], device)
    model, scheduler = comps["transformer"], comps["scheduler"]
    p = ParallelDenoiser(c)
    sync = synchronizer(c.device)
    report: dict[str, Any] = {}
    if cfg["mode"] == "steps":
        report["steps"] = {}
        for w, h, f in cfg["shapes"]:
            for guided in (True, False):
                task = _task(model, scheduler, w, h, f, guided, cfg["device"])

                def one() -> None:
                    p.run([(c.world, [task], 1)])
                    sync()

                for _ in range(2):
                    one()
                c.barrier()
                pt, ph, pw = model.config.patch_size
                report["steps"][f"{w}x{h}x{f}/{'cfg' if guided else 'nocfg'}"] = {
                    "ms": 1000 * _timed(one, cfg["steps"]),
                    "tokens": task.latents.shape[2] // pt * (task.latents.shape[3] // ph) * (task.latents.shape[4] // pw)}
    else:  # overhead, in a world of 2
        w, h, f = cfg["shapes"][0]
        task = _task(model, scheduler, w, h, f, False, cfg["device"])
        p.run([(c.world, [task], 1)])  # warm the hooks once
        reps = 200

        def switch() -> None:
            p.sp.attach(model, c.world)
            p.sp.attach(model, None)

        noise = torch.zeros_like(task.latents)

        def broadcast() -> None:
            dist.broadcast(noise, 0)
            sync()

        report["overhead"] = {"group_ms": 1000 * group_s, "switch_us": 1e6 * _timed(switch, reps) / 2,
                              "broadcast_us": 1e6 * _timed(broadcast, reps), "noise_shape": list(noise.shape),
                              "share_us": 1e6 * _timed(lambda: c.share(b"[]" if c.rank == 0 else None), reps)}
    if c.rank == 0:
        out = report.get("overhead") or report
        (Path(cfg["out"]) / "report.json").write_text(json.dumps(out))
    c.close()
    leave()


if __name__ == "__main__":
    rank_main(orjson.loads(sys.argv[1]))
