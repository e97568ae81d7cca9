"""What the served OpenAPI schema (``/openapi.json``) says each route answers.

The routes build their responses by hand (``JsonResponse``, proxy/errors.py), so FastAPI can
infer neither their bodies nor their error statuses, and it declares a 422 that the proxy never
sends (validation errors are 400s). This module declares both, and :func:`finish` corrects the
generated schema; an HTTP fuzz (tests/test_proxy_fuzz.py) checks every answer against it.
"""

from __future__ import annotations

from typing import Any

from onepiece.config import MAX_GUIDANCE, MAX_SEED, Workflow
from onepiece.db.protocol import COMPLETED, FAILED, IN_PROGRESS, MAX_PAGE, QUEUED
from onepiece.proxy.idempotency import HEADER as IDEM_HEADER
from onepiece.proxy.validation import MAX_PRIORITY, MAX_SECONDS, CreateFields

Schema = dict[str, Any]

_STR: Schema = {"type": "string"}
_INT: Schema = {"type": "integer"}
_NULL_STR: Schema = {"type": ["string", "null"]}
_NULL_INT: Schema = {"type": ["integer", "null"]}

ERROR: Schema = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": _STR, "type": _STR, "param": _NULL_STR, "code": _STR},
    }},
}

VIDEO_ID: Schema = {"type": "string", "pattern": "^video_[0-9a-f]{32}$"}

VIDEO: Schema = {
    "type": "object",
    "required": ["id", "object", "model", "status", "progress", "created_at", "completed_at", "expires_at",
                 "error", "size", "seconds", "prompt", "remixed_from_video_id", "stage", "set"],
    "properties": {
        "id": VIDEO_ID, "object": {"const": "video"}, "model": _STR,
        "status": {"enum": [QUEUED, IN_PROGRESS, COMPLETED, FAILED]},
        "progress": {"type": "integer", "minimum": 0, "maximum": 100},
        "created_at": _INT, "completed_at": _NULL_INT, "expires_at": _NULL_INT,
        "error": {"anyOf": [{"type": "null"}, {"type": "object", "required": ["code", "message"],
                                                "properties": {"code": _STR, "message": _STR}}]},
        "size": _STR, "seconds": _STR, "prompt": _NULL_STR, "remixed_from_video_id": {"type": "null"},
        "stage": _NULL_STR, "set": _NULL_STR,
    },
}

VIDEO_LIST: Schema = {
    "type": "object", "required": ["object", "data", "first_id", "last_id", "has_more"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": VIDEO},
                   "first_id": _NULL_STR, "last_id": _NULL_STR, "has_more": {"type": "boolean"}},
}

DELETED: Schema = {
    "type": "object", "required": ["id", "object", "deleted"],
    "properties": {"id": VIDEO_ID, "object": {"const": "video.deleted"}, "deleted": {"const": True}},
}

MODELS: Schema = {
    "type": "object", "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
        "type": "object", "required": ["id", "object", "kind", "stages"],
        "properties": {"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR, "kind": _STR,
                       "stages": {"type": "array", "items": _STR}},
    }}},
}

HEALTH: Schema = {"type": "object", "required": ["status", "set", "inflight", "max_inflight", "dbs", "entrances"],
                  "properties": {"status": {"const": "ok"}, "set": _NULL_STR, "inflight": _INT,
                                 "max_inflight": _INT, "dbs": _INT, "entrances": {"type": "object"}}}

READY: Schema = {"type": "object", "required": ["status", "set", "missing"],
                 "properties": {"status": {"enum": ["ready", "not ready"]}, "set": _NULL_STR,
                                "missing": {"type": "array", "items": _STR}}}

LIST_PARAMETERS: list[Schema] = [
    {"name": "after", "in": "query", "required": False, "schema": VIDEO_ID,
     "description": "the id of the last video of the previous page"},
    {"name": "limit", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1,
                                                                    "maximum": MAX_PAGE}},
    {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"]}},
]


