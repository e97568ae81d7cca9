"""The cost model of one stage: seconds per step (a stepped function) or per call (a one-step
function), per compatibility key and batch size, and per key what a request costs besides its
steps (preparing its state and finishing it).

Measured by the stage itself: every step a worker runs is one sample of (key, batch size,
seconds), kept in a moving window whose median is the cost. It may start from a table (``onepiece profile`` writes
one; ``load_table`` reads it), which measurements then replace key by key. Lookups fill
gaps in three ways, each conservative for latency:

- a batch size between two known ones: linear interpolation;
- above the largest known: the last known per-sample time (no further batching gain assumed);
  below the smallest known: the smallest known time (a smaller batch is never slower);
- an unknown key: the nearest known key of the same variant (CFG, text length, DoP), scaled
  by the ratio of their shapes' volumes (of two equally near, the dearer estimate);
- a key at a DoP nothing was measured at (``…@d``, sched.keys.at_dop): the same key at the
  nearest DoP that is known, scaled as if parallelism were perfect (``t·d'/d``): a larger DoP
  looks better than it will be, so a policy tries it once; a smaller one looks worse.

No clock, no I/O; bounded (windows and keys). The report (``report``) is what the stage sends
with its heartbeat and what a simulator or a later run can load again.
"""

from __future__ import annotations

import collections
import itertools
import statistics
from pathlib import Path
from typing import Any, Iterable

import orjson

from onepiece.sched.keys import split_dop, variant, volume

WINDOW = 16  # samples per (key, batch size)
SETTLED = 3  # samples before a batch size's figure is judged (``CostModel.unsettled``)
MAX_KEYS = 128  # keys kept, least recently observed dropped first
TABLE_VERSION = 1
# A table's figures, in seconds: a step or call under a microsecond is no measurement (one of
# 5e-324 divided the chunk rule by zero and wedged a stage), and one over a day is none either.
MIN_SECONDS, MAX_SECONDS = 1e-6, 86_400.0


