"""Pause and resume with memory kept: a paused sandbox's processes are frozen (no CPU, nothing
runs) and its timeout clock stops; commands, files and ports answer `paused` with what to do;
resume (or `Sandbox.connect`, as E2B's) thaws it with the time it had left, every process and
file as it was, also after a server restart and over many cycles; a paused sandbox can be
killed, and ends when its retention runs out.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ServerHandle, create_sandbox, run, start_server

from agentbox.sdk import Sandbox
from agentbox.sdk.exceptions import ConflictError

pytestmark = pytest.mark.timeout(120)

# A process that counts in a file every 20 ms: frozen, it stops counting.
COUNTER = "nohup sh -c 'while true; do echo x >> /tmp/ticks; sleep 0.02; done' >/dev/null 2>&1 &"


class Background:
    """A call run in a thread: `result()` waits for it and gives its value or raises."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._out: list[Any] = []
        self._thread = threading.Thread(target=lambda: self._out.append(self._call(fn)))
        self._thread.start()

    @staticmethod
    def _call(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - handed back by result()
            return e

    def result(self) -> Any:
        self._thread.join()
        if isinstance(self._out[0], Exception):
            raise self._out[0]
        return self._out[0]


def _ticks(c: httpx.Client, sid: str) -> int:
    return int(run(c, sid, "wc -l < /tmp/ticks").stdout)


@pytest.fixture
def client(server: ServerHandle) -> Iterator[httpx.Client]:
    with server.client(server.make_key(f"pause-{time.monotonic_ns()}")) as c:
        yield c


def test_pause_freezes_and_resume_thaws(client: httpx.Client) -> None:
    c = client
    sid = create_sandbox(c, timeout=60)["sandbox_id"]
    run(c, sid, f"echo kept > /workspace/note; {COUNTER}")
    time.sleep(0.3)
    r = c.post(f"/v1/sandboxes/{sid}/pause", json={"keep_memory": True})
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["state"] == "paused" and info["paused_at"]
    assert 50 < info["timeout_left"] <= 60
    assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"
    listed = c.get("/v1/sandboxes", params={"state": "paused"}).json()["sandboxes"]
    assert [s["sandbox_id"] for s in listed] == [sid]

    # Nothing is served while paused, and the answer says what to do.
    for req in (
        c.build_request("POST", f"/v1/sandboxes/{sid}/commands", json={"cmd": "true"}),
        c.build_request("GET", f"/v1/sandboxes/{sid}/files", params={"path": "note"}),
        c.build_request("POST", f"/v1/sandboxes/{sid}/timeout", json={"timeout": 30}),
    ):
        r = c.send(req)
        assert r.status_code == 409, (req.url, r.text)
        assert r.json()["code"] == "sandbox_not_running" and "resume" in r.json()["message"]
    again = c.post(f"/v1/sandboxes/{sid}/pause")
    assert again.status_code == 409 and "already paused" in again.json()["message"]

    time.sleep(1.0)  # frozen: the counter does not count
    r = c.post(f"/v1/sandboxes/{sid}/resume")
    assert r.status_code == 200 and r.json()["state"] == "running"
    assert r.json()["paused_at"] is None and r.json()["timeout_left"] is None
    first = _ticks(c, sid)
    time.sleep(0.5)
    second = _ticks(c, sid)
    assert second - first >= 10  # counting again (25 a second when running)
    assert run(c, sid, "cat /workspace/note").stdout == "kept\n"
    # A resume of a running sandbox changes nothing.
    assert c.post(f"/v1/sandboxes/{sid}/resume").json()["state"] == "running"
    assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204


def test_no_cpu_while_paused(client: httpx.Client) -> None:
    """The frozen counter made no progress: a tick count read just before the pause and just
    after the resume differ by what runs between the reads, not by the paused second."""
    c = client
    sid = create_sandbox(c, timeout=60)["sandbox_id"]
    run(c, sid, COUNTER)
    time.sleep(0.3)
    before = _ticks(c, sid)
    c.post(f"/v1/sandboxes/{sid}/pause").raise_for_status()
    time.sleep(2.0)  # 100 ticks if it ran
    c.post(f"/v1/sandboxes/{sid}/resume").raise_for_status()
    after = _ticks(c, sid)
    assert after - before < 40, (before, after)
    c.delete(f"/v1/sandboxes/{sid}")


def test_the_timeout_stops_while_paused(client: httpx.Client) -> None:
    c = client
    sid = create_sandbox(c, timeout=3)["sandbox_id"]
    c.post(f"/v1/sandboxes/{sid}/pause").raise_for_status()
    time.sleep(4)  # past its timeout, had it been running
    info = c.get(f"/v1/sandboxes/{sid}").json()
    assert info["state"] == "paused"
    r = c.post(f"/v1/sandboxes/{sid}/resume")
    assert r.json()["state"] == "running"
    assert run(c, sid, "echo alive").stdout == "alive\n"
    # The time it had left carries on: it expires within it.
    deadline = time.time() + 10
    while c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running":
        assert time.time() < deadline, "the resumed sandbox never expired"
        time.sleep(0.2)
    info = c.get(f"/v1/sandboxes/{sid}").json()
    assert (info["state"], info["end_reason"]) == ("expired", "timeout")


def test_resume_with_a_timeout_extends_never_shortens(client: httpx.Client) -> None:
    c = client
    sid = create_sandbox(c, timeout=100)["sandbox_id"]
    c.post(f"/v1/sandboxes/{sid}/pause").raise_for_status()
    r = c.post(f"/v1/sandboxes/{sid}/resume", json={"timeout": 5})
    left = _left(r.json())
    assert 90 < left <= 100  # the 5 s asked for is shorter: the time it had stays
    c.post(f"/v1/sandboxes/{sid}/pause").raise_for_status()
    r = c.post(f"/v1/sandboxes/{sid}/resume", json={"timeout": 500})
    assert 490 < _left(r.json()) <= 500
    bad = c.post(f"/v1/sandboxes/{sid}/resume", json={"timeout": -1})
    assert bad.status_code == 422
    c.delete(f"/v1/sandboxes/{sid}")


def _left(info: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(info["end_at"].replace("Z", "+00:00")).timestamp() - time.time()


def test_kill_while_paused(client: httpx.Client, server: ServerHandle) -> None:
    c = client
    sid = create_sandbox(c, timeout=60)["sandbox_id"]
    run(c, sid, COUNTER)
    c.post(f"/v1/sandboxes/{sid}/pause").raise_for_status()
    assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
    info = c.get(f"/v1/sandboxes/{sid}").json()
    assert (info["state"], info["end_reason"]) == ("killed", "killed")
    assert not list(Path("/sys/fs/cgroup").glob(f"*/agentbox/*/{sid}"))  # nothing left frozen
    assert c.post(f"/v1/sandboxes/{sid}/resume").status_code == 409


BOOT_ID = "cat /proc/sys/kernel/random/boot_id"


def test_pause_without_memory(client: httpx.Client, server: ServerHandle) -> None:
    """keep_memory=false: its processes end and everything it held on the host goes but its
    disk; a resume boots it fresh on that disk (same files, a new boot, the time it had left),
    and a kill then removes the disk too."""
    c = client
    sid = create_sandbox(c, timeout=60)["sandbox_id"]
    run(c, sid, f"echo kept > /workspace/note; {COUNTER}")
    boot = run(c, sid, BOOT_ID).stdout
    r = c.post(f"/v1/sandboxes/{sid}/pause", json={"keep_memory": False})
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "paused" and 50 < r.json()["timeout_left"] <= 60
    # Nothing of it runs or is mounted; its image stays.
    assert not list(Path("/sys/fs/cgroup").glob(f"*/agentbox/*/{sid}"))
    assert sid not in Path("/proc/self/mountinfo").read_text()
    assert list(server.data_dir.glob(f"sandboxes/{sid}/workspace.img"))
    r = c.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "true"})
    assert r.status_code == 409 and "resume" in r.json()["message"]
    assert c.post(f"/v1/sandboxes/{sid}/pause", json={"keep_memory": False}).status_code == 409
    # A snapshot and a fork of it work as of a frozen one.
    kids = c.post(f"/v1/sandboxes/{sid}/fork").json()["sandboxes"]
    assert run(c, kids[0]["sandbox_id"], "cat /workspace/note").stdout == "kept\n"
    c.delete(f"/v1/sandboxes/{kids[0]['sandbox_id']}")

    r = c.post(f"/v1/sandboxes/{sid}/resume")
    assert r.status_code == 200 and r.json()["state"] == "running", r.text
    end_at = datetime.fromisoformat(r.json()["end_at"].replace("Z", "+00:00")).timestamp()
    assert 45 < end_at - time.time() <= 60 and r.json()["timeout_left"] is None
    assert run(c, sid, "cat /workspace/note").stdout == "kept\n"
    time.sleep(0.2)  # a fresh boot: its /tmp is new, and no counter counts there
    assert run(c, sid, "cat /tmp/ticks 2>/dev/null | wc -l").stdout == "0\n"
    assert run(c, sid, BOOT_ID).stdout != boot
    assert run(c, sid, "echo more >> /workspace/note").exit_code == 0

    # Parked again, then killed: nothing of it is left.
    c.post(f"/v1/sandboxes/{sid}/pause", json={"keep_memory": False}).raise_for_status()
    assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
    assert not list(server.data_dir.glob(f"sandboxes/{sid}"))
    actions = [e["action"] for e in c.get("/v1/audit", params={"sandbox_id": sid}).json()["events"]]
    assert actions.count("sandbox.pause") == 2 and actions.count("sandbox.resume") == 1


