"""The port gateway against real servers: an upstream app on loopback stands in for a server in
a sandbox, and the gateway runs under uvicorn like the API server does."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect as ws_connect
from websockets.typing import Subprotocol

from agentbox.core import ports
from agentbox.server import gateway as gateway_module
from agentbox.server.fastpath import fast_protocol
from agentbox.server.gateway import PortGateway, PortTarget, _ws_authority

try:
    from ._asgi_server import serve
except ImportError:
    from _asgi_server import serve  # type: ignore[no-redef]

SANDBOX = "sbx_0123456789abcdef"
PUBLIC = "sbx_fedcba9876543210"
TOKEN = "tok-0123456789-secret"
PORT = 3000  # the port "in the sandbox"; the connect callback maps it to the upstream
CLOSED_PORT = 3001  # mapped to a loopback port nothing listens on
HANGING_PORT = 3002  # connecting never completes

# ---------------------------------------------------------------------------- servers


@dataclass
class Upstream:
    """What the server "in the sandbox" saw."""

    chunk_seen: threading.Event = field(default_factory=threading.Event)
    upload_started: threading.Event = field(default_factory=threading.Event)
    events_closed: threading.Event = field(default_factory=threading.Event)
    ws_close_codes: list[int] = field(default_factory=list)
    ws_closed: threading.Event = field(default_factory=threading.Event)


def upstream_app(seen: Upstream) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        return JSONResponse(
            {
                "method": request.method,
                "path": request.url.path,
                "raw_path": request.scope["raw_path"].decode(),
                "query": request.scope["query_string"].decode(),
                "headers": [[k.decode(), v.decode()] for k, v in request.scope["headers"]],
                "body": len(body),
            }
        )

    async def chunks(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            yield b"chunk 1\n"
            # Chunk 3 only exists once the client has chunk 1: a buffering proxy deadlocks here.
            for _ in range(500):
                if seen.chunk_seen.is_set():
                    break
                await asyncio.sleep(0.01)
            yield b"chunk 2\n" if seen.chunk_seen.is_set() else b"client never saw chunk 1\n"
            await asyncio.sleep(0.05)
            yield b"chunk 3\n"

        return StreamingResponse(body(), media_type="text/plain")

    async def events(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            try:
                n = 0
                while True:
                    yield f"data: {n}\n\n".encode()
                    n += 1
                    await asyncio.sleep(0.05)
            finally:
                seen.events_closed.set()

        return StreamingResponse(body(), media_type="text/event-stream")

    async def upload(request: Request) -> JSONResponse:
        total, digest = 0, hashlib.sha256()
        async for chunk in request.stream():
            total += len(chunk)
            digest.update(chunk)
            if total >= 2**20:
                seen.upload_started.set()
        return JSONResponse({"bytes": total, "sha256": digest.hexdigest()})

    async def ws_echo(ws: WebSocket) -> None:
        offered = ws.scope.get("subprotocols") or []
        await ws.accept(subprotocol="echo.v1" if "echo.v1" in offered else None)
        try:
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    seen.ws_close_codes.append(message.get("code", 0))
                    return
                if message.get("text") == "headers":
                    headers = [[k.decode(), v.decode()] for k, v in ws.scope["headers"]]
                    path = ws.scope["path"] + "?" + ws.scope["query_string"].decode()
                    await ws.send_text(json.dumps({"headers": headers, "path": path}))
                elif message.get("text") == "close-me":
                    await ws.close(4001, "bye")
                    return
                elif message.get("text") is not None:
                    await ws.send_text(message["text"])
                else:
                    await ws.send_bytes(message["bytes"])
        except WebSocketDisconnect as e:
            seen.ws_close_codes.append(e.code)
        finally:
            seen.ws_closed.set()

    async def set_cookies(request: Request) -> Response:
        response = Response(b"ok")
        for value in request.query_params.getlist("set"):
            response.raw_headers.append((b"set-cookie", value.encode()))
        return response

    async def ws_deny(ws: WebSocket) -> None:
        await ws.close()  # before accepting: uvicorn answers the upgrade with 403

    return Starlette(
        routes=[
            Route("/chunks", chunks),
            Route("/set-cookies", set_cookies),
            Route("/events", events),
            Route("/upload", upload, methods=["POST", "PUT"]),
            WebSocketRoute("/ws", ws_echo),
            WebSocketRoute("/ws-deny", ws_deny),
            Route("/{path:path}", echo, methods=["GET", "POST", "PUT", "DELETE", "HEAD"]),
        ]
    )


@dataclass
class Gateway:
    port: int
    upstream_port: int
    seen: Upstream
    connects: list[tuple[str, int]]
    audit: list[tuple[str, int, str, int]]
    gateway: PortGateway
    fast: bool

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def host(self, sandbox: str = SANDBOX, port: int = PORT) -> str:
        return f"{port}-{sandbox}.localhost:{self.port}"

    def path(self, rest: str = "", sandbox: str = SANDBOX, port: int = PORT) -> str:
        return f"{ports.port_path_prefix(sandbox, port)}{rest}"


@pytest.fixture(scope="module", params=["asgi", "fast"])
def gw(request: pytest.FixtureRequest) -> Iterator[Gateway]:
    """The gateway under uvicorn, each test twice: requests the ASGI way only, and with the
    server's protocol running the fast path (server/fastpath.py) in front, as the API server
    does."""
    fast = request.param == "fast"
    seen = Upstream()
    connects: list[tuple[str, int]] = []
    audit: list[tuple[str, int, str, int]] = []
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]  # nothing listens once the probe is closed

    with serve(upstream_app(seen)) as upstream_port:
        targets = {
            SANDBOX: PortTarget(SANDBOX, "acme", TOKEN, public=False),
            PUBLIC: PortTarget(PUBLIC, "acme", "another-token", public=True),
        }
        keys = {"key-acme": "acme", "key-other": "other"}

        async def lookup(sandbox_id: str) -> PortTarget | None:
            return targets.get(sandbox_id)

        async def tenant_of_key(key: str) -> str | None:
            return keys.get(key)

        async def connect(sandbox_id: str, port: int) -> socket.socket:
            connects.append((sandbox_id, port))
            if port == HANGING_PORT:
                await asyncio.sleep(3600)
            real = {PORT: upstream_port, CLOSED_PORT: closed_port}[port]
            sock = socket.socket()
            sock.setblocking(False)
            try:
                await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", real))
            except BaseException:
                sock.close()
                raise
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

        @api.get("/v1/sandboxes/{sandbox_id}/files")
        async def files(sandbox_id: str) -> dict[str, str]:
            return {"api": sandbox_id}

        gateway = PortGateway(
            api,
            domain="LocalHost",
            lookup=lookup,
            tenant_of_key=tenant_of_key,
            connect=connect,
            on_access=lambda *a: audit.append(a),
            lookup_now=targets.get if fast else None,
            tenant_of_key_now=keys.get if fast else None,
        )
        http = fast_protocol(lambda: gateway) if fast else "h11"
        # uvicorn would otherwise take the client's address from a loopback peer's
        # X-Forwarded-For, which the tests send on purpose.
        with serve(gateway, proxy_headers=False, http=http) as port:
            yield Gateway(port, upstream_port, seen, connects, audit, gateway, fast)


def client(gw: Gateway, **kw: Any) -> httpx.Client:
    return httpx.Client(base_url=gw.url, timeout=10, trust_env=False, **kw)


def header(echo: dict[str, Any], name: str) -> list[str]:
    return [v for k, v in echo["headers"] if k == name]


# ---------------------------------------------------------------------------- core/ports.py


def test_sign_and_check() -> None:
    exp = int(time.time()) + 60
    sig = ports.sign(TOKEN, SANDBOX, PORT, exp)
    assert "=" not in sig and len(sig) == 43
    assert ports.check_signature(TOKEN, SANDBOX, PORT, str(exp), sig, time.time()) is None
    # No URL lives for ever, nor longer than the maximum.
    never = ports.check_signature(TOKEN, SANDBOX, PORT, "0", ports.sign(TOKEN, SANDBOX, PORT, 0), 1)
    assert never is not None and "never expires" in never
    far = int(time.time()) + ports.MAX_LIFETIME + 3600
    too_long = ports.check_signature(
        TOKEN, SANDBOX, PORT, str(far), ports.sign(TOKEN, SANDBOX, PORT, far), time.time()
    )
    assert too_long is not None and "maximum" in too_long
    bad = "bad signature"
    assert ports.check_signature(TOKEN, SANDBOX, PORT + 1, str(exp), sig, time.time()) == bad
    assert ports.check_signature("other", SANDBOX, PORT, str(exp), sig, time.time()) == bad
    assert ports.check_signature(TOKEN, PUBLIC, PORT, str(exp), sig, time.time()) == bad
    for exp_text, s in [
        ("", sig),
        ("-1", sig),
        ("1e9", sig),
        (str(exp), ""),
        (str(exp), "é" * 43),
        (str(exp), sig + "A"),
        (str(exp) + "\0", sig),
        ("9" * 400, sig),
    ]:
        assert ports.check_signature(TOKEN, SANDBOX, PORT, exp_text, s, time.time()) == bad
    old = ports.sign(TOKEN, SANDBOX, PORT, 1_700_000_000)
    reason = ports.check_signature(TOKEN, SANDBOX, PORT, "1700000000", old, time.time())
    assert reason == "signed URL expired at 2023-11-14T22:13:20Z"


def test_parse_port_host() -> None:
    parse = ports.parse_port_host
    assert parse("3000-sbx_0123abcd.localhost:8000", "localhost") == (3000, "sbx_0123abcd")
    assert parse("8080-SBX_AB.Example.COM", ".example.com") == (8080, "sbx_ab")
    assert parse("1-a.example.com.", "example.com") == (1, "a")
    assert parse("65535-sbx-x_y.example.com:443", "example.com") == (65535, "sbx-x_y")
    for host in [
        "localhost:8000",
        "3000-sbx.localhost.evil.com",
        "3000-sbx.evillocalhost",
        "a.3000-sbx.localhost",
        "0-sbx.localhost",
        "65536-sbx.localhost",
        "03000-sbx.localhost",
        "-sbx.localhost",
        "3000-.localhost",
        "3000.localhost",
        "x3000-sbx.localhost",
        "3000-sb%78.localhost",
        "3000-" + "a" * 65 + ".localhost",
        "[::1]:8000",
        "",
    ]:
        assert parse(host, "localhost") is None, host
    assert parse("3000-sbx.localhost", "") is None


def test_parse_port_path() -> None:
    parse = ports.parse_port_path
    assert parse(f"/v1/sandboxes/{SANDBOX}/ports/3000") == (3000, SANDBOX, "/")
    assert parse(f"/v1/sandboxes/{SANDBOX}/ports/3000/") == (3000, SANDBOX, "/")
    assert parse(f"/v1/sandboxes/{SANDBOX}/ports/3000/a/b") == (3000, SANDBOX, "/a/b")
    for path in [
        "/v1/sandboxes/x/ports/0/",
        "/v1/sandboxes/x/ports/70000",
        "/v1/sandboxes/x/ports",
        "/v1/sandboxes/x/ports/80x",
        "/v1/sandboxes/x/files",
        "/v1/sandboxes//ports/80",
    ]:
        assert parse(path) is None, path


# ---------------------------------------------------------------------------- routing


def test_host_routed_reaches_the_sandbox_without_our_credentials(gw: Gateway) -> None:
    with client(gw) as c:
        r = c.get(
            "/any/pa%20th?b=1&abx_other=2",
            headers={
                "Host": gw.host(),
                "X-Access-Token": TOKEN,
                "X-API-Key": "key-acme",
                "Cookie": "theme=dark; abx_port=1.x; lang=en",
                "Connection": "keep-alive, X-Hop",
                "X-Hop": "must not pass",
                "Proxy-Authorization": "Basic Zm9v",
                "X-Forwarded-For": "10.0.0.1",
                "X-Forwarded-Prefix": "/spoofed",
                "X-Custom": "kept",
            },
        )
    assert r.status_code == 200, r.text
    echo = r.json()
    assert (echo["method"], echo["path"], echo["raw_path"]) == ("GET", "/any/pa th", "/any/pa%20th")
    assert echo["query"] == "b=1&abx_other=2"
    assert header(echo, "host") == [gw.host()]
    assert header(echo, "x-forwarded-host") == [gw.host()]
    assert header(echo, "x-forwarded-proto") == ["http"]
    assert header(echo, "x-forwarded-for") == ["10.0.0.1, 127.0.0.1"]
    assert header(echo, "cookie") == ["theme=dark; lang=en"]
    assert header(echo, "x-custom") == ["kept"]
    names = {k for k, _ in echo["headers"]}
    for gone in (
        "x-access-token",
        "x-api-key",
        "x-hop",
        "proxy-authorization",
        "x-forwarded-prefix",
    ):
        assert gone not in names


def test_path_routed_rewrites_the_path(gw: Gateway) -> None:
    with client(gw, headers={"X-Access-Token": TOKEN}) as c:
        r = c.post(gw.path("/deep/x%2Fy?q=1&q=2"), content=b"12345")
        bare = c.get(gw.path("?z=3"))
    assert r.status_code == 200, r.text
    echo = r.json()
    assert (echo["method"], echo["raw_path"], echo["query"], echo["body"]) == (
        "POST",
        "/deep/x%2Fy",
        "q=1&q=2",
        5,
    )
    assert header(echo, "x-forwarded-prefix") == [gw.path()]
    assert header(echo, "host") == [f"127.0.0.1:{gw.port}"]
    assert bare.status_code == 200 and (bare.json()["path"], bare.json()["query"]) == ("/", "z=3")


def test_other_paths_reach_the_api(gw: Gateway) -> None:
    with client(gw) as c:
        assert c.get("/v1/health").json() == {"ok": True}
        assert c.get(f"/v1/sandboxes/{SANDBOX}/files").json() == {"api": SANDBOX}
        # Not a port: the API answers (with its own 404).
        assert c.get(f"/v1/sandboxes/{SANDBOX}/ports/0/x").status_code == 404
        assert c.get("/v1/health", headers={"Host": f"localhost:{gw.port}"}).json() == {"ok": True}


# ---------------------------------------------------------------------------- auth


def test_private_port_needs_credentials(gw: Gateway) -> None:
    with client(gw) as c:
        r = c.get(gw.path("/"))
        assert r.status_code == 401
        body = r.json()
        assert body["code"] == "unauthorized"
        assert "X-Access-Token" in body["message"] and "get_url(3000)" in body["message"]
        assert c.get(gw.path("/"), headers={"X-Access-Token": "wrong"}).status_code == 401
        assert c.get("/", headers={"Host": gw.host()}).status_code == 401
        assert c.get(gw.path("/"), headers={"X-API-Key": "not-a-key"}).status_code == 401


def test_api_key_of_the_tenant(gw: Gateway) -> None:
    with client(gw) as c:
        assert c.get(gw.path("/"), headers={"X-API-Key": "key-acme"}).status_code == 200
        other = c.get(gw.path("/"), headers={"X-API-Key": "key-other"})
        missing = c.get(
            gw.path("/", sandbox="sbx_0000000000000000"), headers={"X-API-Key": "key-acme"}
        )
    # Another tenant's sandbox looks exactly like a missing one.
    assert other.status_code == missing.status_code == 404
    assert other.json()["code"] == "not_found"


def test_public_port_needs_nothing(gw: Gateway) -> None:
    with client(gw) as c:
        assert c.get(gw.path("/", sandbox=PUBLIC)).status_code == 200
        assert c.get("/x", headers={"Host": gw.host(PUBLIC)}).json()["path"] == "/x"


def test_signed_url_sets_a_cookie_only_for_host_routed_ports(gw: Gateway) -> None:
    exp = int(time.time()) + 60
    sig = ports.sign(TOKEN, SANDBOX, PORT, exp)
    with client(gw, cookies={"theme": "dark"}) as c:
        r = c.get(gw.path(f"/page?keep=1&abx_exp={exp}&abx_sig={sig}"))
        assert r.status_code == 200, r.text
        assert r.json()["query"] == "keep=1"
        assert all("abx" not in v for _, v in r.json()["headers"])
        # Path-routed ports share the API's origin: no cookie, the next request needs the
        # signature again.
        assert "set-cookie" not in r.headers
        assert c.get(gw.path("/next")).status_code == 401
    # Host-routed: the cookie is for the whole (port) host.
    with client(gw) as c:
        r = c.get(f"/?abx_exp={exp}&abx_sig={sig}", headers={"Host": gw.host()})
        assert r.status_code == 200 and "Path=/;" in r.headers["set-cookie"] + ";"
        cookie = r.headers["set-cookie"]
        assert cookie.startswith(f"abx_port={exp}.{sig};")
        assert "HttpOnly" in cookie and "SameSite=Lax" in cookie
        ok = c.get("/", headers={"Host": gw.host(), "Cookie": f"abx_port={exp}.{sig}; theme=dark"})
        assert ok.status_code == 200
        assert header(ok.json(), "cookie") == ["theme=dark"]


def test_expired_and_bad_signatures_are_forbidden(gw: Gateway) -> None:
    past = int(time.time()) - 10
    expired = ports.sign(TOKEN, SANDBOX, PORT, past)
    for_other_port = ports.sign(TOKEN, SANDBOX, PORT + 1, past + 100)
    with client(gw) as c:
        r = c.get(gw.path(f"/?abx_exp={past}&abx_sig={expired}"))
        assert r.status_code == 403 and r.json()["code"] == "forbidden"
        assert "expired at" in r.json()["message"]
        for query in [
            f"abx_exp={past + 100}&abx_sig={for_other_port}",
            f"abx_exp={past + 100}&abx_sig=AAAA",
            "abx_sig=%00%ff",
            "abx_exp=99999999999",
        ]:
            r = c.get(gw.path(f"/?{query}"))
            assert r.status_code == 403, query
            assert r.json()["detail"]["reason"] == "bad signature"
        forged = c.get(gw.path("/"), headers={"Cookie": f"abx_port={past + 100}.{for_other_port}"})
        assert forged.status_code == 403


# ---------------------------------------------------------------------------- upstream


def test_nothing_listening_is_502_and_unknown_sandbox_404(gw: Gateway) -> None:
    with client(gw, headers={"X-Access-Token": TOKEN}) as c:
        r = c.get(gw.path("/", port=CLOSED_PORT))
        assert r.status_code == 502
        assert r.json()["code"] == "port_not_open"
        assert "nothing is listening on port 3001" in r.json()["message"]
    with client(gw, headers={"X-API-Key": "key-acme"}) as c:
        assert c.get(gw.path("/", sandbox="sbx_ffffffffffffffff")).status_code == 404
    assert (SANDBOX, CLOSED_PORT, "GET", 502) in gw.audit


def test_without_credentials_a_live_sandbox_and_an_unknown_id_look_the_same(gw: Gateway) -> None:
    """No existence oracle: whatever a caller without valid credentials sends, a running
    sandbox's private port and an id that does not exist answer alike."""
    unknown = "sbx_0123456789abcdee"
    exp = int(time.time()) + 60
    attempts: list[dict[str, Any]] = [
        {},
        {"headers": {"X-Access-Token": "guess"}},
        {"headers": {"X-API-Key": "not-a-key"}},
        {"headers": {"Cookie": f"abx_port={exp}.{'A' * 43}"}},
        {"params": {"abx_exp": str(exp), "abx_sig": "A" * 43}},
    ]
    with client(gw) as c:
        for kw in attempts:
            live = c.get(gw.path("/x"), **kw)
            missing = c.get(gw.path("/x", sandbox=unknown), **kw)
            assert live.status_code == missing.status_code, kw
            assert live.status_code in (401, 403), kw
            same = live.text.replace(SANDBOX, unknown)
            assert same == missing.text, (kw, live.text, missing.text)
            host_live = c.get("/", headers={"Host": gw.host(), **kw.get("headers", {})})
            host_missing = c.get("/", headers={"Host": gw.host(unknown), **kw.get("headers", {})})
            assert host_live.status_code == host_missing.status_code, kw


