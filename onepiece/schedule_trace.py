"""`onepiece schedule`: what a deployment's workers ran, from its stages' schedule logs
(stage/schedule_log.py, ``<logs>/<instance>.schedule.jsonl`` under `onepiece up`), as a
Chrome/Perfetto trace in the simulator's format (sim/report.py): a process per stage instance,
a thread per worker, a slice per chunk named by its batch's size and key. Open it in
ui.perfetto.dev beside a simulation of the same traffic (`onepiece sim`'s ``sim.perfetto.json``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from onepiece.argtypes import positive
from onepiece.config import ConfigError
from onepiece.sim.engine import Chunk
from onepiece.sim.report import perfetto
from onepiece.stage.schedule_log import read

SUFFIX = ".schedule.jsonl"


def logged(log_dir: Path, since: float = float("-inf")) -> list[dict[str, Any]]:
    """Every chunk the schedule logs under ``log_dir`` hold that started at ``since`` or later
    (seconds since the epoch), as the logs have them."""
    return [c for path in sorted(log_dir.glob("*" + SUFFIX)) for c in read(path, since=since)]


def chunks(found: list[dict[str, Any]], t0: float = 0.0, names: Mapping[str, str] | None = None) -> list[Chunk]:
    """Logged chunks (``logged``) in the simulator's terms, timed in seconds after ``t0``, in
    start order. ``names``: what to call each request (a trace's ``r0``, ``r1``, ...); given, only
    chunks of requests it names are kept, and only those requests in them (and in what each
    chunk's decision passed over). ``steps`` is the passes the worker ran."""
    out = []
    for c in found:
        parts = [(len(p[0]), tuple(u if names is None else names[u] for u in p[1] if names is None or u in names))
                 for p in c["parts"]]
        if not any(us for _, us in parts):
            continue
        passed = tuple((u if names is None else names[u], *rest) for u, *rest in _passed(c)
                       if names is None or u in names)
        out.append(Chunk(c["stage"], c["instance"], c["worker"], c["start"] - t0, c["end"] - t0,
                         tuple(u for _, us in parts for u in us), c["passes"], tuple(parts), passed))
    return sorted(out, key=lambda c: c.start)


def _passed(c: dict[str, Any]) -> list[list[Any]]:
    """A logged chunk's ``passed`` entries that have a uid (a log from before it had none: [])."""
    p = c.get("passed")
    return [e for e in p if isinstance(e, list) and e and isinstance(e[0], str)] if isinstance(p, list) else []


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", help="the deployment's log folder (`onepiece up` prints it: runs/<time>)")
    p.add_argument("--last", type=positive(" seconds"), default=300.0,
                   help="the chunks started in this many seconds before now (default %(default)g)")
    p.add_argument("--out", default="schedule.perfetto.json", help="the trace to write (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    logs = Path(args.logs)
    if not logs.is_dir():
        raise ConfigError(f"{logs}: not a folder (give the deployment's log folder, runs/<time>)")
    if not any(logs.glob("*" + SUFFIX)) and not any(logs.glob("*.log")):
        raise ConfigError(f"{logs}: neither role logs nor *{SUFFIX} here (a stage writes one beside its log under "
                          f"`onepiece up`, from its first chunk on)")
    since = time.time() - args.last
    found = logged(logs, since)
    keys = {u: str(p[3]) for c in found for p in c["parts"] if len(p) > 3 for u in p[1]}  # a slice's name
    drawn = chunks(found, t0=since)
    Path(args.out).write_bytes(orjson.dumps(perfetto(drawn, [{"uid": u, "class": k} for u, k in keys.items()])))
    print(f"{len(drawn)} chunks of the last {args.last:g} s from {logs} -> {args.out} (open it in ui.perfetto.dev)")
    return 0
