"""The egress proxy's TLS machinery with real handshakes: minted leaves, SNI, ClientHello bytes."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import random
import socket
import ssl
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agentbox.egress.tls import (
    MAX_CLIENT_HELLO_BYTES,
    ClientHelloResult,
    EgressCA,
    client_sni,
    parse_client_hello,
    trust_bundle,
    upstream_context,
)

HOST = "api.example.test"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EgressCA]:
    ca = EgressCA.generate("sbx-test", tmp_path_factory.mktemp("ca") / "work")
    yield ca
    ca.close()


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EgressCA]:
    ca = EgressCA.generate("sbx-other", tmp_path_factory.mktemp("ca") / "work")
    yield ca
    ca.close()


def _trusting(ca_pem: bytes | None) -> ssl.SSLContext:
    """A client that trusts only `ca_pem` (or, if None, only the system store)."""
    if ca_pem is None:
        ctx = ssl.create_default_context()
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(cadata=ca_pem.decode())
    # Python 3.13 turns these checks on by default; sandboxes may run it.
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT | ssl.VERIFY_X509_PARTIAL_CHAIN
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    return ctx


class Handshake:
    """Both ends of one TLS handshake over a socketpair (server in a thread, ssl.SSLSocket)."""

    def __init__(
        self, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, server_hostname: str | None
    ) -> None:
        self.server_error: BaseException | None = None
        self.server_sni: str | None = None
        a, b = socket.socketpair()
        a.settimeout(5)
        b.settimeout(5)
        server = threading.Thread(target=self._serve, args=(server_ctx, a))
        server.start()
        try:
            with client_ctx.wrap_socket(b, server_hostname=server_hostname) as tls:
                self.alpn = tls.selected_alpn_protocol()
                der = tls.getpeercert(binary_form=True)
                assert der is not None
                self.peer_cert = x509.load_der_x509_certificate(der)
                tls.sendall(b"ping")
                assert tls.recv(4) == b"pong"
        finally:
            b.close()
            server.join()

    def _serve(self, ctx: ssl.SSLContext, sock: socket.socket) -> None:
        try:
            with ctx.wrap_socket(sock, server_side=True) as tls:
                self.server_sni = client_sni(tls)
                assert tls.recv(4) == b"ping"
                tls.sendall(b"pong")
        except BaseException as e:  # reported to the test thread
            self.server_error = e
        finally:
            sock.close()


# --- EgressCA: minted leaves verify, for the right name only ----------------------------------


@pytest.mark.parametrize("host", [HOST, "127.0.0.1"])
def test_minted_leaf_verifies_with_only_the_ca(ca: EgressCA, host: str) -> None:
    hs = Handshake(ca.server_context(host), _trusting(ca.cert_pem), host)
    assert hs.server_error is None
    assert hs.alpn == "http/1.1"
    san = hs.peer_cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    if host == HOST:
        assert san.get_values_for_type(x509.DNSName) == [HOST]
        assert hs.server_sni == HOST
    else:
        assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(host)]
        # Clients send no SNI for IP literals (RFC 6066 3).
        assert hs.server_sni is None


def test_client_sni_is_none_when_the_client_sends_none(ca: EgressCA) -> None:
    client = _trusting(ca.cert_pem)
    client.check_hostname = False
    hs = Handshake(ca.server_context(HOST), client, None)
    assert hs.server_error is None and hs.server_sni is None


@pytest.mark.parametrize(("host", "asked"), [(HOST, "other.example.test"), ("127.0.0.1", "::1")])
def test_leaf_for_another_name_is_rejected(ca: EgressCA, host: str, asked: str) -> None:
    with pytest.raises(ssl.SSLCertVerificationError):
        Handshake(ca.server_context(host), _trusting(ca.cert_pem), asked)


def test_client_without_the_ca_rejects_the_leaf(ca: EgressCA, other_ca: EgressCA) -> None:
    for client in (_trusting(None), _trusting(other_ca.cert_pem)):
        with pytest.raises(ssl.SSLCertVerificationError):
            Handshake(ca.server_context(HOST), client, HOST)


def test_asyncio_start_tls_records_sni_on_the_ssl_object(ca: EgressCA) -> None:
    """The proxy's own shape: answer CONNECT in plain text, then upgrade the stream in place."""
    seen: dict[str, object] = {}

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.start_tls(ca.server_context(HOST))
        ssl_object = writer.get_extra_info("ssl_object")
        seen["type"] = type(ssl_object)
        seen["sni"] = client_sni(ssl_object)
        seen["alpn"] = ssl_object.selected_alpn_protocol()
        writer.write(await reader.readline())
        await writer.drain()
        writer.close()

    async def main() -> bytes:
        server = await asyncio.start_server(proxy, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"CONNECT {HOST}:443 HTTP/1.1\r\nHost: {HOST}:443\r\n\r\n".encode())
        await reader.readuntil(b"\r\n\r\n")
        await writer.start_tls(_trusting(ca.cert_pem), server_hostname=HOST)
        writer.write(b"echo\n")
        echoed = await reader.readline()
        writer.close()
        server.close()
        await server.wait_closed()
        return echoed

    assert asyncio.run(asyncio.wait_for(main(), 5)) == b"echo\n"
    assert seen == {"type": ssl.SSLObject, "sni": HOST, "alpn": "http/1.1"}


