"""Bad input and races end cleanly: refused before anything changes, never half-done, never 5xx.

Real servers and real sandboxes; hostile trees are made from inside the sandbox with commands,
as untrusted code would make them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

try:
    from . import _http as h
except ImportError:  # tests/integration is not a package
    import _http as h

from conftest import ServerHandle, start_server


@pytest.fixture
def client(server: ServerHandle, tenant_key: str) -> Iterator[httpx.Client]:
    with server.client(tenant_key) as c:
        yield c


@pytest.fixture
def sbx(client: httpx.Client) -> Iterator[str]:
    sid = h.create(client)["sandbox_id"]
    yield sid
    h.kill(client, sid)


def _delete(c: httpx.Client, sid: str, path: str) -> httpx.Response:
    return c.delete(f"/v1/sandboxes/{sid}/files", params={"path": path})


# ---------------------------------------------------------------- file removal


@pytest.mark.parametrize("root", ["/workspace", "/workspace/", "/tmp", "/dev/shm", "/dev"])
def test_removing_a_mount_point_is_refused_before_anything_is_removed(
    client: httpx.Client, sbx: str, root: str
) -> None:
    made = h.run(client, sbx, "mkdir -p /workspace/keep /tmp/keep /dev/shm/keep && echo ok")
    assert made.ok, made
    r = _delete(client, sbx, root)
    body = h.assert_rejected(r, "permission_denied", status=403)
    assert "nothing was removed" in body["message"], body
    left = h.run(client, sbx, "ls -d /workspace/keep /tmp/keep /dev/shm/keep")
    assert left.ok, f"the refused removal emptied something: {left}"


def test_a_3000_deep_tree_is_removed(client: httpx.Client, sbx: str) -> None:
    made = h.run(
        client,
        sbx,
        "python3 -c \"import os\nfor i in range(3000):\n  os.mkdir('d'); os.chdir('d')\n"
        "open('leaf', 'w').write('x')\" && echo made",
        timeout=60,
    )
    assert made.stdout == "made\n", made
    listed = client.get(
        f"/v1/sandboxes/{sbx}/files/list", params={"path": "/workspace/d", "depth": 64}
    )
    assert listed.status_code == 200, listed.text
    assert len(listed.json()["entries"]) == 64
    r = _delete(client, sbx, "/workspace/d")
    assert r.status_code == 204, r.text
    gone = client.get(f"/v1/sandboxes/{sbx}/files/stat", params={"path": "/workspace/d"})
    h.assert_rejected(gone, "path_not_found", status=404)


def test_removal_never_follows_symlinks(client: httpx.Client, sbx: str) -> None:
    made = h.run(
        client,
        sbx,
        "mkdir -p /tmp/outside/sub && echo keep > /tmp/outside/sub/f && "
        "mkdir -p t/a/b && ln -s /tmp/outside t/a/b/link && ln -s /tmp/outside/sub t/l2 && "
        "touch t/a/f1 t/a/b/f2 && echo ok",
    )
    assert made.ok, made
    assert _delete(client, sbx, "/workspace/t").status_code == 204
    left = h.run(client, sbx, "cat /tmp/outside/sub/f; ls /workspace")
    assert left.stdout == "keep\n", left


# ---------------------------------------------------------------- wedged agents


def _fresh(tmp: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> ServerHandle:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return start_server(tmp)


def _agent_host_pid(srv: ServerHandle, sid: str) -> int:
    """The host pid of the sandbox's agent: forked from the zygote, as its state says; else
    the child of bwrap's init."""
    row = _runtime_state(srv, sid)
    if "agent_pid" in row:
        return int(row["agent_pid"])
    init = row["init_pid"]
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == init:
                return int(name)
    raise AssertionError(f"no agent under init {init}")


