"""What belongs to a tenant rather than a sandbox: secrets, network ceiling and default, API
keys, quotas."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from agentbox.core.auth import check_tenant_name, create_key
from agentbox.core.errors import NotFound
from agentbox.server import models as m
from agentbox.server.routes.deps import RESPONSES, Admin, Db, Mgr, Net, Who


def secrets_router() -> APIRouter:
    r = APIRouter()

    @r.put("/v1/secrets/{name}", responses=RESPONSES, tags=["network"])
    async def put_secret(
        name: str, body: m.SecretBody, mgr: Mgr, net: Net, who: Who
    ) -> dict[str, Any]:
        binding: dict[str, Any] = {
            "hosts": body.hosts,
            "in_url": body.in_url,
            "headers": body.headers,
            "allow_plaintext": body.allow_plaintext,
        }
        result = net.set_secret(who.tenant, name, body.value, **binding)
        mgr.audit(who, "secret.set", name=name, **binding)
        return _times(result)

    @r.get("/v1/secrets", responses=RESPONSES, tags=["network"])
    async def list_secrets(net: Net, who: Who) -> dict[str, Any]:
        return {"secrets": [_times(s) for s in net.list_secrets(who.tenant)]}

    @r.delete("/v1/secrets/{name}", status_code=204, responses=RESPONSES, tags=["network"])
    async def delete_secret(name: str, mgr: Mgr, net: Net, who: Who) -> Response:
        net.remove_secret(who.tenant, name)
        mgr.audit(who, "secret.remove", name=name)
        return Response(status_code=204)

    return r


def network_router() -> APIRouter:
    r = APIRouter()

    @r.get("/v1/tenants/{tenant}/network", responses=RESPONSES, tags=["network"])
    async def get_tenant_network(tenant: str, net: Net, who: Who) -> dict[str, Any]:
        if not who.admin and who.tenant != tenant:
            raise NotFound(f"tenant {tenant} not found")
        return net.tenant_network(tenant)

    @r.put("/v1/tenants/{tenant}/network", responses=RESPONSES, tags=["admin"])
    async def put_tenant_network(
        tenant: str, body: m.TenantNetworkBody, mgr: Mgr, net: Net, who: Admin
    ) -> dict[str, Any]:
        """Set a tenant's ceiling (what its sandboxes may ever allow) and default policy."""
        check_tenant_name(tenant)
        fields = body.model_fields_set
        if "ceiling" in fields:
            ceiling = body.ceiling.model_dump() if body.ceiling else None
            if ceiling is not None:
                ceiling.pop("allow_public_traffic", None)
            net.set_tenant_ceiling(tenant, ceiling)
        if "default" in fields:
            net.set_tenant_default(tenant, body.default.model_dump() if body.default else None)
        mgr.audit(who, "tenant.network", tenant=tenant, network=body.model_dump())
        return net.tenant_network(tenant)

    @r.put("/v1/network/default", responses=RESPONSES, tags=["network"])
    async def put_network_default(
        body: m.NetworkBody, mgr: Mgr, net: Net, who: Who
    ) -> dict[str, Any]:
        """The caller's tenant's default network for sandboxes created without one."""
        result = net.set_tenant_default(who.tenant, body.model_dump())
        mgr.audit(who, "tenant.network", tenant=who.tenant, default=body.model_dump())
        return result

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
    async def make_key(body: m.KeyBody, mgr: Mgr, store: Db, who: Admin) -> m.KeyCreated:
        key_id, key = create_key(store, body.tenant, body.admin)
        mgr.audit(who, "key.create", key=key_id, for_tenant=body.tenant, admin=body.admin)
        return m.KeyCreated(key_id=key_id, key=key, tenant=body.tenant, admin=body.admin)

    @r.get("/v1/keys", responses=RESPONSES, tags=["admin"])
    async def list_keys(store: Db, who: Admin) -> dict[str, Any]:
        return {"keys": store.list_keys()}

    @r.delete("/v1/keys/{key_id}", status_code=204, responses=RESPONSES, tags=["admin"])
    async def delete_key(key_id: str, mgr: Mgr, store: Db, who: Admin) -> Response:
        if not store.revoke_key(key_id):
            raise NotFound(f"key {key_id} not found")
        mgr.audit(who, "key.delete", key=key_id)
        return Response(status_code=204)

    return r


def quotas_router() -> APIRouter:
    r = APIRouter()

    @r.put("/v1/tenants/{tenant}/quota", responses=RESPONSES, tags=["admin"])
    async def put_quota(tenant: str, body: m.QuotaBody, mgr: Mgr, who: Admin) -> dict[str, Any]:
        check_tenant_name(tenant)
        return mgr.set_quota(who, tenant, body.model_dump(exclude_none=True))

    @r.get("/v1/tenants/{tenant}/quota", responses=RESPONSES, tags=["admin"])
    async def get_quota(tenant: str, mgr: Mgr, who: Who) -> dict[str, Any]:
        if not who.admin and who.tenant != tenant:
            raise NotFound(f"tenant {tenant} not found")
        return mgr.quota(tenant)

    return r


def _times(secret: dict[str, Any]) -> dict[str, Any]:
    return {
        **secret,
        "created_at": m.rfc3339(secret.get("created_at")),
        "updated_at": m.rfc3339(secret.get("updated_at")),
    }
