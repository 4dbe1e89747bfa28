"""Secrets on the wire: where the proxy puts a value, and keeping it out of what comes back.

The pure pieces (header bindings, injection, the forms of a value, the streaming scrubber, the
content decoders) are tested alone, with hostile inputs; then the proxy itself, in this process,
between a client on loopback and loopback upstreams (plain and TLS) that echo what they get.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import http.client
import json
import os
import random
import socket
import ssl
import threading
import time
import urllib.parse
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agentbox.egress.addresses import AddressGuard
from agentbox.egress.policy import EgressPolicy, parse_rule
from agentbox.egress.proxy import HTTP_PORT, EgressProxy
from agentbox.egress.secrets import (
    DEFAULT_HEADERS,
    BoundSecret,
    ResponseBody,
    Scrubber,
    Uninspectable,
    inject,
    parse_header_names,
    value_forms,
)
from agentbox.egress.tls import CA_CERT_FILE, EgressCA

pytestmark = pytest.mark.timeout(60)

VALUE = "sk-live-" + os.urandom(12).hex()
PH = "agentbox_secret_" + os.urandom(16).hex()


def secret(value: str = VALUE, hosts: tuple[str, ...] = ("bound.test",), **kw: Any) -> BoundSecret:
    return BoundSecret("TOKEN", value, tuple(parse_rule(h) for h in hosts), **kw)


# ---------------------------------------------------------------------------- bindings


def test_headers_default_to_authorization_and_dedupe_case_insensitively() -> None:
    assert parse_header_names(None) == DEFAULT_HEADERS == ("Authorization",)
    assert parse_header_names(["X-Api-Key", "x-api-key", "Authorization"]) == (
        "X-Api-Key",
        "Authorization",
    )


@pytest.mark.parametrize(
    ("names", "message"),
    [
        ([], "list of header names"),
        ("Authorization", "list of header names"),
        (["Bad Header"], "not an HTTP header name"),
        (["X-Key\r\nEvil: 1"], "not an HTTP header name"),
        (["X:Key"], "not an HTTP header name"),
        ([""], "not an HTTP header name"),
        (["x" * 65], "not an HTTP header name"),
        (["Host"], "frames or routes"),
        (["content-length"], "frames or routes"),
        (["Transfer-Encoding"], "frames or routes"),
        (["Connection"], "frames or routes"),
        (["Proxy-Authorization"], "frames or routes"),
        (["Upgrade"], "frames or routes"),
        ([f"X-{i}" for i in range(17)], "at most 16"),
    ],
)
def test_header_bindings_are_validated(names: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_header_names(names)


def test_a_secret_may_travel_only_over_verified_tls_unless_it_opts_in() -> None:
    assert secret().may_send(verified_tls=True)
    assert not secret().may_send(verified_tls=False)
    assert secret(allow_plaintext=True).may_send(verified_tls=False)


# ---------------------------------------------------------------------------- injection


def _headers(**h: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").lower().encode(), v.encode()) for k, v in h.items()]


def test_the_value_goes_only_in_the_bound_headers() -> None:
    got = inject(
        _headers(authorization=f"Bearer {PH}", x_api_key=PH, cookie=f"s={PH}"),
        b"/",
        [(PH.encode(), secret())],
    )
    assert dict(got.headers) == {
        b"authorization": f"Bearer {VALUE}".encode(),
        b"x-api-key": PH.encode(),
        b"cookie": f"s={PH}".encode(),
    }
    assert got.carried == {"TOKEN"}
    named = inject(_headers(x_api_key=PH), b"/", [(PH.encode(), secret(headers=("X-Api-Key",)))])
    assert dict(named.headers) == {b"x-api-key": VALUE.encode()}


def test_nothing_is_carried_when_no_placeholder_is_sent() -> None:
    got = inject(_headers(authorization="Bearer mine"), b"/?q=1", [(PH.encode(), secret())])
    assert got.headers == _headers(authorization="Bearer mine")
    assert not got.carried and not got.built


@pytest.mark.parametrize("user", ["git", "x-access-token", "", "us:er"])
def test_basic_credentials_as_git_sends_them(user: str) -> None:
    sent = base64.b64encode(f"{user}:{PH}".encode())
    got = inject([(b"authorization", b"Basic " + sent)], b"/", [(PH.encode(), secret())])
    (name, value), *_ = got.headers
    assert value[:6] == b"Basic "
    assert base64.b64decode(value[6:]) == f"{user}:{VALUE}".encode()
    assert got.carried == {"TOKEN"}
    # The scrubber is told what was built, and answers an echo of it with what was sent.
    assert (value[6:], sent) in got.built


def test_basic_credentials_in_an_unbound_header_keep_the_placeholder() -> None:
    sent = b"Basic " + base64.b64encode(f"u:{PH}".encode())
    got = inject([(b"x-auth", sent)], b"/", [(PH.encode(), secret())])
    assert got.headers == [(b"x-auth", sent)] and not got.carried


@pytest.mark.parametrize(
    "garbage", [b"Basic !!!", b"Basic ", b"Basic " + base64.b64encode(PH.encode())[:-2]]
)
def test_broken_basic_credentials_pass_without_a_value(garbage: bytes) -> None:
    got = inject([(b"authorization", garbage)], b"/", [(PH.encode(), secret())])
    assert VALUE.encode() not in got.headers[0][1]


def test_the_url_gets_the_value_only_for_in_url_secrets() -> None:
    target = f"/v1/items?key={PH}".encode()
    assert inject([], target, [(PH.encode(), secret())]).target == target
    got = inject([], target, [(PH.encode(), secret(in_url=True))])
    assert got.target == f"/v1/items?key={VALUE}".encode() and got.carried == {"TOKEN"}


def test_the_weakened_proxy_puts_values_in_any_header() -> None:
    got = inject(_headers(x_other=PH), b"/", [(PH.encode(), secret())], any_header=True)
    assert dict(got.headers) == {b"x-other": VALUE.encode()}


# ---------------------------------------------------------------------------- forms, scrubber


def _scrub(value: str, text: bytes) -> bytes:
    return Scrubber.for_secrets([(PH.encode(), secret(value))]).line(text)


def _b64_windows(text: bytes) -> list[bytes]:
    """What base64-decoding any run of `text` at any offset yields (an attacker's view)."""
    out = []
    for alphabet in (b"+/", b"-_"):
        ok = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789" + alphabet)
        runs, run = [], bytearray()
        for c in text:
            if c in ok:
                run.append(c)
            else:
                runs.append(bytes(run))
                run = bytearray()
        runs.append(bytes(run))
        for r in runs:
            for shift in range(4):
                part = r[shift:]
                part = part[: len(part) - len(part) % 4]
                out.append(base64.b64decode(part, altchars=alphabet))
    return out


def _leaks(value: bytes, text: bytes) -> bool:
    """Whether `text`, read raw or base64-decoded anywhere, holds 4 bytes in a row of `value`.

    The placeholder is taken out first: both are random hex, so a 4-byte run of the value turns
    up in the placeholder about one run in a hundred.
    """
    text = text.replace(PH.encode(), b" ")
    windows = {value[i : i + 4] for i in range(len(value) - 3)}
    return any(w in blob for blob in [text, *_b64_windows(text)] for w in windows)


@pytest.mark.parametrize("alphabet", ["standard", "urlsafe"])
@pytest.mark.parametrize("prefix", range(6))
@pytest.mark.parametrize("suffix", range(4))
def test_base64_of_the_value_inside_any_text_is_scrubbed(
    alphabet: str, prefix: int, suffix: int
) -> None:
    encode = base64.b64encode if alphabet == "standard" else base64.urlsafe_b64encode
    value = VALUE.encode()
    blob = encode(b"Bearer "[:prefix] + value + b"\x00\xff\xfe"[:suffix])
    for text in (blob, blob.rstrip(b"="), b'{"echo": "' + blob + b'"}'):
        assert _leaks(value, text)  # the test can see it before...
        assert not _leaks(value, _scrub(VALUE, text)), text  # ...and not after


@pytest.mark.parametrize(
    "value",
    [VALUE, "p@ss/w:rd+x=y&z é" + VALUE[-8:], 'quo"te\\back/slash' + VALUE[-8:]],
)
def test_percent_and_json_escaped_forms_are_scrubbed(value: str) -> None:
    forms = [
        urllib.parse.quote(value, safe=""),
        urllib.parse.quote(value),
        urllib.parse.quote_plus(value),
        urllib.parse.quote(value, safe="").lower(),
        json.dumps(value)[1:-1],
        json.dumps(value, ensure_ascii=False)[1:-1],
        json.dumps(value).replace("/", "\\/")[1:-1],
    ]
    for form in forms:
        out = _scrub(value, f"https://x.test/?k={form}&n=1".encode())
        assert out == f"https://x.test/?k={PH}&n=1".encode(), form


def test_the_value_is_replaced_by_its_placeholder_everywhere() -> None:
    text = f"a {VALUE} b {VALUE}{VALUE} c".encode()
    assert _scrub(VALUE, text) == f"a {PH} b {PH}{PH} c".encode()


def test_forms_are_long_enough_not_to_match_by_chance() -> None:
    assert all(len(f) >= 8 for f in value_forms(b"12345678"))
    assert b"123" in value_forms(b"123")  # a short legacy value still scrubs raw


@pytest.mark.parametrize("seed", range(20))
def test_streaming_finds_values_split_across_reads(seed: int) -> None:
    rng = random.Random(seed)
    other = "tok-" + os.urandom(10).hex()
    pairs = [(PH.encode(), secret()), (b"agentbox_secret_other", secret(other))]
    parts = [os.urandom(rng.randrange(0, 50)).hex().encode() for _ in range(8)]
    values = [VALUE, other, base64.b64encode(VALUE.encode()).decode(), urllib.parse.quote(other)]
    text = b"".join(p + rng.choice(values).encode() for p in parts)
    whole = Scrubber.for_secrets(pairs).line(text)
    s = Scrubber.for_secrets(pairs)
    out, pos = b"", 0
    while pos < len(text):
        n = rng.randrange(1, 12)
        out += s.feed(text[pos : pos + n])
        pos += n
    out += s.flush()
    assert out == whole
    assert VALUE.encode() not in out and other.encode() not in out


def test_a_value_split_at_every_position_is_found() -> None:
    text = b"x" * 5 + VALUE.encode() + b"y" * 5
    for cut in range(len(text) + 1):
        s = Scrubber.for_secrets([(PH.encode(), secret())])
        assert s.feed(text[:cut]) + s.feed(text[cut:]) + s.flush() == b"xxxxx" + PH.encode() + (
            b"yyyyy"
        )


def test_the_scrubber_holds_back_only_a_bounded_tail() -> None:
    s = Scrubber.for_secrets([(PH.encode(), secret())])
    longest = max(len(f) for f in value_forms(VALUE.encode()))
    for _ in range(50):
        s.feed(os.urandom(4096))
        assert len(s._tail) < longest


# ---------------------------------------------------------------------------- response bodies


def _body(
    data: bytes, coding: str | None, pieces: int = 1, has_body: bool = True
) -> tuple[list[tuple[bytes, bytes]], bytes]:
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(data)).encode())]
    if coding:
        headers.append((b"content-encoding", coding.encode()))
    body = ResponseBody.open(Scrubber.for_secrets([(PH.encode(), secret())]), headers, has_body)
    out = b""
    step = max(1, -(-len(data) // pieces))
    for i in range(0, len(data), step):
        out += b"".join(body.feed(data[i : i + step]))
    return body.headers, out + b"".join(body.finish())


ECHO = f"echo: Bearer {VALUE}\n".encode() * 3


def _deflate(data: bytes, wbits: int) -> bytes:
    c = zlib.compressobj(wbits=wbits)
    return c.compress(data) + c.flush()


@pytest.mark.parametrize(
    ("coding", "encoded"),
    [
        (None, ECHO),
        ("identity", ECHO),
        ("gzip", gzip.compress(ECHO)),
        ("x-gzip", gzip.compress(ECHO)),
        ("GZIP", gzip.compress(ECHO)),
        ("gzip", gzip.compress(ECHO[:20]) + gzip.compress(ECHO[20:])),  # two members
        ("deflate", _deflate(ECHO, 15)),  # zlib-wrapped, as the RFC says
        ("deflate", _deflate(ECHO, -15)),  # raw, as some servers send it
        ("deflate, gzip", gzip.compress(_deflate(ECHO, 15))),
    ],
)
@pytest.mark.parametrize("pieces", [1, 7, 10_000])
def test_encoded_bodies_are_decoded_and_scrubbed(
    coding: str | None, encoded: bytes, pieces: int
) -> None:
    headers, out = _body(encoded, coding, pieces)
    assert out == ECHO.replace(VALUE.encode(), PH.encode())
    names = [n for n, _ in headers]
    assert b"content-length" not in names and b"content-encoding" not in names
    assert (b"content-type", b"text/plain") in headers


@pytest.mark.parametrize("coding", ["br", "zstd", "compress", "gzip, br", "x-custom"])
def test_codings_the_proxy_cannot_decode_are_uninspectable(coding: str) -> None:
    with pytest.raises(Uninspectable, match="cannot decode"):
        _body(b"whatever", coding)
    headers, _ = _body(b"", coding, has_body=False)  # a HEAD answer: nothing to read
    assert (b"content-encoding", coding.encode()) in headers


def test_response_headers_are_scrubbed() -> None:
    scrubber = Scrubber.for_secrets([(PH.encode(), secret())])
    b64 = base64.b64encode(VALUE.encode())
    body = ResponseBody.open(
        scrubber,
        [(b"x-echo", f"Bearer {VALUE}".encode()), (b"location", b"/?t=" + b64)],
        has_body=True,
    )
    assert body.headers == [
        (b"x-echo", f"Bearer {PH}".encode()),
        (b"location", b"/?t=" + PH.encode()),
    ]


def test_a_decompression_bomb_streams_in_bounded_pieces() -> None:
    bomb = gzip.compress(b"\0" * (64 << 20), compresslevel=9)
    body = ResponseBody.open(
        Scrubber.for_secrets([(PH.encode(), secret())]), [(b"content-encoding", b"gzip")], True
    )
    total, biggest = 0, 0
    for i in range(0, len(bomb), 4096):
        for piece in body.feed(bomb[i : i + 4096]):
            total, biggest = total + len(piece), max(biggest, len(piece))
    for piece in body.finish():
        total, biggest = total + len(piece), max(biggest, len(piece))
    assert total == 64 << 20
    assert biggest <= 256 * 1024 + 1024


def test_a_broken_coding_raises_zlib_error() -> None:
    body = ResponseBody.open(
        Scrubber.for_secrets([(PH.encode(), secret())]), [(b"content-encoding", b"gzip")], True
    )
    with pytest.raises(zlib.error):
        b"".join(body.feed(b"\x1f\x8b\x08\x00garbage-garbage-garbage"))


# ---------------------------------------------------------------------------- the proxy


class Echo:
    """An HTTP(S) upstream on 127.0.0.1 that echoes the Authorization header it got, in the
    way the path asks; it records every request."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                heard = {k.lower(): v for k, v in self.headers.items()}
                outer.requests.append({"method": self.command, "path": self.path, **heard})
                auth = heard.get("authorization", "").encode()
                mode = self.path.split("?")[0].strip("/")
                if mode == "chunked":
                    self.send_response(200)
                    self.send_header("X-Echo", auth.decode("latin-1"))
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for i in range(0, len(auth), 3):  # the value split across chunks and reads
                        part = auth[i : i + 3]
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                        self.wfile.flush()
                        time.sleep(0.002)
                    self.wfile.write(b"0\r\n\r\n")
                    return
                if mode == "upgrade":
                    self.send_response(101)
                    self.send_header("Connection", "Upgrade")
                    self.send_header("Upgrade", "websocket")
                    self.end_headers()
                    self.wfile.write(auth)
                    return
                body, coding = auth, None
                if mode == "gzip":
                    body, coding = gzip.compress(auth), "gzip"
                elif mode == "br":
                    coding = "br"  # not really: the proxy must not pass it either way
                elif mode == "b64":
                    body = base64.b64encode(auth) + b"\n" + base64.b64encode(auth[7:])
                elif mode == "url":
                    body = urllib.parse.quote(auth.decode(), safe="").encode()
                elif mode == "quiet":
                    body = b"ok"
                self.send_response(200)
                self.send_header("X-Echo", auth.decode("latin-1"))
                if coding:
                    self.send_header("Content-Encoding", coding)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_TRACE = do_TRACK = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def seen(self, path: str) -> list[dict[str, Any]]:
        """The requests for `path` (the query aside)."""
        return [r for r in self.requests if r["path"].split("?")[0] == path]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Sandbox:
    """The proxy serving one sandbox with one secret, run in its own event loop thread; the
    test is the client (HTTP_PROXY on `port`), trusting the sandbox's CA."""

    def __init__(self, tmp: Path, secret: BoundSecret, upstream_ca: Path, weaken: str = "") -> None:
        self.events: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.proxy = EgressProxy(
            guard=AddressGuard(["127.0.0.0/8"]),
            static_hosts={"bound.test": "127.0.0.1", "other.test": "127.0.0.1"},
            upstream_ca_files=[upstream_ca],
            secret=lambda tenant, name: secret if name == secret.name else None,
            record=self.events.append,
            weaken=frozenset({weaken} - {""}),
        )
        self.ca = EgressCA.generate("sbx", tmp / "sbx-ca")
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        policy = EgressPolicy.from_dict({"allow_out": ["bound.test", "other.test"]})
        self._run(
            self.proxy.attach("sbx", "t", policy, {HTTP_PORT: sock}, {PH: secret.name}, self.ca)
        )

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self._run(self.proxy.close())
        self.loop.call_soon_threadsafe(self.loop.stop)

    def request(
        self, url: str, method: str = "GET", headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """One request through the proxy: http:// as an absolute URL, https:// via CONNECT."""
        u = urllib.parse.urlsplit(url)
        conn: http.client.HTTPConnection
        if u.scheme == "https":
            ctx = ssl.create_default_context(cadata=self.ca.cert_pem.decode())
            conn = http.client.HTTPSConnection("127.0.0.1", self.port, timeout=10, context=ctx)
            conn.set_tunnel(u.hostname or "", u.port)
            target = u.path + (f"?{u.query}" if u.query else "")
        else:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            target = url
        try:
            conn.request(method, target, headers=headers or {})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def recorded(self, count: int, rule: str | None = None) -> list[dict[str, Any]]:
        """The attempts recorded (refused under `rule`, if given), once there are `count`: the
        proxy records an attempt just after it answers."""
        deadline = time.monotonic() + 5
        while True:
            found = [
                e for e in self.events if rule is None or (e["rule"], e["allowed"]) == (rule, False)
            ]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.01)


@pytest.fixture(scope="module")
def upstream_ca_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("upstream") / "ca"


@pytest.fixture(scope="module")
def upstream_ca(upstream_ca_dir: Path) -> Iterator[EgressCA]:
    """The tests' own CA for their HTTPS upstream, which the proxy is told to trust."""
    ca = EgressCA.generate("upstream", upstream_ca_dir)
    yield ca
    ca.close()


@pytest.fixture(scope="module")
def plain() -> Iterator[Echo]:
    up = Echo()
    yield up
    up.close()


@pytest.fixture(scope="module")
def secure(upstream_ca: EgressCA) -> Iterator[Echo]:
    up = Echo(upstream_ca.server_context("bound.test"))
    yield up
    up.close()


@pytest.fixture
def make(tmp_path: Path, upstream_ca: EgressCA, upstream_ca_dir: Path) -> Iterator[Any]:
    """make(weaken="", **secret fields) -> a Sandbox whose one secret is bound to bound.test."""
    made: list[Sandbox] = []

    def make(weaken: str = "", **kw: Any) -> Sandbox:
        sbx = Sandbox(
            tmp_path / str(len(made)), secret(**kw), upstream_ca_dir / CA_CERT_FILE, weaken
        )
        made.append(sbx)
        return sbx

    yield make
    for sbx in made:
        sbx.close()


AUTH = {"Authorization": f"Bearer {PH}"}


def test_over_verified_tls_only_the_bound_header_gets_the_value(make: Any, secure: Echo) -> None:
    sbx = make()
    status, _, _ = sbx.request(
        f"https://bound.test:{secure.port}/quiet/tls", headers={**AUTH, "X-Other": PH}
    )
    assert status == 200
    got = secure.seen("/quiet/tls")[-1]
    assert got["authorization"] == f"Bearer {VALUE}" and got["x-other"] == PH


def test_plain_http_gets_the_placeholder_unless_the_secret_opts_in(make: Any, plain: Echo) -> None:
    basic = {"Authorization": "Basic " + base64.b64encode(f"git:{PH}".encode()).decode()}
    sbx = make()
    sbx.request(f"http://bound.test:{plain.port}/quiet/plain", headers=AUTH)
    sbx.request(f"http://bound.test:{plain.port}/quiet/plain-basic", headers=basic)
    assert plain.seen("/quiet/plain")[-1]["authorization"] == f"Bearer {PH}"
    assert plain.seen("/quiet/plain-basic")[-1]["authorization"] == basic["Authorization"]
    opted = make(allow_plaintext=True)
    opted.request(f"http://bound.test:{plain.port}/quiet/opted", headers=AUTH)
    assert plain.seen("/quiet/opted")[-1]["authorization"] == f"Bearer {VALUE}"


def test_other_hosts_get_the_placeholder(make: Any, plain: Echo) -> None:
    make(allow_plaintext=True).request(f"http://other.test:{plain.port}/quiet/o", headers=AUTH)
    assert plain.seen("/quiet/o")[-1]["authorization"] == f"Bearer {PH}"


def test_an_upstream_that_does_not_verify_gets_nothing(make: Any, tmp_path: Path) -> None:
    stranger = EgressCA.generate("stranger", tmp_path / "stranger")
    up = Echo(stranger.server_context("bound.test"))
    try:
        status, headers, body = make().request(f"https://bound.test:{up.port}/quiet", headers=AUTH)
    finally:
        up.close()
        stranger.close()
    assert status == 502 and headers["x-agentbox-rule"] == "upstream_tls"
    assert b"did not verify" in body
    assert not up.requests


@pytest.mark.parametrize("scheme", ["https", "http"])
@pytest.mark.parametrize("mode", ["raw", "gzip", "chunked", "b64", "url"])
def test_echoed_values_come_back_as_placeholders(
    make: Any, plain: Echo, secure: Echo, scheme: str, mode: str
) -> None:
    sbx = make(allow_plaintext=True)
    port = secure.port if scheme == "https" else plain.port
    status, headers, body = sbx.request(
        f"{scheme}://bound.test:{port}/{mode}", headers={**AUTH, "Accept-Encoding": "gzip"}
    )
    assert status == 200
    up = secure if scheme == "https" else plain
    assert up.seen(f"/{mode}")[-1]["authorization"] == f"Bearer {VALUE}"  # it was sent...
    assert not _leaks(VALUE.encode(), body), body  # ...and does not come back
    assert not _leaks(VALUE.encode(), urllib.parse.unquote_to_bytes(body))
    assert headers["x-echo"] == f"Bearer {PH}"
    assert "content-encoding" not in headers
    if mode in ("raw", "gzip", "chunked"):
        assert body == f"Bearer {PH}".encode()


def test_trace_to_a_bound_host_is_refused(make: Any, secure: Echo, plain: Echo) -> None:
    sbx = make(allow_plaintext=True)
    for url in (f"https://bound.test:{secure.port}/trace", f"http://bound.test:{plain.port}/trace"):
        for method in ("TRACE", "TRACK", "trace"):
            status, headers, body = sbx.request(url, method, headers=AUTH)
            assert status == 405, (url, method)
            assert headers["x-agentbox-rule"] == "secret_echo_method"
            assert VALUE.encode() not in body
    assert not secure.seen("/trace") and not plain.seen("/trace")
    refused = sbx.recorded(6, "secret_echo_method")
    assert len(refused) == 6 and all("answers with the request" in e["reason"] for e in refused)
    # Elsewhere TRACE is no business of the secrets' rules.
    status, _, _ = sbx.request(f"http://other.test:{plain.port}/quiet/t", "TRACE")
    assert status == 200


@pytest.mark.parametrize("mode", ["br", "upgrade"])
def test_responses_the_proxy_cannot_scrub_are_refused_when_a_value_went_out(
    make: Any, secure: Echo, mode: str
) -> None:
    sbx = make()
    headers = {**AUTH}
    if mode == "upgrade":
        headers |= {"Connection": "Upgrade", "Upgrade": "websocket"}
    status, got, body = sbx.request(f"https://bound.test:{secure.port}/{mode}", headers=headers)
    assert status == 502 and got["x-agentbox-rule"] == "secret_uninspectable"
    assert VALUE.encode() not in body and b"secret" in body
    (event,) = sbx.recorded(1, "secret_uninspectable")
    assert event["status"] == 502 and event["path"] == f"/{mode}"
    assert ("br-encoded" if mode == "br" else "switched protocols") in event["reason"]
    # Without a value on the request there is nothing to keep out: relayed.
    status, _, _ = sbx.request(f"https://bound.test:{secure.port}/br", headers={"X": "y"})
    assert status == 200


def test_requests_to_bound_hosts_ask_only_for_codings_the_scrubber_reads(
    make: Any, secure: Echo
) -> None:
    sbx = make()
    sbx.request(
        f"https://bound.test:{secure.port}/quiet/ae",
        headers={**AUTH, "Accept-Encoding": "br, zstd", "Range": "bytes=7-9", "If-Range": "x"},
    )
    got = secure.seen("/quiet/ae")[-1]
    assert got["accept-encoding"] == "gzip, deflate"
    assert "range" not in got and "if-range" not in got  # no echo in slices


def test_the_log_never_holds_the_value(make: Any, secure: Echo) -> None:
    sbx = make(in_url=True)
    sbx.request(f"https://bound.test:{secure.port}/quiet/log?key={PH}", headers=AUTH)
    assert secure.seen("/quiet/log")[-1]["path"] == f"/quiet/log?key={VALUE}"
    log = json.dumps(sbx.recorded(2))  # the request, and the tunnel it came through
    assert VALUE not in log and PH in log


def test_the_weakened_proxy_injects_anywhere_and_scrubs_nothing(make: Any, plain: Echo) -> None:
    sbx = make("secrets-loose")
    _, _, body = sbx.request(f"http://bound.test:{plain.port}/raw", headers=AUTH)
    assert body == f"Bearer {VALUE}".encode()
    sbx.request(f"http://bound.test:{plain.port}/quiet/loose", headers={"X-Other": PH})
    assert plain.seen("/quiet/loose")[-1]["x-other"] == VALUE
    status, _, _ = sbx.request(f"http://bound.test:{plain.port}/trace-loose", "TRACE")
    assert status == 200


# ---------------------------------------------------------------------------- stored bindings


def test_secrets_stored_before_bindings_get_the_defaults(tmp_path: Path) -> None:
    """A data dir from before `headers` and `allow_plaintext`: Authorization, TLS only."""
    import sqlite3

    from agentbox.core.network import NetworkService, NetworkSettings
    from agentbox.store.db import Store

    with sqlite3.connect(tmp_path / "agentbox.db") as db:
        db.execute(
            "CREATE TABLE secrets (tenant VARCHAR(128) NOT NULL, name VARCHAR(64) NOT NULL, "
            "value VARCHAR NOT NULL, hosts JSON NOT NULL, in_url BOOLEAN NOT NULL, "
            "created_at FLOAT NOT NULL, updated_at FLOAT NOT NULL, PRIMARY KEY (tenant, name))"
        )
    net = NetworkService(Store.for_data_dir(tmp_path), tmp_path, NetworkSettings())
    token = net._fernet.encrypt(VALUE.encode()).decode()
    with sqlite3.connect(tmp_path / "agentbox.db") as db:
        db.execute(
            "INSERT INTO secrets (tenant, name, value, hosts, in_url, created_at, updated_at) "
            "VALUES ('t', 'OLD', ?, '[\"bound.test\"]', 0, 1, 1)",
            (token,),
        )
    found = net.bound_secret("t", "OLD")
    assert found is not None and found.value == VALUE
    assert found.headers == ("Authorization",) and not found.allow_plaintext
    (info,) = net.list_secrets("t")
    assert info["headers"] == ["Authorization"] and info["allow_plaintext"] is False
    info = net.set_secret("t", "NEW", VALUE, ["bound.test"], headers=["X-Key"])
    assert info["headers"] == ["X-Key"] and net.bound_secret("t", "NEW").headers == ("X-Key",)
