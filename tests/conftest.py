"""Shared test fixtures. Nothing in the tests may download: the hub is forced offline."""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import IO

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


# --- two test processes on the machine's cores (pytest-xdist, pyproject's addopts) --------------
# Two deployments starting side by side on 2 cores made a text encoding of a few ms take 0.4 s
# and failed tests that pass alone, so the two processes share the machine as follows: a test
# marked ``exclusive`` (it asserts on rates, times or bounds) runs while no other test runs; a
# ``slow`` one (it starts a whole deployment, or otherwise takes the cores) runs while no other
# slow one does; the rest run beside anything but an exclusive test. Locks per test (a module
# fixture's deployment starts under its first test's turn and idles between its tests) on files
# in a folder the controller makes for the run: a readers-writer lock, fair through a
# turnstile (an exclusive test that waits holds it, so the tests after it wait behind it), and
# a mutex for the slow ones.
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
        rank[f] = min(rank.get(f, 2), 0 if it.get_closest_marker("exclusive") else 1 if it.get_closest_marker("slow") else 2)
    items.sort(key=lambda it: rank[it.nodeid.split("::")[0]])  # (stable)


_lock_files: tuple[IO, IO, IO] | None = None  # (turnstile, tests, slow), this process's


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    global _lock_files
    folder = getattr(item.config, "workerinput", {}).get(_LOCKS)
    if folder is None:  # one process (-n 0): nothing to share
        return (yield)
    if _lock_files is None:
        _lock_files = tuple(open(os.path.join(folder, name), "a") for name in ("turnstile", "tests", "slow"))
    turnstile, tests, slow = _lock_files
    exclusive, heavy = item.get_closest_marker("exclusive") is not None, item.get_closest_marker("slow") is not None
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    try:
        fcntl.flock(tests, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    finally:
        fcntl.flock(turnstile, fcntl.LOCK_UN)
    if heavy and not exclusive:
        fcntl.flock(slow, fcntl.LOCK_EX)  # (always after ``tests``: no two processes wait on each other)
    try:
        return (yield)
    finally:
        if heavy and not exclusive:
            fcntl.flock(slow, fcntl.LOCK_UN)
        fcntl.flock(tests, fcntl.LOCK_UN)
