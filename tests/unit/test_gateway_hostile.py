"""The port gateway against hostile servers "in a sandbox": raw loopback servers that stream
1-byte chunks forever, flood pings, stop reading or go quiet. The gateway runs under uvicorn in
this process, beside an API route whose latency shows whether the event loop is still free."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import select
import socket
import statistics
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from agentbox.core import ports
from agentbox.server.fastpath import fast_protocol
from agentbox.server.gateway import PortGateway, PortTarget, RelayLimits

try:
    from ._asgi_server import serve
    from ._raw_server import RawServer
except ImportError:
    from _asgi_server import serve  # type: ignore[no-redef]
    from _raw_server import RawServer  # type: ignore[no-redef]

TENANT = "acme"
BOX = "sbx_00000000000000aa"
BOX2 = "sbx_00000000000000bb"  # same tenant
LIMITS = RelayLimits(
    idle_timeout=1.5,
    write_timeout=1.0,
    per_sandbox=3,
    per_tenant=4,
    ws_ping_burst=5,
    ws_pings_per_second=2,
    ws_write_buffer=256 * 1024,
)


# ---------------------------------------------------------------------------- hostile servers


def _read_head(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the headers ended")
        data += chunk
    return data


def _peer_closed(conn: socket.socket, timeout: float) -> bool:
    """Whether the peer shut its end within `timeout` (even with unread data waiting)."""
    poller = select.poll()
    poller.register(conn, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(timeout * 1000))


def _ws_accept(conn: socket.socket) -> None:
    head = _read_head(conn).decode("latin-1")
    key = next(
        line.split(":", 1)[1].strip()
        for line in head.split("\r\n")
        if line.lower().startswith("sec-websocket-key:")
    )
    accept = base64.b64encode(
        hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()
    ).decode()
    conn.sendall(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        + f"Sec-WebSocket-Accept: {accept}\r\n\r\n".encode()
    )


def trickle(conn: socket.socket) -> None:
    """Chunked, then 1-byte chunks as fast as the reader takes them, forever."""
    _read_head(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    # ~240 KB a write: a relay that took a whole read of these at once would hold the event
    # loop for ~50-100 ms at a time (the fast path parses at most CHUNKS_PER_TURN a turn).
    burst = b"1\r\nx\r\n" * 40000
    while True:
        conn.sendall(burst)


def silent(conn: socket.socket) -> None:
    """Headers of a streamed answer, then nothing; waits for the gateway to hang up."""
    _read_head(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
    _peer_closed(conn, 60)


def sink(conn: socket.socket) -> None:
    """Reads the request line and headers, never the body, and never answers."""
    _read_head(conn)
    _peer_closed(conn, 60)


def ping_flood(conn: socket.socket) -> None:
    _ws_accept(conn)
    flood = b"\x89\x00" * 32768  # unmasked, empty PING frames
    while True:
        conn.sendall(flood)


def deaf(conn: socket.socket) -> None:
    """Accepts the WebSocket, then never reads a byte."""
    _ws_accept(conn)
    _peer_closed(conn, 60)


# Answers that are not valid HTTP/1.1, by request path: each must reach the client as an error
# or a cut-short answer, never as headers or an answer of their own.
LIES = {
    "/split": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: a\nSet-Cookie: forged=1\r\n\r\nok",
    "/cr": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: a\rSet-Cookie: forged=1\r\n\r\nok",
    "/fold": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: a\r\n Set-Cookie: forged=1\r\n\r\nok",
    "/two-lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 30\r\n\r\nok",
    "/both": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"2\r\nok\r\n0\r\n\r\n",
    "/coding": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "/status": b"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\nok",
    "/switch": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: evil\r\n\r\n",
    "/huge-head": b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n",
}
# Answers whose body is cut short or malformed after the head: the client sees it cut short.
BROKEN_BODIES = {
    "/bad-chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\nzz\r\n",
    "/hex-prefix": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\nok\r\n0\r\n\r\n",
    "/short": b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nok",
}
# What h11 (the ASGI way) takes leniently, as RFC 9112 lets a recipient: a bare LF ends a line,
# a folded line joins the one before, Transfer-Encoding wins over Content-Length, and bytes after
# an answer are read as the next answer on that connection. Each is something the sandbox's
# server could have sent plainly (its own header, its own answer to the next request to its
# port), so neither way lets it reach past its port; the fast path refuses them all the same.
LENIENT = {"/split", "/fold", "/both", "/extra", "/extra-chunked"}
# One answer followed by a forged second one, which must never answer the client's next request.
FORGED = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged"
SMUGGLE = {
    "/extra": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" + FORGED,
    "/extra-chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"2\r\nok\r\n0\r\n\r\n" + FORGED,
}


def liar(conn: socket.socket) -> None:
    """Answers each request by its path from LIES, BROKEN_BODIES and SMUGGLE (else a plain
    `fine`), closing after an answer it cannot follow with another."""
    while True:
        head = _read_head(conn)
        path = head.split(b" ", 2)[1].decode()
        answer = LIES.get(path) or BROKEN_BODIES.get(path) or SMUGGLE.get(path)
        if answer is None:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nfine")
            continue
        conn.sendall(answer)
        if path in BROKEN_BODIES:
            conn.shutdown(socket.SHUT_WR)
            _peer_closed(conn, 10)
            return


# ---------------------------------------------------------------------------- the gateway

SERVERS = {3000: trickle, 3001: silent, 3002: sink, 3003: ping_flood, 3004: deaf, 3005: liar}


@dataclass
class Gw:
    port: int
    servers: dict[int, RawServer]
    fast: bool

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def path(self, port: int, box: str = BOX) -> str:
        return ports.port_path_prefix(box, port)

    def health_latencies(self, n: int = 20) -> list[float]:
        out = []
        with httpx.Client(base_url=self.url, timeout=10, trust_env=False) as c:
            for _ in range(n):
                t0 = time.perf_counter()
                assert c.get("/v1/health").status_code == 200
                out.append(time.perf_counter() - t0)
        return out


@pytest.fixture(scope="module", params=["asgi", "fast"])
def gw(request: pytest.FixtureRequest) -> Iterator[Gw]:
    """Each test twice: the ASGI way only, and with the fast path in front (server/fastpath.py)."""
    fast = request.param == "fast"
    servers = {port: RawServer(handler) for port, handler in SERVERS.items()}

    async def lookup(sandbox_id: str) -> PortTarget | None:
        if sandbox_id in (BOX, BOX2):
            return PortTarget(sandbox_id, TENANT, "token", public=True)
        return None

    async def tenant_of_key(key: str) -> str | None:
        return None

    async def connect(sandbox_id: str, port: int) -> socket.socket:
        sock = socket.socket()
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", servers[port].port))
        return sock

    gateway: PortGateway

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await gateway.aclose()

    api = FastAPI(lifespan=lifespan)

    @api.get("/v1/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    gateway = PortGateway(
        api,
        domain="localhost",
        lookup=lookup,
        tenant_of_key=tenant_of_key,
        connect=connect,
        limits=LIMITS,
        lookup_now=lambda sandbox_id: (
            PortTarget(sandbox_id, TENANT, "token", public=True)
            if sandbox_id in (BOX, BOX2)
            else None
        ),
        tenant_of_key_now=lambda key: None,
    )
    http = fast_protocol(lambda: gateway) if fast else "h11"
    with serve(gateway, http=http) as port:
        yield Gw(port, servers, fast)
    for s in servers.values():
        s.listener.close()


def _p50(xs: list[float]) -> float:
    return statistics.median(xs)


# ---------------------------------------------------------------------------- HTTP relays


def test_a_trickling_sandbox_does_not_starve_the_event_loop(
    gw: Gw, caplog: pytest.LogCaptureFixture
) -> None:
    before = gw.health_latencies()
    got = {"bytes": 0}
    stop = threading.Event()

    def read_trickle() -> None:
        with httpx.Client(base_url=gw.url, timeout=30, trust_env=False) as c:
            with c.stream("GET", gw.path(3000) + "/") as r:
                for chunk in r.iter_raw():
                    got["bytes"] += len(chunk)
                    if stop.is_set():
                        return

    ended = len(gw.servers[3000].ended)
    reader = threading.Thread(target=read_trickle, daemon=True)
    caplog.set_level(logging.INFO)
    reader.start()
    try:
        deadline = time.monotonic() + 10
        # (1-byte chunks: ~10k/s on a loaded 2-core host, ~20k/s on a quiet one)
        while got["bytes"] < 30_000 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got["bytes"] >= 30_000, "the trickle never reached the client"
        during = gw.health_latencies()
    finally:
        stop.set()
        reader.join(10)
    # Other requests are served while the relay runs flat out (on main they hung until the
    # client went away: the relay never yielded to the event loop).
    assert _p50(during) < 3 * _p50(before) + 0.02, (before, during)
    assert max(during) < 1.0, during
    # The client left: the relay ends and the gateway hangs up on the sandbox's server.
    assert gw.servers[3000].wait_ended(ended + 1, 5), "the upstream connection outlived the client"
    time.sleep(0.3)
    repeated = [r for r in caplog.records if "socket.send() raised" in r.getMessage()]
    assert len(repeated) < 5, f"{len(repeated)} repeated warnings"


def test_a_quiet_upstream_ends_after_the_idle_timeout(gw: Gw) -> None:
    ended = len(gw.servers[3001].ended)
    t0 = time.monotonic()
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as c:
        with c.stream("GET", gw.path(3001) + "/") as r:
            assert r.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                b"".join(r.iter_raw())  # truncated: the chunked body never ends properly
    waited = time.monotonic() - t0
    assert LIMITS.idle_timeout <= waited < LIMITS.idle_timeout + 3
    assert gw.servers[3001].wait_ended(ended + 1, 3)


def test_a_body_the_sandbox_never_reads_is_let_go_when_the_client_leaves(gw: Gw) -> None:
    ended = len(gw.servers[3002].ended)
    client = socket.create_connection(("127.0.0.1", gw.port))
    client.sendall(
        f"POST {gw.path(3002)}/up HTTP/1.1\r\nHost: x\r\nContent-Length: {10**10}\r\n\r\n".encode()
    )
    client.setblocking(False)
    block = b"\0" * 65536
    stuck_since = None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            client.send(block)
            stuck_since = None
        except BlockingIOError:
            stuck_since = stuck_since or time.monotonic()
            if time.monotonic() - stuck_since > 0.5:
                break  # every buffer on the way is full
            time.sleep(0.02)
        except OSError:
            break  # the gateway already gave up on it
    client.close()
    # Both of the gateway's descriptors for it go: the sandbox's side sees the hang-up.
    assert gw.servers[3002].wait_ended(ended + 1, LIMITS.write_timeout + 5)


def test_a_request_with_two_framings_is_400(gw: Gw) -> None:
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as s:
        s.sendall(
            f"POST {gw.path(3002)}/ HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
            "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n".encode()
        )
        answer = s.recv(65536).decode("latin-1")
    assert answer.startswith("HTTP/1.1 400"), answer[:300]


@pytest.mark.parametrize("path", sorted(LIES))
def test_an_answer_that_is_not_http_is_502(gw: Gw, path: str) -> None:
    if not gw.fast and path in LENIENT:
        pytest.skip("h11 takes this answer leniently (see LENIENT)")
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as c:
        r = c.get(gw.path(3005) + path)
        assert r.status_code == 502, (r.status_code, r.headers, r.content[:200])
        assert r.json()["code"] == "upstream_error"
        assert "forged" not in str(r.headers) and "set-cookie" not in r.headers
        # The connection goes on: the next request gets its own answer.
        assert c.get(gw.path(3005) + "/next").content == b"fine"


@pytest.mark.parametrize("path", sorted(BROKEN_BODIES))
def test_a_body_cut_short_or_malformed_reaches_the_client_cut_short(gw: Gw, path: str) -> None:
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as c:
        with c.stream("GET", gw.path(3005) + path) as r:
            assert r.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                r.read()


@pytest.mark.parametrize("path", sorted(SMUGGLE))
def test_bytes_after_an_answer_never_answer_the_next_request(gw: Gw, path: str) -> None:
    if not gw.fast:
        pytest.skip("h11 reads them as the answer to the next request (see LENIENT)")
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        request = f"GET {gw.path(3005)}{{}} HTTP/1.1\r\nHost: x\r\n\r\n"
        sock.sendall(request.format(path).encode())
        time.sleep(0.3)  # the forged answer has arrived at the gateway by now
        sock.sendall(request.format("/next").encode())
        seen = b""
        while not (seen.endswith(b"fine") or b"forged" in seen):
            chunk = sock.recv(65536)
            if not chunk:
                break
            seen += chunk
    assert b"forged" not in seen, seen
    assert seen.count(b"HTTP/1.1 200") == 2 and seen.endswith(b"fine"), seen


def test_relays_are_capped_per_sandbox_and_per_tenant(gw: Gw) -> None:
    clients = [httpx.Client(base_url=gw.url, timeout=10, trust_env=False) for _ in range(6)]
    streams = []
    try:
        for c in clients[: LIMITS.per_sandbox]:
            s = c.stream("GET", gw.path(3001) + "/")
            streams.append(s)
            assert s.__enter__().status_code == 200
        over = clients[3].get(gw.path(3001) + "/")
        assert over.status_code == 503
        assert over.json()["code"] == "gateway_busy"
        assert "per-sandbox" in over.json()["message"]
        # The tenant's other sandbox gets what is left of the tenant's share, then no more.
        s = clients[4].stream("GET", gw.path(3001, BOX2) + "/")
        streams.append(s)
        assert s.__enter__().status_code == 200
        over = clients[5].get(gw.path(3001, BOX2) + "/")
        assert over.status_code == 503 and "per-tenant" in over.json()["message"]
    finally:
        for s in streams:
            s.__exit__(None, None, None)
        for c in clients:
            c.close()
    # Slots come back once the relays end.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as c:
            with c.stream("GET", gw.path(3001) + "/") as r:
                if r.status_code == 200:
                    return
        time.sleep(0.1)
    pytest.fail("relay slots were not given back")


# ---------------------------------------------------------------------------- WebSocket relays


def _ws(gw: Gw, port: int) -> Any:
    return ws_connect(f"ws://127.0.0.1:{gw.port}{gw.path(port)}/", open_timeout=5)


def test_a_ping_flood_is_cut_off(gw: Gw) -> None:
    ended = len(gw.servers[3003].ended)
    t0 = time.monotonic()
    with _ws(gw, 3003) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
    assert time.monotonic() - t0 < 3
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011
    assert "pings" in closed.value.rcvd.reason
    assert gw.servers[3003].wait_ended(ended + 1, 5)
    assert _p50(gw.health_latencies(5)) < 0.2


def test_a_sandbox_that_stops_reading_ends_the_websocket(gw: Gw) -> None:
    ended = len(gw.servers[3004].ended)
    t0 = time.monotonic()
    with _ws(gw, 3004) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            while time.monotonic() - t0 < 20:
                ws.send(b"x" * 65536)
                time.sleep(0.005)
            ws.recv(timeout=5)
    assert time.monotonic() - t0 < LIMITS.write_timeout + 8
    rcvd = closed.value.rcvd
    assert rcvd is None or rcvd.code == 1011, rcvd
    assert gw.servers[3004].wait_ended(ended + 1, 5)


def test_an_idle_websocket_is_closed(gw: Gw) -> None:
    t0 = time.monotonic()
    with _ws(gw, 3004) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    waited = time.monotonic() - t0
    assert LIMITS.idle_timeout <= waited < LIMITS.idle_timeout + 4
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
