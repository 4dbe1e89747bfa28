"""Egress through the policy proxy, with real sandboxes and real upstream servers on loopback.

The test server lets policies reach 127.0.0.0/8 (`--egress-allow-cidr`) and names a few test
hosts (`--egress-resolve`); every other internal range stays refused, and is only ever refused
before any connection is made, so nothing leaves this machine.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import shlex
import signal
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from conftest import ServerHandle, create_sandbox, run, start_server

from agentbox.egress.tls import CA_CERT_FILE, EgressCA

pytestmark = pytest.mark.timeout(180)


class Upstream:
    """An HTTP(S) server on 127.0.0.1 that remembers every request it got. Under /echo/MODE/
    it sends back the Authorization header it got, the way MODE says (see `_echo`)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                outer.requests.append(
                    {
                        "method": self.command,
                        "path": self.path,
                        "headers": {k.lower(): v for k, v in self.headers.items()},
                        "body": body,
                    }
                )
                if self.path.startswith("/echo/"):
                    _echo(self, self.path.split("/")[2])
                    return
                out = b"hello from upstream " + self.command.encode() + b"\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_PUT = do_TRACE = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def seen(self, path: str) -> list[dict]:
        return [r for r in self.requests if r["path"].startswith(path)]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _echo(h: BaseHTTPRequestHandler, mode: str) -> None:
    """Send the request's Authorization header back: raw (and in an X-Echo header), gzip'd,
    chunked with the value split across chunks and reads, base64'd, URL-encoded, as a body
    "encoded" with a coding the proxy does not know (br), on a protocol switch (upgrade), or,
    for git, only once credentials come (401 first)."""
    auth = h.headers.get("Authorization", "").encode("latin-1")
    if mode == "git" and not auth:
        h.send_response(401)
        h.send_header("WWW-Authenticate", 'Basic realm="echo"')
        h.send_header("Content-Length", "0")
        h.end_headers()
        return
    if mode == "upgrade":
        h.send_response(101)
        h.send_header("Connection", "Upgrade")
        h.send_header("Upgrade", "websocket")
        h.end_headers()
        h.wfile.write(auth)
        return
    h.send_response(200)
    h.send_header("X-Echo", auth.decode("latin-1"))
    if mode == "chunked":
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        for i in range(0, len(auth), 5):
            h.wfile.write(b"%x\r\n%s\r\n" % (len(auth[i : i + 5]), auth[i : i + 5]))
            h.wfile.flush()
            time.sleep(0.005)
        h.wfile.write(b"0\r\n\r\n")
        return
    body = {
        "gzip": gzip.compress(auth),
        "b64": base64.b64encode(auth) + b" " + base64.urlsafe_b64encode(auth.split(b" ")[-1]),
        "url": urllib.parse.quote(auth.decode("latin-1"), safe="").encode(),
    }.get(mode, auth)
    coding = {"gzip": "gzip", "br": "br"}.get(mode)
    if coding:
        h.send_header("Content-Encoding", coding)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


@pytest.fixture(scope="module")
def upstream_ca_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("upstream-ca") / "ca"


@pytest.fixture(scope="module")
def upstream_ca(upstream_ca_dir: Path) -> Iterator[EgressCA]:
    """A CA of the tests' own for their HTTPS upstream, which the proxy is told to trust."""
    ca = EgressCA.generate("test upstream", upstream_ca_dir)
    yield ca
    ca.close()


@pytest.fixture(scope="module")
def plain(upstream_ca: EgressCA) -> Iterator[Upstream]:
    up = Upstream()
    yield up
    up.close()


@pytest.fixture(scope="module")
def secure(upstream_ca: EgressCA) -> Iterator[Upstream]:
    up = Upstream(upstream_ca.server_context("secure.test"))
    yield up
    up.close()


TEST_HOSTS = (
    "upstream.test",
    "other.test",
    "wild.test",
    "a.wild.test",
    "bad.wild.test",
    "secure.test",
    "unbound-secure.test",
)


@pytest.fixture(scope="module")
def egress_server(
    tmp_path_factory: pytest.TempPathFactory, upstream_ca: EgressCA, upstream_ca_dir: Path
) -> Iterator[ServerHandle]:
    ca_file = upstream_ca_dir / CA_CERT_FILE
    args = ["--egress-allow-cidr", "127.0.0.0/8", "--egress-upstream-ca", str(ca_file)]
    for host in TEST_HOSTS:
        args += ["--egress-resolve", f"{host}={'127.0.0.1'}"]
    # Rebinding-style answers: allowed names that resolve to internal addresses.
    args += ["--egress-resolve", "private.test=10.0.0.5"]
    args += ["--egress-resolve", "meta.test=169.254.169.254"]
    args += ["--egress-deny", "forbidden.test"]
    handle = start_server(tmp_path_factory.mktemp("egress"), args)
    yield handle
    handle.kill_all_sandboxes()
    handle.stop()


@pytest.fixture
def client(egress_server: ServerHandle) -> Iterator[httpx.Client]:
    key = egress_server.make_key(f"egress-{time.monotonic_ns() % 10**9}")
    with egress_server.client(key) as c:
        yield c


