"""The process runtime's disks formatted ahead (runtimes/process/blanks.py), on the real tier:
a sandbox started on a blank made ahead has its workspace as one formatted for it would (the
sandbox's own, writable, its own filesystem), the pool refills, and the runtime leaves no
blank behind when it closes."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from agentbox.agent.client import AgentClient, OutputChunk
from agentbox.runtimes.base import Resources, SandboxSpec
from agentbox.runtimes.process.blanks import PER_SIZE
from agentbox.runtimes.process.runtime import ProcessRuntime
from agentbox.runtimes.process.workspace import IMAGE_NAME

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="loop-mounted disks need root"),
]


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


def _uuid(image: Path) -> str:
    out = subprocess.run(
        ["dumpe2fs", "-h", str(image)], capture_output=True, text=True, check=True
    ).stdout
    return next(line.split(":", 1)[1].strip() for line in out.splitlines() if "UUID" in line)


async def test_a_sandbox_on_a_blank_made_ahead_has_its_own_workspace(data_dir: Path) -> None:
    runtime = ProcessRuntime(data_dir)
    if runtime.blanks is None:
        await runtime.close()
        pytest.skip("no loop devices: disks are directories")
    blank_dir = runtime.layout.blank_disks
    ids = ["sbx_blankdisks00001", "sbx_blankdisks00002"]
    try:
        await runtime.create(SandboxSpec(ids[0], "default", Resources(disk_mb=96)))
        deadline = time.monotonic() + 10
        while runtime.blanks.count() < PER_SIZE:
            assert time.monotonic() < deadline, "no blank disk was made ahead"
            time.sleep(0.02)
        ahead = set(blank_dir.iterdir())
        state = await runtime.create(SandboxSpec(ids[1], "default", Resources(disk_mb=96)))
        assert len(ahead - set(blank_dir.iterdir())) == 1  # the second took one of them
        client = AgentClient(runtime.agent_address(ids[1], state).socket_path, connect_timeout=5)
        out = await _run(
            client,
            "id -u; stat -c '%u %a' /workspace; echo data > /workspace/f && cat /workspace/f;"
            " ls -A /workspace; df -m /workspace | tail -1 | awk '{print $2}'",
        )
        uid, owner, written, listing, size = out.split("\n")[:5]
        assert owner == f"{uid} 700", out  # the sandbox's, as a disk formatted for it
        assert written == "data" and listing == "f", out  # no lost+found, nothing else
        assert 80 <= int(size) <= 96, out
        images = [runtime.root / sid / IMAGE_NAME for sid in ids]
        assert _uuid(images[0]) != _uuid(images[1])
    finally:
        for sid in ids:
            await runtime.destroy(sid, None, keep_workspace=False)
        await runtime.close()
    assert not blank_dir.exists()
