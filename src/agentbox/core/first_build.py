"""A create whose template is not built yet: it answers at once with a sandbox in `building`,
and the template's first-use build, then the sandbox's start, go on in the background; the
row says how they went (running, failed with `build_failed`, or killed meanwhile).

Part of sandbox creation (core/creation.py), which hands such creates here.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from agentbox.core.auth import Caller
from agentbox.core.errors import AgentboxError
from agentbox.core.network import SandboxNetwork
from agentbox.core.requests import CreateRequest
from agentbox.core.states import SandboxState
from agentbox.runtimes.base import Resources
from agentbox.store.db import DETAIL_STRING_CHARS, SandboxRow
from agentbox.vocab import ErrorCode, status_of

if TYPE_CHECKING:
    from agentbox.core.creation import Creation

log = logging.getLogger("agentbox.manager")

BUILDING = SandboxState.BUILDING  # a create waiting for the first-use build of its template
BUILD_ALLOWANCE_S = 3600.0  # a `building` sandbox ends (timeout) if its build takes longer
# A start or first-use build that failed is audited as the sandbox being unavailable.
START_FAILED = status_of(ErrorCode.SANDBOX_UNAVAILABLE)


class FirstUseBuild:
    def __init__(self, creation: Creation) -> None:
        self.creation = creation
        self.core = creation.core

    async def create(
        self,
        caller: Caller,
        template: str,
        req: CreateRequest,
        quota: dict[str, Any],
        resources: Resources,
        net: SandboxNetwork,
    ) -> SandboxRow:
        """A create that must wait for a first-use build answers at once with a `building`
        sandbox (no client waits minutes on one request); the build, then the start, go on
        here, and the row tells how they went."""
        started = time.monotonic()
        sandbox_id = "sbx_" + secrets.token_hex(8)
        async with self.core.table.tenant_lock(caller.tenant):
            await self.core.admission.check_capacity(caller, quota, started, resources)
            # Its deadline counts from when it runs; until then the build has an hour.
            self.creation.insert(
                sandbox_id, caller.tenant, template, req, resources, net, None, BUILDING,
                BUILD_ALLOWANCE_S,
            )  # fmt: skip
        task = asyncio.create_task(self._build_then_start(caller, sandbox_id, req, resources, net))
        self.core.watchers.add(task)
        task.add_done_callback(self.core.watchers.discard)
        self.core.audit(
            caller, "sandbox.create", sandbox_id, status=202, started=started, template=template,
            building=True,
        )  # fmt: skip
        row = self.core.store.get_sandbox(sandbox_id)
        assert row is not None
        return row

    async def _build_then_start(
        self,
        caller: Caller,
        sandbox_id: str,
        req: CreateRequest,
        resources: Resources,
        net: SandboxNetwork,
    ) -> None:
        row = self.core.store.get_sandbox(sandbox_id)
        assert row is not None
        try:
            tpl = await self.core.template(row.template)
            assert tpl is not None  # only a template that needs a build gets here
            row = self.core.store.get_sandbox(sandbox_id)
            if row is None or row.state != BUILDING:
                return  # killed while it waited
            egress = self.core.network.setup(row.tenant, sandbox_id, req.secrets, str(tpl.rootfs))
        except Exception as e:  # noqa: BLE001 - whatever it was, the row must say it
            if not isinstance(e, AgentboxError):
                log.exception("the first-use build for %s failed", sandbox_id)
            self._fail(caller, sandbox_id, getattr(e, "message", None) or str(e))
            return
        # No await from the check above to here: a kill sees `building` or `starting`.
        moved = self.core.states.move(
            sandbox_id, SandboxState.STARTING, only_from=frozenset({BUILDING}),
            secrets=egress.placeholders or None,
        )  # fmt: skip
        if moved is None:
            await self.core.network.forget(sandbox_id)
            return  # killed while it was building
        try:
            await self.creation.start(
                sandbox_id, tpl, row.template, resources, req.envs, req.timeout,
                egress, net, row.tenant, row.runtime,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - _start recorded how it ended; add why
            message = e.message if isinstance(e, AgentboxError) else str(e)
            self.core.store.update_sandbox(sandbox_id, error=message[:DETAIL_STRING_CHARS])
            self.core.audit(caller, "sandbox.start", sandbox_id, status=START_FAILED, error=message)
            return
        self.core.audit(caller, "sandbox.start", sandbox_id, status=200, template=row.template)

    def _fail(self, caller: Caller, sandbox_id: str, message: str) -> None:
        moved = self.core.states.move(
            sandbox_id,
            SandboxState.FAILED,
            only_from=frozenset({BUILDING}),
            end_reason="build_failed",
            ended_at=time.time(),
            error=message[:DETAIL_STRING_CHARS],
        )
        if moved is None:
            return  # killed (or timed out) while it was building
        self.core.audit(caller, "sandbox.start", sandbox_id, status=START_FAILED, error=message)
