"""Kept workspaces: the /workspace of ended sandboxes created with `keep_workspace`. Their tenant
lists them, reads one file or the whole tree as a tar stream, and deletes them; the server
deletes them itself after the retention. They count against the tenant's disk (core/disk.py).

Their files were made by the sandbox and are read on the host, so a read never follows a
symlink (a path through one is refused; the archive holds links as links), opens nothing but a
regular file, and never leaves the workspace.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentbox.core.auth import Caller
from agentbox.core.disk import DiskUse
from agentbox.core.errors import AgentboxError, NotFound, SandboxUnavailable, from_agent
from agentbox.core.runtimes import Runtimes
from agentbox.runtimes.base import KeptWorkspace, Runtime, RuntimeError_
from agentbox.store.db import SandboxRow, Store
from agentbox.vocab import status_of

log = logging.getLogger("agentbox.workspaces")

WORKSPACE = "/workspace"
MAX_PATH = 4096
CHUNK = 1 << 20
EXPIRY_CHECK_S = 60.0  # how often expired workspaces are looked for (at most)
Chunks = AsyncGenerator[bytes, None]  # close it (`aclose`) if it is not read to the end
_cleanups: set[asyncio.Task[None]] = set()


async def to_the_end(cleanup: Awaitable[None]) -> None:
    """Await a stream's cleanup (unmount, kill tar) to its end even when the task that read the
    stream is being cancelled, as it is when its client leaves: else the mount would stay."""
    task = asyncio.ensure_future(cleanup)
    _cleanups.add(task)
    task.add_done_callback(_cleanups.discard)
    await asyncio.shield(task)


@dataclass(frozen=True)
class KeptInfo:
    """A kept workspace as its tenant sees it."""

    sandbox_id: str
    tenant: str
    template: str
    metadata: dict[str, str] = field(default_factory=dict)
    used_bytes: int = 0
    kept_at: float = 0.0
    expires_at: float = 0.0


def _path_error(code: str, message: str, path: str, **detail: Any) -> AgentboxError:
    # The same codes as the live files API (the agent's; their statuses: vocab.STATUS).
    return from_agent(code, message, {"path": path, **detail})


async def file_chunks(fd: int, size: int, stack: contextlib.AsyncExitStack) -> Chunks:
    """The `size` bytes of the open file `fd`, read in chunks as they are sent; the file is
    closed and `stack` (what holds it readable: a mount) closed at the end, however it ends."""
    try:
        left = size  # the size sent as Content-Length is a promise: never more
        while left > 0:
            chunk = await asyncio.to_thread(os.read, fd, min(CHUNK, left))
            if not chunk:
                break
            left -= len(chunk)
            yield chunk
    finally:
        os.close(fd)
        await to_the_end(stack.aclose())


def workspace_parts(raw: str) -> list[str]:
    """A path in a kept workspace (`/workspace/a/b` or `a/b`) as its components."""
    if not raw or "\0" in raw:
        raise _path_error("invalid_path", "path must be a non-empty string without NUL", raw)
    if len(raw.encode("utf-8", "surrogateescape")) > MAX_PATH:
        raise _path_error("invalid_path", f"path is longer than {MAX_PATH} bytes", raw)
    rel = raw
    if raw.startswith("/"):
        if raw != WORKSPACE and not raw.startswith(WORKSPACE + "/"):
            raise _path_error(
                "invalid_path",
                f"{raw}: a kept workspace holds only {WORKSPACE}; give a path below it",
                raw,
            )
        rel = raw[len(WORKSPACE) :]
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _path_error("invalid_path", f"{raw}: '..' is not allowed in paths", raw)
    if not parts:
        raise _path_error(
            "is_a_directory", f"{raw} is the workspace itself; download /archive for all of it", raw
        )
    return parts


def open_confined(root: Path, parts: list[str], follow: bool = False) -> tuple[int, int]:
    """Open the regular file `root/parts...` for reading without following any symlink or
    leaving `root` (`follow`: the security battery's positive control); (fd, size). Raises
    the files API's errors."""
    shown = WORKSPACE + "/" + "/".join(parts)
    nofollow = (0 if follow else os.O_NOFOLLOW) | os.O_CLOEXEC
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | nofollow)
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            # O_NONBLOCK: opening a FIFO must not hang; O_NOCTTY: nor adopt a terminal.
            flags = os.O_RDONLY | nofollow | (os.O_NONBLOCK | os.O_NOCTTY if last else 0)
            try:
                nxt = os.open(name, flags | (0 if last else os.O_DIRECTORY), dir_fd=fd)
            except OSError as e:
                at = WORKSPACE + "/" + "/".join(parts[: i + 1])
                raise _open_error(e, fd, name, at, shown) from None
            os.close(fd)
            fd = nxt
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise _path_error("is_a_directory", f"{shown} is a directory", shown)
        if not stat.S_ISREG(st.st_mode):
            raise _path_error("not_a_regular_file", f"{shown} is not a regular file", shown)
        os.set_blocking(fd, True)
        return fd, st.st_size
    except BaseException:
        os.close(fd)
        raise


