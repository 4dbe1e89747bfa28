"""The agentbox HTTP API as pure functions: requests to send and how to read the answers.

Nothing here does I/O. `Sandbox` (httpx.Client) and `AsyncSandbox` (httpx.AsyncClient) both
build a `Call` here, send it their own way, and hand the response back to `finish`, so the two
faces cannot drift apart on paths, bodies, error mapping or NDJSON handling.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import dataclasses
import functools
import json
import logging
import os
import ssl
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import quote

import httpx

from agentbox import __version__
from agentbox.config import DEFAULT_API_URL, local_admin_key
from agentbox.sdk.exceptions import (
    AgentboxError,
    AuthenticationError,
    CommandExitException,
    CommandTimeoutError,
    ConflictError,
    ConnectionFailedError,
    InvalidArgumentError,
    NotFoundError,
    QuotaExceededError,
    SandboxTimeoutError,
)
from agentbox.sdk.models import (
    AuditEvent,
    BlockedAttempt,
    BuildProgress,
    CommandInfo,
    CommandResult,
    Context,
    EgressEvent,
    EntryInfo,
    EntryList,
    Execution,
    ExecutionError,
    FilesystemEvent,
    KeptWorkspace,
    KeyInfo,
    NetworkInfo,
    OutputMessage,
    PoolStats,
    Resources,
    Result,
    SandboxInfo,
    SandboxMetrics,
    SecretInfo,
    SnapshotInfo,
    TemplateInfo,
    Violation,
    VolumeInfo,
)
from agentbox.vocab import UNHEALTHY, ErrorCode, SandboxState

T = TypeVar("T")
Params = list[tuple[str, str | int | float | bool | None]]
NetworkSpec = NetworkInfo | Mapping[str, Any]

API_KEY_HEADER = "X-API-Key"
# A label for what a request does it for (an MCP session and tool), recorded in the audit.
VIA_HEADER = "X-Agentbox-Via"
_VIA: contextvars.ContextVar[str | None] = contextvars.ContextVar("agentbox_via", default=None)


@contextlib.contextmanager
def via(label: str) -> Iterator[None]:
    """Requests made inside (from this thread or task, and tasks it starts) carry `label`
    (1-96 characters: letters, digits, `_ . : / @ -`), which the server's audit records as
    `via` of everything they do, e.g. `with via("mcp:s1/run_command"): sbx.commands.run(...)`."""
    token = _VIA.set(label)
    try:
        yield
    finally:
        _VIA.reset(token)


def call_headers() -> dict[str, str] | None:
    label = _VIA.get()
    return {VIA_HEADER: label} if label else None
# Reads of file streams and uploads go in chunks of this size, never whole files.
CHUNK_SIZE = 1 << 20
# A dropped command stream is resumed from its last offset this many times in a row
# (with reconnect_delay between tries: about 9 s in all, enough for a server restart).
MAX_RECONNECTS = 8
# Extra seconds a foreground stream may stay silent beyond the command's own timeout before
# the SDK gives up on the server (the server itself ends the command at `timeout`).
STREAM_GRACE = 30.0
# Page size when listing sandboxes (the server allows up to 1000).
PAGE_SIZE = 200

# ---------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ClientConfig:
    api_url: str
    api_key: str
    request_timeout: float


def resolve_config(api_key: str | None = None, api_url: str | None = None,
                   request_timeout: float = 60.0) -> ClientConfig:
    """Arguments first, then AGENTBOX_API_URL / AGENTBOX_API_KEY, then the local admin key."""
    url = api_url or os.environ.get("AGENTBOX_API_URL") or DEFAULT_API_URL
    key = api_key or os.environ.get("AGENTBOX_API_KEY") or local_admin_key()
    if not key:
        raise AuthenticationError(
            "no API key: pass api_key=, set AGENTBOX_API_KEY, or run where the local server's "
            "admin.key is readable", code=ErrorCode.UNAUTHORIZED)
    return ClientConfig(api_url=url.rstrip("/"), api_key=key, request_timeout=request_timeout)


@functools.lru_cache(maxsize=2)
def _tls_context(verifying: bool) -> ssl.SSLContext:
    # Building a verifying TLS context loads the CA bundle (20-50 ms); every Sandbox has its
    # own client, so they share one context instead of paying that on each create/connect.
    if verifying:
        return httpx.create_ssl_context()
    # For a plain-HTTP server: one that trusts no certificate at all (a CLI run saves the CA
    # bundle's load), so an https URL such a client were ever sent to fails closed.
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


def tls_context(url: str) -> ssl.SSLContext:
    """The TLS context for a client of `url`: verifying against the CA bundle when the URL is
    https or wss, else one that refuses every certificate (no TLS expected, none trusted)."""
    return _tls_context(url.lower().startswith(("https:", "wss:")))


def client_options(config: ClientConfig) -> dict[str, Any]:
    """Keyword arguments for httpx.Client / httpx.AsyncClient."""
    return {
        "base_url": config.api_url,
        "verify": tls_context(config.api_url),
        "headers": {API_KEY_HEADER: config.api_key, "User-Agent": f"agentbox-sdk/{__version__}"},
        "timeout": httpx.Timeout(config.request_timeout),
    }


def request_timeout(config: ClientConfig, call: Call[Any]) -> float:
    """The call's own request timeout (E2B's per-call `request_timeout=`), else the client's."""
    return config.request_timeout if call.request_timeout is None else call.request_timeout


def call_timeout(config: ClientConfig, call: Call[Any]) -> httpx.Timeout:
    return httpx.Timeout(request_timeout(config, call))


def stream_timeout(config: ClientConfig, read: float | None, call: Call[Any]) -> httpx.Timeout:
    """Connect/write as usual; `read` bounds the silence between two chunks (None = forever)."""
    t = request_timeout(config, call)
    return httpx.Timeout(connect=t, read=read, write=t, pool=t)


# ---------------------------------------------------------------------------- calls


