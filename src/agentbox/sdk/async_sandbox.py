"""`AsyncSandbox`: the asyncio face of the SDK (httpx.AsyncClient over the shared `protocol`).

Same API as `Sandbox` with `await`; streams are async iterators and output callbacks may be
plain functions or coroutine functions.

This file is the source of both faces: `scripts/unasync.py` generates `sandbox.py` from it, so
write docstrings that read right for both once `await`/`async` are dropped and `AsyncX` is `X`
(see that script for every rewrite). What cannot be generated lives in `faces.py`.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, TypeVar, overload

import httpx

from agentbox.sdk import protocol as p
from agentbox.sdk.exceptions import AgentboxError, InvalidArgumentError, NotFoundError
from agentbox.sdk.faces import (
    AsyncLiveOutput,
    AsyncOutputCallback,
    AsyncWriteData,
    AsyncWriteEntry,
    async_deliver,
    async_upload_body,
)
from agentbox.sdk.models import (
    BuildProgress,
    CommandInfo,
    CommandResult,
    Context,
    EntryInfo,
    EntryList,
    Execution,
    ExecutionError,
    FilesystemEvent,
    KeptWorkspace,
    OutputMessage,
    PoolStats,
    Resources,
    Result,
    SandboxInfo,
    SandboxMetrics,
    SecretInfo,
    SnapshotInfo,
    TemplateInfo,
    VolumeInfo,
)
from agentbox.sdk.variants import class_variant
from agentbox.vocab import DEFAULT_LANGUAGE, LIVE_FILTER, ErrorCode, SandboxState

T = TypeVar("T")


class AsyncTransport:
    """One httpx.AsyncClient for a server and key; maps every transport failure to the SDK's."""

    def __init__(self, config: p.ClientConfig) -> None:
        self.config = config
        self.client = httpx.AsyncClient(**p.client_options(config))

    async def call(self, call: p.Call[T], content: Any = None) -> T:
        try:
            response = await self.client.request(
                call.method,
                call.path,
                params=call.params,
                json=call.json,
                content=content,
                headers=p.call_headers(),
                timeout=p.call_timeout(self.config, call),
            )
        except httpx.HTTPError as e:
            raise p.transport_error(e, self.config.api_url) from None
        return p.finish(call, response)

    async def open(self, call: p.Call[Any], read_timeout: float | None) -> httpx.Response:
        """Send and return the response with its body unread; the caller must close it."""
        request = self.client.build_request(
            call.method,
            call.path,
            params=call.params,
            json=call.json,
            headers=p.call_headers(),
            timeout=p.stream_timeout(self.config, read_timeout, call),
        )
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise p.transport_error(e, self.config.api_url) from None
        if response.is_error:
            try:
                await response.aread()
            except httpx.HTTPError as e:
                raise p.transport_error(e, self.config.api_url) from None
            finally:
                await response.aclose()
            raise p.error_from_response(response)
        return response

    async def events(
        self, call: p.Call[Any], read_timeout: float | None
    ) -> AsyncIterator[dict[str, Any]]:
        response = await self.open(call, read_timeout)
        try:
            async for line in response.aiter_lines():
                event = p.parse_event_line(line)
                if event is not None:
                    yield event
        except httpx.HTTPError as e:
            raise p.transport_error(e, self.config.api_url) from None
        finally:
            await response.aclose()

    async def follow(
        self, progress: p.CommandProgress, first: p.Call[Any] | None, read_timeout: float | None
    ) -> AsyncIterator[tuple[str, str]]:
        """Output of a command until its `end` event, resuming dropped streams at the offset."""
        call = first or progress.resume()
        failures = 0
        while not progress.done:
            error: AgentboxError
            try:
                async for event in self.events(call, read_timeout):
                    failures = 0
                    out = progress.feed(event)
                    if out is not None:
                        yield out
                    if progress.done:
                        return
                error = p.ConnectionFailedError(
                    "the command stream ended before the command", code=ErrorCode.CONNECTION_FAILED
                )
            except AgentboxError as e:
                if not p.may_reconnect(e) or progress.cmd_id is None:
                    raise
                error = e
            if failures >= p.MAX_RECONNECTS:
                raise error
            await asyncio.sleep(p.reconnect_delay(failures))
            failures += 1
            call = progress.resume()

    async def bytes_stream(self, call: p.Call[Any]) -> AsyncIterator[bytes]:
        # Opened now, so a missing file raises here rather than when the first chunk is asked.
        response = await self.open(call, p.request_timeout(self.config, call))

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_bytes(p.CHUNK_SIZE):
                    yield chunk
            except httpx.HTTPError as e:
                raise p.transport_error(e, self.config.api_url) from None
            finally:
                await response.aclose()

        return chunks()

    async def close(self) -> None:
        await self.client.aclose()

    async def __aenter__(self) -> AsyncTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _found(transport: AsyncTransport, call: p.Call[Any]) -> bool:
    """Send `call`; False when what it names does not exist (E2B's kills answer so)."""
    try:
        await transport.call(call)
    except NotFoundError:
        return False
    return True


