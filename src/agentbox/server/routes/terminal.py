"""A terminal command, live over a WebSocket (`agentbox shell`, browser terminals):
`GET /v1/sandboxes/{id}/commands/{cmd_id}/terminal` with the API key in `X-API-Key`.

Frames: the server sends the command's output as binary frames (UTF-8) and, at its end, one
text frame holding its `end` event (JSON), then closes (1000). The client sends its input as
binary frames (UTF-8: what a keyboard types), and control as text frames holding a JSON object:
`{"resize": {"cols": C, "rows": R}}`. A refused control message is answered with a text frame
`{"type": "error", "code", "message"}` and the terminal goes on. Leaving does not end the
command: attach again (`?offset=N` to skip output already seen) or kill it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import WebSocket
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketDisconnect

from agentbox.core.auth import Caller
from agentbox.core.errors import AgentboxError, InvalidRequest
from agentbox.core.manager import SandboxManager
from agentbox.server import models as m
from agentbox.server.errors import http_status

MAX_INPUT = 1 << 20  # bytes in one input frame (as a command's stdin call)
INVALID_DATA = 1007  # WebSocket close code: a frame that is not what it must be
TOO_BIG = 1009


async def attach(ws: WebSocket, sandbox_id: str, cmd_id: str) -> None:
    core = ws.app.state.core
    mgr: SandboxManager = core.manager
    try:
        who: Caller = core.auth.authenticate(ws.headers.get("x-api-key"))
        conn = ws.scope.get("agentbox.connection")
        if conn is not None:
            conn.mark_authenticated()
        offset = int(ws.query_params.get("offset", "0"))
        if offset < 0:
            raise InvalidRequest("offset must be >= 0")
        events = await mgr.command_events(who, sandbox_id, cmd_id, offset)
    except ValueError:
        await _deny(ws, InvalidRequest("offset must be a whole number"))
        return
    except AgentboxError as e:
        await _deny(ws, e)
        return
    await ws.accept()
    output = asyncio.create_task(_output(ws, events))
    typing = asyncio.create_task(_input(ws, mgr, who, sandbox_id, cmd_id))
    try:
        await asyncio.wait({output, typing}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (output, typing):
            task.cancel()
        await asyncio.gather(output, typing, return_exceptions=True)
        await events.aclose()  # type: ignore[attr-defined]
    if output.done() and not output.cancelled() and output.exception() is None:
        await _close(ws, output.result())


async def _deny(ws: WebSocket, e: AgentboxError) -> None:
    """Refuse the handshake with the API's error body (a client that cannot read it gets
    the status)."""
    body = {"code": e.code, "message": m.text(e.message), "detail": {}}
    await ws.send_denial_response(JSONResponse(status_code=http_status(e), content=body))


async def _close(ws: WebSocket, code: int) -> None:
    try:
        await ws.close(code)
    except RuntimeError:  # already closed by the other side
        pass


async def _output(ws: WebSocket, events: AsyncIterator[dict[str, Any]]) -> int:
    """The command's output to the client, then its end; the close code to end with."""
    async for ev in events:
        kind = ev.get("type")
        if kind in ("stdout", "stderr"):
            await ws.send_bytes(str(ev["data"]).encode())
        elif kind == "end":
            await ws.send_text(json.dumps(m.clean(ev)))
            return 1000
        elif kind == "error":
            await ws.send_text(json.dumps(m.clean(ev)))
            return 1011
        else:  # `truncated`: output nobody read was dropped, said as it is
            await ws.send_text(json.dumps(m.clean(ev)))
    return 1000


async def _input(ws: WebSocket, mgr: SandboxManager, who: Caller, sid: str, cmd_id: str) -> None:
    """The client's typing and resizes to the command, until it leaves."""
    while True:
        try:
            msg = await ws.receive()
        except WebSocketDisconnect:
            return
        if msg["type"] == "websocket.disconnect":
            return
        raw, text = msg.get("bytes"), msg.get("text")
        if raw is not None:
            if len(raw) > MAX_INPUT:
                await _close(ws, TOO_BIG)
                return
            try:
                data = raw.decode()
            except UnicodeDecodeError:
                await _close(ws, INVALID_DATA)  # a terminal's input is UTF-8 text
                return
            await _said(ws, mgr.command_stdin(who, sid, cmd_id, data, False))
        elif text is not None:
            await _said(ws, _control(mgr, who, sid, cmd_id, text))


async def _control(mgr: SandboxManager, who: Caller, sid: str, cmd_id: str, text: str) -> None:
    try:
        msg = json.loads(text)
    except ValueError:
        raise InvalidRequest("a text frame must be a JSON control message") from None
    size = msg.get("resize") if isinstance(msg, dict) else None
    if not isinstance(size, dict):
        raise InvalidRequest('unknown control message: send {"resize": {"cols": C, "rows": R}}')
    cols, rows = size.get("cols"), size.get("rows")
    if not (isinstance(cols, int) and isinstance(rows, int)) or isinstance(cols, bool):
        raise InvalidRequest("resize needs whole numbers cols and rows")
    await mgr.commands.command_resize(who, sid, cmd_id, cols, rows)


async def _said(ws: WebSocket, work: Any) -> None:
    """Run one input or control call; a refusal goes back to the client as a text frame."""
    try:
        await work
    except AgentboxError as e:
        await ws.send_text(json.dumps({"type": "error", "code": e.code, "message": e.message}))