def test_cookies_from_a_sandbox_stay_on_its_port(gw: Gateway) -> None:
    cookies = [
        "sid=1; Domain=localhost; Path=/; HttpOnly",
        "pref=2; path=/app; SameSite=Strict",
        "plain=3",
        "up=4; Path=/../../v1",
        "abx_port=1.forged; Path=/",
    ]
    with client(gw, headers={"X-Access-Token": TOKEN}) as c:
        r = c.get(gw.path("/set-cookies"), params=[("set", x) for x in cookies])
        got = r.headers.get_list("set-cookie")
        prefix = ports.port_path_prefix(SANDBOX, PORT)
        assert got == [
            f"sid=1; HttpOnly; Path={prefix}/",
            f"pref=2; SameSite=Strict; Path={prefix}/app",
            f"plain=3; Path={prefix}/",
            f"up=4; Path={prefix}/",
        ], got
        h = c.get("/set-cookies", params=[("set", x) for x in cookies], headers={"Host": gw.host()})
        assert h.headers.get_list("set-cookie") == [
            "sid=1; HttpOnly; Path=/",
            "pref=2; SameSite=Strict; Path=/app",
            "plain=3",
            "up=4; Path=/../../v1",
        ]


def test_connect_timeout_is_504(gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway_module, "CONNECT_TIMEOUT", 0.2)
    with client(gw, headers={"X-Access-Token": TOKEN}) as c:
        r = c.get(gw.path("/", port=HANGING_PORT))
    assert r.status_code == 504 and r.json()["code"] == "upstream_timeout"