class AsyncCommandHandle(p.CommandHandleBase):
    """A command running in the background: wait for it, stream it, feed it stdin, kill it.

    Made with output callbacks, it delivers the output to them as it arrives (in the sync SDK,
    during `wait()`); then `wait()` gives the result and the handle cannot be iterated."""

    def __init__(
        self,
        commands: AsyncCommands,
        cmd_id: str,
        pid: int | None,
        on_stdout: AsyncOutputCallback | None = None,
        on_stderr: AsyncOutputCallback | None = None,
        request_timeout: float | None = None,
        keep_output: bool = True,
    ) -> None:
        self._commands = commands
        self._progress = p.CommandProgress(
            commands._sandbox_id, cmd_id, pid, request_timeout=request_timeout,
            keep_output=keep_output,
        )  # fmt: skip
        self._on_stdout = on_stdout
        self._on_stderr = on_stderr
        self._live: AsyncLiveOutput | None = None
        if on_stdout is not None or on_stderr is not None:
            self._live = AsyncLiveOutput(self._deliver_output)

    async def __aiter__(self) -> AsyncIterator[tuple[str | None, str | None]]:
        """Yields (stdout, stderr) pairs with one side set, until the command ends."""
        if self._live is not None:
            raise InvalidArgumentError(
                "this command's output goes to its on_stdout/on_stderr callbacks; use wait()",
                code=ErrorCode.INVALID_REQUEST,
            )
        async for stream, data in self._follow():
            yield (data, None) if stream == "stdout" else (None, data)

    async def _follow(self) -> AsyncIterator[tuple[str, str]]:
        if self._progress.done:
            return
        async for out in self._commands._transport.follow(self._progress, None, None):
            yield out

    async def _deliver_output(self) -> None:
        async for stream, data in self._follow():
            await async_deliver(self._on_stdout if stream == "stdout" else self._on_stderr, data)

    async def wait(
        self,
        on_stdout: AsyncOutputCallback | None = None,
        on_stderr: AsyncOutputCallback | None = None,
    ) -> CommandResult:
        """Block until the command ends; raises CommandExitException unless it exited 0.

        Callbacks given here get the output from now on, in place of those given to `run`."""
        self._on_stdout = on_stdout or self._on_stdout
        self._on_stderr = on_stderr or self._on_stderr
        if self._live is not None:
            await self._live.wait()
        else:
            await self._deliver_output()
        return self._progress.outcome()

    async def kill(self) -> bool:
        return await self._commands.kill(self.cmd_id)

    async def send_stdin(self, data: str) -> None:
        await self._commands.send_stdin(self.cmd_id, data)

    async def close_stdin(self) -> None:
        await self._commands.close_stdin(self.cmd_id)


class AsyncCommands:
    """`sbx.commands`: run shell commands (`bash -l -c`) in the sandbox."""

    def __init__(self, sandbox_id: str, transport: AsyncTransport) -> None:
        self._sandbox_id = sandbox_id
        self._transport = transport

    @overload
    async def run(
        self,
        cmd: str,
        background: Literal[False] = False,
        envs: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float = 60,
        on_stdout: AsyncOutputCallback | None = None,
        on_stderr: AsyncOutputCallback | None = None,
        stdin: bool = False,
        on_start: Callable[[str], Any] | None = None,
        *,
        user: str | None = None,
        request_timeout: float | None = None,
        keep_output: bool = True,
    ) -> CommandResult: ...

    @overload
    async def run(
        self,
        cmd: str,
        background: Literal[True],
        envs: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float = 60,
        on_stdout: AsyncOutputCallback | None = None,
        on_stderr: AsyncOutputCallback | None = None,
        stdin: bool = False,
        on_start: Callable[[str], Any] | None = None,
        *,
        user: str | None = None,
        request_timeout: float | None = None,
        keep_output: bool = True,
    ) -> AsyncCommandHandle: ...

    async def run(
        self,
        cmd: str,
        background: bool = False,
        envs: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float = 60,
        on_stdout: AsyncOutputCallback | None = None,
        on_stderr: AsyncOutputCallback | None = None,
        stdin: bool = False,
        on_start: Callable[[str], Any] | None = None,
        *,
        user: str | None = None,
        request_timeout: float | None = None,
        keep_output: bool = True,
    ) -> CommandResult | AsyncCommandHandle:
        """Run `cmd` in `cwd` (default /workspace) as `user` ("user", uid 1000, or "root", the
        sandbox's own root; default: the template's); `timeout` seconds (0 = none) is enforced
        by the server. `request_timeout` overrides the client's for the HTTP requests (not the
        command's run time).

        Foreground: streams output to the callbacks as it arrives, returns the result, and
        raises CommandExitException (CommandTimeoutError on timeout) unless it exited 0.
        `on_start` is called with the command's id as soon as it started (from the task
        running it: it must not block), e.g. to `send_stdin` (with `stdin=True`) or `kill` it
        from another task.
        Background: returns a CommandHandle at once; its output goes to the callbacks as it
        arrives, from a task following the command (in the sync SDK: during `wait()`).
        `keep_output=False`: the output goes only to the callbacks (or the handle's iteration),
        and the result's stdout and stderr stay empty: a long-running command's output then
        takes no memory here beyond what the callbacks keep.
        """
        if background:
            info = await self._transport.call(
                p.timed(
                    p.start_command(self._sandbox_id, cmd, envs, cwd, timeout, stdin, user),
                    request_timeout,
                )
            )
            if on_start is not None:
                on_start(info.cmd_id)
            return AsyncCommandHandle(
                self, info.cmd_id, info.pid, on_stdout, on_stderr, request_timeout, keep_output
            )
        progress = p.CommandProgress(
            self._sandbox_id, cmd=cmd, on_start=on_start, request_timeout=request_timeout,
            keep_output=keep_output,
        )  # fmt: skip
        first = p.timed(
            p.run_command(self._sandbox_id, cmd, envs, cwd, timeout, stdin, user),
            request_timeout,
        )
        async for stream, data in self._transport.follow(
            progress, first, p.command_read_timeout(timeout)
        ):
            await async_deliver(on_stdout if stream == "stdout" else on_stderr, data)
        return progress.outcome()

    async def list(self, *, request_timeout: float | None = None) -> list[CommandInfo]:
        return await self._transport.call(
            p.timed(p.list_commands(self._sandbox_id), request_timeout)
        )

    async def get_info(self, cmd_id: str, *, request_timeout: float | None = None) -> CommandInfo:
        return await self._transport.call(
            p.timed(p.get_command(self._sandbox_id, cmd_id), request_timeout)
        )

    async def connect(self, cmd_id: str) -> AsyncCommandHandle:
        """A handle on a command started earlier (its buffered output is replayed)."""
        info = await self.get_info(cmd_id)
        return AsyncCommandHandle(self, info.cmd_id, info.pid)

    async def kill(
        self, cmd_id: str, signal: str | int = "SIGKILL", *, request_timeout: float | None = None
    ) -> bool:
        """Kill the command's process tree; False when there is no such command."""
        call = p.kill_command(self._sandbox_id, cmd_id, signal)
        return await _found(self._transport, p.timed(call, request_timeout))

    async def send_stdin(
        self, cmd_id: str, data: str, *, request_timeout: float | None = None
    ) -> None:
        await self._transport.call(
            p.timed(p.command_stdin(self._sandbox_id, cmd_id, data, False), request_timeout)
        )

    async def close_stdin(self, cmd_id: str, *, request_timeout: float | None = None) -> None:
        await self._transport.call(
            p.timed(p.command_stdin(self._sandbox_id, cmd_id, "", True), request_timeout)
        )