class CostModel:
    def __init__(self, table: dict[str, dict[int, float]] | None = None, window: int = WINDOW,
                 fixed: dict[str, float] | None = None) -> None:
        self.window = window
        self._seed: dict[str, dict[int, float]] = {k: dict(v) for k, v in (table or {}).items()}
        self._fixed_seed: dict[str, float] = dict(fixed or {})  # a table's per-request figures, until measured
        self._obs: collections.OrderedDict[str, dict[int, collections.deque]] = collections.OrderedDict()
        self._fixed: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()
        self._rows: dict[str, dict[int, float]] = {}  # row() of each key, kept up to date by observe()
        self._fixed_s: dict[str, float] = {}  # fixed_s() of each key, until it is observed again
        self._runs: dict[str, dict[int, int]] = {}  # per key and batch size: runs (chunks) measured
        # Sums since the start, per key and batch size [seconds, steps] and per key [seconds,
        # requests] besides steps: what a benchmark differences over one trace (``totals``).
        self._sums: dict[str, dict[int, list[float]]] = {}
        self._fixed_sums: dict[str, list[float]] = {}
        self._ones: dict[str, int] = {}  # batch-1 samples of each key so far
        self._at_ones: dict[str, dict[int, int]] = {}  # per key and batch size: _ones at its last sample
        # Lookups the scheduler repeats at every decision, valid until a figure changes:
        # (key, batch) -> step_s, (key, cap, sustained) -> reached.
        self._step_memo: dict[tuple[str, int], float | None] = {}
        self._reached_memo: dict[tuple[str, int, bool], int] = {}
        self.version = 0  # bumped whenever a lookup may answer differently: what callers' memos check

    def _changed(self) -> None:
        self.version += 1
        self._step_memo.clear()
        self._reached_memo.clear()

    # --- measurements ---------------------------------------------------------------------------
    def observe(self, key: str, batch: int, seconds: float, first: bool = True, times: int = 1) -> None:
        """One step of ``batch`` requests of ``key`` took ``seconds`` (``times`` such steps in a
        row: what as many calls would leave); ``first``: the first step of a run (a chunk) at this
        size. Runs, not steps, are what ``SETTLED`` counts: the steps of one chunk share one
        moment's contention (two chunks of batch 3 gave 4 samples at 6x a step alone, beside the
        other stages' bursts, and put a stage's rate under batch 1's)."""
        if batch < 1 or not seconds >= 0 or times < 1:
            return
        row = self._obs.get(key)
        if row is None:
            row = self._obs[key] = {}
            if len(self._obs) > MAX_KEYS:  # the least recently observed key falls back to the table
                dropped = self._obs.popitem(last=False)[0]
                for d in (self._rows, self._runs, self._sums, self._ones, self._at_ones):
                    d.pop(dropped, None)
                self._changed()
        else:
            self._obs.move_to_end(key)  # most recently observed last
        window = row.get(batch)
        if window is None:
            window = row[batch] = collections.deque(maxlen=self.window)
        if times == 1:
            window.append(float(seconds))
        else:
            window.extend(itertools.repeat(float(seconds), min(times, self.window)))
        total = self._sums.setdefault(key, {}).setdefault(batch, [0.0, 0, 0.0])
        for _ in range(times):  # (added one by one: the sums come out as from one call a step)
            total[0] += seconds
            total[2] += seconds * seconds
        total[1] += times
        runs = self._runs.setdefault(key, {})
        before = runs.get(batch, 0)
        runs[batch] = min(before + first, SETTLED)  # (only whether it reached SETTLED matters)
        ones = self._ones[key] = self._ones.get(key, 0) + (batch == 1) * times
        self._at_ones.setdefault(key, {})[batch] = ones
        cached = self._rows.get(key)
        if cached is None or (before < SETTLED <= before + first):  # (a size now sustained: ``reached`` changes)
            self._changed()  # not looked up since: whatever it was, lookups start afresh
            if cached is None:
                return
        x = window[-1]
        median = x if window.count(x) == len(window) else statistics.median(window)  # steady figures: no sort
        if cached.get(batch) != median:  # a sample that leaves the median where it was changes nothing
            cached = dict(cached)  # a row handed out earlier stays as it was
            cached[batch] = median
            self._rows[key] = cached
            self._changed()

    def row(self, key: str) -> dict[int, float]:
        """Known seconds per batch size for ``key`` (do not change it): measured medians (a step
        that shared the cores with another process is an outlier, not the cost) over the table's.
        Kept up to date as samples come: the scheduler asks for it at every decision."""
        out = self._rows.get(key)
        if out is None:
            out = dict(self._seed.get(key, {}))
            for b, d in self._obs.get(key, {}).items():
                out[b] = statistics.median(d)
            if key in self._seed or key in self._obs:
                self._rows[key] = out
        return out

    def observe_fixed(self, key: str, seconds: float) -> None:
        """What one request of ``key`` costs besides its steps (preparing and finishing it)."""
        if not seconds >= 0:
            return
        window = self._fixed.pop(key, None) or collections.deque(maxlen=self.window)
        window.append(float(seconds))
        self._fixed[key] = window
        total = self._fixed_sums.setdefault(key, [0.0, 0])
        total[0] += seconds
        total[1] += 1
        while len(self._fixed) > MAX_KEYS:
            dropped = self._fixed.popitem(last=False)[0]
            self._fixed_s.pop(dropped, None)
            self._fixed_sums.pop(dropped, None)
        self._fixed_s.pop(key, None)
        self.version += 1

    def fixed_s(self, key: str) -> float:
        """Seconds a request of ``key`` costs besides its steps (its table's figure, else 0,
        until measured)."""
        out = self._fixed_s.get(key)
        if out is None:
            window = self._fixed.get(key)
            if not window:
                return self._fixed_seed.get(key, 0.0)
            out = self._fixed_s[key] = statistics.median(window)
        return out

    def unsettled(self, key: str, batch: int) -> bool:
        """Whether the figure of ``key`` at ``batch`` (above 1) was measured but cannot be judged
        yet: in fewer than ``SETTLED`` runs, or on samples older than the last window of
        batch-1 ones (a batch size runs when the stage is busy, batch 1 often when it is not:
        against batch 1 it must be measured again now and then, or one busy moment decides
        for good)."""
        window = self._obs.get(key, {}).get(batch)
        if not window:
            return False
        return self._runs[key][batch] < SETTLED or self._ones.get(key, 0) - self._at_ones[key][batch] >= self.window

    def goes_stale(self, key: str) -> bool:
        """Whether a batch size above 1 was measured for ``key``: its figure goes unsettled
        again after a window of batch-1 samples (``unsettled``), with no change of ``version``."""
        return any(b > 1 for b in self._obs.get(key, ()))

    def keys(self) -> set[str]:
        return set(self._seed) | set(self._obs)

    # --- lookups --------------------------------------------------------------------------------
    def step_s(self, key: str, batch: int = 1) -> float | None:
        """Seconds one step (or call) of a batch of ``batch`` requests of ``key`` takes; None
        when nothing comparable is known."""
        try:
            return self._step_memo[key, batch]
        except KeyError:
            pass
        if len(self._step_memo) >= 4096:  # bounded: keys a stage was asked about and never ran
            self._step_memo.clear()
        t = self._step_memo[key, batch] = self._lookup(key, batch)
        return t

    def _lookup(self, key: str, batch: int) -> float | None:
        row = self.row(key)
        if row:
            return at_batch(row, batch)
        # Of known keys equally near, the dearest estimate (conservative, and the same in every
        # process: picking by the order of a set made it depend on the hash seed, 2x apart)
        near = self._nearest(key) or self._other_dop(key)
        return max((t * ratio for other, ratio in near if (t := at_batch(self.row(other), batch)) is not None),
                   default=None)

    def _other_dop(self, key: str) -> list[tuple[str, float]]:
        base, dop = split_dop(key)
        known = []
        for k in self.keys():
            b, kd = split_dop(k)
            if b == base and self.row(k):
                known.append((kd, k))
        if not known:
            return []
        gap = min(abs(other_dop - dop) for other_dop, _ in known)
        return [(k, other_dop / dop) for other_dop, k in known if abs(other_dop - dop) == gap]

    def _nearest(self, key: str) -> list[tuple[str, float]]:
        vol, var = volume(key), variant(key)
        if not vol:
            return []
        found = [(abs(v - vol), k, vol / v) for k in self.keys()
                 if (v := volume(k)) and variant(k) == var and self.row(k)]
        if not found:
            return []
        gap = min(d for d, _, _ in found)
        return [(k, ratio) for d, k, ratio in found if d == gap]

    def reached(self, key: str, cap: int, sustained: bool = False) -> int:
        """The largest batch size known for ``key`` up to ``cap`` (1 when none); ``sustained``:
        only sizes from the table or measured in ``SETTLED`` runs or more (a size the policy tried
        once or twice is not one the stage runs at: on 2 samples a batch of 3 cost 3× a step
        alone, and the stage's rate fell to batch 1's while it ran at 2)."""
        try:
            return self._reached_memo[key, cap, sustained]
        except KeyError:
            pass
        if len(self._reached_memo) >= 4096:
            self._reached_memo.clear()
        seeded, runs = self._seed.get(key, {}), self._runs.get(key, {})
        b = self._reached_memo[key, cap, sustained] = max(
            (b for b in self.row(key)
             if b <= cap and (not sustained or b in seeded or runs.get(b, 0) >= SETTLED)), default=1)
        return b

    def share_s(self, key: str, cap: int) -> float | None:
        """Device seconds per request-step when the stage runs ``key`` at the largest batch it
        sustains (at most ``cap``): what its sustained rate follows from."""
        b = self.reached(key, cap, sustained=True)
        t = self.step_s(key, b)
        return None if t is None else t / b

    # --- tables ---------------------------------------------------------------------------------
    def report(self, limit: int = 32) -> dict[str, dict[str, float]]:
        """{key: {batch: seconds}} as lookups price them (measured medians over the table's), the
        most recently measured keys first (JSON keys are strings)."""
        keys = list(reversed(self._obs))[:limit]
        keys += [k for k in self._seed if k not in self._obs][:max(0, limit - len(keys))]
        return {k: {str(b): round(t, 6) for b, t in sorted(self.row(k).items())} for k in keys}

    def totals(self, limit: int = 32) -> dict[str, Any]:
        """Sums since the start, the most recently measured keys first: ``steps`` {key: {batch:
        [seconds, steps, squared seconds]}} and ``fixed`` {key: [seconds, requests]} (what requests
        cost besides their steps). Their difference over a trace is what that trace's steps summed
        to: what a simulator replaying it should charge (the medians that price decisions leave
        out the slow steps, and a window holds only the trace's end), and how much they varied."""
        return {"steps": {k: {str(b): [round(t, 6), n, round(q, 9)]
                              for b, (t, n, q) in sorted(self._sums[k].items())}
                          for k in list(reversed(self._obs))[:limit] if k in self._sums},
                "fixed": {k: [round(self._fixed_sums[k][0], 6), self._fixed_sums[k][1]]
                          for k in list(reversed(self._fixed))[:limit] if k in self._fixed_sums}}


