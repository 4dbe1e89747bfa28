"""How a `gvisor` sandbox is launched: runsc, and with it the sentry, the gofer and the ptrace
stubs, runs in a pid namespace of its own (runsc 2022's ptrace platform would leave the sentry
in the server's), whose init the server kills to end it all; the launcher's mount namespace keeps
no other sandbox's mounts alive; a create cut short after runsc started leaves nothing running.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from agentbox.runtimes.base import Resources, RuntimeError_, SandboxSpec
from agentbox.runtimes.process.runtime import proc_start_time

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the gvisor runtime needs root"),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _ns(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def _nspid(pid: int) -> list[int]:
    """The process's pid in its namespace and in each one above it, the host's first."""
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("NSpid:"))
    return [int(x) for x in line.split()[1:]]


def _mount_points(pid: int) -> list[str]:
    with open(f"/proc/{pid}/mountinfo") as f:
        return [line.split()[4] for line in f]


async def test_the_sandbox_has_a_pid_namespace_and_leaves_nothing(data_dir: Path) -> None:
    from agentbox.runtimes.oci.runtime import GvisorRuntime

    runtime = GvisorRuntime(data_dir=data_dir)
    first, second = "sbx_gvisorlaunch0001", "sbx_gvisorlaunch0002"
    a = await runtime.create(SandboxSpec(first, "default", Resources(disk_mb=64)))
    try:
        b = await runtime.create(SandboxSpec(second, "default", Resources(disk_mb=64)))
        try:
            init = b["pidns_pid"]
            procs = runtime.cgroups.pids(second)
            assert b["init_pid"] in procs and len(procs) >= 3  # sentry, gofer, stubs
            assert _ns(b["init_pid"], "pid") == _ns(init, "pid") != _ns(os.getpid(), "pid")
            for pid in procs:  # in the launcher's namespace, or one nested in it
                assert _ns(pid, "pid") != _ns(os.getpid(), "pid"), pid
                assert len(_nspid(pid)) >= 2, pid
            # The launcher's mount namespace: the second sandbox's own mounts, not the first's.
            own, other = runtime.bind_root / second, runtime.bind_root / first
            points = _mount_points(init)
            assert any(Path(p).is_relative_to(own) for p in points)
            assert not [p for p in points if Path(p).is_relative_to(other)]
            assert any(Path(p).is_relative_to(other) for p in _mount_points(os.getpid()))
        finally:
            await runtime.destroy(second, b, keep_workspace=False)
        assert proc_start_time(init) is None
        assert not runtime.cgroups.pids(second)
    finally:
        await runtime.destroy(first, a, keep_workspace=False)
        await runtime.close()


async def test_a_create_cut_short_after_start_leaves_no_launcher(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentbox.runtimes.oci.runtime import GvisorRuntime

    runtime = GvisorRuntime(data_dir=data_dir)
    sid = "sbx_gvisorlaunch0003"
    seen: list[int] = []

    def agent_never_answers(*args: object) -> None:
        pid, _ = runtime._pidns(sid, {})
        seen.append(pid)
        raise RuntimeError_("the sandbox agent did not start (injected)")

    monkeypatch.setattr(runtime, "_wait_for_agent", agent_never_answers)
    try:
        with pytest.raises(RuntimeError_, match="injected"):
            await runtime.create(SandboxSpec(sid, "default", Resources(disk_mb=64)))
        assert seen and isinstance(seen[0], int)
        assert proc_start_time(seen[0]) is None  # the namespace's init, and all in it, gone
        assert sid not in await runtime.list_sandboxes()
    finally:
        await runtime.close()
