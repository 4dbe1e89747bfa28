"""Commands in a sandbox: run (streamed or in the background), follow, feed stdin, signal."""

from __future__ import annotations

import signal as signals
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse

from agentbox.core.errors import InvalidRequest
from agentbox.core.manager import CommandRequest
from agentbox.server import models as m
from agentbox.server.routes import terminal
from agentbox.server.routes.deps import RESPONSES, Mgr, Who
from agentbox.server.streaming import ndjson


def router() -> APIRouter:
    r = APIRouter()

    @r.post(
        "/v1/sandboxes/{sandbox_id}/commands",
        responses={
            **RESPONSES,
            200: {
                "content": {"application/x-ndjson": {}},
                "description": "foreground: live NDJSON events",
            },
            201: {"model": m.CommandInfo, "description": "background: the command's handle"},
        },
        tags=["commands"],
    )
    async def run_command(sandbox_id: str, body: m.CommandBody, mgr: Mgr, who: Who) -> Response:
        req = CommandRequest(
            cmd=body.cmd,
            cwd=body.cwd,
            user=body.user,
            envs=body.envs,
            timeout=body.timeout,
            background=body.background,
            stdin=body.stdin,
            pty=(body.pty.cols, body.pty.rows) if body.pty is not None else None,
        )
        if body.background:
            info = await mgr.start_command(who, sandbox_id, req)
            return JSONResponse(status_code=201, content=m.CommandInfo.of(info).model_dump())
        info, events = await mgr.run_command(who, sandbox_id, req)
        return ndjson(_with_start(info, events))

    @r.get(
        "/v1/sandboxes/{sandbox_id}/commands",
        response_model=m.CommandList,
        responses=RESPONSES,
        tags=["commands"],
    )
    async def list_commands(sandbox_id: str, mgr: Mgr, who: Who) -> m.CommandList:
        found = await mgr.commands.list(who, sandbox_id)
        return m.CommandList(commands=[m.CommandInfo.of(c) for c in found])

    @r.get(
        "/v1/sandboxes/{sandbox_id}/commands/{cmd_id}",
        response_model=m.CommandInfo,
        responses=RESPONSES,
        tags=["commands"],
    )
    async def get_command(sandbox_id: str, cmd_id: str, mgr: Mgr, who: Who) -> m.CommandInfo:
        return m.CommandInfo.of(await mgr.commands.info(who, sandbox_id, cmd_id))

    @r.get(
        "/v1/sandboxes/{sandbox_id}/commands/{cmd_id}/events",
        responses={**RESPONSES, 200: {"content": {"application/x-ndjson": {}}}},
        tags=["commands"],
    )
    async def command_events(
        sandbox_id: str, cmd_id: str, mgr: Mgr, who: Who, offset: Annotated[int, Query(ge=0)] = 0
    ) -> Response:
        return ndjson(await mgr.command_events(who, sandbox_id, cmd_id, offset))

    @r.post(
        "/v1/sandboxes/{sandbox_id}/commands/{cmd_id}/stdin",
        status_code=204,
        responses=RESPONSES,
        tags=["commands"],
    )
    async def command_stdin(
        sandbox_id: str, cmd_id: str, body: m.StdinBody, mgr: Mgr, who: Who
    ) -> Response:
        await mgr.command_stdin(who, sandbox_id, cmd_id, body.data, body.eof)
        return Response(status_code=204)

    @r.post(
        "/v1/sandboxes/{sandbox_id}/commands/{cmd_id}/resize",
        status_code=204,
        responses=RESPONSES,
        tags=["commands"],
    )
    async def command_resize(
        sandbox_id: str, cmd_id: str, body: m.TerminalSize, mgr: Mgr, who: Who
    ) -> Response:
        """A terminal command's new size (SIGWINCH to its foreground process group)."""
        await mgr.commands.command_resize(who, sandbox_id, cmd_id, body.cols, body.rows)
        return Response(status_code=204)

    r.add_api_websocket_route(
        "/v1/sandboxes/{sandbox_id}/commands/{cmd_id}/terminal", terminal.attach
    )

    @r.post(
        "/v1/sandboxes/{sandbox_id}/commands/{cmd_id}/kill",
        status_code=204,
        responses=RESPONSES,
        tags=["commands"],
    )
    async def command_kill(
        sandbox_id: str, cmd_id: str, mgr: Mgr, who: Who, body: m.SignalBody | None = None
    ) -> Response:
        sig = signal_number(body.signal if body else "SIGKILL")
        await mgr.command_kill(who, sandbox_id, cmd_id, sig)
        return Response(status_code=204)

    return r


async def _with_start(
    info: dict[str, Any], events: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    yield {"type": "start", "cmd_id": info["cmd_id"], "pid": info["pid"]}
    async for e in events:
        yield e


def signal_number(value: str | int) -> int:
    if isinstance(value, int):
        sig = value
    else:
        name = value.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        # Signals only: the module also holds SIG_IGN, SIG_DFL, SIG_BLOCK... (0, 1, 2).
        member = signals.Signals.__members__.get(name)
        if member is None:
            raise InvalidRequest(f"unknown signal {value!r}; use a name like SIGTERM or a number")
        sig = int(member)
    if not 1 <= sig <= 64:
        raise InvalidRequest(f"signal must be between 1 and 64, not {sig}")
    return sig
