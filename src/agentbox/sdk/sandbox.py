"""`Sandbox`: the synchronous face of the SDK (httpx.Client over the shared `protocol`)."""

from __future__ import annotations

import builtins
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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
    ExecutionError,
    KeptWorkspace,
    OutputMessage,
    PoolStats,
    Resources,
    Result,
    SandboxInfo,
    SecretInfo,
    TemplateInfo,
)

T = TypeVar("T")
OutputCallback = Callable[[str], Any]
WriteData = str | bytes | bytearray | memoryview | IO[bytes] | Iterable[bytes]


class Transport:
    """One httpx.Client bound to a server and key; maps every transport failure to the SDK's."""

    def __init__(self, config: p.ClientConfig) -> None:
        self.config = config
        self.client = httpx.Client(**p.client_options(config))

    def call(self, call: p.Call[T], content: Any = None) -> T:
        try:
            response = self.client.request(call.method, call.path, params=call.params,
                                           json=call.json, content=content)
        except httpx.HTTPError as e:
            raise p.transport_error(e, self.config.api_url) from None
        return p.finish(call, response)

    def open(self, call: p.Call[Any], read_timeout: float | None) -> httpx.Response:
        """Send and return the response with its body unread; the caller must close it."""
        request = self.client.build_request(
            call.method, call.path, params=call.params, json=call.json,
            timeout=p.stream_timeout(self.config, read_timeout))
        try:
            response = self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise p.transport_error(e, self.config.api_url) from None
        if response.is_error:
            try:
                response.read()
            except httpx.HTTPError as e:
                raise p.transport_error(e, self.config.api_url) from None
            finally:
                response.close()
            raise p.error_from_response(response)
        return response

    def events(self, call: p.Call[Any], read_timeout: float | None) -> Iterator[dict[str, Any]]:
        response = self.open(call, read_timeout)
        try:
            for line in response.iter_lines():
                event = p.parse_event_line(line)
                if event is not None:
                    yield event
        except httpx.HTTPError as e:
            raise p.transport_error(e, self.config.api_url) from None
        finally:
            response.close()

    def follow(self, progress: p.CommandProgress, first: p.Call[Any] | None,
               read_timeout: float | None) -> Iterator[tuple[str, str]]:
        """Output of a command until its `end` event, resuming dropped streams at the offset."""
        call = first or progress.resume()
        failures = 0
        while not progress.done:
            error: AgentboxError
            try:
                for event in self.events(call, read_timeout):
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
            time.sleep(p.reconnect_delay(failures))
            failures += 1
            call = progress.resume()

    def bytes_stream(self, call: p.Call[Any]) -> Iterator[bytes]:
        # Opened now, so a missing file raises here rather than on the first next().
        response = self.open(call, self.config.request_timeout)

        def chunks() -> Iterator[bytes]:
            try:
                yield from response.iter_bytes(p.CHUNK_SIZE)
            except httpx.HTTPError as e:
                raise p.transport_error(e, self.config.api_url) from None
            finally:
                response.close()

        return chunks()

    def close(self) -> None:
        self.client.close()


def _upload_body(data: WriteData) -> bytes | Iterator[bytes]:
    if isinstance(data, str | bytes | bytearray | memoryview):
        return p.upload_parts(bytes(data) if not isinstance(data, str) else data)
    read = getattr(data, "read", None)
    if callable(read):
        return _file_chunks(read)
    return (p.upload_parts(chunk) for chunk in data)


def _file_chunks(read: Callable[[int], Any]) -> Iterator[bytes]:
    # Chunked upload: a file object is never read into memory as a whole.
    while True:
        chunk = read(p.CHUNK_SIZE)
        if not chunk:
            return
        yield p.upload_parts(chunk)


