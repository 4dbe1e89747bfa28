"""The port gateway's fast path: plain HTTP/1.1 requests to a sandbox's port relayed at the
protocol level, without h11, ASGI messages or a task per request.

The gateway (server/gateway.py) is ASGI middleware: each proxied request is parsed by uvicorn's
h11, turned into ASGI messages, relayed by a task pair and parsed again by h11 towards the
sandbox, ~0.6 ms of server CPU. Most requests to an exposed port are simple ones, so
`GatewayH11Protocol` (uvicorn's HTTP/1.1 protocol, which the API server runs) looks at each
request head itself while the connection is between requests. A request it can relay as is
goes through `FastRelay`:

- its head is parsed strictly here (origin-form target, HTTP/1.1, token names, no control
  characters, one Host, at most one plain Content-Length) and routed as the gateway routes;
- the gateway admits it at once (`PortGateway.fast_admit`: a running sandbox, its access
  token, a key of its tenant or a signed cookie, a relay slot), the same checks the ASGI way
  makes;
- the head the sandbox gets is made by the gateway's own `_forwarded_headers` (credentials,
  hop-by-hop headers and the access cookie removed, X-Forwarded-* set), and the response head
  the client gets by its `_response_headers` (Set-Cookie confined);
- bodies are relayed as they arrive, both ways, with flow control (a side that does not read
  pauses the other), the relay limits' idle and write timeouts, and the response's framing
  checked: Content-Length counted, chunked bodies parsed and written anew, a body that runs to
  the close re-chunked. Connections to the sandbox are kept alive in its port's pool.

Everything else — WebSocket upgrades, Expect, chunked or ambiguous request bodies, HTTP/1.0, a
signed-URL query, a paused or unknown sandbox, wrong credentials, a full relay budget, the
control plane's own ports, the API itself — goes to h11 and the ASGI app untouched, which answer
them as before. An error the fast path meets itself (the port closed, no answer in time) is
answered with the gateway's own error body.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from typing import Any
from urllib.parse import unquote

import h11
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from agentbox.core.errors import AgentboxError
from agentbox.server import gateway as gateway_module
from agentbox.server import upstream
from agentbox.server.errors import http_status
from agentbox.server.gateway import (
    _JSON,
    _RETRYABLE_METHODS,
    PortGateway,
    PortTarget,
    _error_body,
    _forwarded_headers,
    _response_headers,
    _Route,
    _route,
    _Stalled,
    _upstream_error,
)
from agentbox.server.upstream import dial, reset_if_unread
from agentbox.vocab import ErrorCode

log = logging.getLogger("agentbox.gateway")

_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+\Z")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_ORIGIN_FORM = re.compile(rb"/[\x21-\x7e]*\Z")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}\Z")
MAX_HEAD = 16 * 1024  # h11's default limit for a head, both ways
MAX_CHUNK_LINE = 1024
# Informational answers (100 Continue, 103 Early Hints) skipped before an answer, at most.
MAX_INFORMATIONAL = 8
# Chunks of a chunked answer parsed in one turn of the event loop: a read of 1-byte chunks
# (256 KiB: ~43,000 of them) would otherwise hold the loop for ~100 ms; the rest waits for the
# next turn, with the sandbox's connection paused meanwhile.
CHUNKS_PER_TURN = 256
# Request bytes read ahead of the exchange (the rest of a body, pipelined requests) before the
# client is paused.
READ_AHEAD = 64 * 1024

# Response body framing.
_NONE, _LENGTH, _CHUNKED, _UNTIL_CLOSE = range(4)
# Where a chunked body's parser is.
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)


class _Refused(Exception):
    """What the sandbox's server sent is not HTTP/1.1 the fast path relays."""


# ---------------------------------------------------------------------------- heads


