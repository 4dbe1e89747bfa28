"""The `agentbox` command line: parses arguments and prints; the SDK does the talking.

`serve` works on the local data dir, and `keys` may (see `_keys_offline_dir`); every other
command goes through the SDK to a server (`--api-url` / AGENTBOX_API_URL, `--api-key` /
AGENTBOX_API_KEY).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import os
import re
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import typer


def _without_httpx_cli() -> None:
    """httpx imports its own command line (`httpx._main`: rich, pygments) with the package
    when they are installed, as they are here: ~1/3 of this CLI's start-up, for a `main` that
    is never called. A module of that name that has only `main` stands in for it."""
    if "httpx" in sys.modules or "httpx._main" in sys.modules:
        return
    import types

    stand_in = types.ModuleType("httpx._main")

    def main() -> None:
        raise SystemExit("httpx's command line is not loaded in agentbox's")

    stand_in.main = main  # type: ignore[attr-defined]
    sys.modules["httpx._main"] = stand_in


_without_httpx_cli()

from agentbox import config  # noqa: E402
from agentbox.cli import quick  # noqa: E402
from agentbox.sdk import (  # noqa: E402
    AgentboxError,
    CommandExitException,
    CommandResult,
    ConflictError,
    ConnectionFailedError,
    EgressEvent,
    KeyInfo,
    NetworkInfo,
    Resources,
    Sandbox,
    SandboxInfo,
    Secrets,
    Templates,
    Volumes,
    Workspaces,
)
from agentbox.sdk.audit import list_audit_events, list_egress_events  # noqa: E402
from agentbox.sdk.keys import create_key, delete_key, list_keys  # noqa: E402

app = typer.Typer(
    name="agentbox", help="Self-hosted sandboxes for AI agents.", no_args_is_help=True,
    add_completion=False, pretty_exceptions_enable=False,
)
keys_app = typer.Typer(help="Manage API keys (admin): through the API, or on the server's "
                       "own data dir.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
template_app = typer.Typer(help="Build, list and remove templates.", no_args_is_help=True)
app.add_typer(template_app, name="template")
pool_app = typer.Typer(help="Warm pools of started sandboxes.", no_args_is_help=True)
app.add_typer(pool_app, name="pool")
secrets_app = typer.Typer(help="Secrets sandboxes use without seeing them.",
                          no_args_is_help=True)
app.add_typer(secrets_app, name="secrets")
workspaces_app = typer.Typer(help="Workspaces kept after their sandbox ended (--keep-workspace).",
                             no_args_is_help=True)
app.add_typer(workspaces_app, name="workspaces")
files_app = typer.Typer(help="Files of a running sandbox.", no_args_is_help=True)
app.add_typer(files_app, name="files")
snapshot_app = typer.Typer(help="Snapshots of sandboxes' disks: start sandboxes from one "
                           "with `agentbox create --template ID_OR_NAME`.", no_args_is_help=True)
app.add_typer(snapshot_app, name="snapshot")
volume_app = typer.Typer(help="Volumes: named filesystems that outlive sandboxes; mount one "
                         "with `agentbox create --volume /data=NAME`.", no_args_is_help=True)
app.add_typer(volume_app, name="volume")

class _Console:
    """A rich Console made at its first use: rich takes ~45 ms to import, and most commands
    (`exec` among them) print nothing through it unless something goes wrong."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._made: Any = None

    @property
    def console(self) -> Any:
        if self._made is None:
            from rich.console import Console

            self._made = Console(**self._options)
        return self._made

    def __getattr__(self, name: str) -> Any:
        return getattr(self.console, name)


def escape(markup: str) -> str:
    from rich.markup import escape as rich_escape

    return rich_escape(markup)


out = _Console()
err = _Console(stderr=True)
T = TypeVar("T")



@dataclasses.dataclass
class Connection:
    api_url: str | None
    api_key: str | None


@app.callback()
def _global(
    ctx: typer.Context,
    api_url: Annotated[str | None, typer.Option(
        "--api-url", envvar="AGENTBOX_API_URL",
        help="Server URL.", show_default=config.DEFAULT_API_URL)] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="AGENTBOX_API_KEY",
        help="API key.", show_default="the local server's admin.key")] = None,
) -> None:
    ctx.obj = Connection(api_url, api_key)


def _conn(ctx: typer.Context) -> dict[str, Any]:
    c: Connection = ctx.obj
    return {"api_url": c.api_url, "api_key": c.api_key}


def _pairs(items: list[str] | None, what: str) -> dict[str, str]:
    """`k=v` options into a dict; a malformed one is a usage error, not a traceback."""
    result: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r} must look like KEY=VALUE", param_hint=what)
        result[key] = value
    return result


def _json_default(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else str(value)


def _print_json(value: Any) -> None:
    out.out(json.dumps(value, default=_json_default, indent=2), highlight=False)


def _time(value: datetime | None) -> str:
    # Local time, no year: tables must fit 80 columns.
    return value.astimezone().strftime("%m-%d %H:%M:%S") if value else "-"


# ---------------------------------------------------------------------------- local commands


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = config.DEFAULT_HOST,
    port: Annotated[int, typer.Option(help="Port to listen on.")] = config.DEFAULT_PORT,
    data_dir: Annotated[Path | None, typer.Option(
        help="State dir.", show_default="AGENTBOX_DATA_DIR, /var/lib/agentbox as root, "
        "else ~/.local/share/agentbox")] = None,
    warm_pool: Annotated[list[str] | None, typer.Option(
        "--warm-pool", help="TEMPLATE=N: keep N started sandboxes of TEMPLATE ready "
        "(repeatable; also AGENTBOX_WARM_POOLS).")] = None,
    template_dir: Annotated[Path | None, typer.Option(
        help="Where built templates live.",
        show_default="AGENTBOX_TEMPLATE_DIR, else DATA_DIR/templates")] = None,
    default_template: Annotated[str | None, typer.Option(
        help="What a create that names no template gets: a template's name, or host (the "
        "host's userland, read-only, nothing to build). A shipped one not built yet is built "
        "at start-up (`agentbox setup` builds it ahead).",
        show_default="AGENTBOX_DEFAULT_TEMPLATE, else base")] = None,
    egress_allow_cidr: Annotated[list[str] | None, typer.Option(
        "--egress-allow-cidr", help="Let egress policies reach this otherwise refused address "
        "range, e.g. 10.20.0.0/16 (repeatable).")] = None,
    egress_resolve: Annotated[list[str] | None, typer.Option(
        "--egress-resolve", help="HOST=IP: a static answer for the egress proxy's resolver "
        "(repeatable).")] = None,
    egress_deny: Annotated[list[str] | None, typer.Option(
        "--egress-deny", help="A host, *.domain or CIDR no sandbox may reach, whatever its "
        "policy (repeatable).")] = None,
    egress_upstream_ca: Annotated[list[Path] | None, typer.Option(
        "--egress-upstream-ca", help="Extra CA file the egress proxy trusts for upstreams it "
        "inspects (repeatable).")] = None,
    sandbox_ca: Annotated[list[Path] | None, typer.Option(
        "--sandbox-ca", help="A PEM file of CA certificates every sandbox trusts besides the "
        "system's, e.g. a TLS-inspecting proxy's (repeatable; the egress proxy trusts them "
        "too).")] = None,
    ports_domain: Annotated[str, typer.Option(
        help="Exposed ports are reachable at PORT-SANDBOX_ID.DOMAIN.")] = "localhost",
    public_url: Annotated[str | None, typer.Option(
        help="This server's URL as clients see it, for signed port URLs.",
        show_default="http://localhost:PORT")] = None,
    max_connections: Annotated[int | None, typer.Option(
        min=16, help="Open HTTP connections the server keeps; half at most for clients that "
        "have not shown a valid API key.", show_default="a quarter of the descriptor limit"
    )] = None,
    mcp_idle_timeout: Annotated[float | None, typer.Option(
        min=1, help="Seconds an MCP session over HTTP (/mcp) may go without a request before "
        "it ends, and its sandbox with it.", show_default="1800")] = None,
    mcp_sessions_per_tenant: Annotated[int | None, typer.Option(
        min=1, help="MCP sessions over HTTP one tenant may have open at once.",
        show_default="16")] = None,
    host_path: Annotated[list[str] | None, typer.Option(
        "--host-path", help="A host path sandboxes of the host template see read-only, "
        "e.g. /usr/local (hidden otherwise) or /etc/pip.conf (repeatable).")] = None,
    relay_write_timeout: Annotated[float, typer.Option(
        min=1, help="Seconds an exposed port's relay waits for a side that does not take what "
        "is written to it (a client or a sandbox's server that stopped reading) before ending "
        "the relay.")] = 30.0,
    log_retention_days: Annotated[float, typer.Option(
        min=0, help="Audit and egress log rows older than this are deleted.")] = 30.0,
    log_max_rows: Annotated[int, typer.Option(
        min=1000, help="Rows the audit log and the egress log each keep at most (the newest)."
        )] = 1_000_000,
    runtime: Annotated[str, typer.Option(
        help="Isolation runtimes to serve, comma-separated; the first is the default for "
        "sandboxes that name none. One of the others that cannot run on this host is left "
        "out (GET /v1/health says why).")] = "process,container,gvisor",
) -> None:
    """Run the agentbox server in the foreground."""
    from agentbox import runtimes
    from agentbox.core.logs import LogLimits
    from agentbox.core.network import NetworkSettings
    from agentbox.server.app import serve as run_server  # the server is heavy: load on use
    from agentbox.server.gateway import RelayLimits
    from agentbox.server.limits import McpLimits, ServerLimits
    from agentbox.templates import valid_name

    default_template = default_template or config.default_template()
    if not valid_name(default_template):
        raise typer.BadParameter(f"{default_template!r} is not a template name",
                                 param_hint="--default-template")
    for name in (n.strip() for n in runtime.split(",")):
        if name not in runtimes.available():
            raise typer.BadParameter(
                f"unknown runtime {name!r}; installed: {', '.join(runtimes.available())}",
                param_hint="--runtime")

    try:
        pools = {**config.default_pool_sizes(), **config.parse_pool_sizes(warm_pool or [])}
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--warm-pool") from None
    network = NetworkSettings(
        egress_allow_cidrs=tuple(egress_allow_cidr or ()),
        egress_resolve=tuple(egress_resolve or ()),
        egress_deny=tuple(egress_deny or ()),
        egress_upstream_ca=tuple(str(p) for p in egress_upstream_ca or ()),
        sandbox_ca=tuple(str(p) for p in sandbox_ca or ()),
        ports_domain=ports_domain,
        public_url=public_url or "",
    )
    try:
        network.sandbox_ca_pem()
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--sandbox-ca") from None
    try:
        network.parsed()
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--egress-*") from None
    data_dir = data_dir or config.default_data_dir()
    try:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # private, as the server keeps it
    except OSError as e:
        raise typer.BadParameter(f"cannot create {data_dir}: {e.strerror}",
                                 param_hint="--data-dir") from None
    run_server(host=host, port=port, data_dir=data_dir,
               template_dir=template_dir or config.default_template_dir(), warm_pools=pools,
               network=network, limits=ServerLimits(
                   max_connections=max_connections,
                   relay=RelayLimits(write_timeout=relay_write_timeout),
                   logs=LogLimits(retention_days=log_retention_days, max_rows=log_max_rows),
                   mcp=McpLimits(
                       idle_timeout=mcp_idle_timeout or McpLimits.idle_timeout,
                       per_tenant=mcp_sessions_per_tenant or McpLimits.per_tenant)),
               runtime_name=runtime,
               runtime_config={"host_paths": host_path} if host_path else None,
               default_template=default_template)


