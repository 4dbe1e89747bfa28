"""E2B's REST control plane (`E2B_API_URL`): create, connect, look up, list, time, pause and
end sandboxes, in E2B's paths and camelCase JSON, over agentbox's core. The API key is the
tenant's agentbox key, sent as `X-API-KEY` (the SDK's header; headers are case-blind)."""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import parse_qsl

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field

from agentbox.core.auth import Caller
from agentbox.core.errors import Conflict, InvalidRequest, NotFound
from agentbox.core.manager import SandboxManager
from agentbox.core.requests import CreateRequest
from agentbox.server.e2b.common import (
    PAUSED_STATES,
    RUNNING_STATES,
    Body,
    E2BRoute,
    Str,
    created,
    e2b_state,
    listed,
)
from agentbox.server.e2b.operations import operations_routes
from agentbox.server.routes.deps import Mgr, Who
from agentbox.server.surfaces import Core, SurfaceRoutes
from agentbox.store.db import SandboxRow

# E2B's API default when a create names no timeout (its SDKs send 300).
DEFAULT_TIMEOUT = 15
# How long a create waits for a template's first-use build before answering (E2B's create
# answers once the sandbox runs; agentbox's /v1 answers 202 and lets the client wait).
BUILD_WAIT_S = 900.0

# E2B's template names that name an agentbox template of another name: e2b-code-interpreter's
# default is agentbox's code interpreter with the most kernels (python, javascript, typescript,
# r, bash; built on first use from code-interpreter's layers). E2B's `base` is agentbox's.
TEMPLATES = {"code-interpreter-v1": "code-interpreter-full"}


def template_name(e2b_name: str) -> str:
    return TEMPLATES.get(e2b_name, e2b_name)


class AutoResume(Body):
    enabled: bool = False


class VolumeMount(Body):
    name: Annotated[str, Field(max_length=128)]
    path: Annotated[str, Field(max_length=1024)]


class Network(Body):
    allowOut: list[Str] | None = Field(None, max_length=256)
    denyOut: list[Str] | None = Field(None, max_length=256)
    allowPublicTraffic: bool | None = None
    maskRequestHost: str | None = Field(None, max_length=300)
    rules: Any = None
    egressProxy: Any = None
    dnsServers: Any = None
    httpsPorts: Any = None


class NewSandbox(Body):
    templateID: Annotated[str, Field(min_length=1, max_length=128)]
    timeout: int = Field(DEFAULT_TIMEOUT, ge=0, le=10**9)
    secure: bool = True
    allow_internet_access: bool | None = None
    metadata: (
        dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=4096)]] | None
    ) = None  # noqa: E501
    envVars: (
        dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=32768)]] | None
    ) = None  # noqa: E501
    autoPause: bool | None = None
    autoPauseMemory: bool | None = None
    autoResume: AutoResume | None = None
    network: Network | None = None
    volumeMounts: list[VolumeMount] | None = Field(None, max_length=64)
    mcp: Any = None
    iam: Any = None


class TimeoutBody(Body):
    timeout: int = Field(ge=0, le=10**9)


class ConnectBody(Body):
    timeout: int = Field(DEFAULT_TIMEOUT, ge=0, le=10**9)
    memory: bool | None = None


class PauseBody(Body):
    memory: bool = True
    requireHealthyGuest: bool | None = None


class ResumeBody(Body):
    timeout: int = Field(DEFAULT_TIMEOUT, ge=0, le=10**9)
    autoPause: bool | None = None


def _unsupported(body: NewSandbox) -> str | None:
    """The first thing asked that agentbox's E2B surface cannot do, said plainly."""
    if body.mcp is not None:
        return "MCP gateways inside sandboxes (mcp) are not supported by agentbox"
    if body.iam is not None:
        return "workload identity (iam) is not supported by agentbox"
    if not body.secure:
        return (
            "secure=false (a sandbox anyone who knows its id controls) is not served by "
            "agentbox: create it with secure=true (the SDK's default)"
        )
    if body.autoPause and body.autoPauseMemory is False:
        return (
            "autoPauseMemory=false (pausing at the timeout without memory) is not supported "
            "yet: pause it yourself with memory=false, or let it pause with its memory"
        )
    net = body.network
    if net is not None:
        for name in ("rules", "egressProxy", "dnsServers", "httpsPorts", "maskRequestHost"):
            if getattr(net, name) not in (None, [], {}):
                return f"network.{name} is not supported by agentbox"
    return None


