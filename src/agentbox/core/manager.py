"""The sandbox manager: lifecycle, tenants and quotas, commands, files, TTLs and audit.

It drives a runtime through the narrow contract in `runtimes/base.py` and the sandbox's agent
through `agent/client.py`; it knows nothing of HTTP. A sandbox's life is decided here, from the
store's records: the TTL reaper ends sandboxes at their deadline, `reconcile` re-adopts live
sandboxes after a restart and removes everything no record explains.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from agentbox.agent.client import AgentClient, AgentOpError, AgentUnavailable
from agentbox.core import quotas
from agentbox.core.admission import Admission
from agentbox.core.audit import Audit
from agentbox.core.auth import Caller
from agentbox.core.code import CodeService
from agentbox.core.commands import CommandService
from agentbox.core.creation import Creation
from agentbox.core.disk import DiskAccounting, DiskSettings, live_workspaces
from agentbox.core.errors import (
    AgentboxError,
    Conflict,
    InvalidRequest,
    NotFound,
    SandboxNotRunning,
    SandboxUnavailable,
    SandboxUnhealthy,
    from_agent,
)
from agentbox.core.files import FileService
from agentbox.core.lifecycle import Lifecycle, SandboxStates
from agentbox.core.metrics import Metrics
from agentbox.core.network import (
    NetworkService,
)
from agentbox.core.parking import Parking
from agentbox.core.pool_service import PoolService
from agentbox.core.pools import POOL_TENANT, WarmPools
from agentbox.core.requests import (
    LANGUAGES,
    CodeRequest,
    CommandRequest,
    CreateRequest,
)
from agentbox.core.runtimes import Runtimes
from agentbox.core.snapshots import Snapshots
from agentbox.core.states import LIVE_FILTER, UNHEALTHY, SandboxState
from agentbox.core.supervision import Supervisor
from agentbox.core.table import SandboxTable
from agentbox.core.template_service import (
    DEFAULT_TEMPLATE,
    TemplateCheck,
    TemplateService,
)
from agentbox.core.tenants import TenantService
from agentbox.core.volumes import Volumes
from agentbox.core.workspaces import KeptWorkspaces
from agentbox.runtimes.base import Runtime, RuntimeError_
from agentbox.store.db import LIVE_STATES, SandboxRow, Store
from agentbox.templates import (
    TemplateInfo,
    TemplateSpec,
    TemplateStore,
)
from agentbox.vocab import status_of

log = logging.getLogger("agentbox.manager")
T = TypeVar("T")

DEFAULT_QUOTA: dict[str, Any] = quotas.default_quota()  # derived from this host (core/quotas.py)
HEALTH_CHECK_S = 2.0  # how often every running sandbox's agent is pinged
AGENT_PING_TIMEOUT_S = 5.0  # no answer in this long: the sandbox is `unhealthy`
LIVE = LIVE_FILTER  # a list filter: every state of a sandbox not ended


class SandboxManager:
    def __init__(
        self,
        store: Store,
        runtime: Runtime | Runtimes,
        templates: TemplateStore,
        network: NetworkService,
        pool_sizes: dict[str, int] | None = None,
        health_interval: float = HEALTH_CHECK_S,
        ping_timeout: float = AGENT_PING_TIMEOUT_S,
        default_quota: dict[str, Any] | None = None,
        check_templates: bool = True,
        default_template: str = DEFAULT_TEMPLATE,
        paused_retention_s: float | None = None,
        snapshot_dir: Path | None = None,
        follow_links: bool = False,
    ) -> None:
        """`default_quota`: values of every tenant's quota until an admin sets its own, over
        those derived from this host. The disk settings come from the environment.
        `follow_links`: the host-side files APIs (volumes, kept workspaces) follow symlinks;
        only the security battery's positive control sets it."""
        self.store = store
        self.states = SandboxStates(store)  # the one writer of sandbox states
        # The runtimes it serves with; each sandbox's is on its record (core/runtimes.py).
        self.runtimes = runtime if isinstance(runtime, Runtimes) else Runtimes.of(runtime)
        default = self.runtimes.get(self.runtimes.default)
        self.audit = Audit(store)
        self.default_quota = {**DEFAULT_QUOTA, **(default_quota or {})}
        disk = DiskSettings.from_env()
        # Disk is accounted in one place: live workspaces and kept ones, by real usage.
        self.disk = DiskAccounting(disk, default.storage_path())
        self.follow_links = follow_links
        self.workspaces = KeptWorkspaces(
            store, self.runtimes, disk.kept_retention_s, self.audit, follow_links
        )
        self.disk.add_source(live_workspaces(store, self.runtimes))
        self.disk.add_source(self.workspaces.usage)
        self.admission = Admission(store, self.runtimes, self.disk, self.default_quota, self.audit)
        self.templates = templates
        self.network = network
        self.template_service = TemplateService(self, check_templates, default_template)
        self.pool_service = PoolService(self)
        self.pools = WarmPools(
            {self.pool_service.name(k): v for k, v in (pool_sizes or {}).items()},
            self.pool_service.make_member, self.pool_service.end_member
        )
        # What only this process knows of live sandboxes, shared by every service.
        self.table = SandboxTable()
        self.watchers: set[asyncio.Task] = set()  # first-use builds
        self._tasks: list[asyncio.Task] = []
        self.wake = asyncio.Event()  # the reaper looks again (a deadline moved)
        # How long a paused sandbox is kept before it ends (AGENTBOX_PAUSED_RETENTION_DAYS).
        self.paused_retention_s = (
            paused_retention_s if paused_retention_s is not None else disk.paused_retention_s
        )
        self.health_interval = health_interval
        self.ping_timeout = ping_timeout
        # The services by job, over the agent access this object gives them.
        self.lifecycle = Lifecycle(self)
        self.parking = Parking(self)
        storage = default.storage_path()
        if snapshot_dir is None and storage is not None:
            snapshot_dir = storage.parent / "snapshots"
        self.snapshots = Snapshots(self, snapshot_dir)
        self.disk.add_source(self.snapshots.usage)
        self.volumes = Volumes(self, storage.parent / "volumes" if storage is not None else None)
        self.disk.add_source(self.volumes.usage)
        self.creation = Creation(self)
        self.files = FileService(self)
        self.commands = CommandService(self)
        self.code = CodeService(self)
        self.supervisor = Supervisor(self)
        self.metrics = Metrics(self)
        self.tenants = TenantService(store, network, self.admission, self.audit)

    # ------------------------------------------------------------------ quotas

    def quota(self, tenant: str) -> dict[str, Any]:
        return self.admission.quota(tenant)

    def set_quota(self, caller: Caller, tenant: str, values: dict[str, Any]) -> dict[str, Any]:
        return self.admission.set_quota(caller, tenant, values)

    # ------------------------------------------------------------------ lifecycle

    # ------------------------------------------------------------------ warm pools

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

    def list(
        self,
        caller: Caller,
        states: list[str] | None,
        metadata: dict[str, str],
        limit: int,
        next_token: str | None,
        match: Callable[[SandboxRow], bool] | None = None,
        ascending: bool = False,
    ) -> tuple[list[SandboxRow], str | None]:
        """The caller's sandboxes, newest first (oldest first if `ascending`), in `states`,
        with `metadata`, and for which `match` holds; a page of `limit` and the next page's
        token."""
        before: int | None = None
        if next_token:
            try:
                before = int(next_token)
            except ValueError:
                raise InvalidRequest("invalid next_token") from None
            if not 0 <= before < 1 << 63:  # beyond SQLite's integers: never one we handed out
                raise InvalidRequest("invalid next_token")
        wanted = set(states) if states else None
        if wanted is not None and LIVE in wanted:
            wanted = (wanted - {LIVE}) | set(LIVE_STATES) | {UNHEALTHY}
            states = sorted(wanted)
        # `unhealthy` is never stored: such rows are `running` in the store.
        if wanted is not None and UNHEALTHY in wanted:
            states = sorted(wanted | {SandboxState.RUNNING.value})
        out: list[SandboxRow] = []
        while len(out) < limit:
            batch = self.store.list_sandboxes(
                caller.tenant, states, before, max(limit, 100), ascending
            )
            if not batch:
                before = None
                break
            for row in batch:
                before = row.seq
                row = self._shown(row)
                if wanted is not None and row.state not in wanted:
                    continue
                if all(row.metadata.get(k) == v for k, v in metadata.items()) and (
                    match is None or match(row)
                ):
                    out.append(row)
                    if len(out) == limit:
                        break
        more = (
            before is not None
            and len(out) == limit
            and bool(self.store.list_sandboxes(caller.tenant, states, before, 1, ascending))
        )
        return out, (str(before) if more else None)

    # ------------------------------------------------------------------ background loops

    async def start(self) -> None:
        await self.supervisor.reconcile()
        await asyncio.to_thread(self.snapshots.recover)
        await asyncio.to_thread(self.volumes.recover)
        if self.template_service.check_at_start:
            await self.template_service.check_templates()
            self.template_service.prepare_default()
        self._tasks = [
            asyncio.create_task(self.supervisor.reaper()),
            asyncio.create_task(self.supervisor.health()),
            asyncio.create_task(self.workspaces.run_expiry()),
            asyncio.create_task(self.metrics.run()),
        ]
        self.pools.start()

    async def stop(self) -> None:
        await self.pools.stop()
        for t in [*self._tasks, *self.watchers]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self.watchers, return_exceptions=True)
        await self.commands.stop()

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
            return SandboxNotRunning(
                f"sandbox {row.sandbox_id} is {state}; create a new sandbox", state=state
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

    # ------------------------------------------------------------------ the services' faces
    # The surfaces call these; each is one call into the service that does the job.

    async def start_command(
        self, caller: Caller, sandbox_id: str, req: CommandRequest
    ) -> dict[str, Any]:
        return await self.commands.start_command(caller, sandbox_id, req)

    async def run_command(
        self, caller: Caller, sandbox_id: str, req: CommandRequest
    ) -> tuple[dict[str, Any], AsyncIterator[dict[str, Any]]]:
        return await self.commands.run_command(caller, sandbox_id, req)

    async def command_events(
        self, caller: Caller, sandbox_id: str, cmd_id: str, offset: int = 0
    ) -> AsyncIterator[dict[str, Any]]:
        return await self.commands.command_events(caller, sandbox_id, cmd_id, offset)

    async def command_stdin(
        self, caller: Caller, sandbox_id: str, cmd_id: str, data: str, eof: bool
    ) -> None:
        await self.commands.command_stdin(caller, sandbox_id, cmd_id, data, eof)

    async def command_kill(self, caller: Caller, sandbox_id: str, cmd_id: str, sig: int) -> None:
        await self.commands.command_kill(caller, sandbox_id, cmd_id, sig)

    async def run_code(
        self, caller: Caller, sandbox_id: str, req: CodeRequest
    ) -> AsyncIterator[dict[str, Any]]:
        return await self.code.run_code(caller, sandbox_id, req)

    async def code_call(
        self, caller: Caller, sandbox_id: str, call: str, action: str, **args: Any
    ) -> dict[str, Any]:
        return await self.code.code_call(caller, sandbox_id, call, action, **args)

    async def template(self, name: str) -> TemplateInfo | None:
        return await self.template_service.template(name)

    def needs_build(self, template: str) -> bool:
        return self.template_service.needs_build(template)

    def build_progress(self, row: SandboxRow) -> dict[str, Any] | None:
        return self.template_service.build_progress(row)

    def rootfs_in_use(self, rootfs: Path) -> bool:
        in_use = self.template_service.rootfs_in_use
        return in_use(rootfs) or self.snapshots.rootfs_in_use(rootfs)

    @property
    def template_checks(self) -> dict[str, TemplateCheck]:
        return self.template_service.template_checks

    async def check_templates(self) -> None:
        await self.template_service.check_templates()

    def build_template(self, caller: Caller, spec: TemplateSpec) -> AsyncIterator[dict[str, Any]]:
        return self.template_service.build_template(caller, spec)

    async def remove_template(self, caller: Caller, name: str) -> None:
        await self.template_service.remove_template(caller, name)

    def pool_stats(self, caller: Caller) -> builtins.list[dict[str, Any]]:
        return self.pool_service.pool_stats(caller)

    async def set_pool_size(self, caller: Caller, template: str, size: int) -> dict[str, Any]:
        return await self.pool_service.set_pool_size(caller, template, size)

    async def create(self, caller: Caller, req: CreateRequest) -> SandboxRow:
        return await self.creation.create(caller, req)

    async def read_file(
        self, caller: Caller, sandbox_id: str, path: str, user: str | None = None
    ) -> tuple[int, AsyncIterator[bytes]]:
        return await self.files.read(caller, sandbox_id, path, user)

    async def write_file(
        self,
        caller: Caller,
        sandbox_id: str,
        path: str,
        chunks: AsyncIterator[bytes],
        user: str | None = None,
    ) -> dict[str, Any]:
        return await self.files.write(caller, sandbox_id, path, chunks, user)

    async def kill(self, caller: Caller, sandbox_id: str) -> None:
        await self.lifecycle.kill(caller, sandbox_id)

    async def set_timeout(self, caller: Caller, sandbox_id: str, timeout: float) -> SandboxRow:
        return await self.lifecycle.set_timeout(caller, sandbox_id, timeout)

    def get_metrics(
        self, caller: Caller, sandbox_id: str, start: float | None, end: float | None
    ) -> builtins.list[dict[str, Any]]:
        return self.metrics.get(caller, sandbox_id, start, end)

    async def pause(self, caller: Caller, sandbox_id: str, keep_memory: bool = True) -> SandboxRow:
        return await self.lifecycle.pause(caller, sandbox_id, keep_memory)

    async def resume(
        self, caller: Caller, sandbox_id: str, timeout: float | None = None
    ) -> SandboxRow:
        return await self.lifecycle.resume(caller, sandbox_id, timeout)

    async def set_network(
        self, caller: Caller, sandbox_id: str, network: dict[str, Any] | None
    ) -> SandboxRow:
        return await self.lifecycle.set_network(caller, sandbox_id, network)

    async def rotate_access_token(self, caller: Caller, sandbox_id: str) -> SandboxRow:
        return await self.lifecycle.rotate_access_token(caller, sandbox_id)

    def sign_port_url(
        self, caller: Caller, sandbox_id: str, port: int, expires_in: float | None
    ) -> tuple[int, dict[str, str]]:
        return self.lifecycle.sign_port_url(caller, sandbox_id, port, expires_in)


__all__ = [
    "SandboxManager",
    "CreateRequest",
    "CommandRequest",
    "CodeRequest",
    "DEFAULT_QUOTA",
    "Conflict",
    "LANGUAGES",
]