def test_certificates_are_shaped_for_their_jobs(ca: EgressCA) -> None:
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    assert b"PRIVATE" not in ca.cert_pem
    cn = ca_cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert cn == "agentbox egress CA sbx-test"
    basic = ca_cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca and basic.value.path_length == 0
    usage = ca_cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.key_cert_sign and usage.value.crl_sign
    lifetime = ca_cert.not_valid_after_utc - ca_cert.not_valid_before_utc
    assert lifetime == datetime.timedelta(days=30, hours=1)

    leaf = Handshake(ca.server_context(HOST), _trusting(ca.cert_pem), HOST).peer_cert
    assert leaf.issuer == ca_cert.subject
    assert leaf.serial_number != ca_cert.serial_number
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    aki = leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ski.digest
    assert leaf.not_valid_after_utc - leaf.not_valid_before_utc <= datetime.timedelta(
        days=7, hours=1
    )


def test_contexts_are_cached_per_normalised_host(ca: EgressCA) -> None:
    ctx = ca.server_context(HOST)
    assert ca.server_context("API.Example.TEST.") is ctx
    assert ca.server_context("[::1]") is ca.server_context("::1")
    assert ca.server_context("127.0.0.1") is not ctx


@pytest.mark.parametrize(
    "host",
    [
        "",
        ".",
        "a b",
        "a..b",
        "-a.test",
        "münchen.test",
        "\u212a.test",
        "a\x00b",
        "fe80::1%eth0",
        "x" * 64,
        "a." * 130,
    ],
)
def test_server_context_refuses_names_that_are_not_hosts(ca: EgressCA, host: str) -> None:
    with pytest.raises(ValueError, match="not a DNS name or IP address"):
        ca.server_context(host)


def test_workdir_is_private_and_close_keeps_only_the_ca(tmp_path: Path) -> None:
    workdir = tmp_path / "egress"
    ca = EgressCA.generate("sbx", workdir)
    ca.server_context(HOST)
    assert stat.S_IMODE(workdir.stat().st_mode) == 0o700
    ca_key, ca_cert = workdir / "ca.key", workdir / "ca.pem"
    assert stat.S_IMODE(ca_key.stat().st_mode) == 0o600
    assert stat.S_IMODE(ca_cert.stat().st_mode) == 0o644
    assert ca_cert.read_bytes() == ca.cert_pem
    key_pem = ca_key.read_bytes()
    assert key_pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS8, not encrypted
    ca_public = x509.load_pem_x509_certificate(ca.cert_pem).public_key()
    assert serialization.load_pem_private_key(key_pem, password=None).public_key() == ca_public
    leaf_files = [f for f in workdir.iterdir() if f not in (ca_key, ca_cert)]
    assert len(leaf_files) == 1  # the shared leaf key; minted certificates are gone already
    assert stat.S_IMODE(leaf_files[0].stat().st_mode) == 0o600
    leaf_key = serialization.load_pem_private_key(leaf_files[0].read_bytes(), password=None)
    assert leaf_key.public_key() != ca_public
    ca.close()
    # The CA stays for a restarted server; the owner removes the workdir with the sandbox.
    assert sorted(f.name for f in workdir.iterdir()) == ["ca.key", "ca.pem"]
    with pytest.raises(RuntimeError, match="closed"):
        ca.server_context(HOST)


def test_a_loaded_ca_mints_leaves_the_sandbox_still_trusts(tmp_path: Path) -> None:
    """A restarted server: the sandbox kept the old cert_pem in its trust store."""
    workdir = tmp_path / "egress"
    original = EgressCA.generate("sbx", workdir)
    trusted_pem = original.cert_pem
    original.close()

    loaded = EgressCA.load(workdir)
    try:
        assert loaded.cert_pem == trusted_pem
        hs = Handshake(loaded.server_context(HOST), _trusting(trusted_pem), HOST)
        assert hs.server_error is None and hs.server_sni == HOST
        assert hs.peer_cert.issuer == x509.load_pem_x509_certificate(trusted_pem).subject
    finally:
        loaded.close()
    assert sorted(f.name for f in workdir.iterdir()) == ["ca.key", "ca.pem"]


