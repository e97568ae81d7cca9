"""Errors the proxy answers with, shaped like OpenAI's: ``{"error": {message, type, param, code}}``.

Every failure a client can cause is raised as an :class:`ApiError` and rendered by one handler,
so no code path answers with a bare traceback or an unshaped body.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response


class JsonResponse(Response):
    """JSON via orjson (fast, strict); FastAPI's ORJSONResponse is deprecated."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)

# OpenAI's error "type" per status class; code carries the precise reason.
_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """A request the proxy answers with ``status`` and an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JsonResponse:
        return JsonResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, *, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)
