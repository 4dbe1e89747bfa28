"""The sandbox tools as a LangChain toolkit (`pip install 'agentbox[langchain]'`).

    from agentbox.integrations.langchain import AgentboxToolkit

    with AgentboxToolkit(template="code-interpreter") as toolkit:
        tools = toolkit.get_tools()   # StructuredTools: give them to an agent
        ...

The tools are integrations/tools.py's, rendered as `StructuredTool`s (the same names,
descriptions and argument schemas the MCP server lists). They share one session, so one
sandbox, made on the first call; closing the toolkit ends it (`on_end`). They work both ways a
LangChain tool is called: `invoke` (sync) and `ainvoke`. The session lives on an event loop of
the toolkit's own, in a thread, so both reach the same sandbox from any thread or loop. A tool
that fails answers the model with what happened (LangChain's ToolException, shown to the model).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from agentbox.integrations import tools
from agentbox.integrations.session import Session, SessionConfig

T = TypeVar("T")


class _Portal:
    """An event loop in a thread of its own, where the session's sandbox client lives."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="agentbox-toolkit", daemon=True
        )
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


class AgentboxToolkit:
    """One agentbox session's tools for LangChain. Settings as `SessionConfig`'s (template,
    isolation, timeout, network, secrets, envs, on_end, sandbox_id, api_url, api_key)."""

    def __init__(self, **settings: Any) -> None:
        self.session = Session(SessionConfig(**settings), front="langchain")
        self._portal = _Portal()
        self._closed = False

    @property
    def sandbox_id(self) -> str | None:
        return self.session.sandbox_id

    def get_tools(self) -> list[Any]:
        from langchain_core.tools import StructuredTool, ToolException

        portal, session = self._portal, self.session

        def render(t: tools.Tool) -> Any:
            async def run_there(arguments: dict[str, Any]) -> str:
                try:
                    reply = await tools.call(session, t.name, arguments)
                except tools.ToolFailed as e:
                    raise ToolException(str(e)) from None
                return reply.text_only()

            def call(**arguments: Any) -> str:
                return portal.submit(run_there(arguments)).result()

            async def acall(**arguments: Any) -> str:
                return await asyncio.wrap_future(portal.submit(run_there(arguments)))

            return StructuredTool.from_function(
                func=call,
                coroutine=acall,
                name=t.name,
                description=t.description,
                args_schema=t.args,
                handle_tool_error=True,
            )

        return [render(t) for t in tools.TOOLS.values()]

    def close(self) -> None:
        """End the session (its sandbox killed, paused or kept: `on_end`) and the loop."""
        if self._closed:
            return
        self._closed = True
        try:
            self._portal.submit(self.session.close()).result(timeout=120)
        finally:
            self._portal.close()

    def __enter__(self) -> AgentboxToolkit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
