"""The sandbox tools an agent gets, defined once: a name, a description written for a model, a
pydantic model of the arguments (its JSON schema is the tool's input schema) and an async
function over a `Session`. Front ends (the MCP server, framework adapters) render them.

A tool answers with `Reply` parts (text, and images for plots). A failure the agent can act on
(the sandbox blocked something, a file is missing, a command failed) is a `ToolFailed`, whose
text says what happened, which setting decided it and what to do instead; front ends show it
to the model as the tool's error.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import json
import mimetypes
import posixpath
import shlex
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentbox.integrations.session import Output, Session
from agentbox.sdk.exceptions import AgentboxError, CommandExitException
from agentbox.sdk.models import CommandResult, Execution
from agentbox.sdk.protocol import via

PAGE = 16_000  # characters of one stream in one answer; the rest is paged
FILE_PAGE = 64_000  # characters (or bytes, base64) of a file in one answer


@dataclass
class Reply:
    """A tool's answer: text parts and images (PNG or JPEG, base64)."""

    texts: list[str] = field(default_factory=list)
    images: list[tuple[str, str]] = field(default_factory=list)  # (mime type, base64 data)

    def text(self) -> str:
        return "\n".join(self.texts)

    def text_only(self) -> str:
        """For front ends that answer in text alone: the images named, not inlined."""
        if not self.images:
            return self.text()
        kinds = ", ".join(mime for mime, _ in self.images)
        return f"{self.text()}\n[{len(self.images)} image(s): {kinds}]"


class ToolFailed(Exception):
    """What the model should hear when a tool could not do what it asked."""


class Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    args: type[Args]
    run: Callable[[Session, Any], Awaitable[Reply]]

    def schema(self) -> dict[str, Any]:
        return self.args.model_json_schema()


TOOLS: dict[str, Tool] = {}


def tool(name: str, description: str, args: type[Args]) -> Callable[[Any], Any]:
    def register(fn: Callable[[Session, Any], Awaitable[Reply]]) -> Any:
        TOOLS[name] = Tool(name, description, args, fn)
        return fn

    return register


async def call(session: Session, name: str, arguments: dict[str, Any] | None) -> Reply:
    """Run tool `name`; ToolFailed (with text for the model) for anything it should hear."""
    t = TOOLS.get(name)
    if t is None:
        raise ToolFailed(f"no tool named {name!r}; the tools are {', '.join(TOOLS)}")
    try:
        args = t.args.model_validate(arguments or {})
    except ValueError as e:
        raise ToolFailed(f"invalid arguments for {name}: {e}") from None
    try:
        # Every request the tool makes (and the commands it leaves running) is audited as
        # made via this session's tool.
        with via(f"{session.label}/{name}"):
            return await t.run(session, args)
    except AgentboxError as e:
        raise ToolFailed(explain(e)) from None


def explain(e: AgentboxError) -> str:
    """An SDK error as a model should read it: what, and when the sandbox blocked it, which
    setting did and how to proceed."""
    lines = [f"{e.message} (error code {e.code})"]
    if e.violation is not None:
        v = e.violation
        lines.append(f"blocked: {v.message} (code {v.code}; setting: {v.setting or 'none'})")
    hint = e.detail.get("hint") if isinstance(e.detail, dict) else None
    if hint:
        lines.append(f"what to do: {hint}")
    return "\n".join(lines)


def _page(label: str, text: str, offset: int, cmd_id: str | None, dropped: int = 0) -> str:
    """`text` from `offset` (counted from the stream's very start), at most PAGE characters,
    saying how to read the rest."""
    start = max(offset - dropped, 0)
    out = []
    if offset < dropped:
        out.append(f"[{label}: the first {dropped} characters are gone (over the buffer)]")
    chunk = text[start : start + PAGE]
    out.append(f"{label}:\n{chunk}" if chunk else f"{label}: (empty)")
    rest = len(text) - (start + len(chunk))
    if rest > 0:
        where = f"command_output(command_id={cmd_id!r}, stream={label!r}, offset="
        out.append(f"[{rest} more characters of {label}: {where}{dropped + start + len(chunk)})]")
    return "\n".join(out)


# ---------------------------------------------------------------------------- commands


