"""Request and response models of the HTTP API (pydantic, at the edge only)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentbox.core import ports
from agentbox.runtimes.base import ISOLATION_RANKS
from agentbox.store.db import SandboxRow


def rfc3339(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def text(s: str) -> str:
    """A sandbox-made string (a file name is bytes) as valid UTF-8: invalid bytes become U+FFFD.

    The agent hands non-UTF-8 names over as surrogate escapes, which no JSON encoder takes.
    """
    try:
        return s.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate that is no escaped byte
        return s.encode("utf-8", "replace").decode("utf-8")


def clean(value: Any) -> Any:
    """`text()` applied to every string in a JSON-like value."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, dict):
        return {text(str(k)): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return value


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResourcesBody(Strict):
    cpu_count: float | None = Field(None, gt=0, le=1024)
    memory_mb: int | None = Field(None, gt=0, le=1 << 30)
    pids: int | None = Field(None, gt=0, le=1 << 22)
    nofile: int | None = Field(None, gt=0, le=1 << 20)
    file_size_mb: int | None = Field(None, gt=0, le=1 << 30)
    disk_mb: int | None = Field(None, gt=0, le=1 << 30)
    tmp_mb: int | None = Field(None, gt=0, le=1 << 20)


class NetworkBody(Strict):
    """A sandbox's network settings (E2B's names). Egress is off unless allowed here."""

    allow_out: list[Annotated[str, Field(max_length=300)]] = Field(
        default_factory=list,
        max_length=256,
        description="hosts the sandbox may reach: example.com, *.example.com, host:port, "
        "IP or CIDR",
    )
    deny_out: list[Annotated[str, Field(max_length=300)]] = Field(
        default_factory=list, max_length=256, description="refused even if allowed (deny wins)"
    )
    allow_internet_access: bool = Field(
        False, description="allow every public destination not denied"
    )
    allow_public_traffic: bool = Field(False, description="exposed ports need no access token")


RuntimeName = Annotated[str, Field(max_length=32, pattern=r"^[a-z][a-z0-9_-]*$")]
Isolation = Literal["process", "container", "gvisor"]


class VolumeMountBody(Strict):
    volume: str = Field(max_length=128, description="the volume's name or id")
    read_only: bool = False


class CreateSandboxBody(Strict):
    template: str | None = Field(
        None,
        max_length=128,
        description="a built or shipped template, or `host` (the host's userland, read-only); "
        "null or `default`: the server's default template (`base` unless the server says "
        "otherwise: /v1/health `default_template`)",
    )
    timeout: float = Field(300, gt=0, le=10**9, description="seconds until the sandbox is killed")
    metadata: dict[str, str] = Field(default_factory=dict)
    envs: dict[str, str] = Field(default_factory=dict)
    resources: ResourcesBody = Field(default_factory=ResourcesBody)  # type: ignore[arg-type]
    keep_workspace: bool = False
    network: NetworkBody | None = Field(
        None, description="egress policy and port access; default: the tenant's default"
    )
    allow_internet_access: bool | None = Field(
        None, description="shorthand for network.allow_internet_access (E2B)"
    )
    lifecycle: LifecycleBody | None = Field(
        None, description="what its timeout does, and whether requests wake it when paused"
    )
    secrets: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list,
        max_length=64,
        description="names of the tenant's secrets; the sandbox sees only placeholders",
    )
    runtime: RuntimeName | None = Field(
        None,
        description="the isolation runtime (GET /v1/health lists those served); default: the "
        "tenant's default_runtime, else the server's",
    )
    isolation: Isolation | None = Field(
        None,
        description="the isolation tier: process, container or gvisor (another name for "
        "`runtime`, limited to the tiers)",
    )
    volume_mounts: dict[
        Annotated[str, Field(max_length=1024)],
        Annotated[str, Field(max_length=128)] | VolumeMountBody,
    ] = Field(
        default_factory=dict,
        max_length=8,
        description="{path in the sandbox: volume name or id, or {volume, read_only}}",
    )

    @model_validator(mode="after")
    def _one_runtime(self) -> CreateSandboxBody:
        if self.isolation is not None and self.runtime not in (None, self.isolation):
            raise ValueError(
                f"runtime {self.runtime!r} and isolation {self.isolation!r} disagree; give one"
            )
        return self


