"""Typed results the SDK hands to users, built from the server's JSON (no raw dicts leak out)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any


def _time(value: Any) -> datetime | None:
    """RFC 3339 strings from the server; None and empty strings stay None."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return None


@dataclass(frozen=True)
class Violation:
    """Why the sandbox blocked something, and which setting to change to allow it."""

    code: str
    setting: str | None
    message: str

    @classmethod
    def from_json(cls, data: Any) -> Violation | None:
        if not isinstance(data, dict):
            return None
        return cls(code=str(data.get("code", "")), setting=data.get("setting"),
                   message=str(data.get("message", "")))


@dataclass(frozen=True)
class Resources:
    """Resource limits of a sandbox. On create, fields left None take the server's defaults."""

    cpu_count: float | None = None
    memory_mb: int | None = None
    pids: int | None = None
    nofile: int | None = None
    file_size_mb: int | None = None
    disk_mb: int | None = None
    tmp_mb: int | None = None

    @classmethod
    def from_json(cls, data: Any) -> Resources:
        data = data if isinstance(data, dict) else {}
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _strings(value: Any) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []


@dataclass(frozen=True)
class NetworkInfo:
    """A sandbox's network policy (E2B's names). Egress is refused unless allowed here.

    `allow_out` and `deny_out` hold hosts (example.com, *.example.com, host:port), IPs or CIDRs;
    deny wins. `allow_public_traffic` makes exposed ports reachable without the access token."""

    allow_out: list[str] = field(default_factory=list)
    deny_out: list[str] = field(default_factory=list)
    allow_internet_access: bool = False
    allow_public_traffic: bool = False

    @classmethod
    def from_json(cls, data: Any) -> NetworkInfo | None:
        if not isinstance(data, dict):
            return None
        return cls(allow_out=_strings(data.get("allow_out")),
                   deny_out=_strings(data.get("deny_out")),
                   allow_internet_access=bool(data.get("allow_internet_access")),
                   allow_public_traffic=bool(data.get("allow_public_traffic")))

    def to_json(self) -> dict[str, Any]:
        return {"allow_out": list(self.allow_out), "deny_out": list(self.deny_out),
                "allow_internet_access": self.allow_internet_access,
                "allow_public_traffic": self.allow_public_traffic}


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as the server sees it. `network` is None when the server did not say;
    `access_token` (None once the sandbox ended) opens its private exposed ports, and `domain`
    is where they are host-routed: {port}-{sandbox_id}.{domain}."""

    sandbox_id: str
    tenant: str
    template: str
    state: str
    metadata: dict[str, str]
    created_at: datetime | None
    end_at: datetime | None
    ended_at: datetime | None
    end_reason: str | None
    resources: Resources
    keep_workspace: bool
    network: NetworkInfo | None = None
    secrets: list[str] = field(default_factory=list)
    # Out of repr: an info printed to a log must not hand out access to the sandbox's ports.
    access_token: str | None = field(default=None, repr=False)
    domain: str | None = None
    # Why it failed after the create answered; while `building`, how far its template's build got.
    error: str | None = None
    build: BuildProgress | None = None
    runtime: str = ""  # the isolation runtime it runs on
    isolation: str | None = None  # its tier (process, container, gvisor), when it is one
    # While paused: since when, and the seconds it will run on for once resumed (`end_at` is
    # then when the paused sandbox itself ends).
    paused_at: datetime | None = None
    timeout_left: float | None = None
    lifecycle: dict[str, Any] = field(default_factory=dict)  # on_timeout, auto_resume
    # Where its disk came from, when not fresh: {"snapshot": id} or {"fork_of": sandbox id}.
    origin: dict[str, str] | None = None
    # The volumes it mounts: [{"volume_id", "path", "read_only"}].
    volume_mounts: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SandboxInfo:
        return cls(
            error=data.get("error") or None, build=BuildProgress.from_json(data.get("build")),
            sandbox_id=str(data["sandbox_id"]), tenant=str(data.get("tenant", "")),
            template=str(data.get("template", "")), state=str(data.get("state", "")),
            metadata=dict(data.get("metadata") or {}), created_at=_time(data.get("created_at")),
            end_at=_time(data.get("end_at")), ended_at=_time(data.get("ended_at")),
            end_reason=data.get("end_reason"), resources=Resources.from_json(data.get("resources")),
            keep_workspace=bool(data.get("keep_workspace")),
            network=NetworkInfo.from_json(data.get("network")),
            secrets=_strings(data.get("secrets")), access_token=data.get("access_token") or None,
            domain=data.get("domain") or None, runtime=str(data.get("runtime") or ""),
            isolation=data.get("isolation") or None, paused_at=_time(data.get("paused_at")),
            timeout_left=data.get("timeout_left"), lifecycle=dict(data.get("lifecycle") or {}),
            origin=dict(data["origin"]) if isinstance(data.get("origin"), dict) else None,
            volume_mounts=[dict(m) for m in data.get("volume_mounts") or [] if isinstance(m, dict)],
        )


@dataclass(frozen=True)
class SnapshotInfo:
    """A copy of a sandbox's disk (root layer and workspace). Start sandboxes from it with
    `template=` its `snapshot_id` or `name`; each gets at least `disk_mb` of disk. `used_bytes`
    is what it really takes on the server's disk."""

    snapshot_id: str
    name: str | None
    sandbox_id: str  # the sandbox it was taken of
    template: str
    runtime: str
    created_at: datetime | None
    disk_mb: int
    used_bytes: int
    metadata: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any) -> SnapshotInfo:
        data = data if isinstance(data, dict) else {}
        return cls(snapshot_id=str(data.get("snapshot_id", "")), name=data.get("name") or None,
                   sandbox_id=str(data.get("sandbox_id", "")),
                   template=str(data.get("template", "")), runtime=str(data.get("runtime", "")),
                   created_at=_time(data.get("created_at")),
                   disk_mb=int(data.get("disk_mb") or 0),
                   used_bytes=int(data.get("used_bytes") or 0),
                   metadata=dict(data.get("metadata") or {}))


