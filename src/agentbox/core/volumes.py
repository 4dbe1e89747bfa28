"""Volumes: named, tenant-scoped persistent filesystems that outlive sandboxes.

A volume is a sparse ext4 image in the data dir whose size is its limit. Its files are owned by
the sandbox model's ids (`user` is 1000), not by any sandbox's host uids: a sandbox mounts it
through an idmapped mount into its own uid block, so every sandbox that mounts it over time
sees its files as its own. The server mounts the image once on the host (one filesystem
instance, however many sandboxes use it) while anything holds it: sandboxes that mount it (read
and write, one at a time: a second gets 409; read-only ones may share it) and requests of the
volume files API, which reads and writes it when no sandbox holds it.

Volumes count against the tenant's disk (their images' real blocks) and `quota.max_volumes`;
they are kept until deleted (a volume a live sandbox holds cannot be).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import posixpath
import secrets
import shutil
import stat
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentbox.core.auth import Caller
from agentbox.core.disk import DiskUse
from agentbox.core.errors import (
    AgentboxError,
    Conflict,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    QuotaExceeded,
    SandboxUnavailable,
)
from agentbox.core.requests import check_object_name
from agentbox.core.workspaces import Chunks, file_chunks, open_confined, workspace_parts
from agentbox.runtimes import diskimage
from agentbox.runtimes.base import VolumeMount
from agentbox.store.db import VolumeRow
from agentbox.vocab import USER_UID

if TYPE_CHECKING:
    from agentbox.core.manager import SandboxManager

log = logging.getLogger("agentbox.volumes")

PREFIX = "vol_"
IMAGE = "volume.img"
MOUNT = "mnt"
MAX_MOUNTS = 8  # volumes one sandbox may mount
MIN_SIZE_MB = 16
# Where a sandbox may not mount a volume: its system, the kernel's views, its private dirs.
FORBIDDEN = (
    "/proc", "/sys", "/dev", "/run", "/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32",
    "/lib64", "/libx32", "/boot", "/tmp", "/var/tmp", "/.agentbox",
)  # fmt: skip
MOUNT_PATH_DOC = (
    "an absolute path (as /data or /workspace/data) that is not /, /workspace itself, nor in "
    f"{', '.join(FORBIDDEN)}"
)


class Volumes:
    """The volumes service of the core (core/manager.py)."""

    def __init__(self, core: SandboxManager, root: Path | None) -> None:
        self.core = core
        self.root = root  # one directory per volume; None: no volumes on this server
        # Volume id -> who holds its host mount now: sandbox ids, and "api:<n>" for a files
        # request in progress. A sandbox's claim is its record (`volumes`); this is the mount's.
        self._holders: dict[str, set[str]] = {}
        self._lock = asyncio.Lock()
        self._requests = 0

    # ------------------------------------------------------------------ what there is

    def _dir(self, volume_id: str) -> Path:
        assert self.root is not None
        return self.root / volume_id

    def used_bytes(self, volume_id: str) -> int:
        try:
            return os.stat(self._dir(volume_id) / IMAGE).st_blocks * 512
        except OSError:
            return 0

    def usage(self, tenant: str) -> list[DiskUse]:
        """The disk accounting's source: each volume at its size (what it may grow to: every
        volume of a tenant may fill up, and its images are sparse)."""
        if self.root is None:
            return []
        return [
            DiskUse("volume", v.volume_id, max(self.used_bytes(v.volume_id), v.size_mb << 20))
            for v in self.core.store.list_volumes(tenant)
        ]

    def of_tenant(self, caller: Caller) -> list[VolumeRow]:
        return self.core.store.list_volumes(caller.tenant)

    def get(self, caller: Caller, ref: str) -> VolumeRow:
        """The caller's volume with this id or name (another tenant's is not found)."""
        for vol in self.core.store.list_volumes(caller.tenant):
            if ref in (vol.volume_id, vol.name):
                return vol
        raise NotFound(f"no volume {ref!r}", volume=ref)

    def mounted_by(self, volume_id: str) -> list[dict[str, Any]]:
        """The live sandboxes that mount the volume: [{"sandbox_id", "path", "read_only"}]."""
        return [
            {"sandbox_id": row.sandbox_id, "path": m["path"], "read_only": m["read_only"]}
            for row in self.core.store.live_sandboxes()
            for m in row.volumes or ()
            if m["volume_id"] == volume_id
        ]

    # ------------------------------------------------------------------ create, delete

    def _check_unmounted(self, vol: VolumeRow, instead: str) -> None:
        """409 while a sandbox mounts the volume, saying what to do `instead`."""
        users = self.mounted_by(vol.volume_id)
        if users:
            raise Conflict(
                f"volume {vol.name} is mounted by sandbox {users[0]['sandbox_id']}: {instead}",
                volume=vol.volume_id,
                sandbox_id=users[0]["sandbox_id"],
            )

    def _available(self) -> Path:
        if self.root is None:
            raise InvalidRequest("this server keeps no volumes (its runtime has no data dir)")
        return self.root

    async def create(
        self, caller: Caller, name: str, size_mb: int, metadata: dict[str, str] | None = None
    ) -> VolumeRow:
        started = time.monotonic()
        root = self._available()
        check_object_name("volume", name, PREFIX)
        quota = self.core.quota(caller.tenant)
        if not MIN_SIZE_MB <= size_mb <= quota["max_disk_mb"]:
            raise LimitExceeded(
                f"size_mb must be between {MIN_SIZE_MB} and {quota['max_disk_mb']} (the "
                "tenant's quota.max_disk_mb)",
                setting="quota.max_disk_mb",
                limit=quota["max_disk_mb"],
            )
        async with self.core.table.tenant_lock(caller.tenant):
            have = self.core.store.list_volumes(caller.tenant)
            if any(v.name == name for v in have):
                raise Conflict(f"a volume named {name!r} exists", name=name)
            if len(have) >= quota["max_volumes"]:
                raise QuotaExceeded(
                    f"tenant {caller.tenant} has {len(have)} volumes, its limit is "
                    f"{quota['max_volumes']}; delete one or ask an admin to raise "
                    "quota.max_volumes",
                    setting="quota.max_volumes",
                    limit=quota["max_volumes"],
                )
            # Counted at the size it may grow to, as a new sandbox's disk is.
            await asyncio.to_thread(self.core.disk.check_room, caller.tenant, quota, size_mb)
            self.core.admission.check_free_space(caller, started)
            volume_id = PREFIX + secrets.token_hex(8)
            d = root / volume_id
            try:
                await asyncio.to_thread(_make_image, d, size_mb)
            except BaseException:
                shutil.rmtree(d, ignore_errors=True)
                raise
            self.core.store.insert_volume(
                volume_id=volume_id, tenant=caller.tenant, name=name, size_mb=size_mb,
                created_at=time.time(), metadata=dict(metadata or {}),
            )  # fmt: skip
        self.core.audit(
            caller, "volume.create", None, status=201, started=started, volume_id=volume_id,
            name=name, size_mb=size_mb,
        )  # fmt: skip
        return self.get(caller, volume_id)

    async def delete(self, caller: Caller, ref: str) -> None:
        started = time.monotonic()
        vol = self.get(caller, ref)
        async with self.core.table.tenant_lock(caller.tenant):
            self._check_unmounted(vol, "kill it (or wait for it to end) first")
            async with self._lock:
                if self._holders.get(vol.volume_id):
                    raise Conflict(f"volume {vol.name} is being read or written; retry")
                await asyncio.to_thread(self._remove, vol.volume_id)
                self.core.store.delete_volume(vol.volume_id)
        self.core.audit(
            caller, "volume.delete", None, status=204, started=started, volume_id=vol.volume_id,
            name=vol.name,
        )  # fmt: skip

    def _remove(self, volume_id: str) -> None:
        d = self._dir(volume_id)
        if os.path.ismount(d / MOUNT) and not diskimage.unmount(d / MOUNT):
            raise SandboxUnavailable(f"volume {volume_id} could not be unmounted; retry")
        shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------ sandboxes' mounts

    def resolve(self, caller: Caller, raw: dict[str, Any] | None) -> list[dict[str, Any]]:
        """A create's `volume_mounts` ({path: name or {"volume", "read_only"}}) checked: the
        caller's volumes, at paths a volume may be mounted at, each once."""
        if not raw:
            return []
        self._available()
        if len(raw) > MAX_MOUNTS:
            raise InvalidRequest(f"at most {MAX_MOUNTS} volume mounts", setting="volume_mounts")
        out: list[dict[str, Any]] = []
        for path, spec in raw.items():
            ref, read_only = (spec, False) if isinstance(spec, str) else (
                spec.get("volume") or spec.get("name"), bool(spec.get("read_only", False))
            )  # fmt: skip
            if not isinstance(ref, str):
                raise InvalidRequest(f"volume_mounts[{path!r}] names no volume")
            clean = posixpath.normpath(path) if path.startswith("/") else ""
            if (
                clean != path
                or path.startswith("//")
                or clean in ("/", "/workspace")
                or any(clean == f or clean.startswith(f + "/") for f in FORBIDDEN)
            ):
                raise InvalidRequest(
                    f"volume_mounts: {path!r} is not a path a volume may be mounted at: "
                    + MOUNT_PATH_DOC,
                    setting="volume_mounts",
                )
            vol = self.get(caller, ref)
            if any(m["volume_id"] == vol.volume_id for m in out):
                raise InvalidRequest(f"volume {vol.name} is mounted twice in one sandbox")
            out.append({"volume_id": vol.volume_id, "path": path, "read_only": read_only})
        return out

    def check_free(self, mounts: list[dict[str, Any]]) -> None:
        """Under the tenant's lock: no read-write mount of a volume another live sandbox
        mounts read-write."""
        for m in mounts:
            if m["read_only"]:
                continue
            for user in self.mounted_by(m["volume_id"]):
                if not user["read_only"]:
                    raise Conflict(
                        f"volume {m['volume_id']} is mounted read-write by sandbox "
                        f"{user['sandbox_id']}; a volume has one read-write mount at a time "
                        "(read-only ones may share it)",
                        volume=m["volume_id"],
                        sandbox_id=user["sandbox_id"],
                    )

    async def attach(
        self, sandbox_id: str, mounts: list[dict[str, Any]]
    ) -> tuple[VolumeMount, ...]:
        """The sandbox's volumes mounted on the host (once each, whoever else holds them), as
        the runtime mounts them into it."""
        out = []
        for m in mounts:
            mnt = await self._hold(m["volume_id"], sandbox_id)
            out.append(VolumeMount(m["path"], mnt, m["read_only"]))
        return tuple(out)

    async def detach(self, sandbox_id: str) -> None:
        """The sandbox ended: volumes no one else holds are unmounted from the host."""
        for volume_id, holders in list(self._holders.items()):
            if sandbox_id in holders:
                await self._release(volume_id, sandbox_id)

    async def _hold(self, volume_id: str, holder: str) -> Path:
        async with self._lock:
            mnt = self._dir(volume_id) / MOUNT
            if not os.path.ismount(mnt):  # (also with holders: a reboot unmounted it)
                if not (self._dir(volume_id) / IMAGE).exists():
                    raise NotFound(f"volume {volume_id} is gone", volume=volume_id)
                await asyncio.to_thread(_mount, self._dir(volume_id))
            self._holders.setdefault(volume_id, set()).add(holder)
            return mnt

    async def _release(self, volume_id: str, holder: str) -> None:
        async with self._lock:
            holders = self._holders.get(volume_id, set())
            holders.discard(holder)
            if holders:
                return
            self._holders.pop(volume_id, None)
            mnt = self._dir(volume_id) / MOUNT
            if os.path.ismount(mnt) and not await asyncio.to_thread(diskimage.unmount, mnt):
                log.warning("volume %s stays mounted: still busy", volume_id)

    def recover(self) -> None:
        """At start-up: who holds which volume is what the live records say; volumes nobody
        holds are unmounted, directories no record explains removed."""
        if self.root is None:
            return
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        known = {v.volume_id for v in self.core.store.list_volumes()}
        for row in self.core.store.live_sandboxes():
            if row.parked:
                continue  # paused without memory: it mounts them again when it resumes
            for m in row.volumes or ():
                self._holders.setdefault(m["volume_id"], set()).add(row.sandbox_id)
        for d in self.root.iterdir():
            mnt = d / MOUNT
            if os.path.ismount(mnt) and not self._holders.get(d.name):
                diskimage.unmount(mnt)
            if d.name not in known:
                if not os.path.ismount(mnt):
                    shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------ the files API

    @contextlib.asynccontextmanager
    async def _files(self, caller: Caller, ref: str) -> AsyncIterator[Path]:
        """The volume's filesystem, held for one request; 409 while a sandbox mounts it."""
        vol = self.get(caller, ref)
        self._check_unmounted(vol, "use that sandbox's files API, or wait for it to end")
        self._requests += 1
        holder = f"api:{self._requests}"
        mnt = await self._hold(vol.volume_id, holder)
        try:
            yield mnt
        finally:
            await self._release(vol.volume_id, holder)

    async def read_file(self, caller: Caller, ref: str, path: str) -> tuple[int, Chunks]:
        """One regular file of the volume: its size and its bytes, streamed (the volume is
        held until the stream is closed)."""
        parts = workspace_parts(path)
        stack = contextlib.AsyncExitStack()
        try:
            root = await stack.enter_async_context(self._files(caller, ref))
            fd, size = await asyncio.to_thread(open_confined, root, parts, self.core.follow_links)
        except BaseException:
            await stack.aclose()
            raise
        return size, file_chunks(fd, size, stack)

    async def write_file(
        self, caller: Caller, ref: str, path: str, body: AsyncIterator[bytes]
    ) -> int:
        """Write one file from a stream (made with its missing directories, owned by the
        sandbox user); the bytes written. A full volume answers 400."""
        parts = workspace_parts(path)
        written = 0
        async with self._files(caller, ref) as root:
            fd = await asyncio.to_thread(_open_for_writing, root, parts, self.core.follow_links)
            try:
                async for chunk in body:
                    await asyncio.to_thread(_write_all, fd, chunk)
                    written += len(chunk)
            finally:
                os.close(fd)
        self.core.audit(caller, "volume.write", None, volume=ref, path=path, size=written)
        return written


