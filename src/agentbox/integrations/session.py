"""One agent's sandbox session, shared by every tool front end (MCP, framework adapters).

A session owns at most one sandbox: made on the first tool call that needs it (with the
session's template, tier, network and secrets), reused by every later call, and ended with
the session (killed, paused or kept: `on_end`). A session may instead start on a sandbox that
already exists (`sandbox_id`): it is connected (and resumed if paused) on first use.

Command output the model has not read yet is kept here, so a long output is paged, never cut:
each command's stdout and stderr are buffered (the newest commands' first, `output_keep`
characters in all; a command pushed out says so when asked for).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from agentbox.sdk.async_sandbox import AsyncCommandHandle, AsyncSandbox

OnEnd = Literal["kill", "pause", "keep"]
OUTPUT_KEEP = 8 << 20  # characters of command output a session keeps for paging, all commands
STREAM_KEEP = 2 << 20  # characters of one command's stdout (or stderr) kept
MAX_BACKGROUND = 32  # background commands a session follows at once


@dataclass
class SessionConfig:
    """What a session's sandbox is made with (None: the server's or tenant's default)."""

    api_url: str | None = None
    api_key: str | None = None
    template: str | None = "code-interpreter"
    isolation: str | None = None
    timeout: float = 1800  # the sandbox's idle time-out: every tool call extends it again
    network: dict[str, Any] | None = None
    secrets: list[str] = field(default_factory=list)
    envs: dict[str, str] = field(default_factory=dict)
    on_end: OnEnd = "kill"
    sandbox_id: str | None = None  # start on this sandbox instead of making one
    # Characters of command output kept for paging, all commands (one stream: half of it).
    output_keep: int = OUTPUT_KEEP


@dataclass
class Output:
    """One command's output as far as it has come (each stream's oldest part dropped past
    `stream_keep`, and counted), and whether it has ended."""

    stdout: str = ""
    stderr: str = ""
    dropped: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    exit_code: int | None = None
    error: str | None = None
    done: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    stream_keep: int = STREAM_KEEP

    def add(self, stream: str, text: str) -> None:
        kept = getattr(self, stream) + text
        if len(kept) > self.stream_keep:
            self.dropped[stream] += len(kept) - self.stream_keep
            kept = kept[-self.stream_keep :]
        setattr(self, stream, kept)
        self.changed.set()

    def size(self) -> int:
        return len(self.stdout) + len(self.stderr)


class Session:
    """A tool session: `sandbox()` makes or connects its sandbox; `close()` ends it."""

    def __init__(self, config: SessionConfig, front: str = "mcp") -> None:
        self.config = config
        self.front = front  # which front end: mcp, langchain, openai-agents
        self.id = "ses_" + secrets.token_hex(6)
        self._sandbox: AsyncSandbox | None = None
        self._lock = asyncio.Lock()
        self.outputs: OrderedDict[str, Output] = OrderedDict()
        self.evicted: set[str] = set()
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._forks: list[AsyncSandbox] = []  # made by fork_sandbox: they end with the session
        self._handles: dict[str, AsyncCommandHandle] = {}

    @property
    def label(self) -> str:
        """The session as the audit records it (`via`): `<front>:<id>`."""
        return f"{self.front}:{self.id}"

    @property
    def sandbox_id(self) -> str | None:
        return self._sandbox.sandbox_id if self._sandbox is not None else self.config.sandbox_id

    @property
    def has_sandbox(self) -> bool:
        """Whether the session has (or starts on) a sandbox: one is not made to be looked at."""
        return self._sandbox is not None or self.config.sandbox_id is not None

    async def sandbox(self) -> AsyncSandbox:
        """The session's sandbox, made (or connected) on first use; its time-out extended by
        every later use, so it ends `timeout` seconds after the session's last tool call."""
        async with self._lock:
            c = self.config
            if self._sandbox is None:
                if c.sandbox_id is not None:
                    self._sandbox = await AsyncSandbox.connect(
                        c.sandbox_id, api_key=c.api_key, api_url=c.api_url
                    )
                    await self._sandbox.set_timeout(c.timeout)
                else:
                    self._sandbox = await AsyncSandbox.create(
                        template=c.template,
                        timeout=c.timeout,
                        metadata={"session": self.label},
                        envs=c.envs or None,
                        network=c.network,  # type: ignore[arg-type]
                        secrets=c.secrets or None,
                        isolation=c.isolation,
                        api_key=c.api_key,
                        api_url=c.api_url,
                    )
            else:
                await self._sandbox.set_timeout(c.timeout)
            return self._sandbox

    # ------------------------------------------------------------------ command output

    def keep(self, cmd_id: str, out: Output) -> None:
        """Keep a command's output for paging; past `output_keep` in all, the oldest ended
        commands' output goes (and a later read of it says so)."""
        self.outputs[cmd_id] = out
        self.outputs.move_to_end(cmd_id)
        total = sum(o.size() for o in self.outputs.values())
        for old_id in list(self.outputs)[:-1]:
            if total <= self.config.output_keep:
                break
            old = self.outputs[old_id]
            if old.done:
                del self.outputs[old_id]
                self.evicted.add(old_id)
                total -= old.size()

    async def start_background(self, handle: AsyncCommandHandle) -> Output:
        if len(self._followers) >= MAX_BACKGROUND:
            raise RuntimeError(
                f"this session already follows {MAX_BACKGROUND} background commands; "
                "kill one (kill_command) or wait for one to end"
            )
        out = self.output()
        self.keep(handle.cmd_id, out)
        self._handles[handle.cmd_id] = handle

        async def follow() -> None:
            try:
                async for stdout, stderr in handle:
                    if stdout:
                        out.add("stdout", stdout)
                    if stderr:
                        out.add("stderr", stderr)
                result = await handle.wait()
                out.exit_code = result.exit_code
            except Exception as e:  # noqa: BLE001 - the command's end, however it came
                out.exit_code = getattr(e, "exit_code", None)
                out.error = str(e)
            finally:
                out.done = True
                out.changed.set()
                self._followers.pop(handle.cmd_id, None)
                self._handles.pop(handle.cmd_id, None)

        self._followers[handle.cmd_id] = asyncio.create_task(follow())
        return out

    def output(self) -> Output:
        """An empty output buffer under this session's budget."""
        return Output(stream_keep=min(STREAM_KEEP, self.config.output_keep // 2))

    def handle(self, cmd_id: str) -> AsyncCommandHandle | None:
        return self._handles.get(cmd_id)

    def adopt_fork(self, sandbox: AsyncSandbox) -> None:
        """A fork of the session's sandbox, ended (killed, paused, kept) with the session."""
        self._forks.append(sandbox)

    # ------------------------------------------------------------------ the end

    async def close(self) -> None:
        """End the session: stop following commands, then kill, pause or keep its sandbox."""
        for task in self._followers.values():
            task.cancel()
        for task in list(self._followers.values()):
            with contextlib.suppress(BaseException):
                await task
        forks, self._forks = self._forks, []
        sbx, self._sandbox = self._sandbox, None
        failed: Exception | None = None
        for each in [*forks, *([sbx] if sbx is not None else [])]:
            try:
                if self.config.on_end == "kill":
                    await each.kill()
                elif self.config.on_end == "pause":
                    await each.pause()
            except Exception as e:  # noqa: BLE001 - the others still end; the first is raised
                failed = failed or e
            finally:
                await each.close()
        if failed is not None:
            raise failed
