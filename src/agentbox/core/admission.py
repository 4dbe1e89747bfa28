"""Admission: what a tenant may have (its quota over the host's defaults), what a sandbox gets
(its resources within the quota and the runtime's ceilings), and whether there is room for one
more (the tenant's live sandboxes, descriptors and disk; the host's free space)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from agentbox.core import quotas
from agentbox.core.auth import Caller
from agentbox.core.disk import DiskAccounting
from agentbox.core.errors import AgentboxError, QuotaExceeded
from agentbox.core.runtimes import Runtimes
from agentbox.runtimes.base import Resources
from agentbox.store.db import Store
from agentbox.vocab import status_of


class Admission:
    def __init__(
        self,
        store: Store,
        runtimes: Runtimes,
        disk: DiskAccounting,
        default_quota: dict[str, Any],
        audit: Callable[..., None],
    ) -> None:
        self.store = store
        self.runtimes = runtimes
        self.disk = disk
        self.default_quota = default_quota
        self.audit = audit

    def quota(self, tenant: str) -> dict[str, Any]:
        return {**self.default_quota, **self.store.get_quota(tenant)}

    def set_quota(self, caller: Caller, tenant: str, values: dict[str, Any]) -> dict[str, Any]:
        # A runtime named must be one this server serves (a typo would refuse every create).
        for name in [values.get("default_runtime"), *(values.get("runtimes") or [])]:
            if name is not None:
                self.runtimes.get(name)
        merged = {**self.store.get_quota(tenant), **values}
        self.store.set_quota(tenant, merged)
        self.audit(caller, "quota.set", tenant=tenant, quota=values)
        return self.quota(tenant)

    def resources(
        self, requested: dict[str, Any], quota: dict[str, Any], runtime: str
    ) -> Resources:
        """What a sandbox on `runtime` gets: its request within the quota and what that runtime
        can give on this host."""
        ceilings = self.runtimes.get(runtime).resource_ceilings()
        return quotas.sandbox_resources(requested, quota, ceilings)

    async def check_capacity(
        self, caller: Caller, quota: dict[str, Any], started: float, resources: Resources
    ) -> None:
        """Under the tenant's lock: room for one more sandbox of `resources` (sandbox count,
        descriptors and disk summed over the tenant's live sandboxes)."""
        try:
            quotas.check_tenant_room(caller.tenant, quota, self.holding(caller.tenant), resources)
            await asyncio.to_thread(self.disk.check_room, caller.tenant, quota, resources.disk_mb)
        except AgentboxError as e:
            self._refused(caller, started, e)
            raise

    def holding(self, tenant: str) -> quotas.Holding:
        """What the tenant's live sandboxes hold (a sandbox paused without memory holds only
        its disk, which the disk accounting counts)."""
        usual = Resources()
        count, held = self.store.tenant_holding(tenant, usual.pids, usual.nofile)
        return quotas.Holding(count, held)

    def check_paused_room(self, caller: Caller, quota: dict[str, Any]) -> None:
        """Room for one more paused sandbox (`quota.max_paused`)."""
        paused = [r for r in self.store.live_sandboxes(caller.tenant) if r.state == "paused"]
        if len(paused) >= quota["max_paused"]:
            raise QuotaExceeded(
                f"tenant {caller.tenant} has {len(paused)} paused sandboxes, its limit is "
                f"{quota['max_paused']}; resume or kill one, or ask an admin to raise "
                "quota.max_paused",
                setting="quota.max_paused",
                limit=quota["max_paused"],
            )

    def check_free_space(self, caller: Caller | None, started: float) -> None:
        try:
            self.disk.check_free_space()
        except AgentboxError as e:
            if caller is not None:
                self._refused(caller, started, e)
            raise

    def _refused(self, caller: Caller, started: float, e: AgentboxError) -> None:
        self.audit(
            caller, "sandbox.create", status=status_of(e.code), started=started, error=e.code
        )
