"""Battery checks on secrets on the wire: where the egress proxy puts a value, and what comes back.

A sandbox holds only a placeholder; the proxy puts the value in on the wire, only where the
secret's binding says (its header, its hosts, over TLS unless it opts into plain HTTP), and keeps
the value out of what those hosts send back. Both checks bind secrets to the battery's allowed
egress name, served for them by a host-side upstream (on the allowed listener's address, on a
port of its own) that records what it gets and sends the Authorization header back in every way
an echo can. The judging is done here, on the host, from what that upstream received and from
the raw bytes the sandbox got, decoded here: it shares no code with the proxy's scrubber.

The battery's server trusts no CA of the battery's own, so both checks speak plain HTTP; the
reflection check uses a secret that opts into it (the proxy scrubs TLS and plain responses with
the same code). Positive control: `secrets-loose` (battery/server.py).
"""

from __future__ import annotations

import base64
import gzip
import secrets
import socketserver
import threading
import time
import urllib.parse
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agentbox.battery.checks import Ctx, ProbeFailed, Verdict, blocked, check, results_of
from agentbox.battery.netns import EGRESS_ALLOWED
from agentbox.battery.target import Box

CONTROL = ["secrets-loose"]
ECHO_MODES = ("raw", "gzip", "chunked", "b64", "url", "br")