class CommandHandle(p.CommandHandleBase):
    """A command running in the background: wait for it, stream it, feed it stdin, kill it."""

    def __init__(self, commands: Commands, cmd_id: str, pid: int | None,
                 on_stdout: OutputCallback | None = None,
                 on_stderr: OutputCallback | None = None) -> None:
        self._commands = commands
        self._progress = p.CommandProgress(commands._sandbox_id, cmd_id, pid)
        self._on_stdout = on_stdout
        self._on_stderr = on_stderr

    def __iter__(self) -> Iterator[tuple[str | None, str | None]]:
        """Yields (stdout, stderr) pairs with one side set, until the command ends."""
        for stream, data in self._follow():
            yield (data, None) if stream == "stdout" else (None, data)

    def _follow(self) -> Iterator[tuple[str, str]]:
        if self._progress.done:
            return iter(())
        return self._commands._transport.follow(self._progress, None, None)

    def wait(self, on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None) -> CommandResult:
        """Block until the command ends; raises CommandExitException unless it exited 0."""
        on_stdout = on_stdout or self._on_stdout
        on_stderr = on_stderr or self._on_stderr
        for stream, data in self._follow():
            callback = on_stdout if stream == "stdout" else on_stderr
            if callback is not None:
                callback(data)
        return self._progress.outcome()

    def kill(self) -> bool:
        return self._commands.kill(self.cmd_id)

    def send_stdin(self, data: str) -> None:
        self._commands.send_stdin(self.cmd_id, data)

    def close_stdin(self) -> None:
        self._commands.close_stdin(self.cmd_id)


class Commands:
    """`sbx.commands`: run shell commands (`bash -l -c`) in the sandbox."""

    def __init__(self, sandbox_id: str, transport: Transport) -> None:
        self._sandbox_id = sandbox_id
        self._transport = transport

    @overload
    def run(self, cmd: str, background: Literal[False] = False,
            envs: Mapping[str, str] | None = None, cwd: str | None = None,
            timeout: float = 60, on_stdout: OutputCallback | None = None,
            on_stderr: OutputCallback | None = None, stdin: bool = False,
            on_start: Callable[[str], Any] | None = None) -> CommandResult: ...

    @overload
    def run(self, cmd: str, background: Literal[True],
            envs: Mapping[str, str] | None = None, cwd: str | None = None,
            timeout: float = 60, on_stdout: OutputCallback | None = None,
            on_stderr: OutputCallback | None = None, stdin: bool = False,
            on_start: Callable[[str], Any] | None = None) -> CommandHandle: ...

    def run(self, cmd: str, background: bool = False, envs: Mapping[str, str] | None = None,
            cwd: str | None = None, timeout: float = 60,
            on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None,
            stdin: bool = False, on_start: Callable[[str], Any] | None = None,
            ) -> CommandResult | CommandHandle:
        """Run `cmd`; `timeout` seconds (0 = none) is enforced by the server.

        Foreground: streams output to the callbacks as it arrives, returns the result, and
        raises CommandExitException (CommandTimeoutError on timeout) unless it exited 0.
        `on_start` is called with the command's id as soon as it started (from the thread
        running it: it must not block), e.g. to `send_stdin` (with `stdin=True`) or `kill` it
        from another thread.
        Background: returns a CommandHandle at once.
        """
        if background:
            info = self._transport.call(
                p.start_command(self._sandbox_id, cmd, envs, cwd, timeout, stdin))
            if on_start is not None:
                on_start(info.cmd_id)
            return CommandHandle(self, info.cmd_id, info.pid, on_stdout, on_stderr)
        progress = p.CommandProgress(self._sandbox_id, cmd=cmd, on_start=on_start)
        first = p.run_command(self._sandbox_id, cmd, envs, cwd, timeout, stdin)
        for stream, data in self._transport.follow(progress, first,
                                                   p.command_read_timeout(timeout)):
            callback = on_stdout if stream == "stdout" else on_stderr
            if callback is not None:
                callback(data)
        return progress.outcome()

    def list(self) -> list[CommandInfo]:
        return self._transport.call(p.list_commands(self._sandbox_id))

    def get_info(self, cmd_id: str) -> CommandInfo:
        return self._transport.call(p.get_command(self._sandbox_id, cmd_id))

    def connect(self, cmd_id: str) -> CommandHandle:
        """A handle on a command started earlier (its buffered output is replayed)."""
        info = self.get_info(cmd_id)
        return CommandHandle(self, info.cmd_id, info.pid)

    def kill(self, cmd_id: str, signal: str | int = "SIGKILL") -> bool:
        """Kill the command's process tree; False when there is no such command."""
        try:
            self._transport.call(p.kill_command(self._sandbox_id, cmd_id, signal))
        except NotFoundError:
            return False
        return True

    def send_stdin(self, cmd_id: str, data: str) -> None:
        self._transport.call(p.command_stdin(self._sandbox_id, cmd_id, data, False))

    def close_stdin(self, cmd_id: str) -> None:
        self._transport.call(p.command_stdin(self._sandbox_id, cmd_id, "", True))