class SecretBody(Strict):
    value: str = Field(min_length=1, max_length=65536)
    hosts: list[Annotated[str, Field(max_length=300)]] = Field(min_length=1, max_length=64)
    in_url: bool = Field(False, description="also swap the placeholder in request URLs")
    headers: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=lambda: ["Authorization"],
        min_length=1,
        max_length=16,
        description="the only request headers the value goes in (Basic credentials included)",
    )
    allow_plaintext: bool = Field(
        False, description="also send the value over plain http:// (default: verified TLS only)"
    )


class TenantNetworkBody(Strict):
    default: NetworkBody | None = None
    ceiling: NetworkBody | None = None


class PortUrlBody(Strict):
    port: int = Field(ge=1, le=65535)
    expires_in: float | None = Field(
        None,
        gt=0,
        le=ports.MAX_LIFETIME,
        description=f"seconds (default {ports.DEFAULT_LIFETIME}, at most {ports.MAX_LIFETIME}); "
        "rotating the sandbox's access token revokes the URL sooner",
    )
    path: str = Field("/", max_length=4096)
    routing: Literal["path", "host"] = "path"


class TimeoutBody(Strict):
    timeout: float = Field(gt=0, le=10**9)


class LifecycleBody(Strict):
    on_timeout: Literal["kill", "pause"] = Field(
        "kill", description="at its timeout the sandbox is killed, or paused (resumable)"
    )
    auto_resume: bool = Field(
        False,
        description="a paused sandbox is resumed by the next request to it (its commands, "
        "files, code, or its exposed ports with credentials) instead of answering `paused`",
    )


class PauseBody(Strict):
    keep_memory: bool = Field(
        default=True,
        description="keep its processes and their memory (frozen); false: its processes "
        "end, its disk (workspace and root) is kept, and a resume boots it fresh on it",
    )


class ResumeBody(Strict):
    timeout: float | None = Field(
        default=None,
        gt=0,
        le=10**9,
        description="seconds to run on for, if longer than the time it had left at the pause",
    )


class SandboxInfo(BaseModel):
    sandbox_id: str
    tenant: str
    template: str
    runtime: str
    isolation: str | None = None  # its tier, when its runtime is one
    state: str
    metadata: dict[str, str]
    created_at: str
    end_at: str
    ended_at: str | None
    end_reason: str | None
    resources: dict[str, Any]
    keep_workspace: bool
    network: dict[str, Any] | None = None
    secrets: list[str] = []
    access_token: str | None = None
    domain: str | None = None
    # Why it failed after the create answered; how far the build a `building` one waits for got.
    error: str | None = None
    build: dict[str, Any] | None = None
    # While paused: since when, and the seconds of its timeout it will have on resume (end_at
    # is then when the paused sandbox itself ends, its retention).
    paused_at: str | None = None
    timeout_left: float | None = None
    lifecycle: dict[str, Any] | None = None
    # Where its disk came from, when not fresh: {"snapshot": id} or {"fork_of": sandbox id}.
    origin: dict[str, str] | None = None
    # The volumes it mounts: [{"volume_id", "path", "read_only"}].
    volume_mounts: list[dict[str, Any]] = []

    @classmethod
    def of(
        cls, row: SandboxRow, domain: str | None = None, build: dict[str, Any] | None = None
    ) -> SandboxInfo:
        return cls(
            error=row.error,
            build=build,
            network=row.network,
            secrets=sorted(row.secrets or {}),
            # `unhealthy` is a live sandbox whose agent is silent (never a stored state).
            access_token=row.access_token if row.live or row.state == "unhealthy" else None,
            domain=domain,
            sandbox_id=row.sandbox_id,
            tenant=row.tenant,
            template=row.template,
            runtime=row.runtime,
            isolation=row.runtime if row.runtime in ISOLATION_RANKS else None,
            state=row.state,
            metadata=row.metadata,
            created_at=rfc3339(row.created_at) or "",
            end_at=rfc3339(row.end_at) or "",
            ended_at=rfc3339(row.ended_at),
            end_reason=row.end_reason,
            resources=row.resources,
            keep_workspace=row.keep_workspace,
            paused_at=rfc3339(row.paused_at),
            timeout_left=row.ttl_left if row.state == "paused" else None,
            lifecycle=_lifecycle(row.lifecycle),
            origin=row.origin,
            volume_mounts=list(row.volumes or []),
        )


