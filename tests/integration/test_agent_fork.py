"""The agent forked from the zygote (AGENTBOX_AGENT_START=fork) against the agent bwrap starts
(exec, the default), on the real process tier: what bwrap does for its first process, the
forked agent must do for itself (docs/design/agent-zygote.md, section 3). So both are read from
the host (/proc) and from inside (a probe as root and as `user`) and must agree, field by field;
then what only the forked start has: its lifetime bound to the agent, a zygote that dies, a
request the zygote must refuse."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbox.agent.client import AgentClient, OutputChunk
from agentbox.runtimes.base import Resources, RuntimeError_, SandboxSpec
from agentbox.runtimes.process.runtime import ProcessRuntime
from agentbox.runtimes.process.weaken import WeakenedProcessRuntime
from agentbox.runtimes.process.zygote import ZygoteError
from tests.conftest import sweep_bind_roots

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the forked start needs a root server"),
]
SID = "sbx_agentfork000001"
STATUS_FIELDS = (
    "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp",
    "Seccomp_filters", "Cpus_allowed_list", "Umask", "SigBlk", "SigIgn",
)  # fmt: skip
PROBE = (
    "id; grep -E '^(Cap|NoNewPrivs|Seccomp|Groups|Umask)' /proc/self/status; ulimit -a; nproc;"
    " pwd; env | grep -v AGENTBOX_CMD_ID | sort; cat /proc/self/oom_score_adj;"
    " cat /proc/self/cgroup; hostname"
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _runtime(data_dir: Path, start: str) -> ProcessRuntime:
    before = os.environ.get("AGENTBOX_AGENT_START")
    os.environ["AGENTBOX_AGENT_START"] = start
    try:
        runtime = ProcessRuntime(data_dir)
    finally:
        if before is None:
            del os.environ["AGENTBOX_AGENT_START"]
        else:
            os.environ["AGENTBOX_AGENT_START"] = before
    assert runtime.capabilities()["agent_start"] == start
    return runtime


@pytest.fixture
def second_dir() -> Iterator[Path]:
    path = Path("/var/tmp") / f"agentbox-rt-fork-{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir(mode=0o700)
    yield path
    sweep_bind_roots(path)
    shutil.rmtree(path, ignore_errors=True)


async def _run(client: AgentClient, cmd: str, user: str = "root") -> str:
    _, events = await client.run_command(cmd=cmd, user=user, timeout=20)
    out = b""
    async for ev in events:
        if isinstance(ev, OutputChunk):
            out += ev.data
    return out.decode()


def _agent_pid(state: dict[str, Any]) -> int:
    if "agent_pid" in state:
        return int(state["agent_pid"])
    init = state["init_pid"]
    with open(f"/proc/{init}/task/{init}/children") as f:
        return int(f.read().split()[0])  # bwrap's init has one child: the agent


def _host_view(runtime: ProcessRuntime, state: dict[str, Any]) -> dict[str, Any]:
    pid, init, base = _agent_pid(state), state["init_pid"], state["uid"]
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    view: dict[str, Any] = {k: status.get(k) for k in STATUS_FIELDS}
    # The sandbox's root: the first id of its block, in every one of the four.
    view["ids"] = {status["Uid"], status["Gid"]} == {"\t".join([str(base)] * 4)}
    with open(f"/proc/{pid}/limits") as f:
        view["limits"] = f.read()
    with open(f"/proc/{pid}/cgroup") as f:
        cgroups = f.read().replace(runtime.layout.cgroup_group, "GROUP")
    view["cgroup"] = cgroups.replace(runtime.layout.scope, "SCOPE")
    view["cwd"] = os.readlink(f"/proc/{pid}/cwd")
    with open(f"/proc/{pid}/stat") as f:
        sid = int(f.read().rsplit(")", 1)[1].split()[3])
    view["session leader"] = sid == pid
    view["in a session of the server's"] = sid == os.getsid(0)
    view["namespaces are the init's"] = {
        ns: os.readlink(f"/proc/{pid}/ns/{ns}") == os.readlink(f"/proc/{init}/ns/{ns}")
        for ns in ("mnt", "pid", "net", "ipc", "uts", "cgroup", "user")
    }
    return view


async def _sandbox(runtime: ProcessRuntime) -> tuple[dict[str, Any], AgentClient]:
    state = await runtime.create(SandboxSpec(SID, "default", Resources(disk_mb=64)))
    client = AgentClient(runtime.agent_address(SID, state).socket_path, connect_timeout=5)
    return state, client


async def _close(runtime: ProcessRuntime) -> None:
    await runtime.destroy(SID, None, keep_workspace=False)
    await runtime.close()


async def test_the_forked_agent_is_the_agent_bwrap_starts(data_dir: Path, second_dir: Path):
    views = {}
    for start, where in (("exec", data_dir), ("fork", second_dir)):
        runtime = _runtime(where, start)
        try:
            state, client = await _sandbox(runtime)
            view = _host_view(runtime, state)
            view["probe as root"] = await _run(client, PROBE)
            view["probe as user"] = await _run(client, PROBE, user="user")
            views[start] = view
            log = (Path(state["dir"]) / "runtime.log").read_text()
        finally:
            await _close(runtime)
    exec_view, fork_view = views["exec"], views["fork"]
    for key in exec_view:
        assert fork_view[key] == exec_view[key], (key, exec_view[key], fork_view[key])
    # What the comparison rests on, stated (a check that the views are not both empty).
    assert exec_view["ids"] and not exec_view["session leader"]
    assert not exec_view["in a session of the server's"]
    assert exec_view["CapBnd"] == exec_view["CapPrm"] == "00000000800405fb"
    assert exec_view["Seccomp"] == "2" and exec_view["NoNewPrivs"] == "1"
    assert all(exec_view["namespaces are the init's"].values())
    assert "uid=0(root)" in exec_view["probe as root"]
    assert "uid=1000(user)" in exec_view["probe as user"]
    assert "\n500\n" in exec_view["probe as user"]  # the agent's own score is its children's
    assert "was not preloaded" not in log, log


async def test_the_forked_agents_descriptors_are_its_own(data_dir: Path) -> None:
    """Nothing of the zygote's or the server's: /dev/null, the log, the listener, the hold
    pipe, and what the agent opens itself (its oom_score_adj, its sudo socket)."""
    runtime = _runtime(data_dir, "fork")
    try:
        state, client = await _sandbox(runtime)
        await _run(client, "true")
        pid = state["agent_pid"]
        targets = {
            int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")
        }
    finally:
        await _close(runtime)
    log = str(Path(state["dir"]) / "runtime.log")
    assert targets[0] == "/dev/null" and targets[1] == targets[2] == log, targets
    assert targets[3].startswith("socket:") and targets[4].startswith("pipe:"), targets
    for fd, target in targets.items():
        assert target.startswith(("socket:", "/dev/null", log, "/proc/")) or fd == 4, targets
        assert not target.startswith(("anon_inode:", "user:", "pid:")), targets
    assert sum(t.startswith("pipe:") for t in targets.values()) == 1, targets


async def test_the_sandbox_ends_with_its_forked_agent(data_dir: Path) -> None:
    """The agent holds the hold pipe's only write end: killed, the hold program reads its end,
    exits, and bwrap ends the sandbox (is_alive False, its processes gone)."""
    runtime = _runtime(data_dir, "fork")
    try:
        state, client = await _sandbox(runtime)
        await _run(client, "sleep 300 >/dev/null 2>&1 &")
        assert await runtime.is_alive(SID, state)
        os.kill(state["agent_pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while await runtime.is_alive(SID, state):
            assert time.monotonic() < deadline, "the sandbox outlived its agent"
            await asyncio.sleep(0.05)
        # The hold pipe kept by nothing else: a daemon of the sandbox's did not inherit it.
        assert not os.path.exists(f"/proc/{state['bwrap_pid']}/status") or (
            "Z" in Path(f"/proc/{state['bwrap_pid']}/stat").read_text().split()[2]
        )
    finally:
        await _close(runtime)


async def test_a_sandbox_bwrap_cannot_set_up_fails_and_leaves_no_agent(data_dir: Path) -> None:
    """The agent is forked while bwrap still sets the sandbox up, and waits for the hold
    program's word before it joins anything: a bwrap that fails after making the namespaces
    (here: the working directory is not in the tree) fails the create with bwrap's own words,
    the forked agent ends without having joined the sandbox, and the next create works."""
    runtime = _runtime(data_dir, "fork")
    assert runtime.zygote is not None
    zygote = runtime.zygote.pid()
    spec = SandboxSpec(SID, "default", Resources(disk_mb=64), workdir="/no/such/dir")
    try:
        with pytest.raises(RuntimeError_, match="(?i)chdir") as e:
            await runtime.create(spec)
        assert "/no/such/dir" in str(e.value), e.value
        deadline = time.monotonic() + 5
        while Path(f"/proc/{zygote}/task/{zygote}/children").read_text().split():
            assert time.monotonic() < deadline, "the forked agent outlived its sandbox's bwrap"
            await asyncio.sleep(0.02)
        await runtime.destroy(SID, None, keep_workspace=False)
        state, client = await _sandbox(runtime)
        assert "hi" in await _run(client, "echo hi")
        assert runtime.zygote.pid() == zygote
    finally:
        await _close(runtime)


async def test_a_command_cannot_read_or_trace_the_forked_agent(data_dir: Path) -> None:
    """Its memory is the zygote's, of the host's user namespace: no process of the sandbox,
    its root included, may read its /proc files or attach to it. bwrap's pid 1 and the hold
    program are filtered as every command is."""
    runtime = _runtime(data_dir, "fork")
    try:
        _, client = await _sandbox(runtime)
        out = await _run(
            client,
            "a=$(pgrep -f '^/.agentbox/main.py'); echo agent=$a;"
            " cat /proc/$a/environ >/dev/null 2>&1 && echo READ-ENVIRON;"
            " cat /proc/$a/maps >/dev/null 2>&1 && echo READ-MAPS;"
            " dd if=/proc/$a/mem bs=1 count=1 skip=4096 2>/dev/null && echo READ-MEM;"
            " grep -h ^Seccomp: /proc/1/status /proc/2/status;"
            " cat /proc/self/maps >/dev/null && echo READS-ITS-OWN",
        )
    finally:
        await _close(runtime)
    assert "agent=" in out and "agent=\n" not in out, out
    assert "READ-" not in out and "READS-ITS-OWN" in out, out
    assert out.count("Seccomp:\t2") == 2, out


async def test_the_zygote_comes_back_and_its_agents_do_not_need_it(data_dir: Path) -> None:
    runtime = _runtime(data_dir, "fork")
    assert runtime.zygote is not None
    assert _zygotes_of(os.getpid()) == [runtime.zygote.pid()]
    second = "sbx_agentfork000002"
    try:
        _, client = await _sandbox(runtime)
        assert runtime.zygote is not None
        old = runtime.zygote.pid()
        assert old is not None
        os.kill(old, signal.SIGKILL)
        await asyncio.sleep(0.1)
        assert (await _run(client, "echo still here")).strip() == "still here"
        state = await runtime.create(SandboxSpec(second, "default", Resources(disk_mb=64)))
        assert runtime.zygote.pid() not in (None, old)
        again = AgentClient(runtime.agent_address(second, state).socket_path, connect_timeout=5)
        assert (await _run(again, "echo new")).strip() == "new"
    finally:
        await runtime.destroy(second, None, keep_workspace=False)
        await _close(runtime)
    assert not _zygotes_of(os.getpid()), "the zygote outlived its runtime"


def _zygotes_of(parent: int) -> list[int]:
    """Zygote processes `parent` started (their boot code on their command line)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"runpy.run_path" in cmdline:
            found.append(int(pid))
    return found


