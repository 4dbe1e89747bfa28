"""Warm pools: per template and runtime, sandboxes created and fully started ahead of demand.

A member is an ordinary sandbox (a store row, a runtime state, reconciled on restart like any
other) owned by the reserved tenant `POOL_TENANT`, which no API key can have, so it counts
against nobody's quota and no tenant can see it. A create that finds a ready member claims it
(the row changes hands) instead of starting a sandbox; a background task per pool makes new
members until the pool is back at its size. The pool only tracks ids and numbers; making and
ending sandboxes is the manager's job (`make_member`, `end_member`).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("agentbox.pools")

POOL_TENANT = "~pool"  # not a valid tenant name (auth._TENANT_RE): no key can own it
CHECK_TENANT = "~check"  # start-up checks of templates (like POOL_TENANT: no key can own it)
MAX_POOL_SIZE = 64
RETRY_AFTER_FAILURE_S = 5.0
# A claim is usually followed at once by the claimer's first commands; a refill started in the
# same instant competes with them for the server process and the CPU (a create forks the server).
REFILL_DELAY_S = 0.05


def pool_name(template: str, runtime: str, default_runtime: str) -> str:
    """A pool's name: its template, with `@RUNTIME` when that is not the server's default
    (`code-interpreter`, `code-interpreter@gvisor`)."""
    return template if runtime == default_runtime else f"{template}@{runtime}"


def split_pool_name(name: str) -> tuple[str, str | None]:
    """(template, runtime or None for the server's default) of a pool's name."""
    template, sep, runtime = name.partition("@")
    return template, (runtime if sep else None)


@dataclass
class Pool:
    template: str  # the pool's name: its template, `@RUNTIME` when not the default (above)
    size: int
    ready: deque[str] = field(default_factory=deque)
    starting: int = 0
    hits: int = 0
    misses: int = 0
    failures: int = 0
    last_error: str | None = None
    refill_s: deque[float] = field(default_factory=lambda: deque(maxlen=200))
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    # tenant -> [hits, misses]: how a tenant's creates fared is that tenant's business only.
    by_tenant: dict[str, list[int]] = field(default_factory=dict)

    def count(self, tenant: str, hit: bool) -> None:
        if hit:
            self.hits += 1
        else:
            self.misses += 1
        self.by_tenant.setdefault(tenant, [0, 0])[0 if hit else 1] += 1

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        """The pool's numbers: all of them (the operator's view), or with `tenant` that
        tenant's own hits and misses and no error text (it may name other sandboxes)."""
        times = sorted(self.refill_s)
        hits, misses = (
            (self.hits, self.misses) if tenant is None else self.by_tenant.get(tenant, [0, 0])
        )
        return {
            "template": self.template,
            "runtime": split_pool_name(self.template)[1],
            "size": self.size,
            "ready": len(self.ready),
            "starting": self.starting,
            "hits": hits,
            "misses": misses,
            "failures": self.failures,
            "last_error": self.last_error if tenant is None else None,
            "refills": len(times),
            "refill_ms_p50": round(statistics.median(times) * 1000, 1) if times else None,
            "refill_ms_max": round(times[-1] * 1000, 1) if times else None,
            "refill_ms_last": round(self.refill_s[-1] * 1000, 1) if times else None,
        }


class WarmPools:
    def __init__(
        self,
        sizes: dict[str, int],
        make_member: Callable[[str], Awaitable[str]],
        end_member: Callable[[str], Awaitable[None]],
    ) -> None:
        self.pools: dict[str, Pool] = {t: Pool(t, n) for t, n in sizes.items()}
        self.make_member = make_member
        self.end_member = end_member
        self.running = False

    # ------------------------------------------------------------------ claims

    def take(self, template: str, is_usable: Callable[[str], bool], tenant: str) -> str | None:
        """A ready member's id for `tenant`, or None (a miss) when the pool is empty or absent."""
        pool = self.pools.get(template)
        if pool is None:
            return None
        while pool.ready:
            sid = pool.ready.popleft()
            if is_usable(sid):
                pool.count(tenant, hit=True)
                pool.wake.set()
                return sid
        pool.count(tenant, hit=False)
        pool.wake.set()
        return None

    def forget(self, sandbox_id: str) -> None:
        """A member that ended (killed, vanished): never hand it out."""
        for pool in self.pools.values():
            if sandbox_id in pool.ready:
                pool.ready.remove(sandbox_id)
                pool.wake.set()

    def adopt(self, template: str, sandbox_id: str) -> bool:
        """After a restart: keep a live member if its pool still wants it."""
        pool = self.pools.get(template)
        if pool is None or len(pool.ready) >= pool.size:
            return False
        pool.ready.append(sandbox_id)
        return True

    # ------------------------------------------------------------------ sizes

    async def set_size(self, template: str, size: int) -> Pool:
        pool = self.pools.get(template)
        if pool is None:
            pool = self.pools[template] = Pool(template, size)
        pool.size = size
        surplus = []
        while len(pool.ready) > size:
            surplus.append(pool.ready.pop())
        for sid in surplus:
            await self.end_member(sid)
        if self.running and pool.task is None:
            pool.task = asyncio.create_task(self._refill(pool))
        pool.wake.set()
        return pool

    def stats(self, tenant: str | None = None) -> list[dict[str, Any]]:
        return [p.stats(tenant) for p in self.pools.values()]

    # ------------------------------------------------------------------ refill

    def start(self) -> None:
        self.running = True
        for pool in self.pools.values():
            if pool.task is None:
                pool.task = asyncio.create_task(self._refill(pool))

    async def stop(self, grace: float = 30.0) -> None:
        """Stop refilling. A member being started is let finish (it is a whole sandbox the
        next start adopts): cut off half-way, nothing would own it until a restart."""
        self.running = False
        tasks = [p.task for p in self.pools.values() if p.task is not None]
        for pool in self.pools.values():
            pool.wake.set()
        _, pending = await asyncio.wait(tasks, timeout=grace) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for pool in self.pools.values():
            pool.task = None

    async def _refill(self, pool: Pool) -> None:
        """Keep the pool at its size, one new member at a time (creation is CPU-bound)."""
        while self.running:
            if len(pool.ready) + pool.starting >= pool.size:
                pool.wake.clear()
                await pool.wake.wait()
                await asyncio.sleep(REFILL_DELAY_S)
                continue
            pool.starting += 1
            t0 = time.monotonic()
            try:
                sid = await self.make_member(pool.template)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a failed refill is retried, never fatal
                pool.failures += 1
                pool.last_error = str(e)
                log.warning("warm pool %s: could not start a member: %s", pool.template, e)
                if self.running:
                    await asyncio.sleep(RETRY_AFTER_FAILURE_S)
                continue
            finally:
                pool.starting -= 1
            pool.refill_s.append(time.monotonic() - t0)
            if len(pool.ready) < pool.size:
                pool.ready.append(sid)
            else:  # the pool shrank while this one started
                await self.end_member(sid)
