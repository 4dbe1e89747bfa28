"""The sandbox tools for the OpenAI Agents SDK (`pip install openai-agents`; it pins
`websockets<17`, so it may need an environment of its own beside an agentbox server's).

    from agents import Agent
    from agentbox.integrations.openai_agents import AgentboxTools

    async with AgentboxTools(template="code-interpreter") as box:
        agent = Agent(name="coder", tools=box.tools)
        ...

The tools are integrations/tools.py's, rendered as `FunctionTool`s with the same names,
descriptions and argument schemas the MCP server lists (not in the SDK's strict mode: they
have optional arguments with defaults). They share one session, so one sandbox, made on the
first call and ended when the `AgentboxTools` closes (`on_end`). A failing tool answers the
model with what happened instead of raising.
"""

from __future__ import annotations

import json
from typing import Any

from agentbox.integrations import tools
from agentbox.integrations.session import Session, SessionConfig


class AgentboxTools:
    """One agentbox session's tools for the OpenAI Agents SDK. Settings as `SessionConfig`'s."""

    def __init__(self, **settings: Any) -> None:
        self.session = Session(SessionConfig(**settings), front="openai-agents")
        self.tools = [_function_tool(self.session, t) for t in tools.TOOLS.values()]

    @property
    def sandbox_id(self) -> str | None:
        return self.session.sandbox_id

    async def aclose(self) -> None:
        await self.session.close()

    async def __aenter__(self) -> AgentboxTools:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _function_tool(session: Session, t: tools.Tool) -> Any:
    from agents import FunctionTool

    async def on_invoke(ctx: Any, raw: str) -> str:  # noqa: ARG001
        try:
            arguments = json.loads(raw) if raw else {}
        except ValueError as e:
            return f"error: the arguments are not JSON: {e}"
        try:
            reply = await tools.call(session, t.name, arguments)
        except tools.ToolFailed as e:
            return f"error: {e}"
        return reply.text_only()

    return FunctionTool(
        name=t.name,
        description=t.description,
        params_json_schema=t.schema(),
        on_invoke_tool=on_invoke,
        strict_json_schema=False,
    )
