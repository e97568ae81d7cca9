"""A Python client for onepiece proxies (the OpenAI-shaped videos API), on httpx.

``Client(urls)`` takes one proxy URL or several (of different sets), or ``{set: [urls]}``;
``Client.from_nm(address)`` asks the node manager for every set's proxies. A create that is
refused (429, 503) or cannot connect goes on to the next proxy at once, as DESIGN §1 asks of
clients; when every proxy refused, the client waits (jittered exponential backoff, at least the
smallest Retry-After, capped) and goes round again, a bounded number of ``rounds``, before it
raises RequestRejected. The video object names the set that accepted it (``"set"``); later
reads of the video go to the proxy that accepted it, or another proxy of the same set, since
only that set's DBs hold the result.

    with Client("http://127.0.0.1:8000") as c:
        c.generate("a cat on a surfboard", "cat.mp4", model="t2v", size="64x64", seconds=1)
    with Client.from_nm("tcp://127.0.0.1:7700") as c:
        video = c.submit("a cat on a surfboard")   # video["set"]: the set that took it
"""

from __future__ import annotations

import collections
import itertools
import mimetypes
import os
import random
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import httpx

from onepiece.proxy.keys import client_key

DEFAULT_URL = "http://127.0.0.1:8000"
TERMINAL = ("completed", "failed")


class OnepieceError(Exception):
    """Base of the client's errors."""


class RequestFailed(OnepieceError):
    """The server refused the request (4xx/5xx) or the generation failed.

    ``status_code`` is the HTTP status (None for a generation that failed), ``code`` and
    ``message`` the server's error, ``video`` the last video object when there is one."""

    def __init__(self, message: str, *, status_code: int | None = None, code: str | None = None,
                 param: str | None = None, video: dict | None = None) -> None:
        super().__init__(message)
        self.message, self.status_code, self.code, self.param, self.video = message, status_code, code, param, video


