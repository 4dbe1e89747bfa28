"""Blank disks made ahead (runtimes/process/blanks.py): bounded per size and in sizes, each
used once, a failing format stops only its size, nothing left after close or from a crash."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agentbox.runtimes.process import blanks
from agentbox.runtimes.process.blanks import PER_SIZE, SIZES, BlankDisks


def _wait(pred, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class _Maker:
    def __init__(self, fail: set[int] = frozenset()) -> None:
        self.fail = set(fail)
        self.made: list[tuple[Path, int]] = []
        self.lock = threading.Lock()

    def __call__(self, path: Path, size: int) -> None:
        if size in self.fail:
            raise OSError(f"no {size}")
        path.write_bytes(b"x" * size)
        with self.lock:
            self.made.append((path, size))


def test_a_size_asked_is_made_ahead_and_each_image_is_taken_once(tmp_path: Path) -> None:
    make = _Maker()
    pool = BlankDisks(tmp_path / "blank", make)
    try:
        assert pool.take(64) is None  # none yet: the caller formats its own
        _wait(lambda: pool.count() == PER_SIZE)
        taken = [pool.take(64) for _ in range(PER_SIZE)]
        assert all(p is not None and p.read_bytes() == b"x" * 64 for p in taken)
        assert len(set(taken)) == PER_SIZE
        _wait(lambda: pool.count() == PER_SIZE)  # refilled, with new files
        assert not {p for p, _ in make.made[-PER_SIZE:]} & set(taken)
    finally:
        pool.close()
    assert not (tmp_path / "blank").exists()


def test_only_the_most_recent_sizes_are_kept(tmp_path: Path) -> None:
    pool = BlankDisks(tmp_path / "blank", _Maker())
    try:
        for size in range(1, SIZES + 3):
            pool.take(size)
            want = PER_SIZE * min(size, SIZES)
            _wait(lambda want=want: pool.count() == want)
        files = sorted(p.name.split("-")[0] for p in (tmp_path / "blank").iterdir())
        assert len(files) == PER_SIZE * SIZES, files
        assert set(files) == {str(s) for s in range(3, SIZES + 3)}, files
    finally:
        pool.close()


def test_a_size_that_fails_to_format_is_not_retried(tmp_path: Path) -> None:
    make = _Maker(fail={13})
    pool = BlankDisks(tmp_path / "blank", make)
    try:
        assert pool.take(13) is None
        pool.take(64)
        _wait(lambda: pool.count() == PER_SIZE)  # the other size still works
        time.sleep(0.1)
        assert pool.take(13) is None
        assert all(size == 64 for _, size in make.made)
        assert not [p for p in (tmp_path / "blank").iterdir() if p.name.startswith("13-")]
    finally:
        pool.close()


def test_what_a_previous_server_left_is_removed(tmp_path: Path) -> None:
    stale = tmp_path / "blank"
    stale.mkdir()
    (stale / "64-0000.img").write_bytes(b"a tenant's? never trusted")
    pool = BlankDisks(stale, _Maker())
    try:
        assert list(stale.iterdir()) == []
        assert stale.stat().st_mode & 0o777 == 0o700
    finally:
        pool.close()


@pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="needs mkfs.ext4")
def test_real_blanks_are_each_their_own_filesystem(tmp_path: Path) -> None:
    def make(path: Path, size: int) -> None:
        blanks.format_blank(path, size, "0:0", lambda argv: subprocess.run(argv, check=True))

    pool = BlankDisks(tmp_path / "blank", make)
    try:
        pool.take(16)
        _wait(lambda: pool.count() == PER_SIZE)
        images = [pool.take(16) for _ in range(PER_SIZE)]
        uuids, seeds = set(), set()
        for image in images:
            assert image is not None and image.stat().st_size == 16 << 20
            info = subprocess.run(
                ["dumpe2fs", "-h", str(image)], capture_output=True, text=True, check=True
            ).stdout
            fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
            uuids.add(fields["Filesystem UUID"].strip())
            seeds.add(fields["Directory Hash Seed"].strip())
        assert len(uuids) == len(seeds) == PER_SIZE
    finally:
        pool.close()