def at_batch(row: dict[int, float], batch: int) -> float | None:
    """Seconds per step of a batch of ``batch`` from a row {batch size: seconds}: interpolated
    between known sizes, no gain assumed past the largest, never slower below the smallest."""
    if not row:
        return None
    if batch in row:
        return row[batch]
    sizes = sorted(row)
    if batch < sizes[0]:
        return row[sizes[0]]
    if batch > sizes[-1]:
        return row[sizes[-1]] / sizes[-1] * batch
    lo = max(b for b in sizes if b < batch)
    hi = min(b for b in sizes if b > batch)
    return row[lo] + (row[hi] - row[lo]) * (batch - lo) / (hi - lo)


# --- the table file `onepiece profile` writes ---------------------------------------------------
class TableError(ValueError):
    pass


# What a table may say, per level: anything else is a typo (``"overhead": 5`` for ``overhead_s``)
# that would be dropped without a word. A row's or fixed entry's notes are what the writers add
# beside the figure (``onepiece profile``, ``bench shares``, a published table's ``source``).
# The top level is free-form metadata (device, cpu, units, notes, ...) beside version and
# stages; only the names of a stage's fields are refused there (a stage's figure written once
# for the whole table would be ignored).
FIGURES = ("overhead_s", "step_cv")  # a stage's optional figures, each a number >= 0 (``table_figure``)
STAGE_FIELDS = ("rows", "fixed", *FIGURES)
ROW_FIELDS = ("key", "batch", "seconds")
ROW_NOTES = ("dop", "samples", "source", "stepped")
FIXED_FIELDS = ("key", "seconds")
FIXED_NOTES = ("source",)