def test_a_body_sent_while_the_port_is_dialled_is_not_buffered(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gateway_module, "CONNECT_TIMEOUT", 3.0)
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        head = (
            f"POST {gw.path('/up', port=HANGING_PORT)} HTTP/1.1\r\nHost: x\r\n"
            f"X-Access-Token: {TOKEN}\r\nContent-Length: {10**12}\r\n\r\n"
        )
        sock.sendall(head.encode())
        sock.setblocking(False)
        block, sent = b"\0" * 65536, 0
        deadline = time.monotonic() + 2.0  # inside the connect timeout
        while time.monotonic() < deadline:
            try:
                sent += sock.send(block)
            except BlockingIOError:
                time.sleep(0.01)
        sock.setblocking(True)
        sock.settimeout(10)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
    # Kernel buffers on both sides hold a few MiB (4-7 sent here); a gateway that took it all
    # holds what the client can send in 2 s (45 MiB under load, before the fix).
    assert sent < 24 * 2**20, f"{sent >> 20} MiB taken while the port was being dialled"
    assert answer.startswith(b"HTTP/1.1 504"), answer[:200]


def test_keep_alive_reuses_upstream_connections(gw: Gateway) -> None:
    before = len(gw.connects)
    with client(gw, headers={"X-Access-Token": TOKEN}) as c:
        for i in range(30):
            assert c.get(gw.path(f"/n/{i}")).status_code == 200
    with client(gw, headers={"X-Access-Token": TOKEN}) as c:  # another client, same pool
        assert c.get(gw.path("/again")).status_code == 200
    assert len(gw.connects) - before <= 2


