"""Checks that attack the control plane itself rather than the sandbox wall: an anonymous client
that floods bodies or holds slow connections, and a tenant's own sandbox server that tries to
starve or flood the exposed-ports gateway.

Their positive controls weaken the server's budgets (`server-unguarded`, `gateway-unbounded` in
battery/server.py), never the runtime.
"""

from __future__ import annotations

import json
import re
import socket
import statistics
import threading
import time
from typing import Any

import httpx

from agentbox.battery.checks import Ctx, Verdict, blocked, check, na
from agentbox.battery.netns import RELAY_WRITE_TIMEOUT
from agentbox.battery.target import Box, answers

# Servers run inside a sandbox (stdlib only). Each takes its port as argv[1].


# The hostile servers, run inside a sandbox (stdlib only): `python3 script PORT MODE`.
_HOSTILE_SERVER = r"""
import base64, hashlib, socket, sys, threading, time

def head(c):
    data = b""
    while b"\r\n\r\n" not in data:
        data += c.recv(65536)
    return data

def websocket(c, data):
    key = [l.split(b":", 1)[1].strip() for l in data.split(b"\r\n")
           if l.lower().startswith(b"sec-websocket-key:")][0]
    acc = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
              b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + acc + b"\r\n\r\n")

def trickle(c):  # chunked, then 1-byte chunks as fast as they are taken
    head(c)
    c.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    burst = b"1\r\nx\r\n" * 4000
    end = time.monotonic() + 20  # bounded: a starved server must recover for the next check
    while time.monotonic() < end:
        c.sendall(burst)

def pingflood(c):
    websocket(c, head(c))
    flood = b"\x89\x00" * 32768
    end = time.monotonic() + 15
    while time.monotonic() < end:
        c.sendall(flood)

def deaf(c):  # accepts the WebSocket, then never reads again
    websocket(c, head(c))
    time.sleep(3600)

def desync(c):  # answers each request with a lie its path names; keeps the connection
    data = b""
    while True:
        while b"\r\n\r\n" not in data:
            more = c.recv(65536)
            if not more:
                return
            data += more
        first, _, data = data.partition(b"\r\n\r\n")
        path = first.split(b" ", 2)[1]
        forged = b'{"ok": "forged by the sandbox"}'
        if path.endswith(b"/split"):  # a bare LF: a header of its own to a lax client
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: a\n"
                      b"Set-Cookie: api=forged; Path=/v1/\r\n\r\nok")
        else:  # an answer, then a second one for whatever the client asks next
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
                      b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(forged), forged))

def cookies(c):
    head(c)
    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
              b"Set-Cookie: session=tossed; Domain=localhost; Path=/\r\n"
              b"Set-Cookie: api=tossed; Path=/v1/\r\n"
              b"Set-Cookie: abx_port=1.forged; Path=/\r\n\r\nok")

def serve(c, mode):
    try:
        globals()[mode](c)
    except OSError:
        pass
    finally:
        c.close()

s = socket.create_server(("127.0.0.1", int(sys.argv[1])))
print("listening", flush=True)
while True:
    threading.Thread(target=serve, args=(s.accept()[0], sys.argv[2]), daemon=True).start()
"""


def _health_p50(url: str, n: int = 15, budget: float = 3.0) -> tuple[float, float]:
    """The API's health latency over `n` requests (p50, max), or over those made within
    `budget` seconds: a starved server says so in its first slow answers, more only cost time."""
    times: list[float] = []
    start = time.perf_counter()
    with httpx.Client(base_url=url, timeout=5) as c:
        while len(times) < n and (not times or time.perf_counter() - start < budget):
            t0 = time.perf_counter()
            try:
                c.get("/v1/health")
                times.append(time.perf_counter() - t0)
            except httpx.HTTPError:
                times.append(5.0)
                break
    return statistics.median(times), max(times)


def _hostile(ctx: Ctx, mode: str, port: int) -> tuple[Box, dict[str, str], str]:
    """A sandbox running the hostile server in `mode` on `port`; the headers that reach the port
    through the gateway, and the port's path prefix there."""
    box = ctx.box()
    path = "/tmp/.abx-hostile-server.py"
    box.put(path, _HOSTILE_SERVER.encode()).raise_for_status()
    cmd_id = box.start(f"python3 {path} {port} {mode}")
    box.wait_output(cmd_id, "listening", timeout=15)
    headers = {"X-Access-Token": box.info.get("access_token") or ""}
    return box, headers, f"/v1/sandboxes/{box.id}/ports/{port}"


