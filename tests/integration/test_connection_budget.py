"""The real server against anonymous clients: descriptor limit, auth before body, body caps,
slow headers and a connection budget that always leaves room for newcomers."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ServerHandle, start_server

pytestmark = pytest.mark.security


def _answer(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_the_server_raises_its_descriptor_limit(server: ServerHandle) -> None:
    assert server.proc is not None
    limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
    line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    assert soft == hard, line


def test_anonymous_bodies_are_never_read(server: ServerHandle) -> None:
    port = server.port
    for extra in ("", "X-API-Key: not-a-key\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(
                f"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\n{extra}"
                "Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n".encode()
            )
            t0 = time.monotonic()
            answer = _answer(s)
            assert time.monotonic() - t0 < 2
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        assert b'"code":"unauthorized"' in answer.replace(b" ", b"")


def test_json_bodies_are_capped_with_a_clear_413(server: ServerHandle) -> None:
    with server.client() as c:
        r = c.post(
            "/v1/sandboxes",
            content=b'{"metadata": {"x": "' + b"a" * (9 * 2**20) + b'"}}',
            headers={"content-type": "application/json"},
        )
    assert r.status_code == 413
    body = r.json()
    assert body["code"] == "body_too_large" and body["detail"]["limit"] == 8 * 2**20


@pytest.fixture
def small_server(tmp_path: Path) -> Iterator[ServerHandle]:
    handle = start_server(tmp_path, ["--max-connections", "256"])
    try:
        yield handle
    finally:
        handle.stop()


def test_slow_anonymous_connections_cannot_lock_others_out(small_server: ServerHandle) -> None:
    """Thousands of slowloris connections, eight times the connection budget: health and admin
    calls are still answered at once, and the slow connections are dropped."""
    slow: list[socket.socket] = []
    try:
        for _ in range(2048):
            s = socket.create_connection(("127.0.0.1", small_server.port), timeout=5)
            s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            slow.append(s)
        with httpx.Client(base_url=small_server.url, timeout=5) as anon:
            t0 = time.monotonic()
            assert anon.get("/v1/health").status_code == 200
        with small_server.client() as admin:
            assert admin.get("/v1/keys").status_code == 200
            assert admin.get("/v1/sandboxes").status_code == 200
        assert time.monotonic() - t0 < 2
        alive = 0
        for s in slow:
            s.settimeout(0.01)
            try:
                alive += s.recv(1) != b""
            except TimeoutError:
                alive += 1
            except OSError:
                pass
        assert alive <= 128, f"{alive} slow connections still open"  # the anonymous share
    finally:
        for s in slow:
            s.close()


def test_slow_headers_time_out(server: ServerHandle) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
        s.sendall(b"GET /v1/health HTTP/1.1\r\n")
        t0 = time.monotonic()
        try:
            assert s.recv(65536) == b""
        except ConnectionResetError:
            pass
        assert 9 < time.monotonic() - t0 < 14
