"""The control plane's lifecycle against the fake runtime: every state change goes through the
transition table and is announced; failures, kills, timeouts, vanished sandboxes and a restart
end (or keep) sandboxes the way they must. Milliseconds each, no sandbox started."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentbox.core import supervision
from agentbox.core.auth import Caller
from agentbox.core.errors import (
    InvalidRequest,
    QuotaExceeded,
    SandboxNotRunning,
    SandboxUnavailable,
)
from agentbox.core.lifecycle import InvalidTransition, StateChange
from agentbox.core.manager import CreateRequest, SandboxManager
from agentbox.core.network import NetworkService, NetworkSettings
from agentbox.core.states import ENDED, TRANSITIONS, SandboxState, allowed
from agentbox.runtimes.fake import FakeRuntime
from agentbox.store.db import Store
from agentbox.templates import TemplateStore

ACME = Caller(tenant="acme", key_id="k1", admin=False)
S = SandboxState
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class World:
    """A store and a runtime that outlive the managers made on them (a server's restarts)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.store = Store(f"sqlite:///{root / 'agentbox.db'}")
        self.runtime = FakeRuntime(root)
        self.changes: list[StateChange] = []

    def manager(self, **kwargs: object) -> SandboxManager:
        m = SandboxManager(
            self.store,
            self.runtime,
            TemplateStore(self.root / "templates"),
            NetworkService(self.store, self.root, NetworkSettings()),
            check_templates=False,
            default_template="host",
            **kwargs,  # type: ignore[arg-type]
        )
        m.states.subscribe(self.changes.append)
        return m

    def moves(self, sandbox_id: str) -> list[tuple[str | None, str]]:
        return [
            (c.old.value if c.old else None, c.new.value)
            for c in self.changes
            if c.sandbox_id == sandbox_id
        ]


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


@pytest.fixture
async def mgr(world: World) -> AsyncIterator[SandboxManager]:
    m = world.manager(health_interval=0.05, ping_timeout=0.5)
    await m.start()
    yield m
    await m.stop()


async def _wait_for(check: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_the_table_has_no_way_back_from_an_end() -> None:
    for end in ENDED:
        assert TRANSITIONS[end] == frozenset()
        assert not any(allowed(end, s) for s in SandboxState)
    assert allowed(S.BUILDING, S.STARTING) and not allowed(S.RUNNING, S.STARTING)
    assert allowed(S.RUNNING, S.PAUSED) and allowed(S.PAUSED, S.RUNNING)
    # A sandbox paused without memory resumes through starting, and pauses again from there
    # if it cannot start; nothing else goes from starting to paused or back.
    assert allowed(S.STARTING, S.PAUSED) and allowed(S.PAUSED, S.STARTING)
    assert not allowed(S.BUILDING, S.PAUSED) and not allowed(S.PAUSED, S.BUILDING)
    assert all(allowed(S.PAUSED, end) for end in ENDED)
    assert not allowed(S.RUNNING, "sleeping")  # no such state


async def test_create_and_kill(world: World, mgr: SandboxManager) -> None:
    row = await mgr.create(ACME, CreateRequest())
    assert row.state == S.RUNNING and row.sandbox_id in world.runtime.sandboxes
    await mgr.kill(ACME, row.sandbox_id)
    ended = mgr.get(ACME, row.sandbox_id)
    assert ended.state == S.KILLED and ended.end_reason == "killed"
    assert row.sandbox_id not in world.runtime.sandboxes
    assert world.moves(row.sandbox_id) == [
        (None, "starting"),
        ("starting", "running"),
        ("running", "killed"),
    ]
    await mgr.kill(ACME, row.sandbox_id)  # idempotent: no second change, no second destroy
    assert len(world.moves(row.sandbox_id)) == 3
    assert world.runtime.calls.count(("destroy", row.sandbox_id)) == 1


async def test_a_runtime_failure_fails_the_create_and_leaves_nothing(
    world: World, mgr: SandboxManager
) -> None:
    world.runtime.fail("create")
    with pytest.raises(SandboxUnavailable):
        await mgr.create(ACME, CreateRequest())
    (sid,) = {c.sandbox_id for c in world.changes}
    assert world.moves(sid) == [(None, "starting"), ("starting", "failed")]
    assert mgr.get(ACME, sid).state == S.FAILED
    assert world.runtime.sandboxes == {}


async def test_a_sandbox_ends_at_its_timeout(world: World, mgr: SandboxManager) -> None:
    row = await mgr.create(ACME, CreateRequest(timeout=0.2))
    await _wait_for(lambda: mgr.get(ACME, row.sandbox_id).state != S.RUNNING)
    ended = mgr.get(ACME, row.sandbox_id)
    assert ended.state == S.EXPIRED and ended.end_reason == "timeout"
    assert ("destroy", row.sandbox_id) in world.runtime.calls


async def test_a_vanished_sandbox_is_ended_and_a_silent_one_is_unhealthy(
    world: World, mgr: SandboxManager
) -> None:
    gone = await mgr.create(ACME, CreateRequest())
    quiet = await mgr.create(ACME, CreateRequest())
    world.runtime.vanish(gone.sandbox_id)
    world.runtime.silence(quiet.sandbox_id)
    await _wait_for(lambda: mgr.get(ACME, gone.sandbox_id).state == S.KILLED)
    assert mgr.get(ACME, gone.sandbox_id).end_reason == "vanished"
    await _wait_for(lambda: mgr.get(ACME, quiet.sandbox_id).state == "unhealthy")
    world.runtime.silence(quiet.sandbox_id, False)
    await _wait_for(lambda: mgr.get(ACME, quiet.sandbox_id).state == S.RUNNING)
    # Unhealthy is shown, never stored.
    assert all(c.new != "unhealthy" for c in world.changes)


async def test_health_pings_a_bounded_number_of_agents_a_round_the_longest_unpinged_first(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every round reads whether each sandbox lives; only so many agents are pinged, in turn."""
    monkeypatch.setattr(supervision, "HEALTH_PINGS_PER_ROUND", 2)
    m = world.manager(health_interval=0.05, ping_timeout=0.5)
    await m.start()
    try:
        rows = [await m.create(ACME, CreateRequest()) for _ in range(4)]
        boxes = [world.runtime.sandboxes[r.sandbox_id] for r in rows]

        def pings() -> list[int]:
            return [sum(1 for q in b.requests if q.get("op") == "ping") for b in boxes]

        def rounds() -> int:
            return min(world.runtime.calls.count(("is_alive", r.sandbox_id)) for r in rows)

        first, before = rounds(), pings()
        await _wait_for(lambda: rounds() >= first + 10)
        done, after = rounds() - first, pings()
        assert sum(after) - sum(before) <= 2 * (done + 1)
        assert all(a - b >= 3 for a, b in zip(after, before, strict=True)), (before, after)
    finally:
        await m.stop()


async def test_a_restarted_manager_adopts_live_sandboxes(world: World) -> None:
    first = world.manager()
    await first.start()
    kept = await first.create(ACME, CreateRequest(timeout=60))
    short = await first.create(ACME, CreateRequest(timeout=0.3))
    # A create wakes the reaper as the server stops: stop must still end (Python 3.11's
    # wait_for lost that cancellation, and this hung).
    await asyncio.wait_for(first.stop(), 5)
    await world.runtime.close()
    await asyncio.sleep(0.4)  # `short` passes its deadline while no server runs
    second = world.manager()
    await second.start()
    try:
        assert second.get(ACME, kept.sandbox_id).state == S.RUNNING
        assert second.get(ACME, short.sandbox_id).state == S.EXPIRED
        assert ("adopt", kept.sandbox_id) in world.runtime.calls
        await second.kill(ACME, kept.sandbox_id)
        assert world.runtime.sandboxes == {}
    finally:
        await second.stop()


async def test_a_leftover_with_no_record_is_removed(world: World) -> None:
    m = world.manager()
    await m.start()
    await m.stop()
    from agentbox.runtimes.base import Resources, SandboxSpec

    await world.runtime.create(SandboxSpec("sbx_0123456789abcdef", "default", Resources()))
    again = world.manager()
    await again.start()
    try:
        assert "sbx_0123456789abcdef" not in world.runtime.sandboxes
    finally:
        await again.stop()


async def test_the_quota_counts_live_sandboxes(world: World, mgr: SandboxManager) -> None:
    mgr.set_quota(Caller("root", "k0", admin=True), "acme", {"max_sandboxes": 2})
    rows = [await mgr.create(ACME, CreateRequest()) for _ in range(2)]
    with pytest.raises(QuotaExceeded):
        await mgr.create(ACME, CreateRequest())
    await mgr.kill(ACME, rows[0].sandbox_id)
    await mgr.create(ACME, CreateRequest())  # an ended sandbox frees its place


async def test_only_the_state_writer_writes_states(world: World, mgr: SandboxManager) -> None:
    row = await mgr.create(ACME, CreateRequest())
    with pytest.raises(ValueError, match="only through"):
        world.store.update_sandbox(row.sandbox_id, state="starting")
    with pytest.raises(InvalidTransition):
        mgr.states.move(row.sandbox_id, S.STARTING, only_from=frozenset({S.RUNNING}))
    # A move the current state does not allow changes nothing and says so.
    assert mgr.states.move(row.sandbox_id, S.STARTING) is None
    await mgr.kill(ACME, row.sandbox_id)
    assert mgr.states.move(row.sandbox_id, S.RUNNING) is None
    assert mgr.get(ACME, row.sandbox_id).state == S.KILLED


async def test_a_tier_that_cannot_pause_says_so(world: World, mgr: SandboxManager) -> None:
    row = await mgr.create(ACME, CreateRequest())
    with pytest.raises(InvalidRequest, match="fake isolation tier cannot pause") as e:
        await mgr.pause(ACME, row.sandbox_id)
    assert e.value.detail["setting"] == "isolation"
    assert mgr.get(ACME, row.sandbox_id).state == S.RUNNING
    # A resume of a running sandbox leaves it running; of an ended one, says it ended.
    assert (await mgr.resume(ACME, row.sandbox_id)).state == S.RUNNING
    await mgr.kill(ACME, row.sandbox_id)
    with pytest.raises(SandboxNotRunning, match="killed"):
        await mgr.resume(ACME, row.sandbox_id)


async def test_a_lifecycle_that_pauses_needs_a_tier_that_can(
    world: World, mgr: SandboxManager
) -> None:
    for lifecycle in ({"on_timeout": "pause"}, {"auto_resume": True}):
        with pytest.raises(InvalidRequest, match="cannot pause") as e:
            await mgr.create(ACME, CreateRequest(lifecycle=lifecycle))
        assert e.value.detail["setting"] == "lifecycle"
    # The default policy asks nothing of the tier.
    row = await mgr.create(ACME, CreateRequest(lifecycle={"on_timeout": "kill"}))
    assert row.lifecycle is None
    await mgr.kill(ACME, row.sandbox_id)


def test_a_store_move_is_compare_and_set_and_refuses_an_unknown_column(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'agentbox.db'}")
    now = time.time()
    store.insert_sandbox(
        sandbox_id="sbx_a", tenant="t", template="base", runtime="process", state="running",
        metadata={}, resources={}, runtime_state=None, keep_workspace=False, created_at=now,
        end_at=now + 60, network={}, access_token="x",
    )  # fmt: skip
    assert not store.move_sandbox("sbx_a", "starting", state="stopped")
    assert store.move_sandbox("sbx_a", "running", state="stopped", runtime_state={"pid": [1]})
    row = store.get_sandbox("sbx_a")
    assert row is not None and row.state == "stopped" and row.runtime_state == {"pid": [1]}
    assert store.get_sandbox("sbx_b") is None
    with pytest.raises(ValueError, match="no column bogus"):
        store.move_sandbox("sbx_a", "stopped", state="running", bogus=1)
    row = store.get_sandbox("sbx_a")
    assert row is not None and row.state == "stopped"


def test_a_tenants_holding_and_disk_are_summed_by_the_store_like_its_rows(tmp_path: Path) -> None:
    """The store's sums over a tenant's live rows against the same sums made from the rows:
    other tenants, ended sandboxes and (for what is held) one paused without memory left out;
    a row naming no pids, nofile or disk_mb counts at the defaults given."""
    store = Store(f"sqlite:///{tmp_path / 'agentbox.db'}")
    now = time.time()
    rows = [  # (tenant, state, park, runtime, resources)
        ("t", "running", None, "process", {"pids": 16, "nofile": 1024, "disk_mb": 64}),
        ("t", "starting", None, "gvisor", {"pids": 8, "nofile": 100, "disk_mb": 10}),
        ("t", "paused", "parked", "process", {"pids": 1000, "nofile": 1000, "disk_mb": 5}),
        ("t", "paused", None, "process", {"pids": 2, "nofile": 3, "disk_mb": 7}),
        ("t", "running", "parking", "process", {}),
        ("t", "killed", None, "process", {"pids": 10**6, "nofile": 1, "disk_mb": 10**6}),
        ("u", "running", None, "process", {"pids": 10**6, "nofile": 1, "disk_mb": 10**6}),
    ]
    for i, (tenant, state, park, runtime, res) in enumerate(rows):
        store.insert_sandbox(
            sandbox_id=f"sbx_{i}", tenant=tenant, template="base", runtime=runtime, state=state,
            metadata={}, resources=res, runtime_state=None, keep_workspace=False,
            created_at=now, end_at=now + 60, park=park,
        )  # fmt: skip
    live = store.live_sandboxes("t")
    assert sorted(r.sandbox_id for r in live) == [f"sbx_{i}" for i in range(5)]
    assert {r.tenant for r in store.live_sandboxes()} == {"t", "u"}
    holding = [r.resources for r in live if not (r.state == "paused" and r.parked)]
    expected = sum(r.get("pids", 4) * r.get("nofile", 5) for r in holding)
    assert store.tenant_holding("t", 4, 5) == (len(holding), expected) == (4, 16_384 + 800 + 6 + 20)
    assert store.tenant_holding("nobody", 4, 5) == (0, 0)
    assert store.tenant_disk_mb("t", 9) == {"process": (4, 64 + 5 + 7 + 9), "gvisor": (1, 10)}
    assert store.tenant_disk_mb("nobody", 9) == {}
