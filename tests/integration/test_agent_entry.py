"""The agent's own start-up options, for runtimes that start it as a container's first process
(no bwrap to load the filter or reap orphans for it): `--seccomp FILE` and `--init`.

They run here under the real process tier with bwrap's own filter switched off, so the filter a
command sees can only be the one the agent loaded; the same sandbox without the option is the
positive control.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from agentbox.agent.client import AgentClient, OutputChunk
from agentbox.runtimes.base import Resources, SandboxSpec
from agentbox.runtimes.process.runtime import AGENT_MOUNT, ProcessRuntime

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
]
SID = "sbx_agententry00001"


class SelfConfined(ProcessRuntime):
    """bwrap without its --seccomp; the agent takes the given options instead."""

    name = "self-confined"
    host_namespace = "selfconf"
    forks_agents = False  # bwrap runs the agent, with the options under test
    agent_options: tuple[str, ...] = ()

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir=data_dir)
        (self.agent_dir / "seccomp.bpf").write_bytes(self.seccomp)

    def _seccomp_args(self, fds: dict[str, int]) -> list[str]:
        return []

    def _agent_flags(self, fds: dict[str, int]) -> list[str]:
        return list(self.agent_options)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"



async def _run(client: AgentClient, cmd: str) -> tuple[str, dict[str, Any]]:
    _, events = await client.run_command(cmd=cmd, user="root", timeout=20)
    out, end = b"", {}
    async for ev in events:
        if isinstance(ev, OutputChunk):
            out += ev.data
        else:
            end = ev
    return out.decode(), end


async def _sandbox(data_dir: Path, options: tuple[str, ...]) -> tuple[SelfConfined, dict]:
    runtime = SelfConfined(data_dir)
    runtime.agent_options = options
    state = await runtime.create(SandboxSpec(SID, "default", Resources(disk_mb=64)))
    return runtime, state


async def _with(data_dir: Path, options: tuple[str, ...], cmd: str) -> str:
    runtime, state = await _sandbox(data_dir, options)
    try:
        client = AgentClient(runtime.agent_address(SID, state).socket_path, connect_timeout=5)
        out, end = await _run(client, cmd)
        assert end.get("exit_code") == 0, (out, end)
        return out
    finally:
        await runtime.destroy(SID, None, keep_workspace=False)
        await runtime.close()


SECCOMP_PROBE = "grep ^Seccomp: /proc/self/status; unshare -U true 2>&1; echo rc=$?"


async def test_the_agent_loads_the_filter_on_itself(data_dir: Path) -> None:
    out = await _with(data_dir, ("--seccomp", f"{AGENT_MOUNT}/seccomp.bpf"), SECCOMP_PROBE)
    assert "Seccomp:\t2" in out, out
    # EPERM is the filter's answer (the nesting limit alone would say ENOSPC).
    assert "Operation not permitted" in out and "rc=1" in out, out


async def test_without_the_option_there_is_no_filter(data_dir: Path) -> None:
    out = await _with(data_dir, (), SECCOMP_PROBE)
    assert "Seccomp:\t0" in out, out
    assert "Operation not permitted" not in out, out


async def test_a_filter_that_cannot_load_stops_the_sandbox(data_dir: Path) -> None:
    runtime = SelfConfined(data_dir)
    runtime.agent_options = ("--seccomp", f"{AGENT_MOUNT}/no-such-filter.bpf")
    try:
        with pytest.raises(Exception, match="seccomp filter"):
            await runtime.create(SandboxSpec(SID, "default", Resources(disk_mb=64)))
    finally:
        await runtime.destroy(SID, None, keep_workspace=False)
        await runtime.close()


async def test_the_init_reaps_orphans(data_dir: Path) -> None:
    """An orphan goes to the agent's init (a subreaper: bwrap's init is pid 1 here), which
    reaps it once it ends: no zombie stays behind."""
    runtime, state = await _sandbox(data_dir, ("--init",))
    try:
        client = AgentClient(runtime.agent_address(SID, state).socket_path, connect_timeout=5)
        out, _ = await _run(client, "sh -c 'sleep 300 >/dev/null 2>&1 & echo $!'")
        orphan = int(out.split()[-1])
        agent_parent, _ = await _run(client, "ps -o ppid= -p $PPID")
        ppid, _ = await _run(client, f"ps -o ppid=,comm= -p {orphan}")
        # The agent's parent is its init, not bwrap's (pid 1), and the orphan went to it.
        assert agent_parent.strip() not in ("", "1"), agent_parent
        assert ppid.split()[0] == agent_parent.strip(), (ppid, agent_parent)
        await _run(client, f"kill -9 {orphan}")
        states, _ = await _run(client, f"sleep 0.2; ps -o stat= -p {orphan}; true")
        assert states.strip() == "", f"the orphan is still there: {states!r}"
    finally:
        await runtime.destroy(SID, None, keep_workspace=False)
        await runtime.close()
