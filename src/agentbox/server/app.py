"""The HTTP API: a FastAPI app over the sandbox manager, and `serve()` to run it under uvicorn.

This module only speaks HTTP: it authenticates, validates, maps errors to responses in one
place, and streams. Everything else happens in `core/`.
"""

import asyncio
import base64
import dataclasses
import json
import logging
import math
import os
import signal as signals
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Annotated, Any
from urllib.parse import urlencode, urlsplit

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentbox import __version__
from agentbox.agent.protocol import LIST_LIMIT
from agentbox.core import ports
from agentbox.core.auth import Authenticator, Caller, check_tenant_name, create_key
from agentbox.core.errors import (
    AgentboxError,
    Forbidden,
    InvalidRequest,
    NotFound,
    SandboxUnavailable,
)
from agentbox.core.logs import LogKeeper
from agentbox.core.manager import (
    CodeRequest,
    CommandRequest,
    CreateRequest,
    SandboxManager,
    builtin_spec_names,
)
from agentbox.core.network import NetworkService, NetworkSettings
from agentbox.server import logfilter
from agentbox.server import models as m
from agentbox.server.gateway import PortGateway, PortTarget
from agentbox.server.limits import RequestGuard, ServerLimits, protocol_class, raise_nofile
from agentbox.store.db import Store
from agentbox.templates import SpecError, TemplateStore, builtin_spec_path, load_spec

log = logging.getLogger("agentbox.server")