class _Echo:
    """An HTTP/1.1 server that records every request and, under /echo/MODE, sends back the
    Authorization header it got: raw (and in X-Echo), gzip'd, chunked in 3-byte pieces,
    base64'd, URL-encoded, under a content coding nobody can decode (br), or after a 101."""

    def __init__(self, address: str) -> None:
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                heard = {k.lower(): v for k, v in self.headers.items()}
                outer.requests.append({"method": self.command, "path": self.path, **heard})
                mode = self.path.split("/")[2] if self.path.startswith("/echo/") else "quiet"
                _echo(self, heard.get("authorization", "").encode("latin-1"), mode)

            do_GET = do_TRACE = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = _Server((address, 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def got(self, path: str, value: str) -> bool:
        """Whether a request for `path` carried `value` anywhere in its head."""
        return any(value in str(r) for r in self.requests if r["path"] == path)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Server(ThreadingHTTPServer):
    def server_bind(self) -> None:
        # HTTPServer's own looks its address up in DNS (getfqdn): the oracle would count that.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)


def _echo(h: BaseHTTPRequestHandler, auth: bytes, mode: str) -> None:
    if mode == "upgrade":
        h.send_response(101)
        h.send_header("Connection", "Upgrade")
        h.send_header("Upgrade", "websocket")
        h.end_headers()
        h.wfile.write(auth)
        h.close_connection = True
        return
    h.send_response(200)
    if mode != "quiet":
        h.send_header("X-Echo", auth.decode("latin-1"))
    if mode == "chunked":
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        for i in range(0, len(auth), 3):
            h.wfile.write(b"%x\r\n%s\r\n" % (len(auth[i : i + 3]), auth[i : i + 3]))
            h.wfile.flush()
            time.sleep(0.002)
        h.wfile.write(b"0\r\n\r\n")
        return
    body = {
        "quiet": b"ok",
        "gzip": gzip.compress(auth),
        "b64": base64.b64encode(auth) + b"\n" + base64.urlsafe_b64encode(auth[7:]),
        "url": urllib.parse.quote(auth, safe="").encode(),
    }.get(mode, auth)
    if mode in ("gzip", "br"):
        h.send_header("Content-Encoding", mode)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


@contextmanager
def _upstream(ctx: Ctx) -> Iterator[_Echo]:
    if not ctx.roles.get("egress-allowed"):
        raise ProbeFailed("the egress listener addresses could not be set up")
    up = _Echo(EGRESS_ALLOWED[1])
    try:
        yield up
    finally:
        up.close()


def _secret(ctx: Ctx, name: str, **binding: Any) -> str:
    """A fresh secret of tenant battery-a bound to the allowed name; its value."""
    value = f"abx-secret-{secrets.token_hex(16)}"
    body = {"value": value, "hosts": [EGRESS_ALLOWED[0]], **binding}
    c = ctx.server.client(ctx.server.key("battery-a"))
    r = c.put(f"/v1/secrets/{name}", json=body)
    if r.status_code != 200:
        raise ProbeFailed(f"PUT /v1/secrets/{name}: HTTP {r.status_code} {r.text[:200]}")
    return value


def _ask(box: Box, requests: list[dict[str, Any]]) -> dict[str, bytes]:
    """The raw answers to `requests` (probe_secret_wire) by key."""
    res = results_of(box.probe("secret_wire", requests=requests, timeout=120))
    out = {}
    for key, answer in res.items():
        if not isinstance(answer, str) or answer.startswith("ERR "):
            raise ProbeFailed(f"{key}: {answer}")
        out[key] = base64.b64decode(answer)
    return out


def _readable(raw: bytes) -> bytes:
    """A response as the sandbox could read it: head, then the body unchunked and unzipped."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        plain, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            try:
                n = int(size.split(b";")[0], 16)
            except ValueError:
                break
            plain, rest = plain + rest[:n], rest[n + 2 :]
        body = plain
    if b"content-encoding: gzip" in lower:
        try:
            body = zlib.decompressobj(47).decompress(body)
        except zlib.error:
            pass
    return head + b"\r\n\r\n" + body


def _exposed(value: str, raw: bytes) -> list[str]:
    """The spellings of `value` a sandbox finds in `raw`: as is, URL-encoded, base64 of it or of
    "Bearer VALUE" (in both alphabets; the last few characters left out, as they depend on what
    follows)."""
    text = _readable(raw)
    forms = {"raw": value.encode(), "url-encoded": urllib.parse.quote(value, safe="").encode()}
    for what, data in (("base64", value), ("base64 of the header", f"Bearer {value}")):
        forms[what] = base64.b64encode(data.encode()).rstrip(b"=")[:-2]
        forms[what + " (url-safe)"] = base64.urlsafe_b64encode(data.encode()).rstrip(b"=")[:-2]
    return [what for what, form in forms.items() if form in text]


def _status(raw: bytes) -> str:
    return raw.split(b"\r\n", 1)[0].decode("latin-1")[:40] or "no answer"


@check(
    "secrets-plaintext",
    "secrets",
    "secret values go only in their bound header, and over plain HTTP only if opted in",
    CONTROL,
)
def _secrets_plaintext(ctx: Ctx) -> Verdict:
    with _upstream(ctx) as up:
        strict = _secret(ctx, "ABX_STRICT")  # Authorization, verified TLS only: the defaults
        keyed = _secret(ctx, "ABX_KEYED", headers=["X-Abx-Key"], allow_plaintext=True)
        box = ctx.box(
            secrets=["ABX_STRICT", "ABX_KEYED"], network={"allow_out": [EGRESS_ALLOWED[0]]}
        )
        url = f"http://{EGRESS_ALLOWED[0]}:{up.port}"
        asks = {
            # The one place a value may go here: it proves the proxy injects at all.
            "/baseline": ({"X-Abx-Key": "$ABX_KEYED"}, None),
            "/strict-bearer": ({"Authorization": "Bearer $ABX_STRICT"}, None),
            "/strict-basic": ({}, "git:$ABX_STRICT"),
            "/strict-other-header": ({"X-Abx-Key": "$ABX_STRICT"}, None),
            "/keyed-authorization": ({"Authorization": "Bearer $ABX_KEYED"}, None),
            "/keyed-basic": ({}, "git:$ABX_KEYED"),
            "/keyed-other-header": ({"X-Api-Key": "$ABX_KEYED", "Cookie": "k=$ABX_KEYED"}, None),
        }
        requests = []
        for path, (headers, basic) in asks.items():
            r: dict[str, Any] = {
                "key": path,
                "method": "GET",
                "url": url + path,
                "headers": headers,
            }
            if basic:
                r["basic"] = basic
            requests.append(r)
        answers = _ask(box, requests)
        if not up.got("/baseline", keyed):
            return Verdict(
                "ERROR",
                evidence="the proxy put ABX_KEYED in X-Abx-Key nowhere (baseline "
                f"{_status(answers['/baseline'])}), so the check proves nothing",
            )
        v = blocked(f"{len(asks) - 1} requests carried placeholders only; baseline injected")
        for path in list(asks)[1:]:
            basic_seen = [r.get("authorization", "") for r in up.requests if r["path"] == path]
            decoded = [base64.b64decode(a[6:] + "==") for a in basic_seen if a[:6] == "Basic "]
            for name, value in (("ABX_STRICT", strict), ("ABX_KEYED", keyed)):
                if up.got(path, value) or any(value.encode() in d for d in decoded):
                    v.add_break("READ", f"{path}: the upstream got the value of {name}")
    return v


@check(
    "secrets-reflection",
    "secrets",
    "a bound host echoing the secret (raw, gzip, chunked, base64, URL-encoded, TRACE, unknown "
    "coding, WebSocket) gives the sandbox no value back",
    CONTROL,
)
def _secrets_reflection(ctx: Ctx) -> Verdict:
    with _upstream(ctx) as up:
        value = _secret(ctx, "ABX_ECHO", allow_plaintext=True)
        box = ctx.box(secrets=["ABX_ECHO"], network={"allow_out": [EGRESS_ALLOWED[0]]})
        url = f"http://{EGRESS_ALLOWED[0]}:{up.port}/echo"
        auth = {"Authorization": "Bearer $ABX_ECHO"}
        requests = [
            {"key": mode, "method": "GET", "url": f"{url}/{mode}/", "headers": auth}
            for mode in ECHO_MODES
        ]
        requests.append(
            {"key": "TRACE", "method": "TRACE", "url": f"{url}/trace/", "headers": auth}
        )
        upgrade = {**auth, "Connection": "Upgrade", "Upgrade": "websocket"}
        upgrade |= {"Sec-WebSocket-Version": "13", "Sec-WebSocket-Key": "YWJ4LWJhdHRlcnktcHJvYmU="}
        requests.append(
            {"key": "websocket", "method": "GET", "url": f"{url}/upgrade/", "headers": upgrade}
        )
        answers = _ask(box, requests)
        if not up.got("/echo/raw/", value):
            return Verdict(
                "ERROR",
                evidence="the proxy never sent the value to the echo upstream (raw: "
                f"{_status(answers['raw'])}), so the check proves nothing",
            )
        v = blocked("; ".join(f"{k}: {_status(a)}" for k, a in answers.items()))
        for key, raw in answers.items():
            found = _exposed(value, raw)
            if found:
                v.add_break("READ", f"{key} ({_status(raw)}) gave back the value {found}")
    return v
