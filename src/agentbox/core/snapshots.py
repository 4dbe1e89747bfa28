"""Snapshots and forks: a sandbox's disk (its root layer and workspace, one image) copied while
it runs or sleeps, kept as something new sandboxes start from.

A snapshot freezes the sandbox only for the copy (core/creation.py then starts sandboxes from
it: `template=<snapshot id or name>`). It belongs to its tenant, counts against the tenant's
disk (its image's real blocks) and snapshot count, outlives its sandbox and a server restart,
and keeps the template tree its root layer was made on (a template rebuilt since does not
change what a sandbox started from it sees). A fork is a snapshot no one lists, started N times
and then removed. Memory is not copied: a sandbox started from either boots fresh on the disk.

A snapshot is `creating` until its image is whole: a server that stops meanwhile removes it on
its next start, with any image directory no record explains.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentbox.core import quotas
from agentbox.core.auth import Caller
from agentbox.core.disk import DiskUse
from agentbox.core.errors import (
    AgentboxError,
    Conflict,
    InvalidRequest,
    NotFound,
    QuotaExceeded,
    SandboxUnavailable,
)
from agentbox.core.requests import CreateRequest, check_metadata, check_object_name
from agentbox.core.states import SandboxState
from agentbox.core.template_service import TEMPLATE_ROOTFS
from agentbox.runtimes.base import DiskSource, Resources, RuntimeError_, Snapshottable
from agentbox.runtimes.diskimage import can_reflink
from agentbox.store.db import SandboxRow, SnapshotRow
from agentbox.templates import TemplateInfo
from agentbox.vocab import status_of

if TYPE_CHECKING:
    from agentbox.core.manager import SandboxManager

log = logging.getLogger("agentbox.snapshots")

PREFIX = "snap_"
IMAGE = "disk.img"
MAX_FORKS = 16  # children of one fork request
CREATING, READY = "creating", "ready"
_ALIVE = frozenset({SandboxState.RUNNING, SandboxState.PAUSED})


@dataclass(frozen=True)
class StartFrom:
    """A start from a disk image rather than a fresh disk: a snapshot's, a fork's copy of its
    parent's, or a sandbox's own disk when it starts again after a pause without memory
    (core/parking.py)."""

    template: str
    runtime: str  # the tier it was taken on: the default for the new sandbox
    disk_mb: int  # the image's size: the least disk_mb the new sandbox may have
    disk: DiskSource
    rootfs: str | None  # the template tree its root layer was made on
    origin: dict[str, str]  # stored with the new sandbox: {"snapshot": id} / {"fork_of": id}
    hold: str | None = None  # the snapshot to keep from deletion while it is copied


class Snapshots:
    """Taking, listing, deleting snapshots; forking. A service of the core (core/manager.py)."""

    def __init__(self, core: SandboxManager, root: Path | None) -> None:
        self.core = core
        self.root = root  # the images, one directory each; None: no snapshots on this server
        self._in_use: Counter[str] = Counter()  # snapshot id -> sandboxes starting from it
        self.copy_method: str | None = None  # "reflink" or "sparse", found at start-up
        # Tenants that have (or had, since start-up) a snapshot: a create naming a template
        # looks for a snapshot of that name only for them.
        self._tenants: set[str] = set()

    # ------------------------------------------------------------------ what there is

    def usage(self, tenant: str) -> list[DiskUse]:
        """The disk accounting's source: each snapshot's image, by its real blocks."""
        return [
            DiskUse("snapshot", s.snapshot_id, s.used_bytes)
            for s in self.core.store.list_snapshots(tenant)
        ]

    def of_tenant(self, caller: Caller) -> list[SnapshotRow]:
        return [s for s in self.core.store.list_snapshots(caller.tenant) if s.state == READY]

    def get(self, caller: Caller, ref: str) -> SnapshotRow:
        """The caller's ready snapshot with this id or name (another tenant's is not found)."""
        found = self._find(caller.tenant, ref)
        if found is None:
            raise NotFound(f"no snapshot {ref!r}", snapshot=ref)
        return found

    def _find(self, tenant: str, ref: str) -> SnapshotRow | None:
        if ref.startswith(PREFIX):
            snap = self.core.store.get_snapshot(ref)
            ok = snap is not None and snap.tenant == tenant and snap.state == READY
            return snap if ok else None
        for snap in self.core.store.list_snapshots(tenant):
            if snap.name == ref and snap.state == READY:
                return snap
        return None

    def _image(self, snapshot_id: str) -> Path:
        assert self.root is not None
        return self.root / snapshot_id / IMAGE

    def start_from(self, tenant: str, template: str | None) -> StartFrom | None:
        """What a create naming `template` starts from, when that names one of the tenant's
        snapshots (an id, or a name: a snapshot's name comes before a template's)."""
        if not template or self.root is None:
            return None
        if tenant not in self._tenants and not template.startswith(PREFIX):
            return None
        snap = self._find(tenant, template)
        if snap is None:
            if template.startswith(PREFIX):
                raise NotFound(f"no snapshot {template!r}", snapshot=template)
            return None
        return StartFrom(
            template=snap.template,
            runtime=snap.runtime,
            disk_mb=snap.disk_mb,
            disk=DiskSource(self._image(snap.snapshot_id), snap.uid, snap.span),
            rootfs=snap.rootfs,
            origin={"snapshot": snap.snapshot_id},
            hold=snap.snapshot_id,
        )

    def request_from(self, req: CreateRequest, start: StartFrom) -> CreateRequest:
        """A create from a disk image: its tier by default, a disk at least as large."""
        asked = req.resources.get("disk_mb")
        if asked is not None and int(asked) < start.disk_mb:
            raise InvalidRequest(
                f"resources.disk_mb {asked} is smaller than the disk it starts from "
                f"({start.disk_mb} MiB); ask for at least that, or leave it out",
                setting="resources.disk_mb",
            )
        return dataclasses.replace(
            req,
            runtime=req.runtime or start.runtime,
            resources={**req.resources, "disk_mb": asked or start.disk_mb},
        )

    async def image_template(self, start: StartFrom) -> TemplateInfo | None:
        """The template of a sandbox started from an image, on the tree its root layer was
        made on (kept for it even if the template was rebuilt since)."""
        try:
            tpl = await self.core.template(start.template)
        except NotFound:
            raise Conflict(
                f"template {start.template!r}, which the disk was taken with, was removed; "
                "build it again to start from this disk",
                template=start.template,
            ) from None
        if tpl is None or start.rootfs is None:
            return tpl
        if not Path(start.rootfs).is_dir():
            raise Conflict(
                f"the tree of template {start.template!r} this disk was made on is gone",
                template=start.template,
            )
        return dataclasses.replace(tpl, rootfs=Path(start.rootfs))

    @contextlib.contextmanager
    def holding(self, start: StartFrom | None) -> Iterator[None]:
        """While a sandbox copies a snapshot's image, the snapshot cannot be deleted."""
        key = start.hold if start is not None else None
        if key:
            self._in_use[key] += 1
        try:
            yield
        finally:
            if key:
                self._in_use[key] -= 1
                if self._in_use[key] <= 0:
                    del self._in_use[key]

    # ------------------------------------------------------------------ taking one

    def _snapshottable(self, row: SandboxRow) -> Snapshottable:
        runtime = self.core.runtimes.for_row(row)
        if (
            self.root is None
            or not self.core.runtimes.features(runtime.name).snapshot
            or not isinstance(runtime, Snapshottable)
        ):
            raise InvalidRequest(
                f"the {runtime.name} isolation tier cannot snapshot or fork sandboxes on this "
                "server (it needs loop devices and a cgroup freezer)",
                setting="isolation",
            )
        return runtime

    def _live(self, caller: Caller, sandbox_id: str) -> SandboxRow:
        row = self.core.owned(caller, sandbox_id)
        if SandboxState(row.state) not in _ALIVE:
            raise self.core.not_running(row)
        return row

    async def _copy(self, row: SandboxRow, runtime: Snapshottable, dest: Path) -> DiskSource:
        """Copy the running or paused sandbox's disk to `dest`, under its lock (no pause,
        resume or end meanwhile)."""
        async with self.core.table.lock(row.sandbox_id):
            fresh = self.core.store.get_sandbox(row.sandbox_id)
            if fresh is None or SandboxState(fresh.state) not in _ALIVE:
                raise self.core.not_running(fresh or row)
            assert fresh.runtime_state is not None
            # To its end, lock held, even if this request is cancelled: the sandbox is frozen
            # while it runs, and thawed by it.
            copy = asyncio.ensure_future(
                runtime.snapshot(row.sandbox_id, fresh.runtime_state, dest)
            )
            try:
                return await asyncio.shield(copy)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await copy
                raise
            except RuntimeError_ as e:
                raise SandboxUnavailable(
                    f"the disk of sandbox {row.sandbox_id} could not be copied: {e}"
                ) from None

    def _check_room(self, caller: Caller, row: SandboxRow) -> None:
        """The tenant's snapshot count and disk must allow one more (the sandbox's disk as it
        is now: what its copy will take)."""
        quota = self.core.quota(caller.tenant)
        have = len(self.core.store.list_snapshots(caller.tenant))
        if have >= quota["max_snapshots"]:
            raise QuotaExceeded(
                f"tenant {caller.tenant} has {have} snapshots, its limit is "
                f"{quota['max_snapshots']}; delete one (DELETE /v1/snapshots/{{id}}) or ask an "
                "admin to raise quota.max_snapshots",
                setting="quota.max_snapshots",
                limit=quota["max_snapshots"],
            )
        runtime = self.core.runtimes.for_row(row)
        used = runtime.workspace_bytes(row.sandbox_id, row.runtime_state or {}) or 0
        self.core.disk.check_room(caller.tenant, quota, -(-used // (1 << 20)))

    async def create(
        self,
        caller: Caller,
        sandbox_id: str,
        name: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> SnapshotRow:
        """Snapshot the caller's running or paused sandbox; the ready snapshot."""
        started = time.monotonic()
        row = self._live(caller, sandbox_id)
        runtime = self._snapshottable(row)
        check_metadata(metadata or {})
        snapshot_id = PREFIX + secrets.token_hex(8)
        image = self._image(snapshot_id)
        async with self.core.table.tenant_lock(caller.tenant):
            if name is not None:
                self._check_name(caller, name)
            await asyncio.to_thread(self._check_room, caller, row)
            self.core.admission.check_free_space(caller, started)
            self._insert(caller, snapshot_id, row, name, metadata)
        try:
            image.parent.mkdir(mode=0o700, parents=True)
            src = await self._copy(row, runtime, image)
            used = (await asyncio.to_thread(os.stat, image)).st_blocks * 512
        except BaseException as e:
            await asyncio.to_thread(self._remove_files, snapshot_id)
            self.core.store.delete_snapshot(snapshot_id)
            if isinstance(e, AgentboxError):
                self.core.audit(caller, "snapshot.create", sandbox_id, status=status_of(e.code),
                                started=started, error=e.message)  # fmt: skip
            raise
        self.core.store.update_snapshot(
            snapshot_id, state=READY, uid=src.uid, span=src.span, used_bytes=used
        )
        self.core.audit(
            caller, "snapshot.create", sandbox_id, status=201, started=started,
            snapshot_id=snapshot_id, name=name, used_bytes=used,
        )  # fmt: skip
        snap = self.core.store.get_snapshot(snapshot_id)
        assert snap is not None
        return snap

    def _insert(
        self,
        caller: Caller,
        snapshot_id: str,
        row: SandboxRow,
        name: str | None,
        metadata: dict[str, str] | None,
    ) -> None:
        """Record the snapshot `creating` (removed at start-up if no copy finished)."""
        self._tenants.add(caller.tenant)
        self.core.store.insert_snapshot(
            snapshot_id=snapshot_id,
            tenant=caller.tenant,
            name=name,
            state=CREATING,
            sandbox_id=row.sandbox_id,
            template=row.template,
            runtime=row.runtime,
            created_at=time.time(),
            rootfs=(row.runtime_state or {}).get(TEMPLATE_ROOTFS),
            disk_mb=int(row.resources.get("disk_mb", 0)),
            uid=0,
            span=0,
            metadata=dict(metadata or {}),
        )

    def _check_name(self, caller: Caller, name: str) -> None:
        check_object_name("snapshot", name, PREFIX)
        if any(s.name == name for s in self.core.store.list_snapshots(caller.tenant)):
            raise Conflict(
                f"a snapshot named {name!r} exists; delete it first or choose another name",
                name=name,
            )
        if name in self.core.template_service.known():
            raise Conflict(
                f"{name!r} names a template; a snapshot's name must not hide it", name=name
            )

    # ------------------------------------------------------------------ deleting

    async def delete(self, caller: Caller, ref: str) -> None:
        started = time.monotonic()
        snap = self.get(caller, ref)
        if self._in_use.get(snap.snapshot_id):
            raise Conflict(
                f"snapshot {snap.snapshot_id} is being copied by a sandbox starting from it; "
                "retry in a moment",
                snapshot=snap.snapshot_id,
            )
        self.core.store.delete_snapshot(snap.snapshot_id)
        await asyncio.to_thread(self._remove_files, snap.snapshot_id)
        self.core.audit(
            caller, "snapshot.delete", snap.sandbox_id, status=204, started=started,
            snapshot_id=snap.snapshot_id, used_bytes=snap.used_bytes,
        )  # fmt: skip

    def _remove_files(self, snapshot_id: str) -> None:
        if self.root is None:
            return
        d = self.root / snapshot_id
        if not d.exists():
            return
        doomed = self.root / f".removing-{snapshot_id}-{secrets.token_hex(4)}"
        with contextlib.suppress(FileNotFoundError):
            d.rename(doomed)  # out of sight at once; a sandbox copying it keeps its open file
            shutil.rmtree(doomed, ignore_errors=True)

    def recover(self) -> None:
        """At start-up: snapshots a stopped server left `creating`, and image directories no
        record explains (a crash between the two, a fork's scratch copy), are removed."""
        if self.root is None:
            return
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.copy_method = "reflink" if can_reflink(self.root) else "sparse"
        known = set()
        for snap in self.core.store.list_snapshots():
            if snap.state == CREATING:
                self.core.store.delete_snapshot(snap.snapshot_id)
                log.warning("removed snapshot %s, left half-made", snap.snapshot_id)
            else:
                known.add(snap.snapshot_id)
                self._tenants.add(snap.tenant)
        if not self.root.is_dir():
            return
        for d in self.root.iterdir():
            if d.name not in known:
                shutil.rmtree(d, ignore_errors=True)

    def rootfs_in_use(self, rootfs: Path) -> bool:
        """Whether a snapshot's root layer was made on this template tree (it is kept)."""
        return any(s.rootfs == str(rootfs) for s in self.core.store.list_snapshots())

    # ------------------------------------------------------------------ forking

    async def fork(
        self, caller: Caller, sandbox_id: str, count: int = 1, timeout: float | None = None
    ) -> list[SandboxRow]:
        """`count` new running sandboxes, each with a copy of the caller's running or paused
        sandbox's disk and its settings (template, resources, network, environment, metadata,
        lifecycle), each with its own id, access token, uids and TTL (`timeout`, default the
        parent's at its create). All or none: if one cannot start, those started are killed."""
        started = time.monotonic()
        if not 1 <= count <= MAX_FORKS:
            raise InvalidRequest(f"count must be between 1 and {MAX_FORKS}", setting="count")
        row = self._live(caller, sandbox_id)
        runtime = self._snapshottable(row)
        await asyncio.to_thread(self._check_fork_room, caller, row, count)
        self.core.admission.check_free_space(caller, started)
        assert self.root is not None
        scratch = self.root / f".fork-{secrets.token_hex(8)}"
        scratch.mkdir(mode=0o700, parents=True)
        children: list[SandboxRow] = []
        try:
            src = await self._copy(row, runtime, scratch / IMAGE)
            req = self._child_request(row, timeout)
            base = StartFrom(
                template=row.template,
                runtime=row.runtime,
                disk_mb=int(row.resources.get("disk_mb", 0)),
                disk=src,
                rootfs=(row.runtime_state or {}).get(TEMPLATE_ROOTFS),
                origin={"fork_of": sandbox_id},
            )
            for i in range(count):
                # The last child takes the scratch image itself instead of a copy.
                last = i == count - 1
                start = dataclasses.replace(base, disk=dataclasses.replace(src, consume=last))
                children.append(await self.core.creation.create(caller, req, start))
        except BaseException as e:
            for child in children:
                with contextlib.suppress(Exception):
                    await self.core.lifecycle.kill(caller, child.sandbox_id)
            if isinstance(e, AgentboxError):
                self.core.audit(caller, "sandbox.fork", sandbox_id, status=status_of(e.code),
                                started=started, count=count, error=e.message)  # fmt: skip
            raise
        finally:
            await asyncio.to_thread(shutil.rmtree, scratch, True)
        self.core.audit(
            caller, "sandbox.fork", sandbox_id, status=201, started=started, count=count,
            children=[c.sandbox_id for c in children],
        )  # fmt: skip
        return children

    def _check_fork_room(self, caller: Caller, row: SandboxRow, count: int) -> None:
        """Before anything is copied: room for `count` more sandboxes like the parent (each
        child's create checks again, under the tenant's lock)."""
        quota = self.core.quota(caller.tenant)
        held = self.core.admission.holding(caller.tenant).plus(row.resources, count - 1)
        new = Resources(**row.resources)
        quotas.check_tenant_room(caller.tenant, quota, held, new)
        self.core.disk.check_room(caller.tenant, quota, count * new.disk_mb)

    def _child_request(self, row: SandboxRow, timeout: float | None) -> CreateRequest:
        lifecycle: dict[str, Any] | None = None
        if row.lifecycle:
            lifecycle = {k: row.lifecycle[k] for k in ("on_timeout", "auto_resume")}
        period = timeout or float((row.lifecycle or {}).get("timeout") or 0) or 300
        return CreateRequest(
            template=row.template,
            timeout=period,
            metadata=dict(row.metadata),
            envs=dict(row.envs or {}),
            resources=dict(row.resources),
            keep_workspace=row.keep_workspace,
            network=dict(row.network or {}),
            secrets=sorted(row.secrets or {}),
            runtime=row.runtime,
            lifecycle=lifecycle,
        )
