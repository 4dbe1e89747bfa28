"""`AsyncSandbox`: the asyncio face of the SDK (httpx.AsyncClient over the shared `protocol`).

Same API as `Sandbox` with `await`; streams are async iterators and output callbacks may be
plain functions or coroutine functions.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import inspect
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from typing import IO, Any, Literal, TypeVar, overload

import httpx

from agentbox.sdk import protocol as p
from agentbox.sdk.exceptions import AgentboxError, NotFoundError
from agentbox.sdk.models import (
    BuildProgress,
    CommandInfo,
    CommandResult,
    Context,
    EntryInfo,
    EntryList,
    Execution,
    KeptWorkspace,
    Resources,
    SandboxInfo,
)

T = TypeVar("T")
OutputCallback = Callable[[str], Any] | Callable[[str], Awaitable[Any]]
AsyncWriteData = (str | bytes | bytearray | memoryview | IO[bytes] | Iterable[bytes]
                  | AsyncIterable[bytes])


async def _deliver(callback: Callable[[Any], Any] | None, data: Any) -> None:
    if callback is None:
        return
    result = callback(data)
    if inspect.isawaitable(result):
        await result


class AsyncTransport:
    """One httpx.AsyncClient bound to a server and key; maps transport failures."""

    def __init__(self, config: p.ClientConfig) -> None:
        self.config = config
        self.client = httpx.AsyncClient(**p.client_options(config))

    async def call(self, call: p.Call[T], content: Any = None) -> T:
        try:
            response = await self.client.request(call.method, call.path, params=call.params,
                                                 json=call.json, content=content)
        except httpx.HTTPError as e:
            raise p.transport_error(e, self.config.api_url) from None
        return p.finish(call, response)

    async def open(self, call: p.Call[Any], read_timeout: float | None) -> httpx.Response:
        """Send and return the response with its body unread; the caller must close it."""
        request = self.client.build_request(
            call.method, call.path, params=call.params, json=call.json,
            timeout=p.stream_timeout(self.config, read_timeout))
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

    async def events(self, call: p.Call[Any],
                     read_timeout: float | None) -> AsyncIterator[dict[str, Any]]:
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

    async def follow(self, progress: p.CommandProgress, first: p.Call[Any] | None,
                     read_timeout: float | None) -> AsyncIterator[tuple[str, str]]:
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
                error = p.ConnectionFailedError("the command stream ended before the command",
                                                code="connection_failed")
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
        # Opened now, so a missing file raises here rather than on the first __anext__().
        response = await self.open(call, self.config.request_timeout)

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


def _upload_body(data: AsyncWriteData) -> bytes | AsyncIterator[bytes]:
    if isinstance(data, str | bytes | bytearray | memoryview):
        return p.upload_parts(bytes(data) if not isinstance(data, str) else data)
    return _chunks(data)


async def _chunks(data: Any) -> AsyncIterator[bytes]:
    # Chunked upload: a file object is never read into memory as a whole.
    read = getattr(data, "read", None)
    if callable(read):
        while True:
            chunk = read(p.CHUNK_SIZE)
            if inspect.isawaitable(chunk):  # an async file object (aiofiles and the like)
                chunk = await chunk
            if not chunk:
                return
            yield p.upload_parts(chunk)
    elif hasattr(data, "__aiter__"):
        async for chunk in data:
            yield p.upload_parts(chunk)
    else:
        for chunk in data:
            yield p.upload_parts(chunk)


class AsyncCommandHandle(p.CommandHandleBase):
    """A background command: `await wait()`, `async for stdout, stderr in handle`, kill, stdin."""

    def __init__(self, commands: AsyncCommands, cmd_id: str, pid: int | None,
                 on_stdout: OutputCallback | None = None,
                 on_stderr: OutputCallback | None = None) -> None:
        self._commands = commands
        self._progress = p.CommandProgress(commands._sandbox_id, cmd_id, pid)
        self._on_stdout = on_stdout
        self._on_stderr = on_stderr

    async def __aiter__(self) -> AsyncIterator[tuple[str | None, str | None]]:
        if self._progress.done:
            return
        async for stream, data in self._commands._transport.follow(self._progress, None, None):
            yield (data, None) if stream == "stdout" else (None, data)

    async def wait(self, on_stdout: OutputCallback | None = None,
                   on_stderr: OutputCallback | None = None) -> CommandResult:
        on_stdout = on_stdout or self._on_stdout
        on_stderr = on_stderr or self._on_stderr
        if not self._progress.done:
            async for stream, data in self._commands._transport.follow(self._progress, None,
                                                                        None):
                await _deliver(on_stdout if stream == "stdout" else on_stderr, data)
        return self._progress.outcome()

    async def kill(self) -> bool:
        return await self._commands.kill(self.cmd_id)

    async def send_stdin(self, data: str) -> None:
        await self._commands.send_stdin(self.cmd_id, data)

    async def close_stdin(self) -> None:
        await self._commands.close_stdin(self.cmd_id)


class AsyncCommands:
    def __init__(self, sandbox_id: str, transport: AsyncTransport) -> None:
        self._sandbox_id = sandbox_id
        self._transport = transport

    @overload
    async def run(self, cmd: str, background: Literal[False] = False,
                  envs: Mapping[str, str] | None = None, cwd: str | None = None,
                  timeout: float = 60, on_stdout: OutputCallback | None = None,
                  on_stderr: OutputCallback | None = None,
                  stdin: bool = False,
                  on_start: Callable[[str], Any] | None = None) -> CommandResult: ...

    @overload
    async def run(self, cmd: str, background: Literal[True],
                  envs: Mapping[str, str] | None = None, cwd: str | None = None,
                  timeout: float = 60, on_stdout: OutputCallback | None = None,
                  on_stderr: OutputCallback | None = None,
                  stdin: bool = False,
                  on_start: Callable[[str], Any] | None = None) -> AsyncCommandHandle: ...

    async def run(self, cmd: str, background: bool = False,
                  envs: Mapping[str, str] | None = None, cwd: str | None = None,
                  timeout: float = 60, on_stdout: OutputCallback | None = None,
                  on_stderr: OutputCallback | None = None,
                  stdin: bool = False, on_start: Callable[[str], Any] | None = None,
                  ) -> CommandResult | AsyncCommandHandle:
        """See `Commands.run`."""
        if background:
            info = await self._transport.call(
                p.start_command(self._sandbox_id, cmd, envs, cwd, timeout, stdin))
            if on_start is not None:
                on_start(info.cmd_id)
            return AsyncCommandHandle(self, info.cmd_id, info.pid, on_stdout, on_stderr)
        progress = p.CommandProgress(self._sandbox_id, cmd=cmd, on_start=on_start)
        first = p.run_command(self._sandbox_id, cmd, envs, cwd, timeout, stdin)
        async for stream, data in self._transport.follow(progress, first,
                                                         p.command_read_timeout(timeout)):
            await _deliver(on_stdout if stream == "stdout" else on_stderr, data)
        return progress.outcome()

    async def list(self) -> list[CommandInfo]:
        return await self._transport.call(p.list_commands(self._sandbox_id))

    async def get_info(self, cmd_id: str) -> CommandInfo:
        return await self._transport.call(p.get_command(self._sandbox_id, cmd_id))

    async def connect(self, cmd_id: str) -> AsyncCommandHandle:
        info = await self.get_info(cmd_id)
        return AsyncCommandHandle(self, info.cmd_id, info.pid)

    async def kill(self, cmd_id: str, signal: str | int = "SIGKILL") -> bool:
        try:
            await self._transport.call(p.kill_command(self._sandbox_id, cmd_id, signal))
        except NotFoundError:
            return False
        return True

    async def send_stdin(self, cmd_id: str, data: str) -> None:
        await self._transport.call(p.command_stdin(self._sandbox_id, cmd_id, data, False))

    async def close_stdin(self, cmd_id: str) -> None:
        await self._transport.call(p.command_stdin(self._sandbox_id, cmd_id, "", True))


class AsyncFiles:
    def __init__(self, sandbox_id: str, transport: AsyncTransport) -> None:
        self._sandbox_id = sandbox_id
        self._transport = transport

    @overload
    async def read(self, path: str, format: Literal["text"] = "text") -> str: ...

    @overload
    async def read(self, path: str, format: Literal["bytes"]) -> bytes: ...

    @overload
    async def read(self, path: str, format: Literal["stream"]) -> AsyncIterator[bytes]: ...

    async def read(self, path: str, format: Literal["text", "bytes", "stream"] = "text",
                   ) -> str | bytes | AsyncIterator[bytes]:
        call = p.read_file(self._sandbox_id, path)
        stream = await self._transport.bytes_stream(call)
        if format == "stream":
            return stream
        data = b"".join([chunk async for chunk in stream])
        return data if format == "bytes" else p.decode_text(data)

    async def write(self, path: str, data: AsyncWriteData) -> EntryInfo:
        return await self._transport.call(p.write_file(self._sandbox_id, path),
                                          _upload_body(data))

    async def list(self, path: str = "/workspace", depth: int = 1, *, limit: int | None = None,
             cursor: str | None = None) -> EntryList:
        """Entries under `path` to `depth` levels, in path order. A listing stops at `limit`
        entries (the server's page size, 10,000, by default): then `.truncated` is True and
        `list(path, depth, cursor=page.next_cursor)` gives the next page."""
        return await self._transport.call(
            p.list_files(self._sandbox_id, path, depth, limit, cursor))

    async def exists(self, path: str) -> bool:
        try:
            await self.get_info(path)
        except AgentboxError as e:
            if p.is_missing_path(e):
                return False
            raise
        return True

    async def get_info(self, path: str) -> EntryInfo:
        return await self._transport.call(p.stat_file(self._sandbox_id, path))

    async def make_dir(self, path: str) -> bool:
        return await self._transport.call(p.make_dir(self._sandbox_id, path))

    async def remove(self, path: str) -> None:
        await self._transport.call(p.remove_file(self._sandbox_id, path))

    async def rename(self, src: str, dst: str) -> EntryInfo:
        return await self._transport.call(p.rename_file(self._sandbox_id, src, dst))


class AsyncWorkspaces:
    """See `Workspaces`: `async with AsyncWorkspaces() as kept:`."""

    def __init__(self, api_key: str | None = None, api_url: str | None = None,
                 request_timeout: float = 60) -> None:
        self._transport = AsyncTransport(p.resolve_config(api_key, api_url, request_timeout))

    async def list(self) -> list[KeptWorkspace]:
        return await self._transport.call(p.list_workspaces())

    @overload
    async def read(self, sandbox_id: str, path: str,
                   format: Literal["text"] = "text") -> str: ...

    @overload
    async def read(self, sandbox_id: str, path: str, format: Literal["bytes"]) -> bytes: ...

    @overload
    async def read(self, sandbox_id: str, path: str,
                   format: Literal["stream"]) -> AsyncIterator[bytes]: ...

    async def read(self, sandbox_id: str, path: str,
                   format: Literal["text", "bytes", "stream"] = "text",
                   ) -> str | bytes | AsyncIterator[bytes]:
        stream = await self._transport.bytes_stream(p.read_workspace_file(sandbox_id, path))
        if format == "stream":
            return stream
        data = b"".join([chunk async for chunk in stream])
        return data if format == "bytes" else p.decode_text(data)

    async def archive(self, sandbox_id: str) -> AsyncIterator[bytes]:
        return await self._transport.bytes_stream(p.workspace_archive(sandbox_id))

    async def remove(self, sandbox_id: str) -> None:
        await self._transport.call(p.remove_workspace(sandbox_id))

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncWorkspaces:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncSandbox:
    """`sbx = await AsyncSandbox.create()`; `async with sbx:` kills it when the block ends."""

    def __init__(self, sandbox_id: str, transport: AsyncTransport,
                 info: SandboxInfo | None = None) -> None:
        self.sandbox_id = sandbox_id
        self._transport = transport
        self._info = info
        self.commands = AsyncCommands(sandbox_id, transport)
        self.files = AsyncFiles(sandbox_id, transport)

    def __repr__(self) -> str:
        return f"AsyncSandbox(sandbox_id={self.sandbox_id!r})"

    @classmethod
    async def create(cls, template: str | None = None, timeout: float = 300,
                     metadata: Mapping[str, str] | None = None,
                     envs: Mapping[str, str] | None = None,
                     resources: Resources | Mapping[str, Any] | None = None,
                     keep_workspace: bool = False, network: p.NetworkSpec | None = None,
                     secrets: Sequence[str] | None = None,
                     allow_internet_access: bool | None = None, api_key: str | None = None,
                     api_url: str | None = None, request_timeout: float = 60,
                     on_progress: Callable[[BuildProgress], None] | None = None,
                     ) -> AsyncSandbox:
        """See `Sandbox.create`."""
        transport = AsyncTransport(p.resolve_config(api_key, api_url, request_timeout))
        try:
            info = await transport.call(p.create_sandbox(template, timeout, metadata, envs,
                                                         resources, keep_workspace, network,
                                                         secrets, allow_internet_access))
            try:
                report = p.ProgressReporter(on_progress)
                while not p.create_finished(info):
                    report(info)
                    await asyncio.sleep(p.BUILD_POLL_S)
                    info = await transport.call(p.get_sandbox(info.sandbox_id))
            except BaseException:
                if info.state in ("building", "starting"):  # given up on: not left to run
                    with contextlib.suppress(AgentboxError):
                        await transport.call(p.kill_sandbox(info.sandbox_id))
                raise
        except BaseException:
            await transport.close()
            raise
        return cls(info.sandbox_id, transport, info)

    @classmethod
    async def connect(cls, sandbox_id: str, api_key: str | None = None,
                      api_url: str | None = None, request_timeout: float = 60) -> AsyncSandbox:
        transport = AsyncTransport(p.resolve_config(api_key, api_url, request_timeout))
        try:
            info = await transport.call(p.get_sandbox(sandbox_id))
        except BaseException:
            await transport.close()
            raise
        return cls(info.sandbox_id, transport, info)

    @classmethod
    async def list(cls, state: str | list[str] | None = "live",
                   metadata: Mapping[str, str] | None = None, limit: int | None = None,
                   api_key: str | None = None, api_url: str | None = None,
                   request_timeout: float = 60) -> list[SandboxInfo]:
        """See `Sandbox.list`: the live ones by default, `state="all"` for every state."""
        transport = AsyncTransport(p.resolve_config(api_key, api_url, request_timeout))
        found: list[SandboxInfo] = []
        token: str | None = None
        try:
            while limit is None or len(found) < limit:
                page = await transport.call(
                    p.list_sandboxes(state, metadata, p.page_size(limit, len(found)), token))
                found += page.sandboxes
                token = page.next_token
                if not token or not page.sandboxes:
                    break
        finally:
            await transport.close()
        return found if limit is None else found[:limit]

    async def get_info(self) -> SandboxInfo:
        return self._keep(await self._transport.call(p.get_sandbox(self.sandbox_id)))

    def _keep(self, info: SandboxInfo) -> SandboxInfo:
        self._info = info
        return info

    # -------------------------------------------------------------------- network

    @property
    def access_token(self) -> str | None:
        """See `Sandbox.access_token`."""
        return self._info.access_token if self._info is not None else None

    def get_host(self, port: int) -> str:
        """{port}-{sandbox_id}.{domain}; see `Sandbox.get_host` (no request: not awaited)."""
        return p.sandbox_host(self._info, port)

    async def get_url(self, port: int, expires_in: float | None = None, path: str = "/",
                      routing: p.Routing = "path") -> str:
        """A signed URL to `port` that needs no headers; see `Sandbox.get_url`."""
        return await self._transport.call(p.port_url(self.sandbox_id, port, expires_in, path,
                                                     routing))

    async def rotate_access_token(self) -> str:
        """A new access token; see `Sandbox.rotate_access_token`."""
        info = self._keep(await self._transport.call(p.rotate_access_token(self.sandbox_id)))
        assert info.access_token is not None
        return info.access_token

    async def update_network(self, network: p.NetworkSpec | None = None, *,
                             allow_out: str | Sequence[str] | None = None,
                             deny_out: str | Sequence[str] | None = None,
                             allow_internet_access: bool | None = None,
                             allow_public_traffic: bool | None = None) -> SandboxInfo:
        """Replace the sandbox's whole network policy; see `Sandbox.update_network` (fields
        not given take their defaults, they are not kept)."""
        body = p.network_body(network, allow_out=allow_out, deny_out=deny_out,
                              allow_internet_access=allow_internet_access,
                              allow_public_traffic=allow_public_traffic)
        return self._keep(await self._transport.call(p.set_network(self.sandbox_id, body)))

    # -------------------------------------------------------------------- code interpreter

    async def run_code(self, code: str, language: str | None = None,
                       context: Context | str | None = None,
                       on_stdout: Callable[[Any], Any] | None = None,
                       on_stderr: Callable[[Any], Any] | None = None,
                       on_result: Callable[[Any], Any] | None = None,
                       on_error: Callable[[Any], Any] | None = None,
                       envs: Mapping[str, str] | None = None,
                       timeout: float | None = None) -> Execution:
        """Run code in a stateful context; see `Sandbox.run_code`. Callbacks may be async."""
        callbacks = {"on_stdout": on_stdout, "on_stderr": on_stderr, "on_result": on_result,
                     "on_error": on_error}
        builder = p.ExecutionBuilder()
        call = p.run_code(self.sandbox_id, code, language, context, envs, timeout)
        async for event in self._transport.events(call, p.code_read_timeout(timeout)):
            fired = builder.feed(event)
            if fired is not None:
                await _deliver(callbacks[fired[0]], fired[1])
        return builder.result()

    async def create_code_context(self, language: str = "python",
                                  cwd: str | None = None) -> Context:
        return await self._transport.call(p.create_code_context(self.sandbox_id, language, cwd))

    async def list_code_contexts(self) -> builtins.list[Context]:
        return await self._transport.call(p.list_code_contexts(self.sandbox_id))

    async def restart_code_context(self, context: Context | str) -> Context:
        return await self._transport.call(p.restart_code_context(self.sandbox_id, context))

    async def remove_code_context(self, context: Context | str) -> None:
        await self._transport.call(p.remove_code_context(self.sandbox_id, context))

    async def is_running(self) -> bool:
        try:
            return (await self.get_info()).state == "running"
        except NotFoundError:
            return False

    async def set_timeout(self, timeout: float) -> SandboxInfo:
        return self._keep(await self._transport.call(p.set_timeout(self.sandbox_id, timeout)))

    async def kill(self) -> None:
        await self._transport.call(p.kill_sandbox(self.sandbox_id))

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.kill()
        finally:
            await self.close()
