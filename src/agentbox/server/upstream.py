"""HTTP/1.1 towards the servers in sandboxes, for the port gateway: a pool of kept-alive
connections per (sandbox, port) and one exchange at a time on each.

The sockets come from the runtime (`connect(sandbox_id, port)`: already connected to the port
on the sandbox's loopback); h11 does the framing both ways, so a request's body and a response's
end are read exactly as HTTP/1.1 says, whatever the sandbox's server sends. The pool is small on
purpose: a list of idle connections taken last-in first-out, a count against the port's cap and
a queue of requests waiting for a connection, so a request costs the same with one connection
open or a hundred (httpcore's pool, used before, scanned every connection and waiting request on
each request: the gateway served fewer requests a second with 16 clients than with one).
"""

from __future__ import annotations

import asyncio
import fcntl
import select
import socket
import struct
import termios
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import h11

# Idle connections are dropped after this, below the idle timeout of common servers (uvicorn
# and node: 5 s) so a reused connection is rarely one the server is just closing.
KEEPALIVE_EXPIRY = 4.0
READ_SIZE = 64 * 1024


class UpstreamError(Exception):
    """Talking to the sandbox's server failed."""


class PoolTimeout(UpstreamError):
    """No connection to the port came free in time (the port's cap is reached)."""


class ReadTimeout(UpstreamError):
    """The sandbox's server sent nothing for the read timeout."""


class WriteTimeout(UpstreamError):
    """The sandbox's server did not take what was written to it for the write timeout."""


class UpstreamClosed(UpstreamError):
    """The connection broke (reset, closed early, or a socket error)."""


class UpstreamProtocolError(UpstreamError):
    """What the sandbox's server sent (or what was to be sent to it) is not valid HTTP/1.1."""


Connect = Callable[[str, int], Awaitable[socket.socket]]


class Idle(Protocol):
    """An idle connection of the fast path, as its pool sees it."""

    idle_since: float

    def close(self) -> None: ...

    def closing(self) -> bool: ...


async def dial(connect: Connect, sandbox_id: str, port: int, timeout: float) -> socket.socket:
    """A non-blocking socket connected to `port` in the sandbox."""
    async with asyncio.timeout(timeout):
        sock = await connect(sandbox_id, port)
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        # Head and body go out in separate writes: Nagle would hold the second back.
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
    return sock


def readable(sock: socket.socket) -> bool:
    """Whether a read would return at once: on an idle pooled connection, that means the server
    closed it (or sent junk), so it must not be reused."""
    if sock.fileno() < 0:
        return True
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