def _lifecycle(stored: dict[str, Any] | None) -> dict[str, Any]:
    stored = stored or {}
    return {
        "on_timeout": stored.get("on_timeout", "kill"),
        "auto_resume": bool(stored.get("auto_resume", False)),
    }


class SandboxList(BaseModel):
    sandboxes: list[SandboxInfo]
    next_token: str | None


SandboxUser = Literal["user", "root"]
USER_DOC = (
    'who acts: "user" (uid 1000) or the sandbox\'s "root"; default the template\'s user'
)


class TerminalSize(Strict):
    cols: int = Field(ge=1, le=4096)
    rows: int = Field(ge=1, le=4096)


class CommandBody(Strict):
    cmd: str = Field(min_length=1, max_length=1 << 20)
    cwd: str | None = Field(None, max_length=4096)
    user: SandboxUser | None = Field(None, description=USER_DOC)
    envs: dict[str, str] = Field(default_factory=dict)
    timeout: float = Field(60, ge=0, le=10**9, description="seconds; 0 = no timeout")
    background: bool = False
    stdin: bool = False
    pty: TerminalSize | None = Field(
        None,
        description="run on a terminal of its own (/dev/pts/N, its controlling terminal) of "
        "this size: its output (one stream, stdout) and input are the terminal's; resize it "
        "with .../resize, or attach to it over the WebSocket .../terminal",
    )


class CommandInfo(BaseModel):
    cmd_id: str
    pid: int
    cmd: str
    cwd: str
    user: str
    running: bool
    exit_code: int | None
    timed_out: bool
    started_at: str | None
    ended_at: str | None

    @classmethod
    def of(cls, info: dict[str, Any]) -> CommandInfo:
        return cls(
            cmd_id=str(info.get("cmd_id")),
            pid=int(info.get("pid") or 0),
            cmd=str(info.get("cmd", "")),
            cwd=str(info.get("cwd", "")),
            user=str(info.get("user", "user")),
            running=bool(info.get("running")),
            exit_code=info.get("exit_code"),
            timed_out=bool(info.get("timed_out")),
            started_at=rfc3339(info.get("started_at")),
            ended_at=rfc3339(info.get("ended_at")),
        )


class CommandList(BaseModel):
    commands: list[CommandInfo]


class StdinBody(Strict):
    data: str = Field("", max_length=1 << 20)
    eof: bool = False


class SignalBody(Strict):
    signal: str | int = "SIGKILL"


class EntryInfo(BaseModel):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    permissions: str
    modified_time: str | None
    symlink_target: str | None = None

    @classmethod
    def of(cls, e: dict[str, Any]) -> EntryInfo:
        target = e.get("symlink_target")
        return cls(
            name=text(e["name"]),
            path=text(e["path"]),
            type=e["type"],
            size=e["size"],
            mode=e["mode"],
            permissions=e["permissions"],
            modified_time=rfc3339(e.get("modified_time")),
            symlink_target=None if target is None else text(target),
        )


class EntryList(BaseModel):
    entries: list[EntryInfo]
    # True when the listing stopped at its limit: ask again with cursor=next_cursor for more.
    truncated: bool = False
    next_cursor: str | None = None


class PathBody(Strict):
    path: str = Field(max_length=8192)
    user: SandboxUser | None = Field(None, description=USER_DOC)


class RenameBody(Strict):
    src: str = Field(max_length=8192)
    dst: str = Field(max_length=8192)
    user: SandboxUser | None = Field(None, description=USER_DOC)


class KeyBody(Strict):
    tenant: str = Field(min_length=1, max_length=64)
    admin: bool = False


class KeyCreated(BaseModel):
    key_id: str
    key: str
    tenant: str
    admin: bool