@dataclass(frozen=True)
class VolumeInfo:
    """A named filesystem of your tenant that outlives sandboxes (`size_mb` is what it can
    hold; `used_bytes` what it takes on the server's disk); `mounted_by` lists the live
    sandboxes that mount it: [{"sandbox_id", "path", "read_only"}]."""

    volume_id: str
    name: str
    size_mb: int
    used_bytes: int
    created_at: datetime | None
    metadata: dict[str, str] = field(default_factory=dict)
    mounted_by: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: Any) -> VolumeInfo:
        data = data if isinstance(data, dict) else {}
        return cls(volume_id=str(data.get("volume_id", "")), name=str(data.get("name", "")),
                   size_mb=int(data.get("size_mb") or 0),
                   used_bytes=int(data.get("used_bytes") or 0),
                   created_at=_time(data.get("created_at")),
                   metadata=dict(data.get("metadata") or {}),
                   mounted_by=[dict(m) for m in data.get("mounted_by") or []
                               if isinstance(m, dict)])


@dataclass(frozen=True)
class SandboxMetrics:
    """One sample of a sandbox's use (E2B's fields): `cpu_used_pct` of its `cpu_count` CPUs
    since the sample before, memory and disk in bytes."""

    timestamp: datetime | None
    cpu_count: float
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    disk_used: int
    disk_total: int

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SandboxMetrics:
        at = data.get("timestamp")
        return cls(
            timestamp=datetime.fromtimestamp(float(at), UTC) if at is not None else None,
            cpu_count=float(data.get("cpu_count") or 0),
            cpu_used_pct=float(data.get("cpu_used_pct") or 0),
            mem_used=int(data.get("mem_used") or 0), mem_total=int(data.get("mem_total") or 0),
            disk_used=int(data.get("disk_used") or 0), disk_total=int(data.get("disk_total") or 0),
        )


