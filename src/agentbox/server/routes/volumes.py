"""Volumes: named, tenant-scoped persistent filesystems (core/volumes.py)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from agentbox.core.manager import SandboxManager
from agentbox.server import models as m
from agentbox.server.routes.deps import RESPONSES, Mgr, Who
from agentbox.server.streaming import Streamed
from agentbox.store.db import VolumeRow

PathQuery = Annotated[str, Query(max_length=8192, description="a path in the volume")]


def _info(mgr: SandboxManager, v: VolumeRow) -> m.VolumeInfo:
    return m.VolumeInfo(
        volume_id=v.volume_id,
        name=v.name,
        size_mb=v.size_mb,
        used_bytes=mgr.volumes.used_bytes(v.volume_id),
        created_at=m.rfc3339(v.created_at) or "",
        metadata=v.metadata,
        mounted_by=mgr.volumes.mounted_by(v.volume_id),
    )


def router() -> APIRouter:
    r = APIRouter()

    @r.post(
        "/v1/volumes",
        response_model=m.VolumeInfo,
        status_code=201,
        responses=RESPONSES,
        tags=["volumes"],
    )
    async def create_volume(body: m.VolumeBody, mgr: Mgr, who: Who) -> m.VolumeInfo:
        """A new, empty volume of `size_mb` (its files' owner is the sandbox user)."""
        vol = await mgr.volumes.create(who, body.name, body.size_mb, body.metadata)
        return _info(mgr, vol)

    @r.get("/v1/volumes", response_model=m.VolumeList, responses=RESPONSES, tags=["volumes"])
    async def list_volumes(mgr: Mgr, who: Who) -> m.VolumeList:
        """The caller's tenant's volumes, oldest first."""
        vols = await asyncio.to_thread(mgr.volumes.of_tenant, who)
        return m.VolumeList(volumes=[_info(mgr, v) for v in vols])

    @r.get(
        "/v1/volumes/{volume}", response_model=m.VolumeInfo, responses=RESPONSES, tags=["volumes"]
    )
    async def get_volume(volume: str, mgr: Mgr, who: Who) -> m.VolumeInfo:
        """One volume, by id or name."""
        return _info(mgr, mgr.volumes.get(who, volume))

    @r.delete("/v1/volumes/{volume}", status_code=204, responses=RESPONSES, tags=["volumes"])
    async def delete_volume(volume: str, mgr: Mgr, who: Who) -> Response:
        """Delete a volume and its files; 409 while a live sandbox mounts it."""
        await mgr.volumes.delete(who, volume)
        return Response(status_code=204)

    @r.get(
        "/v1/volumes/{volume}/files",
        responses={**RESPONSES, 200: {"content": {"application/octet-stream": {}}}},
        tags=["volumes"],
    )
    async def read_volume_file(volume: str, path: PathQuery, mgr: Mgr, who: Who) -> Response:
        """One file of a volume no sandbox mounts (409 while one does), streamed."""
        size, chunks = await mgr.volumes.read_file(who, volume, path)
        return Streamed(
            chunks, media_type="application/octet-stream", headers={"Content-Length": str(size)}
        )

    @r.put("/v1/volumes/{volume}/files", responses=RESPONSES, tags=["volumes"])
    async def write_volume_file(
        volume: str, path: PathQuery, request: Request, mgr: Mgr, who: Who
    ) -> dict[str, int]:
        """Write one file of a volume no sandbox mounts (its directories made as needed)."""
        return {"size": await mgr.volumes.write_file(who, volume, path, request.stream())}

    return r
