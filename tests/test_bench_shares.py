"""`onepiece bench shares`: a small run through the CLI times every stage and writes shares that
add up and a cost table the simulator reads; the real size is the real architecture; bad shapes
are refused. Figures are not asserted."""

from __future__ import annotations

import json

import pytest

from onepiece.cli import main
from onepiece.sim.costs import CostTable


@pytest.mark.parametrize("app, calls", [("t2v", ["text_encode", "vae_decode"]),
                                        ("i2v", ["text_encode", "image_encode", "vae_encode", "vae_decode"])])
def test_a_small_run_writes_shares_and_a_cost_table(tmp_path, app, calls):
    with pytest.raises(SystemExit) as done:
        main(["bench", "shares", "--app", app, "--size", "tiny", "--shapes", "32x32x5,48x32x5", "--batch", "1,2",
              "--steps", "4", "--text-length", "16", "--warmup", "0", "--repeat", "1", "--out", str(tmp_path)])
    assert done.value.code == 0
    doc = json.loads((tmp_path / "shares.json").read_text())
    assert [r["shape"] for r in doc["rows"]] == ["32x32x5", "48x32x5"]
    for r in doc["rows"]:
        assert list(r["calls_s"]) == calls
        assert sum(r["shares"].values()) == pytest.approx(1.0)
        assert r["denoise_s"] == pytest.approx(4 * r["step_s"]["1"])
        assert r["standalone_s"] == pytest.approx(sum(r["calls_s"].values()) + r["denoise_s"])
    table = CostTable(json.loads((tmp_path / "costs.json").read_text()))
    assert {k: set(b) for k, b in table.rows[f"denoise_{app}"].items()} == {
        "32x32x5/cfg/L16": {1, 2}, "48x32x5/cfg/L16": {1, 2}}
    for stage in calls:
        assert set(table.rows[stage]) == {"32x32x5", "48x32x5"}
    assert "48x32x5" in (tmp_path / "shares.md").read_text()


def test_the_sizes_offered_are_the_builder_s():
    """The flag's choices are listed apart (the CLI builds its parser without torch)."""
    from onepiece.bench.shares import SIZES
    from onepiece.stage.wan.tiny import PROFILES, REAL

    assert SIZES == (*PROFILES, REAL)


@pytest.mark.parametrize("app, billions", [
    ("t2v", {"text_encoder": 5.68, "transformer": 1.42, "vae": 0.13}),
    ("i2v", {"text_encoder": 5.68, "transformer": 16.39, "vae": 0.13, "image_encoder": 0.63}),
])
def test_the_real_size_is_wan21(app, billions):
    """Built on the meta device (no memory, no time): the parameter counts of Wan2.1-T2V-1.3B and
    Wan2.1-I2V-14B-480P (UMT5-XXL encoder, transformer, VAE; CLIP ViT-H/14 for I2V)."""
    from onepiece.stage.wan.tiny import REAL, components

    comps = components(app, REAL, "meta")
    assert {k: round(sum(p.numel() for p in v.parameters()) / 1e9, 2)
            for k, v in comps.items() if hasattr(v, "parameters")} == billions


@pytest.mark.parametrize("shapes", ["64x64", "65x64x5", "axbxc", "64x64x10", "100000x100000x1"])
def test_bad_shapes_are_refused(tmp_path, capsys, shapes):
    with pytest.raises(SystemExit) as done:
        main(["bench", "shares", "--shapes", shapes, "--out", str(tmp_path)])
    assert done.value.code == 2 and "argument --shapes: " in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["--device", "gpu"], "argument --device: expected cpu, cuda or cuda:N, got 'gpu'"),
    (["--size", "wan2.1"], "is for a GPU (--device cuda)"),  # 29 GB of float32 weights on this machine's CPU
])
def test_what_cannot_run_here_is_refused_at_once(tmp_path, capsys, argv, said):
    with pytest.raises(SystemExit) as done:
        main(["bench", "shares", *argv, "--out", str(tmp_path)])
    assert said in str(done.value.code) + capsys.readouterr().err