def _runtime_state(srv: ServerHandle, sid: str) -> dict[str, Any]:
    import sqlite3

    with sqlite3.connect(srv.data_dir / "agentbox.db") as db:
        (raw,) = db.execute(
            "SELECT runtime_state FROM sandboxes WHERE sandbox_id = ?", (sid,)
        ).fetchone()
    return json.loads(raw)


def _wait_state(c: httpx.Client, sid: str, state: str, within: float) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        info = c.get(f"/v1/sandboxes/{sid}").json()
        if info["state"] == state:
            return info
        assert time.monotonic() < deadline, f"not {state} after {within} s: {info}"
        time.sleep(0.1)


def _events(
    c: httpx.Client, sid: str, cmd: str, http_timeout: float, **extra: Any
) -> list[dict[str, Any]]:
    body = {"cmd": cmd, "timeout": 60, **extra}
    with c.stream("POST", f"/v1/sandboxes/{sid}/commands", json=body, timeout=http_timeout) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line) for line in r.iter_lines() if line.strip()]


HEALTH = {"AGENTBOX_HEALTH_INTERVAL": "0.5", "AGENTBOX_AGENT_PING_TIMEOUT": "1.5"}


def test_a_wedged_agent_is_noticed_and_in_flight_requests_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = _fresh(tmp_path, monkeypatch, **HEALTH)
    try:
        with srv.client() as c:
            sid = h.create(c)["sandbox_id"]
            # The command stops its own agent: its stream is now a request in flight to an
            # agent that will never answer.
            # (It waits first so the stream has begun: stopped before its start event is sent,
            # the same error comes as the 503 answer instead of the stream's last event.)
            t0 = time.monotonic()
            # As the sandbox's root: `user` may not signal the agent.
            events = _events(
                c,
                sid,
                "sleep 1; kill -STOP $(pgrep -f '[/].agentbox/main.py'); sleep 30",
                http_timeout=15,
                user="root",
            )
            took = time.monotonic() - t0
            errors = [e for e in events if e.get("type") == "error"]
            assert errors and errors[-1]["code"] == "sandbox_unhealthy", events
            assert "stopped answering" in errors[-1]["message"]
            assert took < 1 + 0.5 + 1.5 + 5, f"the in-flight request took {took:.1f} s to end"
            assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "unhealthy"
            listed = c.get("/v1/sandboxes", params={"state": "unhealthy"}).json()["sandboxes"]
            assert [s["sandbox_id"] for s in listed] == [sid]
            # New requests are refused at once, with the same reason.
            r = c.get(f"/v1/sandboxes/{sid}/commands", timeout=5)
            assert r.status_code == 503 and r.json()["code"] == "sandbox_unhealthy", r.text
            # The agent answers again: the sandbox is running again, and works.
            os.kill(_agent_host_pid(srv, sid), signal.SIGCONT)
            _wait_state(c, sid, "running", within=10)
            again = h.run(c, sid, "echo back")
            assert again.stdout == "back\n", again
            assert h.kill(c, sid).status_code == 204
    finally:
        srv.kill_all_sandboxes()
        srv.stop()


def test_back_pressure_from_a_slow_reader_is_not_wedged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = _fresh(tmp_path, monkeypatch, **HEALTH)
    try:
        with srv.client() as c:
            sid = h.create(c)["sandbox_id"]
            body = {"cmd": "head -c 30000000 /dev/zero | base64", "timeout": 120}
            with c.stream("POST", f"/v1/sandboxes/{sid}/commands", json=body, timeout=120) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                next(lines)  # the start event; then read nothing while the agent blocks
                deadline = time.monotonic() + 2 * (0.5 + 1.5) + 1
                while time.monotonic() < deadline:
                    assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
                    time.sleep(0.2)
                got_end = False
                for line in lines:
                    if line and json.loads(line).get("type") in ("end", "error"):
                        assert json.loads(line)["type"] == "end", line
                        got_end = True
                assert got_end
            assert h.kill(c, sid).status_code == 204
    finally:
        srv.kill_all_sandboxes()
        srv.stop()


