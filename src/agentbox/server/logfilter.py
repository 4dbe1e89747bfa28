"""A log filter that lets a repeating message through a few times a minute, then counts it.

Untrusted code decides how often some things happen on the server (a sandbox's server breaking
off, a client going away mid-write): one log line per event would let it fill the disk. A
message is "the same" when it comes from the same logger at the same level with the same format
string, whatever its arguments.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

# How many distinct messages are tracked; past it the oldest windows are forgotten.
_MAX_KEYS = 4096


@dataclass
class _Window:
    start: float
    passed: int = 0
    suppressed: int = 0


class RepeatFilter(logging.Filter):
    """Passes the first `burst` records of each message per `window` seconds; the first record
    after a window in which some were dropped says how many."""

    def __init__(
        self,
        burst: int = 5,
        window: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.burst, self.window, self._clock = burst, window, clock
        self._windows: dict[tuple[str, int, str], _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        w = self._windows.get(key)
        if w is None or now - w.start >= self.window:
            if len(self._windows) >= _MAX_KEYS and w is None:
                self._forget(now)
            dropped = w.suppressed if w is not None else 0
            w = self._windows[key] = _Window(now)
            if dropped:
                record.msg = f"{record.msg} [{dropped} more like this in the last window]"
        if w.passed < self.burst:
            w.passed += 1
            return True
        w.suppressed += 1
        return False

    def _forget(self, now: float) -> None:
        old = [k for k, w in self._windows.items() if now - w.start >= self.window]
        for k in old or list(self._windows)[: _MAX_KEYS // 2]:
            del self._windows[k]


def install(logger: logging.Logger | None = None, **options: float) -> RepeatFilter:
    """Put one RepeatFilter on every handler of `logger` (default: the root logger)."""
    f = RepeatFilter(**options)  # type: ignore[arg-type]
    for handler in (logger or logging.getLogger()).handlers:
        handler.addFilter(f)
    return f
