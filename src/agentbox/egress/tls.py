"""TLS for the egress proxy: a per-sandbox CA, upstream verification, ClientHello SNI parsing.

To swap secret placeholders in request headers the proxy must read them, so for hosts that have
secrets bound it terminates the sandbox's TLS with a leaf certificate minted by a CA that only
that sandbox trusts (`EgressCA`, `trust_bundle`), and re-encrypts to the real upstream with full
verification (`upstream_context`). Every other CONNECT tunnel is passed through untouched; there
the proxy reads the SNI from the client's first bytes (`parse_client_hello`) so a tunnel opened
to an allowed host cannot carry a handshake for another one. A terminated handshake records its
SNI too (`client_sni`), for the same check.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import ssl
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_VALIDITY = datetime.timedelta(days=30)
LEAF_VALIDITY = datetime.timedelta(days=7)
# Backdating absorbs clock skew between the host and a sandbox.
BACKDATE = datetime.timedelta(hours=1)
CONTEXT_CACHE_SIZE = 256
ALPN = ("http/1.1",)
# The CA's files in its workdir.
CA_KEY_FILE = "ca.key"
CA_CERT_FILE = "ca.pem"

# ClientHellos are normally well under 2 KiB (a post-quantum key share adds ~1.2 KiB); a peer
# still short of a complete one after this much input is refused, not buffered further.
MAX_CLIENT_HELLO_BYTES = 64 * 1024

SYSTEM_BUNDLES = (
    Path("/etc/ssl/certs/ca-certificates.crt"),
    Path("/etc/pki/tls/certs/ca-bundle.crt"),
    Path("/etc/ssl/cert.pem"),
)

_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")


def _normalise_dns_name(name: str) -> str | None:
    """Lowercase `name` without its trailing dot, or None if it is not a plausible DNS name."""
    if not name.isascii():  # also keeps out what .lower() would fold to ASCII (K, the Kelvin sign)
        return None
    name = name.lower()
    if name.endswith("."):
        name = name[:-1]
    if not name or len(name) > 253:
        return None
    if not all(_LABEL.fullmatch(label) for label in name.split(".")):
        return None
    return name


class EgressCA:
    """A sandbox's own CA: mints leaf certificates so the proxy can terminate its TLS.

    The CA lives in `workdir` (which must be private to the server: 0700, under its data dir)
    as `ca.key` (PKCS8 PEM, unencrypted, 0600) and `ca.pem` (0644), so that a restarted server
    can `load` the CA a still-running sandbox trusts. Besides them only the leaf key (shared by
    all leaves of this object) and, briefly, each leaf certificate are written there, because
    `ssl.SSLContext.load_cert_chain` reads only files. `close` removes the leaf key but keeps
    the CA's files: the owner deletes the whole workdir when the sandbox ends.
    """

    def __init__(
        self, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, workdir: Path
    ) -> None:
        """Use `generate` or `load`; this takes over the CA they made or read from `workdir`
        (which must exist) and writes the shared leaf key there."""
        self._ca_key = ca_key
        self._ca_cert = ca_cert
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())
        self._workdir = workdir
        self._contexts: OrderedDict[str, ssl.SSLContext] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self._leaf_key_file = _write_private(
            workdir,
            "leaf-key-",
            self._leaf_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )

    @classmethod
    def generate(cls, name: str, workdir: Path) -> EgressCA:
        """A fresh CA named for `name` (e.g. the sandbox id), saved in `workdir` for `load`.

        `workdir` must be private to the server; it is created (0700) if missing. Raises
        FileExistsError, changing nothing, if `workdir` already holds a CA key.
        """
        now = datetime.datetime.now(datetime.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "agentbox"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"agentbox egress CA {name}"[:64]),
            ]
        )
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + CA_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
            )
            .sign(ca_key, hashes.SHA256())
        )
        workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # The key first: it is the one that must not be overwritten, and a cert without its key
        # would be no use to `load` anyway.
        key_file = workdir / CA_KEY_FILE
        _publish(
            key_file,
            ca_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
            0o600,
        )
        published = [key_file]
        try:
            cert_file = workdir / CA_CERT_FILE
            _publish(cert_file, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
            published.append(cert_file)
            _fsync_dir(workdir)
        except BaseException:
            for path in published:
                path.unlink(missing_ok=True)
            raise
        return cls(ca_key, ca_cert, workdir)

    @classmethod
    def load(cls, workdir: Path) -> EgressCA:
        """The CA that `generate` saved in `workdir` (e.g. by the server before a restart).

        Raises ValueError if `workdir` holds no CA (either file missing, FileNotFoundError
        included) or a broken one: unreadable PEM, an encrypted or non-EC key, a certificate
        that is not a CA, or a key that does not match the certificate. Any other OSError
        (permissions, I/O) passes through unchanged.
        """
        key_path, cert_path = workdir / CA_KEY_FILE, workdir / CA_CERT_FILE
        try:
            key_pem = key_path.read_bytes()
            cert_pem = cert_path.read_bytes()
        except FileNotFoundError as e:
            raise ValueError(f"no egress CA in {workdir}: {e.filename} is missing") from e
        try:
            ca_key = serialization.load_pem_private_key(key_pem, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as e:
            # TypeError: the key is encrypted; UnsupportedAlgorithm: a key type we cannot use.
            raise ValueError(f"egress CA key {key_path} is unreadable: {e}") from e
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"egress CA key {key_path} is not an EC key")
        try:
            ca_cert = x509.load_pem_x509_certificate(cert_pem)
            basic = ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        except (ValueError, x509.ExtensionNotFound) as e:
            raise ValueError(f"egress CA certificate {cert_path} is unreadable: {e}") from e
        if not basic.ca:
            raise ValueError(f"egress CA certificate {cert_path} is not a CA certificate")
        if _spki(ca_key.public_key()) != _spki(ca_cert.public_key()):
            raise ValueError(f"egress CA key {key_path} does not match certificate {cert_path}")
        return cls(ca_key, ca_cert, workdir)

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate (not its key), for the sandbox's trust store."""
        return self._ca_cert.public_bytes(serialization.Encoding.PEM)

    def server_context(self, host: str) -> ssl.SSLContext:
        """A server context presenting a leaf for `host` (a DNS name or an IP literal).

        Contexts are cached per host, so only a host's first call pays for minting.
        """
        key, san = self._leaf_name(host)
        with self._lock:
            ctx = self._contexts.get(key)
            if ctx is not None:
                self._contexts.move_to_end(key)
                return ctx
            if self._closed:
                raise RuntimeError("this egress CA is closed; mint a new one for the sandbox")
            ctx = self._mint_context(san)
            self._contexts[key] = ctx
            if len(self._contexts) > CONTEXT_CACHE_SIZE:
                self._contexts.popitem(last=False)
            return ctx

    def close(self) -> None:
        """Forget the minted contexts and delete the leaf key file; later `server_context` calls
        raise RuntimeError. The CA's own files (`ca.key`, `ca.pem`) and the workdir stay, for
        `load` after a server restart: whoever owns the workdir deletes it (e.g. with
        shutil.rmtree) when the sandbox ends."""
        with self._lock:
            self._closed = True
            self._contexts.clear()
            self._leaf_key_file.unlink(missing_ok=True)

    @staticmethod
    def _leaf_name(host: str) -> tuple[str, x509.GeneralName]:
        literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            ip = ipaddress.ip_address(literal)
        except ValueError:
            pass
        else:
            # A zone ("fe80::1%eth0") names an interface here, not an address a cert can hold.
            if not (isinstance(ip, ipaddress.IPv6Address) and ip.scope_id):
                return str(ip), x509.IPAddress(ip)
        name = _normalise_dns_name(host)
        if name is None:
            raise ValueError(
                f"cannot mint a certificate for {host!r}: not a DNS name or IP address"
            )
        return name, x509.DNSName(name)

    def _mint_context(self, san: x509.GeneralName) -> ssl.SSLContext:
        now = datetime.datetime.now(datetime.UTC)
        # A leaf must not outlive the CA that signed it.
        not_after = min(now + LEAF_VALIDITY, self._ca_cert.not_valid_after_utc)
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "agentbox")]))
            .issuer_name(self._ca_cert.subject)
            .public_key(self._leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._ca_key.public_key()),
                critical=False,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._leaf_key.public_key()),
                critical=False,
            )
            .sign(self._ca_key, hashes.SHA256())
        )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(ALPN)
        ctx.sni_callback = _record_sni
        cert_file = _write_private(
            self._workdir, "leaf-", leaf.public_bytes(serialization.Encoding.PEM)
        )
        try:
            ctx.load_cert_chain(cert_file, self._leaf_key_file)
        finally:
            # load_cert_chain has read it; the certificate is public, the file just clutter.
            cert_file.unlink(missing_ok=True)
        return ctx