def test_a_parked_disk_still_attached_is_neither_copied_nor_mounted(
    client: httpx.Client, server: ServerHandle
) -> None:
    """A parked sandbox's image held by a loop device (a leftover, a reader): a snapshot of it
    and a resume on it are refused, saying why, as a second mount of the image (or a copy
    under a writer) would corrupt it; the sandbox stays parked, and resumes once it is let go."""
    c = client
    sid = create_sandbox(c, timeout=60)["sandbox_id"]
    run(c, sid, "echo kept > /workspace/note")
    c.post(f"/v1/sandboxes/{sid}/pause", json={"keep_memory": False}).raise_for_status()
    image = server.data_dir / "sandboxes" / sid / "workspace.img"
    attach = ["losetup", "--read-only", "--find", "--show", str(image)]
    device = subprocess.run(attach, capture_output=True, text=True, check=True).stdout.strip()
    try:
        r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={})
        assert r.status_code == 503 and "still attached" in r.json()["message"], r.text
        r = c.post(f"/v1/sandboxes/{sid}/resume")
        assert r.status_code == 503 and "still attached" in r.json()["message"], r.text
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"
    finally:
        # (The failed resume's clean-up may have detached it already: it detaches what holds
        # the image of a start cut short.)
        subprocess.run(["losetup", "-d", device], capture_output=True)
    r = c.post(f"/v1/sandboxes/{sid}/resume")
    assert r.status_code == 200, r.text
    assert run(c, sid, "cat /workspace/note").stdout == "kept\n"
    assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204