class RunCommand(Args):
    command: Annotated[
        str, Field(description="A bash command line, e.g. `ls -la && python3 x.py`.")
    ]
    background: Annotated[
        bool,
        Field(
            description="Start it and return at once with a command_id (for servers and long "
            "jobs); read its output later with command_output."
        ),
    ] = False
    timeout: Annotated[
        float,
        Field(ge=0, le=3600, description="Seconds before it is killed (0: no limit)."),
    ] = 120
    cwd: Annotated[str | None, Field(description="Working directory (default /workspace).")] = None
    envs: Annotated[
        dict[str, str] | None, Field(description="Extra environment variables for it.")
    ] = None


def _command_reply(
    cmd_id: str | None, out: Output, result: CommandResult | None = None, note: str = ""
) -> Reply:
    """A command's answer: how it ended (`result`, once it has) and its output so far (`out`,
    the session's bounded copy: the SDK keeps none of a tool's command output)."""
    parts = [f"command_id: {cmd_id}" + (f" ({note})" if note else "")]
    parts.append(f"exit code: {out.exit_code}" if out.done else "still running")
    if result is not None:
        if result.timed_out:
            parts.append("it was killed at its timeout")
        violation = result.violation
        if result.error and not (violation is not None and violation.message in result.error):
            parts.append(f"error: {result.error}")
        if violation is not None:
            parts.append(f"blocked: {violation.message} (setting: {violation.setting or 'none'})")
        for attempt in result.network_blocked:
            parts.append(
                f"network blocked: {attempt.host}:{attempt.port} ({attempt.message}; "
                f"rule: {attempt.rule or 'default deny'})"
            )
    parts.append(_page("stdout", out.stdout, 0, cmd_id, out.dropped["stdout"]))
    if out.stderr or out.dropped["stderr"]:
        parts.append(_page("stderr", out.stderr, 0, cmd_id, out.dropped["stderr"]))
    return Reply([part for part in parts if part])


@tool(
    "run_command",
    "Run a shell command in the sandbox (a Linux machine of your own: bash, python3, files "
    "under /workspace). Returns its exit code, stdout and stderr; long output is paged "
    "(command_output reads the rest). With background=true it returns at once with a "
    "command_id: use it for servers and long jobs, then command_output, send_stdin or "
    "kill_command. The network is off unless the sandbox's policy allows a destination; a "
    "refused connection is reported with the rule that refused it.",
    RunCommand,
)
async def run_command(session: Session, a: RunCommand) -> Reply:
    if a.background:
        sbx = await session.sandbox()
        handle = await sbx.commands.run(
            a.command, background=True, envs=a.envs, cwd=a.cwd, timeout=a.timeout, stdin=True,
            keep_output=False,
        )  # fmt: skip
        try:
            out = await session.start_background(handle)  # type: ignore[arg-type]
        except RuntimeError as e:
            await handle.kill()  # type: ignore[union-attr]
            raise ToolFailed(str(e)) from None
        return (
            Reply([f"command_id: {handle.cmd_id} (started in the background)"])
            if not (out.stdout or out.stderr)
            else _command_reply(handle.cmd_id, out, note="started in the background")
        )
    out, result = await _foreground(session, a.command, a.timeout, envs=a.envs, cwd=a.cwd)
    cmd_id = result.cmd_id or f"fg{len(session.outputs)}"
    session.keep(cmd_id, out)
    return _command_reply(cmd_id, out, result)


async def _foreground(
    session: Session, command: str, timeout: float, **kw: Any
) -> tuple[Output, CommandResult]:
    """Run a command to its end; its output (only in the session's bounded buffer: the SDK
    keeps none) and how it ended, whatever its exit code."""
    sbx = await session.sandbox()
    out = session.output()
    try:
        result = await sbx.commands.run(
            command, timeout=timeout, keep_output=False,
            on_stdout=lambda text: out.add("stdout", text),
            on_stderr=lambda text: out.add("stderr", text), **kw,
        )  # fmt: skip
    except CommandExitException as e:
        result = CommandResult(
            stdout="", stderr="", exit_code=e.exit_code, error=e.error, timed_out=e.timed_out,
            violation=e.violation, cmd_id=e.cmd_id, network_blocked=e.network_blocked,
        )  # fmt: skip
    assert isinstance(result, CommandResult)
    out.exit_code, out.done = result.exit_code, True
    return out, result


