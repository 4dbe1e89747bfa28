"""Snapshots and forks through the SDK, both faces, against the session's server (the API's
own edges are in test_snapshots.py): snapshot a sandbox, start sandboxes from the snapshot by
name and by id, fork it, list, get and delete snapshots, on the class and on a sandbox."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from agentbox.sdk import AsyncSandbox, NotFoundError, Sandbox, SnapshotInfo

pytestmark = pytest.mark.timeout(240)

NOTE = "/workspace/note.txt"


def test_snapshot_start_from_it_fork_and_delete(conn: dict[str, Any]) -> None:
    made: list[Sandbox] = []
    try:
        parent = Sandbox.create(timeout=120, **conn)
        made.append(parent)
        assert parent.get_info().origin is None
        parent.files.write(NOTE, "at the snapshot")
        snap = parent.create_snapshot(name="sdk-snap", metadata={"k": "v"})
        assert isinstance(snap, SnapshotInfo) and snap.snapshot_id.startswith("snap_")
        assert (snap.name, snap.metadata) == ("sdk-snap", {"k": "v"})
        assert snap.sandbox_id == parent.sandbox_id
        assert snap.runtime == parent.get_info().runtime and snap.template
        assert snap.created_at is not None and snap.disk_mb > 0 and snap.used_bytes > 0
        parent.files.write(NOTE, "after the snapshot")  # the snapshot keeps what it copied

        # A tenant's live sandboxes share a descriptor quota (about four default ones): the
        # first child goes before the fork's two come.
        for ref in ("sdk-snap", snap.snapshot_id):
            child = Sandbox.create(template=ref, timeout=60, **conn)
            made.append(child)
            assert child.files.read(NOTE) == "at the snapshot", ref
            assert child.get_info().origin == {"snapshot": snap.snapshot_id}
        made[1].kill()

        kids = parent.fork(count=2, timeout=60)
        made += kids
        assert all(isinstance(k, Sandbox) for k in kids)
        assert len({parent.sandbox_id, *(k.sandbox_id for k in kids)}) == 3
        for kid in kids:
            assert kid.files.read(NOTE) == "after the snapshot"
            info = kid.get_info()
            assert info.state == "running" and info.origin == {"fork_of": parent.sandbox_id}
        kids[0].files.write(NOTE, "the first child's")  # each is its own from then on
        assert kids[1].files.read(NOTE) == "after the snapshot"
        assert parent.files.read(NOTE) == "after the snapshot"

        # On the class with connection arguments, or on a sandbox with its connection.
        assert [s.snapshot_id for s in Sandbox.list_snapshots(**conn)] == [snap.snapshot_id]
        assert [s.snapshot_id for s in kids[0].list_snapshots()] == [snap.snapshot_id]
        assert Sandbox.get_snapshot("sdk-snap", **conn).snapshot_id == snap.snapshot_id
        assert parent.get_snapshot(snap.snapshot_id).name == "sdk-snap"
        Sandbox.delete_snapshot("sdk-snap", **conn)
        assert Sandbox.list_snapshots(**conn) == []
        assert made[2].files.read(NOTE) == "at the snapshot"  # a sandbox from it keeps its copy
        with pytest.raises(NotFoundError):
            Sandbox.get_snapshot(snap.snapshot_id, **conn)
        with pytest.raises(NotFoundError):
            parent.delete_snapshot("sdk-snap")
    finally:
        for sbx in made:
            with contextlib.suppress(Exception):
                sbx.kill()
            sbx.close()


def test_the_async_face(conn: dict[str, Any]) -> None:
    async def flow() -> None:
        made: list[AsyncSandbox] = []
        try:
            parent = await AsyncSandbox.create(timeout=120, **conn)
            made.append(parent)
            await parent.files.write(NOTE, "async")
            snap = await parent.create_snapshot()
            assert snap.name is None and snap.sandbox_id == parent.sandbox_id
            await parent.create_snapshot(name="async-snap")

            child = await AsyncSandbox.create(template=snap.snapshot_id, timeout=60, **conn)
            made.append(child)
            named = await AsyncSandbox.create(template="async-snap", timeout=60, **conn)
            made.append(named)
            for sbx in (child, named):
                assert await sbx.files.read(NOTE) == "async"
                await sbx.kill()  # room for the fork's two in the tenant's descriptor quota

            kids = await parent.fork(count=2)
            made += kids
            assert all(isinstance(k, AsyncSandbox) for k in kids)
            assert len({parent.sandbox_id, *(k.sandbox_id for k in kids)}) == 3
            for kid in kids:
                assert await kid.files.read(NOTE) == "async"
                assert (await kid.get_info()).origin == {"fork_of": parent.sandbox_id}

            listed = await AsyncSandbox.list_snapshots(**conn)
            assert [s.name for s in listed] == [None, "async-snap"]
            assert [s.snapshot_id for s in await parent.list_snapshots()] == [
                s.snapshot_id for s in listed
            ]
            got = await AsyncSandbox.get_snapshot("async-snap", **conn)
            assert got.snapshot_id == listed[1].snapshot_id
            assert (await kids[0].get_snapshot(snap.snapshot_id)).sandbox_id == parent.sandbox_id
            await AsyncSandbox.delete_snapshot(snap.snapshot_id, **conn)
            await parent.delete_snapshot("async-snap")
            assert await AsyncSandbox.list_snapshots(**conn) == []
            with pytest.raises(NotFoundError):
                await AsyncSandbox.get_snapshot("async-snap", **conn)
            with pytest.raises(NotFoundError):
                await AsyncSandbox.delete_snapshot("snap_0000000000000000", **conn)
        finally:
            for sbx in made:
                with contextlib.suppress(Exception):
                    await sbx.kill()
                await sbx.close()

    asyncio.run(flow())
