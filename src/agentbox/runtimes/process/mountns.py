"""Sandboxes started from a mount namespace that holds none of the other sandboxes' mounts.

bwrap makes a sandbox's mount namespace as a copy of the one it starts in and then drops the
copy's old tree: both walk every mount there. Started from the server's namespace, which holds
every live sandbox's disk and root overlay, a create beside 2,000 idle sandboxes took 6-8x its
time beside 10 (BENCHMARKS.md, issue 19; docs/design/mount-namespaces.md).

So the runtime makes one *clean* namespace when it starts: a private copy of the host's from
which every mount of agentbox's is detached (below `/run/agentbox`: sandboxes' disks and
roots, shared trees; elsewhere: any data dir's volumes and kept workspaces being read). Each
sandbox is then started from a fresh copy of it (`CleanNamespace.start`), into which clones of
that sandbox's own trees are moved at the same paths (and made private). The clones are taken
in the server's namespace, where the mounts stay: destroy, snapshots, usage and restarts reach
them there as before. The copy lives as long as the outer bwrap that starts in it, and holds
nothing but the sandbox's own mounts and the host's of the moment the runtime started.

The cost of that: a host mount present when the runtime started (an administrator's disk, an
NFS export) stays referenced by the clean namespace, and by the sandboxes started since, after
the host unmounts it, until the server stops (resp. the sandbox ends). Mounts the host makes
later never reach a sandbox. `AGENTBOX_CLEAN_MOUNT_NS=0` turns it off (runtime.py).

Every call that changes a namespace runs in a short-lived thread of its own (`unshare` and
`setns` change the calling thread only; a pool thread must never carry them).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from agentbox.runtimes.diskimage import LOOP_MAJOR, MNT_DETACH, unescape_mountinfo

T = TypeVar("T")

CLONE_FS = 0x200
CLONE_NEWNS = 0x20000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
OPEN_TREE_CLONE = 1
AT_RECURSIVE = 0x8000
AT_FDCWD = -100
MOVE_MOUNT_F_EMPTY_PATH = 4
# Numbered alike on every architecture (the syscall table shared since 5.1).
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
log = logging.getLogger(__name__)


class MountNsError(OSError):
    pass


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise MountNsError(err, f"{what}: {os.strerror(err)}")
    return ret


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo, the fields the clean namespace is made by."""

    point: str
    major: int
    fstype: str

    @classmethod
    def parse(cls, line: str) -> Mount:
        fields = line.split()
        sep = fields.index("-", 6)
        major = int(fields[2].split(":")[0])
        return cls(point=unescape_mountinfo(fields[4]), major=major, fstype=fields[sep + 1])


# Where agentbox mounts a disk image on the host outside the bind roots, in any data dir:
# a volume's host mount (core/volumes.py) and a kept workspace being read (runtime.py).
_IMAGE_MOUNT = re.compile(r"/volumes/[^/]+/mnt$|/kept-mounts[^/]*/[^/]+$")


def agentbox_mount(run_root: Path) -> Callable[[Mount], bool]:
    """Which mounts a clean namespace drops: everything below `run_root` (every data dir's
    sandboxes, shared trees, template binds), and the loop mounts of volumes and kept
    workspaces of any data dir. Never `/` or a mount `run_root` lies in; never another host
    mount, loop or overlay alike (a snap, a systemd-sysext /usr, a data dir on a loop disk):
    sandboxes may need them."""
    prefix = str(run_root).rstrip("/") + "/"

    def dropped(m: Mount) -> bool:
        if prefix.startswith(m.point.rstrip("/") + "/"):
            return False
        if m.point.startswith(prefix):
            return True
        return m.major == LOOP_MAJOR and _IMAGE_MOUNT.search(m.point) is not None

    return dropped