def test_response_streams_as_it_is_produced(gw: Gateway) -> None:
    gw.seen.chunk_seen.clear()
    with client(gw, headers={"X-Access-Token": TOKEN}) as c:
        with c.stream("GET", gw.path("/chunks")) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines) == "chunk 1"
            gw.seen.chunk_seen.set()
            assert list(lines) == ["chunk 2", "chunk 3"]


def test_event_stream_ends_upstream_when_the_client_leaves(gw: Gateway) -> None:
    gw.seen.events_closed.clear()
    with client(gw, headers={"X-Access-Token": TOKEN}) as c:
        with c.stream("GET", gw.path("/events")) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            assert next(lines) == "data: 0"
            assert [next(lines), next(lines)] == ["", "data: 1"]
    assert gw.seen.events_closed.wait(5), "the upstream stream outlived the client"


def test_request_body_streams_to_the_sandbox(gw: Gateway) -> None:
    gw.seen.upload_started.clear()
    piece = bytes(range(256)) * 4096  # 1 MiB
    digest = hashlib.sha256()

    def body() -> Iterator[bytes]:
        for i in range(20):
            if i == 4:
                # The upstream has bytes before the client finished: nothing buffered the body.
                assert gw.seen.upload_started.wait(5), "the upload was buffered"
            digest.update(piece)
            yield piece

    with client(gw, headers={"X-Access-Token": TOKEN}) as c:
        r = c.post(gw.path("/upload"), content=body())
    assert r.status_code == 200, r.text
    assert r.json() == {"bytes": 20 * 2**20, "sha256": digest.hexdigest()}


