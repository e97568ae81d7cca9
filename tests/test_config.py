"""Workflow and topology YAML: the shipped files load, and bad files name file, key and expectation."""

import subprocess
import sys

import pytest

from onepiece.config import ConfigError, deploy_dir, load_topology, load_workflow


def test_shipped_files_load_and_share_stages():
    topo, wf, base = load_topology(deploy_dir() / "local.yaml")
    assert base == deploy_dir()
    t2v, i2v = wf.applications["t2v"].stages, wf.applications["i2v"].stages
    assert {"text_encode", "vae_decode"} <= set(t2v) & set(i2v)  # shared stages
    assert wf.next_stage("i2v", "text_encode") == "image_encode" and wf.next_stage("t2v", "vae_decode") is None
    assert set(topo.sets[0].stages) == set(wf.stages)


def write(tmp_path, text, name="wf.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


GOOD = (deploy_dir() / "wan21.yaml").read_text()


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda t: t.replace("    components: [vae]\n  denoise_t2v", "    components: [vae]\n    workers: -1\n  denoise_t2v", 1),
         "stages.vae_encode.workers: Input should be greater than 0 (got -1)"),
        (lambda t: t.replace("model: wan-i2v\n    components: [image_encoder", "model: nope\n    components: [image_encoder"),
         "stages.image_encode.model: unknown model 'nope'"),
        (lambda t: t.replace("stages: [text_encode, denoise_t2v, vae_decode]", "stages: [text_encode, denoise, vae_decode]"),
         "applications.t2v.stages[1]: unknown stage 'denoise'"),
        (lambda t: t.replace("    tiny: t2v\n", "    tiny: t2v\n    colour: blue\n", 1),
         "models.wan-t2v.colour: Extra inputs are not permitted"),
        (lambda t: t.replace("fps: 16}", "fps: fast}", 1), "applications.t2v.defaults.fps"),
        (lambda t: t + "\n  broken: [\n", "not valid YAML"),
        (lambda t: "just a string\n", "(top level)"),
    ],
)
def test_bad_workflow_names_file_key_and_expectation(tmp_path, mutate, expected):
    path = write(tmp_path, mutate(GOOD))
    with pytest.raises(ConfigError) as e:
        load_workflow(path)
    assert str(path) in str(e.value)
    assert expected in str(e.value)


def test_bad_topology_names_the_key(tmp_path):
    write(tmp_path, GOOD)
    path = write(tmp_path, "workflow: wf.yaml\nsets:\n  - name: a\n    stages: {denoise_t2v: 1, warp_drive: 2}\n", "topo.yaml")
    with pytest.raises(ConfigError, match=r"topo.yaml: sets.a.stages.warp_drive: unknown stage"):
        load_topology(path)
    path = write(tmp_path, "workflow: wf.yaml\nsets:\n  - stages: {denoise_t2v: -3}\n", "topo2.yaml")
    with pytest.raises(ConfigError, match=r"topo2.yaml: sets.0.stages: .*denoise_t2v: expected an instance count"):
        load_topology(path)
    with pytest.raises(ConfigError, match="missing.yaml: cannot read"):
        load_topology(tmp_path / "missing.yaml")


def test_cli_reports_config_errors_and_bad_flags(tmp_path):
    path = write(tmp_path, "workflow: nowhere.yaml\nsets: []\n", "topo.yaml")
    out = subprocess.run([sys.executable, "-m", "onepiece", "nm", "--topology", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "sets: List should have at least 1 item" in out.stderr
    out = subprocess.run([sys.executable, "-m", "onepiece", "up", "--ready-timeout", "soon"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "invalid float value: 'soon'" in out.stderr
