"""The host-wide uid allocator (runtimes/uids.py): blocks of 65,536 ids that no two sandboxes of
any server share, released only by their owner, found again after a crash."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentbox.runtimes import uids
from agentbox.runtimes.uids import BLOCK, POOL, NoFreeUid, UidLeases


def test_blocks_are_aligned_whole_and_never_shared(tmp_path: Path) -> None:
    a, b = UidLeases("server-a", tmp_path), UidLeases("server-b", tmp_path)
    taken = [a.take(f"sbx_a{i}") for i in range(50)] + [b.take(f"sbx_b{i}") for i in range(50)]
    assert len(set(taken)) == 100
    for base in taken:
        assert base % BLOCK == 0 and POOL[0] <= base and base + BLOCK <= POOL[1]
    assert sorted(a.held().values()) == sorted(f"sbx_a{i}" for i in range(50))


def test_a_full_pool_says_so(tmp_path: Path) -> None:
    tiny = UidLeases("server-a", tmp_path, pool=(BLOCK, 3 * BLOCK))
    assert {tiny.take("sbx_1"), tiny.take("sbx_2")} == {BLOCK, 2 * BLOCK}
    with pytest.raises(NoFreeUid):
        tiny.take("sbx_3")
    tiny.release("sbx_1")  # by scanning: the base is not given
    assert tiny.take("sbx_3") in (BLOCK, 2 * BLOCK)


def test_release_touches_only_the_owners_lease(tmp_path: Path) -> None:
    a, b = UidLeases("server-a", tmp_path), UidLeases("server-b", tmp_path)
    base = b.take("sbx_1")
    a.release("sbx_1", base)  # another server's sandbox of the same id: not ours
    assert b.held() == {base: "sbx_1"}
    b.release("sbx_2", base)  # ours, but another sandbox's
    assert b.held() == {base: "sbx_1"}
    b.release("sbx_1", base)
    b.release("sbx_1", base)  # idempotent
    assert b.held() == {} and os.listdir(tmp_path) == []


def test_the_pool_is_whole_blocks() -> None:
    with pytest.raises(ValueError, match="blocks"):
        UidLeases("x", Path("/nonexistent"), pool=(100, 200_000))
    with pytest.raises(ValueError, match="path component"):
        UidLeases("a/b", Path("/nonexistent"))
    assert uids.UID_RANGE == POOL