class RequestRejected(OnepieceError):
    """Every proxy tried was full (429) or could not take work right now (503: no entrance
    instance or no DB up); try again after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.retry_after, self.code = message, retry_after, code


class Timeout(OnepieceError, TimeoutError):
    """The video did not finish (or a proxy did not answer) in time."""


def _error_of(resp: httpx.Response) -> tuple[str, str | None, str | None]:
    try:
        err = resp.json().get("error") or {}
        return str(err.get("message") or resp.reason_phrase), err.get("code"), err.get("param")
    except (ValueError, AttributeError):
        return f"HTTP {resp.status_code}: {resp.text[:200]}", None, None


def _video_of(resp: httpx.Response) -> dict:
    """The video object a 200 answer holds. An answer that is not one (not JSON, or without an
    ``id`` and a ``status``: a server other than a proxy at that URL, a broken gateway) raises
    RequestFailed (code ``bad_response``) saying what came back, not an error from deep inside."""
    try:
        video = resp.json()
    except ValueError:  # not JSON, or not UTF-8
        video = None
    if not isinstance(video, dict) or not isinstance(video.get("id"), str) \
            or not isinstance(video.get("status"), str):
        kind = resp.headers.get("content-type", "no content type")
        raise RequestFailed(f"{resp.request.url}: HTTP {resp.status_code} ({kind}) is not a video object: "
                            f"{resp.text[:200]!r}", status_code=resp.status_code, code="bad_response")
    return video


def _retry_after(resp: httpx.Response) -> float | None:
    try:
        return float(resp.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def _interleave(sets: Mapping[str, Sequence[str]]) -> list[tuple[str, str]]:
    """(url, set) pairs taking one proxy of each set in turn, so that the proxy tried after a
    refusal is of another set (a set's proxies share its admission, so they refuse together)."""
    lists = [[(u.rstrip("/"), name) for u in urls] for name, urls in sets.items()]
    out = []
    for i in range(max((len(x) for x in lists), default=0)):
        out += [x[i] for x in lists if i < len(x)]
    return out


class _Bounded(collections.OrderedDict):
    """A dict that keeps only its newest ``limit`` entries."""

    limit = 10_000

    def __setitem__(self, key: str, value: str) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


@dataclass
class _Tries:
    """What one submit's tries learnt: the set a try may have reached, and who refused the caller."""

    pinned: str | None = None
    denied: list[RequestFailed] = field(default_factory=list)


def output_file(path: str | os.PathLike) -> Path:
    """The file a download goes to: ``path``, or where it links to (the rename must not put a
    file in place of the link). Raises OSError for anything but a regular file or a new name: a
    rename onto a device (``/dev/null``) or a directory would replace it."""
    target = Path(path)
    if target.is_symlink():
        target = target.resolve()
    if target.is_dir():
        raise IsADirectoryError(f"{path}: is a directory; name the MP4 file")
    if target.exists() and not target.is_file():
        raise OSError(f"{path}: not a regular file; name a file to write the MP4 to")
    return target


# Rounds of a create while every proxy refuses or is unreachable: their pauses (0.25 s doubling,
# jittered, 4 to 8 s together) outlast `onepiece up` restarting a killed proxy (about 2 s); 3
# rounds, under a second, gave up before it was back.
ROUNDS = 6


class Client:
    def __init__(self, base_url: str | Sequence[str] | Mapping[str, Sequence[str]] = DEFAULT_URL,
                 timeout: float = 30.0, api_key: str | None = None, *, rounds: int = ROUNDS,
                 backoff_s: float = 0.25, backoff_cap_s: float = 5.0) -> None:
        """``base_url``: one proxy URL, several, or ``{set name: [urls]}``. ``api_key``: sent as
        a bearer key (default ``$ONEPIECE_API_KEY``). A create refused by every proxy is tried
        again ``rounds - 1`` more times; between rounds the client waits ``backoff_s`` doubling
        per round, jittered, at least the smallest Retry-After, at most ``backoff_cap_s``."""
        if rounds < 1 or backoff_s < 0 or backoff_cap_s < 0:
            raise ValueError("rounds must be at least 1 and the backoff times not negative")
        if isinstance(base_url, Mapping):
            pairs = _interleave(base_url)
        else:
            pairs = [(u.rstrip("/"), None) for u in ([base_url] if isinstance(base_url, str) else base_url)]
        if not pairs:
            raise ValueError("give at least one proxy URL")
        self.urls = list(dict.fromkeys(u for u, _ in pairs))
        # proxy URL -> its set: from the mapping, and learnt from the video objects proxies answer
        self._set_of_url: dict[str, str] = {u: name for u, name in pairs if name is not None}
        self.rounds, self.backoff_s, self.backoff_cap_s = rounds, backoff_s, backoff_cap_s
        api_key = api_key if api_key is not None else client_key()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=timeout, headers=headers)
        # Bounded (least recently added dropped first): a long-lived client must not grow
        # without end; a forgotten video is still found by asking every proxy.
        self._home: _Bounded = _Bounded()  # video id -> the proxy that accepted it
        self._set_of: _Bounded = _Bounded()  # video id -> the set that accepted it
        # A random first proxy: every client starting at the same one would load it alone, and
        # each proxy admits only its share of the set's capacity.
        self._rr = itertools.count(random.randrange(1 << 16))
        self.last_refusals: list[str] = []  # what the latest submit was refused with, in order

    @classmethod
    def from_nm(cls, nm_address: str, nm_timeout: float = 2.0, **kwargs: Any) -> "Client":
        """A client over every set's proxies, as the node manager at ``nm_address`` lists
        them now. ``kwargs`` go to the constructor. Raises RequestFailed (code
        ``nm_unreachable`` or ``no_proxy``) when the NM does not answer or lists no proxy."""
        # Imported here: the client itself needs only httpx, the NM speaks ZMQ.
        from onepiece.nm.client import NmClient
        from onepiece.transport.rpc import RpcError

        nm = NmClient(nm_address, timeout=nm_timeout, retries=0)
        try:
            proxies = nm.proxies()
        except RpcError as e:
            raise RequestFailed(f"no node manager answers at {nm_address}: {e}", code="nm_unreachable") from None
        finally:
            nm.close()
        proxies = {name: urls for name, urls in proxies.items() if urls}
        if not proxies:
            raise RequestFailed(f"the node manager at {nm_address} lists no proxy in any set", code="no_proxy")
        return cls(proxies, **kwargs)

    def set_of(self, video_id: str) -> str | None:
        """The workflow set that accepted ``video_id`` (None if unknown to this client)."""
        return self._set_of.get(video_id)

    # --- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- API -----------------------------------------------------------------------------------
    def submit(self, prompt: str, model: str | None = "t2v", image: str | os.PathLike | bytes | None = None,
               size: str = "64x64", seconds: float | str | None = None, idempotency_key: str | None = None,
               **extra: Any) -> dict:
        """Create a video job; returns the video object (``id``, ``status`` "queued", ...).

        Every try of one submit carries the same ``Idempotency-Key`` (a fresh random one unless
        given), so a try whose answer was lost and is repeated on another proxy of the same set
        gets the video the first try made instead of a second one.

        ``extra``: num_frames, steps, guidance, seed, negative_prompt, timeout_s, slo_s, priority.
        Every proxy is offered the request in turn, for up to ``rounds`` rounds with a pause
        between them. Raises RequestRejected when every proxy still refused (429/503) in the last
        round, RequestFailed (code ``unreachable``) when none could be reached, RequestFailed
        at once on a request a proxy found bad (4xx). The video object's ``set`` names the
        set that accepted it. ``model`` None: the proxy infers it (i2v with an image, else t2v)."""
        fields: dict[str, Any] = {"prompt": prompt, "size": size}
        if model is not None:
            fields["model"] = model
        if seconds is not None:
            fields["seconds"] = str(seconds)
        fields.update({k: v for k, v in extra.items() if v is not None})
        files = None
        if image is not None:
            if isinstance(image, (bytes, bytearray)):
                name, data = "image.png", bytes(image)
            else:
                name, data = Path(image).name, Path(image).read_bytes()
            mime = mimetypes.guess_type(name)[0] or "application/octet-stream"
            files = {"input_reference": (name, data, mime)}

        self.last_refusals = []
        rejected: list[RequestRejected] = []
        headers = {"Idempotency-Key": idempotency_key or secrets.token_urlsafe(24)}
        tries = _Tries()
        for rnd in range(self.rounds):
            if rnd:
                time.sleep(self._pause(rnd, rejected))
            video, rejected, unreachable = self._submit_round(fields, files, headers, tries)
            if video is not None:
                return video
            if tries.denied and not rejected and not unreachable:
                raise tries.denied[0]  # every proxy tried refused the caller: no round changes that
        if rejected:
            waits = [r.retry_after for r in rejected if r.retry_after is not None]
            raise RequestRejected("; ".join(r.message for r in rejected + [RequestRejected(u) for u in unreachable])
                                  + (f" (after {self.rounds} rounds)" if self.rounds > 1 else ""),
                                  min(waits) if waits else None, rejected[0].code)
        if tries.denied:
            raise tries.denied[0]
        raise RequestFailed(f"no proxy reachable: {'; '.join(unreachable)}", code="unreachable")

    def _pause(self, rnd: int, rejected: list[RequestRejected]) -> float:
        """Seconds to wait before round ``rnd`` (1, 2, ...): exponential, jittered (half to all
        of it) so that clients refused together do not all come back together, but never less
        than the smallest Retry-After the proxies asked for; capped."""
        delay = random.uniform(0.5, 1.0) * self.backoff_s * 2 ** (rnd - 1)
        waits = [r.retry_after for r in rejected if r.retry_after is not None and r.retry_after >= 0]
        if waits:
            delay = max(delay, min(waits))
        return min(delay, self.backoff_cap_s)

    def _submit_round(self, fields: dict[str, Any], files: dict | None, headers: dict[str, str], tries: "_Tries"
                      ) -> tuple[dict | None, list[RequestRejected], list[str]]:
        """Offer the request to every proxy once, from the next in rotation: the video object
        of the first that accepts, else the refusals and the unreachable proxies. Once a try may
        have reached a set (its answer was lost), only that set's proxies are offered it: its
        Idempotency-Key finds that try there, and another set would make the video twice.
        A proxy that refuses the caller (401, 403: another set's keys) is passed over."""
        start = next(self._rr)
        rejected: list[RequestRejected] = []
        unreachable: list[str] = []
        for i in range(len(self.urls)):
            url = self.urls[(start + i) % len(self.urls)]
            if tries.pinned is not None and self._set_of_url.get(url) != tries.pinned:
                continue
            try:
                if files is None:
                    resp = self._http.post(f"{url}/v1/videos", json=fields, headers=headers)
                else:
                    data = {k: str(v) for k, v in fields.items()}
                    resp = self._http.post(f"{url}/v1/videos", data=data, files=files, headers=headers)
            except httpx.TransportError as e:
                unreachable.append(f"{url}: {e}")
                if not isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)) and url in self._set_of_url:
                    tries.pinned = self._set_of_url[url]  # it may have arrived: that set's, from now on
                    self.last_refusals.append(f"{url}: {e!r}; trying only set {tries.pinned} now")
                continue
            if resp.status_code == 200:
                video = _video_of(resp)
                set_name = video.get("set") or self._set_of_url.get(url)
                if set_name is not None:
                    video["set"] = set_name  # a proxy that does not say: the set the NM listed it in
                    self._set_of_url[url] = set_name
                    self._set_of[video["id"]] = set_name
                self._home[video["id"]] = url
                return video, rejected, unreachable
            message, code, param = _error_of(resp)
            if resp.status_code in (401, 403):
                tries.denied.append(RequestFailed(message, status_code=resp.status_code, code=code, param=param))
                self.last_refusals.append(f"{url}: {message}")
                continue
            if resp.status_code in (429, 503) or code == "idempotency_key_in_use":
                # Full or without an entrance (another set may take it), or still storing an
                # earlier try of this request: go on, and come back after the pause.
                where = f"{url} (set {self._set_of_url[url]})" if url in self._set_of_url else url
                rejected.append(RequestRejected(f"{where}: {message}", _retry_after(resp), code))
                self.last_refusals.append(rejected[-1].message)
                continue
            raise RequestFailed(message, status_code=resp.status_code, code=code, param=param)
        return None, rejected, unreachable

    def status(self, video_id: str, timeout: float | None = None) -> dict:
        """The video object now (status, progress, error...). ``timeout``: seconds for the
        answer, every proxy tried included (default: the client's timeout for each proxy)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        resp = self._get(video_id, f"/v1/videos/{video_id}", deadline=deadline)
        if resp.status_code != 200:
            message, code, param = _error_of(resp)
            raise RequestFailed(message, status_code=resp.status_code, code=code, param=param)
        return _video_of(resp)

    def wait(self, video_id: str, timeout: float = 600.0, on_progress: Callable[[dict], None] | None = None,
             interval: float = 0.05, max_interval: float = 1.0, max_errors: int = 30) -> dict:
        """Poll until the video completes (returns its object) or fails (raises RequestFailed).

        The poll interval starts at ``interval`` and grows by half each time up to
        ``max_interval``: short jobs are seen at once, long ones without hammering the proxy.
        A poll that fails for a passing reason (a 5xx answer, no proxy reachable) is retried on
        the same schedule, up to ``max_errors`` times in a row, within ``timeout``; an unknown
        video (404) or a failed one raises at once."""
        deadline = time.monotonic() + timeout
        errors, last_error = 0, None  # transient errors in a row, the latest
        while True:
            video: dict | None
            try:
                # A proxy that does not answer must not hold the poll past the deadline.
                video = self.status(video_id, timeout=max(deadline - time.monotonic(), 0.0))
            except RequestFailed as e:
                errors += 1
                if not _transient(e) or errors > max_errors:
                    raise
                video, last_error = None, e
            else:
                errors = 0
                if on_progress is not None:
                    on_progress(video)
                if video["status"] == "completed":
                    return video
                if video["status"] == "failed":
                    err = video.get("error") or {}
                    if not isinstance(err, dict):  # a bare message, not the API's error object
                        err = {"message": str(err)}
                    raise RequestFailed(f"video {video_id} failed: {err.get('message', 'unknown error')}",
                                        code=err.get("code"), video=video)
            left = deadline - time.monotonic()
            if left <= 0:
                if video is not None:
                    raise Timeout(f"video {video_id} not done after {timeout:.0f}s "
                                  f"(status {video['status']}, {video.get('progress', 0)}%)")
                raise Timeout(f"video {video_id}: no answer after {timeout:.0f}s (last poll: {last_error})") \
                    from last_error
            time.sleep(min(interval, left))
            interval = min(interval * 1.5, max_interval)

    def download(self, video_id: str, path: str | os.PathLike, tries: int = 5) -> Path:
        """Save the finished MP4 at ``path`` (written whole, then renamed into place).

        A download that fails for a passing reason (no proxy reachable, a 5xx, the transfer
        broken off: a proxy restarting) starts again, up to ``tries`` times in all, with the
        backoff of submit's rounds between them: the proxies keep a fetched MP4 a while for
        this (``purge_after_fetch_s``)."""
        path = output_file(path)
        attempt = 1
        while True:
            try:
                return self._download(video_id, path)
            except RequestFailed as e:
                if attempt >= tries or not (_transient(e) or e.code == "download_failed"):
                    raise
            time.sleep(self._pause(attempt + 1, []))
            attempt += 1

    def _download(self, video_id: str, path: Path) -> Path:
        """One try of download."""
        tmp = path.with_name(f".{path.name}.part")
        resp = self._get(video_id, f"/v1/videos/{video_id}/content", stream=True)
        try:
            if resp.status_code != 200:
                resp.read()
                message, code, param = _error_of(resp)
                raise RequestFailed(message, status_code=resp.status_code, code=code, param=param)
            with open(tmp, "wb") as f:
                for chunk in resp.iter_bytes():
                    f.write(chunk)
            os.replace(tmp, path)
        except httpx.TimeoutException as e:
            raise Timeout(f"download of {video_id} timed out: {e}") from e
        except httpx.TransportError as e:  # the connection broke off mid-transfer
            raise RequestFailed(f"download of {video_id} failed: {e}", code="download_failed") from e
        finally:
            resp.close()
            tmp.unlink(missing_ok=True)
        return path

    def delete(self, video_id: str) -> bool:
        """Drop the video on its set's DBs; True if it was held. Asks the proxy that accepted
        it, or another of the same set when that one cannot be reached. A video this client
        did not submit or read may be on any set: each proxy is asked in turn (as reads do),
        since another set's 404 says nothing about the video (the first proxy alone left a
        video of the second set in place)."""
        home = self._home.get(video_id)
        errors = []
        not_found = False
        for url in [home, *self._same_set(video_id, home)] if home else self._read_order(video_id):
            try:
                resp = self._http.delete(f"{url}/v1/videos/{video_id}")
            except httpx.TransportError as e:
                errors.append(f"{url}: {e}")
                continue
            if resp.status_code == 404 and home is None:
                not_found = True
                continue
            return resp.status_code == 200
        if not_found and not errors:
            return False
        also = "; the others do not know the video" if not_found else ""
        raise RequestFailed(f"no proxy reachable: {'; '.join(errors)}{also}", code="unreachable")

    def generate(self, prompt: str, path: str | os.PathLike, model: str = "t2v",
                 image: str | os.PathLike | bytes | None = None, size: str = "64x64",
                 seconds: float | str | None = None, timeout: float = 600.0,
                 on_progress: Callable[[dict], None] | None = None, **extra: Any) -> Path:
        """Submit, wait and download in one call; the path of the saved MP4."""
        video = self.submit(prompt, model=model, image=image, size=size, seconds=seconds, **extra)
        if on_progress is not None:
            on_progress(video)
        self.wait(video["id"], timeout=timeout, on_progress=on_progress)
        return self.download(video["id"], path)

    # --- internals ---------------------------------------------------------------------------
    def _get(self, video_id: str, path: str, stream: bool = False, deadline: float | None = None) -> httpx.Response:
        """GET ``path`` from the proxy that accepted the video, or from the others in turn when
        it cannot be reached. With ``stream`` the body is left unread: close the response.
        ``deadline`` (time.monotonic()): no try waits past it, and none starts after it.

        Other proxies may serve other sets, whose DBs never saw the video, so a 404 from one
        of them only counts when every proxy answered and none knows the video; while the
        proxy that accepted it (or any other) is unreachable, that is the error."""
        home = self._home.get(video_id)
        urls = self._read_order(video_id)
        errors: list[str] = []
        not_found: httpx.Response | None = None
        for url in urls:
            timeout: Any = httpx.USE_CLIENT_DEFAULT
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 and errors:
                    errors.append("no time left for the others")
                    break
                default = self._http.timeout.read
                timeout = max(left, 0.01) if default is None else min(default, max(left, 0.01))
            try:
                resp = self._http.send(self._http.build_request("GET", f"{url}{path}", timeout=timeout), stream=stream)
            except httpx.TransportError as e:  # connection refused, timed out, reset...
                errors.append(f"{url}: {e}")
                continue
            if resp.status_code == 404 and url != home and len(urls) > 1:
                resp.read()
                resp.close()
                if not_found is None:
                    not_found = resp
                continue
            if url != home and resp.status_code == 200:
                self._home[video_id] = url  # a proxy of the video's set: read from it from now on
                if video_id not in self._set_of and url in self._set_of_url:
                    self._set_of[video_id] = self._set_of_url[url]
            return resp
        if not_found is not None and not errors:
            return not_found
        also = "; the others do not know the video" if not_found is not None else ""
        raise RequestFailed(f"no proxy reachable: {'; '.join(errors)}{also}", code="unreachable")


    def _same_set(self, video_id: str, home: str | None) -> list[str]:
        """The other proxies known to serve the set that accepted ``video_id``."""
        set_name = self._set_of.get(video_id) or (self._set_of_url.get(home) if home else None)
        if set_name is None:
            return []
        return [u for u in self.urls if u != home and self._set_of_url.get(u) == set_name]

    def _read_order(self, video_id: str) -> list[str]:
        """Where to read ``video_id`` from: the proxy that accepted it, then the other proxies
        of its set (they read the same DBs), then the rest, whose sets may not know it."""
        home = self._home.get(video_id)
        same = self._same_set(video_id, home)
        return ([home] if home else []) + same + [u for u in self.urls if u != home and u not in same]


def _transient(e: RequestFailed) -> bool:
    """Whether a failed request may well succeed if tried again: a 5xx, or no proxy answered."""
    return e.code == "unreachable" or (e.status_code is not None and e.status_code >= 500)
