"""Volumes through the API: a named, size-limited filesystem of its tenant that sandboxes mount
one read-write at a time (read-only ones may share it), kept when they die, whose files every
sandbox sees as its own user's, readable and writable from the API while no sandbox holds it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import ServerHandle, create_sandbox, run

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def tenant(server: ServerHandle) -> Iterator[tuple[httpx.Client, str]]:
    name = f"vol-{time.monotonic_ns() % 10**9}"
    with server.client(server.make_key(name)) as c:
        yield c, name


def _volume(c: httpx.Client, name: str, size_mb: int = 64) -> dict:
    r = c.post("/v1/volumes", json={"name": name, "size_mb": size_mb})
    assert r.status_code == 201, r.text
    return r.json()


def test_a_volume_across_sandboxes(tenant: tuple[httpx.Client, str], server: ServerHandle) -> None:
    c, _ = tenant
    vol = _volume(c, "data")
    assert vol["volume_id"].startswith("vol_") and vol["mounted_by"] == []
    a = create_sandbox(c, timeout=60, volume_mounts={"/data": "data"})
    assert a["volume_mounts"] == [
        {"volume_id": vol["volume_id"], "path": "/data", "read_only": False}
    ]
    out = run(c, a["sandbox_id"], "echo one > /data/f && mkdir -p /data/d && stat -c %U /data/f")
    assert out.stdout == "user\n", out
    # One read-write mount at a time; read-only ones share it, and see its writes.
    r = c.post("/v1/sandboxes", json={"volume_mounts": {"/data": "data"}})
    assert r.status_code == 409 and "read-write" in r.json()["message"], r.text
    ro = create_sandbox(c, volume_mounts={"/mnt/v": {"volume": "data", "read_only": True}})
    assert run(c, ro["sandbox_id"], "cat /mnt/v/f").stdout == "one\n"
    assert run(c, ro["sandbox_id"], "echo x > /mnt/v/g").exit_code != 0
    info = c.get("/v1/volumes/data").json()
    assert {u["sandbox_id"] for u in info["mounted_by"]} == {a["sandbox_id"], ro["sandbox_id"]}
    # Held: no API access, no deletion.
    assert c.get("/v1/volumes/data/files", params={"path": "f"}).status_code == 409
    assert c.delete("/v1/volumes/data").status_code == 409
    for s in (a, ro):
        c.delete(f"/v1/sandboxes/{s['sandbox_id']}")
    mnt = server.data_dir / "volumes" / vol["volume_id"] / "mnt"
    assert not mnt.is_mount()  # nobody holds it: unmounted from the host

    # Kept: the API reads and writes it, and a new sandbox (other uids) owns its files.
    assert c.get("/v1/volumes/data/files", params={"path": "f"}).content == b"one\n"
    r = c.put("/v1/volumes/data/files", params={"path": "d/new"}, content=b"from api")
    assert r.status_code == 200, r.text
    b = create_sandbox(c, volume_mounts={"/workspace/v": "data"})["sandbox_id"]
    out = run(
        c,
        b,
        "cat /workspace/v/d/new && echo two >> /workspace/v/f && stat -c %U /workspace/v/d/new",
    )
    assert out.stdout == "from apiuser\n", out  # (no newline written)
    assert c.get("/v1/volumes/data").json()["used_bytes"] > 0
    c.delete(f"/v1/sandboxes/{b}")
    assert c.get("/v1/volumes/data/files", params={"path": "f"}).content == b"one\ntwo\n"
    assert c.delete("/v1/volumes/data").status_code == 204
    assert not (server.data_dir / "volumes" / vol["volume_id"]).exists()


def test_limits_and_refusals(tenant: tuple[httpx.Client, str], server: ServerHandle) -> None:
    c, name = tenant
    _volume(c, "small", size_mb=16)
    sid = create_sandbox(c, volume_mounts={"/data": "small"})["sandbox_id"]
    out = run(c, sid, "head -c 40000000 /dev/zero > /data/big; echo $?")
    assert out.stdout.strip() != "0"  # its size is its limit
    c.delete(f"/v1/sandboxes/{sid}")
    r = c.put("/v1/volumes/small/files", params={"path": "big"}, content=b"\0" * (24 << 20))
    assert r.status_code == 400 and "full" in r.json()["message"], r.text
    assert c.post("/v1/volumes", json={"name": "small", "size_mb": 16}).status_code == 409
    for bad in ("/", "/workspace", "/proc/x", "/etc", "relative", "/a/../etc"):
        r = c.post("/v1/sandboxes", json={"volume_mounts": {bad: "small"}})
        assert r.status_code == 400, (bad, r.text)
    assert c.post("/v1/sandboxes", json={"volume_mounts": {"/d": "nope"}}).status_code == 404
    for path in ("../x", "/etc/passwd"):
        r = c.put("/v1/volumes/small/files", params={"path": path}, content=b"x")
        assert r.status_code == 400, (path, r.text)
    with server.client() as admin:
        admin.put(f"/v1/tenants/{name}/quota", json={"max_volumes": 1})
    r = c.post("/v1/volumes", json={"name": "second", "size_mb": 16})
    assert r.status_code == 429 and "max_volumes" in r.json()["message"]
    # Another tenant sees none of it.
    with server.client(server.make_key(f"other-{time.monotonic_ns() % 10**9}")) as other:
        assert other.get("/v1/volumes/small").status_code == 404
        assert other.get("/v1/volumes").json()["volumes"] == []
        r = other.post("/v1/sandboxes", json={"volume_mounts": {"/d": "small"}})
        assert r.status_code == 404
        assert other.delete("/v1/volumes/small").status_code == 404
    assert c.delete("/v1/volumes/small").status_code == 204


def test_through_a_restart(fresh_server: ServerHandle) -> None:
    """A restarted server knows who holds a volume from the records: the sandbox mounting it
    keeps it, and its end unmounts it from the host."""
    srv = fresh_server
    with srv.client(srv.make_key("vol-restart")) as c:
        vol = _volume(c, "kept")
        sid = create_sandbox(c, timeout=60, volume_mounts={"/data": "kept"})["sandbox_id"]
        run(c, sid, "echo before > /data/f")
    srv.stop()
    srv.start()
    with srv.client(srv.keys[-1]) as c:
        assert run(c, sid, "cat /data/f; echo after >> /data/f").stdout == "before\n"
        assert c.post("/v1/sandboxes", json={"volume_mounts": {"/d": "kept"}}).status_code == 409
        c.delete(f"/v1/sandboxes/{sid}")
        assert not (srv.data_dir / "volumes" / vol["volume_id"] / "mnt").is_mount()
        assert c.get("/v1/volumes/kept/files", params={"path": "f"}).content == b"before\nafter\n"


def test_sdk(server: ServerHandle, tenant_key: str) -> None:
    from agentbox import Sandbox, Volumes

    conn = {"api_key": tenant_key, "api_url": server.url}
    with Volumes(**conn) as vols:
        info = vols.create("sdk", 32)
        assert info.name == "sdk" and info.size_mb == 32
        assert vols.write("sdk", "cfg/a.txt", "hello") == 5
        with Sandbox.create(volume_mounts={"/data": "sdk"}, **conn) as sbx:
            assert sbx.get_info().volume_mounts[0]["path"] == "/data"
            assert sbx.commands.run("cat /data/cfg/a.txt").stdout == "hello"
            assert [m["sandbox_id"] for m in vols.get("sdk").mounted_by] == [sbx.sandbox_id]
            sbx.commands.run("echo more > /data/b")
            sbx.kill()
        assert vols.read("sdk", "b") == b"more\n"
        assert [v.name for v in vols.list()] == ["sdk"]
        vols.delete("sdk")
        assert vols.list() == []


def test_the_files_api_never_follows_what_a_sandbox_made(
    tenant: tuple[httpx.Client, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The server reads and writes volumes as host root: a symlink a sandbox left there (to a
    host path) is never followed, neither as a directory on the way nor as the file."""
    c, _ = tenant
    target = tmp_path_factory.mktemp("host-target")
    (target / "secret").write_text("host secret")
    _volume(c, "traps", size_mb=16)
    sid = create_sandbox(c, volume_mounts={"/data": "traps"})["sandbox_id"]
    plant = f"ln -s {target} /data/dir && ln -s {target}/secret /data/file && mkfifo /data/fifo"
    assert run(c, sid, plant).exit_code == 0
    c.delete(f"/v1/sandboxes/{sid}")
    for path in ("dir/secret", "file", "fifo"):
        r = c.get("/v1/volumes/traps/files", params={"path": path})
        assert r.status_code == 400, (path, r.text)
    for path in ("dir/new", "file", "fifo"):
        r = c.put("/v1/volumes/traps/files", params={"path": path}, content=b"pwned")
        assert r.status_code == 400, (path, r.text)
    assert sorted(p.name for p in target.iterdir()) == ["secret"]
    assert (target / "secret").read_text() == "host secret"
    assert c.delete("/v1/volumes/traps").status_code == 204


