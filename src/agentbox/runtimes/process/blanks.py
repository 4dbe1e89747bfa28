"""Blank workspace disks made ahead (issue 19: mkfs off the create path).

A sandbox's disk is a sparse image file formatted ext4 (workspace.py); mkfs.ext4 takes ~3 ms of
a ~20 ms start. A few blank images per recently asked size wait in a private directory of the
runtime's, each formatted on its own (its own filesystem UUID and directory hash seed: nothing
is shared between two sandboxes' disks) and never used twice: a create moves one into its
sandbox's directory (a rename, the same filesystem) and a worker thread formats the next. The
filesystem's root is root-owned, as the disk of a template's root layer wants it; a disk that
is the workspace itself is given to the sandbox's uid after the mount, as a fresh one is.

Bounded: at most SIZES sizes (the most recently asked) of PER_SIZE images each, ~150 KiB of
real blocks an image whatever its size. What a crash left is removed when the runtime starts;
close() removes what is left. A format that fails stops the pool for that size (the create
then formats inline and says why, as without a pool)."""

from __future__ import annotations

import logging
import secrets
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

PER_SIZE = 2
SIZES = 2


def format_blank(image: Path, disk_mb: int, owner: str, run: Callable[[list[str]], object]) -> None:
    """A sparse `disk_mb` MiB image at `image`, formatted ext4, its root owned by `owner`."""
    with open(image, "wb") as f:
        f.truncate(disk_mb * 1024 * 1024)
    mkfs = ["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal,^resize_inode"]
    run([*mkfs, "-E", f"lazy_itable_init=1,root_owner={owner}", str(image)])


class BlankDisks:
    """`take(disk_mb)`: a blank image of that size, the caller's to rename, or None (none
    ready: the caller formats its own). `make(path, disk_mb)` formats one (format_blank)."""

    def __init__(self, directory: Path, make: Callable[[Path, int], None]) -> None:
        self.directory = directory
        self._make = make
        shutil.rmtree(directory, ignore_errors=True)  # a previous server's, never trusted
        directory.mkdir(mode=0o700)
        self._lock = threading.Condition()
        self._ready: dict[int, list[Path]] = {}
        self._wanted: list[int] = []  # most recent first, at most SIZES
        self._failed: set[int] = set()
        self._closed = False
        self._worker: threading.Thread | None = None

    def take(self, disk_mb: int) -> Path | None:
        with self._lock:
            if self._closed:
                return None
            if disk_mb in self._wanted:
                self._wanted.remove(disk_mb)
            self._wanted.insert(0, disk_mb)
            for dropped in self._wanted[SIZES:]:
                for path in self._ready.pop(dropped, []):
                    path.unlink(missing_ok=True)
            del self._wanted[SIZES:]
            ready = self._ready.get(disk_mb)
            image = ready.pop() if ready else None
            if self._worker is None:
                self._worker = threading.Thread(target=self._fill, name="blank-disks", daemon=True)
                self._worker.start()
            self._lock.notify()
            return image

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
            worker = self._worker
        if worker is not None:
            worker.join(timeout=30)
        shutil.rmtree(self.directory, ignore_errors=True)

    def count(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._ready.values())

    def _next_size(self) -> int | None:
        for size in self._wanted:
            if size not in self._failed and len(self._ready.get(size, [])) < PER_SIZE:
                return size
        return None

    def _fill(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (size := self._next_size()) is None:
                    self._lock.wait()
                if self._closed:
                    return
            assert size is not None
            path = self.directory / f"{size}-{secrets.token_hex(8)}.img"
            try:
                self._make(path, size)
            except Exception as e:  # noqa: BLE001  (any: creates format their own)
                log.warning("blank %d MiB disks are not made ahead: %s", size, e)
                path.unlink(missing_ok=True)
                with self._lock:
                    self._failed.add(size)
                continue
            with self._lock:
                if self._closed or size not in self._wanted:
                    path.unlink(missing_ok=True)
                    continue
                self._ready.setdefault(size, []).append(path)
