"""Terminals: a command on a pty of its own, driven over the WebSocket
`/v1/sandboxes/{id}/commands/{cmd_id}/terminal` (what `agentbox shell` uses), through the SDK's
`sbx.pty`, and through `agentbox shell` itself on a real pty."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

import httpx
import pytest
from conftest import ServerHandle, create_sandbox
from websockets.exceptions import ConnectionClosedOK, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from agentbox.sdk import CommandExitException, Sandbox


def _ws_url(server: ServerHandle, sid: str, cmd_id: str, query: str = "") -> str:
    base = server.url.replace("http", "ws", 1)
    return f"{base}/v1/sandboxes/{sid}/commands/{cmd_id}/terminal{query}"


def _until(ws: ClientConnection, want: str, seen: list[str], timeout: float = 15) -> str:
    """Output frames until `want` shows (text frames are kept in `seen`)."""
    out, deadline = "", time.monotonic() + timeout
    while want not in out:
        left = deadline - time.monotonic()
        assert left > 0, f"{want!r} never came: {out!r}"
        frame = ws.recv(timeout=left)
        if isinstance(frame, bytes):
            out += frame.decode()
        else:
            seen.append(frame)
    return out


def _shell(c: httpx.Client, sid: str, cols: int = 100, rows: int = 30) -> str:
    r = c.post(
        f"/v1/sandboxes/{sid}/commands",
        json={"cmd": "exec bash -i", "background": True, "timeout": 0,
              "pty": {"cols": cols, "rows": rows}},
    )  # fmt: skip
    assert r.status_code == 201, r.text
    return str(r.json()["cmd_id"])


def test_a_terminal_over_its_websocket(server: ServerHandle, tenant_key: str) -> None:
    with server.client(tenant_key) as c:
        sid = create_sandbox(c, timeout=120)["sandbox_id"]
        cmd_id = _shell(c, sid)
        headers = {"X-API-Key": tenant_key}
        seen: list[str] = []
        with connect(_ws_url(server, sid, cmd_id), additional_headers=headers) as ws:
            ws.send(b"stty size; tty; echo hi-$((1+2))\n")
            out = _until(ws, "hi-3", seen)
            assert "30 100" in out and "/dev/pts/" in out, out
            ws.send(json.dumps({"resize": {"cols": 120, "rows": 40}}))
            ws.send(b"stty size\n")
            _until(ws, "40 120", seen)
            ws.send("not json")  # refused, said, and the terminal goes on
            ws.send(json.dumps({"resize": {"cols": 0, "rows": 40}}))
            ws.send(b"echo still-$((2*3))\n")
            _until(ws, "still-6", seen)
            errors = [json.loads(t) for t in seen]
            assert [e["code"] for e in errors] == ["invalid_request"] * 2, errors
        # Leaving does not end it: attach again, past what was already seen.
        r = c.get(f"/v1/sandboxes/{sid}/commands/{cmd_id}")
        assert r.json()["running"] is True, r.text
        with connect(_ws_url(server, sid, cmd_id), additional_headers=headers) as ws:
            ws.send(b"sleep 0.2; exit 3\n")
            frames: list[str] = []
            _until(ws, "exit", frames)
            while not frames:
                frame = ws.recv(timeout=15)
                if isinstance(frame, str):
                    frames.append(frame)
            end = json.loads(frames[-1])
            assert end["type"] == "end" and end["exit_code"] == 3, end
            with pytest.raises(ConnectionClosedOK):
                ws.recv(timeout=5)
            assert ws.close_code == 1000
        c.delete(f"/v1/sandboxes/{sid}")


def test_a_terminal_refuses_without_its_tenants_key(server: ServerHandle, tenant_key: str) -> None:
    other = server.make_key(f"term-other-{time.monotonic_ns() % 10**9}")
    with server.client(tenant_key) as c:
        sid = create_sandbox(c, timeout=60)["sandbox_id"]
        cmd_id = _shell(c, sid)
        for headers, status in (({}, 401), ({"X-API-Key": other}, 404)):
            with pytest.raises(InvalidStatus) as e:
                connect(_ws_url(server, sid, cmd_id), additional_headers=headers).close()
            assert e.value.response.status_code == status
            assert json.loads(e.value.response.body)["code"], e.value.response.body
        mine = {"X-API-Key": tenant_key}
        with pytest.raises(InvalidStatus) as e:
            connect(_ws_url(server, sid, cmd_id, "?offset=x"), additional_headers=mine)
        assert e.value.response.status_code == 400
        c.delete(f"/v1/sandboxes/{sid}")


def test_sdk_pty(server: ServerHandle, tenant_key: str) -> None:
    sbx = Sandbox.create(api_url=server.url, api_key=tenant_key, timeout=120)
    try:
        once = sbx.pty.create(cols=90, rows=20, cmd="stty size; tty").wait()
        assert "20 90" in once.stdout and "/dev/pts/" in once.stdout, once.stdout
        seen: list[str] = []
        term = sbx.pty.create(cols=90, rows=20, on_data=seen.append)
        sbx.pty.resize(term.cmd_id, cols=91, rows=21)  # done before the next line is typed
        term.send_stdin("stty size; exit 4\n")
        with pytest.raises(CommandExitException) as e:  # as for any command that fails
            term.wait()
        assert "21 91" in "".join(seen), seen
        assert e.value.exit_code == 4
    finally:
        sbx.kill()


def test_agentbox_shell_on_a_real_terminal(server: ServerHandle, tenant_key: str) -> None:
    """`agentbox shell ID` as a person runs it: its own terminal in raw mode, keys through,
    the remote exit status its own."""
    with server.client(tenant_key) as c:
        sid = create_sandbox(c, timeout=120)["sandbox_id"]
    env = {**os.environ, "AGENTBOX_API_URL": server.url, "AGENTBOX_API_KEY": tenant_key}
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI on the pty's slave side
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 111, 0, 0))
        os.execvpe(sys.executable, [sys.executable, "-m", "agentbox.cli.app", "shell", sid], env)
    out = b""
    try:

        def read_until(want: bytes, timeout: float = 30) -> None:
            nonlocal out
            deadline = time.monotonic() + timeout
            while want not in out:
                assert time.monotonic() < deadline, f"{want!r} never came: {out[-2000:]!r}"
                ready, _, _ = select.select([fd], [], [], 0.5)
                if ready:
                    out += os.read(fd, 65536)

        read_until(b"$ ")  # the remote shell's prompt: the CLI is attached
        os.write(fd, b"echo hi-$((40+2)); tty; stty size\n")
        read_until(b"hi-42")
        read_until(b"/dev/pts/")
        read_until(b"33 111")  # this terminal's size, set before the CLI started
        os.write(fd, b"exit 7\n")
        deadline = time.monotonic() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() < deadline, out[-2000:]
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    out += os.read(fd, 65536)
                except OSError:
                    pass
        assert os.waitstatus_to_exitcode(status) == 7, out[-2000:]
    finally:
        os.close(fd)
        subprocess.run(["true"])
        with server.client(tenant_key) as c:
            c.delete(f"/v1/sandboxes/{sid}")