def _curl(url: str, *extra: str) -> str:
    return "curl -sS -m 10 -o /dev/null -w '%{http_code}' " + " ".join(extra) + " " + url


def _events(client: httpx.Client, **params: object) -> list[dict]:
    r = client.get("/v1/audit/egress", params=params)
    assert r.status_code == 200, r.text
    return r.json()["events"]


# ---------------------------------------------------------------------------- policy


def test_default_sandbox_has_no_egress_and_is_told_why(
    client: httpx.Client, plain: Upstream
) -> None:
    sid = create_sandbox(client)["sandbox_id"]
    res = run(client, sid, f"curl -sS -m 10 -i http://upstream.test:{plain.port}/x")
    assert "403" in res.stdout and "network policy" in res.stdout
    assert "allow_out" in res.stdout  # says how to allow it, for this very sandbox
    assert f"PUT /v1/sandboxes/{sid}/network" in res.stdout
    assert not plain.seen("/x")
    blocked = res.end["network_blocked"]
    assert blocked and blocked[0]["host"] == "upstream.test"
    res = run(client, sid, _curl(f"http://upstream.test:{plain.port}/y", "-f"))
    assert res.exit_code != 0
    assert res.end["violation"]["code"] == "network_blocked"


def test_allow_exact_wildcard_and_deny_wins(client: httpx.Client, plain: Upstream) -> None:
    net = {
        "allow_out": ["upstream.test", "*.wild.test"],
        "deny_out": ["bad.wild.test"],
    }
    sid = create_sandbox(client, network=net)["sandbox_id"]
    p = plain.port
    codes = {}
    for host in ("upstream.test", "a.wild.test", "wild.test", "bad.wild.test", "other.test"):
        codes[host] = run(client, sid, _curl(f"http://{host}:{p}/w-{host}")).stdout
    assert codes == {
        "upstream.test": "200",
        "a.wild.test": "200",
        "wild.test": "403",  # *.wild.test does not cover the apex
        "bad.wild.test": "403",  # deny wins
        "other.test": "403",
    }
    assert plain.seen("/w-a.wild.test") and not plain.seen("/w-bad.wild.test")
    # Python's urllib uses the proxy variables too.
    py = f"import urllib.request as u; print(u.urlopen('http://upstream.test:{p}/py').status)"
    assert run(client, sid, f"python3 -c {shlex.quote(py)}").stdout.strip() == "200"


def test_port_rules(client: httpx.Client, plain: Upstream) -> None:
    sid = create_sandbox(client, network={"allow_out": [f"upstream.test:{plain.port}"]})[
        "sandbox_id"
    ]
    assert run(client, sid, _curl(f"http://upstream.test:{plain.port}/p")).stdout == "200"
    assert run(client, sid, _curl("http://upstream.test:1/p")).stdout == "403"


def test_operator_deny_beats_allow_internet(client: httpx.Client) -> None:
    sid = create_sandbox(client, network={"allow_internet_access": True})["sandbox_id"]
    res = run(client, sid, "curl -sS -m 10 -i http://forbidden.test/")
    assert "403" in res.stdout and "operator" in res.stdout


@pytest.mark.parametrize(
    "target",
    [
        "private.test",  # an allowed name answered with a private address
        "meta.test",  # ... or with the metadata address
        "169.254.169.254",
        "0xa9fea9fe",
        "2852039166",
        "[::ffff:169.254.169.254]",
        "[fd00:ec2::254]",
        "10.0.0.1",
        "0x0a000001",
        "100.64.0.1",
        "192.168.1.1",
        "[fe80::1]",
    ],
)
def test_internal_destinations_refused_even_when_allowed(client: httpx.Client, target: str) -> None:
    sid = create_sandbox(
        client,
        network={
            "allow_out": ["private.test", "meta.test", "10.0.0.0/8", "169.254.0.0/16"],
            "allow_internet_access": True,
        },
    )["sandbox_id"]
    res = run(client, sid, f"curl -sS -m 10 -i http://{target}/latest/meta-data/")
    assert "403" in res.stdout, res.stdout + res.stderr
    connect = run(client, sid, f"curl -sS -m 10 -p -i http://{target}:443/")
    assert connect.exit_code != 0
    events = _events(client, sandbox_id=sid, allowed="false")
    assert events and all(
        e["rule"] in ("address_guard", "sandbox: no allow_out rule matches")
        or e["rule"].startswith("sandbox")
        for e in events
    )
    assert any(e["rule"] == "address_guard" for e in events)


def test_no_way_around_the_proxy(client: httpx.Client, plain: Upstream) -> None:
    sid = create_sandbox(client, network={"allow_internet_access": True})["sandbox_id"]
    host_ip = _host_address()
    script = f"""
set -u
curl -sS -m 5 --noproxy '*' http://127.0.0.1:{plain.port}/direct && echo DIRECT-OK
curl -sS -m 5 --noproxy '*' http://{host_ip}:{plain.port}/direct && echo HOSTIP-OK
env -u HTTP_PROXY -u http_proxy -u ALL_PROXY -u all_proxy \
  curl -sS -m 5 http://upstream.test:{plain.port}/direct && echo NOPROXY-OK
getent hosts example.com && echo DNS-OK
python3 -c "import socket; socket.create_connection(('{host_ip}', {plain.port}), 3)" \
  && echo PY-OK
ip route 2>/dev/null | grep -q . && echo ROUTE-OK
exit 0
"""
    res = run(client, sid, script)
    for marker in ("DIRECT-OK", "HOSTIP-OK", "NOPROXY-OK", "DNS-OK", "PY-OK", "ROUTE-OK"):
        assert marker not in res.stdout, res.stdout + res.stderr
    assert not plain.seen("/direct")


