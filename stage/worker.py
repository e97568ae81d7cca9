"""A TaskWorker (DESIGN §6, §6.1): one process per device, executing its scheduler's step plans.

The worker loads its stage's components once, says it is ready, and then keeps request states
resident and does what the scheduler (sched/core.py, through stage/scheduler.py) says:

- ``run``: admit the messages that come with it (the stage function prepares each one's
  state; a function that does not step runs whole here, a one-step task), then advance the
  listed requests ``steps`` steps, compatible states together in one forward pass; a state
  whose last step is done is finished and its result sent at once;
- ``drop``: free these states (cancelled or expired), applied at the next step boundary even
  in the middle of a chunk (in a collaboration group, in a part on the whole group; a part on
  fewer ranks, at the next run's start);
- ``cut``: end run number ``run`` where a chunk of ``every`` steps ends (counted from the run's
  start, one step at least), as if it had been sent that long: the core opened it with all of
  its steps while nothing else waited (sched/core.py). A cut for a run that already ended is
  ignored.

It talks to the scheduler over a ZMQ DEALER socket:

- worker → scheduler: ``[b"ready", {stepped: {app: bool}, ranks}]`` (ranks: a collaboration
  group's size, else 1), ``[b"broken", {error}]`` (it cannot start: its models do not load, or
  its group does not form; it exits), ``[b"admitted", {uid, nbytes}]``,
  ``[b"progress", {uid, fraction}]``, ``[b"done", *message frames]``, ``[b"failed", {uid,
  error}]`` and, when a ``run`` ends, ``[b"idle", {steps: [[uids, seconds], ...], fixed: {uid:
  seconds preparing and finishing}, exec_s}]``;
- scheduler → worker: ``[b"run", {uids, steps, admit: [frames per message], parts: [[ranks,
  uids, steps], ...], run}, *frames]`` (a group's batches side by side, each on its ranks; ``run``
  numbers it), ``[b"drop", {uids}]``, ``[b"cut", {run, every}]``.

Started as ``python -m onepiece.stage.worker '<json config>'``: nothing is pickled.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import zmq

from onepiece.sched.keys import call_key, compat_key
from onepiece.stage.gpu import synchronizer
from onepiece.stage.registry import SteppedTask
from onepiece.stage.threads import ThreadChoice
from onepiece.transport.message import Message, MessageError, decode, encode

log = logging.getLogger("onepiece.stage.worker")

PROGRESS_EVERY_S = 0.2  # progress reports are throttled; the DB only needs a few per second
# Model compute yields the CPU to the latency-critical roles (proxy admission, schedulers, DB,
# NM) when cores are short; it still gets every cycle they leave idle. On CPU the compute is
# the whole load, so the worker goes further: SCHED_IDLE, which any of them preempts on
# waking (a nice value alone still lets a busy worker finish its time slice first).
NICE = 10
GROUP_TIMEOUT_S = 30.0  # a collective that waits longer: a rank is gone (its instance restarts the group)
BROKEN_CHARS = 2000  # of why it cannot start, told to the scheduler (the whole traceback is in the log)
TICK_S = 1.0  # a group's rank 0 hands on an empty command at least this often while idle


def run_task(fn: Any, ctx: Any, msg: Message, report: Any = None) -> dict:
    """Run one request through a stage function alone, step after step (for tests and
    benchmarks; the worker interleaves requests as its scheduler says)."""
    out = fn(ctx, msg)
    if isinstance(out, SteppedTask):
        while not out.step():
            if report is not None:
                report(out.progress)
        out = out.result()
    return out


@dataclass
class Resident:
    task: SteppedTask
    msg: Message
    reported: float = 0.0


class Executor:
    """The worker's side of the step contract: resident states and the commands that act on
    them. Socket-free except ``send``, so the rules can be read in one place."""

    def __init__(self, stage: str, name: str, ctx: Any, functions: dict[str, Any], send: Any,
                 pending_drops: Any, group_run: Any = None, threads: ThreadChoice | None = None) -> None:
        self.stage, self.name, self.ctx, self.functions = stage, name, ctx, functions
        self.send = send  # frames -> None
        # () -> uids the scheduler dropped since (read between steps); cuts that came with them
        # land in ``cuts``
        self.pending_drops = pending_drops
        self.cuts: dict[int, int] = {}  # run number -> the Cut's ``every`` (sched/core.py)
        # A collaboration group's parallel run (stage function's ``parallel``): [(ranks, tasks,
        # steps), ...] -> per part (tasks stepped at each step, seconds). A failure there leaves
        # the ranks apart, so it ends the group (raised).
        self.group_run = group_run
        self.states: dict[str, Resident] = {}
        self.fixed: dict[str, float] = {}  # this run's prepare and finish seconds per stepped request
        self.threads = threads  # torch threads per call or step, by key (None: as configured)
        self.sync = synchronizer(getattr(ctx, "device", "cpu"))  # a step's time is its kernels' time

    def _set_threads(self, key: tuple | None) -> int | None:
        if key is None:  # no choice to make (``self.threads`` is None)
            return None
        import torch

        n = self.threads.pick(key)
        torch.set_num_threads(n)
        return n

    def _took(self, key: tuple | None, threads: int | None, seconds: float) -> None:
        if threads is not None and (chosen := self.threads.observe(key, threads, seconds)) is not None:
            log.info("torch threads for %s: %d (median %s)", "/".join(map(str, key)), chosen,
                     ", ".join(f"{t * 1000:.1f} ms at {n}" for n, t in self.threads.medians(key).items()))

    def fail(self, uid: Any, error: str) -> None:
        self.send([b"failed", orjson.dumps({"uid": uid, "error": error})])

    def drop(self, uids: list[str]) -> None:
        for u in uids:
            self.states.pop(u, None)  # its tensors go with it

    def admit(self, msg: Message) -> bool:
        """Prepare ``msg``'s state, or run it whole if its function does not step; True if it
        was such a one-step call (finished, or failed)."""
        import torch

        uid = msg.uid
        t0 = time.perf_counter()
        msg.mark(self.stage, "start", self.name)
        # (keys only where a choice is made: no string work per call or step otherwise)
        key = None if self.threads is None else ("call", msg.header.get("app"), _params_key(msg, call_key))
        threads = self._set_threads(key)
        try:
            fn = self.functions.get(msg.header.get("app"))
            if fn is None:
                raise ValueError(f"application {msg.header.get('app')!r} is not served by stage {self.stage}")
            with torch.inference_mode():
                out = fn(self.ctx, msg)
        except Exception as e:  # the request fails alone; the worker stays up
            log.exception("uid=%s failed in stage %s", uid, self.stage)
            self.fail(uid, f"{type(e).__name__}: {e}")
            return True
        self._took(key, threads, time.perf_counter() - t0)
        if isinstance(out, SteppedTask):
            self.fixed[uid] = self.fixed.get(uid, 0.0) + time.perf_counter() - t0
            self.states[uid] = Resident(out, msg)
            self.send([b"admitted", orjson.dumps({"uid": uid, "nbytes": int(out.nbytes)})])
            if out.done:
                self._finish(uid)
            return False
        self._deliver(msg, out)
        return True

    def _deliver(self, msg: Message, parts: dict) -> None:
        msg.parts = parts
        msg.mark(self.stage, "end", self.name)
        try:
            out = encode(msg)  # an unsendable result fails this request, not the worker
        except Exception as e:
            log.exception("uid=%s: result cannot travel", msg.uid)
            self.fail(msg.uid, f"{type(e).__name__}: {e}")
            return
        self.send([b"done", *out])

    def _finish(self, uid: str) -> None:
        t0 = time.perf_counter()
        r = self.states.pop(uid)
        try:
            parts = r.task.result()
        except Exception as e:
            log.exception("uid=%s failed finishing in stage %s", uid, self.stage)
            self.fail(uid, f"{type(e).__name__}: {e}")
            return
        self._deliver(r.msg, parts)
        self.fixed[uid] = self.fixed.get(uid, 0.0) + time.perf_counter() - t0

    def run(self, uids: list[str], steps: int, new: list[Message], parts: list | None = None,
            number: int | None = None) -> tuple[list[list[Any]], dict[str, float]]:
        """Admit ``new``, then advance ``uids`` ``steps`` steps, or each of ``parts`` ([ranks,
        uids, steps]: a collaboration group's batches, side by side on their ranks) its own
        steps: the (uids, seconds) of every forward pass (a one-step call counts as one), and
        the seconds each stepped request spent being prepared or finished. A Cut of run
        ``number`` that comes meanwhile ends it early, where a chunk of the Cut's steps ends."""
        import torch

        timings: list[list[Any]] = []
        self.fixed = {}
        for msg in new:
            t0 = time.perf_counter()
            if self.admit(msg):  # a one-step call: its time is the call's cost
                timings.append([[msg.uid], time.perf_counter() - t0])
        for u in uids:
            if u not in self.states and u not in (m.uid for m in new):
                self.fail(u, f"request state is not resident on worker {self.name} of stage {self.stage}")
        parts = [(tuple(r), list(us), int(n)) for r, us, n in parts] if parts else [((0,), list(uids), steps)]
        if self.group_run is not None:
            self._run_group(parts, timings)
            return timings, self.fixed
        self.cuts = {}  # a cut of an earlier run came too late for it
        every = None
        for i in range(max(n for _, _, n in parts)):
            # A step's time is all the worker spends on it: the forward pass and its own
            # bookkeeping (drops, grouping, progress), but not finishing a request (fixed).
            t_iter = time.perf_counter()
            self.drop(self.pending_drops())
            every = every or self.cuts.get(number)
            if every and i and i % every == 0:
                break
            batches = []  # (ranks, task class, uids)
            for ranks, part, n in parts:
                groups: dict[Any, list[str]] = collections.defaultdict(list)
                for u in part if i < n else ():  # the scheduler batched by key; the tensors have the last word
                    if u in self.states and not self.states[u].task.done:
                        t = self.states[u].task
                        groups[(type(t), t.key)].append(u)
                batches += [(ranks, cls, group) for (cls, _), group in groups.items()]
            if not batches:
                break
            shared = (time.perf_counter() - t_iter) / len(batches)
            for _, cls, group in batches:
                key = None if self.threads is None else (
                    "step", _params_key(self.states[group[0]].msg, compat_key), len(group))
                threads = self._set_threads(key)
                t0 = time.perf_counter()
                try:
                    with torch.inference_mode():
                        cls.step_batch([self.states[u].task for u in group])
                    self.sync()
                    self._took(key, threads, time.perf_counter() - t0)
                except Exception:
                    log.exception("batched step of %s failed; stepping each alone", group)
                    group = self._step_alone(group)
                finishing = self._after_step(group)
                timings.append([group, time.perf_counter() - t0 - finishing + shared])
        return timings, self.fixed

    def _run_group(self, parts: list, timings: list[list[Any]]) -> None:
        """A collaboration group's run: its parts side by side, each on its ranks for its steps
        (stage function's parallel run). Drops are taken at the run's start and, in a part on
        the whole group, before every step, on every rank alike (``pending_drops`` is a
        collective there)."""
        import torch

        self.drop(self.pending_drops())
        batches = [(ranks, group, n) for ranks, part, n in parts
                   if (group := [u for u in part if u in self.states and not self.states[u].task.done])]
        if not batches:
            return

        def leave_out(i: int) -> set[int]:
            gone = self.pending_drops()
            self.drop(gone)
            return {j for j, u in enumerate(batches[i][1]) if u in gone}

        with torch.inference_mode():
            out = self.group_run([(ranks, [self.states[u].task for u in group], n) for ranks, group, n in batches],
                                 leave_out)
        for (_, group, _), (live_at, seconds) in zip(batches, out):
            for live in live_at:
                timings.append([[group[j] for j in live], seconds / len(live_at)])
            self._after_step(group)

    def _after_step(self, group: list[str]) -> float:
        """Finish what is done, report progress of the rest; the seconds finishing took."""
        before = sum(self.fixed.get(u, 0.0) for u in group)
        now = time.monotonic()
        for u in group:
            r = self.states.get(u)
            if r is None:
                continue
            if r.task.done:
                self._finish(u)
            elif now - r.reported >= PROGRESS_EVERY_S:
                r.reported = now
                self.send([b"progress", orjson.dumps({"uid": u, "fraction": r.task.progress})])
        return sum(self.fixed.get(u, 0.0) for u in group) - before

    def _step_alone(self, group: list[str]) -> list[str]:
        """After a batch failed: each alone, so one bad request fails only itself."""
        ok = []
        for u in group:
            try:
                self.states[u].task.step()
                ok.append(u)
            except Exception as e:
                log.exception("uid=%s failed in stage %s", u, self.stage)
                self.states.pop(u, None)
                self.fail(u, f"{type(e).__name__}: {e}")
        return ok


def main(config: dict[str, Any]) -> None:
    import torch

    from onepiece.stage.loader import load_components
    from onepiece.stage.collective import pack, unpack
    from onepiece.stage.registry import StageContext, is_stepped, lookup, parallel_of

    name = f"{config['instance']}/{config['identity']}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    try:  # a scheduling hint: where a sandbox forbids it, the worker runs as it is
        os.nice(NICE)
        if str(config["device"]).startswith("cpu"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError as e:
        log.warning("could not lower this worker's CPU priority: %s", e)
    # Threads as configured, else on CPU 1 or all cores per call and step, whichever is faster
    # there (stage/threads.py); a collaboration group's ranks keep one setting, so that their
    # replicas of every state compute alike.
    threads = None
    if config.get("threads"):
        torch.set_num_threads(int(config["threads"]))
    elif str(config["device"]).startswith("cpu") and not config.get("group") and torch.get_num_threads() > 1:
        threads = ThreadChoice(torch.get_num_threads())
    stage, function, kinds = config["stage"], config["function"], config["kinds"]

    # A collaboration group (config "group": rank, size, address): every rank loads the models
    # and keeps every state; rank 0 alone talks to the scheduler and hands each command on.
    leader = not config.get("group") or int(config["group"]["rank"]) == 0
    sock = None
    if leader:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, config["identity"].encode())
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(config["scheduler"])

    def broken(error: str) -> None:
        """Said to the scheduler too (the NM's status and `onepiece up` show it): otherwise the
        cause of a stage that never gets ready is only in this log. The traceback follows there."""
        if sock is not None:
            sock.send_multipart([b"broken", orjson.dumps({"error": error[:BROKEN_CHARS]})])
            zmq.Context.instance().destroy(linger=1000)  # delivered before the exit

    coll = None
    if config.get("group"):
        from onepiece.stage.collective import Collective

        g = config["group"]
        try:
            coll = Collective(int(g["rank"]), int(g["size"]), g["address"], config["device"], GROUP_TIMEOUT_S)
        except Exception as e:  # a group that cannot form restarts forever: say why, as a load error does
            broken(f"its collaboration group does not form: {type(e).__name__}: {e}")
            raise

    t0 = time.monotonic()
    try:
        components = load_components(Path(config["model_dir"]), config["components"], config["device"])
    except Exception as e:
        broken(f"its models do not load: {type(e).__name__}: {e}")
        raise
    ctx = StageContext(components, config["device"])
    log.info("loaded %s for stage %s in %.1fs (%s torch threads)", config["components"], stage,
             time.monotonic() - t0, torch.get_num_threads() if threads is None else f"1 or {torch.get_num_threads()}")
    functions = {app: lookup(function, kind) for app, kind in kinds.items()}
    group_run = None
    if coll is not None:
        makers = {parallel_of(function, kind) for kind in kinds.values()}
        if len(makers) != 1:
            raise ValueError("a collaboration group needs one parallel step for all its applications")
        group_run = makers.pop()(coll).run
        coll.barrier()  # every rank has loaded before rank 0 says ready
    stash: collections.deque = collections.deque()  # commands that came while a chunk ran

    def receive(timeout_ms: int) -> list | None:
        if stash:
            return stash.popleft()
        return sock.recv_multipart(copy=False) if sock.poll(timeout_ms, zmq.POLLIN) else None

    def next_command() -> list | None:
        """The next command, or None after a quiet second (the group shares those too, so that
        no rank's wait reaches the group's timeout)."""
        if coll is None:
            return receive(1000)
        if leader:
            frames = receive(int(TICK_S * 1000))
            coll.share(pack([f.bytes for f in frames]) if frames else b"")
            return frames
        data = coll.share(None)
        return [zmq.Frame(f) for f in unpack(data)] if data else None

    def pending_drops() -> list[str]:
        """Drops that arrived since the last look (between two steps; in a group, the same on
        every rank: every rank calls it at the same point); cuts go to the executor's ``cuts``
        (a group's runs are never cut); anything else waits."""
        out: list[str] = []
        while leader and sock.poll(0, zmq.POLLIN):
            frames = sock.recv_multipart(copy=False)
            if frames[0].bytes == b"drop":
                out += _uids(frames)
            elif frames[0].bytes == b"cut":
                _cut(frames, ex.cuts)
            else:
                stash.append(frames)
        if coll is not None:  # none (the usual case) costs one 8-byte broadcast
            shared = coll.share((orjson.dumps(out) if out else b"") if leader else None)
            out = orjson.loads(shared) if shared else []
        return out

    def send(frames: list) -> None:
        if leader:  # the group's other ranks hold the same states and say nothing
            sock.send_multipart(frames, copy=False)

    ex = Executor(stage, name, ctx, functions, send, pending_drops, group_run, threads)
    send([b"ready", orjson.dumps({"stepped": {app: is_stepped(function, kind) for app, kind in kinds.items()},
                                  "ranks": coll.size if coll is not None else 1})])
    parent = os.getppid()
    while True:
        frames = next_command()
        if frames is None:
            if os.getppid() != parent:  # the instance is gone; nothing will ever come
                return
            continue
        what = frames[0].bytes
        if what == b"drop":
            ex.drop(_uids(frames))
        elif what == b"cut":  # its run ended before it came
            continue
        elif what == b"run":
            t0 = time.perf_counter()
            try:
                cmd = orjson.loads(frames[1].bytes)
                uids, steps, sizes, parts = cmd["uids"], int(cmd["steps"]), cmd["admit"], cmd.get("parts")
                number = cmd.get("run")
                new, at = [], 2
                for n in sizes:
                    new.append(decode(frames[at:at + n]))
                    at += n
            except (MessageError, orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                # A scheduler bug, not a client's: what it named fails, and the worker stays idle.
                log.error("malformed run command: %s", e)
                for u in _uids(frames):
                    ex.drop([u])
                    ex.fail(u, f"malformed run command: {e}")
                send([b"idle", orjson.dumps({"steps": [], "fixed": {}, "exec_s": 0.0})])
                continue
            timings, fixed = ex.run(uids, steps, new, parts, number)
            send([b"idle", orjson.dumps({"steps": timings, "fixed": fixed, "exec_s": time.perf_counter() - t0})])


def _params_key(msg: Message, key: Any) -> str:
    """``key`` (a sched.keys function) of the request's params: what its cost depends on."""
    params = msg.header.get("params")
    return key(params if isinstance(params, dict) else {})


def _cut(frames: list, cuts: dict[int, int]) -> None:
    """Note a cut ({"run": number, "every": steps}); a malformed one is a scheduler bug: logged."""
    try:
        cmd = orjson.loads(frames[1].bytes)
        run, every = cmd["run"], cmd["every"]
        if type(run) is not int or type(every) is not int or every < 1:
            raise ValueError(f"run and every must be ints, every at least 1: {cmd!r}"[:200])
    except (orjson.JSONDecodeError, KeyError, TypeError, IndexError, ValueError) as e:
        log.error("malformed cut command: %s", e)
        return
    cuts[run] = every


def _uids(frames: list) -> list[str]:
    try:
        uids = orjson.loads(frames[1].bytes)["uids"]
        return [u for u in uids if isinstance(u, str)]
    except (orjson.JSONDecodeError, KeyError, TypeError, IndexError):
        return []


if __name__ == "__main__":
    main(orjson.loads(sys.argv[1]))
