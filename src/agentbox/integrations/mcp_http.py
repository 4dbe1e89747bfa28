"""`/mcp`: the sandbox tools over MCP's streamable HTTP transport, served by the control plane
beside the /v1 API (a surface, server/surfaces.py; needs the `mcp` extra, without which `/mcp`
answers 501 saying so).

Every MCP session (its `Mcp-Session-Id`) is one tool session (integrations/session.py), owned
by the tenant whose API key opened it (`Authorization: Bearer <key>` or `X-API-Key`; every
later request shows a key of the same tenant, or the session is not found). Its sandbox is made
on the first tool call that needs one, through the server's own API on the address the request
came in on, with the key that opened the session: the same checks, quotas and audit apply as
to any other client, and the audit names the session and the tool (`via`).

What the session's sandbox is made with goes in the URL's query: `template`, `isolation`,
`idle_timeout` (the sandbox's, extended by every call), `secret` and `allow_out` (its network
policy's destinations; without, the tenant's default policy; both repeatable), `on_end`
(`kill`, `pause` or `keep`) and `sandbox` (start on an existing sandbox, resumed if paused).
A session ends when the client deletes it or after `McpLimits.idle_timeout` with no request in
flight (ended here, through the SDK's own DELETE path, so both forget it at once); its sandbox
is then killed, paused or kept. A server that stops ends its sessions but leaves their
sandboxes alone (they outlive it, as every sandbox does; their own idle timeout ends them).

The tool handlers find their session by the `Mcp-Session-Id` of the HTTP request the SDK hands
them (`ctx.request`), the one per-request datum the SDK's low-level context carries publicly.

Only the handshake-era protocol versions are served: a session per client is what this
endpoint is. A request at a later, sessionless version (2026-07-28) is refused with
UNSUPPORTED_PROTOCOL_VERSION naming the versions served, on which clients in `auto` mode fall
back to the initialize handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, get_args
from urllib.parse import parse_qsl

from starlette.types import Message, Receive, Scope, Send

from agentbox.core.auth import Caller
from agentbox.core.errors import AgentboxError, InvalidRequest, QuotaExceeded, Unauthorized
from agentbox.integrations.session import OnEnd, Session, SessionConfig
from agentbox.server.limits import header, refuse

if TYPE_CHECKING:
    from agentbox.server.surfaces import Core, SurfaceRoutes

log = logging.getLogger("agentbox.mcp")

PATH = "/mcp"
_QUERY_KEYS = ("template", "isolation", "idle_timeout", "secret", "allow_out", "on_end", "sandbox")
_REPEATED = ("secret", "allow_out")


@dataclass
class _Live:
    """An open MCP session: whose, its tool session, and whether a request is in flight."""

    tenant: str
    session: Session
    in_flight: int = 0
    last: float = field(default_factory=time.monotonic)


class McpEndpoint:
    """The ASGI app at `/mcp`: authenticates, budgets sessions per tenant, hands the request to
    the `mcp` SDK's session manager, and ends idle sessions (with their sandboxes)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.limits = core.limits.mcp
        self._manager: Any = None
        self._live: dict[str, _Live] = {}  # by MCP session id
        self._opening_lock = asyncio.Lock()
        self._stopping = False

    # ------------------------------------------------------------------ the server's life

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        try:
            from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
            from mcp.server.transport_security import TransportSecuritySettings
        except ImportError:
            log.info("/mcp is off: the mcp package is not installed (pip install agentbox[mcp])")
            yield
            return
        from agentbox.integrations.mcp_server import build_server

        self._manager = StreamableHTTPSessionManager(
            build_server(self._session_of),
            # Keys authenticate requests, not the browser's origin: DNS rebinding protection
            # would refuse every Host the operator did not list, and a key is never ambient.
            security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
            session_idle_timeout=None,  # idle sessions are ended here (_reap), with their sandbox
            max_sessions=self.limits.sessions,
            max_request_body_size=self.core.limits.json_body,
        )
        async with self._manager.run():
            reaper = asyncio.create_task(self._reap())
            try:
                yield
            finally:
                self._stopping = True  # sessions end with the server; their sandboxes stay
                reaper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reaper

    async def _reap(self) -> None:
        every = min(30.0, self.limits.idle_timeout / 4)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for sid, live in list(self._live.items()):
                if live.in_flight == 0 and now - live.last >= self.limits.idle_timeout:
                    log.info("MCP session %s idle for %.0f s: ended", sid[:12], now - live.last)
                    await self._terminate(sid)

    async def _terminate(self, sid: str) -> None:
        """End a session in the SDK as its client's DELETE would, then here."""
        scope = {
            "type": "http", "method": "DELETE", "path": PATH, "raw_path": PATH.encode(),
            "query_string": b"", "headers": [(b"mcp-session-id", sid.encode())],
            "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 0),
            "client": ("127.0.0.1", 0), "root_path": "",
        }  # fmt: skip

        async def receive() -> Message:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Message) -> None:
            pass

        with contextlib.suppress(Exception):
            await self._manager.handle_request(scope, receive, send)
        await self._ended(sid)

    # ------------------------------------------------------------------ requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            if self._manager is None:
                raise AgentboxError(
                    "MCP over HTTP needs the mcp package on the server: pip install "
                    "'agentbox[mcp]'",
                    code="not_installed",
                )
            key = _key(scope)
            caller = self.core.auth.authenticate(key)
            conn = scope.get("agentbox.connection")
            if conn is not None:
                conn.mark_authenticated()
        except AgentboxError as e:
            await refuse(send, e)
            return
        version = header(scope["headers"], b"mcp-protocol-version")
        if version is not None and _is_modern(version):
            await _unsupported_version(version, receive, send)
            return
        sid = header(scope["headers"], b"mcp-session-id")
        if sid is not None:
            await self._in_session(sid, caller, scope, receive, send)
            return
        if scope["method"] != "POST":  # the SDK says what is missing
            await self._manager.handle_request(scope, receive, send)
            return
        try:
            config = self._config(scope, key)
        except AgentboxError as e:
            await refuse(send, e)
            return
        # Opening requests wait for each other (an initialize is quick), so the counts they
        # check are the counts they leave.
        async with self._opening_lock:
            try:
                self._admit(caller.tenant)
            except AgentboxError as e:
                await refuse(send, e)
                return

            async def opened(message: Message) -> None:
                if message["type"] == "http.response.start" and message["status"] < 400:
                    made = header(message.get("headers", []), b"mcp-session-id")
                    if made is not None:
                        session = Session(config, front="mcp-http")
                        self._live[made] = _Live(caller.tenant, session)
                        log.info("MCP session %s opened: tenant %s, %s", made[:12],
                                 caller.tenant, session.label)  # fmt: skip
                await send(message)

            await self._manager.handle_request(scope, receive, opened)

    async def _in_session(
        self, sid: str, caller: Caller, scope: Scope, receive: Receive, send: Send
    ) -> None:
        live = self._live.get(sid)
        if live is None or (live.tenant != caller.tenant and self.limits.owner_check):
            # Unknown, ended, or another tenant's: the same answer.
            await _jsonrpc_error(send, 404, -32600, "Session not found")
            return
        live.in_flight += 1
        status = 0

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._manager.handle_request(scope, receive, watched)
        finally:
            live.in_flight -= 1
            live.last = time.monotonic()
        if scope["method"] == "DELETE" and status < 400 or status == 404:
            await self._ended(sid)  # the client ended it (or the SDK no longer has it)

    def _config(self, scope: Scope, key: str) -> SessionConfig:
        """The new session's sandbox settings, from the URL's query."""
        pairs = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        unknown = sorted({k for k, _ in pairs} - set(_QUERY_KEYS))
        if unknown:
            raise InvalidRequest(
                f"unknown query parameter {unknown[0]!r} on /mcp; the ones taken are "
                + ", ".join(_QUERY_KEYS)
            )
        one: dict[str, str] = {}
        for k, v in pairs:
            if k not in _REPEATED and k in one:
                raise InvalidRequest(f"query parameter {k!r} given twice")
            one[k] = v
        on_end = one.get("on_end", "kill")
        if on_end not in get_args(OnEnd):
            raise InvalidRequest(f"on_end must be one of {', '.join(get_args(OnEnd))}")
        timeout = 1800.0
        if "idle_timeout" in one:
            try:
                timeout = float(one["idle_timeout"])
            except ValueError:
                timeout = -1
            if not 1 <= timeout <= 86400:
                raise InvalidRequest("idle_timeout is seconds, from 1 to 86400")
        allowed = [v for k, v in pairs if k == "allow_out" and v]
        # The session's tool calls come back to this server, on the address they came in on.
        host, port = scope["server"]
        host = f"[{host}]" if ":" in host else host
        return SessionConfig(
            api_url=f"http://{host}:{port}",
            api_key=key,
            template=one.get("template") or "code-interpreter",
            isolation=one.get("isolation") or None,
            timeout=timeout,
            secrets=[v for k, v in pairs if k == "secret" and v],
            # The sandbox's policy, checked by the API as any create's (None: the tenant's).
            network={"allow_out": allowed} if allowed else None,
            on_end=on_end,  # type: ignore[arg-type]
            sandbox_id=one.get("sandbox") or None,
            output_keep=self.limits.output_keep,
        )

    def _admit(self, tenant: str) -> None:
        if len(self._live) >= self.limits.sessions:
            raise AgentboxError(
                f"the server has {len(self._live)} MCP sessions open, its limit; end one "
                "(the client's DELETE) or try again later",
                code="server_busy",
                limit=self.limits.sessions,
            )
        mine = sum(1 for live in self._live.values() if live.tenant == tenant)
        if mine >= self.limits.per_tenant:
            raise QuotaExceeded(
                f"this tenant has {mine} MCP sessions open, its limit; end one (close the "
                "client) or wait for an idle one to time out",
                limit=self.limits.per_tenant,
            )

    # ------------------------------------------------------------------ sessions

    def _session_of(self, ctx: Any) -> Session:
        """The tool session of a tool call's MCP session (its HTTP request's session id)."""
        request = getattr(ctx, "request", None)
        sid = request.headers.get("mcp-session-id") if request is not None else None
        live = self._live.get(sid) if sid else None
        if live is None:
            raise RuntimeError("a tool call outside an open MCP session")
        return live.session

    async def _ended(self, sid: str) -> None:
        live = self._live.pop(sid, None)
        if live is None or self._stopping:
            return
        session = live.session
        log.info("MCP session %s ended: sandbox %s (%s)", sid[:12], session.sandbox_id,
                 session.config.on_end)  # fmt: skip
        try:
            await session.close()
        except Exception as e:  # noqa: BLE001 - said; the sandbox's idle timeout ends it
            log.warning("ending MCP session %s's sandbox %s: %s", sid[:12], session.sandbox_id, e)


