"""Disk images mounted by ioctls (diskimage.mount_image): the loop device is bound with direct
I/O where the backing filesystem allows it, clears itself with the mount, and a mount that
fails leaves no device behind."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from agentbox.runtimes import diskimage

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts: needs root")


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


def _mount_options(mnt: Path) -> set[str]:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(mnt):
            return set(fields[5].split(","))
    raise AssertionError(f"{mnt} is not mounted")


@pytest.mark.parametrize("where", ["/var/tmp", "/dev/shm"])  # ext4 host; tmpfs (no O_DIRECT)
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
        assert _loops_of(image) == []
    finally:
        subprocess.run(["rm", "-rf", str(d)], check=True)


def test_a_mount_that_fails_leaves_no_loop_device(tmp_path: Path) -> None:
    image, mnt = tmp_path / "junk.img", tmp_path / "mnt"
    image.write_bytes(b"not a filesystem" * 65536)
    mnt.mkdir()
    with pytest.raises(diskimage.ImageError, match="mount"):
        diskimage.mount_image(image, mnt)
    assert not os.path.ismount(mnt)
    assert _loops_of(image) == []


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
    assert all(_loops_of(image) == [] for image, _ in pairs)
