"""What a simulation leaves behind: figures per class (``bench.trace.summarize``, the very
function the benchmark reports with), per-stage utilization, a plot, and a Chrome/Perfetto
trace of the schedule (open it in ui.perfetto.dev or chrome://tracing: one process per stage
instance, one thread per worker, one slice per chunk of steps)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from onepiece.sim.engine import Chunk


def perfetto(chunks: list[Chunk], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The Trace Event Format (JSON): complete events (``ph: X``) in microseconds."""
    cls = {r["uid"]: r["class"] for r in records}
    pids = {name: i + 1 for i, name in enumerate(sorted({c.instance for c in chunks}))}
    events: list[dict[str, Any]] = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
                                    for name, pid in pids.items()]
    for c in chunks:
        kinds = sorted({cls.get(u, "?") for u in c.uids})
        events.append({"ph": "X", "pid": pids[c.instance], "tid": c.worker, "ts": round(c.start * 1e6, 3),
                       "dur": round((c.end - c.start) * 1e6, 3),
                       "name": f"{len(c.uids)}x {'+'.join(kinds)} ({c.steps} step{'s' if c.steps != 1 else ''})",
                       "args": {"stage": c.stage, "uids": list(c.uids), "steps": c.steps,
                                "parts": [[d, list(u)] for d, u in c.parts],
                                **({"passed": [list(p) for p in c.passed]} if c.passed else {})}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def utilization_over_time(chunks: list[Chunk], lifetimes: list[tuple[str, Any, float, float | None]],
                          bin_s: float) -> dict[str, list[float]]:
    """Per stage, the share of its workers busy in each ``bin_s`` window: over the workers its
    instances had then (``Simulation.lifetimes``: a collaboration group is one worker, as in
    ``Simulation.utilization``, and an elastic move changes a stage's count mid-run)."""
    end = max((c.end for c in chunks), default=0.0)
    n = max(1, int(end / bin_s) + 1)

    def spread(row: list[float], start: float, stop: float, weight: float) -> None:
        for b in range(int(start / bin_s), min(n - 1, int(stop / bin_s)) + 1):
            row[b] += weight * max(0.0, min(stop, (b + 1) * bin_s) - max(start, b * bin_s))

    slots: dict[str, list[float]] = {}
    for stage, vi, born, retired in lifetimes:
        spread(slots.setdefault(stage, [0.0] * n), born, end if retired is None else min(retired, end),
               len(vi.core.workers))
    busy = {s: [0.0] * n for s in slots}
    for c in chunks:
        spread(busy.setdefault(c.stage, [0.0] * n), c.start, c.end, 1.0)
    return {s: [b / w if w > 0 else 0.0 for b, w in zip(row, slots.get(s, [0.0] * n))] for s, row in busy.items()}


def write(out: Path, name: str, result: dict[str, Any], chunks: list[Chunk] | None,
          lifetimes: list[tuple[str, Any, float, float | None]]) -> list[Path]:
    """``name``.json, .md, .png and (with chunks) .perfetto.json under ``out``; ``lifetimes``:
    the simulation's instances (``Simulation.lifetimes``), what the plot's shares are of."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md"]
    paths[0].write_text(json.dumps(result, indent=1))
    paths[1].write_text(markdown(result) + "\n")
    if chunks:
        bin_s = max(0.5, max(c.end for c in chunks) / 200)
        plot(out / f"{name}.png", result, utilization_over_time(chunks, lifetimes, bin_s), bin_s)
        (out / f"{name}.perfetto.json").write_text(json.dumps(perfetto(chunks, result["requests"])))
        paths += [out / f"{name}.png", out / f"{name}.perfetto.json"]
    return paths


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [f"`onepiece sim` — {result['title']}", "",
             "| class | n | completed | failed | refused | mean ms | p50 ms | p99 ms | SLO attainment |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c, r in s.items():
        att = "—" if r["attainment"] is None else f"{r['attainment']:.0%}"
        lines.append(f"| {c} | {r['n']} | {r['completed']} | {r['failed']} | {r['refused']} | {_ms(r['mean_s'])} "
                     f"| {_ms(r['p50_s'])} "
                     f"| {_ms(r['p99_s'])} | {att} |")
    lines += ["", "Utilization per stage (busy worker-seconds over worker-seconds): " + ", ".join(
        f"{k} {v:.0%}" for k, v in result["utilization"].items()),
        f"Simulated {result['simulated_s']:.1f} s in {result['wall_s']:.2f} s of wall time"
        + ("; steps varied with CV " + ", ".join(f"{st} {cv:.3g}" for st, cv in result["step_cv"].items())
           + f" (seed {result['seed']})." if result.get("step_cv") else ".")]
    for mv in result.get("moves", []):
        lines.append(f"- {mv['at']:.1f} s: the NM moved {mv['instance']} from {mv['from'] or 'the idle pool'} to "
                     f"{mv['to'] or 'the idle pool'} (serving there at {mv.get('serving_at', float('nan')):.1f} s): "
                     f"{mv['reason']}")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:.0f}"


def plot(path: Path, result: dict[str, Any], util: dict[str, list[float]], bin_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for stage, xs in util.items():
        ax1.plot([i * bin_s for i in range(len(xs))], [x * 100 for x in xs], label=stage)
    ax1.set_xlabel("simulated time (s)")
    ax1.set_ylabel("workers busy (%)")
    ax1.legend(fontsize=8)
    ax1.grid(True, alpha=0.3)
    by_class: dict[str, list[float]] = {}
    for r in result["requests"]:
        if r["outcome"] == "completed":
            by_class.setdefault(r["class"], []).append(r["latency_s"])
    for c, xs in sorted(by_class.items()):
        xs.sort()
        ax2.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=c)
    ax2.set_xlabel("latency (s)")
    ax2.set_ylabel("completed requests (CDF)")
    ax2.legend(fontsize=8)
    ax2.grid(True, alpha=0.3)
    fig.suptitle(result["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
