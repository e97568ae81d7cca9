"""The request monitor (DESIGN §8): admission at the set's measured capacity, a deadline
check, and a bounded in-flight count as the hard cap.

Capacity (``CapacityAdmission``) comes from the NM's view of the set, refreshed with every
heartbeat: a token bucket per application at this proxy's share of the set's rate, and a
refusal for requests predicted to miss their deadline. Both are decided in memory, before the
proxy touches a DB or a stage.

In flight (``InflightTracker``): an accepted request holds a slot until its terminal event
arrives from a DB (``done`` on the DB's events socket) or its deadline passes, whichever comes
first, so a lost event can never leak capacity for longer than one request timeout.
Everything here runs on the proxy's event loop, so reserve-then-insert needs no lock.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq
import zmq.asyncio

from onepiece.events import CANCEL, DONE, MAX_EVENT_BYTES, read_event
from onepiece.nm.capacity import at_shape, predicted_latency
from onepiece.sched.options import DEADLINE_ORDERED
from onepiece.transport import curve
from onepiece.transport.zmq_transport import peer_of

log = logging.getLogger(__name__)


# A request in flight as admission sees it: (seconds to its target, which orders it at a
# deadline-first stage: its slo_s, else its deadline; seconds to the completion it was admitted
# for; its work in seconds at the bottleneck). The two times differ for a request without its own
# timeout_s or slo_s: the stage orders it by the application's limit, admission held it to
# deadline_factor × its standalone.
Ahead = tuple[float, float, float]

PATH_SAMPLES = 32  # latest samples of the path between stages, per application
PATH_MIN_SAMPLES = 3  # before the path counts: a median of 3 outvotes one odd request


class InflightTracker:
    """Accepted-but-not-terminal requests, each with its deadline (ns since epoch), application,
    work at its bottleneck stage (seconds), the completion time it was admitted for and the time
    the stages order it by (ns): admission reads the requests ahead of a new one."""

    def __init__(self, max_inflight: int, on_end: Callable[[str, str], None] | None = None) -> None:
        """``on_end(app, outcome)``: hears how each request left (``release``'s ``outcome``, or
        ``expired``: its deadline passed before any word of its end; the DBs fail it there)."""
        if max_inflight <= 0:
            raise ValueError("max_inflight must be positive")
        self.max_inflight = max_inflight
        self.on_end = on_end
        self._deadlines: dict[str, tuple[int, str, float, int, int]] = {}
        self._last_sweep_ns = 0

    def __len__(self) -> int:
        return len(self._deadlines)

    def __contains__(self, uid: str) -> bool:
        return uid in self._deadlines

    def ahead(self, app: str, now_ns: int) -> list[Ahead]:
        """Every request of ``app`` in flight (see ``Ahead``)."""
        return [((o - now_ns) / 1e9, (p - now_ns) / 1e9, w) for _, a, w, p, o in self._deadlines.values() if a == app]

    def try_admit(self, uid: str, deadline_ns: int, app: str, work_s: float = 0.0, promise_ns: int | None = None,
                  order_ns: int | None = None, now_ns: int | None = None) -> bool:
        """Reserve a slot for ``uid`` until its deadline; False when the set is full.
        ``promise_ns``: the completion time admission held it to; ``order_ns``: the time the
        stages order it by (both default to its deadline)."""
        if len(self._deadlines) >= self.max_inflight:
            now = time.time_ns() if now_ns is None else now_ns
            # A slot may be free already, its deadline passed unseen. The sweep is O(n), so a
            # flood of requests against a full set sweeps at most every 10 ms.
            if now - self._last_sweep_ns > 10_000_000:
                self.sweep(now)
            if len(self._deadlines) >= self.max_inflight:
                return False
        order = deadline_ns if order_ns is None else order_ns
        self._deadlines[uid] = (deadline_ns, app, work_s, order if promise_ns is None else promise_ns, order)
        return True

    def release(self, uid: str, outcome: str | None = None) -> bool:
        """Free ``uid``'s slot (False: it held none); ``outcome``: how the request ended, for
        ``on_end`` (None: it did not, its slot is only given back)."""
        held = self._deadlines.pop(uid, None)
        if held is None:
            return False
        if outcome is not None and self.on_end is not None:
            self.on_end(held[1], outcome)
        return True

    def sweep(self, now_ns: int | None = None) -> int:
        """Drop entries whose deadline passed; returns how many."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        self._last_sweep_ns = now_ns
        expired = [u for u, (d, *_) in self._deadlines.items() if d <= now_ns]
        for u in expired:
            self.release(u, "expired")
        return len(expired)


