"""The core decides what a caller may see and change of a tenant, and audits every change:
no surface has to (core/tenants.py), so a surface that forgets an admin check or a tenant
scope still cannot leak or change another tenant's settings. Real store, fake runtime."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbox.core import ports
from agentbox.core.auth import Caller
from agentbox.core.errors import Forbidden, NotFound
from agentbox.core.manager import CreateRequest, SandboxManager
from agentbox.core.network import NetworkService, NetworkSettings
from agentbox.core.tenants import TenantService
from agentbox.runtimes.fake import FakeRuntime
from agentbox.store.db import Store
from agentbox.templates import TemplateStore

ACME = Caller(tenant="acme", key_id="k1", admin=False)
OTHER = Caller(tenant="other", key_id="k2", admin=False)
ADMIN = Caller(tenant="admin", key_id="k0", admin=True)
OPEN = {"allow_out": ["example.com"], "deny_out": [], "allow_internet_access": False}


@pytest.fixture
def manager(tmp_path: Path) -> SandboxManager:
    store = Store(f"sqlite:///{tmp_path / 'agentbox.db'}")
    return SandboxManager(
        store,
        FakeRuntime(tmp_path),
        TemplateStore(tmp_path / "templates"),
        NetworkService(store, tmp_path, NetworkSettings()),
        check_templates=False,
        default_template="host",
    )


@pytest.fixture
def tenants(manager: SandboxManager) -> TenantService:
    return manager.tenants


def _actions(t: TenantService, caller: Caller = ADMIN) -> list[tuple[str, str | None]]:
    return [(e["action"], e["tenant"]) for e in t.audit_events(caller, None, None, None, None, 50)]


def test_a_tenant_sees_only_its_own_network_and_quota(tenants: TenantService) -> None:
    tenants.set_tenant_network(ADMIN, "acme", {"ceiling": OPEN})
    assert tenants.network_settings(ACME, "acme")["ceiling"]["allow_out"] == ["example.com"]
    assert tenants.quota(ACME, "acme")["max_sandboxes"] > 0
    for read in (tenants.network_settings, tenants.quota):
        with pytest.raises(NotFound, match="tenant acme not found"):
            read(OTHER, "acme")
        assert read(ADMIN, "acme")


def test_keys_quotas_and_ceilings_need_an_admin(tenants: TenantService) -> None:
    refused = [
        lambda: tenants.create_key(ACME, "acme", True),
        lambda: tenants.list_keys(ACME),
        lambda: tenants.delete_key(ACME, "k0"),
        lambda: tenants.set_quota(ACME, "acme", {"max_sandboxes": 1000}),
        lambda: tenants.set_tenant_network(ACME, "acme", {"ceiling": None}),
    ]
    for call in refused:
        with pytest.raises(Forbidden, match="needs an admin API key"):
            call()
    assert tenants.list_keys(ADMIN) == []
    assert _actions(tenants) == []  # nothing refused was done, nor recorded


def test_every_change_is_audited_with_its_detail(tenants: TenantService) -> None:
    key_id, key = tenants.create_key(ADMIN, "acme", False)
    assert key.startswith(f"abx_{key_id}_")
    tenants.set_secret(ACME, "TOKEN", "s3cret-value", ["api.example.com"], False, ["X-Key"], False)
    tenants.remove_secret(ACME, "TOKEN")
    tenants.set_network_default(ACME, {**OPEN, "allow_public_traffic": False})
    tenants.set_quota(ADMIN, "acme", {"max_sandboxes": 3})
    tenants.delete_key(ADMIN, key_id)
    assert _actions(tenants)[::-1] == [
        ("key.create", "admin"),
        ("secret.set", "acme"),
        ("secret.remove", "acme"),
        ("tenant.network", "acme"),
        ("quota.set", "acme"),  # recorded as the tenant's, whoever set it
        ("key.delete", "admin"),
    ]
    (secret_set,) = tenants.audit_events(ACME, None, None, "secret.set", None, 5)
    assert secret_set["detail"] == {
        "name": "TOKEN",
        "hosts": ["api.example.com"],
        "in_url": False,
        "headers": ["X-Key"],
        "allow_plaintext": False,
    }
    assert "s3cret" not in str(secret_set)
    with pytest.raises(NotFound, match=f"key {key_id} not found"):
        tenants.delete_key(ADMIN, key_id)


def test_a_ceiling_bounds_egress_only_and_is_recorded_as_given(tenants: TenantService) -> None:
    ceiling = {**OPEN, "allow_public_traffic": True}  # a ceiling has a sandbox network's shape
    shown = tenants.set_tenant_network(ADMIN, "acme", {"ceiling": ceiling})
    assert shown == {"default": None, "ceiling": OPEN}
    (event,) = tenants.audit_events(ADMIN, "acme", None, "tenant.network", None, 5)
    assert event["detail"] == {"network": {"default": None, "ceiling": ceiling}}
    assert ceiling["allow_public_traffic"] is True  # the caller's value is left alone


def test_a_tenants_log_filter_is_its_own_whatever_it_asks(tenants: TenantService) -> None:
    tenants.set_network_default(ACME, OPEN)
    tenants.set_network_default(OTHER, OPEN)
    assert _actions(tenants, OTHER) == [("tenant.network", "other")]
    other_events = tenants.audit_events(OTHER, "acme", None, None, None, 50)
    assert [e["tenant"] for e in other_events] == ["other"]
    assert [e["tenant"] for e in tenants.audit_events(ADMIN, "acme", None, None, None, 50)] == [
        "acme"
    ]
    assert tenants.egress_events(OTHER, "acme", None, None, None, None, 50) == []


def test_a_signed_port_query_is_what_the_gateway_accepts() -> None:
    expires, query = ports.signed_query("tok", "sbx_1", 8080, None, 1000.2)
    assert expires == 1001 + ports.DEFAULT_LIFETIME
    assert query[ports.EXP_PARAM] == str(expires)
    sig = query[ports.SIG_PARAM]
    assert ports.check_signature("tok", "sbx_1", 8080, str(expires), sig, 1001) is None
    assert ports.check_signature("tok", "sbx_1", 8081, str(expires), sig, 1001) is not None
    assert ports.signed_query("tok", "sbx_1", 8080, 60.5, 1000.0)[0] == 1061


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_only_the_owner_gets_a_port_url_and_it_is_audited(manager: SandboxManager) -> None:
    await manager.start()
    try:
        row = await manager.create(ACME, CreateRequest())
        with pytest.raises(NotFound):
            manager.sign_port_url(OTHER, row.sandbox_id, 8080, None)
        expires, query = manager.sign_port_url(ACME, row.sandbox_id, 8080, 90)
        assert row.access_token is not None
        signed = (row.access_token, row.sandbox_id, 8080, str(expires), query[ports.SIG_PARAM])
        assert ports.check_signature(*signed, now=expires - 1) is None
        (event,) = manager.tenants.audit_events(ACME, None, None, "port.url", None, 5)
        assert event["sandbox_id"] == row.sandbox_id
        assert event["detail"] == {"port": 8080, "expires_in": 90}
    finally:
        await manager.stop()
