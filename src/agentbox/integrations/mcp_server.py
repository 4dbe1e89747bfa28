"""`agentbox mcp`: the sandbox tools (integrations/tools.py) as an MCP server over stdio, built
on the official `mcp` SDK (an optional extra: `pip install agentbox[mcp]`). The control plane
serves the same server over streamable HTTP at `/mcp` (integrations/mcp_http.py).

Over stdio, one server process is one session: its sandbox is made on the first tool call
that needs one and reused by every later call; when the client goes away (stdin closes) the
sandbox is killed, paused or kept (`--on-end`). Tool errors come back as MCP tool errors
(`isError`) whose text says what was blocked, by which setting, and what to do instead.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from typing import Any

from agentbox.integrations import tools
from agentbox.integrations.session import Session, SessionConfig

log = logging.getLogger("agentbox.mcp")
SERVER_NAME = "agentbox"


def build_server(session_of: Callable[[Any], Session]) -> Any:
    """An `mcp` low-level Server whose tools run in the session `session_of(ctx)` gives for
    a request's context (stdio: always the process's one; HTTP: the MCP session's)."""
    import mcp_types as types
    from mcp.server.lowlevel import Server

    listing = [
        types.Tool(name=t.name, description=t.description, input_schema=t.schema())
        for t in tools.TOOLS.values()
    ]

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:  # noqa: ARG001
        return types.ListToolsResult(tools=listing)

    async def call_tool(ctx: Any, params: Any) -> types.CallToolResult:
        try:
            reply = await tools.call(session_of(ctx), params.name, params.arguments)
        except tools.ToolFailed as e:
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=str(e))], is_error=True
            )
        content: list[Any] = [types.TextContent(type="text", text=reply.text())]
        content += [
            types.ImageContent(type="image", data=data, mime_type=mime)
            for mime, data in reply.images
        ]
        return types.CallToolResult(content=content)

    async def list_resources(ctx: Any, params: Any) -> types.ListResourcesResult:
        cursor = params.cursor if params is not None else None
        try:
            files, more = await tools.workspace_files(session_of(ctx), cursor)
        except tools.AgentboxError as e:
            raise _mcp_error(tools.explain(e)) from None
        resources = [
            types.Resource(
                uri=f.uri,
                name=f.path.removeprefix("/workspace/"),
                mime_type=f.mime_type,
                size=f.size,
            )  # fmt: skip
            for f in files
        ]
        return types.ListResourcesResult(resources=resources, next_cursor=more)

    async def list_templates(ctx: Any, params: Any) -> types.ListResourceTemplatesResult:  # noqa: ARG001
        workspace = types.ResourceTemplate(
            uri_template="file:///workspace/{path}",
            name="workspace file",
            description="A file of the session's sandbox, under /workspace (read whole, up to "
            "4 MiB; the read_file tool pages larger ones).",
        )
        return types.ListResourceTemplatesResult(resource_templates=[workspace])

    async def read_resource(ctx: Any, params: Any) -> types.ReadResourceResult:
        try:
            data, mime = await tools.read_resource(session_of(ctx), str(params.uri))
        except tools.ToolFailed as e:
            raise _mcp_error(str(e)) from None
        except tools.AgentboxError as e:
            raise _mcp_error(tools.explain(e)) from None
        uri = str(params.uri)
        contents: Any = (
            types.TextResourceContents(uri=uri, mime_type=mime, text=data)
            if isinstance(data, str)
            else types.BlobResourceContents(
                uri=uri, mime_type=mime, blob=base64.b64encode(data).decode()
            )
        )
        return types.ReadResourceResult(contents=[contents])

    return Server(
        SERVER_NAME,
        instructions=(
            "Tools for one Linux sandbox of your own (agentbox), kept for this session: run "
            "commands and stateful code, read and write files, expose servers. Nothing you do "
            "there reaches the host; the network is closed unless its policy allows a "
            "destination."
        ),
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_list_resources=list_resources,
        on_list_resource_templates=list_templates,
        on_read_resource=read_resource,
    )


def _mcp_error(message: str) -> Exception:
    from mcp.shared.exceptions import MCPError
    from mcp_types import INVALID_PARAMS

    return MCPError(code=INVALID_PARAMS, message=message)


async def serve_stdio(config: SessionConfig) -> None:
    """Serve one session over stdin/stdout until the client closes it, then end the session."""
    from mcp.server.stdio import stdio_server

    session = Session(config)
    server = build_server(lambda _ctx: session)
    try:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
    finally:
        try:
            await session.close()
        except Exception as e:  # noqa: BLE001 - said, and the process ends anyway
            log.warning("ending the session's sandbox %s: %s", session.sandbox_id, e)
