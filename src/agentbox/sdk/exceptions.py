"""Every error the SDK raises: one `AgentboxError` root carrying the server's reason.

The server answers errors as `{"code", "message", "detail"}`; those land on `.code`, `.message`
and `.detail`, and `.status` holds the HTTP status (None when no answer came back). The
E2B-style names (`SandboxException`, `NotFoundException`, ...) are aliases, so code written for
E2B catches the same errors.
"""

from __future__ import annotations

from typing import Any

from agentbox.sdk.models import BlockedAttempt, Violation

__all__ = [
    "AgentboxError",
    "AuthenticationError",
    "NotFoundError",
    "InvalidArgumentError",
    "QuotaExceededError",
    "ConflictError",
    "SandboxTimeoutError",
    "ConnectionFailedError",
    "CommandExitException",
    "CommandTimeoutError",
    "SandboxException",
    "NotFoundException",
    "TimeoutException",
    "RateLimitException",
]


class AgentboxError(Exception):
    """Base of all SDK errors. `violation` is set when the sandbox blocked the operation."""

    def __init__(self, message: str, *, status: int | None = None, code: str = "error",
                 detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.detail: dict[str, Any] = detail or {}
        self.violation: Violation | None = Violation.from_json(self.detail.get("violation"))

    def __str__(self) -> str:
        return f"{self.message} ({self.code})" if self.code != "error" else self.message


class AuthenticationError(AgentboxError):
    """401/403: the API key is missing, unknown, or lacks the rights for this route."""


class NotFoundError(AgentboxError):
    """404: no such sandbox (or not yours), command, template or path."""


class InvalidArgumentError(AgentboxError):
    """400/413/422 (and policy 403s): the server refuses what was asked; `message` says why."""


class QuotaExceededError(AgentboxError):
    """429: the tenant is at a limit (for example its concurrent-sandbox quota)."""


class ConflictError(AgentboxError):
    """409: the target is in the wrong state (sandbox not running, path exists, stdin closed)."""


class SandboxTimeoutError(AgentboxError):
    """A request, a stream or a command ran out of time."""


class ConnectionFailedError(AgentboxError):
    """The server could not be reached or dropped the connection."""


class CommandExitException(AgentboxError):
    """A command ended with a non-zero exit code (or by a signal, or without an exit code)."""

    def __init__(self, message: str, *, stdout: str, stderr: str, exit_code: int | None,
                 error: str | None = None, timed_out: bool = False,
                 violation: Violation | None = None, cmd_id: str | None = None,
                 code: str = "command_exit",
                 network_blocked: list[BlockedAttempt] | None = None,
                 dropped_bytes: int = 0) -> None:
        super().__init__(message, code=code)
        # Output dropped before anyone read it (see CommandResult.dropped_bytes).
        self.dropped_bytes = dropped_bytes
        # Egress attempts the sandbox's proxy refused while the command ran.
        self.network_blocked = list(network_blocked or [])
        self.stdout = stdout
        self.stderr = stderr
        self.exit_code = exit_code
        self.error = error
        self.timed_out = timed_out
        self.violation = violation
        self.cmd_id = cmd_id

    def __str__(self) -> str:
        return self.message


class CommandTimeoutError(CommandExitException, SandboxTimeoutError):
    """The command hit its own `timeout`; catchable as either parent."""


# E2B-compatible names.
SandboxException = AgentboxError
NotFoundException = NotFoundError
TimeoutException = SandboxTimeoutError
RateLimitException = QuotaExceededError
