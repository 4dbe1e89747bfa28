"""Nothing a command prints is silently lost: an attached client gets all of it (the command
waits for a slow one), output nobody was attached for is dropped only past the sandbox's
buffer and then said, and a failing command's exception shows the end of its output."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbox import Sandbox
from agentbox.sdk.exceptions import CommandExitException

LINES = 2_000_000  # `seq` prints 14.8 MB: more than three times the sandbox's buffer
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def sbx(conn: dict[str, Any]) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(timeout=300, **conn)
    yield sandbox
    sandbox.kill()
    sandbox.close()


def _is_seq(text: str) -> None:
    lines = text.splitlines()
    assert len(lines) == LINES, f"{len(lines)} of {LINES} lines"
    assert lines[0] == "1" and lines[-1] == str(LINES) and lines[LINES // 2] == str(LINES // 2 + 1)


def test_the_sdk_gets_every_line(sbx: Sandbox) -> None:
    result = sbx.commands.run(f"seq 1 {LINES}", timeout=120)
    _is_seq(result.stdout)
    assert not result.truncated and result.dropped_bytes == 0
    # A slow consumer: the command waits for it instead of dropping what it has not taken.
    got: list[str] = []

    def slow(data: str) -> None:
        got.append(data)
        if len(got) % 50 == 0:
            time.sleep(0.02)

    result = sbx.commands.run(f"seq 1 {LINES}", on_stdout=slow, timeout=120)
    _is_seq("".join(got))
    assert not result.truncated

    # keep_output=False: the output goes to the callback alone; the result keeps none of it.
    got.clear()
    result = sbx.commands.run(
        f"seq 1 {LINES}", on_stdout=got.append, timeout=120, keep_output=False
    )
    _is_seq("".join(got))
    assert result.stdout == "" and result.exit_code == 0
    handle = sbx.commands.run("seq 1 3", background=True, keep_output=False)
    assert "".join(out for out, _ in handle if out) == "1\n2\n3\n"
    assert handle.wait().stdout == ""


def test_raw_http_gets_every_line_even_reading_slowly(sbx: Sandbox, conn: dict[str, Any]) -> None:
    with httpx.Client(
        base_url=conn["api_url"], headers={"X-API-Key": conn["api_key"]}, timeout=120
    ) as c:
        body = {"cmd": f"seq 1 {LINES}", "timeout": 120}
        parts: list[str] = []
        types: set[str] = set()
        with c.stream("POST", f"/v1/sandboxes/{sbx.sandbox_id}/commands", json=body) as r:
            assert r.status_code == 200
            time.sleep(2)  # the command fills the buffer and waits meanwhile
            for line in r.iter_lines():
                if line:
                    event = json.loads(line)
                    types.add(event["type"])
                    if event["type"] == "stdout":
                        parts.append(event["data"])
    assert "truncated" not in types, types
    _is_seq("".join(parts))


@pytest.mark.parametrize("entry", ["agentbox.cli", "agentbox.cli.app"])  # short path; full CLI
def test_the_cli_prints_every_line(sbx: Sandbox, conn: dict[str, Any], entry: str) -> None:
    env = {"AGENTBOX_API_URL": conn["api_url"], "AGENTBOX_API_KEY": conn["api_key"]}
    env["PATH"] = "/usr/bin:/bin"
    cli = [sys.executable, "-m", entry]
    r = subprocess.run(
        [*cli, "exec", sbx.sandbox_id, "--", "seq", "1", str(LINES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    _is_seq(r.stdout)


def test_output_nobody_followed_is_dropped_only_past_the_buffer_and_said(sbx: Sandbox) -> None:
    handle = sbx.commands.run("head -c 6291456 /dev/zero | tr '\\0' a; echo; echo tail",
                              background=True)  # fmt: skip
    deadline = time.monotonic() + 30
    while sbx.commands.get_info(handle.cmd_id).running and time.monotonic() < deadline:
        time.sleep(0.1)
    result = handle.wait()  # from offset 0: older than the buffer holds
    assert result.stdout.endswith("a\ntail\n")
    assert result.truncated and result.dropped_bytes > 0
    assert len(result.stdout) + result.dropped_bytes == 6291456 + len("\ntail\n")


def test_a_failing_command_shows_the_end_of_its_output(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("python3 -c \"[print(i) for i in range(100)]; assert 1 == 2, 'boom'\"")
    assert "AssertionError: boom" in str(e.value), str(e.value)
    # Nothing on stderr: the end of stdout, where test runners print what failed.
    script = "for i in $(seq 1 100); do echo line $i; done; echo 'FAILED test_x: 1 != 2'; exit 3"
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run(script)
    text = str(e.value)
    assert "exited with code 3" in text and "FAILED test_x: 1 != 2" in text, text
    assert "line 100" in text and "line 50" not in text, "only the last lines"


def test_unread_output_has_a_budget_across_the_sandbox(sbx: Sandbox, conn: dict[str, Any]) -> None:
    # Six background commands of 3.5 MiB each: each under the 4 MiB a command may hold, 21 MiB
    # together, over the 16 MiB a sandbox holds: the oldest commands' output goes first.
    size = 3_670_016
    handles = [
        sbx.commands.run(f"head -c {size} /dev/zero | tr '\\0' {c}", background=True)
        for c in "abcdef"
    ]
    deadline = time.monotonic() + 60
    while any(sbx.commands.get_info(h.cmd_id).running for h in handles):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    results = [h.wait() for h in handles]
    kept = [len(r.stdout) for r in results]
    assert sum(kept) <= 16 << 20, kept
    assert results[0].dropped_bytes > 0 and results[-1].dropped_bytes == 0, kept
    for r in results:
        assert len(r.stdout) + r.dropped_bytes == size
    # The raw stream says where the gap is and why.
    url = f"{conn['api_url']}/v1/sandboxes/{sbx.sandbox_id}/commands/{handles[0].cmd_id}/events"
    with httpx.Client(headers={"X-API-Key": conn["api_key"]}, timeout=60) as c:
        events = [json.loads(line) for line in c.get(url).text.splitlines()]
    gap = next(e for e in events if e["type"] == "truncated")
    assert gap["offset"] == 0 and gap["dropped"] == results[0].dropped_bytes, gap
    assert "16 MiB" in gap["message"] and "4 MiB" in gap["message"], gap
    # The CLI warns on stderr, and still prints what is left.
    env = {"AGENTBOX_API_URL": conn["api_url"], "AGENTBOX_API_KEY": conn["api_key"]}
    env["PATH"] = "/usr/bin:/bin"
    cli = [sys.executable, "-m", "agentbox.cli.app"]
    r = subprocess.run(
        [*cli, "logs", sbx.sandbox_id, handles[0].cmd_id],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert len(r.stdout) == kept[0]
    assert f"{results[0].dropped_bytes} bytes of output were dropped" in r.stderr, r.stderr
    r = subprocess.run(
        [*cli, "logs", sbx.sandbox_id, handles[-1].cmd_id],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and len(r.stdout) == size and "dropped" not in r.stderr