# Served without an API key: liveness and the API's own description.
OPEN_ROUTES = frozenset({"/v1/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def _error(
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


_closings: set[asyncio.Task[None]] = set()


class Streamed(StreamingResponse):
    """A streamed response whose source is closed when the response ends, however it ends:
    sent in full, the client gone, or an error on the way.

    Starlette does not close a half-read body iterator; an async generator left so is closed
    only when the garbage collector gets to it, and its cleanup (unmounting a kept workspace,
    killing tar, letting go of an agent stream) would wait for that.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                # To its end even when this task is being cancelled.
                task = asyncio.ensure_future(aclose())
                _closings.add(task)
                task.add_done_callback(_closings.discard)
                await asyncio.shield(task)


def _ndjson(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield (json.dumps(event, separators=(",", ":")) + "\n").encode()
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    return Streamed(
        body(),
        media_type="application/x-ndjson",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


def _signal_number(value: str | int) -> int:
    if isinstance(value, int):
        sig = value
    else:
        name = value.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        # Signals only: the module also holds SIG_IGN, SIG_DFL, SIG_BLOCK... (0, 1, 2).
        member = signals.Signals.__members__.get(name)
        if member is None:
            raise InvalidRequest(f"unknown signal {value!r}; use a name like SIGTERM or a number")
        sig = int(member)
    if not 1 <= sig <= 64:
        raise InvalidRequest(f"signal must be between 1 and 64, not {sig}")
    return sig


def _parse_time(value: str | None) -> float | None:
    """An RFC 3339 time or unix seconds, as a unix time."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(
            f"since={value!r} is neither an RFC 3339 time nor unix seconds"
        ) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.timestamp()


def _times(secret: dict[str, Any]) -> dict[str, Any]:
    return {
        **secret,
        "created_at": m.rfc3339(secret.get("created_at")),
        "updated_at": m.rfc3339(secret.get("updated_at")),
    }


def _load_spec(text: str, base: Path | None) -> Any:
    try:
        return load_spec(text, base)
    except SpecError as e:
        raise InvalidRequest(f"invalid template spec: {e}") from None


def _spec_with_files(text: str, files: dict[str, str]) -> Any:
    """Load a spec whose `src` files came with the request: they are laid out in a private
    temporary directory (relative paths only) that the spec resolves against."""
    if not files:
        return _load_spec(text, None)
    with tempfile.TemporaryDirectory(prefix="agentbox-spec-") as tmp:
        for rel, b64 in files.items():
            parts = PurePosixPath(rel).parts
            if not rel or rel.startswith("/") or ".." in parts or "\0" in rel:
                raise InvalidRequest(f"files: {rel!r} must be a relative path inside the spec dir")
            try:
                data = base64.b64decode(b64, validate=True)
            except ValueError:
                raise InvalidRequest(f"files: {rel!r} is not base64") from None
            dest = Path(tmp, *parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
        return _load_spec(text, Path(tmp))


def create_app(
    data_dir: Path,
    admin_key: str | None = None,
    runtime_name: str = "process",
    runtime_config: dict[str, Any] | None = None,
    template_dir: Path | None = None,
    warm_pools: dict[str, int] | None = None,
    network: NetworkSettings | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """The HTTP API over one data dir and one runtime (`runtime_config` goes to its constructor).

    Templates live in `template_dir` (default `<data_dir>/templates`; servers may share one);
    `warm_pools` maps template names to pool sizes; `network` holds the operator's egress and
    exposed-ports settings; `limits` what clients may make the server spend.
    """
    data_dir = data_dir.resolve()
    limits = limits or ServerLimits()
    state: dict[str, Any] = {}
    net_settings = network or NetworkSettings()
    public = urlsplit(net_settings.public_url or "http://localhost")
    # What clients put after "{port}-{sandbox_id}." to reach an exposed port.
    domain = net_settings.ports_domain
    if public.port and public.port not in (80, 443):
        domain = f"{domain}:{public.port}"

    def info(row: Any) -> m.SandboxInfo:
        mgr = state.get("manager")
        return m.SandboxInfo.of(row, domain, mgr.build_progress(row) if mgr else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import fcntl

        from agentbox.runtimes import get_runtime

        data_dir.mkdir(parents=True, exist_ok=True)
        # One server per data dir, decided before anything is read or touched: a second one
        # would reconcile (and end) the first one's sandboxes and pool members.
        lock_fd = os.open(data_dir / "server.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(lock_fd, 32, 0).decode("ascii", "replace").strip()
            os.close(lock_fd)
            msg = (
                f"the data dir {data_dir} is in use by another agentbox server "
                f"(pid {holder or 'unknown'}); stop it, or give this one another --data-dir"
            )
            print(f"agentbox: {msg}", file=sys.stderr, flush=True)
            raise RuntimeError(msg) from None
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
        store = Store.for_data_dir(data_dir)
        auth = Authenticator(store, admin_key)
        made = auth.bootstrap(data_dir)
        if made:
            log.warning("created bootstrap admin key in %s", data_dir / "admin.key")
            print(
                f"agentbox: admin API key (also in {data_dir / 'admin.key'}): {made}",
                file=sys.stderr,
                flush=True,
            )
        runtime = get_runtime(runtime_name, data_dir=data_dir, **(runtime_config or {}))
        # A rebuilt or removed template keeps the tree its live sandboxes run from.
        templates = TemplateStore(
            template_dir or data_dir / "templates",
            in_use=lambda rootfs: manager.rootfs_in_use(rootfs),
        )
        netsvc = NetworkService(store, data_dir, net_settings, limits.logs)
        health: dict[str, Any] = {
            arg: float(os.environ[var])
            for arg, var in (
                ("health_interval", "AGENTBOX_HEALTH_INTERVAL"),
                ("ping_timeout", "AGENTBOX_AGENT_PING_TIMEOUT"),
            )
            if os.environ.get(var)
        }
        manager = SandboxManager(
            store, runtime, templates, netsvc, warm_pools, default_quota=limits.tenant_quota,
            **health,
        )  # fmt: skip
        await manager.start()
        log_keeper = LogKeeper(store, limits.logs)
        log_keeper.start()
        state.update(store=store, auth=auth, manager=manager, runtime=runtime, network=netsvc)
        try:
            yield
        finally:
            # Sandboxes are not stopped: they outlive the server and are re-adopted.
            await manager.stop()
            await gateway.aclose()
            await netsvc.close()
            await log_keeper.stop()
            await runtime.close()
            os.close(lock_fd)  # the lock goes with it

    app = FastAPI(
        title="agentbox",
        version=__version__,
        lifespan=lifespan,
        description="Self-hosted sandboxes for AI agents. See docs/API.md.",
    )

    # ------------------------------------------------------------------ exposed ports

    async def port_target(sandbox_id: str) -> PortTarget | None:
        row = state["manager"].running_row(sandbox_id)
        if row is None or row.access_token is None:
            return None
        return PortTarget(
            sandbox_id=sandbox_id,
            tenant=row.tenant,
            access_token=row.access_token,
            public=bool((row.network or {}).get("allow_public_traffic")),
        )

    async def tenant_of_key(key: str) -> str | None:
        try:
            return state["auth"].authenticate(key).tenant
        except AgentboxError:
            return None

    async def connect_port(sandbox_id: str, port: int) -> Any:
        return await state["manager"].connect_port(sandbox_id, port)

    gateway_holder: list[PortGateway] = []

    def make_gateway(inner: Any) -> PortGateway:
        gw = PortGateway(
            inner,
            domain=net_settings.ports_domain,
            lookup=port_target,
            tenant_of_key=tenant_of_key,
            connect=connect_port,
            limits=limits.relay,
        )
        gateway_holder.append(gw)
        return gw

    class _Gateway:
        """Holds the gateway the middleware stack builds, for closing at shutdown."""

        async def aclose(self) -> None:
            for gw in gateway_holder:
                await gw.aclose()

    gateway = _Gateway()

    def key_owner(key: str) -> Caller | None:
        try:
            return state["auth"].authenticate(key)
        except AgentboxError:
            return None

    # Inside the gateway (which authorizes port requests its own way): every API request shows
    # a valid key before its body is read.
    app.add_middleware(
        RequestGuard,  # type: ignore[arg-type]
        authenticate=key_owner,
        limits=limits,
        open_routes=OPEN_ROUTES,
    )
    app.add_middleware(make_gateway)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ errors, in one place

    @app.exception_handler(AgentboxError)
    async def _agentbox_error(_: Request, e: AgentboxError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status in (429, 503) else None
        return _error(e.status, e.code, e.message, e.detail, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        reason = _unreadable_body(e)
        if reason is not None:
            return _error(400, "invalid_request", reason)
        errors = [
            {
                "loc": list(err.get("loc", ())),
                "msg": str(err.get("msg", "")),
                "type": str(err.get("type", "")),
            }
            for err in e.errors()
        ]
        summary = "; ".join(
            f"{'.'.join(str(x) for x in er['loc'])}: {er['msg']}" for er in errors[:5]
        )
        return _error(422, "invalid_request", f"invalid request: {summary}", {"errors": errors})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # Raised by the framework itself (no such route, wrong method, unparseable body):
        # answer with a documented code and a message that says what to change.
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
        return _error(status, code, message, headers=dict(e.headers) if e.headers else None)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(500, "internal_error", f"internal error: {type(e).__name__}")

    # ------------------------------------------------------------------ dependencies

    # Dependencies are coroutines: plain functions would each be run in a worker thread, two
    # thread hand-offs per request, which is where a busy host's scheduling delays add up.
    async def manager() -> SandboxManager:
        return state["manager"]

    async def caller(request: Request, x_api_key: Annotated[str | None, Header()] = None) -> Caller:
        known = request.scope.get("agentbox.caller")  # the RequestGuard's check
        return known if known is not None else state["auth"].authenticate(x_api_key)

    async def admin(c: Annotated[Caller, Depends(caller)]) -> Caller:
        if not c.admin:
            raise Forbidden("this route needs an admin API key")
        return c

    Mgr = Annotated[SandboxManager, Depends(manager)]
    Who = Annotated[Caller, Depends(caller)]
    Admin = Annotated[Caller, Depends(admin)]
    responses: dict[int | str, dict[str, Any]] = {
        s: {"model": m.ErrorBody} for s in (400, 401, 403, 404, 409, 422, 429, 503)
    }

    # ------------------------------------------------------------------ health

    @app.get("/v1/health", tags=["health"])
    async def health() -> dict[str, Any]:
        # Whether each template could start a sandbox at start-up (why not: the log, and the
        # template's `check` for API keys).
        checks = {n: c.status for n, c in state["manager"].template_checks.items()}
        return {
            "status": "degraded" if "failed" in checks.values() else "ok",
            "version": __version__,
            "runtime": state["runtime"].capabilities() if "runtime" in state else None,
            "templates": checks,
        }

    # ------------------------------------------------------------------ sandboxes

    @app.post(
        "/v1/sandboxes",
        status_code=201,
        response_model=m.SandboxInfo,
        responses=responses,
        tags=["sandboxes"],
    )
    async def create_sandbox(
        body: m.CreateSandboxBody, mgr: Mgr, who: Who, response: Response
    ) -> m.SandboxInfo:
        network = body.network.model_dump() if body.network is not None else None
        if body.allow_internet_access is not None:
            network = {**(network or {}), "allow_internet_access": body.allow_internet_access}
        row = await mgr.create(
            who,
            CreateRequest(
                template=body.template or "default",
                timeout=body.timeout,
                metadata=body.metadata,
                envs=body.envs,
                resources=body.resources.model_dump(exclude_none=True),
                keep_workspace=body.keep_workspace,
                network=network,
                secrets=body.secrets,
            ),
        )
        if row.state == "building":  # the template's first-use build: the client waits on GET
            response.status_code = 202
        return info(row)

    @app.get("/v1/sandboxes", response_model=m.SandboxList, responses=responses, tags=["sandboxes"])
    async def list_sandboxes(
        mgr: Mgr,
        who: Who,
        state_: Annotated[list[str] | None, Query(alias="state")] = None,
        metadata: Annotated[list[str] | None, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 50,
        next_token: Annotated[str | None, Query(max_length=32)] = None,
    ) -> m.SandboxList:
        states = [s for item in state_ or [] for s in item.split(",") if s]
        meta: dict[str, str] = {}
        for item in metadata or []:
            k, sep, v = item.partition("=")
            if not sep or not k:
                raise InvalidRequest(f"metadata filter {item!r} must look like key=value")
            meta[k] = v
        rows, token = mgr.list(who, states or None, meta, limit, next_token)
        return m.SandboxList(sandboxes=[info(r) for r in rows], next_token=token)

    @app.get(
        "/v1/sandboxes/{sandbox_id}",
        response_model=m.SandboxInfo,
        responses=responses,
        tags=["sandboxes"],
    )
    async def get_sandbox(sandbox_id: str, mgr: Mgr, who: Who) -> m.SandboxInfo:
        return info(mgr.get(who, sandbox_id))

    @app.delete(
        "/v1/sandboxes/{sandbox_id}", status_code=204, responses=responses, tags=["sandboxes"]
    )
    async def kill_sandbox(sandbox_id: str, mgr: Mgr, who: Who) -> Response:
        await mgr.kill(who, sandbox_id)
        return Response(status_code=204)

    @app.post(
        "/v1/sandboxes/{sandbox_id}/timeout",
        response_model=m.SandboxInfo,
        responses=responses,
        tags=["sandboxes"],
    )
    async def set_timeout(
        sandbox_id: str, body: m.TimeoutBody, mgr: Mgr, who: Who
    ) -> m.SandboxInfo:
        return info(await mgr.set_timeout(who, sandbox_id, body.timeout))

    @app.put(
        "/v1/sandboxes/{sandbox_id}/network",
        response_model=m.SandboxInfo,
        responses=responses,
        tags=["network"],
    )
    async def set_network(
        sandbox_id: str, body: m.NetworkBody, mgr: Mgr, who: Who
    ) -> m.SandboxInfo:
        return info(await mgr.set_network(who, sandbox_id, body.model_dump()))

    @app.post("/v1/sandboxes/{sandbox_id}/port-url", responses=responses, tags=["network"])
    async def port_url(sandbox_id: str, body: m.PortUrlBody, mgr: Mgr, who: Who) -> dict[str, Any]:
        row = mgr.running(who, sandbox_id)
        assert row.access_token is not None
        expires = math.ceil(time.time() + (body.expires_in or ports.DEFAULT_LIFETIME))
        sig = ports.sign(row.access_token, sandbox_id, body.port, expires)
        path = body.path if body.path.startswith("/") else "/" + body.path
        sep = "&" if "?" in path else "?"
        query = urlencode({ports.EXP_PARAM: expires, ports.SIG_PARAM: sig})
        if body.routing == "host":
            base = f"{public.scheme}://{body.port}-{sandbox_id}.{domain}"
        else:
            base = (
                f"{public.scheme}://{public.netloc}{public.path.rstrip('/')}"
                f"/v1/sandboxes/{sandbox_id}/ports/{body.port}"
            )
        mgr.audit(who, "port.url", sandbox_id, port=body.port, expires_in=body.expires_in)
        return {
            "url": f"{base}{path}{sep}{query}",
            "port": body.port,
            "expires_at": m.rfc3339(expires),
        }

    @app.post(
        "/v1/sandboxes/{sandbox_id}/access-token",
        response_model=m.SandboxInfo,
        responses=responses,
        tags=["network"],
    )
    async def rotate_access_token(sandbox_id: str, mgr: Mgr, who: Who) -> m.SandboxInfo:
        """A new access token for the sandbox's private ports: the old one, every URL signed
        with it and every port cookie made from those stop working at once."""
        return info(await mgr.rotate_access_token(who, sandbox_id))

    # ------------------------------------------------------------------ secrets

    @app.put("/v1/secrets/{name}", responses=responses, tags=["network"])
    async def put_secret(name: str, body: m.SecretBody, mgr: Mgr, who: Who) -> dict[str, Any]:
        binding: dict[str, Any] = {
            "hosts": body.hosts,
            "in_url": body.in_url,
            "headers": body.headers,
            "allow_plaintext": body.allow_plaintext,
        }
        result = state["network"].set_secret(who.tenant, name, body.value, **binding)
        mgr.audit(who, "secret.set", name=name, **binding)
        return _times(result)

    @app.get("/v1/secrets", responses=responses, tags=["network"])
    async def list_secrets(who: Who) -> dict[str, Any]:
        return {"secrets": [_times(s) for s in state["network"].list_secrets(who.tenant)]}

    @app.delete("/v1/secrets/{name}", status_code=204, responses=responses, tags=["network"])
    async def delete_secret(name: str, mgr: Mgr, who: Who) -> Response:
        state["network"].remove_secret(who.tenant, name)
        mgr.audit(who, "secret.remove", name=name)
        return Response(status_code=204)

    # ------------------------------------------------------------------ tenant network

    @app.get("/v1/tenants/{tenant}/network", responses=responses, tags=["network"])
    async def get_tenant_network(tenant: str, who: Who) -> dict[str, Any]:
        if not who.admin and who.tenant != tenant:
            raise NotFound(f"tenant {tenant} not found")
        return state["network"].tenant_network(tenant)

    @app.put("/v1/tenants/{tenant}/network", responses=responses, tags=["admin"])
    async def put_tenant_network(
        tenant: str, body: m.TenantNetworkBody, mgr: Mgr, who: Admin
    ) -> dict[str, Any]:
        """Set a tenant's ceiling (what its sandboxes may ever allow) and default policy."""
        check_tenant_name(tenant)
        net = state["network"]
        fields = body.model_fields_set
        if "ceiling" in fields:
            ceiling = body.ceiling.model_dump() if body.ceiling else None
            if ceiling is not None:
                ceiling.pop("allow_public_traffic", None)
            net.set_tenant_ceiling(tenant, ceiling)
        if "default" in fields:
            net.set_tenant_default(tenant, body.default.model_dump() if body.default else None)
        mgr.audit(who, "tenant.network", tenant=tenant, network=body.model_dump())
        return net.tenant_network(tenant)

    @app.put("/v1/network/default", responses=responses, tags=["network"])
    async def put_network_default(body: m.NetworkBody, mgr: Mgr, who: Who) -> dict[str, Any]:
        """The caller's tenant's default network for sandboxes created without one."""
        result = state["network"].set_tenant_default(who.tenant, body.model_dump())
        mgr.audit(who, "tenant.network", tenant=who.tenant, default=body.model_dump())
        return result

    # ------------------------------------------------------------------ commands

    @app.post(
        "/v1/sandboxes/{sandbox_id}/commands",
        responses={
            **responses,
            200: {
                "content": {"application/x-ndjson": {}},
                "description": "foreground: live NDJSON events",
            },
            201: {"model": m.CommandInfo, "description": "background: the command's handle"},
        },
        tags=["commands"],
    )
    async def run_command(sandbox_id: str, body: m.CommandBody, mgr: Mgr, who: Who) -> Response:
        req = CommandRequest(
            cmd=body.cmd,
            cwd=body.cwd,
            envs=body.envs,
            timeout=body.timeout,
            background=body.background,
            stdin=body.stdin,
        )
        if body.background:
            info = await mgr.start_command(who, sandbox_id, req)
            return JSONResponse(status_code=201, content=m.CommandInfo.of(info).model_dump())
        info, events = await mgr.run_command(who, sandbox_id, req)

        async def with_start() -> AsyncIterator[dict[str, Any]]:
            yield {"type": "start", "cmd_id": info["cmd_id"], "pid": info["pid"]}
            async for e in events:
                yield e

        return _ndjson(with_start())

    @app.get(
        "/v1/sandboxes/{sandbox_id}/commands",
        response_model=m.CommandList,
        responses=responses,
        tags=["commands"],
    )
    async def list_commands(sandbox_id: str, mgr: Mgr, who: Who) -> m.CommandList:
        reply = await mgr.agent_call(who, sandbox_id, {"op": "exec.list"}, "command.list")
        return m.CommandList(commands=[m.CommandInfo.of(c) for c in reply.get("commands", [])])

    @app.get(
        "/v1/sandboxes/{sandbox_id}/commands/{cmd_id}",
        response_model=m.CommandInfo,
        responses=responses,
        tags=["commands"],
    )
    async def get_command(sandbox_id: str, cmd_id: str, mgr: Mgr, who: Who) -> m.CommandInfo:
        reply = await mgr.agent_call(
            who, sandbox_id, {"op": "exec.info", "cmd_id": cmd_id}, "command.info", cmd_id=cmd_id
        )
        return m.CommandInfo.of(reply["command"])

    @app.get(
        "/v1/sandboxes/{sandbox_id}/commands/{cmd_id}/events",
        responses={**responses, 200: {"content": {"application/x-ndjson": {}}}},
        tags=["commands"],
    )
    async def command_events(
        sandbox_id: str, cmd_id: str, mgr: Mgr, who: Who, offset: Annotated[int, Query(ge=0)] = 0
    ) -> Response:
        return _ndjson(await mgr.command_events(who, sandbox_id, cmd_id, offset))

    @app.post(
        "/v1/sandboxes/{sandbox_id}/commands/{cmd_id}/stdin",
        status_code=204,
        responses=responses,
        tags=["commands"],
    )
    async def command_stdin(
        sandbox_id: str, cmd_id: str, body: m.StdinBody, mgr: Mgr, who: Who
    ) -> Response:
        await mgr.command_stdin(who, sandbox_id, cmd_id, body.data, body.eof)
        return Response(status_code=204)

    @app.post(
        "/v1/sandboxes/{sandbox_id}/commands/{cmd_id}/kill",
        status_code=204,
        responses=responses,
        tags=["commands"],
    )
    async def command_kill(
        sandbox_id: str, cmd_id: str, mgr: Mgr, who: Who, body: m.SignalBody | None = None
    ) -> Response:
        sig = _signal_number(body.signal if body else "SIGKILL")
        await mgr.command_kill(who, sandbox_id, cmd_id, sig)
        return Response(status_code=204)

    # ------------------------------------------------------------------ files

    PathQ = Annotated[str, Query(max_length=8192, description="sandbox path")]

    @app.get(
        "/v1/sandboxes/{sandbox_id}/files",
        responses={**responses, 200: {"content": {"application/octet-stream": {}}}},
        tags=["files"],
    )
    async def read_file(sandbox_id: str, path: PathQ, mgr: Mgr, who: Who) -> Response:
        size, chunks = await mgr.read_file(who, sandbox_id, path)
        return Streamed(
            chunks, media_type="application/octet-stream", headers={"Content-Length": str(size)}
        )

    @app.put(
        "/v1/sandboxes/{sandbox_id}/files",
        response_model=m.EntryInfo,
        responses=responses,
        tags=["files"],
        openapi_extra={
            "requestBody": {
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
                "required": True,
            }
        },
    )
    async def write_file(
        sandbox_id: str, path: PathQ, request: Request, mgr: Mgr, who: Who
    ) -> m.EntryInfo:
        return m.EntryInfo.of(await mgr.write_file(who, sandbox_id, path, request.stream()))

    @app.get(
        "/v1/sandboxes/{sandbox_id}/files/list",
        response_model=m.EntryList,
        responses=responses,
        tags=["files"],
    )
    async def list_files(
        sandbox_id: str,
        path: PathQ,
        mgr: Mgr,
        who: Who,
        depth: Annotated[int, Query(ge=1, le=64)] = 1,
        limit: Annotated[
            int, Query(ge=1, le=LIST_LIMIT, description="entries per page at most")
        ] = LIST_LIMIT,
        cursor: Annotated[
            str | None,
            Query(max_length=8192, description="next_cursor of the previous page"),
        ] = None,
    ) -> m.EntryList:
        req: dict[str, Any] = {"op": "fs.list", "path": path, "depth": depth, "limit": limit}
        if cursor is not None:
            req["cursor"] = cursor
        reply = await mgr.agent_call(who, sandbox_id, req, "file.list", path=path)
        return m.EntryList(
            entries=[m.EntryInfo.of(e) for e in reply["entries"]],
            truncated=bool(reply.get("truncated")),
            next_cursor=reply.get("next_cursor"),
        )

    @app.get(
        "/v1/sandboxes/{sandbox_id}/files/stat",
        response_model=m.EntryInfo,
        responses=responses,
        tags=["files"],
    )
    async def stat_file(sandbox_id: str, path: PathQ, mgr: Mgr, who: Who) -> m.EntryInfo:
        reply = await mgr.agent_call(
            who, sandbox_id, {"op": "fs.stat", "path": path}, "file.stat", path=path
        )
        return m.EntryInfo.of(reply["entry"])

    @app.post(
        "/v1/sandboxes/{sandbox_id}/files/mkdir",
        response_model=m.EntryInfo,
        status_code=201,
        responses=responses,
        tags=["files"],
    )
    async def make_dir(sandbox_id: str, body: m.PathBody, mgr: Mgr, who: Who) -> Response:
        reply = await mgr.agent_call(
            who, sandbox_id, {"op": "fs.mkdir", "path": body.path}, "file.mkdir", path=body.path
        )
        return JSONResponse(
            status_code=201 if reply.get("created") else 200,
            content=m.EntryInfo.of(reply["entry"]).model_dump(),
        )

    @app.delete(
        "/v1/sandboxes/{sandbox_id}/files", status_code=204, responses=responses, tags=["files"]
    )
    async def remove_file(sandbox_id: str, path: PathQ, mgr: Mgr, who: Who) -> Response:
        await mgr.agent_call(
            who, sandbox_id, {"op": "fs.remove", "path": path}, "file.remove", path=path
        )
        return Response(status_code=204)

    @app.post(
        "/v1/sandboxes/{sandbox_id}/files/rename",
        response_model=m.EntryInfo,
        responses=responses,
        tags=["files"],
    )
    async def rename_file(sandbox_id: str, body: m.RenameBody, mgr: Mgr, who: Who) -> m.EntryInfo:
        reply = await mgr.agent_call(
            who,
            sandbox_id,
            {"op": "fs.rename", "src": body.src, "dst": body.dst},
            "file.rename",
            src=body.src,
            dst=body.dst,
        )
        return m.EntryInfo.of(reply["entry"])

    # ------------------------------------------------------------------ keys, quotas, audit

    # ------------------------------------------------------------------ code interpreter

    @app.post(
        "/v1/sandboxes/{sandbox_id}/code/execute",
        responses={**responses, 200: {"content": {"application/x-ndjson": {}}}},
        tags=["code"],
    )
    async def run_code(sandbox_id: str, body: m.CodeBody, mgr: Mgr, who: Who) -> Response:
        req = CodeRequest(
            code=body.code,
            language=body.language,
            context_id=body.context_id,
            envs=body.envs,
            timeout=body.timeout,
        )
        events = await mgr.run_code(who, sandbox_id, req)

        async def cleaned() -> AsyncIterator[dict[str, Any]]:
            async for e in events:
                yield m.clean(e)

        return _ndjson(cleaned())

    @app.post(
        "/v1/sandboxes/{sandbox_id}/code/contexts",
        status_code=201,
        response_model=m.CodeContext,
        responses=responses,
        tags=["code"],
    )
    async def create_context(
        sandbox_id: str, body: m.ContextBody, mgr: Mgr, who: Who
    ) -> m.CodeContext:
        args: dict[str, Any] = {"language": body.language}
        if body.cwd is not None:
            args["cwd"] = body.cwd
        reply = await mgr.code_call(
            who, sandbox_id, "create_context", "code.context.create", **args
        )
        return m.CodeContext.of(reply.get("context"))

    @app.get(
        "/v1/sandboxes/{sandbox_id}/code/contexts",
        response_model=m.CodeContextList,
        responses=responses,
        tags=["code"],
    )
    async def list_contexts(sandbox_id: str, mgr: Mgr, who: Who) -> m.CodeContextList:
        reply = await mgr.code_call(who, sandbox_id, "list_contexts", "code.context.list")
        contexts = reply.get("contexts")
        if not isinstance(contexts, list):
            raise SandboxUnavailable("the sandbox sent no context list")
        return m.CodeContextList(contexts=[m.CodeContext.of(c) for c in contexts])

    @app.post(
        "/v1/sandboxes/{sandbox_id}/code/contexts/{context_id}/restart",
        response_model=m.CodeContext,
        responses=responses,
        tags=["code"],
    )
    async def restart_context(
        sandbox_id: str, context_id: str, mgr: Mgr, who: Who
    ) -> m.CodeContext:
        reply = await mgr.code_call(
            who, sandbox_id, "restart_context", "code.context.restart", context_id=context_id
        )
        return m.CodeContext.of(reply.get("context"))

    @app.delete(
        "/v1/sandboxes/{sandbox_id}/code/contexts/{context_id}",
        status_code=204,
        responses=responses,
        tags=["code"],
    )
    async def remove_context(sandbox_id: str, context_id: str, mgr: Mgr, who: Who) -> Response:
        await mgr.code_call(
            who, sandbox_id, "remove_context", "code.context.remove", context_id=context_id
        )
        return Response(status_code=204)

    # ------------------------------------------------------------------ templates, pools

    @app.get(
        "/v1/templates", response_model=m.TemplateList, responses=responses, tags=["templates"]
    )
    async def list_templates(mgr: Mgr, who: Who) -> m.TemplateList:
        return m.TemplateList(
            templates=[
                m.TemplateInfo.of(t, mgr.template_checks.get(t.name)) for t in mgr.templates.list()
            ],
            builtin=builtin_spec_names(),
        )

    @app.get(
        "/v1/templates/{name}",
        response_model=m.TemplateInfo,
        responses=responses,
        tags=["templates"],
    )
    async def get_template(name: str, mgr: Mgr, who: Who) -> m.TemplateInfo:
        info = mgr.templates.get(name)
        if info is None:
            raise NotFound(f"template {name!r} is not built", template=name)
        return m.TemplateInfo.of(info, mgr.template_checks.get(name))

    @app.post(
        "/v1/templates",
        responses={**responses, 200: {"content": {"application/x-ndjson": {}}}},
        tags=["templates"],
    )
    async def build_template(body: m.TemplateBuildBody, mgr: Mgr, who: Admin) -> Response:
        """Build (or find in the cache) a template; streams the build log as NDJSON."""
        if (body.spec is None) == (body.builtin is None):
            raise InvalidRequest("give exactly one of spec (TOML text) or builtin (a name)")
        if body.builtin is not None:
            path = builtin_spec_path(body.builtin)
            if path is None:
                raise NotFound(
                    f"no shipped spec {body.builtin!r}; shipped: {', '.join(builtin_spec_names())}"
                )
            text, base = path.read_text(), path.parent
            spec = _load_spec(text, base)
        else:
            spec = _spec_with_files(body.spec or "", body.files)
        return _ndjson(mgr.build_template(who, spec))

    @app.delete("/v1/templates/{name}", status_code=204, responses=responses, tags=["templates"])
    async def remove_template(name: str, mgr: Mgr, who: Admin) -> Response:
        await mgr.remove_template(who, name)
        return Response(status_code=204)

    @app.get("/v1/pools", response_model=m.PoolList, responses=responses, tags=["pools"])
    async def list_pools(mgr: Mgr, who: Who) -> m.PoolList:
        # Sizes are the operator's settings, visible to all; hits and misses are per tenant.
        return m.PoolList(pools=[m.PoolStats(**p) for p in mgr.pool_stats(who)])

    @app.put(
        "/v1/pools/{template}", response_model=m.PoolStats, responses=responses, tags=["pools"]
    )
    async def set_pool(template: str, body: m.PoolBody, mgr: Mgr, who: Admin) -> m.PoolStats:
        return m.PoolStats(**await mgr.set_pool_size(who, template, body.size))

    @app.post(
        "/v1/keys",
        status_code=201,
        response_model=m.KeyCreated,
        responses=responses,
        tags=["admin"],
    )
    async def make_key(body: m.KeyBody, mgr: Mgr, who: Admin) -> m.KeyCreated:
        key_id, key = create_key(state["store"], body.tenant, body.admin)
        mgr.audit(who, "key.create", key=key_id, for_tenant=body.tenant, admin=body.admin)
        return m.KeyCreated(key_id=key_id, key=key, tenant=body.tenant, admin=body.admin)

    @app.get("/v1/keys", responses=responses, tags=["admin"])
    async def list_keys(who: Admin) -> dict[str, Any]:
        return {"keys": state["store"].list_keys()}

    @app.delete("/v1/keys/{key_id}", status_code=204, responses=responses, tags=["admin"])
    async def delete_key(key_id: str, mgr: Mgr, who: Admin) -> Response:
        if not state["store"].revoke_key(key_id):
            raise NotFound(f"key {key_id} not found")
        mgr.audit(who, "key.delete", key=key_id)
        return Response(status_code=204)

    @app.put("/v1/tenants/{tenant}/quota", responses=responses, tags=["admin"])
    async def put_quota(tenant: str, body: m.QuotaBody, mgr: Mgr, who: Admin) -> dict[str, Any]:
        check_tenant_name(tenant)
        return mgr.set_quota(who, tenant, body.model_dump(exclude_none=True))

    @app.get("/v1/tenants/{tenant}/quota", responses=responses, tags=["admin"])
    async def get_quota(tenant: str, mgr: Mgr, who: Who) -> dict[str, Any]:
        if not who.admin and who.tenant != tenant:
            raise NotFound(f"tenant {tenant} not found")
        return mgr.quota(tenant)

    @app.get("/v1/audit/egress", responses=responses, tags=["audit"])
    async def audit_egress(
        who: Who,
        sandbox_id: Annotated[str | None, Query(max_length=64)] = None,
        host: Annotated[str | None, Query(max_length=255)] = None,
        allowed: bool | None = None,
        tenant: Annotated[str | None, Query(max_length=64)] = None,
        since: Annotated[
            str | None, Query(max_length=40, description="RFC 3339 time or unix seconds")
        ] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    ) -> dict[str, Any]:
        """Every egress attempt: destination, method and path, bytes, allowed or denied, rule."""
        scope = tenant if who.admin else who.tenant
        events = state["network"].egress_events(
            scope, sandbox_id, host, allowed, _parse_time(since), limit
        )
        for e in events:
            e["time"] = m.rfc3339(e["time"])
        return {"events": events}

    @app.get("/v1/audit", responses=responses, tags=["audit"])
    async def audit(
        mgr: Mgr,
        who: Who,
        sandbox_id: Annotated[str | None, Query(max_length=64)] = None,
        action: Annotated[str | None, Query(max_length=64)] = None,
        tenant: Annotated[str | None, Query(max_length=64)] = None,
        since: Annotated[
            str | None, Query(max_length=40, description="RFC 3339 time or unix seconds")
        ] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    ) -> dict[str, Any]:
        scope = tenant if who.admin else who.tenant
        events = state["store"].list_audit(scope, sandbox_id, action, _parse_time(since), limit)
        for e in events:
            e["time"] = m.rfc3339(e["time"])
        return {"events": events}

    # ------------------------------------------------------------------ kept workspaces

    @app.get(
        "/v1/workspaces",
        response_model=m.KeptWorkspaceList,
        responses=responses,
        tags=["workspaces"],
    )
    async def list_workspaces(mgr: Mgr, who: Who) -> m.KeptWorkspaceList:
        """The caller's tenant's kept workspaces (sandboxes created with keep_workspace)."""
        kept = await asyncio.to_thread(mgr.workspaces.of_tenant, who.tenant)
        return m.KeptWorkspaceList(workspaces=[m.KeptWorkspaceInfo.of(k) for k in kept])

    @app.get(
        "/v1/workspaces/{sandbox_id}/files",
        responses={**responses, 200: {"content": {"application/octet-stream": {}}}},
        tags=["workspaces"],
    )
    async def read_workspace_file(
        sandbox_id: str,
        mgr: Mgr,
        who: Who,
        path: Annotated[str, Query(max_length=8192, description="/workspace/… or relative")],
    ) -> Response:
        size, chunks = await mgr.workspaces.read_file(who, sandbox_id, path)
        # Closed after the response, also when the client left mid-way: that unmounts it.
        return Streamed(
            chunks, media_type="application/octet-stream", headers={"Content-Length": str(size)}
        )

    @app.get(
        "/v1/workspaces/{sandbox_id}/archive",
        responses={**responses, 200: {"content": {"application/x-tar": {}}}},
        tags=["workspaces"],
    )
    async def workspace_archive(sandbox_id: str, mgr: Mgr, who: Who) -> Response:
        """The whole kept workspace as a tar stream, made as it is sent."""
        chunks = await mgr.workspaces.archive(who, sandbox_id)
        return Streamed(
            chunks,
            media_type="application/x-tar",
            headers={"Content-Disposition": f'attachment; filename="{sandbox_id}.tar"'},
        )

    @app.delete(
        "/v1/workspaces/{sandbox_id}", status_code=204, responses=responses, tags=["workspaces"]
    )
    async def remove_workspace(sandbox_id: str, mgr: Mgr, who: Who) -> Response:
        await mgr.workspaces.remove(who, sandbox_id)
        return Response(status_code=204)

    return app


def serve(
    host: str,
    port: int,
    data_dir: Path,
    runtime_name: str = "process",
    runtime_config: dict[str, Any] | None = None,
    template_dir: Path | None = None,
    warm_pools: dict[str, int] | None = None,
    network: NetworkSettings | None = None,
    limits: ServerLimits | None = None,
) -> None:
    """Run the server in the foreground until SIGINT/SIGTERM (sandboxes keep running)."""
    import uvicorn

    if os.geteuid() != 0:
        print(
            "agentbox: warning: not running as root; cgroup limits, per-sandbox uids and "
            "disk limits are unavailable",
            file=sys.stderr,
        )
    logging.basicConfig(
        level=os.environ.get("AGENTBOX_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    limits = limits or ServerLimits()
    if limits.log_repeats:
        # Sandboxes and clients decide how often some things get logged: repeats are counted.
        logfilter.install(burst=limits.log_repeats)
    nofile = raise_nofile()
    if network is None or not network.public_url:
        shown = "localhost" if host in ("0.0.0.0", "::", "127.0.0.1") else host
        network = dataclasses.replace(
            network or NetworkSettings(), public_url=f"http://{shown}:{port}"
        )
    app = create_app(
        data_dir,
        os.environ.get("AGENTBOX_ADMIN_KEY"),
        runtime_name,
        runtime_config,
        template_dir,
        warm_pools,
        network,
        limits,
    )
    started = time.monotonic()
    log.info(
        "agentbox %s starting on http://%s:%d (data dir %s, %d descriptors, %d connections)",
        __version__,
        host,
        port,
        data_dir,
        nofile,
        limits.connection_cap(),
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        http=protocol_class(limits),
        ws_max_size=limits.relay.ws_max_message,
        ws_ping_interval=limits.ws_ping_interval,
        ws_ping_timeout=limits.ws_ping_interval,
        log_level="warning",
        # uvicorn's loggers go to the root handler, through the repeat filter.
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
        # Exposed ports relay the sandbox server's own Date and Server headers.
        server_header=False,
        date_header=False,
    )
    log.info("agentbox stopped after %.0f s", time.monotonic() - started)