class DoneWatcher:
    """Subscribes to every DB's events address and reports each terminal uid, and each uid
    deleted before it finished (status None): a request deleted through another proxy of the
    set must free the slot it holds here too, not keep it until its deadline.

    One SUB socket connects to all of them; ``update`` connects new DBs and drops gone ones,
    so the set of DBs can change at runtime. Malformed events are ignored.
    """

    def __init__(self, on_done: Callable[[str, str | None, float | None], None]) -> None:
        self.on_done = on_done
        self.sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_BYTES)
        self.sock.setsockopt(zmq.SUBSCRIBE, DONE)
        self.sock.setsockopt(zmq.SUBSCRIBE, CANCEL)
        curve.client(self.sock)
        self.connected: set[str] = set()
        self._task: asyncio.Task | None = None

    def update(self, addresses: list[str]) -> None:
        want = {a for a in addresses if a}
        for addr in want - self.connected:
            try:
                self.sock.connect(addr)
                self.connected.add(addr)
                log.info("subscribed to DB events at %s", addr)
            except zmq.ZMQError as e:
                log.warning("cannot subscribe to DB events at %s: %s", addr, e)
        for addr in self.connected - want:
            try:
                self.sock.disconnect(addr)
            except zmq.ZMQError:
                pass
            self.connected.discard(addr)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            try:
                frames = await self.sock.recv_multipart(copy=False)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                log.warning("DB events socket error: %s", e)
                await asyncio.sleep(0.1)
                continue
            try:
                topic = CANCEL if bytes(getattr(frames[0], "buffer", frames[0])) == CANCEL else DONE
                ev = read_event(frames, topic)
                self.on_done(ev.uid, ev.status if topic == DONE else None, ev.service_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # one event must not end the watch (ValueError: malformed)
                log.warning("ignored a DB event from %s: %s", peer_of(frames[0]), e)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self.sock.close(linger=0)


# --- the request monitor: admission at the set's measured capacity ----------------------------
# What the monitor refuses a create for (429): capacity, not a bad request (a 400's code is the
# validation's). `onepiece status` tells them apart.
REFUSALS = ("over_capacity", "deadline", "no_capacity", "inflight_full")


@dataclass
class Refusal:
    """Why a create is refused, in the words of the 429 it becomes."""

    code: str  # one of REFUSALS
    message: str
    retry_after_s: int  # whole seconds (HTTP Retry-After), at least 1
    hint: str = "retry later or use another set"  # what the client can do about it


class TokenBucket:
    """A token bucket on an injected monotonic clock (seconds): ``rate`` tokens a second up to
    ``burst``. It starts full, so an idle set takes a burst at once. A take may cost more than
    one token (a request larger than the mean) and more than the burst: it is granted once the
    bucket holds ``min(cost, burst)`` and leaves it in debt, which the rate pays off."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = max(self.stamp, now)

    def rerate(self, rate: float, burst: float, now: float) -> None:
        """Change the rate: what accrued so far accrued at the old one; the level is kept
        (clamped to the new burst), so re-rating never hands out a fresh burst."""
        self._refill(now)
        self.rate, self.burst = rate, burst
        self.tokens = min(self.tokens, burst)

    def try_take(self, now: float, cost: float = 1.0) -> bool:
        self._refill(now)
        if self.tokens >= min(cost, self.burst):
            self.tokens -= cost
            return True
        return False

    def give_back(self, cost: float = 1.0) -> None:
        """Undo a take (the request was refused later for another reason)."""
        self.tokens = min(self.burst, self.tokens + cost)

    def wait_s(self, now: float, cost: float = 1.0) -> float:
        """Seconds until a take of ``cost`` would be granted (inf at rate 0)."""
        self._refill(now)
        need = min(cost, self.burst) - self.tokens
        if need <= 0:
            return 0.0
        return need / self.rate if self.rate > 0 else math.inf


def standalone_latency(app_estimate: dict[str, Any], shape: str, measured: bool = False) -> float | None:
    """Seconds a request of ``shape`` takes through an idle set (no queue anywhere): the sum of
    the stages' service times (``at_shape``; ``measured``: None unless every stage measured the
    shape)."""
    total = 0.0
    for s in app_estimate["stages"].values():
        t = (s["shapes_s"].get(shape) or None) if measured else at_shape(s, shape)
        if t is None:
            return None
        total += t
    return total


def bottleneck_work(app_estimate: dict[str, Any], shape: str) -> float:
    """Seconds of the bottleneck's time a request of ``shape`` takes, per worker there (its
    standalone time at that stage / its workers), or, where the bottleneck is a GPU that stages
    share (``shared_gpu``), the sum of theirs; 0 when not known yet."""
    try:
        shared = app_estimate.get("shared_gpu")
        names = shared["stages"] if shared else [app_estimate["bottleneck"]]
        total = 0.0
        for name in names:
            row = app_estimate["stages"].get(name)
            if row is None:  # a stage of another application on the card: not this request's
                continue
            t = at_shape(row, shape)
            if not t or not row["workers"]:
                return 0.0
            total += float(t) / row["workers"]
        return total
    except (KeyError, TypeError, AttributeError, ZeroDivisionError):
        return 0.0


def deadline_first(app_estimate: dict[str, Any]) -> bool:
    """Whether the application's bottleneck stage serves earlier deadlines first."""
    try:
        return app_estimate["stages"][app_estimate["bottleneck"]].get("policy") in DEADLINE_ORDERED
    except (KeyError, TypeError, AttributeError):
        return False