def parse_head(
    head: bytes, response: bool = False
) -> tuple[bytes, bytes, bytes, list[tuple[bytes, bytes]]] | None:
    """A request head (method, target, version) or a response head (version, status, reason),
    with its headers (names lower-cased), or None unless it is plainly valid HTTP/1.x: no
    obsolete line folding, no control characters, token names."""
    lines = head.split(b"\r\n")
    if response:
        version, _, rest = lines[0].partition(b" ")
        status, sp, reason = rest.partition(b" ")
        if (
            version not in (b"HTTP/1.1", b"HTTP/1.0")
            or len(status) != 3
            or not status.isdigit()
            or (not sp and reason)
            or _BAD_VALUE.search(reason)
        ):
            return None
        first = (version, status, reason)
    else:
        parts = lines[0].split(b" ")
        if (
            len(parts) != 3
            or parts[2] != b"HTTP/1.1"
            or not _TOKEN.match(parts[0])
            or not _ORIGIN_FORM.match(parts[1])
        ):
            return None
        first = (parts[0], parts[1], parts[2])
    headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.match(name):  # also a folded line (leading whitespace)
            return None
        value = value.strip(b" \t")
        if _BAD_VALUE.search(value):
            return None
        headers.append((name.lower(), value))
    return (*first, headers)


def _tokens(value: bytes) -> set[bytes]:
    return {t.strip().lower() for t in value.split(b",")}


@functools.lru_cache(maxsize=4)
def _proxy_headers(trusted: str | tuple[str, ...]) -> ProxyHeadersMiddleware:
    hosts = list(trusted) if isinstance(trusted, tuple) else trusted
    return ProxyHeadersMiddleware(_nothing, trusted_hosts=hosts)  # type: ignore[arg-type]


async def _nothing(scope: Any, receive: Any, send: Any) -> None:
    return None


def _as_proxied(config: Any, scope: dict[str, Any]) -> None:
    """Client address and scheme as uvicorn's ProxyHeadersMiddleware sets them for the ASGI
    app (a trusted proxy's X-Forwarded-For and -Proto), so both ways forward the same."""
    trusted = config.forwarded_allow_ips
    middleware = _proxy_headers(tuple(trusted) if isinstance(trusted, list) else trusted)
    step = middleware(scope, None, None)  # type: ignore[arg-type]
    try:
        step.send(None)
    except StopIteration:
        return
    step.close()  # not reached: nothing in it waits


# ---------------------------------------------------------------------------- upstream side


class _Upstream(asyncio.Protocol):
    """A kept-alive connection to a sandbox's port, owned by one relay at a time or idle in its
    port's pool (`upstream.Pool.fast_idle`)."""

    def __init__(self, pool: upstream.Pool) -> None:
        self.pool = pool
        self.relay: FastRelay | None = None
        self.transport: asyncio.Transport | None = None
        self.idle_since = time.monotonic()
        self.counted = True  # in the pool's count of open connections
        self.used = False  # has carried an exchange before

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.relay is not None:
            self.relay.upstream_data(self, data)
        else:  # sent unasked (idle, or not yet given its request): it cannot carry one
            if self in self.pool.fast_idle:
                self.pool.fast_idle.remove(self)
            self.discard()

    def eof_received(self) -> bool:
        return False  # close; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        relay, self.relay = self.relay, None
        if relay is not None:
            relay.upstream_lost(self)
        elif self.counted:
            self.counted = False
            self.pool.forget_fast(self)

    def pause_writing(self) -> None:
        if self.relay is not None:
            self.relay.upstream_full(True)

    def resume_writing(self) -> None:
        if self.relay is not None:
            self.relay.upstream_full(False)

    def closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def close(self) -> None:
        """Close at once (a reset if the sandbox left data unread); the caller uncounts it."""
        self.relay = None
        self.counted = False
        transport = self.transport
        if transport is not None and not transport.is_closing():
            sock = transport.get_extra_info("socket")
            if sock is not None:
                reset_if_unread(sock)
            transport.abort()

    def discard(self) -> None:
        """Close it and take it off its pool's count."""
        counted = self.counted
        self.close()
        if counted:
            self.pool.unreserve()


# ---------------------------------------------------------------------------- the relay


