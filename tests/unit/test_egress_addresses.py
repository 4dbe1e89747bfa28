"""Hostile inputs for the egress proxy's address checks: every spelling of an internal address."""

from __future__ import annotations

import ipaddress
import random
import socket

import pytest

from agentbox.egress.addresses import (
    AddressGuard,
    name_refusal,
    normalize_name,
    parse_ip_literal,
    parse_resolve_option,
)

pytestmark = pytest.mark.security

GUARD = AddressGuard()
LOOPBACK = ipaddress.IPv4Address("127.0.0.1")
METADATA = ipaddress.IPv4Address("169.254.169.254")


def teredo(server: str, client: str) -> str:
    """A Teredo address for `client` behind relay `server` (client bits stored inverted)."""
    value = (
        0x2001_0000 << 96
        | int(ipaddress.IPv4Address(server)) << 64
        | 0x8000_63BF << 32
        | (~int(ipaddress.IPv4Address(client)) & 0xFFFFFFFF)
    )
    return str(ipaddress.IPv6Address(value))


def refusal(text: str, guard: AddressGuard = GUARD) -> str | None:
    ip = parse_ip_literal(text)
    assert ip is not None, f"{text!r} should parse as an IP literal"
    return guard.refusal(ip)


LOOPBACK_SPELLINGS = [
    "127.0.0.1",
    "2130706433",
    "0x7f000001",
    "0X7F000001",
    "0x7F000001",
    "017700000001",
    "0177.0.0.1",
    "0177.0000.0.01",
    "000000177.0.0.1",
    "127.1",
    "127.0.1",
    "0x7f.1",
    "0x7f.0.0.1",
    "0x7f.0x0.0x0.0x1",
    "0x7f.0.1",
    "127.0x1",
    "127.0.0.1.",
    "0x7f.1.",
]


@pytest.mark.parametrize("text", LOOPBACK_SPELLINGS)
def test_every_legacy_spelling_of_loopback_parses_to_127_0_0_1(text: str) -> None:
    assert parse_ip_literal(text) == LOOPBACK
    assert "loopback" in (refusal(text) or "")


LOOPBACK_V6_FORMS = [
    "[::1]",
    "::1",
    "0:0:0:0:0:0:0:1",
    "[::ffff:127.0.0.1]",
    "::ffff:127.0.0.1",
    "[::ffff:7f00:1]",
    "[0:0:0:0:0:ffff:7f00:1]",
    "::FFFF:7F00:1",
    "::127.0.0.1",
    "::7f00:1",
    "::ffff:0:7f00:1",  # IPv4-translated
    "64:ff9b::7f00:1",  # NAT64
    "64:ff9b::127.0.0.1",
    "64:ff9b:1::7f00:1",  # local-use NAT64, /96 placement
    "64:ff9b:1:7f00:0:100::",  # local-use NAT64, /48 placement
    "2002:7f00:1::",  # 6to4
    "2002:7f00:1:1234::5",
    teredo("65.54.227.120", "127.0.0.1"),
    "[::ffff:127.0.0.1%eth0]",
    "::1%lo",
    "::1%25lo",
]


@pytest.mark.parametrize("text", LOOPBACK_V6_FORMS)
def test_ipv6_forms_carrying_loopback_are_refused(text: str) -> None:
    reason = refusal(text)
    assert reason is not None
    assert "loopback" in reason or "this network" in reason or "unspecified" in reason


@pytest.mark.parametrize(
    "text",
    ["::ffff:127.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::", teredo("65.54.227.120", "127.0.0.1")],
)
def test_embedded_loopback_reason_names_the_v4_address_and_the_form(text: str) -> None:
    reason = refusal(text) or ""
    assert reason.startswith("loopback address 127.0.0.1")
    assert "embedded in" in reason


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[::1]", ipaddress.IPv6Address("::1")),
        ("fe80::1%eth0", ipaddress.IPv6Address("fe80::1")),
        ("fe80::1%25eth0", ipaddress.IPv6Address("fe80::1")),
        ("[fe80::1%25eth0]", ipaddress.IPv6Address("fe80::1")),
        ("fe80::1%2", ipaddress.IPv6Address("fe80::1")),
        ("2001:DB8::1", ipaddress.IPv6Address("2001:db8::1")),
        ("0", ipaddress.IPv4Address("0.0.0.0")),
        ("4294967295", ipaddress.IPv4Address("255.255.255.255")),
        ("0xffffffff", ipaddress.IPv4Address("255.255.255.255")),
        ("1.2.3", ipaddress.IPv4Address("1.2.0.3")),
        ("1.65535", ipaddress.IPv4Address("1.0.255.255")),
        ("0xa9fea9fe", METADATA),
        ("2852039166", METADATA),
        ("0251.0376.0251.0376", METADATA),
        ("169.16689662", METADATA),
        ("8.8.8.8", ipaddress.IPv4Address("8.8.8.8")),
    ],
)
def test_parse_ip_literal(text: str, expected: ipaddress.IPv4Address) -> None:
    assert parse_ip_literal(text) == expected


