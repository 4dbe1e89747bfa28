"""The `agentbox` command line: parses arguments and prints; the SDK does the talking.

`serve` and `keys create` work on the local data dir; every other command goes through the SDK
to a server (`--api-url` / AGENTBOX_API_URL, `--api-key` / AGENTBOX_API_KEY).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from agentbox import config
from agentbox.sdk import (
    AgentboxError,
    CommandExitException,
    Resources,
    Sandbox,
    SandboxInfo,
)
from agentbox.sdk.audit import list_audit_events

app = typer.Typer(
    name="agentbox", help="Self-hosted sandboxes for AI agents.", no_args_is_help=True,
    add_completion=False, pretty_exceptions_enable=False,
)
keys_app = typer.Typer(help="Manage API keys on the local data dir.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")

out = Console()
err = Console(stderr=True)

# The exit code `timeout(1)` uses, so scripts can tell a timeout from a failure.
TIMEOUT_EXIT = 124


@dataclasses.dataclass
class Connection:
    api_url: str | None
    api_key: str | None


@app.callback()
def _global(
    ctx: typer.Context,
    api_url: Annotated[str | None, typer.Option(
        "--api-url", envvar="AGENTBOX_API_URL",
        help=f"Server URL [default: {config.DEFAULT_API_URL}]")] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="AGENTBOX_API_KEY",
        help="API key [default: the local server's admin.key]")] = None,
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
        help="State dir [default: AGENTBOX_DATA_DIR, /var/lib/agentbox as root, "
             "else ~/.local/share/agentbox]")] = None,
) -> None:
    """Run the agentbox server in the foreground."""
    from agentbox.server.app import serve as run_server  # the server is heavy: load on use

    run_server(host=host, port=port, data_dir=data_dir or config.default_data_dir())


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="Tenant the key belongs to.")],
    admin: Annotated[bool, typer.Option("--admin", help="Make an admin key.")] = False,
    data_dir: Annotated[Path | None, typer.Option(help="State dir of the server.")] = None,
) -> None:
    """Create an API key in the local database (no server needed). Shown only once."""
    from agentbox.core.auth import create_key_offline
    from agentbox.core.errors import AgentboxError as CoreError

    try:
        key_id, key = create_key_offline(data_dir or config.default_data_dir(), tenant, admin)
    except CoreError as e:
        err.print(f"[red]error:[/red] {escape(e.message)}", highlight=False)
        raise typer.Exit(1) from None
    if not sys.stdout.isatty():
        # Plain, so `KEY=$(agentbox keys create --tenant t)` works.
        print(key)
        return
    out.print(Panel(
        f"[bold]{escape(key)}[/bold]\n\nkey id: {escape(key_id)}   tenant: {escape(tenant)}"
        f"   admin: {'yes' if admin else 'no'}\n[dim]Store it now: it is not shown again.[/dim]",
        title="new API key", expand=False))


# ---------------------------------------------------------------------------- sandboxes


@app.command()
def create(
    ctx: typer.Context,
    template: Annotated[str | None, typer.Option(help="Template name.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds until the sandbox ends.")] = 300,
    metadata: Annotated[list[str] | None, typer.Option(
        "--metadata", "-m", help="KEY=VALUE label (repeatable).")] = None,
    env: Annotated[list[str] | None, typer.Option(
        "--env", "-e", help="KEY=VALUE environment variable (repeatable).")] = None,
    memory_mb: Annotated[int | None, typer.Option(help="Memory limit in MiB.")] = None,
    cpu: Annotated[float | None, typer.Option(help="CPU count.")] = None,
    keep_workspace: Annotated[bool, typer.Option(
        help="Keep /workspace after the sandbox ends.")] = False,
) -> None:
    """Create a sandbox and print its id."""
    sbx = Sandbox.create(
        template=template, timeout=timeout, metadata=_pairs(metadata, "--metadata"),
        envs=_pairs(env, "--env"), resources=Resources(cpu_count=cpu, memory_mb=memory_mb),
        keep_workspace=keep_workspace, **_conn(ctx))
    sbx.close()
    print(sbx.sandbox_id)


@app.command("ls")
def list_sandboxes(
    ctx: typer.Context,
    state: Annotated[str | None, typer.Option(
        help="starting, running, killed, expired or failed (comma-separated).")] = None,
    metadata: Annotated[list[str] | None, typer.Option(
        "--metadata", "-m", help="Only sandboxes with this KEY=VALUE (repeatable).")] = None,
    limit: Annotated[int | None, typer.Option(help="At most this many.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List your sandboxes, newest first."""
    states = [s for s in (state or "").split(",") if s] or None
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


