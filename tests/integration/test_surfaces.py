"""Surfaces are plug-ins: a test-only surface, registered through the same registry the
`agentbox.surfaces` entry points feed, serves beside the /v1 API on the same port, through the
core front object, with no edit to the core or to the /v1 routes.

The server runs in this process (a surface registered in code lives in the process that serves
it), under uvicorn, with the real process runtime."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
from conftest import ADMIN_KEY, serving_app
from fastapi import APIRouter, Header
from starlette.types import Receive, Scope, Send

from agentbox.server import surfaces
from agentbox.server.app import create_app
from agentbox.server.surfaces import Core, SurfaceRoutes


def hello_surface(core: Core) -> SurfaceRoutes:
    """Owns the path /hello-surface: how many sandboxes the caller's tenant has running."""
    router = APIRouter()

    @router.get("/hello-surface")
    async def hello(x_api_key: Annotated[str | None, Header()] = None) -> dict[str, Any]:
        caller = core.auth.authenticate(x_api_key)
        rows, _ = core.manager.list(caller, ["running"], {}, 1000, None)
        return {"tenant": caller.tenant, "running": len(rows)}

    return SurfaceRoutes(router=router)


def _claims(scope: Scope) -> bool:
    return (b"x-hello-surface", b"1") in scope["headers"]


def claiming_surface(core: Core) -> SurfaceRoutes:
    """Owns requests with `X-Hello-Surface: 1`, even on a path the /v1 API serves (the way the
    E2B API selects sandbox traffic by header)."""
    router = APIRouter()

    @router.get("/v1/health")
    async def claimed() -> dict[str, Any]:
        return {"surface": "hello", "runtime": core.runtimes.default}

    return SurfaceRoutes(router=router, predicate=_claims, open_paths=frozenset({"/v1/health"}))


ENVD_PORT = 49990  # a port the stand-in surface serves (E2B's own surface has 49983 and 49999)


async def envd_stand_in(scope: Scope, receive: Receive, send: Send) -> None:
    """Served by the control plane in place of a sandbox port: says what it was handed."""
    port = scope["agentbox.port"]
    target = port["target"]
    body = {
        "sandbox_id": target.sandbox_id if target else None,
        "port": port["port"],
        "path": scope["path"],
        "query": scope["query_string"].decode(),
    }
    status = 200 if target else 404
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})  # fmt: skip
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


def port_surface(core: Core) -> SurfaceRoutes:
    return SurfaceRoutes(router=APIRouter(), ports={ENVD_PORT: envd_stand_in})


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    surfaces.register("hello", hello_surface)
    surfaces.register("hello-claims", claiming_surface)
    surfaces.register("hello-port", port_surface)
    try:
        app = create_app(tmp_path / "data", admin_key=ADMIN_KEY, default_template="host")
    finally:
        surfaces.unregister("hello")
        surfaces.unregister("hello-claims")
        surfaces.unregister("hello-port")
    with serving_app(app) as served:
        yield served


def test_a_registered_surface_serves_beside_v1(url: str) -> None:
    admin = httpx.Client(base_url=url, headers={"X-API-Key": ADMIN_KEY}, timeout=60)
    key = admin.post("/v1/keys", json={"tenant": "hello-tenant"}).raise_for_status().json()["key"]
    c = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=60)
    assert c.get("/hello-surface").json() == {"tenant": "hello-tenant", "running": 0}
    sandbox = c.post("/v1/sandboxes", json={}).raise_for_status().json()
    try:
        assert c.get("/hello-surface").json() == {"tenant": "hello-tenant", "running": 1}
        # The other tenant's sandbox is not counted: the surface went through the core's scope.
        assert admin.get("/hello-surface").json()["running"] == 0
    finally:
        assert c.delete(f"/v1/sandboxes/{sandbox['sandbox_id']}").status_code == 204
    assert c.get("/hello-surface").json()["running"] == 0


def test_a_surface_gets_the_same_key_check_and_error_bodies(url: str) -> None:
    r = httpx.get(f"{url}/hello-surface")
    assert r.status_code == 401
    assert r.json()["code"] == "unauthorized"
    r = httpx.get(f"{url}/hello-surface", headers={"X-API-Key": "not-a-key"})
    assert (r.status_code, r.json()["code"]) == (401, "unauthorized")


def test_a_predicate_surface_claims_its_requests_and_leaves_the_rest(url: str) -> None:
    claimed = httpx.get(f"{url}/v1/health", headers={"X-Hello-Surface": "1"}).json()
    assert claimed == {"surface": "hello", "runtime": "process"}
    v1 = httpx.get(f"{url}/v1/health").json()
    assert v1["status"] == "ok" and "surface" not in v1
    paths = httpx.get(f"{url}/openapi.json").json()["paths"]
    assert "/hello-surface" in paths and "/v1/sandboxes" in paths


def test_a_surface_serves_a_sandbox_port_in_place_of_the_sandbox(url: str) -> None:
    """The gateway hands a port a surface claims to that surface's app (as E2B's envd port
    is), with the sandbox it names; every other port is still the sandbox's own."""
    admin = httpx.Client(base_url=url, headers={"X-API-Key": ADMIN_KEY}, timeout=60)
    sid = admin.post("/v1/sandboxes", json={}).raise_for_status().json()["sandbox_id"]
    try:
        r = httpx.get(f"{url}/v1/sandboxes/{sid}/ports/{ENVD_PORT}/files?path=/a%20b")
        assert r.status_code == 200, r.text
        assert r.json() == {"sandbox_id": sid, "port": ENVD_PORT, "path": "/files",
                            "query": "path=/a%20b"}  # fmt: skip
        # No running sandbox of that id: the surface's app is told so and answers itself.
        r = httpx.get(f"{url}/v1/sandboxes/sbx_0000000000000000/ports/{ENVD_PORT}/x")
        assert r.status_code == 404 and r.json()["sandbox_id"] is None
        # Another port is relayed to the sandbox, behind its access token as always.
        r = httpx.get(f"{url}/v1/sandboxes/{sid}/ports/8000/files")
        assert r.status_code in (401, 403), r.text
    finally:
        assert admin.delete(f"/v1/sandboxes/{sid}").status_code == 204