@dataclass(frozen=True)
class Call(Generic[T]):
    """One HTTP request and how to turn its successful response into a result."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    params: Params | None = None
    json: Any = None
    # Overrides the client's request timeout for this call alone; None = the client's.
    request_timeout: float | None = None


def timed(call: Call[T], request_timeout: float | None) -> Call[T]:
    """`call` with its own request timeout (the `request_timeout=` of an SDK method)."""
    if request_timeout is None:
        return call
    return dataclasses.replace(call, request_timeout=request_timeout)


def finish(call: Call[T], response: httpx.Response) -> T:
    """Raise the mapped error for a non-2xx response, else parse it. The body must be read."""
    if response.is_error:
        raise error_from_response(response)
    return call.parse(response)


def _seg(value: str) -> str:
    """Ids go into URL paths; quote them so a hostile id cannot change the route."""
    return quote(str(value), safe="")


def _sbx(sandbox_id: str) -> str:
    return f"/v1/sandboxes/{_seg(sandbox_id)}"


def _none(_: httpx.Response) -> None:
    return None


def _sandbox(r: httpx.Response) -> SandboxInfo:
    return SandboxInfo.from_json(r.json())


def _entry(r: httpx.Response) -> EntryInfo:
    return EntryInfo.from_json(r.json())


def _command(r: httpx.Response) -> CommandInfo:
    return CommandInfo.from_json(r.json())


# Sandboxes


def create_sandbox(template: str | None, timeout: float, metadata: Mapping[str, str] | None,
                   envs: Mapping[str, str] | None,
                   resources: Resources | Mapping[str, Any] | None,
                   keep_workspace: bool, network: NetworkSpec | None = None,
                   secrets: Sequence[str] | None = None,
                   allow_internet_access: bool | None = None,
                   runtime: str | None = None,
                   isolation: str | None = None,
                   lifecycle: Mapping[str, Any] | None = None,
                   volume_mounts: Mapping[str, Any] | None = None) -> Call[SandboxInfo]:
    """`network` None takes the tenant's default policy; `allow_internet_access` is E2B's
    shorthand, applied over `network` by the server; `secrets` are names of tenant secrets;
    `runtime` (or `isolation`, for a tier) None takes the tenant's default runtime, else the
    server's."""
    if isinstance(resources, Resources):
        res = resources.to_json()
    else:
        res = {k: v for k, v in (resources or {}).items() if v is not None}
    body: dict[str, Any] = {
        "timeout": timeout, "metadata": dict(metadata or {}), "envs": dict(envs or {}),
        "resources": res, "keep_workspace": keep_workspace,
    }
    if template is not None:
        body["template"] = template
    if network is not None:
        body["network"] = network_body(network)
    if allow_internet_access is not None:
        body["allow_internet_access"] = allow_internet_access
    if secrets:
        body["secrets"] = _names(secrets, "secrets")
    if runtime is not None:
        body["runtime"] = runtime
    if isolation is not None:
        body["isolation"] = isolation
    if lifecycle is not None:
        body["lifecycle"] = dict(lifecycle)
    if volume_mounts:
        body["volume_mounts"] = {k: v if isinstance(v, str) else dict(v)
                                 for k, v in volume_mounts.items()}
    return Call("POST", "/v1/sandboxes", _sandbox, json=body)


BUILD_POLL_S = 1.0  # how often a create that waits for a template build asks how it goes


PROGRESS_EVERY_S = 15.0  # while a build step goes on, how often it is reported again


def log_progress(progress: BuildProgress) -> None:
    logging.getLogger("agentbox").info("%s", progress)


class ProgressReporter:
    """Passes a waiting create's build progress on: each new step, and every PROGRESS_EVERY_S
    while one takes long (not at every poll)."""

    def __init__(self, on_progress: Callable[[BuildProgress], None] | None) -> None:
        self.on_progress = on_progress or log_progress
        self.shown: tuple[Any, ...] | None = None
        self.at = 0.0

    def __call__(self, info: SandboxInfo) -> None:
        build = info.build
        if build is None:
            return
        now = time.monotonic()
        key = (build.template, build.step, build.step_name)
        if key != self.shown or now - self.at >= PROGRESS_EVERY_S:
            self.shown, self.at = key, now
            self.on_progress(build)


def create_finished(info: SandboxInfo) -> bool:
    """After a create answered: whether the sandbox runs (False while its template is built
    or it starts); raises why it failed if it did."""
    if info.state in (SandboxState.BUILDING, SandboxState.STARTING):
        return False
    if info.state in (SandboxState.RUNNING, UNHEALTHY):
        return True
    failed = info.end_reason == "build_failed"  # an end reason, named like the error code
    code = ErrorCode.BUILD_FAILED if failed else ErrorCode.SANDBOX_UNAVAILABLE
    why = info.error or f"it is {info.state} ({info.end_reason})"
    raise AgentboxError(f"sandbox {info.sandbox_id} did not start: {why}", status=503,
                        code=code, detail={"sandbox_id": info.sandbox_id})


@dataclass(frozen=True)
class SandboxPage:
    sandboxes: list[SandboxInfo]
    next_token: str | None


def _sandbox_page(r: httpx.Response) -> SandboxPage:
    body = r.json()
    return SandboxPage([SandboxInfo.from_json(s) for s in body.get("sandboxes", [])],
                       body.get("next_token") or None)


def list_sandboxes(state: str | list[str] | None, metadata: Mapping[str, str] | None,
                   limit: int, next_token: str | None) -> Call[SandboxPage]:
    """`state` "live" (the SDK's default) is every state of a sandbox not ended; "all" or None
    is every state."""
    params: Params = [("limit", limit)]
    states = [state] if isinstance(state, str) else list(state or [])
    params += [("state", s) for s in states if s != "all"]
    params += [("metadata", f"{k}={v}") for k, v in (metadata or {}).items()]
    if next_token:
        params.append(("next_token", next_token))
    return Call("GET", "/v1/sandboxes", _sandbox_page, params=params)