@dataclass(frozen=True)
class BuildProgress:
    """A `building` sandbox waits for the first-use build of its template: how far it got."""

    template: str
    step: int | None = None
    steps: int | None = None
    step_name: str | None = None
    seconds: float | None = None

    @classmethod
    def from_json(cls, data: Any) -> BuildProgress | None:
        if not isinstance(data, dict):
            return None
        return cls(template=str(data.get("template", "")), step=data.get("step"),
                   steps=data.get("steps"), step_name=data.get("step_name"),
                   seconds=data.get("seconds"))

    def __str__(self) -> str:
        where = f": step {self.step}/{self.steps} ({self.step_name})" if self.step else ""
        took = f", {self.seconds:.0f} s" if self.seconds is not None else ""
        return f"building template {self.template}{where}{took}"


@dataclass(frozen=True)
class BlockedAttempt:
    """A connection the egress proxy refused while a command ran, and the rule that did."""

    host: str
    port: int | None
    protocol: str
    rule: str | None
    message: str

    @classmethod
    def list_from_json(cls, data: Any) -> list[BlockedAttempt]:
        return [cls(host=str(d.get("host", "")), port=d.get("port"),
                    protocol=str(d.get("protocol", "")), rule=d.get("rule"),
                    message=str(d.get("message", "")))
                for d in (data if isinstance(data, list) else []) if isinstance(d, dict)]


@dataclass(frozen=True)
class CommandResult:
    """How a command ended. `exit_code` is -N when it died of signal N, None when unknown."""

    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None = None
    timed_out: bool = False
    violation: Violation | None = None
    cmd_id: str | None = None
    # Egress attempts the proxy refused while the command ran (whatever its exit code).
    network_blocked: list[BlockedAttempt] = field(default_factory=list)
    # Output nobody was attached for went past the sandbox's buffer: this many of its oldest
    # bytes are missing from stdout/stderr (never while a client follows the command).
    dropped_bytes: int = 0

    @property
    def truncated(self) -> bool:
        return self.dropped_bytes > 0


@dataclass(frozen=True)
class CommandInfo:
    cmd_id: str
    pid: int
    cmd: str
    cwd: str
    running: bool
    exit_code: int | None
    timed_out: bool
    started_at: datetime | None
    ended_at: datetime | None
    user: str = "user"  # who runs it: "user" or "root"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CommandInfo:
        return cls(
            cmd_id=str(data["cmd_id"]), pid=int(data.get("pid") or 0),
            cmd=str(data.get("cmd", "")), cwd=str(data.get("cwd", "")),
            running=bool(data.get("running")), exit_code=data.get("exit_code"),
            timed_out=bool(data.get("timed_out")), started_at=_time(data.get("started_at")),
            ended_at=_time(data.get("ended_at")), user=str(data.get("user") or "user"),
        )


@dataclass(frozen=True)
class EntryInfo:
    """A file system entry inside a sandbox. `type` is file, dir, symlink or other."""

    name: str
    path: str
    type: str
    size: int
    mode: int
    permissions: str
    modified_time: datetime | None
    symlink_target: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EntryInfo:
        return cls(
            name=str(data.get("name", "")), path=str(data.get("path", "")),
            type=str(data.get("type", "other")), size=int(data.get("size") or 0),
            mode=int(data.get("mode") or 0), permissions=str(data.get("permissions", "")),
            modified_time=_time(data.get("modified_time")),
            symlink_target=data.get("symlink_target"),
        )


@dataclass(frozen=True)
class FilesystemEvent:
    """A change in a watched directory: `name` relative to it, `type` create, write, remove,
    rename (the old name; the new one comes as create) or chmod."""

    name: str
    type: str

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FilesystemEvent:
        return cls(name=str(data.get("name", "")), type=str(data.get("op", "")))


class EntryList(list[EntryInfo]):
    """A page of a directory listing: a list of entries that also says whether the listing
    stopped at its limit. When `truncated`, ask for the rest with `cursor=next_cursor`."""

    truncated: bool = False
    next_cursor: str | None = None

    def __init__(self, entries: Iterable[EntryInfo] = (), truncated: bool = False,
                 next_cursor: str | None = None) -> None:
        super().__init__(entries)
        self.truncated = truncated
        self.next_cursor = next_cursor

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EntryList:
        return cls((EntryInfo.from_json(e) for e in data.get("entries", [])),
                   truncated=bool(data.get("truncated")), next_cursor=data.get("next_cursor"))


