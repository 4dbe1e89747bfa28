"""envd's RPC as the E2B SDKs speak it: the Connect protocol (JSON codec, HTTP/1.1) for
`process.Process` (process.py) and `filesystem.Filesystem` (filesystem.py), on the envd surface
(requests that carry `E2b-Sandbox-Id` and `E2b-Sandbox-Port: 49983`). This module holds what
both services share: the token gate in front of them, the request's caller and user, core
errors as Connect codes, and the relay of a core event stream with keepalives.

The Connect framing, codecs and errors are connectrpc's; the messages are generated from
proto/envd (`wire/`, scripts/gen-envd.sh). Each method is one call into the core, as the /v1
API's: the sandbox's envd token names the tenant, the core checks and audits.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import inspect
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from contextvars import ContextVar
from typing import Any, TypeVar, cast

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from agentbox.agent.client import AgentUnavailable
from agentbox.core.auth import Caller
from agentbox.core.errors import AgentboxError
from agentbox.server.surfaces import Core
from agentbox.vocab import status_of

T = TypeVar("T")
log = logging.getLogger("agentbox.e2b")

PROCESS_PATH = "/process.Process"
FILESYSTEM_PATH = "/filesystem.Filesystem"
KEEPALIVE_S = 30.0  # a silent stream carries a keepalive event this often (the SDK asks 50 s)
READ_MAX_BYTES = 4 << 20  # one request message (stdin chunks are far smaller)
CONTENT_TYPES = frozenset(
    {"application/json", "application/proto"}
    | {"application/connect+json", "application/connect+proto"}
)

# The request's sandbox, set by _Authenticated for the call it wraps.
_BOX: ContextVar[Any] = ContextVar("agentbox_e2b_box")

_STATUS_CODES = {
    400: Code.INVALID_ARGUMENT,
    401: Code.UNAUTHENTICATED,
    403: Code.PERMISSION_DENIED,
    404: Code.NOT_FOUND,
    408: Code.DEADLINE_EXCEEDED,
    409: Code.FAILED_PRECONDITION,
    413: Code.INVALID_ARGUMENT,
    429: Code.RESOURCE_EXHAUSTED,  # the SDK says "rate limit": only for what is one
    503: Code.UNAVAILABLE,
    504: Code.DEADLINE_EXCEEDED,
    507: Code.FAILED_PRECONDITION,
}
_CODE_OVERRIDES = {
    "path_exists": Code.ALREADY_EXISTS,
    "path_not_found": Code.NOT_FOUND,
    "sandbox_not_running": Code.UNAVAILABLE,
}


def connect_error(e: AgentboxError) -> ConnectError:
    """A core error as Connect says it: the status's code, the message unchanged."""
    code = _CODE_OVERRIDES.get(e.code) or _STATUS_CODES.get(status_of(e.code), Code.INTERNAL)
    return ConnectError(code, e.message)


@asynccontextmanager
async def _said() -> AsyncIterator[None]:
    try:
        yield
    except AgentboxError as e:
        raise connect_error(e) from None


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """A service method whose failures are Connect errors: core errors by their code, anything
    else INTERNAL without its text (logged here), never an exception's words verbatim."""

    def failed(e: Exception) -> ConnectError:
        if isinstance(e, ConnectError):
            return e
        if isinstance(e, AgentboxError):
            return connect_error(e)
        log.exception("envd RPC %s failed", method.__name__)
        return ConnectError(Code.INTERNAL, "internal error (logged by the server)")

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self: Any, request: Any, ctx: RequestContext) -> AsyncIterator[Any]:
            try:
                async with aclosing(method(self, request, ctx)) as events:
                    async for event in events:
                        yield event
            except Exception as e:
                raise failed(e) from None

        return stream

    @functools.wraps(method)
    async def unary(self: Any, request: Any, ctx: RequestContext) -> Any:
        try:
            return await method(self, request, ctx)
        except Exception as e:
            raise failed(e) from None

    return unary


