"""Disk images mounted by ioctls (diskimage.mount_image): the loop device is bound with direct
I/O where the backing filesystem allows it, clears itself with the mount, and a mount that
fails leaves no device behind."""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

from agentbox.runtimes import diskimage

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts: needs root")


_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, MS_REC, MS_PRIVATE = 0x00020000, 0x4000, 0x40000


def private_mounts(test: Callable[..., None]) -> Callable[..., None]:
    """Run the test in a forked child, in a private mount namespace of its own: what it mounts
    no other process sees or copies. The battery runs beside the suite: it reads the host's
    mount table for mounts a sandbox should not have made (a test's mount of the moment is one
    to it), and a sandbox it starts on the gVisor tier copies the host's mounts into its
    launcher's namespace, which holds them (and their loop devices) for that sandbox's life."""

    @functools.wraps(test)
    def run(*args: object, **kwargs: object) -> None:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                if _libc.unshare(CLONE_NEWNS) != 0 or (
                    _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0
                ):
                    raise OSError(ctypes.get_errno(), "no private mount namespace")
                test(*args, **kwargs)
                code = 0
            except BaseException:  # noqa: BLE001 - said, and the exit status fails the test
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "failed in its child: see its stderr"

    return run


def _image(path: Path, mb: int = 64) -> Path:
    with open(path, "wb") as f:
        f.truncate(mb << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", str(path)], check=True)
    return path


def _loops_of(image: Path) -> list[str]:
    target = os.path.realpath(image)
    found = []
    for f in Path("/sys/block").glob("loop*/loop/backing_file"):
        if f.read_text().strip().removesuffix(" (deleted)") == target:
            found.append(f.parent.parent.name)
    return found


def _cleared(image: Path, within: float = 5.0) -> bool:
    """No loop device holds `image`, waited for: an autoclear device is detached at its last
    close, which may be another process's (udev probing the device after its change event)
    a moment after the unmount; a CI run under load once caught it still attached."""
    deadline = time.monotonic() + within
    while _loops_of(image):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _mount_options(mnt: Path) -> set[str]:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(mnt):
            return set(fields[5].split(","))
    raise AssertionError(f"{mnt} is not mounted")


@pytest.mark.parametrize("where", ["/var/tmp", "/dev/shm"])  # ext4 host; tmpfs (no O_DIRECT)
@private_mounts
def test_an_image_mounts_hardened_and_its_device_goes_with_the_mount(
    tmp_path: Path, where: str
) -> None:
    d = Path(where) / f"agentbox-test-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    try:
        image, mnt = _image(d / "disk.img"), d / "mnt"
        mnt.mkdir()
        diskimage.mount_image(image, mnt)
        try:
            assert {"rw", "nosuid", "nodev", "noatime"} <= _mount_options(mnt)
            (loop,) = _loops_of(image)
            sysfs = Path("/sys/block") / loop / "loop"
            assert (sysfs / "autoclear").read_text().strip() == "1"
            if where == "/var/tmp":
                assert (sysfs / "dio").read_text().strip() == "1"
            (mnt / "f").write_text("x")
        finally:
            assert diskimage.umount(mnt)
        assert _cleared(image)
    finally:
        subprocess.run(["rm", "-rf", str(d)], check=True)


@private_mounts
def test_a_mount_that_fails_leaves_no_loop_device(tmp_path: Path) -> None:
    image, mnt = tmp_path / "junk.img", tmp_path / "mnt"
    image.write_bytes(b"not a filesystem" * 65536)
    mnt.mkdir()
    with pytest.raises(diskimage.ImageError, match="mount"):
        diskimage.mount_image(image, mnt)
    assert not os.path.ismount(mnt)
    assert _cleared(image)


@private_mounts
def test_concurrent_mounts_each_get_a_device_of_their_own(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    pairs = []
    for i in range(6):
        (tmp_path / f"m{i}").mkdir()
        pairs.append((_image(tmp_path / f"i{i}.img", 16), tmp_path / f"m{i}"))
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda p: diskimage.mount_image(*p), pairs))
    try:
        loops = [_loops_of(image) for image, _ in pairs]
        assert all(len(found) == 1 for found in loops)
        assert len({found[0] for found in loops}) == 6
    finally:
        for _, mnt in pairs:
            diskimage.umount(mnt)
    assert all(_cleared(image) for image, _ in pairs)


