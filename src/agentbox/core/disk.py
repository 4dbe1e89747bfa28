"""Disk: what each tenant takes of the server's disk, in one accounting, and the free-space floor
below which nothing new is created.

Usage is real: the blocks a workspace really holds on the host (images are sparse, so a 1 GiB
workspace with 10 MiB written costs about 10 MiB), for live sandboxes and kept workspaces alike;
snapshots' images count by their real blocks too (core/snapshots.py), volumes at their size
(core/volumes.py: what they may grow to). A new sandbox counts at the size it asked for
(`resources.disk_mb`), which it may grow to, and so does one still starting: a tenant goes
past `quota.max_total_disk_mb` only by the growth of sandboxes already running, and no new one
starts then.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentbox.core.errors import InsufficientStorage, QuotaExceeded
from agentbox.runtimes.base import Resources
from agentbox.store.db import Store

if TYPE_CHECKING:
    from agentbox.core.runtimes import Runtimes

MiB = 2**20


@dataclass(frozen=True)
class DiskUse:
    """One thing of a tenant's on the disk, and the bytes it really takes."""

    kind: str  # "workspace" (a live sandbox's), "kept_workspace" or "snapshot"
    sandbox_id: str
    used_bytes: int


# A source of disk uses: tenant -> what of its is on the disk.
UsageSource = Callable[[str], Iterable[DiskUse]]
# A source's bound: tenant -> the most its uses can be, known without reading the host (None:
# not known then). A create within every bound needs no reading of the host.
UsageBound = Callable[[str], "int | None"]
# What a workspace image may take beyond its size: its extent blocks on the host's filesystem.
IMAGE_SLACK = MiB


@dataclass(frozen=True)
class DiskSettings:
    """The operator's disk settings (environment variables, docs/API.md)."""

    min_free_mb: float = 2048  # AGENTBOX_MIN_FREE_DISK_MB
    min_free_percent: float = 5.0  # AGENTBOX_MIN_FREE_DISK_PERCENT
    kept_retention_s: float = 7 * 86_400  # AGENTBOX_KEPT_WORKSPACE_DAYS
    paused_retention_s: float = 7 * 86_400  # AGENTBOX_PAUSED_RETENTION_DAYS

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> DiskSettings:
        defaults = cls()

        def number(name: str, default: float) -> float:
            raw = env.get(name, "").strip()
            try:
                value = float(raw) if raw else default
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a number") from None
            if not 0 <= value < float("inf"):
                raise ValueError(f"{name}={raw!r} must be a number >= 0")
            return value

        return cls(
            min_free_mb=number("AGENTBOX_MIN_FREE_DISK_MB", defaults.min_free_mb),
            min_free_percent=number("AGENTBOX_MIN_FREE_DISK_PERCENT", defaults.min_free_percent),
            kept_retention_s=number(
                "AGENTBOX_KEPT_WORKSPACE_DAYS", defaults.kept_retention_s / 86_400
            )
            * 86_400,
            paused_retention_s=number(
                "AGENTBOX_PAUSED_RETENTION_DAYS", defaults.paused_retention_s / 86_400
            )
            * 86_400,
        )


