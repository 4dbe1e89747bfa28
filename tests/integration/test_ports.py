# ruff: noqa: E501 - the sandbox server below is a script in a string, kept compact
"""Exposed ports: a server inside a real sandbox reached through the gateway (no interface)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime

import httpx
import pytest
import websockets
from conftest import ServerHandle, create_sandbox, run

pytestmark = pytest.mark.timeout(120)

# A small HTTP/1.1 + WebSocket server in the standard library, written into the sandbox.
SERVER = r"""
import asyncio, base64, hashlib, json, os, struct, sys

async def ws(reader, writer, key, protocols):
    accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
    extra = f"Sec-WebSocket-Protocol: {protocols[0]}\r\n" if protocols else ""
    writer.write(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Accept: {accept}\r\n{extra}\r\n").encode())
    while True:
        b1, b2 = await reader.readexactly(2)
        op, n = b1 & 0x0F, b2 & 0x7F
        if n == 126: n = struct.unpack("!H", await reader.readexactly(2))[0]
        elif n == 127: n = struct.unpack("!Q", await reader.readexactly(8))[0]
        mask = await reader.readexactly(4) if b2 & 0x80 else b"\0\0\0\0"
        data = bytes(c ^ mask[i % 4] for i, c in enumerate(await reader.readexactly(n)))
        if op == 8:
            writer.write(b"\x88\x02" + data[:2]); await writer.drain(); return
        if op in (1, 2):
            out = (b"echo:" + data) if op == 1 else data[::-1]
            head = bytes([0x80 | op]) + (bytes([len(out)]) if len(out) < 126 else b"\x7e" + struct.pack("!H", len(out)))
            writer.write(head + out); await writer.drain()

async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    k, v = line.split(":", 1); headers[k.strip().lower()] = v.strip()
            if headers.get("upgrade", "").lower() == "websocket":
                protos = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
                return await ws(reader, writer, headers["sec-websocket-key"], protos)
            body = b""
            if "content-length" in headers:
                body = await reader.readexactly(int(headers["content-length"]))
            elif headers.get("transfer-encoding") == "chunked":
                while True:
                    size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                    chunk = await reader.readexactly(size + 2)
                    if size == 0: break
                    body += chunk[:-2]
            if target.startswith("/stream"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
                for i in range(3):
                    data = f"tick {i} {asyncio.get_running_loop().time():.3f}\n".encode()
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data)); await writer.drain()
                    await asyncio.sleep(0.4)
                writer.write(b"0\r\n\r\n"); await writer.drain(); continue
            out = json.dumps({"method": method, "target": target, "headers": headers,
                              "body_len": len(body), "pid": os.getpid()}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(out) + out)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def box(server: ServerHandle) -> Iterator[tuple[httpx.Client, dict, ServerHandle]]:
    key = server.make_key(f"ports-{time.monotonic_ns() % 10**9}")
    with server.client(key) as c:
        info = create_sandbox(c)
        sid = info["sandbox_id"]
        r = c.put(
            f"/v1/sandboxes/{sid}/files",
            params={"path": "/workspace/srv.py"},
            content=SERVER.encode(),
        )
        assert r.status_code in (200, 201), r.text
        run(c, sid, "nohup python3 /workspace/srv.py 8080 >/tmp/srv.log 2>&1 &", timeout=5)
        deadline = time.monotonic() + 10
        while run(
            c, sid, "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8080))\""
        ).exit_code:
            assert time.monotonic() < deadline, run(c, sid, "cat /tmp/srv.log").stdout
            time.sleep(0.1)
        yield c, info, server
        c.delete(f"/v1/sandboxes/{sid}")


def _path(info: dict, port: int = 8080, rest: str = "/") -> str:
    return f"/v1/sandboxes/{info['sandbox_id']}/ports/{port}{rest}"