def test_plain_requests_take_the_fast_path_and_the_rest_the_asgi_way(gw: Gateway) -> None:
    def relayed(send: Any) -> int:
        before = gw.gateway.fast_relayed
        send()
        return gw.gateway.fast_relayed - before

    token = {"X-Access-Token": TOKEN}
    with client(gw) as c:
        plain = relayed(lambda: c.get(gw.path("/a"), headers=token).raise_for_status())
        keyed = relayed(lambda: c.get(gw.path("/a"), headers={"X-API-Key": "key-acme"}))
        public = relayed(lambda: c.get(gw.path("/a", sandbox=PUBLIC)).raise_for_status())
        sized = relayed(lambda: c.post(gw.path("/a"), headers=token, content=b"x" * 10))
        # The rest: refusals, chunked bodies, signed URLs, the API.
        refused = relayed(lambda: c.get(gw.path("/a"), headers={"X-Access-Token": "no"}))
        other = relayed(lambda: c.get(gw.path("/a"), headers={"X-API-Key": "key-other"}))
        chunked = relayed(
            lambda: c.post(gw.path("/a"), headers=token, content=iter([b"x"])).raise_for_status()
        )
        api = relayed(lambda: c.get("/v1/health").raise_for_status())
    assert (refused, other, chunked, api) == (0, 0, 0, 0)
    assert (plain, keyed, public, sized) == ((1, 1, 1, 1) if gw.fast else (0, 0, 0, 0))


