"""What each worker of a stage ran, chunk by chunk: one JSON line per chunk, written when the
worker reports the chunk done. The simulator draws its schedule (``sim/report.py``); this is the
real one, in the same terms, so the two can be laid side by side (``onepiece bench sched`` keeps
each trace's as a Perfetto file, ``onepiece bench simval`` reads it).

A line: ``{"stage", "instance", "worker", "start", "end", "parts": [[ranks, uids, steps, key],
...], "passes", "passed"}``:

- ``start`` when the scheduler sent the chunk and ``end`` when the worker's report of it
  arrived, in seconds since the epoch (the clients' clock on the same host);
- ``parts`` as the core planned them (``sched.core.Part``), each with its requests' key
  (``sched.keys``);
- ``passes`` the forward passes the worker ran (fewer where members finished or were dropped
  mid-chunk);
- ``passed`` why the others waited: the requests that the decision that sent the chunk could
  have advanced and did not (the 64 longest-waiting), each ``[uid, slack, steps left, aged]``
  (``sched.core.Passed``: slack is the seconds it had to spare had it run alone from then on
  at its fastest DoP, negative where it was late even so, null without a deadline).

`onepiece up` rotates the file as it does the roles' logs (onepiece/logrotate.py), so it stays bounded.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger(__name__)


class ScheduleLog:
    def __init__(self, path: str | Path, instance: str = "") -> None:
        self.path, self.instance = Path(path), instance
        self._lock = threading.Lock()  # a moved instance's old and new schedulers may both write
        self._failing = False

    def chunk(self, stage: str, worker: str, start: float, end: float, parts: list[list[Any]], passes: int,
              passed: list = ()) -> None:
        line = orjson.dumps({"stage": stage, "instance": self.instance, "worker": worker, "start": start, "end": end,
                             "parts": parts, "passes": passes, "passed": passed}) + b"\n"
        with self._lock:
            try:
                # Opened for each line, appending: the launcher's copy-then-truncate rotation and a
                # deleted file both leave the next line landing in the file of that name.
                with open(self.path, "ab") as f:
                    f.write(line)
                self._failing = False
            except OSError as e:  # a full or vanished log folder costs the log, never the stage
                if not self._failing:
                    log.warning("cannot write the schedule log %s: %s (lines are dropped until it can)", self.path, e)
                self._failing = True


def read(path: str | Path, since: float = float("-inf")) -> list[dict[str, Any]]:
    """The chunks of a schedule log (and of its rotated parts, oldest first) that started at
    ``since`` or later, in start order; a line that is not a whole chunk (torn by a crash, or
    written by something else) is skipped."""
    path = Path(path)
    parts = sorted(path.parent.glob(path.name + ".*"), key=lambda p: -int(p.suffix[1:]) if p.suffix[1:].isdigit()
                   else 0)
    out = []
    for p in [*parts, path]:
        try:
            text = p.read_bytes()
        except OSError:
            continue
        for line in text.splitlines():
            try:
                c = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if _whole(c) and c["start"] >= since:
                out.append(c)
    return sorted(out, key=lambda c: c["start"])


def _whole(c: Any) -> bool:
    """Whether ``c`` is a chunk as ``ScheduleLog.chunk`` writes it."""
    return (isinstance(c, dict) and all(isinstance(c.get(k), str) for k in ("stage", "instance", "worker"))
            and all(isinstance(c.get(k), (int, float)) and not isinstance(c.get(k), bool) for k in ("start", "end"))
            and isinstance(c.get("passes"), int) and isinstance(c.get("parts"), list)
            and all(isinstance(p, list) and len(p) >= 3 and isinstance(p[0], list) and isinstance(p[1], list)
                    and all(isinstance(u, str) for u in p[1]) for p in c["parts"]))
