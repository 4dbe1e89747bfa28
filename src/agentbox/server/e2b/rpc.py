"""envd's RPC as the E2B SDKs speak it: the Connect protocol (JSON codec, HTTP/1.1) for
`process.Process` and `filesystem.Filesystem`, on the envd surface (requests that carry
`E2b-Sandbox-Id` and `E2b-Sandbox-Port: 49983`).

The Connect framing, codecs and errors are connectrpc's; the messages are generated from
proto/envd (`wire/`, scripts/gen-envd.sh). Each method is one call into the core, as the /v1
API's: the sandbox's envd token names the tenant, the core checks and audits. A process is an
agentbox command: its pid is the one the sandbox sees, its output streams as E2B's events.

A process started with a `pty` gets a terminal of its own (its output is the `pty` data; input
and Update's size go to the terminal). Directories are watched with inotify in the sandbox
(WatchDir streams; CreateWatcher's watchers hold events until polled), as many per sandbox
as the core allows (core/files.py).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import inspect
import json
import logging
import math
import secrets
import shlex
import signal
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from contextvars import ContextVar
from typing import Any, TypeVar, cast

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from agentbox.agent.client import AgentUnavailable
from agentbox.core.auth import Caller
from agentbox.core.errors import AgentboxError
from agentbox.core.requests import CommandRequest
from agentbox.server.e2b.wire.filesystem import filesystem_pb as fs
from agentbox.server.e2b.wire.filesystem.filesystem_connect import (
    Filesystem,
    FilesystemASGIApplication,
)
from agentbox.server.e2b.wire.process import process_pb as pb
from agentbox.server.e2b.wire.process.process_connect import Process, ProcessASGIApplication
from agentbox.server.surfaces import Core
from agentbox.vocab import status_of

T = TypeVar("T")
log = logging.getLogger("agentbox.e2b")

PROCESS_PATH = "/process.Process"
FILESYSTEM_PATH = "/filesystem.Filesystem"
KEEPALIVE_S = 30.0  # a silent stream carries a keepalive event this often (the SDK asks 50 s)
MAX_LIST_ENTRIES = 10_000  # ListDir answers in one message; deeper trees are refused, said so
READ_MAX_BYTES = 4 << 20  # one request message (stdin chunks are far smaller)
MAX_LIST_DEPTH = 64  # as the /v1 files API's
MAX_LIST_PAGES = 100  # agent pages read for one ListDir
MAX_TAG_CHARS = 256
KNOWN_BYTES = 16 << 20  # E2B configs and tags kept for List and tag selectors, newest first
KNOWN_PER_SANDBOX = 256
CONTENT_TYPES = frozenset(
    {"application/json", "application/proto"}
    | {"application/connect+json", "application/connect+proto"}
)

# The request's sandbox, set by _Authenticated for the call it wraps.
_BOX: ContextVar[Any] = ContextVar("agentbox_e2b_box")

_STATUS_CODES = {
    400: Code.INVALID_ARGUMENT,
    401: Code.UNAUTHENTICATED,
    403: Code.PERMISSION_DENIED,
    404: Code.NOT_FOUND,
    408: Code.DEADLINE_EXCEEDED,
    409: Code.FAILED_PRECONDITION,
    413: Code.INVALID_ARGUMENT,
    429: Code.RESOURCE_EXHAUSTED,  # the SDK says "rate limit": only for what is one
    503: Code.UNAVAILABLE,
    504: Code.DEADLINE_EXCEEDED,
    507: Code.FAILED_PRECONDITION,
}
_CODE_OVERRIDES = {
    "path_exists": Code.ALREADY_EXISTS,
    "path_not_found": Code.NOT_FOUND,
    "sandbox_not_running": Code.UNAVAILABLE,
}


def connect_error(e: AgentboxError) -> ConnectError:
    """A core error as Connect says it: the status's code, the message unchanged."""
    code = _CODE_OVERRIDES.get(e.code) or _STATUS_CODES.get(status_of(e.code), Code.INTERNAL)
    return ConnectError(code, e.message)


