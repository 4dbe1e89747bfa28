"""workspace.reown: a disk started from again gets its files moved to the new sandbox's uids,
however deep its tree, without following a symlink out of it."""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import pytest

from agentbox.runtimes.process.workspace import reown
from agentbox.runtimes.uids import BLOCK, UID_RANGE

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")

OLD = UID_RANGE[0] + 3 * BLOCK
NEW = UID_RANGE[0] + 7 * BLOCK


def _deep(root: Path, depth: int, name: str) -> int:
    """`depth` nested directories named `name` (made by descriptor: the path is longer than
    PATH_MAX), each owned by OLD + 1000, with a set-gid file at the bottom; the bottom's fd."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir(name, dir_fd=fd)
        os.chown(name, OLD + 1000, OLD + 1000, dir_fd=fd)
        nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    f = os.open("f", os.O_WRONLY | os.O_CREAT, 0o2755, dir_fd=fd)
    os.fchown(f, OLD + 1000, OLD + 1000)
    os.fchmod(f, 0o2755)
    os.close(f)
    return fd


def test_a_tree_deeper_than_a_path_is_moved(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    root.mkdir()
    os.chown(root, OLD, OLD)
    bottom = _deep(root, 90, "d" * 60)  # ~5,500 bytes of path: past PATH_MAX (4,096)
    outside = tmp_path / "outside"
    outside.write_text("host")
    os.chown(outside, OLD + 1000, OLD + 1000)
    os.symlink(outside, root / "link")
    os.lchown(root / "link", OLD + 1000, OLD + 1000)
    try:
        changed = reown(root, OLD, NEW, BLOCK)
        st = os.stat("f", dir_fd=bottom)
        assert (st.st_uid, st.st_gid) == (NEW + 1000, NEW + 1000)
        assert stat.S_IMODE(st.st_mode) == 0o2755  # the set-gid bit a chown clears is back
        assert os.stat(".", dir_fd=bottom).st_uid == NEW + 1000
    finally:
        os.close(bottom)
    assert changed == 90 + 1 + 1 + 1  # the directories, the file, the link, the root
    assert root.stat().st_uid == NEW
    assert os.lstat(root / "link").st_uid == NEW + 1000
    assert outside.stat().st_uid == OLD + 1000  # the link's target, outside: untouched
    # Run again (a crash cut the first short): nothing left to move.
    assert reown(root, OLD, NEW, BLOCK) == 0


def _acl(*named: tuple[int, int]) -> bytes:
    """A POSIX ACL xattr: owner, the named (tag, id) entries, group, mask, other."""
    undefined = 0xFFFFFFFF
    entries = [(0x01, 6, undefined), *[(tag, 6, i) for tag, i in named], (0x04, 4, undefined)]
    entries += [(0x10, 6, undefined), (0x20, 4, undefined)]
    entries.sort(key=lambda e: (e[0], e[2]))  # the kernel wants them in tag order
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


def test_acls_and_file_capabilities_move_with_the_files(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    root.mkdir()
    f = root / "tool"
    f.write_text("x")
    os.chown(f, OLD + 1000, OLD + 1000)
    os.setxattr(f, "system.posix_acl_access", _acl((0x02, OLD + 1001), (0x08, OLD + 1002)))
    # CAP_NET_RAW, namespaced: it applies to the sandbox whose root is host uid OLD.
    caps = struct.pack("<IIIIII", 0x03000000 | 1, 1 << 13, 0, 0, 0, OLD)
    os.setxattr(f, "security.capability", caps)
    d = root / "shared"
    d.mkdir()
    os.setxattr(d, "system.posix_acl_default", _acl((0x02, 1234)))  # an id of no sandbox
    reown(root, OLD, NEW, BLOCK)
    assert f.stat().st_uid == NEW + 1000
    assert os.getxattr(f, "system.posix_acl_access") == _acl((0x02, NEW + 1001), (0x08, NEW + 1002))
    # Not dropped by the chown, and now the new sandbox's root's.
    moved = struct.unpack("<IIIIII", os.getxattr(f, "security.capability"))
    assert moved[1] == 1 << 13 and moved[5] == NEW
    assert os.getxattr(d, "system.posix_acl_default") == _acl((0x02, 1234))
    assert reown(root, OLD, NEW, BLOCK) == 0  # nothing left to move
