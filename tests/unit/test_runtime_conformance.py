"""The runtime contract (runtimes/base.py), held by every runtime this machine has: the real
`process` runtime (bubblewrap) and the fake one the core's tests use. A new runtime is added to
RUNTIMES and must pass the same checks.

- create gives a live sandbox whose agent answers;
- it is found by list_sandboxes (how reconcile finds leftovers), also by a new instance over
  the same data dir (a restarted server), which can adopt it, reach its agent and end it;
- destroy is complete (not alive, not listed) and idempotent, also with no state (a leftover).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from agentbox.agent.client import AgentClient
from agentbox.battery import inventory
from agentbox.runtimes.base import (
    RESOURCE_NAMES,
    HostFootprint,
    Pausable,
    Resources,
    Runtime,
    RuntimeError_,
    SandboxSpec,
    Snapshottable,
)
from agentbox.runtimes.fake import FakeRuntime

pytestmark = pytest.mark.anyio


def _process(data_dir: Path) -> Runtime:
    from agentbox.runtimes.process.runtime import ProcessRuntime

    return ProcessRuntime(data_dir=data_dir)


def _process_weakened(data_dir: Path) -> Runtime:
    """The battery's weakened process runtime: its declared features must stay honest too."""
    from agentbox.runtimes.process.weaken import WeakenedProcessRuntime

    return WeakenedProcessRuntime(data_dir=data_dir, weaken=["no-limits", "same-uid"])


def _container(data_dir: Path) -> Runtime:
    from agentbox.runtimes.oci.runtime import ContainerRuntime

    return ContainerRuntime(data_dir=data_dir)


def _gvisor(data_dir: Path) -> Runtime:
    from agentbox.runtimes.oci.runtime import GvisorRuntime

    return GvisorRuntime(data_dir=data_dir)


_shared_fakes: dict[Path, FakeRuntime] = {}


def _fake(data_dir: Path) -> Runtime:
    # The fake's sandboxes live in its memory: a "new instance" over the same data dir is the
    # same object, as the host is the same for a restarted server.
    return _shared_fakes.setdefault(data_dir, FakeRuntime(data_dir))


RUNTIMES: dict[str, Callable[[Path], Runtime]] = {
    "container": _container,
    "fake": _fake,
    "gvisor": _gvisor,
    "process": _process,
    "process-weakened": _process_weakened,
}
SID = "sbx_c0nf0rmance0001"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=sorted(RUNTIMES))
def make(request: pytest.FixtureRequest) -> Callable[[Path], Runtime]:
    if request.param.startswith("process") and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    binary = {"container": "runc", "gvisor": "runsc"}.get(request.param)
    if binary is not None and shutil.which(binary) is None:
        pytest.skip(f"{binary} is not installed (scripts/install.sh installs it)")
    return RUNTIMES[request.param]



async def _answers(runtime: Runtime, state: dict) -> bool:
    client = AgentClient(runtime.agent_address(SID, state).socket_path, connect_timeout=5)
    return (await client.ping(5)).get("ok") is True


async def test_create_adopt_destroy(make: Callable[[Path], Runtime], data_dir: Path) -> None:
    runtime = make(data_dir)
    state = await runtime.create(SandboxSpec(SID, "default", Resources(disk_mb=64)))
    try:
        assert await runtime.is_alive(SID, state)
        assert await _answers(runtime, state)
        assert SID in await runtime.list_sandboxes()
        await runtime.close()  # the server stops; the sandbox must outlive it
        again = make(data_dir)
        assert SID in await again.list_sandboxes()
        again.adopt(SID, state)
        assert await again.is_alive(SID, state)
        assert await _answers(again, state)
        await again.destroy(SID, state, keep_workspace=False)
        assert not await again.is_alive(SID, state)
        assert SID not in await again.list_sandboxes()
        await again.destroy(SID, state, keep_workspace=False)  # idempotent
        await again.destroy(SID, None, keep_workspace=False)  # a leftover with no state
        await again.close()
        await again.close()  # closing twice, or with nothing left, is fine
    finally:
        await make(data_dir).destroy(SID, None, keep_workspace=False)


async def test_a_leftover_without_state_is_removed(
    make: Callable[[Path], Runtime], data_dir: Path
) -> None:
    runtime = make(data_dir)
    await runtime.create(SandboxSpec(SID, "default", Resources(disk_mb=64)))
    # The record is lost (a crash before it was written): only the host knows the sandbox.
    assert SID in await runtime.list_sandboxes()
    await runtime.destroy(SID, None, keep_workspace=False)
    assert SID not in await runtime.list_sandboxes()
    await runtime.close()