def guard_methods(cls: type[T]) -> type[T]:
    for name, value in list(vars(cls).items()):
        if not name.startswith("_") and inspect.iscoroutinefunction(value):
            setattr(cls, name, _guarded(value))
        elif not name.startswith("_") and inspect.isasyncgenfunction(value):
            setattr(cls, name, _guarded(value))
    return cls


async def call(work: Awaitable[T]) -> T:
    async with _said():
        return await work


class Authenticated:
    """ASGI: the request's sandbox, from its headers and envd token, for the service methods
    (a method of a request without a valid token is UNAUTHENTICATED)."""

    def __init__(self, core: Core, app: ASGIApp, sandbox: Callable[[Core, Request], Any]) -> None:
        self.core, self.app, self.sandbox = core, app, sandbox

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope)
        box = self.sandbox(self.core, request)
        try:
            box.caller()  # no valid token (or not envd's port): answered before any body
        except AgentboxError as e:
            await _refuse(send, connect_error(e))
            return
        kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind not in CONTENT_TYPES:
            unsupported = ConnectError(
                Code.INVALID_ARGUMENT,
                f"content type {kind!r}: envd speaks Connect (application/json, "
                "application/proto, application/connect+json or application/connect+proto)",
            )
            await _refuse(send, unsupported, 415)
            return
        token = _BOX.set(box)
        try:
            await self.app(scope, receive, send)
        finally:
            _BOX.reset(token)


_HTTP_STATUS = {
    Code.INVALID_ARGUMENT: 400,
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.NOT_FOUND: 404,
}


async def _refuse(send: Send, error: ConnectError, status: int | None = None) -> None:
    """A Connect error answered without reading the request (Connect's unary error shape;
    a streaming client reads the HTTP status)."""
    body = json.dumps({"code": error.code.value, "message": error.message}).encode()
    status = status or _HTTP_STATUS.get(error.code, 400)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def request_caller() -> tuple[Caller, str]:
    """Who acts, by the request's envd token, and on which sandbox."""
    box = _BOX.get()
    try:
        return box.caller(), box.id
    except AgentboxError as e:
        raise connect_error(e) from None


def request_user(ctx: RequestContext) -> str | None:
    """envd's user: `Authorization: Basic base64("name:")`; none is the sandbox's default."""
    value = ctx.request_headers.get("authorization") or ""
    if not value:
        return None
    scheme, _, encoded = value.partition(" ")
    try:
        name = base64.b64decode(encoded.strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        name = None
    if scheme.lower() != "basic" or name is None:
        raise ConnectError(Code.UNAUTHENTICATED, 'Authorization must be Basic base64("user:")')
    if name not in ("user", "root"):
        raise ConnectError(Code.PERMISSION_DENIED, f"unknown user {name!r}: use user or root")
    return name


def oneof(field: str, value: Any) -> Any:
    """A oneof's value (the generated types want each field name as a literal)."""
    return cast(Any, Oneof(field, value))


async def relay(
    first: T,
    events: AsyncIterator[dict[str, Any]],
    convert: Callable[[dict[str, Any]], tuple[list[T], bool]],
    keepalive: Callable[[], T],
) -> AsyncGenerator[T, None]:
    """`first`, then each core event converted (to messages, and whether it was the last), a
    keepalive after each silent KEEPALIVE_S. The core's stream is under way before `first`
    is yielded, so closing this at any point closes it too (a command's end is then audited
    when it comes)."""
    it = aiter(events)
    pending: asyncio.Task[dict[str, Any]] | None = asyncio.ensure_future(anext(it))
    try:
        await asyncio.sleep(0)  # the task's first step runs: the core's stream has begun
        yield first
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
            if not done:
                yield keepalive()
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            except AgentUnavailable as e:
                raise ConnectError(Code.UNAVAILABLE, str(e)) from None
            messages, last = convert(item)
            for message in messages:
                yield message
            if last:
                return
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        close = getattr(it, "aclose", None)
        if close is not None:
            await close()
