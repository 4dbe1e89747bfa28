"""API keys through the SDK (admin keys only): create one for a tenant, list them, revoke one.

On the server's own machine, `agentbox keys create` can also work on the data dir directly."""

from __future__ import annotations

from typing import TypeVar

from agentbox.sdk import protocol as p
from agentbox.sdk.models import KeyInfo
from agentbox.sdk.sandbox import Transport

T = TypeVar("T")


def _call(call: p.Call[T], api_key: str | None, api_url: str | None,
          request_timeout: float) -> T:
    transport = Transport(p.resolve_config(api_key, api_url, request_timeout))
    try:
        return transport.call(call)
    finally:
        transport.close()


async def _acall(call: p.Call[T], api_key: str | None, api_url: str | None,
                 request_timeout: float) -> T:
    from agentbox.sdk.async_sandbox import AsyncTransport  # asyncio only when asked for

    transport = AsyncTransport(p.resolve_config(api_key, api_url, request_timeout))
    try:
        return await transport.call(call)
    finally:
        await transport.close()


def create_key(tenant: str, admin: bool = False, api_key: str | None = None,
               api_url: str | None = None, request_timeout: float = 60) -> KeyInfo:
    """A new key for `tenant`; its secret is in `.key`, shown this once."""
    return _call(p.create_key(tenant, admin), api_key, api_url, request_timeout)


async def acreate_key(tenant: str, admin: bool = False, api_key: str | None = None,
                      api_url: str | None = None, request_timeout: float = 60) -> KeyInfo:
    """`create_key` for asyncio."""
    return await _acall(p.create_key(tenant, admin), api_key, api_url, request_timeout)


def list_keys(api_key: str | None = None, api_url: str | None = None,
              request_timeout: float = 60) -> list[KeyInfo]:
    """Every key not revoked, oldest first (never their secrets)."""
    return _call(p.list_keys(), api_key, api_url, request_timeout)


async def alist_keys(api_key: str | None = None, api_url: str | None = None,
                     request_timeout: float = 60) -> list[KeyInfo]:
    """`list_keys` for asyncio."""
    return await _acall(p.list_keys(), api_key, api_url, request_timeout)


def delete_key(key_id: str, api_key: str | None = None, api_url: str | None = None,
               request_timeout: float = 60) -> None:
    """Revoke a key at once; NotFoundError if there is no such key."""
    _call(p.delete_key(key_id), api_key, api_url, request_timeout)


async def adelete_key(key_id: str, api_key: str | None = None, api_url: str | None = None,
                      request_timeout: float = 60) -> None:
    """`delete_key` for asyncio."""
    await _acall(p.delete_key(key_id), api_key, api_url, request_timeout)
