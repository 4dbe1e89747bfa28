"""What the E2B control plane and the envd surface share: E2B's error body, the envd access
token, and how an agentbox sandbox looks in E2B's terms."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from agentbox.core.errors import AgentboxError, Unauthorized
from agentbox.server import models as m
from agentbox.server.errors import http_status, validation_message
from agentbox.server.surfaces import Core
from agentbox.store.db import SandboxRow

# The envd version reported to the SDK, which switches wire behaviour on it (e2b/envd/versions.py):
# 0.6.4 and later is today's (octet-stream uploads, default user, no legacy fallbacks).
ENVD_VERSION = "0.6.4"
ENVD_PORT = 49983
CODE_INTERPRETER_PORT = 49999

# agentbox states an E2B client sees as `running`, and as `paused`; ended ones it never sees
# (E2B answers 404 for a sandbox that is gone).
RUNNING_STATES = ("starting", "building", "running", "unhealthy")
PAUSED_STATES = ("paused",)


# envd's answer to a valid file URL signature past its expiry, word for word.
EXPIRED = "signature is already expired"


class ExpiredSignature(Unauthorized):
    """A valid signature past its expiry (answered with E2B's exact body, see signed.py)."""


Str = Annotated[str, Field(max_length=300)]  # a string field of E2B's bodies


class Body(BaseModel):
    """An E2B request body. Fields a newer SDK adds are ignored; those whose meaning agentbox
    cannot give are refused by name (where each body is read) rather than dropped."""

    model_config = ConfigDict(extra="ignore")


def e2b_error(status: int, message: str, reason: str | None = None) -> JSONResponse:
    """E2B's error body, `{"code": <HTTP status>, "message": ...}` (the SDK raises its
    message); `reason` is agentbox's reason code, kept beside it."""
    body: dict[str, Any] = {"code": status, "message": m.text(message)}
    if reason:
        body["reason"] = reason
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse(status_code=status, content=body, headers=headers)


def error_of(e: Exception) -> JSONResponse | None:
    """E2B's answer to an error a route raised; None for one it does not know."""
    if isinstance(e, ExpiredSignature):
        return e2b_error(401, EXPIRED)
    if isinstance(e, AgentboxError):
        return e2b_error(http_status(e), e.message, e.code)
    if isinstance(e, RequestValidationError):
        status, message = validation_message(e)
        return e2b_error(status, message, "invalid_request")
    if isinstance(e, HTTPException):
        return e2b_error(e.status_code, str(e.detail))
    return None


class E2BRoute(APIRoute):
    """A route whose errors answer in E2B's shape (its SDKs read `message` for every status)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        inner = super().get_route_handler()

        async def handler(request: Request) -> Response:
            try:
                return await inner(request)
            except Exception as e:
                answer = error_of(e)
                if answer is None:
                    raise
                return answer

        return handler


def envd_token(core: Core, row: SandboxRow) -> str:
    return _token(core, row.sandbox_id, row.access_token or "")


def _token(core: Core, sandbox_id: str, access_token: str) -> str:
    """The sandbox's envd access token: what E2B's SDK sends as X-Access-Token to run commands
    and reach files. Derived from its port access token with a key only the server holds, so
    the port token (which a sandbox's web users may hold) does not give it, and rotating the
    port token (POST /v1/sandboxes/{id}/access-token) rotates this one too."""
    key = core.network.derived_key("e2b-envd")
    msg = f"{sandbox_id}:{access_token}".encode()
    digest = hmac.new(key, msg, hashlib.sha256).digest()
    return "ea_" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def token_matches(core: Core, sandbox_id: str, row: SandboxRow | None, given: str | None) -> bool:
    """Whether `given` is the envd token of the sandbox (`row`, None for one not known); the
    same work either way, so the answer's timing does not tell whether it exists."""
    expected = _token(core, sandbox_id, (row.access_token or "") if row is not None else "-")
    same = hmac.compare_digest((given or "").encode(), expected.encode())
    if row is None or not given:
        return False
    if not core.limits.e2b_envd_tokens:  # the battery's positive control only
        return True
    return same


def e2b_state(row: SandboxRow) -> str | None:
    """`running` or `paused`, or None for a sandbox that has ended (gone, for E2B)."""
    if row.state in PAUSED_STATES:
        return "paused"
    if row.state in RUNNING_STATES:
        return "running"
    return None


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def created(row: SandboxRow, core: Core) -> dict[str, Any]:
    """E2B's `Sandbox` (what create and connect answer)."""
    return {
        "templateID": row.template,
        "sandboxID": row.sandbox_id,
        "clientID": "agentbox",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": envd_token(core, row),
        # The code interpreter's credential: the SDK sends it on each of its requests (the
        # envd token only on /execute), so agentbox always issues it.
        "trafficAccessToken": envd_token(core, row),
        "domain": None,
    }


def listed(row: SandboxRow, state: str) -> dict[str, Any]:
    """E2B's `ListedSandbox`."""
    r = row.resources or {}
    end_at = row.end_at
    if state == "paused" and row.ttl_left is not None:
        end_at = time.time() + row.ttl_left  # when it would end if resumed now
    return {
        "templateID": row.template,
        "sandboxID": row.sandbox_id,
        "clientID": "agentbox",
        "startedAt": rfc3339(row.created_at),
        "endAt": rfc3339(end_at),
        "cpuCount": max(1, round(float(r.get("cpu_count") or 1))),
        "memoryMB": int(r.get("memory_mb") or 0),
        "diskSizeMB": int(r.get("disk_mb") or 0),
        "state": state,
        "envdVersion": ENVD_VERSION,
        "metadata": row.metadata,
    }


def sandbox_home(core: Core, sandbox_id: str) -> str | None:
    """E2B's home (/home/user) if the runtime mounted the sandbox's workspace there, else None
    (a template whose root could not take the mount point: agentbox's /workspace applies)."""
    row = core.manager.running_row(sandbox_id)
    home = (row.runtime_state or {}).get("home") if row is not None else None
    return str(home) if home else None