class QuotaBody(Strict):
    # Bounded like the resources they cap (and finite: a JSON 1e999 is infinity, which no
    # answer could carry back).
    max_sandboxes: int | None = Field(None, ge=0, le=100_000)
    max_memory_mb: int | None = Field(None, gt=0, le=1 << 30)
    max_cpu_count: float | None = Field(None, gt=0, le=1024)
    max_timeout: float | None = Field(None, gt=0, le=10**9)
    max_disk_mb: int | None = Field(None, gt=0, le=1 << 30)
    max_pids: int | None = Field(None, gt=0, le=1 << 22)
    max_nofile: int | None = Field(None, gt=0, le=1 << 20)
    max_file_size_mb: int | None = Field(None, gt=0, le=1 << 30)
    max_tmp_mb: int | None = Field(None, gt=0, le=1 << 20)
    max_descriptors: int | None = Field(
        None, gt=0, le=1 << 42, description="pids × nofile of one sandbox"
    )
    max_total_descriptors: int | None = Field(
        None, gt=0, le=1 << 62, description="pids × nofile summed over live sandboxes"
    )
    max_total_disk_mb: int | None = Field(
        None, gt=0, le=1 << 40, description="live and kept workspaces and snapshots, by real usage"
    )
    max_snapshots: int | None = Field(None, ge=0, le=100_000)
    max_paused: int | None = Field(None, ge=0, le=100_000, description="paused sandboxes")
    max_volumes: int | None = Field(None, ge=0, le=100_000)
    default_runtime: RuntimeName | None = Field(
        None, description="the runtime of its sandboxes that name none (default: the server's)"
    )
    runtimes: list[RuntimeName] | None = Field(
        None, max_length=16, description="the runtimes its sandboxes may use (default: all)"
    )
    min_isolation: Isolation | None = Field(
        None,
        description="the weakest isolation tier its sandboxes may run on (process < container "
        "< gvisor); a create asking for a weaker one is refused, one asking for none gets the "
        "weakest served tier that meets it",
    )


class ErrorBody(BaseModel):
    code: str
    message: str
    detail: dict[str, Any] = Field(default_factory=dict)


# ---------------------------------------------------------------------- code interpreter

Language = Literal["python", "bash", "javascript", "typescript", "r"]


class CodeBody(Strict):
    code: str = Field(..., max_length=4 << 20)
    language: Language | None = Field(None, description="default python; not with context_id")
    context_id: str | None = Field(None, max_length=64)
    envs: dict[str, str] = Field(default_factory=dict)
    timeout: float | None = Field(None, ge=0, le=86_400, description="seconds; 0 = none")


class ContextBody(Strict):
    language: Language = "python"
    cwd: str | None = Field(None, max_length=4096)


class CodeContext(BaseModel):
    id: str
    language: str
    cwd: str | None = None
    default: bool = False

    @classmethod
    def of(cls, c: Any) -> CodeContext:
        if not isinstance(c, dict):
            raise ValueError("bad context from the sandbox")
        return cls(
            id=str(c.get("id")),
            language=str(c.get("language")),
            cwd=None if c.get("cwd") is None else text(str(c["cwd"])),
            default=bool(c.get("default")),
        )


class CodeContextList(BaseModel):
    contexts: list[CodeContext]


# ---------------------------------------------------------------------- templates and pools


class TemplateBuildBody(Strict):
    spec: str | None = Field(
        None, max_length=1 << 20, description="the spec file's TOML text (files inline)"
    )
    builtin: str | None = Field(
        None, max_length=64, description="build a shipped spec by name, e.g. code-interpreter"
    )
    files: dict[str, str] = Field(
        default_factory=dict,
        description="contents (base64) of the files the spec names by `src`, by that path",
    )