def page_size(limit: int | None, have: int) -> int:
    """How many sandboxes to ask for next when `limit` (None = all) caps the total."""
    return PAGE_SIZE if limit is None else max(1, min(PAGE_SIZE, limit - have))


def get_sandbox(sandbox_id: str) -> Call[SandboxInfo]:
    return Call("GET", _sbx(sandbox_id), _sandbox)


def kill_sandbox(sandbox_id: str) -> Call[None]:
    return Call("DELETE", _sbx(sandbox_id), _none)


def set_timeout(sandbox_id: str, timeout: float) -> Call[SandboxInfo]:
    return Call("POST", f"{_sbx(sandbox_id)}/timeout", _sandbox, json={"timeout": timeout})


def _seconds(when: datetime | float | None) -> float | None:
    if when is None or isinstance(when, int | float):
        return when
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def sandbox_metrics(sandbox_id: str, start: datetime | float | None,
                    end: datetime | float | None) -> Call[list[SandboxMetrics]]:
    params: list[tuple[str, str | int | float | bool | None]] = [
        (k, v) for k, v in (("start", _seconds(start)), ("end", _seconds(end))) if v is not None
    ]
    return Call("GET", f"{_sbx(sandbox_id)}/metrics",
                lambda r: [SandboxMetrics.from_json(m) for m in r.json()["metrics"]],
                params=params)


def pause_sandbox(sandbox_id: str, keep_memory: bool = True) -> Call[SandboxInfo]:
    return Call("POST", f"{_sbx(sandbox_id)}/pause", _sandbox, json={"keep_memory": keep_memory})


def resume_sandbox(sandbox_id: str, timeout: float | None = None) -> Call[SandboxInfo]:
    body = {"timeout": timeout} if timeout is not None else {}
    return Call("POST", f"{_sbx(sandbox_id)}/resume", _sandbox, json=body)


def timeout_extends(info: SandboxInfo, timeout: float) -> bool:
    """Whether ending `timeout` seconds from now is later than the sandbox ends today: a
    connect with a timeout only ever extends a sandbox's life (as E2B's), never shortens it."""
    if info.end_at is None:
        return True
    end_at = info.end_at if info.end_at.tzinfo else info.end_at.replace(tzinfo=UTC)
    return (end_at - datetime.now(UTC)).total_seconds() < timeout


# Snapshots and forks


def _snapshot(r: httpx.Response) -> SnapshotInfo:
    return SnapshotInfo.from_json(r.json())


def _snap(ref: str) -> str:
    return f"/v1/snapshots/{_seg(ref)}"


def create_snapshot(sandbox_id: str, name: str | None = None,
                    metadata: Mapping[str, str] | None = None) -> Call[SnapshotInfo]:
    body: dict[str, Any] = {"metadata": dict(metadata or {})}
    if name is not None:
        body["name"] = name
    return Call("POST", f"{_sbx(sandbox_id)}/snapshots", _snapshot, json=body)


def list_snapshots() -> Call[list[SnapshotInfo]]:
    def parse(r: httpx.Response) -> list[SnapshotInfo]:
        return [SnapshotInfo.from_json(s) for s in r.json().get("snapshots", [])]

    return Call("GET", "/v1/snapshots", parse)


def get_snapshot(ref: str) -> Call[SnapshotInfo]:
    """`ref`: a snapshot's id or name."""
    return Call("GET", _snap(ref), _snapshot)


def delete_snapshot(ref: str) -> Call[None]:
    return Call("DELETE", _snap(ref), _none)


def fork_sandbox(sandbox_id: str, count: int = 1,
                 timeout: float | None = None) -> Call[list[SandboxInfo]]:
    """`timeout` None: each child gets its parent's."""
    body: dict[str, Any] = {"count": count}
    if timeout is not None:
        body["timeout"] = timeout

    def parse(r: httpx.Response) -> list[SandboxInfo]:
        return [SandboxInfo.from_json(s) for s in r.json().get("sandboxes", [])]

    # Children start one after another: the server may take a while.
    return Call("POST", f"{_sbx(sandbox_id)}/fork", parse, json=body,
                request_timeout=max(60.0, 30.0 * count))


# Network and exposed ports


def _names(values: str | Sequence[str], what: str) -> list[str]:
    # A lone string is one name, not a sequence of one-letter names.
    if isinstance(values, str):
        return [values]
    if not all(isinstance(v, str) for v in values):
        raise InvalidArgumentError(f"{what} must be strings", code=ErrorCode.INVALID_REQUEST)
    return list(values)


def network_body(network: NetworkSpec | None = None, *,
                 allow_out: str | Sequence[str] | None = None,
                 deny_out: str | Sequence[str] | None = None,
                 allow_internet_access: bool | None = None,
                 allow_public_traffic: bool | None = None) -> dict[str, Any]:
    """The JSON of a whole network policy: `network`'s fields, overridden by the keywords given.

    Fields neither names are left out, so the server gives them their defaults (nothing
    allowed, ports private): the policy sent replaces the sandbox's, it is not merged into it."""
    body = network.to_json() if isinstance(network, NetworkInfo) else dict(network or {})
    if allow_out is not None:
        body["allow_out"] = _names(allow_out, "allow_out")
    if deny_out is not None:
        body["deny_out"] = _names(deny_out, "deny_out")
    if allow_internet_access is not None:
        body["allow_internet_access"] = allow_internet_access
    if allow_public_traffic is not None:
        body["allow_public_traffic"] = allow_public_traffic
    return body


def set_network(sandbox_id: str, network: dict[str, Any]) -> Call[SandboxInfo]:
    return Call("PUT", f"{_sbx(sandbox_id)}/network", _sandbox, json=network)


Routing = Literal["path", "host"]


def rotate_access_token(sandbox_id: str) -> Call[SandboxInfo]:
    return Call("POST", f"{_sbx(sandbox_id)}/access-token", _sandbox)