@asynccontextmanager
async def _said() -> AsyncIterator[None]:
    try:
        yield
    except AgentboxError as e:
        raise connect_error(e) from None


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """A service method whose failures are Connect errors: core errors by their code, anything
    else INTERNAL without its text (logged here), never an exception's words verbatim."""

    def failed(e: Exception) -> ConnectError:
        if isinstance(e, ConnectError):
            return e
        if isinstance(e, AgentboxError):
            return connect_error(e)
        log.exception("envd RPC %s failed", method.__name__)
        return ConnectError(Code.INTERNAL, "internal error (logged by the server)")

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self: Any, request: Any, ctx: RequestContext) -> AsyncIterator[Any]:
            try:
                async with aclosing(method(self, request, ctx)) as events:
                    async for event in events:
                        yield event
            except Exception as e:
                raise failed(e) from None

        return stream

    @functools.wraps(method)
    async def unary(self: Any, request: Any, ctx: RequestContext) -> Any:
        try:
            return await method(self, request, ctx)
        except Exception as e:
            raise failed(e) from None

    return unary


def _guard_methods(cls: type[T]) -> type[T]:
    for name, value in list(vars(cls).items()):
        if not name.startswith("_") and inspect.iscoroutinefunction(value):
            setattr(cls, name, _guarded(value))
        elif not name.startswith("_") and inspect.isasyncgenfunction(value):
            setattr(cls, name, _guarded(value))
    return cls


async def _call(work: Awaitable[T]) -> T:
    async with _said():
        return await work


class _Authenticated:
    """ASGI: the request's sandbox, from its headers and envd token, for the service methods
    (a method of a request without a valid token is UNAUTHENTICATED)."""

    def __init__(self, core: Core, app: ASGIApp, sandbox: Callable[[Core, Request], Any]) -> None:
        self.core, self.app, self.sandbox = core, app, sandbox

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope)
        box = self.sandbox(self.core, request)
        try:
            box.caller()  # no valid token (or not envd's port): answered before any body
        except AgentboxError as e:
            await _refuse(send, connect_error(e))
            return
        kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind not in CONTENT_TYPES:
            unsupported = ConnectError(
                Code.INVALID_ARGUMENT,
                f"content type {kind!r}: envd speaks Connect (application/json, "
                "application/proto, application/connect+json or application/connect+proto)",
            )
            await _refuse(send, unsupported, 415)
            return
        token = _BOX.set(box)
        try:
            await self.app(scope, receive, send)
        finally:
            _BOX.reset(token)


_HTTP_STATUS = {
    Code.INVALID_ARGUMENT: 400,
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.NOT_FOUND: 404,
}


async def _refuse(send: Send, error: ConnectError, status: int | None = None) -> None:
    """A Connect error answered without reading the request (Connect's unary error shape;
    a streaming client reads the HTTP status)."""
    body = json.dumps({"code": error.code.value, "message": error.message}).encode()
    status = status or _HTTP_STATUS.get(error.code, 400)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _caller() -> tuple[Caller, str]:
    """Who acts, by the request's envd token, and on which sandbox."""
    box = _BOX.get()
    try:
        return box.caller(), box.id
    except AgentboxError as e:
        raise connect_error(e) from None


