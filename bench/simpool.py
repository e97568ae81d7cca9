"""`onepiece bench simpool`: the simulator against the mean of repeated runs (DESIGN §12).

One `bench sched` run of 60 requests is one draw: a rerun of the same trace on the same machine
lands ±7 to ±12 points of SLO attainment away by chance alone, and on a saturated group at 1.3×
`slo` met 47% in one run and 92% in another. ``bench simval`` puts each run beside its own
prediction, so a cell's error mixes the simulator's bias with that draw. This pools the cells
that ``bench simval`` wrote for several runs of one trace (each run's ``simval.json`` beside its
``sched.json``), per policy, trace and setup (denoise workers, a collaboration group or not, max
batch): the mean of the measured figures against the mean of the predicted ones, and the paired
differences' spread, so that a bias of the simulator shows apart from the noise of a run. Saved
as ``simpool.json`` and ``simpool.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from onepiece.argtypes import out_dir
from onepiece.bench.common import save_report
from onepiece.bench.simval import TARGETS, sched_results

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 15: 2.13,
       20: 2.09, 30: 2.04}  # Student's t at 97.5%, by degrees of freedom (between two: the lower one's)


def _t95(df: int) -> float:
    return T95[max(k for k in T95 if k <= df)]


def validated_run(value: str) -> Path:
    """An argparse type: a folder holding a `bench sched` run's sched.json (checked as `bench
    simval` checks it) and the simval.json that ``bench simval`` wrote for it."""
    path = Path(sched_results(value)) / "simval.json"
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{path} is not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), dict):
        raise argparse.ArgumentTypeError(f"{path} is not what `bench simval` writes")
    return path.parent


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", type=validated_run, metavar="RUN",
                   help="folders of bench sched runs, each with the simval.json that bench simval wrote for it")
    p.add_argument("--out", type=out_dir, default="bench/results", help="folder for simpool.json and simpool.md")


def setup(settings: dict[str, Any]) -> str:
    """What a run's denoise stage ran on, in words: runs pool only with runs of the same."""
    n = int(settings.get("denoise_workers") or 1)
    return (f"{n} denoise worker{'s' if n > 1 else ''}" + (", one group" if settings.get("collaboration") else "")
            + f", max batch {settings.get('max_batch')}")


def pool(runs: list[Path]) -> dict[str, Any]:
    """Per (policy, trace, setup) and class: the runs' measured and predicted SLO attainment and
    mean latency, their means, and the mean paired difference with its 95% interval."""
    cells: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for d in runs:
        settings = json.loads((d / "sched.json").read_text())["settings"]
        for policy, by_load in json.loads((d / "simval.json").read_text())["rows"].items():
            for load, cell in by_load.items():
                cells.setdefault((policy, load, setup(settings)), []).append(cell)
    rows = []
    for (policy, load, where), got in cells.items():
        classes = sorted({c for cell in got for c in cell["measured"]} - {"all"})
        for c in ["all", *classes]:
            # (a class none of whose requests completed has no mean latency on that side: left out)
            pairs = [(m, p) for cell in got
                     if (m := cell["measured"].get(c)) and (p := cell["predicted"].get(c))
                     and all(isinstance(x.get(f), (int, float)) for x in (m, p) for f in ("attainment", "mean_s"))
                     and m["mean_s"] > 0]
            if not pairs:
                continue
            row: dict[str, Any] = {"policy": policy, "load": load, "setup": where, "class": c, "runs": len(pairs)}
            for figure, scale in (("attainment", 100.0), ("mean_s", 1.0)):
                # attainment in points; latency in seconds, its difference a share of the measured:
                # what the targets say
                m = [p[0][figure] * scale for p in pairs]
                s = [p[1][figure] * scale for p in pairs]
                diffs = [b - a if figure == "attainment" else (b - a) / a for a, b in zip(m, s)]
                sd = statistics.stdev(diffs) if len(diffs) > 1 else None
                row[figure] = {"measured": statistics.fmean(m), "predicted": statistics.fmean(s),
                               "measured_sd": statistics.stdev(m) if len(m) > 1 else None,
                               "diff": statistics.fmean(diffs),
                               "diff_ci": None if sd is None else _t95(len(diffs) - 1) * sd / math.sqrt(len(diffs))}
            rows.append(row)
    return {"bench": "simpool", "when": time.strftime("%Y-%m-%d %H:%M"), "runs": [str(d) for d in runs],
            "rows": rows, "targets": TARGETS}


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"`onepiece bench simpool` — {doc['when']}: the simulator's predictions (each run's `bench simval`, "
             f"on its shared host where it saved its schedule) against the measured figures, pooled over "
             f"{len(doc['runs'])} runs by policy, trace and setup. Δ is the mean of each run's predicted minus "
             "measured (attainment in points, mean latency as a share of the measured), ± its 95% interval "
             "over the runs; SD the measured figure's spread from run to run.", "",
             "| policy | trace | setup | class | runs | attainment % measured (SD) | predicted | Δ points "
             "| mean s measured (SD) | predicted | Δ |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def ci(x: dict[str, Any], fmt: str) -> str:
        return format(x["diff"], fmt) + ("" if x["diff_ci"] is None else " ± " + format(x["diff_ci"], fmt.lstrip("+")))

    def sd(x: float | None, fmt: str) -> str:
        return "" if x is None else f" ({format(x, fmt)})"

    for r in doc["rows"]:
        a, m = r["attainment"], r["mean_s"]
        lines.append(f"| {r['policy']} | {r['load']} | {r['setup']} | {r['class']} | {r['runs']} "
                     f"| {a['measured']:.0f}{sd(a['measured_sd'], '.0f')} | {a['predicted']:.0f} | {ci(a, '+.1f')} "
                     f"| {m['measured']:.2f}{sd(m['measured_sd'], '.2f')} | {m['predicted']:.2f} | {ci(m, '+.0%')} |")
    t = doc["targets"]
    pools = [r for r in doc["rows"] if r["class"] == "all" and r["runs"] > 1]
    within = [r for r in pools
              if abs(r["attainment"]["diff"]) <= t["attainment_points"] and abs(r["mean_s"]["diff"]) <= t["mean_rel"]]
    if pools:
        lines += ["", f"All classes together, over the pools of more than one run, the mean prediction is within "
                      f"{t['attainment_points']:g} points of the mean measured attainment and {t['mean_rel']:.0%} of "
                      f"the mean measured latency in {len(within)} of {len(pools)}: "
                      + "; ".join(f"{r['policy']} at {r['load']} ({r['setup']}, {r['runs']} runs)"
                                  f" {'within' if r in within else 'not'}" for r in pools) + "."]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    doc = pool(args.runs)
    save_report(Path(args.out), "simpool", doc, markdown(doc))
    return 0