def test_path_and_host_routed_with_token(box: tuple[httpx.Client, dict, ServerHandle]) -> None:
    c, info, server = box
    token = info["access_token"]
    assert token and info["domain"] == f"localhost:{server.port}"
    with httpx.Client(base_url=server.url) as anon:
        r = anon.get(_path(info, rest="/hello?x=1"), headers={"X-Access-Token": token})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["target"] == "/hello?x=1"
        assert "x-access-token" not in body["headers"] and "x-api-key" not in body["headers"]
        assert body["headers"]["x-forwarded-prefix"] == _path(info, rest="")
        host = f"8080-{info['sandbox_id']}.{info['domain']}"
        r = anon.get("/via-host", headers={"Host": host, "X-Access-Token": token})
        assert r.status_code == 200 and r.json()["target"] == "/via-host"
        # The tenant's API key works too, and is not passed on.
        r = c.get(_path(info, rest="/k"))
        assert r.status_code == 200 and "x-api-key" not in r.json()["headers"]
        # Keep-alive to the sandbox: the same server connection serves several requests.
        pids = {
            anon.get(_path(info), headers={"X-Access-Token": token}).json()["pid"] for _ in range(5)
        }
        assert len(pids) == 1


def test_private_by_default(box: tuple[httpx.Client, dict, ServerHandle]) -> None:
    c, info, server = box
    with httpx.Client(base_url=server.url) as anon:
        r = anon.get(_path(info))
        assert r.status_code == 401 and "access token" in r.json()["message"].lower()
        assert anon.get(_path(info), headers={"X-Access-Token": "wrong"}).status_code == 401
        other = server.make_key(f"other-{time.monotonic_ns() % 10**9}")
        assert anon.get(_path(info), headers={"X-API-Key": other}).status_code == 404
        assert anon.get(_path(info, port=9)).status_code == 401
        r = anon.get(_path(info, port=9), headers={"X-Access-Token": info["access_token"]})
        assert r.status_code == 502 and r.json()["code"] == "port_not_open"


def test_signed_url_and_expiry(box: tuple[httpx.Client, dict, ServerHandle]) -> None:
    c, info, server = box
    sid = info["sandbox_id"]
    r = c.post(f"/v1/sandboxes/{sid}/port-url", json={"port": 8080, "path": "/signed?a=b"})
    assert r.status_code == 200, r.text
    url = r.json()["url"]
    assert url.startswith(f"http://localhost:{server.port}/v1/sandboxes/{sid}/ports/8080/")
    # No URL without an end: an hour by default, a day at most.
    expires_at = datetime.fromisoformat(r.json()["expires_at"].replace("Z", "+00:00"))
    assert 3500 < expires_at.timestamp() - time.time() <= 3601
    too_long = c.post(
        f"/v1/sandboxes/{sid}/port-url", json={"port": 8080, "expires_in": 86400 * 2}
    )
    assert too_long.status_code == 422 and "86400" in too_long.text
    got = httpx.get(url)  # a plain client, no headers
    assert got.status_code == 200 and got.json()["target"] == "/signed?a=b"
    r = c.post(f"/v1/sandboxes/{sid}/port-url", json={"port": 8080, "expires_in": 1})
    short = r.json()["url"]
    assert httpx.get(short).status_code == 200
    time.sleep(2.1)
    expired = httpx.get(short)
    assert expired.status_code == 403 and "expired" in expired.json()["message"]
    # A signature is for one port only.
    assert httpx.get(url.replace("/ports/8080/", "/ports/8081/")).status_code == 403


def test_streaming_both_ways(box: tuple[httpx.Client, dict, ServerHandle]) -> None:
    c, info, server = box
    headers = {"X-Access-Token": info["access_token"]}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as h:
        arrivals = []
        with h.stream("GET", _path(info, rest="/stream")) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    arrivals.append(time.monotonic())
        assert len(arrivals) == 3
        assert arrivals[2] - arrivals[0] > 0.6  # each tick came when it was sent

        def body() -> Iterator[bytes]:
            for _ in range(40):
                yield b"x" * 256 * 1024

        r = h.post(_path(info, rest="/upload"), content=body())
        assert r.status_code == 200 and r.json()["body_len"] == 40 * 256 * 1024


