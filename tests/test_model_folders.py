"""Model folders: a broken copy is told apart from a whole one without loading weights, and
`onepiece models`/`bench`/`up` say what is wrong in one line (no traceback, non-zero exit)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from onepiece.cli import main
from onepiece.stage.loader import is_built, load_components, model_problems, safetensors_problem
from onepiece.stage.wan.tiny import MARKER, build_tiny, ensure_models, remove_stale
from workflows import t2v_only

WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


def test_safetensors_check_reads_only_the_header(tmp_path) -> None:
    f = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(10, 10), "b": torch.ones(3)}, str(f))
    assert safetensors_problem(f) is None
    whole = f.read_bytes()
    f.write_bytes(whole[:-1])
    assert "truncated" in safetensors_problem(f)
    f.write_bytes(whole[:20])  # cut inside the header
    assert "truncated" in safetensors_problem(f)
    f.write_bytes(whole + b"x")
    assert "longer than its header says" in safetensors_problem(f)
    f.write_bytes(b"abc")
    assert "shorter than a safetensors header" in safetensors_problem(f)
    f.write_bytes((4).to_bytes(8, "little") + b"{{{{")
    assert "not a valid safetensors header" in safetensors_problem(f)


def test_sharded_weights_need_every_shard(tmp_path) -> None:
    # The layout of real (sharded) weights: a weight map naming each shard.
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "X", "vae": ["diffusers", "AutoencoderKLWan"]}))
    (tmp_path / "vae").mkdir()
    save_file({"a": torch.zeros(2)}, str(tmp_path / "vae" / "m-00001-of-00002.safetensors"))
    (tmp_path / "vae" / "m.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "m-00001-of-00002.safetensors", "b": "m-00002-of-00002.safetensors"}}))
    assert "m-00002-of-00002.safetensors" in model_problems(tmp_path)[0]
    save_file({"b": torch.zeros(2)}, str(tmp_path / "vae" / "m-00002-of-00002.safetensors"))
    assert is_built(tmp_path)


def test_broken_model_is_named_refused_and_rebuilt(tiny_models, tmp_path) -> None:
    path = shutil.copytree(tiny_models["t2v"], tmp_path / "t2v")
    os.truncate(path / WEIGHTS, 1000)
    assert not is_built(path)
    [why] = model_problems(path)
    assert "'transformer'" in why and WEIGHTS in why and "truncated" in why
    assert model_problems(path, ["vae"]) == []  # a stage that loads only the VAE is not held up
    with pytest.raises(ValueError, match="'transformer'.*diffusion_pytorch_model.safetensors.*truncated"):
        load_components(path, ["transformer"])
    shutil.rmtree(path / "transformer")
    assert "'transformer'" in model_problems(path)[0] and "missing" in model_problems(path)[0]

    wf = _workflow(path)
    # The shipped workflow around these models: `up` refuses before starting a worker.
    from onepiece.launcher import Deployment, write_topology

    topo = write_topology(tmp_path, {"t2v": path, "i2v": tiny_models["i2v"]}, "tcp://127.0.0.1:1")
    with pytest.raises(RuntimeError, match="stage denoise_t2v: component 'transformer'"):
        Deployment(topo, tmp_path / "logs", runtime_dir=tmp_path).check_models()

    # Our own tiny build, broken: rebuilt. Anyone else's: refused, saying what is broken.
    assert ensure_models(wf, tmp_path) == [path] and is_built(path)
    (path / MARKER).unlink()
    os.truncate(path / WEIGHTS, 1000)
    with pytest.raises(FileExistsError, match="incomplete pipeline not built by build_tiny.*'transformer'"):
        build_tiny("t2v", path, overwrite=False)


def _workflow(t2v: Path) -> "Workflow":  # noqa: F821
    from onepiece.config import Workflow

    return Workflow.model_validate(t2v_only({"wan-t2v": {"path": str(t2v), "tiny": "t2v"}}, "wan-t2v"))


def _models(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code


def test_models_command_says_what_is_wrong(tiny_models, tmp_path, capsys) -> None:
    def workflow(model_path: Path, tiny: bool = True) -> str:
        f = tmp_path / "wf.yaml"
        f.write_text(yaml.safe_dump(t2v_only({"m": {"path": str(model_path), **({"tiny": "t2v"} if tiny else {})}}, "m")))
        return str(f)

    assert _models(["models", "build", "--workflow", workflow(Path("/proc/nope/m"))]) == 1
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "/proc/nope" in err and "Traceback" not in err
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    assert _models(["models", "build", "--workflow", workflow(tmp_path / "junk")]) == 1
    assert "junk: not empty and not a diffusers pipeline" in capsys.readouterr().err

    real = shutil.copytree(tiny_models["t2v"], tmp_path / "real")  # no MARKER, no `tiny:`: real weights
    (real / MARKER).unlink()
    os.truncate(real / WEIGHTS, 1000)
    assert _models(["models", "list", "--workflow", workflow(tiny_models["t2v"])]) == 0
    assert "present" in capsys.readouterr().out
    assert _models(["models", "list", "--workflow", workflow(real, tiny=False)]) == 1
    out = capsys.readouterr().out
    assert "broken" in out and WEIGHTS in out
    assert _models(["models", "build", "--workflow", workflow(real, tiny=False)]) == 1
    err = capsys.readouterr().err
    assert "'transformer'" in err and "all models present" not in err

    with pytest.raises(SystemExit, match="cannot build the tiny models under /proc/nope"):
        from onepiece.bench.common import tiny_models as bench_models
        bench_models(Path("/proc/nope"))


def test_build_removes_stale_temp_folders_and_opens_modes(tmp_path) -> None:
    path = tmp_path / "wan2.1-t2v-tiny"
    stale, fresh = tmp_path / f".{path.name}.building-abc", tmp_path / f".{path.name}.old-def"
    other = tmp_path / ".other.building-abc"  # another model's: not ours to remove
    for d in (stale, fresh, other):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "f").write_text("x")
    hour_ago = time.time() - 2 * 3600
    for p in (stale, stale / "sub", stale / "sub" / "f", other):
        os.utime(p, (hour_ago, hour_ago))
    os.utime(fresh, (hour_ago, hour_ago))  # but its file was written just now: a live build
    assert remove_stale(path) == [stale]

    umask = os.umask(0o022)
    try:
        build_tiny("t2v", path, seed=0)
    finally:
        os.umask(umask)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([fresh.name, other.name, path.name])
    assert path.stat().st_mode & 0o777 == 0o755  # not mkdtemp's 0700: other users can read it
    assert (path / "transformer").stat().st_mode & 0o777 == 0o755
    assert (path / WEIGHTS).stat().st_mode & 0o777 == 0o644