def test_generate_never_overwrites_a_ca(tmp_path: Path) -> None:
    workdir = tmp_path / "egress"
    EgressCA.generate("sbx", workdir).close()
    before = {f.name: f.read_bytes() for f in workdir.iterdir()}
    with pytest.raises(FileExistsError):
        EgressCA.generate("sbx", workdir)
    assert {f.name: f.read_bytes() for f in workdir.iterdir()} == before


@pytest.fixture
def saved_ca(tmp_path: Path) -> Path:
    """A workdir holding a closed CA, to break."""
    workdir = tmp_path / "saved"
    EgressCA.generate("sbx", workdir).close()
    return workdir


@pytest.mark.parametrize("missing", ["ca.key", "ca.pem", "both", "workdir"])
def test_load_without_a_ca_is_a_value_error(saved_ca: Path, missing: str) -> None:
    if missing == "workdir":
        saved_ca = saved_ca / "absent"
    for name in ("ca.key", "ca.pem"):
        if missing in (name, "both"):
            (saved_ca / name).unlink()
    with pytest.raises(ValueError, match="no egress CA in .* is missing"):
        EgressCA.load(saved_ca)


def _encrypted_key_pem() -> bytes:
    return ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )


def _non_ec_key_pem() -> bytes:
    return ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("ca.key", b"", "key .* is unreadable"),
        ("ca.key", b"-----BEGIN PRIVATE KEY-----\ngarbage\n-----END PRIVATE KEY-----\n", "key"),
        ("ca.key", _encrypted_key_pem(), "key .* is unreadable"),
        ("ca.key", _non_ec_key_pem(), "not an EC key"),
        ("ca.pem", b"not a certificate", "certificate .* is unreadable"),
    ],
)
def test_load_a_corrupt_ca_is_a_value_error(
    saved_ca: Path, name: str, content: bytes, message: str
) -> None:
    (saved_ca / name).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        EgressCA.load(saved_ca)


def test_load_truncated_key_is_a_value_error(saved_ca: Path) -> None:
    key_file = saved_ca / "ca.key"
    key_file.write_bytes(key_file.read_bytes()[:60])
    with pytest.raises(ValueError, match="key .* is unreadable"):
        EgressCA.load(saved_ca)