async def test_features_are_honest(make: Callable[[Path], Runtime], data_dir: Path) -> None:
    """What a runtime declares it can do, it does; what it declares it cannot, it refuses."""
    runtime = make(data_dir)
    feats = runtime.features()
    assert feats.enforces <= RESOURCE_NAMES, feats.enforces - RESOURCE_NAMES
    state = await runtime.create(SandboxSpec(SID, "default", Resources(disk_mb=64)))
    try:
        if feats.network:
            # Reaching in works without the sandbox having a network: nothing listens on
            # this port inside, so the refusal comes from the sandbox's own loopback.
            with pytest.raises(ConnectionRefusedError):
                await runtime.connect_inside(SID, state, 1)
            listener = await runtime.listen_inside(SID, state, 3129)
            listener.close()
        else:
            with pytest.raises(RuntimeError_):
                await runtime.listen_inside(SID, state, 3129)
        await runtime.destroy(SID, state, keep_workspace=feats.kept_workspaces)
        kept = {k.sandbox_id for k in runtime.kept_workspaces()}
        assert (SID in kept) == feats.kept_workspaces
        if feats.kept_workspaces:
            assert await runtime.remove_kept_workspace(SID)
            assert SID not in {k.sandbox_id for k in runtime.kept_workspaces()}
    finally:
        await runtime.destroy(SID, None, keep_workspace=False)
        await runtime.close()


async def test_the_host_footprint_shows_a_sandbox_and_its_removal(
    make: Callable[[Path], Runtime], data_dir: Path
) -> None:
    """Leak checks look where `host_footprint` says: a live sandbox is seen there, and once
    destroyed nothing of it is."""
    runtime = make(data_dir)
    at = type(runtime).host_footprint(data_dir)
    if at == HostFootprint():
        # Nothing on the host (the fake keeps its sandboxes in memory): then there must be
        # nothing to find, which the process runtime's footprint would show.
        assert not inventory.take(data_dir, at=at).sandbox_ids()
        return
    before = inventory.take(data_dir, at=at)
    state = await runtime.create(SandboxSpec(SID, "default", Resources(disk_mb=64)))
    try:
        assert SID in inventory.take(data_dir, at=at).sandbox_ids()
    finally:
        await runtime.destroy(SID, state, keep_workspace=False)
        await runtime.close()
    assert inventory.leaks(before, inventory.take(data_dir, at=at)) == []


def test_optional_capabilities_match_the_declared_features(
    make: Callable[[Path], Runtime], data_dir: Path
) -> None:
    """A declared feature has its methods. (Methods without the feature are never reached: a
    runtime whose host lacks what they need, e.g. loop devices for snapshots, says so.)"""
    runtime = make(data_dir)
    feats = runtime.features()
    assert isinstance(runtime, Pausable) or not feats.pause
    assert isinstance(runtime, Snapshottable) or not feats.snapshot
    assert not isinstance(FakeRuntime(), Snapshottable | Pausable)


async def test_runtimes_sharing_a_data_dir_keep_to_their_own(data_dir: Path) -> None:
    """Two runtimes over one data dir (a server serving several tiers) each have their own
    corner of the host: neither lists, removes or unmounts the other's sandboxes, and closing
    one leaves the other's shared trees mounted."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    from agentbox.runtimes.process.runtime import ProcessRuntime

    class Twin(ProcessRuntime):
        name = "twin"
        host_namespace = "twin"

    ours, theirs = "sbx_c0nf0rmanceours1", "sbx_c0nf0rmancetheirs"
    process, twin = ProcessRuntime(data_dir=data_dir), Twin(data_dir=data_dir)
    mine = await process.create(SandboxSpec(ours, "default", Resources(disk_mb=64)))
    other = await twin.create(SandboxSpec(theirs, "default", Resources(disk_mb=64)))
    try:
        assert await process.list_sandboxes() == {ours}
        assert await twin.list_sandboxes() == {theirs}
        # A stray of one (no record) is nothing to the other: its destroy finds nothing.
        await process.destroy(theirs, None, keep_workspace=False)
        assert await twin.is_alive(theirs, other)
        client = AgentClient(twin.agent_address(theirs, other).socket_path, connect_timeout=5)
        assert (await client.ping(5)).get("ok") is True
        await process.destroy(ours, mine, keep_workspace=False)
        await process.close()  # nothing of its own left: it drops its own scaffolding
        assert await twin.is_alive(theirs, other)
        assert await twin.list_sandboxes() == {theirs}
        assert (await client.ping(5)).get("ok") is True
        assert (await twin.create(SandboxSpec(ours, "default", Resources(disk_mb=64))))["uid"]
        await twin.destroy(ours, None, keep_workspace=False)
        at = {name: type(rt).host_footprint(data_dir) for name, rt in (("p", process), ("t", twin))}
        assert not set(at["p"].dirs) & set(at["t"].dirs)
        assert at["p"].cgroup_groups != at["t"].cgroup_groups
        assert at["p"].lease_owners != at["t"].lease_owners
    finally:
        await twin.destroy(theirs, None, keep_workspace=False)
        await process.destroy(ours, None, keep_workspace=False)
        await twin.close()
        await process.close()
    assert await twin.list_sandboxes() == set() == await process.list_sandboxes()
