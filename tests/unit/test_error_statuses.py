"""Which HTTP status each core error's reason code means is the HTTP surface's table
(server/errors.py), not the error's: an error that carries only a code answers right."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from agentbox.core import errors
from agentbox.core.errors import AGENT_CODE_STATUS, AgentboxError
from agentbox.server.errors import HTTP_STATUS, http_status, install_handlers

CORE_ERRORS = [
    c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, AgentboxError)
]


@pytest.mark.parametrize("cls", CORE_ERRORS, ids=lambda c: c.__name__)
def test_every_core_error_code_has_its_status_in_the_table(cls: type[AgentboxError]) -> None:
    # Until core errors stop carrying a status (their audit records still use it), the two agree.
    assert HTTP_STATUS[cls.code] == cls.status


@pytest.mark.parametrize("code", sorted(AGENT_CODE_STATUS))
def test_every_agent_code_has_its_status_in_the_table(code: str) -> None:
    assert http_status(errors.from_agent(code, "x", {})) == AGENT_CODE_STATUS[code]


def test_an_unknown_code_falls_back_to_the_errors_own_status() -> None:
    assert http_status(AgentboxError("x", code="something_new", status=418)) == 418
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
