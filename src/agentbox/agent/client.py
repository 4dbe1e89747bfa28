"""The control plane's side of the agent protocol (asyncio, one connection per request).

The agent is untrusted: replies are bounded by the protocol and checked here; a broken or
hostile agent can only fail its own sandbox's requests.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentbox.agent import protocol as P


class AgentUnavailable(Exception):
    """The sandbox's agent could not be reached or broke the protocol."""


class AgentOpError(Exception):
    """The agent refused an operation; carries its reason code and detail."""

    def __init__(self, code: str, message: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail or {}


@dataclass(frozen=True)
class OutputChunk:
    stream: str  # "stdout" | "stderr"
    offset: int
    data: bytes


class _Conn:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        inflight: set[_Conn] | None = None,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.inflight = inflight
        if inflight is not None:
            inflight.add(self)

    async def send(self, frame: bytes) -> None:
        self.writer.write(frame)
        await self.writer.drain()

    async def recv(self) -> tuple[int, Any]:
        """The next frame, decoded: a dict (J), an OutputChunk (O) or raw bytes (D, E)."""
        try:
            head = await self.reader.readexactly(P.HEADER.size)
            kind, length = P.HEADER.unpack(head)
            P.check_header(kind, length)
            payload = await self.reader.readexactly(length) if length else b""
            if kind == P.KIND_JSON:
                return kind, P.decode_json(payload)
            if kind == P.KIND_OUTPUT:
                stream, offset, data = P.decode_output(payload)
                return kind, OutputChunk(P.STREAM_NAMES[stream], offset, data)
        except asyncio.IncompleteReadError:
            raise AgentUnavailable("the sandbox agent closed the connection") from None
        except P.ProtocolError as e:
            raise AgentUnavailable(f"the sandbox agent broke the protocol: {e}") from None
        return kind, payload

    async def recv_json(self) -> dict[str, Any]:
        kind, msg = await self.recv()
        if kind != P.KIND_JSON:
            raise AgentUnavailable("the sandbox agent sent data where a reply was expected")
        return msg

    async def reply(self) -> dict[str, Any]:
        msg = await self.recv_json()
        while msg.get("type") == "keepalive":  # long waits (exec.wait) ping meanwhile
            msg = await self.recv_json()
        if msg.get("ok") is False:
            detail = msg.get("detail")
            raise AgentOpError(
                str(msg.get("code", "agent_error")),
                str(msg.get("message", "")),
                detail if isinstance(detail, dict) else None,
            )
        return msg

    def close(self) -> None:
        if self.inflight is not None:
            self.inflight.discard(self)
        self.writer.close()

    def abort(self) -> None:
        """Break the connection now: whoever waits on it gets AgentUnavailable."""
        self.writer.transport.abort()


class AgentClient:
    """Talks to one sandbox's agent over its Unix socket.

    `inflight`, when given, holds the client's open connections until they close, so that
    the caller can abort them all (a sandbox whose agent stopped answering)."""

    def __init__(
        self,
        socket_path: Path,
        connect_timeout: float = 5.0,
        inflight: set[_Conn] | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.connect_timeout = connect_timeout
        self.inflight = inflight

    async def _open(self, request: dict[str, Any]) -> _Conn:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(str(self.socket_path), limit=P.MAX_DATA + 64),
                self.connect_timeout,
            )
        except (TimeoutError, OSError) as e:
            raise AgentUnavailable(f"cannot reach the sandbox agent: {e}") from None
        conn = _Conn(reader, writer, self.inflight)
        try:
            await conn.send(P.encode_json(request))
        except OSError as e:
            conn.close()
            raise AgentUnavailable(f"cannot reach the sandbox agent: {e}") from None
        return conn

    async def call(self, request: dict[str, Any], timeout: float | None = 60.0) -> dict[str, Any]:
        conn = await self._open(request)
        try:
            return await asyncio.wait_for(conn.reply(), timeout)
        except TimeoutError:
            raise AgentUnavailable("the sandbox agent did not answer in time") from None
        except OSError as e:
            raise AgentUnavailable(f"lost the sandbox agent: {e}") from None
        finally:
            conn.close()

    async def ping(self, timeout: float = 2.0) -> dict[str, Any]:
        return await self.call({"op": "ping"}, timeout)

    # ------------------------------------------------------------------ typed operations
    # One method per agent operation: the control plane never words a request itself.

    # File operations take `user` ("user" or "root"; None: the sandbox's default), whose
    # permissions the agent applies (and who owns what they make).

    async def list_dir(
        self,
        path: str,
        depth: int = 1,
        limit: int | None = None,
        cursor: str | None = None,
        user: str | None = None,
        metadata: bool = False,
    ) -> dict[str, Any]:
        """A page of entries under `path`: {entries, truncated, next_cursor?}."""
        req: dict[str, Any] = {"op": "fs.list", "path": path, "depth": depth}
        if limit is not None:
            req["limit"] = limit
        if cursor is not None:
            req["cursor"] = cursor
        if metadata:  # each file's user.e2b.* xattrs too
            req["metadata"] = True
        return await self.call(_as(req, user))

    async def watch_dir(
        self, path: str, recursive: bool = False, user: str | None = None, entries: bool = False
    ) -> AsyncIterator[dict[str, Any]]:
        """A directory's changes until closed: {"type": "fs", name, op} (op: create, write,
        remove, rename, chmod; with `entries`, also the path's `entry` as fs.stat gives it when
        it is still there), {"type": "overflow"}, and a {"type": "keepalive"} after each
        silent while. Errors (no such directory, too many to watch) surface here, before any
        event."""
        request = {"op": "fs.watch", "path": path, "recursive": recursive}
        if entries:
            request["entries"] = True
        request = _as(request, user)
        return await self.event_stream(request, keepalives=True)

    async def stat(
        self, path: str, user: str | None = None, metadata: bool = False
    ) -> dict[str, Any]:
        req: dict[str, Any] = {"op": "fs.stat", "path": path}
        if metadata:
            req["metadata"] = True
        return dict((await self.call(_as(req, user)))["entry"])

    async def make_dir(self, path: str, user: str | None = None) -> dict[str, Any]:
        """{entry, created}: created is false when it was a directory already."""
        return await self.call(_as({"op": "fs.mkdir", "path": path}, user))

    async def remove(self, path: str, user: str | None = None) -> None:
        await self.call(_as({"op": "fs.remove", "path": path}, user))

    async def rename(self, src: str, dst: str, user: str | None = None) -> dict[str, Any]:
        req = _as({"op": "fs.rename", "src": src, "dst": dst}, user)
        return dict((await self.call(req))["entry"])

    async def list_commands(self) -> list[dict[str, Any]]:
        return list((await self.call({"op": "exec.list"})).get("commands", []))

    async def command_info(self, cmd_id: str) -> dict[str, Any]:
        return dict((await self.call({"op": "exec.info", "cmd_id": cmd_id}))["command"])

    async def start_command(self, **spec: Any) -> dict[str, Any]:
        """Start a background command (`cmd`, `cwd`, `envs`, `timeout`, `stdin`, `cmd_id`,
        `hidden`, `pty`: {cols, rows} for a terminal of its own); its info."""
        return dict((await self.call({"op": "exec.start", **spec}))["command"])

    async def run_command(self, **spec: Any) -> tuple[dict[str, Any], AsyncIterator[Any]]:
        """Start a foreground command (as `start_command`); its info and its event stream."""
        return await self.command_stream({"op": "exec.run", **spec})

    async def command_events(self, cmd_id: str, offset: int) -> AsyncIterator[Any]:
        """A command's output from `offset`, then its end."""
        _, stream = await self.command_stream(
            {"op": "exec.events", "cmd_id": cmd_id, "offset": offset}
        )
        return stream

    async def send_stdin(self, cmd_id: str, data: str, eof: bool) -> None:
        await self.call({"op": "exec.stdin", "cmd_id": cmd_id, "data": data, "eof": eof})

    async def kill_command(self, cmd_id: str, signal: int) -> None:
        await self.call({"op": "exec.kill", "cmd_id": cmd_id, "signal": signal})

    async def resize_terminal(self, cmd_id: str, cols: int, rows: int) -> None:
        """A command started with a `pty`: its terminal's new size."""
        await self.call(
            {"op": "exec.resize", "cmd_id": cmd_id, "pty": {"cols": cols, "rows": rows}}
        )

    async def ended_commands(self, after: int) -> dict[str, Any]:
        """Ends of commands numbered past `after`, once there is one: {seq, ends, complete}."""
        return await self.call({"op": "exec.ended", "after": after}, timeout=None)

    async def set_env(self, envs: dict[str, str]) -> None:
        """Environment for every later command and code context (a pool member's new owner)."""
        await self.call({"op": "env.set", "envs": envs})

    async def code_call(
        self, call: str, timeout: float | None = 120, **args: Any
    ) -> dict[str, Any]:
        """Code contexts: create_context, list_contexts, restart_context, remove_context, warm."""
        return await self.call({"op": "code.call", "call": call, **args}, timeout)

    async def execute_code(self, **spec: Any) -> AsyncIterator[dict[str, Any]]:
        """Run code (`code`, `envs`, `language` or `context_id`, `timeout`): its events."""
        return await self.event_stream({"op": "code.execute", **spec})

    # ------------------------------------------------------------------ files

    async def read_file(
        self, path: str, user: str | None = None
    ) -> tuple[int, AsyncIterator[bytes]]:
        """Open a file for reading; returns (size, chunks). Errors surface before the size."""
        conn = await self._open(_as({"op": "fs.read", "path": path}, user))
        try:
            head = await conn.reply()
        except BaseException:
            conn.close()
            raise

        size = int(head.get("size", 0))

        async def chunks() -> AsyncIterator[bytes]:
            # Never more than the size announced: it is the response's Content-Length, and the
            # agent runs inside the sandbox, so its stream is not trusted to keep the promise.
            left = size
            try:
                while left > 0:
                    kind, payload = await conn.recv()
                    if kind == P.KIND_END:
                        return
                    if kind != P.KIND_DATA:
                        raise AgentUnavailable("the sandbox agent broke the file stream")
                    payload = payload[:left]
                    left -= len(payload)
                    yield payload
            finally:
                conn.close()

        return size, chunks()

    async def write_file(
        self,
        path: str,
        chunks: AsyncIterator[bytes],
        user: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Write a file whole (replaced by rename once it is all in), with `metadata` as its
        user.e2b.* xattrs if given."""
        request: dict[str, Any] = {"op": "fs.write", "path": path}
        if metadata:
            request["metadata"] = metadata
        conn = await self._open(_as(request, user))
        try:
            try:
                async for chunk in chunks:
                    for i in range(0, len(chunk), P.MAX_DATA):
                        await conn.send(P.encode(P.KIND_DATA, chunk[i : i + P.MAX_DATA]))
                await conn.send(P.encode(P.KIND_END))
            except (ConnectionError, OSError):
                pass  # the agent stopped reading: its reply says why
            return await conn.reply()
        finally:
            conn.close()

    # ------------------------------------------------------------------ commands

    async def command_stream(
        self, request: dict[str, Any]
    ) -> tuple[dict[str, Any], AsyncIterator[Any]]:
        """Send an `exec.run` / `exec.events` request; returns (command info, events).

        Events are OutputChunk, {"type": "truncated"}, and finally the end event dict. Errors
        (unknown command, bad cwd) surface here, before any event.
        """
        conn = await self._open(request)
        try:
            head = await conn.reply()
        except BaseException:
            conn.close()
            raise
        info = head.get("command")
        if not isinstance(info, dict):
            conn.close()
            raise AgentUnavailable("the sandbox agent sent no command info")

        async def events() -> AsyncIterator[Any]:
            try:
                while True:
                    kind, event = await conn.recv()
                    if kind == P.KIND_OUTPUT:
                        yield event
                        continue
                    if kind != P.KIND_JSON:
                        raise AgentUnavailable("the sandbox agent broke the event stream")
                    if event.get("type") == "keepalive":
                        continue
                    yield event
                    if event.get("type") == "end":
                        return
            except OSError as e:
                raise AgentUnavailable(f"lost the sandbox agent: {e}") from None
            finally:
                conn.close()

        return info, _closed_with(events(), conn)

    # ------------------------------------------------------------------ code

    async def event_stream(
        self, request: dict[str, Any], keepalives: bool = False
    ) -> AsyncIterator[dict[str, Any]]:
        """Send a request answered by `{"ok": true}` and then JSON events, up to one whose
        type is `done` or `failed` (keepalives among them too if asked). Refusals surface
        here, before any event."""
        conn = await self._open(request)
        try:
            await conn.reply()
        except BaseException:
            conn.close()
            raise

        async def events() -> AsyncIterator[dict[str, Any]]:
            try:
                while True:
                    event = await conn.recv_json()
                    if event.get("type") == "keepalive" and not keepalives:
                        continue
                    yield event
                    if event.get("type") in ("done", "failed"):
                        return
            except OSError as e:
                raise AgentUnavailable(f"lost the sandbox agent: {e}") from None
            finally:
                conn.close()

        return _closed_with(events(), conn)


def _closed_with(events: AsyncIterator[Any], conn: _Conn) -> AsyncIterator[Any]:
    """`events`, whose connection is closed also when the generator is dropped unstarted (its
    own `finally` then never runs: a client gone before the first event)."""
    weakref.finalize(events, conn.close)
    return events


def _as(req: dict[str, Any], user: str | None) -> dict[str, Any]:
    """`req` acting as `user` (unchanged for the sandbox's default)."""
    return req if user is None else {**req, "user": user}
