"""The audit trail: what callers did, and every egress attempt of their sandboxes."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query

from agentbox.core.errors import InvalidRequest
from agentbox.server import models as m
from agentbox.server.routes.deps import RESPONSES, Tenants, Who

Since = Annotated[str | None, Query(max_length=40, description="RFC 3339 time or unix seconds")]


def router() -> APIRouter:
    r = APIRouter()

    @r.get("/v1/audit/egress", responses=RESPONSES, tags=["audit"])
    async def audit_egress(
        tenants: Tenants,
        who: Who,
        sandbox_id: Annotated[str | None, Query(max_length=64)] = None,
        host: Annotated[str | None, Query(max_length=255)] = None,
        allowed: bool | None = None,
        tenant: Annotated[str | None, Query(max_length=64)] = None,
        since: Since = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    ) -> dict[str, Any]:
        """Every egress attempt: destination, method and path, bytes, allowed or denied, rule."""
        since_t = parse_time(since)
        events = tenants.egress_events(who, tenant, sandbox_id, host, allowed, since_t, limit)
        return {"events": _timed(events)}

    @r.get("/v1/audit", responses=RESPONSES, tags=["audit"])
    async def audit(
        tenants: Tenants,
        who: Who,
        sandbox_id: Annotated[str | None, Query(max_length=64)] = None,
        action: Annotated[str | None, Query(max_length=64)] = None,
        tenant: Annotated[str | None, Query(max_length=64)] = None,
        since: Since = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    ) -> dict[str, Any]:
        events = tenants.audit_events(who, tenant, sandbox_id, action, parse_time(since), limit)
        return {"events": _timed(events)}

    return r


def _timed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for e in events:
        e["time"] = m.rfc3339(e["time"])
    return events


def parse_time(value: str | None) -> float | None:
    """An RFC 3339 time or unix seconds, as a unix time."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(
            f"since={value!r} is neither an RFC 3339 time nor unix seconds"
        ) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.timestamp()
