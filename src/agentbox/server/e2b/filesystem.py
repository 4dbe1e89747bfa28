"""envd's `filesystem.Filesystem` service: a sandbox's files as the /v1 files API's.
Directories are watched with inotify in the sandbox (WatchDir streams; CreateWatcher's
watchers hold events until polled), as many per sandbox as the core allows (core/files.py).
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from agentbox.agent.client import AgentUnavailable
from agentbox.core.errors import AgentboxError
from agentbox.server.e2b.connect import (
    call,
    guard_methods,
    oneof,
    relay,
    request_caller,
    request_user,
)
from agentbox.server.e2b.wire.filesystem import filesystem_pb as fs
from agentbox.server.e2b.wire.filesystem.filesystem_connect import (
    Filesystem,
)
from agentbox.server.surfaces import Core

MAX_LIST_ENTRIES = 10_000  # ListDir answers in one message; deeper trees are refused, said so
MAX_LIST_DEPTH = 64  # as the /v1 files API's
MAX_LIST_PAGES = 100  # agent pages read for one ListDir


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


@guard_methods
class FilesystemService(Filesystem):
    """filesystem.Filesystem: the request's sandbox's files, as the /v1 files API's."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._watchers: dict[str, _Watcher] = {}

    async def stat(self, request: fs.StatRequest, ctx: RequestContext) -> fs.StatResponse:
        caller, sandbox_id = request_caller()
        files = self.core.manager.files
        entry = await call(files.stat(caller, sandbox_id, request.path, request_user(ctx), True))
        return fs.StatResponse(entry=entry_info(entry))

    async def make_dir(self, request: fs.MakeDirRequest, ctx: RequestContext) -> fs.MakeDirResponse:
        caller, sandbox_id = request_caller()
        files = self.core.manager.files
        try:
            reply = await files.make_dir(caller, sandbox_id, request.path, request_user(ctx))
        except AgentboxError as e:
            if e.code == "path_exists":  # a file is there: envd's "invalid", not "exists"
                raise ConnectError(Code.INVALID_ARGUMENT, e.message) from None
            raise
        if not reply.get("created"):  # envd's answer, which the SDK reads as "not made"
            raise ConnectError(Code.ALREADY_EXISTS, f"directory {request.path} already exists")
        return fs.MakeDirResponse(entry=entry_info(reply.get("entry") or {}))

    async def move(self, request: fs.MoveRequest, ctx: RequestContext) -> fs.MoveResponse:
        caller, sandbox_id = request_caller()
        files = self.core.manager.files
        src, dst, user = request.source, request.destination, request_user(ctx)
        entry = await call(files.rename(caller, sandbox_id, src, dst, user))
        return fs.MoveResponse(entry=entry_info(entry))

    async def list_dir(self, request: fs.ListDirRequest, ctx: RequestContext) -> fs.ListDirResponse:
        caller, sandbox_id = request_caller()
        files, user = self.core.manager.files, request_user(ctx)
        depth = max(int(request.depth), 1)
        if depth > MAX_LIST_DEPTH:
            raise ConnectError(Code.INVALID_ARGUMENT, f"depth: at most {MAX_LIST_DEPTH}")
        entries: list[fs.EntryInfo] = []
        cursor: str | None = None
        for _ in range(MAX_LIST_PAGES):
            page = await call(
                files.list(caller, sandbox_id, request.path, depth, None, cursor, user, True)
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
        caller, sandbox_id = request_caller()
        files = self.core.manager.files
        await call(files.remove(caller, sandbox_id, request.path, request_user(ctx)))
        return fs.RemoveResponse()

    async def watch_dir(
        self, request: fs.WatchDirRequest, ctx: RequestContext
    ) -> AsyncIterator[fs.WatchDirResponse]:
        """The directory's changes, streamed: a start event once the watch is set, then
        create/write/remove/rename/chmod events by name (relative to the directory)."""
        caller, sandbox_id = request_caller()
        files = self.core.manager.files
        path, recursive, user = request.path, request.recursive, request_user(ctx)
        entries = request.include_entry
        events = await call(files.watch(caller, sandbox_id, path, recursive, user, entries))

        def convert(item: dict[str, Any]) -> tuple[list[fs.WatchDirResponse], bool]:
            if item.get("type") == "keepalive":
                return [], False
            return [fs.WatchDirResponse(event=oneof("filesystem", _fs_event(item)))], False

        def keepalive() -> fs.WatchDirResponse:
            return fs.WatchDirResponse(event=oneof("keepalive", fs.WatchDirResponse.KeepAlive()))

        start = fs.WatchDirResponse(event=oneof("start", fs.WatchDirResponse.StartEvent()))
        async with aclosing(relay(start, events, convert, keepalive)) as stream:
            async for message in stream:
                yield message

    async def create_watcher(
        self, request: fs.CreateWatcherRequest, ctx: RequestContext
    ) -> fs.CreateWatcherResponse:
        caller, sandbox_id = request_caller()
        user = request_user(ctx)
        await self._sweep()
        if sum(w.sandbox_id == sandbox_id for w in self._watchers.values()) >= MAX_WATCHERS:
            raise ConnectError(
                Code.FAILED_PRECONDITION,
                f"this sandbox has {MAX_WATCHERS} watchers: remove one (remove_watcher) first",
            )
        files = self.core.manager.files
        path, recursive, entries = request.path, request.recursive, request.include_entry
        events = await call(files.watch(caller, sandbox_id, path, recursive, user, entries))
        watcher_id = secrets.token_hex(12)
        self._watchers[watcher_id] = _Watcher(sandbox_id, events)
        await asyncio.sleep(0)  # its task has begun: a stop now closes the agent's stream
        return fs.CreateWatcherResponse(watcher_id=watcher_id)

    async def get_watcher_events(
        self, request: fs.GetWatcherEventsRequest, ctx: RequestContext
    ) -> fs.GetWatcherEventsResponse:
        _, sandbox_id = request_caller()
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
        _, sandbox_id = request_caller()
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
