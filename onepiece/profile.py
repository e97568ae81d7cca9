"""`onepiece profile`: the cost table of a workflow's stages on this machine (DESIGN §6.1).

For every stage asked for, it loads the stage's components as a worker would and times the
real stage functions over a grid of shapes: a stepped stage (denoising) per (shape, batch
size and DoP), one forward pass of a batch of prepared states at a time; a one-step stage per
shape, one call at a time. A DoP above 1 (``--dops``) runs that many ranks as a collaboration
group of local processes (gloo on CPU, NCCL on CUDA) through the stage function's parallel run,
and its rows are keyed ``…@d``. Inputs come from running the application's earlier stages on the same
shapes, in this process. Each cell is the median of ``--repeat`` timed runs after a warm-up.

The table (``sched.costs.make_table``; seconds per step or per call, by compatibility key and
batch size) is what ``stages.<name>.schedule.costs`` in a workflow YAML starts a stage's cost
model from, and what a simulator prices a machine with.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from onepiece.argtypes import VideoShapes, count, numbers, out_file, torch_device
from onepiece.config import Workflow, load_workflow


def timed(fn: Callable[[], Any], sync: Callable[[], None], warmup: int, repeat: int) -> float:
    """Median seconds of ``repeat`` runs of ``fn`` after ``warmup``, each run from an idle device
    until the device has run it (``sync``: stage/gpu.py's ``synchronizer``)."""
    times = []
    for _ in range(warmup + repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workflow", help="workflow YAML (default: the shipped one of --profile)")
    p.add_argument("--profile", choices=["tiny", "scale"], default="tiny", help="without --workflow: which shipped one")
    p.add_argument("--stage", action="append", help="a stage to profile (repeatable; default: every stage)")
    p.add_argument("--shapes", type=VideoShapes(), default=[(64, 64, 9)],
                   help="comma-separated WxHxFRAMES (default 64x64x9)")
    p.add_argument("--batch", type=numbers(count(1, 64)), default=[1, 2, 4, 8],
                   help="batch sizes of stepped stages, each at most 64 as a schedule's max_batch (default 1,2,4,8)")
    p.add_argument("--dops", type=numbers(count()), default=[1], help="degrees of parallelism of stepped stages, each a "
                                                           "collaboration group of local processes (default 1)")
    p.add_argument("--repeat", type=count(), default=5, help="timed runs per cell (median taken)")
    p.add_argument("--device", type=torch_device, help="torch device (default: each stage's own)")
    p.add_argument("--threads", type=count(), help="torch threads (default: each stage's own, or all cores)")
    p.add_argument("-o", "--out", type=out_file, default="costs.json", help="where to write the table (JSON)")


def run(args: argparse.Namespace) -> int:
    import orjson

    from onepiece.cli import PROFILE_WORKFLOWS
    from onepiece.config import deploy_dir
    from onepiece.sched.costs import make_table
    from onepiece.stage.gpu import lacking
    from onepiece.stage.registry import is_stepped
    from onepiece.stage.wan.tiny import ensure_models

    # A value given twice timed its cells twice and wrote a second row for them: a table that
    # no stage or simulator loads ("a second row for key"), found only after the work.
    twice = [f"{flag} gives {'x'.join(map(str, v)) if isinstance(v, tuple) else v} twice"
             for flag, values in (("--stage", args.stage or []), ("--shapes", args.shapes), ("--batch", args.batch),
                                  ("--dops", args.dops))
             for v in {v for v in values if values.count(v) > 1}]
    if twice:
        print(f"onepiece profile: {'; '.join(sorted(twice))}", file=sys.stderr)
        return 2
    wf_path = Path(args.workflow) if args.workflow else deploy_dir() / PROFILE_WORKFLOWS[args.profile]
    wf = load_workflow(wf_path)
    stages = args.stage or list(wf.stages)
    unknown = [s for s in stages if s not in wf.stages]
    if unknown:
        print(f"onepiece profile: unknown stage(s) {unknown} (known: {sorted(wf.stages)})", file=sys.stderr)
        return 2
    ranks = {s: max(args.dops) if is_stepped(wf.function_of(s), wf.applications[_app_of(wf, s)].kind) else 1
             for s in stages}  # a DoP above 1 takes a device per rank, for stepped stages only
    missing = [f"{s} runs on {d}, but {why}" for s in stages
               if (why := lacking(d := args.device or wf.stages[s].device, ranks[s]))]
    if missing:
        print(f"onepiece profile: {'; '.join(missing)}", file=sys.stderr)
        return 2
    ensure_models(wf, wf_path.parent)
    prof = Profiler(wf, wf_path.parent, args.device, args.threads)
    rows: dict[str, list[dict[str, Any]]] = {}
    for stage in stages:
        rows[stage] = prof.stage(stage, args.shapes, args.batch, args.repeat)
        if rows[stage] and rows[stage][0]["stepped"]:
            rows[stage] += [_group_row(wf_path, args, stage, shape, b, d)
                            for d in args.dops if d > 1 for shape in args.shapes for b in args.batch]
        for r in rows[stage]:
            print(f"{stage:14s} {r['key']:28s} batch {r['batch']:2d}  {r['seconds'] * 1000:9.2f} ms"
                  f"{'  per step' if r['stepped'] else '  per call'}", flush=True)
    from onepiece.bench.common import cpu_name

    doc = make_table(rows, device=args.device or "per stage", cpu=cpu_name(), workflow=str(wf_path),
                     created=time.strftime("%Y-%m-%d %H:%M:%S"), units="seconds per step of a batch (stepped "
                     "stages) or per call (one-step stages), median of the timed runs", repeat=args.repeat)
    Path(args.out).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    print(f"wrote {args.out}")
    return 0


def _group_row(wf_path: Path, args: argparse.Namespace, stage: str, shape: tuple[int, int, int], batch: int,
               dop: int) -> dict[str, Any]:
    from onepiece.stage.collective import local_world

    config = {"workflow": str(wf_path), "stage": stage, "shape": list(shape), "batch": batch, "repeat": args.repeat,
              # the stage's own threads, as its group's workers run at (none: 1 per rank)
              "device": args.device, "threads": args.threads or load_workflow(wf_path).stages[stage].threads or 1}
    return local_world("onepiece.profile", config, dop)


def rank_main(cfg: dict[str, Any]) -> None:
    """One rank of a profiled collaboration group: prepares the same states as every rank (the
    same seeds), then times whole steps of the batch on all ranks; rank 0 reports the row."""
    import json

    import torch

    from onepiece.sched.keys import at_dop, compat_key
    from onepiece.stage.collective import Collective, leave
    from onepiece.stage.gpu import worker_device
    from onepiece.stage.registry import parallel_of

    wf_path = Path(cfg["workflow"])
    wf = load_workflow(wf_path)
    stage, shape, batch, repeat, warm = cfg["stage"], tuple(cfg["shape"]), cfg["batch"], cfg["repeat"], 2
    # one device per rank, as a collaboration group's workers have (cuda:0, cuda:1, ... on CUDA)
    device = worker_device(cfg["device"] or wf.stages[stage].device, cfg["rank"], cfg["size"])
    prof = Profiler(wf, wf_path.parent, device, cfg["threads"])
    c = Collective(cfg["rank"], cfg["size"], cfg["address"], device)
    ctx = prof.context(stage)
    msgs = [prof.message(stage, shape, seed, warm + repeat) for seed in range(batch)]
    with torch.inference_mode():
        tasks = [fn(ctx, m) for m, fn in msgs]
    group = parallel_of(wf.function_of(stage), wf.applications[prof._app(stage)].kind)(c)
    times = []
    for _ in range(warm + repeat):
        c.barrier()
        t0 = time.perf_counter()
        group.run([(c.world, tasks, 1)])
        times.append(time.perf_counter() - t0)
    if c.rank == 0:
        row = {"key": at_dop(compat_key(msgs[0][0].header["params"]), c.size), "batch": batch, "stepped": True,
               "seconds": statistics.median(times[warm:]), "samples": repeat, "dop": c.size}
        (Path(cfg["out"]) / "report.json").write_text(json.dumps(row))
    c.close()
    leave()


def _app_of(wf: Workflow, stage: str) -> str:
    """The first application that runs ``stage``."""
    return next(a for a, spec in wf.applications.items() if stage in spec.stages)


class Profiler:
    """The real stage functions of a workflow in this process, components loaded once."""

    def __init__(self, wf: Workflow, base: Path, device: str | None, threads: int | None) -> None:
        import torch

        self.wf, self.base, self.device, self.threads = wf, base, device, threads
        self._loaded: dict[str, Any] = {}
        self._all_cores = torch.get_num_threads()  # a stage without threads of its own runs at this

    def context(self, stage: str):
        import torch

        from onepiece.stage.loader import load_components
        from onepiece.stage.registry import StageContext

        spec = self.wf.stages[stage]
        # Set every time, not only where given: an earlier stage's setting (run to build this
        # one's inputs) otherwise stayed in force and this stage was timed at its threads.
        torch.set_num_threads(self.threads or spec.threads or self._all_cores)
        if stage not in self._loaded:
            device = self.device or spec.device
            comps = load_components(self.wf.model_path(spec.model, self.base), spec.components, device)
            self._loaded[stage] = StageContext(comps, device)
        return self._loaded[stage]

    def _app(self, stage: str) -> str:
        return _app_of(self.wf, stage)

    def message(self, stage: str, shape: tuple[int, int, int], seed: int, steps: int):
        """The message ``stage`` receives for ``shape``, from the application's earlier stages."""
        from onepiece.stage.registry import lookup
        from onepiece.stage.worker import run_task
        from onepiece.transport.message import Message, decode, encode, new_uid

        app = self._app(stage)
        spec = self.wf.applications[app]
        d = spec.defaults
        w, h, f = shape
        params = {"prompt": f"a profiled request {seed}", "negative_prompt": d.negative_prompt, "width": w,
                  "height": h, "num_frames": f, "steps": steps, "guidance": d.guidance, "seed": seed, "fps": d.fps,
                  "max_sequence_length": d.max_sequence_length}
        image = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
        msg = Message({"uid": new_uid(), "app": app, "params": params}, {"image": image} if spec.kind == "i2v" else {})
        for before in spec.stages[:spec.stages.index(stage)]:
            fn = lookup(self.wf.function_of(before), spec.kind)
            msg = decode([bytes(x) for x in encode(Message(msg.header, run_task(fn, self.context(before), msg)))])
        self.context(stage)  # back to this stage's threads, which its timing runs at
        return msg, lookup(self.wf.function_of(stage), spec.kind)

    def stage(self, stage: str, shapes: list[tuple[int, int, int]], batches: list[int], repeat: int) -> list[dict]:
        import torch

        from onepiece.sched.keys import call_key, compat_key
        from onepiece.stage.gpu import synchronizer
        from onepiece.stage.registry import is_stepped

        kind = self.wf.applications[self._app(stage)].kind
        stepped = is_stepped(self.wf.function_of(stage), kind)
        ctx = self.context(stage)
        sync = synchronizer(ctx.device)
        rows = []
        for shape in shapes:
            warm = 2
            if not stepped:
                msg, fn = self.message(stage, shape, 0, 1)
                with torch.inference_mode():
                    seconds = timed(lambda: fn(ctx, msg), sync, warm, repeat)
                rows.append({"key": call_key(msg.header["params"]), "batch": 1, "stepped": False,
                             "seconds": seconds, "samples": repeat})
                continue
            for b in batches:
                msgs = [self.message(stage, shape, seed, warm + repeat) for seed in range(b)]
                with torch.inference_mode():
                    tasks = [fn(ctx, m) for m, fn in msgs]
                seconds = timed(lambda: type(tasks[0]).step_batch(tasks), sync, warm, repeat)
                rows.append({"key": compat_key(msgs[0][0].header["params"]), "batch": b, "stepped": True,
                             "seconds": seconds, "samples": repeat})
        return rows


if __name__ == "__main__":
    import orjson

    rank_main(orjson.loads(sys.argv[1]))
