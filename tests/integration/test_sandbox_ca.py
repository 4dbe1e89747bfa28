"""`agentbox serve --sandbox-ca FILE`: sandboxes trust the operator's CAs (a site behind a
TLS-inspecting proxy), on the default template and on built ones; a bad file stops the start.

A TLS server on a sandbox's own loopback presents a leaf signed by a test CA; curl and Python's
urllib inside the sandbox must accept it with the CA given, and refuse it without."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ServerHandle, start_server
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agentbox import Sandbox
from agentbox.core.network import CA_BUNDLE_PATH, SYSTEM_BUNDLE_PATH

_SERVE = """
import http.server, ssl
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain("/workspace/leaf.pem", "/workspace/leaf.key")
srv = http.server.HTTPServer(("127.0.0.1", 8443), http.server.SimpleHTTPRequestHandler)
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
srv.serve_forever()
"""
_FETCH = """
import sys, urllib.request
try:
    print(urllib.request.urlopen("https://localhost:8443/hello.txt", timeout=10).read().decode())
except Exception as e:
    print("FAILED", e)
    sys.exit(1)
"""
_WAIT = "for i in $(seq 100); do (: </dev/tcp/127.0.0.1/8443) 2>/dev/null && break; sleep .05; done"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(
    subject: str,
    issuer: str,
    key: ec.EllipticCurvePrivateKey,
    signer: ec.EllipticCurvePrivateKey,
    ca: bool,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), critical=False
        )
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
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
    else:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return builder.sign(signer, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes | Path]:
    """A test CA (its certificate in a file for --sandbox-ca) and a localhost leaf it signed."""
    ca_key, leaf_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    ca = _cert(
        "agentbox test inspecting proxy CA",
        "agentbox test inspecting proxy CA",
        ca_key,
        ca_key,
        ca=True,
    )
    leaf = _cert("localhost", "agentbox test inspecting proxy CA", leaf_key, ca_key, ca=False)
    ca_file = tmp_path_factory.mktemp("pki") / "proxy-ca.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return {
        "ca_file": ca_file,
        "leaf": leaf.public_bytes(serialization.Encoding.PEM),
        "key": leaf_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    }


@pytest.fixture(scope="module")
def ca_server(
    tmp_path_factory: pytest.TempPathFactory, pki: dict, code_template: Path
) -> Iterator[ServerHandle]:
    handle = start_server(
        tmp_path_factory.mktemp("agentbox-ca"),
        ["--sandbox-ca", str(pki["ca_file"]), "--template-dir", str(code_template)],
    )
    yield handle
    handle.kill_all_sandboxes()
    handle.stop()


def _probe(server: ServerHandle, pki: dict, template: str | None = None) -> dict[str, str]:
    """Serve TLS on the sandbox's loopback and fetch from it with curl and with urllib."""
    with Sandbox.create(
        template=template, timeout=120, api_key=server.admin_key, api_url=server.url
    ) as sbx:
        sbx.files.write("leaf.pem", pki["leaf"])
        sbx.files.write("leaf.key", pki["key"])
        sbx.files.write("hello.txt", "hello over inspected TLS\n")
        sbx.files.write("serve.py", _SERVE)
        sbx.files.write("fetch.py", _FETCH)
        sbx.commands.run("python3 serve.py", background=True)
        curl = sbx.commands.run(
            f"{_WAIT}; curl -sS https://localhost:8443/hello.txt 2>&1; echo rc=$?"
        )
        fetch = sbx.commands.run("python3 fetch.py 2>&1; echo rc=$?")
        env = sbx.commands.run("echo $SSL_CERT_FILE").stdout.strip()
        return {"curl": curl.stdout, "python": fetch.stdout, "SSL_CERT_FILE": env}


def test_default_template_trusts_the_operator_ca(ca_server: ServerHandle, pki: dict) -> None:
    seen = _probe(ca_server, pki)
    assert seen["curl"] == "hello over inspected TLS\nrc=0\n", seen
    assert seen["python"] == "hello over inspected TLS\n\nrc=0\n", seen
    assert seen["SSL_CERT_FILE"] == "/run/agentbox/ca-bundle.pem"


def test_built_template_trusts_the_operator_ca(ca_server: ServerHandle, pki: dict) -> None:
    seen = _probe(ca_server, pki, template="code-interpreter")
    assert seen["curl"] == "hello over inspected TLS\nrc=0\n", seen
    assert seen["python"] == "hello over inspected TLS\n\nrc=0\n", seen


def test_the_system_store_stays_trusted(ca_server: ServerHandle, pki: dict) -> None:
    host = Path("/etc/ssl/certs/ca-certificates.crt").read_text().count("BEGIN CERTIFICATE")
    with Sandbox.create(timeout=60, api_key=ca_server.admin_key, api_url=ca_server.url) as sbx:
        counted = sbx.commands.run(
            "grep -c 'BEGIN CERTIFICATE' /etc/ssl/certs/ca-certificates.crt $SSL_CERT_FILE"
        ).stdout
    expected = [f"{path}:{host + 1}" for path in (SYSTEM_BUNDLE_PATH, CA_BUNDLE_PATH)]
    assert sorted(counted.split()) == sorted(expected)


def test_without_the_ca_the_leaf_is_refused(server: ServerHandle, pki: dict) -> None:
    """The control: the same probe on a server without --sandbox-ca fails verification."""
    seen = _probe(server, pki)
    assert "rc=60" in seen["curl"], seen  # curl: peer certificate cannot be authenticated
    assert "CERTIFICATE_VERIFY_FAILED" in seen["python"] and "rc=1" in seen["python"], seen


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "No such file"),
        (b"not a certificate\n", "no PEM certificate"),
        (
            b"-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIA==\n-----END PRIVATE KEY-----\n",
            "private key",
        ),
    ],
)
def test_a_bad_ca_file_stops_the_start(tmp_path: Path, content: bytes | None, says: str) -> None:
    path = tmp_path / "ca.pem"
    if content is not None:
        path.write_bytes(content)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentbox.cli.app",
            "serve",
            "--port",
            "1",
            "--data-dir",
            str(tmp_path / "data"),
            "--sandbox-ca",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--sandbox-ca" in r.stderr and says in " ".join(r.stderr.split()), r.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was touched
