"""The sandbox manager: lifecycle, tenants and quotas, commands, files, TTLs and audit.

It drives a runtime through the narrow contract in `runtimes/base.py` and the sandbox's agent
through `agent/client.py`; it knows nothing of HTTP. A sandbox's life is decided here, from the
store's records: the TTL reaper ends sandboxes at their deadline, `reconcile` re-adopts live
sandboxes after a restart and removes everything no record explains.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from agentbox.core import quotas
from agentbox.core.access import SandboxAccess
from agentbox.core.admission import Admission
from agentbox.core.audit import Audit
from agentbox.core.auth import Caller
from agentbox.core.code import CodeService
from agentbox.core.commands import CommandService
from agentbox.core.creation import Creation
from agentbox.core.disk import DiskAccounting, DiskSettings, live_workspaces, live_workspaces_bound
from agentbox.core.errors import (
    Conflict,
    InvalidRequest,
)
from agentbox.core.files import FileService
from agentbox.core.lifecycle import Lifecycle, SandboxStates
from agentbox.core.metrics import Metrics
from agentbox.core.network import (
    NetworkService,
)
from agentbox.core.parking import Parking
from agentbox.core.pool_service import PoolService
from agentbox.core.pools import WarmPools
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
from agentbox.runtimes.base import Runtime
from agentbox.store.db import LIVE_STATES, SandboxRow, Store
from agentbox.templates import (
    TemplateInfo,
    TemplateSpec,
    TemplateStore,
)

DEFAULT_QUOTA: dict[str, Any] = quotas.default_quota()  # derived from this host (core/quotas.py)
HEALTH_CHECK_S = 2.0  # how often every running sandbox's agent is pinged
AGENT_PING_TIMEOUT_S = 5.0  # no answer in this long: the sandbox is `unhealthy`
LIVE = LIVE_FILTER  # a list filter: every state of a sandbox not ended


class SandboxManager(SandboxAccess):
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
        self.disk.add_source(
            live_workspaces(store, self.runtimes), live_workspaces_bound(store, self.runtimes)
        )
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

    # ------------------------------------------------------------------ listing

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
        # Rows the store gives that a page may still drop (by state shown, metadata or
        # `match`) are read in batches; otherwise a page is what the store gives.
        batch_size = limit if wanted is None and not metadata and match is None else max(limit, 100)
        while len(out) < limit:
            batch = self.store.list_sandboxes(caller.tenant, states, before, batch_size, ascending)
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