NOT_LITERALS = [
    # names
    "cafe.be",
    "example.com",
    "1.2.3.4.nip.io",
    "0x7f.example",
    "127.0.0.1.example",
    "localhost",
    "deadbeef",
    "face",
    # garbage that must not be mistaken for an address
    "",
    ".",
    "..",
    "1.2.3.4.5",
    "256.1.1.1",
    "1.256.1.1",
    "1.2.3.256",
    "1.2.65536",
    "1.16777216",
    "4294967296",
    "0x100000000",
    "08.0.0.1",
    "0x",
    "0x.0x.0x.0x",
    "0xg",
    "1..2",
    ".1.2.3",
    "127.0.0.1..",
    "+1.2.3.4",
    "-1",
    "1.2.3.4 ",
    " 1.2.3.4",
    "1.2.3.4\t",
    "1.2.3.4\x00",
    "1 .2.3.4",
    "[127.0.0.1]",
    "[::1",
    "::1]",
    "[[::1]]",
    "[]",
    "[:]",
    "fe80::1%",
    "fe80::1%%",
    "fe80::1%eth 0",
    "fe80::1%eth0%eth1",
    "::ffff:127.1",
    "::ffff:0177.0.0.1",
    "1:2:3:4:5:6:7:8:9",
    ":::",
    "\u0661\u0662\u0667.0.0.1",  # Arabic-Indic digits
    "\uff11\uff12\uff17.0.0.1",  # full-width digits
    "127\u30020.0.1",  # ideographic full stop
    "1" * 5000,
]


@pytest.mark.parametrize("text", NOT_LITERALS)
def test_names_and_garbage_are_not_literals(text: str) -> None:
    assert parse_ip_literal(text) is None


def test_legacy_ipv4_parsing_agrees_with_inet_aton() -> None:
    # The resolver the proxy uses reads literals with inet_aton; disagreeing with it on any
    # spelling would let a name through as "not an address". (We also accept one trailing dot.)
    rng = random.Random(20240601)
    alphabet = "0123456789xXaAfg...."
    for _ in range(4000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14)))
        if text.endswith(".") and not text.endswith(".."):
            continue
        try:
            expected: ipaddress.IPv4Address | None = ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            expected = None
        assert parse_ip_literal(text) == expected, text


def test_random_strings_never_raise() -> None:
    rng = random.Random(7)
    alphabet = "0123456789abcdefxX.:[]%-_ /@\t\x00\u0661\uff0e\u3002\uff11\u00df\U0001f600"
    guard = AddressGuard(["127.0.0.0/8"])
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        ip = parse_ip_literal(text)
        if ip is not None:
            assert isinstance(ip, ipaddress.IPv4Address | ipaddress.IPv6Address)
            reason = guard.refusal(ip)
            assert reason is None or isinstance(reason, str)
        assert name_refusal(text) is None or isinstance(name_refusal(text), str)


def test_random_addresses_never_raise() -> None:
    rng = random.Random(11)
    for _ in range(3000):
        v4 = ipaddress.IPv4Address(rng.getrandbits(32))
        v6 = ipaddress.IPv6Address(rng.getrandbits(128))
        for ip in (v4, v6, ipaddress.IPv6Address((0xFFFF << 32) | int(v4))):
            reason = GUARD.refusal(ip)
            assert reason is None or isinstance(reason, str)


@pytest.mark.parametrize("text", [1, None, b"127.0.0.1", ["127.0.0.1"]])
def test_non_strings_are_not_literals(text: object) -> None:
    assert parse_ip_literal(text) is None  # type: ignore[arg-type]


METADATA_SPELLINGS = [
    "169.254.169.254",
    "0xa9fea9fe",
    "2852039166",
    "0251.0376.0251.0376",
    "169.254.43518",
    "[::ffff:a9fe:a9fe]",
    "::ffff:169.254.169.254",
    "64:ff9b::a9fe:a9fe",
    "2002:a9fe:a9fe::",
    teredo("65.54.227.120", "169.254.169.254"),
    "169.254.170.2",
    "100.100.100.200",
    "168.63.129.16",
    "fd00:ec2::254",
    "[fd00:ec2::254]",
    "192.0.0.192",
]


