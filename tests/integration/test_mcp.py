"""agentbox's MCP server driven by the official `mcp` client, against a real server: over stdio
(`agentbox mcp`) and over streamable HTTP (the server's own `/mcp`). One session, one sandbox
reused across tool calls (files, commands, code with a plot, a background server exposed on a
signed URL, downloads run in the sandbox, resources, snapshot and fork), paged output, a
blocked action reported with its rule, tool errors a model can act on, sessions owned by their
tenant and budgeted, and the sandbox ended with the session (the client leaving, its DELETE, or
an idle timeout)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ServerHandle, start_server

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(300)]
AGENTBOX = str(Path(sys.executable).parent / "agentbox")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _text(result: Any) -> str:
    return "\n".join(c.text for c in result.content if c.type == "text")


async def test_an_mcp_session_over_stdio(ci_server: ServerHandle) -> None:
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    key = ci_server.make_key(f"mcp-{time.monotonic_ns() % 10**9}")
    env = {**os.environ, "AGENTBOX_API_URL": ci_server.url, "AGENTBOX_API_KEY": key}
    params = StdioServerParameters(
        command=AGENTBOX,
        args=["mcp", "--template", "code-interpreter", "--allow", "pypi.org"],
        env=env,
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as s:
        await s.initialize()
        names = {t.name for t in (await s.list_tools()).tools}
        assert {"run_command", "command_output", "run_code", "read_file", "write_file",
                "list_files", "remove_file", "expose_port", "sandbox_info"} <= names  # fmt: skip
        schema = next(t for t in (await s.list_tools()).tools if t.name == "run_command")
        assert schema.input_schema["required"] == ["command"], schema.input_schema

        # Files and commands in one sandbox, reused.
        r = await s.call_tool("write_file", {"path": "hello.py", "content": "print(6 * 7)\n"})
        assert not r.is_error and "/workspace/hello.py" in _text(r), _text(r)
        r = await s.call_tool("run_command", {"command": "python3 hello.py"})
        assert not r.is_error and "exit code: 0" in _text(r) and "42" in _text(r), _text(r)
        r = await s.call_tool("list_files", {})
        assert "/workspace/hello.py" in _text(r), _text(r)
        r = await s.call_tool("read_file", {"path": "/workspace/hello.py"})
        assert "print(6 * 7)" in _text(r)
        info = await s.call_tool("sandbox_info", {})
        sandbox_id = next(
            line.split('"')[3] for line in _text(info).splitlines() if '"sandbox_id"' in line
        )
        assert "access_token" not in _text(info) and '"pypi.org"' in _text(info), _text(info)

        # Stateful code, and a plot as an image.
        await s.call_tool("run_code", {"code": "data = [3, 1, 2]"})
        r = await s.call_tool(
            "run_code",
            {
                "code": "import matplotlib.pyplot as plt\nplt.plot(sorted(data))\nplt.show()\n"
                "sum(data)"
            },  # fmt: skip
        )
        assert "result:\n6" in _text(r), _text(r)
        images = [c for c in r.content if c.type == "image"]
        assert images and images[0].mime_type == "image/png", r.content

        # Output past a page is paged, never cut.
        r = await s.call_tool("run_command", {"command": "seq 1 30000"})
        text = _text(r)
        assert "more characters of stdout" in text and "30000" not in text, text[-300:]
        cmd_id = text.split("command_id: ")[1].split()[0]
        offset = int(text.rsplit("offset=", 1)[1].split(")")[0])
        seen = text
        while "more characters" in text:
            r = await s.call_tool("command_output", {"command_id": cmd_id, "offset": offset})
            text = _text(r)
            seen += text
            if "offset=" in text:
                offset = int(text.rsplit("offset=", 1)[1].split(")")[0])
        assert "\n30000\n" in seen + "\n" and "exit code: 0" in text, text[-300:]

        # A background server, exposed on a signed URL anyone can open.
        r = await s.call_tool(
            "run_command",
            {"command": "cd /workspace && python3 -m http.server 8123", "background": True},
        )
        server_id = _text(r).split("command_id: ")[1].split()[0]
        url = ""
        for _ in range(40):
            r = await s.call_tool("expose_port", {"port": 8123})
            url = _text(r).strip()
            got = httpx.get(url, timeout=10)
            if got.status_code == 200:
                break
            time.sleep(0.25)
        assert got.status_code == 200 and "hello.py" in got.text, (url, got.status_code)
        for _ in range(40):  # http.server logs the request after it has answered it
            r = await s.call_tool("command_output", {"command_id": server_id, "stream": "stderr"})
            if "GET /" in _text(r):
                break
            await asyncio.sleep(0.25)
        assert "still running" in _text(r) and "GET /" in _text(r), _text(r)
        # fetch_url runs in the sandbox: its own loopback needs no egress policy.
        r = await s.call_tool(
            "fetch_url", {"url": "http://127.0.0.1:8123/hello.py", "path": "copy/hello.py"}
        )
        assert not r.is_error and "saved" in _text(r) and "/workspace/copy/hello.py" in _text(r)
        r = await s.call_tool("read_file", {"path": "copy/hello.py"})
        assert "print(6 * 7)" in _text(r), _text(r)
        r = await s.call_tool("kill_command", {"command_id": server_id})
        assert "killed" in _text(r), _text(r)

        # A blocked action says what blocked it; a failed tool says what to do.
        r = await s.call_tool("run_command", {"command": "curl -sS -m 5 https://example.com"})
        text = _text(r)
        assert "blocked:" in text and "example.com" in text and "setting: network" in text, text
        assert "allow_out" in text, text  # what to do instead
        r = await s.call_tool("fetch_url", {"url": "https://example.com/x.txt"})
        assert r.is_error and "blocked:" in _text(r) and "example.com" in _text(r), _text(r)
        r = await s.call_tool("fetch_url", {"url": "file:///etc/passwd"})
        assert r.is_error and "http" in _text(r), _text(r)
        r = await s.call_tool("read_file", {"path": "/workspace/nope.txt"})
        assert r.is_error and "nope.txt" in _text(r), _text(r)
        r = await s.call_tool("run_command", {"command": 7})
        assert r.is_error and "invalid arguments" in _text(r), _text(r)

    # The client went away: the session's sandbox is killed.
    state, via = _ended(ci_server, key, sandbox_id)
    assert state == "killed", state
    session = via.get("sandbox.create", "")
    assert session.startswith("mcp:ses_") and session.endswith("/write_file"), via
    prefix = session.rsplit("/", 1)[0]
    assert via.get("command.run") == f"{prefix}/fetch_url", via  # the newest command
    assert via.get("code.run") == f"{prefix}/run_code", via
    assert via.get("sandbox.kill", "") == "", via  # the session's end is no tool call


def _ended(server: ServerHandle, key: str, sandbox_id: str) -> tuple[str, dict[str, str]]:
    """The sandbox's state once it left running (10 s at most), and the audit's `via` of the
    newest action of each kind done to it."""
    with server.client(key) as c:
        for _ in range(50):
            state = c.get(f"/v1/sandboxes/{sandbox_id}").json()["state"]
            if state not in ("running", "stopping"):
                break
            time.sleep(0.2)
        audit = c.get("/v1/audit", params={"sandbox_id": sandbox_id}).json()["events"]
    return state, {e["action"]: (e.get("detail") or {}).get("via", "") for e in reversed(audit)}


async def test_an_mcp_session_over_http(ci_server: ServerHandle) -> None:
    """The control plane's `/mcp`, with the official client in its default (`auto`) mode: it
    probes for the sessionless protocol, is told the versions served, and falls back to the
    handshake. One session, one sandbox; the session's id is the tenant's alone; the client's
    DELETE kills the sandbox."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    tenant = f"mcp-http-{time.monotonic_ns() % 10**9}"
    key = ci_server.make_key(tenant)
    other = ci_server.make_key(tenant + "-other")
    url = f"{ci_server.url}/mcp?template=code-interpreter&idle_timeout=600&allow_out=pypi.org"
    session_ids: list[str] = []

    async def remember(response: Any) -> None:
        if sid := response.headers.get("mcp-session-id"):
            session_ids.append(sid)

    async with httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {key}"},
        timeout=httpx2.Timeout(120),
        event_hooks={"response": [remember]},
    ) as http:
        async with Client(streamable_http_client(url, http_client=http)) as client:
            assert client.protocol_version < "2026", client.protocol_version
            names = {t.name for t in (await client.list_tools()).tools}
            assert {"run_command", "run_code", "write_file", "expose_port"} <= names, names

            r = await client.call_tool("write_file", {"path": "a.py", "content": "print(2**10)"})
            assert not r.is_error, _text(r)
            r = await client.call_tool("run_command", {"command": "python3 /workspace/a.py"})
            assert "exit code: 0" in _text(r) and "1024" in _text(r), _text(r)
            listed = await client.list_resources()
            uris = {str(res.uri): res for res in listed.resources}
            assert "file:///workspace/a.py" in uris, uris
            assert uris["file:///workspace/a.py"].size == len("print(2**10)")
            got = await client.read_resource("file:///workspace/a.py")
            assert got.contents[0].text == "print(2**10)", got
            await client.call_tool(
                "write_file", {"path": "b.bin", "content": "/wD+", "base64": True}
            )
            got = await client.read_resource("file:///workspace/b.bin")
            assert got.contents[0].blob == "/wD+", got
            r = await client.call_tool(
                "run_code",
                {"code": "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()\n5 * 8"},
            )
            assert "result:\n40" in _text(r), _text(r)
            assert [c.mime_type for c in r.content if c.type == "image"] == ["image/png"]
            r = await client.call_tool(
                "run_command",
                {"command": "cd /workspace && python3 -m http.server 8124", "background": True},
            )
            for _ in range(40):
                url = _text(await client.call_tool("expose_port", {"port": 8124})).strip()
                got = httpx.get(url, timeout=10)
                if got.status_code == 200:
                    break
                await asyncio.sleep(0.25)
            assert got.status_code == 200 and "a.py" in got.text, (url, got.status_code)
            r = await client.call_tool(
                "run_command", {"command": "curl -sS -m 5 https://example.com"}
            )
            assert "blocked:" in _text(r) and "setting: network" in _text(r), _text(r)
            info = _text(await client.call_tool("sandbox_info", {}))
            assert '"pypi.org"' in info, info  # the policy the URL asked for
            sandbox_id = next(
                line.split('"')[3] for line in info.splitlines() if '"sandbox_id"' in line
            )

            # The session is its tenant's: another tenant's key finds no such session, and
            # no key gets nothing at all.
            sid = session_ids[-1]
            probe = {"jsonrpc": "2.0", "id": 9, "method": "tools/list"}
            h = {"Mcp-Session-Id": sid, "Accept": "application/json, text/event-stream"}
            with httpx.Client(base_url=ci_server.url, timeout=30) as raw:
                got = raw.post("/mcp", json=probe, headers={**h, "X-API-Key": other})
                assert got.status_code == 404, got.text
                got = raw.post("/mcp", json=probe, headers=h)
                assert got.status_code == 401 and "Bearer" in got.json()["message"], got.text
                got = raw.post("/mcp", json=probe, headers={**h, "X-API-Key": key})
                assert got.status_code == 200 and "run_code" in got.text, got.text

    # The client's DELETE ended the session, and the sandbox with it.
    state, via = _ended(ci_server, key, sandbox_id)
    assert state == "killed", state
    assert via.get("code.run", "").startswith("mcp-http:ses_"), via
    assert via["code.run"].endswith("/run_code"), via


