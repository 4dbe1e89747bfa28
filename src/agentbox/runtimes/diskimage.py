"""Disk images on the host: ext4 image files mounted through loop devices, copied sharing
their blocks where the filesystem can (reflink), else only their written extents.

What a sandbox's disk, a snapshot and a volume are made of, whichever runtime runs the sandbox:
the runtimes (their workspaces) and the core (snapshots, volumes) use these."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import stat
import struct
import subprocess
import time
from pathlib import Path

FICLONE = 0x40049409  # ioctl: share all of one file's blocks with another (XFS, btrfs)
# <linux/loop.h>: attach a file to a free loop device in one call (Linux 5.8)
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A  # struct loop_config: fd, block_size, loop_info64, 8 reserved u64
LOOP_INFO64_SIZE = 232
LO_FLAGS_OFFSET = 52  # lo_flags in struct loop_info64
LO_FLAGS_AUTOCLEAR = 4
LO_FLAGS_DIRECT_IO = 16
LOOP_CLR_FD = 0x4C01
LOOP_MAJOR = 7
MNT_DETACH = 2
MS_NOSUID, MS_NODEV, MS_NOATIME = 2, 4, 1024
# <linux/stat.h>: statx(2) says whether a path is the root of a mount (Linux 5.8), bind mounts
# of a directory of the same filesystem too (a stat's st_dev cannot tell those).
AT_FDCWD, AT_SYMLINK_NOFOLLOW, AT_NO_AUTOMOUNT = -100, 0x100, 0x800
STATX_ATTR_MOUNT_ROOT = 0x2000
STATX_SIZE = 256  # struct statx; stx_attributes at 8, stx_attributes_mask at 56 (u64 each)
_libc = ctypes.CDLL(None, use_errno=True)
_OCTAL = re.compile(r"\\([0-7]{3})")


class ImageError(RuntimeError):
    pass


def run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ImageError(f"{argv[0]} failed: {proc.stderr.strip() or proc.stdout.strip()}")


def unescape_mountinfo(field: str) -> str:
    """A path field of mountinfo: the kernel writes space, tab, newline and backslash as
    octal escapes (`\\040` for a space)."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field) if "\\" in field else field


def mounted_under(prefix: Path) -> list[Path]:
    """Mount points at or below `prefix`, deepest first (the order to unmount them). Reads
    every mount of the host (~20 ms with 2,000 sandboxes): for leftovers, not a sandbox's own
    (`mounts_at`)."""
    found = []
    prefix_s = str(prefix).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mnt = unescape_mountinfo(line.split()[4])
            if (mnt + "/").startswith(prefix_s):
                found.append(Path(mnt))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def is_mount_point(path: Path) -> bool:
    """Whether `path` (not followed if a symlink) is the root of a mount: statx's attribute
    where the kernel gives it, else a stat of it and its parent."""
    buf = ctypes.create_string_buffer(STATX_SIZE)
    flags = AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT
    if _libc.statx(AT_FDCWD, os.fsencode(path), flags, 0, buf) == 0:
        (attributes,) = struct.unpack_from("=Q", buf, 8)
        (known,) = struct.unpack_from("=Q", buf, 56)
        if known & STATX_ATTR_MOUNT_ROOT:
            return bool(attributes & STATX_ATTR_MOUNT_ROOT)
    elif ctypes.get_errno() in (errno.ENOENT, errno.ENOTDIR):
        return False
    return os.path.ismount(path)


def mounts_at(*dirs: Path) -> list[Path]:
    """The mount points among `dirs` and their immediate entries (where a sandbox's
    filesystems, and its namespaces' files, are mounted), those below first: a statx each,
    where reading every mount of the host (`mounted_under`) grows with the number of
    sandboxes."""
    found = []
    for d in dirs:
        top = is_mount_point(d)
        try:
            entries = [] if top else list(os.scandir(d))
        except (FileNotFoundError, NotADirectoryError):
            continue
        # Files too: a namespace is bind-mounted on a file (the OCI tiers' bind_dir/userns).
        found += [Path(e.path) for e in entries if is_mount_point(Path(e.path))]
        if top:
            found.append(d)
    return found


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


def attach_loop(image: Path) -> str:
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
        detach_loops(image)
    raise ImageError(f"losetup failed: {proc.stderr.strip() or proc.stdout.strip()}")


def loops_of(image: Path) -> list[str]:
    """The loop devices (`loop7`) backed by `image`: attached, so maybe mounted somewhere, in
    any mount namespace (reads every loop device's backing file)."""
    target = os.path.realpath(image)
    names = (f.parent.parent.name for f in Path("/sys/block").glob("loop*/loop/backing_file"))
    return [name for name in names if backing_file(name) == target]


def backing_file(device: str) -> str | None:
    """The file a loop device (`loop7`) is bound to, if it is bound."""
    try:
        with open(f"/sys/block/{device}/loop/backing_file") as f:
            return f.read().strip().removesuffix(" (deleted)")
    except OSError:
        return None


def check_detached(image: Path, what: str, wait: float = 2.0) -> None:
    """Raise unless no loop device holds `image`: one that does may be mounted (in another
    mount namespace too) and written, and a second mount of an ext4 image, or a copy taken
    under a writer, corrupts or tears it. A device that clears itself goes at the last close
    of its filesystem, which may be a killed process's exit a moment later: waited for, up to
    `wait` seconds. `what`: the operation refused, for the message."""
    deadline = time.monotonic() + wait
    while (held := loops_of(image)) and time.monotonic() < deadline:
        time.sleep(0.02)
    if held:
        raise ImageError(
            f"{what}: the disk image {image.name} is still attached to {', '.join(held)} "
            "(in use by a sandbox that has not ended, or by a reader)"
        )


