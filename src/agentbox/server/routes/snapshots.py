"""Snapshots of sandboxes' disks, and forks (core/snapshots.py)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response

from agentbox.server import models as m
from agentbox.server.routes.deps import RESPONSES, Links, Mgr, Who


def router(links: Links) -> APIRouter:
    r = APIRouter()

    @r.post(
        "/v1/sandboxes/{sandbox_id}/snapshots",
        response_model=m.SnapshotInfo,
        status_code=201,
        responses=RESPONSES,
        tags=["snapshots"],
    )
    async def create_snapshot(
        sandbox_id: str, mgr: Mgr, who: Who, body: m.SnapshotBody | None = None
    ) -> m.SnapshotInfo:
        """Copy the running or paused sandbox's disk (root layer and workspace), freezing it
        only for the copy; start sandboxes from it with template=<snapshot id or name>."""
        body = body or m.SnapshotBody(name=None)
        snap = await mgr.snapshots.create(who, sandbox_id, body.name, body.metadata)
        return m.SnapshotInfo.of(snap)

    @r.get("/v1/snapshots", response_model=m.SnapshotList, responses=RESPONSES, tags=["snapshots"])
    async def list_snapshots(mgr: Mgr, who: Who) -> m.SnapshotList:
        """The caller's tenant's snapshots, oldest first."""
        snaps = await asyncio.to_thread(mgr.snapshots.of_tenant, who)
        return m.SnapshotList(snapshots=[m.SnapshotInfo.of(s) for s in snaps])

    @r.get(
        "/v1/snapshots/{snapshot}",
        response_model=m.SnapshotInfo,
        responses=RESPONSES,
        tags=["snapshots"],
    )
    async def get_snapshot(snapshot: str, mgr: Mgr, who: Who) -> m.SnapshotInfo:
        """One snapshot, by id or name."""
        return m.SnapshotInfo.of(mgr.snapshots.get(who, snapshot))

    @r.delete("/v1/snapshots/{snapshot}", status_code=204, responses=RESPONSES, tags=["snapshots"])
    async def delete_snapshot(snapshot: str, mgr: Mgr, who: Who) -> Response:
        """Delete a snapshot (by id or name) and its image; sandboxes started from it keep
        their own copies."""
        await mgr.snapshots.delete(who, snapshot)
        return Response(status_code=204)

    @r.post(
        "/v1/sandboxes/{sandbox_id}/fork",
        response_model=m.ForkResult,
        status_code=201,
        responses=RESPONSES,
        tags=["sandboxes"],
    )
    async def fork_sandbox(
        sandbox_id: str, mgr: Mgr, who: Who, body: m.ForkBody | None = None
    ) -> m.ForkResult:
        """`count` new running sandboxes, each with a copy of this running or paused
        sandbox's disk and settings, each its own from then on."""
        body = body or m.ForkBody(count=1, timeout=None)
        rows = await mgr.snapshots.fork(who, sandbox_id, body.count, body.timeout)
        return m.ForkResult(sandboxes=[links.sandbox(row, mgr) for row in rows])

    return r
