"""Per-sandbox workspaces: a sparse ext4 image, loop-mounted, whose size is the disk limit.

The kernels we target often lack quota support (no CONFIG_QUOTA), so a filesystem of its own is
the one disk limit a sandbox cannot write past. The image is sparse (it costs only what is
written), has no journal (it dies with the sandbox), and is mounted nosuid,nodev. When loop
devices are unavailable the workspace falls back to a plain directory and says the disk limit is
not enforced.

A kept workspace (`keep_workspace`) keeps its image, trimmed so it holds only the blocks of files
that still exist; it is read through a read-only mount of its own per reader.

A snapshot is a copy of the image (`clone_image`: shared blocks where the filesystem can reflink,
else only the written extents). A sandbox started from one gets its own copy, its files moved to
its own host uids (`reown`), since the image stores the uids of the sandbox it was taken from.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentbox.runtimes.base import DiskSource
from agentbox.runtimes.process import rootfs
from agentbox.runtimes.uids import BLOCK, UID_RANGE

IMAGE_NAME = "workspace.img"
MOUNT_NAME = "workspace"
DISK_NAME = "disk"  # where the image is mounted when it also holds a root layer (rootfs.py)
WORKSPACE_DIR = "workspace"  # on such a disk, the workspace's directory


FICLONE = 0x40049409  # ioctl: share all of one file's blocks with another (XFS, btrfs)
MiB = 1 << 20


class WorkspaceError(RuntimeError):
    pass


@dataclass(frozen=True)
class Workspace:
    path: Path  # what is bound to /workspace
    disk_limit_enforced: bool


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise WorkspaceError(f"{argv[0]} failed: {proc.stderr.strip() or proc.stdout.strip()}")


def mounted_under(prefix: Path) -> list[Path]:
    """Mount points at or below `prefix`, deepest first (the order to unmount them)."""
    found = []
    prefix_s = str(prefix).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mnt = line.split()[4].replace("\\040", " ")
            if (mnt + "/").startswith(prefix_s):
                found.append(Path(mnt))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def create(
    sandbox_dir: Path,
    bind_dir: Path,
    disk_mb: int,
    uid: int,
    use_loop: bool,
    root_layer: Callable[[Path], Path] | None = None,
    source: DiskSource | None = None,
    base: int = 0,
) -> Workspace:
    """The image lives in the private `sandbox_dir`; it is mounted in `bind_dir`, where the
    sandbox's bwrap (running as `uid`) can reach it. With `root_layer`, the disk also holds the
    sandbox's root layer: it is mounted at bind_dir/disk, root-owned, and `root_layer(disk)`
    makes its directories and returns the workspace's (bind_dir/workspace links to it).

    With `source`, the image is a copy of that one (grown to `disk_mb` if it is smaller), its
    files moved from the source's uids to this sandbox's, [base, base + source.span); the copy
    already has its directories, so `root_layer` is not called (the workspace is its
    bind_dir/disk/workspace)."""
    bind_dir.mkdir(mode=0o711, exist_ok=True)
    mnt = bind_dir / (DISK_NAME if root_layer else MOUNT_NAME)
    mnt.mkdir(mode=0o700)
    gid = uid
    owner = "0:0" if root_layer else f"{uid}:{gid}"
    if source is not None and not use_loop:
        raise WorkspaceError("a sandbox starts from a disk image only with loop devices")
    if source is not None:
        image = sandbox_dir / IMAGE_NAME
        try:
            if not source.consume:
                raise OSError(errno.EXDEV, "a copy")
            os.rename(source.image, image)
        except OSError:
            clone_image(source.image, image)
        if os.path.getsize(image) < disk_mb * MiB:
            # A copy of a mounted filesystem is not marked clean: checked (and its counts
            # fixed) before it grows.
            subprocess.run(["e2fsck", "-fy", str(image)], capture_output=True)
            with open(image, "r+b") as f:
                f.truncate(disk_mb * MiB)
            _run(["resize2fs", str(image)])
        mount_image(image, mnt)
        if (root_layer is not None) != (mnt / rootfs.MARKER).exists():
            raise WorkspaceError(
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
        _run(
            [
                "mkfs.ext4",
                "-q",
                "-F",
                "-m",
                "0",
                "-O",
                "^has_journal,^resize_inode",
                "-E",
                f"lazy_itable_init=1,root_owner={owner}",
                str(image),
            ]
        )
        mount_image(image, mnt)
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


def clone_image(src: Path, dest: Path) -> str:
    """Copy a disk image to the new file `dest`: "reflink" where the filesystem shares the
    blocks (XFS, btrfs; instant, whatever the size), else "sparse" (only the extents written,
    found with SEEK_DATA/SEEK_HOLE and copied in the kernel; holes stay holes)."""
    fd_in = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fd_out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except BaseException:
        os.close(fd_in)
        raise
    try:
        try:
            fcntl.ioctl(fd_out, FICLONE, fd_in)
            return "reflink"
        except OSError:
            pass
        _copy_extents(fd_in, fd_out, os.fstat(fd_in).st_size)
        return "sparse"
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            dest.unlink()
        raise
    finally:
        os.close(fd_out)
        os.close(fd_in)


def _copy_extents(fd_in: int, fd_out: int, size: int) -> None:
    os.ftruncate(fd_out, size)
    pos = 0
    while pos < size:
        try:
            data = os.lseek(fd_in, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # nothing but a hole to the end
                return
            raise
        hole = os.lseek(fd_in, data, os.SEEK_HOLE)
        while data < hole:
            n = os.copy_file_range(fd_in, fd_out, hole - data, data, data)
            if n == 0:
                raise OSError(errno.EIO, "the image shrank while it was copied")
            data += n
        pos = hole


_libc = ctypes.CDLL(None, use_errno=True)


def syncfs(path: Path) -> None:
    """Write what is cached of the filesystem at `path` to its device (os has no syncfs)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"syncfs {path}: {os.strerror(e)}")
    finally:
        os.close(fd)