@private_mounts
def test_umount_clears_a_device_attached_by_losetup_which_does_not_clear_itself(
    tmp_path: Path,
) -> None:
    """As `umount -d`: older servers and the kept-workspace reader attach with losetup."""
    image, mnt = _image(tmp_path / "old.img", 16), tmp_path / "mnt"
    mnt.mkdir()
    device = diskimage.attach_loop(image)
    subprocess.run(["mount", device, str(mnt)], check=True)
    (loop,) = _loops_of(image)
    assert not diskimage.clears_itself(loop) and diskimage.mounted_device(mnt) == loop
    assert diskimage.umount(mnt)
    assert not os.path.ismount(mnt) and _cleared(image)
    assert diskimage.umount(mnt)  # nothing mounted: nothing to do
    assert diskimage.mounted_device(mnt) is None


@private_mounts
def test_a_busy_mount_is_detached_lazily_and_its_device_cleared_when_let_go(
    tmp_path: Path,
) -> None:
    image, mnt = _image(tmp_path / "busy.img", 16), tmp_path / "mnt"
    mnt.mkdir()
    diskimage.mount_image(image, mnt)
    held = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)  # keeps the filesystem busy
    try:
        assert diskimage.umount(mnt)
        assert not diskimage.is_mount_point(mnt)
        assert len(_loops_of(image)) == 1  # still in use through `held`
    finally:
        os.close(held)
    assert _cleared(image)  # by the kernel at the last close


@private_mounts
def test_mount_points_are_found_by_statx_bind_mounts_of_the_same_filesystem_too(
    tmp_path: Path,
) -> None:
    """A bind mount of a directory of the same filesystem has its parent's st_dev: only the
    kernel's mount-root attribute tells it apart (the runtime's idmapped template mounts)."""
    top = tmp_path / "sbx"
    src, bound, image_mnt, plain = tmp_path / "src", top / "vol0", top / "disk", top / "plain"
    for d in (src, bound, image_mnt, plain):
        d.mkdir(parents=True)
    (top / "file").write_text("x")
    (top / "link").symlink_to(src)
    ns_file = top / "userns"  # a namespace bound on a file, as the OCI tiers keep theirs
    ns_file.touch()
    subprocess.run(["mount", "--bind", "/proc/self/ns/user", str(ns_file)], check=True)
    subprocess.run(["mount", "--bind", str(src), str(bound)], check=True)
    diskimage.mount_image(_image(tmp_path / "d.img", 16), image_mnt)
    try:
        assert os.stat(bound).st_dev == os.stat(top).st_dev  # what os.path.ismount compares
        assert diskimage.is_mount_point(bound) and diskimage.is_mount_point(image_mnt)
        assert not diskimage.is_mount_point(plain) and not diskimage.is_mount_point(top / "link")
        assert not diskimage.is_mount_point(top / "missing")
        assert not diskimage.is_mount_point(top / "file") and diskimage.is_mount_point(ns_file)
        found = sorted(diskimage.mounts_at(top, tmp_path / "none"))
        assert found == [image_mnt, ns_file, bound]
        assert found == sorted(diskimage.mounted_under(top))
    finally:
        subprocess.run(["umount", str(bound)], check=True)
        assert diskimage.umount(ns_file) and not diskimage.is_mount_point(ns_file)
        assert diskimage.umount(image_mnt)
    assert diskimage.mounts_at(top) == []


@private_mounts
def test_an_attached_image_is_refused_until_let_go_and_a_mount_is_checked_for_its_image(
    tmp_path: Path,
) -> None:
    """The guards before a copy or a second mount of an image: `check_detached` refuses while
    any loop device holds it (waiting a moment for one that clears itself), and
    `check_mounted_from` accepts only the image's own mount, not a directory or another's."""
    image, other = _image(tmp_path / "a.img", 16), _image(tmp_path / "b.img", 16)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    diskimage.check_detached(image, "copy", wait=0)  # nothing holds it
    with pytest.raises(diskimage.ImageError, match="is not the mount of a.img"):
        diskimage.check_mounted_from(mnt, image)  # a plain directory
    device = diskimage.attach_loop(image)
    try:
        assert diskimage.loops_of(image) == [device.removeprefix("/dev/")]
        assert diskimage.backing_file(device.removeprefix("/dev/")) == os.path.realpath(image)
        started = time.monotonic()
        with pytest.raises(diskimage.ImageError, match="copy: .* attached to loop"):
            diskimage.check_detached(image, "copy", wait=0.3)
        assert time.monotonic() - started >= 0.3
        subprocess.run(["mount", "-o", "ro", device, str(mnt)], check=True)
        try:
            diskimage.check_mounted_from(mnt, image)
            with pytest.raises(diskimage.ImageError, match="is not the mount of b.img"):
                diskimage.check_mounted_from(mnt, other)
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
    finally:
        subprocess.run(["losetup", "-d", device], check=True)
    diskimage.check_detached(image, "copy")
    assert diskimage.loops_of(image) == []