class AsyncPty:
    """`sbx.pty`: terminals, each a command on a pty of its own (`/dev/pts/N`, its controlling
    terminal: job control and ^C work), its output one stream (on_data / stdout). Attach a
    live client to one over the WebSocket `.../commands/{cmd_id}/terminal` (as `agentbox
    shell` does)."""

    def __init__(self, commands: AsyncCommands) -> None:
        self._commands = commands

    async def create(
        self,
        cols: int = 80,
        rows: int = 24,
        on_data: AsyncOutputCallback | None = None,
        cmd: str = "exec bash -i",
        envs: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float = 0,
        *,
        user: str | None = None,
        request_timeout: float | None = None,
    ) -> AsyncCommandHandle:
        """Start `cmd` (an interactive shell) on a `cols` x `rows` terminal; its handle takes
        input (`send_stdin`), and `wait()` gives its exit. `timeout` 0: none."""
        c = self._commands
        info = await c._transport.call(
            p.timed(
                p.start_command(c._sandbox_id, cmd, envs, cwd, timeout, True, user, (cols, rows)),
                request_timeout,
            )
        )
        return AsyncCommandHandle(c, info.cmd_id, info.pid, on_data, None, request_timeout)

    async def resize(
        self, cmd_id: str, cols: int, rows: int, *, request_timeout: float | None = None
    ) -> None:
        c = self._commands
        await c._transport.call(
            p.timed(p.resize_command(c._sandbox_id, cmd_id, cols, rows), request_timeout)
        )

    async def send_input(
        self, cmd_id: str, data: str, *, request_timeout: float | None = None
    ) -> None:
        await self._commands.send_stdin(cmd_id, data, request_timeout=request_timeout)

    async def kill(self, cmd_id: str, *, request_timeout: float | None = None) -> bool:
        return await self._commands.kill(cmd_id, request_timeout=request_timeout)


class AsyncFiles:
    """`sbx.files`: the sandbox file system. Paths are absolute or relative to /workspace."""

    def __init__(self, sandbox_id: str, transport: AsyncTransport) -> None:
        self._sandbox_id = sandbox_id
        self._transport = transport

    @overload
    async def read(
        self,
        path: str,
        format: Literal["text"] = "text",
        *,
        user: str | None = None,
        request_timeout: float | None = None,
    ) -> str: ...

    @overload
    async def read(
        self,
        path: str,
        format: Literal["bytes"],
        *,
        user: str | None = None,
        request_timeout: float | None = None,
    ) -> bytes: ...

    @overload
    async def read(
        self,
        path: str,
        format: Literal["stream"],
        *,
        user: str | None = None,
        request_timeout: float | None = None,
    ) -> AsyncIterator[bytes]: ...

    async def read(
        self,
        path: str,
        format: Literal["text", "bytes", "stream"] = "text",
        *,
        user: str | None = None,
        request_timeout: float | None = None,
    ) -> str | bytes | AsyncIterator[bytes]:
        """The file's content; `stream` yields chunks as they arrive (iterate it to the end).

        Every method here takes `user` ("user" or "root": whose permissions apply and who owns
        what is made; default the template's user, as on E2B) and `request_timeout`: seconds
        for this call's HTTP request (for a read, of silence between chunks) in place of the
        client's."""
        stream = await self._transport.bytes_stream(
            p.timed(p.read_file(self._sandbox_id, path, user), request_timeout)
        )
        if format == "stream":
            return stream
        data = b"".join([chunk async for chunk in stream])
        return data if format == "bytes" else p.decode_text(data)

    async def write(
        self,
        path: str,
        data: AsyncWriteData,
        *,
        user: str | None = None,
        request_timeout: float | None = None,
    ) -> EntryInfo:
        """Write (atomically) from str, bytes, a binary file object or an iterable of chunks."""
        return await self._transport.call(
            p.timed(p.write_file(self._sandbox_id, path, user), request_timeout),
            async_upload_body(data),
        )

    async def write_files(
        self,
        files: Sequence[AsyncWriteEntry],
        *,
        user: str | None = None,
        request_timeout: float | None = None,
    ) -> builtins.list[EntryInfo]:
        """Write several files, in order: `[{"path": ..., "data": ...}, ...]` (data as for
        `write`). Each file is written atomically, the set is not: when one fails, the files
        before it stay written."""
        entries = [p.write_entry(entry) for entry in files]  # all checked before any is written
        return [
            await self.write(path, data, user=user, request_timeout=request_timeout)
            for path, data in entries
        ]

    async def list(
        self,
        path: str = "/workspace",
        depth: int = 1,
        *,
        limit: int | None = None,
        cursor: str | None = None,
        user: str | None = None,
        request_timeout: float | None = None,
    ) -> EntryList:
        """Entries under `path` to `depth` levels, in path order. A listing stops at `limit`
        entries (the server's page size, 10,000, by default): then `.truncated` is True and
        `list(path, depth, cursor=page.next_cursor)` gives the next page."""
        return await self._transport.call(
            p.timed(
                p.list_files(self._sandbox_id, path, depth, limit, cursor, user), request_timeout
            )
        )

    async def exists(
        self, path: str, *, user: str | None = None, request_timeout: float | None = None
    ) -> bool:
        try:
            await self.get_info(path, user=user, request_timeout=request_timeout)
        except AgentboxError as e:
            if p.is_missing_path(e):
                return False
            raise
        return True

    async def get_info(
        self, path: str, *, user: str | None = None, request_timeout: float | None = None
    ) -> EntryInfo:
        return await self._transport.call(
            p.timed(p.stat_file(self._sandbox_id, path, user), request_timeout)
        )

    async def watch_dir(
        self,
        path: str,
        *,
        recursive: bool = False,
        user: str | None = None,
        request_timeout: float | None = None,
    ) -> AsyncIterator[FilesystemEvent]:
        """The directory's changes as they happen, until you stop iterating (close the
        iterator, or leave the loop): create, write, remove, rename, chmod, by name relative
        to the directory; `recursive` follows the whole tree, new directories too. A missing
        directory raises here; lost events end the iteration with an error, never a gap."""
        call = p.timed(p.watch_dir(self._sandbox_id, path, recursive, user), request_timeout)
        lines = self._transport.events(call, None)
        await anext(lines)  # the start line: the watch is set (or the error raised)

        async def changes() -> AsyncIterator[FilesystemEvent]:
            try:
                async for line in lines:
                    event = p.watch_event(line)
                    if event is not None:
                        yield event
            finally:
                close = getattr(lines, "aclose", None)  # the HTTP stream with it
                if close is not None:
                    await close()

        return changes()

    async def make_dir(
        self, path: str, *, user: str | None = None, request_timeout: float | None = None
    ) -> bool:
        """Create the directory and its parents; False if it already existed."""
        return await self._transport.call(
            p.timed(p.make_dir(self._sandbox_id, path, user), request_timeout)
        )

    async def remove(
        self, path: str, *, user: str | None = None, request_timeout: float | None = None
    ) -> None:
        await self._transport.call(
            p.timed(p.remove_file(self._sandbox_id, path, user), request_timeout)
        )

    async def rename(
        self,
        src: str,
        dst: str,
        *,
        user: str | None = None,
        request_timeout: float | None = None,
    ) -> EntryInfo:
        return await self._transport.call(
            p.timed(p.rename_file(self._sandbox_id, src, dst, user), request_timeout)
        )


