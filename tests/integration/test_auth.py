"""API keys, tenants and cross-tenant denial on every sandbox route."""

from __future__ import annotations

import httpx
from conftest import ServerHandle, create_sandbox

SANDBOX_ROUTES = [
    ("GET", "/v1/sandboxes/{id}", None),
    ("DELETE", "/v1/sandboxes/{id}", None),
    ("POST", "/v1/sandboxes/{id}/timeout", {"timeout": 10}),
    ("POST", "/v1/sandboxes/{id}/pause", {}),
    ("POST", "/v1/sandboxes/{id}/resume", {}),
    ("GET", "/v1/sandboxes/{id}/metrics", None),
    ("POST", "/v1/sandboxes/{id}/snapshots", {}),
    ("POST", "/v1/sandboxes/{id}/fork", {}),
    ("POST", "/v1/sandboxes/{id}/commands", {"cmd": "true"}),
    ("GET", "/v1/sandboxes/{id}/commands", None),
    ("GET", "/v1/sandboxes/{id}/commands/c1", None),
    ("GET", "/v1/sandboxes/{id}/commands/c1/events", None),
    ("POST", "/v1/sandboxes/{id}/commands/c1/stdin", {"data": "x"}),
    ("POST", "/v1/sandboxes/{id}/commands/c1/kill", {}),
    ("GET", "/v1/sandboxes/{id}/files?path=a.txt", None),
    ("PUT", "/v1/sandboxes/{id}/files?path=a.txt", None),
    ("GET", "/v1/sandboxes/{id}/files/list?path=/workspace", None),
    ("GET", "/v1/sandboxes/{id}/files/stat?path=a.txt", None),
    ("POST", "/v1/sandboxes/{id}/files/mkdir", {"path": "d"}),
    ("DELETE", "/v1/sandboxes/{id}/files?path=a.txt", None),
    ("POST", "/v1/sandboxes/{id}/files/rename", {"src": "a.txt", "dst": "b.txt"}),
]


def test_missing_and_bad_keys_are_401(server: ServerHandle) -> None:
    r = httpx.get(f"{server.url}/v1/sandboxes")
    assert r.status_code == 401 and r.json()["code"] == "unauthorized"
    r = httpx.get(f"{server.url}/v1/sandboxes", headers={"X-API-Key": "abx_nope_nope"})
    assert r.status_code == 401


def test_other_tenant_gets_404_everywhere(server: ServerHandle) -> None:
    owner = server.make_key("owner-tenant")
    intruder = server.make_key("intruder-tenant")
    with server.client(owner) as c:
        sid = create_sandbox(c)["sandbox_id"]
        c.put(f"/v1/sandboxes/{sid}/files", params={"path": "a.txt"}, content=b"secret")
    with server.client(intruder) as c:
        for method, route, body in SANDBOX_ROUTES:
            url = route.format(id=sid)
            if method == "PUT":
                r = c.request(method, url, content=b"overwrite")
            else:
                r = c.request(method, url, json=body)
            assert r.status_code == 404, (method, url, r.status_code, r.text)
            assert r.json()["code"] == "not_found"
        assert sid not in [s["sandbox_id"] for s in c.get("/v1/sandboxes").json()["sandboxes"]]
        audit = c.get("/v1/audit", params={"sandbox_id": sid}).json()["events"]
        assert audit == []
    with server.client(owner) as c:
        assert c.get(f"/v1/sandboxes/{sid}/files", params={"path": "a.txt"}).content == b"secret"
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        c.delete(f"/v1/sandboxes/{sid}")


def test_key_management_needs_admin(server: ServerHandle, tenant_key: str) -> None:
    with server.client(tenant_key) as c:
        r = c.post("/v1/keys", json={"tenant": "evil", "admin": True})
        assert r.status_code == 403 and r.json()["code"] == "forbidden"
        assert c.get("/v1/keys").status_code == 403
        assert c.put("/v1/tenants/x/quota", json={"max_sandboxes": 999}).status_code == 403
    with server.client() as admin:
        made = admin.post("/v1/keys", json={"tenant": "short-lived"}).json()
        assert made["key"].startswith("abx_")
        assert (
            httpx.get(f"{server.url}/v1/sandboxes", headers={"X-API-Key": made["key"]}).status_code
            == 200
        )
        assert admin.delete(f"/v1/keys/{made['key_id']}").status_code == 204
        assert (
            httpx.get(f"{server.url}/v1/sandboxes", headers={"X-API-Key": made["key"]}).status_code
            == 401
        )
        bad = admin.post("/v1/keys", json={"tenant": "../etc"})
        assert bad.status_code == 400


def test_offline_key_creation(tmp_path) -> None:
    from agentbox.core.auth import Authenticator, create_key_offline
    from agentbox.store.db import Store

    key_id, key = create_key_offline(tmp_path, "offline-tenant")
    caller = Authenticator(Store.for_data_dir(tmp_path), None).authenticate(key)
    assert caller.tenant == "offline-tenant" and caller.key_id == key_id and not caller.admin
