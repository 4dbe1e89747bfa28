"""The request guard and the guarded HTTP protocol under uvicorn, with small limits: anonymous
bodies never read, capped and stalled bodies, slow headers, the connection budget."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from agentbox.server.limits import RequestGuard, ServerLimits, protocol_class
from agentbox.server.logfilter import RepeatFilter

try:
    from ._asgi_server import serve
except ImportError:
    from _asgi_server import serve  # type: ignore[no-redef]

KEY = "good-key"
LIMITS = ServerLimits(
    json_body=1000,
    header_timeout=1.0,
    body_idle_timeout=1.0,
    max_connections=40,
    anonymous_share=0.5,
)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    api = FastAPI()
    seen: dict[str, int] = {"bodies": 0}

    @api.get("/v1/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, "bodies": seen["bodies"]}

    @api.post("/v1/things")
    async def things(request: Request) -> dict[str, Any]:
        body = await request.body()
        seen["bodies"] += 1
        return {"bytes": len(body), "caller": request.scope.get("agentbox.caller")}

    @api.post("/v1/slow")
    async def slow(request: Request) -> StreamingResponse:
        await request.body()

        async def ticks() -> AsyncIterator[bytes]:
            for i in range(4):  # 2 s: twice the body idle timeout
                await asyncio.sleep(0.5)
                yield f"tick {i}\n".encode()

        return StreamingResponse(ticks())

    @api.put("/v1/sandboxes/sbx_1/files")
    async def upload(request: Request) -> dict[str, int]:
        total = 0
        async for chunk in request.stream():
            total += len(chunk)
        return {"bytes": total}

    app = RequestGuard(
        api,
        authenticate=lambda key: "acme" if key == KEY else None,
        limits=LIMITS,
        open_routes=frozenset({"/v1/health"}),
    )
    with serve(app, http=protocol_class(LIMITS)) as p:
        yield p


def _raw(port: int, data: bytes, timeout: float = 5) -> bytes:
    """Send `data`, return everything the server answers until it closes (or `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        return out


def _request(method: str, path: str, body: bytes = b"", key: str | None = KEY) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    if key is not None:
        head += f"X-API-Key: {key}\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def test_no_key_is_401_before_the_body(port: int) -> None:
    for key in (None, "bad-key"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            head = "POST /v1/things HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n"
            if key:
                head += f"X-API-Key: {key}\r\n"
            s.sendall(head.encode() + b"\r\n")  # and not a byte of the promised body
            t0 = time.monotonic()
            answer = b""
            # The whole answer, then the server hangs up instead of reading (and discarding)
            # the promised body.
            while chunk := s.recv(65536):
                answer += chunk
            assert time.monotonic() - t0 < 1
            assert answer.startswith(b"HTTP/1.1 401"), answer
            assert b"connection: close" in answer.lower()


def test_bodies_are_capped(port: int) -> None:
    answer = _raw(port, _request("POST", "/v1/things", b"x" * 1001))
    assert answer.startswith(b"HTTP/1.1 413") and b'"limit": 1000' in answer, answer
    chunked = (
        b"POST /v1/things HTTP/1.1\r\nHost: x\r\nX-API-Key: good-key\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + b"200\r\n" + b"y" * 512 + b"\r\n"
    ) * 1
    answer = _raw(port, chunked + b"200\r\n" + b"y" * 512 + b"\r\n0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413"), answer
    ok = _raw(port, _request("POST", "/v1/things", b"x" * 1000))
    assert ok.startswith(b"HTTP/1.1 200") and b'"bytes":1000' in ok and b'"acme"' in ok
    # The upload route streams: the JSON cap does not apply to it.
    big = _raw(port, _request("PUT", "/v1/sandboxes/sbx_1/files", b"z" * 100_000))
    assert big.startswith(b"HTTP/1.1 200") and b'"bytes":100000' in big, big[:300]


def test_a_stalled_body_is_408(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(
            b"POST /v1/things HTTP/1.1\r\nHost: x\r\nX-API-Key: good-key\r\n"
            b"Content-Length: 500\r\n\r\n" + b"x" * 10
        )
        t0 = time.monotonic()
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert LIMITS.body_idle_timeout * 0.9 <= time.monotonic() - t0 < LIMITS.body_idle_timeout + 4


def test_a_response_may_outlast_the_body_timeout(port: int) -> None:
    # The stall bound is for the body; after it, the server waits only for the client to
    # leave, and a long command's output must not be cut at the body's idle timeout.
    answer = _raw(port, _request("POST", "/v1/slow", b"{}"), timeout=10)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert b"tick 3" in answer, answer


def test_slow_headers_are_cut_off(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /v1/health HTTP/1.1\r\n")
        for _ in range(10):
            try:
                s.sendall(b"X-a: b\r\n")  # a header line now and then, never the blank line
            except OSError:
                break
            if s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) if _readable(s) else False:
                break
            time.sleep(0.3)
        s.settimeout(3)
        try:
            assert s.recv(65536) == b""
        except ConnectionResetError:
            pass
    assert time.monotonic() - t0 < LIMITS.header_timeout + 2


def _readable(s: socket.socket) -> bool:
    import select

    return bool(select.select([s], [], [], 0)[0])


def test_anonymous_connections_cannot_crowd_out_others(port: int) -> None:
    # Twice the whole budget in slow, anonymous connections: the oldest are dropped as new
    # ones come, and a newcomer (a health check, a client with a key) is still served.
    slow = []
    try:
        for _ in range(2 * (LIMITS.max_connections or 0)):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")
            slow.append(s)
        t0 = time.monotonic()
        assert _raw(port, _request("GET", "/v1/health", key=None)).startswith(b"HTTP/1.1 200")
        assert _raw(port, _request("POST", "/v1/things", b"{}")).startswith(b"HTTP/1.1 200")
        assert time.monotonic() - t0 < 1
        time.sleep(0.2)
        dropped = 0
        for s in slow[:20]:
            s.settimeout(0.5)
            try:
                dropped += s.recv(1) == b""
            except ConnectionResetError:
                dropped += 1
            except TimeoutError:
                pass
        assert dropped == 20, "the oldest slow connections should have been dropped"
    finally:
        for s in slow:
            s.close()


def test_repeat_filter_counts_repeats() -> None:
    now = [0.0]
    f = RepeatFilter(burst=3, window=10, clock=lambda: now[0])

    def rec(msg: str, *args: Any) -> logging.LogRecord:
        return logging.LogRecord("x", logging.WARNING, __file__, 1, msg, args, None)

    passed = [f.filter(rec("send failed on %s", i)) for i in range(1000)]
    assert sum(passed) == 3
    assert f.filter(rec("another message"))  # others are counted on their own
    now[0] = 11
    r = rec("send failed on %s", 1)
    assert f.filter(r)
    assert "997 more like this" in r.getMessage()
