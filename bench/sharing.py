"""What sharing the host's cores does to a stage's steps, from a real run's schedule (`onepiece
bench sched` saves each trace's: ``sched-schedule-<policy>-<load>.json``).

On one host every stage's workers share its cores: where the denoise workers' ranks already
use every core, a text encoder's or VAE decoder's call beside them slows their steps. The
simulator gives each worker a device of its own (sim/engine.py: processes sharing CPU cores are
not modelled) and prices every step at its table's figure; this says by how much the measured
steps departed from that, and when: per (class, DoP, batch size), the median seconds per
forward pass of the chunks during which no other stage's worker ran, against those during most
of which one did.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

BUSY = 0.5  # a chunk is "beside other work" when another stage's worker ran for more than this share of it


def _overlap(spans: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans)


def step_times(events: Iterable[dict[str, Any]], classes: dict[str, str], stage: str) -> dict[tuple, dict[str, list]]:
    """Seconds per forward pass of ``stage``'s one-batch chunks in a schedule (Trace Event
    Format events), by (class, DoP, batch size): ``alone`` where no other stage's chunk overlapped
    it, ``beside`` where others covered more than ``BUSY`` of it. ``classes``: request -> class."""
    chunks = [e for e in events if e.get("ph") == "X" and isinstance(e.get("args"), dict)]
    others = sorted((e["ts"], e["ts"] + e["dur"]) for e in chunks if e["args"].get("stage") != stage)
    out: dict[tuple, dict[str, list]] = {}
    for e in chunks:
        args = e["args"]
        parts = args.get("parts") or []
        if args.get("stage") != stage or len(parts) != 1 or not args.get("steps") or e["dur"] <= 0:
            continue
        dop, uids = parts[0]
        kinds = {classes.get(u) for u in uids}
        if len(kinds) != 1 or None in kinds:
            continue
        a, b = e["ts"], e["ts"] + e["dur"]
        covered = _overlap([s for s in others if s[0] < b and s[1] > a], a, b) / (b - a)
        where = "alone" if covered == 0 else "beside" if covered > BUSY else None
        if where:
            row = out.setdefault((kinds.pop(), dop, len(uids)), {"alone": [], "beside": []})
            row[where].append(e["dur"] / 1e6 / args["steps"])
    return out


def merge(tables: Iterable[dict[tuple, dict[str, list]]]) -> dict[tuple, dict[str, list]]:
    out: dict[tuple, dict[str, list]] = {}
    for t in tables:
        for k, v in t.items():
            row = out.setdefault(k, {"alone": [], "beside": []})
            for where, xs in v.items():
                row[where] += xs
    return out


def summary(table: dict[tuple, dict[str, list]]) -> list[dict[str, Any]]:
    """One row per (class, DoP, batch size): each side's median seconds per pass and its count,
    and their ratio where both sides have a chunk."""
    rows = []
    for (cls, dop, batch), v in sorted(table.items()):
        alone = statistics.median(v["alone"]) if v["alone"] else None
        beside = statistics.median(v["beside"]) if v["beside"] else None
        rows.append({"class": cls, "dop": dop, "batch": batch, "alone_s": alone, "alone_n": len(v["alone"]),
                     "beside_s": beside, "beside_n": len(v["beside"]),
                     "ratio": beside / alone if alone and beside else None})
    return rows