class AsyncTemplates:
    """Templates (root filesystems built offline) and warm pools: `AsyncTemplates()` with a key.

    Building, removing and sizing pools need an admin key; listing needs any key."""

    def __init__(
        self, api_key: str | None = None, api_url: str | None = None, request_timeout: float = 60
    ) -> None:
        self._transport = AsyncTransport(p.resolve_config(api_key, api_url, request_timeout))

    async def list(self) -> list[TemplateInfo]:
        templates, _ = await self._transport.call(p.list_templates())
        return templates

    async def builtin(self) -> builtins.list[str]:
        """Names of the specs agentbox ships (built on first use)."""
        _, shipped = await self._transport.call(p.list_templates())
        return shipped

    async def get(self, name: str) -> TemplateInfo:
        return await self._transport.call(p.get_template(name))

    async def build(
        self,
        spec: str | None = None,
        builtin: str | None = None,
        on_event: Callable[[dict[str, Any]], Any] | None = None,
        spec_dir: str | None = None,
    ) -> TemplateInfo:
        """Build from a spec's TOML text or a shipped spec's name; build log events go to
        `on_event` as they come. Files the spec names by `src` are read from `spec_dir` and
        sent along. Unchanged steps come from the cache."""
        name: str | None = None
        files = p.spec_files(spec, spec_dir) if spec is not None and spec_dir else None
        async for event in self._transport.events(p.build_template(spec, builtin, files), None):
            await async_deliver(on_event, event)
            if event.get("type") == "error":
                raise p.error_from_code(ErrorCode.BUILD_FAILED, str(event.get("message", "")))
            if event.get("type") == "done":
                name = str((event.get("template") or {}).get("name", ""))
        if not name:
            raise AgentboxError(
                "the build stream ended before the build did", code=ErrorCode.STREAM_ENDED
            )
        return await self.get(name)

    async def remove(self, name: str) -> None:
        await self._transport.call(p.remove_template(name))

    async def pools(self) -> builtins.list[PoolStats]:
        return await self._transport.call(p.list_pools())

    async def set_pool_size(self, template: str, size: int) -> PoolStats:
        return await self._transport.call(p.set_pool_size(template, size))

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncTemplates:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncSecrets:
    """The tenant's secrets: `AsyncSecrets()` with a key. Values go in and never come back out.

    A sandbox created with `secrets=["NAME"]` sees only a placeholder in $NAME; the egress
    proxy swaps in the value on requests to the secret's `hosts`, in its `headers` only
    (default Authorization, Basic credentials included; the URL too when `in_url`), over TLS
    it verified (plain HTTP only with `allow_plaintext`), and scrubs the value out of those
    hosts' responses, so the sandbox can use a credential it cannot read."""

    def __init__(
        self, api_key: str | None = None, api_url: str | None = None, request_timeout: float = 60
    ) -> None:
        self._transport = AsyncTransport(p.resolve_config(api_key, api_url, request_timeout))

    async def set(
        self,
        name: str,
        value: str,
        hosts: str | Sequence[str],
        in_url: bool = False,
        headers: str | Sequence[str] | None = None,
        allow_plaintext: bool = False,
    ) -> SecretInfo:
        """Create or replace a secret; `hosts` (example.com, *.example.com) are the only
        destinations its value is ever sent to, `headers` (default Authorization) the only
        headers it goes in. `name` is an environment variable name."""
        return await self._transport.call(
            p.set_secret(name, value, hosts, in_url, headers, allow_plaintext)
        )

    async def list(self) -> builtins.list[SecretInfo]:
        return await self._transport.call(p.list_secrets())

    async def remove(self, name: str) -> None:
        """NotFoundError if there is no such secret. Running sandboxes lose it at once."""
        await self._transport.call(p.remove_secret(name))

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncSecrets:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncWorkspaces:
    """Kept workspaces: the /workspace of your ended sandboxes created with
    `keep_workspace=True`, until you remove them or the server's retention does (7 days by
    default). They count against your tenant's disk quota. `AsyncWorkspaces()` with a key."""

    def __init__(
        self, api_key: str | None = None, api_url: str | None = None, request_timeout: float = 60
    ) -> None:
        self._transport = AsyncTransport(p.resolve_config(api_key, api_url, request_timeout))

    async def list(self) -> list[KeptWorkspace]:
        """Your kept workspaces, most recently kept first."""
        return await self._transport.call(p.list_workspaces())

    @overload
    async def read(self, sandbox_id: str, path: str, format: Literal["text"] = "text") -> str: ...

    @overload
    async def read(self, sandbox_id: str, path: str, format: Literal["bytes"]) -> bytes: ...

    @overload
    async def read(
        self, sandbox_id: str, path: str, format: Literal["stream"]
    ) -> AsyncIterator[bytes]: ...

    async def read(
        self, sandbox_id: str, path: str, format: Literal["text", "bytes", "stream"] = "text"
    ) -> str | bytes | AsyncIterator[bytes]:
        """One file (`/workspace/...` or relative to it); symlinks are never followed."""
        stream = await self._transport.bytes_stream(p.read_workspace_file(sandbox_id, path))
        if format == "stream":
            return stream
        data = b"".join([chunk async for chunk in stream])
        return data if format == "bytes" else p.decode_text(data)

    async def archive(self, sandbox_id: str) -> AsyncIterator[bytes]:
        """The whole workspace as a tar stream (GNU tar; symlinks as links), in chunks:
        iterate it to the end, e.g. into a file or `tarfile.open(fileobj=..., mode="r|")`."""
        return await self._transport.bytes_stream(p.workspace_archive(sandbox_id))

    async def remove(self, sandbox_id: str) -> None:
        """NotFoundError if there is no such kept workspace (of your tenant)."""
        await self._transport.call(p.remove_workspace(sandbox_id))

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncWorkspaces:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncVolumes:
    """Volumes: named filesystems of your tenant that outlive sandboxes. Mount one with
    `AsyncSandbox.create(volume_mounts={"/data": "NAME"})`: one sandbox at a time read-write,
    any number read-only. While no sandbox mounts it, `read` and `write` reach its files.
    `AsyncVolumes()` with a key."""

    def __init__(
        self, api_key: str | None = None, api_url: str | None = None, request_timeout: float = 60
    ) -> None:
        self._transport = AsyncTransport(p.resolve_config(api_key, api_url, request_timeout))

    async def create(
        self, name: str, size_mb: int, metadata: Mapping[str, str] | None = None
    ) -> VolumeInfo:
        """A new, empty volume that holds `size_mb` MiB."""
        return await self._transport.call(p.create_volume(name, size_mb, metadata))

    async def list(self) -> list[VolumeInfo]:
        return await self._transport.call(p.list_volumes())

    async def get(self, ref: str) -> VolumeInfo:
        """By id or name; NotFoundError if you have none such."""
        return await self._transport.call(p.get_volume(ref))

    async def delete(self, ref: str) -> None:
        """ConflictError while a live sandbox mounts it."""
        await self._transport.call(p.delete_volume(ref))

    async def read(self, ref: str, path: str) -> bytes:
        return await self._transport.call(p.read_volume_file(ref, path))

    async def write(self, ref: str, path: str, data: bytes | str) -> int:
        """Write one file (its missing directories made); the bytes written."""
        content = data.encode() if isinstance(data, str) else data
        return await self._transport.call(p.write_volume_file(ref, path), content=content)

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncVolumes:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# What `AsyncSandbox.kill(id)`, `.set_timeout(id, t)` and `.get_info(id)` mean on the class.