def test_load_a_key_of_another_ca_is_a_value_error(saved_ca: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    EgressCA.generate("sbx-other", other).close()
    (saved_ca / "ca.key").write_bytes((other / "ca.key").read_bytes())
    with pytest.raises(ValueError, match="does not match certificate"):
        EgressCA.load(saved_ca)


def test_load_a_leaf_in_place_of_the_ca_is_a_value_error(ca: EgressCA, saved_ca: Path) -> None:
    leaf = Handshake(ca.server_context(HOST), _trusting(ca.cert_pem), HOST).peer_cert
    (saved_ca / "ca.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(ValueError, match="not a CA certificate"):
        EgressCA.load(saved_ca)


def test_load_passes_other_os_errors_through(saved_ca: Path) -> None:
    (saved_ca / "ca.key").unlink()
    (saved_ca / "ca.key").mkdir()
    with pytest.raises(IsADirectoryError):
        EgressCA.load(saved_ca)


# --- upstream_context and trust_bundle --------------------------------------------------------


def test_upstream_context_trusts_extra_ca_files(
    ca: EgressCA, other_ca: EgressCA, tmp_path: Path
) -> None:
    ca_file = tmp_path / "upstream-ca.pem"
    ca_file.write_bytes(ca.cert_pem)
    ctx = upstream_context([ca_file])
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    hs = Handshake(ca.server_context(HOST), ctx, HOST)
    assert hs.server_error is None and hs.alpn == "http/1.1"
    for server_ctx, client_ctx, name in [
        (other_ca.server_context(HOST), ctx, HOST),  # signed by a CA it was not given
        (ca.server_context(HOST), ctx, "other.example.test"),  # right CA, wrong name
        (ca.server_context(HOST), upstream_context(), HOST),  # test CA not in the system store
    ]:
        with pytest.raises(ssl.SSLCertVerificationError):
            Handshake(server_ctx, client_ctx, name)


def test_trust_bundle_holds_the_system_store_and_the_ca(ca: EgressCA, tmp_path: Path) -> None:
    system = tmp_path / "system.pem"
    system.write_bytes(b"# system roots, no final newline")
    assert trust_bundle(ca.cert_pem, system) == (
        b"# system roots, no final newline\n" + ca.cert_pem
    )

    bundle = trust_bundle(ca.cert_pem)
    assert bundle.endswith(ca.cert_pem)
    bundle_file = tmp_path / "bundle.pem"
    bundle_file.write_bytes(bundle)
    client = ssl.create_default_context(cafile=str(bundle_file))
    assert Handshake(ca.server_context(HOST), client, HOST).server_error is None
    defaults = ssl.create_default_context()
    if defaults.cert_store_stats()["x509_ca"]:  # the host has a system store: it is kept
        assert client.cert_store_stats()["x509_ca"] > 1


# --- parse_client_hello -----------------------------------------------------------------------


def _real_client_hello(server_hostname: str | None) -> bytes:
    """The bytes a real OpenSSL client sends first."""
    ctx = ssl.create_default_context()
    if server_hostname is None:
        ctx.check_hostname = False
    ctx.set_alpn_protocols(["http/1.1"])
    outgoing = ssl.MemoryBIO()
    tls = ctx.wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


REAL_HELLO = _real_client_hello(HOST)
REAL_HELLO_NO_SNI = _real_client_hello(None)


def _u(n: int, size: int) -> bytes:
    return n.to_bytes(size, "big")


def _vec(data: bytes, len_size: int) -> bytes:
    return _u(len(data), len_size) + data


def _sni_ext(*names: bytes, name_type: int = 0) -> tuple[int, bytes]:
    return 0, _vec(b"".join(bytes([name_type]) + _vec(n, 2) for n in names), 2)


def _hello(*extensions: tuple[int, bytes], ciphers: bytes = b"\x13\x01") -> bytes:
    """A minimal ClientHello in one record, built by hand to say what a real client would not."""
    body = (
        b"\x03\x03"
        + bytes(32)
        + _vec(b"", 1)
        + _vec(ciphers, 2)
        + _vec(b"\x00", 1)
        + _vec(b"".join(_u(t, 2) + _vec(d, 2) for t, d in extensions), 2)
    )
    return _record(b"\x01" + _vec(body, 3))


def _record(message: bytes) -> bytes:
    return b"\x16\x03\x01" + _vec(message, 2)


def _grow(message: bytes) -> bytes:
    """`message` with one byte more in its body than a ClientHello has room for."""
    return message[:1] + _vec(message[4:] + b"x", 3)


def _split(record: bytes, size: int) -> bytes:
    message = record[5:]
    chunks = [message[i : i + size] for i in range(0, len(message), size)]
    return b"".join(record[:3] + _vec(chunk, 2) for chunk in chunks)


def test_real_client_hellos() -> None:
    assert parse_client_hello(REAL_HELLO) == ClientHelloResult("ok", HOST)
    assert parse_client_hello(REAL_HELLO_NO_SNI).status == "ok"
    assert parse_client_hello(REAL_HELLO_NO_SNI).sni is None
    # Whatever follows the hello (early data, the next flight) does not change the answer.
    assert parse_client_hello(REAL_HELLO + b"\x17\x03\x03\x00\x05hello").sni == HOST


@pytest.mark.parametrize("hello", [REAL_HELLO, _split(REAL_HELLO, 1), _split(REAL_HELLO, 97)])
def test_every_prefix_needs_more(hello: bytes) -> None:
    assert parse_client_hello(hello).sni == HOST
    for n in range(len(hello)):
        assert parse_client_hello(hello[:n]).status == "need_more", n


def test_a_hello_split_across_records() -> None:
    rng = random.Random(7)
    for size in (1, 2, 3, 4, 5, 100, 511, 10_000):
        assert parse_client_hello(_split(REAL_HELLO, size)).sni == HOST, size
    for _ in range(50):
        message = REAL_HELLO[5:]
        cuts = sorted(rng.sample(range(1, len(message)), rng.randint(1, 10)))
        chunks = [message[i:j] for i, j in zip([0, *cuts], [*cuts, len(message)], strict=True)]
        data = b"".join(REAL_HELLO[:3] + _vec(chunk, 2) for chunk in chunks)
        assert parse_client_hello(data) == ClientHelloResult("ok", HOST)


def test_the_name_is_lowercased_without_its_trailing_dot() -> None:
    assert parse_client_hello(_hello(_sni_ext(b"API.Example.Test."))).sni == HOST
    assert parse_client_hello(_hello(_sni_ext(b"127.0.0.1"))).sni == "127.0.0.1"
    assert parse_client_hello(_hello((16, _vec(_vec(b"h2", 1), 2)))) == ClientHelloResult("ok")


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\nHost: api.example.test\r\n\r\n",
        b"CONNECT api.example.test:443 HTTP/1.1\r\n\r\n",
        b"SSH-2.0-OpenSSH_9.6\r\n",
        b"\x80\x2e\x01\x03\x01",  # SSL 2.0 style hello
        b"\x16\x02",
        b"\x17\x03\x03\x00\x01x",
    ],
)
def test_other_protocols_are_not_tls(data: bytes) -> None:
    assert parse_client_hello(data).status == "not_tls"


