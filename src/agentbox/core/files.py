"""Files of running sandboxes: read and written as streams, listed, looked at, made, removed
and renamed, each through the sandbox's agent (which resolves every path without following a
symlink) and audited.

A service of the core (see core/manager.py, the front object): the one place that words these
agent requests.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from agentbox.agent.client import AgentOpError, AgentUnavailable
from agentbox.core.auth import Caller
from agentbox.core.errors import Conflict, InvalidRequest

if TYPE_CHECKING:
    from agentbox.core.manager import SandboxManager


def check_user(user: str | None) -> None:
    if user not in (None, "user", "root"):
        raise InvalidRequest(f'user must be "user" or "root", not {user!r}')


def _who(user: str | None) -> dict[str, Any]:
    """What the audit notes of the acting user: nothing for the sandbox's default."""
    return {} if user is None else {"user": user}


MAX_WATCHES = 16  # directory watches open at once per sandbox


async def _closing(events: AsyncIterator[dict[str, Any]]) -> AsyncGenerator[dict[str, Any], None]:
    """`events`, closed with this (a generator's frame is its liveness, for the count)."""
    try:
        async for event in events:
            yield event
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()


class FileService:
    """Each operation takes `user` ("user" or "root"; None: the sandbox's default user), whose
    permissions apply inside the sandbox and who owns what it makes."""

    def __init__(self, core: SandboxManager) -> None:
        self.core = core
        # Each sandbox's open directory watches (their event iterators, while alive).
        self._watches: dict[str, weakref.WeakSet[AsyncGenerator[dict[str, Any], None]]] = {}
        self._starting: dict[str, int] = {}  # watches being set up, their places held

    async def read(
        self, caller: Caller, sandbox_id: str, path: str, user: str | None = None
    ) -> tuple[int, AsyncIterator[bytes]]:
        check_user(user)
        started = time.monotonic()
        row = await self.core.awake(caller, sandbox_id)
        try:
            size, chunks = await self.core.client(row).read_file(path, user)
        except (AgentOpError, AgentUnavailable) as e:
            raise self.core.failed(caller, row, "file.read", started, e, path=path) from None
        self.core.audit(
            caller, "file.read", sandbox_id, started=started, path=path, size=size, **_who(user)
        )
        return size, chunks

    async def write(
        self,
        caller: Caller,
        sandbox_id: str,
        path: str,
        chunks: AsyncIterator[bytes],
        user: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Write a file; `metadata` (E2B's file metadata) is kept as its user.e2b.* xattrs."""
        check_user(user)
        started = time.monotonic()
        row = await self.core.awake(caller, sandbox_id)
        try:
            reply = await self.core.client(row).write_file(path, chunks, user, metadata)
        except (AgentOpError, AgentUnavailable) as e:
            raise self.core.failed(caller, row, "file.write", started, e, path=path) from None
        except OSError as e:  # the agent hung up mid-upload: its reply, if any, is lost
            lost = AgentUnavailable(f"lost the sandbox agent during the upload: {e}")
            raise self.core.failed(caller, row, "file.write", started, lost, path=path) from None
        entry = reply["entry"]
        self.core.audit(
            caller,
            "file.write",
            sandbox_id,
            started=started,
            path=path,
            size=entry.get("size"),
            **_who(user),
        )
        return entry

    async def list(
        self,
        caller: Caller,
        sandbox_id: str,
        path: str,
        depth: int = 1,
        limit: int | None = None,
        cursor: str | None = None,
        user: str | None = None,
        metadata: bool = False,
    ) -> dict[str, Any]:
        """A page of entries under `path`: {entries, truncated, next_cursor}."""
        check_user(user)
        reply = await self.core.agent_do(
            caller, sandbox_id, "file.list",
            lambda c: c.list_dir(path, depth, limit, cursor, user, metadata), path=path,
            **_who(user),
        )  # fmt: skip
        return {
            "entries": reply.get("entries", []),
            "truncated": bool(reply.get("truncated")),
            "next_cursor": reply.get("next_cursor"),
        }

    async def watch(
        self,
        caller: Caller,
        sandbox_id: str,
        path: str,
        recursive: bool = False,
        user: str | None = None,
        entries: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        """A directory's changes until the iterator is closed (AgentClient.watch_dir), at
        most MAX_WATCHES open per sandbox (each holds a thread and an inotify instance in it)."""
        check_user(user)
        live = self._watches.setdefault(sandbox_id, weakref.WeakSet())
        held = sum(getattr(w, "ag_frame", None) is not None for w in live)
        if held + self._starting.get(sandbox_id, 0) >= MAX_WATCHES:
            raise Conflict(
                f"this sandbox has {MAX_WATCHES} directory watches open already: stop one first"
            )
        self._starting[sandbox_id] = self._starting.get(sandbox_id, 0) + 1  # its place, now
        try:
            events = await self.core.agent_do(
                caller, sandbox_id, "file.watch",
                lambda c: c.watch_dir(path, recursive, user, entries), path=path,
                recursive=recursive,
                **_who(user),
            )  # fmt: skip
            watch = _closing(events)
            live.add(watch)
        finally:
            self._starting[sandbox_id] -= 1
            if not self._starting[sandbox_id]:
                del self._starting[sandbox_id]
        return watch

    def forget(self, sandbox_id: str) -> None:
        """An ended sandbox's watches (their streams end with its agent)."""
        self._watches.pop(sandbox_id, None)

    async def stat(
        self,
        caller: Caller,
        sandbox_id: str,
        path: str,
        user: str | None = None,
        metadata: bool = False,
    ) -> dict[str, Any]:
        """A path's entry; with `metadata`, a file's user.e2b.* xattrs (E2B's file metadata)."""
        check_user(user)
        return await self.core.agent_do(
            caller, sandbox_id, "file.stat", lambda c: c.stat(path, user, metadata), path=path,
            **_who(user),
        )  # fmt: skip

    async def make_dir(
        self, caller: Caller, sandbox_id: str, path: str, user: str | None = None
    ) -> dict[str, Any]:
        """The agent's reply: {entry, created}."""
        check_user(user)
        return await self.core.agent_do(
            caller, sandbox_id, "file.mkdir", lambda c: c.make_dir(path, user), path=path,
            **_who(user),
        )  # fmt: skip

    async def remove(
        self, caller: Caller, sandbox_id: str, path: str, user: str | None = None
    ) -> None:
        check_user(user)
        await self.core.agent_do(
            caller, sandbox_id, "file.remove", lambda c: c.remove(path, user), path=path,
            **_who(user),
        )  # fmt: skip

    async def rename(
        self, caller: Caller, sandbox_id: str, src: str, dst: str, user: str | None = None
    ) -> dict[str, Any]:
        check_user(user)
        return await self.core.agent_do(
            caller, sandbox_id, "file.rename", lambda c: c.rename(src, dst, user), src=src,
            dst=dst, **_who(user),
        )  # fmt: skip