def _write_private(directory: Path, prefix: str, data: bytes) -> Path:
    # mkstemp creates the file 0600 with O_EXCL, under a name no one else can predict.
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".pem", dir=directory)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return Path(path)


def _publish(path: Path, data: bytes, mode: int) -> None:
    """Write `path` whole or not at all, and only if it does not exist yet (FileExistsError).

    The data goes to a fresh temporary file (mkstemp: O_EXCL, 0600) that is synced, then
    hard-linked to `path`: unlike a rename, a link never replaces an existing file.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
    finally:
        os.unlink(tmp)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _spki(key: PublicKeyTypes) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


# The SNI each server-side handshake saw, keyed by the ssl.SSLObject (asyncio) or ssl.SSLSocket
# the callback was given; weak, so an entry goes with its connection.
_sni_seen: weakref.WeakKeyDictionary[ssl.SSLObject | ssl.SSLSocket, str] = (
    weakref.WeakKeyDictionary()
)


def _record_sni(
    ssl_object: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _ctx: ssl.SSLContext
) -> None:
    if server_name is not None:
        _sni_seen[ssl_object] = server_name.lower().removesuffix(".")


def client_sni(ssl_object: ssl.SSLObject | ssl.SSLSocket) -> str | None:
    """The server name (lowercase, no trailing dot) the client sent in a handshake served by an
    `EgressCA.server_context`, or None if it sent none. Meaningful once the handshake is done."""
    return _sni_seen.get(ssl_object)


def upstream_context(extra_ca_files: Sequence[Path] = ()) -> ssl.SSLContext:
    """A client context for the proxy's own connection to the real upstream: the system trust
    store plus `extra_ca_files` (an operator option), full certificate and hostname checks."""
    ctx = ssl.create_default_context()
    for ca_file in extra_ca_files:
        ctx.load_verify_locations(cafile=str(ca_file))
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = True
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(ALPN)
    return ctx


# Operator CA files are small; a bigger one is a mistake (a whole disk image, a log).
MAX_CA_FILE_BYTES = 1 << 20


def read_ca_file(path: Path) -> bytes:
    """The PEM certificates of an operator's CA file (`agentbox serve --sandbox-ca`), checked:
    ValueError says what is wrong. Private keys are refused: the file goes into sandboxes."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CA_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"CA file {path}: {e.strerror}") from None
    if len(data) > MAX_CA_FILE_BYTES:
        raise ValueError(f"CA file {path} is larger than {MAX_CA_FILE_BYTES} bytes")
    if b"PRIVATE KEY-----" in data:
        raise ValueError(f"CA file {path} holds a private key: give only the certificates")
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise ValueError(
            f"CA file {path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
        ) from None
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


