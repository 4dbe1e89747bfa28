"""How much the audit and egress logs may hold, and what keeps them there.

Sandboxes decide how often they try a refused host, and clients how often they call the API;
neither may decide how much disk the server fills. The store cuts every field to a documented
length (store/db.py); here:

- `RefusalSampler` lets the first refused egress attempts of a sandbox in each window through
  to the log in full and only counts the rest, in one summary row per rule and window;
- `LogKeeper` trims both logs to their retention and row cap, at start and then every minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentbox.store.db import Store

log = logging.getLogger(__name__)

OTHER_RULES = "*"  # the summary key of rules past `refused_rules` in one window


@dataclass(frozen=True)
class LogLimits:
    """The logs' budgets. Defaults suit one small host; see docs/API.md."""

    # Rows older than this are deleted.
    retention_days: float = 30.0
    # Rows each log keeps at most (the newest).
    max_rows: int = 1_000_000
    # Refused egress attempts of one sandbox written in full per window; the rest are counted.
    refused_sampled: int = 20
    refused_window_s: float = 60.0
    # Summary rows per sandbox and window: one per rule, rules past this many share one.
    refused_rules: int = 16
    # How often the keeper trims; the caps can be overshot by what is written meanwhile.
    trim_interval_s: float = 60.0


@dataclass
class Tally:
    """Refusals counted, not written, under one rule in one window, and their summary row."""

    row: dict[str, Any]  # the summary row, with `suppressed` = the count once written
    count: int = 0
    written: int = 0  # the count the stored row holds
    row_id: int | None = None


@dataclass
class _Window:
    start: float
    sampled: int = 0
    tallies: dict[str, Tally] = field(default_factory=dict)


class RefusalSampler:
    """Decides which egress events are written one by one: every allowed attempt, and a
    sandbox's first `refused_sampled` refused ones per `refused_window_s`; the others are
    counted per rule, and `changed` hands out the summary rows to write or update."""

    def __init__(self, limits: LogLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        self._ended: list[Tally] = []  # of windows that ended, not yet handed out

    def admit(self, event: dict[str, Any]) -> bool:
        """Whether to write this event in full; False: it was counted in a summary."""
        sid = event.get("sandbox_id")
        if event.get("allowed") or not sid:
            return True
        w = self._window(sid, self._clock())
        if w.sampled < self.limits.refused_sampled:
            w.sampled += 1
            return True
        rule = str(event.get("rule") or "")
        if rule not in w.tallies and len(w.tallies) >= self.limits.refused_rules:
            rule = OTHER_RULES
        tally = w.tallies.get(rule)
        if tally is None:
            tally = w.tallies[rule] = Tally(self._summary(event, rule))
        tally.count += 1
        tally.row["time"] = event.get("time", time.time())
        return False

    def _window(self, sandbox_id: str, now: float) -> _Window:
        w = self._windows.get(sandbox_id)
        if w is None or now - w.start >= self.limits.refused_window_s:
            if w is not None:
                self._ended.extend(w.tallies.values())
            w = self._windows[sandbox_id] = _Window(now)
        return w

    def _summary(self, first: dict[str, Any], rule: str) -> dict[str, Any]:
        n, window = self.limits.refused_sampled, self.limits.refused_window_s
        shared = "; rules past the first few share this row" if rule == OTHER_RULES else ""
        return {
            **first,
            "rule": rule,
            "reason": f"refused attempts of this sandbox past the first {n} in {window:g} s are "
            "counted in `suppressed`, not written one by one; host, port and request are the "
            f"first counted one's{shared}",
            "bytes_out": 0,
            "bytes_in": 0,
            "duration_ms": None,
            "suppressed": 0,
        }

    def changed(self) -> list[Tally]:
        """Summaries whose count is not stored yet. The caller writes each (`row_id` None:
        insert) and sets `written`; windows that ended are forgotten once handed out."""
        now = self._clock()
        for sid, w in list(self._windows.items()):
            if now - w.start >= self.limits.refused_window_s:
                self._ended.extend(w.tallies.values())
                del self._windows[sid]
        out, self._ended = self._ended, []
        for w in self._windows.values():
            out += w.tallies.values()
        return [t for t in out if t.count != t.written]

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: its open window ends now (its summaries still get written)."""
        w = self._windows.pop(sandbox_id, None)
        if w is not None:
            self._ended.extend(w.tallies.values())


class LogKeeper:
    """Trims both logs to `retention_days` and `max_rows`, at start and every interval."""

    def __init__(self, store: Store, limits: LogLimits) -> None:
        self.store = store
        self.limits = limits
        self._task: asyncio.Task[None] | None = None

    def trim(self) -> int:
        before = time.time() - self.limits.retention_days * 86_400
        return self.store.trim_logs(before, self.limits.max_rows)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                # In a thread: a first trim of a big log takes seconds, the API must not wait.
                removed = await asyncio.to_thread(self.trim)
                if removed:
                    log.info("trimmed %d audit and egress log rows", removed)
            except Exception:  # noqa: BLE001 - a failed trim is retried next round
                log.exception("could not trim the audit and egress logs")
            await asyncio.sleep(self.limits.trim_interval_s)
