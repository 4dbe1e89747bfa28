"""Hostile inputs to the agent's path parser (the first fence of the files API)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src/agentbox/agent"))
import sandbox_agent as A  # noqa: E402


@pytest.mark.parametrize(
    ("raw", "parts"),
    [
        ("a.txt", ["workspace", "a.txt"]),
        ("/workspace/x/y", ["workspace", "x", "y"]),
        ("./a//b/.", ["workspace", "a", "b"]),
        ("/tmp", ["tmp"]),
        ("/", []),
    ],
)
def test_accepted_paths(raw: str, parts: list[str]) -> None:
    assert A.parse_path(raw) == parts


@pytest.mark.parametrize(
    "raw",
    [
        "",
        None,
        7,
        "../etc/passwd",
        "/workspace/../../etc/shadow",
        "a/../../b",
        "..",
        "/..",
        "a\x00b",
        "/workspace/\x00",
        "x" * 5000,
    ],
)
def test_refused_paths(raw: object) -> None:
    with pytest.raises(A.OpError) as e:
        A.parse_path(raw)
    assert e.value.reply["code"] == "invalid_path"
    assert e.value.reply["ok"] is False


def test_open_dir_refuses_symlinks(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    parts = [p for p in str(tmp_path).split("/") if p]
    fd = A.open_dir([*parts, "real"])
    A.os.close(fd)
    with pytest.raises(A.OpError) as e:
        A.open_dir([*parts, "link"])
    assert e.value.reply["code"] == "symlink_refused"
    assert e.value.reply["detail"]["target"] == str(tmp_path / "real")


def test_errno_mapping_names_the_violation() -> None:
    import errno

    err = A.os_error(OSError(errno.ENOSPC, "full"), "/workspace/big")
    assert err.reply["code"] == "limit_exceeded"
    assert err.reply["detail"]["violation"]["code"] == "disk_limit"
    ro = A.os_error(OSError(errno.EROFS, "ro"), "/etc/x")
    assert ro.reply["code"] == "read_only_path"
    assert ro.reply["detail"]["violation"]["setting"] == "path"


# ------------------------------------------------------------------ answered, or nobody to answer


def _ask(op, request: dict) -> dict | None:
    """Run one request through serve_one with `op` as its handler; its answer (None: none)."""
    import socket

    A.OPS["test.op"] = op
    try:
        client, served = socket.socketpair()
        client.sendall(A.P.encode_json({"op": "test.op", **request}))
        A.serve_one(served)
        client.settimeout(5)
        head = client.recv(A.P.HEADER.size)
        if not head:
            return None
        _, length = A.P.HEADER.unpack(head)
        body = b""
        while len(body) < length:
            body += client.recv(length - len(body))
        return A.P.decode_json(body)
    finally:
        A.OPS.pop("test.op", None)


def test_an_operations_own_os_error_is_answered_with_its_code() -> None:
    def fails(conn, req) -> None:
        raise PermissionError(13, "Permission denied")

    reply = _ask(fails, {"path": "/workspace/x"})
    assert reply is not None and reply["code"] == "permission_denied", reply
    assert "/workspace/x" in reply["message"], reply

    def fails_oddly(conn, req) -> None:
        raise OSError(5, "Input/output error")

    reply = _ask(fails_oddly, {})
    assert reply is not None and reply["code"] == "io_error", reply


def test_a_lost_connection_is_not_answered_and_does_not_raise() -> None:
    def client_gone(conn, req) -> None:
        raise A.ConnectionLost(104, "Connection reset by peer")

    assert _ask(client_gone, {}) is None