def _host_address() -> str:
    """An address of this host other than loopback (what a sandbox might try to reach)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 9))  # no packet is sent: only picks the source address
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.2"
    finally:
        s.close()


def test_policy_update_takes_effect(client: httpx.Client, plain: Upstream) -> None:
    sid = create_sandbox(client)["sandbox_id"]
    url = f"http://other.test:{plain.port}/upd"
    assert run(client, sid, _curl(url)).stdout == "403"
    r = client.put(f"/v1/sandboxes/{sid}/network", json={"allow_out": ["other.test"]})
    assert r.status_code == 200, r.text
    assert r.json()["network"]["allow_out"] == ["other.test"]
    assert run(client, sid, _curl(url)).stdout == "200"
    r = client.put(f"/v1/sandboxes/{sid}/network", json={"deny_out": ["other.test"]})
    assert r.status_code == 200
    assert run(client, sid, _curl(url)).stdout == "403"
    bad = client.put(f"/v1/sandboxes/{sid}/network", json={"allow_out": ["*.com"]})
    assert bad.status_code == 400 and "allow_internet_access" in bad.json()["message"]


def test_host_header_and_sni_must_match(
    client: httpx.Client, plain: Upstream, secure: Upstream
) -> None:
    sid = create_sandbox(client, network={"allow_out": ["upstream.test", "secure.test"]})[
        "sandbox_id"
    ]
    res = run(
        client,
        sid,
        f"curl -sS -m 10 -i -H 'Host: evil.test' http://upstream.test:{plain.port}/hm",
    )
    assert "403" in res.stdout and "host_mismatch" in res.stdout
    assert not plain.seen("/hm")
    # Plain HTTP inside a CONNECT tunnel: each request's Host must be the tunnel's host.
    tunnel = f"""
import socket
s = socket.create_connection(("127.0.0.1", 3128), 5)
s.sendall(b"CONNECT upstream.test:{plain.port} HTTP/1.1\\r\\nHost: upstream.test\\r\\n\\r\\n")
assert s.recv(4096).startswith(b"HTTP/1.1 200")
f = s.makefile("rb")
for host in (b"upstream.test:{plain.port}", b"evil.test"):
    s.sendall(b"GET /tun HTTP/1.1\\r\\nHost: " + host + b"\\r\\n\\r\\n")
    print(f.readline().decode().strip())
    length = 0
    while (line := f.readline().strip()):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    f.read(length)
"""
    res = run(client, sid, f"python3 -c {shlex.quote(tunnel)}")
    assert res.stdout.split("\n")[:2] == [
        "HTTP/1.1 200 OK",
        "HTTP/1.1 403 Blocked by agentbox network policy",
    ], res.stdout + res.stderr
    assert len(plain.seen("/tun")) == 1 and plain.seen("/tun")[0]["headers"]["host"].startswith(
        "upstream.test"
    )
    # CONNECT to an allowed name, then a TLS hello naming another: refused.
    script = f"""
import socket, ssl
s = socket.create_connection(("127.0.0.1", 3128), 5)
s.sendall(b"CONNECT secure.test:{secure.port} HTTP/1.1\\r\\nHost: secure.test\\r\\n\\r\\n")
assert s.recv(4096).startswith(b"HTTP/1.1 200")
ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
try:
    t = ctx.wrap_socket(s, server_hostname="evil.test")
    t.sendall(b"GET /sni HTTP/1.1\\r\\nHost: evil.test\\r\\n\\r\\n")
    print("GOT", t.recv(100))
except (ssl.SSLError, OSError) as e:
    print("REFUSED", type(e).__name__)
