"""A sandbox's network: its policy, signed URLs to its exposed ports, its access token."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter

from agentbox.server import models as m
from agentbox.server.routes.deps import RESPONSES, Links, Mgr, Who


def router(links: Links) -> APIRouter:
    r = APIRouter()

    @r.put(
        "/v1/sandboxes/{sandbox_id}/network",
        response_model=m.SandboxInfo,
        responses=RESPONSES,
        tags=["network"],
    )
    async def set_network(
        sandbox_id: str, body: m.NetworkBody, mgr: Mgr, who: Who
    ) -> m.SandboxInfo:
        return links.sandbox(await mgr.set_network(who, sandbox_id, body.model_dump()), mgr)

    @r.post("/v1/sandboxes/{sandbox_id}/port-url", responses=RESPONSES, tags=["network"])
    async def port_url(sandbox_id: str, body: m.PortUrlBody, mgr: Mgr, who: Who) -> dict[str, Any]:
        expires, query = mgr.sign_port_url(who, sandbox_id, body.port, body.expires_in)
        path = body.path if body.path.startswith("/") else "/" + body.path
        sep = "&" if "?" in path else "?"
        return {
            "url": f"{_port_base(links, body, sandbox_id)}{path}{sep}{urlencode(query)}",
            "port": body.port,
            "expires_at": m.rfc3339(expires),
        }

    @r.post(
        "/v1/sandboxes/{sandbox_id}/access-token",
        response_model=m.SandboxInfo,
        responses=RESPONSES,
        tags=["network"],
    )
    async def rotate_access_token(sandbox_id: str, mgr: Mgr, who: Who) -> m.SandboxInfo:
        """A new access token for the sandbox's private ports: the old one, every URL signed
        with it and every port cookie made from those stop working at once."""
        return links.sandbox(await mgr.rotate_access_token(who, sandbox_id), mgr)

    return r


def _port_base(links: Links, body: m.PortUrlBody, sandbox_id: str) -> str:
    public = links.public
    if body.routing == "host":
        return f"{public.scheme}://{body.port}-{sandbox_id}.{links.domain}"
    return (
        f"{public.scheme}://{public.netloc}{public.path.rstrip('/')}"
        f"/v1/sandboxes/{sandbox_id}/ports/{body.port}"
    )