def port_url(sandbox_id: str, port: int, expires_in: float | None = None, path: str = "/",
             routing: Routing = "path") -> Call[str]:
    """A signed URL to the sandbox's `port` that works with no headers: path-routed
    ({api}/v1/sandboxes/{id}/ports/{port}{path}) or host-routed ({port}-{id}.{domain})."""
    if routing not in ("path", "host"):
        raise InvalidArgumentError(f"routing must be 'path' or 'host', not {routing!r}",
                                   code=ErrorCode.INVALID_REQUEST)
    return Call("POST", f"{_sbx(sandbox_id)}/port-url", lambda r: str(r.json()["url"]),
                json={"port": port, "expires_in": expires_in, "path": path,
                      "routing": routing})


def sandbox_host(info: SandboxInfo | None, port: int) -> str:
    """Where the sandbox's `port` is host-routed, E2B's shape: {port}-{sandbox_id}.{domain}.

    Requests there need the sandbox's access token (X-Access-Token) or a tenant API key
    unless the sandbox allows public traffic."""
    if info is None or not info.domain:
        raise AgentboxError("the server did not say which domain exposed ports use (a server "
                            "older than exposed ports?); use get_url instead",
                            code=ErrorCode.UNSUPPORTED)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidArgumentError(f"port must be 1-65535, not {port!r}",
                                   code=ErrorCode.INVALID_REQUEST)
    return f"{port}-{info.sandbox_id}.{info.domain}"


# Secrets


def _secret(r: httpx.Response) -> SecretInfo:
    return SecretInfo.from_json(r.json())


def set_secret(name: str, value: str, hosts: str | Sequence[str], in_url: bool = False,
               headers: str | Sequence[str] | None = None,
               allow_plaintext: bool = False) -> Call[SecretInfo]:
    """`headers` None and `allow_plaintext` False are the server's defaults (Authorization,
    verified TLS only) and are left out of the body."""
    body: dict[str, Any] = {"value": value, "hosts": _names(hosts, "hosts"), "in_url": in_url}
    if headers is not None:
        body["headers"] = _names(headers, "headers")
    if allow_plaintext:
        body["allow_plaintext"] = True
    return Call("PUT", f"/v1/secrets/{_seg(name)}", _secret, json=body)


def list_secrets() -> Call[list[SecretInfo]]:
    def parse(r: httpx.Response) -> list[SecretInfo]:
        return [SecretInfo.from_json(s) for s in r.json().get("secrets", [])]

    return Call("GET", "/v1/secrets", parse)


def remove_secret(name: str) -> Call[None]:
    return Call("DELETE", f"/v1/secrets/{_seg(name)}", _none)


# Commands


def _command_body(cmd: str, background: bool, envs: Mapping[str, str] | None, cwd: str | None,
                  timeout: float, stdin: bool, user: str | None,
                  pty: tuple[int, int] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"cmd": cmd, "cwd": cwd, "envs": dict(envs or {}), "timeout": timeout,
                            "background": background, "stdin": stdin}
    if pty is not None:
        body["pty"] = {"cols": pty[0], "rows": pty[1]}
    return _with_user(body, user)


def run_command(sandbox_id: str, cmd: str, envs: Mapping[str, str] | None, cwd: str | None,
                timeout: float, stdin: bool, user: str | None = None) -> Call[None]:
    """Foreground: the answer is an NDJSON stream, fed to a `CommandProgress`."""
    return Call("POST", f"{_sbx(sandbox_id)}/commands", _none,
                json=_command_body(cmd, False, envs, cwd, timeout, stdin, user))


def start_command(sandbox_id: str, cmd: str, envs: Mapping[str, str] | None, cwd: str | None,
                  timeout: float, stdin: bool, user: str | None = None,
                  pty: tuple[int, int] | None = None) -> Call[CommandInfo]:
    return Call("POST", f"{_sbx(sandbox_id)}/commands", _command,
                json=_command_body(cmd, True, envs, cwd, timeout, stdin, user, pty))


def resize_command(sandbox_id: str, cmd_id: str, cols: int, rows: int) -> Call[None]:
    return Call("POST", f"{_sbx(sandbox_id)}/commands/{_seg(cmd_id)}/resize", _none,
                json={"cols": cols, "rows": rows})


def command_events(sandbox_id: str, cmd_id: str, offset: int) -> Call[None]:
    return Call("GET", f"{_sbx(sandbox_id)}/commands/{_seg(cmd_id)}/events", _none,
                params=[("offset", offset)])


def list_commands(sandbox_id: str) -> Call[list[CommandInfo]]:
    def parse(r: httpx.Response) -> list[CommandInfo]:
        return [CommandInfo.from_json(c) for c in r.json().get("commands", [])]

    return Call("GET", f"{_sbx(sandbox_id)}/commands", parse)


def get_command(sandbox_id: str, cmd_id: str) -> Call[CommandInfo]:
    return Call("GET", f"{_sbx(sandbox_id)}/commands/{_seg(cmd_id)}", _command)


def command_stdin(sandbox_id: str, cmd_id: str, data: str, eof: bool) -> Call[None]:
    return Call("POST", f"{_sbx(sandbox_id)}/commands/{_seg(cmd_id)}/stdin", _none,
                json={"data": data, "eof": eof})


def kill_command(sandbox_id: str, cmd_id: str, signal: str | int = "SIGKILL") -> Call[None]:
    return Call("POST", f"{_sbx(sandbox_id)}/commands/{_seg(cmd_id)}/kill", _none,
                json={"signal": signal})


# Files


def _path_params(path: str, user: str | None) -> list[tuple[str, Any]]:
    """A file call's query: the path and, unless the sandbox's default, who acts."""
    return [("path", path)] + ([] if user is None else [("user", user)])


def _with_user(body: dict[str, Any], user: str | None) -> dict[str, Any]:
    return body if user is None else {**body, "user": user}


def read_file(sandbox_id: str, path: str, user: str | None = None) -> Call[None]:
    """The answer is the raw file, read as a stream by the caller."""
    return Call("GET", f"{_sbx(sandbox_id)}/files", _none, params=_path_params(path, user))


