"""Where the suite's time goes: a pytest plugin that records, in each test process, when each test
asked for its turn (tests/cores.py), when it got it and when it ended, its kind (exclusive, slow
or the rest) and how long its set-up, body and teardown took; and a summary of those records.
Off unless asked for:

    .venv/bin/python -m pytest -q -p timeline            # writes $TIMELINE_OUT (default .timeline/)
    .venv/bin/python tests/timeline.py .timeline         # busy and waiting seconds per process,
                                                         # and the tests the waits were behind
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest

import cores

_asked: dict[str, tuple[float, str]] = {}
_started: dict[str, float] = {}
_phases: dict[str, dict[str, float]] = {}
_body: dict[str, list[float]] = {}
# {test, kind, asked, started, ended, body_asked, body_started (wall clock: the test's turn, and
# in its call the wait to run alone before its body), setup, call, teardown (seconds)}
_rows: list[dict] = []


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outside conftest's wrapper, which waits for the turn
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _asked[item.nodeid] = (time.time(), cores.kind(item))
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outside conftest's wrapper, which waits to run alone
def pytest_runtest_call(item: pytest.Item):
    _body[item.nodeid] = [time.time()] * 2
    return (yield)


class _Body:
    @pytest.hookimpl(wrapper=True, trylast=True)  # inside it: the body starts now
    def pytest_runtest_call(self, item: pytest.Item):
        _body.setdefault(item.nodeid, [time.time()] * 2)[1] = time.time()
        return (yield)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Body(), "timeline-body")


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    _started[nodeid] = time.time()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _phases.setdefault(report.nodeid, {})[report.when] = report.duration


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    started = _started.pop(nodeid, time.time())
    asked, kind = _asked.pop(nodeid, (started, "rest"))
    phases = _phases.pop(nodeid, {})
    body_asked, body_started = _body.pop(nodeid, (started, started))
    _rows.append({"test": nodeid, "kind": kind, "asked": asked, "started": started, "ended": time.time(),
                  "body_asked": body_asked, "body_started": body_started,
                  **{when: phases.get(when, 0.0) for when in ("setup", "call", "teardown")}})


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if not _rows or (getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")):
        return  # (the controller of a run in several processes hears of every test, and runs none)
    folder = Path(os.environ.get("TIMELINE_OUT", ".timeline"))
    folder.mkdir(parents=True, exist_ok=True)
    name = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (folder / f"{name}.json").write_text(json.dumps(_rows))


def summary(folder: Path, top: int = 15) -> str:
    procs = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    if not procs:
        raise SystemExit(f"{folder}: no timeline (run the tests with -p timeline first)")
    rows = [r for rs in procs.values() for r in rs]
    span = max(r["ended"] for r in rows) - min(r["asked"] for r in rows)
    out = [f"{span:.0f} s from the first test asking for its turn to the last one ending"]
    behind: collections.Counter[str] = collections.Counter()
    for name, mine in procs.items():
        waits = [((r["asked"], r["started"]), (r["body_asked"], r["body_started"])) for r in mine]
        waited = sum(end - start for w in waits for start, end in w)
        busy = sum(r["ended"] - r["asked"] for r in mine) - waited
        out.append(f"{name}: {len(mine)} tests, {busy:.0f} s running, {waited:.0f} s waiting for a turn")
        for other, theirs in procs.items():
            if other == name:
                continue
            for start, end in (pair for w in waits for pair in w):  # for its turn, to run its body alone
                for t in theirs:  # what ran in the other process meanwhile
                    if (overlap := min(end, t["ended"]) - max(start, t["started"])) > 0:
                        behind[t["test"]] += overlap

    def total(kind: str, *phases: str) -> float:
        return sum(r[p] for r in rows if r["kind"] == kind for p in phases)
    body_waits = sum(r["body_started"] - r["body_asked"] for r in rows if r["kind"] == "exclusive")
    # What runs one at a time (tests/cores.py): exclusive bodies alone, and slow tests with the
    # exclusive set-ups under the slow tests' mutex; the rest fill the other process.
    out.append(f"exclusive bodies {total('exclusive', 'call') - body_waits:.0f} s; "
               f"slow tests and exclusive set-ups "
               f"{total('slow', 'setup', 'call', 'teardown') + total('exclusive', 'setup'):.0f} s; "
               f"the rest and exclusive teardowns "
               f"{total('rest', 'setup', 'call', 'teardown') + total('exclusive', 'teardown'):.0f} s")
    out.append("waits were behind (seconds):")
    out += [f"  {s:6.1f}  {test}" for test, s in behind.most_common(top) if s >= 0.05]
    return "\n".join(out)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1] if len(sys.argv) > 1 else ".timeline")))
