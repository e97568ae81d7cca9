"""Request traces: what `onepiece bench sched` and `bench batching` send, saved so that a run can
be replayed exactly (`--trace FILE`) and by a simulator (DESIGN §12).

A trace file is JSON::

    {"version": 1, "created": "...", "note": "...",
     "capacity_rps": 1.23, "load": 0.8,            # what the arrivals were drawn at (informative)
     "classes": {"S": {"size": "64x64", "num_frames": 9, "steps": 20,
                       "standalone_s": 0.9, "alpha": 2.0, "slo_s": 1.8}, ...},
     "requests": [{"at": 0.0, "app": "t2v", "class": "S", "size": "64x64", "num_frames": 9,
                   "steps": 20, "slo_s": 1.8, "timeout_s": 90.0, "priority": 0, "seed": 17}, ...]}

``at`` is seconds after the trace starts (non-decreasing); ``slo_s`` is the latency the request
aims for (what the stages schedule for; absent: its deadline), ``timeout_s`` its deadline, where it
fails (absent: the application's limit); ``class`` names an entry of ``classes``, whose ``slo_s``
is what SLO attainment is judged against. ``load_trace`` checks all of it and says which field of
which request is wrong.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from onepiece.bench.common import percentile

VERSION = 1
# The latest arrival a trace may hold, seconds: about three years, longer than any replayed day or
# month, and short enough that every time stays an integer of nanoseconds (1e300 overflowed).
MAX_AT_S = 1e8


class TraceClass(BaseModel):
    model_config = ConfigDict(extra="allow")

    size: str = Field(pattern=r"^\d+x\d+$")
    num_frames: int = Field(ge=1)
    steps: int = Field(ge=1)
    slo_s: float | None = Field(None, gt=0)


class TraceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    at: float = Field(ge=0, le=MAX_AT_S)
    app: str = "t2v"
    cls: str = Field(alias="class")
    size: str = Field(pattern=r"^\d+x\d+$")
    num_frames: int = Field(ge=1)
    steps: int = Field(ge=1)
    slo_s: float | None = Field(None, gt=0)
    timeout_s: float | None = Field(None, gt=0)
    priority: int = 0
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _within(self) -> "TraceRequest":
        if self.slo_s is not None and self.timeout_s is not None and self.slo_s > self.timeout_s:
            raise ValueError(f"slo_s: {self.slo_s} is after the deadline timeout_s {self.timeout_s}")
        return self

    def body(self, prompt: str) -> dict[str, Any]:
        out = {"prompt": f"{prompt} {self.seed}", "model": self.app, "size": self.size, "num_frames": self.num_frames,
               "steps": self.steps, "seed": self.seed, "priority": self.priority}
        for k in ("slo_s", "timeout_s"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out


class Trace(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    version: int
    classes: dict[str, TraceClass]
    requests: list[TraceRequest] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> "Trace":
        if self.version != VERSION:
            raise ValueError(f"version: expected {VERSION}, got {self.version}")
        last = 0.0
        for i, r in enumerate(self.requests):
            if r.cls not in self.classes:
                raise ValueError(f"requests[{i}].class: {r.cls!r} is not in classes ({sorted(self.classes)})")
            if r.at < last:
                raise ValueError(f"requests[{i}].at: {r.at} comes before the previous request's {last}")
            last = r.at
        return self

    def dump(self) -> bytes:
        return orjson.dumps(self.model_dump(by_alias=True, exclude_none=True), option=orjson.OPT_INDENT_2)


class TraceError(ValueError):
    pass


def load_trace(path: str | Path) -> Trace:
    try:
        raw = orjson.loads(Path(path).read_bytes())
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror}") from None
    except orjson.JSONDecodeError as e:
        raise TraceError(f"{path}: not JSON: {e}") from None
    try:
        return Trace.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])  # none: the check names its own field
        raise TraceError(f"{path}: {where + ': ' if where else ''}{err['msg'].removeprefix('Value error, ')}") from None


def poisson_trace(classes: dict[str, dict[str, Any]], mix: dict[str, float], rate: float, n: int, seed: int,
                  deadlines: bool = True, timeout_s: float | None = None, app: str = "t2v", **meta: Any) -> Trace:
    """``n`` requests with exponential gaps at ``rate`` a second (the first at 0), classes drawn
    by ``mix``. With ``deadlines``, each aims for its class's ``slo_s``: as its target (``slo_s``)
    with ``timeout_s`` as its deadline, or as its deadline when ``timeout_s`` is None. The draws
    depend only on ``seed`` and ``n``: traces at other rates are the same sequence, stretched."""
    rng = random.Random(seed)
    names = sorted(mix)
    at, reqs = 0.0, []
    for i in range(n):
        if i:
            at += rng.expovariate(1.0) / rate
        name = rng.choices(names, weights=[mix[c] for c in names])[0]
        c = classes[name]
        due: dict[str, float] = {}
        if deadlines and c.get("slo_s"):
            due = {"timeout_s": c["slo_s"]} if timeout_s is None else {"slo_s": c["slo_s"], "timeout_s": timeout_s}
        reqs.append({"at": round(at, 6), "app": c.get("app", app), "class": name, "size": c["size"], "num_frames": c["num_frames"],
                     "steps": c["steps"], "seed": rng.randrange(2**31), **due})
    return Trace.model_validate({"version": VERSION, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                                 "classes": classes, "requests": reqs, **meta})


def scaled(trace: Trace, factor: float) -> Trace:
    """The same requests arriving ``factor`` times as fast."""
    return trace.model_copy(update={"requests": [r.model_copy(update={"at": r.at / factor}) for r in trace.requests]})


def parse_floats(spec: str, n: int, what: str) -> list[float]:
    """``n`` comma-separated positive numbers (a flag's value, one per class), or one for all of
    them, or SystemExit naming ``what``."""
    try:
        out = [float(x) for x in spec.split(",")]
    except ValueError:
        raise SystemExit(f"bad {what} {spec!r}: expected {n} comma-separated numbers") from None
    if len(out) == 1:
        out *= n
    if len(out) != n or not all(math.isfinite(x) and x > 0 for x in out):
        raise SystemExit(f"bad {what} {spec!r}: expected {n} positive numbers (or one for all)")
    return out


def parse_classes(spec: str) -> dict[str, dict[str, Any]]:
    """``S=64x64x9:20,M=...`` -> {name: {size, num_frames, steps}}; ``I=i2v/64x64x9:20``
    also names the class's application (default: the trace's)."""
    out = {}
    for item in spec.split(","):
        m = re.match(r"^\s*(\w+)=(?:(\w+)/)?(\d+)x(\d+)x(\d+):(\d+)\s*$", item)
        if not m:
            raise SystemExit(f"bad class {item!r}: expected NAME=[APP/]WxHxFRAMES:STEPS, e.g. S=64x64x9:20")
        name, app, w, h, f, steps = m.groups()
        if name in out:
            raise SystemExit(f"class {name} is given twice in {spec!r}")
        out[name] = {"size": f"{w}x{h}", "num_frames": int(f), "steps": int(steps), **({"app": app} if app else {})}
    return out


async def replay(target: Any, trace: Trace, prompt: str, max_duration: float) -> list[dict[str, Any]]:
    """Send every request of ``trace`` at its time (open loop) through ``target``
    (bench.overload.Target) and wait for all; one record per request sent, in trace order."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    for r in trace.requests:
        if r.at > max_duration:
            break
        delay = start + r.at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = loop.time() - start - r.at
        body = orjson.dumps(r.body(prompt))

        async def one(r: TraceRequest = r, body: bytes = body, lag: float = lag) -> dict[str, Any]:
            rec = await target.request(body)
            rec.update({"class": r.cls, "at": r.at, "lag_s": lag, "timeout_s": r.timeout_s, "slo_s": r.slo_s})
            return rec

        tasks.append(asyncio.create_task(one()))
    recs = list(await asyncio.gather(*tasks))
    await target.finish(recs)
    return recs