def test_without_memory_through_a_restart(fresh_server: ServerHandle) -> None:
    """A server restarted while a sandbox is paused without memory keeps it so; one that
    crashed while such a sandbox was resuming pauses it again, its disk whole."""
    srv = fresh_server
    key = srv.make_key("park-restart")
    with srv.client(key) as c:
        a = create_sandbox(c, timeout=60)["sandbox_id"]
        b = create_sandbox(c, timeout=60)["sandbox_id"]
        for sid in (a, b):
            run(c, sid, f"echo {sid} > /workspace/me")
            c.post(f"/v1/sandboxes/{sid}/pause", json={"keep_memory": False}).raise_for_status()
        resuming = Background(lambda: c.post(f"/v1/sandboxes/{b}/resume"))
        time.sleep(0.03)
        srv.stop(signal.SIGKILL)
        with contextlib.suppress(httpx.HTTPError):
            resuming.result()
    srv.start()
    with srv.client(key) as c:
        for sid in (a, b):
            state = c.get(f"/v1/sandboxes/{sid}").json()["state"]
            if state == "paused":
                c.post(f"/v1/sandboxes/{sid}/resume").raise_for_status()
            assert run(c, sid, "cat /workspace/me").stdout == f"{sid}\n"
            c.delete(f"/v1/sandboxes/{sid}")


def test_sdk_pause_resume_and_connect(server: ServerHandle) -> None:
    key = server.make_key(f"pause-sdk-{time.monotonic_ns()}")
    conn = {"api_key": key, "api_url": server.url}
    with Sandbox.create(timeout=60, **conn) as sbx:
        sbx.commands.run("echo 1 > /workspace/n")
        assert sbx.pause(keep_memory=False).state == "paused"
        assert sbx.resume().state == "running"
        assert sbx.commands.run("cat /workspace/n").stdout == "1\n"
        assert sbx.pause().state == "paused"
        with pytest.raises(ConflictError):
            sbx.pause()
        with pytest.raises(ConflictError, match="resume"):
            sbx.commands.run("true")
        # connect(resume=False) attaches to it paused; connect() resumes it, as E2B's does.
        attached = Sandbox.connect(sbx.sandbox_id, resume=False, **conn)
        assert attached.get_info().state == "paused"
        attached.close()
        again = Sandbox.connect(sbx.sandbox_id, **conn)
        assert again.get_info().state == "running"
        assert again.commands.run("cat /workspace/n").stdout == "1\n"
        again.pause()
        assert again.resume(timeout=30).state == "running"
        again.close()