def _print_table(headers: list[str], rows: list[list[str]]) -> None:
    """Every column keeps its full width except the last, which is cut to fit the terminal."""
    widths = [max([Text.from_markup(r[i]).cell_len for r in rows] + [len(name)])
              for i, name in enumerate(headers)]
    room = out.width - sum(widths[:-1]) - 2 * (len(headers) - 1)
    table = Table(box=None, header_style="bold", pad_edge=False)
    for i, name in enumerate(headers):
        last = i == len(headers) - 1
        table.add_column(name, no_wrap=True, overflow="ellipsis",
                         width=min(widths[i], max(room, 8)) if last else widths[i])
    for row in rows:
        table.add_row(*row)
    out.print(table)


@app.command()
def kill(
    ctx: typer.Context,
    sandbox_ids: Annotated[list[str], typer.Argument(help="Sandboxes to kill.")],
) -> None:
    """Kill sandboxes."""
    failed = False
    for sandbox_id in sandbox_ids:
        try:
            sbx = Sandbox.connect(sandbox_id, **_conn(ctx))
            try:
                sbx.kill()
            finally:
                sbx.close()
        except AgentboxError as e:
            _print_error(e, f"{sandbox_id}: ")
            failed = True
            continue
        print(f"killed {sandbox_id}")
    if failed:
        raise typer.Exit(1)


# ---------------------------------------------------------------------------- commands


@app.command(name="exec", context_settings={"ignore_unknown_options": True})
def exec_command(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox to run in.")],
    cmd: Annotated[list[str], typer.Argument(help="Command, after `--`.")],
    cwd: Annotated[str | None, typer.Option(help="Working directory.")] = None,
    env: Annotated[list[str] | None, typer.Option(
        "--env", "-e", help="KEY=VALUE (repeatable).")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds; 0 = no limit.")] = 60,
) -> None:
    """Run a command in a sandbox, streaming its output; exits with its exit code.

    One argument runs as a shell line (`agentbox exec ID -- 'ls | wc -l'`); several are quoted
    as words. Death by signal N exits 128+N; a timeout exits 124.
    """
    line = cmd[0] if len(cmd) == 1 else shlex.join(cmd)
    sbx = Sandbox.connect(sandbox_id, **_conn(ctx))
    try:
        sbx.commands.run(line, envs=_pairs(env, "--env"), cwd=cwd, timeout=timeout,
                         on_stdout=_writer(sys.stdout), on_stderr=_writer(sys.stderr))
    except CommandExitException as e:
        sys.stdout.flush()
        if e.violation is not None:
            err.print(f"[red]{escape(e.violation.message)}[/red]")
        elif e.exit_code is None:
            err.print(f"[red]{escape(e.error or 'command ended without an exit code')}[/red]")
        raise typer.Exit(_exit_status(e)) from None
    finally:
        sbx.close()


def _writer(stream: Any) -> Any:
    def write(data: str) -> None:
        stream.write(data)
        stream.flush()

    return write


def _exit_status(e: CommandExitException) -> int:
    if e.timed_out:
        return TIMEOUT_EXIT
    if e.exit_code is None:
        return 1
    if e.exit_code < 0:
        return 128 - e.exit_code  # shell convention for "killed by signal N"
    return e.exit_code


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
        sbx = Sandbox.connect(sandbox_id, **_conn(ctx))
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
    sbx = Sandbox.connect(sandbox_id, **_conn(ctx))
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
    sandbox: Annotated[str | None, typer.Option("--sandbox", help="Sandbox id.")] = None,
    action: Annotated[str | None, typer.Option(help="e.g. command.run, file.write.")] = None,
    tenant: Annotated[str | None, typer.Option(help="Tenant (admin keys only).")] = None,
    limit: Annotated[int, typer.Option(help="At most this many events.")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show the audit log, newest first."""
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
    _print_table(headers, rows)


# ---------------------------------------------------------------------------- entry point


def _print_error(e: AgentboxError, prefix: str = "") -> None:
    code = f" [dim]({escape(e.code)})[/dim]" if e.code and e.code != "error" else ""
    err.print(f"[red]error:[/red] {escape(prefix)}{escape(e.message)}{code}", highlight=False)


def main() -> None:
    # Errors from the server end as one red line and exit 1, never a traceback.
    try:
        app()
    except AgentboxError as e:
        _print_error(e)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        # `agentbox cp ID:/f - | head`: the reader left; exit quietly like other tools.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)


if __name__ == "__main__":
    main()