def create_body(workflow: Workflow, image_field: str) -> Schema:
    """``POST /v1/videos``'s header and body (the route reads the raw request, JSON or multipart,
    validated by proxy/validation.py, so FastAPI cannot infer them), with the bounds that hold for
    some application of ``workflow``: a request outside them is refused whatever its model."""
    lims = [app.limits for app in workflow.applications.values()]
    fields = CreateFields.model_json_schema()
    bounds: dict[str, Schema] = {
        "prompt": {"minLength": 1, "maxLength": max(x.max_prompt_chars for x in lims)},
        "negative_prompt": {"maxLength": max(x.max_prompt_chars for x in lims)},
        "model": {"enum": sorted(workflow.applications)},
        "size": {"pattern": r"^\s*[0-9]{1,6}\s*[xX]\s*[0-9]{1,6}\s*$"},
        "seconds": {"exclusiveMinimum": 0, "maximum": MAX_SECONDS},
        "num_frames": {"minimum": 1, "maximum": max(x.max_frames for x in lims)},
        "steps": {"minimum": 1, "maximum": max(x.max_steps for x in lims)},
        "guidance": {"minimum": 0, "maximum": MAX_GUIDANCE},
        "seed": {"minimum": 0, "maximum": MAX_SEED},
        "timeout_s": {"exclusiveMinimum": 0, "maximum": max(x.timeout_s for x in lims)},
        "slo_s": {"exclusiveMinimum": 0, "maximum": max(x.timeout_s for x in lims)},
        "priority": {"minimum": -MAX_PRIORITY, "maximum": MAX_PRIORITY},
    }
    bounds["num_inference_steps"], bounds["guidance_scale"] = bounds["steps"], bounds["guidance"]
    props = {}
    for name, prop in fields["properties"].items():
        extra = bounds.get(name, {})
        # pydantic writes an optional field as anyOf [its type, null]: the bounds go on the type
        props[name] = ({**prop, "anyOf": [{**alt, **extra} if alt.get("type") != "null" else alt
                                          for alt in prop["anyOf"]]} if "anyOf" in prop else {**prop, **extra})
    image = {"description": "image-to-video: the first frame, as base64, a data URL or {\"image_url\": data URL}",
             "anyOf": [{"type": "string"}, {"type": "object", "properties": {"image_url": {"type": "string"}}}]}
    as_json = {**fields, "properties": {**props, image_field: image}}
    # A form field is a string or absent: it cannot say null.
    form_props = {name: {**prop, "anyOf": [alt for alt in prop["anyOf"] if alt.get("type") != "null"]}
                  if "anyOf" in prop else prop for name, prop in props.items()}
    as_form = {**fields, "properties": {**form_props, image_field: {"type": "string", "format": "binary"}}}
    idem = {"name": IDEM_HEADER, "in": "header", "required": False,
            "schema": {"type": "string", "pattern": "^[!-~]{1,255}$"},
            "description": "a retry with the same key answers the video the first create made"}
    return {"parameters": [idem],
            "requestBody": {"required": True, "content": {"application/json": {"schema": as_json},
                                                          "multipart/form-data": {"schema": as_form}}}}


_WHY = {
    400: "invalid request (the error names the parameter)",
    401: "no API key, or a wrong one (when the proxy has keys)",
    404: "no such video (unknown, expired, deleted or not the caller's)",
    409: "the video is not ready or failed, or an Idempotency-Key conflict",
    413: "request body too large",
    415: "unsupported content type",
    429: "refused by admission (the set is at capacity, or the deadline cannot be met); see Retry-After",
    503: "a DB or the entrance stage is unavailable, or the proxy's body buffers are full; see Retry-After",
}


def ok(schema: Schema | None = None, media_type: str = "application/json", why: str = "success") -> Schema:
    return {"description": why, "content": {media_type: {"schema": schema if schema is not None else {}}}}


def responses(ok_response: Schema, *errors: int) -> dict[int | str, Any]:
    """A route's ``responses=``: its 200 and the error statuses it answers with an :data:`ERROR`."""
    out: dict[int | str, Any] = {200: ok_response}
    for status in errors:
        out[status] = {"description": _WHY[status], "content": {"application/json": {"schema": ERROR}}}
    return out


# Any request can be refused by the guard middleware before it reaches its route (proxy/api.py):
# a malformed Content-Length (400), a body over the bound (413), all body buffers taken (503).
_GUARD = (400, 413, 503)


def finish(schema: Schema, bearer: bool = False) -> Schema:
    """The generated schema, corrected: no 422 anywhere (the proxy answers 400), the guard's
    statuses on every operation, and a 401 on every ``/v1`` operation (proxy/auth.py).
    ``bearer``: the proxy asks for API keys, so every ``/v1`` operation declares the scheme."""
    guard = responses(ok(), *_GUARD, 401)
    for path, item in schema.get("paths", {}).items():
        v1 = path == "/v1" or path.startswith("/v1/")
        for op in item.values():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            rs = op["responses"]
            rs.pop("422", None)
            for status in _GUARD + ((401,) if v1 else ()):
                rs.setdefault(str(status), guard[status])
            if bearer and v1:
                op["security"] = [{"apiKey": []}]
    if bearer:
        schema.setdefault("components", {})["securitySchemes"] = {
            "apiKey": {"type": "http", "scheme": "bearer",
                       "description": "one of the proxy's API keys (`onepiece keys new`)"}}
    comps = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    if "components" in schema and not comps:
        schema["components"].pop("schemas", None)
        if not schema["components"]:
            del schema["components"]
    return schema