@dataclass(frozen=True)
class KeyInfo:
    """An API key. `key` (the secret itself) is set only on the answer to its creation."""

    key_id: str
    tenant: str
    admin: bool
    created_at: datetime | None = None
    key: str | None = field(default=None, repr=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KeyInfo:
        created = data.get("created_at")
        return cls(
            key_id=str(data.get("key_id", "")), tenant=str(data.get("tenant", "")),
            admin=bool(data.get("admin")), key=data.get("key") or None,
            # The server gave unix seconds here before RFC 3339.
            created_at=datetime.fromtimestamp(created, UTC)
            if isinstance(created, int | float) else _time(created),
        )


@dataclass(frozen=True)
class AuditEvent:
    id: int | str
    time: datetime | None
    tenant: str
    key_id: str | None
    action: str
    sandbox_id: str | None
    status: int | None
    duration_ms: float | None
    detail: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AuditEvent:
        return cls(
            id=data.get("id", ""), time=_time(data.get("time")),
            tenant=str(data.get("tenant", "")), key_id=data.get("key_id"),
            action=str(data.get("action", "")), sandbox_id=data.get("sandbox_id"),
            status=data.get("status"), duration_ms=data.get("duration_ms"),
            detail=dict(data.get("detail") or {}),
        )


@dataclass(frozen=True)
class EgressEvent:
    """One egress attempt through the proxy: where to, what was sent, and the verdict.

    `protocol` is http, connect, connect-inspected, https-inspected or socks5; `method`, `path`
    and `status` are known only for requests the proxy could read."""

    id: int | str
    time: datetime | None
    tenant: str | None
    sandbox_id: str | None
    protocol: str
    host: str
    port: int | None
    method: str | None
    path: str | None
    status: int | None
    bytes_out: int
    bytes_in: int
    allowed: bool
    rule: str | None
    reason: str | None
    duration_ms: float | None

    @classmethod
    def from_json(cls, data: Any) -> EgressEvent:
        data = data if isinstance(data, dict) else {}
        return cls(
            id=data.get("id", ""), time=_time(data.get("time")), tenant=data.get("tenant"),
            sandbox_id=data.get("sandbox_id"), protocol=str(data.get("protocol", "")),
            host=str(data.get("host", "")), port=data.get("port"), method=data.get("method"),
            path=data.get("path"), status=data.get("status"),
            bytes_out=int(data.get("bytes_out") or 0), bytes_in=int(data.get("bytes_in") or 0),
            allowed=bool(data.get("allowed")), rule=data.get("rule"), reason=data.get("reason"),
            duration_ms=data.get("duration_ms"),
        )


@dataclass(frozen=True)
class SecretInfo:
    """A tenant secret as the server shows it: never its value. The proxy puts the value in
    place of the sandbox's placeholder only on requests to `hosts`, only in `headers` (in URLs
    too if `in_url`), and only over verified TLS unless `allow_plaintext`."""

    name: str
    hosts: list[str]
    in_url: bool
    created_at: datetime | None
    updated_at: datetime | None
    headers: list[str] = field(default_factory=lambda: ["Authorization"])
    allow_plaintext: bool = False

    @classmethod
    def from_json(cls, data: Any) -> SecretInfo:
        data = data if isinstance(data, dict) else {}
        return cls(name=str(data.get("name", "")), hosts=_strings(data.get("hosts")),
                   in_url=bool(data.get("in_url")), created_at=_time(data.get("created_at")),
                   updated_at=_time(data.get("updated_at")),
                   headers=_strings(data.get("headers")) or ["Authorization"],
                   allow_plaintext=bool(data.get("allow_plaintext")))


# ---------------------------------------------------------------------------- code interpreter

_RESULT_FORMATS = ("text", "html", "markdown", "svg", "png", "jpeg", "pdf", "latex", "json",
                   "javascript")


@dataclass
class Result:
    """One rich output of a cell: what Jupyter displayed, in each format it offered.

    `is_main_result` marks the cell's value (its last expression); displays (`display()`, a
    matplotlib figure) are not main results. Images (png, jpeg) are base64 strings."""

    text: str | None = None
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    png: str | None = None
    jpeg: str | None = None
    pdf: str | None = None
    latex: str | None = None
    json: Any = None
    javascript: str | None = None
    data: Any = None
    chart: Any = None
    is_main_result: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any) -> Result:
        data = data if isinstance(data, dict) else {}
        known = {k: data[k] for k in (*_RESULT_FORMATS, "data", "chart") if k in data}
        extra = data.get("extra") if isinstance(data.get("extra"), dict) else {}
        return cls(**known, is_main_result=bool(data.get("is_main_result")), extra=extra)

    def formats(self) -> list[str]:
        """The formats this result carries (e.g. ["text", "png"])."""
        return [f for f in (*_RESULT_FORMATS, "chart") if getattr(self, f) is not None]

    def __str__(self) -> str:
        return self.text or ""


