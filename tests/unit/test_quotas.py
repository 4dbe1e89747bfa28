"""Tenant quotas without a server: every resource capped, the lower of cap and ceiling named, the
descriptor budgets derived from the host's file table, the disk floor and totals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentbox.core import quotas
from agentbox.core.disk import DiskAccounting, DiskSettings, DiskUse
from agentbox.core.errors import InsufficientStorage, LimitExceeded, QuotaExceeded
from agentbox.runtimes.base import Ceiling, Resources
from agentbox.server.models import QuotaBody, ResourcesBody
from agentbox.vocab import status_of

MiB = 2**20


def test_every_resource_a_sandbox_can_ask_for_has_a_quota_cap() -> None:
    fields = set(Resources.__dataclass_fields__)
    assert set(ResourcesBody.model_fields) == fields
    assert set(quotas.RESOURCE_CAPS) == fields
    default = quotas.default_quota()
    caps = set(quotas.RESOURCE_CAPS.values()) | {"max_descriptors", "max_total_descriptors"}
    caps |= {
        "max_total_disk_mb",
        "max_sandboxes",
        "max_timeout",
        "max_snapshots",
        "max_paused",
        "max_volumes",
    }
    assert caps == set(default)
    # Besides the caps, which runtimes its sandboxes use (unset: the server's, any; no floor).
    assert set(QuotaBody.model_fields) == caps | {"default_runtime", "runtimes", "min_isolation"}
    # The defaults let a sandbox with default resources be created.
    assert quotas.sandbox_resources({}, default, {}) == Resources()


def test_descriptor_budgets_derive_from_the_file_table() -> None:
    q = quotas.default_quota(file_table=2_466_174)
    assert q["max_descriptors"] == 2_466_174 // 8
    assert q["max_total_descriptors"] == 2_466_174 // 2
    # The example: 4096 processes × 1024 files, more than the whole table.
    with pytest.raises(LimitExceeded) as e:
        quotas.sandbox_resources({"pids": 4096, "nofile": 1024}, q, {})
    assert e.value.detail["setting"] == "quota.max_descriptors"
    # A tiny table never refuses the default sandbox.
    small = quotas.default_quota(file_table=10_000)
    assert small["max_descriptors"] == small["max_total_descriptors"] == 256 * 1024


def test_an_unlimited_file_table_is_sized_like_the_kernel_would(monkeypatch) -> None:
    real = Path.read_text
    monkeypatch.setattr(
        Path,
        "read_text",
        lambda self, *a, **k: (
            "9223372036854775807\n" if str(self) == "/proc/sys/fs/file-max" else real(self, *a, **k)
        ),
    )
    table = quotas.host_file_table()
    mem_kib = int(next(x for x in open("/proc/meminfo") if x.startswith("MemTotal")).split()[1])
    assert table == mem_kib // 10


def test_the_lower_of_quota_and_ceiling_is_named() -> None:
    q = {**quotas.default_quota(), "max_nofile": 4096}
    hard = {"nofile": Ceiling(2000, "server.rlimit_nofile", "the server's hard limit 2000")}
    with pytest.raises(LimitExceeded) as e:
        quotas.sandbox_resources({"nofile": 3000}, q, hard)
    assert e.value.detail == {"setting": "server.rlimit_nofile", "limit": 2000}
    assert "2000" in e.value.message
    with pytest.raises(LimitExceeded) as e:
        quotas.sandbox_resources({"nofile": 5000}, q, hard)
    assert e.value.detail["setting"] == "server.rlimit_nofile"
    loose = {"nofile": Ceiling(10_000, "server.rlimit_nofile", "x")}
    with pytest.raises(LimitExceeded) as e:
        quotas.sandbox_resources({"nofile": 5000}, q, loose)
    assert e.value.detail == {"setting": "quota.max_nofile", "limit": 4096}
    assert quotas.sandbox_resources({"nofile": 4096, "pids": 16}, q, loose).nofile == 4096


def test_tenant_room_counts_sandboxes_and_descriptors() -> None:
    q = {**quotas.default_quota(), "max_sandboxes": 3, "max_total_descriptors": 40_000}
    small = Resources(pids=16, nofile=1024)  # 16384
    one = quotas.Holding().plus({"pids": 16, "nofile": 1024})
    assert one == quotas.Holding(1, 16_384)
    quotas.check_tenant_room("t", q, one, small)
    with pytest.raises(QuotaExceeded) as e:
        quotas.check_tenant_room("t", q, one.plus(small), small)
    assert e.value.detail["setting"] == "quota.max_total_descriptors"
    assert e.value.detail["used"] == 32_768 and "its 2 live sandboxes" in e.value.message
    assert status_of(e.value.code) == 429
    with pytest.raises(QuotaExceeded) as e:
        loose = {**q, "max_total_descriptors": 10**9}
        quotas.check_tenant_room("t", loose, one.plus({"pids": 16, "nofile": 1024}, 2), small)
    assert e.value.detail["setting"] == "quota.max_sandboxes"


def test_disk_total_counts_every_source_and_the_new_sandbox_at_its_size() -> None:
    disk = DiskAccounting(DiskSettings(), None)
    disk.add_source(lambda t: [DiskUse("workspace", "sbx_a", 30 * MiB)] if t == "t" else [])
    disk.add_source(lambda t: [DiskUse("kept_workspace", "sbx_b", 50 * MiB)])
    q = {"max_total_disk_mb": 200}
    disk.check_room("t", q, 120)
    with pytest.raises(QuotaExceeded) as e:
        disk.check_room("t", q, 121)
    assert e.value.detail["setting"] == "quota.max_total_disk_mb"
    assert "80 MiB" in e.value.message and "1 kept" in e.value.message


def test_disk_bounds_spare_reading_the_host_until_the_total_is_near() -> None:
    """Within every source's bound nothing is read; past it, what is really used decides; a
    source whose bound is not known is read each time."""
    read: list[str] = []

    def live(tenant: str) -> list[DiskUse]:
        read.append(tenant)
        return [DiskUse("workspace", "sbx_a", 10 * MiB)]

    disk = DiskAccounting(DiskSettings(), None)
    bound: list[int | None] = [100 * MiB]
    disk.add_source(live, lambda t: bound[0])
    disk.add_source(lambda t: [DiskUse("snapshot", "snap_a", 20 * MiB)])
    q = {"max_total_disk_mb": 200}
    disk.check_room("t", q, 80)  # 100 + 20 + 80: within the bounds
    assert read == []
    disk.check_room("t", q, 170)  # past the bound: 10 really used + 20 + 170
    assert read == ["t"]
    with pytest.raises(QuotaExceeded) as e:
        disk.check_room("t", q, 171)
    assert e.value.detail["used_mb"] == 30
    bound[0] = None
    read.clear()
    disk.check_room("t", q, 1)
    assert read == ["t"]


def test_free_space_floor(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    DiskAccounting(DiskSettings(min_free_mb=0, min_free_percent=0), tmp_path).check_free_space()
    above = DiskSettings(min_free_mb=free / MiB * 2, min_free_percent=0)
    with pytest.raises(InsufficientStorage) as e:
        DiskAccounting(above, tmp_path).check_free_space()
    assert status_of(e.value.code) == 507 and e.value.code == "insufficient_storage"
    assert str(tmp_path) in e.value.message and e.value.detail["needed_bytes"] > free
    assert DiskAccounting(DiskSettings(), tmp_path).floor_bytes(10**12) == 5 * 10**10
    assert DiskAccounting(DiskSettings(), tmp_path).floor_bytes(10**9) == 2048 * MiB


def test_disk_settings_from_the_environment() -> None:
    s = DiskSettings.from_env({"AGENTBOX_KEPT_WORKSPACE_DAYS": "0.5"})
    assert s.kept_retention_s == 43_200 and s.min_free_mb == 2048
    for bad in ("x", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match="AGENTBOX_MIN_FREE_DISK_MB"):
            DiskSettings.from_env({"AGENTBOX_MIN_FREE_DISK_MB": bad})
