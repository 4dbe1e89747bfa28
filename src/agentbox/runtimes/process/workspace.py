"""Per-sandbox workspaces: a sparse ext4 image, loop-mounted, whose size is the disk limit.

The kernels we target often lack quota support (no CONFIG_QUOTA), so a filesystem of its own is
the one disk limit a sandbox cannot write past. The image is sparse (it costs only what is
written), has no journal (it dies with the sandbox), and is mounted nosuid,nodev. When loop
devices are unavailable the workspace falls back to a plain directory and says the disk limit is
not enforced.

A kept workspace (`keep_workspace`) keeps its image, trimmed so it holds only the blocks of files
that still exist; it is read through a read-only mount of its own per reader.

A snapshot is a copy of the image (`diskimage.clone_image`: shared blocks where the filesystem
can reflink, else only the written extents). A sandbox started from one gets its own copy, its
files moved to its own host uids (`reown`), since the image stores the uids of the sandbox it was
taken from. The image mechanics themselves (loop devices, mounts, copies) are runtimes/diskimage.py.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentbox.runtimes import diskimage
from agentbox.runtimes.base import DiskSource
from agentbox.runtimes.process import rootfs
from agentbox.runtimes.uids import BLOCK, UID_RANGE

IMAGE_NAME = "workspace.img"
MOUNT_NAME = "workspace"
DISK_NAME = "disk"  # where the image is mounted when it also holds a root layer (rootfs.py)
WORKSPACE_DIR = "workspace"  # on such a disk, the workspace's directory


MiB = 1 << 20


@dataclass(frozen=True)
class Workspace:
    path: Path  # what is bound to /workspace
    disk_limit_enforced: bool


def create(
    sandbox_dir: Path,
    bind_dir: Path,
    disk_mb: int,
    uid: int,
    use_loop: bool,
    root_layer: Callable[[Path], Path] | None = None,
    source: DiskSource | None = None,
    base: int = 0,
    tools: Callable[[Callable[[], object]], object] = lambda fn: fn(),
) -> Workspace:
    """The image lives in the private `sandbox_dir`; it is mounted in `bind_dir`, where the
    sandbox's bwrap (running as `uid`) can reach it. With `root_layer`, the disk also holds the
    sandbox's root layer: it is mounted at bind_dir/disk, root-owned, and `root_layer(disk)`
    makes its directories and returns the workspace's (bind_dir/workspace links to it).

    With `source`, the image is a copy of that one (grown to `disk_mb` if it is smaller), its
    files moved from the source's uids to this sandbox's, [base, base + source.span); the copy
    already has its directories, so `root_layer` is not called (the workspace is its
    bind_dir/disk/workspace).

    `tools(fn)` runs `fn`, which starts mkfs.ext4, e2fsck or resize2fs: each of them opens
    every mounted block device of its mount namespace to check that the image is not mounted
    (1,000 sandboxes' disks: mkfs 9 -> 24 ms), so the runtime runs them in its clean one."""
    bind_dir.mkdir(mode=0o711, exist_ok=True)
    mnt = bind_dir / (DISK_NAME if root_layer else MOUNT_NAME)
    mnt.mkdir(mode=0o700)
    gid = uid
    owner = "0:0" if root_layer else f"{uid}:{gid}"
    if source is not None and not use_loop:
        raise diskimage.ImageError("a sandbox starts from a disk image only with loop devices")
    if source is not None:
        image = sandbox_dir / IMAGE_NAME
        try:
            if not source.consume:
                raise OSError(errno.EXDEV, "a copy")
            os.rename(source.image, image)
        except OSError:
            diskimage.clone_image(source.image, image)
        if os.path.getsize(image) < disk_mb * MiB:
            # A copy of a mounted filesystem is not marked clean: checked (and its counts
            # fixed) before it grows. (Where no disk is mounted: e2fsck would not see one.)
            diskimage.check_detached(image, "the disk to grow", wait=0)
            tools(lambda: subprocess.run(["e2fsck", "-fy", str(image)], capture_output=True))
            with open(image, "r+b") as f:
                f.truncate(disk_mb * MiB)
            tools(lambda: diskimage.run(["resize2fs", str(image)]))
        diskimage.mount_image(image, mnt)
        if (root_layer is not None) != (mnt / rootfs.MARKER).exists():
            raise diskimage.ImageError(
                "the disk image has "
                + ("no root layer" if root_layer else "a root layer")
                + " and this sandbox's template "
                + ("has one" if root_layer else "has none")
                + ": start it from the template the snapshot was taken with"
            )
        reown(mnt, source.uid, base, source.span)
    elif use_loop:
        image = sandbox_dir / IMAGE_NAME
        with open(image, "wb") as f:
            f.truncate(disk_mb * 1024 * 1024)
        mkfs = ["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal,^resize_inode"]
        mkfs += ["-E", f"lazy_itable_init=1,root_owner={owner}", str(image)]
        tools(lambda: diskimage.run(mkfs))
        diskimage.mount_image(image, mnt)
        try:
            (mnt / "lost+found").rmdir()
        except OSError:
            pass
    if root_layer is not None:
        ws = mnt / WORKSPACE_DIR if source is not None else root_layer(mnt)
        (bind_dir / MOUNT_NAME).symlink_to(ws.relative_to(bind_dir))
        return Workspace(path=ws, disk_limit_enforced=use_loop)
    if source is None:
        os.chown(mnt, uid, gid)
        os.chmod(mnt, 0o700)
    return Workspace(path=mnt, disk_limit_enforced=use_loop)


def reown(root: Path, old: int, new: int, span: int) -> int:
    """Give every inode of the filesystem at `root` whose owner or group is in [old, old +
    span) the same place in [new, new + span); how many changed. A whole uid block (`span`
    BLOCK) moves every id of any sandbox block (blocks are aligned): a walk a crash cut short,
    which left ids of two blocks, is finished by the next one. The tree is a copy no process
    uses yet, walked without following symlinks or leaving its filesystem. The ids inside
    POSIX ACLs and file capabilities move too; set-id bits and capabilities, which a chown
    clears, are put back."""
    top = os.lstat(root)
    whole = span == BLOCK and old % BLOCK == 0 and new % BLOCK == 0

    def moved(i: int) -> int:
        if whole:
            return new + i % BLOCK if UID_RANGE[0] <= i < UID_RANGE[1] else i
        return i - old + new if old <= i < old + span else i

    changed = 0

    def fix(name: str, st: os.stat_result, dir_fd: int | None) -> None:
        nonlocal changed
        uid, gid = moved(st.st_uid), moved(st.st_gid)
        # xattrs by the fd's /proc link: short whatever the depth (they take no dir_fd).
        path = name if dir_fd is None else f"/proc/self/fd/{dir_fd}/{name}"
        xattrs: list[tuple[str, bytes]] = []
        shifted = False
        if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):  # (no such xattrs elsewhere)
            xattrs, shifted = _id_xattrs(path, moved)
        if (uid, gid) == (st.st_uid, st.st_gid) and not shifted:
            return
        os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
        if st.st_mode & (stat.S_ISUID | stat.S_ISGID) and not stat.S_ISLNK(st.st_mode):
            os.chmod(name, stat.S_IMODE(st.st_mode), dir_fd=dir_fd)
        for attr, value in xattrs:
            os.setxattr(path, attr, value, follow_symlinks=False)
        changed += 1

    fix(str(root), top, None)
    # By directory descriptor (fwalk), never by path: a tree the sandbox made may be deeper
    # than a path can name (PATH_MAX).
    for _, dirs, files, dir_fd in os.fwalk(root, follow_symlinks=False):
        for name in [*dirs, *files]:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if st.st_dev != top.st_dev:
                if name in dirs:
                    dirs.remove(name)  # another filesystem: not entered
                continue
            fix(name, st, dir_fd)
    return changed