def test_mcp_over_http_refuses_what_it_should(ci_server: ServerHandle) -> None:
    """Bad connect options and the sessionless protocol version are refused with a reason; a
    tenant's open sessions are capped."""
    key = ci_server.make_key(f"mcp-refusals-{time.monotonic_ns() % 10**9}")
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    h = {"X-API-Key": key, "Accept": "application/json, text/event-stream"}
    with httpx.Client(base_url=ci_server.url, timeout=30) as raw:
        got = raw.post("/mcp?templat=x", json=init, headers=h)
        assert got.status_code == 400 and "'templat'" in got.json()["message"], got.text
        got = raw.post("/mcp?on_end=explode", json=init, headers=h)
        assert got.status_code == 400 and "on_end" in got.json()["message"], got.text
        got = raw.post("/mcp?idle_timeout=0", json=init, headers=h)
        assert got.status_code == 400 and "idle_timeout" in got.json()["message"], got.text
        modern = {"jsonrpc": "2.0", "id": 7, "method": "server/discover", "params": {}}
        got = raw.post("/mcp", json=modern, headers={**h, "MCP-Protocol-Version": "2026-07-28"})
        body = got.json()
        assert got.status_code == 400 and body["id"] == 7, got.text
        assert body["error"]["code"] == -32022, body
        assert "2025-06-18" in body["error"]["data"]["supported"], body

        # Sessions are opened (no sandbox until a tool needs one) up to the tenant's limit.
        opened = []
        for _ in range(16):
            got = raw.post("/mcp", json=init, headers=h)
            assert got.status_code == 200, got.text
            opened.append(got.headers["mcp-session-id"])
        got = raw.post("/mcp", json=init, headers=h)
        assert got.status_code == 429 and "16 MCP sessions" in got.json()["message"], got.text
        for sid in opened:
            assert raw.delete("/mcp", headers={**h, "Mcp-Session-Id": sid}).status_code == 200
        got = raw.post("/mcp", json=init, headers=h)
        assert got.status_code == 200, got.text
        raw.delete("/mcp", headers={**h, "Mcp-Session-Id": got.headers["mcp-session-id"]})