class FastRelay:
    """The fast path of one client connection: one exchange at a time (see the module doc)."""

    def __init__(self, proto: GatewayH11Protocol, gateway: PortGateway) -> None:
        self.proto = proto
        self.gw = gateway
        self.limits = gateway.limits
        self.loop = proto.loop
        self.pending = b""  # client bytes not yet taken by an exchange
        self.busy = False
        self.closed = False  # the client connection is gone
        self.close_after = False  # close the client connection once the exchange ends
        self.read_paused: set[str] = set()
        self.client_is_full = False  # the client's transport asked us to stop writing
        # The exchange in progress.
        self.route: _Route | None = None
        self.target: PortTarget | None = None
        self.slot: tuple[str, str] | None = None
        self.pool: upstream.Pool | None = None
        self.up: _Upstream | None = None
        self.method = b""
        self.request_head = b""
        self.body_first = b""
        self.body_left = 0
        self.retry = False
        self.status = 0
        self.response_started = False
        self.response_buf = b""
        self.framing = _NONE
        self.left = 0
        self.chunk_state = _SIZE
        self.trailer_size = 0
        self.backlog = False  # response bytes read but left for the next turn
        self.up_paused: set[str] = set()  # why the sandbox's connection is not read
        self.reusable = False
        self.last = 0.0
        self.timer: asyncio.TimerHandle | None = None
        # A side that does not take what is written to it: the client, the sandbox's server.
        self.stalls: dict[bool, asyncio.TimerHandle] = {}
        self.informational = 0  # 1xx answers skipped in this exchange
        self.dialling: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ client side

    def feed(self, data: bytes) -> None:
        """Bytes from the client, while this relay has the connection."""
        if self.busy:
            if self.body_left:
                take = data[: self.body_left]
                data = data[len(take) :]
                self.body_left -= len(take)
                self.last = time.monotonic()
                if self.up is not None and self.up.transport is not None:
                    self.up.transport.write(take)
                else:  # still dialling the sandbox's port
                    self.body_first += take
                    if len(self.body_first) > READ_AHEAD:
                        self._pause_client("dial")
            if data:
                self.pending += data
                if len(self.pending) > READ_AHEAD:
                    self._pause_client("pending")
            return
        self.pending += data
        self._next()

    def _next(self) -> None:
        """Start the next request in `pending`, or hand the connection to h11."""
        while not self.busy and self.pending and not self.closed:
            end = self.pending.find(b"\r\n\r\n")
            if end < 0:
                if len(self.pending) > MAX_HEAD:
                    self._hand_over()
                return
            if not self._start(end):
                self._hand_over()
                return

    def _hand_over(self) -> None:
        data, self.pending = self.pending, b""
        self.proto.h11_receive(data)

    def _start(self, end: int) -> bool:
        """Relay the request whose head ends at `end`, or False for h11 to take it."""
        parsed = parse_head(self.pending[:end])
        if parsed is None:
            return False
        method, target, _, headers = parsed
        length = 0
        hosts = lengths = 0
        close = False
        for name, value in headers:
            if name == b"host":
                hosts += 1
            elif name == b"content-length":
                lengths += 1
                if not value.isdigit() or len(value) > 15:
                    return False
                length = int(value)
            elif name in (b"transfer-encoding", b"upgrade", b"expect"):
                return False
            elif name == b"connection":
                tokens = _tokens(value)
                if b"upgrade" in tokens:
                    return False
                close = close or b"close" in tokens
        if hosts != 1 or lengths > 1:
            return False
        proto = self.proto
        raw_path, _, query = target.partition(b"?")
        root = proto.root_path
        scope: dict[str, Any] = {
            "type": "http",
            "method": method.decode("ascii"),
            "path": root + unquote(raw_path.decode("ascii")),
            "raw_path": root.encode("ascii") + raw_path,
            "query_string": query,
            "headers": headers,
            "client": proto.client,
            "scheme": proto.scheme,
        }
        route = _route(scope, self.gw.domain)
        if route is None:
            return False
        if proto.config.proxy_headers and any(
            name in (b"x-forwarded-for", b"x-forwarded-proto") for name, _ in headers
        ):
            _as_proxied(proto.config, scope)
        decoded = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        try:
            admitted = self.gw.fast_admit(route, decoded)
        except Exception:
            # The ASGI way tries again, and answers 500 if it fails too.
            log.exception("port gateway: admitting a request on the fast path failed")
            return False
        if admitted is None:
            return False
        target_, slot = admitted
        pool = self.gw._pool(route.sandbox_id, route.port)
        up: _Upstream | None = None
        if not pool.queued:  # else requests of the ASGI way wait for a connection: join them
            up = pool.take_fast()  # type: ignore[assignment]
        if up is None and not pool.reserve():
            self.gw._give_slot(slot)
            return False  # the port's connections are all in use: h11's way queues for one
        out = _forwarded_headers(scope, decoded, route, frozenset())
        host = next(v for k, v in decoded if k == "host") or "localhost"
        lines = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method, route.target, host.encode("latin-1"))]
        lines += [b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1")) for k, v in out]
        if lengths:
            lines.append(b"content-length: %d\r\n" % length)
        lines.append(b"\r\n")
        # The exchange is on.
        rest = self.pending[end + 4 :]
        self.body_first, self.pending = rest[:length], rest[length:]
        self.body_left = length - len(self.body_first)
        self.busy = True
        self.gw.fast_busy.add(self)
        self.close_after = close
        self.route, self.target, self.slot, self.pool = route, target_, slot, pool
        self.method = method
        self.request_head = b"".join(lines)
        self.retry = not length and method.decode("ascii") in _RETRYABLE_METHODS
        self.status = 0
        self.response_started = False
        self.response_buf = b""
        self.informational = 0
        self.reusable = True
        self.last = time.monotonic()
        pool.active += 1
        proto.fast_request_started()
        self.timer = self.loop.call_later(self.limits.idle_timeout, self._check_idle)
        if self.pending and len(self.pending) > READ_AHEAD:
            self._pause_client("pending")
        if up is not None:
            self._send(up)
        else:
            self.dialling = self.loop.create_task(self._dial(route, pool))
        return True

    async def _dial(self, route: _Route, pool: upstream.Pool) -> None:
        up = _Upstream(pool)
        try:
            sock = await dial(
                self.gw._connect, route.sandbox_id, route.port, gateway_module.CONNECT_TIMEOUT
            )
            try:
                await self.loop.create_connection(lambda: up, sock=sock)
            except BaseException:
                sock.close()
                raise
        except asyncio.CancelledError:  # the server is going away
            pool.unreserve()
            raise
        except Exception as e:  # noqa: BLE001 (reported to the client)
            pool.unreserve()
            if self.busy and self.route is route and not self.closed:
                self._fail(e)
            return
        finally:
            self.dialling = None
        if not self.busy or self.route is not route or self.closed:
            up.discard()
            return
        self._send(up)

    def _send(self, up: _Upstream) -> None:
        transport = up.transport
        if transport is None or transport.is_closing():
            up.discard()
            self._fail(upstream.UpstreamClosed("the server closed the connection at once"))
            return
        self.up = up
        up.relay = self
        transport.write(self.request_head + self.body_first)
        self.body_first = b""
        self._resume_client("dial")
        if self.client_is_full:
            self.client_full(True)

    def _pause_client(self, why: str) -> None:
        if not self.read_paused:
            self.proto.transport.pause_reading()
        self.read_paused.add(why)

    def _resume_client(self, why: str) -> None:
        if why in self.read_paused:
            self.read_paused.discard(why)
            if not self.read_paused and not self.closed:
                self.proto.transport.resume_reading()

    def client_full(self, full: bool) -> None:
        """The client stopped (or resumed) reading what is written to it."""
        self.client_is_full = full
        up = self.up
        if not self.busy or up is None or up.transport is None:
            return
        if full:
            self._pause_upstream("client")
            why = f"the client did not read for {self.limits.write_timeout:g} s"
            self._arm_stall(why, client=True)
        else:
            self._resume_upstream("client")
            self._disarm_stall(client=True)

    def _pause_upstream(self, why: str) -> None:
        up = self.up
        if up is not None and up.transport is not None:
            if not self.up_paused:
                up.transport.pause_reading()
            self.up_paused.add(why)

    def _resume_upstream(self, why: str) -> None:
        if why in self.up_paused:
            self.up_paused.discard(why)
            up = self.up
            if not self.up_paused and up is not None and up.transport is not None:
                up.transport.resume_reading()

    def upstream_full(self, full: bool) -> None:
        """The sandbox's server stopped (or resumed) reading the request body."""
        if full:
            self._pause_client("upstream")
            self._arm_stall("the server did not read the request", client=False)
        else:
            self._resume_client("upstream")
            self._disarm_stall(client=False)

    def _arm_stall(self, why: str, client: bool) -> None:
        if client not in self.stalls:
            timeout = self.limits.write_timeout
            self.stalls[client] = self.loop.call_later(timeout, self._stalled, why, client)

    def _disarm_stall(self, client: bool) -> None:
        handle = self.stalls.pop(client, None)
        if handle is not None:
            handle.cancel()

    def _stalled(self, why: str, client: bool) -> None:
        self.stalls.pop(client, None)
        if not self.busy:
            return
        if client:  # nothing can be said to a client that does not read
            self._fail(_Stalled(why, ErrorCode.CLIENT_STALLED), abort=True)
        else:
            self._fail(upstream.WriteTimeout(why))

    def _check_idle(self) -> None:
        self.timer = None
        if not self.busy:
            return
        quiet = time.monotonic() - self.last
        if quiet < self.limits.idle_timeout:
            self.timer = self.loop.call_later(self.limits.idle_timeout - quiet, self._check_idle)
            return
        if self.body_left and not self.response_started:
            why = f"the client sent no more of the request body for {self.limits.idle_timeout:g} s"
            self._fail(_Stalled(why, ErrorCode.REQUEST_TIMEOUT))
        else:
            self._fail(upstream.ReadTimeout("read timed out"))

    def abort(self) -> None:
        """The server is going away: end the exchange and the client's connection now."""
        if not self.busy:
            return
        if not self.closed:
            self.closed = True
            self.proto.transport.abort()
        self._end(self.status or 499, keep_upstream=False)

    def client_lost(self) -> None:
        self.closed = True
        if self.busy:
            self._end(499 if not self.status else self.status, keep_upstream=False)

    # ------------------------------------------------------------------ upstream side

    def upstream_data(self, up: _Upstream, data: bytes) -> None:
        if up is not self.up or not self.busy:
            up.discard()
            return
        self.last = time.monotonic()
        out: list[bytes] = []
        try:
            done = self._response(data, out)
        except _Refused as e:
            if out:
                self.proto.transport.write(b"".join(out))
            self._fail(upstream.UpstreamProtocolError(str(e)))
            return
        if out:
            self.proto.transport.write(b"".join(out))
        if done:
            self._end(self.status, keep_upstream=self.reusable)
        elif self.backlog:
            self._pause_upstream("backlog")
            self.loop.call_soon(self._next_turn, up)

    def _next_turn(self, up: _Upstream) -> None:
        """Parse what the last turn left of the answer."""
        if up is not self.up or not self.busy:
            return
        self.backlog = False
        self.upstream_data(up, b"")
        if not self.backlog and self.up is up:
            self._resume_upstream("backlog")

    def upstream_lost(self, up: _Upstream) -> None:
        if up.counted:
            up.counted = False
            up.pool.unreserve()
        if up is not self.up or not self.busy:
            return
        self.up = None
        self.up_paused.clear()  # the old connection's; a new one starts unpaused
        self.backlog = False
        if not self.response_started:
            if self.retry and up.used and not self.response_buf and not self.informational:
                # A kept-alive connection the server closed as it was reused: once more on a
                # new one (a request without a body only).
                self.retry = False
                assert self.route is not None and self.pool is not None
                if self.pool.reserve():
                    self.loop.create_task(self._dial(self.route, self.pool))
                    return
            why = "the server closed the connection without an answer"
            self._fail(upstream.UpstreamClosed(why))
        elif self.framing == _UNTIL_CLOSE:
            self.proto.transport.write(b"0\r\n\r\n")
            self._end(self.status, keep_upstream=False)
        else:
            log.info(
                "port gateway: relay from %s:%s ended: the server closed the connection "
                "mid-response",
                self.route.sandbox_id if self.route else "?",
                self.route.port if self.route else 0,
            )
            self.close_after = True
            self._end(self.status, keep_upstream=False)

    def _response(self, data: bytes, out: list[bytes]) -> bool:
        """Take response bytes, put what goes to the client in `out`; whether it ended."""
        if not self.limits.check_answers:
            return self._spliced(data, out)
        if not self.response_started:
            buf = self.response_buf + data
            while True:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise _Refused("the response head is over 16 KiB")
                    self.response_buf = buf
                    return False
                parsed = parse_head(buf[:end], response=True)
                if parsed is None:
                    raise _Refused("the response head is not valid HTTP/1.1")
                version, status_text, _, headers = parsed
                status = int(status_text)
                buf = buf[end + 4 :]
                if status == 101 or not 100 <= status <= 599:
                    raise _Refused(f"status {status} answers no request of this kind")
                if status >= 200:
                    break
                # 100 Continue, 103 Early Hints and the like: skipped, as the ASGI way does,
                # a few of them.
                self.informational += 1
                if self.informational > MAX_INFORMATIONAL:
                    raise _Refused(f"more than {MAX_INFORMATIONAL} informational answers")
            self.response_buf = b""
            out.append(self._response_head(status, version, headers))
            self.response_started = True
            self.status = status
            if self.framing == _NONE:
                if buf:
                    self.reusable = False  # more than the answer: the connection is not sound
                return True
            data = buf
            if not data:
                return False
        if self.framing == _LENGTH:
            if len(data) >= self.left:
                if len(data) > self.left:
                    self.reusable = False
                    data = data[: self.left]
                out.append(data)
                self.left = 0
                return True
            out.append(data)
            self.left -= len(data)
            return False
        if self.framing == _UNTIL_CLOSE:
            out += [b"%x\r\n" % len(data), data, b"\r\n"]
            return False
        return self._chunks(data, out)

    def _spliced(self, data: bytes, out: list[bytes]) -> bool:
        """The answer as a naive splice relays it: bytes as they come, its end found by a loose
        look at Content-Length, what follows it passed on too. Only the battery's positive
        control (`check_answers=False`) runs this: it shows what the checks stop."""
        if not self.response_started:
            buf = self.response_buf + data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.response_buf = buf
                return False
            self.response_buf = b""
            self.response_started = True
            self.status = int(buf[9:12]) if buf[9:12].isdigit() else 502
            found = re.search(rb"(?i)content-length:\s*(\d+)", buf[:end])
            self.left = int(found.group(1)) if found else 0
            self.reusable = False
            data = buf[end + 4 :]
            out.append(buf[: end + 4])
        out.append(data)
        self.left -= len(data)
        return self.left <= 0

    def _response_head(
        self, status: int, version: bytes, headers: list[tuple[bytes, bytes]]
    ) -> bytes:
        assert self.route is not None
        lengths = [v for k, v in headers if k == b"content-length"]
        codings = [v for k, v in headers if k == b"transfer-encoding"]
        connection: set[bytes] = set()
        for k, v in headers:
            if k == b"connection":
                connection |= _tokens(v)
        if version != b"HTTP/1.1" or b"close" in connection:
            self.reusable = False
        if codings:
            if lengths or len(codings) != 1 or codings[0].lower() != b"chunked":
                raise _Refused("the response's Transfer-Encoding is not plain chunked")
            framing = _CHUNKED
        elif self.method == b"HEAD" or status in (204, 304):
            framing = _NONE  # no body, whatever the headers say (checked below when given)
        elif lengths:
            values = {v.strip() for value in lengths for v in value.split(b",")}
            if len(values) != 1:
                raise _Refused("the response has conflicting Content-Length values")
            value = values.pop()
            if not value.isdigit() or len(value) > 18:
                raise _Refused("the response's Content-Length is not a number")
            framing, self.left = _LENGTH, int(value)
            if not self.left:
                framing = _NONE
        else:
            framing = _UNTIL_CLOSE
            self.reusable = False
        if lengths and framing == _NONE:
            values = {v.strip() for value in lengths for v in value.split(b",")}
            if len(values) != 1 or not values.pop().isdigit():
                raise _Refused("the response's Content-Length is not one number")
        if self.method == b"HEAD" or status in (204, 304):
            framing = _NONE
        self.framing = framing
        self.chunk_state, self.trailer_size = _SIZE, 0
        passed = _response_headers(headers, self.route.prefix, self.limits.confine_cookies)
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, STATUS_PHRASES[status])]
        lines += [b"%s: %s\r\n" % (k, v) for k, v in self.proto.server_state.default_headers]
        lines += [b"%s: %s\r\n" % (k, v) for k, v in passed if k != b"content-length"]
        if framing == _LENGTH or (framing == _NONE and lengths):
            lines.append(b"content-length: %s\r\n" % lengths[0].split(b",")[0].strip())
        elif framing in (_CHUNKED, _UNTIL_CLOSE):
            lines.append(b"transfer-encoding: chunked\r\n")
        if self.close_after:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def _chunks(self, data: bytes, out: list[bytes]) -> bool:
        """A chunked answer's bytes: their data goes out as one chunk per turn."""
        pieces: list[bytes] = []
        ended = self._parse_chunks(data, pieces)
        if pieces:
            out += [b"%x\r\n" % sum(len(p) for p in pieces), *pieces, b"\r\n"]
        if ended:
            out.append(b"0\r\n\r\n")
        return ended

    def _parse_chunks(self, data: bytes, pieces: list[bytes]) -> bool:
        buf = self.response_buf + data if self.response_buf else data
        self.response_buf = b""
        i, size = 0, len(buf)
        turn = CHUNKS_PER_TURN
        while i < size:
            state = self.chunk_state
            if state == _DATA:
                take = buf[i : i + self.left]
                pieces.append(take)
                i += len(take)
                self.left -= len(take)
                if not self.left:
                    self.chunk_state = _DATA_END
                continue
            if state == _DATA_END:
                if size - i < 2:
                    self.response_buf = buf[i:]
                    return False
                if buf[i : i + 2] != b"\r\n":
                    raise _Refused("a chunk of the response does not end with CRLF")
                i += 2
                self.chunk_state = _SIZE
                continue
            eol = buf.find(b"\r\n", i)
            if eol < 0:
                rest = buf[i:]
                limit = MAX_CHUNK_LINE if state == _SIZE else MAX_HEAD - self.trailer_size
                if len(rest) > limit:
                    raise _Refused("a chunk size line or the trailer of the response is too long")
                self.response_buf = rest
                return False
            line = buf[i:eol]
            i = eol + 2
            if state == _SIZE:
                text = line.split(b";", 1)[0].strip(b" \t")
                if not _HEX.match(text):
                    raise _Refused("a chunk size in the response is not hexadecimal")
                self.left = int(text, 16)
                self.chunk_state = _DATA if self.left else _TRAILER
                turn -= 1
                if not turn and i < size:
                    self.response_buf = buf[i:]
                    self.backlog = True
                    return False
                continue
            # The trailer: its fields are not passed on (nor are they the ASGI way).
            self.trailer_size += len(line) + 2
            if self.trailer_size > MAX_HEAD:
                raise _Refused("the response's trailer is over 16 KiB")
            if not line:
                if i < size:
                    self.reusable = False
                return True
        return False

    # ------------------------------------------------------------------ endings

    def _fail(self, error: BaseException, abort: bool = False) -> None:
        """The exchange broke: the client hears why if nothing of the answer was sent yet,
        else its connection ends (the answer is seen cut short)."""
        if not self.busy:
            return
        route = self.route
        assert route is not None
        if self.response_started or self.closed or abort:
            log.info("port gateway: relay to %s:%s ended: %s", route.sandbox_id, route.port, error)
            self.close_after = True
            if abort and not self.closed:  # a client that does not read: drop what is queued
                self.proto.transport.abort()
            self._end(self.status or 499, keep_upstream=False)
            return
        mapped = _upstream_error(route, error, self.limits)
        if mapped is None:  # not one of ours: a bug, said as one
            log.error("port gateway: fast relay failed", exc_info=error)
            mapped = AgentboxError("internal error while relaying the request")
        body = _error_body(mapped)
        status = http_status(mapped)
        if self.body_left:
            self.close_after = True  # the rest of the body is still coming: no next request
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, STATUS_PHRASES[status])]
        lines += [b"%s: %s\r\n" % (k, v) for k, v in self.proto.server_state.default_headers]
        lines += [b"%s: %s\r\n" % (k, v) for k, v in _JSON]
        lines.append(b"content-length: %d\r\n" % len(body))
        if self.close_after:
            lines.append(b"connection: close\r\n")
        lines += [b"\r\n", body]
        self.proto.transport.write(b"".join(lines))
        self._end(status, keep_upstream=False)

    def _end(self, status: int, keep_upstream: bool) -> None:
        """The exchange is over: the slot, the connection to the sandbox (back to its pool or
        closed), the audit; then the client's next request, if it sent one."""
        route, slot, pool, up = self.route, self.slot, self.pool, self.up
        self.busy = False
        self.gw.fast_busy.discard(self)
        self.route = self.target = self.slot = self.pool = self.up = None
        self.backlog = False
        self.up_paused.clear()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for handle in self.stalls.values():
            handle.cancel()
        self.stalls.clear()
        if slot is not None:
            self.gw._give_slot(slot)
        if pool is not None:
            pool.active -= 1
            pool.idle_since = time.monotonic()
        if up is not None:
            if (
                keep_upstream
                and not self.body_left
                and not up.closing()
                and not up.transport.get_write_buffer_size()  # type: ignore[union-attr]
                and pool is not None
                and pool.give_fast(up)
            ):
                up.relay = None
                up.used = True
                up.idle_since = time.monotonic()
                up.transport.resume_reading()  # type: ignore[union-attr]
            else:
                up.discard()
        if route is not None:
            self.gw._audit(route, self.method.decode("ascii"), status)
            self.gw._sweep()
        if self.closed:
            return
        if self.close_after or self.body_left:
            self.body_left = 0
            self.proto.transport.close()
            self.closed = True
            return
        self.proto.fast_exchange_done()
        for why in ("upstream", "dial", "pending"):
            self._resume_client(why)
        self._next()