# ---------------------------------------------------------------- creates killed while starting


def test_a_create_killed_while_starting_answers_an_error_not_201(
    server: ServerHandle, client: httpx.Client
) -> None:
    from agentbox.battery import inventory

    for _attempt in range(10):
        answer: list[httpx.Response] = []

        def create(into: list[httpx.Response]) -> None:
            into.append(client.post("/v1/sandboxes", json={"timeout": 120}))

        t = threading.Thread(target=create, args=(answer,))
        t.start()
        caught = None
        while caught is None and t.is_alive():
            starting = client.get("/v1/sandboxes", params={"state": "starting"}).json()
            caught = starting["sandboxes"][0]["sandbox_id"] if starting["sandboxes"] else None
        if caught is None:  # it started before we looked: try again
            t.join()
            h.kill(client, answer[0].json()["sandbox_id"])
            continue
        assert h.kill(client, caught).status_code == 204
        t.join()
        r = answer[0]
        info = client.get(f"/v1/sandboxes/{caught}").json()
        assert info["state"] == "killed" and info["end_reason"] == "killed", info
        assert inventory.take(server.data_dir).about(caught) == []
        if r.status_code == 201:  # the start had finished when the kill arrived: try again
            continue
        body = h.assert_rejected(r, "sandbox_not_running", status=409)
        assert "killed while it was starting" in body["message"], body
        return
    pytest.fail("never killed a sandbox while it was starting")


# ---------------------------------------------------------------- pools, one data dir


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    handle = start_server(tmp_path_factory.mktemp("pooled"), ["--warm-pool", "default=1"])
    yield handle
    handle.kill_all_sandboxes()
    handle.stop()


def _pools(srv: ServerHandle, key: str | None = None) -> dict[str, dict[str, Any]]:
    with srv.client(key) as c:
        r = c.get("/v1/pools")
        assert r.status_code == 200, r.text
        return {p["template"]: p for p in r.json()["pools"]}


def _wait_pool_ready(srv: ServerHandle, within: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        pool = _pools(srv)["host"]
        if pool["ready"] == 1 and pool["starting"] == 0:
            return pool
        assert time.monotonic() < deadline, f"the pool never filled: {pool}"
        time.sleep(0.1)


def _claim(srv: ServerHandle, key: str) -> str:
    _wait_pool_ready(srv)
    with srv.client(key) as c:
        sid = h.create(c, timeout=120)["sandbox_id"]
        events = c.get("/v1/audit", params={"sandbox_id": sid, "action": "sandbox.create"})
    assert events.json()["events"][0]["detail"]["pool"] == "hit", events.text
    return sid


def test_pool_stats_show_each_tenant_only_its_own_hits(pooled: ServerHandle) -> None:
    mine, other = pooled.make_key("pool-mine"), pooled.make_key("pool-other")
    before = _pools(pooled)["host"]
    sid = _claim(pooled, mine)
    admin = _pools(pooled)["host"]
    assert admin["hits"] == before["hits"] + 1
    assert _pools(pooled, mine)["host"]["hits"] == 1
    seen_by_other = _pools(pooled, other)["host"]
    assert seen_by_other["hits"] == 0 and seen_by_other["misses"] == 0, seen_by_other
    assert seen_by_other["size"] == 1 and seen_by_other["last_error"] is None
    with pooled.client(mine) as c:
        h.kill(c, sid)


def test_a_claimed_members_warm_up_command_is_not_listed(pooled: ServerHandle) -> None:
    key = pooled.make_key("pool-cmds")
    sid = _claim(pooled, key)
    with pooled.client(key) as c:
        listed = c.get(f"/v1/sandboxes/{sid}/commands").json()["commands"]
        assert listed == [], listed
        ran = h.run(c, sid, "echo mine")
        listed = c.get(f"/v1/sandboxes/{sid}/commands").json()["commands"]
        assert [x["cmd_id"] for x in listed] == [ran.start["cmd_id"]]
        h.kill(c, sid)


def test_a_second_server_on_the_same_data_dir_touches_nothing(pooled: ServerHandle) -> None:
    assert pooled.proc is not None
    _wait_pool_ready(pooled)
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentbox.cli.app",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(pooled.port + 1),
            "--data-dir",
            str(pooled.data_dir),
        ],
        env=dict(os.environ, AGENTBOX_ADMIN_KEY=pooled.admin_key),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode != 0, second.stderr
    assert f"the data dir {pooled.data_dir.resolve()} is in use" in second.stderr, second.stderr
    assert f"pid {pooled.proc.pid}" in second.stderr, second.stderr
    assert "reconciled" not in second.stderr, second.stderr
    # The first server's pool member lived through it: claimed, it works.
    key = pooled.make_key("pool-after")
    sid = _claim(pooled, key)
    with pooled.client(key) as c:
        assert h.run(c, sid, "echo alive").stdout == "alive\n"
        h.kill(c, sid)


