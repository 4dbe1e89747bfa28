"""The user-namespace helper (runtimes/process/userns.py): a namespace mapping a block, its
nesting limit 0 unless asked, and a helper that died replaced on the next request."""

from __future__ import annotations

import os
import subprocess

import pytest

from agentbox.runtimes.process import userns

# A block no sandbox of a test run leases (the allocator hands out blocks from the bottom).
BASE = 0x6E000000

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="maps another uid range: needs root")


def _inside(fd: int, script: str) -> str:
    r = subprocess.run(
        ["nsenter", f"--user=/proc/self/fd/{fd}", "--preserve-credentials", "sh", "-c", script],
        pass_fds=[fd],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return r.stdout + r.stderr


def test_the_namespace_maps_the_block_and_forbids_nesting() -> None:
    fd = userns.make(BASE)
    try:
        out = _inside(
            fd,
            "cat /proc/self/uid_map /proc/self/gid_map /proc/sys/user/max_user_namespaces; "
            "unshare --user true 2>/dev/null; echo rc=$?",
        )
    finally:
        os.close(fd)
    lines = [line.split() for line in out.splitlines()]
    assert lines[0] == ["0", str(BASE), "65536"] and lines[1] == lines[0], out
    assert lines[2] == ["0"] and lines[-1] == ["rc=1"], out
    fd = userns.make(BASE, nesting=True)  # the battery's weakening
    try:
        assert _inside(fd, "cat /proc/sys/user/max_user_namespaces").strip() != "0"
    finally:
        os.close(fd)


def test_a_dead_helper_is_replaced() -> None:
    os.close(userns.make(BASE))
    proc = userns._helper._proc
    assert proc is not None and proc.poll() is None
    proc.kill()
    proc.wait()
    fd = userns.make(BASE)
    try:
        assert _inside(fd, "cat /proc/self/uid_map").split() == ["0", str(BASE), "65536"]
    finally:
        os.close(fd)
    assert userns._helper._proc is not proc


def test_a_block_it_cannot_map_is_an_error_not_a_hang() -> None:
    # Ids beyond what the kernel maps: the write of the map fails, the request says so.
    with pytest.raises(userns.UsernsError, match="could not map|failed"):
        userns.make(2**32 - 10)


def test_a_namespace_for_a_runtime_binary_maps_what_it_is_told() -> None:
    """GvisorRuntime's: root stays host root, `nobody` is the block's last id, the rest of the
    block maps to itself, nesting allowed (runsc makes namespaces inside)."""
    lines = [(0, 0, 1), (65534, BASE + 65535, 1), (BASE, BASE, 65535)]
    fd = userns.make_mapped(lines)
    try:
        out = _inside(
            fd, "cat /proc/self/uid_map /proc/self/gid_map; unshare --user true; echo rc=$?"
        )
    finally:
        os.close(fd)
    got = [tuple(int(x) for x in line.split()) for line in out.splitlines()[:-1]]
    assert sorted(got[:3]) == sorted(lines) and sorted(got[3:]) == sorted(lines), out
    assert out.splitlines()[-1] == "rc=0", out
    assert userns.mapped_range(os.getpid()) is None  # the host's own namespace