def test_a_mount_point_through_a_symlink_is_refused(tenant: tuple[httpx.Client, str]) -> None:
    """A disk a sandbox starts from (here a snapshot) may hold symlinks the tenant made: a
    volume mounted through one would land where it points (over the agent's own tree)."""
    c, _ = tenant
    _volume(c, "linked", size_mb=16)
    sid = create_sandbox(c, timeout=60)["sandbox_id"]
    run(c, sid, "ln -s /.agentbox /workspace/evil && touch /workspace/file")
    snap = c.post(f"/v1/sandboxes/{sid}/snapshots").json()["snapshot_id"]
    c.delete(f"/v1/sandboxes/{sid}")
    for path in ("/workspace/evil", "/workspace/evil/x", "/workspace/file/x", "//.agentbox"):
        r = c.post("/v1/sandboxes", json={"template": snap, "volume_mounts": {path: "linked"}})
        assert r.status_code in (400, 409), (path, r.text)
    ok = create_sandbox(c, template=snap, volume_mounts={"/workspace/fine": "linked"})
    assert run(c, ok["sandbox_id"], "ls /.agentbox/main.py").exit_code == 0
    c.delete(f"/v1/sandboxes/{ok['sandbox_id']}")
    c.delete(f"/v1/snapshots/{snap}")
    assert c.delete("/v1/volumes/linked").status_code == 204
