"""How the suite's two test processes share the machine's cores (pytest-xdist; tests/conftest.py
takes and gives back the locks around each test).

Two deployments starting side by side on 2 cores made a text encoding of a few ms take 0.4 s
and failed tests that pass alone, so: a ``slow`` test (it starts a whole deployment, or
otherwise takes the cores) runs while no other slow one does; an ``exclusive`` one (it asserts
on rates, times or bounds) sets up like a slow one, then runs its body while no other test runs
(so an exclusive test starts its deployment in a fixture); the rest run beside anything but an
exclusive body. A fixture whose set-up times something calls ``alone()`` first. Before, an
exclusive test was alone from its set-up on: the deployments its fixtures start (10-25 s of
imports and model loads each) left the other process idle, about 40% of each process's time
over the whole suite (tests/timeline.py measures it).

Locks on files in a folder the controller makes for the run: a readers-writer lock, fair through
a turnstile (an exclusive test that waits holds it, so the tests after it wait behind it), and a
mutex for the slow ones, always taken after the readers-writer lock (no two processes wait on
each other)."""

from __future__ import annotations

import fcntl
import os
from typing import IO

KINDS = ("exclusive", "slow", "rest")  # a test's kind, by its markers: the first it has


def kind(item) -> str:
    """``item``'s kind (``KINDS``): how it shares the cores."""
    return next((k for k in KINDS[:2] if item.get_closest_marker(k) is not None), "rest")


_files: tuple[IO, IO, IO] | None = None  # (turnstile, tests, slow), this process's
_held: str | None = None  # "shared" | "alone", the readers-writer lock as this process holds it
_slow = False  # holding the slow tests' mutex


def open_locks(folder: str) -> None:
    global _files
    if _files is None:
        _files = tuple(open(os.path.join(folder, name), "a") for name in ("turnstile", "tests", "slow"))


def _take(alone: bool) -> None:
    global _held
    turnstile, tests, _ = _files
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    try:
        fcntl.flock(tests, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    finally:
        fcntl.flock(turnstile, fcntl.LOCK_UN)
    _held = "alone" if alone else "shared"


def begin(slow: bool) -> None:
    """A test starts: beside other tests (``slow``: and no other slow one)."""
    global _slow
    if _files is None:
        return
    _take(False)
    if slow:
        fcntl.flock(_files[2], fcntl.LOCK_EX)
        _slow = True


def alone() -> None:
    """From here to the end of the body of the test now running, no other test runs. A no-op
    in one process (``-n 0``) or when already so."""
    global _slow
    if _files is None or _held == "alone":
        return
    if _slow:  # (given back first: the mutex is only ever taken after the readers-writer lock)
        fcntl.flock(_files[2], fcntl.LOCK_UN)
        _slow = False
    fcntl.flock(_files[1], fcntl.LOCK_UN)
    _take(True)


def share() -> None:
    """Other tests may run again (a teardown that only stops what the test started)."""
    global _held
    if _files is not None and _held == "alone":
        fcntl.flock(_files[1], fcntl.LOCK_SH)  # (a conversion, not atomic: an exclusive test waiting may go first)
        _held = "shared"


def end() -> None:
    """The test is over: give back whatever it holds."""
    global _held, _slow
    if _files is None:
        return
    if _slow:
        fcntl.flock(_files[2], fcntl.LOCK_UN)
        _slow = False
    fcntl.flock(_files[1], fcntl.LOCK_UN)
    _held = None