"""
    res = run(client, sid, f"python3 -c {shlex.quote(script)}")
    assert "REFUSED" in res.stdout, res.stdout + res.stderr
    assert not secure.seen("/sni")
    assert any(e["rule"] == "sni_mismatch" for e in _events(client, sandbox_id=sid))


def test_socks5(client: httpx.Client, plain: Upstream) -> None:
    sid = create_sandbox(client, network={"allow_out": ["upstream.test"]})["sandbox_id"]
    ok = run(
        client,
        sid,
        _curl(f"http://upstream.test:{plain.port}/socks", "-x", "socks5h://127.0.0.1:1080"),
    )
    assert ok.stdout == "200", ok.stdout + ok.stderr
    assert plain.seen("/socks")
    denied = run(
        client,
        sid,
        _curl(f"http://other.test:{plain.port}/socks2", "-x", "socks5h://127.0.0.1:1080"),
    )
    assert denied.exit_code != 0
    assert not plain.seen("/socks2")


def test_audit_records_every_attempt(client: httpx.Client, plain: Upstream) -> None:
    sid = create_sandbox(client, network={"allow_out": ["upstream.test"]})["sandbox_id"]
    run(client, sid, f"curl -sS -m 10 -d hello-body http://upstream.test:{plain.port}/audit?q=1")
    run(client, sid, _curl(f"http://other.test:{plain.port}/nope"))
    events = _events(client, sandbox_id=sid)
    allowed = [e for e in events if e["allowed"]]
    denied = [e for e in events if not e["allowed"]]
    assert allowed[0]["host"] == "upstream.test" and allowed[0]["port"] == plain.port
    assert allowed[0]["method"] == "POST" and allowed[0]["path"] == "/audit?q=1"
    assert allowed[0]["bytes_out"] > len("hello-body") and allowed[0]["bytes_in"] > 0
    assert (
        allowed[0]["status"] == 200 and allowed[0]["rule"] == "sandbox: allow_out 'upstream.test'"
    )
    assert denied[0]["host"] == "other.test" and denied[0]["method"] == "GET"
    assert denied[0]["tenant"] == allowed[0]["tenant"]
    # Another tenant sees none of it.
    other = httpx.Client(base_url=str(client.base_url), headers={"X-API-Key": "nope"})
    assert other.get("/v1/audit/egress").status_code == 401


# ---------------------------------------------------------------------------- secrets


def _put_secret(
    client: httpx.Client, name: str, value: str, hosts: list[str], **binding: object
) -> dict:
    r = client.put(f"/v1/secrets/{name}", json={"value": value, "hosts": hosts, **binding})
    assert r.status_code == 200, r.text
    assert value not in r.text
    return r.json()


def _leaks(value: str, text: str) -> list[str]:
    """The forms of `value` found in `text`: raw, base64 (also of "Bearer VALUE", which puts
    it at another alignment), URL-encoded."""
    forms = {"raw": value, "quoted": urllib.parse.quote(value, safe="")}
    for what, data in (("b64", value), ("b64 bearer", f"Bearer {value}")):
        forms[what] = base64.b64encode(data.encode()).decode().rstrip("=")[:-2]
        forms[what + " urlsafe"] = base64.urlsafe_b64encode(data.encode()).decode()[:-4]
    return [what for what, form in forms.items() if form in text]


def test_secret_goes_only_where_its_binding_says(
    client: httpx.Client, plain: Upstream, secure: Upstream
) -> None:
    """Authorization (the default header), bound hosts only, verified TLS only."""
    value = "sk-live-" + os.urandom(12).hex()
    info = _put_secret(client, "API_TOKEN", value, ["upstream.test", "secure.test"])
    sid = create_sandbox(
        client,
        secrets=["API_TOKEN"],
        network={
            "allow_out": ["upstream.test", "other.test", "secure.test", "unbound-secure.test"]
        },
    )["sandbox_id"]
    placeholder = run(client, sid, 'printf %s "$API_TOKEN"').stdout
    assert placeholder.startswith("agentbox_secret_") and value not in placeholder
    hdr = '-H "Authorization: Bearer $API_TOKEN" -H "X-Other: $API_TOKEN"'
    for url in (
        f"https://secure.test:{secure.port}/b-tls",
        f"http://upstream.test:{plain.port}/b-plain",  # bound, but no TLS
        f"http://other.test:{plain.port}/b-unbound",
        f"https://unbound-secure.test:{secure.port}/b-unbound-tls -k",  # tunnelled untouched
    ):
        res = run(client, sid, f"curl -sS -m 10 -f {hdr} {url}")
        assert res.exit_code == 0, res.stdout + res.stderr
    got = {
        path: (h["authorization"], h["x-other"])
        for path in ("/b-tls", "/b-plain", "/b-unbound", "/b-unbound-tls")
        for h in [(plain.seen(path) or secure.seen(path))[-1]["headers"]]
    }
    assert got == {
        "/b-tls": (f"Bearer {value}", placeholder),
        "/b-plain": (f"Bearer {placeholder}", placeholder),
        "/b-unbound": (f"Bearer {placeholder}", placeholder),
        "/b-unbound-tls": (f"Bearer {placeholder}", placeholder),
    }
    # A tunnel to a bound host is for TLS, which the proxy terminates: plain HTTP in it fails.
    run(client, sid, f"curl -sS -m 10 -p {hdr} http://upstream.test:{plain.port}/b-tunnel")
    assert not plain.seen("/b-tunnel")
    events = _events(client, sandbox_id=sid)
    assert any(e["protocol"] == "https-inspected" and e["path"] == "/b-tls" for e in events)
    assert value not in json.dumps(events)
    assert info["headers"] == ["Authorization"] and info["allow_plaintext"] is False


def test_basic_credentials_as_git_sends_them(client: httpx.Client, secure: Upstream) -> None:
    """The placeholder as a password (curl -u, user:password@ in a URL, a git credential
    helper) travels base64'd in Authorization: Basic; the proxy swaps it inside."""
    value = "ghp_" + os.urandom(12).hex()
    _put_secret(client, "GIT_TOKEN", value, ["secure.test"])
    sid = create_sandbox(client, secrets=["GIT_TOKEN"], network={"allow_out": ["secure.test"]})[
        "sandbox_id"
    ]
    base = f"secure.test:{secure.port}"
    run(client, sid, f'curl -sS -m 10 -u "user:$GIT_TOKEN" https://{base}/basic-u')
    run(client, sid, f'curl -sS -m 10 "https://user:$GIT_TOKEN@{base}/basic-url"')
    git = "git -c http.sslCAInfo=$GIT_SSL_CAINFO"
    run(client, sid, f'{git} ls-remote "https://git:$GIT_TOKEN@{base}/echo/git/url.git"')
    helper = "!f() { echo username=x-access-token; echo password=$GIT_TOKEN; }; f"
    run(
        client,
        sid,
        f"{git} -c credential.helper='{helper}' ls-remote https://{base}/echo/git/h.git",
    )
    sent = {}
    for path in ("/basic-u", "/basic-url", "/echo/git/url.git", "/echo/git/h.git"):
        with_auth = [r for r in secure.seen(path) if "authorization" in r["headers"]]
        assert with_auth, f"{path}: no credentials arrived"
        scheme, _, b64 = with_auth[-1]["headers"]["authorization"].partition(" ")
        sent[path] = (scheme, base64.b64decode(b64).decode())
    assert sent == {
        "/basic-u": ("Basic", f"user:{value}"),
        "/basic-url": ("Basic", f"user:{value}"),
        "/echo/git/url.git": ("Basic", f"git:{value}"),
        "/echo/git/h.git": ("Basic", f"x-access-token:{value}"),
    }


