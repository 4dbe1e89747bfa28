"""The host inventory is an oracle: check that it sees each kind of leak it claims to see
(positive controls planted by hand), that diff reports appearances and disappearances, and that
snapshots survive JSON."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from agentbox.battery import inventory as inv
from agentbox.runtimes.process.cgroups import CGROUP_ROOT, GROUP
from agentbox.runtimes.process.runtime import UID_RANGE

pytestmark = pytest.mark.reliability


def test_diff_semantics_and_json() -> None:
    base = inv.Inventory(data_dir="/d", bind_root="/run/agentbox/x", digest="x", taken_at=0.0)
    p = inv.ProcessInfo(
        pid=10,
        start=5,
        ppid=1,
        uid=200_001,
        state="S",
        comm="sleep",
        cmdline="sleep 1",
        cgroup="/agentbox/x/sbx_a",
        sandbox="sbx_a",
        netns="net:[1]",
        why=["cgroup"],
    )
    after = inv.Inventory.from_json(base.to_json())
    assert inv.diff(base, after) == [] and after.is_empty()
    after.processes.append(p)
    after.mounts.append("/run/agentbox/x/sbx_a/workspace (ext4 from /dev/loop0)")
    after.entries.append("/d/sandboxes/sbx_a")
    changes = inv.diff(base, after)
    assert len(changes) == 3 and all(c.startswith("leaked ") for c in changes), changes
    assert all(c.startswith("removed ") for c in inv.diff(after, base))
    assert inv.leaks(after, base) == []
    assert after.sandbox_ids() == {"sbx_a"}
    assert len(after.about("sbx_a")) == 3 and after.about("sbx_b") == []
    again = inv.Inventory.from_json(after.to_json())
    assert inv.diff(after, again) == []
    # The same pid with another start time is another process.
    reused = inv.Inventory.from_dict(again.to_dict())
    reused.processes[0].start = 6
    assert len(inv.diff(after, reused)) == 2


def _child_of(ppid: int, timeout: float = 5) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in os.listdir("/proc"):
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except (OSError, ValueError):
                continue
            if name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == ppid:
                return int(name)
        time.sleep(0.02)
    raise AssertionError(f"no child of {ppid} appeared")


@pytest.mark.skipif(os.geteuid() != 0, reason="planting mounts, cgroups and uids needs root")
def test_sees_planted_leaks(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    (data_dir / "sandboxes" / "sbx_planted").mkdir(parents=True)
    before = inv.take(data_dir)
    assert before.entries == [str(data_dir / "sandboxes" / "sbx_planted")]
    bind_root = Path(before.bind_root)
    mnt = data_dir / "sandboxes" / "sbx_planted" / "m"
    mnt.mkdir()
    image = tmp_path / "img"
    cgroups = [
        base / GROUP / before.digest / "sbx_planted"
        for base in (CGROUP_ROOT / "pids", CGROUP_ROOT)
        if (base / "cgroup.procs").exists() and (base / GROUP).is_dir()
    ][:1]
    procs: list[subprocess.Popen] = []
    loop = None
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "planted", str(mnt)], check=True)
        bind_root.mkdir(parents=True)
        for cg in cgroups:
            cg.mkdir(parents=True)
        with open(image, "wb") as f:
            f.truncate(1024 * 1024)
        img_in_data = data_dir / "sandboxes" / "sbx_planted" / "workspace.img"
        shutil.copy(image, img_in_data)
        loop = subprocess.run(
            ["losetup", "-f", "--show", str(img_in_data)], capture_output=True, text=True
        ).stdout.strip()
        # A helper whose argv names the bind root, and a process as a sandbox uid in no cgroup.
        procs.append(
            subprocess.Popen(
                ["sh", "-c", "sleep 60; true", f"{bind_root}/sbx_planted/x"],
            )
        )
        uid = UID_RANGE[1] - 1

        def drop() -> None:
            os.setgid(uid)
            os.setuid(uid)

        procs.append(subprocess.Popen(["sleep", "60"], preexec_fn=drop))
        # ... and one whose parent is another data dir's sandbox (a server without cgroups).
        other_root = "/run/agentbox/ffffffffffff/sbx_other/workspace"
        theirs = subprocess.Popen(
            [
                "sh",
                "-c",
                f"setpriv --reuid={uid} --regid={uid} --clear-groups sleep 60; true",
                other_root,
            ]
        )
        their_child = _child_of(theirs.pid)
        if cgroups:
            joined = subprocess.Popen(["sleep", "60"])
            procs.append(joined)
            (cgroups[0] / "cgroup.procs").write_text(str(joined.pid))
        time.sleep(0.1)
        after = inv.take(data_dir)
        changes = "\n".join(inv.diff(before, after))
        assert f"leaked mount: {mnt} (tmpfs from planted)" in changes
        assert f"leaked entry: {bind_root}/" in changes
        for cg in cgroups:
            assert f"leaked cgroup: {os.path.realpath(cg)}" in changes
        if loop:
            assert f"leaked loop device: {loop} -> {img_in_data}" in changes
        found = {p.pid: p for p in after.processes}
        assert "argv" in found[procs[0].pid].why
        assert found[procs[1].pid].why == ["sandbox-uid"] and found[procs[1].pid].uid == uid
        assert their_child not in found, "another data dir's sandbox process was counted"
        if cgroups:
            assert found[procs[2].pid].sandbox == "sbx_planted"
            assert "cgroup" in found[procs[2].pid].why
        assert "sbx_planted" in after.sandbox_ids()
    finally:
        if "their_child" in locals():
            os.kill(their_child, signal.SIGKILL)
        if "theirs" in locals():
            procs.append(theirs)
        for proc in procs:
            proc.kill()
            proc.wait()
        subprocess.run(["umount", str(mnt)], capture_output=True)
        if loop:
            subprocess.run(["losetup", "-d", loop], capture_output=True)
        for cg in cgroups:
            for _ in range(50):
                try:
                    cg.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)
            try:
                cg.parent.rmdir()  # the scope this test made (no server uses its digest)
            except OSError:
                pass
        shutil.rmtree(bind_root, ignore_errors=True)
    assert inv.diff(before, inv.take(data_dir)) == []
