"""The audit log's writer: who did what to which sandbox, how it went, how long it took."""

from __future__ import annotations

import logging
import time
from typing import Any

from agentbox.core.auth import Caller
from agentbox.store.db import Store

log = logging.getLogger("agentbox.audit")


class Audit:
    def __init__(self, store: Store) -> None:
        self.store = store

    def __call__(
        self,
        caller: Caller | None,
        action: str,
        sandbox_id: str | None = None,
        status: int = 200,
        started: float | None = None,
        tenant: str | None = None,
        **detail: Any,
    ) -> None:
        """Record one action (`started`: its time.monotonic() start, for its duration)."""
        if caller is not None and caller.via:
            detail = {**detail, "via": caller.via}
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