def _kill(box: Box) -> None:
    """Kill a check's sandbox; a server the positive control starved may not answer in time
    (its sandboxes go with the profile's server)."""
    try:
        box.kill(timeout=5)
    except httpx.HTTPError:
        pass


def _ws_url(ctx: Ctx, prefix: str) -> str:
    return ctx.server.url.replace("http://", "ws://") + prefix + "/"


def _log_lines(ctx: Ctx) -> int:
    try:
        with open(ctx.server.log_path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


# ---------------------------------------------------------------------------- anonymous clients


@check(
    "srv-anonymous-body",
    "control-plane",
    "an anonymous client's request body is not read (401 before the body)",
    {"server-unguarded"},
    tier_free=True,
)
def _srv_anonymous_body(ctx: Ctx) -> Verdict:
    promised = 256 * 2**20
    sent = 0
    with socket.create_connection(("127.0.0.1", ctx.server.port), timeout=5) as s:
        s.sendall(
            b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {promised}\r\n\r\n".encode()
        )
        s.setblocking(False)
        block = b"{" * 65536
        answer = b""
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and sent < promised:
            try:
                answer += s.recv(65536)
                if answer.startswith(b"HTTP/1.1 401"):
                    break
            except BlockingIOError:
                pass
            except OSError:
                break
            try:
                sent += s.send(block)
            except BlockingIOError:
                time.sleep(0.01)
            except OSError:
                break
    mib = sent / 2**20
    if mib > 32:
        return Verdict("BROKEN", ["DOS"], f"the server took {mib:.0f} MiB of an anonymous body")
    return blocked(f"answered {answer[:12]!r} after {mib:.1f} MiB were sent")


@check(
    "srv-slowloris",
    "control-plane",
    "slow request headers are cut off; anonymous connections cannot hold the server",
    {"server-unguarded"},
    tier_free=True,
)
def _srv_slowloris(ctx: Ctx) -> Verdict:
    conns = []
    for _ in range(40):
        s = socket.create_connection(("127.0.0.1", ctx.server.port), timeout=5)
        s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")
        conns.append(s)
    try:
        deadline = time.monotonic() + 14  # the shipped header timeout is 10 s
        while time.monotonic() < deadline:
            for s in conns:
                try:
                    s.send(b"X-a: b\r\n")  # a header line now and then, never the blank line
                except OSError:
                    pass
            time.sleep(2)
        open_ = 0
        for s in conns:
            s.settimeout(0.05)
            try:
                open_ += s.recv(1) != b""
            except TimeoutError:
                open_ += 1
            except OSError:
                pass
    finally:
        for s in conns:
            s.close()
    if open_:
        return Verdict("BROKEN", ["DOS"], f"{open_}/40 slow connections still held after 14 s")
    return blocked("every slow connection was closed within 14 s")


# ---------------------------------------------------------------------------- the port gateway


@check(
    "gw-trickle-starvation",
    "control-plane",
    "a sandbox server streaming 1-byte chunks through the gateway does not stall the API; "
    "its relay ends with the client and floods no log",
    {"gateway-unbounded"},
)
def _gw_trickle(ctx: Ctx) -> Verdict:
    box, headers, prefix = _hostile(ctx, "trickle", 8701)
    before, _ = _health_p50(ctx.server.url)
    got = {"bytes": 0}
    stop = threading.Event()
    client = httpx.Client(base_url=ctx.server.url, timeout=20)

    def read() -> None:
        try:
            with client.stream("GET", prefix + "/", headers=headers) as r:
                for chunk in r.iter_raw():
                    got["bytes"] += len(chunk)
                    if stop.is_set():
                        return
        except Exception:  # noqa: BLE001 - the client closed under it, or the relay ended
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 20  # 1-byte chunks come slower on a loaded host
    while got["bytes"] < 50_000 and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = _log_lines(ctx)
    during, worst = _health_p50(ctx.server.url)
    stop.set()
    reader.join(2)
    client.close()  # a reader a starved relay no longer feeds leaves now, with its connection
    reader.join(10)
    time.sleep(2)
    flood = _log_lines(ctx) - lines
    answers(ctx.server.url, 40)  # starved by a control while its hostile server runs
    _kill(box)
    if got["bytes"] < 50_000:
        return Verdict("ERROR", evidence=f"the trickle never reached the client: {got}")
    v = blocked(
        f"health p50 {before * 1000:.1f} ms before, {during * 1000:.1f} ms during "
        f"(max {worst * 1000:.0f} ms); {flood} log lines"
    )
    if during > 5 * before + 0.05 or worst > 2:
        v.add_break(
            "DOS",
            f"API health p50 {during * 1000:.0f} ms (max {worst * 1000:.0f}) during the "
            f"relay vs {before * 1000:.1f} ms before",
        )
    if flood > 200:
        v.add_break("LOG", f"{flood} server log lines in 2 s after the client left")
    return v


@check(
    "gw-ping-flood",
    "control-plane",
    "a sandbox WebSocket server flooding pings is cut off",
    {"gateway-unbounded"},
)
def _gw_ping_flood(ctx: Ctx) -> Verdict:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    box, headers, prefix = _hostile(ctx, "pingflood", 8702)
    t0 = time.monotonic()
    cut = None
    try:
        with connect(_ws_url(ctx, prefix), additional_headers=headers, open_timeout=10) as ws:
            try:
                ws.recv(timeout=6)
            except ConnectionClosed:
                cut = time.monotonic() - t0
            except TimeoutError:
                pass
    except Exception as e:  # noqa: BLE001 - any failure to relay is reported
        _kill(box)
        return Verdict("ERROR", evidence=f"{type(e).__name__}: {e}"[:300])
    during, _ = _health_p50(ctx.server.url, 5)
    answers(ctx.server.url, 40)  # starved by a control while its hostile server runs
    _kill(box)
    if cut is None:
        return Verdict("BROKEN", ["DOS"], "the ping flood was relayed for 6 s without a cut")
    return blocked(f"cut after {cut:.1f} s; health p50 {during * 1000:.1f} ms afterwards")


@check(
    "gw-answer-desync",
    "control-plane",
    "a sandbox's server cannot answer the API's requests on a client's connection, nor add "
    "headers of its own, by sending more than one answer (path-routed ports share the API's "
    "origin and the client's keep-alive connection)",
    {"gateway-splice"},
)
def _gw_answer_desync(ctx: Ctx) -> Verdict:
    box, headers, prefix = _hostile(ctx, "desync", 8705)
    host, port = ctx.server.url.removeprefix("http://").rsplit(":", 1)
    token = headers["X-Access-Token"]
    trail: list[str] = []
    v = blocked("")

    def exchange(conn: socket.socket, file: Any, path: str, auth: bool) -> tuple[bytes, bytes]:
        """One request on the kept-alive connection, its answer read as a plain HTTP/1.1 client
        reads it (the head to its blank line, then Content-Length bytes)."""
        extra = f"X-Access-Token: {token}\r\n" if auth else ""
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{extra}\r\n".encode())
        head = b""
        while not head.endswith(b"\r\n\r\n") and not head.endswith(b"\n\n"):
            line = file.readline()
            if not line:
                raise ConnectionError("the connection closed")
            head += line
        length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        return head, file.read(int(length.group(1))) if length else b""

    try:
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            head, _ = exchange(conn, conn.makefile("rb"), prefix + "/split", True)
            status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            trail.append(f"split: {status_line}")
            # A line that LF alone ends is a header of its own to a lax client (as the ASGI way
            # reads it too, as a cookie of the port, confined like any other): a break only if
            # it reached the client unconfined, as the sandbox wrote it.
            for cookie in re.findall(rb"(?im)^set-cookie:\s*(api=forged[^\r\n]*)", head):
                if f"path={prefix.lower()}/".encode() not in cookie.lower():
                    v.add_break("COOKIE", f"a cookie hidden behind a bare LF, as set: {cookie!r}")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            file = conn.makefile("rb")
            for _ in range(2):
                _, body = exchange(conn, file, prefix + "/extra", True)
                _, api = exchange(conn, file, "/v1/health", False)
                trail.append(f"extra: {body!r}, then the API: {api[:60]!r}")
                if b"forged" in api:
                    v.add_break(
                        "WRITE",
                        "the sandbox's second answer was read as the API's answer to the next "
                        f"request on the connection: {api[:100]!r}",
                    )
                    break
    except (OSError, ValueError) as e:
        trail.append(f"{type(e).__name__}: {e}")
    finally:
        _kill(box)
    if v.status == "BLOCKED":
        v.evidence = "; ".join(trail)[:600]
    return v


@check(
    "gw-cookie-tossing",
    "control-plane",
    "a sandbox's Set-Cookie cannot reach beyond its own port (no Domain, path-routed cookies "
    "under the port's prefix, never the gateway's own cookie)",
    {"gateway-unbounded"},
)
def _gw_cookie_tossing(ctx: Ctx) -> Verdict:
    box, headers, prefix = _hostile(ctx, "cookies", 8703)
    with httpx.Client(base_url=ctx.server.url, timeout=10) as c:
        r = c.get(prefix + "/", headers=headers)
    _kill(box)
    if r.status_code != 200:
        return Verdict("ERROR", evidence=f"HTTP {r.status_code}: {r.text[:200]}")
    cookies = r.headers.get_list("set-cookie")
    v = blocked(f"cookies as relayed: {cookies}")
    for cookie in cookies:
        attrs = [a.strip().lower() for a in cookie.split(";")[1:]]
        paths = [a.partition("=")[2] for a in attrs if a.startswith("path=")]
        if any(a.startswith("domain=") for a in attrs):
            v.add_break("COOKIE", f"relayed with a Domain: {cookie}")
        if not paths or not all(p.startswith(prefix.lower() + "/") for p in paths):
            v.add_break("COOKIE", f"not confined to {prefix}/: {cookie}")
        if cookie.startswith("abx_port="):
            v.add_break("COOKIE", f"the gateway's own cookie set by the sandbox: {cookie}")
    return v


@check(
    "gw-deaf-peer",
    "control-plane",
    "a WebSocket relay to a sandbox server that stops reading ends (write timeout) instead of "
    "holding server memory and descriptors for ever",
    {"gateway-unbounded"},
)
def _gw_deaf_peer(ctx: Ctx) -> Verdict:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    box, headers, prefix = _hostile(ctx, "deaf", 8704)
    url = _ws_url(ctx, prefix)
    limit = RELAY_WRITE_TIMEOUT + 10  # the battery's servers run with this write timeout
    t0 = time.monotonic()
    sent = 0
    ended = None
    try:
        # No keepalive of our own: its unanswered pings would end the relay from this side.
        with connect(url, additional_headers=headers, open_timeout=10, ping_interval=None) as ws:
            while time.monotonic() - t0 < limit:
                try:
                    ws.send(b"x" * 65536)
                    sent += 1
                    ws.recv(timeout=0.05)
                except TimeoutError:
                    continue
                except ConnectionClosed:
                    ended = time.monotonic() - t0
                    break
    except Exception as e:  # noqa: BLE001 - any failure to relay is reported
        _kill(box)
        return Verdict("ERROR", evidence=f"{type(e).__name__}: {e}"[:300])
    _kill(box)
    if ended is None:
        return Verdict(
            "BROKEN", ["DOS"], f"the relay was still open after {limit:g} s ({sent} messages)"
        )
    return blocked(f"the relay ended after {ended:.1f} s ({sent} messages accepted)")


# ---------------------------------------------------------------------------- E2B's surface


@check(
    "e2b-envd-token",
    "control-plane",
    "E2B's sandbox traffic (envd) needs the sandbox's own envd token: its port token, another "
    "sandbox's envd token, another tenant's API key or no token reach none of its files and "
    "run nothing in it (envd's RPC, the code interpreter's port 49999, the host-routed form); "
    "another tenant's key cannot look it up or end it through E2B's API",
    {"e2b-envd-open"},
    tier_free=True,
)
def _e2b_envd_token(ctx: Ctx) -> Verdict:
    url = ctx.server.url
    box = ctx.box()
    secret = f"abx-e2b-{ctx.oracle.nonce}"
    box.put("/workspace/e2b-secret.txt", secret.encode()).raise_for_status()
    b_key = ctx.server.key("battery-b")
    with httpx.Client(base_url=url, timeout=30) as c:
        other = _e2b_create(c, b_key)
        if isinstance(other, Verdict):
            return other
        attempts: dict[str, dict[str, str]] = {
            "no token": {},
            "its port token": {"X-Access-Token": box.info.get("access_token") or ""},
            "another sandbox's envd token": {"X-Access-Token": other["envdAccessToken"]},
            "another tenant's API key": {"X-API-KEY": b_key},
        }
        v = blocked("")
        seen = []
        for label, extra in attempts.items():
            headers = {"E2b-Sandbox-Id": box.id, "E2b-Sandbox-Port": "49983", **extra}
            read = c.get("/files", params={"path": "/workspace/e2b-secret.txt"}, headers=headers)
            drop = f"/workspace/e2b-drop-{ctx.oracle.nonce}"
            wrote = c.post("/files", params={"path": drop}, content=b"x", headers=headers)
            ran = f"/workspace/e2b-ran-{ctx.oracle.nonce}"
            start = {"process": {"cmd": "/bin/sh", "args": ["-c", f"echo x > {ran}"]}}
            body = json.dumps(start).encode()
            run = c.post(
                "/process.Process/Start",
                content=b"\0" + len(body).to_bytes(4, "big") + body,  # one enveloped message
                headers={**headers, "Content-Type": "application/connect+json"},
            )
            listed = c.post(
                "/filesystem.Filesystem/ListDir",
                json={"path": "/workspace"},
                headers={**headers, "Content-Type": "application/json"},
            )
            started = b'"start"' in run.content  # a stream's error is in its body
            said = "started" if started else _connect_code(run)
            # The code interpreter's port: the SDK sends the token in either header there.
            token = extra.get("X-Access-Token")
            port = {**headers, "E2b-Sandbox-Port": "49999"}
            if token is not None:
                port["E2B-Traffic-Access-Token"] = token
            coded = f"/workspace/e2b-coded-{ctx.oracle.nonce}"
            cell = {"code": f"echo x > {coded}", "language": "bash"}
            execute = c.post("/execute", json=cell, headers=port)
            contexts = c.get("/contexts", headers=port)
            # The host-routed form (`49983-<id>.<domain>`, through the port gateway).
            host = f"{box.id}.localhost:{httpx.URL(url).port}"
            routed = {**extra, "Host": f"49983-{host}"}
            if token is not None:
                routed["E2B-Traffic-Access-Token"] = token
            host_read = c.get("/files", params={"path": "/workspace/e2b-secret.txt"},
                              headers=routed)  # fmt: skip
            host_execute = c.post(
                "/execute", json=cell, headers={**routed, "Host": f"49999-{host}"}
            )
            seen.append(
                f"{label}: read {read.status_code}, write {wrote.status_code}, "
                f"rpc start {said}, rpc list {listed.status_code}, "
                f"execute {execute.status_code}, contexts {contexts.status_code}, "
                f"host-routed read {host_read.status_code}, execute {host_execute.status_code}"
            )
            if host_read.status_code == 200 and secret in host_read.text:
                v.add_break("READ", f"{label} read the sandbox's file (host-routed form)")
            if host_execute.status_code == 200:
                v.add_break("ESCAPE", f"{label} ran code in the sandbox (host-routed form)")
            if started or box.get(ran).status_code == 200:
                v.add_break("ESCAPE", f"{label} ran a command in the sandbox (envd RPC)")
            if execute.status_code == 200 or box.get(coded).status_code == 200:
                v.add_break("ESCAPE", f"{label} ran code in the sandbox (port 49999)")
            if contexts.status_code == 200:
                v.add_break("READ", f"{label} listed the sandbox's code contexts")
            if listed.status_code == 200 and "e2b-secret.txt" in listed.text:
                v.add_break("READ", f"{label} listed the sandbox's files (envd RPC)")
            if read.status_code == 200 and secret in read.text:
                v.add_break("READ", f"{label} read the sandbox's file")
            if wrote.status_code == 200:
                v.add_break("WRITE", f"{label} wrote {drop} into the sandbox")
        got = c.get(f"/sandboxes/{box.id}", headers={"X-API-KEY": b_key})
        ended = c.delete(f"/sandboxes/{box.id}", headers={"X-API-KEY": b_key})
        seen.append(f"another tenant's key: get {got.status_code}, kill {ended.status_code}")
        if got.status_code == 200:
            v.add_break("READ", "another tenant's key looked the sandbox up through E2B's API")
        if box.client.get(f"/v1/sandboxes/{box.id}").json().get("state") != "running":
            v.add_break("DOS", "another tenant's key ended the sandbox through E2B's API")
        c.delete(f"/sandboxes/{other['sandboxID']}", headers={"X-API-KEY": b_key})
    v.evidence = "; ".join(seen)
    return v


@check(
    "e2b-signed-url",
    "control-plane",
    "E2B's signed file URLs open only what they were signed for: a signature over another "
    "path, for the other operation, made with another sandbox's envd token, past its expiry, "
    "or forged reads and writes nothing, with or without E2B's headers naming the sandbox",
    {"e2b-envd-open"},
    tier_free=True,
)
def _e2b_signed_url(ctx: Ctx) -> Verdict:
    from agentbox.server.e2b.signed import signature

    url, nonce = ctx.server.url, ctx.oracle.nonce
    secret, target = f"abx-signed-{nonce}", f"/workspace/e2b-signed-{nonce}.txt"
    a_key, b_key = ctx.server.key("battery-a"), ctx.server.key("battery-b")
    with httpx.Client(base_url=url, timeout=30) as c:
        victim = _e2b_create(c, a_key)
        if isinstance(victim, Verdict):
            return victim
        other = _e2b_create(c, b_key)
        if isinstance(other, Verdict):
            c.delete(f"/sandboxes/{victim['sandboxID']}", headers={"X-API-KEY": a_key})
            return other
        own = {"E2b-Sandbox-Id": victim["sandboxID"], "E2b-Sandbox-Port": "49983"}
        try:
            put = c.post(
                "/files",
                params={"path": target},
                content=secret.encode(),
                headers={**own, "X-Access-Token": victim["envdAccessToken"]},
            )
            if put.status_code != 200:
                return Verdict("ERROR", evidence=f"envd write: HTTP {put.status_code}")
            token, past = victim["envdAccessToken"], int(time.time()) - 60

            def sig(path: str, op: str, tok: str = token, exp: int | None = None) -> dict[str, str]:
                q = {"path": target, "username": "user", "signature": signature(tok, path, op,
                     "user", exp)}  # fmt: skip
                if exp is not None:
                    q["signature_expiration"] = str(exp)
                return q

            reads = {
                "a signature over another path": sig(f"{target}.other", "read"),
                "a write signature": sig(target, "write"),
                "another sandbox's envd token": sig(target, "read", other["envdAccessToken"]),
                "an expired signature": sig(target, "read", exp=past),
                "a forged signature": {**sig(target, "read"), "signature": "v1_" + "A" * 43},
            }
            # The positive case first: the URL the SDK would make reads the file.
            good = c.get("/files", params=sig(target, "read"), headers=own)
            if not (good.status_code == 200 and secret in good.text):
                return Verdict("ERROR", evidence=f"a good signed URL: HTTP {good.status_code}")
            writes = {
                "a read signature": sig(target, "read"),
                "an expired write signature": sig(target, "write", exp=past),
            }
            v = blocked("")
            seen = []
            for headers, how in (({}, "bare"), (own, "with E2B headers")):
                for label, q in reads.items():
                    r = c.get("/files", params=q, headers=headers)
                    seen.append(f"{label} ({how}): read {r.status_code}")
                    if r.status_code == 200 and secret in r.text:
                        v.add_break("READ", f"{label} ({how}) read the sandbox's file")
                for label, q in writes.items():
                    r = c.post("/files", params=q, content=b"tampered", headers=headers)
                    seen.append(f"{label} ({how}): write {r.status_code}")
                    if r.status_code == 200:
                        v.add_break("WRITE", f"{label} ({how}) wrote the sandbox's file")
        finally:
            c.delete(f"/sandboxes/{victim['sandboxID']}", headers={"X-API-KEY": a_key})
            c.delete(f"/sandboxes/{other['sandboxID']}", headers={"X-API-KEY": b_key})
    v.evidence = "; ".join(seen)
    return v


# ---------------------------------------------------------------------------- MCP over HTTP

_MCP_ACCEPT = {"Accept": "application/json, text/event-stream"}


def _mcp_rpc(
    c: httpx.Client, headers: dict[str, str], method: str, params: dict[str, Any] | None = None
) -> tuple[int, str]:
    """One JSON-RPC request to /mcp: its status and its answer's text (SSE or JSON)."""
    body: dict[str, Any] = {"jsonrpc": "2.0", "id": 1, "method": method}
    if params is not None:
        body["params"] = params
    r = c.post("/mcp", json=body, headers={**_MCP_ACCEPT, **headers})
    return r.status_code, r.text


@check(
    "mcp-session-owner",
    "control-plane",
    "An MCP session over HTTP (/mcp) is its opening tenant's alone: with another tenant's key "
    "(either header) or no key, no tool runs in it, nothing of its sandbox is read, and the "
    "session cannot be ended",
    {"mcp-sessions-open"},
    tier_free=True,
)
def _mcp_session_owner(ctx: Ctx) -> Verdict:
    nonce = ctx.oracle.nonce
    secret = f"abx-mcp-{nonce}"
    a_key, b_key = ctx.server.key("battery-a"), ctx.server.key("battery-b")
    init = {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "battery", "version": "1"},
    }
    with httpx.Client(base_url=ctx.server.url, timeout=120) as c:
        opened = c.post(
            "/mcp?template=host",
            json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init},
            headers={**_MCP_ACCEPT, "Authorization": f"Bearer {a_key}"},
        )
        if opened.status_code == 501:
            return na("the server has no mcp package: /mcp is not served")
        sid = opened.headers.get("mcp-session-id")
        if opened.status_code != 200 or not sid:
            said = f"initialize: {opened.status_code} {opened.text[:200]}"
            return Verdict("ERROR", evidence=said)
        owner = {"X-API-Key": a_key, "Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-06-18"}
        c.post(
            "/mcp",
            json={"jsonrpc": "2.0", "method": "notifications/initialized"},
            headers={**_MCP_ACCEPT, **owner},
        )
        wrote = {"name": "write_file", "arguments": {"path": "mcp-secret.txt", "content": secret}}
        status, text = _mcp_rpc(c, owner, "tools/call", wrote)
        if status != 200 or "/workspace/mcp-secret.txt" not in text:
            return Verdict("ERROR", evidence=f"the owner's write_file: {status} {text[:200]}")
        ran = f"/workspace/mcp-ran-{nonce}"
        attempts = {
            "another tenant's key": {"X-API-Key": b_key},
            "another tenant's bearer": {"Authorization": f"Bearer {b_key}"},
            "no key": {},
        }
        v, seen = blocked(""), []
        for label, key in attempts.items():
            h = {**key, "Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-06-18"}
            read = {"name": "read_file", "arguments": {"path": "mcp-secret.txt"}}
            run = {"name": "run_command", "arguments": {"command": f"echo x > {ran}"}}
            r_status, r_text = _mcp_rpc(c, h, "tools/call", read)
            x_status, _ = _mcp_rpc(c, h, "tools/call", run)
            listed, _ = _mcp_rpc(c, h, "tools/list")
            ended = c.delete("/mcp", headers={**_MCP_ACCEPT, **h}).status_code
            seen.append(
                f"{label}: read_file {r_status}, run_command {x_status}, tools/list {listed}, "
                f"DELETE {ended}"
            )
            if secret in r_text:
                v.add_break("READ", f"{label} read the session's sandbox's file")
        status, text = _mcp_rpc(c, owner, "tools/call", {"name": "list_files", "arguments": {}})
        if f"mcp-ran-{nonce}" in text:
            v.add_break("ESCAPE", "another tenant's key ran a command in the session's sandbox")
        if status == 404:
            v.add_break("DOS", "another tenant's key (or none) ended the session")
        elif status != 200:
            return Verdict("ERROR", evidence=f"the owner's list_files: {status} {text[:200]}")
        c.delete("/mcp", headers={**_MCP_ACCEPT, **owner})
    v.evidence = "; ".join(seen)
    return v


def _e2b_create(c: httpx.Client, key: str) -> dict[str, Any] | Verdict:
    """A sandbox made through E2B's API with `key` (its answer), or the check's ERROR."""
    r = c.post(
        "/v2/sandboxes", json={"templateID": "host", "timeout": 300}, headers={"X-API-KEY": key}
    )
    if r.status_code != 201:
        return Verdict("ERROR", evidence=f"E2B create: HTTP {r.status_code} {r.text[:200]}")
    made: dict[str, Any] = r.json()
    return made


def _connect_code(r: httpx.Response) -> str:
    """The Connect error code of a streamed answer (its end message), else its status."""
    for code in (b'"unauthenticated"', b'"permission_denied"', b'"not_found"'):
        if code in r.content:
            return code.decode().strip('"')
    return str(r.status_code)
