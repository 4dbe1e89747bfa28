"""Tenant quotas: what one sandbox may ask for, and what a tenant's live sandboxes may hold
together.

Every resource a sandbox can request (a `Resources` field) has a per-sandbox cap,
`quota.max_<resource>`, and none may pass what the runtime can give at all (its ceilings, such
as a hard rlimit the server cannot raise): asking more is refused with the setting named, never
left to fail in the spawn. Each of a sandbox's `pids` processes may open `nofile` files, so
`pids × nofile` is what it may take of the host's file table (fs.file-max), which every
sandbox, tenant and host process shares: that product is capped per sandbox (`max_descriptors`)
and summed over a tenant's live sandboxes (`max_total_descriptors`), with defaults derived from
the table's size. Disk is summed in core/disk.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentbox.core.errors import InvalidRequest, LimitExceeded, QuotaExceeded
from agentbox.runtimes.base import Ceiling, Resources

# Per resource, the quota key that caps it in one sandbox.
RESOURCE_CAPS = {
    "cpu_count": "max_cpu_count",
    "memory_mb": "max_memory_mb",
    "pids": "max_pids",
    "nofile": "max_nofile",
    "file_size_mb": "max_file_size_mb",
    "disk_mb": "max_disk_mb",
    "tmp_mb": "max_tmp_mb",
}
RESOURCE_MIN = {
    "memory_mb": 32,
    "cpu_count": 0.05,
    "pids": 16,
    "nofile": 64,
    "file_size_mb": 1,
    "disk_mb": 16,
    "tmp_mb": 1,
}
# Shares of the host's file table: one sandbox, and one tenant's live sandboxes together.
SANDBOX_TABLE_SHARE = 8  # an eighth
TENANT_TABLE_SHARE = 2  # a half
# A table at least this large is no limit (systemd sets fs.file-max to LONG_MAX).
_UNLIMITED_TABLE = 1 << 40


def host_file_table() -> int:
    """How many open files the host's kernel allows in all (fs.file-max); for an unlimited
    table, what the kernel would size it at by default (one file per 10 KiB of memory)."""
    try:
        table = int(Path("/proc/sys/fs/file-max").read_text())
    except (OSError, ValueError):
        table = _UNLIMITED_TABLE
    if table < _UNLIMITED_TABLE:
        return table
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 10
    except (OSError, ValueError):
        pass
    return 1 << 20


def default_quota(file_table: int | None = None) -> dict[str, Any]:
    """Every tenant's quota until an admin sets its own values (docs/API.md lists them)."""
    table = host_file_table() if file_table is None else file_table
    usual = Resources()
    # Never below what a sandbox with the default resources takes: on a host whose table is
    # that small, the defaults would refuse every default create.
    per_sandbox = max(table // SANDBOX_TABLE_SHARE, usual.pids * usual.nofile)
    return {
        "max_sandboxes": 20,
        "max_memory_mb": 4096,
        "max_cpu_count": float(os.cpu_count() or 1),
        "max_timeout": 86_400,
        "max_disk_mb": 10_240,
        "max_pids": 4096,
        "max_nofile": 65_536,
        "max_file_size_mb": 10_240,
        "max_tmp_mb": 4096,
        "max_descriptors": per_sandbox,
        "max_total_descriptors": max(table // TENANT_TABLE_SHARE, per_sandbox),
        "max_total_disk_mb": 51_200,
        "max_snapshots": 50,
        "max_paused": 20,
        "max_volumes": 20,
    }


def descriptors(resources: Resources | Mapping[str, Any]) -> int:
    """What a sandbox may take of the host's file table: each process `nofile` files."""
    if isinstance(resources, Resources):
        return resources.pids * resources.nofile
    usual = Resources()
    return int(resources.get("pids", usual.pids)) * int(resources.get("nofile", usual.nofile))


def sandbox_resources(
    requested: Mapping[str, Any], quota: Mapping[str, Any], ceilings: Mapping[str, Ceiling]
) -> Resources:
    """The resources of a new sandbox: the defaults with what was asked, if the tenant may."""
    unknown = set(requested) - set(Resources.__dataclass_fields__)
    if unknown:
        raise InvalidRequest(f"unknown resources: {', '.join(sorted(unknown))}")
    res = Resources(**{k: v for k, v in requested.items() if v is not None})
    for name, minimum in RESOURCE_MIN.items():
        if getattr(res, name) < minimum:
            raise InvalidRequest(f"resources.{name} must be at least {minimum}")
    for name, cap in RESOURCE_CAPS.items():
        _check_cap(name, getattr(res, name), cap, quota[cap], ceilings.get(name))
    held, most = descriptors(res), quota["max_descriptors"]
    if held > most:
        raise LimitExceeded(
            f"resources.pids × resources.nofile = {res.pids} × {res.nofile} = {held} open files "
            f"is above your tenant's per-sandbox limit of {most} (each process may open nofile "
            "files, and the host's file table is shared); ask for fewer pids or a lower nofile, "
            "or have an admin raise quota.max_descriptors",
            setting="quota.max_descriptors",
            limit=most,
        )
    return res


def _check_cap(name: str, value: float, cap: str, most: float, ceiling: Ceiling | None) -> None:
    """Refuse a value above the lower of the tenant's cap and the runtime's ceiling, naming
    whichever it is."""
    if ceiling is not None and value > ceiling.limit and ceiling.limit < most:
        raise LimitExceeded(
            f"resources.{name}={value} is above {ceiling.reason}; ask for at most {ceiling.limit}",
            setting=ceiling.setting,
            limit=ceiling.limit,
        )
    if value > most:
        raise LimitExceeded(
            f"resources.{name}={value} is above your tenant's limit of {most}; ask for less "
            f"or have an admin raise quota.{cap}",
            setting=f"quota.{cap}",
            limit=most,
        )


@dataclass(frozen=True)
class Holding:
    """What a tenant's live sandboxes hold of the host: how many they are, and the descriptors
    they may open together (`descriptors` of each, summed)."""

    sandboxes: int = 0
    descriptors: int = 0

    def plus(self, resources: Resources | Mapping[str, Any], count: int = 1) -> Holding:
        return Holding(self.sandboxes + count, self.descriptors + count * descriptors(resources))


def check_tenant_room(tenant: str, quota: Mapping[str, Any], held: Holding, new: Resources) -> None:
    """Whether the tenant may add a sandbox with `new` resources to what its live sandboxes
    hold: the sandbox count and the descriptors they may open together."""
    if held.sandboxes >= quota["max_sandboxes"]:
        raise QuotaExceeded(
            f"tenant {tenant} already has {held.sandboxes} running sandboxes, its limit "
            f"is {quota['max_sandboxes']}; kill one or ask an admin to raise "
            "quota.max_sandboxes",
            setting="quota.max_sandboxes",
            limit=quota["max_sandboxes"],
        )
    asked, most = descriptors(new), quota["max_total_descriptors"]
    if held.descriptors + asked > most:
        raise QuotaExceeded(
            f"tenant {tenant}'s live sandboxes may together open {most} files (pids × nofile "
            f"of each, summed); its {held.sandboxes} live sandboxes may open "
            f"{held.descriptors} and this one asks {new.pids} × {new.nofile} = {asked}; kill "
            "one, ask for fewer pids or a lower nofile, or ask an admin to raise "
            "quota.max_total_descriptors",
            setting="quota.max_total_descriptors",
            limit=most,
            used=held.descriptors,
        )