def test_api_and_port_requests_alternate_on_one_connection(gw: Gateway) -> None:
    """The fast path hands a connection to h11 and takes it back between requests; pipelined
    requests are answered in order."""
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        file = sock.makefile("rb")

        def answer() -> tuple[int, bytes]:
            status = int(file.readline().split()[1])
            length = 0
            while (line := file.readline()) != b"\r\n":
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            return status, file.read(length)

        port = f"GET {gw.path('/p/{}')} HTTP/1.1\r\nHost: x\r\nX-Access-Token: {TOKEN}\r\n\r\n"
        api = "GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n"
        for i in range(3):
            sock.sendall(port.format(i).encode())
            status, body = answer()
            assert status == 200 and json.loads(body)["path"] == f"/p/{i}"
            sock.sendall(api.encode())
            assert answer() == (200, b'{"ok":true}')
        # Pipelined: port, API, port in one write.
        sock.sendall((port.format(7) + api + port.format(8)).encode())
        first, second, third = answer(), answer(), answer()
    assert json.loads(first[1])["path"] == "/p/7" and second == (200, b'{"ok":true}')
    assert json.loads(third[1])["path"] == "/p/8"


def test_a_sized_body_streams_to_the_sandbox(gw: Gateway) -> None:
    data = bytes(range(256)) * (40 * 4096)  # 40 MiB, sent with its Content-Length
    with client(gw, headers={"X-Access-Token": TOKEN}) as c:
        r = c.put(gw.path("/upload"), content=data)
        again = c.get(gw.path("/after"))  # the same connection, kept alive
    assert r.status_code == 200, r.text
    assert r.json() == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert again.status_code == 200 and again.json()["path"] == "/after"