def write_file(sandbox_id: str, path: str, user: str | None = None) -> Call[EntryInfo]:
    """The body (a chunk stream) is supplied by the face that sends it."""
    return Call("PUT", f"{_sbx(sandbox_id)}/files", _entry, params=_path_params(path, user))


def list_files(sandbox_id: str, path: str, depth: int, limit: int | None = None,
               cursor: str | None = None, user: str | None = None) -> Call[EntryList]:
    params = [*_path_params(path, user), ("depth", depth)]
    if limit is not None:
        params.append(("limit", limit))
    if cursor is not None:
        params.append(("cursor", cursor))
    return Call("GET", f"{_sbx(sandbox_id)}/files/list",
                lambda r: EntryList.from_json(r.json()), params=params)


def stat_file(sandbox_id: str, path: str, user: str | None = None) -> Call[EntryInfo]:
    return Call("GET", f"{_sbx(sandbox_id)}/files/stat", _entry, params=_path_params(path, user))


def watch_dir(sandbox_id: str, path: str, recursive: bool, user: str | None = None) -> Call[None]:
    params = [*_path_params(path, user), ("recursive", "true" if recursive else "false")]
    return Call("GET", f"{_sbx(sandbox_id)}/files/watch", _none, params=params)


def watch_event(event: dict[str, Any]) -> FilesystemEvent | None:
    """A line of a watch: its change, None for what is not one; an error line raises."""
    kind = event.get("type")
    if kind == "fs":
        return FilesystemEvent.from_json(event)
    if kind == "error":
        raise error_from_code(str(event.get("code") or "error"),
                              str(event.get("message") or "the watch failed"), None)
    return None


def make_dir(sandbox_id: str, path: str, user: str | None = None) -> Call[bool]:
    # 201 = created, 200 = it was already a directory (E2B's make_dir returns this bool).
    return Call("POST", f"{_sbx(sandbox_id)}/files/mkdir", lambda r: r.status_code == 201,
                json=_with_user({"path": path}, user))


def remove_file(sandbox_id: str, path: str, user: str | None = None) -> Call[None]:
    return Call("DELETE", f"{_sbx(sandbox_id)}/files", _none, params=_path_params(path, user))


def rename_file(sandbox_id: str, src: str, dst: str, user: str | None = None) -> Call[EntryInfo]:
    return Call("POST", f"{_sbx(sandbox_id)}/files/rename", _entry,
                json=_with_user({"src": src, "dst": dst}, user))


def write_entry(entry: Mapping[str, Any]) -> tuple[str, Any]:
    """The (path, data) of one `files.write_files` entry: {"path": ..., "data": ...}."""
    if not (isinstance(entry, Mapping) and isinstance(entry.get("path"), str) and "data" in entry):
        raise InvalidArgumentError(
            f"write_files takes entries like {{'path': 'a.txt', 'data': 'hi'}}, not {entry!r:.80}",
            code=ErrorCode.INVALID_REQUEST)
    return entry["path"], entry["data"]


def is_missing_path(error: AgentboxError) -> bool:
    """A 404 about the path, not about the sandbox (which must still raise in `exists`)."""
    return isinstance(error, NotFoundError) and error.code == "path_not_found"


# Audit


def _audit_params(limit: int, since: datetime | float | None,
                  **filters: str | bool | None) -> Params:
    """Query of the audit routes: filters left None (or "") are not sent."""
    params: Params = [("limit", limit)]
    params += [(name, value) for name, value in filters.items()
               if value is not None and value != ""]
    if since is not None:
        params.append(("since", since.timestamp() if isinstance(since, datetime) else since))
    return params


def list_audit(sandbox_id: str | None, action: str | None, tenant: str | None,
               since: datetime | float | None, limit: int) -> Call[list[AuditEvent]]:
    def parse(r: httpx.Response) -> list[AuditEvent]:
        return [AuditEvent.from_json(e) for e in r.json().get("events", [])]

    return Call("GET", "/v1/audit", parse,
                params=_audit_params(limit, since, sandbox_id=sandbox_id, action=action,
                                     tenant=tenant))


def list_egress(sandbox_id: str | None, host: str | None, allowed: bool | None,
                tenant: str | None, since: datetime | float | None,
                limit: int) -> Call[list[EgressEvent]]:
    def parse(r: httpx.Response) -> list[EgressEvent]:
        return [EgressEvent.from_json(e) for e in r.json().get("events", [])]

    return Call("GET", "/v1/audit/egress", parse,
                params=_audit_params(limit, since, sandbox_id=sandbox_id, host=host,
                                     allowed=allowed, tenant=tenant))


# Keys (admin)


def create_key(tenant: str, admin: bool) -> Call[KeyInfo]:
    return Call("POST", "/v1/keys", lambda r: KeyInfo.from_json(r.json()),
                json={"tenant": tenant, "admin": admin})


def list_keys() -> Call[list[KeyInfo]]:
    def parse(r: httpx.Response) -> list[KeyInfo]:
        return [KeyInfo.from_json(k) for k in r.json().get("keys", [])]

    return Call("GET", "/v1/keys", parse)


def delete_key(key_id: str) -> Call[None]:
    return Call("DELETE", f"/v1/keys/{_seg(key_id)}", _none)


# Code interpreter

# `run_code`'s default timeout, as in E2B's code interpreter: long cells are normal there.
RUN_CODE_TIMEOUT = 300.0


def run_code(sandbox_id: str, code: str, language: str | None, context: Context | str | None,
             envs: Mapping[str, str] | None, timeout: float | None) -> Call[None]:
    if language is not None and context is not None:
        raise InvalidArgumentError("give either language or context, not both",
                                   code=ErrorCode.INVALID_REQUEST)
    body: dict[str, Any] = {"code": code, "envs": dict(envs or {})}
    if context is not None:
        body["context_id"] = context.id if isinstance(context, Context) else str(context)
    elif language is not None:
        body["language"] = language
    if timeout is not None:
        body["timeout"] = timeout
    return Call("POST", f"{_sbx(sandbox_id)}/code/execute", _none, json=body)