def test_plaintext_needs_an_explicit_opt_in(client: httpx.Client, plain: Upstream) -> None:
    url = f"http://upstream.test:{plain.port}"

    def sent(name: str, value: str, **binding: object) -> tuple[str, bytes]:
        """What upstream.test got over plain HTTP as Bearer and as Basic credentials."""
        _put_secret(client, name, value, ["upstream.test"], **binding)
        sid = create_sandbox(client, secrets=[name], network={"allow_out": ["upstream.test"]})[
            "sandbox_id"
        ]
        run(client, sid, f'curl -sS -m 10 -H "Authorization: Bearer ${name}" {url}/pt-{name}')
        run(client, sid, f'curl -sS -m 10 -u "u:${name}" {url}/pt-basic-{name}')
        basic = plain.seen(f"/pt-basic-{name}")[-1]["headers"]["authorization"]
        bearer = plain.seen(f"/pt-{name}")[-1]["headers"]["authorization"]
        return bearer, base64.b64decode(basic.removeprefix("Basic "))

    strict = "strict-" + os.urandom(8).hex()
    bearer, basic = sent("STRICT_TOKEN", strict)
    assert bearer.startswith("Bearer agentbox_secret_") and basic.startswith(b"u:agentbox_secret_")
    opted = "plain-" + os.urandom(8).hex()
    assert sent("PLAIN_TOKEN", opted, allow_plaintext=True) == (
        f"Bearer {opted}",
        f"u:{opted}".encode(),
    )


def test_in_url_secrets_follow_the_same_rules(
    client: httpx.Client, plain: Upstream, secure: Upstream
) -> None:
    value = "key-" + os.urandom(12).hex()
    _put_secret(client, "URL_KEY", value, ["secure.test", "upstream.test"], in_url=True)
    sid = create_sandbox(
        client, secrets=["URL_KEY"], network={"allow_out": ["secure.test", "upstream.test"]}
    )["sandbox_id"]
    run(client, sid, f'curl -sS -m 10 "https://secure.test:{secure.port}/iu?key=$URL_KEY"')
    run(client, sid, f'curl -sS -m 10 "http://upstream.test:{plain.port}/iu?key=$URL_KEY"')
    assert secure.seen("/iu")[-1]["path"] == f"/iu?key={value}"
    assert plain.seen("/iu")[-1]["path"].startswith("/iu?key=agentbox_secret_")
    assert value not in json.dumps(_events(client, sandbox_id=sid))


def test_echoes_from_bound_hosts_come_back_scrubbed(client: httpx.Client, secure: Upstream) -> None:
    value = "sk-live-" + os.urandom(16).hex()
    _put_secret(client, "ECHO_TOKEN", value, ["secure.test"])
    sid = create_sandbox(client, secrets=["ECHO_TOKEN"], network={"allow_out": ["secure.test"]})[
        "sandbox_id"
    ]
    outputs = {}
    for mode in ("raw", "gzip", "chunked", "b64", "url"):
        res = run(
            client,
            sid,
            "curl -sS -m 10 -i --suppress-connect-headers --compressed "
            '-H "Authorization: Bearer $ECHO_TOKEN" '
            f"https://secure.test:{secure.port}/echo/{mode}/",
        )
        assert res.exit_code == 0, res.stderr
        assert secure.seen(f"/echo/{mode}/")[-1]["headers"]["authorization"] == f"Bearer {value}"
        outputs[mode] = res.stdout
    leaks = {mode: _leaks(value, out) for mode, out in outputs.items()}
    assert not any(leaks.values()), leaks
    placeholder = run(client, sid, 'printf %s "$ECHO_TOKEN"').stdout
    for mode in ("raw", "gzip", "chunked"):
        assert outputs[mode].endswith(f"\r\n\r\nBearer {placeholder}"), outputs[mode]
        assert f"x-echo: Bearer {placeholder}\r\n" in outputs[mode]
    assert value not in json.dumps(_events(client, sandbox_id=sid))


