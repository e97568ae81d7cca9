"""Shared test fixtures. Nothing in the tests may download: the hub is forced offline."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

import cores

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


# --- two test processes on the machine's cores (pytest-xdist, pyproject's addopts) --------------
# How they share them: tests/cores.py. The locks' folder is the controller's, made for the run.
_LOCKS = "onepiece_locks"


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        config._onepiece_locks = tempfile.mkdtemp(prefix="onepiece-test-locks-")  # the controller's


@pytest.hookimpl(optionalhook=True)  # xdist's hook, on the controller: what each worker is given
def pytest_configure_node(node) -> None:
    node.workerinput[_LOCKS] = node.config._onepiece_locks


def pytest_unconfigure(config: pytest.Config) -> None:
    if folder := getattr(config, "_onepiece_locks", None):
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files in the order they are handed out (``--no-loadscope-reorder``): those with exclusive
    tests first, then those with slow ones (the longest), then the rest, which fill the other
    process beside the slow ones and run two at a time at the end. A file's own tests keep their
    order."""
    rank: dict[str, int] = {}
    for it in items:
        f = it.nodeid.split("::")[0]
        rank[f] = min(rank.get(f, 2), cores.KINDS.index(cores.kind(it)))
    items.sort(key=lambda it: rank[it.nodeid.split("::")[0]])  # (stable)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    folder = getattr(item.config, "workerinput", {}).get(_LOCKS)
    if folder is None:  # one process (-n 0): nothing to share
        return (yield)
    cores.open_locks(folder)
    # (an exclusive test's set-up may start a deployment: as a slow test's)
    cores.begin(slow=cores.kind(item) != "rest")
    try:
        return (yield)
    finally:
        cores.end()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    if cores.kind(item) == "exclusive":
        cores.alone()  # (its set-up, which starts what it times, shared the machine)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    cores.share()  # stopping what a test started times nothing
    return (yield)
