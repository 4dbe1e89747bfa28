"""The clean mount namespace sandboxes start from (runtimes/process/mountns.py): it holds none
of agentbox's mounts nor any loop or overlay mount, a sandbox's copy of it gets that sandbox's
own trees at their paths, and neither keeps a disk attached once the host lets go of it."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest
from test_diskimage_mount import _cleared, _image, _loops_of, private_mounts

from agentbox.runtimes import diskimage
from agentbox.runtimes.diskimage import unescape_mountinfo
from agentbox.runtimes.process import mountns
from agentbox.runtimes.process.mountns import Mount

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces: needs root")


def _points(pid: int | str = "self") -> list[str]:
    with open(f"/proc/{pid}/mountinfo") as f:
        return [Mount.parse(line).point for line in f]


def test_mountinfo_lines_are_read_with_their_escapes() -> None:
    line = "36 35 7:3 / /run/agentbox/x/sbx_a/my\\040disk rw,relatime shared:1 - ext4 /dev/loop3 rw"
    assert Mount.parse(line) == Mount("/run/agentbox/x/sbx_a/my disk", 7, "ext4")
    assert unescape_mountinfo("a\\011b\\134c\\012") == "a\tb\\c\n"
    assert unescape_mountinfo("trailing\\04") == "trailing\\04"  # not an escape: left alone
    assert unescape_mountinfo("not\\089octal") == "not\\089octal"
    no_optional = "22 1 0:5 / /dev rw - devtmpfs udev rw"
    assert Mount.parse(no_optional) == Mount("/dev", 0, "devtmpfs")


def test_what_a_clean_namespace_drops() -> None:
    dropped = mountns.agentbox_mount(Path("/run/agentbox"))
    assert dropped(Mount("/run/agentbox/x/sbx_a/disk", 7, "ext4"))
    assert dropped(Mount("/run/agentbox/x/sbx_a/root", 0, "overlay"))
    assert dropped(Mount("/run/agentbox/x/agent", 0, "tmpfs"))
    # Any data dir's volumes and kept workspaces being read.
    assert dropped(Mount("/var/lib/agentbox/volumes/vol_1/mnt", 7, "ext4"))
    assert dropped(Mount("/srv/other/kept-mounts/sbx_k.x1", 7, "ext4"))
    assert dropped(Mount("/srv/other/kept-mounts-gvisor/sbx_k.x1", 7, "ext4"))
    # The host's own, loop and overlay mounts included, and what the bind root lies in.
    assert not dropped(Mount("/", 0, "overlay"))
    assert not dropped(Mount("/usr", 0, "overlay"))  # systemd-sysext
    assert not dropped(Mount("/snap/core/1", 7, "squashfs"))
    assert not dropped(Mount("/var/lib/agentbox", 7, "ext4"))  # a data dir on a loop disk
    assert not dropped(Mount("/var/lib/agentbox/volumes/vol_1/mnt", 8, "ext4"))  # not a loop
    assert not dropped(Mount("/run", 7, "ext4"))
    assert not dropped(Mount("/run/agentbox", 0, "tmpfs"))
    assert not dropped(Mount("/media/usb", 8, "ext4"))
    assert not dropped(Mount("/run/agentboxes/x", 7, "tmpfs"))


@needs_root
@private_mounts
def test_a_sandbox_gets_its_own_trees_and_no_one_elses(tmp_path: Path) -> None:
    # As on a systemd host: the server's mounts are shared (this test's namespace only).
    subprocess.run(["mount", "--make-rshared", "/"], check=True)
    base = tmp_path
    run_root, host = base / "run", base / "host"
    mine, other, later = (run_root / "x" / n for n in ("sbx_mine", "sbx_other", "sbx_later"))
    for d in (host, mine / "disk", other / "disk", later / "disk"):
        d.mkdir(parents=True)
    diskimage.mount_image(_image(base / "other.img", 16), other / "disk")
    volume = _image(base / "volume.img", 16)  # another data dir's volume, mounted on the host
    vol = base / "other-data" / "volumes" / "vol_1" / "mnt"
    vol.mkdir(parents=True)
    diskimage.mount_image(volume, vol)
    subprocess.run(["mount", "-t", "tmpfs", "host", str(host)], check=True)
    stacked = run_root / "x" / "agent"  # two at one point: a shared tree made again
    stacked.mkdir()
    for _ in range(2):
        subprocess.run(["mount", "-t", "tmpfs", "tree", str(stacked)], check=True)

    clean = mountns.CleanNamespace.make(mountns.agentbox_mount(run_root))
    try:
        assert clean.mounts < len(_points())
        # Made after the clean namespace, like every sandbox's own.
        disk = _image(base / "mine.img", 16)
        diskimage.mount_image(disk, mine / "disk")
        (mine / "disk" / "hello").write_text("mine\n")
        diskimage.mount_image(_image(base / "later.img", 16), later / "disk")

        def inside() -> tuple[list[str], str, subprocess.Popen]:
            seen = _points(f"self/task/{threading.get_native_id()}")
            text = (mine / "disk" / "hello").read_text()
            return seen, text, subprocess.Popen(["sleep", "60"])

        seen, text, holder = clean.start([mine], inside)
        try:
            assert text == "mine\n"
            assert str(mine / "disk") in seen and str(host) in seen
            ours = sorted(p for p in seen if p.startswith(f"{run_root}/"))
            assert ours == [str(mine), str(mine / "disk")]  # the clone, its disk
            for gone in (other / "disk", later / "disk", vol, stacked):
                assert str(gone) not in seen, (gone, seen)
            # What the thread started holds the copy; the server's namespace is unchanged.
            assert _points(holder.pid) == seen
            # The clones are not peers of the server's mounts: nothing propagates either way.
            with open(f"/proc/{holder.pid}/mountinfo") as f:
                shared = [ln for ln in f if " shared:" in ln.split(" - ")[0]]
            assert shared == [], shared
            assert os.readlink(f"/proc/{holder.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
            assert str(other / "disk") in _points() and str(mine / "disk") in _points()
            # The host lets go of the volume: nothing the clean namespace made still holds it.
            assert diskimage.umount(vol)
            assert _cleared(volume), _loops_of(volume)
            # The sandbox's own disk stays attached while its copy lives...
            assert diskimage.umount(mine / "disk")
            assert _loops_of(disk)
        finally:
            holder.kill()
            holder.wait()
        # ...and goes with it.
        assert _cleared(disk), _loops_of(disk)
    finally:
        clean.close()
    with pytest.raises(mountns.MountNsError, match="closed"):
        clean.start([], lambda: None)
    for mnt in (other / "disk", later / "disk", host, stacked, stacked):
        subprocess.run(["umount", str(mnt)], check=True)


@needs_root
@private_mounts
def test_a_tree_that_cannot_be_cloned_fails_the_start_and_runs_nothing(tmp_path: Path) -> None:
    clean = mountns.CleanNamespace.make(mountns.agentbox_mount(tmp_path / "run"))
    ran: list[int] = []
    try:
        with pytest.raises(mountns.MountNsError, match="clone .*missing"):
            clean.start([tmp_path / "missing"], lambda: ran.append(1))
    finally:
        clean.close()
    assert ran == []


@needs_root
@private_mounts
def test_a_host_that_cannot_clone_a_tree_starts_sandboxes_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe clones a real tree: without open_tree (Linux < 5.2, or a seccomp profile that
    refuses it) there is no clean namespace, and nothing is left open."""
    monkeypatch.setattr(mountns, "SYS_OPEN_TREE", 100_000)  # ENOSYS, as a kernel without it
    fds = len(os.listdir("/proc/self/fd"))
    assert mountns.CleanNamespace.try_make(mountns.agentbox_mount(tmp_path), tmp_path) is None
    assert len(os.listdir("/proc/self/fd")) == fds
    monkeypatch.undo()
    clean = mountns.CleanNamespace.try_make(mountns.agentbox_mount(tmp_path), tmp_path)
    assert clean is not None
    clean.close()
