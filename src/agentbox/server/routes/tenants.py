"""What belongs to a tenant rather than a sandbox: secrets, network ceiling and default, API
keys, quotas."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from agentbox.server import models as m
from agentbox.server.routes.deps import RESPONSES, Admin, Tenants, Who


def secrets_router() -> APIRouter:
    r = APIRouter()

    @r.put("/v1/secrets/{name}", responses=RESPONSES, tags=["network"])
    async def put_secret(
        name: str, body: m.SecretBody, tenants: Tenants, who: Who
    ) -> dict[str, Any]:
        fields = body.model_dump(include={"hosts", "in_url", "headers", "allow_plaintext"})
        return _times(tenants.set_secret(who, name, body.value, **fields))

    @r.get("/v1/secrets", responses=RESPONSES, tags=["network"])
    async def list_secrets(tenants: Tenants, who: Who) -> dict[str, Any]:
        return {"secrets": [_times(s) for s in tenants.list_secrets(who)]}

    @r.delete("/v1/secrets/{name}", status_code=204, responses=RESPONSES, tags=["network"])
    async def delete_secret(name: str, tenants: Tenants, who: Who) -> Response:
        tenants.remove_secret(who, name)
        return Response(status_code=204)

    return r


def network_router() -> APIRouter:
    r = APIRouter()

    @r.get("/v1/tenants/{tenant}/network", responses=RESPONSES, tags=["network"])
    async def get_tenant_network(tenant: str, tenants: Tenants, who: Who) -> dict[str, Any]:
        return tenants.network_settings(who, tenant)

    @r.put("/v1/tenants/{tenant}/network", responses=RESPONSES, tags=["admin"])
    async def put_tenant_network(
        tenant: str, body: m.TenantNetworkBody, tenants: Tenants, who: Admin
    ) -> dict[str, Any]:
        """Set a tenant's ceiling (what its sandboxes may ever allow) and default policy."""
        changes = body.model_dump(include=body.model_fields_set)
        return tenants.set_tenant_network(who, tenant, changes)

    @r.put("/v1/network/default", responses=RESPONSES, tags=["network"])
    async def put_network_default(
        body: m.NetworkBody, tenants: Tenants, who: Who
    ) -> dict[str, Any]:
        """The caller's tenant's default network for sandboxes created without one."""
        return tenants.set_network_default(who, body.model_dump())

    return r


def keys_router() -> APIRouter:
    r = APIRouter()

    @r.post(
        "/v1/keys",
        status_code=201,
        response_model=m.KeyCreated,
        responses=RESPONSES,
        tags=["admin"],
    )
    async def make_key(body: m.KeyBody, tenants: Tenants, who: Admin) -> m.KeyCreated:
        key_id, key = tenants.create_key(who, body.tenant, body.admin)
        return m.KeyCreated(key_id=key_id, key=key, tenant=body.tenant, admin=body.admin)

    @r.get("/v1/keys", responses=RESPONSES, tags=["admin"])
    async def list_keys(tenants: Tenants, who: Admin) -> dict[str, Any]:
        return {"keys": tenants.list_keys(who)}

    @r.delete("/v1/keys/{key_id}", status_code=204, responses=RESPONSES, tags=["admin"])
    async def delete_key(key_id: str, tenants: Tenants, who: Admin) -> Response:
        tenants.delete_key(who, key_id)
        return Response(status_code=204)

    return r


def quotas_router() -> APIRouter:
    r = APIRouter()

    @r.put("/v1/tenants/{tenant}/quota", responses=RESPONSES, tags=["admin"])
    async def put_quota(
        tenant: str, body: m.QuotaBody, tenants: Tenants, who: Admin
    ) -> dict[str, Any]:
        return tenants.set_quota(who, tenant, body.model_dump(exclude_none=True))

    @r.get("/v1/tenants/{tenant}/quota", responses=RESPONSES, tags=["admin"])
    async def get_quota(tenant: str, tenants: Tenants, who: Who) -> dict[str, Any]:
        return tenants.quota(who, tenant)

    return r


def _times(secret: dict[str, Any]) -> dict[str, Any]:
    return {
        **secret,
        "created_at": m.rfc3339(secret.get("created_at")),
        "updated_at": m.rfc3339(secret.get("updated_at")),
    }
