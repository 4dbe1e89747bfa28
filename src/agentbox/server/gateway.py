"""The port gateway: an ASGI middleware that makes a server inside a sandbox reachable.

A request reaches port P of a sandbox either host-routed (`{P}-{sandbox_id}.{domain}`, the whole
path goes to the sandbox) or path-routed (`/v1/sandboxes/{id}/ports/{P}/rest`, `/rest` goes to
the sandbox with `X-Forwarded-Prefix`). Everything else goes to the wrapped API app untouched.

Sandboxes have no network interface: `connect(sandbox_id, port)` hands over a socket already
connected to the port on the sandbox's loopback. HTTP/1.1 goes through one connection pool per
(sandbox, port) over those sockets (server/upstream.py), so upstream connections are kept alive
and reused; bodies stream both ways. WebSocket upgrades are relayed message by message.

Ports are private unless the sandbox made them public: a request needs the sandbox's access token
(`X-Access-Token`), an API key of the sandbox's tenant (`X-API-Key`), or a signed URL (see
`core/ports.py`), which on a host-routed port also sets a cookie so a browser's follow-up
requests work. Those credentials are never forwarded into the sandbox.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import re
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, unquote_plus, urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidStatus,
    ProtocolError,
)
from websockets.frames import Frame, Opcode
from websockets.protocol import Protocol

from agentbox.core import ports
from agentbox.core.errors import (
    AgentboxError,
    Forbidden,
    InvalidRequest,
    NotFound,
    SandboxNotRunning,
    Unauthorized,
)
from agentbox.server import upstream
from agentbox.server.errors import http_status
from agentbox.server.upstream import KEEPALIVE_EXPIRY, dial, reset_if_unread
from agentbox.vocab import ErrorCode

log = logging.getLogger("agentbox.gateway")

CONNECT_TIMEOUT = 10.0
# Waiting for a free connection when a port already has `max_connections` in use.
POOL_TIMEOUT = 30.0
WS_CLOSE_TIMEOUT = 5.0


@dataclass(frozen=True)
class RelayLimits:
    """What relays through the gateway may hold, and for how long. A server in a sandbox is
    untrusted code: it may stream forever, stop reading, or flood control frames."""

    # No byte either way for this long ends a relay (a long poll or an event stream that sends
    # nothing for five minutes is gone; event streams send keep-alive comments well inside it).
    idle_timeout: float = 300.0
    # A side that does not take what is written to it for this long ends the relay.
    write_timeout: float = 30.0
    # Concurrent relays (HTTP exchanges and open WebSockets) per sandbox and per tenant.
    per_sandbox: int = 64
    per_tenant: int = 256
    # The largest WebSocket message relayed either way (one buffered message per side).
    ws_max_message: int = 4 * 2**20
    # Pings a sandbox's WebSocket server may send (answered by the gateway, never relayed):
    # a burst, refilled at a rate per second; beyond it the connection is closed (1008).
    ws_ping_burst: int = 20
    ws_pings_per_second: float = 5.0
    # Bytes queued towards a sandbox that stopped reading (pong replies included).
    ws_write_buffer: int = 2**20
    # Yield to the event loop after each relayed chunk. Off only in the security battery's
    # positive control (`gateway-unbounded`), to show its checks can see a starved loop.
    fair: bool = True
    # Confine a sandbox's Set-Cookie to its port (see _confined_cookie). Off only in the same
    # positive control.
    confine_cookies: bool = True
    # Relay plain HTTP/1.1 requests at the protocol level (server/fastpath.py) where the
    # server's protocol offers it; off: every request the ASGI way.
    fast_path: bool = True
    # The fast path checks each answer's head and framing. Off only in the security battery's
    # positive control `gateway-splice`: answers pass as a naive splice would pass them.
    check_answers: bool = True


_ORIGIN_SUFFIX = ".agentbox-gw"
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"}
)
_CREDENTIALS = frozenset({"x-access-token", "x-api-key"})
# Request headers the gateway sets itself (framing, forwarding) or must not pass on.
_REPLACED = frozenset(
    {
        "host",
        "content-length",
        "expect",  # uvicorn already answered 100-continue; the relay would not wait for it
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
        "x-forwarded-prefix",
    }
)
# What the WebSocket client library writes itself in the upgrade request.
_WS_HANDSHAKE = frozenset(
    {
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-protocol",
        "sec-websocket-accept",
    }
)
_AUTHORITY = re.compile(r"[A-Za-z0-9._~-]+(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")
_RETRYABLE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Close codes an endpoint may put in a close frame (RFC 6455 section 7.4).
_SENDABLE_CLOSE = frozenset({1000, 1001, 1002, 1003, *range(1007, 1015)})


@dataclass(frozen=True)
class PortTarget:
    sandbox_id: str
    tenant: str
    access_token: str
    public: bool  # ports public: no auth needed
    paused: bool = False  # whoever may reach it hears so (nothing is relayed)
    auto_resume: bool = False  # paused: a request with credentials resumes it (`wake`)


@dataclass(frozen=True)
class _Route:
    sandbox_id: str
    port: int
    target: bytes  # path and query as the sandbox's server sees them
    prefix: str | None  # path-routed: the X-Forwarded-Prefix
    exp: str | None  # the signed-URL query params, if any
    sig: str | None


# ---------------------------------------------------------------------------- routing


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def _split_query(query: bytes) -> tuple[bytes, str | None, str | None]:
    """The query without the signed-URL params (others kept byte for byte), and those params."""
    if not query:
        return b"", None, None
    kept: list[bytes] = []
    exp = sig = None
    for part in query.split(b"&"):
        raw_name, _, raw_value = part.partition(b"=")
        name = unquote_plus(raw_name.decode("latin-1"))
        if name == ports.EXP_PARAM:
            exp = unquote_plus(raw_value.decode("latin-1")) if exp is None else exp
        elif name == ports.SIG_PARAM:
            sig = unquote_plus(raw_value.decode("latin-1")) if sig is None else sig
        else:
            kept.append(part)
    return b"&".join(kept), exp, sig


def _route(scope: Scope, domain: str) -> _Route | None:
    """Where a request goes, or None for the wrapped app. Runs on every API request."""
    host = _header(scope, b"host")
    hit = ports.parse_port_host(host, domain) if host else None
    path: str = scope["path"]
    prefix = None
    if hit is not None:
        port, sandbox_id = hit
        raw_path = scope.get("raw_path") or quote(path).encode("ascii")
        target = raw_path if raw_path.startswith(b"/") else b"/"
    elif path.startswith("/v1/sandboxes/"):
        parsed = ports.parse_port_path(path)
        if parsed is None:
            return None
        port, sandbox_id, rest = parsed
        raw_path = scope.get("raw_path") or quote(path).encode("ascii")
        prefix = ports.port_path_prefix(sandbox_id, port)
        raw_prefix = prefix.encode("ascii")
        # Keep the client's own encoding of the rest when the prefix was spelled plainly.
        if raw_path.startswith(raw_prefix + b"/"):
            target = raw_path[len(raw_prefix) :]
        elif raw_path == raw_prefix:
            target = b"/"
        else:
            target = quote(rest).encode("ascii")
    else:
        return None
    query, exp, sig = _split_query(scope.get("query_string", b""))
    if query:
        target += b"?" + query
    return _Route(sandbox_id, port, target, prefix, exp, sig)


# ---------------------------------------------------------------------------- headers


def _connection_tokens(headers: Iterable[tuple[str, str]]) -> set[str]:
    tokens: set[str] = set()
    for name, value in headers:
        if name == "connection":
            tokens.update(t.strip().lower() for t in value.split(","))
    return tokens


def _cookies(headers: Iterable[tuple[str, str]], name: str) -> list[str]:
    found = []
    for key, value in headers:
        if key == "cookie":
            for part in value.split(";"):
                k, eq, v = part.strip().partition("=")
                if eq and k.strip() == name:
                    found.append(v.strip())
    return found


def _without_cookie(value: str, name: str) -> str:
    parts = (p.strip() for p in value.split(";"))
    return "; ".join(p for p in parts if p and p.partition("=")[0].strip() != name)


def _decoded(scope: Scope) -> list[tuple[str, str]]:
    return [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]]


def _forwarded_headers(
    scope: Scope, headers: list[tuple[str, str]], route: _Route, drop: frozenset[str]
) -> list[tuple[str, str]]:
    """The client's headers as the sandbox gets them: without our credentials, hop-by-hop
    headers or `drop`, plus the X-Forwarded-* set. Framing and Host are the caller's."""
    listed = _connection_tokens(headers)
    out: list[tuple[str, str]] = []
    forwarded_for = []
    for name, value in headers:
        if name == "x-forwarded-for":
            forwarded_for.append(value)
        if (
            name in _HOP_BY_HOP
            or name.startswith("proxy-")
            or name in listed
            or name in _CREDENTIALS
            or name in _REPLACED
            or name in drop
        ):
            continue
        if name == "cookie":
            value = _without_cookie(value, ports.COOKIE)
            if not value:
                continue
        out.append((name, value))
    client = scope.get("client")
    if client:
        forwarded_for.append(str(client[0]))
    if forwarded_for:
        out.append(("x-forwarded-for", ", ".join(forwarded_for)))
    scheme = str(scope.get("scheme") or "http")
    scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
    out.append(("x-forwarded-proto", scheme))
    host = _header(scope, b"host")
    if host:
        out.append(("x-forwarded-host", host))
    if route.prefix:
        out.append(("x-forwarded-prefix", route.prefix))
    return out


