"""A writable root for sandboxes of built templates: the template, copy-on-write.

The template's tree stays shared and read-only on the host. Each sandbox sees it through an
idmapped mount (the template's root-owned files show as owned by the sandbox's own root, so its
uids can write through the overlay: without the idmap they could not) under an overlay whose
upper layer lives on the sandbox's disk image, beside `/workspace`: one size limit, and later one
snapshot, covers all the sandbox's state. The server mounts it, as host root, before bwrap starts;
bwrap binds it as `/`. The template tree is never written: writes copy up into the sandbox's
upper layer.

Layout in a sandbox's bind dir (0710 root:base, so only the sandbox's bwrap may traverse it):

    disk/            its disk image (ext4), or a plain directory without loop devices
    disk/upper       the overlay's upper layer (its "/", owned by the sandbox's root)
    disk/work        overlayfs's work dir
    disk/workspace   bound to /workspace
    root/            the overlay: what bwrap binds as /

The overlay's options name its layers relative to the bind dir (mounted from a thread whose
working directory is the bind dir), so that the sandbox's mountinfo names no host path.
Python 3.11's os has none of open_tree, mount_setattr or move_mount: ctypes (x86_64, aarch64).
"""

from __future__ import annotations

import ctypes
import os
import platform
import stat
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from agentbox.runtimes import diskimage

DISK = "disk"
UPPER = "upper"
WORK = "work"
ROOT = "root"
LOWER = "lower"  # the idmapped template, mounted only while the overlay is made
MARKER = (
    ".agentbox-layout"  # in a disk image holding a root layer: kept workspaces read disk/workspace
)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_NR = {  # (x86_64, aarch64): the new mount API has one number on both
    "open_tree": 428,
    "move_mount": 429,
    "mount_setattr": 442,
}
_UNSHARE_FS = 0x00000200  # CLONE_FS: a working directory of the thread's own
OPEN_TREE_CLONE = 1
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_IDMAP = 0x00100000
MS_NOSUID = 0x2
MS_NODEV = 0x4
MNT_DETACH = 2
# The sandbox's own accounts, when a template has none for uid 1000.
USER_LINE = "user:x:1000:1000:sandbox user:/workspace:/bin/bash\n"
GROUP_LINE = "user:x:1000:\n"


class RootfsError(Exception):
    pass


def supported() -> bool:
    return platform.machine() in ("x86_64", "aarch64")


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise RootfsError(f"{what}: {os.strerror(e)}")
    return ret


def _idmapped_clone(path: Path, userns_fd: int, read_only: bool = True) -> int:
    """A detached copy of the tree at `path` (read-only unless told), its ids seen through
    `userns_fd`'s maps (host id k shows as base + k)."""
    fd = _check(
        _libc.syscall(
            _NR["open_tree"],
            AT_FDCWD,
            str(path).encode(),
            ctypes.c_uint(OPEN_TREE_CLONE | os.O_CLOEXEC | AT_RECURSIVE),
        ),
        f"open_tree {path}",
    )
    try:
        flags = MOUNT_ATTR_IDMAP | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
        flags |= MOUNT_ATTR_RDONLY if read_only else 0
        attr = ctypes.create_string_buffer(struct.pack("QQQQ", flags, 0, 0, userns_fd), 32)
        _check(
            _libc.syscall(
                _NR["mount_setattr"],
                fd,
                b"",
                ctypes.c_uint(AT_EMPTY_PATH | AT_RECURSIVE),
                attr,
                ctypes.c_size_t(32),
            ),
            f"idmap {path}",
        )
        return fd
    except BaseException:
        os.close(fd)
        raise


def _attach(fd: int, target: Path) -> None:
    _check(
        _libc.syscall(
            _NR["move_mount"],
            fd,
            b"",
            AT_FDCWD,
            str(target).encode(),
            ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH),
        ),
        f"move_mount to {target}",
    )


def prepare_disk(disk: Path, base: int, user_uid: int) -> Path:
    """Make the root layer's directories on a fresh disk (its mount or plain directory);
    returns the workspace directory. `base` is the sandbox's root on the host."""
    upper, work, ws = disk / UPPER, disk / WORK, disk / "workspace"
    upper.mkdir(mode=0o755)
    os.chown(upper, base, base)
    os.chmod(upper, 0o755)
    work.mkdir(mode=0o700)
    ws.mkdir(mode=0o700)
    os.chown(ws, user_uid, user_uid)
    os.chmod(ws, 0o700)
    (disk / MARKER).write_text("root\n")
    os.chmod(disk, 0o711)
    return ws


# What the agent loads before it confines itself (Landlock; on the container tier, its seccomp
# filter too): its interpreter, the standard library, the shared libraries and the dynamic
# loader's configuration. A fresh sandbox boots on the template's own; a sandbox started from a
# disk (a snapshot, a fork, a resume without memory) would boot on whatever the tenant changed
# there, so such a start is refused when the disk's root layer changed any of them.
BOOT_PATHS = (
    "etc/ld.so.preload", "etc/ld.so.cache", "etc/ld.so.conf", "etc/ld.so.conf.d",
    "lib", "lib32", "lib64", "libx32", "usr/lib", "usr/lib32", "usr/lib64", "usr/libx32",
    "usr/bin/python3", "usr/pyvenv.cfg", "usr/bin/pyvenv.cfg",
)  # fmt: skip
_OPAQUE = "trusted.overlay.opaque"


