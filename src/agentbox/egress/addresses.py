"""What the egress proxy may connect to, whatever spelling a sandbox uses.

The proxy resolves names itself and connects to the addresses it got, so this is the last word
on reachability: a sandbox must never reach the host's loopback, private networks, link-local,
carrier-grade NAT or a cloud metadata service. Attackers spell those addresses in every way a
resolver or client library accepts (`2130706433`, `0x7f.1`, `[::ffff:7f00:1]`, NAT64, 6to4,
Teredo), so literals are parsed the way `inet_aton` and browsers parse them, and every IPv6 form
that carries an IPv4 address is judged by that IPv4 address. The blocked ranges are written out
here rather than taken from `ipaddress.is_private`, whose lists changed between Python releases.
"""

from __future__ import annotations

import encodings.idna
import ipaddress
import re
from collections.abc import Iterable
from typing import TypeAlias

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network

# Longer inputs are never addresses (and never valid names); the cap also keeps int() cheap.
_MAX_INPUT = 1024

# One part of a legacy IPv4 literal, as glibc's inet_aton reads it: 0x-hex (at least one digit),
# 0-octal, or decimal. Explicit ASCII ranges: \d would accept other scripts' digits.
_V4_PART = re.compile(r"0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*")
# A last label that makes a name read as an IPv4 literal (the WHATWG "ends in a number" rule).
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")
_ZONE_ID = re.compile(r"[A-Za-z0-9._~-]+")
_LABEL = re.compile(r"[a-z0-9_][a-z0-9_-]{0,62}")
# IDNA 2003 treats these as label separators too (ideographic and full-width full stops).
_IDNA_DOTS = ("\u3002", "\uff0e", "\uff61")


def _parse_ipv4(text: str) -> ipaddress.IPv4Address | None:
    if text.endswith("."):  # a fully qualified literal, as browsers accept
        text = text[:-1]
    parts = text.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    values = []
    for part in parts:
        if not _V4_PART.fullmatch(part):
            return None
        if part[:2] in ("0x", "0X"):
            values.append(int(part[2:], 16))
        elif part.startswith("0"):
            values.append(int(part, 8))
        else:
            values.append(int(part))
    # a.b.c.d, a.b.c (c fills 16 bits), a.b (b fills 24 bits), a (32 bits): inet_aton's rules.
    *leading, last = values
    if any(value > 0xFF for value in leading) or last >= 1 << (8 * (4 - len(leading))):
        return None
    number = last
    for index, value in enumerate(leading):
        number |= value << (8 * (3 - index))
    return ipaddress.IPv4Address(number)


def _parse_ipv6(text: str) -> ipaddress.IPv6Address | None:
    address, percent, zone = text.partition("%")
    if percent:
        # A zone id names an interface on the client's side; it changes nothing about the
        # destination, so it is dropped. `%25` is its URL-encoded spelling.
        if zone.startswith("25") and len(zone) > 2:
            zone = zone[2:]
        if not _ZONE_ID.fullmatch(zone):
            return None
    try:
        return ipaddress.IPv6Address(address)
    except ValueError:
        return None


def parse_ip_literal(host: str) -> IPAddress | None:
    """The address `host` spells, or None if it is a name (or garbage); never raises.

    `host` is what a client sends in CONNECT, a Host header or SOCKS5, without the port:
    `[::1]`, `fe80::1%eth0`, `127.0.0.1.`, and the legacy IPv4 forms inet_aton accepts
    (`2130706433`, `0x7f000001`, `0177.0.0.1`, `127.1`, `0x7f.1`). IPv6 only inside brackets.
    """
    if not isinstance(host, str) or not host or len(host) > _MAX_INPUT or not host.isascii():
        return None
    if host.startswith("[") or host.endswith("]"):
        if not (host.startswith("[") and host.endswith("]")):
            return None
        host = host[1:-1]
        return _parse_ipv6(host) if ":" in host else None
    if ":" in host:
        return _parse_ipv6(host)
    return _parse_ipv4(host)


