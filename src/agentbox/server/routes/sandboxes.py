"""Sandboxes: create, list, look up, end, and extend."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response

from agentbox.core.errors import InvalidRequest
from agentbox.core.manager import CreateRequest
from agentbox.server import models as m
from agentbox.server.routes.deps import RESPONSES, Links, Mgr, Who


def router(links: Links) -> APIRouter:
    r = APIRouter()

    @r.post(
        "/v1/sandboxes",
        status_code=201,
        response_model=m.SandboxInfo,
        responses=RESPONSES,
        tags=["sandboxes"],
    )
    async def create_sandbox(
        body: m.CreateSandboxBody, mgr: Mgr, who: Who, response: Response
    ) -> m.SandboxInfo:
        row = await mgr.create(who, _create_request(body))
        if row.state == "building":  # the template's first-use build: the client waits on GET
            response.status_code = 202
        return links.sandbox(row, mgr)

    @r.get("/v1/sandboxes", response_model=m.SandboxList, responses=RESPONSES, tags=["sandboxes"])
    async def list_sandboxes(
        mgr: Mgr,
        who: Who,
        state_: Annotated[list[str] | None, Query(alias="state")] = None,
        metadata: Annotated[list[str] | None, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 50,
        next_token: Annotated[str | None, Query(max_length=32)] = None,
    ) -> m.SandboxList:
        states = [s for item in state_ or [] for s in item.split(",") if s]
        rows, token = mgr.list(who, states or None, _metadata_filter(metadata), limit, next_token)
        return m.SandboxList(sandboxes=[links.sandbox(r, mgr) for r in rows], next_token=token)

    @r.get(
        "/v1/sandboxes/{sandbox_id}",
        response_model=m.SandboxInfo,
        responses=RESPONSES,
        tags=["sandboxes"],
    )
    async def get_sandbox(sandbox_id: str, mgr: Mgr, who: Who) -> m.SandboxInfo:
        return links.sandbox(mgr.get(who, sandbox_id), mgr)

    @r.delete(
        "/v1/sandboxes/{sandbox_id}", status_code=204, responses=RESPONSES, tags=["sandboxes"]
    )
    async def kill_sandbox(sandbox_id: str, mgr: Mgr, who: Who) -> Response:
        await mgr.kill(who, sandbox_id)
        return Response(status_code=204)

    @r.post(
        "/v1/sandboxes/{sandbox_id}/timeout",
        response_model=m.SandboxInfo,
        responses=RESPONSES,
        tags=["sandboxes"],
    )
    async def set_timeout(
        sandbox_id: str, body: m.TimeoutBody, mgr: Mgr, who: Who
    ) -> m.SandboxInfo:
        return links.sandbox(await mgr.set_timeout(who, sandbox_id, body.timeout), mgr)

    @r.get("/v1/sandboxes/{sandbox_id}/metrics", responses=RESPONSES, tags=["sandboxes"])
    async def sandbox_metrics(
        sandbox_id: str,
        mgr: Mgr,
        who: Who,
        start: Annotated[float | None, Query(ge=0, le=1e11)] = None,
        end: Annotated[float | None, Query(ge=0, le=1e11)] = None,
    ) -> dict[str, Any]:
        """CPU, memory and disk of a live sandbox over time (unix seconds `start`..`end`),
        sampled every few seconds and kept for an hour (docs/API.md, "Metrics")."""
        return {"metrics": mgr.get_metrics(who, sandbox_id, start, end)}

    @r.post(
        "/v1/sandboxes/{sandbox_id}/pause",
        response_model=m.SandboxInfo,
        responses=RESPONSES,
        tags=["sandboxes"],
    )
    async def pause_sandbox(
        sandbox_id: str, mgr: Mgr, who: Who, body: m.PauseBody | None = None
    ) -> m.SandboxInfo:
        """Freeze the sandbox with its memory: no CPU, its timeout stopped; 409 if already
        paused."""
        keep = body.keep_memory if body is not None else True
        return links.sandbox(await mgr.pause(who, sandbox_id, keep), mgr)

    @r.post(
        "/v1/sandboxes/{sandbox_id}/resume",
        response_model=m.SandboxInfo,
        responses=RESPONSES,
        tags=["sandboxes"],
    )
    async def resume_sandbox(
        sandbox_id: str, mgr: Mgr, who: Who, body: m.ResumeBody | None = None
    ) -> m.SandboxInfo:
        """Thaw a paused sandbox (a running one is left running); it gets the time it had left,
        or `timeout` if longer."""
        timeout = body.timeout if body is not None else None
        return links.sandbox(await mgr.resume(who, sandbox_id, timeout), mgr)

    return r


def _create_request(body: m.CreateSandboxBody) -> CreateRequest:
    network = body.network.model_dump() if body.network is not None else None
    if body.allow_internet_access is not None:
        network = {**(network or {}), "allow_internet_access": body.allow_internet_access}
    return CreateRequest(
        template=body.template,
        timeout=body.timeout,
        metadata=body.metadata,
        envs=body.envs,
        resources=body.resources.model_dump(exclude_none=True),
        keep_workspace=body.keep_workspace,
        network=network,
        secrets=body.secrets,
        runtime=body.isolation or body.runtime,
        lifecycle=body.lifecycle.model_dump() if body.lifecycle is not None else None,
        volume_mounts={
            path: v if isinstance(v, str) else v.model_dump()
            for path, v in body.volume_mounts.items()
        }
        or None,
    )


def _metadata_filter(items: list[str] | None) -> dict[str, str]:
    meta: dict[str, str] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise InvalidRequest(f"metadata filter {item!r} must look like key=value")
        meta[k] = v
    return meta
