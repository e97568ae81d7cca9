"""A stage whose worker cannot load its models says why where the user looks: `onepiece up`'s
output (at once, not at its ready timeout), `onepiece status`, and the NM's status. Real
processes: a deployment whose transformer's config disagrees with its weights, which passes the
file check before start (every file is whole) and fails in diffusers' own loading."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from deployment import Up
from onepiece.launcher import free_tcp_address
from onepiece.nm.client import NmClient
from waiting import wait_for
from workflows import t2v_only

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]


def test_a_worker_that_cannot_load_its_models_says_why(tiny_models, tmp_path) -> None:
    model = shutil.copytree(tiny_models["t2v"], tmp_path / "model")
    config = model / "transformer" / "config.json"
    doc = json.loads(config.read_text())
    doc["ffn_dim"] += 16  # the weights' shapes no longer match: diffusers refuses them
    config.write_text(json.dumps(doc))
    (tmp_path / "wf.yaml").write_text(yaml.safe_dump(t2v_only({"m": {"path": str(model)}}, "m")))
    nm = free_tcp_address()
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump({
        "workflow": "wf.yaml", "nm": {"address": nm, "heartbeat_s": 0.25},
        "sets": [{"name": "set0", "proxy": {"count": 1, "port": 0}, "db": {"count": 1},
                  "stages": {"denoise": 1}}]}))  # only the stage that fails: nothing else loads meanwhile
    up = Up(tmp_path / "topology.yaml", tmp_path / "logs", nm)
    try:
        line = up.wait_for(r"waiting for set0/denoise 0/1 \(a worker fails to start: its models do not load", timeout=180)
        assert "ValueError: Cannot load" in line.string and "ffn" in line.string, line.string

        client = NmClient(nm, timeout=2.0)
        try:
            def denoise() -> dict | None:
                (i,) = client.status()["sets"]["set0"]["stages"]["denoise"]["instances"]
                return i if i["stats"].get("worker_error") else None

            instance = wait_for(denoise, timeout=30, what="the NM's status to carry the load error")
            assert not instance["ready"] and instance["stats"]["worker_error"].startswith("its models do not load: ValueError: Cannot load")
        finally:
            client.close()
        shown = subprocess.run([sys.executable, "-m", "onepiece", "status", "--nm", nm],
                               capture_output=True, text=True, timeout=60)
        assert "a worker fails to start: its models do not load: ValueError: Cannot load" in shown.stdout, shown.stdout + shown.stderr
        assert up.proc.poll() is None  # it keeps waiting (the worker retries): a fixed file is picked up
    finally:
        up.stop()


def test_a_collaboration_group_that_cannot_form_says_why(tiny_models, tmp_path, make_topology, monkeypatch) -> None:
    """A group whose ranks cannot open their world (here gloo told to use an interface that does
    not exist) restarts forever: `onepiece up` and the status say why, as for a load error."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "bogus0")  # the ranks inherit it through `up` (a user's setting wins)
    nm = free_tcp_address()
    topo = make_topology(tmp_path, tiny_models, nm, stages={"denoise_t2v": 1},  # only the group that fails
                         proxy={"count": 1, "port": 0}, threads=1,
                         stage_options={"denoise_t2v": {"mode": "collaboration", "workers": 2}})
    up = Up(topo, tmp_path / "logs", nm)
    try:
        line = up.wait_for(r"waiting for set0/denoise_t2v 0/1 \(a worker fails to start: its collaboration group "
                           r"does not form", timeout=180)
        assert "bogus0" in line.string, line.string
        shown = subprocess.run([sys.executable, "-m", "onepiece", "status", "--nm", nm],
                               capture_output=True, text=True, timeout=60)
        assert "its collaboration group does not form: RuntimeError" in shown.stdout, shown.stdout + shown.stderr
    finally:
        up.stop()
