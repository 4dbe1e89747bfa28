"""The audit and egress logs cannot fill the disk, and the egress proxy's connections are
budgeted: stored fields are cut to their documented lengths (JSON details stay JSON), refused
attempts past a few per window are only counted, old and surplus rows are trimmed, and a
sandbox (or tenant) past its connection cap is answered with why instead of being served."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from agentbox.core.logs import LogKeeper, LogLimits, RefusalSampler
from agentbox.core.network import NetworkService, NetworkSettings
from agentbox.egress.addresses import AddressGuard
from agentbox.egress.policy import EgressPolicy
from agentbox.egress.proxy import HTTP_PORT, SOCKS_PORT, EgressProxy
from agentbox.store.db import (
    AUDIT_FIELD_LENGTHS,
    DETAIL_MAX_BYTES,
    EGRESS_FIELD_LENGTHS,
    Store,
    clip_detail,
)

BIG = "x" * 100_000


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store.for_data_dir(tmp_path)


def _egress(i: int = 0, **values: Any) -> dict[str, Any]:
    return {
        "time": time.time(),
        "tenant": "t",
        "sandbox_id": "sbx",
        "protocol": "connect",
        "host": f"h{i}.test",
        "port": 443,
        "allowed": False,
        "rule": "default: no rule allows it",
        "reason": "refused",
        **values,
    }


# ---------------------------------------------------------------------------- field lengths


def test_egress_fields_are_cut_to_their_lengths(store: Store) -> None:
    long = {name: BIG for name in EGRESS_FIELD_LENGTHS}
    store.add_egress_events([_egress(**long)])
    (row,) = store.list_egress(None, None, None, None, None, 10)
    for name, most in EGRESS_FIELD_LENGTHS.items():
        assert row[name] == "x" * most, name


def test_audit_fields_and_a_100k_detail_are_cut_and_the_detail_stays_json(store: Store) -> None:
    detail = {
        "path": "/workspace/" + BIG,
        "cmd": BIG,
        "nested": {"deep": [{"deeper": {"deepest": {"x": BIG}}}] * 500},
        "keys": {f"k{i}": i for i in range(1000)},
        "n": 7,
    }
    store.add_audit(
        time=time.time(),
        action="file.read" + BIG,
        tenant=BIG,
        key_id=BIG,
        sandbox_id=BIG,
        detail=detail,
    )
    (row,) = store.list_audit(None, None, None, None, 10)
    for name, most in AUDIT_FIELD_LENGTHS.items():
        assert len(row[name]) == most, name
    stored = row["detail"]
    assert len(json.dumps(stored)) <= DETAIL_MAX_BYTES
    assert stored["n"] == 7
    assert stored["path"].startswith("/workspace/xxx") and stored["path"].endswith("…")


def test_small_details_are_kept_as_they_are() -> None:
    detail = {"cmd": "echo hi", "exit_code": 0, "timed_out": False, "envs": ["A", "B"]}
    assert clip_detail(detail) == detail
    assert clip_detail(None) is None


def test_a_detail_that_cannot_fit_still_stores_json() -> None:
    huge = {f"key-{i}-{'k' * 200}": "v" for i in range(64)}
    clipped = clip_detail(huge)
    assert clipped is not None and len(json.dumps(clipped)) <= DETAIL_MAX_BYTES


# ---------------------------------------------------------------------------- retention and caps


def test_trim_removes_old_rows_and_rows_past_the_cap(store: Store) -> None:
    now = time.time()
    old = now - 40 * 86_400
    store.add_egress_events([_egress(i, time=old if i < 30 else now) for i in range(100)])
    for i in range(100):
        store.add_audit(time=old if i < 30 else now, action="file.read", detail={"i": i})
    assert store.log_rows() == {"audit": 100, "egress_log": 100}
    removed = store.trim_logs(now - 30 * 86_400, max_rows=1000, batch=7)
    assert removed == 60
    assert store.log_rows() == {"audit": 70, "egress_log": 70}
    store.trim_logs(0, max_rows=10, batch=7)
    assert store.log_rows() == {"audit": 10, "egress_log": 10}
    kept = store.list_audit(None, None, None, None, 100)
    assert sorted(r["detail"]["i"] for r in kept) == list(range(90, 100))  # the newest


def test_trim_gives_the_space_back(tmp_path: Path) -> None:
    store = Store.for_data_dir(tmp_path)
    with store.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA auto_vacuum").scalar() == 2  # incremental
    for _ in range(20):
        store.add_egress_events([_egress(i, reason="r" * 1000) for i in range(500)])
    store.trim_logs(0, max_rows=0)
    with store.engine.connect() as c:
        c.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        free = c.exec_driver_sql("PRAGMA freelist_count").scalar()
        pages = c.exec_driver_sql("PRAGMA page_count").scalar()
    assert free == 0
    assert pages is not None and pages < 100  # ~10 MB of rows were written


def test_the_keeper_trims_at_start(store: Store) -> None:
    store.add_egress_events([_egress(i) for i in range(50)])

    async def main() -> None:
        keeper = LogKeeper(store, LogLimits(max_rows=5, trim_interval_s=3600))
        keeper.start()
        for _ in range(100):
            if store.log_rows()["egress_log"] == 5:
                break
            await asyncio.sleep(0.02)
        await keeper.stop()

    asyncio.run(main())
    assert store.log_rows()["egress_log"] == 5


# ---------------------------------------------------------------------------- refusal sampling


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_sampler_writes_the_first_refusals_and_counts_the_rest() -> None:
    clock = _Clock()
    s = RefusalSampler(LogLimits(refused_sampled=20, refused_window_s=60), clock)
    admitted = sum(s.admit(_egress(i)) for i in range(5000))
    assert admitted == 20
    assert all(s.admit(_egress(i, allowed=True)) for i in range(100))  # allowed: all written
    (tally,) = s.changed()
    assert tally.count == 4980 and tally.row["suppressed"] == 0 and tally.row_id is None
    tally.written = tally.count
    assert s.changed() == []
    clock.now += 61  # a new window: a few in full again, then a new summary
    assert sum(s.admit(_egress(i)) for i in range(30)) == 20
    changed = s.changed()
    assert [t.count for t in changed] == [10]


def test_sampler_bounds_summaries_per_window() -> None:
    s = RefusalSampler(LogLimits(refused_sampled=0, refused_rules=4), _Clock())
    for i in range(1000):
        assert not s.admit(_egress(i, rule=f"rule {i}"))
    changed = s.changed()
    assert len(changed) == 5  # four rules of their own, the rest together
    assert sorted(t.count for t in changed) == [1, 1, 1, 1, 996]


def test_5000_refusals_of_a_sandbox_make_a_few_rows_and_a_count(
    store: Store, tmp_path: Path
) -> None:
    async def main() -> None:
        net = NetworkService(store, tmp_path, NetworkSettings(), LogLimits(refused_sampled=20))
        for i in range(5000):
            net._record(_egress(i))
        net._record(_egress(0, allowed=True, sandbox_id="other"))
        net.flush()
        for i in range(100):  # the summary row is updated, not repeated
            net._record(_egress(i))
        events = net.egress_events(None, None, None, None, None, 10_000)
        await net.close()
        assert len(events) == 22
        (summary,) = [e for e in events if e["suppressed"]]
        assert summary["suppressed"] == 5080 and summary["allowed"] is False
        assert summary["rule"] == "default: no rule allows it"

    asyncio.run(main())


# ---------------------------------------------------------------------------- proxy budgets


class _Proxied:
    """An egress proxy serving sandboxes on loopback listeners, and an upstream that holds
    every connection open."""

    def __init__(self, per_sandbox: int, per_tenant: int) -> None:
        self.events: list[dict[str, Any]] = []
        self.proxy = EgressProxy(
            guard=AddressGuard(("127.0.0.0/8",)),
            record=self.events.append,
            conns_per_sandbox=per_sandbox,
            conns_per_tenant=per_tenant,
        )
        self.ports: dict[str, dict[int, int]] = {}

    async def upstream(self) -> int:
        async def hold(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.read()
            w.close()

        self._up = await asyncio.start_server(hold, "127.0.0.1", 0)
        return int(self._up.sockets[0].getsockname()[1])

    async def attach(self, sid: str, tenant: str) -> None:
        listeners = {}
        for port in (HTTP_PORT, SOCKS_PORT):
            sock = socket.create_server(("127.0.0.1", 0))
            sock.setblocking(False)
            listeners[port] = sock
        self.ports[sid] = {p: s.getsockname()[1] for p, s in listeners.items()}
        policy = EgressPolicy.from_dict({"allow_out": ["127.0.0.1"]})
        await self.proxy.attach(sid, tenant, policy, listeners)

    async def connect(self, sid: str, up: int) -> tuple[bytes, asyncio.StreamWriter]:
        r, w = await asyncio.open_connection("127.0.0.1", self.ports[sid][HTTP_PORT])
        w.write(f"CONNECT 127.0.0.1:{up} HTTP/1.1\r\nHost: 127.0.0.1:{up}\r\n\r\n".encode())
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
        if not head.startswith(b"HTTP/1.1 200"):
            head += await asyncio.wait_for(r.read(), 5)
        return head, w

    async def socks(self, sid: str, up: int) -> bytes:
        r, w = await asyncio.open_connection("127.0.0.1", self.ports[sid][SOCKS_PORT])
        w.write(b"\x05\x01\x00" + b"\x05\x01\x00\x01" + socket.inet_aton("127.0.0.1"))
        w.write(up.to_bytes(2, "big"))
        reply = await asyncio.wait_for(r.readexactly(12), 5)
        w.close()
        return reply[2:]

    async def close(self) -> None:
        await self.proxy.close()
        self._up.close()


def test_a_sandbox_past_its_connection_cap_is_answered_503_with_why() -> None:
    async def main() -> None:
        p = _Proxied(per_sandbox=4, per_tenant=100)
        up = await p.upstream()
        await p.attach("sbx-a", "t")
        held = [await p.connect("sbx-a", up) for _ in range(4)]
        assert all(head.startswith(b"HTTP/1.1 200") for head, _ in held)
        head, w = await p.connect("sbx-a", up)
        assert head.startswith(b"HTTP/1.1 503"), head
        assert b"connection_limit" in head and b"sandbox sbx-a has 4 egress connections" in head
        w.close()
        assert (await p.socks("sbx-a", up))[:2] == b"\x05\x01"  # SOCKS: general failure
        refused = [e for e in p.events if e["rule"] == "connection_limit"]
        assert len(refused) == 2 and not refused[0]["allowed"]
        for _, w in held[:2]:  # freed slots are usable again
            w.close()
        await asyncio.sleep(0.1)
        head, w = await p.connect("sbx-a", up)
        assert head.startswith(b"HTTP/1.1 200"), head
        await p.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_tenants_sandboxes_share_the_tenant_cap() -> None:
    async def main() -> None:
        p = _Proxied(per_sandbox=4, per_tenant=6)
        up = await p.upstream()
        for sid, tenant in (("sbx-a", "t"), ("sbx-b", "t"), ("sbx-c", "u")):
            await p.attach(sid, tenant)
        held = [await p.connect("sbx-a", up) for _ in range(4)]
        held += [await p.connect("sbx-b", up) for _ in range(2)]
        assert all(head.startswith(b"HTTP/1.1 200") for head, _ in held)
        head, _ = await p.connect("sbx-b", up)
        assert head.startswith(b"HTTP/1.1 503") and b"tenant t have 6" in head, head
        head, _ = await p.connect("sbx-c", up)  # another tenant is not affected
        assert head.startswith(b"HTTP/1.1 200"), head
        await p.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_connections_past_the_cap_are_bounded_even_when_silent() -> None:
    async def main() -> None:
        p = _Proxied(per_sandbox=2, per_tenant=100)
        up = await p.upstream()
        await p.attach("sbx-a", "t")
        held = [await p.connect("sbx-a", up) for _ in range(2)]
        silent = []
        for _ in range(50):  # they never send a request
            silent.append(await asyncio.open_connection("127.0.0.1", p.ports["sbx-a"][HTTP_PORT]))
        await asyncio.sleep(0.3)
        sbx = p.proxy.sandboxes["sbx-a"]
        assert len(sbx.conns) == 2 and len(sbx.busy) <= 8
        for _, w in silent:
            w.close()
        for _, w in held:
            w.close()
        await p.close()

    asyncio.run(asyncio.wait_for(main(), 30))