def trust_bundle(ca_pem: bytes, system_bundle: Path | None = None) -> bytes:
    """The system CA bundle followed by `ca_pem`: the sandbox's trust store, so that real sites
    (tunnelled untouched), the proxy's minted leaves and the operator's CAs all verify."""
    if system_bundle is None:
        system_bundle = next((p for p in SYSTEM_BUNDLES if p.is_file()), None)
    system = system_bundle.read_bytes() if system_bundle is not None else b""
    if system and not system.endswith(b"\n"):
        system += b"\n"
    return system + ca_pem


@dataclass(frozen=True)
class ClientHelloResult:
    """What the first bytes of a tunnel say.

    status:
      - "not_tls": not a TLS handshake record (e.g. plain HTTP, SSLv2);
      - "need_more": a TLS ClientHello so far, but incomplete: read more and call again;
      - "ok": a complete ClientHello; `sni` is its host_name (lowercase, no trailing dot) or None;
      - "malformed": TLS-looking but broken, ambiguous (duplicate extensions or names), carrying
        a name that is not a DNS name, or not complete within MAX_CLIENT_HELLO_BYTES. Refuse it:
        the proxy cannot tell which name the server would act on.
    """

    status: Literal["not_tls", "need_more", "ok", "malformed"]
    sni: str | None = None


_NOT_TLS = ClientHelloResult("not_tls")
_NEED_MORE = ClientHelloResult("need_more")
_MALFORMED = ClientHelloResult("malformed")

_RECORD_HANDSHAKE = 22
_HANDSHAKE_CLIENT_HELLO = 1
_EXT_SERVER_NAME = 0
_NAME_TYPE_HOST_NAME = 0
_MAX_RECORD_FRAGMENT = 2**14
_TLS_HANDSHAKE_START = bytes([_RECORD_HANDSHAKE, 3])  # content type, record version major


class _Malformed(Exception):
    pass


