"""`agentbox exec` on its short path (agentbox.cli.quick) against a real server: it takes the
usual commands without loading the SDK, does what the full CLI does with each of them, and hands
a broken stream to the SDK, which resumes it where it broke."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agentbox import Sandbox

# Runs the short path alone and says on stderr what it answered (None: left to the full CLI)
# and whether the SDK or typer got imported.
QUICK = """import sys
from agentbox.cli import quick
status = quick.run(sys.argv[1:])
sys.stdout.flush()
sys.stderr.write(f"\\nQUICK {status} {'httpx' in sys.modules} {'typer' in sys.modules}\\n")
sys.exit(status or 0)
"""
FULL = [sys.executable, "-m", "agentbox.cli.app"]


@pytest.fixture
def env(server: Any, tenant_key: str) -> dict[str, str]:
    env = dict(os.environ, AGENTBOX_API_URL=server.url, AGENTBOX_API_KEY=tenant_key)
    env.pop("AGENTBOX_ADMIN_KEY", None)
    return env


@pytest.fixture
def sid(server: Any, tenant_key: str) -> Iterator[str]:
    sbx = Sandbox.create(api_key=tenant_key, api_url=server.url, timeout=600)
    yield sbx.sandbox_id
    sbx.kill()


def _run(argv: list[str], env: dict[str, str], stdin: bytes | None) -> tuple[int, str, str]:
    r = subprocess.run(argv, env=env, input=stdin, capture_output=True, timeout=120,
                       stdin=None if stdin is not None else subprocess.DEVNULL)
    return r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")


def _quick(args: list[str], env: dict[str, str], stdin: bytes | None = None,
           ) -> tuple[int, str, str, str]:
    """(exit status, stdout, stderr, the QUICK line)."""
    code, out, err = _run([sys.executable, "-c", QUICK, *args], env, stdin)
    err, _, marker = err.rpartition("\nQUICK ")
    return code, out, err, marker.strip()


CASES: list[tuple[list[str], bytes | None]] = [
    (["--", "true"], None),
    (["--", "echo out; echo err >&2; exit 3"], None),
    (["--", "printf", "%s|", "a b", "c'd", "$HOME"], None),
    (["--cwd", "/tmp", "-e", "A=1", "--env=B=x=y", "--user", "root", "--",
      "pwd; echo $A $B; id -u"], None),
    (["--", "kill -9 $$"], None),
    (["--timeout", "1", "--", "echo started; sleep 5"], None),
    (["--", "cat"], b"piped\nin\n"),
    (["--", "od -c"], b"a\xffb\xc3\n"),  # not UTF-8: replaced, with a warning
    (["--no-stdin", "--", "cat"], b"not sent"),
    (["--", "head -c 3; echo; cat >/dev/null"], b"x" * (3 << 20)),  # several stdin requests
    (["--", "seq 1 100000"], None),
]


@pytest.mark.parametrize("args,stdin", CASES, ids=lambda v: " ".join(v) if isinstance(v, list)
                         else None)
def test_same_as_the_full_cli(env: dict[str, str], sid: str, args: list[str],
                              stdin: bytes | None) -> None:
    code, out, err, marker = _quick(["exec", sid, *args], env, stdin)
    assert marker == f"{code} False False", (marker, err)  # taken, and neither SDK nor typer
    full = _run([*FULL, "exec", sid, *args], env, stdin)
    # rich wraps the full CLI's messages at 80 columns on a pipe; the words are the same.
    assert (code, out, " ".join(err.split())) == (full[0], full[1], " ".join(full[2].split()))


def test_what_it_leaves_to_the_full_cli(env: dict[str, str], sid: str) -> None:
    # Refused by the server: nothing ran, so the full CLI runs the line and says why.
    for args in (["exec", "sbx_nosuch", "--", "true"],
                 ["exec", sid, "--timeout", "-1", "--", "true"],
                 ["exec", sid, "--user", "nobody-here", "--", "true"]):
        code, out, err, marker = _quick(args, env)
        assert marker == "None False False", (args, marker, err)
        full = _run([sys.executable, "-m", "agentbox.cli", *args], env, None)
        assert full[0] in (1, 2) and "error" in full[2].lower() and "Traceback" not in full[2], full
    # No server there: the full CLI's message.
    down = dict(env, AGENTBOX_API_URL="http://127.0.0.1:9")
    assert _quick(["exec", sid, "--", "true"], down)[3] == "None False False"
    code, _, err = _run([sys.executable, "-m", "agentbox.cli", "exec", sid, "--", "true"], down,
                        None)
    assert code == 1 and "cannot talk to the agentbox server" in err, err


class CuttingRelay:
    """A TCP relay to the server that cuts the first command stream (the POST of a foreground
    command) once the first output event went through: a server gone mid-command. With
    `swallow`, it cuts that stream before any of the answer went through: a server gone after
    it took the request."""

    def __init__(self, upstream: tuple[str, int], swallow: bool = False) -> None:
        self.upstream = upstream
        self.swallow = swallow
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.requests: list[bytes] = []
        self.cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        server = socket.create_connection(self.upstream)
        head = client.recv(65536)
        self.requests.append(head.split(b"\r\n", 1)[0])
        server.sendall(head)
        cutting = head.startswith(b"POST ") and b"/commands HTTP/" in head and not self.cut.is_set()
        threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
        try:
            while data := server.recv(65536):
                if cutting and self.swallow:
                    self.cut.set()
                    break
                client.sendall(data)
                if cutting and b'"type":"stdout"' in data:
                    self.cut.set()
                    break
        except OSError:
            pass
        finally:
            for s in (client, server):  # shutdown: the other thread still has them in recv
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()


def test_a_broken_stream_is_resumed_by_the_sdk(server: Any, env: dict[str, str],
                                                sid: str) -> None:
    relay = CuttingRelay(("127.0.0.1", server.port))
    try:
        code, out, err, marker = _quick(
            ["exec", sid, "--", "echo first; sleep 1; echo second >&2; echo third; exit 5"],
            dict(env, AGENTBOX_API_URL=relay.url))
    finally:
        relay.close()
    assert relay.cut.is_set()
    # The SDK took over (app.continue_exec), resumed at the offset: nothing lost, none twice.
    assert marker == "5 True True", (marker, err)
    assert (out, err) == ("first\nthird\n", "second\n")
    assert any(b"/events?offset=6 " in r for r in relay.requests), relay.requests


def test_a_request_without_an_answer_is_not_sent_again(server: Any, tenant_key: str,
                                                       env: dict[str, str], sid: str) -> None:
    relay = CuttingRelay(("127.0.0.1", server.port), swallow=True)
    try:
        code, out, err, marker = _quick(["exec", sid, "--", "echo ran >> /tmp/runs"],
                                        dict(env, AGENTBOX_API_URL=relay.url))
    finally:
        relay.close()
    assert relay.cut.is_set()
    assert (code, out) == (1, "") and marker.startswith("1 True"), (marker, err)
    assert "cannot talk to the agentbox server" in err and "Traceback" not in err, err
    sbx = Sandbox.connect(sid, api_key=tenant_key, api_url=server.url)
    try:
        time.sleep(0.5)
        assert sbx.commands.run("cat /tmp/runs").stdout == "ran\n"  # once, not twice
    finally:
        sbx.close()