def _user(ctx: RequestContext) -> str | None:
    """envd's user: `Authorization: Basic base64("name:")`; none is the sandbox's default."""
    value = ctx.request_headers.get("authorization") or ""
    if not value:
        return None
    scheme, _, encoded = value.partition(" ")
    try:
        name = base64.b64decode(encoded.strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        name = None
    if scheme.lower() != "basic" or name is None:
        raise ConnectError(Code.UNAUTHENTICATED, 'Authorization must be Basic base64("user:")')
    if name not in ("user", "root"):
        raise ConnectError(Code.PERMISSION_DENIED, f"unknown user {name!r}: use user or root")
    return name


def _shell(cfg: pb.ProcessConfig) -> str:
    """The command line agentbox runs (`bash -l -c`) for E2B's cmd and args."""
    args = list(cfg.args)
    if cfg.cmd in ("/bin/bash", "bash") and len(args) == 3 and args[:2] == ["-l", "-c"]:
        return args[2]  # the SDK's own form: the same shell agentbox starts
    if not cfg.cmd:
        raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd must not be empty")
    return "exec " + shlex.join([cfg.cmd, *args])


def _of(field: str, value: Any) -> Any:
    """A oneof's value (the generated types want each field name as a literal)."""
    return cast(Any, Oneof(field, value))


def _size(pty: pb.PTY | None) -> tuple[int, int] | None:
    """A PTY's (cols, rows); None for no PTY."""
    if pty is None:
        return None
    size = pty.size or pb.PTY.Size()
    return int(size.cols), int(size.rows)


# Go's names for the signals a process most often ends by (envd says what Go says).
_SIGNAL_WORDS = {signal.SIGKILL: "killed", signal.SIGTERM: "terminated", signal.SIGINT: "interrupt"}


def _ended(end: dict[str, Any]) -> pb.ProcessEvent.EndEvent:
    code, sig = end.get("exit_code"), end.get("signal")
    error = None
    violation = end.get("violation")
    if isinstance(violation, dict) and violation.get("message"):
        error = str(violation["message"])
    if isinstance(code, int) and 0 <= code <= 255:
        return pb.ProcessEvent.EndEvent(
            exit_code=code, exited=True, status=f"exit status {code}", error=error
        )
    if not isinstance(sig, int) and isinstance(code, int) and code < 0:
        sig = -code
    status = f"signal: {_signal_word(sig)}" if isinstance(sig, int) else "signal: killed"
    return pb.ProcessEvent.EndEvent(
        exit_code=-1, exited=False, status=status, error=error or status
    )


def _signal_word(number: int) -> str:
    try:
        sig = signal.Signals(number)
    except ValueError:
        return str(number)
    return _SIGNAL_WORDS.get(sig, sig.name.removeprefix("SIG").lower())


def _event(item: dict[str, Any], terminal: bool) -> pb.ProcessEvent | None:
    """A core command event as envd's; a stream that failed (the agent lost, the sandbox
    ended) is an error, as envd's stream would be, never a made-up exit."""
    kind = item.get("type")
    if kind in ("stdout", "stderr"):
        field = "pty" if terminal else kind  # a terminal's output is all on stdout
        out = pb.ProcessEvent.DataEvent(output=_of(field, str(item.get("data", "")).encode()))
        return pb.ProcessEvent(event=_of("data", out))
    if kind == "truncated":  # said where the reader looks, never dropped silently
        note = f"\n[agentbox] {item.get('message', 'output was dropped')}\n".encode()
        return pb.ProcessEvent(
            event=_of("data", pb.ProcessEvent.DataEvent(output=_of("stderr", note)))
        )
    if kind == "error":
        code = str(item.get("code") or "internal_error")
        raise connect_error(AgentboxError(str(item.get("message") or "stream failed"), code))
    if kind == "end":
        violation = item.get("violation")
        if isinstance(violation, dict) and violation.get("code") == "sandbox_ended":
            raise ConnectError(Code.UNAVAILABLE, str(violation.get("message")))
        return pb.ProcessEvent(event=_of("end", _ended(item)))
    return None


async def _relay(
    first: T,
    events: AsyncIterator[dict[str, Any]],
    convert: Callable[[dict[str, Any]], tuple[list[T], bool]],
    keepalive: Callable[[], T],
) -> AsyncGenerator[T, None]:
    """`first`, then each core event converted (to messages, and whether it was the last), a
    keepalive after each silent KEEPALIVE_S. The core's stream is under way before `first`
    is yielded, so closing this at any point closes it too (a command's end is then audited
    when it comes)."""
    it = aiter(events)
    pending: asyncio.Task[dict[str, Any]] | None = asyncio.ensure_future(anext(it))
    try:
        await asyncio.sleep(0)  # the task's first step runs: the core's stream has begun
        yield first
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
            if not done:
                yield keepalive()
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            except AgentUnavailable as e:
                raise ConnectError(Code.UNAVAILABLE, str(e)) from None
            messages, last = convert(item)
            for message in messages:
                yield message
            if last:
                return
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        close = getattr(it, "aclose", None)
        if close is not None:
            await close()


def _process_events(
    start: pb.ProcessEvent, events: AsyncIterator[dict[str, Any]], terminal: bool
) -> AsyncGenerator[pb.ProcessEvent, None]:
    def convert(item: dict[str, Any]) -> tuple[list[pb.ProcessEvent], bool]:
        event = _event(item, terminal)
        return ([event] if event is not None else []), item.get("type") == "end"

    def keepalive() -> pb.ProcessEvent:
        return pb.ProcessEvent(event=_of("keepalive", pb.ProcessEvent.KeepAlive()))

    return _relay(start, events, convert, keepalive)


def _pid(info: dict[str, Any]) -> int:
    pid = info.get("pid")
    return pid if isinstance(pid, int) and 0 < pid < 1 << 32 else 0


class _Known:
    """E2B's view of the processes started here: config and tag by (sandbox, command), for
    List and for tag selectors. Bounded: KNOWN_PER_SANDBOX per sandbox and KNOWN_BYTES in all,
    oldest forgotten first (List then shows the command line agentbox ran; a restart forgets
    them all)."""

    def __init__(self) -> None:
        self._configs: OrderedDict[tuple[str, str], tuple[pb.ProcessConfig, str | None, int]] = (
            OrderedDict()
        )
        self._tags: dict[tuple[str, str], str] = {}
        self._per_sandbox: dict[str, int] = {}
        self._bytes = 0

    def add(self, sandbox_id: str, cmd_id: str, cfg: pb.ProcessConfig, tag: str | None) -> None:
        size = len(cfg.to_binary()) + len(tag or "") + 128
        if size > KNOWN_BYTES // 64:
            cfg = pb.ProcessConfig(cmd=cfg.cmd[:256])  # too large to keep: its name only
            size = len(cfg.cmd) + len(tag or "") + 128
        self._forget((sandbox_id, cmd_id))
        self._configs[(sandbox_id, cmd_id)] = (cfg, tag, size)
        self._per_sandbox[sandbox_id] = self._per_sandbox.get(sandbox_id, 0) + 1
        self._bytes += size
        if tag is not None:
            self._tags[(sandbox_id, tag)] = cmd_id
        while self._per_sandbox[sandbox_id] > KNOWN_PER_SANDBOX:
            oldest = next(k for k in self._configs if k[0] == sandbox_id)
            self._forget(oldest)
        while self._bytes > KNOWN_BYTES:
            self._forget(next(iter(self._configs)))

    def _forget(self, key: tuple[str, str]) -> None:
        known = self._configs.pop(key, None)
        if known is None:
            return
        _, tag, size = known
        self._bytes -= size
        self._per_sandbox[key[0]] -= 1
        if not self._per_sandbox[key[0]]:
            del self._per_sandbox[key[0]]
        if tag is not None and self._tags.get((key[0], tag)) == key[1]:
            del self._tags[(key[0], tag)]

    def get(self, sandbox_id: str, cmd_id: str) -> tuple[pb.ProcessConfig, str | None] | None:
        known = self._configs.get((sandbox_id, cmd_id))
        return None if known is None else (known[0], known[1])

    def by_tag(self, sandbox_id: str, tag: str) -> str | None:
        return self._tags.get((sandbox_id, tag))


@_guard_methods
class ProcessService(Process):
    """process.Process: commands of the request's sandbox."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.known = _Known()

    async def _running(self, caller: Caller, sandbox_id: str) -> list[dict[str, Any]]:
        commands = self.core.manager.commands
        listed = await _call(commands.list(caller, sandbox_id))
        return [c for c in listed if c.get("running")]

    async def _select(
        self, caller: Caller, sandbox_id: str, selector: pb.ProcessSelector | None
    ) -> dict[str, Any]:
        """The running command a selector names (by pid or by tag)."""
        which = selector.selector if selector is not None else None
        if which is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "process: give a pid or a tag")
        running = await self._running(caller, sandbox_id)
        if which.field == "pid":
            found = [c for c in running if c.get("pid") == which.value]
        else:
            cmd_id = self.known.by_tag(sandbox_id, which.value)
            found = [c for c in running if c.get("cmd_id") == cmd_id]
        if not found:
            raise ConnectError(Code.NOT_FOUND, f"no process with {which.field} {which.value}")
        return found[0]

    async def list(self, request: pb.ListRequest, ctx: RequestContext) -> pb.ListResponse:
        caller, sandbox_id = _caller()
        out = []
        for c in await self._running(caller, sandbox_id):
            known = self.known.get(sandbox_id, str(c.get("cmd_id")))
            if known is not None:
                cfg, tag = known
            else:
                cmd = str(c.get("cmd", ""))
                cfg, tag = pb.ProcessConfig(cmd="/bin/bash", args=["-l", "-c", cmd]), None
                if c.get("cwd"):
                    cfg.cwd = str(c["cwd"])
            out.append(pb.ProcessInfo(config=cfg, pid=_pid(c), tag=tag))
        return pb.ListResponse(processes=out)

    async def start(
        self, request: pb.StartRequest, ctx: RequestContext
    ) -> AsyncIterator[pb.StartResponse]:
        caller, sandbox_id = _caller()
        size = _size(request.pty)
        cfg = request.process or pb.ProcessConfig()
        if request.tag is not None and len(request.tag) > MAX_TAG_CHARS:
            raise ConnectError(Code.INVALID_ARGUMENT, f"tag: at most {MAX_TAG_CHARS} characters")
        # envd's process lives as long as the call's deadline (the SDK's `timeout`; none when
        # 0), and its stdin is open unless the request says otherwise.
        left = ctx.timeout_ms
        req = CommandRequest(
            cmd=_shell(cfg),
            cwd=cfg.cwd or None,
            user=_user(ctx),
            envs=dict(cfg.envs),
            timeout=max(left / 1000, 0.001) if left is not None else 0,
            stdin=request.stdin if request.has_field("stdin") else True,
            pty=size,
        )
        info, events = await _call(self.core.manager.commands.run_command(caller, sandbox_id, req))
        self.known.add(sandbox_id, str(info["cmd_id"]), cfg, request.tag)
        start = pb.ProcessEvent(event=_of("start", pb.ProcessEvent.StartEvent(pid=_pid(info))))
        async with aclosing(_process_events(start, events, size is not None)) as stream:
            async for event in stream:
                yield pb.StartResponse(event=event)

    async def connect(
        self, request: pb.ConnectRequest, ctx: RequestContext
    ) -> AsyncIterator[pb.ConnectResponse]:
        """The process's output from its start (all agentbox still holds), then its end."""
        caller, sandbox_id = _caller()
        c = await self._select(caller, sandbox_id, request.process)
        commands = self.core.manager.commands
        events = await _call(commands.command_events(caller, sandbox_id, str(c["cmd_id"]), 0))
        start = pb.ProcessEvent(event=_of("start", pb.ProcessEvent.StartEvent(pid=_pid(c))))
        async with aclosing(_process_events(start, events, bool(c.get("pty")))) as stream:
            async for event in stream:
                yield pb.ConnectResponse(event=event)

    async def update(self, request: pb.UpdateRequest, ctx: RequestContext) -> pb.UpdateResponse:
        """A terminal's new size (the only update envd has)."""
        caller, sandbox_id = _caller()
        size = _size(request.pty)
        c = await self._select(caller, sandbox_id, request.process)
        if size is not None:
            commands = self.core.manager.commands
            cmd_id = str(c["cmd_id"])
            await _call(commands.command_resize(caller, sandbox_id, cmd_id, *size))
        return pb.UpdateResponse()

    async def _input(
        self, caller: Caller, sandbox_id: str, c: dict[str, Any], given: pb.ProcessInput | None
    ) -> None:
        which = given.input if given is not None else None
        if which is None:
            return
        try:
            text = bytes(which.value).decode()
        except UnicodeDecodeError:
            raise ConnectError(
                Code.INVALID_ARGUMENT, "stdin must be UTF-8 text on agentbox"
            ) from None
        commands = self.core.manager.commands
        await _call(commands.command_stdin(caller, sandbox_id, str(c["cmd_id"]), text, False))

    async def send_input(
        self, request: pb.SendInputRequest, ctx: RequestContext
    ) -> pb.SendInputResponse:
        caller, sandbox_id = _caller()
        c = await self._select(caller, sandbox_id, request.process)
        await self._input(caller, sandbox_id, c, request.input)
        return pb.SendInputResponse()

    async def stream_input(
        self, requests: AsyncIterator[pb.StreamInputRequest], ctx: RequestContext
    ) -> pb.StreamInputResponse:
        caller, sandbox_id = _caller()
        c: dict[str, Any] | None = None
        async for r in requests:
            event = r.event
            if event is None or event.field == "keepalive":
                continue
            if event.field == "start":
                c = await self._select(caller, sandbox_id, event.value.process)
            elif c is None:
                raise ConnectError(Code.INVALID_ARGUMENT, "the stream's first event is start")
            else:
                await self._input(caller, sandbox_id, c, event.value.input)
        return pb.StreamInputResponse()

    async def send_signal(
        self, request: pb.SendSignalRequest, ctx: RequestContext
    ) -> pb.SendSignalResponse:
        caller, sandbox_id = _caller()
        sig = int(request.signal)
        if sig not in (signal.SIGTERM, signal.SIGKILL):
            raise ConnectError(Code.INVALID_ARGUMENT, "signal must be SIGTERM or SIGKILL")
        c = await self._select(caller, sandbox_id, request.process)
        commands = self.core.manager.commands
        await _call(commands.command_kill(caller, sandbox_id, str(c["cmd_id"]), sig))
        return pb.SendSignalResponse()

    async def close_stdin(
        self, request: pb.CloseStdinRequest, ctx: RequestContext
    ) -> pb.CloseStdinResponse:
        caller, sandbox_id = _caller()
        c = await self._select(caller, sandbox_id, request.process)
        if c.get("stdin") is False:  # closed already: as envd, that is no error
            return pb.CloseStdinResponse()
        commands = self.core.manager.commands
        await _call(commands.command_stdin(caller, sandbox_id, str(c["cmd_id"]), "", True))
        return pb.CloseStdinResponse()


_FILE_TYPES = {
    "file": fs.FileType.FILE,
    "dir": fs.FileType.DIRECTORY,
    "symlink": fs.FileType.SYMLINK,
}


def entry_info(entry: dict[str, Any]) -> fs.EntryInfo:
    """An agent's file entry as envd's EntryInfo (SDKs before 2.55 have no is_symlink; they
    skip fields they do not know)."""
    path = str(entry.get("path", ""))
    try:  # any time a file may carry, within what a Timestamp holds (years 1 to 9999)
        modified = min(max(float(entry.get("modified_time") or 0), -62135596800.0), 253402300799.0)
    except (TypeError, ValueError):
        modified = 0.0
    seconds = math.floor(modified)
    nanos = min(int((modified - seconds) * 1e9), 999_999_999)
    info = fs.EntryInfo(
        name=str(entry.get("name") or path.rsplit("/", 1)[-1]),
        type=_FILE_TYPES.get(str(entry.get("type")), fs.FileType.UNSPECIFIED),
        path=path,
        size=_within(entry.get("size"), 1 << 63),
        mode=_within(entry.get("mode"), 1 << 32),
        permissions=str(entry.get("permissions") or ""),
        modified_time=Timestamp(seconds=seconds, nanos=nanos),
        is_symlink=entry.get("type") == "symlink",
    )
    if entry.get("symlink_target") is not None:
        info.symlink_target = str(entry["symlink_target"])
    metadata = entry.get("metadata")
    if isinstance(metadata, dict):  # a file's user.e2b.* xattrs (E2B's file metadata)
        info.metadata.update({str(k): str(v) for k, v in metadata.items()})
    return info


def _within(value: object, bound: int) -> int:
    """A non-negative count the agent gave, 0 when it is not one that fits."""
    return value if isinstance(value, int) and 0 <= value < bound else 0


_EVENT_TYPES = {
    "create": fs.EventType.CREATE,
    "write": fs.EventType.WRITE,
    "remove": fs.EventType.REMOVE,
    "rename": fs.EventType.RENAME,
    "chmod": fs.EventType.CHMOD,
}
WATCHER_EVENTS = 2048  # a pollable watcher's events held until polled, at most
WATCHER_BYTES = 256 << 10  # and their names' bytes
MAX_WATCHERS = 16  # pollable watchers per sandbox, failed ones until polled or swept too
WATCHER_IDLE_S = 600.0  # a watcher not polled this long is removed


def _fs_event(item: dict[str, Any]) -> fs.FilesystemEvent:
    """An agent's watch event as envd's; a queue overflow is an error, never a silent gap."""
    if item.get("type") == "overflow":
        raise ConnectError(
            Code.RESOURCE_EXHAUSTED,
            "events were lost (the sandbox's kernel dropped some, or the tree grew past what "
            f"one watch follows{': ' + str(item['message']) if item.get('message') else ''}): "
            "list the directory, then watch it again",
        )
    kind = _EVENT_TYPES.get(str(item.get("op")), fs.EventType.UNSPECIFIED)
    event = fs.FilesystemEvent(name=str(item.get("name", "")), type=kind)
    if isinstance(item.get("entry"), dict):  # asked for with include_entry
        event.entry = entry_info(item["entry"])
    return event


class _Watcher:
    """A pollable watcher (CreateWatcher): its events wait here for GetWatcherEvents."""

    def __init__(self, sandbox_id: str, events: AsyncIterator[dict[str, Any]]) -> None:
        self.sandbox_id = sandbox_id
        self.events: list[fs.FilesystemEvent] = []
        self.held = 0  # bytes of the names in `events`
        self.failed: ConnectError | None = None
        self.polled = time.monotonic()
        self.task = asyncio.ensure_future(self._follow(events))

    async def _follow(self, events: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async with aclosing(events) as stream:  # type: ignore[type-var]
                async for item in stream:
                    if item.get("type") == "keepalive":
                        continue
                    event = _fs_event(item)
                    self.events.append(event)
                    self.held += len(event.name) + 16
                    if len(self.events) > WATCHER_EVENTS or self.held > WATCHER_BYTES:
                        raise ConnectError(
                            Code.RESOURCE_EXHAUSTED,
                            f"more than {WATCHER_EVENTS} events waited to be polled: poll "
                            "more often, or watch a smaller tree",
                        )
        except ConnectError as e:
            self.failed = e
        except AgentUnavailable as e:
            self.failed = ConnectError(Code.UNAVAILABLE, str(e))
        else:
            self.failed = ConnectError(Code.UNAVAILABLE, "the watch ended with the sandbox")

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@_guard_methods
class FilesystemService(Filesystem):
    """filesystem.Filesystem: the request's sandbox's files, as the /v1 files API's."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._watchers: dict[str, _Watcher] = {}

    async def stat(self, request: fs.StatRequest, ctx: RequestContext) -> fs.StatResponse:
        caller, sandbox_id = _caller()
        files = self.core.manager.files
        entry = await _call(files.stat(caller, sandbox_id, request.path, _user(ctx)))
        return fs.StatResponse(entry=entry_info(entry))

    async def make_dir(self, request: fs.MakeDirRequest, ctx: RequestContext) -> fs.MakeDirResponse:
        caller, sandbox_id = _caller()
        files = self.core.manager.files
        try:
            reply = await files.make_dir(caller, sandbox_id, request.path, _user(ctx))
        except AgentboxError as e:
            if e.code == "path_exists":  # a file is there: envd's "invalid", not "exists"
                raise ConnectError(Code.INVALID_ARGUMENT, e.message) from None
            raise
        if not reply.get("created"):  # envd's answer, which the SDK reads as "not made"
            raise ConnectError(Code.ALREADY_EXISTS, f"directory {request.path} already exists")
        return fs.MakeDirResponse(entry=entry_info(reply.get("entry") or {}))

    async def move(self, request: fs.MoveRequest, ctx: RequestContext) -> fs.MoveResponse:
        caller, sandbox_id = _caller()
        files = self.core.manager.files
        src, dst, user = request.source, request.destination, _user(ctx)
        entry = await _call(files.rename(caller, sandbox_id, src, dst, user))
        return fs.MoveResponse(entry=entry_info(entry))

    async def list_dir(self, request: fs.ListDirRequest, ctx: RequestContext) -> fs.ListDirResponse:
        caller, sandbox_id = _caller()
        files, user = self.core.manager.files, _user(ctx)
        depth = max(int(request.depth), 1)
        if depth > MAX_LIST_DEPTH:
            raise ConnectError(Code.INVALID_ARGUMENT, f"depth: at most {MAX_LIST_DEPTH}")
        entries: list[fs.EntryInfo] = []
        cursor: str | None = None
        for _ in range(MAX_LIST_PAGES):
            page = await _call(
                files.list(caller, sandbox_id, request.path, depth, None, cursor, user)
            )
            entries += [entry_info(e) for e in page["entries"]]
            if len(entries) > MAX_LIST_ENTRIES:
                raise ConnectError(
                    Code.FAILED_PRECONDITION,
                    f"more than {MAX_LIST_ENTRIES} entries under {request.path}: list with a "
                    "smaller depth, or page through agentbox's /v1 files API",
                )
            following = page.get("next_cursor")
            if not page.get("truncated") or not following:
                return fs.ListDirResponse(entries=entries)
            if following == cursor or not page["entries"]:  # a page that does not advance
                break
            cursor = following
        raise ConnectError(Code.INTERNAL, "the sandbox's listing did not advance; try again")

    async def remove(self, request: fs.RemoveRequest, ctx: RequestContext) -> fs.RemoveResponse:
        caller, sandbox_id = _caller()
        files = self.core.manager.files
        await _call(files.remove(caller, sandbox_id, request.path, _user(ctx)))
        return fs.RemoveResponse()

    async def watch_dir(
        self, request: fs.WatchDirRequest, ctx: RequestContext
    ) -> AsyncIterator[fs.WatchDirResponse]:
        """The directory's changes, streamed: a start event once the watch is set, then
        create/write/remove/rename/chmod events by name (relative to the directory)."""
        caller, sandbox_id = _caller()
        files = self.core.manager.files
        path, recursive, user = request.path, request.recursive, _user(ctx)
        entries = request.include_entry
        events = await _call(files.watch(caller, sandbox_id, path, recursive, user, entries))

        def convert(item: dict[str, Any]) -> tuple[list[fs.WatchDirResponse], bool]:
            if item.get("type") == "keepalive":
                return [], False
            return [fs.WatchDirResponse(event=_of("filesystem", _fs_event(item)))], False

        def keepalive() -> fs.WatchDirResponse:
            return fs.WatchDirResponse(event=_of("keepalive", fs.WatchDirResponse.KeepAlive()))

        start = fs.WatchDirResponse(event=_of("start", fs.WatchDirResponse.StartEvent()))
        async with aclosing(_relay(start, events, convert, keepalive)) as stream:
            async for message in stream:
                yield message

    async def create_watcher(
        self, request: fs.CreateWatcherRequest, ctx: RequestContext
    ) -> fs.CreateWatcherResponse:
        caller, sandbox_id = _caller()
        user = _user(ctx)
        await self._sweep()
        if sum(w.sandbox_id == sandbox_id for w in self._watchers.values()) >= MAX_WATCHERS:
            raise ConnectError(
                Code.FAILED_PRECONDITION,
                f"this sandbox has {MAX_WATCHERS} watchers: remove one (remove_watcher) first",
            )
        files = self.core.manager.files
        path, recursive, entries = request.path, request.recursive, request.include_entry
        events = await _call(files.watch(caller, sandbox_id, path, recursive, user, entries))
        watcher_id = secrets.token_hex(12)
        self._watchers[watcher_id] = _Watcher(sandbox_id, events)
        await asyncio.sleep(0)  # its task has begun: a stop now closes the agent's stream
        return fs.CreateWatcherResponse(watcher_id=watcher_id)

    async def get_watcher_events(
        self, request: fs.GetWatcherEventsRequest, ctx: RequestContext
    ) -> fs.GetWatcherEventsResponse:
        _, sandbox_id = _caller()
        await self._sweep()
        watcher = self._watcher(sandbox_id, request.watcher_id)
        events, watcher.events, watcher.held = watcher.events, [], 0
        watcher.polled = time.monotonic()
        if not events and watcher.failed is not None:
            await self._drop(request.watcher_id)
            raise watcher.failed
        return fs.GetWatcherEventsResponse(events=events)

    async def remove_watcher(
        self, request: fs.RemoveWatcherRequest, ctx: RequestContext
    ) -> fs.RemoveWatcherResponse:
        _, sandbox_id = _caller()
        self._watcher(sandbox_id, request.watcher_id)
        await self._drop(request.watcher_id)
        return fs.RemoveWatcherResponse()

    def _watcher(self, sandbox_id: str, watcher_id: str) -> _Watcher:
        watcher = self._watchers.get(watcher_id)
        if watcher is None or watcher.sandbox_id != sandbox_id:
            raise ConnectError(Code.NOT_FOUND, f"no watcher {watcher_id[:64]!r} in this sandbox")
        return watcher

    async def _drop(self, watcher_id: str) -> None:
        watcher = self._watchers.pop(watcher_id, None)
        if watcher is not None:
            await watcher.stop()

    async def _sweep(self) -> None:
        """Watchers nobody polled for WATCHER_IDLE_S, whose sandbox no longer runs, or that
        failed with nothing left to give, go (with the events they held)."""
        now = time.monotonic()
        manager = self.core.manager
        for watcher_id, w in list(self._watchers.items()):
            gone = manager.running_row(w.sandbox_id) is None
            if gone or now - w.polled > WATCHER_IDLE_S or (w.failed is not None and not w.events):
                await self._drop(watcher_id)


def rpc_apps(core: Core, sandbox: Callable[[Core, Request], Any]) -> dict[str, ASGIApp]:
    """The Connect apps by path prefix, each behind the envd token check."""
    process = ProcessASGIApplication(ProcessService(core), read_max_bytes=READ_MAX_BYTES)
    filesystem = FilesystemASGIApplication(FilesystemService(core), read_max_bytes=READ_MAX_BYTES)
    return {
        PROCESS_PATH: _Authenticated(core, process, sandbox),
        FILESYSTEM_PATH: _Authenticated(core, filesystem, sandbox),
    }
