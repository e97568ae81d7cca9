"""The RequestScheduler (DESIGN §6, §6.1): the I/O shell around the stage's scheduling core.

The decisions are the core's (sched/core.py: which requests advance, batched how, on which
worker, for how many steps); this shell only moves things between it and the world:

- the data receiver → ``core.add`` (header checked first), up to the stage's queue bound: when
  the queue is full it stops reading, so the transport's own bounds push back on senders;
- the workers (a ZMQ ROUTER; workers are executors, stage/worker.py) ↔ the core's commands and
  the workers' reports (admitted, progress, done, failed, idle with each step's time);
- the set's DBs' ``cancel`` events (a DELETE of a request that is not finished) → ``core.cancel``:
  a request cancelled before it arrives is dropped on arrival, one in a worker at its next
  step boundary;
- the outcomes (results, failures with the reason, progress) → the ResultDeliver's mailbox.

It alone knows what each worker holds, so it turns a dead or hung worker's requests into
failures. A message for another stage (sent on a route table from before this instance moved)
is handed to the deliverer to forward. It also keeps the instance's utilization (seconds
workers ran a chunk over worker-wall seconds, nm/utilization.py), its service times and its
cost model, which go out with every heartbeat.
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import threading
import time
from typing import Any, Callable

import orjson
import zmq

from onepiece.config import Workflow
from onepiece.droplog import log_dropped
from onepiece.events import CANCEL, MAX_EVENT_BYTES, read_event
from onepiece.sched.core import Cut, Drop, Run, SchedCore, chunk_steps
from onepiece.sched.costs import CostModel
from onepiece.sched.deadlines import stage_request
from onepiece.sched.keys import at_dop, call_key, compat_key, shape_key
from onepiece.sched.policy import Request
from onepiece.schema import checked, is_name
from onepiece.stage.reports import REPORTS, Admitted, Broken, Failed, Idle, Progress, Ready
from onepiece.stage.schedule_log import ScheduleLog
from onepiece.stage.service_times import ServiceTimes
from onepiece.stage.stats import SchedulerStats
from onepiece.task_header import TaskHeader
from onepiece.transport import curve
from onepiece.transport.base import Receiver
from onepiece.transport.message import Message, MessageError, decode, encode, now_ns
from onepiece.transport.wake import Wake
from onepiece.transport.zmq_transport import peer_of

log = logging.getLogger(__name__)

BUSY_TURN_MS = 50  # while it holds requests: deadlines, aging and hung workers are checked this often
IDLE_TURN_MS = 500  # holding none: only routes and stats need a turn (a worker's death wakes it)
HUNG_GRACE_S = 10.0  # a chunk still running this long past every member's deadline (at least 3 steps): hung
MAX_CANCELLED = 65_536  # cancelled uids remembered, to drop them if they arrive later


class RequestScheduler:
    def __init__(self, stage: str, receiver: Receiver, worker_address: str, workflow: Workflow, outbox: "queue.Queue",
                 stats: SchedulerStats | None = None, routes: Callable[[], dict] | None = None,
                 costs: dict[str, dict[int, float]] | None = None, fixed: dict[str, float] | None = None,
                 schedule_log: ScheduleLog | None = None) -> None:
        spec = workflow.stages[stage]
        self.stage, self.receiver, self.capacity, self.outbox = stage, receiver, spec.queue, outbox
        self.apps = workflow.applications  # their limits hold here too, whatever path a request took
        self.routes = routes or (lambda: {})
        ctx = zmq.Context.instance()
        self.workers = ctx.socket(zmq.ROUTER)
        self.workers.setsockopt(zmq.LINGER, 0)
        self.workers.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker reuses its identity
        # No CURVE: the workers' ipc socket lives in this instance's private folder (mode 0700).
        self.workers.bind(worker_address)
        self.worker_address = self.workers.getsockopt_string(zmq.LAST_ENDPOINT)
        self.events = ctx.socket(zmq.SUB)  # the set's DBs: cancellations
        self.events.setsockopt(zmq.LINGER, 0)
        self.events.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_BYTES)
        self.events.setsockopt(zmq.SUBSCRIBE, CANCEL)
        curve.client(self.events)  # the DBs' events socket admits members only
        self._dbs: set[str] = set()
        self._dbs_version: Any = None
        # from a table (its rows and per-request figures), if given; measured from here on
        self.core = SchedCore(spec.schedule, CostModel(costs, fixed=fixed))
        self.msgs: dict[str, Message] = {}  # waiting requests' messages, sent on with their admission
        self.shapes: dict[str, str] = {}  # the shape key of every request in the core
        self.sample_later: dict[str, list[Request]] = {}  # per worker: finished, not yet sampled
        self.fixed: dict[str, float] = {}  # seconds spent preparing and finishing each stepped request
        self.stepped: dict[str, bool] | None = None  # per app, from the workers (None: none ready yet)
        self.known: set[bytes] = set()  # workers that said ready at least once
        self.fresh: set[bytes] = set()  # workers whose first chunk (JIT, allocator warm-up) is not a sample
        self.born: dict[bytes, float] = {}
        # worker -> (sent at, decision time, uids, last deadline, hung grace, for the schedule log
        # (sent at, epoch; its parts; the requests its decision passed over) or None) of its chunk in flight
        self.running: dict[bytes, tuple[float, float, tuple[str, ...], float | None, float, tuple | None]] = {}
        self._runs = 0  # runs sent: each numbered, so that a Cut ends the run it was meant for
        self._run_of: dict[str, int] = {}  # worker -> the number of the last run sent to it
        self.schedule_log = schedule_log
        self.core.explain = schedule_log is not None
        # uid -> when its latest cancel was heard (ns since epoch): a request of that uid stamped
        # later by a proxy (an Idempotency-Key reused once the DBs forgot the deleted video) is new.
        self.cancelled: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.cancelled_on_arrival = 0
        # ("died", identity, reason, t): worker_died(); ("fenced", uids, reason, t): fence()
        self.control: queue.Queue = queue.Queue(maxsize=256)
        self.wake = Wake()  # the loop's poll returns at once: a worker died, or the stage stops
        self.wake_at = math.inf  # Decision.wake: when the core must be asked again although nothing happens
        self.hung: queue.Queue = queue.Queue(maxsize=256)  # identities for the TaskManager to kill
        self.stats = stats or SchedulerStats()
        self.stats.capacity = spec.queue
        self.stats.policy, self.stats.max_batch = spec.schedule.policy, self.core.max_batch
        self._service = ServiceTimes()
        self._reported = 0.0
        self._clock = time.monotonic()

    # --- outcomes go to the ResultDeliver's mailbox ---------------------------------------
    def _emit(self, item: tuple) -> None:
        if item[0] == "progress":  # advisory: dropped rather than waited for
            try:
                self.outbox.put_nowait(item)
            except queue.Full:
                pass
            return
        try:
            self.outbox.put(item, timeout=30.0)
        except queue.Full:  # the deliverer is wedged; the DB's deadline sweep reports the request
            uid = item[1] if item[0] in ("failed", "gone") else item[1].uid
            log.error("deliver mailbox full for 30s; dropped %s for uid=%s", item[0], uid)

    def _fail(self, uid: str, app: str, error: str, logged: bool = False) -> None:
        self.stats.failed += 1
        self.msgs.pop(uid, None)
        self.shapes.pop(uid, None)
        self.fixed.pop(uid, None)
        if not logged:
            log.warning("uid=%s failed at %s: %s", uid, self.stage, error)
        self._emit(("failed", uid, app, error))

    # --- the loop ---------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(self.workers, zmq.POLLIN)
        poller.register(self.events, zmq.POLLIN)
        poller.register(self.wake.fd, zmq.POLLIN)
        handle = getattr(self.receiver, "sock", None)
        reading = False
        while not stop.is_set():
            want_read = self.stepped is not None and self.core.waiting() < self.capacity
            if handle is not None and want_read != reading:
                if want_read:
                    poller.register(handle, zmq.POLLIN)
                else:
                    poller.unregister(handle)
                reading = want_read
            # A receiver without a socket (the ring) is polled in memory, so the turn is short.
            turn = (BUSY_TURN_MS if self.core.requests or self.running else IDLE_TURN_MS) if handle is not None else 1
            if self.wake_at < math.inf:  # a held run's promise runs out then: decide (and cut it) on time
                turn = max(1, min(turn, math.ceil((self.wake_at - time.monotonic()) * 1000)))
            events = dict(poller.poll(turn))
            self._account()
            try:
                if self.wake.fd in events:
                    self.wake.clear()
                if self.workers in events:
                    self._from_workers()
                if self.events in events:
                    self._cancellations()
                if want_read and (handle is None or handle in events):
                    self._intake()
                self._control()
                self._follow_dbs()
                self._reclaim_hung()
                self._decide()
                self._update_stats()
            except Exception:  # the last guard: what one turn hit must not stop the stage
                log.exception("scheduler of %s: a turn failed; serving on", self.stage)
                time.sleep(0.05)  # a fault that repeats every turn logs 20 lines a second, not thousands

    def _intake(self) -> None:
        now = time.monotonic()
        while self.core.waiting() < self.capacity:
            msg = self.receiver.recv(0)
            if msg is None:
                break
            self.stats.received += 1
            try:
                self._accept(msg, now)
            except Exception:  # one the checks let through and that still breaks: dropped alone
                log.exception("uid=%s: dropped a message from %s that broke intake at %s", msg.header.get("uid"),
                              msg.sender or "?", self.stage)

    def _accept(self, msg: Message, now: float) -> None:
        """Check one message and hand it to the core (or on, or fail it)."""
        try:
            h = checked(TaskHeader, msg.header)
            if h.stage != self.stage:
                self.stats.forwarded += 1
                self._emit(("forward", msg))
                return
            stepped = self.stepped.get(h.app) if self.stepped else None
            if stepped is None or h.app not in self.apps:
                raise ValueError(f"app: application {h.app!r} is not served by stage {self.stage}")
            limits = self.apps[h.app].limits
            params = self.apps[h.app].check_params(h.params)  # at every stage, stepped or not
            steps = params.steps if stepped else 1
        except ValueError as e:
            uid, app = msg.header.get("uid"), msg.header.get("app")
            why = f"malformed request at stage {self.stage}: {e}"
            receiver = f"stage {self.stage} at {self.receiver.address}"
            if is_name(uid):  # a uid the DB takes: the client learns why
                log_dropped(log, receiver, str(e), "uid=%s failed at %s: %s (sent by %s)", uid, self.stage, why,
                            msg.sender or "?")
                self._fail(uid, app if isinstance(app, str) else "", why, logged=True)
            else:
                log_dropped(log, receiver, str(e), "dropped a message from %s without a usable uid: %s",
                            msg.sender or "?", why)
            return
        if self.is_cancelled(msg.header):
            self.cancelled_on_arrival += 1
            log.info("uid=%s dropped on arrival: cancelled", h.uid)
            self._emit(("gone", h.uid))
            return
        t_ns = now_ns()
        msg.header["deadline"] = h.deadline = h.held_to(t_ns, limits.timeout_s)
        key = compat_key(h.params) if stepped else call_key(h.params)
        r = stage_request(h.uid, h.app, key, steps, now, now + (h.deadline - t_ns) / 1e9,
                          None if h.target is None else now + (h.target - t_ns) / 1e9,
                          h.reserve.get(self.stage, 0.0), h.priority, batchable=stepped)
        try:
            self.core.add(r)
        except ValueError:  # the same request twice (a duplicate forward): one is enough
            log.warning("uid=%s arrived twice at %s; dropped the copy", h.uid, self.stage)
            return
        msg.header["trace"] = h.trace
        msg.mark(self.stage, "recv")
        self.msgs[h.uid] = msg
        self.shapes[h.uid] = shape_key(h.params)

    def _decide(self) -> None:
        t0 = time.perf_counter()
        d = self.core.schedule(time.monotonic())
        decided = time.perf_counter() - t0
        self.wake_at = d.wake
        for r in d.expired:
            self._fail(r.uid, r.app, f"deadline exceeded at stage {self.stage} "
                                     f"({'in a worker' if r.worker else 'waiting'}, {r.done}/{r.steps} steps done)")
        for cmd in d.commands:
            if isinstance(cmd, Drop):
                self._send(cmd.worker, [b"drop", orjson.dumps({"uids": list(cmd.uids)})])
            elif isinstance(cmd, Cut):
                run = self._run_of.get(cmd.worker)
                if run is not None:
                    self._send(cmd.worker, [b"cut", orjson.dumps({"run": run, "every": cmd.every})])
            else:
                self._run(cmd, decided, d.passed)

    def _run(self, cmd: Run, decided: float, passed: list) -> None:
        frames, sizes = [], []
        now = time.monotonic()
        for uid in cmd.admit:
            msg = self.msgs.pop(uid)
            r = self.core.requests[uid]
            self.stats.queue_wait.observe(now - r.arrival)
            f = encode(msg)
            frames += f
            sizes.append(len(f))
        for p in cmd.parts:
            self.stats.batch_size.observe(len(p.uids))
        rs = [self.core.requests[u] for u in cmd.uids]
        # The chunk's last deadline, and how long a step of it may take before it looks hung.
        deadline = None if any(r.expires is None for r in rs) else max(r.expires for r in rs)
        step = max(self.core.costs.step_s(at_dop(self.core.requests[p.uids[0]].key, len(p.ranks)), len(p.uids)) or 0.0
                   for p in cmd.parts)
        if deadline is not None and not self.core.spec.drop_expired:
            # Kept past their deadlines (nothing stops the chunk there): hung only once it has
            # also outlasted its own steps; with no step measured, nothing to judge it by.
            deadline = max(deadline, now + cmd.steps * step) if step else None
        parts = [[list(p.ranks), list(p.uids), p.steps] for p in cmd.parts]
        logged = None
        if self.schedule_log is not None:  # each part with its key, for a reader to tell shapes apart
            requests = self.core.requests
            logged = (time.time(), [p + [requests[p[1][0]].key] for p in parts], passed)
        self.running[cmd.worker.encode()] = (now, decided, cmd.uids, deadline, max(HUNG_GRACE_S, 3 * step), logged)
        self._runs += 1
        self._run_of[cmd.worker] = self._runs
        self._send(cmd.worker, [b"run", orjson.dumps({"uids": list(cmd.uids), "steps": cmd.steps, "admit": sizes,
                                                      "parts": parts, "run": self._runs}), *frames])
        for uid in cmd.admit:  # after the hand-over: the DB's update must not hold the worker's start up
            self._emit(("progress", uid, self.core.requests[uid].app, 0.0))

    def _send(self, worker: str, frames: list) -> None:
        try:
            self.workers.send_multipart([worker.encode(), *frames], copy=False)
        except zmq.ZMQError as e:  # a worker that just died: its death notice fails what it held
            log.warning("could not reach worker %s of %s: %s", worker, self.stage, e)

    # --- what workers report ----------------------------------------------------------------
    def _from_workers(self) -> None:
        while True:
            try:
                frames = self.workers.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frames[0].bytes
            tag = frames[1].bytes if len(frames) > 1 else b""
            try:
                if tag == b"done":
                    self._done(ident.decode(errors="replace"), frames[2:])
                elif tag in REPORTS and len(frames) == 3:
                    self._report(ident, checked(REPORTS[tag], orjson.loads(frames[2].bytes), tag.decode()))
                else:
                    raise ValueError(f"{len(frames) - 1} frames tagged {tag[:16]!r}")
            except Exception as e:  # a worker bug: its report is dropped, the scheduler goes on
                log.error("dropped a report from worker %r of %s: %s", ident[:64], self.stage, e)

    def _report(self, ident: bytes, info: Any) -> None:
        wid = ident.decode()
        if isinstance(info, Ready):
            if wid in self.core.workers:  # restarted before its death was noticed
                self._lost(wid, "restarted")
            self.stepped = dict(info.stepped)
            self.core.worker_up(wid, info.ranks)
            self.known.add(ident)
            self.fresh.add(ident)
            self.born[ident] = time.monotonic()
            self.running.pop(ident, None)
            self.stats.serving = True
            self.stats.worker_error = ""
        elif isinstance(info, Broken):  # it exits: its death is handled as any other
            log.error("worker %s of %s fails to start: %s", wid, self.stage, info.error)
            self.stats.worker_error = info.error
        elif isinstance(info, Admitted):
            self.core.admitted(wid, info.uid, info.nbytes)
        elif isinstance(info, Progress):
            r = self.core.requests.get(info.uid)
            if r is not None:
                self._emit(("progress", r.uid, r.app, info.fraction))
        elif isinstance(info, Failed):
            r = self.core.failed(info.uid)
            if r is not None:
                self._fail(r.uid, r.app, info.error)
        elif isinstance(info, Idle):
            measured = ident not in self.fresh
            self.fresh.discard(ident)
            run = self.running.pop(ident, None)
            if run is not None and run[5] is not None and self.schedule_log is not None:
                self.schedule_log.chunk(self.stage, wid, run[5][0], time.time(), run[5][1], len(info.steps), run[5][2])
            try:
                self._learn(wid, info, measured)
                if run is not None and measured:
                    self.core.note_overhead(time.monotonic() - run[0] - info.exec_s + run[1])
            finally:  # whatever its figures did, the worker is free again (else only the hung killer frees it)
                self.core.idle(wid)

    def _learn(self, wid: str, info: Idle, measured: bool) -> None:
        """What a run teaches: its steps' times, and the service times of the requests it ended."""
        for uids, seconds, first, times in chunk_steps(info.steps):
            self.core.stepped(uids, seconds, measure=measured, first=first, times=times)
            if measured:
                for _ in range(times):
                    self.stats.step_time.observe(seconds)
        if measured:
            for uid, seconds in info.fixed.items():
                self.fixed[uid] = self.fixed.get(uid, 0.0) + seconds
        for r in self.sample_later.pop(wid, []):
            self._sample(r)

    def _done(self, wid: str, rest: list) -> None:
        """A finished request's result message."""
        try:
            msg = decode(rest)
        except MessageError as e:  # a worker bug, not a client's: nothing to attribute it to
            log.error("worker %s of %s returned a malformed result: %s", wid, self.stage, e)
            return
        r = self.core.finished(msg.uid, time.monotonic())
        if r is None:  # cancelled or expired while it ran: nobody wants it
            self._emit(("gone", msg.uid))
            return
        self.stats.completed += 1
        self.sample_later.setdefault(wid, []).append(r)  # once its chunk's step times are known
        self._emit(("result", msg))

    def _sample(self, r: Request) -> None:
        """A finished request's service times, from the cost model: alone (its standalone time,
        what its latency is predicted from) and its share of the device at the batch sizes the
        stage reaches (what its rate is)."""
        fixed = self.fixed.pop(r.uid, None)
        if fixed is not None:
            self.core.costs.observe_fixed(r.key, fixed)
        shape = self.shapes.pop(r.uid, None)
        if shape is not None:
            self._service.finished(self.core, r, shape)

    def _lost(self, wid: str, reason: str) -> None:
        self._run_of.pop(wid, None)
        for r in self.sample_later.pop(wid, []):
            self.shapes.pop(r.uid, None)
            self.fixed.pop(r.uid, None)
        for r in self.core.worker_gone(wid):
            self._fail(r.uid, r.app, f"worker {wid} of stage {self.stage} {reason}")

    def worker_died(self, ident: bytes, reason: str, t: float) -> None:
        """From the TaskManager's thread: the worker ``ident`` exited at ``t``."""
        # Counted here, its only writer: once the worker is back nothing else said it had died.
        self.stats.worker_deaths += 1
        self.control.put(("died", ident, reason, t))
        self.wake.set()

    def fence(self, uids: list[str], reason: str) -> None:
        """From the membership thread: the NM declared this instance dead (``reason``) and reported
        ``uids`` failed (nm/fencing.py); they are dropped on the scheduler's thread, as cancels."""
        try:
            self.control.put(("fenced", list(uids), reason, time.monotonic()), timeout=5.0)
        except queue.Full:  # (the loop drains it every turn: a wedged scheduler)
            log.error("scheduler of %s: control queue full; %d fenced request(s) not dropped", self.stage, len(uids))
        self.wake.set()

    def _control(self) -> None:
        while True:
            try:
                what, subject, reason, t = self.control.get_nowait()  # subject: a worker, or uids
            except queue.Empty:
                return
            if what == "fenced":
                self._fenced(subject, reason)
            elif what == "died" and self.born.get(subject, -1.0) < t:  # not a newer incarnation
                self.known.discard(subject)
                self.running.pop(subject, None)
                self._lost(subject.decode(), f"died ({reason})")

    def _fenced(self, uids: list[str], reason: str) -> None:
        """Drop what the NM reported failed for us: queued or resident, as a cancel does (a worker
        frees its state at its next step boundary), and on arrival if it comes later."""
        queued = resident = 0
        for uid in uids:
            r = self.core.requests.get(uid)
            if r is not None:
                queued += r.worker is None
                resident += r.worker is not None
            self.cancel(uid)
        log.warning("stage %s dropped %d queued and %d resident request(s) (of the %d reported failed when the node "
                    "manager declared this instance dead: %s)", self.stage, queued, resident, len(uids), reason)

    # --- cancellation -----------------------------------------------------------------------
    def _follow_dbs(self) -> None:
        routes = self.routes()
        if routes.get("version") == self._dbs_version:
            return
        self._dbs_version = routes.get("version")
        want = {d.get("events") for d in routes.get("dbs", []) if isinstance(d, dict) and d.get("events")}
        for addr in want - self._dbs:
            try:
                self.events.connect(addr)
            except zmq.ZMQError as e:
                log.warning("cannot subscribe to DB events at %s: %s", addr, e)
                continue
            self._dbs.add(addr)
        for addr in self._dbs - want:
            try:
                self.events.disconnect(addr)
            except zmq.ZMQError:
                pass
            self._dbs.discard(addr)

    def _cancellations(self) -> None:
        while True:
            try:
                frames = self.events.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                uid = read_event(frames, CANCEL).uid
            except ValueError as e:
                log.warning("ignored a cancel event from %s: %s", peer_of(frames[0]), e)
                continue
            self.cancel(uid)

    def is_cancelled(self, header: dict[str, Any]) -> bool:
        """Whether the request of this message header was cancelled: a cancel of its uid was heard
        after its proxy stamped it (``ts``). Read by the deliverer's thread too (dict lookups)."""
        heard = self.cancelled.get(header.get("uid"))  # type: ignore[arg-type]
        ts = header.get("ts")
        return heard is not None and (not isinstance(ts, int) or ts <= heard)

    def cancel(self, uid: str) -> None:
        """Forget ``uid`` here and drop it if it arrives later (a copy created before now)."""
        self.cancelled[uid] = now_ns()
        self.cancelled.move_to_end(uid)
        while len(self.cancelled) > MAX_CANCELLED:
            self.cancelled.popitem(last=False)
        known = uid in self.core.requests or uid in self.msgs
        self.msgs.pop(uid, None)
        self.shapes.pop(uid, None)
        self.fixed.pop(uid, None)
        cmd = self.core.cancel(uid)
        if cmd is not None:
            self._send(cmd.worker, [b"drop", orjson.dumps({"uids": list(cmd.uids)})])
        if known:
            log.info("uid=%s cancelled at %s", uid, self.stage)
            self._emit(("gone", uid))  # no longer held here (every cancel event reaches every stage: only ours)

    # --- hung workers -----------------------------------------------------------------------
    def _reclaim_hung(self, now: float | None = None) -> None:
        """A worker still in a chunk well past the deadline of every request it started it with
        (dropped by then, so it should have stopped at the next step; where expired requests are
        kept, past the chunk's measured steps too) is stuck: fail what it holds and have the
        TaskManager kill it (its restart gives the slot back). ``now``: the monotonic clock's."""
        now = time.monotonic() if now is None else now
        for ident, (sent, _, uids, deadline, grace, _) in list(self.running.items()):
            if deadline is not None and now > deadline + grace:
                del self.running[ident]
                self._lost(ident.decode(), "hung past the deadline")
                try:
                    self.hung.put_nowait(ident)
                except queue.Full:
                    pass

    def _account(self) -> None:
        """Worker time since the last turn, busy and in all, as it was while the loop waited: before
        the turn changes who runs (counted after it, an idle wait before a request was busy time)."""
        s = self.stats
        now = time.monotonic()
        s.busy_s += len(self.running) * (now - self._clock)
        s.slot_s += s.workers * (now - self._clock)
        self._clock = now

    def _update_stats(self) -> None:
        s = self.stats
        now = time.monotonic()
        s.queue, s.ready, s.busy = self.core.waiting(), len(self.known), len(self.running)
        s.resident = len(self.core.requests) - s.queue
        s.resident_bytes = sum(r.nbytes for r in self.core.requests.values() if r.worker is not None)
        c = self.core.stats
        s.preempted, s.expired, s.aged, s.left, s.late = c.preempted, c.expired, c.aged, c.left, c.late
        s.cancelled = c.cancelled + self.cancelled_on_arrival
        s.batches, s.batched = c.batches, c.batched
        if c.rejected != s.refused:  # a policy's plan the core refused: a policy bug, said where one looks
            s.refused, s.last_refused = c.rejected, self.core.rejections[-1]
            log_dropped(log, f"scheduler of {self.stage}", "refused plan", "scheduler of %s refused a plan (%d so far): %s",
                        self.stage, c.rejected, s.last_refused)
        s.overhead_ms = self.core.overhead_s * 1000
        s.overhead_total = [round(self.core.overhead_total[0], 6), self.core.overhead_total[1]]
        s.rejected_frames = getattr(self.receiver, "rejected", 0)
        if now - self._reported >= 0.5:  # the heartbeat reads it about once a second
            s.service = self._service.report()
            s.costs = self.core.costs.report()
            s.cost_totals = self.core.costs.totals()
            self._reported = now

    @property
    def idle_now(self) -> bool:
        """Nothing queued and nothing resident (read from another thread: a hint)."""
        return not self.core.requests

    def close(self, moving_to: str | None = None) -> None:
        """Fail what workers hold, so that nothing is lost silently. Shutting down also fails
        what is queued or waiting in the receiver; moving to another stage (``moving_to``)
        forwards the queue to this stage's other instances and leaves the receiver to the
        next stage's scheduler, which forwards anything that was meant for this one."""
        reason = (f"stage {self.stage} instance shut down" if moving_to is None
                  else f"stage {self.stage} instance moved to {moving_to} before the request finished")
        for r in self.core.resident():
            self._fail(r.uid, r.app, reason)
        if moving_to is None:
            while (msg := self.receiver.recv(0)) is not None:
                self.msgs.setdefault(msg.uid, msg)
        for uid, msg in list(self.msgs.items()):
            if moving_to is None:
                self._fail(uid, msg.header.get("app", ""), reason)
            else:
                self._emit(("forward", msg))
        self.msgs.clear()
        self.shapes.clear()
        self.fixed.clear()
        self.workers.close(linger=0)
        self.events.close(linger=0)
        self.wake.close()