async def _kill_by_id(
    sandbox_id: str,
    api_key: str | None = None,
    api_url: str | None = None,
    request_timeout: float = 60,
) -> bool:
    """Kill the sandbox `sandbox_id`; False when you have no such sandbox (killing an ended
    one is fine)."""
    async with AsyncTransport(p.resolve_config(api_key, api_url, request_timeout)) as transport:
        return await _found(transport, p.kill_sandbox(sandbox_id))


async def _set_timeout_by_id(
    sandbox_id: str,
    timeout: float,
    api_key: str | None = None,
    api_url: str | None = None,
    request_timeout: float = 60,
) -> SandboxInfo:
    """The sandbox `sandbox_id` now ends `timeout` seconds from now."""
    async with AsyncTransport(p.resolve_config(api_key, api_url, request_timeout)) as transport:
        return await transport.call(p.set_timeout(sandbox_id, timeout))


async def _get_info_by_id(
    sandbox_id: str,
    api_key: str | None = None,
    api_url: str | None = None,
    request_timeout: float = 60,
) -> SandboxInfo:
    """The sandbox `sandbox_id`; NotFoundError if it is not yours or does not exist."""
    async with AsyncTransport(p.resolve_config(api_key, api_url, request_timeout)) as transport:
        return await transport.call(p.get_sandbox(sandbox_id))


