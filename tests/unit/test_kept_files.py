"""Reading a kept workspace on the host: its files are the sandbox's, so hostile trees (symlinks
out of it, FIFOs, sockets, `..`) must never make the server read anything else or hang."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from agentbox.core.errors import AgentboxError
from agentbox.core.workspaces import open_confined, workspace_parts
from agentbox.vocab import status_of


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    ws = tmp_path / "workspace"
    (ws / "d" / "e").mkdir(parents=True)
    (ws / "d" / "e" / "ok.txt").write_text("fine")
    (ws / "to-secret").symlink_to(secret)
    (ws / "to-etc").symlink_to("/etc")
    (ws / "to-d").symlink_to("d")
    (ws / "d" / "up").symlink_to("../..")
    os.mkfifo(ws / "fifo")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(ws / "sock"))
    s.close()
    return ws


def _read(root: Path, path: str) -> bytes:
    fd, size = open_confined(root, workspace_parts(path))
    try:
        return os.read(fd, size + 1)
    finally:
        os.close(fd)


def _code(root: Path, path: str) -> str:
    with pytest.raises(AgentboxError) as e:
        _read(root, path)
    assert status_of(e.value.code) < 500
    return e.value.code


def test_regular_files_are_read(hostile: Path) -> None:
    assert _read(hostile, "d/e/ok.txt") == b"fine"
    assert _read(hostile, "/workspace/d/e/ok.txt") == b"fine"
    assert _read(hostile, "./d//e/./ok.txt") == b"fine"


def test_symlinks_are_never_followed(hostile: Path) -> None:
    for path in ("to-secret", "to-etc/passwd", "to-d/e/ok.txt", "d/up/secret.txt"):
        assert _code(hostile, path) == "symlink_refused", path
    with pytest.raises(AgentboxError) as e:
        _read(hostile, "to-etc/passwd")
    assert e.value.detail["link"] == "/workspace/to-etc" and e.value.detail["target"] == "/etc"


def test_paths_stay_in_the_workspace(hostile: Path) -> None:
    for path in ("../secret.txt", "d/../../secret.txt", "/etc/passwd", "/workspacex/a", ""):
        assert _code(hostile, path) == "invalid_path", path
    assert _code(hostile, "a\0b") == "invalid_path"
    assert _code(hostile, "x" * 5000) == "invalid_path"
    assert _code(hostile, "/workspace") == "is_a_directory"


def test_only_regular_files_are_opened(hostile: Path) -> None:
    t0 = time.monotonic()
    assert _code(hostile, "fifo") == "not_a_regular_file"  # and no hang on a writer
    assert time.monotonic() - t0 < 1
    assert _code(hostile, "sock") == "not_a_regular_file"
    assert _code(hostile, "d") == "is_a_directory"
    assert _code(hostile, "nope") == "path_not_found"
    assert _code(hostile, "d/e/ok.txt/x") == "not_a_directory"


def test_descriptors_do_not_leak(hostile: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    for path in ("to-secret", "fifo", "nope", "d", "d/e/ok.txt"):
        try:
            _read(hostile, path)
        except AgentboxError:
            pass
    assert len(os.listdir("/proc/self/fd")) == before
