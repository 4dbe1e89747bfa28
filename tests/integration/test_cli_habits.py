"""The CLI as people and scripts use it: piped and narrow output, live-by-default listings,
stdin and Ctrl-C on `exec`, `--json` everywhere, defaults in `--help`, one-line errors, and
`keys` through the API. Each runs the real `agentbox` command against a real server."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbox import AsyncSandbox, Sandbox

CLI = [sys.executable, "-m", "agentbox.cli"]  # as installed: `exec` on the short path
LONG = "a-rather-long-metadata-value-that-will-not-fit-in-forty-columns"


def _env(server: Any, key: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, AGENTBOX_API_URL=server.url, AGENTBOX_API_KEY=key, **extra)
    env.pop("AGENTBOX_ADMIN_KEY", None)
    return env


def _cli(
    env: dict[str, str], *args: str, input: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], env=env, input=input, capture_output=True, text=True, timeout=timeout
    )


def _on_a_terminal(env: dict[str, str], columns: int, *args: str) -> str:
    """What the CLI prints on a terminal `columns` wide (a real pseudo-terminal)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(
        [*CLI, *args],
        env={**env, "COLUMNS": str(columns)},
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
    )
    os.close(follower)
    chunks = []
    try:
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's last writer is gone
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(leader)
        assert proc.wait(30) == 0
    return b"".join(chunks).decode()


@pytest.fixture
def env(server: Any, tenant_key: str) -> dict[str, str]:
    return _env(server, tenant_key)


@pytest.fixture
def two(server: Any, tenant_key: str) -> Iterator[list[str]]:
    """Two running sandboxes with metadata too long for a narrow table."""
    made = [
        Sandbox.create(
            metadata={"note": LONG, "n": str(i)},
            timeout=120,
            api_key=tenant_key,
            api_url=server.url,
        )
        for i in range(2)
    ]
    yield [s.sandbox_id for s in made]
    for s in made:
        s.kill()
        s.close()


def test_piped_output_is_whole_whatever_columns_says(env: dict[str, str], two: list[str]) -> None:
    # COLUMNS=40 is what a script inherits from a narrow terminal; piped, it must not matter.
    narrow = {**env, "COLUMNS": "40"}
    listing = _cli(narrow, "ls")
    assert listing.returncode == 0, listing.stderr
    for sid in two:
        line = next(x for x in listing.stdout.splitlines() if x.startswith(sid))
        assert line.split()[0] == sid and LONG in line
    assert "…" not in listing.stdout
    # Scripts cut columns: no padding at line ends.
    assert all(x == x.rstrip() for x in listing.stdout.splitlines())

    audit = _cli(narrow, "audit", "--action", "sandbox.create")
    assert audit.returncode == 0 and "…" not in audit.stdout
    assert all(sid in audit.stdout for sid in two)


def test_a_narrow_terminal_drops_or_wraps_columns_but_never_cuts_an_id(
    env: dict[str, str], two: list[str]
) -> None:
    for columns in (40, 30):
        shown = _on_a_terminal(env, columns, "ls")
        for sid in two:
            assert sid in shown, shown
        assert "…" not in shown, shown
    wide = _on_a_terminal(env, 100, "ls")
    assert all(sid in wide for sid in two) and "n=0" in wide  # metadata wraps, is not cut


def test_ls_and_list_show_live_sandboxes_unless_asked(
    server: Any, env: dict[str, str], tenant_key: str
) -> None:
    conn = {"api_key": tenant_key, "api_url": server.url}
    ended = Sandbox.create(timeout=120, **conn)
    live = Sandbox.create(timeout=120, **conn)
    try:
        ended.kill()
        shown = [s["sandbox_id"] for s in json.loads(_cli(env, "ls", "--json").stdout)]
        assert shown == [live.sandbox_id]
        every = json.loads(_cli(env, "ls", "--all", "--json").stdout)
        assert [s["sandbox_id"] for s in every] == [live.sandbox_id, ended.sandbox_id]
        killed = json.loads(_cli(env, "ls", "--state", "killed", "--json").stdout)
        assert [s["sandbox_id"] for s in killed] == [ended.sandbox_id]
        assert _cli(env, "ls", "--all", "--state", "killed").returncode == 2

        assert [s.sandbox_id for s in Sandbox.list(**conn)] == [live.sandbox_id]
        assert len(Sandbox.list(state="all", **conn)) == 2
        assert len(Sandbox.list(state=None, **conn)) == 2
        assert [s.sandbox_id for s in asyncio.run(AsyncSandbox.list(**conn))] == [live.sandbox_id]
        assert len(asyncio.run(AsyncSandbox.list(state="all", **conn))) == 2
    finally:
        live.kill()
        ended.close()
        live.close()