def code_read_timeout(timeout: float | None) -> float | None:
    """Silence allowed on a run_code stream: the server sends keepalives every 15 s."""
    return None if timeout == 0 else (timeout or RUN_CODE_TIMEOUT) + STREAM_GRACE


def _context(r: httpx.Response) -> Context:
    return Context.from_json(r.json())


def create_code_context(sandbox_id: str, language: str, cwd: str | None) -> Call[Context]:
    body: dict[str, Any] = {"language": language}
    if cwd is not None:
        body["cwd"] = cwd
    return Call("POST", f"{_sbx(sandbox_id)}/code/contexts", _context, json=body)


def list_code_contexts(sandbox_id: str) -> Call[list[Context]]:
    def parse(r: httpx.Response) -> list[Context]:
        return [Context.from_json(c) for c in r.json().get("contexts", [])]

    return Call("GET", f"{_sbx(sandbox_id)}/code/contexts", parse)


def _context_id(context: Context | str) -> str:
    return _seg(context.id if isinstance(context, Context) else context)


def restart_code_context(sandbox_id: str, context: Context | str) -> Call[Context]:
    return Call("POST", f"{_sbx(sandbox_id)}/code/contexts/{_context_id(context)}/restart",
                _context)


def remove_code_context(sandbox_id: str, context: Context | str) -> Call[None]:
    return Call("DELETE", f"{_sbx(sandbox_id)}/code/contexts/{_context_id(context)}", _none)


class ExecutionBuilder:
    """Folds run_code's NDJSON events into an `Execution`, naming the callback each one is for.

    `feed` returns (callback name, argument) for the caller to invoke (on_stdout, on_stderr,
    on_result, on_error), or None."""

    def __init__(self) -> None:
        self.execution = Execution()
        self.ended = False

    def feed(self, event: dict[str, Any]) -> tuple[str, Any] | None:
        kind = event.get("type")
        ex = self.execution
        if kind in ("stdout", "stderr"):
            text = str(event.get("text", ""))
            getattr(ex.logs, kind).append(text)
            return f"on_{kind}", OutputMessage(text, event.get("timestamp"), kind == "stderr")
        if kind == "result":
            result = Result.from_json(event.get("result"))
            ex.results.append(result)
            return "on_result", result
        if kind == "error":
            raw = event.get("error")
            err: dict[str, Any] = raw if isinstance(raw, dict) else {}
            ex.error = ExecutionError(str(err.get("name", "")), str(err.get("value", "")),
                                      str(err.get("traceback", "")),
                                      Violation.from_json(event.get("violation")))
            return "on_error", ex.error
        if kind == "execution_count":
            ex.execution_count = event.get("execution_count")
        elif kind == "end":
            self.ended = True
            ex.timed_out = bool(event.get("timed_out"))
            if event.get("execution_count") is not None:
                ex.execution_count = event.get("execution_count")
        elif kind == "failed":
            self.ended = True
            why = {"violation": event["violation"]} if event.get("violation") else None
            raise error_from_code(str(event.get("code", "error")), str(event.get("message", "")),
                                  why)
        return None

    def result(self) -> Execution:
        if not self.ended:
            raise AgentboxError("the run_code stream ended before the execution did",
                                code=ErrorCode.STREAM_ENDED)
        return self.execution


# Templates and warm pools


def _template(r: httpx.Response) -> TemplateInfo:
    return TemplateInfo.from_json(r.json())


def list_templates() -> Call[tuple[list[TemplateInfo], list[str]]]:
    def parse(r: httpx.Response) -> tuple[list[TemplateInfo], list[str]]:
        body = r.json()
        return ([TemplateInfo.from_json(t) for t in body.get("templates", [])],
                [str(b) for b in body.get("builtin", [])])

    return Call("GET", "/v1/templates", parse)


def get_template(name: str) -> Call[TemplateInfo]:
    return Call("GET", f"/v1/templates/{_seg(name)}", _template)


def build_template(spec: str | None = None, builtin: str | None = None,
                   files: Mapping[str, bytes] | None = None) -> Call[None]:
    body: dict[str, Any] = {"spec": spec} if spec is not None else {"builtin": builtin}
    if files:
        body["files"] = {k: base64.b64encode(v).decode() for k, v in files.items()}
    return Call("POST", "/v1/templates", _none, json=body)


def spec_files(spec_text: str, spec_dir: str) -> dict[str, bytes]:
    """The files a spec names by `src` (relative to its directory), to send with it."""
    import tomllib
    from pathlib import Path

    try:
        entries = tomllib.loads(spec_text).get("files") or []
    except tomllib.TOMLDecodeError as e:
        raise InvalidArgumentError(f"the spec is not valid TOML: {e}",
                                   code=ErrorCode.INVALID_REQUEST) from None
    out: dict[str, bytes] = {}
    for entry in entries if isinstance(entries, list) else []:
        src = entry.get("src") if isinstance(entry, dict) else None
        if isinstance(src, str):
            try:
                out[src] = (Path(spec_dir) / src).read_bytes()
            except OSError as e:
                raise InvalidArgumentError(f"files: cannot read {src!r}: {e.strerror}",
                                           code=ErrorCode.INVALID_REQUEST) from None
    return out


def remove_template(name: str) -> Call[None]:
    return Call("DELETE", f"/v1/templates/{_seg(name)}", _none)


def list_pools() -> Call[list[PoolStats]]:
    def parse(r: httpx.Response) -> list[PoolStats]:
        return [PoolStats.from_json(p) for p in r.json().get("pools", [])]

    return Call("GET", "/v1/pools", parse)


def set_pool_size(template: str, size: int) -> Call[PoolStats]:
    return Call("PUT", f"/v1/pools/{_seg(template)}", lambda r: PoolStats.from_json(r.json()),
                json={"size": size})


# Kept workspaces


def _kept(workspace_id: str) -> str:
    return f"/v1/workspaces/{_seg(workspace_id)}"


