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

import copy
import statistics
from typing import Any, Iterable

from onepiece.sched.keys import split_dop

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
        one = _one_batch(e, classes) if e["args"].get("stage") == stage else None
        if one is None:
            continue
        a, b = e["ts"], e["ts"] + e["dur"]
        covered = _overlap([s for s in others if s[0] < b and s[1] > a], a, b) / (b - a)
        where = "alone" if covered == 0 else "beside" if covered > BUSY else None
        if where:
            row = out.setdefault(one[:3], {"alone": [], "beside": []})
            row[where].append(one[3])
    return out


def _one_batch(e: dict[str, Any], classes: dict[str, str]) -> tuple[str, int, int, float] | None:
    """(class, DoP, batch size, seconds per forward pass) of a chunk that ran one batch of one
    class; None for any other."""
    args = e["args"]
    parts = args.get("parts") or []
    if len(parts) != 1 or not args.get("steps") or e["dur"] <= 0:
        return None
    dop, uids = parts[0]
    kinds = {classes.get(u) for u in uids}
    if len(kinds) != 1 or None in kinds:
        return None
    return kinds.pop(), int(dop), len(uids), e["dur"] / 1e6 / args["steps"]


def chunk_ranks(e: dict[str, Any]) -> int:
    """Ranks a schedule event's chunk computed on: the DoPs of its parts, summed."""
    return sum(int(dop) for dop, _ in e["args"].get("parts") or [[1, None]])


def alone_passes(events: Iterable[dict[str, Any]], classes: dict[str, str], cores: int
                 ) -> dict[tuple[str, str, int, int], list[float]]:
    """Seconds per forward pass (a call, at a one-step stage) of the one-batch chunks of every
    stage that ran while the host had a core for each rank computing: its own ranks and those of
    every chunk that overlapped it at all, at most ``cores``. By (stage, class, DoP, batch size):
    what each step costs alone, which the simulator's shared host (``onepiece sim --host-cores``)
    then slows as the run's steps were slowed."""
    chunks = [e for e in events if e.get("ph") == "X" and isinstance(e.get("args"), dict) and e["dur"] > 0]
    out: dict[tuple[str, str, int, int], list[float]] = {}
    for e in chunks:
        one = _one_batch(e, classes)
        if one is None:
            continue
        a, b = e["ts"], e["ts"] + e["dur"]
        ranks = sum(chunk_ranks(o) for o in chunks if o["ts"] < b and o["ts"] + o["dur"] > a)  # itself included
        if ranks <= cores:
            out.setdefault((e["args"].get("stage"), *one[:3]), []).append(one[3])
    return out


LEAST = 3  # alone chunks a row's figure is taken from; a row with fewer is scaled as its stage's others were


def alone_table(doc: dict[str, Any], passes: dict[tuple[str, str, int, int], list[float]],
                shapes: dict[str, str]) -> tuple[dict[str, Any], dict[str, int]]:
    """A run's cost table (``sched-costs-*.json``) with each step's (or call's) figure the mean
    of its chunks that ran alone (``alone_passes``): the run's figures are what its stages
    measured, the slowed steps among them. ``shapes``: class -> ``WxHxF``. A row with fewer than
    ``LEAST`` alone chunks is scaled by its stage's median ratio of alone to measured. Also
    returns how many rows of each stage were taken from alone chunks."""
    cls_of = {v: c for c, v in shapes.items()}
    out = copy.deepcopy(doc)
    taken: dict[str, int] = {}
    for stage, entry in out.get("stages", {}).items():
        rows, ratios = entry.get("rows") or [], []
        scale_later = []
        for row in rows:
            key, dop = split_dop(row["key"])
            xs = passes.get((stage, cls_of.get(key.split("/")[0]), dop, row["batch"]), [])  # (its WxHxF)
            if len(xs) >= LEAST and row["seconds"] > 0:
                alone = statistics.fmean(xs)
                ratios.append(alone / row["seconds"])
                row["seconds"] = alone
            else:
                scale_later.append(row)
        if ratios:
            f = statistics.median(ratios)
            for row in scale_later:
                row["seconds"] *= f
        taken[stage] = len(ratios)
    return out, taken


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