def test_uninspectable_responses_and_echo_methods_are_refused(
    client: httpx.Client, secure: Upstream
) -> None:
    value = "sk-live-" + os.urandom(16).hex()
    _put_secret(client, "REFUSE_TOKEN", value, ["secure.test"])
    sid = create_sandbox(client, secrets=["REFUSE_TOKEN"], network={"allow_out": ["secure.test"]})[
        "sandbox_id"
    ]
    base = f"https://secure.test:{secure.port}/echo"
    auth = '-H "Authorization: Bearer $REFUSE_TOKEN"'
    ws = "-H 'Connection: Upgrade' -H 'Upgrade: websocket' -H 'Sec-WebSocket-Version: 13' "
    ws += "-H 'Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=='"
    answers = {
        what: run(client, sid, f"curl -sS -m 10 -i --suppress-connect-headers {auth} {how}").stdout
        for what, how in {
            "trace": f"-X TRACE {base}/trace/",
            "br": f"{base}/br/",
            "websocket": f"{ws} {base}/upgrade/",
        }.items()
    }
    assert answers["trace"].startswith("HTTP/1.1 405"), answers["trace"]
    assert answers["br"].startswith("HTTP/1.1 502") and "br-encoded" in answers["br"]
    assert answers["websocket"].startswith("HTTP/1.1 502"), answers["websocket"]
    assert "switched protocols" in answers["websocket"]
    assert not any(_leaks(value, a) for a in answers.values()), answers
    assert not secure.seen("/echo/trace/")  # refused before anything went out
    refused = {e["rule"]: e for e in _events(client, sandbox_id=sid, allowed="false")}
    assert refused["secret_echo_method"]["method"] == "TRACE"
    assert refused["secret_uninspectable"]["status"] == 502
    assert refused["secret_uninspectable"]["reason"]


def test_ca_trusted_by_python_curl_and_node(client: httpx.Client, secure: Upstream) -> None:
    _put_secret(client, "TLS_TOKEN", "tls-" + os.urandom(8).hex(), ["secure.test"])
    sid = create_sandbox(client, secrets=["TLS_TOKEN"], network={"allow_out": ["secure.test"]})[
        "sandbox_id"
    ]
    url = f"https://secure.test:{secure.port}/trust"
    assert run(client, sid, _curl(url + "-curl")).stdout == "200"
    py = f"import urllib.request as u; print(u.urlopen('{url}-py').status)"
    res = run(client, sid, f"python3 -c {shlex.quote(py)}")
    assert res.stdout.strip() == "200", res.stderr
    node = f"""
const http = require('http'), tls = require('tls');
const req = http.request({{host: '127.0.0.1', port: 3128, method: 'CONNECT',
                          path: 'secure.test:{secure.port}'}});
req.on('connect', (res, sock) => {{
  const t = tls.connect({{socket: sock, servername: 'secure.test'}}, () => {{
    t.write('GET /trust-node HTTP/1.1\\r\\nHost: secure.test\\r\\nConnection: close\\r\\n\\r\\n');
  }});
  let out = ''; t.on('data', d => out += d); t.on('end', () => console.log(out.split('\\r\\n')[0]));
  t.on('error', e => console.log('ERR', e.message));
}});
req.end();
"""
    res = run(client, sid, f"node -e {shlex.quote(node)}")
    if "command not found" in res.stderr or "not found" in res.stderr:
        pytest.skip("node is not installed on this host")
    assert "200" in res.stdout, res.stdout + res.stderr
    assert secure.seen("/trust-node")


def test_secret_value_never_inside_the_sandbox(
    client: httpx.Client, egress_server: ServerHandle, plain: Upstream
) -> None:
    value = "VAL" + os.urandom(16).hex()
    _put_secret(client, "HIDDEN", value, ["upstream.test"], headers=["X-Key"], allow_plaintext=True)
    info = create_sandbox(client, secrets=["HIDDEN"], network={"allow_out": ["upstream.test"]})
    sid = info["sandbox_id"]
    assert value not in json.dumps(info)
    # Use it, so the proxy has certainly handled it; keep a process alive meanwhile.
    run(client, sid, "sleep 300 >/dev/null 2>&1 &", timeout=5)
    res = run(
        client, sid, f'curl -sS -m 10 -H "X-Key: $HIDDEN" http://upstream.test:{plain.port}/h'
    )
    assert res.exit_code == 0
    assert plain.seen("/h")[-1]["headers"]["x-key"] == value
    # The script must not carry the value itself (it would find its own command line).
    half = len(value) // 2
    search = f"""
V="$(printf %s {value[:half]})$(printf %s {value[half:]})"
grep -rasF "$V" /workspace /tmp /run /etc/ssl /var /home 2>/dev/null && echo FOUND-FILE
for p in /proc/[0-9]*; do
  cat $p/environ $p/cmdline 2>/dev/null | grep -aqF "$V" && echo FOUND-PROC-$p
done
ps auxww | grep -F "$V" | grep -v grep && echo FOUND-PS
env | grep -F "$V" && echo FOUND-ENV
exit 0
"""
    res = run(client, sid, search)
    assert "FOUND" not in res.stdout, res.stdout
    # Memory of every process of the sandbox, read from the host.
    state = egress_server.data_dir / "sandboxes" / sid / "runtime.json"
    row = json.loads(state.read_text())
    pids = _descendants(row["init_pid"])
    if "agent_pid" in row:  # forked from the zygote: the agent is not below bwrap's init
        pids += _descendants(row["agent_pid"])
    assert len(pids) >= 2
    for pid in pids:
        assert not _memory_contains(pid, value.encode()), f"value found in memory of {pid}"


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _memory_contains(pid: int, needle: bytes) -> bool:
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        mem = open(f"/proc/{pid}/mem", "rb", buffering=0)
    except OSError:
        return False
    with mem:
        for line in maps:
            addr, perms = line.split()[:2]
            if "r" not in perms:
                continue
            start, end = (int(x, 16) for x in addr.split("-"))
            if end - start > 512 << 20:
                continue
            try:
                mem.seek(start)
                if needle in mem.read(end - start):
                    return True
            except (OSError, ValueError, OverflowError):
                continue
    return False


