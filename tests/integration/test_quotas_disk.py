"""Tenant quotas over every resource a sandbox can ask for, descriptor and disk budgets summed
over a tenant, and the free-space floor, against a real server (issue 11)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from conftest import ServerHandle, create_sandbox, run, start_server

MiB = 2**20


def _tenant_name(server: ServerHandle, name: str) -> str:
    return f"{name}-{server.port}"


def _tenant(server: ServerHandle, name: str, **quota: object) -> httpx.Client:
    """A client of a new tenant with this quota."""
    tenant = _tenant_name(server, name)
    key = server.make_key(tenant)
    if quota:
        with server.client() as admin:
            r = admin.put(f"/v1/tenants/{tenant}/quota", json=quota)
            assert r.status_code == 200, r.text
    return server.client(key)


def _refused(r: httpx.Response, status: int, setting: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["detail"]["setting"] == setting, body
    assert setting.split(".")[-1] in body["message"] or "limit" in body["message"], body
    return body


def _server_hard_nofile(server: ServerHandle) -> int:
    assert server.proc is not None
    limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
    found = re.search(r"^Max open files\s+\S+\s+(\d+)", limits, re.M)
    assert found, limits
    return int(found.group(1))


def test_every_resource_above_its_cap_is_a_4xx_naming_the_cap(server: ServerHandle) -> None:
    caps = {
        "cpu_count": ("max_cpu_count", 0.5, 0.75),
        "memory_mb": ("max_memory_mb", 256, 257),
        "pids": ("max_pids", 64, 65),
        "nofile": ("max_nofile", 512, 513),
        "file_size_mb": ("max_file_size_mb", 8, 9),
        "disk_mb": ("max_disk_mb", 64, 65),
        "tmp_mb": ("max_tmp_mb", 8, 9),
    }
    at = {name: most for name, (_, most, _) in caps.items()}
    with _tenant(server, "caps", **{cap: most for cap, most, _ in caps.values()}) as c:
        for name, (cap, most, over) in caps.items():
            r = c.post("/v1/sandboxes", json={"resources": {**at, name: over}})
            body = _refused(r, 400, f"quota.{cap}")
            assert body["code"] == "limit_exceeded" and body["detail"]["limit"] == most
            assert f"resources.{name}" in body["message"]
        # At the caps, all together: created.
        sid = create_sandbox(c, resources=at)["sandbox_id"]
        assert run(c, sid, "ulimit -n; ulimit -f").stdout.split() == ["512", "8192"]
        c.delete(f"/v1/sandboxes/{sid}")


def test_nofile_above_the_server_hard_limit_is_a_4xx_not_a_503(server: ServerHandle) -> None:
    """It was 503 "Exception occurred in preexec_fn": setrlimit above the server's own hard
    limit fails in the child."""
    hard = _server_hard_nofile(server)
    with _tenant(server, "hard", max_nofile=1 << 20, max_descriptors=1 << 30) as c:
        r = c.post("/v1/sandboxes", json={"resources": {"nofile": hard + 1, "pids": 16}})
        body = _refused(r, 400, "server.rlimit_nofile")
        assert str(hard) in body["message"] and body["detail"]["limit"] == hard
        sid = create_sandbox(c, resources={"nofile": hard, "pids": 16})["sandbox_id"]
        assert run(c, sid, "ulimit -n").stdout.strip() == str(hard)
        c.delete(f"/v1/sandboxes/{sid}")


def test_descriptor_budget_per_sandbox(server: ServerHandle) -> None:
    table = int(Path("/proc/sys/fs/file-max").read_text())
    with _tenant(server, "fd-default") as c:
        # The example: 4096 × 1024 ≈ 4.2 M against a table of ~2.5 M.
        r = c.post("/v1/sandboxes", json={"resources": {"pids": 4096, "nofile": 1024}})
        body = _refused(r, 400, "quota.max_descriptors")
        assert body["detail"]["limit"] <= table // 4
        quota = c.get(f"/v1/tenants/{_tenant_name(server, 'fd-default')}/quota").json()
        assert quota["max_descriptors"] == max(table // 8, 256 * 1024)
        assert quota["max_total_descriptors"] <= table // 2
    with _tenant(server, "fd-small", max_descriptors=64 * 1024) as c:
        _refused(
            c.post("/v1/sandboxes", json={"resources": {"pids": 65, "nofile": 1024}}),
            400,
            "quota.max_descriptors",
        )
        sid = create_sandbox(c, resources={"pids": 64, "nofile": 1024})["sandbox_id"]
        c.delete(f"/v1/sandboxes/{sid}")


def test_descriptor_budget_per_tenant(server: ServerHandle) -> None:
    each = {"pids": 16, "nofile": 1024, "memory_mb": 64, "disk_mb": 16}  # 16384 files
    with _tenant(server, "fd-tenant", max_total_descriptors=3 * 16384 + 100) as c:
        ids = [create_sandbox(c, resources=each)["sandbox_id"] for _ in range(3)]
        r = c.post("/v1/sandboxes", json={"resources": each})
        body = _refused(r, 429, "quota.max_total_descriptors")
        assert body["code"] == "quota_exceeded" and body["detail"]["used"] == 3 * 16384
        c.delete(f"/v1/sandboxes/{ids.pop()}")
        ids.append(create_sandbox(c, resources=each)["sandbox_id"])
        for sid in ids:
            c.delete(f"/v1/sandboxes/{sid}")


def test_total_disk_counts_live_and_kept_workspaces_by_real_usage(server: ServerHandle) -> None:
    with _tenant(server, "disk", max_total_disk_mb=200) as c:
        a = create_sandbox(c, keep_workspace=True, resources={"disk_mb": 64})["sandbox_id"]
        assert run(c, a, "head -c 41943040 /dev/urandom > f && sync").exit_code == 0
        c.delete(f"/v1/sandboxes/{a}")
        kept = c.get("/v1/workspaces").json()["workspaces"]
        assert [w["sandbox_id"] for w in kept] == [a]
        assert 40 * MiB <= kept[0]["used_bytes"] < 48 * MiB
        # 40 MiB kept + 170 MiB asked > 200: refused; 150 fits.
        body = _refused(
            c.post("/v1/sandboxes", json={"resources": {"disk_mb": 170}}),
            429,
            "quota.max_total_disk_mb",
        )
        assert body["detail"]["limit"] == 200 and 40 <= body["detail"]["used_mb"] < 48
        b = create_sandbox(c, resources={"disk_mb": 150})["sandbox_id"]
        # A live workspace counts what it really holds: 30 MiB written, 10 MiB left.
        assert run(c, b, "head -c 31457280 /dev/urandom > f && sync").exit_code == 0
        _refused(
            c.post("/v1/sandboxes", json={"resources": {"disk_mb": 140}}),
            429,
            "quota.max_total_disk_mb",
        )
        # The kept workspace deleted gives its disk back.
        assert c.delete(f"/v1/workspaces/{a}").status_code == 204
        d = create_sandbox(c, resources={"disk_mb": 140})["sandbox_id"]
        for sid in (b, d):
            c.delete(f"/v1/sandboxes/{sid}")


def test_free_space_floor_refuses_creates_with_507(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTBOX_MIN_FREE_DISK_MB", str(2**40))  # more than any disk here
    srv = start_server(tmp_path)
    try:
        with srv.client() as c:
            r = c.post("/v1/sandboxes", json={})
            assert r.status_code == 507, r.text
            body = r.json()
            assert body["code"] == "insufficient_storage"
            assert str(srv.data_dir) in body["message"]
            assert body["detail"]["needed_bytes"] == 2**60
            assert 0 < body["detail"]["free_bytes"] < 2**60
            assert str(body["detail"]["free_bytes"]) in body["message"]
            events = c.get("/v1/audit", params={"action": "sandbox.create"}).json()["events"]
            assert events[0]["status"] == 507
            assert c.get("/v1/sandboxes").json()["sandboxes"] == []
    finally:
        srv.kill_all_sandboxes()  # a stopped server ends none: its sandboxes outlive it
        srv.stop()
