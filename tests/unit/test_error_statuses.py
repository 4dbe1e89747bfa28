"""Core errors carry a reason code, never a status: the status a code means is written once
(vocab.STATUS), recorded in the audit log and answered by the /v1 API (server/errors.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from agentbox.core import errors
from agentbox.core.auth import Caller
from agentbox.core.errors import AgentboxError, QuotaExceeded
from agentbox.core.manager import CreateRequest, SandboxManager
from agentbox.core.network import NetworkService, NetworkSettings
from agentbox.runtimes.fake import FakeRuntime
from agentbox.server.errors import HTTP_STATUS, http_status, install_handlers
from agentbox.store.db import Store
from agentbox.templates import TemplateStore
from agentbox.vocab import STATUS, status_of

CORE_ERRORS = [
    c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, AgentboxError)
]


@pytest.mark.parametrize("cls", CORE_ERRORS, ids=lambda c: c.__name__)
def test_a_core_error_has_a_code_with_a_status_and_no_status_of_its_own(
    cls: type[AgentboxError],
) -> None:
    assert cls.code in STATUS
    assert not hasattr(cls("x"), "status")


def test_the_v1_api_answers_each_code_with_its_recorded_status() -> None:
    assert HTTP_STATUS == STATUS
    for code, status in STATUS.items():
        assert http_status(AgentboxError("x", code=code)) == status


def test_an_agent_code_keeps_its_code_and_an_unknown_one_is_a_500() -> None:
    e = errors.from_agent("path_not_found", "no such file", {"path": "/a"})
    assert (e.code, e.message, e.detail) == ("path_not_found", "no such file", {"path": "/a"})
    assert http_status(e) == 404
    assert status_of("something_new") == 500
    assert http_status(AgentboxError("x", code="something_new")) == 500


async def _raised(e: Exception) -> httpx.Response:
    """What a client gets from an app with the server's error handlers when a route raises e."""
    app = FastAPI()
    install_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise e

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get("/boom")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_an_error_with_only_a_code_answers_with_the_tables_status() -> None:
    e = AgentboxError("wait for some commands to end", code="too_many_commands", sandbox="s1")
    r = await _raised(e)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert r.json() == {
        "code": "too_many_commands",
        "message": "wait for some commands to end",
        "detail": {"sandbox": "s1"},
    }


@pytest.mark.anyio
async def test_an_unexpected_error_is_a_500_with_the_same_body() -> None:
    r = await _raised(ValueError("secret detail"))
    assert r.status_code == 500
    assert r.json() == {
        "code": "internal_error",
        "message": "internal error: ValueError",
        "detail": {},
    }


@pytest.mark.anyio
async def test_a_refused_create_is_audited_with_its_codes_status(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'agentbox.db'}")
    mgr = SandboxManager(
        store,
        FakeRuntime(tmp_path),
        TemplateStore(tmp_path / "templates"),
        NetworkService(store, tmp_path, NetworkSettings()),
        default_quota={"max_sandboxes": 0},
        check_templates=False,
        default_template="host",
    )
    acme = Caller(tenant="acme", key_id="k1", admin=False)
    with pytest.raises(QuotaExceeded):
        await mgr.create(acme, CreateRequest())
    (event,) = store.list_audit("acme", None, "sandbox.create", None, 5)
    assert (event["status"], event["detail"]["error"]) == (429, "quota_exceeded")
