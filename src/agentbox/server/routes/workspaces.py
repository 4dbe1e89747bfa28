"""Kept workspaces: what a sandbox created with keep_workspace left behind after it ended."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query, Response

from agentbox.server import models as m
from agentbox.server.routes.deps import RESPONSES, Mgr, Who
from agentbox.server.streaming import Streamed


def router() -> APIRouter:
    r = APIRouter()

    @r.get(
        "/v1/workspaces",
        response_model=m.KeptWorkspaceList,
        responses=RESPONSES,
        tags=["workspaces"],
    )
    async def list_workspaces(mgr: Mgr, who: Who) -> m.KeptWorkspaceList:
        """The caller's tenant's kept workspaces (sandboxes created with keep_workspace)."""
        kept = await asyncio.to_thread(mgr.workspaces.of_tenant, who.tenant)
        return m.KeptWorkspaceList(workspaces=[m.KeptWorkspaceInfo.of(k) for k in kept])

    @r.get(
        "/v1/workspaces/{sandbox_id}/files",
        responses={**RESPONSES, 200: {"content": {"application/octet-stream": {}}}},
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

    @r.get(
        "/v1/workspaces/{sandbox_id}/archive",
        responses={**RESPONSES, 200: {"content": {"application/x-tar": {}}}},
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

    @r.delete(
        "/v1/workspaces/{sandbox_id}", status_code=204, responses=RESPONSES, tags=["workspaces"]
    )
    async def remove_workspace(sandbox_id: str, mgr: Mgr, who: Who) -> Response:
        await mgr.workspaces.remove(who, sandbox_id)
        return Response(status_code=204)

    return r
