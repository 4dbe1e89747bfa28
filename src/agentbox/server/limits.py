"""What an HTTP client may make the server spend, and the pieces that enforce it.

Anyone who can reach the port is a client, so nothing here trusts one until it shows a valid
API key, and even then only within limits:

- `RequestGuard` (ASGI middleware around the API) answers a request without a valid key with 401
  before reading a byte of its body, caps every body (413 with the limit), and ends bodies that
  stall;
- `GuardedH11Protocol` (uvicorn's HTTP/1.1 protocol) times out requests whose headers do not
  arrive in time (slowloris) and keeps connections within a budget in which connections that
  never showed a valid key can take only a share: when they are over it, the one that has waited
  longest for its headers is dropped, so a newcomer is always served;
- `raise_nofile` lifts the process's descriptor limit to what the host allows.

A proxy in front (see docs/DEPLOYMENT.md) adds per-address rate limits and TLS; none of the
above depends on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentbox.core.errors import AgentboxError, Unauthorized
from agentbox.core.logs import LogLimits
from agentbox.server.errors import http_status
from agentbox.server.fastpath import GatewayH11Protocol
from agentbox.server.gateway import RelayLimits

log = logging.getLogger("agentbox.server")

MiB = 2**20


@dataclass(frozen=True)
class McpLimits:
    """What MCP sessions over HTTP (`/mcp`) may hold: each keeps its commands' unread output."""

    sessions: int = 128  # open at once, every tenant together
    per_tenant: int = 16  # open at once, one tenant
    output_keep: int = 2 * MiB  # characters of command output one session keeps for paging
    idle_timeout: float = 1800.0  # a session with no request (and no open stream) this long ends
    # A session answers only its own tenant's keys. Off only in the security battery's positive
    # control (`mcp-sessions-open`): any valid key may use any session.
    owner_check: bool = True


