"""The sandbox tools through each framework's own tool interface (no model calls): LangChain's
StructuredTools (sync and async) and the OpenAI Agents SDK's FunctionTools (in a virtual
environment of its own: it pins websockets<17), each sharing one sandbox per session, answering
a failure with text the model reads, and killing the sandbox when closed."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ServerHandle, pip_venv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_the_langchain_toolkit(ci_server: ServerHandle) -> None:
    from langchain_core.tools import BaseTool

    from agentbox.integrations.langchain import AgentboxToolkit
    from agentbox.integrations.tools import TOOLS

    key = ci_server.make_key(f"lc-{time.monotonic_ns() % 10**9}")
    with AgentboxToolkit(api_url=ci_server.url, api_key=key) as kit:
        tools = {t.name: t for t in kit.get_tools()}
        assert set(tools) == set(TOOLS) and all(isinstance(t, BaseTool) for t in tools.values())
        assert tools["run_command"].args_schema.model_json_schema() == TOOLS["run_command"].schema()

        out = tools["write_file"].invoke({"path": "n.txt", "content": "21"})
        assert "/workspace/n.txt" in out, out
        out = tools["run_command"].invoke({"command": "echo $(( $(cat n.txt) * 2 ))"})
        assert "42" in out and "exit code: 0" in out, out

        async def from_a_loop() -> str:
            await tools["run_code"].ainvoke({"code": "x = 40"})
            return await tools["run_code"].ainvoke({"code": "x + 2"})

        assert "result:\n42" in asyncio.run(from_a_loop())
        # A failure is the tool's answer (LangChain's handled ToolException), not a crash.
        out = tools["read_file"].invoke({"path": "missing.txt"})
        assert "missing.txt" in out, out
        sandbox_id = kit.sandbox_id
        assert sandbox_id is not None
    with ci_server.client(key) as c:
        assert c.get(f"/v1/sandboxes/{sandbox_id}").json()["state"] == "killed"


OPENAI_AGENTS = ["openai-agents==0.24.0", "httpx>=0.27"]
VENVS = Path("/var/tmp/agentbox-test-integrations")
SRC = Path(__file__).resolve().parents[2] / "src"


def test_the_openai_agents_tools(ci_server: ServerHandle) -> None:
    python = pip_venv(VENVS, OPENAI_AGENTS)
    key = ci_server.make_key(f"oa-{time.monotonic_ns() % 10**9}")
    env = {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "AGENTBOX_API_URL": ci_server.url,
        "AGENTBOX_API_KEY": key,
    }
    client = Path(__file__).with_name("openai_agents_client.py")
    done = subprocess.run(
        [str(python), str(client)], env=env, capture_output=True, text=True, timeout=150
    )
    steps = [line[3:] for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert done.returncode == 0 and steps == ["tools", "session", "failure"], (
        done.stdout[-2000:] + done.stderr[-3000:]
    )
    sandbox_id = done.stdout.split("sandbox ")[1].split()[0]
    with ci_server.client(key) as c:
        assert c.get(f"/v1/sandboxes/{sandbox_id}").json()["state"] == "killed"
