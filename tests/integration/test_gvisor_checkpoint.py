"""A `gvisor` sandbox can be checkpointed from the start: `quiesce` closes every host socket it
holds (the agent's own, its connections, the relays), `runsc checkpoint` then succeeds, and after
a restore `reopen` brings the agent's socket back: the files and the processes of before are
there, the processes still running. Without the quiesce (the positive control) the checkpoint
fails, as runsc refuses to save a sandbox holding a host socket. Pause, snapshots and forks are
built on this by the lifecycle work; here the runtime is driven directly, with runsc's own
commands for the checkpoint and the restore.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from agentbox.agent.client import AgentClient, OutputChunk
from agentbox.runtimes.base import Resources, SandboxSpec
from agentbox.runtimes.oci.runtime import OCI_LOG

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed"),
]
SID = "sbx_gvisorckpt00001"
COUNTER = "nohup sh -c 'while true; do echo x >> /tmp/ticks; sleep 0.05; done' >/dev/null 2>&1 &"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _run(client: AgentClient, cmd: str) -> str:
    _, events = await client.run_command(cmd=cmd, timeout=20)
    out = b""
    async for ev in events:
        if isinstance(ev, OutputChunk):
            out += ev.data
    return out.decode()


async def test_quiesce_checkpoint_restore_reopen(data_dir: Path) -> None:
    from agentbox.runtimes.oci.runtime import PIDNS_FILE, GvisorRuntime, host_pid, run_in_pidns
    from agentbox.runtimes.process.runtime import kill_if_same

    runtime = GvisorRuntime(data_dir=data_dir)
    state = await runtime.create(SandboxSpec(SID, "default", Resources(disk_mb=64)))
    sdir = runtime.root / SID
    try:
        client = AgentClient(Path(state["socket"]), connect_timeout=5)
        await _run(client, f"echo before > /workspace/kept; {COUNTER}")
        await runtime.quiesce(SID, state)
        assert not os.path.exists(state["socket"])  # nothing of the host's is left open
        image = data_dir / "image"
        image.mkdir()
        argv = runtime.binary_argv(SID, state, "checkpoint", "--image-path", str(image), SID)
        done = subprocess.run(argv)
        assert done.returncode == 0, (sdir / OCI_LOG).read_text()[-2000:]
        # The checkpoint ended the sandbox: its pid namespace and runsc's state of it go.
        kill_if_same(state["pidns_pid"], state["pidns_start"])
        runtime._remove_state(SID)
        with open(sdir / "runtime.log", "ab") as log:
            argv = [*runtime._global_args(sdir / OCI_LOG), "restore", "--detach"]
            argv += ["--image-path", str(image), "--bundle", str(sdir / "bundle")]
            argv += ["--pid-file", str(sdir / "init.pid"), SID]
            pidns, rc = run_in_pidns(argv, log, sdir, sdir / PIDNS_FILE)
        assert rc == 0 and pidns is not None, (sdir / OCI_LOG).read_text()[-2000:]
        state["pidns_pid"], state["pidns_start"] = pidns
        state["init_pid"] = host_pid(pidns[0], int((sdir / "init.pid").read_text()))
        await runtime.reopen(SID, state)
        assert (await client.ping(5)).get("ok") is True
        assert await _run(client, "cat /workspace/kept") == "before\n"
        # The loop started before the checkpoint carries on after the restore.
        count = "wc -l < /tmp/ticks"
        ticks = await _run(client, f"a=$({count}); sleep 0.5; {count}; echo $a")
        after, before = (int(x) for x in ticks.split())
        assert after > before > 0, ticks
    finally:
        await runtime.destroy(SID, state, keep_workspace=False)
        await runtime.close()


async def test_without_quiesce_the_checkpoint_fails(data_dir: Path) -> None:
    """The positive control: the agent's bound host socket alone makes runsc refuse."""
    from agentbox.runtimes.oci.runtime import GvisorRuntime

    runtime = GvisorRuntime(data_dir=data_dir)
    state = await runtime.create(SandboxSpec(SID, "default", Resources(disk_mb=64)))
    sdir = runtime.root / SID
    try:
        image = data_dir / "image"
        image.mkdir()
        argv = runtime.binary_argv(SID, state, "checkpoint", "--image-path", str(image), SID)
        done = subprocess.run(argv, capture_output=True, text=True)
        assert done.returncode != 0
        assert "host socket" in (sdir / OCI_LOG).read_text() + done.stderr
    finally:
        await runtime.destroy(SID, state, keep_workspace=False)
        await runtime.close()
