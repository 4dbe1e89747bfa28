"""The lifecycle of sandboxes after their creation (core/creation.py): kill, timeout, network
settings, the end and its clean-up; and the one writer of sandbox states.

Every change of a sandbox's state goes through `SandboxStates`: it checks the move against the
transition table (core/states.py), writes it with a compare-and-set on the stored state (so two
racing writers cannot both win, and a sandbox that ended meanwhile stays ended), and tells every
subscriber (the dashboard and E2B's auto-resume will be ones). The store refuses a state written
any other way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentbox.core import ports
from agentbox.core.auth import Caller
from agentbox.core.errors import (
    AgentboxError,
    Conflict,
    InvalidRequest,
    LimitExceeded,
    SandboxNotRunning,
    SandboxUnavailable,
)
from agentbox.core.network import new_access_token
from agentbox.core.requests import CreateRequest
from agentbox.core.states import INITIAL, SandboxState, allowed
from agentbox.runtimes.base import Parkable, Pausable, RuntimeError_
from agentbox.store.db import SandboxRow, Store

if TYPE_CHECKING:
    from agentbox.core.manager import SandboxManager

log = logging.getLogger("agentbox.lifecycle")


@dataclass(frozen=True)
class StateChange:
    sandbox_id: str
    tenant: str
    old: SandboxState | None  # None: the sandbox was just created
    new: SandboxState
    reason: str | None  # the end reason, for an ended state
    at: float


Listener = Callable[[StateChange], None]


class InvalidTransition(Exception):
    """A move the transition table does not allow: a bug in the caller, never user input."""


class SandboxStates:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call `listener` after every change (in the writer's thread, so it must be quick and
        must not raise); returns the unsubscribe function."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def create(self, state: SandboxState, **values: Any) -> None:
        """Store a new sandbox in one of the initial states."""
        if state not in INITIAL:
            raise InvalidTransition(f"a sandbox cannot be created {state}")
        self.store.insert_sandbox(state=state.value, **values)
        self._tell(StateChange(values["sandbox_id"], values["tenant"], None, state, None,
                               time.time()))  # fmt: skip

    def move(
        self,
        sandbox_id: str,
        new: SandboxState,
        *,
        only_from: frozenset[SandboxState] | None = None,
        **values: Any,
    ) -> StateChange | None:
        """Move the sandbox to `new` (writing `values` with it) if its state allows it, and
        `only_from` (when given) contains its state. None when it does not: the sandbox ended
        or moved meanwhile, which a caller racing a kill or a timeout must expect.

        Raises InvalidTransition when no state could make the move (a caller's bug)."""
        if only_from is not None and not any(allowed(s, new) for s in only_from):
            raise InvalidTransition(f"no move from {sorted(only_from)} to {new}")
        while True:
            row = self.store.get_sandbox(sandbox_id)
            if row is None:
                return None
            old = SandboxState(row.state)
            if not allowed(old, new) or (only_from is not None and old not in only_from):
                return None
            if self.store.move_sandbox(sandbox_id, old.value, state=new.value, **values):
                change = StateChange(
                    sandbox_id, row.tenant, old, new, values.get("end_reason"), time.time()
                )
                self._tell(change)
                return change
            # Another writer moved it between the read and the write: look again.

    def _tell(self, change: StateChange) -> None:
        for listener in list(self._listeners):
            try:
                listener(change)
            except Exception:  # noqa: BLE001 - one bad subscriber must not stop a state change
                log.exception("a state listener failed on %s", change)


class Lifecycle:
    """Ending sandboxes (a kill, a timeout, a vanished or failed one), moving their deadline,
    replacing their network settings and access token. A service of the core (see
    core/manager.py, the front object)."""

    def __init__(self, core: SandboxManager) -> None:
        self.core = core

    def policy(self, req: CreateRequest) -> dict[str, Any] | None:
        """The lifecycle policy as stored (None: the default, killed at its timeout), checked
        against the tier: pausing needs a runtime that can."""
        if req.lifecycle is None:
            return None
        on_timeout = req.lifecycle.get("on_timeout", "kill")
        auto_resume = bool(req.lifecycle.get("auto_resume", False))
        if on_timeout not in ("kill", "pause"):
            raise InvalidRequest(
                f"lifecycle.on_timeout must be kill or pause, not {on_timeout!r}",
                setting="lifecycle.on_timeout",
            )
        if on_timeout == "kill" and not auto_resume:
            return None
        assert req.runtime is not None
        if not self.core.runtimes.features(req.runtime).pause:
            raise InvalidRequest(
                f"the {req.runtime} isolation tier cannot pause sandboxes on this server: no "
                "lifecycle.on_timeout pause or auto_resume there",
                setting="lifecycle",
            )
        return {"on_timeout": on_timeout, "auto_resume": auto_resume, "timeout": req.timeout}

    async def set_network(
        self, caller: Caller, sandbox_id: str, network: dict[str, Any] | None
    ) -> SandboxRow:
        """Replace a running sandbox's network settings (None: the tenant's default); the
        next egress attempt obeys them."""
        self.core.running(caller, sandbox_id)
        net = self.core.network.sandbox_network(caller.tenant, network)
        async with self.core.table.lock(sandbox_id):
            self.core.running(caller, sandbox_id)
            self.core.store.update_sandbox(sandbox_id, network=net.to_dict())
            fresh = self.core.store.get_sandbox(sandbox_id)
            if fresh is not None and fresh.state == SandboxState.RUNNING:
                self.core.table.running[sandbox_id] = fresh
            self.core.network.proxy.update(sandbox_id, net.policy)
        self.core.audit(caller, "sandbox.network", sandbox_id, network=net.to_dict())
        return self.core.get(caller, sandbox_id)

    async def rotate_access_token(self, caller: Caller, sandbox_id: str) -> SandboxRow:
        """Give a running sandbox a new access token; the gateway checks the new one from the
        next request on, so the old token and every URL or cookie signed with it are void."""
        self.core.running(caller, sandbox_id)
        async with self.core.table.lock(sandbox_id):
            self.core.running(caller, sandbox_id)
            self.core.store.update_sandbox(sandbox_id, access_token=new_access_token())
            fresh = self.core.store.get_sandbox(sandbox_id)
            if fresh is not None and sandbox_id in self.core.table.running:
                self.core.table.running[sandbox_id] = fresh
        self.core.audit(caller, "sandbox.access_token", sandbox_id)
        return self.core.get(caller, sandbox_id)

    def sign_port_url(
        self, caller: Caller, sandbox_id: str, port: int, expires_in: float | None
    ) -> tuple[int, dict[str, str]]:
        """(expires, query parameters) that let whoever holds the URL reach `port` of the
        caller's running sandbox until `expires` (unix seconds), signed with its access token."""
        row = self.core.running(caller, sandbox_id)
        assert row.access_token is not None
        signed = ports.signed_query(row.access_token, sandbox_id, port, expires_in, time.time())
        self.core.audit(caller, "port.url", sandbox_id, port=port, expires_in=expires_in)
        return signed

    async def kill(self, caller: Caller, sandbox_id: str) -> None:
        started = time.monotonic()
        row = self.core.owned(caller, sandbox_id)
        if row.state == SandboxState.STARTING:
            # The start gives up at its next step, or now if it waits on the agent.
            self.core.table.kill_pending.add(sandbox_id)
            self.core.table.abort_requests(sandbox_id)
        await self.end(row, state=SandboxState.KILLED, reason="killed")
        self.core.audit(caller, "sandbox.kill", sandbox_id, status=204, started=started)

    def _check_timeout(self, caller: Caller, timeout: float) -> None:
        quota = self.core.quota(caller.tenant)
        if not 0 < timeout <= quota["max_timeout"]:
            raise LimitExceeded(
                f"timeout must be between 0 and {quota['max_timeout']} seconds",
                setting="quota.max_timeout",
                limit=quota["max_timeout"],
            )

    async def set_timeout(self, caller: Caller, sandbox_id: str, timeout: float) -> SandboxRow:
        row = self.core.running(caller, sandbox_id)
        self._check_timeout(caller, timeout)
        # Under the sandbox's lock: `_end` holds it while tearing the sandbox down, and a
        # deadline moved (and the row re-cached as running) meanwhile would resurrect it.
        async with self.core.table.lock(row.sandbox_id):
            row = self.core.running(caller, sandbox_id)
            self.core.store.update_sandbox(row.sandbox_id, end_at=time.time() + timeout)
            self.core.table.running.pop(row.sandbox_id, None)
            fresh = self.core.store.get_sandbox(row.sandbox_id)
            if fresh is not None and fresh.state == SandboxState.RUNNING:
                self.core.table.running[row.sandbox_id] = fresh
        self.core.wake.set()
        self.core.audit(caller, "sandbox.timeout", sandbox_id, timeout=timeout)
        return self.core.get(caller, sandbox_id)

    async def pause(self, caller: Caller, sandbox_id: str, keep_memory: bool = True) -> SandboxRow:
        """Pause a running sandbox: its TTL clock stopped (what was left comes back on resume),
        its agent, ports and files answering `paused` meanwhile; kept for the paused
        retention, then ended. With its memory: frozen (no CPU, its processes carry on when
        resumed). Without: its processes end and only its disk stays (it boots fresh on it
        when resumed)."""
        started = time.monotonic()
        row = self.core.owned(caller, sandbox_id)
        if row.state == SandboxState.PAUSED:
            raise Conflict(f"sandbox {sandbox_id} is already paused", state=row.state)
        row = self.core.running(caller, sandbox_id)
        runtime = self.core.runtimes.for_row(row)
        feats = self.core.runtimes.features(runtime.name)
        if keep_memory and not (feats.pause and isinstance(runtime, Pausable)):
            raise InvalidRequest(
                f"the {runtime.name} isolation tier cannot pause sandboxes on this server",
                setting="isolation",
            )
        if not keep_memory and not (feats.park and isinstance(runtime, Parkable)):
            raise InvalidRequest(
                f"the {runtime.name} isolation tier cannot pause sandboxes without their memory "
                "on this server (it needs loop devices); pause with keep_memory=true",
                setting="keep_memory",
            )
        quota = self.core.quota(caller.tenant)
        async with self.core.table.tenant_lock(caller.tenant):
            self.core.admission.check_paused_room(caller, quota)
            async with self.core.table.lock(sandbox_id):
                row = self.core.running(caller, sandbox_id)
                await self._pause(row, runtime, keep_memory)
        self.core.wake.set()
        self.core.audit(
            caller, "sandbox.pause", sandbox_id, started=started, keep_memory=keep_memory
        )
        return self.core.get(caller, sandbox_id)

    async def _pause(self, row: SandboxRow, runtime: Any, keep_memory: bool) -> None:
        """Pause a running sandbox, its lock held."""
        ttl_left = max(0.0, row.end_at - time.time())
        if keep_memory:
            await self._freeze(row, runtime, ttl_left=ttl_left)
        else:
            await self.core.parking.park(row, runtime, ttl_left=ttl_left)

    async def pause_at_timeout(self, row: SandboxRow) -> bool:
        """A sandbox created with lifecycle `on_timeout: pause` reached its timeout: paused
        instead of ended, to run for its whole timeout again once resumed. False if it could
        not be (it is then ended as any other)."""
        runtime = self.core.runtimes.for_row(row)
        period = float((row.lifecycle or {}).get("timeout") or 300)
        async with self.core.table.lock(row.sandbox_id):
            fresh = self.core.store.get_sandbox(row.sandbox_id)
            if fresh is None or fresh.state != SandboxState.RUNNING:
                return True  # ended or paused meanwhile: nothing to do
            if fresh.end_at > time.time():
                if row.sandbox_id not in self.core.table.running:
                    self.core.table.running[row.sandbox_id] = fresh
                return True  # its deadline moved
            try:
                await self._freeze(fresh, runtime, ttl_left=period)
            except AgentboxError as e:
                log.warning("sandbox %s could not pause at its timeout: %s", row.sandbox_id, e)
                return False
        self.core.audit(None, "sandbox.pause", row.sandbox_id, tenant=row.tenant, reason="timeout")
        return True

    async def _freeze(self, row: SandboxRow, runtime: Any, ttl_left: float) -> None:
        """Pause a running sandbox (its lock held): nothing is served while it is frozen, so
        requests in flight end now, saying why."""
        sandbox_id = row.sandbox_id
        assert row.runtime_state is not None and isinstance(runtime, Pausable)
        self.core.table.running.pop(sandbox_id, None)
        self.core.table.unhealthy.pop(sandbox_id, None)
        self.core.table.pausing.add(sandbox_id)
        try:
            self.core.table.abort_requests(sandbox_id)
            try:
                state = await runtime.pause(sandbox_id, row.runtime_state)
            except RuntimeError_ as e:
                self.core.table.running[sandbox_id] = row
                raise SandboxUnavailable(f"sandbox {sandbox_id} could not pause: {e}") from None
            now = time.time()
            change = self.core.states.move(
                sandbox_id,
                SandboxState.PAUSED,
                only_from=frozenset({SandboxState.RUNNING}),
                runtime_state=state,
                paused_at=now,
                ttl_left=ttl_left,
                end_at=now + self.core.paused_retention_s,
            )
            if change is None:  # ended meanwhile (its end waits for this lock)
                raise SandboxNotRunning(f"sandbox {sandbox_id} ended", state="ended")
            paused = self.core.store.get_sandbox(sandbox_id)
            if paused is not None:
                self.core.table.paused[sandbox_id] = paused
        finally:
            self.core.table.pausing.discard(sandbox_id)

    async def resume(
        self, caller: Caller, sandbox_id: str, timeout: float | None = None
    ) -> SandboxRow:
        """Thaw a paused sandbox: it runs on with the TTL it had left at the pause, or
        `timeout` seconds if that is longer (a resume extends, never shortens). A running
        sandbox is left as it is (its timeout extended the same way)."""
        started = time.monotonic()
        row = self.core.owned(caller, sandbox_id)
        if timeout is not None:
            self._check_timeout(caller, timeout)
        if row.state == SandboxState.RUNNING:
            if timeout is not None and row.end_at < time.time() + timeout:
                await self.set_timeout(caller, sandbox_id, timeout)
            return self.core.get(caller, sandbox_id)
        if row.state != SandboxState.PAUSED:
            raise self.core.not_running(row)
        runtime = self.core.runtimes.for_row(row)
        if row.parked:
            await self.core.parking.unpark(row, runtime, timeout)
            self.core.audit(
                caller, "sandbox.resume", sandbox_id, started=started, timeout=timeout,
                keep_memory=False,
            )  # fmt: skip
            return self.core.get(caller, sandbox_id)
        async with self.core.table.lock(sandbox_id):
            fresh = self.core.store.get_sandbox(sandbox_id)
            if fresh is None or fresh.state != SandboxState.PAUSED:
                return self.core.get(caller, sandbox_id)
            assert fresh.runtime_state is not None and isinstance(runtime, Pausable)
            try:
                state = await runtime.resume(sandbox_id, fresh.runtime_state)
            except RuntimeError_ as e:
                raise SandboxUnavailable(f"sandbox {sandbox_id} could not resume: {e}") from None
            ttl = fresh.ttl_left or 0.0
            if timeout is not None:
                ttl = max(ttl, timeout)
            change = self.core.states.move(
                sandbox_id,
                SandboxState.RUNNING,
                only_from=frozenset({SandboxState.PAUSED}),
                runtime_state=state,
                paused_at=None,
                ttl_left=None,
                end_at=time.time() + ttl,
            )
            now_row = self.core.store.get_sandbox(sandbox_id)
            self.core.table.paused.pop(sandbox_id, None)
            if change is not None and now_row is not None:
                self.core.table.running[sandbox_id] = now_row
                if self.core.table.adopted_paused.pop(sandbox_id, None) is not None:
                    # Paused when this server started: what adoption does for running ones.
                    try:
                        await self.core.supervisor.serve_adopted(now_row, runtime)
                    except Exception:  # noqa: BLE001 - it runs: the resume stands
                        log.exception("sandbox %s resumed, but not served again", sandbox_id)
                else:
                    self.core.commands.rewatch(now_row)
        self.core.wake.set()
        self.core.audit(caller, "sandbox.resume", sandbox_id, started=started, timeout=timeout)
        return self.core.get(caller, sandbox_id)

    async def end(
        self, row: SandboxRow, state: SandboxState, reason: str, only_if_expired: bool = False
    ) -> bool:
        """Destroy a sandbox and record how it ended; False if it had already ended."""
        runtime = self.core.runtimes.for_row(row)  # one it cannot reach stays as it is
        async with self.core.table.lock(row.sandbox_id):
            self.core.table.running.pop(row.sandbox_id, None)
            self.core.table.paused.pop(row.sandbox_id, None)
            self.core.pools.forget(row.sandbox_id)
            fresh = self.core.store.get_sandbox(row.sandbox_id)
            if fresh is None or not fresh.live:
                return False
            if only_if_expired and fresh.end_at > time.time():
                if fresh.state == SandboxState.RUNNING:
                    self.core.table.running[fresh.sandbox_id] = fresh
                elif fresh.state == SandboxState.PAUSED:  # paused while this waited
                    self.core.table.paused[fresh.sandbox_id] = fresh
                return False  # the deadline moved while we waited for the lock
            self.core.table.ending[fresh.sandbox_id] = state
            self.core.table.ending_reason[fresh.sandbox_id] = reason
            await self.core.network.forget(fresh.sandbox_id)
            try:
                await runtime.destroy(fresh.sandbox_id, fresh.runtime_state, fresh.keep_workspace)
            except Exception:
                log.exception("destroy %s failed; will retry", fresh.sandbox_id)
                raise SandboxUnavailable(
                    f"sandbox {fresh.sandbox_id} could not be torn down completely yet; "
                    "retry the kill"
                ) from None
            finally:
                self.core.table.ending.pop(fresh.sandbox_id, None)
                self.core.table.ending_reason.pop(fresh.sandbox_id, None)
            # Its create's environment (credentials, often) is kept only while it lives.
            self.core.states.move(
                fresh.sandbox_id, state, end_reason=reason, ended_at=time.time(), envs=None
            )
            await self.core.volumes.detach(fresh.sandbox_id)
        self.core.table.forget(row.sandbox_id)
        self.core.commands.forget(row.sandbox_id)
        self.core.files.forget(row.sandbox_id)
        self.core.metrics.forget(row.sandbox_id)
        return True