class CommandOutput(Args):
    command_id: Annotated[str, Field(description="From run_command.")]
    stream: Literal["stdout", "stderr"] = "stdout"
    offset: Annotated[int, Field(ge=0, description="Characters already read.")] = 0
    wait: Annotated[
        float,
        Field(ge=0, le=60, description="Seconds to wait for new output of a running command."),
    ] = 0


@tool(
    "command_output",
    "Read a command's output from `offset` (what run_command or an earlier call left unread; "
    "for a background command, what it has printed so far). Says whether it is still running "
    "and its exit code once it ended.",
    CommandOutput,
)
async def command_output(session: Session, a: CommandOutput) -> Reply:
    out = session.outputs.get(a.command_id)
    if out is None:
        if a.command_id in session.evicted:
            raise ToolFailed(
                f"the output of {a.command_id} is no longer kept (this session keeps the "
                "newest commands' output); run the command again with its output in a file"
            )
        raise ToolFailed(f"no command {a.command_id!r} in this session")
    text = getattr(out, a.stream)
    if not out.done and a.wait and len(text) + out.dropped[a.stream] <= a.offset:
        out.changed.clear()
        try:
            await asyncio.wait_for(out.changed.wait(), a.wait)
        except TimeoutError:
            pass
        text = getattr(out, a.stream)
    state = f"exit code: {out.exit_code}" if out.done else "still running"
    if out.error:
        state += f"; error: {out.error}"
    body = _page(a.stream, text, a.offset, a.command_id, out.dropped[a.stream])
    return Reply([f"command_id: {a.command_id}; {state}", body])


class SendStdin(Args):
    command_id: str
    data: Annotated[str, Field(description="Text to write to its stdin (add \\n for a line).")]
    close: Annotated[bool, Field(description="Close its stdin after writing (EOF).")] = False


@tool(
    "send_stdin",
    "Write to the stdin of a background command started by run_command.",
    SendStdin,
)
async def send_stdin(session: Session, a: SendStdin) -> Reply:
    handle = session.handle(a.command_id)
    if handle is None:
        raise ToolFailed(f"no running background command {a.command_id!r} in this session")
    if a.data:
        await handle.send_stdin(a.data)
    if a.close:
        await handle.close_stdin()
    return Reply([f"sent {len(a.data)} characters" + (" and closed stdin" if a.close else "")])


class KillCommand(Args):
    command_id: str


@tool("kill_command", "Kill a background command (and everything it started).", KillCommand)
async def kill_command(session: Session, a: KillCommand) -> Reply:
    sbx = await session.sandbox()
    killed = await sbx.commands.kill(a.command_id)
    return Reply([f"{a.command_id}: " + ("killed" if killed else "was not running")])


# ---------------------------------------------------------------------------- code


class RunCode(Args):
    code: str
    language: Literal["python", "bash", "javascript", "typescript", "r"] = "python"
    context_id: Annotated[
        str | None,
        Field(description="A context from an earlier answer (default: the language's own)."),
    ] = None
    timeout: Annotated[float, Field(ge=0, le=3600)] = 300


def _code_reply(ex: Execution) -> Reply:
    reply = Reply()
    out = "".join(ex.logs.stdout)
    err = "".join(ex.logs.stderr)
    if out:
        reply.texts.append(_page("stdout", out, 0, None))
    if err:
        reply.texts.append(_page("stderr", err, 0, None))
    for r in ex.results:
        if r.png:
            reply.images.append(("image/png", r.png))
        elif r.jpeg:
            reply.images.append(("image/jpeg", r.jpeg))
        value = r.text if r.text is not None else r.markdown
        if value is not None and not (r.png or r.jpeg):
            label = "result" if r.is_main_result else "display"
            reply.texts.append(f"{label}:\n{value[:PAGE]}")
    if ex.error is not None:
        reply.texts.append(
            f"error: {ex.error.name}: {ex.error.value}\n{ex.error.traceback[-PAGE:]}"
        )
        if ex.error.violation is not None:
            v = ex.error.violation
            reply.texts.append(f"blocked: {v.message} (setting: {v.setting or 'none'})")
    if ex.timed_out:
        reply.texts.append("interrupted at its timeout; the context keeps its state")
    if not reply.texts and not reply.images:
        reply.texts.append("(no output)")
    return reply