@pytest.mark.parametrize("text", METADATA_SPELLINGS)
def test_cloud_metadata_addresses_are_refused_as_metadata(text: str) -> None:
    assert "cloud metadata" in (refusal(text) or "")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("10.1.2.3", "private address 10.1.2.3"),
        ("172.16.0.1", "private address"),
        ("172.31.255.255", "private address"),
        ("192.168.1.1", "private address"),
        ("100.64.0.1", "carrier-grade NAT address 100.64.0.1 (100.64.0.0/10)"),
        ("100.127.255.254", "carrier-grade NAT"),
        ("169.254.1.1", "link-local address"),
        ("0.0.0.0", "unspecified address"),
        ("0", "unspecified address"),
        ("0.1.2.3", "this network"),
        ("192.0.0.8", "reserved"),
        ("192.0.2.1", "documentation range"),
        ("198.51.100.7", "documentation range"),
        ("203.0.113.9", "documentation range"),
        ("192.88.99.1", "reserved"),
        ("198.18.0.1", "reserved"),
        ("198.19.255.1", "reserved"),
        ("224.0.0.1", "multicast"),
        ("239.255.255.250", "multicast"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "broadcast"),
        ("::", "unspecified address"),
        ("::1", "loopback address ::1"),
        ("fc00::1", "unique local"),
        ("fd12:3456::1", "unique local"),
        ("fe80::1", "link-local address"),
        ("febf::1", "link-local address"),
        ("fec0::1", "site-local"),
        ("ff02::1", "multicast"),
        ("2001:db8::1", "documentation range"),
        ("100::1", "discard-only"),
        ("2001:2::1", "benchmarking"),
        ("::ffff:10.0.0.1", "private address 10.0.0.1"),
        ("::ffff:100.64.0.1", "carrier-grade NAT"),
        ("::2", "this network"),
        ("64:ff9b::c0a8:101", "private address 192.168.1.1"),
        ("2002:a00:1::", "private address 10.0.0.1"),
        (teredo("10.0.0.1", "8.8.8.8"), "private address 10.0.0.1"),  # internal relay
        (teredo("65.54.227.120", "192.168.0.1"), "private address 192.168.0.1"),
        ("2001:10::1", "reserved"),  # ORCHID: not global
    ],
)
def test_internal_addresses_are_refused_with_a_readable_reason(text: str, reason: str) -> None:
    assert reason in (refusal(text) or "")


@pytest.mark.parametrize(
    "text",
    [
        "8.8.8.8",
        "1.1.1.1",
        "151.101.0.223",
        "100.63.255.255",  # just below CGNAT
        "100.128.0.0",  # just above CGNAT
        "172.15.255.255",
        "172.32.0.0",
        "169.255.0.1",
        "2606:4700::1111",
        "2001:4860:4860::8888",
        "2a00:1450:4001:80b::200e",
        "::ffff:8.8.8.8",
        "[::ffff:808:808]",
        "64:ff9b::808:808",
        "2002:808:808::1",
        teredo("65.54.227.120", "8.8.8.8"),
    ],
)
def test_public_addresses_are_allowed(text: str) -> None:
    assert refusal(text) is None


def test_operator_allow_cidrs_let_loopback_through_in_every_form() -> None:
    guard = AddressGuard(["127.0.0.0/8", "10.200.0.0/16"])
    for text in ["127.0.0.1", "2130706433", "[::ffff:127.0.0.1]", "64:ff9b::7f00:1", "127.9.9.9"]:
        assert refusal(text, guard) is None, text
    assert refusal("10.200.3.4", guard) is None
    assert refusal("::ffff:10.200.3.4", guard) is None
    # Everything outside the exceptions stays refused.
    assert "private" in (refusal("10.201.0.1", guard) or "")
    assert "loopback" in (refusal("::1", guard) or "")
    assert "cloud metadata" in (refusal("169.254.169.254", guard) or "")


def test_operator_allow_cidr_for_ipv6_loopback() -> None:
    guard = AddressGuard(["::1/128"])
    assert refusal("[::1]", guard) is None
    assert refusal("127.0.0.1", guard) is not None


def test_broad_allow_cidr_does_not_open_metadata_but_an_exact_entry_does() -> None:
    broad = AddressGuard(["169.254.0.0/16", "0.0.0.0/0"])
    assert refusal("169.254.1.1", broad) is None
    assert "cloud metadata" in (refusal("169.254.169.254", broad) or "")
    assert "cloud metadata" in (refusal("::ffff:169.254.169.254", broad) or "")
    exact = AddressGuard(["169.254.169.254/32"])
    assert refusal("169.254.169.254", exact) is None
    assert refusal("::ffff:169.254.169.254", exact) is None


