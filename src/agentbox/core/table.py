"""The sandbox table: what the core knows of live sandboxes beyond their records, in one object
every service shares (instead of each reaching into the front object's private fields).

The store holds each sandbox's record; this holds what only this process knows and must keep
exact on every change: which sandboxes run (read on every command and file call), which are
being torn down or killed while they start, whose agent has gone silent, which agent
connections each has open, and the locks that serialize a sandbox's (or a tenant's) changes.
No I/O here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentbox.store.db import SandboxRow


class SandboxTable:
    def __init__(self) -> None:
        # Running sandboxes. This process is the only writer of their rows (embedded mode), so
        # the cache is kept exact on every change.
        self.running: dict[str, SandboxRow] = {}
        # Sandboxes being torn down -> the state they are ending in: their agent connections
        # break before the record changes, and callers must hear "ended", not "unavailable".
        self.ending: dict[str, str] = {}
        # ... and why (`end_reason`): a command it ran is told, e.g. that its memory ran out.
        self.ending_reason: dict[str, str] = {}
        # Starting sandboxes a kill is waiting for: the start gives up instead of finishing.
        self.kill_pending: set[str] = set()
        # Running sandboxes being paused: requests to them are told so.
        self.pausing: set[str] = set()
        # Paused sandboxes (kept exact as `running` is: the ports gateway asks per request).
        self.paused: dict[str, SandboxRow] = {}
        # Sandboxes found paused when this server started -> their egress setup, served once
        # they resume (the proxy reaches a gVisor sandbox through its agent, frozen meanwhile).
        self.adopted_paused: dict[str, Any] = {}
        # Running sandboxes whose agent did not answer its last ping -> why.
        self.unhealthy: dict[str, str] = {}
        # The open agent connections of callers' requests per sandbox (aborted when it turns
        # unhealthy).
        self.inflight: dict[str, set[Any]] = {}
        self._sandbox_locks: dict[str, asyncio.Lock] = {}
        self._tenant_locks: dict[str, asyncio.Lock] = {}

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        """Held while a sandbox starts or ends: one change of its life at a time."""
        return self._sandbox_locks.setdefault(sandbox_id, asyncio.Lock())

    def tenant_lock(self, tenant: str) -> asyncio.Lock:
        """Held from a tenant's admission check to its new record: no two creates both fit."""
        return self._tenant_locks.setdefault(tenant, asyncio.Lock())

    def track(self, sandbox_id: str) -> set[Any]:
        """The set a caller's agent connection to the sandbox registers in."""
        return self.inflight.setdefault(sandbox_id, set())

    def abort_requests(self, sandbox_id: str) -> None:
        for conn in list(self.inflight.get(sandbox_id, ())):
            conn.abort()

    def forget(self, sandbox_id: str) -> None:
        """An ended sandbox: nothing of it is kept."""
        self.running.pop(sandbox_id, None)
        self._sandbox_locks.pop(sandbox_id, None)
        self.unhealthy.pop(sandbox_id, None)
        self.inflight.pop(sandbox_id, None)
        self.adopted_paused.pop(sandbox_id, None)
        self.paused.pop(sandbox_id, None)
