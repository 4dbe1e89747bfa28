"""Creating sandboxes: admission, a claim from a warm pool or a cold start (after the first-use
build of its template, for a `building` sandbox: core/first_build.py), the runtime, the egress
proxy, the template's start command and warm kernels, until the record says running (or
failed, or killed).

A service of the core (see core/manager.py, the front object). A kill that arrives while a
sandbox starts is honoured at the start's next step (`_check_kill`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from agentbox.agent.client import AgentClient, AgentOpError, AgentUnavailable
from agentbox.core.auth import Caller
from agentbox.core.errors import (
    AgentboxError,
    Conflict,
    InvalidRequest,
    LimitExceeded,
    SandboxNotRunning,
    SandboxUnavailable,
)
from agentbox.core.first_build import FirstUseBuild
from agentbox.core.network import SandboxEgressSetup, SandboxNetwork, new_access_token
from agentbox.core.requests import CreateRequest, check_envs, check_metadata
from agentbox.core.snapshots import StartFrom
from agentbox.core.states import SandboxState
from agentbox.core.template_service import TEMPLATE_ROOTFS
from agentbox.egress.policy import EgressPolicy
from agentbox.egress.proxy import HTTP_PORT, SOCKS_PORT
from agentbox.runtimes.base import (
    DiskSource,
    Resources,
    Runtime,
    RuntimeError_,
    RuntimeRefused,
    SandboxSpec,
)
from agentbox.store.db import SandboxRow
from agentbox.templates import TemplateInfo
from agentbox.vocab import status_of

if TYPE_CHECKING:
    from agentbox.core.manager import SandboxManager

log = logging.getLogger("agentbox.manager")



def _start_error(e: Exception) -> AgentboxError:
    """What a start that failed answers: 409 when the runtime refused for a reason the caller
    can act on, else 503."""
    if isinstance(e, RuntimeRefused):
        return Conflict(f"the sandbox was not started: {e}")
    msg = e.message if isinstance(e, AgentboxError) else str(e)
    return SandboxUnavailable(f"the sandbox could not be started: {msg}")


class _KilledWhileStarting(Exception):
    """A kill arrived while the sandbox was starting: the start stops and tears it down."""


class Creation:
    def __init__(self, core: SandboxManager) -> None:
        self.core = core
        self.first_build = FirstUseBuild(self)

    async def create(
        self, caller: Caller, req: CreateRequest, start_from: StartFrom | None = None
    ) -> SandboxRow:
        """Create a sandbox of a template, or from a disk image: `start_from`, or the tenant's
        snapshot the request's template names."""
        if start_from is None:
            start_from = self.core.snapshots.start_from(caller.tenant, req.template)
        # A snapshot it starts from cannot be deleted from here to the end of the start.
        with self.core.snapshots.holding(start_from):
            return await self._create(caller, req, start_from)

    async def _create(
        self, caller: Caller, req: CreateRequest, start_from: StartFrom | None
    ) -> SandboxRow:
        started = time.monotonic()
        if start_from is not None:
            req = self.core.snapshots.request_from(req, start_from)
            template = start_from.template
        else:
            template = self.core.template_service.resolve(req.template)
        check_envs(req.envs)
        check_metadata(req.metadata)
        quota = self.core.quota(caller.tenant)
        req = dataclasses.replace(req, runtime=self.core.runtimes.choose(req.runtime, quota))
        assert req.runtime is not None
        if not 0 < req.timeout <= quota["max_timeout"]:
            raise LimitExceeded(
                f"timeout must be between 0 and {quota['max_timeout']} seconds",
                setting="quota.max_timeout",
                limit=quota["max_timeout"],
            )
        resources = self.core.admission.resources(req.resources, quota, req.runtime)
        mounts = self.core.volumes.resolve(caller, req.volume_mounts)
        if mounts and not self.core.runtimes.features(req.runtime).volumes:
            raise InvalidRequest(
                f"the {req.runtime} isolation tier cannot mount volumes on this server",
                setting="volume_mounts",
            )
        self.core.admission.check_free_space(caller, started)
        net = self.core.network.sandbox_network(caller.tenant, req.network)
        self.core.runtimes.check_request(
            req.runtime,
            req.resources,
            wants_network=not net.policy.is_empty or net.public_ports,
            keep_workspace=req.keep_workspace,
        )
        req = dataclasses.replace(req, lifecycle=self.core.lifecycle.policy(req))
        assert req.runtime is not None
        # Secrets need their placeholders and the CA in place from the start: no pool. Pools
        # are per template and runtime.
        plain = not req.keep_workspace and not req.secrets and req.lifecycle is None
        plain = plain and not mounts
        if resources == Resources() and plain and start_from is None:
            row = await self.core.pool_service.claim(caller, template, req, quota, started, net)
            if row is not None:
                return row
        if start_from is not None:
            tpl = await self.core.snapshots.image_template(start_from)
        elif self.core.needs_build(template):
            if mounts:
                raise Conflict(
                    f"template {template} is not built yet: create a sandbox of it without "
                    "volumes first (it builds it), then one with them",
                    template=template,
                )
            return await self.first_build.create(caller, template, req, quota, resources, net)
        else:
            tpl = await self.core.template(template)
        sandbox_id = "sbx_" + secrets.token_hex(8)
        egress = self.core.network.setup(
            caller.tenant, sandbox_id, req.secrets, str(tpl.rootfs) if tpl else None
        )
        lock = self.core.table.tenant_lock(caller.tenant)
        try:
            async with lock:
                await self.core.admission.check_capacity(caller, quota, started, resources)
                self.core.volumes.check_free(mounts)
                self.insert(
                    sandbox_id, caller.tenant, template, req, resources, net, egress,
                    origin=start_from.origin if start_from else None, volumes=mounts,
                )  # fmt: skip
        except BaseException:
            if egress.ca is not None:
                egress.ca.close()
            raise
        try:
            row = await self.start(
                sandbox_id, tpl, template, resources, req.envs, req.timeout, egress, net,
                caller.tenant, req.runtime, disk=start_from.disk if start_from else None,
                volumes=mounts,
            )  # fmt: skip
        except AgentboxError as e:
            self.core.audit(
                caller,
                "sandbox.create",
                sandbox_id,
                status=status_of(e.code),
                started=started,
                error=e.message,
            )
            raise
        self.core.audit(
            caller,
            "sandbox.create",
            sandbox_id,
            status=201,
            started=started,
            template=template,
            timeout=req.timeout,
            resources=asdict(resources),
            pool="miss" if template in self.core.pools.pools else None,
            network=net.to_dict(),
            secrets=req.secrets or None,
            origin=start_from.origin if start_from else None,
        )
        return row

    def insert(
        self,
        sandbox_id: str,
        tenant: str,
        template: str,
        req: CreateRequest,
        resources: Resources,
        net: SandboxNetwork,
        egress: SandboxEgressSetup | None,
        state: SandboxState = SandboxState.STARTING,
        grace: float = 0.0,
        origin: dict[str, str] | None = None,
        volumes: list[dict[str, Any]] | None = None,
    ) -> None:
        now = time.time()
        self.core.states.create(
            state,
            sandbox_id=sandbox_id,
            tenant=tenant,
            template=template,
            runtime=req.runtime or self.core.runtimes.default,
            metadata=req.metadata,
            resources=asdict(resources),
            runtime_state=None,
            keep_workspace=req.keep_workspace,
            created_at=now,
            end_at=now + grace + req.timeout,
            network=net.to_dict(),
            access_token=new_access_token(),
            secrets=(egress.placeholders or None) if egress else None,
            lifecycle=req.lifecycle,
            envs=req.envs or None,
            origin=origin,
            volumes=volumes or None,
        )

    async def start(
        self,
        sandbox_id: str,
        tpl: TemplateInfo | None,
        template: str,
        resources: Resources,
        envs: dict[str, str],
        timeout: float,
        egress: SandboxEgressSetup,
        net: SandboxNetwork,
        tenant: str,
        runtime_name: str,
        disk: DiskSource | None = None,
        resuming: bool = False,
        volumes: list[dict[str, Any]] | None = None,
    ) -> SandboxRow:
        """Bring an inserted `starting` sandbox up: runtime, egress proxy, template start
        command, warm code contexts; its row says running (or failed) when this returns.
        `disk`: the image it starts from, instead of a fresh disk. `resuming`: it is a parked
        sandbox's own disk, which a failed start must not remove (the row stays `starting`
        for the caller), unless the sandbox was killed meanwhile. `volumes`: its record's
        volume mounts."""
        runtime = self.core.runtimes.get(runtime_name)
        spec = SandboxSpec(
            sandbox_id=sandbox_id,
            template=template,
            resources=resources,
            envs={**egress.envs, **(tpl.env if tpl else {}), **envs},
            rootfs=str(tpl.rootfs) if tpl else None,
            workdir=tpl.workdir if tpl else "/workspace",
            user=tpl.user if tpl else "user",
            files=egress.files,
            disk=disk,
        )
        # The sandbox's lock is held until its record says running (or failed, or killed): a
        # kill that arrives while it starts (the API lists `starting` sandboxes) asks the start
        # to give up at its next step, then waits here for a whole sandbox to tear down.
        async with self.core.table.lock(sandbox_id):
            state: dict[str, Any] | None = None
            try:
                if volumes:
                    attached = await self.core.volumes.attach(sandbox_id, volumes)
                    spec = dataclasses.replace(spec, volumes=attached)
                state = await runtime.create(spec)
                self._check_kill(sandbox_id)
                await self.serve_egress(sandbox_id, state, tenant, net, egress, runtime)
                if tpl is not None:
                    await self._template_ready(sandbox_id, state, tpl, runtime)
                # No await from this check to the record saying running: a kill that saw
                # `starting` is always noticed.
                self._check_kill(sandbox_id)
            except Exception as e:
                # After a kill, whatever broke the start (its agent calls are aborted) is the kill.
                killed = sandbox_id in self.core.table.kill_pending
                if not killed and not isinstance(e, RuntimeRefused):
                    log.exception("create %s failed", sandbox_id)
                if resuming and not killed:
                    raise _start_error(e) from None
                await self._abandon_start(sandbox_id, state, killed, runtime)
                if killed:
                    raise SandboxNotRunning(
                        f"sandbox {sandbox_id} was killed while it was starting; create a new "
                        "sandbox",
                        state=SandboxState.KILLED.value,
                        end_reason="killed",
                    ) from None
                raise _start_error(e) from None
            finally:
                self.core.table.kill_pending.discard(sandbox_id)
            # The deadline counts from when the sandbox is usable, not from when it was asked.
            now = time.time()
            if spec.rootfs:  # the control plane's note, kept with the runtime's (see rootfs_in_use)
                state = {**state, TEMPLATE_ROOTFS: spec.rootfs}
            moved = self.core.states.move(
                sandbox_id, SandboxState.RUNNING, only_from=frozenset({SandboxState.STARTING}),
                runtime_state=state, end_at=now + timeout, park=None,
            )  # fmt: skip
            row = self.core.store.get_sandbox(sandbox_id)
            # Its lock is held, so nothing else ends it meanwhile; a record gone is a bug.
            assert moved is not None and row is not None, f"{sandbox_id} left `starting`"
            self.core.table.running[sandbox_id] = row
        self.core.wake.set()
        return row

    def _check_kill(self, sandbox_id: str) -> None:
        if sandbox_id in self.core.table.kill_pending:
            raise _KilledWhileStarting

    async def _abandon_start(
        self, sandbox_id: str, state: dict[str, Any] | None, killed: bool, runtime: Runtime
    ) -> None:
        """Remove what a start that failed (or was killed) made; record how it ended."""
        await self.core.network.forget(sandbox_id)
        if state is not None:
            try:
                await runtime.destroy(sandbox_id, state, keep_workspace=False)
            except Exception:  # noqa: BLE001 - reconcile removes what is left
                log.exception("could not remove the unstarted sandbox %s", sandbox_id)
        end = SandboxState.KILLED if killed else SandboxState.FAILED
        self.core.states.move(
            sandbox_id, end, end_reason=end.value, ended_at=time.time(), envs=None
        )
        await self.core.volumes.detach(sandbox_id)
        self.core.table.forget(sandbox_id)  # nothing left to serialize

    async def serve_egress(
        self,
        sandbox_id: str,
        state: dict[str, Any],
        tenant: str,
        net: SandboxNetwork,
        egress: SandboxEgressSetup,
        runtime: Runtime,
    ) -> None:
        """Put the egress proxy on the sandbox's loopback. A runtime that cannot leaves the
        sandbox without egress (closed, never open; a create that asked for some was refused)."""
        if not self.core.runtimes.features(runtime.name).network:
            return
        try:
            listeners = {
                port: await runtime.listen_inside(sandbox_id, state, port)
                for port in (HTTP_PORT, SOCKS_PORT)
            }
        except RuntimeError_ as e:
            log.warning("sandbox %s runs without an egress proxy: %s", sandbox_id, e)
            return
        placeholders = {p: name for name, p in egress.placeholders.items()}
        await self.core.network.proxy.attach(
            sandbox_id, tenant, net.policy, listeners, placeholders, egress.ca
        )

    async def _template_ready(
        self, sandbox_id: str, state: dict[str, Any], tpl: TemplateInfo, runtime: Runtime
    ) -> None:
        """Run the template's start command until its readiness check passes; warm the code
        contexts it names."""
        # Tracked: a kill while the sandbox starts aborts a long readiness check or warm-up.
        client = AgentClient(
            runtime.agent_address(sandbox_id, state).socket_path,
            inflight=self.core.table.track(sandbox_id),
        )
        if tpl.start_cmd:
            await client.start_command(cmd=tpl.start_cmd, cmd_id="start")
            if tpl.ready_cmd:
                deadline = time.monotonic() + tpl.ready_timeout
                while True:
                    self._check_kill(sandbox_id)
                    _, events = await client.run_command(cmd=tpl.ready_cmd, timeout=10, hidden=True)
                    end: dict[str, Any] = {}
                    async for ev in events:
                        if isinstance(ev, dict) and ev.get("type") == "end":
                            end = ev
                    if end.get("exit_code") == 0:
                        break
                    if time.monotonic() > deadline:
                        raise SandboxUnavailable(
                            f"template {tpl.name}: the start command was not ready after "
                            f"{tpl.ready_timeout} s (readiness check: {tpl.ready_cmd})"
                        )
                    await asyncio.sleep(0.1)
        if tpl.warm:
            try:
                await client.code_call("warm", languages=list(tpl.warm))
            except AgentOpError as e:
                raise SandboxUnavailable(
                    f"template {tpl.name}: the code interpreter did not start: {e.message}"
                ) from None

    async def start_reserved(
        self, tenant: str, template: str, lifetime: float, runtime: str | None = None
    ) -> SandboxRow:
        """Start a sandbox for the control plane's own use (a pool member, a start-up check):
        default resources, no network, no secrets, owned by a reserved tenant no key can be."""
        tpl = await self.core.template(template)
        sandbox_id = "sbx_" + secrets.token_hex(8)
        runtime = runtime or self.core.runtimes.default
        req = CreateRequest(template=template, timeout=lifetime, runtime=runtime)
        net = SandboxNetwork(EgressPolicy())
        egress = self.core.network.setup(tenant, sandbox_id, [], str(tpl.rootfs) if tpl else None)
        self.insert(sandbox_id, tenant, template, req, Resources(), net, egress)
        return await self.start(
            sandbox_id, tpl, template, Resources(), {}, lifetime, egress, net, tenant, runtime
        )

    async def run_true(self, row: SandboxRow) -> None:
        """Run `true` in the sandbox (hidden from its command list): it works end to end, and
        the agent's lazy imports and cold pages are paid for. SandboxUnavailable if not."""
        try:
            _, events = await self.core.client(row).run_command(cmd="true", timeout=30, hidden=True)
            async for event in events:
                if isinstance(event, dict) and event.get("type") == "end":
                    if event.get("exit_code") != 0:
                        raise SandboxUnavailable(f"`true` ended with {event.get('exit_code')}")
        except (AgentOpError, AgentUnavailable) as e:
            raise SandboxUnavailable(f"the started sandbox did not run a command: {e}") from None