def test_secret_api_validates_and_never_returns_values(client: httpx.Client) -> None:
    assert (
        client.put("/v1/secrets/bad-name", json={"value": "x", "hosts": ["a.test"]}).status_code
        == 400
    )
    assert client.put("/v1/secrets/OK", json={"value": "x", "hosts": ["*"]}).status_code == 400
    assert client.put("/v1/secrets/OK", json={"value": "x", "hosts": []}).status_code == 422
    _put_secret(client, "LISTED", "listed-value", ["a.test"])
    listing = client.get("/v1/secrets").json()["secrets"]
    assert [s["name"] for s in listing] == ["LISTED"] and "listed-value" not in json.dumps(listing)
    for bad, why in (
        ({"headers": ["Host"]}, "frames or routes"),
        ({"headers": ["Bad Header"]}, "not an HTTP header name"),
        ({"value": "short"}, "8 bytes"),
    ):
        body = {"value": "long-enough-value", "hosts": ["a.test"], **bad}
        r = client.put("/v1/secrets/BAD", json=body)
        assert r.status_code == 400 and why in r.json()["message"], r.text
    r = client.post("/v1/sandboxes", json={"secrets": ["MISSING"]})
    assert r.status_code == 404 and "secrets set MISSING" in r.json()["message"]
    assert client.delete("/v1/secrets/LISTED").status_code == 204
    assert client.delete("/v1/secrets/LISTED").status_code == 404


# ---------------------------------------------------------------------------- ceilings, defaults


def test_tenant_ceiling_and_default(egress_server: ServerHandle, plain: Upstream) -> None:
    tenant = f"ceil-{time.monotonic_ns() % 10**9}"
    key = egress_server.make_key(tenant)
    with egress_server.client() as admin:
        r = admin.put(
            f"/v1/tenants/{tenant}/network",
            json={
                "ceiling": {"allow_out": ["*.wild.test", "upstream.test"]},
                "default": {"allow_out": ["upstream.test"]},
            },
        )
        assert r.status_code == 200, r.text
    with egress_server.client(key) as c:
        sid = create_sandbox(c)["sandbox_id"]  # gets the tenant default
        assert run(c, sid, _curl(f"http://upstream.test:{plain.port}/d")).stdout == "200"
        r = c.post("/v1/sandboxes", json={"network": {"allow_out": ["other.test"]}})
        assert r.status_code == 403 and "ceiling" in r.json()["message"]
        r = c.post("/v1/sandboxes", json={"network": {"allow_internet_access": True}})
        assert r.status_code == 403
        assert (
            c.post("/v1/sandboxes", json={"network": {"allow_out": ["a.wild.test"]}}).status_code
            == 201
        )
        # Tenants cannot widen their own ceiling.
        assert c.put(f"/v1/tenants/{tenant}/network", json={"ceiling": None}).status_code == 403


# ---------------------------------------------------------------------------- fail closed


def test_proxy_down_means_no_egress(tmp_path: Path, plain: Upstream, upstream_ca: EgressCA) -> None:
    server = start_server(
        tmp_path,
        ["--egress-allow-cidr", "127.0.0.0/8", "--egress-resolve", "upstream.test=127.0.0.1"],
    )
    try:
        with server.client() as c:
            sid = create_sandbox(c, network={"allow_out": ["upstream.test"]})["sandbox_id"]
            loop = (
                f"while true; do {_curl(f'http://upstream.test:{plain.port}/down')} "
                ">> /workspace/codes; echo >> /workspace/codes; sleep 0.2; done"
            )
            run(c, sid, f"nohup sh -c {shlex.quote(loop)} >/dev/null 2>&1 &", timeout=5)
            time.sleep(1.0)
            before = len(plain.seen("/down"))
            assert before > 0
        server.stop(signal.SIGKILL)  # the proxy dies with the server
        time.sleep(1.5)
        during = len(plain.seen("/down"))
        time.sleep(1.5)
        assert len(plain.seen("/down")) == during  # nothing got out while it was down
        server.start()
        with server.client() as c:
            deadline = time.monotonic() + 20
            while len(plain.seen("/down")) == during and time.monotonic() < deadline:
                time.sleep(0.2)
            assert len(plain.seen("/down")) > during  # re-adopted: egress is back
            codes = run(c, sid, "cat /workspace/codes").stdout.split()
            assert "000" in codes  # attempts while the proxy was down failed
    finally:
        server.kill_all_sandboxes()
        server.stop()


