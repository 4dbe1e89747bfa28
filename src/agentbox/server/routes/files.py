"""Files in a running sandbox: read and write (streamed), list, stat, watch, mkdir, remove,
rename."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse

from agentbox.agent.client import AgentUnavailable
from agentbox.agent.protocol import LIST_LIMIT
from agentbox.server import models as m
from agentbox.server.routes.deps import RESPONSES, Mgr, Who
from agentbox.server.streaming import Streamed, ndjson
from agentbox.vocab import ErrorCode

PathQ = Annotated[str, Query(max_length=8192, description="sandbox path")]
UserQ = Annotated[m.SandboxUser | None, Query(description=m.USER_DOC)]


def router() -> APIRouter:
    r = APIRouter()

    @r.get(
        "/v1/sandboxes/{sandbox_id}/files",
        responses={**RESPONSES, 200: {"content": {"application/octet-stream": {}}}},
        tags=["files"],
    )
    async def read_file(
        sandbox_id: str, path: PathQ, mgr: Mgr, who: Who, user: UserQ = None
    ) -> Response:
        size, chunks = await mgr.read_file(who, sandbox_id, path, user)
        return Streamed(
            chunks, media_type="application/octet-stream", headers={"Content-Length": str(size)}
        )

    @r.put(
        "/v1/sandboxes/{sandbox_id}/files",
        response_model=m.EntryInfo,
        responses=RESPONSES,
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
        sandbox_id: str, path: PathQ, request: Request, mgr: Mgr, who: Who, user: UserQ = None
    ) -> m.EntryInfo:
        entry = await mgr.write_file(who, sandbox_id, path, request.stream(), user)
        return m.EntryInfo.of(entry)

    @r.get(
        "/v1/sandboxes/{sandbox_id}/files/list",
        response_model=m.EntryList,
        responses=RESPONSES,
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
        user: UserQ = None,
    ) -> m.EntryList:
        reply = await mgr.files.list(who, sandbox_id, path, depth, limit, cursor, user)
        return m.EntryList(
            entries=[m.EntryInfo.of(e) for e in reply["entries"]],
            truncated=bool(reply.get("truncated")),
            next_cursor=reply.get("next_cursor"),
        )

    @r.get(
        "/v1/sandboxes/{sandbox_id}/files/stat",
        response_model=m.EntryInfo,
        responses=RESPONSES,
        tags=["files"],
    )
    async def stat_file(
        sandbox_id: str, path: PathQ, mgr: Mgr, who: Who, user: UserQ = None
    ) -> m.EntryInfo:
        return m.EntryInfo.of(await mgr.files.stat(who, sandbox_id, path, user))

    @r.get(
        "/v1/sandboxes/{sandbox_id}/files/watch",
        responses={**RESPONSES, 200: {"content": {"application/x-ndjson": {}}}},
        tags=["files"],
    )
    async def watch_files(
        sandbox_id: str,
        path: PathQ,
        mgr: Mgr,
        who: Who,
        recursive: Annotated[
            bool, Query(description="the whole tree (new directories too)")
        ] = False,
        user: UserQ = None,
    ) -> Response:
        """A directory's changes, as NDJSON until the client leaves: `start`, then
        `{"type": "fs", "name", "op"}` (op create, write, remove, rename or chmod; name relative
        to the directory) and `keepalive` lines; `error` ends it (events lost, the sandbox
        gone). At most 16 watches per sandbox at once (409 past that)."""
        events = await mgr.files.watch(who, sandbox_id, path, recursive, user)
        return ndjson(_watched(path, events))

    @r.post(
        "/v1/sandboxes/{sandbox_id}/files/mkdir",
        response_model=m.EntryInfo,
        status_code=201,
        responses=RESPONSES,
        tags=["files"],
    )
    async def make_dir(sandbox_id: str, body: m.PathBody, mgr: Mgr, who: Who) -> Response:
        reply = await mgr.files.make_dir(who, sandbox_id, body.path, body.user)
        return JSONResponse(
            status_code=201 if reply.get("created") else 200,
            content=m.EntryInfo.of(reply["entry"]).model_dump(),
        )

    @r.delete(
        "/v1/sandboxes/{sandbox_id}/files", status_code=204, responses=RESPONSES, tags=["files"]
    )
    async def remove_file(
        sandbox_id: str, path: PathQ, mgr: Mgr, who: Who, user: UserQ = None
    ) -> Response:
        await mgr.files.remove(who, sandbox_id, path, user)
        return Response(status_code=204)

    @r.post(
        "/v1/sandboxes/{sandbox_id}/files/rename",
        response_model=m.EntryInfo,
        responses=RESPONSES,
        tags=["files"],
    )
    async def rename_file(sandbox_id: str, body: m.RenameBody, mgr: Mgr, who: Who) -> m.EntryInfo:
        entry = await mgr.files.rename(who, sandbox_id, body.src, body.dst, body.user)
        return m.EntryInfo.of(entry)

    return r


async def _watched(
    path: str, events: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    yield {"type": "start", "path": path}
    try:
        async for event in events:
            if event.get("type") == "overflow":
                why = f": {event['message']}" if event.get("message") else ""
                yield {
                    "type": "error",
                    "code": ErrorCode.LIMIT_EXCEEDED,
                    "message": "the watch ended, events may be lost (the sandbox's kernel dropped "
                    f"some, or the tree grew past what one watch follows{why}): list the "
                    "directory, then watch it again",
                }
                return
            if event.get("type") in ("fs", "keepalive"):
                yield event
    except AgentUnavailable as e:
        yield {"type": "error", "code": ErrorCode.SANDBOX_UNAVAILABLE, "message": str(e)}
