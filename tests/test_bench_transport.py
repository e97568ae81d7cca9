"""`onepiece bench transport`: flag validation, and a smoke run of the quick mode through every
transport on two small sizes that checks the files' structure and that the numbers are
positive. Performance targets are not asserted here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from onepiece.bench.transport import TRANSPORTS, parse_size, size_label
from onepiece.cli import build_parser

SIZES = [1024, 4096]


def test_cli_dispatches_transport_bench() -> None:
    p = build_parser()
    a = p.parse_args(["bench", "transport", "--quick", "--sizes", "4K,1K,1K", "--transports", "tcp,shm",
                      "--senders", "2,1"])
    assert (a.which, a.quick, a.sizes, a.transports, a.senders) == ("transport", True, [1024, 4096], ["shm", "tcp"],
                                                                  [1, 2])
    assert a.fn is p.parse_args(["bench", "overload"]).fn
    d = p.parse_args(["bench", "transport"])
    assert d.transports == list(TRANSPORTS) and d.senders == [1, 2] and d.sizes is None


def test_sizes_and_labels() -> None:
    assert [parse_size(x) for x in ("1K", "64kb", "1M", "16MiB", "64M", "4096")] == \
        [1024, 65536, 1 << 20, 16 << 20, 64 << 20, 4096]
    assert [size_label(n) for n in (1024, 1 << 20, 64 << 20, 1000)] == ["1 KB", "1 MB", "64 MB", "1000 B"]


@pytest.mark.parametrize("flags", [
    ["--sizes", "3Q"], ["--sizes", "0"], ["--sizes", ""], ["--sizes", "1K,,2K"], ["--transports", "shm,udp"], ["--senders", "0"],
    ["--senders", "a"], ["--seconds", "-1"], ["--ring-bytes", "3M"], ["--ring-slots", "1000"],
    ["--max-messages", "0"],
])
def test_bad_flags_are_usage_errors(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "transport", *flags])
    assert e.value.code == 2
    assert "error: argument " + flags[0] in capsys.readouterr().err


def test_ring_too_small_for_the_largest_size(tmp_path: Path) -> None:
    args = build_parser().parse_args(["bench", "transport", "--sizes", "1M", "--ring-bytes", "1M",
                                      "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="cannot hold a 1 MB message"):
        args.fn(args)


@pytest.mark.slow  # (a receiver that spins and two senders: the cores)
def test_quick_run_writes_sane_files(tmp_path: Path) -> None:
    out = tmp_path / "results"
    args = build_parser().parse_args(["bench", "transport", "--quick", "--sizes", "1K,4K", "--out", str(out)])
    assert args.fn(args) == 0

    res = json.loads((out / "transport.json").read_text())
    assert res["bench"] == "transport" and res["settings"]["quick"] is True
    assert res["command"].startswith("onepiece bench transport --quick --sizes 1K,4K ")
    assert res["machine"]["cores"] >= 1 and res["machine"]["cpu"]
    assert "CLOCK_MONOTONIC" in res["clock"]
    assert sorted(int(k) for k in res["memcpy"]) == SIZES
    for m in res["memcpy"].values():
        assert m["best_gbps"] >= m["median_gbps"] > 0
    cells = res["cells"]
    assert sorted((c["transport"], c["senders"], c["size"]) for c in cells) == sorted(
        (t, n, s) for t in TRANSPORTS for n in (1, 2) for s in SIZES)
    for c in cells:
        assert "error" not in c, c
        t, lat = c["throughput"], c["latency"]
        assert t["messages"] > 0 and t["messages"] == t["sent"] and t["lost"] == 0 and t["bad"] == 0
        assert t["bytes"] == t["messages"] * c["size"]
        assert t["mb_per_s"] > 0 and t["msgs_per_s"] > 0 and t["seconds"] > 0 and t["vs_memcpy"] > 0
        assert t["retries"] >= 0 and t["errors"] == 0 and not t["timed_out"]
        # The senders stop at the cell's time bound (a loaded machine may not reach the cap), each
        # after one message at least: all that was sent arrives.
        assert c["senders"] <= lat["messages"] == lat["sent"] <= c["senders"] * lat["per_sender_cap"]
        assert lat["lost"] == 0 and lat["bad"] == 0 and lat["errors"] == 0
        assert 0 < lat["min_us"] <= lat["p50_us"] <= lat["p99_us"] <= lat["max_us"]

    md = (out / "transport.md").read_text()
    assert res["command"] in md and "CLOCK_MONOTONIC" in md and f"{res['machine']['cores']} cores" in md
    for title in ("Throughput, MB/s", "Throughput relative to memcpy", "Messages/s", "latency p50", "latency p99"):
        assert f"## {title}" in md or title in md, title
    assert md.count("| transport | senders | 1 KB | 4 KB |") == 5
    for label in TRANSPORTS.values():
        assert md.count(f"| {label} | 1 |") == 5 and md.count(f"| {label} | 2 |") == 5
    assert "| memcpy (bound) |" in md
    assert not Path(f"/dev/shm/onepiece-bench-{os.getpid()}").exists()  # the shm ring is removed


@pytest.mark.slow
def test_rounds_give_medians_and_every_round(tmp_path: Path) -> None:
    out = tmp_path / "results"
    args = build_parser().parse_args(["bench", "transport", "--quick", "--sizes", "1K", "--transports", "shm,ipc",
                                      "--senders", "1", "--rounds", "3", "--out", str(out)])
    assert args.fn(args) == 0
    res = json.loads((out / "transport.json").read_text())
    assert res["settings"]["rounds"] == 3 and " --rounds 3 " in res["command"]
    assert len(res["memcpy"]["1024"]["rounds_best_mb_per_s"]) == 3
    for c in res["cells"]:
        per = c["rounds_mb_per_s"]
        assert len(per) == 3 and all(x > 0 for x in per)
        assert c["throughput"]["mb_per_s"] == sorted(per)[1]  # the median round's own figures
    t = res["targets"]["shm_1K_msgs_vs_zmq_ipc"]
    assert len(t["rounds"]) == 3 and t["value"] == sorted(t["rounds"])[1] and t["met"] == (t["value"] >= 1)
    md = (out / "transport.md").read_text()
    assert "Rounds: 3" in md and ", ".join(f"{x:.2f}" for x in t["rounds"]) in md