class TemplateInfo(BaseModel):
    name: str
    key: str
    size_bytes: int
    built_at: str | None
    env: dict[str, str]
    workdir: str
    user: str
    start_cmd: str | None = None
    ready_cmd: str | None = None
    warm: list[str] = Field(default_factory=list)
    # The start-up check: {"status": "ok" | "failed" | "checking", "error"}; None: not checked.
    check: dict[str, Any] | None = None

    @classmethod
    def of(cls, t: Any, check: Any = None) -> TemplateInfo:
        return cls(
            check={"status": check.status, "error": check.error} if check else None,
            name=t.name,
            key=t.key,
            size_bytes=t.size_bytes,
            built_at=rfc3339(t.built_at),
            env=dict(t.env),
            workdir=t.workdir,
            user=t.user,
            start_cmd=t.start_cmd,
            ready_cmd=t.ready_cmd,
            warm=list(t.warm),
        )


class TemplateList(BaseModel):
    templates: list[TemplateInfo]
    builtin: list[str] = Field(description="shipped specs that build on first use")


class PoolBody(Strict):
    size: int = Field(..., ge=0, le=64)


class PoolStats(BaseModel):
    template: str  # the pool's name: its template, `@RUNTIME` unless the server's default
    runtime: str | None = None  # None: the server's default runtime
    size: int
    ready: int
    starting: int
    hits: int
    misses: int
    failures: int
    last_error: str | None
    refills: int
    refill_ms_p50: float | None
    refill_ms_max: float | None
    refill_ms_last: float | None


class PoolList(BaseModel):
    pools: list[PoolStats]


# ---------------------------------------------------------------------- kept workspaces


class SnapshotBody(Strict):
    name: str | None = Field(
        None,
        max_length=64,
        description="a name to start sandboxes from it by (template=<name>), unique per tenant",
    )
    metadata: dict[str, str] = Field(default_factory=dict)


class SnapshotInfo(BaseModel):
    snapshot_id: str
    name: str | None
    sandbox_id: str = Field(description="the sandbox it was taken of")
    template: str
    runtime: str
    created_at: str
    disk_mb: int = Field(description="its disk's size: the least a sandbox from it gets")
    used_bytes: int = Field(description="what it really takes on the server's disk")
    metadata: dict[str, str]

    @classmethod
    def of(cls, s: Any) -> SnapshotInfo:
        return cls(
            snapshot_id=s.snapshot_id,
            name=s.name,
            sandbox_id=s.sandbox_id,
            template=s.template,
            runtime=s.runtime,
            created_at=rfc3339(s.created_at) or "",
            disk_mb=s.disk_mb,
            used_bytes=s.used_bytes,
            metadata=s.metadata,
        )


class SnapshotList(BaseModel):
    snapshots: list[SnapshotInfo]


class ForkBody(Strict):
    count: int = Field(1, ge=1, le=16, description="how many children")
    timeout: float | None = Field(
        None, gt=0, description="each child's timeout in seconds (default: the parent's)"
    )


class ForkResult(BaseModel):
    sandboxes: list[SandboxInfo]


class VolumeBody(Strict):
    name: str = Field(max_length=64, description="unique in the tenant")
    size_mb: int = Field(gt=0, le=1 << 30, description="its size: what it can hold")
    metadata: dict[str, str] = Field(default_factory=dict)


class VolumeInfo(BaseModel):
    volume_id: str
    name: str
    size_mb: int
    used_bytes: int = Field(description="what it really takes on the server's disk")
    created_at: str
    metadata: dict[str, str]
    mounted_by: list[dict[str, Any]] = Field(
        description="the live sandboxes that mount it: [{sandbox_id, path, read_only}]"
    )


class VolumeList(BaseModel):
    volumes: list[VolumeInfo]


class KeptWorkspaceInfo(BaseModel):
    sandbox_id: str
    template: str
    metadata: dict[str, str]
    used_bytes: int = Field(description="what it really takes on the server's disk")
    kept_at: str
    expires_at: str

    @classmethod
    def of(cls, k: Any) -> KeptWorkspaceInfo:
        return cls(
            sandbox_id=k.sandbox_id,
            template=k.template,
            metadata=k.metadata,
            used_bytes=k.used_bytes,
            kept_at=rfc3339(k.kept_at) or "",
            expires_at=rfc3339(k.expires_at) or "",
        )


class KeptWorkspaceList(BaseModel):
    workspaces: list[KeptWorkspaceInfo]
