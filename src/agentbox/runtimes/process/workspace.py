"""Per-sandbox workspaces: a sparse ext4 image, loop-mounted, whose size is the disk limit.

The kernels we target often lack quota support (no CONFIG_QUOTA), so a filesystem of its own is
the one disk limit a sandbox cannot write past. The image is sparse (it costs only what is
written), has no journal (it dies with the sandbox), and is mounted nosuid,nodev. When loop
devices are unavailable the workspace falls back to a plain directory and says the disk limit is
not enforced.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

IMAGE_NAME = "workspace.img"
MOUNT_NAME = "workspace"


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


def create(sandbox_dir: Path, bind_dir: Path, disk_mb: int, uid: int, use_loop: bool) -> Workspace:
    """The image lives in the private `sandbox_dir`; it is mounted in `bind_dir`, where the
    sandbox's bwrap (running as `uid`) can reach it."""
    bind_dir.mkdir(mode=0o711, exist_ok=True)
    mnt = bind_dir / MOUNT_NAME
    mnt.mkdir(mode=0o700)
    gid = uid
    if use_loop:
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
                f"lazy_itable_init=1,root_owner={uid}:{gid}",
                str(image),
            ]
        )
        _run(["mount", "-o", "loop,nosuid,nodev,noatime", str(image), str(mnt)])
        try:
            (mnt / "lost+found").rmdir()
        except OSError:
            pass
    os.chown(mnt, uid, gid)
    os.chmod(mnt, 0o700)
    return Workspace(path=mnt, disk_limit_enforced=use_loop)


def destroy(sandbox_dir: Path, bind_dir: Path, keep: bool) -> bool:
    """Unmount and remove the workspace. With `keep`, the image (or directory) stays on disk."""
    ok = True
    for mnt in mounted_under(bind_dir) + mounted_under(sandbox_dir):
        ok = _umount(mnt) and ok
    if not ok:
        return False
    mnt = bind_dir / MOUNT_NAME
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
