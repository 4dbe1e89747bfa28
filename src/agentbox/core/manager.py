"""The sandbox manager: lifecycle, tenants and quotas, commands, files, TTLs and audit.

It drives a runtime through the narrow contract in `runtimes/base.py` and the sandbox's agent
through `agent/client.py`; it knows nothing of HTTP. A sandbox's life is decided here, from the
store's records: the TTL reaper ends sandboxes at their deadline, `reconcile` re-adopts live
sandboxes after a restart and removes everything no record explains.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from agentbox.agent.client import AgentClient, AgentOpError, AgentUnavailable, OutputChunk
from agentbox.core import violations
from agentbox.core.auth import Caller
from agentbox.core.errors import (
    AgentboxError,
    Conflict,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    QuotaExceeded,
    SandboxNotRunning,
    SandboxUnavailable,
    from_agent,
)
from agentbox.runtimes.base import Resources, Runtime, SandboxSpec
from agentbox.store.db import SandboxRow, Store

log = logging.getLogger("agentbox.manager")

TEMPLATES = ("default",)
DEFAULT_QUOTA: dict[str, Any] = {
    "max_sandboxes": 20,
    "max_memory_mb": 4096,
    "max_cpu_count": float(os.cpu_count() or 1),
    "max_timeout": 86_400,
    "max_disk_mb": 10_240,
    "max_pids": 4096,
}
_RESOURCE_CAPS = {
    "memory_mb": "max_memory_mb",
    "cpu_count": "max_cpu_count",
    "disk_mb": "max_disk_mb",
    "pids": "max_pids",
}
_RESOURCE_MIN = {
    "memory_mb": 32,
    "cpu_count": 0.05,
    "pids": 16,
    "nofile": 64,
    "file_size_mb": 1,
    "disk_mb": 16,
    "tmp_mb": 1,
}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
HEALTH_CHECK_S = 2.0


@dataclass
class CreateRequest:
    template: str = "default"
    timeout: float = 300
    metadata: dict[str, str] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=dict)
    keep_workspace: bool = False


@dataclass
class CommandRequest:
    cmd: str
    cwd: str | None = None
    envs: dict[str, str] = field(default_factory=dict)
    timeout: float = 60
    background: bool = False
    stdin: bool = False


def _check_envs(envs: dict[str, str]) -> None:
    for k, v in envs.items():
        if not _ENV_NAME.fullmatch(k):  # fullmatch: `$` would also accept a trailing newline
            raise InvalidRequest(f"invalid environment variable name {k!r}")
        if "\0" in v:
            raise InvalidRequest(f"environment variable {k} contains a NUL byte")


def _check_metadata(meta: dict[str, str]) -> None:
    if len(meta) > 64:
        raise InvalidRequest("metadata may hold at most 64 keys")
    for k, v in meta.items():
        if not k or len(k) > 128 or len(v) > 1024:
            raise InvalidRequest("metadata keys must be 1-128 characters and values at most 1024")


class SandboxManager:
    def __init__(self, store: Store, runtime: Runtime) -> None:
        self.store = store
        self.runtime = runtime
        self._tenant_locks: dict[str, asyncio.Lock] = {}
        self._sandbox_locks: dict[str, asyncio.Lock] = {}
        self._baselines: dict[tuple[str, str], tuple[dict[str, int], float]] = {}
        self._violations: dict[tuple[str, str], dict[str, str] | None] = {}
        self._watchers: set[asyncio.Task] = set()
        self._tasks: list[asyncio.Task] = []
        self._wake = asyncio.Event()
        # Running sandboxes, read on every command and file call. This process is the only
        # writer of their rows (embedded mode), so the cache is kept exact on every change.
        self._running: dict[str, SandboxRow] = {}
        # Sandboxes being torn down -> the state they are ending in: their agent connections
        # break before the record changes, and callers must hear "ended", not "unavailable".
        self._ending: dict[str, str] = {}

    # ------------------------------------------------------------------ audit

    def audit(
        self,
        caller: Caller | None,
        action: str,
        sandbox_id: str | None = None,
        status: int = 200,
        started: float | None = None,
        tenant: str | None = None,
        **detail: Any,
    ) -> None:
        try:
            self.store.add_audit(
                time=time.time(),
                tenant=tenant or (caller.tenant if caller else None),
                key_id=caller.key_id if caller else None,
                action=action,
                sandbox_id=sandbox_id,
                status=status,
                duration_ms=round((time.monotonic() - started) * 1000, 3) if started else None,
                detail=detail or None,
            )
        except Exception:  # noqa: BLE001 - auditing must never break the action itself
            log.exception("could not write audit event %s", action)

    # ------------------------------------------------------------------ quotas

    def quota(self, tenant: str) -> dict[str, Any]:
        return {**DEFAULT_QUOTA, **self.store.get_quota(tenant)}

    def set_quota(self, caller: Caller, tenant: str, values: dict[str, Any]) -> dict[str, Any]:
        merged = {**self.store.get_quota(tenant), **values}
        self.store.set_quota(tenant, merged)
        self.audit(caller, "quota.set", tenant=tenant, quota=values)
        return self.quota(tenant)

    def _resources(self, requested: dict[str, Any], quota: dict[str, Any]) -> Resources:
        unknown = set(requested) - set(Resources.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(f"unknown resources: {', '.join(sorted(unknown))}")
        res = Resources(**{k: v for k, v in requested.items() if v is not None})
        for name, minimum in _RESOURCE_MIN.items():
            if getattr(res, name) < minimum:
                raise InvalidRequest(f"resources.{name} must be at least {minimum}")
        for name, cap in _RESOURCE_CAPS.items():
            if getattr(res, name) > quota[cap]:
                raise LimitExceeded(
                    f"resources.{name}={getattr(res, name)} is above your tenant's limit of "
                    f"{quota[cap]}; ask for less or have an admin raise quota.{cap}",
                    setting=f"quota.{cap}",
                    limit=quota[cap],
                )
        return res

    # ------------------------------------------------------------------ lifecycle

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._sandbox_locks.setdefault(sandbox_id, asyncio.Lock())

    async def create(self, caller: Caller, req: CreateRequest) -> SandboxRow:
        started = time.monotonic()
        template = req.template or "default"
        if template not in TEMPLATES:
            raise NotFound(f"unknown template {template!r}; available: {', '.join(TEMPLATES)}")
        _check_envs(req.envs)
        _check_metadata(req.metadata)
        quota = self.quota(caller.tenant)
        if not 0 < req.timeout <= quota["max_timeout"]:
            raise LimitExceeded(
                f"timeout must be between 0 and {quota['max_timeout']} seconds",
                setting="quota.max_timeout",
                limit=quota["max_timeout"],
            )
        resources = self._resources(req.resources, quota)
        sandbox_id = "sbx_" + secrets.token_hex(8)
        lock = self._tenant_locks.setdefault(caller.tenant, asyncio.Lock())
        async with lock:
            live = self.store.count_live(caller.tenant)
            if live >= quota["max_sandboxes"]:
                self.audit(
                    caller, "sandbox.create", status=429, started=started, error="quota_exceeded"
                )
                raise QuotaExceeded(
                    f"tenant {caller.tenant} already has {live} running sandboxes, its limit "
                    f"is {quota['max_sandboxes']}; kill one or ask an admin to raise "
                    "quota.max_sandboxes",
                    setting="quota.max_sandboxes",
                    limit=quota["max_sandboxes"],
                )
            now = time.time()
            self.store.insert_sandbox(
                sandbox_id=sandbox_id,
                tenant=caller.tenant,
                template=template,
                runtime=self.runtime.name,
                state="starting",
                metadata=req.metadata,
                resources=asdict(resources),
                runtime_state=None,
                keep_workspace=req.keep_workspace,
                created_at=now,
                end_at=now + req.timeout,
            )
        spec = SandboxSpec(
            sandbox_id=sandbox_id, template=template, resources=resources, envs=req.envs
        )
        # The sandbox's lock is held until its record says running (or failed): a kill that
        # arrives while it starts (the API lists `starting` sandboxes) waits for the runtime to
        # finish, then tears down a whole sandbox, instead of racing the create half-way.
        async with self._lock(sandbox_id):
            try:
                state = await self.runtime.create(spec)
            except Exception as e:
                log.exception("create %s failed", sandbox_id)
                self.store.update_sandbox(
                    sandbox_id, state="failed", end_reason="failed", ended_at=time.time()
                )
                self.audit(
                    caller, "sandbox.create", sandbox_id, status=503, started=started, error=str(e)
                )
                self._sandbox_locks.pop(sandbox_id, None)  # nothing left to serialize
                raise SandboxUnavailable(f"the sandbox could not be started: {e}") from None
            # The deadline counts from when the sandbox is usable, not from when it was asked.
            now = time.time()
            self.store.update_sandbox(
                sandbox_id, state="running", runtime_state=state, end_at=now + req.timeout
            )
            row = self.store.get_sandbox(sandbox_id)
            assert row is not None
            self._running[sandbox_id] = row
        self._wake.set()
        self.audit(
            caller,
            "sandbox.create",
            sandbox_id,
            status=201,
            started=started,
            template=template,
            timeout=req.timeout,
            resources=asdict(resources),
        )
        return row

    def get(self, caller: Caller, sandbox_id: str) -> SandboxRow:
        row = self._running.get(sandbox_id) or self.store.get_sandbox(sandbox_id)
        # Another tenant's sandbox is indistinguishable from one that never existed.
        if row is None or row.tenant != caller.tenant:
            raise NotFound(f"sandbox {sandbox_id} not found")
        return row

    def running(self, caller: Caller, sandbox_id: str) -> SandboxRow:
        row = self.get(caller, sandbox_id)
        if row.state != "running":
            reason = f" ({row.end_reason})" if row.end_reason else ""
            raise SandboxNotRunning(
                f"sandbox {sandbox_id} is {row.state}{reason}; create a new sandbox",
                state=row.state,
                end_reason=row.end_reason,
            )
        return row

    def list(
        self,
        caller: Caller,
        states: list[str] | None,
        metadata: dict[str, str],
        limit: int,
        next_token: str | None,
    ) -> tuple[list[SandboxRow], str | None]:
        before: int | None = None
        if next_token:
            try:
                before = int(next_token)
            except ValueError:
                raise InvalidRequest("invalid next_token") from None
            if not 0 <= before < 1 << 63:  # beyond SQLite's integers: never one we handed out
                raise InvalidRequest("invalid next_token")
        out: list[SandboxRow] = []
        while len(out) < limit:
            batch = self.store.list_sandboxes(caller.tenant, states, before, max(limit, 100))
            if not batch:
                before = None
                break
            for row in batch:
                before = row.seq
                if all(row.metadata.get(k) == v for k, v in metadata.items()):
                    out.append(row)
                    if len(out) == limit:
                        break
        more = (
            before is not None
            and len(out) == limit
            and bool(self.store.list_sandboxes(caller.tenant, states, before, 1))
        )
        return out, (str(before) if more else None)

    async def kill(self, caller: Caller, sandbox_id: str) -> None:
        started = time.monotonic()
        row = self.get(caller, sandbox_id)
        await self._end(row, state="killed", reason="killed")
        self.audit(caller, "sandbox.kill", sandbox_id, status=204, started=started)

    async def set_timeout(self, caller: Caller, sandbox_id: str, timeout: float) -> SandboxRow:
        row = self.running(caller, sandbox_id)
        quota = self.quota(caller.tenant)
        if not 0 < timeout <= quota["max_timeout"]:
            raise LimitExceeded(
                f"timeout must be between 0 and {quota['max_timeout']} seconds",
                setting="quota.max_timeout",
                limit=quota["max_timeout"],
            )
        # Under the sandbox's lock: `_end` holds it while tearing the sandbox down, and a
        # deadline moved (and the row re-cached as running) meanwhile would resurrect it.
        async with self._lock(row.sandbox_id):
            row = self.running(caller, sandbox_id)
            self.store.update_sandbox(row.sandbox_id, end_at=time.time() + timeout)
            self._running.pop(row.sandbox_id, None)
            fresh = self.store.get_sandbox(row.sandbox_id)
            if fresh is not None and fresh.state == "running":
                self._running[row.sandbox_id] = fresh
        self._wake.set()
        self.audit(caller, "sandbox.timeout", sandbox_id, timeout=timeout)
        return self.get(caller, sandbox_id)

    async def _end(
        self, row: SandboxRow, state: str, reason: str, only_if_expired: bool = False
    ) -> bool:
        """Destroy a sandbox and record how it ended; False if it had already ended."""
        async with self._lock(row.sandbox_id):
            self._running.pop(row.sandbox_id, None)
            fresh = self.store.get_sandbox(row.sandbox_id)
            if fresh is None or not fresh.live:
                return False
            if only_if_expired and fresh.end_at > time.time():
                if fresh.state == "running":
                    self._running[fresh.sandbox_id] = fresh
                return False  # the deadline moved while we waited for the lock
            self._ending[fresh.sandbox_id] = state
            try:
                await self.runtime.destroy(
                    fresh.sandbox_id, fresh.runtime_state, fresh.keep_workspace
                )
            except Exception:
                log.exception("destroy %s failed; will retry", fresh.sandbox_id)
                raise SandboxUnavailable(
                    f"sandbox {fresh.sandbox_id} could not be torn down completely yet; "
                    "retry the kill"
                ) from None
            finally:
                self._ending.pop(fresh.sandbox_id, None)
            self.store.update_sandbox(
                fresh.sandbox_id, state=state, end_reason=reason, ended_at=time.time()
            )
        self._sandbox_locks.pop(row.sandbox_id, None)
        for key in [k for k in self._baselines if k[0] == row.sandbox_id]:
            self._baselines.pop(key, None)
        for key in [k for k in self._violations if k[0] == row.sandbox_id]:
            self._violations.pop(key, None)
        return True

    # ------------------------------------------------------------------ background loops

    async def start(self) -> None:
        await self.reconcile()
        self._tasks = [asyncio.create_task(self._reaper()), asyncio.create_task(self._health())]

    async def stop(self) -> None:
        for t in [*self._tasks, *self._watchers]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._watchers, return_exceptions=True)

    async def _reaper(self) -> None:
        """End sandboxes at their deadline: never before it, and within a few ms after it."""
        while True:
            now = time.time()
            for row in self.store.expired(now):
                try:
                    if await self._end(row, "expired", "timeout", only_if_expired=True):
                        self.audit(None, "sandbox.expire", row.sandbox_id, tenant=row.tenant)
                except AgentboxError:
                    pass
            nxt = self.store.next_deadline()
            delay = 1.0 if nxt is None else min(1.0, max(0.0, nxt - time.time()))
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), delay + 0.001)
            except TimeoutError:
                pass

    async def _health(self) -> None:
        """Notice sandboxes whose processes died underneath us and clean up after them."""
        while True:
            await asyncio.sleep(HEALTH_CHECK_S)
            for row in self.store.live_sandboxes():
                if (
                    row.state == "running"
                    and row.runtime_state is not None
                    and not (await self.runtime.is_alive(row.sandbox_id, row.runtime_state))
                ):
                    try:
                        await self._end(row, "killed", "vanished")
                    except AgentboxError:
                        pass

    async def reconcile(self) -> dict[str, int]:
        """After a (re)start: re-adopt live sandboxes, reap expired ones, remove strays."""
        counts = {"adopted": 0, "expired": 0, "vanished": 0, "failed": 0, "strays": 0}
        now = time.time()
        known: set[str] = set()
        for row in self.store.live_sandboxes():
            if row.state == "starting" or row.runtime_state is None:
                await self._end(row, "failed", "failed")
                counts["failed"] += 1
            elif row.end_at <= now:
                await self._end(row, "expired", "timeout")
                self.audit(None, "sandbox.expire", row.sandbox_id, tenant=row.tenant)
                counts["expired"] += 1
            elif not await self.runtime.is_alive(row.sandbox_id, row.runtime_state):
                await self._end(row, "killed", "vanished")
                counts["vanished"] += 1
            else:
                self.runtime.adopt(row.sandbox_id, row.runtime_state)
                known.add(row.sandbox_id)
                self._running[row.sandbox_id] = row
                counts["adopted"] += 1
                try:
                    for info in (await self._client(row).call({"op": "exec.list"}))["commands"]:
                        if info.get("running"):
                            self._watch(row, info["cmd_id"], info.get("cmd", ""), None, 0)
                except (AgentUnavailable, AgentOpError, KeyError, TypeError):
                    pass
        for stray in await self.runtime.list_sandboxes() - known:
            log.warning("removing stray sandbox %s that no record explains", stray)
            await self.runtime.destroy(stray, None, keep_workspace=False)
            counts["strays"] += 1
        log.info("reconciled: %s", counts)
        return counts

    # ------------------------------------------------------------------ agent access

    def _client(self, row: SandboxRow) -> AgentClient:
        assert row.runtime_state is not None
        return AgentClient(
            self.runtime.agent_address(row.sandbox_id, row.runtime_state).socket_path
        )

    def _agent_error(self, row: SandboxRow, e: Exception) -> AgentboxError:
        if isinstance(e, AgentOpError):
            return from_agent(e.code, e.message, e.detail)
        fresh = self.store.get_sandbox(row.sandbox_id)
        ending = self._ending.get(row.sandbox_id)
        if fresh is None or fresh.state != "running" or ending:
            state = ending or (fresh.state if fresh else "gone")
            return SandboxNotRunning(
                f"sandbox {row.sandbox_id} is {state}; create a new sandbox", state=state
            )
        return SandboxUnavailable(f"the sandbox agent is not answering: {e}")

    async def agent_call(
        self,
        caller: Caller,
        sandbox_id: str,
        request: dict[str, Any],
        action: str,
        timeout: float | None = 60.0,
        **audit_detail: Any,
    ) -> dict[str, Any]:
        started = time.monotonic()
        row = self.running(caller, sandbox_id)
        try:
            reply = await self._client(row).call(request, timeout)
        except (AgentOpError, AgentUnavailable) as e:
            raise self._failed(caller, row, action, started, e, **audit_detail) from None
        self.audit(caller, action, sandbox_id, started=started, **audit_detail)
        return reply

    # ------------------------------------------------------------------ files

    async def read_file(
        self, caller: Caller, sandbox_id: str, path: str
    ) -> tuple[int, AsyncIterator[bytes]]:
        started = time.monotonic()
        row = self.running(caller, sandbox_id)
        try:
            size, chunks = await self._client(row).read_file(path)
        except (AgentOpError, AgentUnavailable) as e:
            raise self._failed(caller, row, "file.read", started, e, path=path) from None
        self.audit(caller, "file.read", sandbox_id, started=started, path=path, size=size)
        return size, chunks

    async def write_file(
        self, caller: Caller, sandbox_id: str, path: str, chunks: AsyncIterator[bytes]
    ) -> dict[str, Any]:
        started = time.monotonic()
        row = self.running(caller, sandbox_id)
        try:
            reply = await self._client(row).write_file(path, chunks)
        except (AgentOpError, AgentUnavailable) as e:
            raise self._failed(caller, row, "file.write", started, e, path=path) from None
        except OSError as e:  # the agent hung up mid-upload: its reply, if any, is lost
            lost = AgentUnavailable(f"lost the sandbox agent during the upload: {e}")
            raise self._failed(caller, row, "file.write", started, lost, path=path) from None
        entry = reply["entry"]
        self.audit(
            caller, "file.write", sandbox_id, started=started, path=path, size=entry.get("size")
        )
        return entry

    # ------------------------------------------------------------------ commands

    def _exec_request(self, req: CommandRequest, op: str) -> dict[str, Any]:
        if not req.cmd.strip():
            raise InvalidRequest("cmd must not be empty")
        if "\0" in req.cmd:
            raise InvalidRequest("cmd contains a NUL byte")
        if req.timeout < 0:
            raise InvalidRequest("timeout must be >= 0 (0 = no timeout)")
        _check_envs(req.envs)
        return {
            "op": op,
            "cmd": req.cmd,
            "cwd": req.cwd,
            "envs": req.envs,
            "timeout": req.timeout,
            "stdin": req.stdin,
        }

    async def start_command(
        self, caller: Caller, sandbox_id: str, req: CommandRequest
    ) -> dict[str, Any]:
        """Start a background command; an audit watcher records how it ends."""
        body = self._exec_request(req, "exec.start")
        started = time.monotonic()
        row = self.running(caller, sandbox_id)
        baseline = self.runtime.limit_counters(sandbox_id)
        try:
            info = (await self._client(row).call(body))["command"]
        except (AgentOpError, AgentUnavailable) as e:
            raise self._failed(caller, row, "command.run", started, e, cmd=req.cmd) from None
        self._baselines[(sandbox_id, info["cmd_id"])] = (baseline, req.timeout)
        self._watch(row, info["cmd_id"], req.cmd, caller, started)
        return info

    async def run_command(
        self, caller: Caller, sandbox_id: str, req: CommandRequest
    ) -> tuple[dict[str, Any], AsyncIterator[dict[str, Any]]]:
        """Start a foreground command; its events stream on the same agent connection."""
        body = self._exec_request(req, "exec.run")
        started = time.monotonic()
        row = self.running(caller, sandbox_id)
        baseline = self.runtime.limit_counters(sandbox_id)
        try:
            info, stream = await self._client(row).command_stream(body)
        except (AgentOpError, AgentUnavailable) as e:
            raise self._failed(caller, row, "command.run", started, e, cmd=req.cmd) from None
        cmd_id = info["cmd_id"]
        self._baselines[(sandbox_id, cmd_id)] = (baseline, req.timeout)

        def ended(end: dict[str, Any] | None) -> None:
            if end is None:  # the client left before the end: audit when it does end
                self._watch(row, cmd_id, req.cmd, caller, started)
            else:
                self._audit_command(caller, row, cmd_id, req.cmd, started, end)

        return info, self._event_stream(row, cmd_id, stream, ended)

    def _failed(
        self,
        caller: Caller,
        row: SandboxRow,
        action: str,
        started: float,
        e: Exception,
        **detail: Any,
    ) -> AgentboxError:
        """Map an agent failure to an API error, audited with its status and reason."""
        err = self._agent_error(row, e)
        self.audit(
            caller,
            action,
            row.sandbox_id,
            status=err.status,
            started=started,
            error=err.code,
            **detail,
        )
        return err

    def _audit_command(
        self,
        caller: Caller | None,
        row: SandboxRow,
        cmd_id: str,
        cmd: str,
        started: float,
        end: dict[str, Any],
    ) -> None:
        self.audit(
            caller,
            "command.run",
            row.sandbox_id,
            started=started,
            tenant=row.tenant,
            cmd=cmd,
            cmd_id=cmd_id,
            exit_code=end.get("exit_code"),
            timed_out=end.get("timed_out"),
            violation=(end.get("violation") or {}).get("code"),
        )

    def _watch(
        self, row: SandboxRow, cmd_id: str, cmd: str, caller: Caller | None, started: float
    ) -> None:
        """Audit the command when it ends, whoever (if anyone) is streaming its output."""

        async def watch() -> None:
            t0 = started or time.monotonic()
            try:
                conn_end = await self._client(row).call(
                    {"op": "exec.wait", "cmd_id": cmd_id}, timeout=None
                )
            except (AgentOpError, AgentUnavailable):
                return
            end = self.finish(row.sandbox_id, cmd_id, conn_end)
            self._audit_command(caller, row, cmd_id, cmd, t0, end)

        task = asyncio.create_task(watch())
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    def finish(self, sandbox_id: str, cmd_id: str, end: dict[str, Any]) -> dict[str, Any]:
        """Turn the agent's end event into the API's, with the violation that explains it."""
        key = (sandbox_id, cmd_id)
        if key not in self._violations:
            baseline, timeout = self._baselines.pop(key, ({}, 0.0))
            after = self.runtime.limit_counters(sandbox_id) if baseline else {}
            self._violations[key] = violations.explain_command_end(end, baseline, after, timeout)
            if len(self._violations) > 10_000:
                self._violations.pop(next(iter(self._violations)))
        return {
            "type": "end",
            "exit_code": end.get("exit_code"),
            "timed_out": bool(end.get("timed_out")),
            "killed": bool(end.get("killed")),
            "signal": end.get("signal"),
            "violation": self._violations[key],
        }

    async def command_events(
        self, caller: Caller, sandbox_id: str, cmd_id: str, offset: int = 0
    ) -> AsyncIterator[dict[str, Any]]:
        """API events for a command from `offset`: output as text, then `end`."""
        row = self.running(caller, sandbox_id)
        request = {"op": "exec.events", "cmd_id": cmd_id, "offset": offset}
        try:
            _, stream = await self._client(row).command_stream(request)
        except (AgentOpError, AgentUnavailable) as e:
            raise self._agent_error(row, e) from None
        return self._event_stream(row, cmd_id, stream, None)

    async def _event_stream(
        self,
        row: SandboxRow,
        cmd_id: str,
        stream: AsyncIterator[Any],
        ended: Callable[[dict[str, Any] | None], None] | None,
    ) -> AsyncIterator[dict[str, Any]]:
        decoders = {
            "stdout": codecs.getincrementaldecoder("utf-8")("replace"),
            "stderr": codecs.getincrementaldecoder("utf-8")("replace"),
        }
        end: dict[str, Any] | None = None
        try:
            async for item in stream:
                if isinstance(item, OutputChunk):
                    text = decoders[item.stream].decode(item.data)
                    if text:
                        yield {"type": item.stream, "data": text, "offset": item.offset}
                elif item.get("type") == "truncated":
                    yield {"type": "truncated", "dropped": int(item.get("dropped", 0))}
                elif item.get("type") == "end":
                    for name, dec in decoders.items():
                        tail = dec.decode(b"", final=True)
                        if tail:
                            yield {"type": name, "data": tail, "offset": -1}
                    end = self.finish(row.sandbox_id, cmd_id, item)
                    yield end
                    return
        except (AgentOpError, AgentUnavailable) as e:
            err = self._agent_error(row, e)
            if isinstance(err, SandboxNotRunning):
                yield {
                    "type": "end",
                    "exit_code": None,
                    "timed_out": False,
                    "killed": True,
                    "signal": None,
                    "violation": violations.violation(
                        "sandbox_ended",
                        "timeout",
                        "the sandbox was killed or reached its timeout while the command "
                        "ran; extend it with set_timeout or create a new one",
                    ),
                }
            else:
                yield {"type": "error", "code": err.code, "message": err.message}
        finally:
            if ended is not None:
                ended(end)

    async def command_stdin(
        self, caller: Caller, sandbox_id: str, cmd_id: str, data: str, eof: bool
    ) -> None:
        await self.agent_call(
            caller,
            sandbox_id,
            {"op": "exec.stdin", "cmd_id": cmd_id, "data": data, "eof": eof},
            "command.stdin",
            cmd_id=cmd_id,
            size=len(data),
            eof=eof,
        )

    async def command_kill(self, caller: Caller, sandbox_id: str, cmd_id: str, sig: int) -> None:
        await self.agent_call(
            caller,
            sandbox_id,
            {"op": "exec.kill", "cmd_id": cmd_id, "signal": sig},
            "command.kill",
            cmd_id=cmd_id,
            signal=sig,
        )


__all__ = ["SandboxManager", "CreateRequest", "CommandRequest", "DEFAULT_QUOTA", "Conflict"]