@tool(
    "run_code",
    "Run code in a stateful interpreter in the sandbox (variables, imports and functions stay "
    "for later calls): python (a Jupyter kernel with numpy, pandas, matplotlib; plots come "
    "back as images), javascript (node), typescript (Deno), r, bash. Returns output, the "
    "last expression's value and errors with their traceback.",
    RunCode,
)
async def run_code(session: Session, a: RunCode) -> Reply:
    sbx = await session.sandbox()
    if a.context_id:
        ex = await sbx.run_code(a.code, context=a.context_id, timeout=a.timeout)
    else:
        ex = await sbx.run_code(a.code, language=a.language, timeout=a.timeout)
    return _code_reply(ex)


# ---------------------------------------------------------------------------- files


class ReadFile(Args):
    path: Annotated[str, Field(description="Absolute, or relative to /workspace.")]
    offset: Annotated[
        int, Field(ge=0, description="Characters (text) or bytes (binary) to skip.")
    ] = 0
    binary: Annotated[
        bool, Field(description="Return base64 of the bytes (for non-text files).")
    ] = False


def _abs(path: str) -> str:
    return path if path.startswith("/") else f"/workspace/{path}"


@tool(
    "read_file",
    "Read a file from the sandbox: text (default) or, with binary=true, base64. Long files are "
    "paged: the answer says which offset to ask for next.",
    ReadFile,
)
async def read_file(session: Session, a: ReadFile) -> Reply:
    sbx = await session.sandbox()
    path = _abs(a.path)
    size = (await sbx.files.get_info(path)).size
    page, more = await _read_page(await sbx.files.read(path, format="stream"), a)
    unit = "bytes" if a.binary else "characters"
    text = base64.b64encode(page).decode() if isinstance(page, bytes) else page
    parts = [f"{path} ({size} bytes; {unit} {a.offset} to {a.offset + len(page)}):", text]
    if more:
        at = a.offset + len(page)
        parts.append(f"[more of the file: read_file(path={path!r}, offset={at})]")
    return Reply(parts)


async def _read_page(stream: AsyncIterator[bytes], a: ReadFile) -> tuple[str | bytes, bool]:
    """FILE_PAGE characters (or bytes) of a file's stream from `a.offset`, and whether more
    follows. Read as it comes and dropped up to the offset, so a page of a large file takes a
    page of memory (the server's, when the session is served by it); the rest is not read."""
    end = a.offset + FILE_PAGE
    seen, kept = 0, []
    decode = codecs.getincrementaldecoder("utf-8")("replace").decode
    try:
        async for chunk in stream:
            piece: str | bytes = chunk if a.binary else decode(chunk)
            if seen + len(piece) > a.offset:
                kept.append(piece[max(a.offset - seen, 0) : end - seen])
            seen += len(piece)
            if seen > end:
                break
        else:
            if not a.binary:
                tail = decode(b"", True)
                kept.append(tail[max(a.offset - seen, 0) : end - seen])
                seen += len(tail)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    page = b"".join(kept) if a.binary else "".join(kept)  # type: ignore[arg-type]
    return page, seen > end


class WriteFile(Args):
    path: Annotated[str, Field(description="Absolute, or relative to /workspace.")]
    content: str
    base64: Annotated[bool, Field(description="`content` is base64 of the bytes to write.")] = False


@tool(
    "write_file",
    "Write a file in the sandbox (parent directories are made; an existing file is replaced).",
    WriteFile,
)
async def write_file(session: Session, a: WriteFile) -> Reply:
    sbx = await session.sandbox()
    data: str | bytes = base64.b64decode(a.content) if a.base64 else a.content
    info = await sbx.files.write(_abs(a.path), data)
    return Reply([f"wrote {info.path} ({len(data)} {'bytes' if a.base64 else 'characters'})"])


class ListFiles(Args):
    path: str = "/workspace"
    depth: Annotated[int, Field(ge=1, le=5)] = 1
    cursor: Annotated[str | None, Field(description="From an earlier answer, for the rest.")] = None