def _number(x: Any) -> bool:
    """A JSON number: not a bool (``true`` is not 1 s), not a string."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _unknown(entry: dict[str, Any], known: Iterable[str], where: str) -> None:
    known = tuple(known)
    extra = [k for k in entry if k not in known]
    if extra:
        raise TableError(f"{where}: unknown field(s) {', '.join(map(repr, extra))} (known: {', '.join(known)})")


def table_rows(doc: Any, stage: str | None = None) -> dict[str, dict[int, float]]:
    """{key: {batch: seconds}} of one stage (or all stages merged) from a parsed table file."""
    version = doc.get("version") if isinstance(doc, dict) else None
    if not _number(version) or version != TABLE_VERSION or not isinstance(doc.get("stages"), dict):
        raise TableError(f"not a version-{TABLE_VERSION} cost table (expected {{'version': 1, 'stages': {{...}}}})")
    misplaced = [k for k in doc if k in STAGE_FIELDS]
    if misplaced:
        raise TableError(f"{', '.join(map(repr, misplaced))} at the top level: a stage's field, it goes in "
                         f"stages.<stage> (top level: version, stages and free-form metadata)")
    out: dict[str, dict[int, float]] = {}
    stages = doc["stages"] if stage is None else {stage: doc["stages"].get(stage, {"rows": []})}
    for name, entry in stages.items():
        rows = entry.get("rows") if isinstance(entry, dict) else None
        if not isinstance(rows, list):
            raise TableError(f"stages.{name}.rows must be a list")
        _unknown(entry, STAGE_FIELDS, f"stages.{name}")
        seen: set[tuple[str, int]] = set()  # per stage: stages merged share call keys
        for i, r in enumerate(rows):
            try:
                key, batch, t = r["key"], r["batch"], r["seconds"]
            except (KeyError, TypeError):
                raise TableError(f"stages.{name}.rows[{i}]: expected {{key, batch, seconds}}, got {r!r}") from None
            where = f"stages.{name}.rows[{i}]"
            _unknown(r, ROW_FIELDS + ROW_NOTES, where)
            if not isinstance(key, str):
                raise TableError(f"{where}.key: expected a string, got {key!r}")
            # a whole number: int() made 1.5 batch 1 and overwrote its figure
            if not (_number(batch) and (isinstance(batch, int) or batch.is_integer()) and batch >= 1):
                raise TableError(f"{where}.batch: expected an integer >= 1, got {batch!r}")
            if not _number(t) or not MIN_SECONDS <= t <= MAX_SECONDS:
                raise TableError(f"{where}.seconds: expected a number in [{MIN_SECONDS:g}, {MAX_SECONDS:g}], "
                                 f"got {t!r}")
            batch = int(batch)
            if (key, batch) in seen:  # the second silently replaced the first
                raise TableError(f"{where}: a second row for key {key!r} at batch {batch} in stage {name!r}")
            seen.add((key, batch))
            out.setdefault(key, {})[batch] = float(t)
    return out


def _stage_entry(doc: Any, stage: str) -> dict[str, Any]:
    """One stage's entry of a parsed table ({} where the table has none)."""
    stages = doc.get("stages") if isinstance(doc, dict) else None
    entry = stages.get(stage) if isinstance(stages, dict) else None
    return entry if isinstance(entry, dict) else {}


