"""Sandbox metrics: CPU, memory and disk over time, sampled by the server.

Every `interval` seconds (AGENTBOX_METRICS_INTERVAL_S, default 5) the sampler asks each live
sandbox's runtime what it uses (its cgroups: CPU time and memory; its workspace image's real
size) and keeps the last `keep` seconds (AGENTBOX_METRICS_KEEP_S, default an hour) of samples
per sandbox in fixed-size rings of 4-byte floats: about 14 KiB a sandbox for an hour of 5 s
samples, so 1,000 sandboxes hold about 14 MiB. A sandbox's samples go when it ends (`forget`,
from the one place sandboxes end).

A sample's CPU is the share of the sandbox's CPUs it used since the sample before (100 = all of
`cpu_count` busy); a paused sandbox's is 0 and its memory is what it holds frozen.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentbox.core.auth import Caller
from agentbox.core.states import SandboxState

if TYPE_CHECKING:
    from agentbox.core.manager import SandboxManager
    from agentbox.store.db import SandboxRow

log = logging.getLogger("agentbox.metrics")
MiB = 2**20
SAMPLE_SLICE = 100  # sandboxes sampled in one go (a round's slices spread over its first half)


@dataclass(frozen=True)
class MetricsSettings:
    interval_s: float = 5.0  # AGENTBOX_METRICS_INTERVAL_S
    keep_s: float = 3600.0  # AGENTBOX_METRICS_KEEP_S

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> MetricsSettings:
        defaults = cls()
        out = {}
        for name, var in (("interval_s", "AGENTBOX_METRICS_INTERVAL_S"),
                          ("keep_s", "AGENTBOX_METRICS_KEEP_S")):  # fmt: skip
            raw = env.get(var, "").strip()
            if not raw:
                continue
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r} is not a number") from None
            if not 0.1 <= value <= 7 * 86_400:
                raise ValueError(f"{var}={raw!r} must be between 0.1 and 604800 seconds")
            out[name] = value
        settings = cls(**{**vars(defaults), **out})
        if settings.keep_s < settings.interval_s:
            raise ValueError("AGENTBOX_METRICS_KEEP_S must be at least the sampling interval")
        return settings


class _Ring:
    """The last `size` samples of one sandbox: time, CPU %, memory and disk (MiB)."""

    __slots__ = ("at", "cpu", "mem", "disk", "next", "count", "last_cpu", "last_at")

    def __init__(self, size: int) -> None:
        self.at = array("d", bytes(8 * size))
        self.cpu = array("f", bytes(4 * size))
        self.mem = array("f", bytes(4 * size))
        self.disk = array("f", bytes(4 * size))
        self.next = 0
        self.count = 0
        self.last_cpu: float | None = None  # CPU seconds at the sample before
        self.last_at = 0.0

    def add(self, at: float, cpu: float, mem: float, disk: float) -> None:
        i = self.next
        self.at[i], self.cpu[i], self.mem[i], self.disk[i] = at, cpu, mem, disk
        self.next = (i + 1) % len(self.at)
        self.count = min(self.count + 1, len(self.at))

    def samples(self, start: float, end: float) -> list[tuple[float, float, float, float]]:
        size = len(self.at)
        first = (self.next - self.count) % size
        out = []
        for k in range(self.count):
            i = (first + k) % size
            if start <= self.at[i] <= end:
                out.append((self.at[i], self.cpu[i], self.mem[i], self.disk[i]))
        return out


class Metrics:
    """The sampler and what it kept (a service of the core, see core/manager.py)."""

    def __init__(self, core: SandboxManager, settings: MetricsSettings | None = None) -> None:
        self.core = core
        self.settings = settings or MetricsSettings.from_env()
        self.size = max(1, int(self.settings.keep_s / self.settings.interval_s) + 1)
        self.rings: dict[str, _Ring] = {}

    async def run(self) -> None:
        """A round every interval; its sandboxes in slices of `SAMPLE_SLICE` spread over the
        first half of it, so that thousands of them do not hold a thread (and the interpreter's
        lock) against the requests for a burst."""
        while True:
            started = time.monotonic()
            table = self.core.table
            rows = [*table.running.values(), *table.paused.values()]
            slices = [rows[i : i + SAMPLE_SLICE] for i in range(0, len(rows), SAMPLE_SLICE)]
            for n, part in enumerate(slices):
                if n:
                    await asyncio.sleep(self.settings.interval_s / 2 / len(slices))
                try:
                    await asyncio.to_thread(self.sample, part)
                except Exception:  # noqa: BLE001 - a bad round must not end sampling
                    log.exception("sampling sandbox metrics failed")
            spent = time.monotonic() - started
            await asyncio.sleep(max(0.05, self.settings.interval_s - spent))

    def sample(self, rows: list[SandboxRow]) -> None:
        now = time.time()
        table = self.core.table
        for row in rows:
            if row.runtime_state is None or not self.core.runtimes.serves(row):
                continue
            if row.sandbox_id not in table.running and row.sandbox_id not in table.paused:
                continue  # ended since the round began: its samples are forgotten
            runtime = self.core.runtimes.for_row(row)
            try:
                used = runtime.usage(row.sandbox_id, row.runtime_state) or {}
                disk = used.get("disk_bytes")
                if disk is None:
                    disk = runtime.workspace_bytes(row.sandbox_id, row.runtime_state)
            except Exception:  # noqa: BLE001 - one sandbox's reading must not stop the round
                log.exception("reading the usage of sandbox %s failed", row.sandbox_id)
                continue
            ring = self.rings.get(row.sandbox_id)
            if ring is None:
                ring = self.rings[row.sandbox_id] = _Ring(self.size)
            cpu_s = used.get("cpu_seconds")
            pct = 0.0
            if cpu_s is not None and ring.last_cpu is not None and now > ring.last_at:
                cpus = float(row.resources.get("cpu_count") or 1)
                pct = max(0.0, (cpu_s - ring.last_cpu) / (now - ring.last_at) / cpus * 100)
            if row.state == SandboxState.PAUSED:
                pct = 0.0
            ring.last_cpu, ring.last_at = cpu_s, now
            memory = used.get("memory_bytes", 0.0) / MiB
            ring.add(now, min(pct, 100.0), memory, (disk or 0) / MiB)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox ended: its samples go (a sandbox between two lists, pausing say, keeps
        them)."""
        self.rings.pop(sandbox_id, None)

    def get(
        self, caller: Caller, sandbox_id: str, start: float | None, end: float | None
    ) -> list[dict[str, Any]]:
        """The caller's sandbox's samples between `start` and `end` (unix seconds), oldest
        first; none for an ended sandbox (its samples went with it)."""
        row = self.core.owned(caller, sandbox_id)
        ring = self.rings.get(sandbox_id)
        if ring is None:
            return []
        resources = row.resources
        mem_total = int(resources.get("memory_mb") or 0) * MiB
        disk_total = int(resources.get("disk_mb") or 0) * MiB
        cpus = float(resources.get("cpu_count") or 1)
        return [
            {
                "timestamp": at,
                "cpu_count": cpus,
                "cpu_used_pct": round(cpu, 2),
                "mem_used": int(mem * MiB),
                "mem_total": mem_total,
                "disk_used": int(disk * MiB),
                "disk_total": disk_total,
            }
            for at, cpu, mem, disk in ring.samples(
                start if start is not None else 0.0, end if end is not None else float("inf")
            )
        ]
