"""Errors as HTTP answers, in one place: each reason code's status, the error body, and the
app's exception handlers.

Core errors carry a stable reason code only. Which HTTP status a code means is this surface's
business: the /v1 API answers with the status the audit log records (agentbox.vocab.STATUS),
and would override a code here.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentbox.core.errors import AgentboxError
from agentbox.server import models as m
from agentbox.vocab import STATUS, status_of

log = logging.getLogger("agentbox.server")

# The /v1 API answers each code with the status the audit log records it with; a code this
# surface answered differently would be overridden here.
HTTP_STATUS: dict[str, int] = dict(STATUS)


def http_status(e: AgentboxError) -> int:
    return HTTP_STATUS.get(e.code, status_of(e.code))


def error_response(
    status: int,
    code: str,
    message: str,
    detail: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    # Messages and details may quote sandbox-made names (bytes, not always UTF-8).
    return JSONResponse(
        status_code=status,
        headers=headers,
        content={"code": code, "message": m.text(message), "detail": m.clean(detail or {})},
    )


# Errors that mean the body as a whole is not a JSON object, rather than an object that breaks
# the schema: docs/API.md answers these 400, schema violations 422.
_NOT_AN_OBJECT = frozenset({"model_attributes_type", "dict_type", "missing"})


def _unreadable_body(e: RequestValidationError) -> str | None:
    """Why the request body could not be read as a JSON object, or None if it could."""
    for err in e.errors():
        loc = tuple(err.get("loc", ()))
        if err.get("type") == "json_invalid" and len(loc) == 2 and isinstance(e.body, str):
            # FastAPI keeps only the decoder's reason and offset: rebuild the line and column.
            where = json.JSONDecodeError(str(err.get("ctx", {}).get("error")), e.body, loc[1])
            return f"the request body is not valid JSON: {where}"
        if err.get("type") in _NOT_AN_OBJECT and loc == ("body",):
            return (
                "the request body must be a JSON object (Content-Type: application/json); "
                f"got {_json_kind(e.body)}"
            )
    return None


def _json_kind(body: Any) -> str:
    if body is None or body == b"":
        return "no body (or null)"
    if isinstance(body, bytes | bytearray):
        return "a body whose Content-Type is not JSON"
    return {list: "an array", str: "a string", bool: "a boolean"}.get(type(body), "a number")


async def _agentbox_error(_: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, AgentboxError)
    status = http_status(e)
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return error_response(status, e.code, e.message, e.detail, headers)


def validation_message(e: RequestValidationError) -> tuple[int, str]:
    """The status and message a request that failed validation is answered with."""
    reason = _unreadable_body(e)
    if reason is not None:
        return 400, reason
    return 422, f"invalid request: {_summary(e)}"


def _summary(e: RequestValidationError) -> str:
    locs = (
        (".".join(str(x) for x in err.get("loc", ())), str(err.get("msg", "")))
        for err in e.errors()[:5]
    )
    return "; ".join(f"{loc}: {msg}" for loc, msg in locs)


async def _validation_error(_: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, RequestValidationError)
    reason = _unreadable_body(e)
    if reason is not None:
        return error_response(400, "invalid_request", reason)
    errors = [
        {
            "loc": list(err.get("loc", ())),
            "msg": str(err.get("msg", "")),
            "type": str(err.get("type", "")),
        }
        for err in e.errors()
    ]
    return error_response(
        422, "invalid_request", f"invalid request: {_summary(e)}", {"errors": errors}
    )


async def _http_error(request: Request, e: Exception) -> JSONResponse:
    # Raised by the framework itself (no such route, wrong method, unparseable body):
    # answer with a documented code and a message that says what to change.
    assert isinstance(e, StarletteHTTPException)
    status, message = e.status_code, str(e.detail)
    route = f"{request.method} {request.url.path}"
    if status == 404:
        code, message = "not_found", f"no such route: {route}; see GET /openapi.json"
    elif status == 405:
        code, message = "method_not_allowed", f"method not allowed: {route}"
    elif status == 400 and message == "There was an error parsing the body":
        code = "invalid_request"
        message = "the request body could not be parsed: send UTF-8 JSON (an object)"
    else:
        code = {401: "unauthorized", 403: "forbidden"}.get(status, "invalid_request")
        if status >= 500:
            code = "internal_error"
    return error_response(status, code, message, headers=dict(e.headers) if e.headers else None)


async def _unexpected(_: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return error_response(500, "internal_error", f"internal error: {type(e).__name__}")


def install_handlers(app: FastAPI) -> None:
    """Every error the app raises answers with the same body: code, message, detail."""
    app.add_exception_handler(AgentboxError, _agentbox_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