@tool(
    "list_files",
    "List a directory of the sandbox (path, type, size), to `depth` levels; a long listing "
    "is paged (the answer gives the cursor for the rest).",
    ListFiles,
)
async def list_files(session: Session, a: ListFiles) -> Reply:
    sbx = await session.sandbox()
    entries = await sbx.files.list(_abs(a.path), depth=a.depth, limit=500, cursor=a.cursor)
    lines = [f"{e.path}{'/' if e.type == 'dir' else ''}\t{e.type}\t{e.size}" for e in entries]
    if entries.truncated:
        lines.append(f"[more: list_files(path={a.path!r}, cursor={entries.next_cursor!r})]")
    return Reply([f"{_abs(a.path)}: {len(entries)} entries", *lines])


class RemoveFile(Args):
    path: str


@tool("remove_file", "Remove a file or a directory (with everything in it).", RemoveFile)
async def remove_file(session: Session, a: RemoveFile) -> Reply:
    sbx = await session.sandbox()
    await sbx.files.remove(_abs(a.path))
    return Reply([f"removed {_abs(a.path)}"])


class FetchUrl(Args):
    url: Annotated[str, Field(description="An http:// or https:// URL.")]
    path: Annotated[
        str | None,
        Field(
            description="Where to save it: absolute, or relative to /workspace (default: the "
            "URL's file name, in /workspace)."
        ),
    ] = None
    timeout: Annotated[float, Field(gt=0, le=600, description="Seconds it may take.")] = 120


@tool(
    "fetch_url",
    "Download a URL into a file of the sandbox. The download runs inside the sandbox, through "
    "its egress proxy: it works only where the sandbox's network policy allows the URL's host "
    "(a refusal says which rule refused it and how to allow it).",
    FetchUrl,
)
async def fetch_url(session: Session, a: FetchUrl) -> Reply:
    url = urllib.parse.urlsplit(a.url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ToolFailed(f"not an http:// or https:// URL with a host: {a.url!r}")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in a.url):
        raise ToolFailed("the URL has spaces or control characters: percent-encode them")
    path = _abs(a.path or posixpath.basename(url.path) or "download")
    # In the sandbox, so the egress proxy decides (and audits) where it may go; curl is in
    # every shipped template.
    command = (
        "command -v curl >/dev/null || { echo 'fetch_url needs curl in the sandbox' >&2; "
        "exit 127; }; curl -fsSL --proto =http,https --proto-redir =http,https --create-dirs "
        f"-o {shlex.quote(path)} -w '%{{http_code}} %{{size_download}} %{{content_type}}' "
        f"-- {shlex.quote(a.url)}"
    )
    out, result = await _foreground(session, command, a.timeout)
    if result.exit_code != 0:
        said = _command_reply(result.cmd_id, out, result).text()
        raise ToolFailed(f"could not fetch {a.url}\n{said}")
    status, size, kind = (out.stdout.split(" ", 2) + ["", ""])[:3]
    what = f", {kind}" if kind else ""
    return Reply([f"saved {a.url} to {path} ({size} bytes{what}; HTTP {status})"])


# ---------------------------------------------------------------------------- the sandbox


class NoArgs(Args):
    pass


@tool(
    "sandbox_info",
    "This session's sandbox: its id, template, isolation tier, state, time left, resources "
    "and network policy.",
    NoArgs,
)
async def sandbox_info(session: Session, a: NoArgs) -> Reply:  # noqa: ARG001
    sbx = await session.sandbox()
    info = _plain(await sbx.get_info())
    info.pop("access_token", None)  # it opens the sandbox's ports: expose_port gives URLs
    return Reply([json.dumps(info, default=str, indent=1)])


