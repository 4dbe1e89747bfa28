"""envd's `process.Process` service: a process is an agentbox command, its pid the one the
sandbox sees, its output streamed as E2B's events. A process started with a `pty` gets a
terminal of its own (its output is the `pty` data; input and Update's size go to the
terminal)."""

from __future__ import annotations

import shlex
import signal
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext

from agentbox.core.auth import Caller
from agentbox.core.errors import AgentboxError
from agentbox.core.requests import CommandRequest
from agentbox.server.e2b.common import sandbox_home
from agentbox.server.e2b.connect import (
    call,
    connect_error,
    guard_methods,
    oneof,
    relay,
    request_caller,
    request_user,
)
from agentbox.server.e2b.wire.process import process_pb as pb
from agentbox.server.e2b.wire.process.process_connect import Process
from agentbox.server.surfaces import Core

MAX_TAG_CHARS = 256
KNOWN_BYTES = 16 << 20  # E2B configs and tags kept for List and tag selectors, newest first
KNOWN_PER_SANDBOX = 256


def _shell(cfg: pb.ProcessConfig) -> str:
    """The command line agentbox runs (`bash -l -c`) for E2B's cmd and args."""
    args = list(cfg.args)
    if cfg.cmd in ("/bin/bash", "bash") and len(args) == 3 and args[:2] == ["-l", "-c"]:
        return args[2]  # the SDK's own form: the same shell agentbox starts
    if not cfg.cmd:
        raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd must not be empty")
    return "exec " + shlex.join([cfg.cmd, *args])


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
        out = pb.ProcessEvent.DataEvent(output=oneof(field, str(item.get("data", "")).encode()))
        return pb.ProcessEvent(event=oneof("data", out))
    if kind == "truncated":  # said where the reader looks, never dropped silently
        note = f"\n[agentbox] {item.get('message', 'output was dropped')}\n".encode()
        return pb.ProcessEvent(
            event=oneof("data", pb.ProcessEvent.DataEvent(output=oneof("stderr", note)))
        )
    if kind == "error":
        code = str(item.get("code") or "internal_error")
        raise connect_error(AgentboxError(str(item.get("message") or "stream failed"), code))
    if kind == "end":
        violation = item.get("violation")
        if isinstance(violation, dict) and violation.get("code") == "sandbox_ended":
            raise ConnectError(Code.UNAVAILABLE, str(violation.get("message")))
        return pb.ProcessEvent(event=oneof("end", _ended(item)))
    return None


def _process_events(
    start: pb.ProcessEvent, events: AsyncIterator[dict[str, Any]], terminal: bool
) -> AsyncGenerator[pb.ProcessEvent, None]:
    def convert(item: dict[str, Any]) -> tuple[list[pb.ProcessEvent], bool]:
        event = _event(item, terminal)
        return ([event] if event is not None else []), item.get("type") == "end"

    def keepalive() -> pb.ProcessEvent:
        return pb.ProcessEvent(event=oneof("keepalive", pb.ProcessEvent.KeepAlive()))

    return relay(start, events, convert, keepalive)


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