def test_the_zygote_refuses_a_process_of_the_hosts_namespaces(data_dir: Path) -> None:
    """Asked to fork an agent beside a process of the host (not a sandbox's init), the zygote
    answers an error and forks nothing."""
    runtime = _runtime(data_dir, "fork")
    assert runtime.zygote is not None
    me = os.pidfd_open(os.getpid())
    a, b = socket.socketpair()
    r, w = os.pipe()
    log = os.open("/dev/null", os.O_WRONLY)
    try:
        with pytest.raises(ZygoteError, match="shares the host's pid namespace"):
            runtime.zygote.fork_agent({"pid": os.getpid()}, [me, a.fileno(), w, log, r, r, r])
    finally:
        for fd in (me, r, w, log):
            os.close(fd)
        a.close()
        b.close()
        asyncio.run(runtime.close())


def test_an_unknown_agent_start_is_refused(data_dir: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("AGENTBOX_AGENT_START", "spawn")
    with pytest.raises(RuntimeError_, match="exec or fork"):
        ProcessRuntime(data_dir)


def test_a_runtime_built_on_the_process_tier_starts_its_agent_by_exec(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTBOX_AGENT_START", "fork")
    runtime = WeakenedProcessRuntime(data_dir)
    try:
        assert runtime.capabilities()["agent_start"] == "exec"
        assert runtime.zygote is None
    finally:
        asyncio.run(runtime.close())


def test_a_zygote_that_does_not_start_leaves_the_exec_start(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback: no answer from the zygote in time (here: no time at all) and sandboxes
    start by exec, as the capabilities say; no zygote process is left behind."""
    from agentbox.runtimes.process import zygote

    monkeypatch.setenv("AGENTBOX_AGENT_START", "fork")
    monkeypatch.setattr(zygote, "START_TIMEOUT_S", 1e-6)
    runtime = ProcessRuntime(data_dir)
    try:
        assert runtime.capabilities()["agent_start"] == "exec"
        assert runtime.zygote is None
        assert not _zygotes_of(os.getpid())
        state = asyncio.run(runtime.create(SandboxSpec(SID, "default", Resources(disk_mb=64))))
        assert "agent_pid" not in state and asyncio.run(runtime.is_alive(SID, state))
    finally:
        asyncio.run(runtime.destroy(SID, None, keep_workspace=False))
        asyncio.run(runtime.close())


def test_the_zygote_ends_when_its_server_does(data_dir: Path) -> None:
    """A server that dies closes its end of the zygote's socket (its only holder): the zygote
    exits on its own, nothing kills it."""
    runtime = _runtime(data_dir, "fork")
    try:
        assert runtime.zygote is not None and runtime.zygote._sock is not None
        proc = runtime.zygote._proc
        assert proc is not None
        runtime.zygote._sock.close()
        assert proc.wait(timeout=10) == 0
    finally:
        asyncio.run(runtime.close())
