"""Errors the control plane raises, each with a stable reason code and an HTTP status.

The HTTP layer maps them to responses in one place; messages tell an agent what to change.
"""

from __future__ import annotations

from typing import Any


class AgentboxError(Exception):
    status = 500
    code = "internal_error"

    def __init__(
        self, message: str, code: str | None = None, status: int | None = None, **detail: Any
    ) -> None:
        super().__init__(message)
        self.message = message
        if code:
            self.code = code
        if status:
            self.status = status
        self.detail = detail


class Unauthorized(AgentboxError):
    status, code = 401, "unauthorized"


class Forbidden(AgentboxError):
    status, code = 403, "forbidden"


class NotFound(AgentboxError):
    status, code = 404, "not_found"


class InvalidRequest(AgentboxError):
    status, code = 400, "invalid_request"


class Conflict(AgentboxError):
    status, code = 409, "conflict"


class QuotaExceeded(AgentboxError):
    status, code = 429, "quota_exceeded"


class LimitExceeded(AgentboxError):
    status, code = 400, "limit_exceeded"


class InsufficientStorage(AgentboxError):
    """The server's own disk is nearly full: nothing new is created until space is freed."""

    status, code = 507, "insufficient_storage"


class SandboxNotRunning(AgentboxError):
    status, code = 409, "sandbox_not_running"


class SandboxUnavailable(AgentboxError):
    status, code = 503, "sandbox_unavailable"


class SandboxUnhealthy(AgentboxError):
    """The sandbox lives but its agent stopped answering health checks."""

    status, code = 503, "sandbox_unhealthy"


# Reason codes the in-sandbox agent returns, and the HTTP status each maps to.
AGENT_CODE_STATUS = {
    "invalid_path": 400,
    "invalid_request": 400,
    "symlink_refused": 400,
    "not_a_directory": 400,
    "is_a_directory": 400,
    "not_a_regular_file": 400,
    "path_not_found": 404,
    "not_found": 404,
    "path_exists": 409,
    "conflict": 409,
    "permission_denied": 403,
    "read_only_path": 403,
    "limit_exceeded": 400,
    "io_error": 400,
    # the code interpreter
    "context_not_found": 404,
    "unsupported": 400,
    "kernel_dead": 409,
    "code_host_unavailable": 503,
    "code_host_error": 502,
}


def from_agent(code: str, message: str, detail: dict[str, Any]) -> AgentboxError:
    return AgentboxError(message, code=code, status=AGENT_CODE_STATUS.get(code, 500), **detail)
