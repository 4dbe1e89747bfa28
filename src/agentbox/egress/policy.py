"""The egress policy: which destinations a sandbox may reach, and the decision for one of them.

Three layers decide, and a deny anywhere wins: the operator's deny list (nothing overrides it),
the tenant's ceiling (the most a tenant's sandboxes may ever allow) and the sandbox's own policy.
Rules name hosts (`pypi.org`), subdomains (`*.githubusercontent.com`) or networks
(`10.200.0.0/16`), each optionally with a port. Everything here works on normalised
destinations (`normalize_host`); which addresses may be reached at all is `addresses`' job.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from agentbox.egress.addresses import IPNetwork, normalize_name, parse_ip_literal

MAX_RULES = 256
_MAX_RULE_LENGTH = 300
_POLICY_KEYS = ("allow_out", "deny_out", "allow_internet_access")
_RULE_FORMS = (
    "a host such as 'pypi.org', a wildcard such as '*.example.com' or a CIDR such as '10.0.0.0/8'"
)


class RuleError(ValueError):
    """An egress rule or policy an agent must fix; the message names the offending entry."""


@dataclass(frozen=True)
class Rule:
    """One allow_out / deny_out entry, normalised (parse it with `parse_rule`)."""

    text: str
    kind: Literal["host", "wildcard", "cidr"]
    host: str  # lowercase A-label; for a wildcard the suffix after '*.'; '' for a cidr
    network: IPNetwork | None = None
    port: int | None = None

    def matches(self, host: str, port: int) -> bool:
        """Whether the normalised destination `host`:`port` falls under this rule.

        A wildcard matches names below its suffix, not the suffix itself; a cidr rule matches
        only IP-literal destinations (names are judged by name, before resolution).
        """
        if self.port is not None and self.port != port:
            return False
        if self.kind == "host":
            return host == self.host
        if self.kind == "wildcard":
            return host.endswith("." + self.host)
        if self.network is None:
            return False
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return ip in self.network


def _rule_text(kind: str, host: str, network: IPNetwork | None, port: int | None) -> str:
    if network is not None:
        body = str(network.network_address if network.num_addresses == 1 else network)
        if port is not None and network.version == 6:
            return f"[{body}]:{port}"
    else:
        body = f"*.{host}" if kind == "wildcard" else host
    return body if port is None else f"{body}:{port}"


def _parse_port(text: str, port_text: str) -> int:
    if "/" in port_text:
        raise RuleError(f"invalid rule {text!r}: give just the host and port, not a path")
    if not (port_text.isascii() and port_text.isdigit() and len(port_text) <= 5):
        raise RuleError(f"invalid rule {text!r}: port must be a number from 1 to 65535")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise RuleError(f"invalid rule {text!r}: port must be a number from 1 to 65535")
    return port


def _parse_network(text: str, host: str) -> IPNetwork:
    address_text, _, prefix_text = host.partition("/")
    address = parse_ip_literal(address_text)
    if address is None:
        raise RuleError(
            f"invalid rule {text!r}: give a host name, not a path (use just the host, e.g. "
            f"'{address_text}'), or a CIDR such as '10.0.0.0/8'"
        )
    if not (prefix_text.isascii() and prefix_text.isdigit() and len(prefix_text) <= 3):
        raise RuleError(f"invalid rule {text!r}: {prefix_text!r} is not a prefix length")
    prefix = int(prefix_text)
    if prefix > address.max_prefixlen:
        raise RuleError(
            f"invalid rule {text!r}: an IPv{address.version} prefix length is at most "
            f"{address.max_prefixlen}"
        )
    return ipaddress.ip_network((address, prefix), strict=False)


def _name_error(text: str, host: str, exc: ValueError) -> RuleError:
    return RuleError(str(exc) if host == text else f"invalid rule {text!r}: {exc}")


def parse_rule(text: str) -> Rule:
    """Parse one allow_out / deny_out entry; RuleError says what is wrong and what to write."""
    if not isinstance(text, str) or not text.strip():
        raise RuleError(f"empty rule: give {_RULE_FORMS}")
    text = text.strip()
    if len(text) > _MAX_RULE_LENGTH:
        raise RuleError(f"invalid rule {text[:40]!r}...: longer than {_MAX_RULE_LENGTH} characters")
    if "://" in text:
        try:
            hint = urllib.parse.urlsplit(text).hostname
        except ValueError:
            hint = None
        example = f" (e.g. '{hint}')" if hint else ""
        raise RuleError(f"invalid rule {text!r}: give a host name, not a URL{example}")
    if any(c.isspace() for c in text):
        raise RuleError(
            f"invalid rule {text!r}: it contains whitespace; give one entry per item: {_RULE_FORMS}"
        )
    if "@" in text:
        raise RuleError(
            f"invalid rule {text!r}: give just the host, without a user name "
            f"(e.g. '{text.rpartition('@')[2]}')"
        )

    port: int | None = None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise RuleError(f"invalid rule {text!r}: '[' without a closing ']'")
        host, rest = text[1:end], text[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise RuleError(f"invalid rule {text!r}: expected ':PORT' after ']'")
            port = _parse_port(text, rest[1:])
        if ":" not in host:
            raise RuleError(
                f"invalid rule {text!r}: brackets are only for IPv6 addresses, e.g. "
                "'[2001:db8::1]:443'"
            )
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = _parse_port(text, port_text)
    else:  # no port, or a bare IPv6 address / network (its colons are not a port separator)
        host = text
    if not host:
        raise RuleError(f"invalid rule {text!r}: the host is missing; give {_RULE_FORMS}")

    if "*" in host:
        if host == "*":
            raise RuleError(
                f"invalid rule {text!r}: to allow every destination set allow_internet_access "
                "instead of a '*' rule"
            )
        if not host.startswith("*.") or "*" in host[2:]:
            raise RuleError(
                f"invalid rule {text!r}: '*' may only be the whole first label, as in "
                "'*.example.com'"
            )
        try:
            suffix = normalize_name(host[2:])
        except ValueError as exc:
            raise _name_error(text, host, exc) from None
        if "." not in suffix:
            raise RuleError(
                f"invalid rule {text!r}: too broad; a wildcard needs at least two labels after "
                "'*.' (e.g. '*.example.com'); to allow everything set allow_internet_access"
            )
        return Rule(_rule_text("wildcard", suffix, None, port), "wildcard", suffix, None, port)

    if "/" in host:
        network = _parse_network(text, host)
        return Rule(_rule_text("cidr", "", network, port), "cidr", "", network, port)
    address = parse_ip_literal(host)
    if address is not None:
        network = ipaddress.ip_network(address)
        return Rule(_rule_text("cidr", "", network, port), "cidr", "", network, port)
    try:
        name = normalize_name(host)
    except ValueError as exc:
        raise _name_error(text, host, exc) from None
    return Rule(_rule_text("host", name, None, port), "host", name, None, port)


def normalize_host(host: str) -> str:
    """The destination as rules see it: an IP literal in canonical form, or a lowercase A-label
    name without brackets or trailing dot. RuleError if `host` is neither."""
    address = parse_ip_literal(host)
    if address is not None:
        return str(address)
    try:
        return normalize_name(host)
    except ValueError as exc:
        raise RuleError(f"invalid destination: {exc}") from None


def _parse_rules(key: str, value: Any) -> tuple[Rule, ...]:
    if value is None:
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise RuleError(f"{key} must be a list of strings, e.g. ['pypi.org', '*.example.com']")
    if len(value) > MAX_RULES:
        raise RuleError(f"{key} has {len(value)} entries; at most {MAX_RULES} are allowed")
    rules: dict[Rule, None] = {}
    for index, entry in enumerate(value):
        if not isinstance(entry, str):
            raise RuleError(f"{key}[{index}] must be a string, not {type(entry).__name__}")
        try:
            rules.setdefault(parse_rule(entry))
        except RuleError as exc:
            raise RuleError(f"{key}[{index}]: {exc}") from None
    return tuple(rules)


@dataclass(frozen=True)
class EgressPolicy:
    """What one sandbox (or, as a ceiling, one tenant) may reach. The default allows nothing."""

    allow_out: tuple[Rule, ...] = ()
    deny_out: tuple[Rule, ...] = ()
    allow_internet: bool = False

    NONE: ClassVar[EgressPolicy]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> EgressPolicy:
        """Read {'allow_out': [...], 'deny_out': [...], 'allow_internet_access': bool}."""
        if data is None:
            return cls.NONE
        if not isinstance(data, Mapping):
            raise RuleError(
                "a network policy must be an object with keys " + ", ".join(_POLICY_KEYS)
            )
        unknown = sorted(str(key) for key in data if key not in _POLICY_KEYS)
        if unknown:
            raise RuleError(
                f"unknown network policy key(s) {', '.join(map(repr, unknown))}; "
                f"expected {', '.join(_POLICY_KEYS)}"
            )
        allow_internet = data.get("allow_internet_access", False)
        if allow_internet is None:
            allow_internet = False
        if not isinstance(allow_internet, bool):
            raise RuleError("allow_internet_access must be true or false")
        return cls(
            allow_out=_parse_rules("allow_out", data.get("allow_out")),
            deny_out=_parse_rules("deny_out", data.get("deny_out")),
            allow_internet=allow_internet,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "allow_out": [rule.text for rule in self.allow_out],
            "deny_out": [rule.text for rule in self.deny_out],
            "allow_internet_access": self.allow_internet,
        }

    @property
    def is_empty(self) -> bool:
        """True when the policy allows nothing at all."""
        return not self.allow_out and not self.allow_internet


EgressPolicy.NONE = EgressPolicy()


@dataclass(frozen=True)
class Decision:
    """The verdict for one destination, with the rule behind it and a message for the agent."""

    allowed: bool
    source: Literal["operator", "tenant", "sandbox"]
    rule: str
    message: str


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _first_match(rules: Sequence[Rule], host: str, port: int) -> Rule | None:
    return next((rule for rule in rules if rule.matches(host, port)), None)


def decide(
    host: str,
    port: int,
    policy: EgressPolicy,
    *,
    operator_deny: Sequence[Rule] = (),
    ceiling: EgressPolicy | None = None,
) -> Decision:
    """Decide whether the sandbox may reach `host` (already normalised) on `port`.

    A deny wins wherever it comes from (operator, then tenant ceiling, then sandbox); then the
    sandbox must allow it (allow_out or allow_internet_access), and so must the ceiling.
    """
    target = _target(host, port)
    rule = _first_match(operator_deny, host, port)
    if rule is not None:
        return Decision(
            False,
            "operator",
            f"deny_out '{rule.text}'",
            f"{target} is blocked by the operator's deny rule '{rule.text}'; it cannot be "
            "overridden by a sandbox or tenant network policy.",
        )
    if ceiling is not None:
        rule = _first_match(ceiling.deny_out, host, port)
        if rule is not None:
            return Decision(
                False,
                "tenant",
                f"deny_out '{rule.text}'",
                f"{target} is blocked by the tenant's deny rule '{rule.text}'; a sandbox policy "
                "cannot override it, only an admin can change the tenant's network ceiling.",
            )
    rule = _first_match(policy.deny_out, host, port)
    if rule is not None:
        return Decision(
            False,
            "sandbox",
            f"deny_out '{rule.text}'",
            f"{target} is blocked by this sandbox's deny_out rule '{rule.text}'; to allow it, "
            "remove that rule from the sandbox's network policy (PUT /v1/sandboxes/{id}/network).",
        )

    rule = _first_match(policy.allow_out, host, port)
    if rule is not None:
        allowed_by = f"allow_out '{rule.text}'"
    elif policy.allow_internet:
        allowed_by = "allow_internet_access"
    else:
        how = (
            "update the sandbox's network policy (PUT /v1/sandboxes/{id}/network or "
            f"`agentbox network ID --allow {host}`) with allow_out ['{host}']"
        )
        if policy.is_empty:
            message = (
                f"{target} is blocked: this sandbox has no network egress at all. To allow it, "
                f"{how}."
            )
        else:
            message = f"{target} is not in this sandbox's allow_out list; to allow it, {how}."
        return Decision(False, "sandbox", "no allow_out rule matches", message)

    if (
        ceiling is not None
        and not ceiling.allow_internet
        and _first_match(ceiling.allow_out, host, port) is None
    ):
        return Decision(
            False,
            "tenant",
            "no tenant ceiling allow_out rule matches",
            f"{target} is allowed by this sandbox's {allowed_by} but is outside the tenant's "
            "network ceiling; an admin must widen the tenant's ceiling to allow it.",
        )
    return Decision(True, "sandbox", allowed_by, f"{target} is allowed by {allowed_by}.")


def _covers(outer: Rule, inner: Rule) -> bool:
    """Whether ceiling rule `outer` matches every destination policy rule `inner` matches."""
    if outer.port is not None and outer.port != inner.port:
        return False
    if inner.kind == "host":
        if outer.kind == "host":
            return outer.host == inner.host
        return outer.kind == "wildcard" and inner.host.endswith("." + outer.host)
    if inner.kind == "wildcard":
        return outer.kind == "wildcard" and (
            inner.host == outer.host or inner.host.endswith("." + outer.host)
        )
    if outer.network is None or inner.network is None:
        return False
    if outer.network.version != inner.network.version:
        return False
    return inner.network.subnet_of(outer.network)  # type: ignore[arg-type]


def check_within(policy: EgressPolicy, ceiling: EgressPolicy) -> None:
    """Raise RuleError naming the first thing `policy` allows that `ceiling` does not."""
    if ceiling.allow_internet:
        return
    if policy.allow_internet:
        raise RuleError(
            "allow_internet_access is outside the tenant's network ceiling, which does not "
            "allow internet access; list the hosts you need in allow_out, or ask an admin to "
            "widen the tenant's ceiling"
        )
    for rule in policy.allow_out:
        if not any(_covers(outer, rule) for outer in ceiling.allow_out):
            raise RuleError(
                f"allow_out '{rule.text}' is outside the tenant's network ceiling; remove it or "
                "ask an admin to widen the tenant's ceiling"
            )