@guard_methods
class ProcessService(Process):
    """process.Process: commands of the request's sandbox."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.known = _Known()

    async def _running(self, caller: Caller, sandbox_id: str) -> list[dict[str, Any]]:
        commands = self.core.manager.commands
        listed = await call(commands.list(caller, sandbox_id))
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
        caller, sandbox_id = request_caller()
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
        caller, sandbox_id = request_caller()
        size = _size(request.pty)
        cfg = request.process or pb.ProcessConfig()
        if request.tag is not None and len(request.tag) > MAX_TAG_CHARS:
            raise ConnectError(Code.INVALID_ARGUMENT, f"tag: at most {MAX_TAG_CHARS} characters")
        # envd's process lives as long as the call's deadline (the SDK's `timeout`; none when
        # 0), and its stdin is open unless the request says otherwise.
        left = ctx.timeout_ms
        user = request_user(ctx)
        # E2B's user lives in /home/user: its home and working directory where the sandbox has
        # the workspace mounted there (the same files as /workspace).
        home = sandbox_home(self.core, sandbox_id) if user != "root" else None
        req = CommandRequest(
            cmd=_shell(cfg),
            cwd=cfg.cwd or home,
            user=user,
            envs={**({"HOME": home} if home else {}), **dict(cfg.envs)},
            timeout=max(left / 1000, 0.001) if left is not None else 0,
            stdin=request.stdin if request.has_field("stdin") else True,
            pty=size,
        )
        info, events = await call(self.core.manager.commands.run_command(caller, sandbox_id, req))
        self.known.add(sandbox_id, str(info["cmd_id"]), cfg, request.tag)
        start = pb.ProcessEvent(event=oneof("start", pb.ProcessEvent.StartEvent(pid=_pid(info))))
        async with aclosing(_process_events(start, events, size is not None)) as stream:
            async for event in stream:
                yield pb.StartResponse(event=event)

    async def connect(
        self, request: pb.ConnectRequest, ctx: RequestContext
    ) -> AsyncIterator[pb.ConnectResponse]:
        """The process's output from its start (all agentbox still holds), then its end."""
        caller, sandbox_id = request_caller()
        c = await self._select(caller, sandbox_id, request.process)
        commands = self.core.manager.commands
        events = await call(commands.command_events(caller, sandbox_id, str(c["cmd_id"]), 0))
        start = pb.ProcessEvent(event=oneof("start", pb.ProcessEvent.StartEvent(pid=_pid(c))))
        async with aclosing(_process_events(start, events, bool(c.get("pty")))) as stream:
            async for event in stream:
                yield pb.ConnectResponse(event=event)

    async def update(self, request: pb.UpdateRequest, ctx: RequestContext) -> pb.UpdateResponse:
        """A terminal's new size (the only update envd has)."""
        caller, sandbox_id = request_caller()
        size = _size(request.pty)
        c = await self._select(caller, sandbox_id, request.process)
        if size is not None:
            commands = self.core.manager.commands
            cmd_id = str(c["cmd_id"])
            await call(commands.command_resize(caller, sandbox_id, cmd_id, *size))
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
        await call(commands.command_stdin(caller, sandbox_id, str(c["cmd_id"]), text, False))

    async def send_input(
        self, request: pb.SendInputRequest, ctx: RequestContext
    ) -> pb.SendInputResponse:
        caller, sandbox_id = request_caller()
        c = await self._select(caller, sandbox_id, request.process)
        await self._input(caller, sandbox_id, c, request.input)
        return pb.SendInputResponse()

    async def stream_input(
        self, requests: AsyncIterator[pb.StreamInputRequest], ctx: RequestContext
    ) -> pb.StreamInputResponse:
        caller, sandbox_id = request_caller()
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
        caller, sandbox_id = request_caller()
        sig = int(request.signal)
        if sig not in (signal.SIGTERM, signal.SIGKILL):
            raise ConnectError(Code.INVALID_ARGUMENT, "signal must be SIGTERM or SIGKILL")
        c = await self._select(caller, sandbox_id, request.process)
        commands = self.core.manager.commands
        await call(commands.command_kill(caller, sandbox_id, str(c["cmd_id"]), sig))
        return pb.SendSignalResponse()

    async def close_stdin(
        self, request: pb.CloseStdinRequest, ctx: RequestContext
    ) -> pb.CloseStdinResponse:
        caller, sandbox_id = request_caller()
        c = await self._select(caller, sandbox_id, request.process)
        if c.get("stdin") is False:  # closed already: as envd, that is no error
            return pb.CloseStdinResponse()
        commands = self.core.manager.commands
        await call(commands.command_stdin(caller, sandbox_id, str(c["cmd_id"]), "", True))
        return pb.CloseStdinResponse()
