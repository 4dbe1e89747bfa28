"""Warm pools: claims, refills, fallback to cold creates, tenant isolation, and no leaked
members across server restarts. Real servers and sandboxes (host template: fast)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import ServerHandle, start_server

from agentbox.battery import inventory
from agentbox.sdk import Sandbox, Templates


def _pool(server: ServerHandle, template: str) -> dict:
    with server.client() as c:
        r = c.get("/v1/pools")
        r.raise_for_status()
    return next(p for p in r.json()["pools"] if p["template"] == template)


def _wait_ready(server: ServerHandle, template: str, ready: int, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        pool = _pool(server, template)
        if pool["ready"] == ready and pool["starting"] == 0:
            return pool
        assert time.monotonic() < deadline, f"pool never reached {ready} ready: {pool}"
        time.sleep(0.1)


@pytest.fixture
def pooled(tmp_path: Path):
    handle = start_server(tmp_path, ["--warm-pool", "default=2"])
    yield handle
    if handle.proc is None:
        handle.start()
    handle.kill_all_sandboxes()
    handle.stop()


def test_claim_is_a_hit_applies_envs_and_metadata_and_refills(pooled: ServerHandle):
    before = _wait_ready(pooled, "host", 2)
    key = pooled.make_key("pool-user")
    sbx = Sandbox.create(
        envs={"GREETING": "hi"}, metadata={"k": "v"}, timeout=120, api_url=pooled.url, api_key=key
    )
    try:
        after = _pool(pooled, "host")
        assert after["hits"] == before["hits"] + 1
        assert sbx.commands.run("echo $GREETING").stdout == "hi\n"
        info = sbx.get_info()
        assert info.metadata == {"k": "v"}
        assert info.tenant == "pool-user"
        # The deadline counts from the claim, not from when the member was made.
        assert 100 < (info.end_at - info.created_at).total_seconds() <= 121
        assert [s.sandbox_id for s in Sandbox.list(api_url=pooled.url, api_key=key)] == [
            sbx.sandbox_id
        ]
        refilled = _wait_ready(pooled, "host", 2)
        assert refilled["refills"] >= 3 and refilled["refill_ms_p50"] is not None
    finally:
        sbx.kill()
        sbx.close()


def test_members_are_invisible_and_not_counted(pooled: ServerHandle):
    _wait_ready(pooled, "host", 2)
    key = pooled.make_key("quota-one")
    with pooled.client() as c:
        r = c.put("/v1/tenants/quota-one/quota", json={"max_sandboxes": 1})
        assert r.status_code == 200, r.text
    assert Sandbox.list(api_url=pooled.url, api_key=key) == []
    sbx = Sandbox.create(api_url=pooled.url, api_key=key)
    try:
        with pooled.client(key) as c:
            r = c.post("/v1/sandboxes", json={})
            assert r.status_code == 429, r.text  # their one sandbox, not the pool, counts
            members = [s for s in pooled.client().get("/v1/sandboxes").json()["sandboxes"]]
            assert all(s["tenant"] != "~pool" for s in members)
    finally:
        sbx.kill()
        sbx.close()


def test_empty_pool_falls_back_to_a_cold_create(pooled: ServerHandle):
    _wait_ready(pooled, "host", 2)
    with Templates(api_url=pooled.url, api_key=pooled.admin_key) as t:
        stats = t.set_pool_size("default", 0)
        assert stats.size == 0 and stats.ready == 0
    misses = _pool(pooled, "host")["misses"]
    sbx = Sandbox.create(envs={"A": "1"}, api_url=pooled.url, api_key=pooled.admin_key)
    try:
        assert sbx.commands.run("echo $A").stdout == "1\n"
        assert _pool(pooled, "host")["misses"] == misses + 1
    finally:
        sbx.kill()
        sbx.close()
    live = inventory.take(pooled.data_dir).sandbox_ids()
    assert live == set(), live  # shrinking to 0 ended the members


def test_pool_api_checks_caller_and_input(pooled: ServerHandle):
    key = pooled.make_key("not-admin")
    with pooled.client(key) as c:
        assert c.put("/v1/pools/default", json={"size": 1}).status_code == 403
        assert c.get("/v1/pools").status_code == 200
    with pooled.client() as c:
        assert c.put("/v1/pools/no-such-template", json={"size": 1}).status_code == 404
        assert c.put("/v1/pools/default", json={"size": 1000}).status_code in (400, 422)


def test_no_leaked_members_across_restarts(pooled: ServerHandle):
    _wait_ready(pooled, "host", 2)
    members = inventory.take(pooled.data_dir).sandbox_ids()
    assert len(members) == 2
    pooled.stop()
    # Smaller pool after the restart: one member re-adopted, the other ended.
    pooled.extra_args = ["--warm-pool", "default=1"]
    pooled.start()
    pool = _wait_ready(pooled, "host", 1)
    assert pool["refills"] == 0  # re-adopted, not re-made
    left = inventory.take(pooled.data_dir).sandbox_ids()
    assert len(left) == 1 and left <= members
    sbx = Sandbox.create(api_url=pooled.url, api_key=pooled.admin_key)
    assert sbx.sandbox_id in members  # the adopted member is claimable
    assert sbx.commands.run("echo ok").stdout == "ok\n"
    sbx.kill()
    sbx.close()
    pooled.stop()
    # No pool at all: every member is ended at start.
    pooled.extra_args = []
    pooled.start()
    deadline = time.monotonic() + 20
    while inventory.take(pooled.data_dir).sandbox_ids():
        assert time.monotonic() < deadline, inventory.take(pooled.data_dir).items()
        time.sleep(0.1)


def test_stop_during_a_refill_leaves_nothing_unowned(pooled: ServerHandle):
    _wait_ready(pooled, "host", 2)
    sbx = Sandbox.create(api_url=pooled.url, api_key=pooled.admin_key)
    time.sleep(0.08)  # the refill has started a new member
    pooled.stop()
    # The member started during the stop was let finish: a restart without pools ends it and
    # the old ones; only the claimed sandbox is left.
    pooled.extra_args = []
    pooled.start()
    deadline = time.monotonic() + 20
    while (left := inventory.take(pooled.data_dir).sandbox_ids()) != {sbx.sandbox_id}:
        assert time.monotonic() < deadline, left
        time.sleep(0.1)
    sbx.kill()
    sbx.close()