def _confined_cookie(value: str, prefix: str | None) -> str | None:
    """A Set-Cookie from a sandbox's server as the client may get it, or None to drop it.

    A sandbox's cookie never reaches beyond where it came from: no `Domain` (a host-routed
    port's cookie would otherwise cover every sandbox's host, or the API's, under a shared
    parent domain), on a path-routed port a `Path` under that port's prefix (they all share the
    API's origin), and never the gateway's own access cookie (cookie tossing)."""
    first, *attributes = value.split(";")
    if first.partition("=")[0].strip() == ports.COOKIE:
        return None
    kept, path = [], None
    for attribute in attributes:
        name, _, arg = attribute.strip().partition("=")
        if name.lower() == "domain":
            continue
        if name.lower() == "path":
            path = arg.strip()
            continue
        kept.append(attribute.strip())
    if prefix is not None:
        safe = path and path.startswith("/") and ".." not in path and "%" not in path
        path = prefix + (path if safe else "/")  # type: ignore[operator]
    if path is not None:
        kept.append(f"Path={path}")
    return "; ".join([first.strip(), *kept])


def _response_headers(
    raw: Iterable[tuple[bytes, bytes]], prefix: str | None, confine: bool = True
) -> list[tuple[bytes, bytes]]:
    pairs = list(raw)
    listed = _connection_tokens(
        (k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in pairs
    )
    out = []
    for key, value in pairs:
        name = key.decode("latin-1").lower()
        if name in _HOP_BY_HOP or name.startswith("proxy-") or name in listed:
            continue
        if name == "set-cookie" and confine:
            cookie = _confined_cookie(value.decode("latin-1"), prefix)
            if cookie is None:
                continue
            value = cookie.encode("latin-1")
        out.append((name.encode("latin-1"), value))  # ASGI wants lower-case names
    return out


# ---------------------------------------------------------------------------- upstream sockets


def _abort(transport: asyncio.BaseTransport) -> None:
    """Drop a WebSocket's connection to a sandbox at once, queued data and all."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        reset_if_unread(sock)
    if isinstance(transport, asyncio.Transport):
        transport.abort()
    else:
        transport.close()


class _GuardedConnection(ClientConnection):
    """A WebSocket connection to a sandbox's server that rations what that server can make the
    gateway do: its pings are answered up to a rate (never relayed), and once it stops reading,
    what is queued for it (pongs included) cannot grow past a bound."""

    def __init__(self, protocol: Protocol, *, limits: RelayLimits, **options: Any) -> None:
        super().__init__(protocol, **options)  # type: ignore[arg-type]
        self._limits = limits
        self._pings = float(limits.ws_ping_burst)
        self._refilled = time.monotonic()
        self.abuse: str | None = None  # why the gateway cut the connection, if it did
        handle = protocol.recv_frame

        def recv_frame(frame: Frame) -> None:
            if frame.opcode is Opcode.PING and not self._take_ping():
                self.abuse = (
                    f"the sandbox's server sent pings faster than {limits.ws_pings_per_second:g}/s"
                )
                # Stops the parser at once (the rest of a flood is not even parsed).
                raise ProtocolError("ping flood")
            handle(frame)

        protocol.recv_frame = recv_frame  # type: ignore[method-assign]

    def _take_ping(self) -> bool:
        now = time.monotonic()
        rate, burst = self._limits.ws_pings_per_second, self._limits.ws_ping_burst
        self._pings = min(burst, self._pings + (now - self._refilled) * rate)
        self._refilled = now
        if self._pings < 1:
            return False
        self._pings -= 1
        return True

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        transport = self.transport
        if self.abuse is None and transport.get_write_buffer_size() > self._limits.ws_write_buffer:
            self.abuse = "the sandbox's server stopped reading"
        if self.abuse is not None:
            _abort(transport)


class _Stalled(Exception):
    """One side of a relay did not take what was written to it (or sent nothing) in time."""

    def __init__(self, why: str, code: str = ErrorCode.UPSTREAM_TIMEOUT) -> None:
        super().__init__(why)
        self.code = code


async def _within(
    what: Awaitable[Any], timeout: float, why: str, code: str = ErrorCode.UPSTREAM_TIMEOUT
) -> Any:
    try:
        async with asyncio.timeout(timeout):
            return await what
    except TimeoutError:
        raise _Stalled(why, code) from None


def _bounded(send: Send, timeout: float) -> Send:
    """`send` to the client, failing with _Stalled when the client does not read for
    `timeout` (uvicorn's send waits for its write buffer to drain, without a limit)."""

    async def bounded(message: Message) -> None:
        why = f"the client did not read for {timeout:g} s"
        await _within(send(message), timeout, why, ErrorCode.CLIENT_STALLED)

    return bounded


# ---------------------------------------------------------------------------- errors


def _token_matches(given: Mapping[str, str], target: PortTarget) -> bool:
    """Whether the request's X-Access-Token is the sandbox's access token."""
    token = given.get("x-access-token")
    return token is not None and hmac.compare_digest(
        token.encode("latin-1"), target.access_token.encode()
    )


def _port_not_open(route: _Route) -> AgentboxError:
    return AgentboxError(
        f"nothing is listening on port {route.port} in sandbox {route.sandbox_id}; "
        "start a server there bound to 127.0.0.1 or 0.0.0.0",
        code="port_not_open",
        sandbox_id=route.sandbox_id,
        port=route.port,
    )


def _upstream_error(route: _Route, e: BaseException, limits: RelayLimits) -> AgentboxError | None:
    """What went wrong talking to the sandbox's server, as the client should hear it; None
    for anything else (a bug here, which the ASGI server reports as such)."""
    where = dict(sandbox_id=route.sandbox_id, port=route.port)
    if isinstance(e, AgentboxError):
        return e
    if isinstance(e, ConnectionRefusedError):
        return _port_not_open(route)
    if isinstance(e, upstream.PoolTimeout):
        return AgentboxError(
            f"too many open connections to port {route.port} in sandbox {route.sandbox_id}; "
            "retry later or close idle ones",
            code="gateway_busy",
            **where,
        )
    if isinstance(e, _Stalled):
        return AgentboxError(str(e), code=e.code, **where)
    if isinstance(e, upstream.ReadTimeout):
        return AgentboxError(
            f"the server on port {route.port} in sandbox {route.sandbox_id} sent no answer "
            f"for {limits.idle_timeout:g} s",
            code="upstream_timeout",
            **where,
        )
    if isinstance(e, upstream.WriteTimeout):
        return AgentboxError(
            f"the server on port {route.port} in sandbox {route.sandbox_id} did not read the "
            f"request for {limits.write_timeout:g} s",
            code="upstream_timeout",
            **where,
        )
    if isinstance(e, TimeoutError):  # dialling the port
        return AgentboxError(
            f"port {route.port} in sandbox {route.sandbox_id} did not answer within "
            f"{CONNECT_TIMEOUT:g} s",
            code="upstream_timeout",
            **where,
        )
    if not isinstance(e, OSError | upstream.UpstreamError | InvalidHandshake):
        return None
    return AgentboxError(
        f"the server on port {route.port} in sandbox {route.sandbox_id} did not answer "
        f"properly: {e or type(e).__name__}",
        code="upstream_error",
        **where,
    )


def _error_body(e: AgentboxError) -> bytes:
    body = {"code": e.code, "message": e.message, "detail": e.detail}
    return json.dumps(body, default=str).encode()


_JSON = [(b"content-type", b"application/json"), (b"cache-control", b"no-store")]


async def _send_http_error(send: Send, e: AgentboxError) -> None:
    body = _error_body(e)
    headers = [*_JSON, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": http_status(e), "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _deny_websocket(
    scope: Scope, send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    """Refuse an upgrade with an HTTP response if the server can, else a close frame."""
    if "websocket.http.response" in (scope.get("extensions") or {}):
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        code = 1008 if status in (401, 403, 404) else 1011
        reason = body.decode("utf-8", "replace").encode()[:123].decode("utf-8", "ignore")
        await send({"type": "websocket.close", "code": code, "reason": reason})


def _ws_authority(host: str) -> str:
    """The Host header as the authority of the upstream WebSocket URI (which only carries it):
    one that is no plain host[:port] (user info, a path, junk) becomes `localhost` rather than
    bend the URI."""
    if _AUTHORITY.fullmatch(host):
        try:
            _ = urlsplit(f"//{host}").port  # raises for a port out of range
            return host
        except ValueError:
            pass
    return "localhost"


def _close_code(code: int | None, lost: int) -> int:
    """A close code one side reported, as one we may send to the other side."""
    if code is None or code == 1005:  # closed without a code
        return 1000
    if code in _SENDABLE_CLOSE or 3000 <= code <= 4999:
        return code
    return lost  # 1006 (connection dropped), 1015 (TLS) and the like


# ---------------------------------------------------------------------------- the middleware


class PortGateway:
    """ASGI middleware that proxies sandbox ports and passes everything else to `app`.

    `max_connections` caps upstream connections per (sandbox, port), so one busy port cannot
    starve the others; `limits` bounds every relay's lifetime, buffers and count.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        domain: str,
        lookup: Callable[[str], Awaitable[PortTarget | None]],
        tenant_of_key: Callable[[str], Awaitable[str | None]],
        connect: Callable[[str, int], Awaitable[socket.socket]],
        on_access: Callable[[str, int, str, int], None] | None = None,
        max_connections: int = 100,
        limits: RelayLimits | None = None,
        handlers: Mapping[int, ASGIApp] | None = None,
        wake: Callable[[str], Awaitable[bool]] | None = None,
        lookup_now: Callable[[str], PortTarget | None] | None = None,
        tenant_of_key_now: Callable[[str], str | None] | None = None,
    ) -> None:
        """`handlers`: ports served by the control plane itself rather than relayed to the
        sandbox (an E2B envd endpoint): port -> ASGI app, see `_hand_over`. `wake`: resume a
        paused sandbox created with auto_resume (whether it now runs). `lookup_now` and
        `tenant_of_key_now`: `lookup` and `tenant_of_key` without waiting, for the fast path
        (see `fast_admit`), which is off without them."""
        self.app = app
        self._lookup_now = lookup_now
        self._tenant_of_key_now = tenant_of_key_now
        self._wake = wake
        self.handlers = dict(handlers or {})
        self.domain = domain
        self._lookup = lookup
        self._tenant_of_key = tenant_of_key
        self._connect = connect
        self._on_access = on_access
        self._max_connections = max_connections
        self._pools: dict[tuple[str, int], upstream.Pool] = {}
        self._last_sweep = time.monotonic()
        self.limits = limits or RelayLimits()
        self._unguessable = secrets.token_urlsafe(32)
        # Relays open now, per sandbox and per tenant.
        self._relays: dict[str, int] = {}
        self.fast_relayed = 0  # requests the fast path took (server/fastpath.py)
        self.fast_busy: set[Any] = set()  # its exchanges in progress (FastRelay)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        route = _route(scope, self.domain) if kind in ("http", "websocket") else None
        if route is None:
            await self.app(scope, receive, send)
            return
        if route.exp is not None or route.sig is not None:
            # uvicorn's access log reads the query from this scope: keep the signature out of it.
            scope["query_string"] = route.target.partition(b"?")[2]
        method = scope.get("method", "GET") if kind == "http" else "WEBSOCKET"
        status: int | None = 500
        try:
            if route.port in self.handlers:
                status = await self._hand_over(scope, receive, send, route)
            else:
                status = await self._serve(scope, receive, send, route)
        finally:
            if status is not None:
                self._audit(route, method, status)

    def fast_ready(self) -> bool:
        """Whether the fast path (server/fastpath.py) may relay requests to this gateway."""
        return (
            self.limits.fast_path
            and self._lookup_now is not None
            and self._tenant_of_key_now is not None
        )

    def fast_admit(
        self, route: _Route, headers: list[tuple[str, str]]
    ) -> tuple[PortTarget, tuple[str, str]] | None:
        """The sandbox and a relay slot (give it back with `_give_slot`) for a request the fast
        path may relay at once, or None: the request then goes the ASGI way, which decides
        every other case itself (refusals, signed URLs, paused sandboxes, the control plane's
        own ports, a full budget). Admits exactly what `_authorize` lets through without a
        Set-Cookie."""
        if (
            not self.fast_ready()
            or route.port in self.handlers
            or route.exp is not None
            or route.sig is not None
        ):
            return None
        assert self._lookup_now is not None and self._tenant_of_key_now is not None
        target = self._lookup_now(route.sandbox_id)
        if target is None or target.paused:
            return None
        if not target.public and not self._fast_credentials(headers, route, target):
            return None
        try:
            slot = self._take_slot(route, target)
        except AgentboxError:
            return None
        self.fast_relayed += 1
        return target, slot

    def _fast_credentials(
        self, headers: list[tuple[str, str]], route: _Route, target: PortTarget
    ) -> bool:
        """`_check_credentials` for the cases it lets through without a Set-Cookie."""
        given = dict(headers)
        if _token_matches(given, target):
            return True
        key = given.get("x-api-key")
        if key is not None:
            assert self._tenant_of_key_now is not None
            tenant = self._tenant_of_key_now(key)
            if tenant is not None:
                return tenant == target.tenant  # another tenant's key: refused the ASGI way
        now = time.time()
        return any(
            ports.check_signature(
                target.access_token, route.sandbox_id, route.port, *value.partition(".")[::2], now
            )
            is None
            for value in _cookies(headers, ports.COOKIE)
        )

    async def aclose(self) -> None:
        """Close every pooled upstream connection, and end the fast path's exchanges still
        running (the server's graceful wait for them is over: they are no task it cancels)."""
        for relay in list(self.fast_busy):
            relay.abort()
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()

    # ------------------------------------------------------------------ per request

    async def _hand_over(
        self, scope: Scope, receive: Receive, send: Send, route: _Route
    ) -> int | None:
        """A port the control plane serves itself: its app gets the request as the sandbox's
        server would (path and query as routed), with `scope["agentbox.port"]` = the sandbox's
        `PortTarget` (None: no running sandbox of that id), port, id as named, and the rest of
        the server (`app`). The app authorizes the
        request itself (its own credentials, not the port's access token); the relay budgets
        of the sandbox and its tenant still apply."""
        target = await self._lookup(route.sandbox_id)
        if target is not None and target.paused:
            target = None  # as for a sandbox that is not running
        path, _, query = route.target.partition(b"?")
        inner = dict(scope, path=unquote(path.decode("latin-1")), raw_path=path)
        inner["query_string"] = query
        # The sandbox as named (also when none runs), and the rest of the server, for an app
        # that serves the port as one of its own requests (E2B's host-routed envd).
        inner["agentbox.port"] = {
            "target": target,
            "port": route.port,
            "sandbox_id": route.sandbox_id,
            "app": self.app,
        }
        slot = None
        if target is not None:
            try:
                slot = self._take_slot(route, target)
            except AgentboxError as e:
                return await self._refuse(scope, receive, send, e)
        status: list[int] = []

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        try:
            await self.handlers[route.port](inner, receive, watched)
        finally:
            if slot is not None:
                self._give_slot(slot)
        if scope["type"] == "websocket":
            return None  # the app answers and audits its own WebSockets
        return status[0] if status else 500

    async def _serve(self, scope: Scope, receive: Receive, send: Send, route: _Route) -> int | None:
        """Authorize and relay one request or WebSocket; the HTTP status it got, or None when
        already audited (a WebSocket is, once accepted: it may stay open for hours)."""
        headers = _decoded(scope)
        try:
            target, set_cookie = await self._authorize(scope, headers, route)
            slot = self._take_slot(route, target)
        except AgentboxError as e:
            return await self._refuse(scope, receive, send, e)
        except Exception:
            log.exception("port gateway: authorizing a request failed")
            internal = AgentboxError("internal error while authorizing the request")
            return await self._refuse(scope, receive, send, internal)
        try:
            if scope["type"] == "websocket":
                return await self._relay_websocket(scope, receive, send, route, headers, set_cookie)
            return await self._relay_http(scope, receive, send, route, headers, set_cookie)
        finally:
            self._give_slot(slot)

    def _take_slot(self, route: _Route, target: PortTarget) -> tuple[str, str]:
        """Count one more relay for the sandbox and its tenant, or refuse past either cap."""
        keys = (f"s:{route.sandbox_id}", f"t:{target.tenant}")
        caps = (self.limits.per_sandbox, self.limits.per_tenant)
        for key, cap, whose in zip(keys, caps, ("sandbox", "tenant"), strict=True):
            if self._relays.get(key, 0) >= cap:
                raise AgentboxError(
                    f"{cap} connections are already open through the gateway to this {whose}'s "
                    "ports (the per-" + whose + " limit); close some or retry later",
                    code="gateway_busy",
                    sandbox_id=route.sandbox_id,
                    port=route.port,
                    limit=cap,
                )
        for key in keys:
            self._relays[key] = self._relays.get(key, 0) + 1
        return keys

    def _give_slot(self, keys: tuple[str, str]) -> None:
        for key in keys:
            left = self._relays.get(key, 0) - 1
            if left > 0:
                self._relays[key] = left
            else:
                self._relays.pop(key, None)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, e: AgentboxError) -> int:
        if scope["type"] == "websocket":
            message = await receive()  # websocket.connect
            if message["type"] == "websocket.connect":
                await _deny_websocket(scope, send, http_status(e), _JSON, _error_body(e))
        else:
            await _send_http_error(send, e)
        return http_status(e)

    def _audit(self, route: _Route, method: str, status: int) -> None:
        if self._on_access is None:
            return
        try:
            self._on_access(route.sandbox_id, route.port, method, status)
        except Exception:
            log.exception("port gateway: on_access failed")

    async def _authorize(
        self, scope: Scope, headers: list[tuple[str, str]], route: _Route
    ) -> tuple[PortTarget, str | None]:
        """Raise unless the request may reach the port; the sandbox, and a Set-Cookie value to
        add if any."""
        found = await self._lookup(route.sandbox_id)
        not_found = NotFound(f"no running sandbox {route.sandbox_id}", sandbox_id=route.sandbox_id)
        # An unknown id is judged like a private port whose token nobody knows, so a caller
        # without valid credentials gets the same answer for both (no existence oracle); a
        # tenant's own key learns that it is not found, as for another tenant's sandbox.
        target = found or PortTarget(route.sandbox_id, "", self._unguessable, public=False)
        set_cookie = await self._check_credentials(scope, headers, route, target, not_found)
        if found is None:
            raise not_found  # not reached: no credential matches the unguessable token
        if found.paused and found.auto_resume and not found.public and self._wake is not None:
            # Woken only by a request that showed credentials (a public port asks none).
            if await self._wake(route.sandbox_id):
                found = await self._lookup(route.sandbox_id) or found
        if found.paused:
            sid = route.sandbox_id
            raise SandboxNotRunning(
                f"sandbox {sid} is paused; resume it first (POST /v1/sandboxes/{sid}/resume)",
                state="paused",
            )
        return found, set_cookie

    async def _check_credentials(
        self,
        scope: Scope,
        headers: list[tuple[str, str]],
        route: _Route,
        target: PortTarget,
        not_found: NotFound,
    ) -> str | None:
        if target.public:
            return None
        given = dict(headers)  # the last of repeated headers wins; none of ours repeat
        token = given.get("x-access-token")
        if _token_matches(given, target):
            return None
        key = given.get("x-api-key")
        if key is not None:
            tenant = await self._tenant_of_key(key)
            if tenant is not None:
                if tenant == target.tenant:
                    return None
                raise not_found  # another tenant's sandbox (or none): do not reveal which
        if route.exp is not None or route.sig is not None:
            reason = ports.check_signature(
                target.access_token,
                route.sandbox_id,
                route.port,
                route.exp or "",
                route.sig or "",
                time.time(),
            )
            if reason is not None:
                raise self._bad_signature(route, reason)
            if route.prefix is not None:
                # Path-routed ports share the API's origin: a cookie there would let a page of
                # one sandbox use another's port. Only host-routed ports (an origin of their
                # own) get one; path-routed requests carry the signature every time.
                return None
            return self._cookie(scope, route, route.exp or "", route.sig or "")
        reason = None
        for value in _cookies(headers, ports.COOKIE):
            exp, _, sig = value.partition(".")
            reason = ports.check_signature(
                target.access_token, route.sandbox_id, route.port, exp, sig, time.time()
            )
            if reason is None:
                return None
        if reason is not None:
            raise self._bad_signature(route, f"{ports.COOKIE} cookie: {reason}")
        why = (
            "the X-Access-Token does not match"
            if token is not None
            else "the API key is not valid"
            if key is not None
            else "no credentials"
        )
        raise Unauthorized(
            f"port {route.port} of sandbox {route.sandbox_id} is private: send X-Access-Token "
            f"with the sandbox's access token, or open a signed URL from "
            f"sandbox.get_url({route.port})",
            sandbox_id=route.sandbox_id,
            port=route.port,
            reason=why,
        )

    @staticmethod
    def _bad_signature(route: _Route, reason: str) -> Forbidden:
        return Forbidden(
            f"{reason}; get a new signed URL from sandbox.get_url({route.port})",
            sandbox_id=route.sandbox_id,
            port=route.port,
            reason=reason,
        )

    @staticmethod
    def _cookie(scope: Scope, route: _Route, exp: str, sig: str) -> str:
        path = f"{route.prefix}/" if route.prefix else "/"
        cookie = f"{ports.COOKIE}={exp}.{sig}; HttpOnly; SameSite=Lax; Path={path}"
        if int(exp):
            cookie += f"; Max-Age={max(0, int(exp) - int(time.time()))}"
        if scope.get("scheme") in ("https", "wss"):
            cookie += "; Secure"
        return cookie

    # ------------------------------------------------------------------ HTTP

    def _pool(self, sandbox_id: str, port: int) -> upstream.Pool:
        key = (sandbox_id, port)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = upstream.Pool(
                self._connect, sandbox_id, port, self._max_connections
            )
        return pool

    def _sweep(self) -> None:
        """Drop the pools of ports nobody used for a while (their connections have expired)."""
        now = time.monotonic()
        if now - self._last_sweep < KEEPALIVE_EXPIRY:
            return
        self._last_sweep = now
        stale = [
            key
            for key, p in self._pools.items()
            if p.active == 0 and now - p.idle_since > KEEPALIVE_EXPIRY
        ]
        for key in stale:
            self._pools.pop(key).close()

    async def _relay_http(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: _Route,
        headers: list[tuple[str, str]],
        set_cookie: str | None,
    ) -> int:
        limits = self.limits
        out = _forwarded_headers(scope, headers, route, frozenset())
        given = dict(headers)
        out.insert(0, ("host", given.get("host") or "localhost"))
        first: Message | None = None
        if "content-length" in given and "transfer-encoding" in given:
            # Two framings for one body (RFC 9112 section 6.3): the classic request-smuggling
            # shape; refuse rather than guess which one the sandbox's server would believe.
            await _send_http_error(
                send,
                InvalidRequest(
                    "the request has both Content-Length and Transfer-Encoding; send one",
                    sandbox_id=route.sandbox_id,
                    port=route.port,
                ),
            )
            return 400
        if "content-length" in given:
            out.append(("content-length", given["content-length"]))
            has_body = given["content-length"].strip() != "0"
        elif "transfer-encoding" in given:
            has_body = True
        elif scope.get("http_version") == "2":
            # HTTP/2 frames a body without either header: look at the first piece.
            first = await receive()
            if first["type"] == "http.disconnect":
                return 499
            has_body = bool(first.get("body") or first.get("more_body"))
        else:
            has_body = False
        if has_body and "content-length" not in given:
            out.append(("transfer-encoding", "chunked"))
        body_queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=4)
        send = _bounded(send, limits.write_timeout)

        async def until_disconnect() -> None:
            # The only reader of `receive`: feeds the body to the upstream request, then
            # notices the client leaving (a long poll or an event stream must not outlive it).
            pending = has_body
            message = first
            while True:
                if message is None:
                    message = await receive()
                if message["type"] == "http.disconnect":
                    return
                if message["type"] == "http.request" and pending:
                    if chunk := message.get("body", b""):
                        await body_queue.put(chunk)
                    if not message.get("more_body", False):
                        pending = False
                        await body_queue.put(None)
                message = None

        async def body() -> AsyncIterator[bytes]:
            stalled = f"the client sent no more of the request body for {limits.idle_timeout:g} s"
            while True:
                chunk = await _within(
                    body_queue.get(), limits.idle_timeout, stalled, ErrorCode.REQUEST_TIMEOUT
                )
                if chunk is None:
                    return
                yield chunk

        method = scope["method"]
        request_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in out]
        status = 0
        answered = False

        async def exchange() -> None:
            nonlocal status, answered
            pool = self._pool(route.sandbox_id, route.port)
            pool.active += 1
            try:
                response = await pool.request(
                    method.encode("ascii"),
                    route.target,
                    request_headers,
                    body() if has_body else None,
                    connect_timeout=CONNECT_TIMEOUT,
                    pool_timeout=POOL_TIMEOUT,
                    # A long poll or an event stream may be quiet a while, not past the idle
                    # timeout.
                    read_timeout=limits.idle_timeout,
                    write_timeout=limits.write_timeout,
                    retry=not has_body and method in _RETRYABLE_METHODS,
                )
                try:
                    response_headers = _response_headers(
                        response.headers, route.prefix, limits.confine_cookies
                    )
                    if set_cookie:
                        response_headers.append((b"set-cookie", set_cookie.encode("latin-1")))
                    await send(
                        {
                            "type": "http.response.start",
                            "status": response.status,
                            "headers": response_headers,
                        }
                    )
                    status = response.status
                    try:
                        async for chunk in response.body():
                            if chunk:
                                await send(
                                    {"type": "http.response.body", "body": chunk, "more_body": True}
                                )
                            # A socket with data waiting never suspends sock_recv, and a client
                            # that reads fast never suspends send: without this, one sandbox
                            # streaming small chunks would hold the event loop for everyone.
                            if limits.fair:
                                await asyncio.sleep(0)
                    except (upstream.UpstreamError, _Stalled) as e:
                        # Too late for an error response: leaving the body unfinished makes the
                        # server drop the connection, so the client sees a truncated response.
                        log.info(
                            "port gateway: relay from %s:%s ended: %s",
                            route.sandbox_id,
                            route.port,
                            e or type(e).__name__,
                        )
                        return
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    answered = True
                finally:
                    # Back to the pool if the whole answer was read, else closed (no await: a
                    # cancel cannot leave it counted as in use).
                    response.close()
            finally:
                pool.active -= 1
                pool.idle_since = time.monotonic()

        self._sweep()
        watcher = asyncio.create_task(until_disconnect())
        worker = asyncio.create_task(exchange())
        try:
            done, _ = await asyncio.wait({watcher, worker}, return_when=asyncio.FIRST_COMPLETED)
            if answered and worker not in done:
                # The client left after the whole answer (uvicorn says so at once): the worker
                # is only handing its connection back to the pool; let it.
                done, _ = await asyncio.wait({worker})
        finally:
            for task in (watcher, worker):
                task.cancel()
            await asyncio.gather(watcher, worker, return_exceptions=True)
        if worker not in done:
            return status or 499  # the client went away first (499: nginx's code for it)
        error = worker.exception()
        if error is None:
            return status
        if status or isinstance(error, _Stalled) and error.code == ErrorCode.CLIENT_STALLED:
            # The response had started (or the client stopped reading before it could): log
            # what broke, the client sees the connection end.
            log.info("port gateway: relay to %s:%s ended: %s", route.sandbox_id, route.port, error)
            return status or 499
        mapped = _upstream_error(route, error, limits)
        if mapped is None:
            raise error
        try:
            await _send_http_error(send, mapped)
        except _Stalled:
            return 499
        return http_status(mapped)

    # ------------------------------------------------------------------ WebSocket

    async def _relay_websocket(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: _Route,
        headers: list[tuple[str, str]],
        set_cookie: str | None,
    ) -> int | None:
        message = await receive()
        if message["type"] != "websocket.connect":
            return 499
        cookie = [(b"set-cookie", set_cookie.encode("latin-1"))] if set_cookie else []
        given = dict(headers)
        host = given.get("host") or "localhost"
        out = _forwarded_headers(scope, headers, route, _WS_HANDSHAKE | {"user-agent"})
        if "user-agent" in given:
            out.append(("user-agent", given["user-agent"]))
        try:
            upstream = await self._open_websocket(scope, route, host, out)
        except InvalidStatus as e:
            # The sandbox's server refused the upgrade: the client gets its answer.
            response = e.response
            passed = _response_headers(
                (
                    (k.encode("latin-1"), v.encode("latin-1"))
                    for k, v in response.headers.raw_items()
                    if k.lower() in ("content-type", "location", "www-authenticate", "set-cookie")
                ),
                route.prefix,
                self.limits.confine_cookies,
            )
            await _deny_websocket(
                scope, send, response.status_code, passed, bytes(response.body or b"")
            )
            return response.status_code
        except Exception as e:
            mapped = _upstream_error(route, e, self.limits)
            if mapped is None:
                raise
            await _deny_websocket(scope, send, http_status(mapped), _JSON, _error_body(mapped))
            return http_status(mapped)
        try:
            handshake = upstream.response
            accept_headers = (
                _response_headers(
                    (
                        (b"set-cookie", v.encode("latin-1"))
                        for v in (handshake.headers.get_all("Set-Cookie") if handshake else [])
                    ),
                    route.prefix,
                    self.limits.confine_cookies,
                )
                + cookie
            )
            try:
                await send(
                    {
                        "type": "websocket.accept",
                        "subprotocol": upstream.subprotocol,
                        "headers": accept_headers,
                    }
                )
            except Exception:  # the client left during the upstream handshake
                return 499
            self._audit(route, "WEBSOCKET", 101)
            await self._pump_websocket(receive, send, upstream, route)
        finally:
            # A sandbox's server that does not read could hold the closing handshake.
            try:
                async with asyncio.timeout(WS_CLOSE_TIMEOUT):
                    await upstream.close()
            except TimeoutError:
                pass
            _abort(upstream.transport)
        return None

    async def _open_websocket(
        self, scope: Scope, route: _Route, host: str, headers: list[tuple[str, str]]
    ) -> ClientConnection:
        sock = await dial(self._connect, route.sandbox_id, route.port, CONNECT_TIMEOUT)
        try:
            path = route.target.decode("ascii")
            options: dict[str, Any] = dict(
                sock=sock,
                subprotocols=scope.get("subprotocols") or None,
                additional_headers=headers,
                user_agent_header=None,
                compression=None,  # loopback: compressing twice would only cost CPU
                open_timeout=CONNECT_TIMEOUT,
                ping_interval=None,  # the client side has its own keepalive
                close_timeout=WS_CLOSE_TIMEOUT,
                max_size=self.limits.ws_max_message,
                # Frames read ahead of the client: with the message cap, a memory bound.
                max_queue=4,
                proxy=None,
                create_connection=functools.partial(_GuardedConnection, limits=self.limits),
            )
            connect = ws_connect(f"ws://{_ws_authority(host)}{path}", **options)
            try:
                return await connect
            except ValueError as e:
                # websockets cannot follow a redirect over a given socket: pass the 3xx on.
                if isinstance(e.__cause__, InvalidStatus):
                    raise e.__cause__ from None
                raise
        except BaseException:
            sock.close()
            raise

    async def _pump_websocket(
        self, receive: Receive, send: Send, upstream: ClientConnection, route: _Route
    ) -> None:
        """Relay messages both ways until one side closes, stalls or both go quiet past the
        idle timeout, then close the other side alike."""
        limits = self.limits
        send = _bounded(send, limits.write_timeout)
        last = time.monotonic()
        stalled = f"the sandbox's server did not read for {limits.write_timeout:g} s"

        async def from_client() -> tuple[int, str]:
            nonlocal last
            while True:
                message = await receive()
                last = time.monotonic()
                if message["type"] == "websocket.receive":
                    data = message.get("bytes")
                    data = data if data is not None else message.get("text") or ""
                    if len(data) > limits.ws_max_message:
                        return 1009, f"message over {limits.ws_max_message} bytes"
                    await _within(upstream.send(data), limits.write_timeout, stalled)
                elif message["type"] == "websocket.disconnect":
                    return message.get("code", 1000), message.get("reason") or ""

        async def from_upstream() -> None:
            nonlocal last
            try:
                async for data in upstream:
                    last = time.monotonic()
                    if isinstance(data, bytes):
                        await send({"type": "websocket.send", "bytes": data})
                    else:
                        await send({"type": "websocket.send", "text": data})
                    if limits.fair:
                        await asyncio.sleep(0)  # a fast sandbox must not hold the event loop
            except ConnectionClosed:
                pass

        async def until_idle() -> None:
            while (quiet := time.monotonic() - last) < limits.idle_timeout:
                await asyncio.sleep(limits.idle_timeout - quiet)

        client_side = asyncio.create_task(from_client())
        upstream_side = asyncio.create_task(from_upstream())
        idle = asyncio.create_task(until_idle())
        tasks = (client_side, upstream_side, idle)
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if client_side in done and client_side.exception() is None:
            code, reason = client_side.result()
            await upstream.close(_close_code(code, 1001), reason)
            return
        # The sandbox's server closed, broke off, stalled or went quiet: tell the client.
        if idle in done:
            code, reason = 1001, f"no message either way for {limits.idle_timeout:g} s"
        elif client_side in done and isinstance(client_side.exception(), _Stalled):
            code, reason = 1011, str(client_side.exception())
            _abort(upstream.transport)  # no closing handshake with a server that does not read
        elif upstream_side in done and isinstance(upstream_side.exception(), _Stalled):
            code, reason = 1011, str(upstream_side.exception())  # the client stopped reading
        elif isinstance(upstream, _GuardedConnection) and upstream.abuse:
            code, reason = 1011, upstream.abuse
        else:
            code = _close_code(upstream.close_code, 1011)
            reason = upstream.close_reason or (
                "" if upstream.close_code else "upstream connection lost"
            )
        if code == 1011 or idle in done:
            log.info(
                "port gateway: websocket to %s:%s ended: %s", route.sandbox_id, route.port, reason
            )
        try:
            await send({"type": "websocket.close", "code": code, "reason": reason[:120]})
        except Exception:  # the client may be gone (or not reading) too
            pass
