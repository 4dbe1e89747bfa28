"""The `agentbox` command line, run as a subprocess against a real server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbox import Sandbox

Run = Callable[..., subprocess.CompletedProcess[str]]


def _cli_env(server: Any, key: str) -> dict[str, str]:
    env = dict(os.environ, AGENTBOX_API_URL=server.url, AGENTBOX_API_KEY=key, COLUMNS="200")
    env.pop("AGENTBOX_ADMIN_KEY", None)
    return env


@pytest.fixture
def cli(server: Any, tenant_key: str) -> Run:
    env = _cli_env(server, tenant_key)

    def run(*args: str, input: str | None = None, timeout: float = 60,
            **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agentbox.cli", *args], env=env,
                              input=input, capture_output=True, text=True, timeout=timeout, **kw)

    return run


@pytest.fixture
def sandbox_id(cli: Run, server: Any, tenant_key: str) -> Iterator[str]:
    r = cli("create", "--timeout", "120")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    yield sid
    Sandbox.connect(sid, api_key=tenant_key, api_url=server.url).kill()


def test_create_ls_kill(cli: Run) -> None:
    r = cli("create", "--metadata", "app=cli", "--metadata", "n=1", "--env", "X=42",
            "--memory-mb", "256", "--cpu", "0.5", "--timeout", "120", "--runtime", "process")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    assert re.fullmatch(r"sbx_\w+", sid)

    listed = json.loads(cli("ls", "--json").stdout)
    mine = next(s for s in listed if s["sandbox_id"] == sid)
    assert mine["metadata"] == {"app": "cli", "n": "1"} and mine["state"] == "running"
    assert mine["runtime"] == "process"
    assert mine["resources"]["memory_mb"] == 256 and mine["resources"]["cpu_count"] == 0.5

    table = cli("ls", "--metadata", "app=cli")
    assert table.returncode == 0 and sid in table.stdout and "running" in table.stdout
    assert sid not in cli("ls", "--metadata", "app=other").stdout

    assert cli("exec", sid, "--", "echo $X").stdout == "42\n"

    r = cli("kill", sid)
    assert r.returncode == 0 and sid in r.stdout
    assert json.loads(cli("ls", "--json", "--state", "running").stdout) == []
    killed = json.loads(cli("ls", "--json", "--state", "killed").stdout)
    assert [s["sandbox_id"] for s in killed] == [sid]


def test_pause_and_resume(cli: Run, sandbox_id: str) -> None:
    r = cli("pause", sandbox_id)
    assert r.returncode == 0 and r.stdout == f"paused {sandbox_id}\n", r.stderr
    info = json.loads(cli("info", sandbox_id, "--json").stdout)  # looking does not wake it
    assert info["state"] == "paused" and info["timeout_left"] > 60
    r = cli("exec", sandbox_id, "--", "true")
    assert r.returncode == 1 and "paused" in r.stderr and "resume" in r.stderr
    again = cli("pause", sandbox_id)
    assert again.returncode == 1 and "already paused" in again.stderr
    r = cli("resume", sandbox_id, "--timeout", "300")
    assert r.returncode == 0 and r.stdout == f"resumed {sandbox_id}\n", r.stderr
    assert json.loads(cli("info", sandbox_id, "--json").stdout)["state"] == "running"
    assert cli("exec", sandbox_id, "--", "echo back").stdout == "back\n"


def test_snapshot_and_fork(cli: Run, sandbox_id: str) -> None:
    assert cli("exec", sandbox_id, "--", "echo kept > /workspace/f").returncode == 0
    r = cli("snapshot", "create", sandbox_id, "--name", "cli-snap", "-m", "k=v")
    assert r.returncode == 0, r.stderr
    snap_id = r.stdout.strip()
    assert re.fullmatch(r"snap_\w+", snap_id)
    listed = json.loads(cli("snapshot", "ls", "--json").stdout)
    assert [(s["snapshot_id"], s["name"], s["sandbox_id"], s["metadata"]) for s in listed] == [
        (snap_id, "cli-snap", sandbox_id, {"k": "v"})]
    table = cli("snapshot", "ls").stdout
    assert snap_id in table and "cli-snap" in table and "k=v" in table

    r = cli("fork", sandbox_id, "-n", "2", "--timeout", "60")
    assert r.returncode == 0, r.stderr
    kids = r.stdout.split()
    try:
        assert len(set(kids)) == 2 and sandbox_id not in kids
        for kid in kids:
            assert cli("exec", kid, "--", "cat /workspace/f").stdout == "kept\n"
        assert f"origin:     fork of {sandbox_id}" in cli("info", kids[0]).stdout
    finally:
        cli("kill", *kids)

    r = cli("snapshot", "rm", "cli-snap")
    assert (r.returncode, r.stdout) == (0, "removed cli-snap\n"), r.stderr
    assert json.loads(cli("snapshot", "list", "--json").stdout) == []
    r = cli("snapshot", "rm", snap_id)
    assert r.returncode == 1 and r.stderr.startswith("error:") and "(not_found)" in r.stderr


def test_volumes_and_a_pause_without_memory(cli: Run) -> None:
    r = cli("volume", "create", "cli-vol", "--size-mb", "32")
    assert r.returncode == 0 and r.stdout.startswith("vol_"), r.stderr
    r = cli("create", "--volume", "/data=cli-vol", "--timeout", "60")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    try:
        assert cli("exec", sid, "--", "echo v > /data/f").returncode == 0
        assert sid in cli("volume", "ls").stdout
        assert cli("pause", "--no-memory", sid).stdout == f"paused {sid}\n"
        assert cli("resume", sid).returncode == 0
        assert cli("exec", sid, "--", "cat /data/f").stdout == "v\n"
    finally:
        cli("kill", sid)
    r = cli("volume", "rm", "cli-vol")
    assert (r.returncode, r.stdout) == (0, "removed cli-vol\n"), r.stderr


def test_exec_exit_codes_and_streams(cli: Run, sandbox_id: str) -> None:
    r = cli("exec", sandbox_id, "--", "echo out; echo err >&2; exit 3")
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")

    r = cli("exec", sandbox_id, "--cwd", "/tmp", "--env", "A=b", "--", "pwd; echo $A")
    assert (r.returncode, r.stdout) == (0, "/tmp\nb\n")

    # Several words are quoted, not re-split by the shell.
    r = cli("exec", sandbox_id, "--", "printf", "%s|", "a b", "c")
    assert r.stdout == "a b|c|"

    r = cli("exec", sandbox_id, "--", "kill -TERM $$")
    assert r.returncode == 128 + 15

    r = cli("exec", sandbox_id, "--timeout", "1", "--", "sleep 20")
    assert r.returncode == 124 and r.stderr.strip()


def test_exec_streams_live(server: Any, tenant_key: str, sandbox_id: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentbox.cli", "exec", sandbox_id, "--",
         "echo first; sleep 2; echo second"],
        env=_cli_env(server, tenant_key), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    assert proc.stdout is not None
    try:
        start = time.monotonic()
        assert proc.stdout.readline() == "first\n"
        # The first line reached us while the command was still sleeping.
        assert proc.poll() is None and time.monotonic() - start < 10
        assert proc.stdout.readline() == "second\n"
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_cp_both_directions(cli: Run, sandbox_id: str, tmp_path: Path) -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)
    src = tmp_path / "up.bin"
    src.write_bytes(payload)

    r = cli("cp", str(src), f"{sandbox_id}:/workspace/dir/up.bin")
    assert r.returncode == 0, r.stderr
    r = cli("exec", sandbox_id, "--", "stat -c %s dir/up.bin")
    assert r.stdout.strip() == str(len(payload))

    down = tmp_path / "down.bin"
    r = cli("cp", f"{sandbox_id}:dir/up.bin", str(down))
    assert r.returncode == 0, r.stderr
    assert down.read_bytes() == payload

    # Into a directory keeps the name, both ways.
    assert cli("cp", str(src), f"{sandbox_id}:/workspace/").returncode == 0
    (tmp_path / "into").mkdir()
    assert cli("cp", f"{sandbox_id}:/workspace/up.bin", str(tmp_path / "into")).returncode == 0
    assert (tmp_path / "into" / "up.bin").read_bytes() == payload

    r = cli("cp", "-", f"{sandbox_id}:from_stdin.txt", input="piped text")
    assert r.returncode == 0
    assert cli("cp", f"{sandbox_id}:from_stdin.txt", "-").stdout == "piped text"

    r = cli("cp", f"{sandbox_id}:/workspace/missing", str(tmp_path / "x"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "no such file" in r.stderr.lower() or "not found" in r.stderr.lower()
    assert cli("cp", str(src), str(tmp_path / "y")).returncode != 0


def test_errors_are_one_red_line(cli: Run, server: Any) -> None:
    r = cli("exec", "sbx_doesnotexist", "--", "true")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "not found" in r.stderr.lower() or "not_found" in r.stderr

    r = cli("kill", "sbx_doesnotexist")
    assert r.returncode == 1 and "Traceback" not in r.stderr

    bad = subprocess.run([sys.executable, "-m", "agentbox.cli", "ls"],
                         env=_cli_env(server, "abx_wrong_key"), capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "unauthorized" in bad.stderr or "API key" in bad.stderr

    down = subprocess.run([sys.executable, "-m", "agentbox.cli", "--api-url",
                           "http://127.0.0.1:9", "ls"], env=_cli_env(server, "k"),
                          capture_output=True, text=True, timeout=60)
    assert down.returncode == 1 and "Traceback" not in down.stderr
    assert "127.0.0.1:9" in down.stderr


def test_audit(cli: Run, sandbox_id: str) -> None:
    assert cli("exec", sandbox_id, "--", "echo audit-me").returncode == 0
    events = json.loads(cli("audit", "--sandbox", sandbox_id, "--json").stdout)
    actions = [e["action"] for e in events]
    assert "sandbox.create" in actions and "command.run" in actions
    assert all(e["sandbox_id"] == sandbox_id for e in events)

    only = json.loads(cli("audit", "--sandbox", sandbox_id, "--action", "command.run",
                          "--json").stdout)
    assert only and {e["action"] for e in only} == {"command.run"}
    assert only[0]["detail"]["cmd"] == "echo audit-me"

    table = cli("audit", "--sandbox", sandbox_id, "--limit", "5")
    assert table.returncode == 0 and "command.run" in table.stdout


def test_keys_create_offline(tmp_path: Path) -> None:
    data_dir = tmp_path / "offline-data"
    data_dir.mkdir()
    r = subprocess.run([sys.executable, "-m", "agentbox.cli", "keys", "create",
                        "--tenant", "offline-t", "--data-dir", str(data_dir)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip()
    assert "\n" not in key and key.startswith("abx_") and len(key) > 20  # only the key

    r = subprocess.run([sys.executable, "-m", "agentbox.cli", "keys", "create",
                        "--tenant", "bad tenant!", "--data-dir", str(data_dir)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "tenant" in r.stderr


def test_serve_refuses_an_unknown_runtime(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "agentbox.cli", "serve", "--runtime",
                        "process,nope", "--data-dir", str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "unknown runtime 'nope'" in r.stderr and "process" in r.stderr


def test_console_script_installed() -> None:
    script = Path(sys.executable).parent / "agentbox"
    if not script.exists():
        pytest.skip("console script not installed in this environment")
    r = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for command in ("serve", "create", "ls", "exec", "cp", "kill", "audit", "keys"):
        assert command in r.stdout
