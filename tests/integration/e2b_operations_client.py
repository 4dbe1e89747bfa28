"""Run inside a virtual environment with a stock `e2b` SDK from PyPI (test_e2b.py makes one per
SDK line), pointed at an agentbox server by E2B's environment variables only:

    python e2b_operations_client.py SCENARIO

E2B's control plane beyond create and kill: metrics, snapshots, fork, network updates. Like
e2b_client.py: one `ok <step>` line per step passed, a non-zero exit on the first failure.
"""

from __future__ import annotations

import os
import sys
import time

import httpx
from e2b import Sandbox
from e2b.exceptions import SandboxException

TEMPLATE = os.environ.get("E2B_TEST_TEMPLATE", "host")


def ok(step: str) -> None:
    print(f"ok {step}", flush=True)


def operations() -> None:
    sbx = Sandbox.create(TEMPLATE, timeout=300)
    made: list[Sandbox] = []
    try:
        sbx.files.write("/workspace/state.txt", "parent's")
        deadline = time.monotonic() + 60
        samples = sbx.get_metrics()
        while not samples and time.monotonic() < deadline:  # sampled every few seconds
            time.sleep(1)
            samples = sbx.get_metrics()
        assert samples, "no metrics within a minute"
        last = samples[-1]
        assert last.cpu_count >= 1 and last.mem_total > 0 and last.disk_total > 0, last
        assert 0 < last.mem_used <= last.mem_total and last.timestamp.tzinfo, last
        ok("metrics")

        snap = sbx.create_snapshot(name="e2b-snap")
        assert snap.snapshot_id.startswith("snap_") and snap.names == ["e2b-snap"], snap
        listed = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()
        assert [s.snapshot_id for s in listed] == [snap.snapshot_id], listed
        assert Sandbox.list_snapshots(sandbox_id="sbx_0000000000000000").next_items() == []
        # Paging: one a page, newest first, through the SDK's paginator (x-next-token).
        second = sbx.create_snapshot()
        pager, paged = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id, limit=1), []
        while pager.has_next:
            paged.append([s.snapshot_id for s in pager.next_items()])
        assert paged == [[second.snapshot_id], [snap.snapshot_id]], paged
        assert Sandbox.delete_snapshot(second.snapshot_id) is True
        sbx.files.write("/workspace/state.txt", "changed after the snapshot")
        child = Sandbox.create(snap.snapshot_id, timeout=120)
        made.append(child)
        assert child.files.read("/workspace/state.txt") == "parent's"
        ok("snapshot")

        forks = sbx.fork(count=2, timeout=120)
        assert len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks), forks
        made += [f for f in forks if isinstance(f, Sandbox)]
        one, two = made[-2:]
        assert len({one.sandbox_id, two.sandbox_id, sbx.sandbox_id}) == 3
        assert one.files.read("/workspace/state.txt") == "changed after the snapshot"
        one.files.write("/workspace/state.txt", "the fork's own")
        assert two.commands.run("cat /workspace/state.txt").stdout == "changed after the snapshot"
        assert sbx.files.read("/workspace/state.txt") == "changed after the snapshot"
        ok("fork")

        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False  # gone: E2B's 404
        assert Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items() == []
        ok("delete_snapshot")

        api = os.environ["E2B_API_URL"]
        key = {"X-API-Key": os.environ["E2B_API_KEY"]}  # an agentbox key: /v1 shows the policy

        def network() -> dict:
            return httpx.get(f"{api}/v1/sandboxes/{sbx.sandbox_id}", headers=key).json()["network"]

        sbx.update_network({"allow_out": ["example.com", "10.9.8.7"], "deny_out": ["10.9.8.7"]})
        net = network()
        assert net["allow_out"] == ["example.com", "10.9.8.7"] and net["deny_out"] == [], net
        assert net["allow_internet_access"] is False, net
        sbx.update_network({})  # everything cleared: the tenant's default, no egress
        net = network()
        assert net["allow_out"] == [] and net["allow_internet_access"] is False, net
        e2b_key = {"X-API-KEY": os.environ["E2B_API_KEY"]}  # what agentbox cannot do: refused
        url = f"{api}/sandboxes/{sbx.sandbox_id}/network"
        r = httpx.put(url, json={"dnsServers": ["1.1.1.1"]}, headers=e2b_key)
        assert r.status_code == 400 and "dnsServers" in r.json()["message"], r.text
        try:
            Sandbox.update_network("sbx_0000000000000000", {"allow_out": ["example.com"]})
        except SandboxException as e:
            assert "not found" in str(e), e
        else:
            raise AssertionError("an unknown sandbox's network was updated")
        ok("update_network")
    finally:
        for s in made:
            s.kill()
        sbx.kill()


if __name__ == "__main__":
    {"operations": operations}[sys.argv[1]]()