class Connection:
    """One socket to a sandbox's port and its HTTP/1.1 state."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.http = h11.Connection(h11.CLIENT)
        self.idle_since = time.monotonic()
        self.reused = False  # has served an exchange before the current one

    async def send(self, event: h11.Event, timeout: float) -> None:
        try:
            data = self.http.send(event)
        except h11.LocalProtocolError as e:
            raise UpstreamProtocolError(str(e)) from None
        if not data:
            return
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                await loop.sock_sendall(self.sock, data)
        except TimeoutError:  # before OSError: TimeoutError is one
            raise WriteTimeout("write timed out") from None
        except OSError as e:
            raise UpstreamClosed(str(e) or type(e).__name__) from e

    async def next_event(self, timeout: float) -> h11.Event:
        loop = asyncio.get_running_loop()
        while True:
            try:
                event = self.http.next_event()
            except h11.RemoteProtocolError as e:
                raise UpstreamProtocolError(str(e)) from None
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]
            try:
                async with asyncio.timeout(timeout):
                    data = await loop.sock_recv(self.sock, READ_SIZE)
            except TimeoutError:
                raise ReadTimeout("read timed out") from None
            except OSError as e:
                raise UpstreamClosed(str(e) or type(e).__name__) from e
            if not data and self.http.their_state is not h11.SEND_BODY:
                # Closed before (or instead of) an answer; a body that runs until the close
                # ends here, and one cut short is h11's error below.
                raise UpstreamClosed("the server closed the connection without an answer")
            try:
                self.http.receive_data(data)
            except h11.RemoteProtocolError as e:
                raise UpstreamProtocolError(str(e)) from None

    def reusable(self) -> bool:
        return self.http.our_state is h11.DONE and self.http.their_state is h11.DONE

    def close(self) -> None:
        close_socket(self.sock)


def reset_if_unread(sock: socket.socket) -> None:
    """Make closing `sock` a reset if data the sandbox never read is still queued on it: the
    kernel would otherwise keep the connection (and that data) waiting for the sandbox."""
    try:
        fd = sock.fileno()
        if fd >= 0 and fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0") != b"\0" * 4:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass


def close_socket(sock: socket.socket) -> None:
    reset_if_unread(sock)
    sock.close()


class Response:
    """A response head, and its body as it arrives (`body()`, once)."""

    def __init__(self, pool: Pool, conn: Connection, head: h11.Response, timeout: float) -> None:
        self.status = head.status_code
        self.headers: list[tuple[bytes, bytes]] = list(head.headers)
        self._pool, self._conn, self._timeout = pool, conn, timeout
        self._done = False

    async def body(self) -> AsyncIterator[bytes]:
        while True:
            event = await self._conn.next_event(self._timeout)
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._done = True
                return
            else:  # ConnectionClosed before the end: h11 says so for framed bodies
                raise UpstreamClosed("the server closed the connection mid-response")

    def close(self) -> None:
        """Give the connection back: to the pool if the exchange ended cleanly, else closed."""
        if self._conn is None:
            return
        conn, self._conn = self._conn, None  # type: ignore[assignment]
        self._pool.release(conn, self._done)


class Pool:
    """The connections to one sandbox's port: at most `limit`, idle ones kept KEEPALIVE_EXPIRY."""

    def __init__(self, connect: Connect, sandbox_id: str, port: int, limit: int) -> None:
        self._connect = connect
        self.sandbox_id, self.port, self.limit = sandbox_id, port, limit
        self._idle: list[Connection] = []
        self._open = 0  # connections open, busy or idle
        self._waiting: deque[asyncio.Future[None]] = deque()
        self.active = 0  # exchanges in progress
        self.idle_since = time.monotonic()
        # The gateway's fast path (server/fastpath.py) keeps its own connections, transports
        # rather than sockets, counted in `_open` alike: idle ones here, newest last.
        self.fast_idle: list[Idle] = []
        self.closed = False
        self._woken = 0  # waiters woken that have not run again yet (the room is theirs)

    @property
    def queued(self) -> bool:
        """Requests of the ASGI way are waiting for a connection (the fast path lets them go
        first)."""
        return bool(self._waiting) or self._woken > 0

    def reserve(self) -> bool:
        """Count one more connection against the cap for the fast path to open, if there is
        room (an idle connection of either kind is closed to make some)."""
        if self.closed or self.queued:
            return False
        if self._open >= self.limit:
            if self._idle:
                self._drop(self._idle.pop(0))
            elif self.fast_idle:
                self.fast_idle.pop(0).close()
                self._open -= 1
            else:
                return False
        self._open += 1
        return True

    def unreserve(self) -> None:
        """A fast-path connection counted by `reserve` is closed."""
        self._open -= 1
        self._wake()

    def take_fast(self) -> Idle | None:
        """The newest idle fast-path connection not yet expired (it stays counted)."""
        now = time.monotonic()
        while self.fast_idle and now - self.fast_idle[0].idle_since >= KEEPALIVE_EXPIRY:
            self.fast_idle.pop(0).close()
            self.unreserve()
        while self.fast_idle:
            conn = self.fast_idle.pop()
            if not conn.closing():
                return conn
            conn.close()  # the server's close is on its way: not worth a retry
            self.unreserve()
        return None

    def give_fast(self, conn: Idle) -> bool:
        """Keep a fast-path connection whose exchange ended cleanly; False if it should be
        closed instead (the pool is closed, or a request of the ASGI way waits for room)."""
        if self.closed or self.queued:
            return False
        self.fast_idle.append(conn)
        return True

    def forget_fast(self, conn: Idle) -> None:
        """An idle fast-path connection went away (the sandbox's server closed it)."""
        if conn in self.fast_idle:
            self.fast_idle.remove(conn)
            self.unreserve()

    async def _acquire(self, connect_timeout: float, pool_timeout: float) -> Connection:
        deadline = time.monotonic() + pool_timeout
        while True:
            now = time.monotonic()
            # The longest idle are first: close the expired ones, not only those popped.
            while self._idle and now - self._idle[0].idle_since >= KEEPALIVE_EXPIRY:
                self._drop(self._idle.pop(0))
            while self._idle:
                conn = self._idle.pop()
                if not readable(conn.sock):
                    conn.reused = True
                    return conn
                self._drop(conn)
            if self._open >= self.limit and self.fast_idle:
                self.fast_idle.pop(0).close()  # one of the fast path's idle ones makes room
                self._open -= 1
            if self._open < self.limit:
                self._open += 1
                try:
                    sock = await dial(self._connect, self.sandbox_id, self.port, connect_timeout)
                except BaseException:
                    self._open -= 1
                    self._wake()
                    raise
                return Connection(sock)
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            woken = False
            try:
                async with asyncio.timeout(max(0.0, deadline - now)):
                    await waiter
                woken = True
            except TimeoutError:
                raise PoolTimeout("no free connection") from None
            finally:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._woken -= 1  # running again
                    if not woken:
                        self._wake()  # woken, but leaving (cancelled, timed out): pass it on

    def release(self, conn: Connection, clean: bool) -> None:
        if clean and conn.reusable():
            conn.http.start_next_cycle()
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            self._drop(conn)
        self._wake()

    def _drop(self, conn: Connection) -> None:
        conn.close()
        self._open -= 1

    def _wake(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._woken += 1
                return

    async def request(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: AsyncIterator[bytes] | None,
        *,
        connect_timeout: float,
        pool_timeout: float,
        read_timeout: float,
        write_timeout: float,
        retry: bool,
    ) -> Response:
        """Send a request and read its response head. `retry`: a request without a body may go
        once more on a new connection when a kept-alive one turns out to have been closed by
        the server just as it was reused."""
        while True:
            conn = await self._acquire(connect_timeout, pool_timeout)
            try:
                await conn.send(h11.Request(method=method, target=target, headers=headers),
                                write_timeout)  # fmt: skip
                try:
                    if body is not None:
                        await _send_body(conn, body, write_timeout)
                    await conn.send(h11.EndOfMessage(), write_timeout)
                except UpstreamClosed as broke:
                    if body is None:
                        raise
                    # The server may have answered before it took the whole body (a 413, a
                    # 401) and closed: that answer is the one to pass on, if it is there.
                    try:
                        head = await _response_head(conn, read_timeout)
                    except UpstreamError:
                        raise broke from None
                    return Response(self, conn, head, read_timeout)
                return Response(self, conn, await _response_head(conn, read_timeout), read_timeout)
            except (UpstreamClosed, UpstreamProtocolError):
                self.release(conn, clean=False)
                if not (retry and conn.reused):
                    raise
                retry = False
            except BaseException:
                self.release(conn, clean=False)
                raise

    def close(self) -> None:
        self.closed = True
        for conn in self._idle:
            self._drop(conn)
        self._idle = []
        for idle in self.fast_idle:
            idle.close()
            self._open -= 1
        self.fast_idle = []


async def _response_head(conn: Connection, timeout: float) -> h11.Response:
    event = await conn.next_event(timeout)
    while isinstance(event, h11.InformationalResponse):  # 100 Continue and the like
        event = await conn.next_event(timeout)
    if not isinstance(event, h11.Response):
        raise UpstreamClosed("the server closed the connection without an answer")
    return event


async def _send_body(conn: Connection, body: AsyncIterator[bytes], timeout: float) -> None:
    async for chunk in body:
        await conn.send(h11.Data(data=chunk), timeout)
