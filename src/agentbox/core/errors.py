"""Errors the control plane raises, each with a stable reason code (agentbox.vocab.ErrorCode).

What a code means as a status (the audit log's, an HTTP answer's) is vocab.status_of; each
surface maps errors to answers in one place. Messages tell an agent what to change.
"""

from __future__ import annotations

from typing import Any


class AgentboxError(Exception):
    code = "internal_error"

    def __init__(self, message: str, code: str | None = None, **detail: Any) -> None:
        super().__init__(message)
        self.message = message
        if code:
            self.code = code
        self.detail = detail


class Unauthorized(AgentboxError):
    code = "unauthorized"


class Forbidden(AgentboxError):
    code = "forbidden"


class NotFound(AgentboxError):
    code = "not_found"


class InvalidRequest(AgentboxError):
    code = "invalid_request"


class Conflict(AgentboxError):
    code = "conflict"


class QuotaExceeded(AgentboxError):
    code = "quota_exceeded"


class LimitExceeded(AgentboxError):
    code = "limit_exceeded"


class InsufficientStorage(AgentboxError):
    """The server's own disk is nearly full: nothing new is created until space is freed."""

    code = "insufficient_storage"


class SandboxNotRunning(AgentboxError):
    code = "sandbox_not_running"


class SandboxUnavailable(AgentboxError):
    code = "sandbox_unavailable"


class SandboxUnhealthy(AgentboxError):
    """The sandbox lives but its agent stopped answering health checks."""

    code = "sandbox_unhealthy"


def from_agent(code: str, message: str, detail: dict[str, Any]) -> AgentboxError:
    """The in-sandbox agent's failure, under the agent's own reason code."""
    return AgentboxError(message, code=code, **detail)
