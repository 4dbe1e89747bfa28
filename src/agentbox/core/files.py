"""Files of running sandboxes: read and written as streams, listed, looked at, made, removed
and renamed, each through the sandbox's agent (which resolves every path without following a
symlink) and audited.

A service of the core (see core/manager.py, the front object): the one place that words these
agent requests.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from agentbox.agent.client import AgentOpError, AgentUnavailable
from agentbox.core.auth import Caller

if TYPE_CHECKING:
    from agentbox.core.manager import SandboxManager


class FileService:
    def __init__(self, core: SandboxManager) -> None:
        self.core = core

    async def read(
        self, caller: Caller, sandbox_id: str, path: str
    ) -> tuple[int, AsyncIterator[bytes]]:
        started = time.monotonic()
        row = self.core.reachable(caller, sandbox_id)
        try:
            size, chunks = await self.core.client(row).read_file(path)
        except (AgentOpError, AgentUnavailable) as e:
            raise self.core.failed(caller, row, "file.read", started, e, path=path) from None
        self.core.audit(caller, "file.read", sandbox_id, started=started, path=path, size=size)
        return size, chunks

    async def write(
        self, caller: Caller, sandbox_id: str, path: str, chunks: AsyncIterator[bytes]
    ) -> dict[str, Any]:
        started = time.monotonic()
        row = self.core.reachable(caller, sandbox_id)
        try:
            reply = await self.core.client(row).write_file(path, chunks)
        except (AgentOpError, AgentUnavailable) as e:
            raise self.core.failed(caller, row, "file.write", started, e, path=path) from None
        except OSError as e:  # the agent hung up mid-upload: its reply, if any, is lost
            lost = AgentUnavailable(f"lost the sandbox agent during the upload: {e}")
            raise self.core.failed(caller, row, "file.write", started, lost, path=path) from None
        entry = reply["entry"]
        self.core.audit(
            caller, "file.write", sandbox_id, started=started, path=path, size=entry.get("size")
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
    ) -> dict[str, Any]:
        """A page of entries under `path`: {entries, truncated, next_cursor}."""
        reply = await self.core.agent_do(
            caller, sandbox_id, "file.list", lambda c: c.list_dir(path, depth, limit, cursor),
            path=path,
        )  # fmt: skip
        return {
            "entries": reply.get("entries", []),
            "truncated": bool(reply.get("truncated")),
            "next_cursor": reply.get("next_cursor"),
        }

    async def stat(self, caller: Caller, sandbox_id: str, path: str) -> dict[str, Any]:
        return await self.core.agent_do(
            caller, sandbox_id, "file.stat", lambda c: c.stat(path), path=path
        )

    async def make_dir(self, caller: Caller, sandbox_id: str, path: str) -> dict[str, Any]:
        """The agent's reply: {entry, created}."""
        return await self.core.agent_do(
            caller, sandbox_id, "file.mkdir", lambda c: c.make_dir(path), path=path
        )

    async def remove(self, caller: Caller, sandbox_id: str, path: str) -> None:
        await self.core.agent_do(
            caller, sandbox_id, "file.remove", lambda c: c.remove(path), path=path
        )

    async def rename(self, caller: Caller, sandbox_id: str, src: str, dst: str) -> dict[str, Any]:
        return await self.core.agent_do(
            caller, sandbox_id, "file.rename", lambda c: c.rename(src, dst), src=src, dst=dst
        )
