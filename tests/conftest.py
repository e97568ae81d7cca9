"""Shared test fixtures. Nothing in the tests may download: the hub is forced offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random-weight Wan2.1 pipelines (seed 0), built once per session: {"t2v": dir, "i2v": dir}."""
    from onepiece.stage.wan.tiny import build_tiny

    base = tmp_path_factory.mktemp("tiny-models")
    return {kind: build_tiny(kind, base / f"wan2.1-{kind}-tiny", seed=0) for kind in ("t2v", "i2v")}


def write_topology(folder: Path, models: dict[str, Path], nm_address: str, *, dbs: int = 2,
                   transport: str = "ipc", stages: dict[str, int] | None = None, **set_options) -> Path:
    """The shipped workflow pointed at ``models``, and a one-set topology around it, in ``folder``.
    The proxy takes a free port; the NM listens at ``nm_address``."""
    import yaml

    from onepiece.config import deploy_dir

    wf = yaml.safe_load((deploy_dir() / "wan21.yaml").read_text())
    for name, spec in wf["models"].items():
        spec["path"] = str(models[spec["tiny"]])
    (folder / "workflow.yaml").write_text(yaml.safe_dump(wf))
    topo = {
        "workflow": "workflow.yaml",
        "transport": transport,
        "nm": {"address": nm_address, "heartbeat_s": 0.25, "dead_after_s": 1.5},
        "sets": [{
            "name": "set0",
            "proxy": {"count": 1, "port": 0},
            "db": {"count": dbs},
            "stages": stages or {s: 1 for s in wf["stages"]},
            **set_options,
        }],
    }
    path = folder / "topology.yaml"
    path.write_text(yaml.safe_dump(topo))
    return path


@pytest.fixture(scope="session")
def make_topology():
    """``write_topology`` for tests (conftest is not importable under importlib import mode)."""
    return write_topology
