"""Kept workspaces (`keep_workspace`) through the API, SDK and CLI: listed, read one file at a
time or as a tar stream, deleted, tenant-scoped, expired after the retention (issue 11)."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import pytest
from conftest import ServerHandle, create_sandbox, run, start_server

SETUP = (
    "mkdir -p d/e && printf fine > d/e/ok.txt && ln -s /etc/passwd to-passwd && ln -s d to-d "
    "&& mkfifo fifo && truncate -s 100M sparse && head -c 3000000 /dev/urandom > big"
)


def _kept(c: httpx.Client, **body: object) -> str:
    """A sandbox with a kept workspace holding the hostile SETUP tree, ended."""
    sid = create_sandbox(c, keep_workspace=True, resources={"disk_mb": 64}, **body)["sandbox_id"]
    assert run(c, sid, SETUP).exit_code == 0
    assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
    return sid


def _loops_on(image: Path) -> list[str]:
    found = []
    for f in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if f.read_text().strip().startswith(str(image)):
                found.append(f.parent.parent.name)
        except OSError:
            pass
    return found


def _mounted(data_dir: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line for line in f if str(data_dir) in line.split()[4]]


def _reading_state(data_dir: Path, image: Path) -> dict[str, object]:
    """What the host shows of a kept workspace being read: its loop devices, the mount
    directories and whether each is a mount point, the mount table's lines for them."""
    mounts = data_dir / "kept-mounts"
    entries = sorted(mounts.iterdir()) if mounts.is_dir() else []
    with open("/proc/self/mountinfo") as f:
        lines = [line.strip() for line in f if "kept-mounts" in line]
    return {
        "loops": _loops_on(image),
        "dirs": {e.name: os.path.ismount(e) for e in entries},
        "mountinfo": lines,
    }


def test_list_read_archive_delete(server: ServerHandle) -> None:
    mine, theirs = server.make_key("kept-mine"), server.make_key("kept-theirs")
    with server.client(mine) as c, server.client(theirs) as other:
        sid = _kept(c, metadata={"job": "j1"})
        listed = c.get("/v1/workspaces").json()["workspaces"]
        assert [w["sandbox_id"] for w in listed] == [sid]
        w = listed[0]
        assert w["metadata"] == {"job": "j1"} and w["template"] == "host"
        assert 3_000_000 <= w["used_bytes"] < 8_000_000  # the sparse 100 MiB file costs nothing
        kept_at = time.mktime(time.strptime(w["kept_at"][:19], "%Y-%m-%dT%H:%M:%S"))
        expires = time.mktime(time.strptime(w["expires_at"][:19], "%Y-%m-%dT%H:%M:%S"))
        assert expires - kept_at == 7 * 86_400  # the default retention
        # One file, streamed, by either spelling; never through a symlink or out of /workspace.
        files = f"/v1/workspaces/{sid}/files"
        for path in ("d/e/ok.txt", "/workspace/d/e/ok.txt"):
            r = c.get(files, params={"path": path})
            assert r.status_code == 200 and r.content == b"fine", r.text
        assert len(c.get(files, params={"path": "big"}).content) == 3_000_000
        for path, code in [
            ("to-passwd", "symlink_refused"),
            ("to-d/e/ok.txt", "symlink_refused"),
            ("/etc/passwd", "invalid_path"),
            ("../../etc/passwd", "invalid_path"),
            ("fifo", "not_a_regular_file"),
            ("d", "is_a_directory"),
            ("nope", "path_not_found"),
        ]:
            r = c.get(files, params={"path": path})
            assert r.status_code in (400, 404) and r.json()["code"] == code, (path, r.text)
        # The whole tree, as a tar stream: links as links, the FIFO as a FIFO, holes as holes.
        r = c.get(f"/v1/workspaces/{sid}/archive")
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
        assert len(r.content) < 5_000_000
        with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
            members = {m.name.removeprefix("./"): m for m in tar.getmembers()}
            assert members["to-passwd"].issym() and members["to-passwd"].linkname == "/etc/passwd"
            assert members["to-d"].issym() and members["fifo"].isfifo()
            assert members["sparse"].size == 100 * 2**20
            assert tar.extractfile(members["d/e/ok.txt"]).read() == b"fine"  # type: ignore[union-attr]
        assert b"root:x:0:0" not in r.content
        # Another tenant's kept workspace does not exist for it.
        assert other.get("/v1/workspaces").json()["workspaces"] == []
        for method, url in [
            ("GET", files + "?path=d/e/ok.txt"),
            ("GET", f"/v1/workspaces/{sid}/archive"),
            ("DELETE", f"/v1/workspaces/{sid}"),
        ]:
            assert other.request(method, url).status_code == 404
        assert not _mounted(server.data_dir / "kept-mounts")
        # Deleted: gone from the listing and the disk, and every action audited.
        assert c.delete(f"/v1/workspaces/{sid}").status_code == 204
        assert c.get("/v1/workspaces").json()["workspaces"] == []
        assert c.get(files, params={"path": "d/e/ok.txt"}).status_code == 404
        assert c.delete(f"/v1/workspaces/{sid}").status_code == 404
        assert not (server.data_dir / "kept-workspaces" / sid).exists()
        actions = [
            e["action"] for e in c.get("/v1/audit", params={"sandbox_id": sid}).json()["events"]
        ]
        for action in ("workspace.read", "workspace.archive", "workspace.remove"):
            assert action in actions, actions


