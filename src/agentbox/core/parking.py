"""Pausing sandboxes without their memory ("parking"): their processes end and all they hold
on the host is given back but their disk, from which a resume boots them fresh.

The row says where a sandbox is (`park`: "parking" from the moment the pause begins, "parked"
once only its disk is left, also while it starts again from it), so a server that stops at any
point finds a sandbox to park again (core/supervision.py), never one whose disk it would remove.
A service of the core (core/manager.py, the front object).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from agentbox.core import quotas
from agentbox.core.errors import AgentboxError, Conflict, SandboxNotRunning, SandboxUnavailable
from agentbox.core.network import SandboxNetwork
from agentbox.core.snapshots import StartFrom
from agentbox.core.states import SandboxState
from agentbox.core.template_service import HOST_TEMPLATE, TEMPLATE_ROOTFS
from agentbox.runtimes.base import Parkable, Resources, RuntimeError_
from agentbox.store.db import PARKED, PARKING, SandboxRow

if TYPE_CHECKING:
    from agentbox.core.manager import SandboxManager

log = logging.getLogger("agentbox.lifecycle")


class Parking:
    """Parking a running sandbox, recording it parked, starting it again from its disk (or
    parking it again when that fails)."""

    def __init__(self, core: SandboxManager) -> None:
        self.core = core

    async def park(self, row: SandboxRow, runtime: Any, ttl_left: float) -> None:
        """Pause a running sandbox without its memory (its lock held): its processes end, its
        egress and commands are forgotten, its disk is kept."""
        sandbox_id = row.sandbox_id
        assert row.runtime_state is not None and isinstance(runtime, Parkable)
        self.core.table.running.pop(sandbox_id, None)
        self.core.table.unhealthy.pop(sandbox_id, None)
        self.core.table.pausing.add(sandbox_id)
        try:
            self.core.table.abort_requests(sandbox_id)
            # Recorded first: a server that stops from here on finds a sandbox to park (its
            # processes may be gone), not one that vanished (whose disk would go).
            self.core.store.update_sandbox(sandbox_id, park=PARKING)
            await self.core.network.forget(sandbox_id)
            try:
                state = await runtime.park(sandbox_id, row.runtime_state)
            except RuntimeError_ as e:
                # Whatever is left of it ends as a vanished sandbox does (the health loop).
                self.core.table.running[sandbox_id] = row
                raise SandboxUnavailable(f"sandbox {sandbox_id} could not pause: {e}") from None
            self.core.commands.forget(sandbox_id)
            await self.core.volumes.detach(sandbox_id)
            await self.record(sandbox_id, row, state, SandboxState.RUNNING, ttl_left)
        finally:
            self.core.table.pausing.discard(sandbox_id)

    async def record(
        self,
        sandbox_id: str,
        row: SandboxRow,
        state: dict[str, Any],
        old: SandboxState,
        ttl_left: float,
    ) -> None:
        """Record a parked sandbox as paused (from `old`: running, or starting when its resume
        failed); its template tree stays noted, so a rebuild keeps it."""
        rootfs = (row.runtime_state or {}).get(TEMPLATE_ROOTFS)
        if rootfs:
            state = {**state, TEMPLATE_ROOTFS: rootfs}
        now = time.time()
        change = self.core.states.move(
            sandbox_id,
            SandboxState.PAUSED,
            only_from=frozenset({old}),
            runtime_state=state,
            paused_at=now,
            ttl_left=ttl_left,
            end_at=now + self.core.paused_retention_s,
            park=PARKED,
        )
        if change is None:
            raise SandboxNotRunning(f"sandbox {sandbox_id} ended", state="ended")
        paused = self.core.store.get_sandbox(sandbox_id)
        if paused is not None:
            self.core.table.paused[sandbox_id] = paused

    async def unpark(self, row: SandboxRow, runtime: Any, timeout: float | None) -> None:
        """Start a sandbox paused without memory again from its disk: `starting` meanwhile,
        `running` with the time it had left (or `timeout` if longer), or `paused` again, its
        disk as it was, if it cannot start."""
        sandbox_id = row.sandbox_id
        quota = self.core.quota(row.tenant)
        # Running again, it holds what a running sandbox holds: it needs room for that.
        async with self.core.table.tenant_lock(row.tenant), self.core.table.lock(sandbox_id):
            fresh = self.core.store.get_sandbox(sandbox_id)
            if fresh is None or fresh.state != SandboxState.PAUSED:
                return
            held = self.core.admission.holding(row.tenant)
            quotas.check_tenant_room(row.tenant, quota, held, Resources(**fresh.resources))
            ttl = max(fresh.ttl_left or 0.0, timeout or 0.0)
            moved = self.core.states.move(
                sandbox_id, SandboxState.STARTING, only_from=frozenset({SandboxState.PAUSED})
            )
            self.core.table.paused.pop(sandbox_id, None)
            if moved is None:
                return
        try:
            await self._restart(fresh, ttl)
        except SandboxNotRunning:
            raise  # killed while it started
        except Exception as e:  # noqa: BLE001 - whatever it was, it is paused again
            try:
                async with self.core.table.lock(sandbox_id):
                    await self._repark(fresh, runtime, ttl)
            except Exception:  # noqa: BLE001 - the next server start tries again
                log.exception("sandbox %s: could not be paused again", sandbox_id)
            why = e.message if isinstance(e, AgentboxError) else str(e)
            kind = Conflict if isinstance(e, Conflict) else SandboxUnavailable
            raise kind(
                f"sandbox {sandbox_id} could not start again from its disk, which is kept: "
                f"it is paused as before ({why})"
            ) from None

    async def _repark(self, row: SandboxRow, runtime: Any, ttl_left: float) -> None:
        """A sandbox `starting` from its parked disk that will not start: paused again (what
        of it started ends, its disk stays)."""
        assert isinstance(runtime, Parkable)
        await self.core.network.forget(row.sandbox_id)
        state = await runtime.park(row.sandbox_id, None)
        self.core.commands.forget(row.sandbox_id)
        await self.core.volumes.detach(row.sandbox_id)
        await self.record(row.sandbox_id, row, state, SandboxState.STARTING, ttl_left)

    async def _restart(self, row: SandboxRow, timeout: float) -> SandboxRow:
        """Start a sandbox paused without memory (`starting` now) again on its parked disk,
        under its own id, with what it was created with (template, resources, environment,
        network, secrets: new placeholders). Raises if it does not start, leaving it
        `starting` with its disk parked, for `unpark` to pause again."""
        state = row.runtime_state or {}
        runtime = self.core.runtimes.get(row.runtime)
        assert isinstance(runtime, Parkable)
        tpl = None
        if row.template != HOST_TEMPLATE:
            start = StartFrom(
                template=row.template, runtime=row.runtime, disk_mb=0,
                disk=runtime.parked_disk(row.sandbox_id, state),
                rootfs=state.get(TEMPLATE_ROOTFS), origin={},
            )  # fmt: skip
            tpl = await self.core.snapshots.image_template(start)
        egress = self.core.network.setup(
            row.tenant, row.sandbox_id, sorted(row.secrets or {}), str(tpl.rootfs) if tpl else None
        )
        self.core.store.update_sandbox(row.sandbox_id, secrets=egress.placeholders or None)
        return await self.core.creation.start(
            row.sandbox_id, tpl, row.template, Resources(**row.resources), row.envs or {},
            timeout, egress, SandboxNetwork.from_dict(row.network), row.tenant, row.runtime,
            disk=runtime.parked_disk(row.sandbox_id, state), resuming=True, volumes=row.volumes,
        )  # fmt: skip