@app.command()
def setup(
    data_dir: Annotated[Path | None, typer.Option(
        help="The server's state dir.", show_default="AGENTBOX_DATA_DIR, /var/lib/agentbox as "
        "root, else ~/.local/share/agentbox")] = None,
    template_dir: Annotated[Path | None, typer.Option(
        help="Where built templates live.",
        show_default="AGENTBOX_TEMPLATE_DIR, else DATA_DIR/templates")] = None,
    template: Annotated[list[str] | None, typer.Option(
        "--template", help="A shipped template to build (repeatable), e.g. code-interpreter.",
        show_default="the default template: AGENTBOX_DEFAULT_TEMPLATE, else base")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print every log line.")] = False,
) -> None:
    """Prepare this machine for `serve`: build the default template (a minimal Debian, from
    Debian's mirror; a few minutes the first time, seconds when cached), showing its progress,
    so that the first sandbox starts at once. Run as root, before `serve`."""
    from agentbox.templates import (
        BuildError,
        TemplateStore,
        builtin_spec_names,
        builtin_spec_path,
        load_spec,
    )

    names = template or [config.default_template()]
    if "host" in names:
        err.print("host is the host's own userland: nothing to build", highlight=False)
        names = [n for n in names if n != "host"]
    specs = {}
    for name in names:
        path = builtin_spec_path(name)
        if path is None:
            shipped = ", ".join(builtin_spec_names())
            raise typer.BadParameter(f"{name!r} is not a shipped template; shipped: {shipped} "
                                     "(build your own with `agentbox template build SPEC`)",
                                     param_hint="--template")
        specs[name] = load_spec(path.read_text(), path.parent)
    if not specs:
        return
    if os.geteuid() != 0:
        err.print("[red]error:[/red] setup builds templates as root (mmdebstrap, chroot); run it "
                  "as root, or serve with --default-template host", highlight=False)
        raise typer.Exit(1)
    data_dir = data_dir or config.default_data_dir()
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if _locked(data_dir / "server.lock"):
        err.print(f"[red]error:[/red] a server is running on {escape(str(data_dir))}: build "
                  "through it (`agentbox template build NAME`), it knows what its sandboxes use",
                  highlight=False)
        raise typer.Exit(1)
    store = TemplateStore(template_dir or config.default_template_dir() or data_dir / "templates")
    for name, spec in specs.items():
        started = time.monotonic()
        try:
            with _build_progress(verbose, f"{name}: ") as on_event:
                info = store.build(spec, on_event)
        except BuildError as e:
            err.print(f"[red]error:[/red] template {escape(name)} could not be built: "
                      f"{escape(str(e))}", highlight=False)
            err.print("agentbox can still serve the host's userland: serve with "
                      "--default-template host", highlight=False)
            raise typer.Exit(1) from None
        out.print(f"template [bold]{escape(name)}[/bold] is ready ({_size(info.size_bytes)}, "
                  f"{time.monotonic() - started:.0f} s)", highlight=False)


def _locked(path: Path) -> bool:
    """Whether another process holds this flock (a server's lock on its data dir)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


# `keys` goes through the server's API (POST /v1/keys, with an admin key) when given --api-url
# or AGENTBOX_API_URL, or when this machine has no agentbox database; on the server's own
# machine, or with --data-dir, it works on the data dir's database (no server needed).
_KEYS_DATA_DIR = typer.Option(
    "--data-dir", help="Work on this server data dir's database, not through the API.",
    show_default="through the API when an API URL is given or no local data dir "
    "(AGENTBOX_DATA_DIR, /var/lib/agentbox as root) holds a database")


def _keys_offline_dir(ctx: typer.Context, data_dir: Path | None) -> Path | None:
    """The data dir to work on, or None to go through the API."""
    if data_dir is not None:
        return data_dir
    if ctx.obj.api_url:
        return None
    local = config.default_data_dir()
    # os.path, not Path.exists: a data dir this user may not enter is simply not theirs.
    return local if os.path.exists(local / "agentbox.db") else None


@keys_app.command("create")
def keys_create(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Option(help="Tenant the key belongs to.")],
    admin: Annotated[bool, typer.Option("--admin", help="Make an admin key.")] = False,
    data_dir: Annotated[Path | None, _KEYS_DATA_DIR] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print key_id, key, tenant and admin as JSON.")] = False,
) -> None:
    """Create an API key (shown only once): through the API with an admin key, or on the
    server's own data dir."""
    from agentbox.core.auth import create_key_offline

    offline = _keys_offline_dir(ctx, data_dir)
    if offline is None:
        with _keys_remote(ctx):
            made = create_key(tenant, admin, **_conn(ctx))
        key_id, key = made.key_id, made.key or ""
    else:
        key_id, key = _offline(lambda: create_key_offline(offline, tenant, admin))
    if as_json:
        _print_json({"key_id": key_id, "key": key, "tenant": tenant, "admin": admin})
        return
    if not sys.stdout.isatty():
        # Plain, so `KEY=$(agentbox keys create --tenant t)` works.
        print(key)
        return
    from rich.panel import Panel

    out.print(Panel(
        f"[bold]{escape(key)}[/bold]\n\nkey id: {escape(key_id)}   tenant: {escape(tenant)}"
        f"   admin: {'yes' if admin else 'no'}\n[dim]Store it now: it is not shown again.[/dim]",
        title="new API key", expand=False))


@keys_app.command("ls")
def keys_ls(
    ctx: typer.Context,
    data_dir: Annotated[Path | None, _KEYS_DATA_DIR] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the API keys not revoked, oldest first (never their secrets)."""
    from agentbox.core.auth import list_keys_offline

    offline = _keys_offline_dir(ctx, data_dir)
    if offline is None:
        with _keys_remote(ctx):
            found = list_keys(**_conn(ctx))
    else:
        found = [KeyInfo.from_json(k) for k in _offline(lambda: list_keys_offline(offline))]
    if as_json:
        _print_json([dataclasses.asdict(k) for k in found])
        return
    rows = [[k.key_id, escape(k.tenant), "yes" if k.admin else "no", _time(k.created_at)]
            for k in found]
    _print_table(["KEY ID", "TENANT", "ADMIN", "CREATED"], rows, last="whole")


@keys_app.command("rm")
def keys_rm(
    ctx: typer.Context,
    key_ids: Annotated[list[str], typer.Argument(help="Key ids to revoke.")],
    data_dir: Annotated[Path | None, _KEYS_DATA_DIR] = None,
) -> None:
    """Revoke API keys at once."""
    from agentbox.core.auth import revoke_key_offline

    offline = _keys_offline_dir(ctx, data_dir)
    for key_id in key_ids:
        if offline is None:
            with _keys_remote(ctx):
                delete_key(key_id, **_conn(ctx))
        else:
            _offline(functools.partial(revoke_key_offline, offline, key_id))
        print(f"revoked {key_id}")


@contextlib.contextmanager
def _keys_remote(ctx: typer.Context) -> Iterator[None]:
    """Says why `keys` went to the API when no server answers and nobody asked for one."""
    try:
        yield
    except ConnectionFailedError as e:
        if not ctx.obj.api_url:
            e.message += (f"; no database in {config.default_data_dir()} either: give the "
                          "server's --data-dir, or --api-url")
        raise


def _offline(work: Callable[[], T]) -> T:
    """Run work on the local data dir; its errors end as one line, like the server's."""
    from agentbox.core.errors import AgentboxError as CoreError

    try:
        return work()
    except CoreError as e:
        err.print(f"[red]error:[/red] {escape(e.message)}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


# ---------------------------------------------------------------------------- sandboxes


@app.command()
def create(
    ctx: typer.Context,
    template: Annotated[str | None, typer.Option(
        help="Template name (host: the host's own userland, read-only).",
        show_default="the server's default template, base unless it says otherwise")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds until the sandbox ends.")] = 300,
    metadata: Annotated[list[str] | None, typer.Option(
        "--metadata", "-m", help="KEY=VALUE label (repeatable).")] = None,
    env: Annotated[list[str] | None, typer.Option(
        "--env", "-e", help="KEY=VALUE environment variable (repeatable).")] = None,
    memory_mb: Annotated[int | None, typer.Option(
        help="Memory limit in MiB.", show_default="512")] = None,
    cpu: Annotated[float | None, typer.Option(help="CPU count.", show_default="1")] = None,
    keep_workspace: Annotated[bool, typer.Option(
        help="Keep /workspace after the sandbox ends.")] = False,
    allow: Annotated[list[str] | None, typer.Option(
        "--allow", help="Host, *.domain, host:port or CIDR the sandbox may reach "
        "(repeatable).")] = None,
    deny: Annotated[list[str] | None, typer.Option(
        "--deny", help="Refused even if allowed (repeatable).")] = None,
    internet: Annotated[bool, typer.Option(
        "--internet", help="Allow every public destination not denied.")] = False,
    public_ports: Annotated[bool, typer.Option(
        "--public-ports", help="Exposed ports need no access token.")] = False,
    secret: Annotated[list[str] | None, typer.Option(
        "--secret", help="NAME of a secret to hand in as a placeholder $NAME "
        "(repeatable).")] = None,
    runtime: Annotated[str | None, typer.Option(
        help="Isolation runtime (GET /v1/health lists those served).",
        show_default="the tenant's default, else the server's")] = None,
    isolation: Annotated[str | None, typer.Option(
        help="Isolation tier: process, container or gvisor (the tiers' name for --runtime).",
        show_default="the tenant's default, else the server's")] = None,
    volume: Annotated[list[str] | None, typer.Option(
        "--volume", "-v", help="PATH=VOLUME to mount a volume at PATH, PATH=VOLUME:ro read-only "
        "(repeatable).")] = None,
) -> None:
    """Create a sandbox and print its id.

    Without --allow, --deny, --internet or --public-ports the sandbox gets the tenant's default
    network policy; with any of them, exactly the policy they describe.
    """
    network = None
    if allow or deny or internet or public_ports:
        network = NetworkInfo(allow_out=list(allow or []), deny_out=list(deny or []),
                              allow_internet_access=internet,
                              allow_public_traffic=public_ports)
    sbx = Sandbox.create(
        template=template, timeout=timeout, metadata=_pairs(metadata, "--metadata"),
        envs=_pairs(env, "--env"), resources=Resources(cpu_count=cpu, memory_mb=memory_mb),
        keep_workspace=keep_workspace, network=network, secrets=secret, runtime=runtime,
        isolation=isolation, volume_mounts=_volume_mounts(volume),
        on_progress=lambda progress: print(f"{progress} ...", file=sys.stderr, flush=True),
        **_conn(ctx))
    sbx.close()
    print(sbx.sandbox_id)


def _volume_mounts(specs: list[str] | None) -> dict[str, Any]:
    mounts: dict[str, Any] = {}
    for path, ref in _pairs(specs, "--volume").items():
        name, ro = (ref[:-3], True) if ref.endswith(":ro") else (ref, False)
        mounts[path] = {"volume": name, "read_only": ro}
    return mounts


@app.command("ls")
def list_sandboxes(
    ctx: typer.Context,
    state: Annotated[str | None, typer.Option(
        help="live, starting, running, unhealthy, killed, expired or failed (comma-separated).",
        show_default="live: starting, running and unhealthy")] = None,
    all_states: Annotated[bool, typer.Option(
        "--all", "-a", help="Sandboxes in every state, ended ones too.")] = False,
    metadata: Annotated[list[str] | None, typer.Option(
        "--metadata", "-m", help="Only sandboxes with this KEY=VALUE (repeatable).")] = None,
    limit: Annotated[int | None, typer.Option(
        help="At most this many.", show_default="all")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List your live sandboxes (--all: ended ones too), newest first."""
    if all_states and state:
        raise typer.BadParameter("give --state or --all, not both", param_hint="--all")
    states = [s for s in (state or "").split(",") if s] or ("all" if all_states else "live")
    found = Sandbox.list(state=states, metadata=_pairs(metadata, "--metadata"), limit=limit,
                         **_conn(ctx))
    if as_json:
        _print_json([dataclasses.asdict(s) for s in found])
        return
    _sandbox_table(found)


def _sandbox_table(found: list[SandboxInfo]) -> None:
    colors = {"running": "green", "starting": "yellow", "failed": "red"}
    rows = [[s.sandbox_id, f"[{colors.get(s.state, 'dim')}]{s.state}[/]", escape(s.template),
             _time(s.created_at), _time(s.ended_at or s.end_at),
             escape(" ".join(f"{k}={v}" for k, v in s.metadata.items()))] for s in found]
    _print_table(["ID", "STATE", "TEMPLATE", "CREATED", "ENDS", "METADATA"], rows)


@app.command()
def info(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox to describe.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show one sandbox: state, times, resources, network policy, metadata."""
    sbx = Sandbox.connect(sandbox_id, resume=False, **_conn(ctx))
    try:
        found = sbx.get_info()
    finally:
        sbx.close()
    if as_json:
        _print_json(dataclasses.asdict(found))
        return
    r = found.resources
    ended = _full_time(found.ended_at)
    rows = [
        ("id", found.sandbox_id), ("state", found.state), ("template", found.template),
        ("runtime", found.runtime),
        ("tenant", found.tenant), ("created", _full_time(found.created_at)),
        ("ends", _full_time(found.end_at)) if found.ended_at is None
        else ("ended", f"{ended} ({found.end_reason or '?'})"),
        ("resources", f"{r.cpu_count} CPU, {r.memory_mb} MiB memory, {r.pids} processes, "
                      f"{r.nofile} open files, {r.disk_mb} MiB disk, {r.tmp_mb} MiB /tmp, "
                      f"{r.file_size_mb} MiB per file"),
        ("workspace", "kept after the end" if found.keep_workspace else "deleted at the end"),
        ("metadata", " ".join(f"{k}={v}" for k, v in found.metadata.items()) or "-"),
        ("secrets", ", ".join(found.secrets) or "-"),
    ]
    if found.origin:
        # {"snapshot": id} or {"fork_of": sandbox id}: "snapshot snap_…", "fork of sbx_…"
        rows.append(("origin", " ".join(f"{k.replace('_', ' ')} {v}"
                                        for k, v in found.origin.items())))
    for name, value in rows:
        out.print(f"{name + ':':<11} {escape(value)}", highlight=False, soft_wrap=True)
    _print_network(found.network)


def _full_time(value: datetime | None) -> str:
    return value.astimezone().isoformat(sep=" ", timespec="seconds") if value else "-"


def _print_table(headers: list[str], rows: list[list[str]],
                 last: Literal["wrap", "ellipsis", "whole"] = "wrap") -> None:
    """A table that never cuts an id or a key: they are what people and scripts copy.

    Piped, every column is printed whole. On a terminal too narrow, the last column (free
    text) wraps in the room left (`ellipsis`: is cut there; `whole`: is never narrowed), or
    when that is too little, columns are dropped from the right; the first (the row's key) is
    always shown whole. `--json` has everything."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    widths = [max([Text.from_markup(r[i]).cell_len for r in rows] + [len(name)])
              for i, name in enumerate(headers)]
    shown = list(range(len(headers)))
    narrowed: int | None = None  # the width the last shown column is narrowed to
    if sys.stdout.isatty() and _table_width(widths, shown) > out.width:
        room = out.width - _table_width(widths, shown[:-1]) - 2
        if last != "whole" and room >= _NARROWED_MIN:
            narrowed = room
        else:
            shown.pop()
            while len(shown) > 1 and _table_width(widths, shown) > out.width:
                shown.pop()
    table = Table(box=None, header_style="bold", pad_edge=False)
    for i in shown:
        narrow = narrowed is not None and i == shown[-1]
        table.add_column(headers[i], no_wrap=not narrow or last == "ellipsis",
                         overflow="ellipsis" if narrow and last == "ellipsis" else "fold",
                         width=narrowed if narrow else widths[i])
    for row in rows:
        table.add_row(*(row[i] for i in shown))
    need = out.width if narrowed is not None else _table_width(widths, shown)
    console = out.console if need <= out.width else Console(width=need, highlight=False)
    if sys.stdout.isatty():
        console.print(table)
        return
    with console.capture() as captured:
        console.print(table)
    # Without the cells' padding at line ends, for `cut`, `diff` and the like.
    sys.stdout.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


# The last column is narrowed to no fewer cells than this; with less room it is dropped.
_NARROWED_MIN = 16


def _table_width(widths: list[int], columns: list[int]) -> int:
    return sum(widths[i] for i in columns) + 2 * max(0, len(columns) - 1)


@app.command()
def kill(
    ctx: typer.Context,
    sandbox_ids: Annotated[list[str], typer.Argument(help="Sandboxes to kill.")],
) -> None:
    """Kill sandboxes."""
    _each(ctx, sandbox_ids, lambda sbx: sbx.kill(), "killed")


@app.command()
def pause(
    ctx: typer.Context,
    sandbox_ids: Annotated[list[str], typer.Argument(help="Sandboxes to pause.")],
    memory: Annotated[bool, typer.Option(
        "--memory/--no-memory",
        help="Keep their processes and memory (frozen); --no-memory ends their processes and "
        "keeps only their disk (a resume boots them fresh on it).")] = True,
) -> None:
    """Pause sandboxes: their processes are frozen with their memory, they use no CPU and
    their timeout stops until `agentbox resume`."""
    _each(ctx, sandbox_ids, lambda sbx: sbx.pause(keep_memory=memory), "paused")


@app.command()
def resume(
    ctx: typer.Context,
    sandbox_ids: Annotated[list[str], typer.Argument(help="Sandboxes to resume.")],
    timeout: Annotated[
        float | None,
        typer.Option(help="Run on for at least this many seconds.",
                     show_default="the time it had left when it was paused"),
    ] = None,
) -> None:
    """Resume paused sandboxes (running ones are left running)."""
    _each(ctx, sandbox_ids, lambda sbx: sbx.resume(timeout), "resumed")


def _each(
    ctx: typer.Context, sandbox_ids: list[str], act: Callable[[Sandbox], Any], done: str
) -> None:
    """Do `act` to each sandbox, saying which were done; exit 1 if any failed."""
    failed = False
    for sandbox_id in sandbox_ids:
        try:
            sbx = Sandbox.connect(sandbox_id, resume=False, **_conn(ctx))
            try:
                act(sbx)
            finally:
                sbx.close()
        except AgentboxError as e:
            _print_error(e, f"{sandbox_id}: ")
            failed = True
            continue
        print(f"{done} {sandbox_id}")
    if failed:
        raise typer.Exit(1)


# ---------------------------------------------------------------------------- volumes


@volume_app.command("create")
def volume_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Its name (unique among your volumes).")],
    size_mb: Annotated[int, typer.Option("--size-mb", help="What it can hold, in MiB.")] = 1024,
) -> None:
    """Create an empty volume and print its id."""
    with Volumes(**_conn(ctx)) as vols:
        print(vols.create(name, size_mb).volume_id)


@volume_app.command("ls")
def volume_ls(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List your volumes, oldest first, and the sandboxes that mount them."""
    with Volumes(**_conn(ctx)) as vols:
        found = vols.list()
    if as_json:
        _print_json([dataclasses.asdict(v) for v in found])
        return
    rows = [[v.volume_id, escape(v.name), f"{v.size_mb} MiB", _bytes(v.used_bytes),
             " ".join(m["sandbox_id"] + (" (ro)" if m["read_only"] else "") for m in v.mounted_by)
             or "-"] for v in found]
    _print_table(["ID", "NAME", "SIZE", "USED", "MOUNTED BY"], rows)


@volume_app.command("rm")
def volume_rm(
    ctx: typer.Context,
    refs: Annotated[list[str], typer.Argument(help="Volumes to delete, by id or name.")],
) -> None:
    """Delete volumes and their files (not while a sandbox mounts them)."""
    with Volumes(**_conn(ctx)) as vols:
        for ref in refs:
            vols.delete(ref)
            print(f"removed {ref}")


# ---------------------------------------------------------------------------- snapshots


@snapshot_app.command("create")
def snapshot_create(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(help="Running or paused sandbox to copy.")],
    name: Annotated[str | None, typer.Option(
        help="A name to start sandboxes from it by (unique among your snapshots).",
        show_default="none: by its id only")] = None,
    metadata: Annotated[list[str] | None, typer.Option(
        "--metadata", "-m", help="KEY=VALUE label (repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the snapshot as JSON.")] = False,
) -> None:
    """Snapshot a sandbox's disk (root layer and /workspace, not its memory) and print the
    snapshot's id; the sandbox is frozen only for the copy."""
    sbx = Sandbox.connect(sandbox_id, resume=False, **_conn(ctx))
    try:
        snap = sbx.create_snapshot(name, _pairs(metadata, "--metadata"))
    finally:
        sbx.close()
    if as_json:
        _print_json(dataclasses.asdict(snap))
        return
    print(snap.snapshot_id)


@snapshot_app.command("ls")
def snapshot_ls(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List your snapshots, oldest first: size on the server's disk, what they were taken of."""
    found = Sandbox.list_snapshots(**_conn(ctx))
    if as_json:
        _print_json([dataclasses.asdict(s) for s in found])
        return
    rows = [[s.snapshot_id, escape(s.name or "-"), _bytes(s.used_bytes), _time(s.created_at),
             escape(s.template), s.sandbox_id,
             escape(" ".join(f"{k}={v}" for k, v in s.metadata.items()))] for s in found]
    _print_table(["ID", "NAME", "USED", "CREATED", "TEMPLATE", "SANDBOX", "METADATA"], rows)


snapshot_app.command("list", hidden=True)(snapshot_ls)


@snapshot_app.command("rm")
def snapshot_rm(
    ctx: typer.Context,
    refs: Annotated[list[str], typer.Argument(help="Snapshots to delete, by id or name.")],
) -> None:
    """Delete snapshots (sandboxes started from them keep their own copies)."""
    for ref in refs:
        Sandbox.delete_snapshot(ref, **_conn(ctx))
        print(f"removed {ref}")


@app.command()
def fork(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(help="Running or paused sandbox to fork.")],
    count: Annotated[int, typer.Option(
        "--count", "-n", min=1, max=16, help="How many new sandboxes.")] = 1,
    timeout: Annotated[float | None, typer.Option(
        help="Seconds until each new sandbox ends.",
        show_default="the timeout the sandbox was created with")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the new sandboxes as JSON.")]
    = False,
) -> None:
    """Start new sandboxes, each with a copy of a sandbox's disk and settings, and print their
    ids, one a line. All or none: if one cannot start, none is left."""
    sbx = Sandbox.connect(sandbox_id, resume=False, **_conn(ctx))
    try:
        children = sbx.fork(count, timeout)
    finally:
        sbx.close()
    try:
        if as_json:
            _print_json([dataclasses.asdict(c.get_info()) for c in children])
            return
        for child in children:
            print(child.sandbox_id)
    finally:
        for child in children:
            child.close()


# ---------------------------------------------------------------------------- network


@app.command()
def network(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox whose policy to show or set.")],
    allow: Annotated[list[str] | None, typer.Option(
        "--allow", help="Host, *.domain, host:port or CIDR the sandbox may reach "
        "(repeatable).")] = None,
    deny: Annotated[list[str] | None, typer.Option(
        "--deny", help="Refused even if allowed (repeatable).")] = None,
    internet: Annotated[bool | None, typer.Option(
        "--internet/--no-internet", help="Allow every public destination not denied.",
        show_default="--no-internet when the policy is replaced")] = None,
    public_ports: Annotated[bool | None, typer.Option(
        "--public-ports/--private-ports", help="Whether exposed ports need no access token.",
        show_default="--private-ports when the policy is replaced")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show a sandbox's network policy, or replace it.

    With no option, print the current policy.

    Options replace the WHOLE policy: what they leave out is refused or private.

    e.g. agentbox network ID --allow pypi.org --allow files.pythonhosted.org
    """
    sbx = Sandbox.connect(sandbox_id, resume=False, **_conn(ctx))
    try:
        if allow is None and deny is None and internet is None and public_ports is None:
            info = sbx.get_info()
        else:
            info = sbx.update_network(allow_out=allow or [], deny_out=deny or [],
                                      allow_internet_access=internet,
                                      allow_public_traffic=public_ports)
    finally:
        sbx.close()
    if as_json:
        _print_json(dataclasses.asdict(info.network) if info.network else None)
        return
    _print_network(info.network)


def _print_network(net: NetworkInfo | None) -> None:
    if net is None:
        out.print("[dim]no network policy reported by the server[/dim]")
        return
    lines = [
        f"allow out:  {escape(', '.join(net.allow_out) or '-')}",
        f"deny out:   {escape(', '.join(net.deny_out) or '-')}",
        "internet:   " + ("[green]allowed[/green]" if net.allow_internet_access
                          else "[dim]not allowed[/dim]"),
        "ports:      " + ("[yellow]public[/yellow]" if net.allow_public_traffic
                          else "private (access token or API key)"),
    ]
    for line in lines:
        out.print(line, highlight=False, soft_wrap=True)  # never cut a host name


@app.command("port-url")
def port_url(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox serving the port.")],
    port: Annotated[int, typer.Argument(help="Port a server in the sandbox listens on.")],
    expires_in: Annotated[float | None, typer.Option(
        help="Seconds the URL stays valid (at most 86400).", show_default="3600")] = None,
    path: Annotated[str, typer.Option(help="Path on the sandbox's server.")] = "/",
    host_routing: Annotated[bool, typer.Option(
        "--host-routing", help="A PORT-SANDBOX_ID.DOMAIN URL instead of one under the API's "
        "/v1/sandboxes/ID/ports/PORT.")] = False,
) -> None:
    """Print a signed URL to a sandbox's port that works with no headers (curl, a browser)."""
    sbx = Sandbox.connect(sandbox_id, resume=False, **_conn(ctx))
    try:
        url = sbx.get_url(port, expires_in=expires_in, path=path,
                          routing="host" if host_routing else "path")
    finally:
        sbx.close()
    print(url)


@app.command("rotate-token")
def rotate_token(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox whose access token to replace.")],
) -> None:
    """Give a sandbox a new access token (printed): the old one and every signed port URL made
    with it stop working at once."""
    sbx = Sandbox.connect(sandbox_id, resume=False, **_conn(ctx))
    try:
        print(sbx.rotate_access_token())
    finally:
        sbx.close()


# ---------------------------------------------------------------------------- secrets


@secrets_app.command("set")
def secrets_set(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Environment variable name, e.g. OPENAI_API_KEY.")],
    value: Annotated[str, typer.Argument(
        help="The value; - reads it from stdin (keeps it out of shell history).")],
    hosts: Annotated[list[str], typer.Option(
        "--hosts", help="Hosts the value may be sent to: H[,H...] (repeatable), "
        "e.g. api.openai.com or *.example.com.")],
    in_url: Annotated[bool, typer.Option(
        "--in-url", help="Also swap the placeholder in request URLs, not only headers.")] = False,
    header: Annotated[list[str] | None, typer.Option(
        "--header", help="A request header the value may go in (repeatable).",
        show_default="Authorization")] = None,
    allow_plaintext: Annotated[bool, typer.Option(
        "--allow-plaintext", help="Also send the value over plain http:// "
        "(default: only over TLS the proxy verified).")] = False,
) -> None:
    """Create or replace a secret. Sandboxes created with --secret NAME see a placeholder in
    $NAME; the egress proxy puts the value in its place on requests to HOSTS only, in the
    bound headers only, and scrubs it out of their responses."""
    if value == "-":
        value = sys.stdin.read().rstrip("\r\n")
    names = [h.strip() for item in hosts for h in item.split(",") if h.strip()]
    if not names:
        raise typer.BadParameter("give at least one host", param_hint="--hosts")
    with Secrets(**_conn(ctx)) as secrets:
        info = secrets.set(name, value, names, in_url=in_url, headers=header or None,
                           allow_plaintext=allow_plaintext)
    where = ", ".join(info.hosts) + f" in {', '.join(info.headers)}"
    where += (" and URLs" if info.in_url else "") + (", plain HTTP too" if info.allow_plaintext
                                                     else "")
    print(f"set secret {info.name} for {where}")


@secrets_app.command("ls")
def secrets_ls(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List your secrets (names and hosts; values are never shown)."""
    with Secrets(**_conn(ctx)) as secrets:
        found = secrets.list()
    if as_json:
        _print_json([dataclasses.asdict(s) for s in found])
        return
    rows = [[escape(s.name), escape(",".join(s.headers)), "yes" if s.in_url else "no",
             "yes" if s.allow_plaintext else "no", _time(s.updated_at),
             escape(",".join(s.hosts))] for s in found]
    _print_table(["NAME", "HEADERS", "IN URL", "PLAINTEXT", "UPDATED", "HOSTS"], rows)


@secrets_app.command("rm")
def secrets_rm(
    ctx: typer.Context,
    names: Annotated[list[str], typer.Argument(help="Secrets to remove.")],
) -> None:
    """Remove secrets; sandboxes using them stop getting the value at once."""
    with Secrets(**_conn(ctx)) as secrets:
        for name in names:
            secrets.remove(name)
            print(f"removed {name}")


# ---------------------------------------------------------------------------- commands


@app.command(name="exec", context_settings={"ignore_unknown_options": True})
def exec_command(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox to run in.")],
    cmd: Annotated[list[str], typer.Argument(help="Command, after `--`.")],
    cwd: Annotated[str | None, typer.Option(
        help="Working directory.", show_default="/workspace")] = None,
    env: Annotated[list[str] | None, typer.Option(
        "--env", "-e", help="KEY=VALUE (repeatable).")] = None,
    user: Annotated[str | None, typer.Option(
        "--user", "-u", help='Run as "user" (uid 1000) or "root" (the sandbox\'s own root).',
        show_default="the template's user")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds; 0 = no limit.")] = 60,
    stdin: Annotated[bool | None, typer.Option(
        "--stdin/--no-stdin", help="Forward stdin to the command, as UTF-8 text.",
        show_default="--stdin unless stdin is a terminal")] = None,
) -> None:
    """Run a command in a sandbox, streaming its output; exits with its exit code.

    One argument runs as a shell line (`agentbox exec ID -- 'ls | wc -l'`); several are quoted
    as words. Death by signal N exits 128+N; a timeout exits 124. Stdin is forwarded when it
    is a pipe or a file (`echo hi | agentbox exec ID -- cat`). Ctrl-C interrupts the command
    (SIGINT to its processes, then SIGKILL to what is left, at most 2 s later) and exits 130.
    """
    line = cmd[0] if len(cmd) == 1 else shlex.join(cmd)
    forward = not sys.stdin.isatty() if stdin is None else stdin
    sbx = Sandbox.connect(sandbox_id, resume=False, **_conn(ctx))
    started: list[str] = []  # the command's id, once the server started it
    ended = threading.Event()

    def on_start(cmd_id: str) -> None:
        started.append(cmd_id)
        if forward:
            threading.Thread(target=_forward_stdin, args=(sbx, cmd_id, ended),
                             daemon=True).start()

    def run() -> CommandResult:
        return sbx.commands.run(line, envs=_pairs(env, "--env"), cwd=cwd, timeout=timeout,
                                on_stdout=_writer(sys.stdout), on_stderr=_writer(sys.stderr),
                                stdin=forward, on_start=on_start, user=user)

    try:
        status = _exec_end(sbx, run, started)
    finally:
        ended.set()
    raise typer.Exit(status)


def _exec_end(sbx: Sandbox, run: Callable[[], CommandResult], started: list[str]) -> int:
    """Run `exec`'s command to its end (`run`); its exit status, having said what went wrong."""
    try:
        result = run()
        _warn_dropped(result.dropped_bytes)
        return 0
    except CommandExitException as e:
        sys.stdout.flush()
        _warn_dropped(e.dropped_bytes)
        if e.violation is not None:
            err.print(f"[red]{escape(e.violation.message)}[/red]")
        elif e.exit_code is None:
            err.print(f"[red]{escape(e.error or 'command ended without an exit code')}[/red]")
        return quick.exit_status(e.exit_code, e.timed_out)
    except KeyboardInterrupt:
        if started:
            _interrupt(sbx, started[0])
        return 130
    finally:
        sbx.close()


def continue_exec(stream: quick.CommandStream, why: str, what: Any) -> int:
    """The rest of an `exec` that `agentbox.cli.quick` started, where its stream left off,
    done by the SDK: `why` is "broken" (resume from the offset, reconnecting as the SDK does),
    "event" (the server's error event `what`), "line" (`what` is not JSON), "timeout" (the
    stream went silent past the command's timeout and grace), "unanswered" (the POST went out
    and `what`, an exception, came instead of an answer: the command may run, so it is not
    sent again) or "interrupt" (Ctrl-C)."""
    from agentbox.sdk import protocol as p
    from agentbox.sdk.sandbox import Transport

    server = stream.server
    try:
        transport = Transport(p.resolve_config(server.key, server.url))
        sbx = Sandbox(stream.sandbox_id, transport)
        progress = p.CommandProgress(stream.sandbox_id, stream.cmd_id, stream.pid)
        progress.offset, progress.dropped = stream.offset, stream.dropped

        def run() -> CommandResult:
            if why == "interrupt":
                raise KeyboardInterrupt
            if why == "event":
                progress.feed(what)  # an error event: raises its error
            elif why == "line":
                p.parse_event_line(what)  # raises: a malformed event
            elif why in ("timeout", "unanswered"):
                import httpx

                lost: httpx.HTTPError = httpx.ReadTimeout("timed out")
                if why == "unanswered" and not isinstance(what, TimeoutError):
                    lost = httpx.ReadError(str(what) or type(what).__name__)
                raise p.transport_error(lost, server.url)
            out, errs = _writer(sys.stdout), _writer(sys.stderr)
            for kind, data in transport.follow(progress, None,
                                               p.command_read_timeout(stream.timeout)):
                (out if kind == "stdout" else errs)(data)
            return progress.outcome()

        return _exec_end(sbx, run, [stream.cmd_id] if stream.cmd_id else [])
    except AgentboxError as e:
        _print_error(e)
        return 1


@app.command()
def shell(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox to open a shell in.")],
    cmd: Annotated[str, typer.Option(help="What runs on the terminal.")] = "exec bash -i",
    cwd: Annotated[str | None, typer.Option(
        help="Working directory.", show_default="/workspace")] = None,
    user: Annotated[str | None, typer.Option(
        "--user", "-u", help='Run as "user" (uid 1000) or "root" (the sandbox\'s own root).',
        show_default="the template's user")] = None,
) -> None:
    """An interactive terminal in a sandbox, like `ssh`: a shell on a terminal of its own,
    your keys (^C, ^Z, arrows) to it as typed, resizes followed; exits with the shell's exit
    status. Needs a terminal: for pipes and scripts use `agentbox exec`."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        err.print("[red]agentbox shell needs a terminal; use agentbox exec for pipes[/red]")
        raise typer.Exit(2)
    from agentbox.cli.shell import run_shell

    raise typer.Exit(run_shell(_conn(ctx), sandbox_id, cmd, user, cwd))


@app.command()
def mcp(
    ctx: typer.Context,
    template: Annotated[str, typer.Option(
        help="Template of the session's sandbox.")] = "code-interpreter",
    isolation: Annotated[str | None, typer.Option(
        help="Isolation tier: process, container or gvisor.",
        show_default="the tenant's or server's")] = None,
    idle_timeout: Annotated[float, typer.Option(
        help="Seconds the sandbox lives after the last tool call.")] = 1800,
    on_end: Annotated[str, typer.Option(
        help="What happens to the sandbox when the client disconnects: kill, pause or keep."
    )] = "kill",
    sandbox: Annotated[str | None, typer.Option(
        help="Use this existing sandbox (resumed if paused) instead of making one.",
        show_default="a new one, made on the first tool call")] = None,
    secret: Annotated[list[str] | None, typer.Option(
        help="A tenant secret the sandbox gets (repeatable).")] = None,
    env: Annotated[list[str] | None, typer.Option(
        "--env", "-e", help="KEY=VALUE in the sandbox's environment (repeatable).")] = None,
    allow: Annotated[list[str] | None, typer.Option(
        "--allow", help="Host, *.domain, host:port or CIDR the sandbox may reach (repeatable).",
        show_default="the tenant's default network policy")] = None,
) -> None:
    """Serve agentbox's sandbox tools over MCP on stdin/stdout (for desktop and IDE agents):
    one session, one sandbox, made on the first tool call and reused. Needs the `mcp` extra
    (pip install 'agentbox[mcp]')."""
    if on_end not in ("kill", "pause", "keep"):
        err.print(f"[red]--on-end: {on_end!r}; use kill, pause or keep[/red]")
        raise typer.Exit(2)
    try:
        import mcp as _mcp  # noqa: F401
    except ImportError:
        err.print("[red]agentbox mcp needs the mcp package: pip install 'agentbox[mcp]'[/red]")
        raise typer.Exit(2) from None
    import asyncio

    from agentbox.integrations.mcp_server import serve_stdio
    from agentbox.integrations.session import SessionConfig

    config = SessionConfig(
        **_conn(ctx), template=template, isolation=isolation, timeout=idle_timeout,
        on_end=on_end,  # type: ignore[arg-type]
        sandbox_id=sandbox, secrets=list(secret or []), envs=_pairs(env, "--env"),
        network={"allow_out": list(allow)} if allow else None,
    )  # fmt: skip
    asyncio.run(serve_stdio(config))


@app.command()
def logs(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox the command runs in.")],
    cmd_id: Annotated[str, typer.Argument(help="Command (its id from the API or the SDK).")],
) -> None:
    """Print a command's output from its start (what the sandbox still holds), following it
    until it ends; exits with its exit code."""
    sbx = Sandbox.connect(sandbox_id, resume=False, **_conn(ctx))
    try:
        handle = sbx.commands.connect(cmd_id)
        result = handle.wait(on_stdout=_writer(sys.stdout), on_stderr=_writer(sys.stderr))
        _warn_dropped(result.dropped_bytes)
    except CommandExitException as e:
        sys.stdout.flush()
        _warn_dropped(e.dropped_bytes)
        raise typer.Exit(quick.exit_status(e.exit_code, e.timed_out)) from None
    finally:
        sbx.close()


def _warn_dropped(dropped: int) -> None:
    if dropped:
        sys.stdout.flush()
        err.print(f"[yellow]warning:[/yellow] {quick.DROPPED.format(dropped)}", highlight=False,
                  soft_wrap=True)


# Ctrl-C: how long the command's processes have to end after SIGINT before SIGKILL.
INTERRUPT_GRACE_S = 2.0


def _forward_stdin(sbx: Sandbox, cmd_id: str, ended: threading.Event) -> None:
    """Send this process's stdin to the command as it comes, then end its stdin."""
    warned = False
    try:
        for text, replaced in quick.utf8_pieces():
            if replaced and not warned:
                err.print(f"[yellow]warning:[/yellow] {quick.NOT_UTF8}", highlight=False,
                          soft_wrap=True)
                warned = True
            sbx.commands.send_stdin(cmd_id, text)
        sbx.commands.close_stdin(cmd_id)
    except ConflictError:
        pass  # the command ended or closed its stdin: like a pipe's reader leaving
    except Exception as e:  # a thread's traceback is no message; after the end, not news
        if not ended.is_set():
            err.print(f"[yellow]warning:[/yellow] stopped forwarding stdin: {escape(str(e))}",
                      highlight=False, soft_wrap=True)


def _interrupt(sbx: Sandbox, cmd_id: str) -> None:
    """Ctrl-C: SIGINT to the command's process tree, as a terminal sends it, then SIGKILL to
    what is left of the tree once the command ended, INTERRUPT_GRACE_S later, or at a second
    Ctrl-C (a shell's background jobs ignore SIGINT; nothing the command started outlives it)."""
    try:
        sbx.commands.kill(cmd_id, "SIGINT")
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while time.monotonic() < deadline and sbx.commands.get_info(cmd_id).running:
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    sbx.commands.kill(cmd_id)


def _writer(stream: Any) -> Any:
    def write(data: str) -> None:
        stream.write(data)
        stream.flush()

    return write


# ---------------------------------------------------------------------------- files

# `ID:/path` names a path in a sandbox; anything starting with / or . is a host path.
_REMOTE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_-]*):(.+)$")


def _remote(spec: str) -> tuple[str, str] | None:
    m = _REMOTE.match(spec)
    return (m.group(1), m.group(2)) if m else None


@app.command()
def cp(
    ctx: typer.Context,
    src: Annotated[str, typer.Argument(help="Host path, `-` (stdin) or ID:/path.")],
    dst: Annotated[str, typer.Argument(help="Host path, `-` (stdout) or ID:/path.")],
) -> None:
    """Copy a file between the host and a sandbox (streamed; one side must be ID:/path)."""
    rsrc, rdst = _remote(src), _remote(dst)
    if (rsrc is None) == (rdst is None):
        raise typer.BadParameter("exactly one of SRC and DST must be a sandbox path ID:/path")
    if rdst is not None:
        sandbox_id, path = rdst
        if path.endswith("/") and src != "-":
            path += Path(src).name
        sbx = Sandbox.connect(sandbox_id, resume=False, **_conn(ctx))
        try:
            if src == "-":
                entry = sbx.files.write(path, sys.stdin.buffer)
            else:
                local = Path(src)
                if local.is_dir():
                    raise typer.BadParameter(f"{src} is a directory; copy files one by one")
                with local.open("rb") as f:
                    entry = sbx.files.write(path, f)
        finally:
            sbx.close()
        err.print(f"{escape(src)} -> {escape(sandbox_id)}:{escape(entry.path)} "
                  f"({entry.size} bytes)", highlight=False)
        return
    assert rsrc is not None
    sandbox_id, path = rsrc
    sbx = Sandbox.connect(sandbox_id, resume=False, **_conn(ctx))
    try:
        chunks = sbx.files.read(path, format="stream")
        if dst == "-":
            for chunk in chunks:
                sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
            return
        target = Path(dst)
        if target.is_dir():
            target = target / Path(path).name
        size = 0
        with target.open("wb") as f:
            for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
    finally:
        sbx.close()
    err.print(f"{escape(sandbox_id)}:{escape(path)} -> {escape(str(target))} ({size} bytes)",
              highlight=False)


# ---------------------------------------------------------------------------- audit


@app.command()
def audit(
    ctx: typer.Context,
    sandbox: Annotated[str | None, typer.Option(
        "--sandbox", help="Only this sandbox's events.", show_default="all")] = None,
    action: Annotated[str | None, typer.Option(
        help="Only this action, e.g. command.run, file.write.", show_default="all")] = None,
    tenant: Annotated[str | None, typer.Option(
        help="Only this tenant (admin keys only).", show_default="all the key sees")] = None,
    limit: Annotated[int, typer.Option(help="At most this many events.")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    egress: Annotated[bool, typer.Option(
        "--egress", help="Show the egress log: every connection sandboxes tried to make.")] = False,
    host: Annotated[str | None, typer.Option(
        help="With --egress: only this host.", show_default="all")] = None,
    denied: Annotated[bool, typer.Option(
        "--denied", help="With --egress: only refused attempts.")] = False,
) -> None:
    """Show the audit log (or with --egress the egress log), newest first."""
    if egress:
        if action is not None:
            raise typer.BadParameter("--action does not apply to --egress", param_hint="--action")
        _egress_log(ctx, sandbox, host, denied, tenant, limit, as_json)
        return
    if host is not None or denied:
        raise typer.BadParameter("--host and --denied need --egress", param_hint="--egress")
    events = list_audit_events(sandbox_id=sandbox, action=action, tenant=tenant, limit=limit,
                               **_conn(ctx))
    if as_json:
        _print_json([dataclasses.asdict(e) for e in events])
        return
    # The tenant column only says something when an admin sees several tenants.
    show_tenant = len({e.tenant for e in events}) > 1
    rows = []
    for e in events:
        status = "-" if e.status is None else str(e.status)
        if e.status is not None and e.status >= 400:
            status = f"[red]{status}[/red]"
        rows.append([
            _time(e.time), *([escape(e.tenant)] if show_tenant else []), escape(e.action),
            escape(e.sandbox_id or "-"), status,
            escape(json.dumps(e.detail, default=str)) if e.detail else ""])
    headers = ["TIME", *(["TENANT"] if show_tenant else []), "ACTION", "SANDBOX", "STATUS",
               "DETAIL"]
    _print_table(headers, rows, last="ellipsis")


def _egress_log(ctx: typer.Context, sandbox: str | None, host: str | None, denied: bool,
                tenant: str | None, limit: int, as_json: bool) -> None:
    events = list_egress_events(sandbox_id=sandbox, host=host, allowed=False if denied else None,
                                tenant=tenant, limit=limit, **_conn(ctx))
    if as_json:
        _print_json([dataclasses.asdict(e) for e in events])
        return
    show_tenant = len({e.tenant for e in events}) > 1
    rows = [_egress_row(e, show_tenant) for e in events]
    headers = ["TIME", *(["TENANT"] if show_tenant else []), "SANDBOX", "PROTOCOL", "HOST:PORT",
               "REQUEST", "STATUS", "OUT/IN", "VERDICT", "RULE"]
    _print_table(headers, rows)


def _egress_row(e: EgressEvent, show_tenant: bool) -> list[str]:
    request = " ".join(x for x in (e.method, e.path) if x) or "-"
    status = "-" if e.status is None else str(e.status)
    if e.status is not None and e.status >= 400:
        status = f"[red]{status}[/red]"
    verdict = "[green]allowed[/green]" if e.allowed else "[red]denied[/red]"
    target = e.host if e.port is None else f"{e.host}:{e.port}"
    return [_time(e.time), *([escape(e.tenant or "-")] if show_tenant else []),
            escape(e.sandbox_id or "-"), escape(e.protocol), escape(target), escape(request),
            status, f"{_bytes(e.bytes_out)}/{_bytes(e.bytes_in)}", verdict,
            escape(e.rule or e.reason or "")]


def _bytes(n: int) -> str:
    """A byte count in a few characters (512, 1.5K, 23K, 4.7M): tables must fit 80 columns."""
    size = float(n)
    for unit in ("", "K", "M"):
        if size < 1024:
            return f"{size:.1f}{unit}" if unit and size < 10 else f"{size:.0f}{unit}"
        size /= 1024
    return f"{size:.1f}G"


# ---------------------------------------------------------------------------- entry point


def _print_error(e: AgentboxError, prefix: str = "") -> None:
    code = f" [dim]({escape(e.code)})[/dim]" if e.code and e.code != "error" else ""
    err.print(f"[red]error:[/red] {escape(prefix)}{escape(e.message)}{code}", highlight=False,
              soft_wrap=True)  # one line, whatever the width: scripts grep it


# ---------------------------------------------------------------------------- code


@app.command("run-code")
def run_code(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox to run in.")],
    code: Annotated[str, typer.Argument(help="Code to run; - reads it from stdin.")],
    language: Annotated[str | None, typer.Option(
        "--language", "-l", help="python, bash, javascript, typescript, r.",
        show_default="python")] = None,
    context: Annotated[str | None, typer.Option(
        help="Context id (not with --language).", show_default="the language's own")] = None,
    timeout: Annotated[float | None, typer.Option(
        help="Seconds (0 = none).", show_default="300")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the Execution as JSON.")] = False,
) -> None:
    """Run code in a sandbox's stateful interpreter; exit 1 if it raised."""
    if code == "-":
        code = sys.stdin.read()
    sbx = Sandbox.connect(sandbox_id, resume=False, **_conn(ctx))
    try:
        stream = not as_json
        execution = sbx.run_code(
            code, language=language, context=context, timeout=timeout,
            on_stdout=(lambda m: print(m.line, end="", flush=True)) if stream else None,
            on_stderr=(lambda m: print(m.line, end="", file=sys.stderr, flush=True))
            if stream else None)
    finally:
        sbx.close()
    if as_json:
        _print_json(dataclasses.asdict(execution))
    else:
        for r in execution.results:
            if r.is_main_result and r.text is not None:
                print(r.text)
            elif r.formats():
                err.print(f"[dim]<result: {', '.join(r.formats())}>[/dim]", highlight=False)
        if execution.error is not None:
            err.print(f"[red]{escape(execution.error.name)}[/red]: "
                      f"{escape(execution.error.value)}", highlight=False)
    if execution.error is not None:
        raise typer.Exit(1)


# ---------------------------------------------------------------------------- templates


def _size(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


@contextlib.contextmanager
def _build_progress(verbose: bool, label: str = "") -> Iterator[Callable[[dict[str, Any]], None]]:
    """A progress bar on stderr fed by a build's events (step i/n, cached or building, the
    last log line; every line with `verbose`). Not on a terminal (a log file), each step is
    a line of its own."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[note]}"),
                  TimeElapsedColumn(), console=err.console, transient=False) as progress:
        task = progress.add_task(f"{label}build", total=None, note="")

        def on_event(event: dict[str, Any]) -> None:
            kind = event.get("type")
            if kind == "step":
                note = "cached" if event.get("cached") else "building"
                if event.get("skipped"):
                    note = "nothing to do"
                progress.update(task, total=event.get("total"), completed=event.get("index", 0),
                                description=f"{label}step {event.get('name')}", note=note)
                if not err.is_terminal:
                    index = int(event.get("index", 0)) + 1
                    progress.console.print(f"{escape(label)}[{index}/{event.get('total')}] "
                                           f"{escape(str(event.get('name')))}: {note}",
                                           highlight=False)
            elif kind == "step_done":
                progress.update(task, completed=int(event.get("index", 0)) + 1)
            elif kind == "log":
                line = str(event.get("line", ""))
                if verbose:
                    progress.console.print(escape(line), highlight=False)
                progress.update(task, note=escape(line[-50:]))

        yield on_event
        progress.update(task, description=f"{label}done", note="")


@template_app.command("build")
def template_build(
    ctx: typer.Context,
    spec: Annotated[str, typer.Argument(
        help="A spec file (TOML) or the name of a shipped spec (e.g. code-interpreter).")],
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print every log line.")] = False,
) -> None:
    """Build a template, streaming its log; unchanged steps come from the cache."""
    path = Path(spec)
    text: str | None = None
    if path.suffix == ".toml" or path.exists():
        try:
            text = path.read_text()
        except OSError as e:
            err.print(f"[red]error:[/red] cannot read {escape(spec)}: {e.strerror}",
                      highlight=False)
            raise typer.Exit(1) from None
    templates = Templates(**_conn(ctx), request_timeout=3600)
    with _build_progress(verbose) as on_event:
        try:
            info = templates.build(spec=text, builtin=None if text is not None else spec,
                                   on_event=on_event, spec_dir=str(path.parent))
        finally:
            templates.close()
    out.print(f"built [bold]{escape(info.name)}[/bold] ({_size(info.size_bytes)}, "
              f"key {info.key})")


@template_app.command("ls")
def template_ls(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List built templates (and the shipped specs not built yet)."""
    with Templates(**_conn(ctx)) as templates:
        built, shipped = templates.list(), templates.builtin()
    if as_json:
        _print_json({"templates": [dataclasses.asdict(t) for t in built], "builtin": shipped})
        return
    rows = [[escape(t.name), _size(t.size_bytes), _time(t.built_at), ",".join(t.warm) or "-",
             t.key] for t in built]
    names = {t.name for t in built}
    rows += [[escape(n), "-", "not built", "-", "-"] for n in shipped if n not in names]
    _print_table(["NAME", "SIZE", "BUILT", "WARM", "KEY"], rows, last="whole")


@template_app.command("rm")
def template_rm(
    ctx: typer.Context,
    names: Annotated[list[str], typer.Argument(help="Templates to remove.")],
) -> None:
    """Remove built templates (refused while sandboxes use them)."""
    with Templates(**_conn(ctx)) as templates:
        for name in names:
            templates.remove(name)
            print(f"removed {name}")


@pool_app.command("ls")
def pool_ls(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Warm pools: size, ready members, hits, misses and refill times."""
    with Templates(**_conn(ctx)) as templates:
        pools = templates.pools()
    if as_json:
        _print_json([dataclasses.asdict(p) for p in pools])
        return
    rows = [[escape(p.template), str(p.size), str(p.ready), str(p.starting), str(p.hits),
             str(p.misses), "-" if p.refill_ms_p50 is None else f"{p.refill_ms_p50:.0f} ms",
             escape(p.last_error or "")] for p in pools]
    _print_table(["TEMPLATE", "SIZE", "READY", "STARTING", "HITS", "MISSES", "REFILL P50",
                  "LAST ERROR"], rows)


@pool_app.command("set")
def pool_set(
    ctx: typer.Context,
    template: Annotated[str, typer.Argument(help="Template of the pool.")],
    size: Annotated[int, typer.Argument(help="Sandboxes to keep ready (0 removes them).")],
) -> None:
    """Resize a warm pool (admin key)."""
    with Templates(**_conn(ctx)) as templates:
        p = templates.set_pool_size(template, size)
    print(f"pool {p.template}: size {p.size}, ready {p.ready}")


# ---------------------------------------------------------------------------- kept workspaces


@files_app.command("ls")
def files_ls(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox to look into.")],
    path: Annotated[str, typer.Argument(help="Directory.")] = "/workspace",
    depth: Annotated[int, typer.Option(help="Levels to descend.", min=1, max=64)] = 1,
    every: Annotated[bool, typer.Option(
        "--all", help="Every page (else the first, and a note on stderr if there is more).")]
    = False,
    cursor: Annotated[str | None, typer.Option(
        help="Start after this path: the cursor the page before printed.",
        show_default="the first entry")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List a directory of a running sandbox, in path order."""
    sbx = Sandbox.connect(sandbox_id, resume=False, **_conn(ctx))
    try:
        page = sbx.files.list(path, depth, cursor=cursor)
        found = list(page)
        while every and page.truncated:
            page = sbx.files.list(path, depth, cursor=page.next_cursor)
            found += page
    finally:
        sbx.close()
    if as_json:
        _print_json({"entries": [dataclasses.asdict(e) for e in found],
                     "truncated": page.truncated, "next_cursor": page.next_cursor})
    else:
        rows = [[e.type, e.permissions, _bytes(e.size), _time(e.modified_time),
                 escape(e.path + (f" -> {e.symlink_target}" if e.symlink_target else ""))]
                for e in found]
        _print_table(["TYPE", "MODE", "SIZE", "MODIFIED", "PATH"], rows, last="whole")
    if page.truncated:
        err.print(f"listing stopped after {len(found)} entries; the rest: --all, or "
                  f"--cursor {escape(shlex.quote(page.next_cursor or ''))}", highlight=False)


@workspaces_app.command("ls")
def workspaces_ls(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List your kept workspaces: size on the server's disk, when kept, when deleted."""
    with Workspaces(**_conn(ctx)) as kept:
        found = kept.list()
    if as_json:
        _print_json([dataclasses.asdict(w) for w in found])
        return
    rows = [[w.sandbox_id, _bytes(w.used_bytes), _time(w.kept_at), _time(w.expires_at),
             escape(w.template), escape(" ".join(f"{k}={v}" for k, v in w.metadata.items()))]
            for w in found]
    _print_table(["ID", "USED", "KEPT", "EXPIRES", "TEMPLATE", "METADATA"], rows)


def _save(chunks: Any, dest: str, what: str) -> None:
    """Stream chunks to a file, or to stdout for `-`."""
    if dest == "-":
        if sys.stdout.isatty():
            raise typer.BadParameter(f"{what} is binary: redirect stdout or give --output FILE")
        for chunk in chunks:
            sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
        return
    size = 0
    with open(dest, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            size += len(chunk)
    err.print(f"{escape(what)} -> {escape(dest)} ({size} bytes)", highlight=False)


@workspaces_app.command("get")
def workspaces_get(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox whose workspace was kept.")],
    path: Annotated[str, typer.Argument(help="/workspace/... or a path relative to it.")],
    output: Annotated[str, typer.Option(
        "--output", "-o", help="File to write, - for stdout.")] = "-",
) -> None:
    """Copy one file out of a kept workspace (streamed; symlinks are never followed)."""
    with Workspaces(**_conn(ctx)) as kept:
        chunks = kept.read(sandbox_id, path, format="stream")
        if output == "-":
            for chunk in chunks:
                sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
        else:
            _save(chunks, output, f"{sandbox_id}:{path}")


@workspaces_app.command("archive")
def workspaces_archive(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox whose workspace was kept.")],
    output: Annotated[str, typer.Option(
        "--output", "-o", help="Tar file to write, - for stdout.",
        show_default="SANDBOX_ID.tar")] = "",
) -> None:
    """Download a whole kept workspace as a tar archive (streamed)."""
    with Workspaces(**_conn(ctx)) as kept:
        _save(kept.archive(sandbox_id), output or f"{sandbox_id}.tar", sandbox_id)


@workspaces_app.command("rm")
def workspaces_rm(
    ctx: typer.Context,
    sandbox_ids: Annotated[list[str], typer.Argument(help="Kept workspaces to delete.")],
) -> None:
    """Delete kept workspaces (their disk goes back to your quota)."""
    with Workspaces(**_conn(ctx)) as kept:
        for sid in sandbox_ids:
            kept.remove(sid)
            print(f"removed {sid}")


def _narrowed(argv: list[str]) -> typer.Typer:
    """The app with only the command (or group) `argv` names first, when it names one: typer
    reads the signature of every command it has, on every run (~150 ms for all of this CLI's
    on this host), to build the one it then runs. Otherwise (options first, a name that is
    not a command, no argument) the whole app, with its usage and suggestions."""
    from typer.main import get_command_name

    if not argv or argv[0].startswith("-"):
        return app
    commands = [
        c for c in app.registered_commands
        if c.callback is not None
        and (c.name or get_command_name(c.callback.__name__)) == argv[0]
    ]  # fmt: skip
    groups = [g for g in app.registered_groups if g.name == argv[0]]
    if len(commands) + len(groups) != 1:
        return app
    narrow = copy.copy(app)
    narrow.registered_commands, narrow.registered_groups = commands, groups
    return narrow


def main() -> None:
    # Errors from the server end as one red line and exit 1, never a traceback.
    try:
        _narrowed(sys.argv[1:])()
    except AgentboxError as e:
        _print_error(e)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # `agentbox cp ID:/f - | head`
        quick.reader_left()
    except OSError as e:
        # A local file the command was given: missing, a directory, not writable...
        where = f": {e.filename}" if e.filename else ""
        err.print(f"[red]error:[/red] {escape((e.strerror or str(e)) + where)}", highlight=False,
                  soft_wrap=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