class Files:
    """`sbx.files`: the sandbox file system. Paths are absolute or relative to /workspace."""

    def __init__(self, sandbox_id: str, transport: Transport) -> None:
        self._sandbox_id = sandbox_id
        self._transport = transport

    @overload
    def read(self, path: str, format: Literal["text"] = "text") -> str: ...

    @overload
    def read(self, path: str, format: Literal["bytes"]) -> bytes: ...

    @overload
    def read(self, path: str, format: Literal["stream"]) -> Iterator[bytes]: ...

    def read(self, path: str, format: Literal["text", "bytes", "stream"] = "text",
             ) -> str | bytes | Iterator[bytes]:
        """The file's content; `stream` yields chunks as they arrive (iterate it to the end)."""
        call = p.read_file(self._sandbox_id, path)
        if format == "stream":
            return self._transport.bytes_stream(call)
        data = b"".join(self._transport.bytes_stream(call))
        return data if format == "bytes" else p.decode_text(data)

    def write(self, path: str, data: WriteData) -> EntryInfo:
        """Write (atomically) from str, bytes, a binary file object or an iterable of chunks."""
        return self._transport.call(p.write_file(self._sandbox_id, path), _upload_body(data))

    def list(self, path: str = "/workspace", depth: int = 1, *, limit: int | None = None,
             cursor: str | None = None) -> EntryList:
        """Entries under `path` to `depth` levels, in path order. A listing stops at `limit`
        entries (the server's page size, 10,000, by default): then `.truncated` is True and
        `list(path, depth, cursor=page.next_cursor)` gives the next page."""
        return self._transport.call(
            p.list_files(self._sandbox_id, path, depth, limit, cursor))

    def exists(self, path: str) -> bool:
        try:
            self.get_info(path)
        except AgentboxError as e:
            if p.is_missing_path(e):
                return False
            raise
        return True

    def get_info(self, path: str) -> EntryInfo:
        return self._transport.call(p.stat_file(self._sandbox_id, path))

    def make_dir(self, path: str) -> bool:
        """Create the directory and its parents; False if it already existed."""
        return self._transport.call(p.make_dir(self._sandbox_id, path))

    def remove(self, path: str) -> None:
        self._transport.call(p.remove_file(self._sandbox_id, path))

    def rename(self, src: str, dst: str) -> EntryInfo:
        return self._transport.call(p.rename_file(self._sandbox_id, src, dst))