# What `AsyncSandbox.list_snapshots()`, `.get_snapshot(ref)` and `.delete_snapshot(ref)` mean on
# the class (on a sandbox, they use its connection).


async def _list_snapshots_by_key(
    api_key: str | None = None,
    api_url: str | None = None,
    request_timeout: float = 60,
) -> list[SnapshotInfo]:
    """Your snapshots, oldest first."""
    async with AsyncTransport(p.resolve_config(api_key, api_url, request_timeout)) as transport:
        return await transport.call(p.list_snapshots())


async def _get_snapshot_by_ref(
    ref: str,
    api_key: str | None = None,
    api_url: str | None = None,
    request_timeout: float = 60,
) -> SnapshotInfo:
    """The snapshot `ref` (its id or name); NotFoundError if you have no such snapshot."""
    async with AsyncTransport(p.resolve_config(api_key, api_url, request_timeout)) as transport:
        return await transport.call(p.get_snapshot(ref))


async def _delete_snapshot_by_ref(
    ref: str,
    api_key: str | None = None,
    api_url: str | None = None,
    request_timeout: float = 60,
) -> None:
    """Delete the snapshot `ref` (its id or name); sandboxes started from it keep their own
    copies. NotFoundError if you have no such snapshot."""
    async with AsyncTransport(p.resolve_config(api_key, api_url, request_timeout)) as transport:
        await transport.call(p.delete_snapshot(ref))


