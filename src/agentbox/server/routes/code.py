"""The code interpreter: run code (streamed) and manage its contexts."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Response

from agentbox.core.errors import SandboxUnavailable
from agentbox.core.manager import CodeRequest
from agentbox.server import models as m
from agentbox.server.routes.deps import RESPONSES, Mgr, Who
from agentbox.server.streaming import ndjson


def router() -> APIRouter:
    r = APIRouter()

    @r.post(
        "/v1/sandboxes/{sandbox_id}/code/execute",
        responses={**RESPONSES, 200: {"content": {"application/x-ndjson": {}}}},
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
        return ndjson(_cleaned(await mgr.run_code(who, sandbox_id, req)))

    @r.post(
        "/v1/sandboxes/{sandbox_id}/code/contexts",
        status_code=201,
        response_model=m.CodeContext,
        responses=RESPONSES,
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

    @r.get(
        "/v1/sandboxes/{sandbox_id}/code/contexts",
        response_model=m.CodeContextList,
        responses=RESPONSES,
        tags=["code"],
    )
    async def list_contexts(sandbox_id: str, mgr: Mgr, who: Who) -> m.CodeContextList:
        reply = await mgr.code_call(who, sandbox_id, "list_contexts", "code.context.list")
        contexts = reply.get("contexts")
        if not isinstance(contexts, list):
            raise SandboxUnavailable("the sandbox sent no context list")
        return m.CodeContextList(contexts=[m.CodeContext.of(c) for c in contexts])

    @r.post(
        "/v1/sandboxes/{sandbox_id}/code/contexts/{context_id}/restart",
        response_model=m.CodeContext,
        responses=RESPONSES,
        tags=["code"],
    )
    async def restart_context(
        sandbox_id: str, context_id: str, mgr: Mgr, who: Who
    ) -> m.CodeContext:
        reply = await mgr.code_call(
            who, sandbox_id, "restart_context", "code.context.restart", context_id=context_id
        )
        return m.CodeContext.of(reply.get("context"))

    @r.delete(
        "/v1/sandboxes/{sandbox_id}/code/contexts/{context_id}",
        status_code=204,
        responses=RESPONSES,
        tags=["code"],
    )
    async def remove_context(sandbox_id: str, context_id: str, mgr: Mgr, who: Who) -> Response:
        await mgr.code_call(
            who, sandbox_id, "remove_context", "code.context.remove", context_id=context_id
        )
        return Response(status_code=204)

    return r


async def _cleaned(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    async for e in events:
        yield m.clean(e)
