"""Control-plane crash: SIGKILL the server while sandboxes run commands, restart it, and check
that live sandboxes are re-adopted with their commands' output intact, expired ones reaped,
workspace data kept, and nothing leaked."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from _rel import (  # noqa: F401 - tier_srv is a fixture
    Background,
    RelServer,
    assert_usable_or_gone,
    private_server,
    run_ok,
    tier_srv,
)

pytestmark = pytest.mark.reliability

TICKS = 50  # background commands print one line per 0.1 s: they span the crash and restart


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[RelServer]:
    with private_server(tmp_path) as s:
        yield s


def _ts(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def _events(c: httpx.Client, sid: str, cmd_id: str, offset: int = 0) -> list[dict[str, Any]]:
    r = c.get(f"/v1/sandboxes/{sid}/commands/{cmd_id}/events", params={"offset": offset})
    assert r.status_code == 200, r.text
    return [json.loads(x) for x in r.text.splitlines() if x]


def _stdout(events: list[dict[str, Any]]) -> str:
    return "".join(e["data"] for e in events if e["type"] == "stdout")


def _ticks(tag: str) -> str:
    return "".join(f"{tag}{i}\n" for i in range(1, TICKS + 1))


def _tick_cmd(tag: str) -> str:
    return f"for i in $(seq 1 {TICKS}); do echo {tag}$i; sleep 0.1; done"


def _foreground(c: httpx.Client, sid: str, cmd: str) -> list[dict[str, Any]]:
    """Stream a foreground command until the server goes away; the events received."""
    got: list[dict[str, Any]] = []
    try:
        with c.stream(
            "POST", f"/v1/sandboxes/{sid}/commands", json={"cmd": cmd, "timeout": 0}
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    got.append(json.loads(line))
    except httpx.HTTPError:
        pass
    return got


def test_crash_readopts_live_reaps_expired_keeps_data(tier_srv: RelServer) -> None:  # noqa: F811
    """On every tier: what runs survives two server crashes, re-adopted."""
    srv = tier_srv
    blobs: dict[str, bytes] = {}
    with srv.client() as c:
        live = [c.post("/v1/sandboxes", json={"timeout": 120}).json()["sandbox_id"] for _ in (1, 2)]
        fg_sid = c.post("/v1/sandboxes", json={"timeout": 120}).json()["sandbox_id"]
        short = [c.post("/v1/sandboxes", json={"timeout": 3}).json() for _ in (1, 2)]
        # One that expires only after the restart: the reaper, not reconcile, must end it.
        later = c.post("/v1/sandboxes", json={"timeout": 25}).json()
        bg: dict[tuple[str, str], str] = {}  # (sandbox, cmd_id) -> expected stdout
        for n, sid in enumerate(live):
            blob = os.urandom(3 * 1024 * 1024 + n)
            blobs[sid] = blob
            r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": "blob.bin"}, content=blob)
            assert r.status_code == 200, r.text
            # Written from inside too, and a file still being appended to at the crash.
            run_ok(c, sid, "head -c 2000000 /dev/urandom > inside.bin; sync")
            for tag in (f"a{n}_", f"b{n}_"):
                r = c.post(
                    f"/v1/sandboxes/{sid}/commands",
                    json={"cmd": _tick_cmd(tag) + f" | tee -a {tag}.log", "background": True},
                )
                assert r.status_code == 201, r.text
                bg[(sid, r.json()["cmd_id"])] = _ticks(tag)
            # A command that is still running long after the restart.
            r = c.post(
                f"/v1/sandboxes/{sid}/commands",
                json={"cmd": "echo up; sleep 600", "background": True},
            )
            bg[(sid, r.json()["cmd_id"])] = "up\n"
        inside = {sid: run_ok(c, sid, "sha256sum inside.bin").split()[0] for sid in live}
        fg = Background(lambda: _foreground(c, fg_sid, _tick_cmd("f")))
        time.sleep(1.0)

        srv.crash()
        seen_before = fg.result()
        assert seen_before and seen_before[0]["type"] == "start", seen_before
        assert not any(e["type"] == "end" for e in seen_before), "crash came too late"
        fg_cmd = seen_before[0]["cmd_id"]
        # Both short-lived sandboxes pass their deadline while no server runs.
        time.sleep(max(0.0, max(_ts(s["end_at"]) for s in short) - time.time()) + 0.3)
        srv.restart()
        # Crash again right after re-adoption: reconciliation must be repeatable.
        srv.crash()
        srv.restart()

        for s in short:
            info = c.get(f"/v1/sandboxes/{s['sandbox_id']}").json()
            assert info["state"] == "expired" and info["end_reason"] == "timeout", info
            assert srv.inventory().about(s["sandbox_id"]) == []
        for sid in [*live, fg_sid]:
            assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"

        # Running commands carried on: their whole output, start to end, is there.
        for (sid, cmd_id), expected in bg.items():
            if expected == "up\n":
                info = c.get(f"/v1/sandboxes/{sid}/commands/{cmd_id}").json()
                assert info["running"], info
                with c.stream("GET", f"/v1/sandboxes/{sid}/commands/{cmd_id}/events") as r:
                    first = json.loads(next(r.iter_lines()))
                assert first["type"] == "stdout" and first["data"] == "up\n", first
                continue
            ev = _events(c, sid, cmd_id)
            assert _stdout(ev) == expected, (sid, cmd_id, _stdout(ev)[-200:])
            assert ev[-1]["type"] == "end" and ev[-1]["exit_code"] == 0, ev[-1]
            tag = expected.split("1\n", 1)[0]
            assert run_ok(c, sid, f"cat {tag}.log") == expected
        # The foreground command's stream broke with the server; resume where it broke.
        offset = sum(len(e["data"].encode()) for e in seen_before if e["type"] == "stdout")
        rest = _events(c, fg_sid, fg_cmd, offset)
        assert _stdout(seen_before) + _stdout(rest) == _ticks("f")
        assert _stdout(_events(c, fg_sid, fg_cmd)) == _ticks("f")
        assert rest[-1]["type"] == "end" and rest[-1]["exit_code"] == 0

        # Workspace data written before the crash is intact.
        for sid in live:
            got = c.get(f"/v1/sandboxes/{sid}/files", params={"path": "blob.bin"}).content
            assert hashlib.sha256(got).digest() == hashlib.sha256(blobs[sid]).digest()
            assert run_ok(c, sid, "sha256sum inside.bin").split()[0] == inside[sid]

        # The reaper carries on after adoption: never before the deadline, soon after it.
        deadline = _ts(later["end_at"])
        sid = later["sandbox_id"]
        assert time.time() < deadline, "the restarts took too long for this check"
        while time.time() < deadline - 0.2:
            assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
            time.sleep(0.1)
        while time.time() < deadline + 2:
            info = c.get(f"/v1/sandboxes/{sid}").json()
            if info["state"] != "running":
                break
            time.sleep(0.05)
        assert info["state"] == "expired", info
        assert deadline <= _ts(info["ended_at"]) <= deadline + 1.0, info

        # Commands that ended after the restart were audited by the re-adopted watchers.
        audit = c.get("/v1/audit", params={"action": "command.run", "limit": 1000}).json()
        audited = {e["detail"].get("cmd_id") for e in audit["events"] if e["sandbox_id"] in live}
        for sid, cmd_id in bg:
            if bg[(sid, cmd_id)] != "up\n":
                assert cmd_id in audited, (sid, cmd_id)
        expiries = c.get("/v1/audit", params={"action": "sandbox.expire"}).json()["events"]
        assert {s["sandbox_id"] for s in short} <= {e["sandbox_id"] for e in expiries}

        assert_usable_or_gone(srv)
    # private_server kills the rest and checks the host is exactly as before


def test_crash_between_attach_and_mount(srv: RelServer) -> None:
    """The server died after attaching a new sandbox's loop device but before mounting it:
    the restarted server's reconcile detaches it (an attached device does not clear itself)."""
    srv.key()
    srv.crash()
    sid = "sbx_attachednotmounted"
    sdir = srv.data_dir / "sandboxes" / sid
    sdir.mkdir(mode=0o711)
    image = sdir / "workspace.img"
    with open(image, "wb") as f:
        f.truncate(16 * 1024 * 1024)
    device = subprocess.run(
        ["losetup", "--find", "--show", str(image)], capture_output=True, text=True, check=True
    ).stdout.strip()
    with sqlite3.connect(srv.data_dir / "agentbox.db") as db:
        now = time.time()
        db.execute(
            "INSERT INTO sandboxes (sandbox_id, tenant, template, runtime, state, metadata, "
            "resources, runtime_state, keep_workspace, created_at, end_at) "
            "VALUES (?, 'rel', 'default', 'process', 'starting', '{}', '{}', NULL, 0, ?, ?)",
            (sid, now, now + 300),
        )
    assert any(device in x for x in srv.inventory().loop_devices)
    srv.restart()
    with srv.client() as c:
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "failed"
    assert srv.inventory().about(sid) == [], srv.inventory().about(sid)
