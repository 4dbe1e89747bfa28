"""The /v1 HTTP API: one router per resource, assembled into the first surface.

Handlers parse, make one core call, and render; errors become answers in `server/errors.py`.
"""

from __future__ import annotations

from fastapi import APIRouter

from agentbox.server.routes import (
    audit,
    code,
    commands,
    files,
    health,
    network,
    pools,
    sandboxes,
    snapshots,
    templates,
    tenants,
    volumes,
    workspaces,
)
from agentbox.server.routes.deps import Links
from agentbox.server.surfaces import Core, SurfaceRoutes


def v1_surface(core: Core) -> SurfaceRoutes:
    links = Links.of(core.settings)
    api = APIRouter()
    for router in (
        health.router(),
        sandboxes.router(links),
        network.router(links),
        tenants.secrets_router(),
        tenants.network_router(),
        commands.router(),
        files.router(),
        code.router(),
        templates.router(),
        pools.router(),
        tenants.keys_router(),
        tenants.quotas_router(),
        audit.router(),
        snapshots.router(links),
        volumes.router(),
        workspaces.router(),
    ):
        api.include_router(router)
    return SurfaceRoutes(router=api, open_paths=health.OPEN_PATHS)
