"""Liveness: served without an API key."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from agentbox import __version__
from agentbox.server.routes.deps import CoreDep

OPEN_PATHS = frozenset({"/v1/health"})


def router() -> APIRouter:
    r = APIRouter()

    @r.get("/v1/health", tags=["health"])
    async def health(core: CoreDep) -> dict[str, Any]:
        # Whether each template could start a sandbox at start-up (why not: the log, and the
        # template's `check` for API keys).
        checks = {n: c.status for n, c in core.manager.template_checks.items()}
        return {
            "status": "degraded" if "failed" in checks.values() else "ok",
            "version": __version__,
            # The default runtime's report (as before more than one could be served), then
            # every runtime served, with its declared features.
            "runtime": core.runtimes.get(core.runtimes.default).capabilities(),
            "runtimes": core.runtimes.info(),
            # Every isolation tier: served here, or why not (not installed, not asked for).
            "tiers": core.runtimes.tiers(),
            "templates": checks,
            # What a create that names no template gets (`building` in `templates` while the
            # server builds it at start-up).
            "default_template": core.manager.template_service.default,
            # How snapshot and fork copies are made on the data dir's filesystem: "reflink"
            # (shared blocks, instant) or "sparse" (the written extents); null: no snapshots.
            "snapshots": core.manager.snapshots.copy_method,
        }

    return r