def surface(core: Core) -> SurfaceRoutes:
    """The `/mcp` surface (entry point `agentbox.surfaces: mcp`)."""
    from agentbox.server.surfaces import SurfaceRoutes

    endpoint = McpEndpoint(core)
    return SurfaceRoutes(
        predicate=lambda scope: scope["path"] in (PATH, PATH + "/"),
        asgi=endpoint,
        authenticates=True,
        lifespan=endpoint.running,
    )


# ---------------------------------------------------------------------------- answers


def _key(scope: Scope) -> str:
    key = header(scope["headers"], b"x-api-key")
    auth = header(scope["headers"], b"authorization")
    if key is None and auth is not None and auth[:7].lower() == "bearer ":
        key = auth[7:].strip()
    if not key:
        raise Unauthorized(
            "missing API key: send it as 'Authorization: Bearer <key>' or in the X-API-Key header"
        )
    return key


def _is_modern(version: str) -> bool:
    from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

    return version not in HANDSHAKE_PROTOCOL_VERSIONS


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


async def _jsonrpc_error(send: Send, status: int, code: int, message: str) -> None:
    await _send_json(
        send, status, {"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}}
    )


async def _unsupported_version(version: str, receive: Receive, send: Send) -> None:
    """UNSUPPORTED_PROTOCOL_VERSION for a sessionless-era request, answering its id."""
    from mcp_types import UNSUPPORTED_PROTOCOL_VERSION
    from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

    body, more = b"", True
    while more and len(body) <= 65536:
        message: Message = await receive()
        if message["type"] != "http.request":
            return
        body += message.get("body", b"")
        more = message.get("more_body", False)
    request_id = None
    with contextlib.suppress(ValueError, AttributeError):
        request_id = json.loads(body).get("id")
    if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
        request_id = None
    await _send_json(
        send,
        400,
        {
            "jsonrpc": "2.0",
            "id": request_id,
            "error": {
                "code": UNSUPPORTED_PROTOCOL_VERSION,
                "message": "Unsupported protocol version: /mcp keeps a session (and its "
                "sandbox) per client, which needs the initialize handshake",
                "data": {"supported": list(HANDSHAKE_PROTOCOL_VERSIONS), "requested": version},
            },
        },
    )