# ---------------------------------------------------------------- code interpreter


@pytest.mark.slow  # needs the code-interpreter template (built once per machine)
def test_a_malformed_display_keeps_the_cell_and_its_output(ci_server: ServerHandle) -> None:
    key = ci_server.make_key(f"display-{time.monotonic_ns() % 10**8}")
    with ci_server.client(key) as c:
        sid = h.create(c, template="code-interpreter", timeout=300)["sandbox_id"]
        try:
            code = (
                "print('before')\n"
                "k = get_ipython().kernel\n"
                "k.session.send(k.iopub_socket, 'display_data', {'data': 5, 'metadata': {}},\n"
                "               parent=k.get_parent())\n"
                "from IPython.display import display\n"
                "display({'text/plain': 'ok', 'image/png': 12345}, raw=True)\n"
                "print('after')"
            )
            r = c.post(f"/v1/sandboxes/{sid}/code/execute", json={"code": code}, timeout=120)
            assert r.status_code == 200, r.text
            events = [json.loads(line) for line in r.text.splitlines() if line.strip()]
            assert events[-1]["type"] == "end", events
            out = "".join(e["text"] for e in events if e["type"] == "stdout")
            assert out == "before\nafter\n", events
            results = [e["result"] for e in events if e["type"] == "result"]
            assert results == [{"text": "ok", "is_main_result": False}], events
        finally:
            h.kill(c, sid)


@pytest.mark.slow  # needs the code-interpreter template (built once per machine)
def test_a_kill_stops_a_slow_start_and_the_create_says_so(ci_server: ServerHandle) -> None:
    """A cold code-interpreter create starts a kernel before it is running: seconds in which
    a kill must end it, promptly, and the create must not answer 201."""
    key = ci_server.make_key(f"slowstart-{time.monotonic_ns() % 10**8}")
    body = {"template": "code-interpreter", "resources": {"memory_mb": 1024}, "timeout": 120}
    with ci_server.client(key) as c:
        answer: list[httpx.Response] = []
        t = threading.Thread(target=lambda: answer.append(c.post("/v1/sandboxes", json=body)))
        t.start()
        caught = None
        while caught is None and t.is_alive():
            starting = c.get("/v1/sandboxes", params={"state": "starting"}).json()["sandboxes"]
            caught = starting[0]["sandbox_id"] if starting else None
        assert caught is not None, "the create finished before it was seen starting"
        t0 = time.monotonic()
        assert h.kill(c, caught).status_code == 204
        assert time.monotonic() - t0 < 5, "the kill waited for the whole start"
        t.join()
        err = h.assert_rejected(answer[0], "sandbox_not_running", status=409)
        assert "killed while it was starting" in err["message"], err
        info = c.get(f"/v1/sandboxes/{caught}").json()
        assert info["state"] == "killed" and info["end_reason"] == "killed", info
