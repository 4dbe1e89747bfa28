"""Warm pools as the control plane runs them: members made and ended, a ready member handed to
a create (a claim), and pool sizes shown and set. The refill mechanics are core/pools.py's.

A service of the core (see core/manager.py, the front object).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from agentbox.agent.client import AgentOpError, AgentUnavailable
from agentbox.core.auth import Caller
from agentbox.core.errors import InvalidRequest, NotFound, SandboxUnavailable
from agentbox.core.network import SandboxNetwork, new_access_token
from agentbox.core.pools import MAX_POOL_SIZE, POOL_TENANT, pool_name, split_pool_name
from agentbox.core.requests import CreateRequest
from agentbox.core.states import SandboxState
from agentbox.core.template_service import HOST_TEMPLATE
from agentbox.runtimes.base import Resources
from agentbox.store.db import SandboxRow
from agentbox.templates import builtin_spec_path

if TYPE_CHECKING:
    from agentbox.core.manager import SandboxManager

log = logging.getLogger("agentbox.manager")

POOL_LIFETIME_S = 10 * 365 * 86_400  # members never expire; a claim sets the real deadline


class PoolService:
    def __init__(self, core: SandboxManager) -> None:
        self.core = core

    async def claim(
        self,
        caller: Caller,
        template: str,
        req: CreateRequest,
        quota: dict[str, Any],
        started: float,
        net: SandboxNetwork,
    ) -> SandboxRow | None:
        """Hand a ready pool member to the caller; None when there is none (a cold create)."""
        assert req.runtime is not None
        name = pool_name(template, req.runtime, self.core.runtimes.default)
        if name not in self.core.pools.pools:
            return None
        lock = self.core.table.tenant_lock(caller.tenant)
        async with lock:
            await self.core.admission.check_capacity(caller, quota, started, Resources())
            sid = self.core.pools.take(name, self.usable_member, caller.tenant)
            if sid is None:
                return None
            now = time.time()
            self.core.store.update_sandbox(
                sid,
                tenant=caller.tenant,
                metadata=req.metadata,
                created_at=now,
                end_at=now + req.timeout,
                network=net.to_dict(),
                access_token=new_access_token(),
            )
            row = self.core.store.get_sandbox(sid)
            assert row is not None
            self.core.table.running[sid] = row
            self.core.network.proxy.update(sid, net.policy, caller.tenant)
        self.core.wake.set()
        if req.envs:
            try:
                await self.core.client(row).set_env(req.envs)
            except (AgentOpError, AgentUnavailable) as e:
                await self.core.lifecycle.end(row, SandboxState.FAILED, "failed")
                log.warning("claimed pool member %s failed its hand-over: %s", sid, e)
                return None
        self.core.audit(
            caller,
            "sandbox.create",
            sid,
            status=201,
            started=started,
            template=template,
            timeout=req.timeout,
            resources=row.resources,
            pool="hit",
            network=net.to_dict(),
        )
        return row

    def name(self, given: str) -> str:
        """A pool's name as the server keeps it: the template resolved (`default`), the
        runtime dropped when it is the server's default."""
        template, runtime = split_pool_name(given)
        template = self.core.template_service.resolve(template)
        default = self.core.runtimes.default
        return pool_name(template, runtime or default, default)

    async def make_member(self, name: str) -> str:
        self.core.admission.check_free_space(None, time.monotonic())
        template, runtime = split_pool_name(name)
        row = await self.core.creation.start_reserved(
            POOL_TENANT, template, POOL_LIFETIME_S, runtime or self.core.runtimes.default
        )
        sandbox_id = row.sandbox_id
        try:
            await self.core.creation.run_true(row)
        except SandboxUnavailable as e:
            await self.core.lifecycle.end(row, SandboxState.FAILED, "failed")
            raise SandboxUnavailable(f"the new pool member did not work: {e.message}") from None
        self.core.audit(None, "pool.refill", sandbox_id, tenant=POOL_TENANT, template=name)
        return sandbox_id

    async def end_member(self, sandbox_id: str) -> None:
        row = self.core.store.get_sandbox(sandbox_id)
        if row is not None and row.tenant == POOL_TENANT:
            await self.core.lifecycle.end(row, SandboxState.KILLED, "pool_shrunk")

    def usable_member(self, sandbox_id: str) -> bool:
        return sandbox_id in self.core.table.running and sandbox_id not in self.core.table.unhealthy

    def pool_stats(self, caller: Caller) -> list[dict[str, Any]]:
        """Every pool; an admin sees all of its numbers, a tenant its own hits and misses."""
        return self.core.pools.stats(None if caller.admin else caller.tenant)

    async def set_pool_size(self, caller: Caller, template: str, size: int) -> dict[str, Any]:
        """`template` names the pool: a template, `@RUNTIME` for another runtime than the
        server's default (`code-interpreter@gvisor`)."""
        if not 0 <= size <= MAX_POOL_SIZE:
            raise InvalidRequest(f"pool size must be between 0 and {MAX_POOL_SIZE}")
        name = self.name(template)
        template, runtime = split_pool_name(name)
        if runtime is not None:
            self.core.runtimes.get(runtime)  # one this server serves
        if template != HOST_TEMPLATE and (
            self.core.templates.get(template) is None and builtin_spec_path(template) is None
        ):
            raise NotFound(f"unknown template {template!r}; build it first", template=template)
        pool = await self.core.pools.set_size(name, size)
        self.core.audit(caller, "pool.set", template=name, size=size)
        return pool.stats()
