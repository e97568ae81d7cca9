"""Shared test fixtures. Nothing in the tests may download: the hub is forced offline."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# The operator key every node manager the tests start (in process or as a child) and every
# `onepiece move` they run share: nothing is written to the user's config folder.
os.environ["ONEPIECE_OPERATOR_KEY"] = secrets.token_urlsafe(24)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random-weight Wan2.1 pipelines (seed 0), built once per session: {"t2v": dir, "i2v": dir}."""
    from onepiece.stage.wan.tiny import build_tiny

    base = tmp_path_factory.mktemp("tiny-models")
    return {kind: build_tiny(kind, base / f"wan2.1-{kind}-tiny", seed=0) for kind in ("t2v", "i2v")}


@pytest.fixture(scope="session")
def make_topology():
    """``onepiece.launcher.write_topology``: a one-set deployment around the tiny models."""
    from onepiece.launcher import write_topology

    return write_topology