def test_head_and_no_content_answers_have_no_body(gw: Gateway) -> None:
    with client(gw, headers={"X-Access-Token": TOKEN}) as c:
        head = c.head(gw.path("/x"))
        after = c.get(gw.path("/y"))
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) > 0
    assert after.json()["path"] == "/y"


# ---------------------------------------------------------------------------- WebSocket


def ws_url(gw: Gateway, rest: str = "/ws", sandbox: str = SANDBOX) -> str:
    return f"ws://127.0.0.1:{gw.port}{gw.path(rest, sandbox=sandbox)}"


def test_websocket_echo_subprotocol_and_close_codes(gw: Gateway) -> None:
    gw.seen.ws_close_codes.clear()
    gw.seen.ws_closed.clear()
    with ws_connect(
        ws_url(gw, "/ws?x=1"),
        additional_headers={"X-Access-Token": TOKEN, "Origin": "http://app.example"},
        subprotocols=[Subprotocol("echo.v1")],
    ) as ws:
        assert ws.subprotocol == "echo.v1"
        ws.send("hello")
        assert ws.recv(timeout=5) == "hello"
        ws.send(b"\x00\x01\xff")
        assert ws.recv(timeout=5) == b"\x00\x01\xff"
        ws.send("headers")
        seen = json.loads(ws.recv(timeout=5))
        assert seen["path"] == "/ws?x=1"
        names = {k for k, _ in seen["headers"]}
        assert "x-access-token" not in names
        assert ["origin", "http://app.example"] in seen["headers"]
        assert ["x-forwarded-prefix", gw.path()] in seen["headers"]
        ws.close(4002, "done here")
    assert gw.seen.ws_closed.wait(5)
    assert gw.seen.ws_close_codes == [4002]

    # The sandbox's server closing reaches the client with its code and reason.
    with ws_connect(ws_url(gw), additional_headers={"X-Access-Token": TOKEN}) as ws:
        assert ws.subprotocol is None
        ws.send("close-me")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd is not None
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4001, "bye")