def list_workspaces() -> Call[list[KeptWorkspace]]:
    def parse(r: httpx.Response) -> list[KeptWorkspace]:
        return [KeptWorkspace.from_json(w) for w in r.json().get("workspaces", [])]

    return Call("GET", "/v1/workspaces", parse)


def read_workspace_file(sandbox_id: str, path: str) -> Call[None]:
    """The answer is the raw file, read as a stream by the caller."""
    return Call("GET", f"{_kept(sandbox_id)}/files", _none, params=[("path", path)])


def workspace_archive(sandbox_id: str) -> Call[None]:
    """The answer is a tar stream of the whole workspace, read by the caller."""
    return Call("GET", f"{_kept(sandbox_id)}/archive", _none)


def remove_workspace(sandbox_id: str) -> Call[None]:
    return Call("DELETE", _kept(sandbox_id), _none)


# ---------------------------------------------------------------------------- volumes


def _volume(r: httpx.Response) -> VolumeInfo:
    return VolumeInfo.from_json(r.json())


def _vol(ref: str) -> str:
    return f"/v1/volumes/{_seg(ref)}"


def create_volume(name: str, size_mb: int,
                  metadata: Mapping[str, str] | None = None) -> Call[VolumeInfo]:
    body = {"name": name, "size_mb": size_mb, "metadata": dict(metadata or {})}
    return Call("POST", "/v1/volumes", _volume, json=body)


def list_volumes() -> Call[list[VolumeInfo]]:
    def parse(r: httpx.Response) -> list[VolumeInfo]:
        return [VolumeInfo.from_json(v) for v in r.json().get("volumes", [])]

    return Call("GET", "/v1/volumes", parse)


def get_volume(ref: str) -> Call[VolumeInfo]:
    """`ref`: a volume's id or name."""
    return Call("GET", _vol(ref), _volume)


def delete_volume(ref: str) -> Call[None]:
    return Call("DELETE", _vol(ref), _none)


def read_volume_file(ref: str, path: str) -> Call[bytes]:
    return Call("GET", f"{_vol(ref)}/files", lambda r: r.content, params=[("path", path)])


def write_volume_file(ref: str, path: str) -> Call[int]:
    """The body (the file's bytes) is supplied by the face that sends it."""
    return Call("PUT", f"{_vol(ref)}/files", lambda r: int(r.json().get("size", 0)),
                params=[("path", path)])


# ---------------------------------------------------------------------------- errors

_BY_STATUS: dict[int, type[AgentboxError]] = {
    400: InvalidArgumentError, 401: AuthenticationError, 403: AuthenticationError,
    404: NotFoundError, 408: SandboxTimeoutError, 409: ConflictError,
    413: InvalidArgumentError, 422: InvalidArgumentError, 429: QuotaExceededError,
    504: SandboxTimeoutError,
}

# For errors that arrive inside an NDJSON stream, where only the code is known.
_BY_CODE: dict[str, type[AgentboxError]] = {
    ErrorCode.UNAUTHORIZED: AuthenticationError,
    ErrorCode.FORBIDDEN: AuthenticationError,
    ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.PATH_NOT_FOUND: NotFoundError,
    ErrorCode.CONTEXT_NOT_FOUND: NotFoundError,
    ErrorCode.INVALID_REQUEST: InvalidArgumentError,
    ErrorCode.INVALID_PATH: InvalidArgumentError,
    ErrorCode.LIMIT_EXCEEDED: InvalidArgumentError,
    ErrorCode.UNSUPPORTED: InvalidArgumentError,
    ErrorCode.QUOTA_EXCEEDED: QuotaExceededError,
    ErrorCode.CONFLICT: ConflictError,
    ErrorCode.SANDBOX_NOT_RUNNING: ConflictError,
    ErrorCode.KERNEL_DEAD: ConflictError,
}


def error_from_response(response: httpx.Response) -> AgentboxError:
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "message" in body:
        code = str(body.get("code") or f"http_{status}")
        message = str(body["message"])
        detail = body.get("detail") if isinstance(body.get("detail"), dict) else {}
    else:
        code = f"http_{status}"
        message = response.text.strip()[:500] or response.reason_phrase or f"HTTP {status}"
        detail = {}
    cls = _BY_STATUS.get(status, AgentboxError)
    if status == 403 and code not in ("forbidden", "unauthorized"):
        # A 403 about the sandbox's policy (read_only_path, ...) is not a key problem.
        cls = InvalidArgumentError
    return cls(message, status=status, code=code, detail=detail)


def error_from_code(code: str, message: str, detail: dict[str, Any] | None = None,
                    ) -> AgentboxError:
    return _BY_CODE.get(code, AgentboxError)(message, code=code, detail=detail)


def transport_error(exc: httpx.HTTPError, api_url: str) -> AgentboxError:
    if isinstance(exc, httpx.TimeoutException):
        return SandboxTimeoutError(
            f"the agentbox server at {api_url} did not answer in time ({type(exc).__name__}); "
            "raise request_timeout or check the server", code=ErrorCode.REQUEST_TIMEOUT)
    return ConnectionFailedError(
        f"cannot talk to the agentbox server at {api_url}: {exc or type(exc).__name__}; "
        "is `agentbox serve` running and AGENTBOX_API_URL right?", code=ErrorCode.CONNECTION_FAILED)


def may_reconnect(exc: AgentboxError) -> bool:
    """Whether a command stream that failed this way is worth resuming from its offset.

    A dropped connection is, and so is `sandbox_unavailable` (the server lost its link to the
    in-sandbox agent; the command itself may still run). Silence past the grace is not.
    """
    return isinstance(exc, ConnectionFailedError) or exc.code == "sandbox_unavailable"


# ---------------------------------------------------------------------------- command streams