def test_a_reader_that_leaves_early_leaves_no_mount(server: ServerHandle) -> None:
    with server.client(server.make_key("kept-leaver")) as c:
        sid = create_sandbox(c, keep_workspace=True, resources={"disk_mb": 128})["sandbox_id"]
        assert run(c, sid, "head -c 60000000 /dev/urandom > big && sync").exit_code == 0
        c.delete(f"/v1/sandboxes/{sid}")
        image = server.data_dir / "kept-workspaces" / sid / "workspace.img"
        for url in (f"/v1/workspaces/{sid}/archive", f"/v1/workspaces/{sid}/files?path=big"):
            with c.stream("GET", url) as r:
                assert r.status_code == 200
                chunks = r.iter_bytes()
                first = next(chunks)
                if not _mounted(server.data_dir / "kept-mounts"):
                    # Seen twice in CI, with the battery beside, never alone: say all we can.
                    state = _reading_state(server.data_dir, image)
                    rest = sum(len(b) for b in chunks)
                    log = (server.log_path or Path("/dev/null")).read_text(errors="replace")[-2000:]
                    pytest.fail(
                        f"no mount while {url} streamed: {state}; "
                        f"{len(first)} + {rest} bytes came; server log: {log}"
                    )
        deadline = time.monotonic() + 30  # a loaded CI host was seen slower than 10 s
        while _mounted(server.data_dir / "kept-mounts") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _mounted(server.data_dir / "kept-mounts")
        assert not _loops_on(image)
        # Deleting while a reader streams: the reader finishes, the workspace is gone.
        with c.stream("GET", f"/v1/workspaces/{sid}/files", params={"path": "big"}) as r:
            chunks = r.iter_bytes()
            first = next(chunks)
            assert c.delete(f"/v1/workspaces/{sid}").status_code == 204
            assert len(first) + sum(len(b) for b in chunks) == 60_000_000
        assert c.get("/v1/workspaces").json()["workspaces"] == []


def test_sdk_and_cli(server: ServerHandle, tmp_path: Path) -> None:
    from agentbox import AsyncWorkspaces, NotFoundError, Workspaces

    key = server.make_key("kept-sdk")
    with server.client(key) as c:
        sid = _kept(c)
    with Workspaces(api_key=key, api_url=server.url) as kept:
        [w] = kept.list()
        assert w.sandbox_id == sid and w.used_bytes > 0 and w.expires_at > w.kept_at
        assert kept.read(sid, "d/e/ok.txt") == "fine"
        assert kept.read(sid, "/workspace/big", format="bytes")[:0] == b""
        data = b"".join(kept.archive(sid))
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            assert "./d/e/ok.txt" in tar.getnames()
        with pytest.raises(NotFoundError):
            kept.read("sbx_0000000000000000", "a")

    async def async_face() -> None:
        async with AsyncWorkspaces(api_key=key, api_url=server.url) as kept:
            assert [w.sandbox_id for w in await kept.list()] == [sid]
            assert await kept.read(sid, "d/e/ok.txt", format="bytes") == b"fine"
            stream = await kept.archive(sid)
            assert len(b"".join([chunk async for chunk in stream])) == len(data)

    asyncio.run(async_face())
    env = dict(os.environ, AGENTBOX_API_URL=server.url, AGENTBOX_API_KEY=key, COLUMNS="200")

    def cli(*args: str) -> subprocess.CompletedProcess[bytes]:
        cmd = [sys.executable, "-m", "agentbox.cli.app", "workspaces", *args]
        return subprocess.run(cmd, env=env, capture_output=True, timeout=60, cwd=tmp_path)

    ls = cli("ls")
    assert ls.returncode == 0 and sid in ls.stdout.decode(), ls
    assert cli("get", sid, "d/e/ok.txt").stdout == b"fine"
    assert cli("get", sid, "to-passwd").returncode == 1
    assert cli("archive", sid).returncode == 0
    with tarfile.open(tmp_path / f"{sid}.tar") as tar:
        assert "./big" in tar.getnames()
    assert cli("rm", sid).returncode == 0
    assert sid not in cli("ls").stdout.decode()


def test_kept_workspaces_expire_after_the_retention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTBOX_KEPT_WORKSPACE_DAYS", str(2 / 86_400))  # 2 s
    srv = start_server(tmp_path)
    try:
        with srv.client() as c:
            sid = create_sandbox(c, keep_workspace=True, resources={"disk_mb": 16})["sandbox_id"]
            c.delete(f"/v1/sandboxes/{sid}")
            deadline = time.monotonic() + 15
            while c.get("/v1/workspaces").json()["workspaces"] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert c.get("/v1/workspaces").json()["workspaces"] == []
            assert not (srv.data_dir / "kept-workspaces" / sid).exists()
            events = c.get("/v1/audit", params={"action": "workspace.expire"}).json()["events"]
            assert [e["sandbox_id"] for e in events] == [sid]
    finally:
        srv.kill_all_sandboxes()  # a stopped server ends none: its sandboxes outlive it
        srv.stop()