def _plain(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return {k: _plain(getattr(obj, k)) for k in obj.__dataclass_fields__}
    if isinstance(obj, list):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


class ExposePort(Args):
    port: Annotated[
        int, Field(ge=1, le=65535, description="A port a server in the sandbox listens on.")
    ]
    expires_in: Annotated[float, Field(gt=0, le=86400, description="Seconds the URL works.")] = 3600


@tool(
    "expose_port",
    "A URL (signed: it works without credentials until it expires) that reaches a server "
    "listening on `port` inside the sandbox (bind it to 0.0.0.0 or 127.0.0.1).",
    ExposePort,
)
async def expose_port(session: Session, a: ExposePort) -> Reply:
    sbx = await session.sandbox()
    url = await sbx.get_url(a.port, expires_in=a.expires_in)
    return Reply([url])


class SnapshotArgs(Args):
    name: Annotated[
        str | None,
        Field(description="A name to start sandboxes from it by (unique among your snapshots)."),
    ] = None


@tool(
    "snapshot_sandbox",
    "Save a copy of this sandbox's disk (its root and /workspace, not its running processes) "
    "as a snapshot that new sandboxes can start from. The sandbox is frozen only while its "
    "disk is copied.",
    SnapshotArgs,
)
async def snapshot_sandbox(session: Session, a: SnapshotArgs) -> Reply:
    sbx = await session.sandbox()
    snap = await sbx.create_snapshot(a.name)
    ref = snap.name or snap.snapshot_id
    return Reply(
        [
            f"snapshot {snap.snapshot_id}"
            + (f" ({snap.name})" if snap.name else "")
            + f" of {snap.sandbox_id}: {snap.used_bytes} bytes; a sandbox starts from it with "
            f"template={ref!r}"
        ]
    )


class ForkArgs(Args):
    count: Annotated[int, Field(ge=1, le=4, description="How many copies.")] = 1


@tool(
    "fork_sandbox",
    "Make running copies of this sandbox (its disk and settings; not its processes), each on "
    "its own from then on, to try alternatives side by side (another session or client works "
    "in one by its id). This session keeps its own sandbox; the copies end with it.",
    ForkArgs,
)
async def fork_sandbox(session: Session, a: ForkArgs) -> Reply:
    sbx = await session.sandbox()
    children = await sbx.fork(a.count)
    ids = [child.sandbox_id for child in children]
    for child in children:
        session.adopt_fork(child)
    return Reply([f"forked: {', '.join(ids)} (running; ended with this session)"])


# ---------------------------------------------------------------------------- resources

WORKSPACE = "/workspace"
RESOURCE_MAX = 4 << 20  # bytes of a file read whole as a resource; read_file pages the rest


@dataclass(frozen=True)
class WorkspaceFile:
    uri: str
    path: str
    size: int
    mime_type: str


def file_uri(path: str) -> str:
    return "file://" + urllib.parse.quote(path)


def uri_path(uri: str) -> str:
    """The workspace path a `file:///workspace/...` URI names; ToolFailed for anything else."""
    parts = urllib.parse.urlsplit(uri)
    path = posixpath.normpath(urllib.parse.unquote(parts.path)) if parts.path else ""
    if parts.scheme != "file" or parts.netloc or not path.startswith(WORKSPACE + "/"):
        raise ToolFailed(f"not a file of the sandbox's workspace: {uri!r} (file:///workspace/...)")
    return path


async def workspace_files(
    session: Session, cursor: str | None = None
) -> tuple[list[WorkspaceFile], str | None]:
    """The files under /workspace (5 levels deep), a page at a time; none while the session
    has no sandbox (listing does not make one)."""
    if not session.has_sandbox:
        return [], None
    sbx = await session.sandbox()
    entries = await sbx.files.list(WORKSPACE, depth=5, limit=500, cursor=cursor)
    files = [
        WorkspaceFile(file_uri(e.path), e.path, e.size, _mime(e.path))
        for e in entries
        if e.type == "file"
    ]
    return files, entries.next_cursor if entries.truncated else None


async def read_resource(session: Session, uri: str) -> tuple[str | bytes, str]:
    """A workspace file whole (text when it is UTF-8, else bytes), and its MIME type."""
    path = uri_path(uri)
    sbx = await session.sandbox()
    size = (await sbx.files.get_info(path)).size
    if size > RESOURCE_MAX:
        raise ToolFailed(
            f"{path} is {size} bytes, over the {RESOURCE_MAX} a resource is read whole: use "
            "the read_file tool, which pages it"
        )
    data = await sbx.files.read(path, format="bytes")
    try:
        return data.decode("utf-8"), _mime(path)
    except UnicodeDecodeError:
        return data, _mime(path, binary=True)


def _mime(path: str, binary: bool = False) -> str:
    guessed = mimetypes.guess_type(path)[0]
    return guessed or ("application/octet-stream" if binary else "text/plain")