def can_reflink(directory: Path) -> bool:
    """Whether copies of images in `directory` share their blocks (shown in health)."""
    a, b = directory / f".reflink-probe-{os.getpid()}", directory / f".reflink-probe-{os.getpid()}b"
    try:
        a.write_bytes(b"\0" * 4096)
        return clone_image(a, b) == "reflink"
    except OSError:
        return False
    finally:
        for p in (a, b):
            with contextlib.suppress(OSError):
                p.unlink()


def reown(root: Path, old: int, new: int, span: int) -> int:
    """Give every inode of the filesystem at `root` whose owner or group is in [old, old +
    span) the same place in [new, new + span); how many changed. A whole uid block (`span`
    BLOCK) moves every id of any sandbox block (blocks are aligned): a walk a crash cut short,
    which left ids of two blocks, is finished by the next one. The tree is a copy no process
    uses yet, walked without following symlinks or leaving its filesystem; set-id bits, which a
    chown clears, are put back."""
    top = os.lstat(root)
    whole = span == BLOCK and old % BLOCK == 0 and new % BLOCK == 0

    def moved(i: int) -> int:
        if whole:
            return new + i % BLOCK if UID_RANGE[0] <= i < UID_RANGE[1] else i
        return i - old + new if old <= i < old + span else i

    changed = 0
    todo = [str(root)]
    paths = [(str(root), top)]
    while todo:
        with os.scandir(todo.pop()) as entries:
            for e in entries:
                st = e.stat(follow_symlinks=False)
                if st.st_dev != top.st_dev:
                    continue
                paths.append((e.path, st))
                if stat.S_ISDIR(st.st_mode):
                    todo.append(e.path)
    for path, st in paths:
        uid, gid = moved(st.st_uid), moved(st.st_gid)
        if (uid, gid) == (st.st_uid, st.st_gid):
            continue
        os.chown(path, uid, gid, follow_symlinks=False)
        if st.st_mode & (stat.S_ISUID | stat.S_ISGID) and not stat.S_ISLNK(st.st_mode):
            os.chmod(path, stat.S_IMODE(st.st_mode))
        changed += 1
    return changed


def _attach(image: Path) -> str:
    """A loop device for the image, with direct I/O: the path of the device.

    Buffered, every block the sandbox writes is cached twice: in the workspace filesystem's
    cache, charged to the sandbox's memory cgroup, and again in the cache of the image file on
    the host, charged to no sandbox (a sandbox limited to 64 MiB that wrote 500 MiB grew the
    host's page cache by ~550 MiB, and the host's writeback did the work). With direct I/O only
    the sandbox's own, limited, cache holds it. Attaching here rather than with `mount -o loop`
    is also faster (~6 ms instead of ~13 ms: libmount scans every loop device for overlaps, and
    switching an attached device to direct I/O afterwards freezes its queue for ~16 ms).
    """
    for options in (["--direct-io=on"], []):  # without direct I/O if the backing fs refuses it
        proc = subprocess.run(
            ["losetup", *options, "--find", "--show", str(image)], capture_output=True, text=True
        )
        if proc.returncode == 0 and proc.stdout.strip().startswith("/dev/loop"):
            return proc.stdout.strip()
        # A losetup that failed late (or was killed) may have attached a device all the same.
        _detach_loops(image)
    raise WorkspaceError(f"losetup failed: {proc.stderr.strip() or proc.stdout.strip()}")


def _detach_loops(image: Path) -> None:
    """Detach loop devices still backed by `image` (a create cut short between attaching the
    device and mounting it: devices attached by losetup do not clear themselves)."""
    target = os.path.realpath(image)
    for f in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            backing = f.read_text().strip().removesuffix(" (deleted)")
        except OSError:
            continue
        if backing == target:
            subprocess.run(["losetup", "-d", f"/dev/{f.parent.parent.name}"], capture_output=True)