def test_claimed_pool_member_gets_its_policy(tmp_path: Path, plain: Upstream) -> None:
    """A warm-pool member is started with no egress; the claim gives it the caller's policy."""
    server = start_server(
        tmp_path,
        [
            "--warm-pool",
            "default=1",
            "--egress-allow-cidr",
            "127.0.0.0/8",
            "--egress-resolve",
            "upstream.test=127.0.0.1",
        ],
    )
    try:
        with server.client() as c:
            deadline = time.monotonic() + 30
            while c.get("/v1/pools").json()["pools"][0]["ready"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            sid = create_sandbox(c, network={"allow_out": ["upstream.test"]})["sandbox_id"]
            hits = [
                e
                for e in c.get("/v1/audit", params={"sandbox_id": sid}).json()["events"]
                if e["action"] == "sandbox.create"
            ]
            assert hits and hits[0]["detail"].get("pool") == "hit"
            assert run(c, sid, _curl(f"http://upstream.test:{plain.port}/pool")).stdout == "200"
            assert run(c, sid, _curl(f"http://other.test:{plain.port}/pool")).stdout == "403"
            events = _events(c, sandbox_id=sid)
            assert {e["tenant"] for e in events} == {c.get(f"/v1/sandboxes/{sid}").json()["tenant"]}
    finally:
        server.kill_all_sandboxes()
        server.stop()


@pytest.fixture(scope="module")
def ws_upstream() -> Iterator[int]:
    """A WebSocket echo server on 127.0.0.1 (the websockets library, in a thread)."""
    import websockets.sync.server as ws_server

    def echo(conn) -> None:  # type: ignore[no-untyped-def]
        for message in conn:
            conn.send(f"echo:{message}")

    server = ws_server.serve(echo, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.socket.getsockname()[1]
    server.shutdown()


WS_CLIENT = """
import base64, os, socket, sys
mode, port = sys.argv[1], int(sys.argv[2])
s = socket.create_connection(("127.0.0.1", 3128), 5)
key = base64.b64encode(os.urandom(16)).decode()
head = (f"Host: upstream.test:{port}\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\n"
        f"Sec-WebSocket-Key: {key}\\r\\nSec-WebSocket-Version: 13\\r\\n\\r\\n")
if mode == "connect":
    s.sendall(f"CONNECT upstream.test:{port} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n".encode())
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    s.sendall(("GET / HTTP/1.1\\r\\n" + head).encode())
else:
    s.sendall((f"GET http://upstream.test:{port}/ HTTP/1.1\\r\\n" + head).encode())
f = s.makefile("rb")
print(f.readline().decode().strip())
while f.readline().strip():
    pass
mask = os.urandom(4)
data = b"hi-" + mode.encode()
masked = bytes(c ^ mask[i % 4] for i, c in enumerate(data))
s.sendall(bytes([0x81, 0x80 | len(data)]) + mask + masked)
b1, b2 = f.read(2)
print(f.read(b2 & 0x7F).decode())
"""


@pytest.mark.parametrize("mode", ["plain", "connect"])
def test_websocket_through_the_proxy(client: httpx.Client, ws_upstream: int, mode: str) -> None:
    sid = create_sandbox(client, network={"allow_out": ["upstream.test"]})["sandbox_id"]
    script = f"python3 -c {shlex.quote(WS_CLIENT)} {mode} {ws_upstream}"
    res = run(client, sid, script)
    assert res.stdout.split("\n")[:2] == ["HTTP/1.1 101 Switching Protocols", f"echo:hi-{mode}"], (
        res.stdout + res.stderr
    )


def test_secrets_survive_a_server_restart(
    tmp_path: Path, secure: Upstream, upstream_ca_dir: Path
) -> None:
    """The sandbox trusts the CA it was created with: a restarted server serves it with the
    same CA (kept in the data dir) and still swaps the placeholder."""
    server = start_server(
        tmp_path,
        [
            "--egress-allow-cidr",
            "127.0.0.0/8",
            "--egress-resolve",
            "secure.test=127.0.0.1",
            "--egress-upstream-ca",
            str(upstream_ca_dir / CA_CERT_FILE),
        ],
    )
    try:
        value = "restart-" + os.urandom(8).hex()
        with server.client() as c:
            _put_secret(c, "RS_TOKEN", value, ["secure.test"], headers=["X-T"])
            sid = create_sandbox(c, secrets=["RS_TOKEN"], network={"allow_out": ["secure.test"]})[
                "sandbox_id"
            ]
            cmd = f'curl -sS -m 10 -f -H "X-T: $RS_TOKEN" https://secure.test:{secure.port}/rs'
            assert run(c, sid, cmd).exit_code == 0
        server.stop()
        server.start()
        with server.client() as c:
            res = run(c, sid, cmd)
            assert res.exit_code == 0, res.stderr
        assert [r["headers"]["x-t"] for r in secure.seen("/rs")] == [value, value]
    finally:
        server.kill_all_sandboxes()
        server.stop()
