"""Sandboxes outlive the server: crash, restart, re-adopt, reap, and remove strays."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

from conftest import ServerHandle, create_sandbox, run


def _bwrap_pids_for(data_dir: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"bwrap .*{data_dir}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_crash_restart_readopts(fresh_server: ServerHandle) -> None:
    srv = fresh_server
    key = srv.make_key("crashy")
    with srv.client(key) as c:
        live = create_sandbox(c, timeout=120)["sandbox_id"]
        short = create_sandbox(c, timeout=2)["sandbox_id"]
        c.put(f"/v1/sandboxes/{live}/files", params={"path": "data.bin"}, content=b"x" * 100_000)
        r = c.post(
            f"/v1/sandboxes/{live}/commands",
            json={
                "cmd": "for i in $(seq 1 20); do echo tick$i; sleep 0.15; done",
                "background": True,
            },
        )
        cmd_id = r.json()["cmd_id"]
        time.sleep(0.4)

    srv.stop(signal.SIGKILL)
    time.sleep(2.5)  # `short` passes its deadline while no server runs
    srv.start()

    with srv.client(key) as c:
        assert c.get(f"/v1/sandboxes/{short}").json()["state"] == "expired"
        info = c.get(f"/v1/sandboxes/{live}").json()
        assert info["state"] == "running"
        # The command kept running through the crash; its whole output is retrievable.
        ev = [
            json.loads(x)
            for x in c.get(f"/v1/sandboxes/{live}/commands/{cmd_id}/events").text.splitlines()
            if x
        ]
        out = "".join(e["data"] for e in ev if e["type"] == "stdout")
        assert out == "".join(f"tick{i}\n" for i in range(1, 21))
        assert ev[-1]["exit_code"] == 0
        assert (
            c.get(f"/v1/sandboxes/{live}/files", params={"path": "data.bin"}).content
            == b"x" * 100_000
        )
        assert run(c, live, "echo still here").stdout == "still here\n"
        # TTL carries on after adoption.
        c.post(f"/v1/sandboxes/{live}/timeout", json={"timeout": 1})
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            if c.get(f"/v1/sandboxes/{live}").json()["state"] == "expired":
                break
            time.sleep(0.05)
        assert c.get(f"/v1/sandboxes/{live}").json()["state"] == "expired"
    assert not (srv.data_dir / "sandboxes" / live).exists()
    assert _bwrap_pids_for(srv.data_dir) == []


def test_strays_without_a_record_are_removed(fresh_server: ServerHandle) -> None:
    srv = fresh_server
    key = srv.make_key("stray")
    with srv.client(key) as c:
        sid = create_sandbox(c, timeout=300)["sandbox_id"]
    srv.stop(signal.SIGKILL)
    # Forget the sandbox behind the server's back: its processes are now unexplained.
    with sqlite3.connect(srv.data_dir / "agentbox.db") as db:
        db.execute("DELETE FROM sandboxes WHERE sandbox_id=?", (sid,))
    assert (srv.data_dir / "sandboxes" / sid).exists()
    srv.start()
    assert not (srv.data_dir / "sandboxes" / sid).exists()
    assert _bwrap_pids_for(srv.data_dir) == []
    cg = [p for p in Path("/sys/fs/cgroup").glob(f"*/agentbox/*/{sid}")]
    cg += [p for p in Path("/sys/fs/cgroup").glob(f"agentbox/*/{sid}")]
    assert cg == []
    with open("/proc/self/mountinfo") as f:
        assert sid not in f.read()


def test_vanished_sandbox_is_noticed(fresh_server: ServerHandle) -> None:
    srv = fresh_server
    key = srv.make_key("vanish")
    with srv.client(key) as c:
        sid = create_sandbox(c)["sandbox_id"]
        state = json.loads((srv.data_dir / "sandboxes" / sid / "runtime.json").read_text())
        os.kill(state["init_pid"], signal.SIGKILL)
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            info = c.get(f"/v1/sandboxes/{sid}").json()
            if info["state"] != "running":
                break
            time.sleep(0.1)
        assert info["state"] == "killed" and info["end_reason"] == "vanished"
    assert not (srv.data_dir / "sandboxes" / sid).exists()
