"""Violations name the setting that blocked the command, provoked for real in a sandbox: a full
/tmp is `resources.tmp_mb` (not the workspace's `disk_mb`), a full workspace is `disk_mb`,
direct network access is `network`, the process limit is `resources.pids`.

The other codes are provoked elsewhere: command_timeout (test_commands, test_sdk),
memory_limit (test_isolation; run_code in test_code_violations), file_size_limit
(test_lifecycle, test_sdk), read_only_path (test_commands, test_files_security),
network_blocked (test_egress), disk_limit on upload (test_files_security), sandbox_ended and
pids_limit at command start (tests/reliability/test_ttl_kill)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from conftest import ServerHandle, create_sandbox, run

TMP_MB = 8


@pytest.fixture
def client(server: ServerHandle, tenant_key: str) -> Iterator[httpx.Client]:
    with server.client(tenant_key) as c:
        yield c


@pytest.fixture
def small(client: httpx.Client) -> Iterator[str]:
    """A sandbox with a small /tmp and a small workspace, so both fill in a second."""
    sid = create_sandbox(client, resources={"tmp_mb": TMP_MB, "disk_mb": 32})["sandbox_id"]
    yield sid
    client.delete(f"/v1/sandboxes/{sid}")


def _violation(client: httpx.Client, sid: str, cmd: str) -> dict:
    res = run(client, sid, cmd, timeout=30)
    assert res.exit_code not in (0, None), res
    assert res.end["violation"], res
    return res.end["violation"]


@pytest.mark.parametrize(
    "cmd",
    [
        # The error line names the file.
        f"dd if=/dev/zero of=/tmp/fill bs=1M count={4 * TMP_MB}",
        # It names no path ("standard output"): the agent's look at the mounts decides.
        f"cd /tmp && head -c {4 * TMP_MB}M /dev/zero > fill",
        # /dev/shm is a tmpfs sized by tmp_mb too.
        f"head -c {4 * TMP_MB}M /dev/zero > /dev/shm/fill",
    ],
)
def test_full_tmp_names_tmp_mb(client: httpx.Client, small: str, cmd: str) -> None:
    v = _violation(client, small, cmd)
    assert v["code"] == "disk_limit" and v["setting"] == "resources.tmp_mb", v
    assert "/tmp" in v["message"] and "resources.tmp_mb" in v["message"], v


def test_full_workspace_names_disk_mb(client: httpx.Client, small: str) -> None:
    # A full /tmp left behind must not be blamed for the workspace filling up.
    run(client, small, f"head -c {4 * TMP_MB}M /dev/zero > /tmp/fill")
    for cmd in ("head -c 64M /dev/zero > fill", "dd if=/dev/zero of=/workspace/f bs=1M count=64"):
        v = _violation(client, small, cmd)
        assert v["code"] == "disk_limit" and v["setting"] == "resources.disk_mb", (cmd, v)
        run(client, small, "rm -f fill f")


def test_upload_to_full_tmp_names_tmp_mb(client: httpx.Client, small: str) -> None:
    body = b"\0" * (2 * TMP_MB << 20)
    r = client.put(f"/v1/sandboxes/{small}/files", params={"path": "/tmp/big"}, content=body)
    assert r.status_code == 400 and r.json()["code"] == "limit_exceeded", r.text
    v = r.json()["detail"]["violation"]
    assert v["code"] == "disk_limit" and v["setting"] == "resources.tmp_mb", v


def test_direct_network_access_names_network(client: httpx.Client, small: str) -> None:
    v = _violation(
        client,
        small,
        "python3 -c \"import socket; socket.create_connection(('192.0.2.1', 80), timeout=5)\"",
    )
    assert v["code"] == "network_disabled" and v["setting"] == "network", v
    assert "HTTP_PROXY" in v["message"], v


def test_process_limit_names_pids(client: httpx.Client) -> None:
    sid = create_sandbox(client, resources={"pids": 32})["sandbox_id"]
    try:
        spawn = "import subprocess\nfor _ in range(64): subprocess.Popen(['sleep', '2'])"
        v = _violation(client, sid, f'python3 -c "{spawn}"')
        assert v["code"] == "pids_limit" and v["setting"] == "resources.pids", v
    finally:
        client.delete(f"/v1/sandboxes/{sid}")
