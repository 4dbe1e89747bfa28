"""The gateway's upstream pool (server/upstream.py) against a raw loopback server whose answers
are written byte for byte: reuse, framing, a server closing or breaking connections, the cap."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from agentbox.server import upstream
from agentbox.server.upstream import Pool

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
HANG_UP = b"<hang up>"

# A scripted server: reads one request head (and its body), then answers with what
# `reply(n, head)` returns for the connection's n-th request; None closes the connection, and so
# does an answer that says `Connection: close` or ends with HANG_UP (which is not sent).
Reply = Callable[[int, bytes], Awaitable[bytes | None]]


class Server:
    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.accepted = 0
        self.ended = 0  # connections the client closed (or the server hung up)
        self.heads: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                fields = {}
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    fields[name.strip().lower()] = value.strip().lower()
                if length := int(fields.get(b"content-length", 0)):
                    await reader.readexactly(length)
                elif fields.get(b"transfer-encoding") == b"chunked":
                    while (size := int((await reader.readline()).strip(), 16)) > 0:
                        await reader.readexactly(size + 2)
                    await reader.readline()
                answer = await self.reply(n, head)
                n += 1
                if answer is None:
                    break
                writer.write(answer.removesuffix(HANG_UP))
                await writer.drain()
                if answer.endswith(HANG_UP) or b"connection: close" in answer.lower():
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.ended += 1
            writer.close()


async def _listen(handle: Any) -> tuple[asyncio.Server, upstream.Connect]:
    """A loopback server running `handle`, and a `connect` that dials it for any port."""
    listener = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]

    async def connect(sandbox_id: str, _: int) -> socket.socket:
        sock = socket.socket()
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        return sock

    return listener, connect


async def _pool(reply: Reply, limit: int = 4) -> tuple[Pool, Server, asyncio.Server]:
    srv = Server(reply)
    listener, connect = await _listen(srv.handle)
    return Pool(connect, "sbx", 80, limit), srv, listener


async def _get(pool: Pool, method: bytes = b"GET", body: bytes | None = None, **kw: Any) -> Any:
    headers = [(b"host", b"x")]
    chunks = None
    if body is not None:
        headers.append((b"content-length", str(len(body)).encode()))

        async def one() -> Any:
            yield body

        chunks = one()
    options = dict(connect_timeout=2.0, pool_timeout=2.0, read_timeout=2.0, write_timeout=2.0,
                   retry=body is None and method == b"GET")  # fmt: skip
    options.update(kw)
    response = await pool.request(method, b"/", headers, chunks, **options)
    try:
        data = b"".join([c async for c in response.body()])
    finally:
        response.close()
    return response.status, data


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 20))


def test_kept_alive_connections_are_reused() -> None:
    async def test() -> None:
        async def reply(n: int, head: bytes) -> bytes:
            return OK

        pool, srv, listener = await _pool(reply)
        for _ in range(20):
            assert await _get(pool) == (200, b"ok")
        assert await _get(pool, b"POST", b"body") == (200, b"ok")
        assert srv.accepted == 1
        pool.close()
        listener.close()

    run(test)


def test_a_connection_the_server_closes_is_not_reused() -> None:
    async def test() -> None:
        async def reply(n: int, head: bytes) -> bytes | None:
            if n == 0:
                return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
            return None

        pool, srv, listener = await _pool(reply)
        for _ in range(3):
            assert await _get(pool) == (200, b"ok")
        assert srv.accepted == 3
        listener.close()

    run(test)


def test_a_kept_connection_closed_while_idle_is_not_used_for_a_body() -> None:
    async def test() -> None:
        async def reply(n: int, head: bytes) -> bytes | None:
            return OK + HANG_UP  # and the connection is closed

        pool, srv, listener = await _pool(reply)
        assert await _get(pool) == (200, b"ok")
        await asyncio.sleep(0.05)
        # A POST (never sent twice) still goes through: the idle socket reads as closed.
        status = await _get(pool, b"POST", b"x")
        assert status == (200, b"ok") and srv.accepted == 2
        listener.close()

    run(test)


def test_a_get_on_a_connection_that_broke_at_reuse_goes_once_more() -> None:
    async def test() -> None:
        async def reply(n: int, head: bytes) -> bytes | None:
            return OK if n == 0 else None  # the second request on a connection: hang up

        pool, srv, listener = await _pool(reply)
        assert await _get(pool) == (200, b"ok")
        assert await _get(pool) == (200, b"ok")  # reused, closed unanswered, sent again
        assert srv.accepted == 2
        with pytest.raises(upstream.UpstreamClosed):  # a POST is not sent twice
            await _get(pool, b"POST", b"x")
        listener.close()

    run(test)


def test_bodies_framed_every_way() -> None:
    answers = {
        b"chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        b"until-close": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it",
        b"head": b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n",
        b"empty": b"HTTP/1.1 204 No Content\r\n\r\n",
        b"continue": b"HTTP/1.1 100 Continue\r\n\r\n" + OK,
    }

    async def test() -> None:
        async def reply(n: int, head: bytes) -> bytes | None:
            return next(a for k, a in answers.items() if k in head) if n == 0 else None

        async def fetch(name: bytes, method: bytes = b"GET") -> Any:
            pool, _, listener = await _pool(reply)
            response = await pool.request(
                method, b"/" + name, [(b"host", b"x"), (b"x-case", name)], None,
                connect_timeout=2, pool_timeout=2, read_timeout=2, write_timeout=2, retry=False,
            )  # fmt: skip
            data = b"".join([c async for c in response.body()])
            response.close()
            listener.close()
            return response.status, data

        assert await fetch(b"chunked") == (200, b"abcde")
        assert await fetch(b"until-close") == (200, b"all of it")
        assert await fetch(b"head", b"HEAD") == (200, b"")
        assert await fetch(b"empty") == (204, b"")
        assert await fetch(b"continue") == (200, b"ok")

    run(test)


def test_broken_answers_are_errors_and_the_connection_is_dropped() -> None:
    async def test() -> None:
        async def reply(n: int, head: bytes) -> bytes | None:
            if b"junk" in head:
                return b"SSH-2.0-OpenSSH\r\n\r\n"
            if b"short" in head:
                return b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nConnection: close\r\n\r\nhalf"
            return OK

        pool, srv, listener = await _pool(reply)
        for path in (b"/junk", b"/short"):
            with pytest.raises((upstream.UpstreamProtocolError, upstream.UpstreamClosed)):
                response = await pool.request(
                    b"GET", path, [(b"host", b"x")], None, connect_timeout=2, pool_timeout=2,
                    read_timeout=2, write_timeout=2, retry=False,
                )  # fmt: skip
                try:
                    [c async for c in response.body()]
                finally:
                    response.close()
        assert await _get(pool) == (200, b"ok")
        assert srv.accepted == 3  # neither broken connection was used again
        listener.close()

    run(test)


def test_a_silent_server_is_a_read_timeout() -> None:
    async def test() -> None:
        async def reply(n: int, head: bytes) -> bytes | None:
            await asyncio.sleep(5)
            return OK

        pool, _, listener = await _pool(reply)
        with pytest.raises(upstream.ReadTimeout):
            await _get(pool, read_timeout=0.2)
        listener.close()

    run(test)


def test_the_cap_makes_requests_wait_then_time_out() -> None:
    async def test() -> None:
        release = asyncio.Event()

        async def reply(n: int, head: bytes) -> bytes | None:
            if b"/slow" in head:
                await release.wait()
            return OK

        pool, srv, listener = await _pool(reply, limit=1)
        slow = asyncio.create_task(
            pool.request(b"GET", b"/slow", [(b"host", b"x")], None, connect_timeout=2,
                         pool_timeout=2, read_timeout=5, write_timeout=2, retry=False)
        )  # fmt: skip
        await asyncio.sleep(0.1)
        with pytest.raises(upstream.PoolTimeout):
            await _get(pool, pool_timeout=0.2)
        waiting = asyncio.create_task(_get(pool, pool_timeout=5))
        cancelled = asyncio.create_task(_get(pool, pool_timeout=5))
        await asyncio.sleep(0.1)
        cancelled.cancel()
        release.set()
        response = await slow
        assert [c async for c in response.body()] == [b"ok"]
        response.close()  # the one connection goes to the request still waiting
        assert await waiting == (200, b"ok")
        assert srv.accepted == 1
        listener.close()

    run(test)


def test_expired_idle_connections_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upstream, "KEEPALIVE_EXPIRY", 1.0)

    async def test() -> None:
        async def reply(n: int, head: bytes) -> bytes:
            await asyncio.sleep(0.05)
            return OK

        pool, srv, listener = await _pool(reply)
        assert await asyncio.gather(*(_get(pool) for _ in range(3))) == [(200, b"ok")] * 3
        await asyncio.sleep(0.6)
        assert await _get(pool) == (200, b"ok")  # one of the three, idle again from now
        await asyncio.sleep(0.6)
        # The other two are past the expiry; the request takes the one used last and closes
        # them (not only expired connections it happens to pick).
        assert await _get(pool) == (200, b"ok")
        await asyncio.sleep(0.1)
        assert (srv.accepted, srv.ended) == (3, 2)
        listener.close()

    run(test)


def test_an_answer_sent_before_the_whole_body_is_passed_on() -> None:
    """A server that refuses an upload after its head (413) and closes without reading the
    rest: the write breaks, and the answer it sent is what the request gets."""

    async def test() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 413 Too Large\r\nContent-Length: 3\r\n"
                         b"Connection: close\r\n\r\nbig")  # fmt: skip
            await writer.drain()
            writer.transport.abort()  # unread data: the kernel resets the connection

        listener, connect = await _listen(handle)
        pool = Pool(connect, "sbx", 80, 4)
        sent = []

        async def body() -> Any:
            for _ in range(200):  # 12.5 MiB, more than the socket buffers hold
                sent.append(1)
                yield b"x" * 65536
                await asyncio.sleep(0.001)

        headers = [(b"host", b"x"), (b"content-length", str(200 * 65536).encode())]
        response = await pool.request(b"POST", b"/", headers, body(), connect_timeout=2,
                                      pool_timeout=2, read_timeout=2, write_timeout=2,
                                      retry=False)  # fmt: skip
        assert response.status == 413
        assert [c async for c in response.body()] == [b"big"]
        response.close()
        assert len(sent) < 200
        listener.close()

    run(test)