def test_websocket_host_routed_with_a_signed_url(gw: Gateway) -> None:
    exp = int(time.time()) + 60
    sig = ports.sign(TOKEN, SANDBOX, PORT, exp)
    uri = f"ws://{gw.host()}/ws?abx_exp={exp}&abx_sig={sig}"
    with ws_connect(uri, sock=socket.create_connection(("127.0.0.1", gw.port))) as ws:
        assert ws.response is not None
        assert ws.response.headers["Set-Cookie"].startswith(f"abx_port={exp}.{sig};")
        ws.send("headers")
        seen = json.loads(ws.recv(timeout=5))
        assert seen["path"] == "/ws?"
        assert ["host", gw.host()] in seen["headers"]


def test_websocket_upstream_uri_takes_only_a_plain_host() -> None:
    assert _ws_authority("3000-sbx_ab.example.com:8443") == "3000-sbx_ab.example.com:8443"
    assert _ws_authority("[::1]:80") == "[::1]:80"
    for hostile in ["a@b", "a/b", "a?b", "a#b", "a:99999", "a b", "", "a:b:c"]:
        assert _ws_authority(hostile) == "localhost", hostile


def test_websocket_refusals(gw: Gateway) -> None:
    with pytest.raises(InvalidStatus) as denied:
        ws_connect(ws_url(gw)).close()
    assert denied.value.response.status_code == 401
    assert json.loads(denied.value.response.body or b"")["code"] == "unauthorized"

    with pytest.raises(InvalidStatus) as refused:  # the sandbox's server said no
        ws_connect(ws_url(gw, "/ws-deny"), additional_headers={"X-Access-Token": TOKEN}).close()
    assert refused.value.response.status_code == 403

    with pytest.raises(InvalidStatus) as closed:
        ws_connect(
            f"ws://127.0.0.1:{gw.port}{gw.path('/ws', port=CLOSED_PORT)}",
            additional_headers={"X-Access-Token": TOKEN},
        ).close()
    assert closed.value.response.status_code == 502
    assert json.loads(closed.value.response.body or b"")["code"] == "port_not_open"

    with ws_connect(ws_url(gw, sandbox=PUBLIC)) as ws:  # public: no credentials needed
        ws.send("hi")
        assert ws.recv(timeout=5) == "hi"
    assert (SANDBOX, PORT, "WEBSOCKET", 401) in gw.audit
    assert (PUBLIC, PORT, "WEBSOCKET", 101) in gw.audit
