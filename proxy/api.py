"""The proxy's HTTP routes (DESIGN §8), shaped like the OpenAI videos API.

``POST /v1/videos`` validates, admits (the request monitor: the set's capacity, the deadline,
the in-flight cap; a refusal is decided in memory before any I/O), stores the queued record in
the DB (so ``GET`` works at once), and hands the workflow message to an entrance instance. Reads go
to the DBs. Every error a client can cause is an OpenAI-style JSON error with a 4xx status;
anything unexpected is a 500 JSON error for that request only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Annotated, Any, AsyncIterator, Callable

import orjson
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message as AsgiMessage, Receive, Scope, Send

from onepiece.db import protocol
from onepiece.db.client import DbError, DbFull, DbGone, DbUnavailable, NotReady
from onepiece.db.listing import created_key
from onepiece.nm.capacity import at_shape
from onepiece.proxy import openapi as oa
from onepiece.proxy.admission import REFUSALS, CapacityAdmission, DoneWatcher, InflightTracker, Refusal, admit
from onepiece.proxy.auth import AuthMiddleware, caller_of
from onepiece.proxy.buffers import ByteBudget
from onepiece.proxy.cluster import Cluster
from onepiece.proxy.dbs import DbAccess
from onepiece.proxy.dispatch import Dispatcher, NoEntrance, SendFailed
from onepiece.proxy.errors import ApiError, JsonResponse, bad_request
from onepiece.proxy.idempotency import HEADER as IDEM_HEADER, check_same, gone, handing, \
    idempotency_key, idempotent_uid, request_hash
from onepiece.proxy.images import check_image, decode_base64_image, decode_image
from onepiece.proxy.keys import ANYONE, ApiKeys, Caller
from onepiece.proxy.listing import Cursors, list_object, parse_query
from onepiece.proxy.metrics import CONTENT_TYPE_LATEST, ProxyMetrics
from onepiece.proxy.validation import VideoJob, build_job, parse_fields
from onepiece.sched import deadlines
from onepiece.sched.keys import shape_key
from onepiece.transport.message import Message, MessageError, new_uid

log = logging.getLogger(__name__)

ID_PREFIX = "video_"
_UID_RE = re.compile(r"^[0-9a-f]{32}$")
IMAGE_FIELD = "input_reference"


@dataclass
class ProxyOptions:
    max_inflight: int = 64
    max_body_bytes: int = 16 << 20
    max_buffered_bytes: int = 256 << 20  # all requests' bodies together (proxy/buffers.py)
    send_timeout: float = 1.0  # per entrance instance
    send_total_timeout: float = 3.0  # all entrance instances together
    db_timeout: float = 1.0
    refresh_s: float = 0.5  # how often the cluster's lists are re-read
    retry_after_s: int = 1
    # The request monitor (DESIGN §8): admit at the set's measured capacity and refuse requests
    # predicted to miss their deadline. Off: only the in-flight cap (to show what it prevents).
    monitor: bool = True
    burst_s: float = 0.5  # token-bucket burst, in seconds of this proxy's admitted rate
    deadline_factor: float = 2.0  # default deadline = factor × standalone time (0: limit only)
    headroom: float = 0.9  # admit at this fraction of the measured capacity

    def admission(self, clock: Callable[[], float] = time.monotonic) -> CapacityAdmission | None:
        """The request monitor these options describe (None: off)."""
        return (CapacityAdmission(burst_s=self.burst_s, deadline_factor=self.deadline_factor, headroom=self.headroom,
                                  no_capacity_retry_s=self.retry_after_s, clock=clock) if self.monitor else None)


class ProxyState:
    """Everything the routes share; built in the app's lifespan, on the serving loop."""

    def __init__(self, cluster: Cluster, opts: ProxyOptions) -> None:
        self.cluster = cluster
        self.opts = opts
        self.metrics = ProxyMetrics()
        self.metrics.max_inflight.set(opts.max_inflight)
        self.tracker = InflightTracker(opts.max_inflight, lambda app, how: self.metrics.ended.labels(app, how).inc())
        self.cursors = Cursors()
        # Idempotent creates this proxy is storing or handing over now: until the hand-over is
        # done their record may still be forgotten (a failed hand-over), so a retry here must not
        # be answered with it.
        self.handing: set[str] = set()
        self.admission = opts.admission()
        self.metrics.watch(self.monitor_snapshot)
        self.dbs = DbAccess(timeout=opts.db_timeout)
        self.dispatcher = Dispatcher(
            cluster.entrances, send_timeout=opts.send_timeout, total_timeout=opts.send_total_timeout,
            on_failure=lambda addr: self.metrics.send_failures.labels(addr).inc(),
        )
        self.watcher: DoneWatcher | None = None
        self._task: asyncio.Task | None = None

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self.watcher = DoneWatcher(self._on_done)
        self.refresh()
        self.watcher.start()
        self._task = asyncio.ensure_future(self._refresh_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.watcher is not None:
            await self.watcher.close()
        self.dbs.close()
        await asyncio.get_running_loop().run_in_executor(None, self.dispatcher.close)

    def stats(self) -> dict[str, Any]:
        """What the proxy reports with each NM heartbeat (shown by `onepiece status`); callable
        from any thread."""
        return {"inflight": len(self.tracker), "max_inflight": self.tracker.max_inflight,
                "accepted": self.metrics.accepted_total(), "rejected": self.metrics.rejected_total(),
                # of those rejected, the ones for capacity (the monitor's 429s, a full proxy's 503)
                "refused": self.metrics.rejected_total((*REFUSALS, "buffers_full")),
                "ended": self.metrics.ended_totals()}

    def observe_monitor(self) -> None:
        """Feed the cluster's latest capacity view to admission (re-rates on a new view)."""
        if self.admission is None:
            return
        try:
            view = self.cluster.monitor()
        except Exception:  # a flaky cluster view must not fail requests; keep the last one
            log.warning("cluster.monitor() failed", exc_info=True)
            return
        self.admission.observe(view)

    def monitor_snapshot(self) -> dict[str, Any]:
        """For /metrics and /healthz: the view admission works from and its rates; read from
        the serving loop (a scrape), so plain attribute reads suffice."""
        adm = self.admission
        if adm is None:
            return {"enabled": False, "set": self.cluster.set_name, "view": None, "rates": {}}
        apps = self.cluster.workflow.applications
        return {"enabled": True, "set": self.cluster.set_name, "view": adm.view, "proxies": adm.proxies,
                "rates": {app: adm.rate(app) for app in apps}, "path_s": adm.paths()}

    def release(self, uid: str, status: str | None = None, service_s: float | None = None,
                outcome: str | None = None) -> bool:
        """Free ``uid``'s slot in flight (False: it held none); ``status`` and ``service_s``: how
        it ended and its stages' time, from the DB's done event, which the monitor times (None:
        it left otherwise, untimed); ``outcome``: how it ended, for the metrics (None: it was not
        a request that ended, a create given back)."""
        if self.admission is not None:
            if status is None:
                self.admission.forget(uid)
            else:
                self.admission.done(uid, status, time.time_ns(), service_s)
        freed = self.tracker.release(uid, outcome)
        self.metrics.inflight.set(len(self.tracker))
        return freed

    def _on_done(self, uid: str, status: str | None, service_s: float | None) -> None:
        if self.release(uid, status, service_s, status or "cancelled"):
            log.debug("uid=%s %s: slot freed", uid, f"terminal ({status})" if status else "deleted")

    def follow_dbs(self) -> None:
        """Re-read the cluster's DB list: new DBs get used and their events subscribed."""
        try:
            dbs = self.cluster.dbs()
        except Exception:  # a flaky cluster view must not stop the proxy; keep the last one
            log.warning("cluster.dbs() failed", exc_info=True)
            return
        self.dbs.update(dbs)
        if self.watcher is not None:
            self.watcher.update([d.get("events", "") for d in dbs if isinstance(d, dict)])

    def refresh(self) -> None:
        """Follow the DB list and the capacity view, and drop slots whose deadline passed."""
        self.follow_dbs()
        self.observe_monitor()
        self.tracker.sweep()
        self.metrics.inflight.set(len(self.tracker))

    async def _refresh_loop(self) -> None:
        loop = asyncio.get_running_loop()
        n = 0
        while True:
            await asyncio.sleep(self.opts.refresh_s)
            self.refresh()
            n += 1
            if n % 20 == 0:  # now and then, close senders to entrances that left
                try:
                    keep = {a for app in self.cluster.workflow.applications for a in self.cluster.entrances(app)}
                    await loop.run_in_executor(None, self.dispatcher.prune, keep)
                except Exception:
                    log.warning("pruning entrance senders failed", exc_info=True)

    # --- submit -------------------------------------------------------------------------------
    def _retry(self) -> dict[str, str]:
        # A constant: slots free as requests complete (seconds, for these pipelines), and a
        # client with other sets to try goes there at once anyway.
        return {"Retry-After": str(self.opts.retry_after_s)}

    def _refuse(self, r: Refusal) -> ApiError:
        return ApiError(429, f"set {self.cluster.set_name!r}: {r.message}; {r.hint}",
                        code=r.code, headers={"Retry-After": str(r.retry_after_s)})

    def reserve(self, app: str, shape: str) -> dict[str, float]:
        """Per stage of ``app``, the seconds the stages after it take alone for ``shape`` (from
        the NM's view; unmeasured stages count 0): each stage schedules to be done that much
        before the request's target, so the stages after it still have their time."""
        try:
            stages = ((self.cluster.monitor() or {}).get("apps") or {})[app]["stages"]
        except (KeyError, TypeError):
            return {}

        def alone_s(stage: str) -> float | None:
            row = stages.get(stage) if isinstance(stages, dict) else None
            return at_shape(row, shape) if isinstance(row, dict) else None

        return deadlines.reserve(self.cluster.workflow.applications[app].stages, alone_s)

    async def _held(self, uid: str, caller: Caller, digest: str, here: bool,
                    held: dict[str, Any] | None = None) -> tuple[str, dict[str, Any] | None]:
        """What an idempotent create finds under its UID (``held``, else read from the DBs):
        ("new", None) when nothing; ("replay", record) for a video to answer with (``here``: this
        proxy is handing it over now); ("resend", record) for one a dead proxy stored and never
        handed over. A 409 when the key made a different request; come back later while another
        proxy may still be handing it over."""
        if held is None:
            held = await _db(self.dbs.get(uid, caller.owner))
            if held is None:
                return "new", None
        check_same(held, digest)
        what, left = ("replay", 0.0) if here else handing(held, time.time(), self.opts.send_total_timeout)
        if what == "wait":
            raise _in_use(max(1, math.ceil(left)))
        return what, held

    async def submit(self, job: VideoJob, caller: Caller = ANYONE, idem: tuple[str, str] | None = None
                     ) -> tuple[dict[str, Any], bool]:
        """Accept ``job`` for ``caller``: (its video object, whether it is a replay). ``idem``:
        (Idempotency-Key, request digest); a create with a key that made a video before answers
        that video (or a 409 when its request differed or it is gone), admitted or not.

        An admitted create with a key reads what its UID holds by trying to create it (one DB
        round trip before the hand-over, not a read and then a create); one that is refused, or
        finds no entrance, reads the UID first, so that a retry of an accepted create still gets
        its video then."""
        wf = self.cluster.workflow
        first_stage = wf.applications[job.app].stages[0]
        params = job.params()
        uid = new_uid() if idem is None else idempotent_uid(caller, idem[0])

        async def replay_or(error: ApiError) -> tuple[dict[str, Any], bool]:
            if idem is not None:
                what, held = await self._held(uid, caller, idem[1], here=uid in self.tracker)
                if what == "replay":
                    return video_object(held), True
            if error.status == 429:  # counted once answered: a retry that gets its video was not refused
                self.metrics.rejected.labels(error.code).inc()
            raise error

        given_back = False

        def give_back() -> None:  # an admission this create turned out not to need (once)
            nonlocal given_back
            if adm is not None and not given_back:
                given_back = True
                adm.give_back(job.app, shape_key(params))

        if idem is not None and uid in self.handing:  # its first create is being stored or handed over here
            raise _in_use(1)
        if idem is not None and uid in self.tracker:  # handed over here, not finished yet
            return await replay_or(_in_use(1))
        self.follow_dbs()  # cheap (set compares): a DB that just joined is used at once
        if not self.cluster.entrances(job.app):
            return await replay_or(ApiError(
                503, f"no instance of stage {first_stage!r} (entrance of model {job.app!r}) is up; "
                     f"try again later or another set", code="no_entrance", headers=self._retry()))
        if job.image_bytes is not None:  # no image at all: a 400 now, not a 429 that says come back
            check_image(job.image_bytes, IMAGE_FIELD)
        # Admission, all in memory: a refusal waits on no DB, stage or NM (but for a create with
        # an Idempotency-Key, whose UID is read then: a retry of an accepted one gets its video
        # even while the set refuses new work).
        adm = self.admission
        self.observe_monitor()
        ts = time.time_ns()
        refusal = admit(adm, self.tracker, uid, job.app, shape_key(params), ts, job.timeout_s,
                        job.target_s, job.target_given, self.opts.retry_after_s)
        if refusal is not None:
            return await replay_or(self._refuse(refusal))
        deadline = ts + int(job.timeout_s * 1e9)  # where it fails
        target = ts + int(job.target_s * 1e9)  # what the stages order it by
        self.metrics.inflight.set(len(self.tracker))
        resend = False  # a retry handing over what a dead proxy stored (proxy/idempotency.py)
        if idem is not None:
            self.handing.add(uid)
        try:
            image = None
            if job.image_bytes is not None:
                image = await asyncio.get_running_loop().run_in_executor(
                    None, decode_image, job.image_bytes, (job.width, job.height), IMAGE_FIELD)
            record = {
                "uid": uid, "app": job.app, "set": self.cluster.set_name, "status": protocol.QUEUED,
                "stage": first_stage, "progress": 0, "created_at": ts / 1e9, "deadline": deadline,
                # Echoed by GET so the video object is complete without the proxy keeping state.
                "size": job.size, "seconds": job.seconds, "prompt": job.prompt,
                # Whose it is (a hash of the API key, proxy/keys.py) and what an idempotent
                # create asked for: reads and retries compare them.
                "owner": caller.owner, "request_hash": idem[1] if idem is not None else None,
            }
            try:
                if idem is None:
                    await self.dbs.create(record)
                else:
                    held, created = await self.dbs.create_once(record)
                    if not created:  # a retry: of one accepted before, or of one a dead proxy stored
                        try:
                            what, held = await self._held(uid, caller, idem[1], here=False, held=held)
                        except ApiError:
                            give_back()
                            raise
                        if what == "replay":
                            give_back()
                            self.release(uid)
                            return video_object(held), True
                        log.warning("uid=%s: stored %.0fs ago and never marked handed over (its proxy died before "
                                    "handing it over): handing it over now", uid, time.time() - held["created_at"])
                        resend = True  # on this admission, by its stored deadline
                        if isinstance(held.get("deadline"), int):
                            deadline = min(deadline, held["deadline"])
            except DbGone:
                raise gone() from None
            except DbError as e:  # DbFull, DbUnavailable, or refused by every DB: not stored
                log.warning("uid=%s: not stored: %s", uid, e)
                raise ApiError(503, f"the request could not be stored: {_unavailable(e)}",
                               code="db_full" if isinstance(e, DbFull) else "db_unavailable",
                               headers=self._retry()) from None
            header = {
                "uid": uid, "ts": ts, "app": job.app, "stage": first_stage, "set": self.cluster.set_name,
                "deadline": deadline, "priority": job.priority, "reserve": self.reserve(job.app, shape_key(params)),
                "kind": "task", "params": params, "trace": [],
            }
            if job.slo_s is not None:
                header["target"] = target
            msg = Message(header, {"image": image} if image is not None else {})
            msg.mark("proxy", "leave")
            try:
                addr = await self.dispatcher.send(job.app, msg)
            except (NoEntrance, SendFailed, MessageError) as e:
                # The client never learns this uid: drop the record so nothing waits on it,
                # leaving no tombstone, so that a retry with the same Idempotency-Key can
                # create it again. If even that fails, the DB's deadline sweep marks it failed.
                with contextlib.suppress(DbError):
                    await self.dbs.delete(uid, caller.owner, forget=True)
                if isinstance(e, NoEntrance):
                    what = "no entrance instance is up"
                elif isinstance(e, SendFailed):  # the instances' addresses and errors: the operator's, not the client's
                    log.warning("uid=%s: not handed to the pipeline: %s", uid, e)
                    what = "every entrance instance refused it or did not take it in time"
                else:  # the message itself (its size, its fields)
                    what = str(e)
                raise ApiError(503, f"model {job.app!r}: the request could not be handed to the pipeline: {what}",
                               code="entrance_unavailable", headers=self._retry()) from None
        except BaseException:  # not stored or not handed over: its admission goes back too
            give_back()
            self.release(uid)
            raise
        finally:
            self.handing.discard(uid)
        self.cluster.delivered(addr, uid)
        if idem is not None:  # before the answer: a retry then knows it was handed over
            try:
                await self.dbs.handed(uid, caller.owner)
            except DbError as e:  # a retry after the hand-over's bound then hands it over again
                log.warning("uid=%s: the mark that it was handed over was not stored: %s", uid, e)
        log.info("uid=%s accepted app=%s size=%s frames=%d steps=%d -> %s", uid, job.app, job.size, job.num_frames,
                 job.steps, addr)
        self.metrics.accepted.labels(job.app).inc()
        if resend:
            return video_object(held), True  # the video its first create made
        return video_object({**record, "progress": 0}), False


def video_object(record: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI video object for a DB record."""
    status = record.get("status", protocol.QUEUED)
    progress = 100 if status == protocol.COMPLETED else int(min(max(record.get("progress") or 0, 0), 100))
    error = None
    if status == protocol.FAILED:
        err = record.get("error")
        if isinstance(err, dict):
            error = {"code": str(err.get("code", "failed")), "message": str(err.get("message", ""))}
        else:
            message = str(err or f"failed at stage {record.get('stage') or '?'}")
            code = ("deadline_exceeded" if message.startswith("deadline exceeded")
                    else "store_full" if message.startswith("store full") else "generation_failed")
            error = {"code": code, "message": message}
    return {
        "id": ID_PREFIX + record["uid"],
        "object": "video",
        "model": record.get("app", ""),
        "status": status,
        "progress": progress,
        "created_at": _unix_s(record.get("created_at")) or 0,
        "completed_at": _unix_s(record.get("completed_at")),
        "expires_at": _unix_s(record.get("expires_at")),
        "error": error,
        "size": record.get("size") or "",
        "seconds": record.get("seconds") or "",
        "prompt": record.get("prompt"),
        "remixed_from_video_id": None,
        "stage": record.get("stage"),
        "set": record.get("set"),  # the workflow set that accepted it (its DBs hold the result)
    }


def _unix_s(v: Any) -> int | None:
    """Whole seconds since the epoch (OpenAI's timestamps) from a record's float seconds."""
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return int(v)


def uid_of(video_id: str, param: str = "video_id") -> str:
    """The uid behind a client-facing id; 404 for anything that cannot be one of ours (a 400
    when it is a query parameter, ``param``, rather than the path)."""
    uid = video_id.removeprefix(ID_PREFIX)
    if not _UID_RE.match(uid):
        if param != "video_id":
            raise bad_request(f"'{param}' must be a video id like 'video_<32 hex digits>' (got {video_id[:80]!r})",
                              param=param)
        raise ApiError(404, f"no video with id {video_id[:80]!r}", code="video_not_found", param="video_id")
    return uid


# --- request bodies -----------------------------------------------------------------------------
async def read_create_body(request: Request, max_body: int) -> tuple[dict[str, Any], bytes | None]:
    """The scalar fields and the raw image bytes (if any) of a create request, JSON or form."""
    mime = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if mime in ("multipart/form-data", "application/x-www-form-urlencoded"):
        return await _read_form(request, max_body)
    if mime in ("", "application/json", "text/json") or mime.endswith("+json"):
        return await _read_json(request)
    raise ApiError(415, f"unsupported content type {mime!r}; send application/json or multipart/form-data",
                   code="unsupported_media_type")


async def _read_form(request: Request, max_body: int) -> tuple[dict[str, Any], bytes | None]:
    form = await request.form(max_files=4, max_fields=64, max_part_size=max_body)
    try:
        fields: dict[str, Any] = {}
        image: bytes | None = None
        seen: set[str] = set()
        for key, value in form.multi_items():
            if key in seen:
                raise bad_request(f"parameter '{key}' given more than once", param=key)
            seen.add(key)
            if isinstance(value, UploadFile):
                if key != IMAGE_FIELD:
                    raise bad_request(f"only '{IMAGE_FIELD}' may be a file upload, not '{key}'", param=key)
                ctype = (value.content_type or "").lower()
                if ctype and not ctype.startswith("image/") and ctype != "application/octet-stream":
                    raise bad_request(f"'{IMAGE_FIELD}' upload has type {ctype!r}; expected an image",
                                      param=IMAGE_FIELD, code="invalid_image")
                image = await value.read()
                if not image:
                    raise bad_request(f"'{IMAGE_FIELD}' upload is empty", param=IMAGE_FIELD, code="invalid_image")
            elif key in (IMAGE_FIELD, f"{IMAGE_FIELD}[image_url]"):
                # the openai client flattens {"image_url": ...} to input_reference[image_url]
                if value.strip():
                    image = decode_base64_image(value)
            elif key == f"{IMAGE_FIELD}[file_id]":
                raise _no_file_ids()
            elif value == "" and key != "prompt":
                continue  # an empty optional form field means "not given"
            else:
                fields[key] = value
        if IMAGE_FIELD in seen and f"{IMAGE_FIELD}[image_url]" in seen:
            raise bad_request(f"'{IMAGE_FIELD}' given twice", param=IMAGE_FIELD)
        return fields, image
    finally:
        await form.close()


async def _read_json(request: Request) -> tuple[dict[str, Any], bytes | None]:
    body = await request.body()
    if not body.strip():
        raise bad_request("request body is empty; expected a JSON object with at least 'prompt'",
                          code="invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    ref = data.pop(IMAGE_FIELD, None)
    image: bytes | None = None
    if isinstance(ref, str):
        image = decode_base64_image(ref) if ref.strip() else None
    elif isinstance(ref, dict):
        if isinstance(ref.get("image_url"), str):
            image = decode_base64_image(ref["image_url"])
        elif "file_id" in ref:
            raise _no_file_ids()
        else:
            raise bad_request(f"'{IMAGE_FIELD}' object needs 'image_url' (a data URL)", param=IMAGE_FIELD)
    elif ref is not None:
        raise bad_request(f"'{IMAGE_FIELD}' must be a base64 string, a data URL or {{\"image_url\": ...}}",
                          param=IMAGE_FIELD)
    return data, image


def _no_file_ids() -> ApiError:
    return bad_request(f"'{IMAGE_FIELD}' by file_id is not supported; upload the image or send it as a data URL",
                       param=IMAGE_FIELD, code="unsupported_reference")


# --- body limits, metrics and last-resort errors, as one pure ASGI middleware ---------------
class BodyTooLarge(Exception):
    pass


class BuffersFull(Exception):
    pass


class GuardMiddleware:
    """Bounds request bodies (Content-Length up front, then the bytes actually streamed), each
    alone and all together (``budget``), counts every response by route template and status,
    and turns anything that escapes into a JSON 500 for that request alone."""

    def __init__(self, app: ASGIApp, state: ProxyState) -> None:
        self.app = app
        self.st = state
        self.budget = ByteBudget(state.opts.max_buffered_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        st = self.st
        limit = st.opts.max_body_bytes
        status = {"code": 500, "started": False}

        async def send_tracked(message: AsgiMessage) -> None:
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
            await send(message)

        held = 0  # bytes of self.budget this request holds

        def hold(n: int) -> None:
            nonlocal held
            if n > held:
                if not self.budget.take(n - held):
                    raise BuffersFull()
                held = n

        try:
            declared = _content_length(scope)
            if declared is not None and declared > limit:
                raise BodyTooLarge()
            hold(declared or 0)  # refused before a byte is read when the total is spent
            received = 0

            async def receive_limited() -> AsgiMessage:
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > limit:
                        raise BodyTooLarge()
                    hold(received)
                return message

            await self.app(scope, receive_limited, send_tracked)
        except BodyTooLarge:
            st.metrics.rejected.labels("body_too_large").inc()
            if not status["started"]:
                await ApiError(413, f"request body exceeds {limit} bytes", code="request_too_large")\
                    .response()(scope, receive, send_tracked)
        except BuffersFull:
            st.metrics.rejected.labels("buffers_full").inc()
            if not status["started"]:
                await ApiError(503, "the proxy holds too many request bodies now; retry later",
                               code="buffers_full", headers={"Retry-After": str(st.opts.retry_after_s)}).response()(scope, receive, send_tracked)
        except ClientDisconnect:
            status["code"] = 499  # the client left (or was cut off as too slow): nobody to answer
        except ApiError as e:
            if not status["started"]:
                await e.response()(scope, receive, send_tracked)
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not status["started"]:
                await ApiError(500, "internal error in the proxy", code="internal_error")\
                    .response()(scope, receive, send_tracked)
        finally:
            self.budget.give(held)
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            st.metrics.requests.labels(endpoint, scope.get("method", ""), str(status["code"])).inc()


def _content_length(scope: Scope) -> int | None:
    for k, v in scope.get("headers", []):
        if k == b"content-length":
            try:
                n = int(v)
            except ValueError:
                raise ApiError(400, "Content-Length is not a number", code="invalid_request") from None
            if n < 0:
                raise ApiError(400, "Content-Length is negative", code="invalid_request")
            return n
    return None


# --- the app ------------------------------------------------------------------------------------
def create_app(cluster: Cluster, opts: ProxyOptions | None = None, keys: ApiKeys | None = None) -> FastAPI:
    """The proxy's ASGI app for ``cluster``; background work starts with the app's lifespan.
    ``keys``: the client API keys every /v1 request must carry one of (None: no keys)."""
    opts = opts or ProxyOptions()
    state = ProxyState(cluster, opts)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    # The schema (not the HTML docs pages, which load scripts from a CDN) at /openapi.json.
    app = FastAPI(title="onepiece proxy", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", default_response_class=JsonResponse)

    def served_schema() -> dict[str, Any]:
        if app.openapi_schema is None:  # built once, on the first request for it
            app.openapi_schema = oa.finish(get_openapi(title=app.title, version=app.version, routes=app.routes),
                                           bearer=keys is not None)
        return app.openapi_schema

    app.openapi = served_schema  # type: ignore[method-assign]
    app.state.proxy = state
    app.add_middleware(AuthMiddleware, keys=keys)
    app.add_middleware(GuardMiddleware, state=state)  # outermost: renders the 401s of the one inside

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        if request.method == "POST" and exc.status in (400, 404, 413, 415, 503):
            state.metrics.rejected.labels(exc.code).inc()
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        if request.method == "POST" and exc.status_code == 400:  # e.g. a malformed multipart body
            state.metrics.rejected.labels(code).inc()
        headers = dict(exc.headers or {})
        message = str(exc.detail)
        if exc.status_code == 405:
            # Starlette names the first matching route's methods only; a path has several routes.
            allowed = allowed_methods(app, request.url.path)
            headers["Allow"] = ", ".join(allowed)
            message = f"{request.method} is not allowed on {request.url.path}; allowed: {', '.join(allowed)}"
        return ApiError(exc.status_code, message, code=code, headers=headers).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return ApiError(400, str(exc.errors()[:1]), code="invalid_request").response()

    @app.post("/v1/videos", openapi_extra=oa.create_body(cluster.workflow, IMAGE_FIELD),
              responses=oa.responses(oa.ok(oa.VIDEO), 400, 409, 413, 415, 429, 503))
    async def create_video(request: Request) -> Response:
        st = state
        t0 = time.perf_counter()
        key = idempotency_key(request)  # checked before the body is read
        raw, image_bytes = await read_create_body(request, st.opts.max_body_bytes)
        idem = (key, request_hash(parse_fields(raw), image_bytes)) if key is not None else None
        job = build_job(st.cluster.workflow, raw, image_bytes)
        try:
            obj, replayed = await st.submit(job, caller_of(request), idem)
        except ApiError as e:
            if e.status == 429:
                st.metrics.refusal_latency.observe(time.perf_counter() - t0)
            raise
        st.metrics.submit_latency.observe(time.perf_counter() - t0)
        return JsonResponse(obj, headers={"Idempotent-Replayed": "true"} if replayed else None)

    @app.get("/v1/videos", openapi_extra={"parameters": oa.LIST_PARAMETERS},
             responses=oa.responses(oa.ok(oa.VIDEO_LIST), 400, 503))
    async def list_videos(request: Request) -> Response:
        st = state
        query = parse_query(request.query_params)
        owner = caller_of(request).owner
        after = None
        if query.after is not None:
            uid = uid_of(query.after, param="after")
            after = st.cursors.get(owner, uid)  # a page's own last video may be gone by now
            if after is None:
                held = await _db(st.dbs.get(uid, owner))
                if held is None:
                    raise bad_request(f"'after': no video with id {query.after[:80]!r} (unknown, expired or "
                                      f"deleted)", param="after")
                after = created_key(uid, held.get("created_at"))
        records, more = await _db(st.dbs.list(owner, after, query.limit, query.order))
        st.cursors.remember(owner, records)
        return JsonResponse(list_object([video_object(r) for r in records], more))

    @app.get("/v1/videos/{video_id}", responses=oa.responses(oa.ok(oa.VIDEO), 404, 503))
    async def retrieve_video(video_id: str, request: Request) -> Response:
        st = state
        uid = uid_of(video_id)
        record = await _db(st.dbs.get(uid, caller_of(request).owner))
        if record is None:
            raise ApiError(404, f"no video with id {video_id!r} (unknown, expired or already fetched)",
                           code="video_not_found", param="video_id")
        if record.get("status") in protocol.TERMINAL and st.tracker.release(uid, record["status"]):
            # its done event is late or lost; the record says enough (the monitor still times
            # the request by that event, if it comes)
            st.metrics.inflight.set(len(st.tracker))
        return JsonResponse(video_object(record))

    @app.get("/v1/videos/{video_id}/content", response_class=Response,
             responses=oa.responses(oa.ok({"type": "string", "format": "binary"}, "video/mp4"), 400, 404, 409, 503))
    async def download_video(video_id: str, request: Request,
                             variant: Annotated[str | None, Query(json_schema_extra={"enum": ["video", ""]})] = None
                             ) -> Response:
        st = state
        if variant not in (None, "", "video"):
            raise bad_request(f"variant {variant!r} is not available; only 'video'", param="variant")
        uid = uid_of(video_id)
        try:
            got = await _db(st.dbs.content(uid, caller_of(request).owner))
        except NotReady as e:
            record = e.record
            if record is None:  # gone between the two reads (fetched by someone else, expired)
                got = None
            elif record.get("status") == protocol.FAILED:
                raise ApiError(409, f"video {video_id!r} failed: {video_object(record)['error']['message']}",
                               code="video_failed", param="video_id") from None
            else:
                raise ApiError(409, f"video {video_id!r} is not ready (status {record.get('status')}, "
                                    f"progress {video_object(record)['progress']}%)", code="video_not_ready",
                               param="video_id") from None
        if got is None:
            raise ApiError(404, f"no video with id {video_id!r} (unknown, expired or already fetched)",
                           code="video_not_found", param="video_id")
        record, data = got
        return Response(bytes(data), media_type=record.get("content_type") or "video/mp4",
                        headers={"Content-Disposition": f'attachment; filename="{ID_PREFIX}{uid}.mp4"'})

    @app.delete("/v1/videos/{video_id}", responses=oa.responses(oa.ok(oa.DELETED), 404, 503))
    async def delete_video(video_id: str, request: Request) -> Response:
        st = state
        uid = uid_of(video_id)
        if not await _db(st.dbs.delete(uid, caller_of(request).owner)):
            raise ApiError(404, f"no video with id {video_id!r}", code="video_not_found", param="video_id")
        # A cancelled request frees its slot now, not at its deadline (the DBs tell the stages).
        st.release(uid, outcome="cancelled")
        return JsonResponse({"id": ID_PREFIX + uid, "object": "video.deleted", "deleted": True})

    @app.get("/v1/models", responses=oa.responses(oa.ok(oa.MODELS)))
    async def list_models() -> Response:
        wf = state.cluster.workflow
        serves = (state.cluster.monitor() or {}).get("serves")  # what the set is laid out for, once the NM said
        return JsonResponse({"object": "list", "data": [
            {"id": app_id, "object": "model", "created": 0, "owned_by": "onepiece", "kind": spec.kind,
             "stages": spec.stages} for app_id, spec in wf.applications.items()
            if not isinstance(serves, list) or app_id in serves]})

    @app.get("/healthz", responses=oa.responses(oa.ok(oa.HEALTH)))
    async def healthz() -> Response:
        st = state
        apps = {}
        for app_id in st.cluster.workflow.applications:
            try:
                apps[app_id] = len(st.cluster.entrances(app_id))
            except Exception:
                apps[app_id] = 0
        return JsonResponse({
            "status": "ok", "set": st.cluster.set_name, "inflight": len(st.tracker),
            "max_inflight": st.tracker.max_inflight, "dbs": st.dbs.count, "entrances": apps,
            "monitor": st.admission is not None, "admission": _admission_health(st),
        })

    @app.get("/readyz", responses={**oa.responses(oa.ok(oa.READY)),
                                   503: oa.ok(oa.READY, why="some application cannot be served now")})
    async def readyz() -> Response:
        missing = _not_ready(state)
        return JsonResponse({"status": "not ready" if missing else "ready", "set": state.cluster.set_name,
                             "missing": missing}, status_code=503 if missing else 200)

    @app.get("/metrics", response_class=Response,
             responses=oa.responses(oa.ok({"type": "string"}, CONTENT_TYPE_LATEST.split(";")[0])))
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every method some route serves at ``path`` (for a 405's Allow header)."""
    out: set[str] = set()
    for route in app.router.routes:
        regex, methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and methods and regex.match(path):
            out |= methods
    return sorted(out)


def _not_ready(st: ProxyState) -> list[str]:
    """What keeps some application of the set from being served now (empty: ready). /healthz
    says the proxy is alive; this says a request would get through: a DB, an entrance and, per
    the NM's view, ready workers at every stage of every application the set is laid out for
    (a set of t2v stages only was never ready for i2v)."""
    out = [] if st.dbs.count else ["no DB"]
    view = st.cluster.monitor() or {}
    apps = view.get("apps") or {}
    serves = view.get("serves")
    for app_id, spec in st.cluster.workflow.applications.items():
        if isinstance(serves, list) and app_id not in serves:
            continue
        if not st.cluster.entrances(app_id):
            out.append(f"{app_id}: no instance of its first stage {spec.stages[0]!r}")
            continue
        stages = (apps.get(app_id) or {}).get("stages") or {}
        out += [f"{app_id}: no ready worker at stage {stage!r}" for stage in spec.stages
                if isinstance(stages.get(stage), dict) and not stages[stage].get("workers")]
    return out


def _admission_health(st: ProxyState) -> dict[str, Any]:
    """What the request monitor admits now, per application: the set's capacity (requests/s,
    None until measured), this proxy's admitted rate, the bottleneck stage and the path between
    the stages that its deadlines allow for (seconds)."""
    snap = st.monitor_snapshot()
    apps = st.admission.apps() if st.admission is not None else {}
    paths = snap.get("path_s") or {}  # the applications measured so far
    return {"enabled": snap["enabled"], "proxies": snap.get("proxies"), "apps": {
        app: {"capacity": (apps.get(app) or {}).get("capacity"), "rate": rate,
              "bottleneck": (apps.get(app) or {}).get("bottleneck"), "path_s": paths.get(app)}
        for app, rate in snap["rates"].items()}}


def _in_use(retry_s: int) -> ApiError:
    return ApiError(409, f"a request with this '{IDEM_HEADER}' is in progress; retry in {retry_s}s",
                    code="idempotency_key_in_use", param=IDEM_HEADER, headers={"Retry-After": str(retry_s)})


def _unavailable(e: DbError) -> str:
    """What a client is told of a DB error: its kind. The DBs' addresses and replies in it are
    for the operator (the proxy's log), not for every client."""
    if isinstance(e, DbFull):
        return "every result store is full; retry later"
    if isinstance(e, DbUnavailable):
        return "no result store answered; retry later"
    return "the result stores refused it"


async def _db(coro: Any) -> Any:
    try:
        return await coro
    except DbUnavailable as e:  # (a read: polled often, so not a warning each time)
        log.debug("a read found no result store: %s", e)
        raise ApiError(503, _unavailable(e), code="db_unavailable") from None