async def test_an_mcp_session_over_http_that_idles_out_ends(tmp_path: Path) -> None:
    """A client that goes away without ending its session (no DELETE): after the server's
    MCP idle timeout the session ends, and its sandbox with it."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    handle = start_server(tmp_path, ["--mcp-idle-timeout", "2"])
    try:
        key = handle.make_key("mcp-idle")
        ids: list[str] = []

        async def remember(response: Any) -> None:
            if sid := response.headers.get("mcp-session-id"):
                ids.append(sid)

        async with httpx2.AsyncClient(
            headers={"X-API-Key": key}, timeout=60, event_hooks={"response": [remember]}
        ) as http:
            transport = streamable_http_client(
                f"{handle.url}/mcp?template=host", http_client=http, terminate_on_close=False
            )
            async with Client(transport) as client:
                r = await client.call_tool("run_command", {"command": "echo hi"})
                assert "hi" in _text(r), _text(r)
                info = _text(await client.call_tool("sandbox_info", {}))
                await client.call_tool("write_file", {"path": "mark.txt", "content": "forked"})
                r = await client.call_tool("snapshot_sandbox", {"name": "mcp-idle-snap"})
                assert "template='mcp-idle-snap'" in _text(r), _text(r)
                r = await client.call_tool("fork_sandbox", {})
                assert _text(r).startswith("forked: sbx_"), _text(r)
                fork_id = _text(r).split()[1]
        sandbox_id = next(
            line.split('"')[3] for line in info.splitlines() if '"sandbox_id"' in line
        )
        with handle.client(key) as c:  # the fork has the sandbox's files
            got = c.get(f"/v1/sandboxes/{fork_id}/files", params={"path": "/workspace/mark.txt"})
            assert got.text == "forked", got.text
        with handle.client(key) as c:
            assert c.get(f"/v1/sandboxes/{sandbox_id}").json()["state"] == "running"
        state, _ = _ended(handle, key, sandbox_id)
        assert state == "killed", state
        with handle.client(key) as c:
            assert c.get(f"/v1/sandboxes/{fork_id}").json()["state"] == "killed"
            got = c.post(
                "/mcp",
                json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                headers={
                    "Mcp-Session-Id": ids[-1],
                    "Accept": "application/json, text/event-stream",
                },
            )
            assert got.status_code == 404, got.text
    finally:
        handle.kill_all_sandboxes()
        handle.stop()