def parse_event_line(line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not line:
        return None
    try:
        event = json.loads(line)
    except ValueError:
        raise AgentboxError(f"malformed event from server: {line[:200]!r}",
                            code=ErrorCode.BAD_RESPONSE) from None
    return event if isinstance(event, dict) else None


class CommandProgress:
    """What is known of one command's output stream, across reconnects.

    `offset` is where a resumed `/events` stream must start: the byte offset just past the
    output already received. The server sends text decoded from UTF-8 and the offset of the raw
    chunk, so the next offset is counted from the text's UTF-8 length; for output that is not
    valid UTF-8 this is approximate (a resume may skip or repeat a few bytes).
    """

    def __init__(self, sandbox_id: str, cmd_id: str | None = None, pid: int | None = None,
                 cmd: str | None = None,
                 on_start: Callable[[str], Any] | None = None,
                 request_timeout: float | None = None, keep_output: bool = True) -> None:
        self.sandbox_id = sandbox_id
        # False: the output is delivered (callbacks, iteration) but not kept for the result.
        self.keep_output = keep_output
        self.request_timeout = request_timeout  # of the resumed streams too
        self.on_start = on_start
        self.cmd_id = cmd_id
        self.pid = pid
        self.cmd = cmd
        self.offset = 0
        self.dropped = 0
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.end: dict[str, Any] | None = None

    @property
    def done(self) -> bool:
        return self.end is not None

    def resume(self) -> Call[None]:
        if self.cmd_id is None:
            raise ConnectionFailedError("the command stream dropped before the command started",
                                        code=ErrorCode.CONNECTION_FAILED)
        return timed(command_events(self.sandbox_id, self.cmd_id, self.offset),
                     self.request_timeout)

    def feed(self, event: dict[str, Any]) -> tuple[str, str] | None:
        """Record one event; returns (stream, text) when it is output to deliver."""
        kind = event.get("type")
        if kind in ("stdout", "stderr"):
            data = str(event.get("data", ""))
            self.offset += len(data.encode("utf-8", "surrogatepass"))
            if self.keep_output:
                (self.stdout if kind == "stdout" else self.stderr).append(data)
            return kind, data
        if kind == "start":
            self.cmd_id = str(event.get("cmd_id")) if event.get("cmd_id") else self.cmd_id
            self.pid = event.get("pid", self.pid)
            if self.on_start is not None and self.cmd_id is not None:
                self.on_start(self.cmd_id)
        elif kind == "truncated":
            dropped = int(event.get("dropped") or 0)
            self.dropped += dropped
            self.offset += dropped
        elif kind == "end":
            self.end = event
        elif kind == "error":
            raise error_from_code(str(event.get("code") or "error"),
                                  str(event.get("message") or "command stream failed"),
                                  event.get("detail") if isinstance(event.get("detail"), dict)
                                  else None)
        # Unknown event types are skipped so newer servers stay readable.
        return None

    def result(self) -> CommandResult:
        end = self.end or {}
        exit_code = end.get("exit_code")
        violation = Violation.from_json(end.get("violation"))
        timed_out = bool(end.get("timed_out"))
        error = None
        if exit_code != 0 or timed_out:
            error = _failure_text(exit_code, timed_out, violation)
        return CommandResult(stdout="".join(self.stdout), stderr="".join(self.stderr),
                             exit_code=exit_code, error=error, timed_out=timed_out,
                             violation=violation, cmd_id=self.cmd_id,
                             network_blocked=BlockedAttempt.list_from_json(
                                 end.get("network_blocked")), dropped_bytes=self.dropped)

    def outcome(self) -> CommandResult:
        """The result, or CommandExitException when the command did not exit 0."""
        result = self.result()
        if result.exit_code == 0 and not result.timed_out:
            return result
        message = result.error or "command failed"
        # What a tool wrapper printing str(e) must show: the failing assertion, the traceback.
        for name, text in (("stderr", result.stderr), ("stdout", result.stdout)):
            if text.strip():
                message += f"\n{name} (last lines):\n{output_tail(text)}"
                break
        cls = CommandTimeoutError if result.timed_out else CommandExitException
        raise cls(message, stdout=result.stdout, stderr=result.stderr,
                  exit_code=result.exit_code, error=result.error, timed_out=result.timed_out,
                  violation=result.violation, cmd_id=result.cmd_id,
                  code=ErrorCode.COMMAND_TIMEOUT if result.timed_out else ErrorCode.COMMAND_EXIT,
                  network_blocked=result.network_blocked, dropped_bytes=result.dropped_bytes)


TAIL_LINES, TAIL_CHARS = 20, 2000


def output_tail(text: str) -> str:
    """The last TAIL_LINES lines of a command's output, at most TAIL_CHARS characters."""
    tail = "\n".join(text.rstrip().splitlines()[-TAIL_LINES:])
    return tail if len(tail) <= TAIL_CHARS else "…" + tail[-TAIL_CHARS:]


def _failure_text(exit_code: int | None, timed_out: bool, violation: Violation | None) -> str:
    if timed_out:
        text = "command timed out"
    elif exit_code is None:
        text = "command ended without an exit code"
    elif exit_code < 0:
        text = f"command was killed by signal {-exit_code}"
    else:
        text = f"command exited with code {exit_code}"
    if violation is not None and violation.message:
        text += f": {violation.message}"
    return text


def command_read_timeout(timeout: float) -> float | None:
    """Silence allowed on a foreground stream: the command's timeout plus grace, 0 = forever."""
    return None if not timeout else timeout + STREAM_GRACE


def reconnect_delay(attempt: int) -> float:
    return min(0.1 * (2 ** attempt), 2.0)


def upload_parts(data: str | bytes) -> bytes:
    return data.encode("utf-8") if isinstance(data, str) else bytes(data)


def decode_text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


class CommandHandleBase:
    """What both command-handle faces expose about a background command's progress."""

    _progress: CommandProgress

    @property
    def cmd_id(self) -> str:
        return str(self._progress.cmd_id)

    @property
    def pid(self) -> int | None:
        return self._progress.pid

    @property
    def stdout(self) -> str:
        """Output received so far."""
        return "".join(self._progress.stdout)

    @property
    def stderr(self) -> str:
        return "".join(self._progress.stderr)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cmd_id={self.cmd_id!r}, pid={self.pid!r})"
