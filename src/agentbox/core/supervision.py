"""Supervision: sandboxes end at their deadline, dead ones are noticed and cleaned up, silent
agents are shown `unhealthy`, and after a (re)start of the server every record is reconciled
with what runs on the host (re-adopted, expired, failed, or a stray removed).

A service of the core (see core/manager.py, the front object).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import os
import resource
import time
from typing import TYPE_CHECKING

from agentbox.agent.client import AgentClient, AgentOpError, AgentUnavailable
from agentbox.core.errors import AgentboxError
from agentbox.core.network import SandboxNetwork
from agentbox.core.pools import CHECK_TENANT, POOL_TENANT, pool_name
from agentbox.core.states import SandboxState
from agentbox.runtimes.base import Parkable, Pausable, Runtime, RuntimeError_
from agentbox.store.db import PARKING, SandboxRow

if TYPE_CHECKING:
    from agentbox.core.manager import SandboxManager

log = logging.getLogger("agentbox.manager")

HEALTH_CONCURRENCY = 32  # pings in flight at once (a wedged agent holds one for the timeout)
# Agents pinged a health round at most (with more running, each every few rounds).
HEALTH_PINGS_PER_ROUND = 100


class _ExitWatches:
    """The pidfds (`Runtime.exit_fd`) of running sandboxes, waited on by the event loop: a
    sandbox whose processes end is noticed then (its health checked at once), not read from
    /proc every round. At most a quarter of the descriptor limit is spent on them; sandboxes
    beyond that, and those whose runtime has no such descriptor, are read every round."""

    def __init__(self, supervisor: Supervisor, limit: asyncio.Semaphore) -> None:
        self.supervisor = supervisor
        self.limit = limit
        self.fds: dict[str, int] = {}
        self.refused: set[str] = set()  # sandboxes whose runtime gave no descriptor
        self.checks: set[asyncio.Task[None]] = set()
        self.loop = asyncio.get_running_loop()
        self.cap = resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4

    def __contains__(self, sandbox_id: str) -> bool:
        return sandbox_id in self.fds

    def add(self, row: SandboxRow) -> None:
        """Watch a running sandbox's end, if its runtime can say and it is not watched yet.
        Called after a round read it alive, so an end before the watch is not missed: the
        descriptor of a process already gone is readable at once."""
        sid = row.sandbox_id
        if sid in self.fds or sid in self.refused or len(self.fds) >= self.cap:
            return
        table = self.supervisor.core.table
        if sid not in table.running or sid in table.ending:
            return
        assert row.runtime_state is not None
        runtime = self.supervisor.core.runtimes.for_row(row)
        fd = runtime.exit_fd(sid, row.runtime_state)
        if fd is None:
            self.refused.add(sid)
            return
        self.fds[sid] = fd
        self.loop.add_reader(fd, self._ended, sid)

    def _ended(self, sandbox_id: str) -> None:
        self._drop(sandbox_id)
        row = self.supervisor.core.table.running.get(sandbox_id)
        if row is None or row.runtime_state is None:
            return
        check = self.loop.create_task(self.supervisor._check_health(row, self.limit, ping=False))
        self.checks.add(check)
        check.add_done_callback(self.checks.discard)

    def keep(self, running: dict[str, float]) -> None:
        """Stop watching sandboxes no longer running (ended or paused)."""
        for sid in [s for s in self.fds if s not in running]:
            self._drop(sid)
        self.refused &= running.keys()

    def _drop(self, sandbox_id: str) -> None:
        fd = self.fds.pop(sandbox_id, None)
        if fd is not None:
            self.loop.remove_reader(fd)
            os.close(fd)

    def close(self) -> None:
        for sid in list(self.fds):
            self._drop(sid)


class Supervisor:
    def __init__(self, core: SandboxManager) -> None:
        self.core = core

    async def reaper(self) -> None:
        """End sandboxes at their deadline: never before it, and within a few ms after it."""
        while True:
            now = time.time()
            stuck = False  # a row past its deadline that cannot be ended now: no busy loop
            for row in self.core.store.expired(now):
                if not self.core.runtimes.serves(row):
                    stuck = True  # left for a server that serves its runtime
                    continue
                on_timeout = (row.lifecycle or {}).get("on_timeout")
                if row.state == SandboxState.RUNNING and on_timeout == "pause":
                    try:
                        if await self.core.lifecycle.pause_at_timeout(row):
                            continue
                    except Exception:  # noqa: BLE001 - the reaper must outlive any one sandbox
                        log.exception("pausing sandbox %s at its timeout failed", row.sandbox_id)
                # A paused sandbox's end_at is the end of its retention.
                paused = row.state == SandboxState.PAUSED
                reason = "paused_retention" if paused else "timeout"
                try:
                    if await self.core.lifecycle.end(
                        row, SandboxState.EXPIRED, reason, only_if_expired=True
                    ):
                        self.core.audit(
                            None, "sandbox.expire", row.sandbox_id, tenant=row.tenant,
                            reason=reason,
                        )  # fmt: skip
                except AgentboxError:
                    stuck = True
            nxt = self.core.store.next_deadline()
            delay = 1.0 if nxt is None else min(1.0, max(0.0, nxt - time.time()))
            if stuck:
                delay = max(delay, 0.5)
            self.core.wake.clear()
            # Not wait_for: in Python 3.11 it loses a cancellation that arrives as the event
            # is set (a create wakes the reaper as the server stops), and stop() would hang.
            try:
                async with asyncio.timeout(delay + 0.001):
                    await self.core.wake.wait()
            except TimeoutError:
                pass

    async def health(self) -> None:
        """Notice sandboxes whose processes died underneath us (and clean up after them), and
        agents that stopped answering (the sandbox is `unhealthy` until they answer again).
        A sandbox whose runtime gives a descriptor for its end (a pidfd) is noticed when that
        becomes readable; the others are read from /proc every round. At most
        `HEALTH_PINGS_PER_ROUND` agents are pinged a round, those pinged longest ago first, so
        that thousands of idle sandboxes do not keep the server busy pinging them."""
        limit = asyncio.Semaphore(HEALTH_CONCURRENCY)
        pinged: dict[str, float] = {}  # sandbox -> when its agent was last pinged
        watches = _ExitWatches(self, limit)
        try:
            while True:
                await asyncio.sleep(self.core.health_interval)
                rows = [r for r in self.core.table.running.values()
                        if r.runtime_state is not None]  # fmt: skip
                pinged = {r.sandbox_id: pinged.get(r.sandbox_id, 0.0) for r in rows}
                watches.keep(pinged)
                due = rows
                if len(rows) > HEALTH_PINGS_PER_ROUND:
                    unhealthy = self.core.table.unhealthy  # pinged first: do they answer again?
                    due = heapq.nsmallest(
                        HEALTH_PINGS_PER_ROUND,
                        rows,
                        key=lambda r: -1.0 if r.sandbox_id in unhealthy else pinged[r.sandbox_id],
                    )
                now = time.monotonic()
                for row in due:
                    pinged[row.sandbox_id] = now
                # Spread over the first half of the round: a hundred pings at once would hold
                # up the requests that came in meanwhile.
                gap = self.core.health_interval / 2 / max(1, len(due))
                pings = asyncio.gather(*(
                    self._check_health(r, limit, ping=True, after=i * gap,
                                       alive=r.sandbox_id in watches)
                    for i, r in enumerate(due)
                ))  # fmt: skip
                chosen = {row.sandbox_id for row in due}
                rest = [row for row in rows
                        if row.sandbox_id not in chosen and row.sandbox_id not in watches]
                for i, row in enumerate(rest):
                    if i % 16 == 15:
                        await asyncio.sleep(0)  # requests between the reads
                    await self._check_health(row, limit, ping=False)
                for row in rows:
                    watches.add(row)
                await pings
        finally:
            watches.close()

    async def _check_health(
        self, row: SandboxRow, limit: asyncio.Semaphore, ping: bool, after: float = 0.0,
        alive: bool = False,
    ) -> None:
        """`alive`: known alive (its end is watched), so only the ping is due."""
        sid = row.sandbox_id
        if after:
            await asyncio.sleep(after)
        assert row.runtime_state is not None
        if sid not in self.core.table.running or sid in self.core.table.ending:
            return  # ended, or paused, since the round began
        runtime = self.core.runtimes.for_row(row)
        if not alive and not await runtime.is_alive(sid, row.runtime_state):
            # A sandbox that went over its memory limit where that ends the whole sandbox
            # (gVisor's kernel is one process to the host's OOM killer) says so.
            oom = runtime.limit_counters(sid).get("oom_kill", 0) > 0
            try:
                await self.core.lifecycle.end(
                    row, SandboxState.KILLED, "memory_limit" if oom else "vanished"
                )
            except AgentboxError:
                pass
            return
        if not ping:
            return
        async with limit:
            # Its own connection, like every request: an agent blocked sending a stream to a
            # slow reader still answers this.
            path = runtime.agent_address(sid, row.runtime_state).socket_path
            client = AgentClient(path, connect_timeout=self.core.ping_timeout)
            try:
                await client.ping(self.core.ping_timeout)
            except AgentOpError:
                pass  # it answered
            except AgentUnavailable as e:
                if sid in self.core.table.running and sid not in self.core.table.ending:
                    self.core.mark_unhealthy(
                        sid, f"no answer to a health check within {self.core.ping_timeout:g} s: {e}"
                    )
                    if row.tenant == POOL_TENANT:  # nobody's yet: replace it
                        try:
                            await self.core.lifecycle.end(row, SandboxState.FAILED, "failed")
                        except AgentboxError:
                            pass
                return
            if self.core.table.unhealthy.pop(sid, None) is not None:
                log.warning("sandbox %s: its agent answers again", sid)

    async def reconcile(self) -> dict[str, int]:
        """After a (re)start: re-adopt live sandboxes, reap expired ones, remove strays."""
        counts = {
            "adopted": 0,
            "expired": 0,
            "vanished": 0,
            "failed": 0,
            "strays": 0,
            "pool_removed": 0,
            "unserved": 0,
            "parked": 0,
        }
        now = time.time()
        known: set[str] = set()
        for row in self.core.store.live_sandboxes():
            if not self.core.runtimes.serves(row):
                # Its runtime is not served now: left as it is, for a server that serves it.
                log.warning(
                    "sandbox %s runs on the %s runtime, which this server does not serve; "
                    "left alone", row.sandbox_id, row.runtime,
                )  # fmt: skip
                counts["unserved"] += 1
                continue
            runtime = self.core.runtimes.for_row(row)
            if (row.parked and (
                row.state == SandboxState.STARTING
                or (row.state == SandboxState.PAUSED and row.end_at > now)
            )) or (row.park == PARKING and row.state == SandboxState.RUNNING):  # fmt: skip
                # Paused without memory (or resuming from that when the last server
                # stopped: paused again, whatever of it had started ended).
                if await self._keep_parked(row, runtime):
                    known.add(row.sandbox_id)
                    counts["parked"] += 1
                else:
                    counts["vanished"] += 1
                continue
            if (
                row.state in (SandboxState.STARTING, SandboxState.BUILDING)
                or row.runtime_state is None
            ):
                await self.core.lifecycle.end(row, SandboxState.FAILED, "failed")
                counts["failed"] += 1
            elif row.tenant == CHECK_TENANT:  # a start-up check the last server left
                await self.core.lifecycle.end(row, SandboxState.KILLED, "checked")
            elif row.end_at <= now and not self._pauses_at_timeout(row):
                reason = "paused_retention" if row.state == SandboxState.PAUSED else "timeout"
                await self.core.lifecycle.end(row, SandboxState.EXPIRED, reason)
                self.core.audit(
                    None, "sandbox.expire", row.sandbox_id, tenant=row.tenant, reason=reason
                )
                counts["expired"] += 1
            elif not await runtime.is_alive(row.sandbox_id, row.runtime_state):
                await self.core.lifecycle.end(row, SandboxState.KILLED, "vanished")
                counts["vanished"] += 1
            elif row.state == SandboxState.PAUSED:
                # Left frozen (frozen again, had a crash come between its freeze and its
                # record); served (egress, commands watched) when it resumes.
                await self._match_freezer(row, runtime, frozen=True)
                runtime.adopt(row.sandbox_id, row.runtime_state)
                known.add(row.sandbox_id)
                self.core.table.adopted_paused[row.sandbox_id] = True
                self.core.table.paused[row.sandbox_id] = row
                counts["adopted"] += 1
            else:
                # Thawed, had a crash come between a freeze and its record (a running one
                # past its deadline with lifecycle on_timeout pause: the reaper pauses it).
                await self._match_freezer(row, runtime, frozen=False)
                runtime.adopt(row.sandbox_id, row.runtime_state)
                known.add(row.sandbox_id)
                self.core.table.running[row.sandbox_id] = row
                name = pool_name(row.template, row.runtime, self.core.runtimes.default)
                if row.tenant == POOL_TENANT and not self.core.pools.adopt(name, row.sandbox_id):
                    await self.core.lifecycle.end(row, SandboxState.KILLED, "pool_shrunk")
                    counts["pool_removed"] += 1
                    continue
                counts["adopted"] += 1
                await self.serve_adopted(row, runtime)
        for each in self.core.runtimes:
            for stray in await each.list_sandboxes() - known:
                log.warning("removing stray sandbox %s (%s) no record explains", stray, each.name)
                await each.destroy(stray, None, keep_workspace=False)
                counts["strays"] += 1
        log.info("reconciled: %s", counts)
        return counts

    async def _keep_parked(self, row: SandboxRow, runtime: Runtime) -> bool:
        """Keep a sandbox paused without memory as it is (its disk), also one a crash caught
        resuming; False if its disk is gone (it is ended, vanished)."""
        try:
            if not isinstance(runtime, Parkable):
                raise RuntimeError_(f"the {runtime.name} runtime cannot keep a parked sandbox")
            if row.state in (SandboxState.STARTING, SandboxState.RUNNING):
                # Resuming (or being paused) when the last server stopped: paused again.
                await self.core.network.forget(row.sandbox_id)
                state = await runtime.park(row.sandbox_id, None)
                ttl = row.ttl_left or 0.0
                if row.state == SandboxState.RUNNING:
                    ttl = max(0.0, row.end_at - time.time())
                await self.core.parking.record(
                    row.sandbox_id, row, state, SandboxState(row.state), ttl
                )
            else:
                await runtime.park(row.sandbox_id, row.runtime_state)
                self.core.table.paused[row.sandbox_id] = row
            return True
        except (RuntimeError_, AgentboxError) as e:
            log.warning("sandbox %s: its parked disk cannot be kept: %s", row.sandbox_id, e)
            await self.core.lifecycle.end(row, SandboxState.KILLED, "vanished")
            return False

    @staticmethod
    def _pauses_at_timeout(row: SandboxRow) -> bool:
        on_timeout = (row.lifecycle or {}).get("on_timeout")
        return row.state == SandboxState.RUNNING and on_timeout == "pause"

    async def _match_freezer(self, row: SandboxRow, runtime: Runtime, frozen: bool) -> None:
        """Make the sandbox frozen or not as its record says (both idempotent)."""
        if not self.core.runtimes.features(runtime.name).pause or not isinstance(
            runtime, Pausable
        ):
            return
        assert row.runtime_state is not None
        try:
            if frozen:
                await runtime.pause(row.sandbox_id, row.runtime_state)
            else:
                await runtime.resume(row.sandbox_id, row.runtime_state)
        except RuntimeError_ as e:
            log.warning("sandbox %s: its freezer does not match its record: %s", row.sandbox_id, e)

    async def serve_adopted(self, row: SandboxRow, runtime: Runtime) -> None:
        """What a running sandbox found at start-up gets again from this server: the egress
        proxy on its loopback, and its commands watched (those that ended meanwhile audited)."""
        assert row.runtime_state is not None
        await self.core.creation.serve_egress(
            row.sandbox_id,
            row.runtime_state,
            row.tenant,
            SandboxNetwork.from_dict(row.network),
            self.core.network.restore(row.sandbox_id, row.secrets or {}),
            runtime,
        )
        try:
            commands = await self.core.client(row).list_commands()
            audited: set[str] | None = None
            for info in commands:
                if not info.get("running"):
                    # Ended while no server ran (or before a crash let it be audited): audit
                    # it now, once.
                    if audited is None:
                        audited = self._audited_commands(row.sandbox_id)
                    if info["cmd_id"] in audited:
                        continue
                self.core.commands.watch(row, info["cmd_id"], info.get("cmd", ""), None, 0)
        except (AgentUnavailable, AgentOpError, KeyError, TypeError):
            pass

    def _audited_commands(self, sandbox_id: str) -> set[str]:
        events = self.core.store.list_audit(None, sandbox_id, "command.run", None, 100_000)
        return {str((e["detail"] or {}).get("cmd_id")) for e in events}