def check_mounted_from(mnt: Path, image: Path) -> None:
    """Raise unless `mnt` is a mount of `image` through its loop device: a path that is not
    (the mount gone, or never made in this mount namespace) names a directory of the host,
    where syncfs or statvfs succeed and say nothing of the image."""
    device = mounted_device(mnt)
    if device is None or backing_file(device) != os.path.realpath(image):
        raise ImageError(f"{mnt} is not the mount of {image.name}")


def detach_loops(image: Path) -> None:
    """Detach loop devices still backed by `image` (a create cut short between attaching the
    device and mounting it: devices attached by losetup do not clear themselves)."""
    for name in loops_of(image):
        subprocess.run(["losetup", "-d", f"/dev/{name}"], capture_output=True)


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


def mount_image(image: Path, mnt: Path) -> None:
    """Mount an image read-write at the existing directory `mnt` (nosuid, nodev: its files
    were made by sandboxes), on a loop device of its own that goes with the mount."""
    try:
        fd, device = _configure_loop(image)
    except OSError:  # no LOOP_CONFIGURE (Linux < 5.8), no /dev/loop-control: losetup's way
        device = attach_loop(image)
        try:
            run(["mount", "-o", "nosuid,nodev,noatime", device, str(mnt)])
        except BaseException:
            subprocess.run(["losetup", "-d", device], capture_output=True)
            raise
        return
    try:
        flags = MS_NOSUID | MS_NODEV | MS_NOATIME
        if _libc.mount(device.encode(), os.fsencode(mnt), b"ext4", flags, None) != 0:
            e = ctypes.get_errno()
            raise ImageError(f"mount {device} on {mnt} failed: {os.strerror(e)}")
    finally:
        os.close(fd)  # the device clears itself when its mount goes (or now, if none was made)


def _configure_loop(image: Path) -> tuple[int, str]:
    """A free loop device bound to `image` by ioctls, with direct I/O (see attach_loop) where
    the backing filesystem allows it and clearing itself once nothing holds it: an open fd of
    the device and its path. What `losetup` + `mount` did in two programs, ~5 ms, takes ~0.7."""
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(64):  # another attach may take the free device first: EBUSY
                device = f"/dev/loop{fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)}"
                fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
                try:
                    _bind_loop(fd, backing)
                    return fd, device
                except OSError as e:
                    os.close(fd)
                    if e.errno != errno.EBUSY:
                        raise
            raise OSError(errno.EBUSY, "no free loop device")
        finally:
            os.close(backing)
    finally:
        os.close(ctl)


def _bind_loop(fd: int, backing: int) -> None:
    """LOOP_CONFIGURE the device `fd` onto `backing`, autoclear, with direct I/O unless the
    backing filesystem refuses it (EINVAL), then without."""
    for flags in (LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO, LO_FLAGS_AUTOCLEAR):
        info = bytearray(LOOP_INFO64_SIZE)
        struct.pack_into("=I", info, LO_FLAGS_OFFSET, flags)
        config = struct.pack("=II", backing, 0) + bytes(info) + bytes(8 * 8)
        try:
            fcntl.ioctl(fd, LOOP_CONFIGURE, config)
            return
        except OSError as e:
            if e.errno != errno.EINVAL or not flags & LO_FLAGS_DIRECT_IO:
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
        raise ImageError(f"losetup failed: {proc.stderr.strip() or proc.stdout.strip()}")
    try:
        run(["mount", "-t", "ext4", "-o", "ro,nosuid,nodev,noexec,noatime", device, str(mnt)])
    except BaseException:
        subprocess.run(["losetup", "-d", device], capture_output=True)
        mnt.rmdir()
        raise


def umount(mnt: Path) -> bool:
    """Unmount `mnt` and free the loop device it was mounted from (as `umount -d`), waiting up
    to ~1 s while it is busy (the sandbox's last processes exiting), then detaching it lazily.
    False if it stays mounted."""
    loop = None
    name = mounted_device(mnt)
    if name is not None:  # held open across the unmount: not cleared and taken meanwhile
        with contextlib.suppress(OSError):
            loop = os.open(f"/dev/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        for _ in range(50):
            if _libc.umount2(os.fsencode(mnt), 0) == 0:
                return True
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOENT) and not is_mount_point(mnt):
                return True  # not (or no longer) a mount point
            if err != errno.EBUSY:
                break
            time.sleep(0.02)
        return _libc.umount2(os.fsencode(mnt), MNT_DETACH) == 0 or not is_mount_point(mnt)
    finally:
        if loop is not None and name is not None:
            _release_loop(loop, name)


def _release_loop(fd: int, name: str) -> None:
    """Close the device; one that does not clear itself with its last user (attached by
    losetup) is cleared first (the kernel defers that to the last close while in use)."""
    try:
        if not clears_itself(name):
            with contextlib.suppress(OSError):
                fcntl.ioctl(fd, LOOP_CLR_FD, 0)
    finally:
        os.close(fd)


def clears_itself(device: str) -> bool:
    """Whether a loop device (`loop7`) is detached by the kernel once nothing holds it."""
    try:
        with open(f"/sys/block/{device}/loop/autoclear") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def mounted_device(mnt: Path) -> str | None:
    """The name of the loop device mounted at `mnt` (`loop7`), if one is."""
    try:
        dev = os.stat(mnt).st_dev
        if os.major(dev) != LOOP_MAJOR or not is_mount_point(mnt):
            return None
        return os.path.basename(os.readlink(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))
    except OSError:
        return None


def unmount(mnt: Path) -> bool:
    """Undo `mount_readonly` (the loop device goes with the mount); False if still mounted."""
    if os.path.ismount(mnt) and not umount(mnt):
        return False
    try:
        mnt.rmdir()
    except OSError:
        pass
    return True


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