def _open_error(e: OSError, dir_fd: int, name: str, at: str, shown: str) -> AgentboxError:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        target = os.readlink(name, dir_fd=dir_fd)
        return _path_error(
            "symlink_refused",
            f"{at} is a symbolic link (to {target}); kept workspaces are read without "
            "following symlinks: use the real path",
            shown,
            link=at,
            target=target,
        )
    if e.errno == errno.ENOENT:
        return _path_error("path_not_found", f"{shown}: no such file or directory", shown)
    if e.errno == errno.ENOTDIR:
        return _path_error("not_a_directory", f"{at} is not a directory", shown)
    if e.errno in (errno.ENXIO, errno.ENODEV, errno.EACCES, errno.EPERM):
        return _path_error("not_a_regular_file", f"{shown} is not a regular file", shown)
    return _path_error("io_error", f"{shown}: {os.strerror(e.errno or 0)}", shown)


class KeptWorkspaces:
    """The tenant-facing side of kept workspaces, over what the runtime keeps on the host."""

    def __init__(
        self,
        store: Store,
        runtimes: Runtimes,
        retention_s: float,
        audit: Callable[..., None],
        follow_links: bool = False,
    ) -> None:
        self.store = store
        self.follow_links = follow_links
        self.runtimes = runtimes
        self.retention_s = retention_s
        self.audit = audit
        # Records of ended sandboxes never change again: kept here, not read on every create.
        self._rows: dict[str, SandboxRow | None] = {}

    # ------------------------------------------------------------------ what there is

    def _row(self, sandbox_id: str) -> SandboxRow | None:
        if sandbox_id not in self._rows:
            row = self.store.get_sandbox(sandbox_id)
            if row is not None and row.live:
                return row  # ending right now: its record is about to change
            self._rows[sandbox_id] = row
        return self._rows[sandbox_id]

    def _info(self, kept: KeptWorkspace, row: SandboxRow) -> KeptInfo:
        kept_at = row.ended_at or kept.kept_at
        return KeptInfo(
            sandbox_id=kept.sandbox_id,
            tenant=row.tenant,
            template=row.template,
            metadata=dict(row.metadata),
            used_bytes=kept.used_bytes,
            kept_at=kept_at,
            expires_at=kept_at + self.retention_s,
        )

    def _keepers(self) -> list[Runtime]:
        return [rt for rt in self.runtimes if self.runtimes.features(rt.name).kept_workspaces]

    def _all(self) -> list[tuple[KeptWorkspace, SandboxRow | None]]:
        return [
            (k, self._row(k.sandbox_id)) for rt in self._keepers() for k in rt.kept_workspaces()
        ]

    def _runtime(self, sandbox_id: str) -> Runtime:
        """The runtime that holds a kept workspace: its sandbox's, or (no record left) the
        first that lists it."""
        row = self._row(sandbox_id)
        if row is not None:
            return self.runtimes.for_row(row)
        for rt in self._keepers():
            if any(k.sandbox_id == sandbox_id for k in rt.kept_workspaces()):
                return rt
        raise NotFound(f"no kept workspace of sandbox {sandbox_id}", sandbox_id=sandbox_id)

    def of_tenant(self, tenant: str) -> list[KeptInfo]:
        """The tenant's kept workspaces, most recently kept first (reads the host: a thread)."""
        found = [self._info(k, row) for k, row in self._all() if row and row.tenant == tenant]
        return sorted(found, key=lambda i: i.kept_at, reverse=True)

    def usage(self, tenant: str) -> list[DiskUse]:
        """The disk accounting's source for kept workspaces."""
        return [
            DiskUse("kept_workspace", i.sandbox_id, i.used_bytes) for i in self.of_tenant(tenant)
        ]

    async def _owned(self, caller: Caller, sandbox_id: str) -> KeptInfo:
        for info in await asyncio.to_thread(self.of_tenant, caller.tenant):
            if info.sandbox_id == sandbox_id:
                return info
        # Another tenant's is indistinguishable from one that never existed.
        raise NotFound(f"no kept workspace of sandbox {sandbox_id}", sandbox_id=sandbox_id)

    # ------------------------------------------------------------------ reading

    async def _open(self, sandbox_id: str) -> tuple[contextlib.AsyncExitStack, Path]:
        """The workspace's files, held open until the stack is closed."""
        stack = contextlib.AsyncExitStack()
        try:
            runtime = self._runtime(sandbox_id)
            root = await stack.enter_async_context(runtime.kept_workspace_files(sandbox_id))
        except (RuntimeError_, AgentboxError) as e:
            await stack.aclose()
            raise SandboxUnavailable(str(e)) from None
        return stack, root

    async def read_file(self, caller: Caller, sandbox_id: str, path: str) -> tuple[int, Chunks]:
        """One regular file of the caller's kept workspace: its size and its bytes."""
        started = time.monotonic()
        parts = workspace_parts(path)
        await self._owned(caller, sandbox_id)
        stack, root = await self._open(sandbox_id)
        try:
            fd, size = await asyncio.to_thread(open_confined, root, parts, self.follow_links)
        except AgentboxError as e:
            await stack.aclose()
            self.audit(
                caller,
                "workspace.read",
                sandbox_id,
                status=status_of(e.code),
                started=started,
                path=path,
                error=e.code,
            )
            raise
        except BaseException:
            await stack.aclose()
            raise
        self.audit(caller, "workspace.read", sandbox_id, started=started, path=path, size=size)
        return size, file_chunks(fd, size, stack)

    async def archive(self, caller: Caller, sandbox_id: str) -> Chunks:
        """The whole kept workspace as a tar stream (GNU tar, sparse files as holes, symlinks
        as links), made as it is sent: never held in memory or on disk."""
        started = time.monotonic()
        info = await self._owned(caller, sandbox_id)
        stack, root = await self._open(sandbox_id)
        try:
            proc = await asyncio.create_subprocess_exec(
                "tar",
                "--create",
                "--file=-",
                f"--directory={root}",
                "--sparse",
                "--numeric-owner",
                "--one-file-system",
                "--warning=no-file-ignored",
                ".",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
        except BaseException:
            await stack.aclose()
            raise
        self.audit(
            caller, "workspace.archive", sandbox_id, started=started, used_bytes=info.used_bytes
        )
        return self._tar_chunks(sandbox_id, proc, stack)

    @staticmethod
    async def _tar_chunks(
        sandbox_id: str, proc: asyncio.subprocess.Process, stack: contextlib.AsyncExitStack
    ) -> Chunks:
        stdout = proc.stdout
        assert stdout is not None

        async def cleanup() -> None:
            if proc.returncode is None:
                proc.kill()
            # wait() returns only once stdout is at its end too, and a reader that left
            # early left it paused with a full buffer: drain what the dead tar wrote.
            while await stdout.read(CHUNK):
                pass
            await proc.wait()
            await stack.aclose()

        try:
            while chunk := await stdout.read(CHUNK):
                yield chunk
            # 1: a file changed while read (it cannot here); more is a failure, and the
            # archive the client got is cut short.
            if await proc.wait() > 1:
                log.warning("archive of %s: tar exited %d", sandbox_id, proc.returncode)
        finally:
            await to_the_end(cleanup())

    # ------------------------------------------------------------------ removal

    async def remove(self, caller: Caller, sandbox_id: str) -> None:
        started = time.monotonic()
        info = await self._owned(caller, sandbox_id)
        await self._runtime(sandbox_id).remove_kept_workspace(sandbox_id)
        self._rows.pop(sandbox_id, None)
        self.audit(
            caller,
            "workspace.remove",
            sandbox_id,
            status=204,
            started=started,
            used_bytes=info.used_bytes,
        )

    async def expire(self) -> int:
        """Delete the kept workspaces past the retention; how many."""
        now = time.time()
        removed = 0
        for kept, row in await asyncio.to_thread(self._all):
            if row is not None and row.live:
                continue
            kept_at = (row.ended_at if row else None) or kept.kept_at
            if kept_at + self.retention_s > now:
                continue
            if await self._runtime(kept.sandbox_id).remove_kept_workspace(kept.sandbox_id):
                removed += 1
                self.audit(
                    None,
                    "workspace.expire",
                    kept.sandbox_id,
                    tenant=row.tenant if row else None,
                    used_bytes=kept.used_bytes,
                    kept_at=kept_at,
                )
            self._rows.pop(kept.sandbox_id, None)
        return removed

    async def run_expiry(self) -> None:
        """Expire kept workspaces, forever (the manager's background task)."""
        interval = min(EXPIRY_CHECK_S, max(0.5, self.retention_s / 4))
        while True:
            try:
                await self.expire()
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("could not expire kept workspaces")
            await asyncio.sleep(interval)