def wrong_kind(keys: Iterable[str], stage: str, steps: bool) -> str | None:
    """Why a table's ``keys`` for ``stage`` cannot price it, a stage that steps (``steps``) or
    one called once per request (None: they can). The keys alone decide how a table prices a
    stage: call keys on a denoising stage priced all its steps as one call, and a stage started
    from rows no request's key ever matched."""
    key = next((k for k in keys if bool(variant(k)) != steps), None)
    if key is None:
        return None
    call = key[:len(key) - len(variant(key))] if variant(key) else key
    step = key if variant(key) else f"{key}/cfg/L64"
    want, got = ("step", "call") if steps else ("call", "step")
    return (f"stages.{stage}: the workflow's stage {'steps' if steps else 'is called once'}, so its rows need "
            f"{want} keys, not {got} keys such as {key!r} (step keys WxHxF/cfg|nocfg/L<text length>, e.g. "
            f"{step!r}; call keys WxHxF, e.g. {call!r})")


def table_fixed(doc: Any, stage: str) -> dict[str, float]:
    """{key: seconds a request costs besides its steps} of one stage of a parsed table (its
    optional ``fixed`` list of ``{key, seconds}``; none: no such cost known)."""
    rows = _stage_entry(doc, stage).get("fixed", [])
    if not isinstance(rows, list):
        raise TableError(f"stages.{stage}.fixed must be a list")
    out: dict[str, float] = {}
    for i, r in enumerate(rows):
        try:
            key, t = r["key"], r["seconds"]
        except (KeyError, TypeError):
            raise TableError(f"stages.{stage}.fixed[{i}]: expected {{key, seconds}}, got {r!r}") from None
        _unknown(r, FIXED_FIELDS + FIXED_NOTES, f"stages.{stage}.fixed[{i}]")
        if not isinstance(key, str) or not _number(t) or not 0 <= t <= MAX_SECONDS:
            raise TableError(f"stages.{stage}.fixed[{i}]: key must be a string, seconds in [0, {MAX_SECONDS:g}], "
                             f"got {r!r}")
        if key in out:  # the second silently replaced the first
            raise TableError(f"stages.{stage}.fixed[{i}]: a second entry for key {key!r} in stage {stage!r}")
        out[key] = float(t)
    return out


