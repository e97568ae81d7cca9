"""How fast the machine ran during each policy's part of a `bench sched` trace.

The policies run one after another, minutes apart, on a machine whose speed drifts by tens of
percent over minutes: on 2026-11-27 a denoising step of S cost 22.0 ms during `slo`'s part of a
run and 14.8 ms during srtf's, and `slo` met 38% of the SLOs where, priced alike, the simulator
put it at 89% (README). So each policy's figures come with what its part's steps cost against
the first policy's, from the cost tables every part measured (``sched-costs-<policy>-<load>.json``).
"""

from __future__ import annotations

import math
from typing import Any


def _alone_rows(table: dict[str, Any]) -> dict[tuple[str, str], float]:
    """(stage, key) -> seconds of a step or call at batch 1: what every policy runs, whatever it
    batches (a batch's cost depends on the policy's choice of sizes, not only on the machine)."""
    out = {}
    for stage, entry in (table.get("stages") or {}).items():
        for row in entry.get("rows") or []:
            if row.get("batch") == 1 and isinstance(row.get("seconds"), (int, float)) and row["seconds"] > 0:
                out[(stage, row["key"])] = float(row["seconds"])
    return out


def pace(tables: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Per policy (in the order given), the geometric mean over the batch-1 rows that every
    table has of its seconds over the first table's: 1.3 means its steps and calls cost 30% more
    than during the first policy's part. None where no row is common to all."""
    rows = {p: _alone_rows(t) for p, t in tables.items()}
    if not rows:
        return {}
    common = set.intersection(*(set(r) for r in rows.values()))
    first = next(iter(rows.values()))
    if not common:
        return {p: None for p in rows}
    return {p: math.exp(sum(math.log(r[k] / first[k]) for k in common) / len(common)) for p, r in rows.items()}