def cost(app_estimate: dict[str, Any], shape: str) -> float:
    """What a request of ``shape`` costs in the application's token bucket, whose tokens are
    mean requests: its measured device share at the bottleneck over the mean share there (1
    where its shape is not measured yet). A mix of small requests gets as much through as the
    stage can do of them, and a large one is charged what it takes."""
    try:
        row = app_estimate["stages"][app_estimate["bottleneck"]]
        share, mean = (row.get("shares_s") or {}).get(shape), row["service_s"]
        if isinstance(share, (int, float)) and isinstance(mean, (int, float)) and share > 0 and mean > 0:
            return min(max(share / mean, 0.01), 100.0)
    except (KeyError, TypeError, AttributeError):
        pass
    return 1.0


def admission_deadline(app_estimate: dict[str, Any], shape: str, timeout_s: float, explicit: bool,
                       factor: float, path_s: float = 0.0) -> float:
    """Seconds within which a request must be predicted to complete to be admitted: its own
    ``timeout_s`` when it gave one; otherwise ``factor`` × what it takes through an idle set
    (the standalone time of its shape, plus ``path_s`` between the stages), unless the
    application's limit (``timeout_s`` then) is tighter."""
    alone = standalone_latency(app_estimate, shape)
    if not explicit and factor > 0 and alone is not None:
        return min(timeout_s, factor * (alone + path_s))
    return timeout_s


def deadline_refusal(app_estimate: dict[str, Any], shape: str, timeout_s: float, explicit: bool,
                     factor: float, ahead: list[Ahead] = (), scale: float = 1.0,
                     path_s: float = 0.0) -> Refusal | None:
    """Refuse a request predicted to finish after its deadline.

    ``ahead``: the requests in flight at this proxy (``Ahead``), counted ``scale`` times (the
    proxies of the set hold about as many each). How a new request waits for them depends on
    the bottleneck stage's policy:

    - one that serves earlier deadlines first (``edf``, ``slo``): the request waits only for the
      work ahead of it with earlier deadlines (``timeout_s``, what the stage orders by), so it
      finishes after its standalone time plus that work; and it must not make late a request
      already admitted with a later deadline that would have made it (its work lands first);
    - any other: two predictions, the later one counts: the NM's, from the stages' queues as of
      their last heartbeats (``predicted_latency``), and a live one: a pipeline whose bottleneck
      passes C requests a second finishes the last of n + 1 requests after at least
      (n + 1) / C seconds, and never before the standalone time. The live one sees the queue
      a burst builds before any heartbeat reports it.

    The completion it is held to is ``admission_deadline``. Both sides use the same service
    times and the same ``path_s`` (what a request spends between the stages of an idle set:
    HTTP, hops, the DB), so for a default deadline this reads "refuse when the queues ahead would
    stretch the request beyond factor × its idle time", whatever the shape. No prediction (a
    stage unmeasured or without workers) admits.
    """
    predicted = predicted_latency(app_estimate, shape)
    if predicted is None:
        return None
    predicted += path_s
    alone = standalone_latency(app_estimate, shape)
    if alone is not None:
        alone += path_s
    deadline = admission_deadline(app_estimate, shape, timeout_s, explicit, factor, path_s)
    if deadline_first(app_estimate) and alone is not None:
        predicted = alone + scale * sum(w for due, _, w in ahead if due <= timeout_s)
        if predicted <= deadline:
            return _makes_late(ahead, timeout_s, bottleneck_work(app_estimate, shape), scale, path_s)
    else:
        capacity = app_estimate.get("capacity")
        if ahead and alone is not None and isinstance(capacity, (int, float)) and capacity > 0:
            # through the bottleneck at its rate, then the path, which no rate limits
            predicted = max(predicted, alone, (len(ahead) * scale + 1) / capacity + path_s)
    if predicted <= deadline:
        return None
    # The queue ahead must drain by the excess before a request like this one fits.
    if alone is not None and alone > deadline:  # an idle set would miss it too: no wait helps
        p, d = _apart(alone, deadline)
        return Refusal("deadline", f"even an idle set takes {p}s for this request, beyond its deadline of {d}s",
                       1, "give it a longer deadline (timeout_s, slo_s) or use a faster set")
    p, d = _apart(predicted, deadline)
    return Refusal("deadline", f"predicted completion in {p}s exceeds the deadline of {d}s",
                   max(1, math.ceil(predicted - deadline)))