class _Reader:
    """Bounds-checked big-endian reads over one complete message."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def remaining(self) -> int:
        return len(self._data) - self._pos

    def take(self, n: int) -> bytes:
        if n > self.remaining():
            raise _Malformed
        chunk = self._data[self._pos : self._pos + n]
        self._pos += n
        return chunk

    def uint(self, size: int) -> int:
        return int.from_bytes(self.take(size), "big")

    def vector(self, len_size: int) -> _Reader:
        return _Reader(self.take(self.uint(len_size)))


def parse_client_hello(data: bytes) -> ClientHelloResult:
    """Find the SNI in the first bytes a client sent through a tunnel. Never raises.

    Call again with all bytes so far while the status is "need_more". A ClientHello may span
    several TLS records; bytes after it (early data, further records) are ignored.
    """
    # SSL 2.0-style hellos (first byte 0x80) are not accepted by any current server either.
    start = bytes(data[:2])
    if start != _TLS_HANDSHAKE_START[: len(start)]:
        return _NOT_TLS
    window = data[:MAX_CLIENT_HELLO_BYTES]
    result = _parse_records(window)
    if result is _NEED_MORE and len(data) > len(window):
        return _MALFORMED
    return result


def _parse_records(data: bytes) -> ClientHelloResult:
    """Reassemble the ClientHello message from the handshake records at the start of `data`."""
    handshake = bytearray()
    pos = 0
    message_len: int | None = None
    while message_len is None or len(handshake) < 4 + message_len:
        header = data[pos : pos + 5]
        if len(header) < 5:
            return _NEED_MORE
        fragment_len = int.from_bytes(header[3:5], "big")
        # Handshake messages cannot be interleaved with other records, and empty handshake
        # fragments are forbidden (RFC 8446 5.1).
        if header[0] != _RECORD_HANDSHAKE or header[1] != 3:
            return _MALFORMED
        if fragment_len == 0 or fragment_len > _MAX_RECORD_FRAGMENT:
            return _MALFORMED
        fragment = data[pos + 5 : pos + 5 + fragment_len]
        handshake += fragment
        pos += 5 + len(fragment)
        if handshake and handshake[0] != _HANDSHAKE_CLIENT_HELLO:
            return _MALFORMED
        if message_len is None and len(handshake) >= 4:
            message_len = int.from_bytes(handshake[1:4], "big")
            if 4 + message_len > MAX_CLIENT_HELLO_BYTES:
                return _MALFORMED
        if len(fragment) < fragment_len:
            return _NEED_MORE
    try:
        sni = _client_hello_sni(bytes(handshake[4 : 4 + message_len]))
    except _Malformed:
        return _MALFORMED
    return ClientHelloResult("ok", sni)


def _client_hello_sni(body: bytes) -> str | None:
    hello = _Reader(body)
    if hello.uint(1) != 3:  # legacy_version major
        raise _Malformed
    hello.take(1 + 32)  # legacy_version minor, random
    if hello.vector(1).remaining() > 32:  # legacy_session_id
        raise _Malformed
    cipher_suites = hello.vector(2).remaining()
    if cipher_suites < 2 or cipher_suites % 2:
        raise _Malformed
    if hello.vector(1).remaining() < 1:  # legacy_compression_methods
        raise _Malformed
    if hello.remaining() == 0:  # a pre-extensions (SSL 3.0 style) hello
        return None
    extensions = hello.vector(2)
    if hello.remaining():
        raise _Malformed
    seen: set[int] = set()
    sni: str | None = None
    while extensions.remaining():
        ext_type = extensions.uint(2)
        ext_data = extensions.vector(2)
        # A second copy of an extension could name a different host for the proxy and for the
        # server; RFC 8446 4.2 forbids duplicates and OpenSSL rejects them, so do we.
        if ext_type in seen:
            raise _Malformed
        seen.add(ext_type)
        if ext_type == _EXT_SERVER_NAME:
            sni = _server_name(ext_data)
    return sni


def _server_name(ext_data: _Reader) -> str:
    names = ext_data.vector(2)
    if ext_data.remaining():
        raise _Malformed
    # Like OpenSSL, accept exactly one entry of type host_name: RFC 6066 allows no second
    # host_name, and other name types were never defined.
    if names.uint(1) != _NAME_TYPE_HOST_NAME:
        raise _Malformed
    host_name = names.vector(2)
    raw = host_name.take(host_name.remaining())
    if names.remaining():
        raise _Malformed
    name = _normalise_dns_name(raw.decode("ascii")) if raw.isascii() else None
    if name is None:
        raise _Malformed
    return name