def stage_spans(events: Any, t0: float) -> list[dict[str, Any]]:
    """A result's own trace (the ``recv`` and ``end`` marks each stage puts on its message, ns
    since the epoch) as the simulator's records give a request's stages: [{stage, enter, leave}],
    seconds after ``t0`` (the client's send), in order. A stage without both marks is left out."""
    out: list[dict[str, Any]] = []
    enter: dict[str, float] = {}
    for ev in events if isinstance(events, list) else ():
        if not isinstance(ev, dict) or not isinstance(ev.get("t"), (int, float)):
            continue
        stage, t = ev.get("stage"), ev["t"] / 1e9 - t0
        if ev.get("event") == "recv":
            enter[stage] = t
        elif ev.get("event") == "end" and stage in enter:
            out.append({"stage": stage, "enter": enter.pop(stage), "leave": t})
    return out


def stage_times(recs: list[dict]) -> dict[str, dict[str, float]]:
    """Per class, then per stage and for the path between the stages (``between``: latency less
    the time in stages): mean seconds over completed requests that have stages."""
    acc: dict[str, dict[str, list[float]]] = {}
    for r in recs:
        spans = r.get("stages") or []
        if r.get("outcome") != "completed" or not spans or r.get("latency_s") is None:
            continue
        row = acc.setdefault(r["class"], {})
        inside = 0.0
        for sp in spans:
            row.setdefault(sp["stage"], []).append(sp["leave"] - sp["enter"])
            inside += sp["leave"] - sp["enter"]
        row.setdefault("between", []).append(r["latency_s"] - inside)
    return {c: {k: statistics.fmean(v) for k, v in row.items()} for c, row in sorted(acc.items())}


