"""Cost tables as the simulator reads them: per stage, seconds per step (a stepped stage) or
per call, by key and batch size, in the format `onepiece profile` writes (``sched.costs``),
whether measured on this machine, saved by a benchmark run, or built from published figures
for hardware the user does not have.

A stage steps when its keys are compatibility keys (``WxHxF/cfg/L64``: `onepiece profile`
times stepped stages by them) and is called once per request when they are call keys
(``WxHxF``). The simulator prices only what the table has: a request whose key a stage's table
lacks is refused up front, not extrapolated (the runtime's cost model fills gaps because it
must start somewhere; a plan must not rest on a guess).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from onepiece.sched.costs import (FIGURES, CostModel, TableError, at_batch, read_table, table_figure, table_fixed,
                                  table_rows, wrong_kind)
from onepiece.sched.keys import at_dop, variant
from onepiece.sched.ranks import dops


class CostTable:
    def __init__(self, doc: dict[str, Any], source: str = "cost table") -> None:
        self.source = source
        try:
            table_rows(doc)  # the whole document first: it says what is wrong
            self.rows = {s: table_rows(doc, s) for s in doc["stages"]}
            self.fixed = {s: table_fixed(doc, s) for s in doc["stages"]}
            # per figure (``FIGURES``), the stages the table gives it for
            self.figures = {f: {s: t for s in doc["stages"] if (t := table_figure(doc, s, f)) is not None}
                            for f in FIGURES}
        except TableError as e:
            raise TableError(f"{source}: {e}") from None
        self.meta = {k: v for k, v in doc.items() if k != "stages"}
        self._stepped = {}
        for s, rows in self.rows.items():
            kinds = {bool(variant(k)) for k in rows}
            if len(kinds) > 1:
                raise TableError(f"{source}: stages.{s}: mixes step keys (WxHxF/cfg/L64) and call keys (WxHxF)")
            self._stepped[s] = kinds == {True}

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        return cls(read_table(path), str(path))

    def stepped(self, stage: str) -> bool:
        return self._stepped.get(stage, False)

    def wrong_kind(self, stage: str, steps: bool) -> str | None:
        """Why ``stage``'s rows cannot price it (``sched.costs.wrong_kind``; None: they can, or it has none)."""
        why = wrong_kind(self.rows.get(stage) or {}, stage, steps)
        return None if why is None else f"{self.source}: {why}"

    def missing(self, stage: str, key: str) -> str | None:
        """Why ``stage`` cannot price ``key`` (None: it can)."""
        rows = self.rows.get(stage)
        if not rows:
            return f"{self.source}: no rows for stage {stage!r} (stages: {', '.join(sorted(self.rows)) or 'none'})"
        if key not in rows:
            return (f"{self.source}: stage {stage!r} has no row for key {key!r} "
                    f"(keys: {', '.join(sorted(rows))})")
        return None

    def step_s(self, stage: str, key: str, batch: int) -> float:
        """Seconds of one step (or call) of a batch of ``batch``: the row's figure, interpolated
        between batch sizes, and no gain assumed past the largest (``sched.costs``' rule)."""
        return at_batch(self.rows[stage][key], batch)

    def alone_s(self, stage: str, key: str, steps: int, ranks: int = 1) -> float:
        """Seconds a request of ``key`` takes at ``stage`` alone: its steps and its ``fixed``
        preparing and finishing, which a worker spends on it as surely (a running stage's
        standalone time, what the proxy's deadline split reads, includes it too). ``ranks``: a
        worker's (a collaboration group's), whose steps run at its fastest DoP alone, as the
        core's standalone time has it (DoP 1: the device-seconds of the work), among the DoPs
        the table prices (a run under a DoP-blind policy measured only the group's)."""
        rows = self.rows[stage]
        step = min(self.step_s(stage, k, 1) for d in dops(ranks) if (k := at_dop(key, d)) in rows)
        return step * steps + self.fixed.get(stage, {}).get(key, 0.0)

    def pricer(self, stage: str) -> Callable[[str, int], float]:
        """(key, batch) -> seconds, for a virtual instance of ``stage``."""
        return lambda key, batch: self.step_s(stage, key, batch)

    def fixed_s(self, stage: str) -> Callable[[str], float]:
        """key -> seconds a request of it costs at ``stage`` besides its steps (preparing and
        finishing its state; 0 where the table says nothing)."""
        fixed = self.fixed.get(stage, {})
        return lambda key: fixed.get(key, 0.0)

    def overhead_s(self, stage: str, default: float) -> float:
        """Decision and IPC per chunk at ``stage``: as the table says (a run measured it over
        its trace), else ``default``."""
        return self.figures["overhead_s"].get(stage, default)

    def step_cv(self, stage: str, default: float) -> float:
        """How much ``stage``'s steps and calls vary around their figures (their coefficient of
        variation): as the table says (a run measured it over its trace), else ``default``."""
        return self.figures["step_cv"].get(stage, default)

    def model(self, stage: str) -> CostModel:
        """The cost model a stage's core starts from: this table's rows and per-request figures,
        as a stage given ``schedule.costs`` starts (the simulated workers report the same
        figures back)."""
        return CostModel(self.rows.get(stage, {}), fixed=self.fixed.get(stage, {}))