def _create_request(body: NewSandbox) -> CreateRequest:
    network: dict[str, Any] | None = None
    net = body.network
    if net is not None and (net.allowOut or net.denyOut or net.allowPublicTraffic is not None):
        # E2B's rule: the sandbox's own allowOut beats its own denyOut. The operator's and
        # tenant's denies, and the address guard, still win over both.
        allow = list(net.allowOut or [])
        deny = [d for d in net.denyOut or [] if d not in allow and d not in ("0.0.0.0/0", "::/0")]
        network = {
            "allow_out": allow,
            "deny_out": deny,
            "allow_public_traffic": bool(net.allowPublicTraffic),
        }
    if body.allow_internet_access is False:
        network = {**(network or {}), "allow_out": [], "allow_internet_access": False}
    # allow_internet_access=true (the SDK always sends it) means the tenant's default policy
    # here: default-deny unless the operator or the tenant opened egress.
    lifecycle = None
    if body.autoPause or (body.autoResume and body.autoResume.enabled):
        lifecycle = {
            "on_timeout": "pause" if body.autoPause else "kill",
            "auto_resume": bool(body.autoResume and body.autoResume.enabled),
        }
    return CreateRequest(
        template=template_name(body.templateID),
        timeout=max(body.timeout, 1),
        metadata=body.metadata or {},
        envs=body.envVars or {},
        network=network,
        lifecycle=lifecycle,
        volume_mounts={v.path: v.name for v in body.volumeMounts} if body.volumeMounts else None,
    )


def _alive(mgr: SandboxManager, who: Caller, sandbox_id: str) -> tuple[SandboxRow, str]:
    """The caller's sandbox and its E2B state; 404 for one that has ended (gone, for E2B)."""
    row = mgr.get(who, sandbox_id)
    state = e2b_state(row)
    if state is None:
        raise NotFound(f"sandbox {sandbox_id} not found (it ended: {row.end_reason or row.state})")
    return row, state


async def _until_started(
    mgr: SandboxManager, who: Caller, row: SandboxRow, request: Request
) -> SandboxRow:
    """A sandbox waiting for its template's first-use build (or starting again from its disk),
    once it runs (or failed); no longer than its client waits."""
    deadline = time.monotonic() + BUILD_WAIT_S
    while row.state in ("building", "starting") and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        if await request.is_disconnected():
            raise Conflict(f"the client left before sandbox {row.sandbox_id} started")
        row = mgr.get(who, row.sandbox_id)
    if e2b_state(row) != "running":
        raise Conflict(
            f"sandbox {row.sandbox_id} did not start: {row.error or row.state}", state=row.state
        )
    return row


def _detail(row: SandboxRow, state: str, core: Core) -> dict[str, Any]:
    """E2B's `SandboxDetail`."""
    out = {**listed(row, state), **created(row, core)}
    out["allowInternetAccess"] = bool((row.network or {}).get("allow_internet_access"))
    if row.lifecycle:
        out["lifecycle"] = {
            "onTimeout": row.lifecycle.get("on_timeout", "kill"),
            "autoResume": bool(row.lifecycle.get("auto_resume")),
        }
    if state == "paused":
        out["pauseMode"] = "filesystem" if row.parked else "full"
    return out


def _states(state: list[str] | None) -> list[str]:
    wanted = {s for item in state or [] for s in item.split(",") if s} or {"running", "paused"}
    unknown = wanted - {"running", "paused"}
    if unknown:
        raise InvalidRequest(f"unknown state filter {sorted(unknown)}: use running, paused")
    out: list[str] = []
    if "running" in wanted:
        out += RUNNING_STATES
    if "paused" in wanted:
        out += PAUSED_STATES
    return out


def _metadata(query: str | None) -> dict[str, str]:
    """E2B's metadata filter: one query parameter holding `k=v&k2=v2`, each part quoted."""
    if not query:
        return {}
    try:
        return dict(parse_qsl(query, keep_blank_values=True, max_num_fields=64))
    except ValueError:
        raise InvalidRequest("at most 64 metadata filters") from None


