"""A TaskWorker (DESIGN §6): one process per device, pulling requests from its instance.

The worker loads its stage's components once, tells the scheduler it is ready, and then runs
one request at a time. It talks to the scheduler over a ZMQ DEALER socket:

- worker → scheduler: ``[b"ready"]``, ``[b"progress", {uid, fraction}]``,
  ``[b"done", *message frames]``, ``[b"failed", {uid, error}]`` (done/failed also mean idle);
- scheduler → worker: ``[b"task", *message frames]``.

Started as ``python -m onepiece.stage.worker '<json config>'``: nothing is pickled.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import zmq

from onepiece.transport.message import Message, MessageError, decode, encode

log = logging.getLogger("onepiece.stage.worker")

PROGRESS_EVERY_S = 0.2  # progress reports are throttled; the DB only needs a few per second
# Model compute yields the CPU to the latency-critical roles (proxy admission, schedulers, DB,
# NM) when cores are short; it still gets every cycle they leave idle. On CPU the compute is
# the whole load, so the worker goes further: SCHED_IDLE, which any of them preempts on
# waking (a nice value alone still lets a busy worker finish its time slice first).
NICE = 10


def run_task(fn: Any, ctx: Any, msg: Message, report: Any) -> dict:
    """Run one request through a stage function, driving stepped tasks step by step and
    reporting their progress at most every PROGRESS_EVERY_S."""
    from onepiece.stage.registry import SteppedTask

    out = fn(ctx, msg)
    if isinstance(out, SteppedTask):
        last = 0.0
        while not out.step():
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                report(out.progress)
                last = time.monotonic()
        out = out.result()
    return out


def main(config: dict[str, Any]) -> None:
    import torch

    from onepiece.stage.loader import load_components
    from onepiece.stage.registry import StageContext, lookup

    name = f"{config['instance']}/{config['identity']}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    try:  # a scheduling hint: where a sandbox forbids it, the worker runs as it is
        os.nice(NICE)
        if str(config["device"]).startswith("cpu"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError as e:
        log.warning("could not lower this worker's CPU priority: %s", e)
    if config.get("threads"):
        torch.set_num_threads(int(config["threads"]))
    stage, function, kinds = config["stage"], config["function"], config["kinds"]

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, config["identity"].encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(config["scheduler"])

    t0 = time.monotonic()
    components = load_components(Path(config["model_dir"]), config["components"], config["device"])
    ctx = StageContext(components, config["device"])
    log.info("loaded %s for stage %s in %.1fs (%d torch threads)", config["components"], stage,
             time.monotonic() - t0, torch.get_num_threads())
    sock.send_multipart([b"ready"])

    parent = os.getppid()
    while True:
        if not sock.poll(1000, zmq.POLLIN):
            if os.getppid() != parent:  # the instance is gone; nothing will ever come
                return
            continue
        frames = sock.recv_multipart(copy=False)
        if frames[0].bytes != b"task":
            continue
        try:
            msg = decode(frames[1:])
        except MessageError as e:
            log.warning("dropped malformed task: %s", e)
            sock.send_multipart([b"failed", orjson.dumps({"uid": None, "error": f"malformed task: {e}"})])
            continue
        uid = msg.uid

        def report(fraction: float, uid: str = uid) -> None:
            sock.send_multipart([b"progress", orjson.dumps({"uid": uid, "fraction": fraction})])

        msg.mark(stage, "start", name)
        try:
            kind = kinds.get(msg.header.get("app"))
            if kind is None:
                raise ValueError(f"application {msg.header.get('app')!r} is not served by stage {stage}")
            with torch.inference_mode():
                msg.parts = run_task(lookup(function, kind), ctx, msg, report)
            msg.mark(stage, "end", name)
            out = encode(msg)  # an unsendable result fails this request, not the worker
        except Exception as e:  # the request fails alone; the worker stays up
            log.exception("uid=%s failed in stage %s", uid, stage)
            sock.send_multipart([b"failed", orjson.dumps({"uid": uid, "error": f"{type(e).__name__}: {e}"})])
            continue
        sock.send_multipart([b"done", *out], copy=False)


if __name__ == "__main__":
    main(orjson.loads(sys.argv[1]))
