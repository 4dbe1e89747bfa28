"""Commands over the HTTP API: streaming, exit codes, timeouts, background handles."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from conftest import ServerHandle, create_sandbox, run


@pytest.fixture
def sbx(server: ServerHandle, tenant_key: str) -> Iterator[tuple]:
    with server.client(tenant_key) as c:
        sid = create_sandbox(c)["sandbox_id"]
        yield c, sid
        c.delete(f"/v1/sandboxes/{sid}")


def test_output_streams_live(sbx: tuple) -> None:
    c, sid = sbx
    arrivals = []
    t0 = time.monotonic()
    with c.stream(
        "POST",
        f"/v1/sandboxes/{sid}/commands",
        json={"cmd": "for i in 1 2 3; do echo $i; sleep 0.4; done"},
    ) as r:
        for line in r.iter_lines():
            if line:
                arrivals.append((time.monotonic() - t0, json.loads(line)))
    first_out = next(t for t, e in arrivals if e["type"] == "stdout")
    end = arrivals[-1][0]
    assert arrivals[0][1]["type"] == "start"
    assert end - first_out > 0.6, "output must arrive before the command ends"


def test_exit_code_stderr_env_cwd(sbx: tuple) -> None:
    c, sid = sbx
    res = run(
        c,
        sid,
        "mkdir -p sub && cd sub && echo $FOO $PWD; echo oops >&2; exit 7",
        envs={"FOO": "bar"},
    )
    assert res.exit_code == 7
    assert res.stdout == "bar /workspace/sub\n"
    assert res.stderr == "oops\n"
    assert run(c, sid, "pwd", cwd="/workspace/sub").stdout == "/workspace/sub\n"
    r = c.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "pwd", "cwd": "/nope"})
    assert r.status_code == 404 and r.json()["code"] == "path_not_found"


def test_timeout_kills_tree_and_reports(sbx: tuple) -> None:
    c, sid = sbx
    t0 = time.monotonic()
    res = run(c, sid, "sleep 100 & setsid sleep 101 & sleep 102", timeout=1)
    assert time.monotonic() - t0 < 5
    assert res.end["timed_out"] is True
    assert res.end["violation"]["code"] == "command_timeout"
    assert res.end["violation"]["setting"] == "timeout"
    left = run(c, sid, "ps -eo args | grep -c '^sleep 10[012]' || true")
    assert left.stdout.strip() == "0"


def test_daemon_holding_stdout_does_not_block_end(sbx: tuple) -> None:
    c, sid = sbx
    t0 = time.monotonic()
    res = run(c, sid, "sleep 30 & echo started")
    assert res.exit_code == 0 and "started" in res.stdout
    assert time.monotonic() - t0 < 3


def test_background_wait_reconnect_stdin_kill(sbx: tuple) -> None:
    c, sid = sbx
    r = c.post(
        f"/v1/sandboxes/{sid}/commands",
        json={"cmd": "for i in 1 2 3 4; do echo n$i; sleep 0.2; done", "background": True},
    )
    assert r.status_code == 201
    cmd_id = r.json()["cmd_id"]
    listed = c.get(f"/v1/sandboxes/{sid}/commands").json()["commands"]
    assert cmd_id in [x["cmd_id"] for x in listed]
    time.sleep(1.2)
    # Reconnect later: everything produced meanwhile is still there, then the end.
    lines = [
        json.loads(x)
        for x in c.get(f"/v1/sandboxes/{sid}/commands/{cmd_id}/events").text.splitlines()
        if x
    ]
    out = "".join(e["data"] for e in lines if e["type"] == "stdout")
    assert out == "n1\nn2\nn3\nn4\n"
    assert lines[-1]["type"] == "end" and lines[-1]["exit_code"] == 0
    # Resume from an offset: only the rest.
    resumed = [
        json.loads(x)
        for x in c.get(
            f"/v1/sandboxes/{sid}/commands/{cmd_id}/events", params={"offset": 6}
        ).text.splitlines()
    ]
    assert "".join(e["data"] for e in resumed if e["type"] == "stdout") == "n3\nn4\n"

    r = c.post(
        f"/v1/sandboxes/{sid}/commands",
        json={"cmd": "cat", "background": True, "stdin": True, "timeout": 0},
    )
    cat_id = r.json()["cmd_id"]
    assert (
        c.post(
            f"/v1/sandboxes/{sid}/commands/{cat_id}/stdin",
            json={"data": "hello stdin\n", "eof": True},
        ).status_code
        == 204
    )
    ev = [
        json.loads(x)
        for x in c.get(f"/v1/sandboxes/{sid}/commands/{cat_id}/events").text.splitlines()
    ]
    assert "".join(e["data"] for e in ev if e["type"] == "stdout") == "hello stdin\n"

    r = c.post(
        f"/v1/sandboxes/{sid}/commands", json={"cmd": "sleep 300", "background": True, "timeout": 0}
    )
    sleep_id = r.json()["cmd_id"]
    assert (
        c.post(
            f"/v1/sandboxes/{sid}/commands/{sleep_id}/kill", json={"signal": "SIGTERM"}
        ).status_code
        == 204
    )
    ev = [
        json.loads(x)
        for x in c.get(f"/v1/sandboxes/{sid}/commands/{sleep_id}/events").text.splitlines()
    ]
    assert ev[-1]["type"] == "end" and ev[-1]["killed"] is True
    r = c.post(f"/v1/sandboxes/{sid}/commands/{sleep_id}/stdin", json={"data": "x"})
    assert r.status_code == 409 and r.json()["code"] == "conflict"
    assert c.get(f"/v1/sandboxes/{sid}/commands/nope").status_code == 404


def test_output_buffer_is_bounded(sbx: tuple) -> None:
    c, sid = sbx
    r = c.post(
        f"/v1/sandboxes/{sid}/commands",
        json={"cmd": "head -c 12000000 /dev/zero | tr '\\0' 'a'", "background": True},
    )
    cmd_id = r.json()["cmd_id"]
    time.sleep(1.5)
    ev = [
        json.loads(x)
        for x in c.get(f"/v1/sandboxes/{sid}/commands/{cmd_id}/events").text.splitlines()
    ]
    assert ev[0]["type"] == "truncated" and ev[0]["dropped"] > 0
    kept = sum(len(e["data"]) for e in ev if e["type"] == "stdout")
    assert kept <= 4 * 1024 * 1024
    assert ev[0]["dropped"] + kept == 12_000_000


def test_read_only_violation_is_explained(sbx: tuple) -> None:
    c, sid = sbx
    res = run(c, sid, "echo x > /usr/x")
    assert res.exit_code != 0
    assert res.end["violation"]["code"] == "read_only_path"


def test_audit_records_commands(server: ServerHandle, sbx: tuple) -> None:
    c, sid = sbx
    run(c, sid, "exit 3")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        events = c.get("/v1/audit", params={"sandbox_id": sid, "action": "command.run"}).json()
        done = [e for e in events["events"] if e["detail"].get("exit_code") == 3]
        if done:
            break
        time.sleep(0.05)
    assert done and done[0]["detail"]["cmd"] == "exit 3"
    assert done[0]["duration_ms"] is not None
    actions = {e["action"] for e in c.get("/v1/audit", params={"sandbox_id": sid}).json()["events"]}
    assert "sandbox.create" in actions


def test_audit_records_what_a_request_is_via(sbx: tuple) -> None:
    """X-Agentbox-Via (an MCP session's tool, say) is recorded as `via` of what it does; a
    malformed one is refused before anything runs."""
    c, sid = sbx
    body = {"cmd": "true"}
    r = c.post(f"/v1/sandboxes/{sid}/commands", json=body, headers={"X-Agentbox-Via": "x y"})
    assert r.status_code == 400 and "X-Agentbox-Via" in r.json()["message"], r.text
    via = "mcp:ses_0123/run_command"
    r = c.post(f"/v1/sandboxes/{sid}/commands", json=body, headers={"X-Agentbox-Via": via})
    assert r.status_code == 200, r.text
    deadline, seen = time.monotonic() + 5, []
    while time.monotonic() < deadline and via not in seen:
        events = c.get("/v1/audit", params={"sandbox_id": sid, "action": "command.run"}).json()
        seen = [e["detail"].get("via") for e in events["events"]]
        time.sleep(0.05)
    assert via in seen, seen


def test_audit_since_accepts_rfc3339_and_unix(sbx: tuple) -> None:
    c, sid = sbx
    iso = c.get("/v1/audit", params={"sandbox_id": sid, "since": "2020-01-01T00:00:00Z"})
    unix = c.get("/v1/audit", params={"sandbox_id": sid, "since": "1577836800"})
    assert iso.status_code == unix.status_code == 200
    assert iso.json()["events"] and iso.json()["events"] == unix.json()["events"]
    future = c.get("/v1/audit", params={"sandbox_id": sid, "since": "2999-01-01T00:00:00Z"})
    assert future.json()["events"] == []
    bad = c.get("/v1/audit", params={"since": "yesterday"})
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_request"