def _apart(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` to 2 decimals, or to as many more as it takes to tell them apart: a near
    miss must not read "0.12s exceeds the deadline of 0.12s"."""
    for n in range(2, 13):
        x, y = f"{a:.{n}f}", f"{b:.{n}f}"
        if x != y:
            return x, y
    return repr(a), repr(b)


def _makes_late(ahead: list[Ahead], due: float, work: float, scale: float, path_s: float = 0.0) -> Refusal | None:
    """Under a deadline-first stage, a new request (due in ``due``, ``work``) runs before every
    request in flight with a later deadline: refuse it if that turns one of them, on time so
    far for what it was admitted for by the work before it and the path after it, late."""
    done = path_s
    for d, promised, w in sorted(ahead):
        done += scale * w
        if d > due and done <= promised < done + work:
            return Refusal("deadline", f"admitting it would make a request admitted earlier miss its deadline "
                                       f"(due in {promised:.2f}s)", max(1, math.ceil(done + work - promised)))
    return None


class CapacityAdmission:
    """Admits creates at this proxy's fair share of the set's capacity, from the NM's view.

    Per application: a token bucket refilled at ``headroom × capacity / proxies`` mean requests
    a second (the set's rate split evenly over its ready proxies; clients spread over proxies
    round-robin; admitting at exactly the capacity would run the bottleneck at utilisation 1,
    where queues drift without bound, so a little is held back), each request charged its
    ``cost`` (its shape's device share over the mean: the capacity is a mean over the recent
    mix, which the next requests need not follow)
    with a burst of ``max(1, rate × burst_s)``: a burst adds at most about ``burst_s`` of
    queueing at the bottleneck, which drains at the capacity, while a slow set (rate ≪ 1/s)
    still admits one request at a time; and a proxy with nothing in flight always admits
    (see ``check``). The buckets are re-rated whenever a new view arrives
    (every heartbeat). Capacity None (some stage not measured yet): no rate limit; capacity 0
    (a stage without workers): refuse. All in memory, no I/O: a refusal costs microseconds.
    Runs on the proxy's event loop only, so no lock.
    """

    def __init__(self, burst_s: float = 0.5, deadline_factor: float = 5.0, headroom: float = 0.9,
                 no_capacity_retry_s: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst_s, self.deadline_factor, self.headroom = burst_s, deadline_factor, headroom
        self.no_capacity_retry_s = no_capacity_retry_s
        self.clock = clock
        self.view: dict[str, Any] | None = None
        self.buckets: dict[str, TokenBucket] = {}
        self.proxies = 1
        # The path between the stages (``path_s``), from requests admitted into an idle set: per
        # application the one awaited (uid, admitted at (ns), its standalone time; one at a
        # time, as the set is idle only for the first), and the latest samples of latency less
        # standalone time.
        self._probes: dict[str, tuple[str, int, float]] = {}
        self._paths: dict[str, collections.deque[float]] = {}

    def observe(self, view: dict[str, Any] | None) -> None:
        """Take the NM's latest view; re-rate the buckets if it is a new one (cheap to call on
        every create: the view is replaced whole, so identity says whether it changed)."""
        if view is self.view:
            return
        self.view = view if isinstance(view, dict) else None
        now = self.clock()
        try:
            self.proxies = max(1, int((self.view or {}).get("proxies") or 1))
        except (TypeError, ValueError):
            self.proxies = 1
        for app in self.apps():
            cap = self._capacity(app)
            if cap is None or cap <= 0:
                continue  # bucket kept as it was: it is not consulted while unknown or zero
            rate = self.headroom * cap / self.proxies
            burst = max(1.0, rate * self.burst_s)
            bucket = self.buckets.get(app)
            if bucket is None:
                self.buckets[app] = TokenBucket(rate, burst, now)
            elif bucket.rate != rate or bucket.burst != burst:
                bucket.rerate(rate, burst, now)

    def apps(self) -> dict[str, Any]:
        """The view's per-application estimates ({} when none or malformed)."""
        apps = (self.view or {}).get("apps")
        return apps if isinstance(apps, dict) else {}

    def app_view(self, app: str) -> dict[str, Any] | None:
        est = self.apps().get(app)
        return est if isinstance(est, dict) else None

    def _capacity(self, app: str) -> float | None:
        est = self.app_view(app)
        cap = est.get("capacity") if est is not None else None
        return float(cap) if isinstance(cap, (int, float)) and not isinstance(cap, bool) else None

    def probe(self, uid: str, app: str, shape: str, now_ns: int) -> None:
        """``uid`` was just admitted into an idle set (nothing in flight here, this proxy the
        set's only one, no stage queue in the NM's view): its latency less its standalone time
        will be a sample of the path between the stages. A request that queued would inflate
        it, and a larger path admits more, so only these count."""
        if self.proxies > 1:  # another proxy's requests are invisible here
            return
        est = self.app_view(app)
        try:
            if est is None or any(row.get("queue") for row in est["stages"].values()):
                return
            # every stage measured at this shape (a mean of other shapes is no standalone time)
            alone = standalone_latency(est, shape, measured=True)
        except (KeyError, TypeError, AttributeError):
            return
        if alone is not None:
            self._probes[app] = (uid, now_ns, alone)

    def done(self, uid: str, status: str, now_ns: int, service_s: float | None = None) -> None:
        """``uid`` ended (the DB's done event) at ``now_ns``; ``service_s``: what its stages'
        workers spent on it, by its trace (None: its standalone time stands for it)."""
        probe = self._take(uid)
        if probe is None or status != "completed":
            return
        app, admitted_ns, alone = probe
        # Less what the workers took, not the standalone estimate: that is a path of ~10 ms
        # beside ~200 ms of compute here, and a few percent of drift in the estimate clamped
        # a whole run's samples to 0 (a CI run). Capped at the standalone time: one slow request
        # (a first call, a wall-clock step) must not double every deadline.
        spent = alone if service_s is None else service_s
        sample = min(max(0.0, (now_ns - admitted_ns) / 1e9 - spent), alone)
        self._paths.setdefault(app, collections.deque(maxlen=PATH_SAMPLES)).append(sample)

    def forget(self, uid: str) -> None:
        """``uid`` left with no done event to time (its store or hand-over failed, it was a
        duplicate create, it was deleted): no sample."""
        self._take(uid)

    def _take(self, uid: str) -> tuple[str, int, float] | None:
        for app, (u, admitted_ns, alone) in self._probes.items():
            if u == uid:
                del self._probes[app]
                return app, admitted_ns, alone
        return None

    def path_s(self, app: str) -> float:
        """Seconds a request of ``app`` spends outside its stages' service time in an idle set:
        the median of the latest samples, 0 until there are ``PATH_MIN_SAMPLES``."""
        samples = self._paths.get(app)
        return statistics.median(samples) if samples and len(samples) >= PATH_MIN_SAMPLES else 0.0

    def paths(self) -> dict[str, float]:
        """``path_s`` of each application measured so far (for /healthz and /metrics)."""
        return {app: self.path_s(app) for app, samples in self._paths.items() if len(samples) >= PATH_MIN_SAMPLES}

    def rate(self, app: str) -> float | None:
        """This proxy's admitted rate for ``app`` now, its token bucket's (None: not limited by
        capacity, also where a deadline-first bottleneck is admitted by the deadline rule alone)."""
        cap, est = self._capacity(app), self.app_view(app)
        if cap is None or (est is not None and deadline_first(est)):
            return None
        return self.headroom * cap / self.proxies

    def deadline_s(self, app: str, shape: str, timeout_s: float, explicit_timeout: bool) -> float:
        """Seconds within which a request is held to complete (``admission_deadline``)."""
        est = self.app_view(app)
        try:
            return timeout_s if est is None else admission_deadline(est, shape, timeout_s, explicit_timeout,
                                                                    self.deadline_factor, self.path_s(app))
        except (KeyError, TypeError, AttributeError):
            return timeout_s

    def work(self, app: str, shape: str) -> float:
        """Seconds of its bottleneck stage a request of ``shape`` takes (0: not known yet)."""
        est = self.app_view(app)
        return 0.0 if est is None else bottleneck_work(est, shape)

    def check(self, app: str, shape: str, timeout_s: float, explicit_timeout: bool,
              *, ahead: list[Ahead]) -> Refusal | None:
        """Admit (takes a token; None) or say why not. ``give_back(app, shape)`` undoes an admission
        that a later check (the in-flight cap) refused.

        ``ahead``: this proxy's requests of ``app`` in flight (``InflightTracker.ahead``); the
        set holds about that many per proxy ahead of a new one (clients spread over the
        proxies), which the deadline rule reads. With none in flight an empty bucket still admits: one request
        cannot overload the set, and a client that waits for each result before the next is
        never refused because the estimate is still pessimistic (the first requests through
        a fresh worker are slow, and they stay in the measured window for a while). Under
        overload a proxy is never idle, so this changes nothing there."""
        est = self.app_view(app)
        if est is None:
            return None
        cap = self._capacity(app)
        # A stage without workers stops the app even while other stages are still unmeasured
        # (capacity None): nothing would get through, so say so now rather than queue.
        stages = est.get("stages")
        stopped = [s for s, row in stages.items() if isinstance(row, dict) and row.get("workers") == 0] \
            if isinstance(stages, dict) else []
        if stopped or (cap is not None and cap <= 0):
            stage = stopped[0] if stopped else est.get("bottleneck") or "?"
            return Refusal("no_capacity", f"stage {stage!r} of model {app!r} has no worker up in this set",
                           self.no_capacity_retry_s)
        try:
            refusal = deadline_refusal(est, shape, timeout_s, explicit_timeout, self.deadline_factor,
                                       ahead=ahead, scale=self.proxies, path_s=self.path_s(app))
        except (KeyError, TypeError, AttributeError):  # a malformed view must not fail requests
            refusal = None
        if refusal is not None:
            return refusal
        bucket = self.buckets.get(app)
        # A deadline-first bottleneck is admitted by the deadline rule alone: it has checked the
        # request against the work ahead of it, which a rate limit only approximates, so a burst
        # that the deadlines leave room for is absorbed instead of refused at the mean rate.
        if cap is None or bucket is None or deadline_first(est):
            return None
        now = self.clock()
        price = cost(est, shape)
        if bucket.try_take(now, price) or not ahead:
            return None
        wait = bucket.wait_s(now, price)
        return Refusal("over_capacity",
                       f"model {app!r} is at this set's capacity ({cap:.2f} requests/s over {self.proxies} "
                       f"prox{'y' if self.proxies == 1 else 'ies'})",
                       max(1, math.ceil(wait)) if math.isfinite(wait) else self.no_capacity_retry_s)

    def give_back(self, app: str, shape: str) -> None:
        bucket, est = self.buckets.get(app), self.app_view(app)
        if bucket is not None and est is not None:
            bucket.give_back(cost(est, shape))


def admit(adm: CapacityAdmission | None, tracker: InflightTracker, uid: str, app: str, shape: str, ts_ns: int,
          timeout_s: float, target_s: float, target_given: bool, retry_after_s: int = 1) -> Refusal | None:
    """The request monitor's whole decision on one create, the proxy's and the simulator's:
    the capacity and deadline rules (when ``adm`` is on), then a slot in flight until the
    request's deadline. None: admitted, its slot taken; else why not, nothing taken."""
    deadline, target = ts_ns + int(timeout_s * 1e9), ts_ns + int(target_s * 1e9)
    work, promise, idle = 0.0, target, not len(tracker)
    if adm is not None:
        refusal = adm.check(app, shape, target_s, target_given, ahead=tracker.ahead(app, ts_ns))
        if refusal is not None:
            return refusal
        work = adm.work(app, shape)
        promise = ts_ns + int(adm.deadline_s(app, shape, target_s, target_given) * 1e9)
    if not tracker.try_admit(uid, deadline, app, work, promise, target, now_ns=ts_ns):
        if adm is not None:
            adm.give_back(app, shape)  # the tokens were not used
        return Refusal("inflight_full", f"full ({tracker.max_inflight} requests in flight)", retry_after_s)
    if adm is not None and idle:
        adm.probe(uid, app, shape, ts_ns)
    return None
