"""What every /v1 route depends on: the core, the caller, and how a sandbox is rendered."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import SplitResult, urlsplit

from fastapi import Depends, Header, Request

from agentbox.core.auth import Caller, require_admin
from agentbox.core.errors import InvalidRequest
from agentbox.core.manager import SandboxManager
from agentbox.core.network import NetworkService, NetworkSettings
from agentbox.core.tenants import TenantService
from agentbox.server import models as m
from agentbox.server.surfaces import Core
from agentbox.store.db import Store

# Dependencies are coroutines: plain functions would each be run in a worker thread, two
# thread hand-offs per request, which is where a busy host's scheduling delays add up.


async def core(request: Request) -> Core:
    found: Core = request.app.state.core
    return found


async def manager(request: Request) -> SandboxManager:
    return (await core(request)).manager


async def network(request: Request) -> NetworkService:
    return (await core(request)).network


async def store(request: Request) -> Store:
    return (await core(request)).store


async def tenants(request: Request) -> TenantService:
    return (await core(request)).manager.tenants


VIA = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/@-]{0,95}")


async def caller(
    request: Request,
    x_api_key: Annotated[str | None, Header()] = None,
    # Not in the OpenAPI schema of every route: docs/API.md ("Keys, tenants, audit") has it.
    x_agentbox_via: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> Caller:
    known = request.scope.get("agentbox.caller")  # the RequestGuard's check
    who = known if known is not None else (await core(request)).auth.authenticate(x_api_key)
    if x_agentbox_via is not None:
        if not VIA.fullmatch(x_agentbox_via):
            raise InvalidRequest(
                "X-Agentbox-Via: a label of 1-96 characters (letters, digits, _ . : / @ -), "
                "starting with a letter or digit"
            )
        who = dataclasses.replace(who, via=x_agentbox_via)
    return who


async def admin(c: Annotated[Caller, Depends(caller)]) -> Caller:
    # Refused before the body is read; the core checks again for every surface.
    return require_admin(c, "this route")


CoreDep = Annotated[Core, Depends(core)]
Mgr = Annotated[SandboxManager, Depends(manager)]
Net = Annotated[NetworkService, Depends(network)]
Db = Annotated[Store, Depends(store)]
Tenants = Annotated[TenantService, Depends(tenants)]
Who = Annotated[Caller, Depends(caller)]
Admin = Annotated[Caller, Depends(admin)]

RESPONSES: dict[int | str, dict[str, Any]] = {
    s: {"model": m.ErrorBody} for s in (400, 401, 403, 404, 409, 422, 429, 503)
}


@dataclass(frozen=True)
class Links:
    """Where clients reach this server and its sandboxes' exposed ports."""

    public: SplitResult
    # What clients put after "{port}-{sandbox_id}." to reach an exposed port.
    domain: str

    @classmethod
    def of(cls, settings: NetworkSettings) -> Links:
        public = urlsplit(settings.public_url or "http://localhost")
        domain = settings.ports_domain
        if public.port and public.port not in (80, 443):
            domain = f"{domain}:{public.port}"
        return cls(public, domain)

    def sandbox(self, row: Any, mgr: SandboxManager) -> m.SandboxInfo:
        return m.SandboxInfo.of(row, self.domain, mgr.build_progress(row))
