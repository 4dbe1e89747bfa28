"""The short path of `agentbox exec` (agentbox.cli.quick) reads a command line exactly as the
full CLI (typer) does, or leaves it to the full CLI: each line here goes through both parsers."""

from __future__ import annotations

from typing import Any

import pytest
import typer.main

from agentbox.cli import app, quick

ID = "sbx_0123"

# Lines the short path takes: (argv, what typer makes of them).
TAKEN: list[list[str]] = [
    ["exec", ID, "--", "true"],
    ["exec", ID, "--", "echo a | wc -c"],
    ["exec", ID, "--", "printf", "%s|", "a b", "-n", "--", "c"],
    ["exec", ID, "--", "--help"],
    ["exec", "--cwd", "/tmp", ID, "--", "ls"],
    ["exec", ID, "--cwd", "/tmp", "--cwd=/srv", "--", "ls"],
    ["exec", ID, "-e", "A=1", "--env", "B=x=y", "--env=C=", "--", "env"],
    ["exec", ID, "-u", "root", "--user=user", "--", "id"],
    ["exec", ID, "--timeout", "1.5", "--", "sleep 1"],
    ["exec", ID, "--timeout=0", "--stdin", "--", "cat"],
    ["exec", ID, "--no-stdin", "--", "cat"],
    ["exec", ID, "--timeout", "-1", "--", "true"],  # the server refuses it, then the full CLI
    ["exec", ID, "--cwd", "--", "--", "pwd"],  # an option's value is the next word, whatever it is
    ["--api-url", "http://127.0.0.1:9", "exec", ID, "--", "true"],
    ["--api-key=k", "--api-url=http://h:1/prefix", "exec", ID, "--", "true"],
]

# Lines it leaves to the full CLI.
LEFT: list[list[str]] = [
    [],
    ["--help"],
    ["exec"],
    ["exec", "--help"],
    ["exec", ID, "--help", "--", "true"],
    ["exec", ID],
    ["exec", ID, "--"],
    ["exec", ID, "true"],  # no `--`: typer's own rules for what is an option
    ["exec", ID, "ls", "-la"],
    ["exec", "--", ID, "true"],
    ["exec", ID, "-eA=1", "--", "env"],  # short options with the value attached
    ["exec", ID, "-e=A=1", "--", "env"],
    ["exec", ID, "--cwd", "--", "true"],  # --cwd takes `--` as its value, then no command
    ["exec", ID, "--timeout", "soon", "--", "true"],
    ["exec", ID, "--timeout", "nan", "--", "true"],
    ["exec", ID, "--timeout", "inf", "--", "true"],
    ["exec", ID, "--unknown", "--", "true"],
    ["exec", ID, "--stdin=yes", "--", "true"],
    ["exec", ID, "--cwd"],
    ["--api-url"],
    ["--api-url", "http://h:1"],
    ["--verbose", "exec", ID, "--", "true"],
    ["ls"],
    ["create", "--", "exec"],
    ["shell", ID],
]


def _typer(argv: list[str]) -> dict[str, Any]:
    """What the full CLI's parser makes of an `exec` line: global and exec parameters."""
    group = typer.main.get_command(app.app)
    ctx = group.make_context("agentbox", list(argv))
    rest = [*ctx._protected_args, *ctx.args]  # type: ignore[attr-defined]
    command = group.get_command(ctx, rest[0])  # type: ignore[attr-defined]
    assert command is not None
    sub = command.make_context(rest[0], rest[1:], parent=ctx)
    return {**ctx.params, **sub.params}


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTBOX_API_URL", raising=False)
    monkeypatch.delenv("AGENTBOX_API_KEY", raising=False)


@pytest.mark.parametrize("argv", TAKEN, ids=lambda a: " ".join(a))
def test_read_as_typer_reads_it(argv: list[str]) -> None:
    line = quick.parse(argv)
    assert line is not None
    want = _typer(argv)
    got = {"api_url": line.api_url, "api_key": line.api_key, "sandbox_id": line.sandbox_id,
           "cmd": line.cmd, "cwd": line.cwd, "env": line.env or None, "user": line.user,
           "timeout": line.timeout, "stdin": line.stdin}
    assert got == {**want, "cmd": list(want["cmd"]), "env": list(want["env"] or []) or None}


@pytest.mark.parametrize("argv", LEFT, ids=lambda a: " ".join(a) or "(nothing)")
def test_left_to_the_full_cli(argv: list[str]) -> None:
    assert quick.parse(argv) is None
    assert quick.run(argv) is None


@pytest.mark.parametrize("url", [
    "https://127.0.0.1:8686",  # TLS: the SDK's verification settings
    "HTTPS://h",
    "http://user:pass@h:1",
    "http://h:1/?q=1",
    "http://h:1/#x",
    "http://h:99999",
    "http://h:port",
    "http://",
    "http://h:1/a b",
    "http://h\r\nX-Evil: 1",
    "http://hé:1",
    "unix:///run/agentbox.sock",
])  # fmt: skip
def test_only_plain_http_servers(url: str) -> None:
    assert quick.Server.resolve(url, "key") is None
    assert quick.run(["--api-url", url, "--api-key", "k", "exec", ID, "--", "true"]) is None


def test_a_key_that_could_end_a_header_is_left_to_httpx() -> None:
    assert quick.Server.resolve("http://h:1", "k\r\nX-Evil: 1") is None
    assert quick.Server.resolve("http://h:1", "k y") is None
    assert quick.Server.resolve("http://h:1", "k-y_z.0") is not None


@pytest.mark.parametrize(("url", "address", "path"), [
    ("http://127.0.0.1:8686", ("127.0.0.1", 8686), "/v1/x"),
    ("http://localhost", ("localhost", 80), "/v1/x"),
    ("http://[::1]:9/", ("::1", 9), "/v1/x"),
    ("http://h:1/prefix/", ("h", 1), "/prefix/v1/x"),
    ("HTTP://h:1", ("h", 1), "/v1/x"),
])  # fmt: skip
def test_where_requests_go(url: str, address: tuple[str, int], path: str) -> None:
    server = quick.Server.resolve(url, "key")
    assert server is not None
    assert server.address == address and server.prefix + "/v1/x" == path


def test_ids_are_quoted_as_the_sdk_quotes_them() -> None:
    from urllib.parse import quote

    for value in ["sbx_1", "a/b", "../x", "a b?c#d%e", "é", "~._-"]:
        assert quick._quote(value) == quote(value, safe="")


def test_exit_status() -> None:
    assert quick.exit_status(0, False) == 0
    assert quick.exit_status(3, False) == 3
    assert quick.exit_status(-9, False) == 137
    assert quick.exit_status(None, False) == 1
    assert quick.exit_status(None, True) == quick.exit_status(0, True) == 124


def test_the_sdks_defaults() -> None:
    """The short path keeps its own copies of the SDK's defaults (importing them would import
    the SDK); they must not drift."""
    import inspect

    from agentbox import config
    from agentbox.sdk import protocol

    assert quick.DEFAULT_API_URL == config.DEFAULT_API_URL
    assert quick.STREAM_GRACE == protocol.STREAM_GRACE
    default = inspect.signature(protocol.resolve_config).parameters["request_timeout"].default
    assert quick.REQUEST_TIMEOUT == default
