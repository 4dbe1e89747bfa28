"""Snapshots and forks through the API (the tiers are in test_tiers.py): a snapshot is a
consistent copy taken while its sandbox keeps writing, belongs to its tenant alone, has a
unique name that never hides a template, counts against the tenant's snapshot and disk quotas,
survives a restart; a sandbox started from one gets at least its disk; a fork is all or none.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ServerHandle, create_sandbox, run

pytestmark = pytest.mark.timeout(180)

LOOP = "cd /workspace; i=0; while true; do i=$((i+1)); echo $i > n.tmp; mv n.tmp n; done"
WRITER = f"nohup sh -c '{LOOP}' >/dev/null 2>&1 &"


@pytest.fixture
def tenant(server: ServerHandle) -> Iterator[tuple[httpx.Client, str]]:
    name = f"snap-{time.monotonic_ns() % 10**9}"
    with server.client(server.make_key(name)) as c:
        yield c, name


def _snapshot(c: httpx.Client, sid: str, **body: object) -> dict:
    r = c.post(f"/v1/sandboxes/{sid}/snapshots", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def test_a_consistent_copy_while_it_writes(
    tenant: tuple[httpx.Client, str], server: ServerHandle
) -> None:
    """Taken while a process renames files in a loop: the image is a clean filesystem, and a
    sandbox from it has a whole file (never a torn one); the parent writes on."""
    c, _ = tenant
    sid = create_sandbox(c, timeout=60)["sandbox_id"]
    run(c, sid, WRITER)
    time.sleep(0.2)
    snap = _snapshot(c, sid)
    image = server.data_dir / "snapshots" / snap["snapshot_id"] / "disk.img"
    fsck = subprocess.run(["e2fsck", "-fn", str(image)], capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    child = create_sandbox(c, template=snap["snapshot_id"])["sandbox_id"]
    n = run(c, child, "cat /workspace/n").stdout.strip()
    assert n.isdigit() and int(n) > 0
    time.sleep(0.1)
    assert run(c, child, "cat /workspace/n").stdout.strip() == n  # no writer in the child
    assert int(run(c, sid, "cat /workspace/n").stdout.strip() or 0) > int(n)  # the parent's runs on
    listed = c.get("/v1/snapshots").json()["snapshots"]
    assert [s["snapshot_id"] for s in listed] == [snap["snapshot_id"]]
    audit = c.get("/v1/audit", params={"action": "snapshot.create"}).json()
    assert any(e.get("sandbox_id") == sid for e in audit.get("events", audit.get("entries", [])))
    for s in (sid, child):
        c.delete(f"/v1/sandboxes/{s}")
    assert c.delete(f"/v1/snapshots/{snap['snapshot_id']}").status_code == 204
    assert not image.parent.exists()


def test_a_disk_whose_mount_the_host_lost_is_refused_not_copied_stale(
    tenant: tuple[httpx.Client, str], server: ServerHandle
) -> None:
    """The server syncs the sandbox's filesystem onto its image before copying it, through its
    mount on the host. Where that mount is gone from the server's mount namespace (the sandbox
    still writes through its own), a sync of the path would sync the host's /run and say
    nothing: the snapshot is refused instead, and the sandbox runs on."""
    c, _ = tenant
    sid = create_sandbox(c, timeout=60)["sandbox_id"]
    state = json.loads((server.data_dir / "sandboxes" / sid / "runtime.json").read_text())
    mnt = Path(state["socket"]).parent.parent / sid / "workspace"
    assert os.path.ismount(mnt)
    subprocess.run(["umount", "--lazy", str(mnt)], check=True)
    r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={})
    assert r.status_code == 503 and "is not the mount of" in r.json()["message"], r.text
    assert run(c, sid, "echo still > /workspace/f && cat /workspace/f").stdout == "still\n"
    assert c.get("/v1/snapshots").json()["snapshots"] == []
    assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204


def test_tenants_names_and_refusals(tenant: tuple[httpx.Client, str], server: ServerHandle) -> None:
    c, _ = tenant
    sid = create_sandbox(c, timeout=60, resources={"disk_mb": 64})["sandbox_id"]
    snap = _snapshot(c, sid, name="mine", metadata={"k": "v"})
    assert snap["metadata"] == {"k": "v"} and snap["disk_mb"] == 64
    assert c.get("/v1/snapshots/mine").json()["snapshot_id"] == snap["snapshot_id"]

    # Names: unique per tenant, never a template's, of a sane form.
    r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "mine"})
    assert r.status_code == 409 and "exists" in r.json()["message"]
    r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "host"})
    assert r.status_code == 409 and "template" in r.json()["message"]
    for bad in ("-x", "a b", "snap_x", "../x"):
        r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": bad})
        assert r.status_code == 400, (bad, r.text)

    # Another tenant sees none of it, and cannot start from it, by id or name.
    with server.client(server.make_key(f"other-{time.monotonic_ns() % 10**9}")) as other:
        for ref in (snap["snapshot_id"], "mine"):
            assert other.get(f"/v1/snapshots/{ref}").status_code == 404
            assert other.delete(f"/v1/snapshots/{ref}").status_code == 404
        assert other.get("/v1/snapshots").json()["snapshots"] == []
        r = other.post("/v1/sandboxes", json={"template": snap["snapshot_id"]})
        assert r.status_code == 404, r.text
        assert other.post(f"/v1/sandboxes/{sid}/snapshots").status_code == 404
        assert other.post(f"/v1/sandboxes/{sid}/fork").status_code == 404

    # A disk at least the snapshot's: smaller is refused, larger grows the filesystem.
    r = c.post("/v1/sandboxes", json={"template": "mine", "resources": {"disk_mb": 32}})
    assert r.status_code == 400 and "disk_mb" in r.json()["message"]
    big = create_sandbox(c, template="mine", resources={"disk_mb": 256})["sandbox_id"]
    size_kb = int(run(c, big, "df -k --output=size /workspace | tail -1").stdout)
    assert 200 * 1024 < size_kb <= 256 * 1024, size_kb
    assert c.delete(f"/v1/sandboxes/{big}").status_code == 204

    # Fork's count is bounded; an ended sandbox has nothing to copy.
    for count in (0, 17):
        assert c.post(f"/v1/sandboxes/{sid}/fork", json={"count": count}).status_code == 422
    assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
    r = c.post(f"/v1/sandboxes/{sid}/snapshots")
    assert r.status_code == 409 and r.json()["code"] == "sandbox_not_running"
    assert c.post(f"/v1/sandboxes/{sid}/fork").status_code == 409
    assert c.post("/v1/sandboxes", json={"template": "snap_0000000000000000"}).status_code == 404
    assert c.delete("/v1/snapshots/mine").status_code == 204


def test_quotas(tenant: tuple[httpx.Client, str], server: ServerHandle) -> None:
    """Snapshots count against quota.max_snapshots and the tenant's disk; a fork that cannot
    start every child starts none."""
    c, name = tenant
    with server.client() as admin:
        r = admin.put(f"/v1/tenants/{name}/quota", json={"max_snapshots": 1, "max_sandboxes": 3})
        assert r.status_code == 200, r.text
    sid = create_sandbox(c, timeout=60)["sandbox_id"]
    run(c, sid, "head -c 40000000 /dev/urandom > /workspace/blob")
    snap = _snapshot(c, sid)
    assert snap["used_bytes"] >= 40_000_000
    r = c.post(f"/v1/sandboxes/{sid}/snapshots")
    assert r.status_code == 429 or r.json()["code"] == "quota_exceeded", r.text
    assert "max_snapshots" in r.json()["message"]

    # The snapshot's blocks count: a new 1 GiB sandbox fits beside the live one's ~40 MiB,
    # not beside that and the snapshot's.
    with server.client() as admin:
        admin.put(
            f"/v1/tenants/{name}/quota", json={"max_snapshots": 5, "max_total_disk_mb": 1024 + 60}
        )
    r = c.post("/v1/sandboxes", json={})
    assert r.json().get("code") == "quota_exceeded", r.text
    assert "max_total_disk_mb" in r.json()["message"]
    with server.client() as admin:
        admin.put(f"/v1/tenants/{name}/quota", json={"max_total_disk_mb": 51_200})

    # Two more sandboxes fit, three do not: nothing of the fork is left.
    r = c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 3})
    assert r.json().get("code") == "quota_exceeded", r.text
    live = c.get("/v1/sandboxes", params={"state": "live"}).json()["sandboxes"]
    assert [s["sandbox_id"] for s in live] == [sid]
    kids = c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 2}).json()["sandboxes"]
    assert run(c, kids[1]["sandbox_id"], "wc -c < /workspace/blob").stdout.strip() == "40000000"
    for s in (sid, *[k["sandbox_id"] for k in kids]):
        c.delete(f"/v1/sandboxes/{s}")
    c.delete(f"/v1/snapshots/{snap['snapshot_id']}")


def test_survives_a_restart(fresh_server: ServerHandle) -> None:
    srv = fresh_server
    with srv.client(srv.make_key("keeper")) as c:
        sid = create_sandbox(c, timeout=60)["sandbox_id"]
        run(c, sid, "echo kept > /workspace/k")
        snap = _snapshot(c, sid, name="kept")
        c.delete(f"/v1/sandboxes/{sid}")
    # A half-made one (a crash mid-copy) and a stray directory are gone after the restart.
    stray = srv.data_dir / "snapshots" / ".fork-deadbeef"
    stray.mkdir()
    srv.stop()
    srv.start()
    assert not stray.exists()
    with srv.client(srv.keys[-1]) as c:
        assert c.get("/v1/snapshots/kept").json()["snapshot_id"] == snap["snapshot_id"]
        child = create_sandbox(c, template="kept")["sandbox_id"]
        assert run(c, child, "cat /workspace/k").stdout == "kept\n"
        c.delete(f"/v1/sandboxes/{child}")