def test_exec_forwards_stdin(env: dict[str, str], two: list[str]) -> None:
    sid = two[0]
    r = _cli(env, "exec", sid, "--", "cat", input="hi\n")
    assert (r.returncode, r.stdout) == (0, "hi\n"), r.stderr
    # More than one request's worth, line by line, and the end of input reaches the command.
    text = "".join(f"line {i}\n" for i in range(200_000))  # 2.3 MB
    r = _cli(env, "exec", sid, "--", "wc -lc", input=text)
    assert r.stdout.split() == ["200000", str(len(text))], r.stderr
    # A command that does not read its stdin ends as usual.
    r = _cli(env, "exec", sid, "--", "echo done", input="ignored")
    assert (r.returncode, r.stdout) == (0, "done\n")
    r = _cli(env, "exec", sid, "--no-stdin", "--", "cat", input="not sent")
    assert (r.returncode, r.stdout) == (0, "")


def test_ctrl_c_ends_the_remote_command(
    server: Any, env: dict[str, str], tenant_key: str, two: list[str]
) -> None:
    sbx = Sandbox.connect(two[0], api_key=tenant_key, api_url=server.url)
    try:
        # Ignores SIGINT, and leaves a background job that would outlive a plain SIGINT.
        proc = subprocess.Popen(
            [*CLI, "exec", two[0], "--", "trap '' INT; sleep 300 & sleep 301; echo after"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        while not [c for c in sbx.commands.list() if c.running]:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 130 and "Traceback" not in err
        assert "after" not in out
        assert not [c for c in sbx.commands.list() if c.running]
        left = sbx.commands.run("pgrep -a sleep || true").stdout
        assert left == "", left
    finally:
        sbx.close()


def test_json_on_every_listing_and_info_command(
    server: Any, env: dict[str, str], two: list[str]
) -> None:
    admin = _env(server, server.admin_key)
    runs = {
        ("ls",): env,
        ("info", two[0]): env,
        ("network", two[0]): env,
        ("audit",): env,
        ("audit", "--egress"): env,
        ("template", "ls"): env,
        ("pool", "ls"): env,
        ("secrets", "ls"): env,
        ("workspaces", "ls"): env,
        ("keys", "ls"): admin,
    }
    for args, who in runs.items():
        r = _cli(who, *args, "--json")
        assert r.returncode == 0, (args, r.stderr)
        json.loads(r.stdout)
    info = json.loads(_cli(env, "info", two[0], "--json").stdout)
    assert info["sandbox_id"] == two[0] and info["metadata"]["note"] == LONG
    shown = _cli(env, "info", two[0]).stdout
    assert two[0] in shown and LONG in shown and "512 MiB memory" in shown


def test_help_shows_every_default() -> None:
    import typer.main
    from typer.core import TyperGroup, TyperOption

    from agentbox.cli.app import app

    def commands(cmd: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
        yield path, cmd
        if isinstance(cmd, TyperGroup):
            for name, sub in cmd.commands.items():
                yield from commands(sub, [*path, name])

    missing = []
    for path, cmd in commands(typer.main.get_command(app), []):
        for opt in cmd.params:
            if not isinstance(opt, TyperOption) or opt.name == "help" or opt.required:
                continue
            if opt.multiple or (opt.is_flag and not opt.secondary_opts):
                continue  # repeatable options and on-off flags: nothing is the default
            # A described default (show_default="...") or a value that is shown as is.
            described = isinstance(opt.show_default, str)
            if not described and (opt.show_default is False or opt.default is None):
                missing.append(f"{' '.join(path)} {opt.opts[0]}")
    assert not missing, missing
    r = subprocess.run(
        [*CLI, "create", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    shown = "[default: (the server's default template, base unless it says otherwise)]"
    assert shown in r.stdout, r.stdout
    assert "[default: 300]" in r.stdout


def test_user_errors_are_one_line_never_a_traceback(
    server: Any, env: dict[str, str], tmp_path: Path, two: list[str]
) -> None:
    nowhere = {**env, "AGENTBOX_API_URL": "http://127.0.0.1:9/some/long/path/to/nothing"}
    no_key = {k: v for k, v in env.items() if k != "AGENTBOX_API_KEY"}
    no_key.update(AGENTBOX_DATA_DIR=str(tmp_path / "none"), HOME=str(tmp_path))
    cases = [
        (env, ["info", "sbx_doesnotexist"], "not found"),
        (env, ["cp", str(tmp_path / "missing.txt"), f"{two[0]}:/workspace/x"], "missing.txt"),
        (env, ["cp", f"{two[0]}:/etc/hostname", str(tmp_path / "no/such/dir/x")], "no/such"),
        (env, ["create", "--memory-mb", "99999999"], "memory_mb"),
        (env, ["exec", two[0], "--timeout", "-1", "--", "true"], "timeout"),
        (nowhere, ["ls"], "127.0.0.1:9"),
        (no_key, ["ls"], "API key"),
        (_env(server, "abx_wrong_key"), ["ls"], "API key"),
    ]
    for who, args, says in cases:
        r = _cli({**who, "COLUMNS": "60"}, *args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert r.stderr.startswith("error:") and says in r.stderr, (args, r.stderr)
    bad_usage = _cli(env, "ls", "--limit", "many")
    assert bad_usage.returncode == 2 and "Traceback" not in bad_usage.stderr


def test_keys_create_through_the_api(server: Any, env: dict[str, str], tmp_path: Path) -> None:
    # No local data dir here: the key must be made by the server, not in some database.
    admin = _env(server, server.admin_key, AGENTBOX_DATA_DIR=str(tmp_path / "absent"))
    r = _cli(admin, "keys", "create", "--tenant", "remote-made")
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip()
    assert not (tmp_path / "absent").exists()
    assert Sandbox.list(api_key=key, api_url=server.url) == []  # the server knows the key

    made = json.loads(_cli(admin, "keys", "create", "--tenant", "remote-2", "--json").stdout)
    listed = json.loads(_cli(admin, "keys", "ls", "--json").stdout)
    assert made["key_id"] in {k["key_id"] for k in listed}
    assert all(k["key"] is None for k in listed)
    assert _cli(admin, "keys", "rm", made["key_id"]).returncode == 0
    with pytest.raises(Exception, match="API key"):
        Sandbox.list(api_key=made["key"], api_url=server.url)

    r = _cli(env, "keys", "create", "--tenant", "x")  # a tenant's key may not
    assert r.returncode == 1 and "admin" in r.stderr and "Traceback" not in r.stderr


def test_keys_offline_keeps_the_data_dir_private(tmp_path: Path) -> None:
    local = {k: v for k, v in os.environ.items() if not k.startswith("AGENTBOX_")}
    data_dir = tmp_path / "data"
    r = _cli(local, "keys", "create", "--tenant", "offline-t", "--data-dir", str(data_dir))
    assert r.returncode == 0, r.stderr
    assert (data_dir.stat().st_mode & 0o777) == 0o700
    # AGENTBOX_DATA_DIR names the data dir; with a database there, keys work on it offline.
    listed = _cli({**local, "AGENTBOX_DATA_DIR": str(data_dir)}, "keys", "ls", "--json")
    assert [k["tenant"] for k in json.loads(listed.stdout)] == ["offline-t"], listed.stderr