def test_many_cycles_keep_every_file_and_process(client: httpx.Client) -> None:
    c = client
    sid = create_sandbox(c, timeout=120)["sandbox_id"]
    run(c, sid, "nohup sleep 1000 >/dev/null 2>&1 & echo $! > /tmp/sleeper")
    for i in range(20):
        run(c, sid, f"echo {i} >> /workspace/log")
        c.post(f"/v1/sandboxes/{sid}/pause").raise_for_status()
        c.post(f"/v1/sandboxes/{sid}/resume").raise_for_status()
    assert run(c, sid, "cat /workspace/log").stdout == "".join(f"{i}\n" for i in range(20))
    assert run(c, sid, "kill -0 $(cat /tmp/sleeper) && echo alive").stdout == "alive\n"
    events = c.get("/v1/audit", params={"sandbox_id": sid, "limit": 200}).json()["events"]
    actions = [e["action"] for e in events]
    assert actions.count("sandbox.pause") == 20 and actions.count("sandbox.resume") == 20
    c.delete(f"/v1/sandboxes/{sid}")


def test_paused_through_a_restart(fresh_server: ServerHandle) -> None:
    srv = fresh_server
    key = srv.make_key("pause-restart")
    with srv.client(key) as c:
        sid = create_sandbox(c, timeout=60)["sandbox_id"]
        run(c, sid, "nohup sleep 1000 >/dev/null 2>&1 & echo $! > /tmp/sleeper")
        r = c.post(
            f"/v1/sandboxes/{sid}/commands",
            json={"cmd": "sleep 1; echo done", "background": True},
        )
        cmd_id = r.json()["cmd_id"]
        c.post(f"/v1/sandboxes/{sid}/pause").raise_for_status()
    srv.stop(signal.SIGKILL)
    srv.start()
    with srv.client(key) as c:
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"
        c.post(f"/v1/sandboxes/{sid}/resume").raise_for_status()
        assert run(c, sid, "kill -0 $(cat /tmp/sleeper) && echo alive").stdout == "alive\n"
        # The background command carried on after the resume, and its end is audited.
        deadline = time.time() + 10
        while True:
            info = c.get(f"/v1/sandboxes/{sid}/commands/{cmd_id}").json()
            if not info["running"]:
                break
            assert time.time() < deadline
            time.sleep(0.1)
        assert info["exit_code"] == 0
        c.delete(f"/v1/sandboxes/{sid}")


def test_a_paused_sandbox_ends_with_its_retention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTBOX_PAUSED_RETENTION_DAYS", str(2 / 86_400))  # 2 s
    srv = start_server(tmp_path)
    try:
        with srv.client(srv.make_key("pause-retention")) as c:
            sid = create_sandbox(c, timeout=600)["sandbox_id"]
            c.post(f"/v1/sandboxes/{sid}/pause").raise_for_status()
            deadline = time.time() + 15
            while (info := c.get(f"/v1/sandboxes/{sid}").json())["state"] == "paused":
                assert time.time() < deadline, "the paused sandbox outlived its retention"
                time.sleep(0.2)
            assert (info["state"], info["end_reason"]) == ("expired", "paused_retention")
    finally:
        srv.kill_all_sandboxes()
        srv.stop()


def test_on_timeout_pause_and_auto_resume(client: httpx.Client, server: ServerHandle) -> None:
    """lifecycle (E2B's names): at its timeout the sandbox pauses instead of ending, and a
    request to it (a command, a file, its exposed port with credentials) resumes it."""
    c = client
    info = create_sandbox(c, timeout=2, lifecycle={"on_timeout": "pause", "auto_resume": True})
    sid, token = info["sandbox_id"], {"X-Access-Token": info["access_token"]}
    assert info["lifecycle"] == {"on_timeout": "pause", "auto_resume": True}
    run(c, sid, "nohup python3 -m http.server 8124 >/dev/null 2>&1 & echo kept > /workspace/k")
    deadline = time.time() + 10
    while (info := c.get(f"/v1/sandboxes/{sid}").json())["state"] == "running":
        assert time.time() < deadline, "it never paused at its timeout"
        time.sleep(0.2)
    assert info["state"] == "paused" and info["end_reason"] is None
    assert info["timeout_left"] == 2  # its whole timeout again, once resumed
    # A command wakes it.
    assert run(c, sid, "cat /workspace/k").stdout == "kept\n"
    assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
    # It pauses again at its timeout; a request to its port with its token wakes it.
    deadline = time.time() + 10
    while c.get(f"/v1/sandboxes/{sid}").json()["state"] != "paused":
        assert time.time() < deadline
        time.sleep(0.2)
    port = f"{server.url}/v1/sandboxes/{sid}/ports/8124/"
    assert httpx.get(port).status_code == 401  # no credentials: it stays paused
    assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"
    assert httpx.get(port, headers=token).status_code == 200
    events = c.get("/v1/audit", params={"sandbox_id": sid, "limit": 100}).json()["events"]
    actions = [e["action"] for e in events]
    assert actions.count("sandbox.pause") == 2 and actions.count("sandbox.resume") == 2
    c.delete(f"/v1/sandboxes/{sid}")