_ACLS = ("system.posix_acl_access", "system.posix_acl_default")
_CAPS = "security.capability"
_ACL_NAMED = (0x02, 0x08)  # ACL_USER, ACL_GROUP: the entries that carry an id
_CAPS_V3 = 0x03000000  # a namespaced capability set, with the root id it applies to


def _id_xattrs(path: str, moved: Callable[[int], int]) -> tuple[list[tuple[str, bytes]], bool]:
    """The ACLs and file capabilities of `path` with their ids moved, to write back after its
    chown (which drops capabilities), and whether any id moved."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return [], False
    out = []
    before = []
    for attr in names:
        if attr not in _ACLS and attr != _CAPS:
            continue
        raw = bytearray(os.getxattr(path, attr, follow_symlinks=False))
        before.append(bytes(raw))
        if attr == _CAPS:
            if len(raw) == 24 and int.from_bytes(raw[:4], "little") & 0xFF000000 == _CAPS_V3:
                raw[20:24] = moved(int.from_bytes(raw[20:24], "little")).to_bytes(4, "little")
            out.append((attr, bytes(raw)))  # a chown clears them: always put back
            continue
        for at in range(4, len(raw) - 7, 8):  # a u32 version, then (u16 tag, u16 perm, u32 id)
            if int.from_bytes(raw[at : at + 2], "little") in _ACL_NAMED:
                ident = int.from_bytes(raw[at + 4 : at + 8], "little")
                raw[at + 4 : at + 8] = moved(ident).to_bytes(4, "little")
        out.append((attr, bytes(raw)))
    return out, before != [value for _, value in out]


def destroy(sandbox_dir: Path, bind_dir: Path, keep: bool) -> bool:
    """Unmount and remove the workspace. With `keep`, the image (or directory) stays on disk."""
    ok = True
    mounts = diskimage.mounts_at(bind_dir, sandbox_dir)
    # Devices attached by ioctls clear themselves (with their mount, or when the create that
    # attached one ends without mounting it): only losetup's leave a device behind.
    devices = [diskimage.mounted_device(mnt) for mnt in mounts]
    self_clearing = bool(devices) and all(d and diskimage.clears_itself(d) for d in devices)
    for mnt in mounts:
        if keep:
            # A kept image then holds (and counts against its tenant's disk) only the blocks
            # of files that still exist: those of deleted ones go back to the host.
            subprocess.run(["fstrim", str(mnt)], capture_output=True)
        ok = diskimage.umount(mnt) and ok
    if not ok:
        return False
    if (sandbox_dir / IMAGE_NAME).exists() and not self_clearing:
        # Also after unmounting: a create cut short may have attached a second device.
        diskimage.detach_loops(sandbox_dir / IMAGE_NAME)
    mnt = bind_dir / MOUNT_NAME
    if mnt.is_symlink():  # a disk with a root layer: the workspace is a directory on it
        mnt = bind_dir / DISK_NAME / MOUNT_NAME
    if keep and mnt.exists() and not (sandbox_dir / IMAGE_NAME).exists():
        # A plain-directory workspace: move it next to the rest of the sandbox's files.
        mnt.rename(sandbox_dir / MOUNT_NAME)
    if bind_dir != sandbox_dir:
        shutil.rmtree(bind_dir, ignore_errors=True)
    if keep:
        return True
    mnt = sandbox_dir / MOUNT_NAME
    if mnt.exists():
        shutil.rmtree(mnt, ignore_errors=True)
    try:
        (sandbox_dir / IMAGE_NAME).unlink()
    except FileNotFoundError:
        pass
    return True


def usage(bind_dir: Path) -> tuple[int, int] | None:
    """(used, total) bytes of the workspace filesystem, when it is one of its own."""
    mnt = bind_dir / MOUNT_NAME
    if not os.path.ismount(mnt):
        return None
    st = os.statvfs(mnt)
    return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_blocks * st.f_frsize
