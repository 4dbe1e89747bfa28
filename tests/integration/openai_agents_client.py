"""Run in a virtual environment with the OpenAI Agents SDK (test_integrations.py makes one) and
agentbox's source on PYTHONPATH: drive AgentboxTools' FunctionTools through the SDK's own tool
interface (no model calls). Prints `ok <step>` per step; exits non-zero on the first failure."""

from __future__ import annotations

import asyncio
import json
import os

from agents import FunctionTool
from agents.tool_context import ToolContext

from agentbox.integrations.openai_agents import AgentboxTools


async def invoke(tool: FunctionTool, arguments: dict) -> str:
    raw = json.dumps(arguments)
    ctx = ToolContext(context=None, tool_name=tool.name, tool_call_id="call_1", tool_arguments=raw)
    return str(await tool.on_invoke_tool(ctx, raw))


async def main() -> None:
    url, key = os.environ["AGENTBOX_API_URL"], os.environ["AGENTBOX_API_KEY"]
    async with AgentboxTools(api_url=url, api_key=key) as box:
        tools = {t.name: t for t in box.tools}
        assert all(isinstance(t, FunctionTool) for t in tools.values())
        assert "command" in tools["run_command"].params_json_schema["properties"]
        print("ok tools", flush=True)
        out = await invoke(tools["write_file"], {"path": "a.py", "content": "print(2 ** 5)"})
        assert "/workspace/a.py" in out, out
        out = await invoke(tools["run_command"], {"command": "python3 a.py"})
        assert "32" in out and "exit code: 0" in out, out
        out = await invoke(tools["run_code"], {"code": "import math\nmath.factorial(5)"})
        assert "result:\n120" in out, out
        print("ok session", flush=True)
        out = await invoke(tools["read_file"], {"path": "/workspace/none.txt"})
        assert out.startswith("error:") and "none.txt" in out, out
        print("ok failure", flush=True)
        print(f"sandbox {box.sandbox_id}", flush=True)


asyncio.run(main())
