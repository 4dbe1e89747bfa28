"""Runtimes are plug-ins chosen per sandbox: a second runtime (the fake one), registered through
the same registry the `agentbox.runtimes` entry points feed, serves beside the process runtime
with no edit to the core. Each sandbox's runtime is on its record; the core asks a runtime what
it can do through its declared features, and refuses what it cannot.

The server runs in this process (a runtime registered in code lives in the process that serves
it), under uvicorn."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ADMIN_KEY, serving_app

from agentbox import runtimes
from agentbox.battery.inventory import digest_of
from agentbox.runtimes.fake import FakeRuntime
from agentbox.server.app import create_app

# The fake's sandboxes live in its memory: a restarted server over the same data dir gets the
# same instance, as the host outlives a server.
_fakes: dict[Path, FakeRuntime] = {}


def _fake(data_dir: Path, **_: Any) -> FakeRuntime:
    return _fakes.setdefault(Path(data_dir), FakeRuntime(data_dir))


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    runtimes.register("fake", _fake)
    try:
        yield
    finally:
        runtimes.unregister("fake")


@contextmanager
def serving(data_dir: Path, runtime_name: str) -> Iterator[str]:
    app = create_app(data_dir, admin_key=ADMIN_KEY, runtime_name=runtime_name,
                     default_template="host")
    with serving_app(app) as url:
        yield url


def _clients(url: str, tenant: str) -> tuple[httpx.Client, httpx.Client]:
    admin = httpx.Client(base_url=url, headers={"X-API-Key": ADMIN_KEY}, timeout=60)
    key = admin.post("/v1/keys", json={"tenant": tenant}).raise_for_status().json()["key"]
    return admin, httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=60)


def _refused(r: httpx.Response, *words: str) -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["code"] == "invalid_request", body
    for w in words:
        assert w in body["message"], body


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    with serving(tmp_path / "data", "process,fake") as u:
        yield u


def test_each_sandbox_runs_on_the_runtime_it_asked_for(url: str, tmp_path: Path) -> None:
    _, c = _clients(url, "plugged")
    fake = _fakes[tmp_path / "data"]
    health = httpx.get(f"{url}/v1/health").json()
    assert health["runtimes"]["process"]["default"] is True
    assert health["runtimes"]["fake"]["features"]["network"] is False
    assert health["runtime"]["runtime"] == "process"  # the default's report, as before

    on_fake = c.post("/v1/sandboxes", json={"runtime": "fake"}).raise_for_status().json()
    on_process = c.post("/v1/sandboxes", json={}).raise_for_status().json()
    try:
        assert on_fake["runtime"] == "fake" and on_fake["state"] == "running"
        assert on_process["runtime"] == "process"
        assert ("create", on_fake["sandbox_id"]) in fake.calls
        assert ("create", on_process["sandbox_id"]) not in fake.calls
        # Calls about a sandbox go to its runtime: the process one runs the command, the
        # fake's stand-in agent says it cannot.
        ran = c.post(f"/v1/sandboxes/{on_process['sandbox_id']}/commands",
                     json={"cmd": "echo hi", "background": True})  # fmt: skip
        assert ran.status_code in (200, 201), ran.text
        r = c.post(f"/v1/sandboxes/{on_fake['sandbox_id']}/commands",
                   json={"cmd": "echo hi", "background": True})  # fmt: skip
        assert r.status_code == 400 and r.json()["code"] == "unsupported", r.text
    finally:
        for s in (on_fake, on_process):
            assert c.delete(f"/v1/sandboxes/{s['sandbox_id']}").status_code == 204
    assert ("destroy", on_fake["sandbox_id"]) in fake.calls
    assert on_fake["sandbox_id"] not in fake.sandboxes


def test_what_a_runtime_cannot_do_is_refused_by_name(url: str) -> None:
    _, c = _clients(url, "plugged")
    _refused(c.post("/v1/sandboxes", json={"runtime": "nope"}), "'nope'", "process, fake")
    # The fake declares no limits, no network and no kept workspaces.
    r = c.post("/v1/sandboxes", json={"runtime": "fake", "resources": {"memory_mb": 256}})
    _refused(r, "fake runtime does not enforce memory_mb")
    r = c.post("/v1/sandboxes", json={"runtime": "fake", "network": {"allow_out": ["a.test"]}})
    _refused(r, "cannot give a sandbox network")
    _refused(c.post("/v1/sandboxes", json={"runtime": "fake", "keep_workspace": True}),
             "cannot keep a workspace")  # fmt: skip
    assert c.get("/v1/sandboxes").json()["sandboxes"] == []


def test_a_tenant_has_a_default_runtime_and_an_allowed_set(url: str) -> None:
    admin, c = _clients(url, "fake-first")
    admin.put("/v1/tenants/fake-first/quota", json={"default_runtime": "fake"}).raise_for_status()
    made = c.post("/v1/sandboxes", json={}).raise_for_status().json()
    assert made["runtime"] == "fake"
    c.delete(f"/v1/sandboxes/{made['sandbox_id']}")

    _, other = _clients(url, "process-only")
    admin.put("/v1/tenants/process-only/quota", json={"runtimes": ["process"]}).raise_for_status()
    _refused(other.post("/v1/sandboxes", json={"runtime": "fake"}), "not allowed", "process")
    r = admin.put("/v1/tenants/process-only/quota", json={"default_runtime": "gvisor"})
    _refused(r, "'gvisor' is not served here")


def test_a_sandbox_keeps_its_runtime_across_restarts(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with serving(data, "process,fake") as url:
        _, c = _clients(url, "keeper")
        key = c.headers["X-API-Key"]
        sid = (
            c.post("/v1/sandboxes", json={"runtime": "fake"})
            .raise_for_status()
            .json()["sandbox_id"]
        )
    fake = _fakes[data]
    # A server that does not serve the fake leaves its sandbox alone, and says why it
    # cannot reach it.
    with serving(data, "process") as url:
        c = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=60)
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        r = c.delete(f"/v1/sandboxes/{sid}")
        assert r.status_code == 503 and "--runtime process,fake" in r.json()["message"], r.text
        assert sid in fake.sandboxes and ("destroy", sid) not in fake.calls
    # One that serves it again re-adopts it.
    with serving(data, "process,fake") as url:
        c = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=60)
        assert ("adopt", sid) in fake.calls
        assert c.get(f"/v1/sandboxes/{sid}").json()["runtime"] == "fake"
        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
    assert sid not in fake.sandboxes


def test_an_unknown_runtime_stops_the_server_at_start(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    app = create_app(tmp_path / "data", admin_key=ADMIN_KEY, runtime_name="process,nope")
    with pytest.raises(ValueError, match="unknown runtime 'nope'; installed: .*process"):
        with TestClient(app):
            pass
    # Refused before any runtime set up its host scaffolding (nothing left mounted).
    assert not list(Path("/run/agentbox").glob(f"{digest_of(tmp_path / 'data')}*"))