def test_without_auto_resume_a_request_does_not_wake_it(client: httpx.Client) -> None:
    c = client
    sid = create_sandbox(c, timeout=60, lifecycle={"on_timeout": "pause"})["sandbox_id"]
    c.post(f"/v1/sandboxes/{sid}/pause").raise_for_status()
    r = c.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "true"})
    assert r.status_code == 409 and "paused" in r.json()["message"]
    assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"
    bad = c.post("/v1/sandboxes", json={"lifecycle": {"on_timeout": "sleep"}})
    assert bad.status_code == 422 and "on_timeout" in bad.text
    c.delete(f"/v1/sandboxes/{sid}")


def test_sdk_lifecycle(server: ServerHandle) -> None:
    key = server.make_key(f"pause-sdk-life-{time.monotonic_ns()}")
    life = {"on_timeout": "pause", "auto_resume": True}
    with Sandbox.create(timeout=60, lifecycle=life, api_key=key, api_url=server.url) as sbx:
        assert sbx.get_info().lifecycle == life
        sbx.pause()
        assert sbx.commands.run("echo woken").stdout == "woken\n"  # auto_resume
        assert sbx.get_info().state == "running"


def test_a_timeout_passed_while_the_server_was_down_pauses(fresh_server: ServerHandle) -> None:
    """A sandbox with lifecycle on_timeout pause whose timeout passed while no server ran is
    paused by the next server, not ended."""
    srv = fresh_server
    key = srv.make_key("pause-downtime")
    with srv.client(key) as c:
        sid = create_sandbox(c, timeout=2, lifecycle={"on_timeout": "pause"})["sandbox_id"]
        run(c, sid, "echo kept > /workspace/k")
    srv.stop(signal.SIGKILL)
    time.sleep(3)
    srv.start()
    with srv.client(key) as c:
        deadline = time.time() + 10
        while (info := c.get(f"/v1/sandboxes/{sid}").json())["state"] == "running":
            assert time.time() < deadline, "never paused"
            time.sleep(0.2)
        assert info["state"] == "paused", info
        c.post(f"/v1/sandboxes/{sid}/resume").raise_for_status()
        assert run(c, sid, "cat /workspace/k").stdout == "kept\n"
        c.delete(f"/v1/sandboxes/{sid}")


def test_paused_quota(server: ServerHandle) -> None:
    """quota.max_paused bounds paused sandboxes; one paused without memory holds no place in
    max_sandboxes (only its disk), and needs one again to resume."""
    tenant = f"pq-{time.monotonic_ns() % 10**9}"
    key = server.make_key(tenant)
    with server.client() as admin:
        r = admin.put(f"/v1/tenants/{tenant}/quota", json={"max_paused": 1, "max_sandboxes": 2})
        assert r.status_code == 200, r.text
    with server.client(key) as c:
        a, b = (create_sandbox(c, timeout=60)["sandbox_id"] for _ in range(2))
        c.post(f"/v1/sandboxes/{a}/pause", json={"keep_memory": False}).raise_for_status()
        r = c.post(f"/v1/sandboxes/{b}/pause")
        assert r.status_code == 429 and "max_paused" in r.json()["message"], r.text
        third = create_sandbox(c, timeout=60)["sandbox_id"]  # a's place is free
        r = c.post(f"/v1/sandboxes/{a}/resume")
        assert r.status_code == 429 and "max_sandboxes" in r.json()["message"], r.text
        assert c.get(f"/v1/sandboxes/{a}").json()["state"] == "paused"
        c.delete(f"/v1/sandboxes/{third}")
        assert c.post(f"/v1/sandboxes/{a}/resume").json()["state"] == "running"
        for sid in (a, b):
            c.delete(f"/v1/sandboxes/{sid}")