def test_the_first_bytes_of_a_record_need_more() -> None:
    for data in (b"", b"\x16", b"\x16\x03", b"\x16\x03\x01\x02"):
        assert parse_client_hello(data).status == "need_more"


HOSTILE_HELLOS = {
    "duplicate server_name": _hello(_sni_ext(HOST.encode()), _sni_ext(b"evil.test")),
    "two host names": _hello(_sni_ext(HOST.encode(), b"evil.test")),
    "unknown name type": _hello(_sni_ext(HOST.encode(), name_type=1)),
    "empty name": _hello(_sni_ext(b"")),
    "NUL in name": _hello(_sni_ext(b"evil.test\x00" + HOST.encode())),
    "not ASCII": _hello(_sni_ext("münchen.test".encode())),
    "space in name": _hello(_sni_ext(b"evil.test " + HOST.encode())),
    "empty label": _hello(_sni_ext(b"api..test")),
    "short extension": _hello((0, b"\x00\x20\x00\x00\x05abc")),
    "trailing bytes in extension": _hello((0, _sni_ext(b"a.test")[1] + b"x")),
    "trailing bytes after extensions": _record(_grow(_hello(_sni_ext(b"a.test"))[5:])),
    "no cipher suites": _hello(_sni_ext(b"a.test"), ciphers=b""),
    "odd cipher suites": _hello(_sni_ext(b"a.test"), ciphers=b"\x13\x01\x13"),
    "alert record in the middle": _split(REAL_HELLO, 100)[:105] + b"\x15\x03\x03\x00\x02\x02\x28",
    "server hello": b"\x16\x03\x03\x00\x04\x02\x00\x00\x00",
    "empty record": b"\x16\x03\x01\x00\x00",
    "record over 16 KiB": b"\x16\x03\x01\x40\x01\x01",
    "message over the cap": b"\x16\x03\x01\x00\x04\x01\x01\x00\x00",
}


@pytest.mark.parametrize("name", list(HOSTILE_HELLOS))
def test_hostile_hellos_are_malformed(name: str) -> None:
    assert parse_client_hello(HOSTILE_HELLOS[name]).status == "malformed"


def test_a_hello_still_incomplete_at_the_cap_is_malformed() -> None:
    padded = _hello(_sni_ext(HOST.encode()), (21, bytes(60_000)))  # 21: padding
    assert parse_client_hello(padded).status == "malformed"  # a record holds at most 16 KiB
    assert parse_client_hello(_split(padded, 2**14)).sni == HOST
    in_tiny_records = _split(padded, 1)
    assert parse_client_hello(in_tiny_records[:MAX_CLIENT_HELLO_BYTES]).status == "need_more"
    assert parse_client_hello(in_tiny_records).status == "malformed"


def test_arbitrary_bytes_never_raise() -> None:
    rng = random.Random(1234)
    statuses = set()
    for _ in range(3000):
        n = rng.randint(0, 600)
        samples = [
            rng.randbytes(n),
            b"\x16\x03" + rng.randbytes(n),
            b"\x16\x03\x01" + _u(n + 4, 2) + b"\x01" + _u(n, 3) + rng.randbytes(n),
        ]
        mutated = bytearray(rng.choice([REAL_HELLO, REAL_HELLO_NO_SNI, _split(REAL_HELLO, 50)]))
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        samples += [bytes(mutated), bytes(mutated[: rng.randrange(len(mutated))])]
        for data in samples:
            result = parse_client_hello(data)
            statuses.add(result.status)
            assert result.status in ("not_tls", "need_more", "ok", "malformed")
            assert result.sni is None or result.status == "ok"
            if result.sni is not None:
                assert result.sni == result.sni.lower() and not result.sni.endswith(".")
    assert statuses == {"not_tls", "need_more", "ok", "malformed"}