class DiskAccounting:
    """Per tenant, every source's uses summed; the quota and free-space checks of a create."""

    def __init__(self, settings: DiskSettings, storage: Path | None) -> None:
        self.settings = settings
        self.storage = storage  # a path on the filesystem the floor protects
        self._sources: list[tuple[UsageSource, UsageBound | None]] = []

    def add_source(self, source: UsageSource, bound: UsageBound | None = None) -> None:
        self._sources.append((source, bound))

    def usage(self, tenant: str) -> list[DiskUse]:
        """Everything of the tenant's on the disk (reads the host: call it in a thread)."""
        return [use for source, _ in self._sources for use in source(tenant)]

    def check_room(self, tenant: str, quota: Mapping[str, Any], asked_mb: int) -> None:
        """Refuse a new sandbox of `asked_mb` that would take the tenant past its total. The
        sources' bounds first: within them, what is really used need not be read (a stat of
        every live workspace of the tenant's, which at thousands is most of a create)."""
        most = quota["max_total_disk_mb"]
        measured: dict[int, list[DiskUse]] = {}
        bound = 0
        for i, (source, upper) in enumerate(self._sources):
            known = None if upper is None else upper(tenant)
            if known is None:
                measured[i] = list(source(tenant))
                known = sum(u.used_bytes for u in measured[i])
            bound += known
        if bound + asked_mb * MiB <= most * MiB:
            return
        uses = [
            use
            for i, (source, _) in enumerate(self._sources)
            for use in (measured[i] if i in measured else source(tenant))
        ]
        used = sum(u.used_bytes for u in uses)
        if used + asked_mb * MiB <= most * MiB:
            return
        kinds = {
            k: sum(1 for u in uses if u.kind == k)
            for k in ("workspace", "kept_workspace", "snapshot", "volume")
        }
        raise QuotaExceeded(
            f"tenant {tenant} uses {used / MiB:.0f} MiB of disk ({kinds['workspace']} live and "
            f"{kinds['kept_workspace']} kept workspaces, {kinds['snapshot']} snapshots, "
            f"{kinds['volume']} volumes) and this would take "
            f"{asked_mb} MiB more, above its limit of {most} MiB; delete kept workspaces "
            "(DELETE /v1/workspaces/{sandbox_id}), snapshots or volumes, "
            "kill sandboxes, ask for a smaller disk_mb, or ask an admin to raise "
            "quota.max_total_disk_mb",
            setting="quota.max_total_disk_mb",
            limit=most,
            used_mb=round(used / MiB, 1),
        )

    def floor_bytes(self, size: int) -> int:
        """The free space a filesystem of `size` bytes must keep: max(5 %, 2 GiB) by default."""
        s = self.settings
        return int(max(size * s.min_free_percent / 100, s.min_free_mb * MiB))

    def check_free_space(self) -> None:
        """Refuse to create anything on a disk that is nearly full (507)."""
        if self.storage is None:
            return
        st = os.statvfs(self.storage)
        free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        floor = self.floor_bytes(size)
        if free >= floor:
            return
        raise InsufficientStorage(
            f"the server's disk is nearly full: the filesystem of its data dir ({self.storage}) "
            f"has {free} bytes free and must keep {floor} (max({self.settings.min_free_percent:g}"
            f" % of {size}, {self.settings.min_free_mb:g} MiB)); no sandbox is created until "
            "space is freed: delete kept workspaces or unused templates, or give the data dir "
            "more room",
            free_bytes=free,
            needed_bytes=floor,
            path=str(self.storage),
        )


def live_workspaces(store: Store, runtimes: Runtimes) -> UsageSource:
    """The workspaces of a tenant's live sandboxes: their real usage once running, the size
    they asked for while starting (or when the runtime cannot tell)."""

    def uses(tenant: str) -> list[DiskUse]:
        found = []
        for row in store.live_sandboxes(tenant):
            used = None
            if row.runtime_state is not None and runtimes.serves(row):
                runtime = runtimes.for_row(row)
                used = runtime.workspace_bytes(row.sandbox_id, row.runtime_state)
            if used is None:
                used = int(row.resources.get("disk_mb", Resources().disk_mb)) * MiB
            found.append(DiskUse("workspace", row.sandbox_id, used))
        return found

    return uses


def live_workspaces_bound(store: Store, runtimes: Runtimes) -> UsageBound:
    """The most a tenant's live workspaces can take: the sizes they asked for, where their
    runtime holds a workspace to its size (a loop image); not known if one's runtime does not."""

    def bound(tenant: str) -> int | None:
        total = 0
        for runtime, (count, mb) in store.tenant_disk_mb(tenant, Resources().disk_mb).items():
            if runtime in runtimes.names() and "disk_mb" not in runtimes.features(runtime).enforces:
                return None
            total += mb * MiB + count * IMAGE_SLACK
        return total

    return bound
