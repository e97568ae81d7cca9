"""Who is calling: the API key of every ``/v1`` request, checked from its headers before its
body is read (an unauthenticated client never holds body buffers). Health, readiness, metrics
and the OpenAPI schema stay open for probes and scrapers; they carry no one's videos.

Without keys (a loopback-only proxy, proxy/keys.py) every request is :data:`ANYONE`.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from onepiece.proxy.errors import ApiError
from onepiece.proxy.keys import ANYONE, ApiKeys, Caller

SCOPE_KEY = "onepiece.caller"
HEADER = "Authorization"


def protected(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def unauthorized(message: str, code: str) -> ApiError:
    return ApiError(401, message, code=code, param=HEADER, headers={"WWW-Authenticate": "Bearer"})


class AuthMiddleware:
    def __init__(self, app: ASGIApp, keys: ApiKeys | None) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SCOPE_KEY] = (self.caller(scope) if self.keys is not None and protected(scope.get("path", ""))
                                else ANYONE)
        await self.app(scope, receive, send)

    def caller(self, scope: Scope) -> Caller:
        """The caller the request's bearer key stands for; a 401 if it has none or a wrong one.
        No message repeats what was sent."""
        assert self.keys is not None
        values = [v for k, v in scope.get("headers", []) if k == b"authorization"]
        if not values:
            raise unauthorized(f"no API key: send the header '{HEADER}: Bearer <key>'", "missing_api_key")
        if len(values) > 1:
            raise unauthorized(f"more than one '{HEADER}' header", "invalid_api_key")
        scheme, _, token = values[0].decode("latin-1").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized(f"the '{HEADER}' header must be 'Bearer <key>'", "invalid_api_key")
        caller = self.keys.caller(token.strip())
        if caller is None:
            raise unauthorized("incorrect API key", "invalid_api_key")
        return caller


def caller_of(request: Request) -> Caller:
    """The caller AuthMiddleware found for ``request``."""
    return request.scope.get(SCOPE_KEY, ANYONE)