def _make_image(d: Path, size_mb: int) -> None:
    d.mkdir(mode=0o700, parents=True)
    image = d / IMAGE
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    owner = f"{USER_UID}:{USER_UID}"
    proc = subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-m", "0", "-E", f"lazy_itable_init=1,root_owner={owner}",
         str(image)],
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise AgentboxError(f"mkfs.ext4 failed: {proc.stderr.strip()}")


def _mount(d: Path) -> None:
    mnt = d / MOUNT
    mnt.mkdir(mode=0o700, exist_ok=True)
    try:
        diskimage.mount_image(d / IMAGE, mnt)
    except diskimage.ImageError as e:
        raise SandboxUnavailable(f"volume {d.name} could not be mounted: {e}") from None
    with contextlib.suppress(OSError):
        (mnt / "lost+found").rmdir()


def _open_for_writing(root: Path, parts: list[str], follow: bool = False) -> int:
    """Open `root/parts...` for writing (created or emptied) without following a symlink or
    leaving `root` (`follow`: the security battery's positive control); missing directories
    are made. What it makes is the sandbox user's (the model's uid 1000)."""
    nofollow = (0 if follow else os.O_NOFOLLOW) | os.O_CLOEXEC
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | nofollow)
    try:
        for name in parts[:-1]:
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
                os.chown(name, USER_UID, USER_UID, dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                pass
            except OSError as e:
                raise _write_error(e, parts) from None
            try:
                nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | nofollow, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ENOTDIR, errno.ELOOP):
                    raise InvalidRequest(
                        f"{'/'.join(parts)}: {name} is not a directory (or is a symlink)"
                    ) from None
                raise
            os.close(fd)
            fd = nxt
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | nofollow | os.O_NONBLOCK
            out = os.open(parts[-1], flags, 0o644, dir_fd=fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EACCES, errno.EPERM):
                raise InvalidRequest(f"{'/'.join(parts)} is not a regular file") from None
            raise _write_error(e, parts) from None
        try:
            if not stat.S_ISREG(os.fstat(out).st_mode):
                raise InvalidRequest(f"{'/'.join(parts)} is not a regular file")
            os.fchown(out, USER_UID, USER_UID)
            os.set_blocking(out, True)
        except BaseException:
            os.close(out)
            raise
        return out
    finally:
        os.close(fd)


def _write_error(e: OSError, parts: list[str]) -> AgentboxError:
    shown = "/".join(parts)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return LimitExceeded(
            "the volume is full: delete files in it, or make a larger volume", setting="size_mb"
        )
    return InvalidRequest(f"{shown}: {os.strerror(e.errno or 0)}")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise LimitExceeded(
                "the volume is full: delete files in it, or make a larger volume",
                setting="size_mb",
            ) from None
        raise