@dataclass
class Logs:
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ExecutionError:
    """An exception the code raised (or a timeout / a dead kernel): name, value, traceback.
    `violation` says which limit killed the kernel (a `KernelDied` error), if one did."""

    name: str
    value: str
    traceback: str
    violation: Violation | None = None


@dataclass
class Execution:
    """The outcome of `run_code`: results, logs, the error if any, and the execution count."""

    results: list[Result] = field(default_factory=list)
    logs: Logs = field(default_factory=Logs)
    error: ExecutionError | None = None
    execution_count: int | None = None
    timed_out: bool = False

    @property
    def text(self) -> str | None:
        """The text of the main result (the cell's value), if any."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None


@dataclass(frozen=True)
class OutputMessage:
    line: str
    # Nanoseconds since the Unix epoch, as E2B's (an int: a float would lose the last digits).
    timestamp: int | None = None
    error: bool = False

    def __str__(self) -> str:
        return self.line


@dataclass(frozen=True)
class Context:
    """A code context: its own kernel (python) or process (bash, javascript) and state."""

    id: str
    language: str
    cwd: str | None = None
    default: bool = False

    @classmethod
    def from_json(cls, data: Any) -> Context:
        data = data if isinstance(data, dict) else {}
        return cls(id=str(data.get("id", "")), language=str(data.get("language", "")),
                   cwd=data.get("cwd"), default=bool(data.get("default")))


@dataclass(frozen=True)
class TemplateInfo:
    name: str
    key: str
    size_bytes: int
    built_at: datetime | None
    env: dict[str, str]
    workdir: str
    user: str
    start_cmd: str | None = None
    ready_cmd: str | None = None
    warm: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: Any) -> TemplateInfo:
        data = data if isinstance(data, dict) else {}
        return cls(name=str(data.get("name", "")), key=str(data.get("key", "")),
                   size_bytes=int(data.get("size_bytes") or 0),
                   built_at=_time(data.get("built_at")), env=dict(data.get("env") or {}),
                   workdir=str(data.get("workdir", "")), user=str(data.get("user", "")),
                   start_cmd=data.get("start_cmd"), ready_cmd=data.get("ready_cmd"),
                   warm=list(data.get("warm") or []))


@dataclass(frozen=True)
class PoolStats:
    """A warm pool's size and how it has served creates."""

    template: str
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

    @classmethod
    def from_json(cls, data: Any) -> PoolStats:
        data = data if isinstance(data, dict) else {}
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class KeptWorkspace:
    """The /workspace of an ended sandbox created with `keep_workspace=True`: what it takes on
    the server's disk (it counts against the tenant's total) and when the server deletes it."""

    sandbox_id: str
    template: str
    metadata: dict[str, str]
    used_bytes: int
    kept_at: datetime | None
    expires_at: datetime | None

    @classmethod
    def from_json(cls, data: Any) -> KeptWorkspace:
        data = data if isinstance(data, dict) else {}
        return cls(sandbox_id=str(data.get("sandbox_id", "")),
                   template=str(data.get("template", "")),
                   metadata=dict(data.get("metadata") or {}),
                   used_bytes=int(data.get("used_bytes") or 0),
                   kept_at=_time(data.get("kept_at")), expires_at=_time(data.get("expires_at")))
