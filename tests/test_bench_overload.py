"""`onepiece bench overload`: the figures' definitions on made-up requests, and a smoke run of
the real benchmark (one deployment, monitor on, two small levels) that checks the files and
that the numbers are sane. Performance targets are not asserted here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from onepiece.bench.common import percentile
from onepiece.bench.overload import summarize
from onepiece.cli import build_parser


def test_cli_dispatches_both_benchmarks() -> None:
    p = build_parser()
    a = p.parse_args(["bench", "e2e", "--requests", "3"])
    assert (a.which, a.requests) == ("e2e", 3)
    b = p.parse_args(["bench", "overload", "--levels", "1,5", "--runs", "on"])
    assert (b.which, b.levels, b.runs) == ("overload", [1.0, 5.0], "on")
    assert a.fn is b.fn


def test_percentile_is_linear_between_ranks() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert math.isclose(percentile(list(range(101)), 99), 99.0)


def test_summarize_definitions() -> None:
    recs = (
        [{"t_send": i * 0.1, "outcome": "completed", "latency_s": 0.5, "answer_s": 0.01} for i in range(6)]
        + [{"t_send": 0.7, "outcome": "completed", "latency_s": 3.0, "answer_s": 0.01}]
        + [{"t_send": 0.8, "outcome": "rejected", "reason": "over_capacity", "answer_s": 0.002}] * 2
        + [{"t_send": 0.9, "outcome": "failed", "latency_s": 0.4, "answer_s": 0.01, "error": "boom"}]
    )
    lv = {"load": 2.0, "offered_rps": 4.0, "sent_rps": 4.0, "duration_s": 5.0, "max_send_lag_ms": 0.0,
          "drained": True, "nm_capacity_start": 2.0, "nm_capacity_end": 2.0, "records": recs}
    s = summarize(lv, slo=1.0)
    assert (s["sent"], s["completed"], s["rejected"], s["failed"], s["accepted"]) == (10, 7, 2, 1, 8)
    assert math.isclose(s["throughput_rps"], 7 / 5.0)
    assert math.isclose(s["goodput_rps"], 6 / 5.0)  # the 3 s one missed the SLO
    assert math.isclose(s["slo_attainment"], 6 / 10)  # of ALL requests, refused ones included
    assert math.isclose(s["reject_rate"], 0.2)
    assert math.isclose(s["reject_p50_ms"], 2.0)
    assert s["accepted_p50_s"] == 0.5 and s["accepted_p99_s"] > 2.5
    assert s["reject_reasons"] == {"over_capacity": 2}


@pytest.mark.slow
def test_smoke_run_writes_sane_files(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "results"
    args = build_parser().parse_args([
        "bench", "overload", "--levels", "1,2", "--requests", "4", "--runs", "on", "--shape", "64x64x9:4",
        "--warmup", "4", "--warmup-concurrency", "2", "--pause", "0.5", "--max-duration", "10",
        "--request-timeout", "30", "--models", str(tiny_models["t2v"].parent), "--out", str(out),
    ])
    assert args.fn(args) == 0

    for name in ("overload.json", "overload.md", "overload.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "overload.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = json.loads((out / "overload.json").read_text())
    assert res["bench"] == "overload"
    assert res["capacity"]["base_rps"] > 0
    assert res["slo_s"] is None or res["slo_s"] > 0
    rows = res["rows"]
    assert [(r["run"], r["load"]) for r in rows] == [("on", 1.0), ("on", 2.0)]
    assert sum(r["completed"] for r in rows) >= 1
    for r in rows:
        assert r["sent"] == round(r["load"] * 4)
        assert r["completed"] + r["rejected"] + r["failed"] + r["timed_out"] + r["errors"] == r["sent"]
        assert math.isclose(r["offered_rps"], r["load"] * res["capacity"]["base_rps"])
        assert r["duration_s"] > 0
        assert 0 <= r["reject_rate"] <= 1
        if r["completed"]:
            assert 0 < r["accepted_p50_s"] <= r["accepted_p99_s"] < 30
            assert 0 < r["throughput_rps"]
        if r["slo_attainment"] is not None:
            assert 0 <= r["slo_attainment"] <= 1
            assert 0 <= r["goodput_rps"] <= r["throughput_rps"] + 1e-9
        if r["rejected"]:
            assert 0 < r["reject_p50_ms"] <= r["reject_p99_ms"] < 30_000
    md = (out / "overload.md").read_text()
    assert "| monitor | load |" in md and "SLO" in md