def test_websocket(box: tuple[httpx.Client, dict, ServerHandle]) -> None:
    c, info, server = box
    base = f"ws://127.0.0.1:{server.port}{_path(info, rest='/ws')}"

    async def talk() -> tuple[str, bytes, str | None]:
        async with websockets.connect(
            base,
            additional_headers={"X-Access-Token": info["access_token"]},
            subprotocols=["chat"],  # type: ignore[list-item]
        ) as ws:
            await ws.send("hi")
            text = await ws.recv()
            await ws.send(b"\x01\x02\x03")
            data = await ws.recv()
            return str(text), bytes(data), ws.subprotocol  # type: ignore[arg-type]

    text, data, proto = asyncio.run(talk())
    assert text == "echo:hi" and data == b"\x03\x02\x01" and proto == "chat"

    async def denied() -> int:
        try:
            async with websockets.connect(base):
                return 101
        except websockets.InvalidStatus as e:
            return e.response.status_code

    assert asyncio.run(denied()) == 401


def test_public_ports(server: ServerHandle) -> None:
    key = server.make_key(f"pub-{time.monotonic_ns() % 10**9}")
    with server.client(key) as c:
        info = create_sandbox(c, network={"allow_public_traffic": True})
        sid = info["sandbox_id"]
        run(
            c,
            sid,
            "nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &",
            timeout=5,
        )
        deadline = time.monotonic() + 10
        while True:
            r = httpx.get(f"{server.url}{_path(info, port=8000)}")
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200 and "Directory listing" in r.text
        # Back to private.
        net = {"allow_public_traffic": False}
        assert c.put(f"/v1/sandboxes/{sid}/network", json=net).status_code == 200
        assert httpx.get(f"{server.url}{_path(info, port=8000)}").status_code == 401
        c.delete(f"/v1/sandboxes/{sid}")


def test_no_network_interface_for_ports(box: tuple[httpx.Client, dict, ServerHandle]) -> None:
    c, info, _ = box
    out = run(c, info["sandbox_id"], "tail -n +3 /proc/net/dev | cut -d: -f1").stdout.split()
    assert out == ["lo"]


def test_rotating_the_access_token_revokes_urls_and_the_old_token(server: ServerHandle) -> None:
    from agentbox.sdk import Sandbox

    key = server.make_key(f"rotate-{time.monotonic_ns() % 10**9}")
    with server.client(key) as c:
        info = create_sandbox(c)
        sid = info["sandbox_id"]
        run(c, sid, "nohup python3 -m http.server -b 127.0.0.1 8000 >/dev/null 2>&1 &", timeout=5)
        old_token = info["access_token"]
        deadline = time.monotonic() + 10
        with httpx.Client(base_url=server.url) as anon:
            while anon.get(_path(info, 8000), headers={"X-Access-Token": old_token}).status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            sbx = Sandbox.connect(sid, api_url=server.url, api_key=key)
            try:
                url = sbx.get_url(8000)
                assert httpx.get(url).status_code == 200
                new_token = sbx.rotate_access_token()
                assert new_token != old_token and sbx.access_token == new_token
            finally:
                sbx.close()
            assert httpx.get(url).status_code == 403
            assert anon.get(_path(info, 8000), headers={"X-Access-Token": old_token}).status_code == 401
            assert anon.get(_path(info, 8000), headers={"X-Access-Token": new_token}).status_code == 200
            # The CLI does the same.
            env = dict(os.environ, AGENTBOX_API_URL=server.url, AGENTBOX_API_KEY=key)
            out = subprocess.run(
                [sys.executable, "-m", "agentbox.cli.app", "rotate-token", sid],
                env=env, capture_output=True, text=True, timeout=60,
            )
            assert out.returncode == 0, out.stderr
            newest = out.stdout.strip()
            assert newest not in (new_token, old_token)
            assert anon.get(_path(info, 8000), headers={"X-Access-Token": new_token}).status_code == 401
            assert anon.get(_path(info, 8000), headers={"X-Access-Token": newest}).status_code == 200
        audit = c.get("/v1/audit", params={"sandbox_id": sid, "action": "sandbox.access_token"})
        assert len(audit.json()["events"]) == 2
        c.delete(f"/v1/sandboxes/{sid}")