def summarize(recs: list[dict], slo: dict[str, float]) -> dict[str, Any]:
    """Per class and overall, the outcomes of a replay (records as ``replay`` returns them, or
    as the simulator writes them): counts, mean latency of the admitted ones (submit → resolved:
    completed, or failed), p50/p99 of completed ones, SLO attainment (completed within the
    class's ``slo`` / sent, refusals included) and goodput."""

    def one(rs: list[dict]) -> dict[str, Any]:
        n = len(rs)
        done = [r["latency_s"] for r in rs if r["outcome"] == "completed" and r.get("latency_s") is not None]
        # A refused request was answered at once, and so was one answered with an error (a 4xx or
        # 5xx, or no answer to the POST): neither was admitted. A failed one is resolved at its
        # failure; one that never resolved (the client gave up, the simulation stopped) at its
        # deadline, and is left out where it has none (counted as 0 s, it lowered the mean).
        resolved = [r["latency_s"] if r.get("latency_s") is not None else r["timeout_s"]
                    for r in rs if r["outcome"] not in ("rejected", "error")
                    and (r.get("latency_s") is not None or r.get("timeout_s"))]
        met = sum(1 for r in rs if r["outcome"] == "completed" and r.get("latency_s") is not None
                  and r["latency_s"] <= slo[r["class"]])
        return {"n": n, "completed": len(done), "failed": sum(1 for r in rs if r["outcome"] == "failed"),
                "refused": sum(1 for r in rs if r["outcome"] == "rejected"),
                "other": sum(1 for r in rs if r["outcome"] not in ("completed", "failed", "rejected")),
                "mean_s": statistics.fmean(resolved) if resolved else None,
                "mean_completed_s": statistics.fmean(done) if done else None,
                "p50_s": percentile(done, 50), "p99_s": percentile(done, 99),
                "slo_met": met, "attainment": met / n if n else None}

    out = {"all": one(recs)}
    for c in sorted({r["class"] for r in recs}):
        out[c] = one([r for r in recs if r["class"] == c])
    t0 = min(r["t_send"] for r in recs)
    end = max(r["t_send"] + (r.get("latency_s") or r.get("answer_s") or 0.0) for r in recs)
    out["all"]["duration_s"] = end - t0
    out["all"]["goodput_rps"] = out["all"]["slo_met"] / (end - t0) if end > t0 else None
    return out
