"""The audit log through the SDK: who did what to which sandbox (own tenant; admins: all)."""

from __future__ import annotations

from datetime import datetime

from agentbox.sdk import protocol as p
from agentbox.sdk.async_sandbox import AsyncTransport
from agentbox.sdk.models import AuditEvent
from agentbox.sdk.sandbox import Transport


def list_audit_events(sandbox_id: str | None = None, action: str | None = None,
                      tenant: str | None = None, since: datetime | float | None = None,
                      limit: int = 100, api_key: str | None = None, api_url: str | None = None,
                      request_timeout: float = 60) -> list[AuditEvent]:
    """Audit events, newest first. `since` is a datetime or a unix time."""
    transport = Transport(p.resolve_config(api_key, api_url, request_timeout))
    try:
        return transport.call(p.list_audit(sandbox_id, action, tenant, since, limit))
    finally:
        transport.close()


async def alist_audit_events(sandbox_id: str | None = None, action: str | None = None,
                             tenant: str | None = None, since: datetime | float | None = None,
                             limit: int = 100, api_key: str | None = None,
                             api_url: str | None = None,
                             request_timeout: float = 60) -> list[AuditEvent]:
    """`list_audit_events` for asyncio."""
    transport = AsyncTransport(p.resolve_config(api_key, api_url, request_timeout))
    try:
        return await transport.call(p.list_audit(sandbox_id, action, tenant, since, limit))
    finally:
        await transport.close()
