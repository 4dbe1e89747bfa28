"""How the manager reaches a sandbox for a caller: its row as the caller may see it (another
tenant's is not found; `unhealthy` while its agent is silent; why it cannot be served when it
is not running), and its agent, with the agent's failures turned into audited API errors.

`SandboxAccess` is a part of `SandboxManager` (its base): the services call these through the
manager they are given.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from agentbox.agent.client import AgentClient, AgentOpError, AgentUnavailable
from agentbox.core.auth import Caller
from agentbox.core.errors import (
    AgentboxError,
    NotFound,
    SandboxNotRunning,
    SandboxUnavailable,
    SandboxUnhealthy,
    from_agent,
)
from agentbox.core.pools import POOL_TENANT
from agentbox.core.states import UNHEALTHY, SandboxState
from agentbox.runtimes.base import RuntimeError_
from agentbox.store.db import SandboxRow
from agentbox.vocab import status_of

if TYPE_CHECKING:
    from agentbox.core.audit import Audit
    from agentbox.core.lifecycle import Lifecycle
    from agentbox.core.runtimes import Runtimes
    from agentbox.core.table import SandboxTable
    from agentbox.store.db import Store

log = logging.getLogger("agentbox.manager")
T = TypeVar("T")


class SandboxAccess:
    """Set by SandboxManager: the records, the live table, the runtimes, the audit and the
    lifecycle (a paused sandbox woken by a request)."""

    store: Store
    table: SandboxTable
    runtimes: Runtimes
    audit: Audit
    lifecycle: Lifecycle

    def get(self, caller: Caller, sandbox_id: str) -> SandboxRow:
        """The caller's sandbox as the API shows it (`unhealthy` while its agent is silent)."""
        return self._shown(self.owned(caller, sandbox_id))

    def owned(self, caller: Caller, sandbox_id: str) -> SandboxRow:
        row = self.table.running.get(sandbox_id) or self.store.get_sandbox(sandbox_id)
        # Another tenant's sandbox is indistinguishable from one that never existed.
        if row is None or row.tenant != caller.tenant:
            raise NotFound(f"sandbox {sandbox_id} not found")
        return row

    def _shown(self, row: SandboxRow) -> SandboxRow:
        if row.state == SandboxState.RUNNING and row.sandbox_id in self.table.unhealthy:
            return dataclasses.replace(row, state=UNHEALTHY)
        return row

    def running(self, caller: Caller, sandbox_id: str) -> SandboxRow:
        row = self.owned(caller, sandbox_id)
        if row.state != SandboxState.RUNNING or sandbox_id in self.table.pausing:
            raise self.not_running(row)
        return row

    def not_running(self, row: SandboxRow) -> SandboxNotRunning:
        """Why a request to a sandbox that is not running cannot be served, and what to do."""
        sid = row.sandbox_id
        if row.state == SandboxState.PAUSED or sid in self.table.pausing:
            return SandboxNotRunning(
                f"sandbox {sid} is paused; resume it first (POST /v1/sandboxes/{sid}/resume, "
                "`agentbox resume`, Sandbox.resume())",
                state=SandboxState.PAUSED.value,
            )
        reason = f" ({row.end_reason})" if row.end_reason else ""
        return SandboxNotRunning(
            f"sandbox {sid} is {row.state}{reason}; create a new sandbox",
            state=row.state,
            end_reason=row.end_reason,
        )

    async def awake(self, caller: Caller, sandbox_id: str) -> SandboxRow:
        """`reachable`, after resuming the sandbox if it is paused and was created to be
        woken by requests (lifecycle `auto_resume`)."""
        row = self.owned(caller, sandbox_id)
        if row.state == SandboxState.PAUSED and (row.lifecycle or {}).get("auto_resume"):
            await self.lifecycle.resume(caller, sandbox_id)
        return self.reachable(caller, sandbox_id)

    def reachable(self, caller: Caller, sandbox_id: str) -> SandboxRow:
        """A running sandbox whose agent answers (requests to a silent one fail at once)."""
        row = self.running(caller, sandbox_id)
        if sandbox_id in self.table.unhealthy:
            raise self._unhealthy_error(sandbox_id)
        return row

    def _unhealthy_error(self, sandbox_id: str) -> SandboxUnhealthy:
        return SandboxUnhealthy(
            f"the agent of sandbox {sandbox_id} stopped answering "
            f"({self.table.unhealthy.get(sandbox_id, 'no reply')}); kill the sandbox, or wait: it "
            "is running again as soon as its agent answers",
            sandbox_id=sandbox_id,
        )

    def running_row(self, sandbox_id: str) -> SandboxRow | None:
        """A running sandbox of any tenant (the ports gateway checks access itself); pool
        members are nobody's yet."""
        row = self.table.running.get(sandbox_id)
        return row if row is not None and row.tenant != POOL_TENANT else None

    def running_rows(self) -> list[SandboxRow]:
        """Every tenant's running sandboxes (E2B's signed file URLs name none)."""
        return [r for r in self.table.running.values() if r.tenant != POOL_TENANT]

    def paused_row(self, sandbox_id: str) -> SandboxRow | None:
        """A paused sandbox of any tenant (the ports gateway tells who may reach it so)."""
        return self.table.paused.get(sandbox_id)

    async def connect_port(self, sandbox_id: str, port: int) -> Any:
        """A connection to `port` on a running sandbox's loopback, for the ports gateway."""
        row = self.table.running.get(sandbox_id)
        if row is None or row.runtime_state is None:
            raise ConnectionRefusedError(f"sandbox {sandbox_id} is not running")
        try:
            runtime = self.runtimes.for_row(row)
            if not self.runtimes.features(runtime.name).network:
                raise RuntimeError_(f"the {runtime.name} runtime cannot reach a sandbox's ports")
            return await runtime.connect_inside(sandbox_id, row.runtime_state, port)
        except (RuntimeError_, AgentboxError) as e:
            raise ConnectionRefusedError(str(e)) from None

    def mark_unhealthy(self, sandbox_id: str, reason: str) -> None:
        if sandbox_id not in self.table.unhealthy:
            log.warning("sandbox %s is unhealthy: %s", sandbox_id, reason)
        self.table.unhealthy[sandbox_id] = reason
        # Requests waiting on the silent agent end now, with the reason, not at the TTL.
        self.table.abort_requests(sandbox_id)

    def limit_counters(self, sandbox_id: str) -> dict[str, int]:
        """The limits its runtime saw it hit so far (to explain an end); {} if unknown."""
        row = self.table.running.get(sandbox_id) or self.store.get_sandbox(sandbox_id)
        if row is None or not self.runtimes.serves(row):
            return {}
        return self.runtimes.for_row(row).limit_counters(sandbox_id)

    # ------------------------------------------------------------------ agent access

    def client(self, row: SandboxRow, tracked: bool = True) -> AgentClient:
        """A client for the sandbox's agent; `tracked` connections (a caller's requests) are
        aborted if the sandbox turns unhealthy."""
        assert row.runtime_state is not None
        inflight = self.table.track(row.sandbox_id) if tracked else None
        return AgentClient(
            self.runtimes.for_row(row).agent_address(row.sandbox_id, row.runtime_state).socket_path,
            inflight=inflight,
        )

    def agent_error(self, row: SandboxRow, e: Exception) -> AgentboxError:
        if isinstance(e, AgentOpError):
            return from_agent(e.code, e.message, e.detail)
        fresh = self.store.get_sandbox(row.sandbox_id)
        ending = self.table.ending.get(row.sandbox_id)
        if row.sandbox_id in self.table.pausing or (
            fresh is not None and fresh.state == SandboxState.PAUSED and not ending
        ):
            return self.not_running(fresh or row)
        if fresh is None or fresh.state != SandboxState.RUNNING or ending:
            state = ending or (fresh.state if fresh else "gone")
            reason = self.table.ending_reason.get(row.sandbox_id) or (
                fresh.end_reason if fresh is not None else None
            )
            return SandboxNotRunning(
                f"sandbox {row.sandbox_id} is {state}; create a new sandbox", state=state,
                **({"reason": reason} if reason else {}),
            )
        if row.sandbox_id in self.table.unhealthy:
            return self._unhealthy_error(row.sandbox_id)
        return SandboxUnavailable(f"the sandbox agent is not answering: {e}")

    def failed(
        self,
        caller: Caller,
        row: SandboxRow,
        action: str,
        started: float,
        e: Exception,
        **detail: Any,
    ) -> AgentboxError:
        """Map an agent failure to an API error, audited with its status and reason."""
        err = self.agent_error(row, e)
        self.audit(
            caller,
            action,
            row.sandbox_id,
            status=status_of(err.code),
            started=started,
            error=err.code,
            **detail,
        )
        return err

    async def agent_do(
        self,
        caller: Caller,
        sandbox_id: str,
        action: str,
        operation: Callable[[AgentClient], Awaitable[T]],
        **audit_detail: Any,
    ) -> T:
        """One operation on the caller's running sandbox through its agent (a typed method of
        AgentClient), audited as `action`; agent failures become core errors."""
        started = time.monotonic()
        row = await self.awake(caller, sandbox_id)
        try:
            result = await operation(self.client(row))
        except (AgentOpError, AgentUnavailable) as e:
            raise self.failed(caller, row, action, started, e, **audit_detail) from None
        self.audit(caller, action, sandbox_id, started=started, **audit_detail)
        return result