# ---------------------------------------------------------------------------- uvicorn side


class GatewayH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the gateway's fast path in front of h11.

    `gateway_of` (set on a subclass, see `fast_protocol`) returns the PortGateway once the app
    has built it, else None (then every request goes to h11)."""

    gateway_of: Any = staticmethod(lambda: None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._relay: FastRelay | None = None

    def data_received(self, data: bytes) -> None:
        relay = self._relay
        if relay is None and self._h11_idle():
            gateway = self.gateway_of()
            if gateway is not None and gateway.fast_ready():
                relay = self._relay = FastRelay(self, gateway)
        if relay is not None and (relay.busy or relay.pending or self._h11_idle()):
            self._unset_keepalive_if_required()
            relay.feed(data)
            return
        self.h11_receive(data)

    def h11_receive(self, data: bytes) -> None:
        """Bytes for h11 (uvicorn's own way)."""
        super().data_received(data)

    def _h11_idle(self) -> bool:
        """Between requests as far as h11 knows, with nothing of a next one read."""
        conn = self.conn
        return (
            conn.our_state is h11.IDLE
            and conn.their_state is h11.IDLE
            and (self.cycle is None or self.cycle.response_complete)
            and not conn.trailing_data[0]
            and not self.transport.is_closing()
        )

    def fast_request_started(self) -> None:
        """The fast path took a request whose head is in."""
        self._unset_keepalive_if_required()  # armed by the last answer: a pipelined request

    def fast_exchange_done(self) -> None:
        """The fast path answered a request; the connection waits for the next one."""
        self.server_state.total_requests += 1
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        if self._relay is not None:
            self._relay.client_lost()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._relay is not None:
            self._relay.client_full(True)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._relay is not None:
            self._relay.client_full(False)

    def shutdown(self) -> None:
        relay = self._relay
        if relay is not None and relay.busy:
            relay.close_after = True  # closed once its answer is out
            return
        super().shutdown()


def fast_protocol(
    gateway_of: Any, base: type[GatewayH11Protocol] = GatewayH11Protocol
) -> type[GatewayH11Protocol]:
    """`base` bound to a gateway (`gateway_of()`: the PortGateway, or None until built), for
    `uvicorn.run(http=...)`."""
    return type("GatewayH11Protocol", (base,), {"gateway_of": staticmethod(gateway_of)})
