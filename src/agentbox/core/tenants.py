"""What belongs to a tenant rather than a sandbox: its secrets, network ceiling and default, API
keys, quota, and what its audit and egress logs show.

Every method takes the `Caller` and decides here what the caller may see or change: a tenant
sees only its own settings and logs (another tenant's are indistinguishable from none), an
admin every tenant's; keys, quotas and ceilings are the admin's. Each change is audited.
"""

from __future__ import annotations

from typing import Any

from agentbox.core.admission import Admission
from agentbox.core.audit import Audit
from agentbox.core.auth import Caller, check_tenant_name, create_key, require_admin
from agentbox.core.errors import NotFound
from agentbox.core.network import NetworkService
from agentbox.store.db import Store


class TenantService:
    def __init__(
        self, store: Store, network: NetworkService, admission: Admission, audit: Audit
    ) -> None:
        self.store = store
        self.network = network
        self.admission = admission
        self.audit = audit

    # ------------------------------------------------------------------ secrets

    def set_secret(
        self,
        caller: Caller,
        name: str,
        value: str,
        hosts: list[str],
        in_url: bool,
        headers: list[str],
        allow_plaintext: bool,
    ) -> dict[str, Any]:
        """Create or replace one of the caller's tenant's secrets (core/network.py says where
        its value may go)."""
        binding: dict[str, Any] = {
            "hosts": hosts,
            "in_url": in_url,
            "headers": headers,
            "allow_plaintext": allow_plaintext,
        }
        result = self.network.set_secret(caller.tenant, name, value, **binding)
        self.audit(caller, "secret.set", name=name, **binding)
        return result

    def list_secrets(self, caller: Caller) -> list[dict[str, Any]]:
        return self.network.list_secrets(caller.tenant)

    def remove_secret(self, caller: Caller, name: str) -> None:
        self.network.remove_secret(caller.tenant, name)
        self.audit(caller, "secret.remove", name=name)

    # ------------------------------------------------------------------ network

    def network_settings(self, caller: Caller, tenant: str) -> dict[str, Any]:
        """A tenant's network ceiling and default."""
        self._check_scope(caller, tenant)
        return self.network.tenant_network(tenant)

    def set_tenant_network(
        self, caller: Caller, tenant: str, changes: dict[str, dict[str, Any] | None]
    ) -> dict[str, Any]:
        """Set a tenant's `ceiling` (what its sandboxes may ever allow) and/or `default` (the
        network of sandboxes created without one): only the keys in `changes` change."""
        require_admin(caller, "setting a tenant's network")
        check_tenant_name(tenant)
        # The ceiling first: a new default is checked against the new ceiling.
        if "ceiling" in changes:
            self.network.set_tenant_ceiling(tenant, _ceiling(changes["ceiling"]))
        if "default" in changes:
            self.network.set_tenant_default(tenant, changes["default"])
        given = {"default": changes.get("default"), "ceiling": changes.get("ceiling")}
        self.audit(caller, "tenant.network", tenant=tenant, network=given)
        return self.network.tenant_network(tenant)

    def set_network_default(self, caller: Caller, network: dict[str, Any]) -> dict[str, Any]:
        """The caller's tenant's default network, within its ceiling."""
        result = self.network.set_tenant_default(caller.tenant, network)
        self.audit(caller, "tenant.network", tenant=caller.tenant, default=network)
        return result

    # ------------------------------------------------------------------ API keys

    def create_key(self, caller: Caller, tenant: str, admin: bool) -> tuple[str, str]:
        """A new key for `tenant`: (key_id, key). The key is shown only this once."""
        require_admin(caller, "making API keys")
        key_id, key = create_key(self.store, tenant, admin)
        self.audit(caller, "key.create", key=key_id, for_tenant=tenant, admin=admin)
        return key_id, key

    def list_keys(self, caller: Caller) -> list[dict[str, Any]]:
        require_admin(caller, "listing API keys")
        return self.store.list_keys()

    def delete_key(self, caller: Caller, key_id: str) -> None:
        require_admin(caller, "revoking API keys")
        if not self.store.revoke_key(key_id):
            raise NotFound(f"key {key_id} not found")
        self.audit(caller, "key.delete", key=key_id)

    # ------------------------------------------------------------------ quotas

    def quota(self, caller: Caller, tenant: str) -> dict[str, Any]:
        self._check_scope(caller, tenant)
        return self.admission.quota(tenant)

    def set_quota(self, caller: Caller, tenant: str, values: dict[str, Any]) -> dict[str, Any]:
        """Change the quota values given; the others keep theirs."""
        require_admin(caller, "setting quotas")
        check_tenant_name(tenant)
        return self.admission.set_quota(caller, tenant, values)

    # ------------------------------------------------------------------ logs

    def audit_events(
        self,
        caller: Caller,
        tenant: str | None,
        sandbox_id: str | None,
        action: str | None,
        since: float | None,
        limit: int,
        until: float | None = None,
        oldest_first: bool = False,
    ) -> list[dict[str, Any]]:
        """The newest audit events (or the oldest from `since`): the caller's tenant's, or
        for an admin `tenant`'s (None: every tenant's)."""
        scope = _log_scope(caller, tenant)
        return self.store.list_audit(scope, sandbox_id, action, since, limit, until, oldest_first)

    def egress_events(
        self,
        caller: Caller,
        tenant: str | None,
        sandbox_id: str | None,
        host: str | None,
        allowed: bool | None,
        since: float | None,
        limit: int,
    ) -> list[dict[str, Any]]:
        """The newest egress attempts, scoped like `audit_events`."""
        scope = _log_scope(caller, tenant)
        return self.network.egress_events(scope, sandbox_id, host, allowed, since, limit)

    @staticmethod
    def _check_scope(caller: Caller, tenant: str) -> None:
        # Another tenant's settings are indistinguishable from a tenant that does not exist.
        if not caller.admin and caller.tenant != tenant:
            raise NotFound(f"tenant {tenant} not found")


def _log_scope(caller: Caller, tenant: str | None) -> str | None:
    # A tenant's `tenant=` filter is ignored, not refused: it only ever sees its own.
    return tenant if caller.admin else caller.tenant


def _ceiling(policy: dict[str, Any] | None) -> dict[str, Any] | None:
    # A ceiling bounds egress only; the body has a sandbox network's shape, whose
    # allow_public_traffic (exposed ports without a token) is no egress rule.
    if policy is None:
        return None
    return {k: v for k, v in policy.items() if k != "allow_public_traffic"}
