"""The audit logs through the SDK (own tenant; admins: all): who did what to which sandbox,
and every connection sandboxes tried to make out through the egress proxy."""

from __future__ import annotations

from datetime import datetime

from agentbox.sdk import protocol as p
from agentbox.sdk.models import AuditEvent, EgressEvent
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
    from agentbox.sdk.async_sandbox import AsyncTransport  # asyncio only when asked for

    transport = AsyncTransport(p.resolve_config(api_key, api_url, request_timeout))
    try:
        return await transport.call(p.list_audit(sandbox_id, action, tenant, since, limit))
    finally:
        await transport.close()


def list_egress_events(sandbox_id: str | None = None, host: str | None = None,
                       allowed: bool | None = None, tenant: str | None = None,
                       since: datetime | float | None = None, limit: int = 100,
                       api_key: str | None = None, api_url: str | None = None,
                       request_timeout: float = 60) -> list[EgressEvent]:
    """Egress attempts, newest first: `allowed=False` gives only the refused ones. `host` is
    an exact host name; `since` is a datetime or a unix time."""
    transport = Transport(p.resolve_config(api_key, api_url, request_timeout))
    try:
        return transport.call(p.list_egress(sandbox_id, host, allowed, tenant, since, limit))
    finally:
        transport.close()


async def alist_egress_events(sandbox_id: str | None = None, host: str | None = None,
                              allowed: bool | None = None, tenant: str | None = None,
                              since: datetime | float | None = None, limit: int = 100,
                              api_key: str | None = None, api_url: str | None = None,
                              request_timeout: float = 60) -> list[EgressEvent]:
    """`list_egress_events` for asyncio."""
    from agentbox.sdk.async_sandbox import AsyncTransport  # asyncio only when asked for

    transport = AsyncTransport(p.resolve_config(api_key, api_url, request_timeout))
    try:
        return await transport.call(p.list_egress(sandbox_id, host, allowed, tenant, since,
                                                  limit))
    finally:
        await transport.close()