class Templates:
    """Templates (root filesystems built offline) and warm pools: `Templates()` with a key.

    Building, removing and sizing pools need an admin key; listing needs any key."""

    def __init__(self, api_key: str | None = None, api_url: str | None = None,
                 request_timeout: float = 60) -> None:
        self._transport = Transport(p.resolve_config(api_key, api_url, request_timeout))

    def list(self) -> list[TemplateInfo]:
        return self._transport.call(p.list_templates())[0]

    def builtin(self) -> builtins.list[str]:
        """Names of the specs agentbox ships (built on first use)."""
        return self._transport.call(p.list_templates())[1]

    def get(self, name: str) -> TemplateInfo:
        return self._transport.call(p.get_template(name))

    def build(self, spec: str | None = None, builtin: str | None = None,
              on_event: Callable[[dict[str, Any]], Any] | None = None,
              spec_dir: str | None = None) -> TemplateInfo:
        """Build from a spec's TOML text or a shipped spec's name; build log events go to
        `on_event` as they come. Files the spec names by `src` are read from `spec_dir` and
        sent along. Unchanged steps come from the cache."""
        name: str | None = None
        files = p.spec_files(spec, spec_dir) if spec is not None and spec_dir else None
        for event in self._transport.events(p.build_template(spec, builtin, files), None):
            if on_event is not None:
                on_event(event)
            if event.get("type") == "error":
                raise p.error_from_code("build_failed", str(event.get("message", "")))
            if event.get("type") == "done":
                name = str((event.get("template") or {}).get("name", ""))
        if not name:
            raise AgentboxError("the build stream ended before the build did",
                                code="stream_ended")
        return self.get(name)

    def remove(self, name: str) -> None:
        self._transport.call(p.remove_template(name))

    def pools(self) -> builtins.list[PoolStats]:
        return self._transport.call(p.list_pools())

    def set_pool_size(self, template: str, size: int) -> PoolStats:
        return self._transport.call(p.set_pool_size(template, size))

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Templates:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Secrets:
    """The tenant's secrets: `Secrets()` with a key. Values go in and never come back out.

    A sandbox created with `secrets=["NAME"]` sees only a placeholder in $NAME; the egress
    proxy swaps in the value on requests to the secret's `hosts`, in its `headers` only
    (default Authorization, Basic credentials included; the URL too when `in_url`), over TLS
    it verified (plain HTTP only with `allow_plaintext`), and scrubs the value out of those
    hosts' responses, so the sandbox can use a credential it cannot read."""

    def __init__(self, api_key: str | None = None, api_url: str | None = None,
                 request_timeout: float = 60) -> None:
        self._transport = Transport(p.resolve_config(api_key, api_url, request_timeout))

    def set(self, name: str, value: str, hosts: str | Sequence[str], in_url: bool = False,
            headers: str | Sequence[str] | None = None,
            allow_plaintext: bool = False) -> SecretInfo:
        """Create or replace a secret; `hosts` (example.com, *.example.com) are the only
        destinations its value is ever sent to, `headers` (default Authorization) the only
        headers it goes in. `name` is an environment variable name."""
        return self._transport.call(
            p.set_secret(name, value, hosts, in_url, headers, allow_plaintext))

    def list(self) -> builtins.list[SecretInfo]:
        return self._transport.call(p.list_secrets())

    def remove(self, name: str) -> None:
        """NotFoundError if there is no such secret. Running sandboxes lose it at once."""
        self._transport.call(p.remove_secret(name))

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Secrets:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Workspaces:
    """Kept workspaces: the /workspace of your ended sandboxes created with
    `keep_workspace=True`, until you remove them or the server's retention does (7 days by
    default). They count against your tenant's disk quota. `Workspaces()` with a key."""

    def __init__(self, api_key: str | None = None, api_url: str | None = None,
                 request_timeout: float = 60) -> None:
        self._transport = Transport(p.resolve_config(api_key, api_url, request_timeout))

    def list(self) -> list[KeptWorkspace]:
        """Your kept workspaces, most recently kept first."""
        return self._transport.call(p.list_workspaces())

    @overload
    def read(self, sandbox_id: str, path: str, format: Literal["text"] = "text") -> str: ...

    @overload
    def read(self, sandbox_id: str, path: str, format: Literal["bytes"]) -> bytes: ...

    @overload
    def read(self, sandbox_id: str, path: str, format: Literal["stream"]) -> Iterator[bytes]: ...

    def read(self, sandbox_id: str, path: str,
             format: Literal["text", "bytes", "stream"] = "text") -> str | bytes | Iterator[bytes]:
        """One file (`/workspace/...` or relative to it); symlinks are never followed."""
        call = p.read_workspace_file(sandbox_id, path)
        if format == "stream":
            return self._transport.bytes_stream(call)
        data = b"".join(self._transport.bytes_stream(call))
        return data if format == "bytes" else p.decode_text(data)

    def archive(self, sandbox_id: str) -> Iterator[bytes]:
        """The whole workspace as a tar stream (GNU tar; symlinks as links), in chunks:
        iterate it to the end, e.g. into a file or `tarfile.open(fileobj=..., mode="r|")`."""
        return self._transport.bytes_stream(p.workspace_archive(sandbox_id))

    def remove(self, sandbox_id: str) -> None:
        """NotFoundError if there is no such kept workspace (of your tenant)."""
        self._transport.call(p.remove_workspace(sandbox_id))

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Workspaces:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sandbox:
    """An agentbox sandbox. Make one with `Sandbox.create()` or `Sandbox.connect(id)`.

    `with Sandbox.create() as sbx:` kills the sandbox when the block ends.
    """

    def __init__(self, sandbox_id: str, transport: Transport,
                 info: SandboxInfo | None = None) -> None:
        self.sandbox_id = sandbox_id
        self._transport = transport
        self._info = info
        self.commands = Commands(sandbox_id, transport)
        self.files = Files(sandbox_id, transport)

    def __repr__(self) -> str:
        return f"Sandbox(sandbox_id={self.sandbox_id!r})"

    @classmethod
    def create(cls, template: str | None = None, timeout: float = 300,
               metadata: Mapping[str, str] | None = None, envs: Mapping[str, str] | None = None,
               resources: Resources | Mapping[str, Any] | None = None,
               keep_workspace: bool = False, network: p.NetworkSpec | None = None,
               secrets: Sequence[str] | None = None, allow_internet_access: bool | None = None,
               api_key: str | None = None, api_url: str | None = None,
               request_timeout: float = 60,
               on_progress: Callable[[BuildProgress], None] | None = None) -> Sandbox:
        """Start a sandbox that lives `timeout` seconds unless extended with set_timeout.

        `network` is its policy ({"allow_out": [...], "deny_out": [...],
        "allow_internet_access": bool, "allow_public_traffic": bool}; None = the tenant's
        default); `allow_internet_access` overrides that one field. `secrets` names tenant
        secrets (see `Secrets`) the sandbox gets as placeholder environment variables.

        A shipped template used for the first time is built first (a minute or two): the
        server answers at once with a `building` sandbox and this waits until it runs, passing
        each change of the build's progress to `on_progress` (default: the `agentbox` logger,
        at INFO)."""
        transport = Transport(p.resolve_config(api_key, api_url, request_timeout))
        try:
            info = transport.call(p.create_sandbox(template, timeout, metadata, envs, resources,
                                                   keep_workspace, network, secrets,
                                                   allow_internet_access))
            try:
                report = p.ProgressReporter(on_progress)
                while not p.create_finished(info):
                    report(info)
                    time.sleep(p.BUILD_POLL_S)
                    info = transport.call(p.get_sandbox(info.sandbox_id))
            except BaseException:
                if info.state in ("building", "starting"):  # given up on: not left to run
                    with contextlib.suppress(AgentboxError):
                        transport.call(p.kill_sandbox(info.sandbox_id))
                raise
        except BaseException:
            transport.close()
            raise
        return cls(info.sandbox_id, transport, info)

    @classmethod
    def connect(cls, sandbox_id: str, api_key: str | None = None, api_url: str | None = None,
                request_timeout: float = 60) -> Sandbox:
        """Attach to an existing sandbox; NotFoundError if it is not yours or does not exist."""
        transport = Transport(p.resolve_config(api_key, api_url, request_timeout))
        try:
            info = transport.call(p.get_sandbox(sandbox_id))
        except BaseException:
            transport.close()
            raise
        return cls(info.sandbox_id, transport, info)

    @classmethod
    def list(cls, state: str | list[str] | None = "live",
             metadata: Mapping[str, str] | None = None, limit: int | None = None,
             api_key: str | None = None, api_url: str | None = None,
             request_timeout: float = 60) -> list[SandboxInfo]:
        """Your sandboxes, newest first, following pages until `limit` (None = all).

        By default the live ones (starting, running, unhealthy), as E2B's `list` gives running
        ones; `state="all"` gives every state, or name states ("killed", ["expired", ...])."""
        transport = Transport(p.resolve_config(api_key, api_url, request_timeout))
        found: list[SandboxInfo] = []
        token: str | None = None
        try:
            while limit is None or len(found) < limit:
                page = transport.call(
                    p.list_sandboxes(state, metadata, p.page_size(limit, len(found)), token))
                found += page.sandboxes
                token = page.next_token
                if not token or not page.sandboxes:
                    break
        finally:
            transport.close()
        return found if limit is None else found[:limit]

    def get_info(self) -> SandboxInfo:
        return self._keep(self._transport.call(p.get_sandbox(self.sandbox_id)))

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

    def get_url(self, port: int, expires_in: float | None = None, path: str = "/",
                routing: p.Routing = "path") -> str:
        """A signed URL to `port` that any HTTP client can open with no headers, valid
        `expires_in` seconds (None = one hour; at most a day) or until `rotate_access_token`.
        `routing="host"` gives a URL on get_host's name instead of under the API's
        /v1/sandboxes/{id}/ports/{port}."""
        return self._transport.call(p.port_url(self.sandbox_id, port, expires_in, path, routing))

    def rotate_access_token(self) -> str:
        """Give the sandbox a new access token and return it: the old one and every URL
        `get_url` signed with it stop working at once."""
        info = self._keep(self._transport.call(p.rotate_access_token(self.sandbox_id)))
        assert info.access_token is not None
        return info.access_token

    def update_network(self, network: p.NetworkSpec | None = None, *,
                       allow_out: str | Sequence[str] | None = None,
                       deny_out: str | Sequence[str] | None = None,
                       allow_internet_access: bool | None = None,
                       allow_public_traffic: bool | None = None) -> SandboxInfo:
        """Replace the sandbox's whole network policy, effective for new connections at once.

        The policy sent is `network` (a dict or a NetworkInfo) with the keywords given put over
        it; anything neither names takes its default (nothing allowed, ports private), so
        `update_network(allow_out=["pypi.org"])` also turns internet access and public ports
        off. To change one field, start from `get_info().network`."""
        body = p.network_body(network, allow_out=allow_out, deny_out=deny_out,
                              allow_internet_access=allow_internet_access,
                              allow_public_traffic=allow_public_traffic)
        return self._keep(self._transport.call(p.set_network(self.sandbox_id, body)))

    # -------------------------------------------------------------------- code interpreter

    def run_code(self, code: str, language: str | None = None,
                 context: Context | str | None = None,
                 on_stdout: Callable[[OutputMessage], Any] | None = None,
                 on_stderr: Callable[[OutputMessage], Any] | None = None,
                 on_result: Callable[[Result], Any] | None = None,
                 on_error: Callable[[ExecutionError], Any] | None = None,
                 envs: Mapping[str, str] | None = None,
                 timeout: float | None = None) -> Execution:
        """Run code in a stateful context (python by default: a Jupyter kernel).

        Without `context`, the language's default context is used. Results stream to the
        callbacks as they appear. An exception in the code is `execution.error`, not raised;
        at `timeout` (default 300 s, 0 = none) the cell is interrupted and the context kept."""
        callbacks = {"on_stdout": on_stdout, "on_stderr": on_stderr, "on_result": on_result,
                     "on_error": on_error}
        builder = p.ExecutionBuilder()
        call = p.run_code(self.sandbox_id, code, language, context, envs, timeout)
        for event in self._transport.events(call, p.code_read_timeout(timeout)):
            fired = builder.feed(event)
            if fired is not None and callbacks[fired[0]] is not None:
                callbacks[fired[0]](fired[1])  # type: ignore[misc]
        return builder.result()

    def create_code_context(self, language: str = "python", cwd: str | None = None) -> Context:
        """A new context with its own state (its own kernel, for python)."""
        return self._transport.call(p.create_code_context(self.sandbox_id, language, cwd))

    def list_code_contexts(self) -> builtins.list[Context]:
        return self._transport.call(p.list_code_contexts(self.sandbox_id))

    def restart_code_context(self, context: Context | str) -> Context:
        """Restart the context's kernel: its state is gone, its id stays."""
        return self._transport.call(p.restart_code_context(self.sandbox_id, context))

    def remove_code_context(self, context: Context | str) -> None:
        self._transport.call(p.remove_code_context(self.sandbox_id, context))

    def is_running(self) -> bool:
        try:
            return self.get_info().state == "running"
        except NotFoundError:
            return False

    def set_timeout(self, timeout: float) -> SandboxInfo:
        """The sandbox now ends `timeout` seconds from now."""
        return self._keep(self._transport.call(p.set_timeout(self.sandbox_id, timeout)))

    def kill(self) -> None:
        """Kill the sandbox (killing a dead one is fine)."""
        self._transport.call(p.kill_sandbox(self.sandbox_id))

    def close(self) -> None:
        """Release the HTTP connection; the sandbox keeps running."""
        self._transport.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.kill()
        finally:
            self.close()