# A coefficient of variation of steps beyond this is not a measurement of steps: the lognormal
# the simulator draws from keeps the mean, so its median falls to 1/sqrt(1 + cv^2) of the
# figure (a tenth at 10; at 1e10 every step costs ~0 and a rare draw carries the whole mean).
# Measured steps vary far less (bench sched's tables: under 0.3).
MAX_STEP_CV = 10.0


def table_figure(doc: Any, stage: str, name: str) -> float | None:
    """One of a stage's optional figures in a parsed table, as a run measured it over its trace
    (None: not given): ``overhead_s``, seconds of decision and IPC per chunk (0, or within a
    row's bounds); ``step_cv``, the coefficient of variation of its steps and calls (their
    spread over their means, at most ``MAX_STEP_CV``)."""
    t = _stage_entry(doc, stage).get(name)
    if t is None:
        return None
    if name == "step_cv":
        ok, want = _number(t) and 0 <= t <= MAX_STEP_CV, f"a number in [0, {MAX_STEP_CV:g}]"
    else:  # seconds: 0 (none) or what a row may say
        ok = _number(t) and (t == 0 or MIN_SECONDS <= t <= MAX_SECONDS)
        want = f"0 or a number in [{MIN_SECONDS:g}, {MAX_SECONDS:g}]"
    if not ok:
        raise TableError(f"stages.{stage}.{name}: expected {want}, got {t!r}")
    return float(t)


def read_table(path: str | Path) -> Any:
    """A table file's parsed JSON (not checked yet), or TableError saying why it cannot be read."""
    try:
        return orjson.loads(Path(path).read_bytes())
    except OSError as e:
        raise TableError(f"{path}: cannot read: {e.strerror}") from None
    except orjson.JSONDecodeError as e:
        raise TableError(f"{path}: not JSON: {e}") from None


def load_table(path: str | Path, stage: str | None = None) -> dict[str, dict[int, float]]:
    doc = read_table(path)
    try:
        return table_rows(doc, stage)
    except TableError as e:
        raise TableError(f"{path}: {e}") from None


def make_table(stages: dict[str, Iterable[dict[str, Any]]], fixed: dict[str, dict[str, float]] | None = None,
               figures: dict[str, dict[str, float]] | None = None, **meta: Any) -> dict[str, Any]:
    """A table document: ``stages`` maps a stage to rows ``{key, batch, seconds, ...}``, ``fixed``
    a stage to {key: seconds a request costs besides its steps}, ``figures`` a stage to its
    optional figures (``FIGURES``); ``meta`` (device, host, model, units...) is kept beside them."""
    fixed, figures = fixed or {}, figures or {}
    return {"version": TABLE_VERSION, **meta, "stages": {
        s: {"rows": list(rows),
            **({"fixed": [{"key": k, "seconds": t} for k, t in fixed[s].items()]} if fixed.get(s) else {}),
            **{k: v for k, v in figures.get(s, {}).items() if k in FIGURES}} for s, rows in stages.items()}}