def normalize_name(name: str) -> str:
    """The lowercase IDNA A-label form of a DNS host name, without a trailing dot.

    Raises ValueError, naming the name and the problem, for anything that is not a usable host
    name: empty or over-long labels, characters outside letters, digits, '-' and '_', or a last
    label that is a number (such a name reads as an IPv4 literal; callers try parse_ip_literal
    first). Non-ASCII labels go through IDNA 2003 (Python's codec), so full-width letters fold
    to ASCII and 'ß' becomes 'ss'; the proxy connects to the name this returns.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("empty host name")
    if len(name) > _MAX_INPUT:
        raise ValueError(f"host name {name[:40]!r}... is longer than 253 characters")
    text = name
    for dot in _IDNA_DOTS:
        text = text.replace(dot, ".")
    if text.endswith("."):
        text = text[:-1]
    labels = []
    for label in text.split("."):
        if not label:
            raise ValueError(f"{name!r} is not a valid host name: it has an empty label")
        if label.isascii():
            ascii_label = label.lower()
        else:
            try:
                ascii_label = encodings.idna.ToASCII(label).decode("ascii").lower()
            except (UnicodeError, ValueError):
                raise ValueError(
                    f"{name!r} is not a valid host name: label {label!r} cannot be IDNA-encoded"
                ) from None
        if len(ascii_label) > 63:
            raise ValueError(
                f"{name!r} is not a valid host name: label {ascii_label[:20]!r}... is longer "
                "than 63 characters"
            )
        if not _LABEL.fullmatch(ascii_label):
            raise ValueError(
                f"{name!r} is not a valid host name: label {ascii_label!r} may only contain "
                "letters, digits, '-' and '_', and may not start with '-'"
            )
        if ascii_label.startswith("xn--"):
            try:
                encodings.idna.ToUnicode(ascii_label)
            except (UnicodeError, ValueError):
                raise ValueError(
                    f"{name!r} is not a valid host name: {ascii_label!r} is not valid punycode"
                ) from None
        labels.append(ascii_label)
    result = ".".join(labels)
    if len(result) > 253:
        raise ValueError(f"host name {result[:40]!r}... is longer than 253 characters")
    if _NUMERIC_LABEL.fullmatch(labels[-1]):
        raise ValueError(
            f"{name!r} is not a valid host name or IP address: it ends in a number, so it reads "
            "as an IPv4 address, but it is not one (write addresses as e.g. '203.0.113.5')"
        )
    return result


def _net(text: str) -> IPNetwork:
    return ipaddress.ip_network(text)


# Metadata services hand out cloud credentials: named first so the reason says so, and exempt
# from broad operator allow CIDRs (only an allow entry for exactly this address lets one through).
_METADATA: dict[IPAddress, str] = {
    ipaddress.ip_address(
        "169.254.169.254"
    ): "instance metadata service of AWS, GCP, Azure and others",
    ipaddress.ip_address("169.254.170.2"): "AWS ECS task metadata and credentials",
    ipaddress.ip_address("100.100.100.200"): "Alibaba Cloud metadata service",
    ipaddress.ip_address("168.63.129.16"): "Azure wire server",
    ipaddress.ip_address("fd00:ec2::254"): "AWS instance metadata over IPv6",
    ipaddress.ip_address("192.0.0.192"): "Oracle Cloud metadata service",
}

# First match wins, so narrower entries come before the ranges that contain them.
_BLOCKED_V4: tuple[tuple[IPNetwork, str], ...] = (
    (_net("0.0.0.0/32"), "unspecified address"),
    (_net("0.0.0.0/8"), "'this network' address"),
    (_net("10.0.0.0/8"), "private address"),
    (_net("100.64.0.0/10"), "carrier-grade NAT address"),
    (_net("127.0.0.0/8"), "loopback address"),
    (_net("169.254.0.0/16"), "link-local address"),
    (_net("172.16.0.0/12"), "private address"),
    (_net("192.0.0.0/24"), "reserved (IETF protocol assignments) address"),
    (_net("192.0.2.0/24"), "documentation range address"),
    (_net("192.88.99.0/24"), "reserved (6to4 relay anycast) address"),
    (_net("192.168.0.0/16"), "private address"),
    (_net("198.18.0.0/15"), "reserved (benchmarking) address"),
    (_net("198.51.100.0/24"), "documentation range address"),
    (_net("203.0.113.0/24"), "documentation range address"),
    (_net("224.0.0.0/4"), "multicast address"),
    (_net("255.255.255.255/32"), "broadcast address"),
    (_net("240.0.0.0/4"), "reserved address"),
)

_BLOCKED_V6: tuple[tuple[IPNetwork, str], ...] = (
    (_net("::/128"), "unspecified address"),
    (_net("::1/128"), "loopback address"),
    (_net("fc00::/7"), "private (unique local) address"),
    (_net("fe80::/10"), "link-local address"),
    (_net("fec0::/10"), "site-local address"),
    (_net("ff00::/8"), "multicast address"),
    (_net("2001:db8::/32"), "documentation range address"),
    (_net("100::/64"), "reserved (discard-only) address"),
    (_net("2001:2::/48"), "reserved (benchmarking) address"),
)

_V4_MAPPED = _net("::ffff:0:0/96")
_V4_COMPATIBLE = _net("::/96")
_V4_TRANSLATED = _net("::ffff:0:0:0/96")
_NAT64 = _net("64:ff9b::/96")
_NAT64_LOCAL = _net("64:ff9b:1::/48")
_SIX_TO_FOUR = _net("2002::/16")
_TEREDO = _net("2001::/32")
_V4_MASK = 0xFFFFFFFF


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> list[tuple[str, ipaddress.IPv4Address]]:
    """Every IPv4 address `ip` may stand for, with the name of the form that embeds it."""
    n = int(ip)
    low = ipaddress.IPv4Address(n & _V4_MASK)
    if ip in _V4_MAPPED:
        return [("IPv4-mapped", low)]
    if ip in _V4_COMPATIBLE:
        return [("IPv4-compatible", low)]
    if ip in _V4_TRANSLATED:
        return [("IPv4-translated", low)]
    if ip in _NAT64:
        return [("NAT64", low)]
    if ip in _NAT64_LOCAL:
        # A local-use NAT64 prefix may be /48 to /96 (RFC 6052 2.2, bits 64-71 skipped); we do
        # not know which the network uses, so every placement must be harmless.
        placements = [
            (96, n & _V4_MASK),
            (64, (n >> 24) & _V4_MASK),
            (56, ((n >> 64) & 0xFF) << 24 | (n >> 32) & 0xFFFFFF),
            (48, ((n >> 64) & 0xFFFF) << 16 | (n >> 40) & 0xFFFF),
        ]
        return [
            (f"local-use NAT64 (/{length} prefix)", ipaddress.IPv4Address(value))
            for length, value in placements
        ]
    if ip in _SIX_TO_FOUR:
        return [("6to4", ipaddress.IPv4Address((n >> 80) & _V4_MASK))]
    if ip in _TEREDO:
        # The client's address is stored inverted; the relay (server) address in the clear.
        return [
            ("Teredo client", ipaddress.IPv4Address(~n & _V4_MASK)),
            ("Teredo server", ipaddress.IPv4Address((n >> 64) & _V4_MASK)),
        ]
    return []


class AddressGuard:
    """Decides whether the proxy may connect to a resolved address.

    `allow_cidrs` are the operator's exceptions (e.g. '10.200.0.0/16' for an internal package
    mirror); they also apply to the IPv4 address inside mapped, NAT64, 6to4 and Teredo forms.
    A cloud metadata address is let through only by an entry for exactly that address.
    """

    def __init__(self, allow_cidrs: Iterable[str] = ()) -> None:
        if isinstance(allow_cidrs, str):
            raise ValueError(
                f"egress allow CIDRs must be a list of networks, not the string {allow_cidrs!r}"
            )
        networks: list[IPNetwork] = []
        for entry in allow_cidrs:
            try:
                networks.append(ipaddress.ip_network(str(entry).strip(), strict=False))
            except ValueError:
                raise ValueError(
                    f"invalid egress allow CIDR {entry!r}: expected an address or network such "
                    "as '10.200.0.0/16', '127.0.0.1' or '::1/128'"
                ) from None
        self.allow_networks: tuple[IPNetwork, ...] = tuple(networks)

    def __repr__(self) -> str:
        return f"AddressGuard({[str(n) for n in self.allow_networks]!r})"

    def _allowed(self, ip: IPAddress) -> bool:
        return any(ip in network for network in self.allow_networks)

    def refusal(self, ip: IPAddress) -> str | None:
        """None if the proxy may connect to `ip`, else a short reason an agent can read."""
        if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id is not None:
            ip = ipaddress.IPv6Address(int(ip))
        service = _METADATA.get(ip)
        if service is not None:
            if any(n.prefixlen == n.max_prefixlen and ip in n for n in self.allow_networks):
                return None
            return f"cloud metadata address {ip} ({service})"
        if self._allowed(ip):
            return None
        table = _BLOCKED_V4 if isinstance(ip, ipaddress.IPv4Address) else _BLOCKED_V6
        for network, what in table:
            if ip in network:
                return f"{what} {ip}" if network.num_addresses == 1 else f"{what} {ip} ({network})"
        if isinstance(ip, ipaddress.IPv6Address):
            embedded = _embedded_ipv4(ip)
            if embedded:
                # Judged by the IPv4 address alone: ::ffff:8.8.8.8 is just 8.8.8.8.
                for form, v4 in embedded:
                    reason = self.refusal(v4)
                    if reason is not None:
                        return f"{reason}, embedded in {form} address {ip}"
                return None
        if not ip.is_global:
            return f"reserved address {ip} (not globally routable)"
        return None


_LOOPBACK_NAME = "a loopback name: it means the proxy's own host, never a sandbox destination"
_METADATA_NAME = "a cloud metadata host name; sandboxes may never reach metadata services"
_KUBERNETES_NAME = "the in-cluster Kubernetes API server name; sandboxes may never reach it"
_BLOCKED_NAMES: dict[str, str] = {
    "localhost": _LOOPBACK_NAME,
    "localhost.localdomain": _LOOPBACK_NAME,
    "ip6-localhost": _LOOPBACK_NAME,
    "ip6-loopback": _LOOPBACK_NAME,
    "metadata.google.internal": _METADATA_NAME,
    "metadata.goog": _METADATA_NAME,
    "metadata": _METADATA_NAME,
    "instance-data": _METADATA_NAME,
    "instance-data.ec2.internal": _METADATA_NAME,
    "metadata.azure.internal": _METADATA_NAME,
    "kubernetes": _KUBERNETES_NAME,
    "kubernetes.default": _KUBERNETES_NAME,
    "kubernetes.default.svc": _KUBERNETES_NAME,
    "kubernetes.default.svc.cluster.local": _KUBERNETES_NAME,
}


def name_refusal(host: str) -> str | None:
    """A reason to refuse the host name `host` even if a policy allows it, else None.

    Covers loopback names (`localhost`, `*.localhost`) and well-known cloud metadata and
    Kubernetes names, case-insensitively, with or without a trailing dot. Never raises.
    """
    if not isinstance(host, str):
        return None
    try:
        name = normalize_name(host)
    except ValueError:
        name = host.lower().rstrip(".")
    reason = _BLOCKED_NAMES.get(name)
    if reason is None and name.endswith(".localhost"):
        reason = _LOOPBACK_NAME
    return None if reason is None else f"{name!r} is {reason}"


def parse_resolve_option(text: str) -> tuple[str, IPAddress]:
    """Parse `--egress-resolve HOST=IP` (like curl's --resolve) into (normalised host, address).

    The host is returned in the form the proxy's destination normalisation produces (lowercase
    A-label, no trailing dot) so lookups match; IP may be IPv4 or IPv6, bracketed or not.
    """
    expected = "expected HOST=IP, e.g. 'pypi.internal=10.200.0.5' or 'pypi.internal=[fd00::5]'"
    host, equals, address = text.partition("=")
    host, address = host.strip(), address.strip()
    if not equals or not host or not address:
        raise ValueError(f"invalid --egress-resolve {text!r}: {expected}")
    ip = parse_ip_literal(address)
    if ip is None:
        raise ValueError(
            f"invalid --egress-resolve {text!r}: {address!r} is not an IP address; {expected}"
        )
    if parse_ip_literal(host) is not None:
        raise ValueError(
            f"invalid --egress-resolve {text!r}: HOST must be a host name, not an address; "
            f"{expected}"
        )
    try:
        name = normalize_name(host)
    except ValueError as exc:
        raise ValueError(f"invalid --egress-resolve {text!r}: {exc}; {expected}") from None
    return name, ip