def _in_thread(fn: Callable[[], T]) -> T:
    """`fn()` in a new thread that ends with it (taking whatever namespace `fn` entered)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=run, name="agentbox-mountns")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def _private_copy() -> None:
    """Move the calling thread into a new mount namespace of its own, private throughout."""
    _check(_libc.unshare(CLONE_FS | CLONE_NEWNS), "unshare a mount namespace")
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")


def _own_mounts() -> list[Mount]:
    with open(f"/proc/self/task/{threading.get_native_id()}/mountinfo") as f:
        return [Mount.parse(line) for line in f]


class CleanNamespace:
    """A mount namespace without agentbox's mounts, held by a descriptor, to start sandboxes
    from (see the module's text)."""

    def __init__(self, fd: int, mounts: int) -> None:
        self.fd = fd
        self.mounts = mounts  # how many it holds (a new sandbox's copy starts with these)
        self._lock = threading.Lock()

    @classmethod
    def make(cls, dropped: Callable[[Mount], bool]) -> CleanNamespace:
        def build() -> CleanNamespace:
            _private_copy()
            # The deepest first; one that went with its parent is gone already. A mount
            # stacked under another at the same point is reached on the next pass.
            for _ in range(4):
                doomed = [m.point for m in _own_mounts() if dropped(m)]
                for point in sorted(doomed, key=lambda p: p.count("/"), reverse=True):
                    _libc.umount2(os.fsencode(point), MNT_DETACH)
                if not doomed:
                    break
            else:
                left = [m for m in _own_mounts() if dropped(m)]
                if left:
                    raise MountNsError(
                        0, f"could not detach {left[0].point} from a clean namespace"
                    )
            count = len(_own_mounts())
            me = f"/proc/self/task/{threading.get_native_id()}/ns/mnt"
            return cls(os.open(me, os.O_RDONLY | os.O_CLOEXEC), count)

        return _in_thread(build)

    @classmethod
    def try_make(cls, dropped: Callable[[Mount], bool], probe: Path) -> CleanNamespace | None:
        """The clean namespace, or None (logged) where this host cannot make or use one:
        `probe`, a directory, is cloned into a copy of it as a sandbox's trees are (open_tree
        and move_mount: Linux 5.2, and not refused by a seccomp profile the server runs
        under)."""
        ns = None
        try:
            ns = cls.make(dropped)
            ns.start([probe], lambda: None)
            return ns
        except (OSError, ValueError) as e:
            if ns is not None:
                ns.close()
            log.warning("sandboxes start from the server's mount namespace: %s", e)
            return None

    def start(self, trees: Sequence[Path], fn: Callable[[], T]) -> T:
        """`fn()` in a new thread in a fresh copy of the clean namespace that has each of
        `trees` (a directory with the mounts below it, or a mount) at its own path, as the
        server's namespace has them. What `fn` starts stays in that copy, and holds it."""

        def run() -> T:
            clones = []
            try:
                for path in trees:  # taken in the server's namespace (the thread's, still)
                    flags = OPEN_TREE_CLONE | AT_RECURSIVE | os.O_CLOEXEC
                    fd = _libc.syscall(SYS_OPEN_TREE, AT_FDCWD, os.fsencode(path), flags)
                    clones.append((_check(fd, f"clone {path}"), path))
                _check(_libc.unshare(CLONE_FS), "unshare the thread's filesystem context")
                with self._lock:  # the descriptor is shared with close()
                    if self.fd < 0:
                        raise MountNsError(0, "the clean mount namespace is closed")
                    _check(_libc.setns(self.fd, CLONE_NEWNS), "enter the clean namespace")
                _check(_libc.unshare(CLONE_NEWNS), "copy the clean namespace")
                for fd, path in clones:
                    ret = _libc.syscall(
                        SYS_MOVE_MOUNT,
                        fd,
                        b"",
                        AT_FDCWD,
                        os.fsencode(path),
                        MOVE_MOUNT_F_EMPTY_PATH,
                    )
                    _check(ret, f"attach {path} in the sandbox's namespace")
                    # A clone of a shared mount (/run on a systemd host) is its peer: private,
                    # so that nothing mounted on either side reaches the other.
                    ret = _libc.mount(b"none", os.fsencode(path), None, MS_REC | MS_PRIVATE, None)
                    _check(ret, f"make {path} private in the sandbox's namespace")
            finally:
                for fd, _ in clones:
                    os.close(fd)
            return fn()

        return _in_thread(run)

    def close(self) -> None:
        with self._lock:
            if self.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self.fd)
                self.fd = -1