@dataclass(frozen=True)
class ServerLimits:
    """The server's budgets for clients. Defaults suit one small host; see docs/API.md."""

    # Largest request body of a JSON route, and of the routes with bigger documents.
    json_body: int = 8 * MiB
    # Template builds carry the spec's files inline (base64).
    template_body: int = 64 * MiB
    # Request headers must be complete this long after a connection opens or goes idle.
    header_timeout: float = 10.0
    # A request body that sends nothing for this long is answered 408.
    body_idle_timeout: float = 30.0
    # Open HTTP connections (None: a quarter of the descriptor limit, at least 256), and the
    # share of them that connections without a valid API key may hold.
    max_connections: int | None = None
    anonymous_share: float = 0.5
    # Pings to WebSocket clients: one unanswered this long after another closes the socket
    # (None: no pings; only the security battery's positive control turns them off).
    ws_ping_interval: float | None = 20.0
    # A message logged more often than this per minute is counted instead (0: no limit).
    log_repeats: int = 5
    # Check the API key before reading the body. Off only in the security battery's positive
    # control (`server-unguarded`), to show its checks can see a server that reads first.
    key_first: bool = True
    relay: RelayLimits = field(default_factory=RelayLimits)
    # Tenants' default quota values over those derived from the host (core/quotas.py); only the
    # security battery's positive control (`quota-open`) sets them.
    tenant_quota: dict[str, Any] | None = None
    # The files APIs the server serves on the host (volumes, kept workspaces) follow no
    # symlink. Off only in the security battery's positive control (`host-files-follow`).
    host_files_nofollow: bool = True
    # E2B's sandbox traffic needs the sandbox's own envd token (server/e2b/). Off only in the
    # security battery's positive control (`e2b-envd-open`): any token (and any signed file
    # URL's signature) is taken.
    e2b_envd_tokens: bool = True
    # What the audit and egress logs may hold (sandboxes' refused attempts are sampled).
    logs: LogLimits = field(default_factory=LogLimits)
    mcp: McpLimits = field(default_factory=McpLimits)

    def connection_cap(self) -> int:
        if self.max_connections is not None:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(256, soft // 4)

    def body_cap(self, method: str, path: str) -> int | None:
        """The body limit of a route; None for the file uploads, which stream to the sandbox
        or the volume (their size is its disk's business)."""
        if (
            method == "PUT"
            and path.startswith(("/v1/sandboxes/", "/v1/volumes/"))
            and (path.endswith("/files"))
        ):
            return None
        if method == "POST" and path == "/v1/templates":
            return self.template_body
        return self.json_body


def raise_nofile() -> int:
    """Lift the soft descriptor limit to the hard one; the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            log.warning("could not raise the descriptor limit from %d to %d", soft, hard)
    return soft


# ---------------------------------------------------------------------------- connections


class ConnectionBudget:
    """Open connections, and which of them have not shown a valid key yet (anonymous)."""

    def __init__(self, cap: int, anonymous_share: float) -> None:
        self.cap = cap
        self.anonymous_cap = max(1, int(cap * anonymous_share))
        self.count = 0
        self.anonymous: dict[GuardedH11Protocol, None] = {}  # insertion order: oldest first
        self.refused = 0
        self.evicted = 0

    def admit(self, conn: GuardedH11Protocol) -> bool:
        if self.count >= self.cap or len(self.anonymous) >= self.anonymous_cap:
            if not self._evict_one():
                self.refused += 1
                return False
        self.count += 1
        self.anonymous[conn] = None
        return True

    def authenticated(self, conn: GuardedH11Protocol) -> None:
        self.anonymous.pop(conn, None)

    def _evict_one(self) -> bool:
        """Drop the anonymous connection that has waited longest for request headers."""
        for c in self.anonymous:
            if c.waiting_for_headers:
                self.evicted += 1
                c.drop()
                return True
        return False

    def leave(self, conn: GuardedH11Protocol) -> None:
        if conn.admitted:
            conn.admitted = False
            self.count -= 1
            self.anonymous.pop(conn, None)


class GuardedH11Protocol(GatewayH11Protocol):
    """uvicorn's HTTP/1.1 protocol (with the port gateway's fast path) with a header timeout
    and a connection budget.

    `budget`, `header_timeout` and `gateway_of` are set on a subclass made by `protocol_class`.
    """

    budget: ConnectionBudget
    header_timeout: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waiting_for_headers = True
        self.admitted = False
        self._header_timer: asyncio.TimerHandle | None = None
        inner = self.app

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            scope["agentbox.connection"] = self
            await inner(scope, receive, send)

        self.app = app

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.budget.admit(self):
            transport.abort()
            return
        self.admitted = True
        self._wait_for_headers()

    def mark_authenticated(self) -> None:
        """A request on this connection showed a valid key: it is no longer anonymous."""
        self.budget.authenticated(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        self.budget.leave(self)
        super().connection_lost(exc)

    def h11_receive(self, data: bytes) -> None:
        cycle = self.cycle
        super().h11_receive(data)
        if self.cycle is not cycle:  # a request's headers are in
            self.waiting_for_headers = False
            self._stop_header_timer()

    def fast_request_started(self) -> None:
        super().fast_request_started()
        self.waiting_for_headers = False
        self._stop_header_timer()

    def fast_exchange_done(self) -> None:
        super().fast_exchange_done()
        self._wait_for_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._wait_for_headers()

    def handle_websocket_upgrade(self, event: Any) -> None:
        # The WebSocket goes to the port gateway, which has its own caps and timeouts.
        self._stop_header_timer()
        self.budget.leave(self)
        super().handle_websocket_upgrade(event)

    def drop(self) -> None:
        self.budget.leave(self)
        self._stop_header_timer()
        self.transport.abort()

    def _wait_for_headers(self) -> None:
        self.waiting_for_headers = True
        self._stop_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.waiting_for_headers and not self.transport.is_closing():
            self.drop()


def protocol_class(
    limits: ServerLimits, gateway_of: Callable[[], Any] | None = None
) -> type[GuardedH11Protocol]:
    """A GuardedH11Protocol bound to one budget and (`gateway_of()`: the PortGateway once the
    app has built it, else None) the gateway whose fast path it runs, for
    `uvicorn.run(http=...)`."""
    budget = ConnectionBudget(limits.connection_cap(), limits.anonymous_share)
    attributes: dict[str, Any] = {"budget": budget, "header_timeout": limits.header_timeout}
    if gateway_of is not None:
        attributes["gateway_of"] = staticmethod(gateway_of)
    return type("AgentboxH11Protocol", (GuardedH11Protocol,), attributes)


# ---------------------------------------------------------------------------- requests


def _deny(status: int, code: str, message: str, detail: dict[str, Any]) -> tuple[bytes, list]:
    body = json.dumps({"code": code, "message": message, "detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        # The body is left unread: the connection cannot carry another request.
        (b"connection", b"close"),
    ]
    return body, headers


class RequestGuard:
    """ASGI middleware: a valid API key before the body, a cap on every body, no stalled body.

    `authenticate(key)` returns the caller a key belongs to (kept in the scope as
    `agentbox.caller` for the routes), or None. Routes in `open_routes` (paths) are served
    without one. A capped body is read here in full before the route runs (routes parse it
    whole anyway), so a route never sees half of one; streamed bodies (file uploads) go through
    with only the stall timeout.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        authenticate: Callable[[str], Any],
        limits: ServerLimits,
        open_routes: frozenset[str] = frozenset(),
        own_credentials: Callable[[Scope], tuple[bool, bool]] | None = None,
    ) -> None:
        self.app = app
        self._authenticate = authenticate
        self.limits = limits
        self._open_routes = open_routes
        # Requests a surface authenticates itself (no API key), and whether their body streams.
        self._own_credentials = own_credentials

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        own, streamed = (
            self._own_credentials(scope) if self._own_credentials is not None else (False, False)
        )
        if not own and path not in self._open_routes and self.limits.key_first:
            key = header(scope["headers"], b"x-api-key")
            if key is None:
                await refuse(send, Unauthorized("missing API key: send it in the X-API-Key header"))
                return
            caller = self._authenticate(key)
            if caller is None:
                await refuse(send, Unauthorized("invalid or revoked API key"))
                return
            scope["agentbox.caller"] = caller
            conn = scope.get("agentbox.connection")
            if conn is not None:
                conn.mark_authenticated()
        cap = None if streamed else self.limits.body_cap(method, path)
        declared = header(scope["headers"], b"content-length")
        if cap is not None and declared is not None and declared.isdigit() and int(declared) > cap:
            await refuse(send, BodyTooLarge(cap))
            return
        receive = self._stall_bounded(receive)
        if cap is None:
            await self.app(scope, receive, send)
            return
        try:
            body = await _read_body(receive, cap)
        except AgentboxError as e:
            await refuse(send, e)
            return
        except _ClientLeft:
            return
        await self.app(scope, _replay(body, receive), send)

    def _stall_bounded(self, receive: Receive) -> Receive:
        """`receive` with a bound on the wait for each piece of the body. Once the body is in,
        what is left to receive is the client leaving, which may rightly take as long as the
        response does (a long command's output, a large download): that wait is unbounded."""
        idle = self.limits.body_idle_timeout
        body_done = False

        async def bounded() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout(idle):
                    message = await receive()
            except TimeoutError:
                raise AgentboxError(
                    f"the request body stalled: nothing arrived for {idle:g} s",
                    code="request_timeout",
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        return bounded


class BodyTooLarge(AgentboxError):
    code = "body_too_large"

    def __init__(self, cap: int) -> None:
        super().__init__(
            f"the request body is over this route's limit of {cap} bytes; send files with "
            "PUT /v1/sandboxes/{id}/files (streamed, no such limit)",
            limit=cap,
        )


class _ClientLeft(Exception):
    pass


async def _read_body(receive: Receive, cap: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientLeft
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cap:
            raise BodyTooLarge(cap)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read, then whatever comes next (a disconnect, for streaming responses)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def refuse(send: Send, e: AgentboxError) -> None:
    body = json.dumps({"code": e.code, "message": e.message, "detail": e.detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        # The body is left unread: the connection cannot carry another request.
        (b"connection", b"close"),
    ]
    status = http_status(e)
    if status in (408, 429, 503):
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The value of header `name` (lower case) in ASGI `headers` (a scope's or a response's)."""
    for key, value in headers:
        if key == name:
            return str(value.decode("latin-1"))
    return None