class Idempotency:
    """Creates by `Idempotency-Key`: the same key from the same tenant within a day answers
    with the sandbox the first create made, never makes a second. Creates that carry a key
    are made one at a time per tenant; each tenant keeps its newest keys only."""

    TTL = 86_400.0
    PER_TENANT = 1000
    KEY = re.compile(r"[a-z0-9-]{1,255}")

    def __init__(self) -> None:
        self._made: dict[str, OrderedDict[str, tuple[float, str]]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def lock(self, tenant: str) -> asyncio.Lock:
        return self._locks.setdefault(tenant, asyncio.Lock())

    def made(self, tenant: str, key: str) -> str | None:
        """The sandbox the key made, if it did within the TTL."""
        if not self.KEY.fullmatch(key):
            raise InvalidRequest(
                "Idempotency-Key must be 1-255 lowercase letters, digits and hyphens"
            )
        found = self._made.get(tenant, OrderedDict()).get(key)
        return found[1] if found is not None and found[0] > time.time() else None

    def record(self, tenant: str, key: str, sandbox_id: str) -> None:
        keys = self._made.setdefault(tenant, OrderedDict())
        keys[key] = (time.time() + self.TTL, sandbox_id)
        keys.move_to_end(key)
        while len(keys) > self.PER_TENANT:
            keys.popitem(last=False)


def control_surface(core: Core) -> SurfaceRoutes:
    r = APIRouter(route_class=E2BRoute, tags=["e2b"], include_in_schema=False)
    idempotency = Idempotency()

    async def create(
        body: NewSandbox,
        request: Request,
        mgr: Mgr,
        who: Who,
        idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
    ) -> JSONResponse:
        why = _unsupported(body)
        if why:
            raise InvalidRequest(why)
        if idempotency_key is None:
            row = await mgr.create(who, _create_request(body))
        else:
            async with idempotency.lock(who.tenant):
                made = idempotency.made(who.tenant, idempotency_key)
                if made is not None:
                    row = mgr.get(who, made)
                    if e2b_state(row) is None:
                        raise Conflict(
                            f"this Idempotency-Key made sandbox {made}, which has ended; "
                            "use a new key for a new sandbox",
                            state=row.state,
                        )
                else:
                    row = await mgr.create(who, _create_request(body))
                    idempotency.record(who.tenant, idempotency_key, row.sandbox_id)
        if row.state != "running":
            row = await _until_started(mgr, who, row, request)
        return JSONResponse(status_code=201, content=created(row, core))

    r.include_router(operations_routes(core))  # metrics, fork, snapshots, network
    r.add_api_route("/sandboxes", create, methods=["POST"], status_code=201)
    r.add_api_route("/v2/sandboxes", create, methods=["POST"], status_code=201)

    @r.get("/sandboxes/{sandbox_id}")
    async def get_sandbox(sandbox_id: str, mgr: Mgr, who: Who) -> dict[str, Any]:
        row, state = _alive(mgr, who, sandbox_id)
        return _detail(row, state, core)

    @r.delete("/sandboxes/{sandbox_id}", status_code=204)
    async def kill(sandbox_id: str, mgr: Mgr, who: Who) -> Response:
        _alive(mgr, who, sandbox_id)
        await mgr.kill(who, sandbox_id)
        return Response(status_code=204)

    @r.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
    async def set_timeout(sandbox_id: str, body: TimeoutBody, mgr: Mgr, who: Who) -> Response:
        _alive(mgr, who, sandbox_id)
        if body.timeout == 0:  # E2B: ends now
            await mgr.kill(who, sandbox_id)
        else:
            await mgr.set_timeout(who, sandbox_id, body.timeout)
        return Response(status_code=204)

    async def connect(
        sandbox_id: str, request: Request, mgr: Mgr, who: Who, body: ConnectBody
    ) -> JSONResponse:
        """Resume a paused sandbox (201), or extend a running one's timeout, never shortening
        it (200)."""
        row, state = _alive(mgr, who, sandbox_id)
        if body.memory is False and state == "paused" and not row.parked:
            # E2B's rule for a server that cannot: refused, never downgraded to a memory resume.
            raise InvalidRequest(
                f"memory=false: sandbox {sandbox_id} was paused with its memory, and agentbox "
                "cannot resume it from its disk alone; connect with memory=true (its processes "
                "carry on), or kill it",
                setting="memory",
            )
        if row.state in ("building", "starting"):
            row = await _until_started(mgr, who, row, request)
        row = await mgr.resume(who, sandbox_id, max(body.timeout, 1))
        if row.state != "running":
            row = await _until_started(mgr, who, row, request)
        return JSONResponse(
            status_code=201 if state == "paused" else 200, content=created(row, core)
        )

    r.add_api_route("/sandboxes/{sandbox_id}/connect", connect, methods=["POST"])
    r.add_api_route("/v2/sandboxes/{sandbox_id}/connect", connect, methods=["POST"])

    @r.post("/sandboxes/{sandbox_id}/resume", status_code=201)
    async def resume(
        sandbox_id: str, request: Request, mgr: Mgr, who: Who, body: ResumeBody
    ) -> JSONResponse:
        _, state = _alive(mgr, who, sandbox_id)
        if state != "paused":
            raise Conflict(f"sandbox {sandbox_id} is not paused", state=state)
        row = await mgr.resume(who, sandbox_id, max(body.timeout, 1))
        if row.state != "running":
            row = await _until_started(mgr, who, row, request)
        return JSONResponse(status_code=201, content=created(row, core))

    @r.post("/sandboxes/{sandbox_id}/pause", status_code=204)
    async def pause(sandbox_id: str, mgr: Mgr, who: Who, body: PauseBody | None = None) -> Response:
        _, state = _alive(mgr, who, sandbox_id)
        if state == "paused":
            raise Conflict(f"sandbox {sandbox_id} is already paused", state=state)
        await mgr.pause(who, sandbox_id, body.memory if body is not None else True)
        return Response(status_code=204)

    def _list(
        mgr: SandboxManager,
        who: Caller,
        state: list[str] | None,
        metadata: str | None,
        template: str | None,
        started_after: datetime | None,
        limit: int,
        next_token: str | None,
        ascending: bool,
    ) -> tuple[list[dict[str, Any]], str | None]:
        if started_after is not None and started_after.tzinfo is None:
            started_after = started_after.replace(tzinfo=UTC)  # E2B's times are UTC
        after = started_after.timestamp() if started_after is not None else None

        def match(row: SandboxRow) -> bool:
            return (template is None or row.template == template_name(template)) and (
                after is None or row.created_at > after
            )

        rows, token = mgr.list(
            who, _states(state), _metadata(metadata), limit, next_token, match, ascending
        )
        return [listed(row, e2b_state(row) or "running") for row in rows], token

    @r.get("/v2/sandboxes")
    async def list_v2(
        mgr: Mgr,
        who: Who,
        response: Response,
        metadata: Annotated[str | None, Query(max_length=8192)] = None,
        state: Annotated[list[str] | None, Query(max_length=64)] = None,
        template: Annotated[str | None, Query(max_length=128)] = None,
        startedAfter: Annotated[datetime | None, Query()] = None,  # noqa: N803 - E2B's name
        order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
        limit: Annotated[int, Query(ge=1, le=100)] = 100,
        nextToken: Annotated[str | None, Query(max_length=32)] = None,  # noqa: N803
    ) -> list[dict[str, Any]]:
        """Newest first (or `order=asc`); the next page's token in `x-next-token`."""
        items, token = _list(
            mgr, who, state, metadata, template, startedAfter, limit, nextToken, order == "asc"
        )
        if token:
            response.headers["x-next-token"] = token
        return items

    @r.get("/sandboxes")
    async def list_v1(
        mgr: Mgr,
        who: Who,
        metadata: Annotated[str | None, Query(max_length=8192)] = None,
    ) -> list[dict[str, Any]]:
        """E2B's first list: every running sandbox (no paging)."""
        out: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            items, token = _list(mgr, who, ["running"], metadata, None, None, 100, token, False)
            out += items
            if not token or len(out) >= 10_000:
                return out

    return SurfaceRoutes(router=r)