class AsyncSandbox:
    """An agentbox sandbox. Make one with `AsyncSandbox.create()` or `AsyncSandbox.connect(id)`.

    `async with await AsyncSandbox.create() as sbx:` kills the sandbox when the block ends.
    As in E2B, `kill`, `set_timeout` and `get_info` also work on the class with a sandbox id
    (`AsyncSandbox.kill(sandbox_id, api_key=...)`), and calls take `request_timeout=` to
    override the client's for that call. So do `list_snapshots`, `get_snapshot` and
    `delete_snapshot` (`AsyncSandbox.get_snapshot(ref, api_key=...)`): on a sandbox, they
    use its connection.
    """

    def __init__(
        self, sandbox_id: str, transport: AsyncTransport, info: SandboxInfo | None = None
    ) -> None:
        self.sandbox_id = sandbox_id
        self._transport = transport
        self._info = info
        self.commands = AsyncCommands(sandbox_id, transport)
        self.pty = AsyncPty(self.commands)
        self.files = AsyncFiles(sandbox_id, transport)

    def __repr__(self) -> str:
        return f"AsyncSandbox(sandbox_id={self.sandbox_id!r})"

    @classmethod
    async def create(
        cls,
        template: str | None = None,
        timeout: float = 300,
        metadata: Mapping[str, str] | None = None,
        envs: Mapping[str, str] | None = None,
        resources: Resources | Mapping[str, Any] | None = None,
        keep_workspace: bool = False,
        network: p.NetworkSpec | None = None,
        secrets: Sequence[str] | None = None,
        allow_internet_access: bool | None = None,
        api_key: str | None = None,
        api_url: str | None = None,
        request_timeout: float = 60,
        on_progress: Callable[[BuildProgress], None] | None = None,
        runtime: str | None = None,
        isolation: str | None = None,
        lifecycle: Mapping[str, Any] | None = None,
        volume_mounts: Mapping[str, Any] | None = None,
    ) -> AsyncSandbox:
        """Start a sandbox that lives `timeout` seconds unless extended with set_timeout.

        `network` is its policy ({"allow_out": [...], "deny_out": [...],
        "allow_internet_access": bool, "allow_public_traffic": bool}; None = the tenant's
        default); `allow_internet_access` overrides that one field. `secrets` names tenant
        secrets (see `Secrets`) the sandbox gets as placeholder environment variables.
        `isolation` picks the isolation tier: "process", "container" or "gvisor" (`runtime`
        is the same choice by runtime name; None: the tenant's default, else the server's).
        `lifecycle` ({"on_timeout": "kill" | "pause", "auto_resume": bool}, E2B's names): a
        sandbox that pauses at its timeout instead of ending, and that requests wake.
        `volume_mounts` ({"/data": "NAME"} or {"/data": {"volume": "NAME", "read_only": True}})
        mounts your volumes (see `AsyncVolumes`).

        A shipped template used for the first time is built first (a minute or two): the
        server answers at once with a `building` sandbox and this waits until it runs, passing
        each change of the build's progress to `on_progress` (default: the `agentbox` logger,
        at INFO)."""
        transport = AsyncTransport(p.resolve_config(api_key, api_url, request_timeout))
        try:
            info = await transport.call(
                p.create_sandbox(
                    template,
                    timeout,
                    metadata,
                    envs,
                    resources,
                    keep_workspace,
                    network,
                    secrets,
                    allow_internet_access,
                    runtime,
                    isolation,
                    lifecycle,
                    volume_mounts,
                )
            )
            try:
                report = p.ProgressReporter(on_progress)
                while not p.create_finished(info):
                    report(info)
                    await asyncio.sleep(p.BUILD_POLL_S)
                    info = await transport.call(p.get_sandbox(info.sandbox_id))
            except BaseException:
                if info.state in (SandboxState.BUILDING, SandboxState.STARTING):  # not left to run
                    with contextlib.suppress(AgentboxError):
                        await transport.call(p.kill_sandbox(info.sandbox_id))
                raise
        except BaseException:
            await transport.close()
            raise
        return cls(info.sandbox_id, transport, info)

    @classmethod
    async def connect(
        cls,
        sandbox_id: str,
        timeout: float | None = None,
        api_key: str | None = None,
        api_url: str | None = None,
        request_timeout: float = 60,
        resume: bool = True,
    ) -> AsyncSandbox:
        """Attach to an existing sandbox; NotFoundError if it is not yours or does not exist.

        With `timeout`, the sandbox lives at least `timeout` seconds from now (set_timeout),
        as with E2B's connect: a sandbox already set to live longer keeps its end. A paused
        sandbox is resumed, as E2B's connect does (`resume=False` attaches to it paused)."""
        transport = AsyncTransport(p.resolve_config(api_key, api_url, request_timeout))
        try:
            info = await transport.call(p.get_sandbox(sandbox_id))
            if info.state == "paused" and resume:  # E2B's connect resumes a paused sandbox
                info = await transport.call(p.resume_sandbox(sandbox_id, timeout))
            elif timeout is not None and p.timeout_extends(info, timeout):
                info = await transport.call(p.set_timeout(sandbox_id, timeout))
        except BaseException:
            await transport.close()
            raise
        return cls(info.sandbox_id, transport, info)

    @classmethod
    async def list(
        cls,
        state: str | list[str] | None = LIVE_FILTER,
        metadata: Mapping[str, str] | None = None,
        limit: int | None = None,
        api_key: str | None = None,
        api_url: str | None = None,
        request_timeout: float = 60,
    ) -> list[SandboxInfo]:
        """Your sandboxes, newest first, following pages until `limit` (None = all).

        By default the live ones (starting, running, unhealthy), as E2B's `list` gives running
        ones; `state="all"` gives every state, or name states ("killed", ["expired", ...])."""
        transport = AsyncTransport(p.resolve_config(api_key, api_url, request_timeout))
        found: list[SandboxInfo] = []
        token: str | None = None
        try:
            while limit is None or len(found) < limit:
                page = await transport.call(
                    p.list_sandboxes(state, metadata, p.page_size(limit, len(found)), token)
                )
                found += page.sandboxes
                token = page.next_token
                if not token or not page.sandboxes:
                    break
        finally:
            await transport.close()
        return found if limit is None else found[:limit]

    @class_variant(_get_info_by_id)
    async def get_info(self, *, request_timeout: float | None = None) -> SandboxInfo:
        call = p.timed(p.get_sandbox(self.sandbox_id), request_timeout)
        return self._keep(await self._transport.call(call))

    def _keep(self, info: SandboxInfo) -> SandboxInfo:
        self._info = info
        return info

    # -------------------------------------------------------------------- network

    @property
    def access_token(self) -> str | None:
        """Opens the sandbox's private exposed ports (header X-Access-Token); None once it
        ended. As of the last answer about this sandbox."""
        return self._info.access_token if self._info is not None else None

    def get_host(self, port: int) -> str:
        """Host name of `port` inside the sandbox: {port}-{sandbox_id}.{domain} (E2B's shape).

        Unless the sandbox allows public traffic, send X-Access-Token: `access_token`, or use
        `get_url` for a signed URL that needs no headers."""
        return p.sandbox_host(self._info, port)

    async def get_url(
        self,
        port: int,
        expires_in: float | None = None,
        path: str = "/",
        routing: p.Routing = "path",
    ) -> str:
        """A signed URL to `port` that any HTTP client can open with no headers, valid
        `expires_in` seconds (None = one hour; at most a day) or until `rotate_access_token`.
        `routing="host"` gives a URL on get_host's name instead of under the API's
        /v1/sandboxes/{id}/ports/{port}."""
        return await self._transport.call(
            p.port_url(self.sandbox_id, port, expires_in, path, routing)
        )

    async def rotate_access_token(self) -> str:
        """Give the sandbox a new access token and return it: the old one and every URL
        `get_url` signed with it stop working at once."""
        info = self._keep(await self._transport.call(p.rotate_access_token(self.sandbox_id)))
        assert info.access_token is not None
        return info.access_token

    async def update_network(
        self,
        network: p.NetworkSpec | None = None,
        *,
        allow_out: str | Sequence[str] | None = None,
        deny_out: str | Sequence[str] | None = None,
        allow_internet_access: bool | None = None,
        allow_public_traffic: bool | None = None,
    ) -> SandboxInfo:
        """Replace the sandbox's whole network policy, effective for new connections at once.

        The policy sent is `network` (a dict or a NetworkInfo) with the keywords given put over
        it; anything neither names takes its default (nothing allowed, ports private), so
        `update_network(allow_out=["pypi.org"])` also turns internet access and public ports
        off. To change one field, start from `get_info().network`."""
        body = p.network_body(
            network,
            allow_out=allow_out,
            deny_out=deny_out,
            allow_internet_access=allow_internet_access,
            allow_public_traffic=allow_public_traffic,
        )
        return self._keep(await self._transport.call(p.set_network(self.sandbox_id, body)))

    # -------------------------------------------------------------------- code interpreter

    async def run_code(
        self,
        code: str,
        language: str | None = None,
        context: Context | str | None = None,
        on_stdout: Callable[[OutputMessage], Any] | None = None,
        on_stderr: Callable[[OutputMessage], Any] | None = None,
        on_result: Callable[[Result], Any] | None = None,
        on_error: Callable[[ExecutionError], Any] | None = None,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = None,
        *,
        request_timeout: float | None = None,
    ) -> Execution:
        """Run code in a stateful context (python by default: a Jupyter kernel).

        Without `context`, the language's default context is used. Results stream to the
        callbacks as they appear. An exception in the code is `execution.error`, not raised;
        at `timeout` (default 300 s, 0 = none) the cell is interrupted and the context kept."""
        callbacks: dict[str, Callable[[Any], Any] | None] = {
            "on_stdout": on_stdout,
            "on_stderr": on_stderr,
            "on_result": on_result,
            "on_error": on_error,
        }
        builder = p.ExecutionBuilder()
        call = p.timed(
            p.run_code(self.sandbox_id, code, language, context, envs, timeout), request_timeout
        )
        async for event in self._transport.events(call, p.code_read_timeout(timeout)):
            fired = builder.feed(event)
            if fired is not None:
                await async_deliver(callbacks[fired[0]], fired[1])
        return builder.result()

    async def create_code_context(
        self, language: str = DEFAULT_LANGUAGE, cwd: str | None = None
    ) -> Context:
        """A new context with its own state (its own kernel, for python)."""
        return await self._transport.call(p.create_code_context(self.sandbox_id, language, cwd))

    async def list_code_contexts(self) -> builtins.list[Context]:
        return await self._transport.call(p.list_code_contexts(self.sandbox_id))

    async def restart_code_context(self, context: Context | str) -> Context:
        """Restart the context's kernel: its state is gone, its id stays."""
        return await self._transport.call(p.restart_code_context(self.sandbox_id, context))

    async def remove_code_context(self, context: Context | str) -> None:
        await self._transport.call(p.remove_code_context(self.sandbox_id, context))

    async def is_running(self, *, request_timeout: float | None = None) -> bool:
        try:
            info = await self.get_info(request_timeout=request_timeout)
        except NotFoundError:
            return False
        return info.state == SandboxState.RUNNING

    async def get_metrics(
        self,
        start: datetime | float | None = None,
        end: datetime | float | None = None,
        *,
        request_timeout: float | None = None,
    ) -> builtins.list[SandboxMetrics]:
        """The sandbox's CPU, memory and disk use over time, oldest first (sampled every few
        seconds by the server and kept for an hour; none once it ended). `start`/`end`:
        datetimes or unix seconds."""
        call = p.timed(p.sandbox_metrics(self.sandbox_id, start, end), request_timeout)
        return await self._transport.call(call)

    async def pause(
        self, keep_memory: bool = True, *, request_timeout: float | None = None
    ) -> SandboxInfo:
        """Freeze the sandbox with its processes and memory: it uses no CPU and its timeout
        stops until `resume` (or `connect`); commands, files and ports answer `paused`
        meanwhile. A ConflictError if it is already paused."""
        call = p.timed(p.pause_sandbox(self.sandbox_id, keep_memory), request_timeout)
        return self._keep(await self._transport.call(call))

    async def resume(
        self, timeout: float | None = None, *, request_timeout: float | None = None
    ) -> SandboxInfo:
        """Thaw a paused sandbox: it runs on for the time it had left at the pause, or
        `timeout` seconds if that is longer. A running sandbox is left running."""
        call = p.timed(p.resume_sandbox(self.sandbox_id, timeout), request_timeout)
        return self._keep(await self._transport.call(call))

    # -------------------------------------------------------------------- snapshots and forks

    async def create_snapshot(
        self,
        name: str | None = None,
        metadata: Mapping[str, str] | None = None,
        *,
        request_timeout: float | None = None,
    ) -> SnapshotInfo:
        """Copy the sandbox's disk (root layer and /workspace; not its memory or processes),
        freezing it only for the copy. Start sandboxes from the copy with
        `AsyncSandbox.create(template=snapshot.snapshot_id)`, or `template=name`: a name is
        unique among your snapshots (ConflictError if taken). A running or paused sandbox."""
        call = p.timed(p.create_snapshot(self.sandbox_id, name, metadata), request_timeout)
        return await self._transport.call(call)

    async def fork(
        self, count: int = 1, timeout: float | None = None, *, request_timeout: float | None = None
    ) -> builtins.list[AsyncSandbox]:
        """`count` (1-16) new running sandboxes, each with a copy of this one's disk and its
        settings (template, resources, network, environment, metadata), each its own from then
        on, ending `timeout` seconds from now (None: this one's timeout at its create). All or
        none: if one cannot start, none is left. Connected with this sandbox's API key."""
        call = p.timed(p.fork_sandbox(self.sandbox_id, count, timeout), request_timeout)
        children = await self._transport.call(call)
        config = self._transport.config
        return [type(self)(c.sandbox_id, AsyncTransport(config), c) for c in children]

    @class_variant(_list_snapshots_by_key)
    async def list_snapshots(
        self, *, request_timeout: float | None = None
    ) -> builtins.list[SnapshotInfo]:
        """Your snapshots, oldest first."""
        call = p.timed(p.list_snapshots(), request_timeout)
        return await self._transport.call(call)

    @class_variant(_get_snapshot_by_ref)
    async def get_snapshot(self, ref: str, *, request_timeout: float | None = None) -> SnapshotInfo:
        """The snapshot `ref` (its id or name); NotFoundError if you have no such snapshot."""
        return await self._transport.call(p.timed(p.get_snapshot(ref), request_timeout))

    @class_variant(_delete_snapshot_by_ref)
    async def delete_snapshot(self, ref: str, *, request_timeout: float | None = None) -> None:
        """Delete the snapshot `ref` (its id or name); sandboxes started from it keep their
        own copies. NotFoundError if you have no such snapshot."""
        await self._transport.call(p.timed(p.delete_snapshot(ref), request_timeout))

    @class_variant(_set_timeout_by_id)
    async def set_timeout(
        self, timeout: float, *, request_timeout: float | None = None
    ) -> SandboxInfo:
        """The sandbox now ends `timeout` seconds from now."""
        call = p.timed(p.set_timeout(self.sandbox_id, timeout), request_timeout)
        return self._keep(await self._transport.call(call))

    @class_variant(_kill_by_id)
    async def kill(self, *, request_timeout: float | None = None) -> bool:
        """Kill the sandbox (killing a dead one is fine); False when it is not found."""
        call = p.timed(p.kill_sandbox(self.sandbox_id), request_timeout)
        return await _found(self._transport, call)

    async def close(self) -> None:
        """Release the HTTP connection; the sandbox keeps running."""
        await self._transport.close()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.kill()
        finally:
            await self.close()