def boot_path_changes(upper: Path, allowed: dict[str, bytes] | None = None) -> list[str]:
    """The paths of BOOT_PATHS (and `usr/bin/python3.*`) that the upper layer `upper` changes,
    replaces or hides, but those whose content is `allowed[path]` exactly (what the runtime
    itself wrote there)."""
    allowed = allowed or {}
    changed = []
    python = sorted(p.name for p in (upper / "usr/bin").glob("python3.*")) if (
        (upper / "usr/bin").is_dir() and not (upper / "usr/bin").is_symlink()
    ) else []  # fmt: skip
    for rel in (*BOOT_PATHS, *(f"usr/bin/{n}" for n in python)):
        parts = rel.split("/")
        for i in range(1, len(parts)):  # a parent replaced (not a plain directory) or opaque
            parent = upper.joinpath(*parts[:i])
            if os.path.lexists(parent) and (
                parent.is_symlink() or not parent.is_dir() or _opaque(parent)
            ):
                changed.append("/".join(parts[:i]))
                break
        else:
            path = upper / rel
            if not os.path.lexists(path):
                continue
            if rel in allowed and not path.is_symlink() and path.is_file():
                if path.read_bytes() == allowed[rel]:
                    continue
            changed.append(rel)
    return sorted(set(changed))


def _opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, _OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def add_accounts(template: Path, upper: Path, base: int) -> None:
    """Give the sandbox `user` (1000) in /etc/passwd and /etc/group when the template has no
    account for uid 1000: written into the upper layer, the template stays as it is."""
    try:
        passwd = (template / "etc/passwd").read_text()
        group = (template / "etc/group").read_text()
    except OSError:
        return
    if any(line.split(":")[2:3] == ["1000"] for line in passwd.splitlines()):
        return
    etc = upper / "etc"
    st = os.stat(template / "etc")
    etc.mkdir(mode=stat.S_IMODE(st.st_mode), exist_ok=True)
    os.chown(etc, base + st.st_uid, base + st.st_gid)
    for name, text, line in (("passwd", passwd, USER_LINE), ("group", group, GROUP_LINE)):
        if any(entry.split(":")[2:3] == ["1000"] for entry in text.splitlines()):
            continue
        src = os.stat(template / "etc" / name)
        p = etc / name
        p.write_text(text + ("" if text.endswith("\n") or not text else "\n") + line)
        os.chown(p, base + src.st_uid, base + src.st_gid)
        os.chmod(p, stat.S_IMODE(src.st_mode))


def mount(bind_dir: Path, template: Path, userns_fd: int) -> Path:
    """Mount the overlay at bind_dir/root: the idmapped template below, disk/upper above.
    Returns its path; raises RootfsError (nothing left mounted) if it cannot."""
    lower, root = bind_dir / LOWER, bind_dir / ROOT
    lower.mkdir(mode=0o700, exist_ok=True)
    root.mkdir(mode=0o755, exist_ok=True)
    mount_idmapped(template, lower, userns_fd, read_only=True)
    try:
        options = f"lowerdir={LOWER},upperdir={DISK}/{UPPER},workdir={DISK}/{WORK},redirect_dir=on"
        _in_dir(bind_dir, lambda: _mount_overlay(root, options))
    finally:
        _libc.umount2(str(lower).encode(), MNT_DETACH)  # the overlay keeps its own reference
        try:
            lower.rmdir()
        except OSError:
            pass
    if _read_only(root):
        unmount(bind_dir)
        raise RootfsError("the overlay came up read-only (see the kernel log)")
    return root


def mount_idmapped(template: Path, target: Path, userns_fd: int, read_only: bool) -> None:
    """The template, idmapped, attached at `target` (an existing directory)."""
    fd = _idmapped_clone(template, userns_fd, read_only)
    try:
        _attach(fd, target)
    finally:
        os.close(fd)


def _mount_overlay(root: Path, options: str) -> None:
    _check(
        _libc.mount(
            b"overlay", str(root).encode(), b"overlay", MS_NOSUID | MS_NODEV, options.encode()
        ),
        "mount overlay",
    )


def _in_dir(path: Path, fn: Callable[[], None]) -> None:
    """Run `fn` in a thread whose working directory (its own: CLONE_FS) is `path`."""
    errors: list[BaseException] = []

    def work() -> None:
        try:
            _check(_libc.unshare(_UNSHARE_FS), "unshare(CLONE_FS)")
            os.chdir(path)
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    t = threading.Thread(target=work, name="rootfs-mount")
    t.start()
    t.join()
    if errors:
        raise errors[0]


def _read_only(root: Path) -> bool:
    """Whether the overlay at `root` is read-only (or not mounted at all): the mount's flags,
    not a read of every mount on the host."""
    return not diskimage.is_mount_point(root) or bool(os.statvfs(root).f_flag & os.ST_RDONLY)


def unmount(bind_dir: Path) -> bool:
    """Unmount the overlay (before the disk it writes to); False if it would not go."""
    root = bind_dir / ROOT
    if not root.is_dir():
        return True  # no root layer (the host template): nothing was mounted
    return diskimage.umount(root)