def detach_orphan_loops(root: Path) -> None:
    """Detach loop devices whose image under `root` is gone. A live sandbox's image is never
    deleted, so these are orphans: a server killed mid-create leaves its `losetup` running, and
    it can attach after the restarted server already removed that sandbox."""
    prefix = f"{os.path.realpath(root)}/"
    for f in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            backing = f.read_text().strip()
        except OSError:
            continue
        if backing.startswith(prefix) and (
            backing.endswith(" (deleted)") or not os.path.exists(backing)
        ):
            subprocess.run(["losetup", "-d", f"/dev/{f.parent.parent.name}"], capture_output=True)


def destroy(sandbox_dir: Path, bind_dir: Path, keep: bool) -> bool:
    """Unmount and remove the workspace. With `keep`, the image (or directory) stays on disk."""
    ok = True
    mounts = mounted_under(bind_dir) + mounted_under(sandbox_dir)
    for mnt in mounts:
        if keep:
            # A kept image then holds (and counts against its tenant's disk) only the blocks
            # of files that still exist: those of deleted ones go back to the host.
            subprocess.run(["fstrim", str(mnt)], capture_output=True)
        ok = _umount(mnt) and ok
    if not ok:
        return False
    if (sandbox_dir / IMAGE_NAME).exists():
        # Also after unmounting: a create cut short may have attached a second device.
        _detach_loops(sandbox_dir / IMAGE_NAME)
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


def _umount(mnt: Path) -> bool:
    for _ in range(50):
        # -d frees the loop device with the mount
        proc = subprocess.run(["umount", "-d", str(mnt)], capture_output=True)
        if proc.returncode == 0 or mnt not in mounted_under(mnt):
            return True
        time.sleep(0.02)  # busy: the sandbox's last processes are still exiting
    proc = subprocess.run(["umount", "-l", "-d", str(mnt)], capture_output=True)
    return proc.returncode == 0


def usage(bind_dir: Path) -> tuple[int, int] | None:
    """(used, total) bytes of the workspace filesystem, when it is one of its own."""
    mnt = bind_dir / MOUNT_NAME
    if not os.path.ismount(mnt):
        return None
    st = os.statvfs(mnt)
    return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_blocks * st.f_frsize


def used_bytes(path: Path) -> int:
    """Bytes `path` really takes on its filesystem: the blocks of a (sparse) image file, or of
    everything below a plain directory (symlinks not followed, other filesystems not entered,
    hard links counted once)."""
    top = os.lstat(path)
    total = top.st_blocks * 512
    if not stat.S_ISDIR(top.st_mode):
        return total
    seen: set[int] = set()
    todo = [str(path)]
    while todo:
        try:
            entries = os.scandir(todo.pop())
        except OSError:
            continue
        with entries:
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_dev != top.st_dev or (st.st_nlink > 1 and st.st_ino in seen):
                    continue
                if st.st_nlink > 1:
                    seen.add(st.st_ino)
                total += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    todo.append(e.path)
    return total


def mount_image(image: Path, mnt: Path) -> None:
    """Mount an image read-write at the existing directory `mnt` (nosuid, nodev: its files
    were made by sandboxes), on a loop device of its own that goes with the mount."""
    device = _attach(image)
    try:
        _run(["mount", "-o", "nosuid,nodev,noatime", device, str(mnt)])
    except BaseException:
        subprocess.run(["losetup", "-d", device], capture_output=True)
        raise


def mount_readonly(image: Path, mnt: Path) -> None:
    """Mount a kept workspace image read-only at `mnt` (a fresh, private directory).

    Read-only at the loop device too, so the kernel writes nothing back to the image; nosuid,
    nodev, noexec: its files were made by the sandbox."""
    mnt.mkdir(mode=0o700)
    proc = subprocess.run(
        ["losetup", "--read-only", "--find", "--show", str(image)], capture_output=True, text=True
    )
    device = proc.stdout.strip()
    if proc.returncode != 0 or not device.startswith("/dev/loop"):
        mnt.rmdir()
        raise WorkspaceError(f"losetup failed: {proc.stderr.strip() or proc.stdout.strip()}")
    try:
        _run(["mount", "-t", "ext4", "-o", "ro,nosuid,nodev,noexec,noatime", device, str(mnt)])
    except BaseException:
        subprocess.run(["losetup", "-d", device], capture_output=True)
        mnt.rmdir()
        raise


def unmount(mnt: Path) -> bool:
    """Undo `mount_readonly` (the loop device goes with the mount); False if still mounted."""
    if os.path.ismount(mnt) and not _umount(mnt):
        return False
    try:
        mnt.rmdir()
    except OSError:
        pass
    return True
