"""Words the server and the SDK share, each written down once: sandbox states, a sandbox's
users, the code interpreter's languages, error codes and the status each code is recorded and
answered with.

Standard library only: the SDK imports this without the server's dependencies. The in-sandbox
agent keeps its own copy of LANGUAGES (it runs alone inside every sandbox, stdlib only), and
the server's error classes keep their code beside them; tests/unit/test_vocab.py checks both
agree with what is here.
"""

from __future__ import annotations

from enum import StrEnum


class SandboxState(StrEnum):
    """A sandbox's stored state; the moves between them are in core/states.py."""

    BUILDING = "building"
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"  # frozen, memory kept; resumed on request (its TTL clock stopped)
    KILLED = "killed"  # asked to end (a kill, a vanished sandbox, a pool or check member)
    FAILED = "failed"  # could not start, or its build failed, or it broke beyond repair
    EXPIRED = "expired"  # its timeout passed


# Shown instead of `running` while the agent does not answer; never stored.
UNHEALTHY = "unhealthy"
# A list filter meaning every live state.
LIVE_FILTER = "live"

# A sandbox's users, as runtimes make them and templates lay out their files for them.
# The sandbox's root (uid 0 inside its user namespace) holds only these capabilities:
# Docker's default set less NET_RAW, MKNOD (useless in a user namespace) and AUDIT_WRITE; never
# SYS_ADMIN, NET_ADMIN, SYS_PTRACE, SYS_MODULE, SYS_RAWIO or the like.
ROOT_CAPS = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_SETFCAP",
)
USER_UID = 1000  # the sandbox's `user`, inside its namespace
USER_VENV = "opt/venv"  # a built template's Python environment of `user`'s (templates/layers.py)

# The code interpreter's languages; the first is the default.
LANGUAGES = ("python", "bash", "javascript", "typescript", "r")
DEFAULT_LANGUAGE = LANGUAGES[0]


class ErrorCode(StrEnum):
    """The reason codes of `{"code", "message", "detail"}` error answers and stream errors,
    and the ones the SDK gives errors that never reached the server."""

    # the control plane
    INTERNAL_ERROR = "internal_error"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    INVALID_REQUEST = "invalid_request"
    CONFLICT = "conflict"
    QUOTA_EXCEEDED = "quota_exceeded"
    LIMIT_EXCEEDED = "limit_exceeded"
    INSUFFICIENT_STORAGE = "insufficient_storage"
    BODY_TOO_LARGE = "body_too_large"
    TOO_MANY_COMMANDS = "too_many_commands"
    SERVER_BUSY = "server_busy"
    NOT_INSTALLED = "not_installed"
    # the port gateway
    PORT_NOT_OPEN = "port_not_open"
    GATEWAY_BUSY = "gateway_busy"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_ERROR = "upstream_error"
    CLIENT_STALLED = "client_stalled"
    SANDBOX_NOT_RUNNING = "sandbox_not_running"
    SANDBOX_UNAVAILABLE = "sandbox_unavailable"
    SANDBOX_UNHEALTHY = "sandbox_unhealthy"
    BUILD_FAILED = "build_failed"
    # the in-sandbox agent (files)
    INVALID_PATH = "invalid_path"
    SYMLINK_REFUSED = "symlink_refused"
    NOT_A_DIRECTORY = "not_a_directory"
    IS_A_DIRECTORY = "is_a_directory"
    NOT_A_REGULAR_FILE = "not_a_regular_file"
    PATH_NOT_FOUND = "path_not_found"
    PATH_EXISTS = "path_exists"
    PERMISSION_DENIED = "permission_denied"
    READ_ONLY_PATH = "read_only_path"
    IO_ERROR = "io_error"
    # the in-sandbox agent (code interpreter)
    CONTEXT_NOT_FOUND = "context_not_found"
    UNSUPPORTED = "unsupported"
    KERNEL_DEAD = "kernel_dead"
    CODE_HOST_UNAVAILABLE = "code_host_unavailable"
    CODE_HOST_ERROR = "code_host_error"
    # the SDK, for what went wrong on its side of the wire
    CONNECTION_FAILED = "connection_failed"
    REQUEST_TIMEOUT = "request_timeout"
    STREAM_ENDED = "stream_ended"
    BAD_RESPONSE = "bad_response"
    COMMAND_EXIT = "command_exit"
    COMMAND_TIMEOUT = "command_timeout"


_E = ErrorCode

# The status an outcome is recorded with in the audit log, and the /v1 API's HTTP status, for
# each code an error of the server can carry. Another surface may answer a code differently
# (server/errors.py); the audit log keeps these.
STATUS: dict[str, int] = {
    # the control plane
    _E.INTERNAL_ERROR: 500,
    _E.UNAUTHORIZED: 401,
    _E.FORBIDDEN: 403,
    _E.NOT_FOUND: 404,
    _E.INVALID_REQUEST: 400,
    _E.CONFLICT: 409,
    _E.QUOTA_EXCEEDED: 429,
    _E.LIMIT_EXCEEDED: 400,
    _E.INSUFFICIENT_STORAGE: 507,
    _E.BODY_TOO_LARGE: 413,
    _E.TOO_MANY_COMMANDS: 429,
    _E.SERVER_BUSY: 503,  # a budget of the whole server's (MCP sessions), not a tenant's
    _E.NOT_INSTALLED: 501,  # a surface whose optional package the server lacks
    _E.SANDBOX_NOT_RUNNING: 409,
    _E.SANDBOX_UNAVAILABLE: 503,
    _E.SANDBOX_UNHEALTHY: 503,
    _E.BUILD_FAILED: 422,
    # the port gateway (499: the client stopped reading, nginx's code for it)
    _E.PORT_NOT_OPEN: 502,
    _E.GATEWAY_BUSY: 503,
    _E.UPSTREAM_TIMEOUT: 504,
    _E.UPSTREAM_ERROR: 502,
    _E.CLIENT_STALLED: 499,
    _E.REQUEST_TIMEOUT: 408,
    # the in-sandbox agent (files)
    _E.INVALID_PATH: 400,
    _E.SYMLINK_REFUSED: 400,
    _E.NOT_A_DIRECTORY: 400,
    _E.IS_A_DIRECTORY: 400,
    _E.NOT_A_REGULAR_FILE: 400,
    _E.PATH_NOT_FOUND: 404,
    _E.PATH_EXISTS: 409,
    _E.PERMISSION_DENIED: 403,
    _E.READ_ONLY_PATH: 403,
    _E.IO_ERROR: 400,
    # the in-sandbox agent (code interpreter)
    _E.CONTEXT_NOT_FOUND: 404,
    _E.UNSUPPORTED: 400,
    _E.KERNEL_DEAD: 409,
    _E.CODE_HOST_UNAVAILABLE: 503,
    _E.CODE_HOST_ERROR: 502,
}

# Codes only the SDK gives, to errors that never reached the server: no answer, so no status
# (the SDK's `.status` is None for them). REQUEST_TIMEOUT is both: the server's for a stalled
# request body, the SDK's for a server that did not answer in time.
CLIENT_SIDE = frozenset(
    {
        _E.CONNECTION_FAILED,
        _E.REQUEST_TIMEOUT,
        _E.STREAM_ENDED,
        _E.BAD_RESPONSE,
        _E.COMMAND_EXIT,
        _E.COMMAND_TIMEOUT,
    }
)


def status_of(code: str) -> int:
    """The status an outcome with this error code is recorded with in the audit log, and the
    /v1 API's HTTP status for it; a code not in STATUS (an agent's newer reason) is a 500."""
    return STATUS.get(code, 500)
