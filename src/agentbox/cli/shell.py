"""`agentbox shell ID`: an interactive terminal in a sandbox, like `ssh`.

A shell starts on a terminal of its own in the sandbox (a pty command, the size of this one),
and this terminal is attached to it over the server's WebSocket
(`/v1/sandboxes/{id}/commands/{cmd_id}/terminal`): this terminal in raw mode, every key sent
as typed (^C and ^Z reach the sandbox's foreground job), its output written as it comes, a
resize here (SIGWINCH) a resize there. It ends when the shell does, with its exit status.
"""

from __future__ import annotations

import codecs
import json
import os
import select
import signal
import sys
import termios
import threading
import tty
from typing import Any

from agentbox.sdk import Sandbox
from agentbox.sdk import protocol as p

POLL_S = 0.2  # how often the key loop looks at resizes and the shell's end


def run_shell(
    conn: dict[str, Any], sandbox_id: str, cmd: str, user: str | None, cwd: str | None
) -> int:
    """Attach this terminal to a new shell in the sandbox; the shell's exit status."""
    from websockets.sync.client import connect

    fd = sys.stdin.fileno()
    cols, rows = _size(fd)
    config = p.resolve_config(conn.get("api_key"), conn.get("api_url"))
    sbx = Sandbox.connect(sandbox_id, resume=False, **conn)
    try:
        term = sbx.pty.create(cols=cols, rows=rows, cmd=cmd, user=user, cwd=cwd)
        base = config.api_url.replace("http", "ws", 1)
        url = f"{base}/v1/sandboxes/{sandbox_id}/commands/{term.cmd_id}/terminal"
        tls = p.tls_context(url) if url.startswith("wss:") else None
        with connect(
            url, additional_headers={p.API_KEY_HEADER: config.api_key}, ssl=tls, max_size=None
        ) as ws:
            return _attached(ws, fd)
    finally:
        sbx.close()


def _size(fd: int) -> tuple[int, int]:
    """This terminal's size (80x24 for one that has none set, as a fresh pty)."""
    cols, rows = os.get_terminal_size(fd)
    return cols or 80, rows or 24


def _attached(ws: Any, fd: int) -> int:
    from websockets.exceptions import ConnectionClosed

    end: dict[str, Any] = {}
    done = threading.Event()

    def output() -> None:
        try:
            for frame in ws:
                if isinstance(frame, bytes):
                    os.write(sys.stdout.fileno(), frame)
                    continue
                msg = json.loads(frame)
                if msg.get("type") == "end":
                    end.update(msg)
                    return
                note = msg.get("message") or msg.get("type")
                os.write(sys.stderr.fileno(), f"\r\n[agentbox: {note}]\r\n".encode())
        except ConnectionClosed:
            pass
        finally:
            done.set()

    resized = threading.Event()
    old_handler = signal.signal(signal.SIGWINCH, lambda *_: resized.set())
    saved = termios.tcgetattr(fd)
    reader = threading.Thread(target=output, daemon=True)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a key's bytes, whole
    try:
        tty.setraw(fd, termios.TCSANOW)  # keys typed ahead are kept, not flushed
        reader.start()
        while not done.is_set():
            if resized.is_set():
                resized.clear()
                cols, rows = _size(fd)
                ws.send(json.dumps({"resize": {"cols": cols, "rows": rows}}))
            ready, _, _ = select.select([fd], [], [], POLL_S)
            if not ready:
                continue
            data = os.read(fd, 4096)
            if not data:
                break
            text = decoder.decode(data)
            if text:
                ws.send(text.encode())
    except ConnectionClosed:
        pass
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        signal.signal(signal.SIGWINCH, old_handler)
    reader.join(5)
    if not end:
        print(
            "agentbox: the connection to the shell ended before the shell did; it may "
            "still run (agentbox exec ID -- ps)",
            file=sys.stderr,
        )
        return 255
    if end.get("exit_code") is not None:
        return int(end["exit_code"])
    return 128 + int(end["signal"]) if end.get("signal") else 1