def test_guard_accepts_host_bits_and_whitespace_in_cidrs() -> None:
    guard = AddressGuard([" 10.200.0.1/16 "])
    assert guard.allow_networks == (ipaddress.ip_network("10.200.0.0/16"),)


@pytest.mark.parametrize("bad", ["10.0.0.0/33", "not-a-cidr", "", "10.0.0.0/8/8", "::1/129"])
def test_invalid_allow_cidrs_raise_a_clear_error(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid egress allow CIDR"):
        AddressGuard([bad])


def test_allow_cidrs_must_be_a_list_not_a_string() -> None:
    with pytest.raises(ValueError, match="list"):
        AddressGuard("127.0.0.0/8")


def test_scoped_ipv6_address_is_judged_without_its_zone() -> None:
    assert "link-local" in (GUARD.refusal(ipaddress.IPv6Address("fe80::1%eth0")) or "")


@pytest.mark.parametrize(
    "host",
    [
        "metadata.google.internal",
        "METADATA.GOOGLE.INTERNAL.",
        "metadata.goog",
        "metadata",
        "instance-data",
        "instance-data.ec2.internal",
        "metadata.azure.internal",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
        "kubernetes.default.svc.cluster.local.",
    ],
)
def test_metadata_and_cluster_names_are_refused(host: str) -> None:
    reason = name_refusal(host) or ""
    assert "metadata" in reason or "Kubernetes" in reason


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "LOCALHOST",
        "localhost.",
        "localhost..",
        "foo.localhost",
        "a.b.LocalHost.",
        "\uff4c\uff4f\uff43\uff41\uff4c\uff48\uff4f\uff53\uff54",  # full-width "localhost"
        "localhost\u3002",
    ],
)
def test_localhost_names_are_refused(host: str) -> None:
    assert "loopback" in (name_refusal(host) or "")


@pytest.mark.parametrize(
    "host",
    [
        "example.com",
        "metadata.example.com",
        "localhost.example.com",
        "mylocalhost",
        "kubernetes.io",
        "google.internal",
        "",
        "[::1]",
    ],
)
def test_ordinary_names_are_not_refused_by_name(host: str) -> None:
    assert name_refusal(host) is None


@pytest.mark.parametrize(
    ("text", "host", "ip"),
    [
        ("pypi.internal=10.200.0.5", "pypi.internal", "10.200.0.5"),
        ("PyPI.Internal.=10.200.0.5", "pypi.internal", "10.200.0.5"),
        ("mirror.local=[fd00::5]", "mirror.local", "fd00::5"),
        ("mirror.local=fd00::5", "mirror.local", "fd00::5"),
        ("bücher.de=203.0.113.1", "xn--bcher-kva.de", "203.0.113.1"),
    ],
)
def test_parse_resolve_option(text: str, host: str, ip: str) -> None:
    assert parse_resolve_option(text) == (host, ipaddress.ip_address(ip))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "pypi.internal",
        "=10.0.0.1",
        "pypi.internal=",
        "pypi.internal=not-an-ip",
        "pypi.internal:443=10.0.0.1",
        "10.0.0.1=10.0.0.2",
        "bad host=10.0.0.1",
        "pypi.internal=10.0.0.1=x",
    ],
)
def test_parse_resolve_option_rejects_bad_input_naming_the_form(text: str) -> None:
    with pytest.raises(ValueError, match="HOST=IP"):
        parse_resolve_option(text)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Example.COM.", "example.com"),
        ("bücher.de", "xn--bcher-kva.de"),
        ("BÜCHER.de", "xn--bcher-kva.de"),
        ("xn--bcher-kva.de", "xn--bcher-kva.de"),
        ("\uff45\uff58\uff41\uff4d\uff50\uff4c\uff45\uff0ecom", "example.com"),
        ("_acme.example.com", "_acme.example.com"),
        ("a-b.example", "a-b.example"),
        ("intranet", "intranet"),
    ],
)
def test_normalize_name(name: str, expected: str) -> None:
    assert normalize_name(name) == expected


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "a..b",
        ".a.b",
        "a.b..",
        "-a.com",
        "a b.com",
        "a/b.com",
        "a@b.com",
        "a:b",
        "[::1]",
        "a" * 64 + ".com",
        ".".join(["a" * 60] * 5),
        "xn--a.com",
        "127.0.0.1",
        "1.2.3.4.5",
        "example.123",
        "example.0x1f",
        "\uff11\uff12\uff17\uff0e\uff10\uff0e\uff10\uff0e\uff11",  # full-width 127.0.0.1
        "a\u2024b.com",  # one-dot leader folds to '.' inside a label
    ],
)
def test_normalize_name_rejects(name: str) -> None:
    with pytest.raises(ValueError):
        normalize_name(name)
