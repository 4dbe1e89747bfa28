"""The egress policy model: rule parsing, matching, the three-layer decision and ceilings."""

from __future__ import annotations

import ipaddress
import random

import pytest

from agentbox.egress.policy import (
    MAX_RULES,
    Decision,
    EgressPolicy,
    Rule,
    RuleError,
    check_within,
    decide,
    normalize_host,
    parse_rule,
)


def policy(
    allow: list[str] | None = None, deny: list[str] | None = None, internet: bool = False
) -> EgressPolicy:
    return EgressPolicy.from_dict(
        {"allow_out": allow or [], "deny_out": deny or [], "allow_internet_access": internet}
    )


# --- parse_rule -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind", "host", "port", "normalised"),
    [
        ("example.com", "host", "example.com", None, "example.com"),
        ("Example.COM.", "host", "example.com", None, "example.com"),
        ("  example.com  ", "host", "example.com", None, "example.com"),
        ("example.com:443", "host", "example.com", 443, "example.com:443"),
        ("example.com:0443", "host", "example.com", 443, "example.com:443"),
        ("*.example.com", "wildcard", "example.com", None, "*.example.com"),
        ("*.Example.com.:8443", "wildcard", "example.com", 8443, "*.example.com:8443"),
        ("*.co.uk", "wildcard", "co.uk", None, "*.co.uk"),
        ("bücher.de", "host", "xn--bcher-kva.de", None, "xn--bcher-kva.de"),
        ("*.bücher.de:443", "wildcard", "xn--bcher-kva.de", 443, "*.xn--bcher-kva.de:443"),
        ("localhost", "host", "localhost", None, "localhost"),
    ],
)
def test_parse_name_rules(
    text: str, kind: str, host: str, port: int | None, normalised: str
) -> None:
    rule = parse_rule(text)
    assert (rule.kind, rule.host, rule.port, rule.text, rule.network) == (
        kind,
        host,
        port,
        normalised,
        None,
    )


@pytest.mark.parametrize(
    ("text", "network", "port", "normalised"),
    [
        ("203.0.113.5", "203.0.113.5/32", None, "203.0.113.5"),
        ("203.0.113.5:443", "203.0.113.5/32", 443, "203.0.113.5:443"),
        ("10.0.0.0/8", "10.0.0.0/8", None, "10.0.0.0/8"),
        ("10.1.2.3/8", "10.0.0.0/8", None, "10.0.0.0/8"),  # host bits are fine
        ("10.0.0.0/8:5432", "10.0.0.0/8", 5432, "10.0.0.0/8:5432"),
        ("[2001:db8::1]:443", "2001:db8::1/128", 443, "[2001:db8::1]:443"),
        ("[2001:db8::1]", "2001:db8::1/128", None, "2001:db8::1"),
        ("2001:db8::1", "2001:db8::1/128", None, "2001:db8::1"),
        ("2001:DB8::/32", "2001:db8::/32", None, "2001:db8::/32"),
        ("[2001:db8::/32]:443", "2001:db8::/32", 443, "[2001:db8::/32]:443"),
        ("2130706433", "127.0.0.1/32", None, "127.0.0.1"),
        ("0x7f.1:80", "127.0.0.1/32", 80, "127.0.0.1:80"),
        ("0x0a000000/8", "10.0.0.0/8", None, "10.0.0.0/8"),
        ("1.2.3.4/0", "0.0.0.0/0", None, "0.0.0.0/0"),
    ],
)
def test_parse_address_rules(text: str, network: str, port: int | None, normalised: str) -> None:
    rule = parse_rule(text)
    assert rule.kind == "cidr"
    assert rule.network == ipaddress.ip_network(network)
    assert (rule.port, rule.text, rule.host) == (port, normalised, "")


@pytest.mark.parametrize(
    "text",
    [
        "example.com",
        "*.example.com:8443",
        "bücher.de",
        "10.1.2.3/8",
        "[2001:db8::1]:443",
        "2001:db8::/32",
        "[2001:db8::/32]:443",
        "0x7f.1:80",
    ],
)
def test_normalised_text_parses_back_to_the_same_rule(text: str) -> None:
    rule = parse_rule(text)
    assert parse_rule(rule.text) == rule


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty rule"),
        ("   ", "empty rule"),
        ("*", "allow_internet_access"),
        ("*.com", "at least two labels"),
        ("*.com:443", "at least two labels"),
        ("*.", "empty"),
        ("*foo.com", "whole first label"),
        ("foo.*.com", "whole first label"),
        ("**.a.com", "whole first label"),
        ("*.*.a.com", "whole first label"),
        ("https://a.com/x", "give a host name, not a URL (e.g. 'a.com')"),
        ("http://a.com", "not a URL"),
        ("a.com/x", "not a path"),
        ("a.com:443/x", "not a path"),
        ("/etc/passwd", "not a path"),
        ("user@a.com", "without a user name (e.g. 'a.com')"),
        ("user:pw@a.com", "without a user name"),
        ("a .com", "whitespace"),
        ("a.com\n", None),  # stripped: valid
        ("a\tb.com", "whitespace"),
        ("a_b!.com", "may only contain"),
        ("exa$mple.com", "may only contain"),
        ("-a.com", "may only contain"),
        ("a" * 64 + ".com", "longer than 63"),
        (".".join(["a" * 63] * 4), "longer than 253"),
        ("a.com:0", "1 to 65535"),
        ("a.com:65536", "1 to 65535"),
        ("a.com:99999999999", "1 to 65535"),
        ("a.com:http", "1 to 65535"),
        ("a.com:", "1 to 65535"),
        ("a.com:-1", "1 to 65535"),
        (":443", "host is missing"),
        ("[a.com]:443", "brackets are only for IPv6"),
        ("[127.0.0.1]", "brackets are only for IPv6"),
        ("[2001:db8::1", "without a closing"),
        ("[2001:db8::1]443", "':PORT'"),
        ("10.0.0.0/33", "at most 32"),
        ("2001:db8::/129", "at most 128"),
        ("10.0.0.0/x", "not a prefix length"),
        ("1.2.3.4.5", "ends in a number"),
        ("256.0.0.1", "ends in a number"),
        ("a..com", "empty label"),
        ("xn--a.com", "punycode"),
        ("a" * 400, "longer than 300"),
    ],
)
def test_parse_rule_rejects_with_actionable_messages(text: str, message: str | None) -> None:
    if message is None:
        parse_rule(text)
        return
    with pytest.raises(RuleError) as excinfo:
        parse_rule(text)
    assert message in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)


def test_rule_errors_name_the_entry() -> None:
    with pytest.raises(RuleError, match="'https://a.com/x'"):
        parse_rule("https://a.com/x")


def test_parse_rule_fuzz_raises_only_rule_error() -> None:
    rng = random.Random(3)
    alphabet = "abc019xX.:*[]/@%-_ \tü\uff0e\u3002:/"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        try:
            rule = parse_rule(text)
        except RuleError:
            continue
        assert parse_rule(rule.text) == rule, text


# --- normalize_host and matching ------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("Example.COM.", "example.com"),
        ("bücher.de", "xn--bcher-kva.de"),
        ("[::1]", "::1"),
        ("[2001:DB8::1]", "2001:db8::1"),
        ("fe80::1%eth0", "fe80::1"),
        ("2130706433", "127.0.0.1"),
        ("0x7f.1", "127.0.0.1"),
        ("127.0.0.1.", "127.0.0.1"),
        ("[::ffff:127.0.0.1]", str(ipaddress.ip_address("::ffff:127.0.0.1"))),
    ],
)
def test_normalize_host(host: str, expected: str) -> None:
    assert normalize_host(host) == expected


@pytest.mark.parametrize(
    "host",
    [
        "",
        "a b",
        "a/b",
        "[example.com]",
        "1.2.3.4.5",
        "example.com:443",
        "\uff11\uff12\uff17\uff0e\uff10\uff0e\uff10\uff0e\uff11",
        "*.example.com",
    ],
)
def test_normalize_host_rejects(host: str) -> None:
    with pytest.raises(RuleError, match="invalid destination"):
        normalize_host(host)


def test_normalize_host_fuzz_raises_only_rule_error() -> None:
    rng = random.Random(5)
    alphabet = "abc0179xX.:[]%-_ ü\uff0e\U0001f600"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        try:
            normalize_host(text)
        except RuleError:
            pass


@pytest.mark.parametrize(
    ("rule", "host", "port", "expected"),
    [
        ("example.com", "example.com", 443, True),
        ("example.com", "example.com", 80, True),
        ("example.com", "a.example.com", 443, False),
        ("example.com", "notexample.com", 443, False),
        ("example.com:443", "example.com", 443, True),
        ("example.com:443", "example.com", 80, False),
        ("*.example.com", "a.example.com", 443, True),
        ("*.example.com", "a.b.example.com", 443, True),
        ("*.example.com", "example.com", 443, False),  # the apex is not included
        ("*.example.com", "badexample.com", 443, False),
        ("*.example.com", "example.com.evil.net", 443, False),
        ("*.example.com:8443", "a.example.com", 8443, True),
        ("*.example.com:8443", "a.example.com", 443, False),
        ("10.0.0.0/8", "10.1.2.3", 443, True),
        ("10.0.0.0/8", "11.0.0.1", 443, False),
        ("10.0.0.0/8", "10.example.com", 443, False),  # names never match a cidr
        ("10.0.0.0/8", "::ffff:a00:1", 443, False),  # other IP version
        ("203.0.113.5:443", "203.0.113.5", 443, True),
        ("203.0.113.5:443", "203.0.113.5", 22, False),
        ("2001:db8::/32", "2001:db8::1", 443, True),
        ("[2001:db8::1]:443", "2001:db8::1", 443, True),
        ("2001:db8::1", "2001:db8::2", 443, False),
        ("bücher.de", "xn--bcher-kva.de", 443, True),
    ],
)
def test_rule_matches(rule: str, host: str, port: int, expected: bool) -> None:
    assert parse_rule(rule).matches(host, port) is expected


def test_rule_is_frozen() -> None:
    rule = parse_rule("example.com")
    with pytest.raises(AttributeError):
        rule.host = "evil.com"  # type: ignore[misc]


# --- EgressPolicy ---------------------------------------------------------------------------


def test_default_policy_allows_nothing() -> None:
    assert EgressPolicy() == EgressPolicy.NONE
    assert EgressPolicy.NONE.is_empty
    assert EgressPolicy.from_dict(None) is EgressPolicy.NONE
    assert EgressPolicy.from_dict({}).is_empty
    assert not policy(["a.com"]).is_empty
    assert not policy(internet=True).is_empty
    assert policy(deny=["a.com"]).is_empty


def test_from_dict_normalises_deduplicates_and_round_trips() -> None:
    p = EgressPolicy.from_dict(
        {
            "allow_out": ["b.com", "Example.com.", "example.com", "b.com", "*.x.org:443"],
            "deny_out": ["10.1.0.0/16", "10.1.2.3/16"],
            "allow_internet_access": False,
        }
    )
    assert p.to_dict() == {
        "allow_out": ["b.com", "example.com", "*.x.org:443"],
        "deny_out": ["10.1.0.0/16"],
        "allow_internet_access": False,
    }
    assert EgressPolicy.from_dict(p.to_dict()) == p


def test_from_dict_accepts_null_lists() -> None:
    assert EgressPolicy.from_dict({"allow_out": None, "allow_internet_access": None}).is_empty


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"allow": ["a.com"]}, "unknown network policy key(s) 'allow'"),
        ({"allow_out": "a.com"}, "allow_out must be a list of strings"),
        ({"deny_out": {"a.com": 1}}, "deny_out must be a list of strings"),
        ({"allow_out": ["a.com", 5]}, "allow_out[1] must be a string"),
        ({"allow_out": ["a.com", "https://b.com/"]}, "allow_out[1]: invalid rule 'https://b.com/'"),
        ({"deny_out": ["*"]}, "deny_out[0]"),
        ({"allow_internet_access": "yes"}, "allow_internet_access must be true or false"),
        ({"allow_internet_access": 1}, "allow_internet_access must be true or false"),
        ({"allow_out": [f"h{i}.example.com" for i in range(MAX_RULES + 1)]}, "at most 256"),
        (["a.com"], "must be an object"),
    ],
)
def test_from_dict_rejects(data: object, message: str) -> None:
    with pytest.raises(RuleError) as excinfo:
        EgressPolicy.from_dict(data)  # type: ignore[arg-type]
    assert message in str(excinfo.value)


def test_from_dict_accepts_exactly_the_rule_limit() -> None:
    hosts = [f"h{i}.example.com" for i in range(MAX_RULES)]
    assert len(policy(hosts).allow_out) == MAX_RULES


# --- decide ---------------------------------------------------------------------------------


def test_empty_policy_denies_and_says_how_to_enable_egress() -> None:
    d = decide("api.example.com", 443, EgressPolicy.NONE)
    assert d == Decision(False, "sandbox", "no allow_out rule matches", d.message)
    assert "no network egress at all" in d.message
    assert "allow_out ['api.example.com']" in d.message
    assert "PUT /v1/sandboxes/{id}/network" in d.message
    assert "--allow api.example.com" in d.message


def test_unlisted_host_is_denied_with_the_fix() -> None:
    d = decide("api.example.com", 443, policy(["pypi.org"]))
    assert not d.allowed and d.source == "sandbox" and d.rule == "no allow_out rule matches"
    assert d.message.startswith("api.example.com:443 is not in this sandbox's allow_out list")
    assert "allow_out ['api.example.com']" in d.message


@pytest.mark.parametrize(
    ("allow", "host", "port", "rule"),
    [
        (["pypi.org"], "pypi.org", 443, "allow_out 'pypi.org'"),
        (["*.pythonhosted.org"], "files.pythonhosted.org", 443, "allow_out '*.pythonhosted.org'"),
        (["a.com:443", "a.com"], "a.com", 80, "allow_out 'a.com'"),
        (["a.com:443", "a.com"], "a.com", 443, "allow_out 'a.com:443'"),
        (["203.0.113.0/24"], "203.0.113.7", 22, "allow_out '203.0.113.0/24'"),
    ],
)
def test_allowed_decisions_name_the_rule(allow: list[str], host: str, port: int, rule: str) -> None:
    d = decide(host, port, policy(allow))
    assert (d.allowed, d.source, d.rule) == (True, "sandbox", rule)
    assert rule in d.message


@pytest.mark.parametrize(
    ("allow", "host", "port"),
    [
        (["*.example.com"], "example.com", 443),
        (["example.com"], "www.example.com", 443),
        (["example.com:443"], "example.com", 80),
        (["10.0.0.0/8"], "ten.example.com", 443),
    ],
)
def test_not_matching_is_denied(allow: list[str], host: str, port: int) -> None:
    assert not decide(host, port, policy(allow)).allowed


def test_deny_wins_over_allow() -> None:
    p = policy(["*.example.com", "good.example.com"], deny=["bad.example.com"])
    assert decide("good.example.com", 443, p).allowed
    d = decide("bad.example.com", 443, p)
    assert (d.allowed, d.source, d.rule) == (False, "sandbox", "deny_out 'bad.example.com'")
    assert "remove that rule" in d.message


def test_sandbox_deny_wins_over_allow_internet() -> None:
    p = policy(deny=["*.evil.com"], internet=True)
    assert decide("pypi.org", 443, p).allowed
    assert decide("pypi.org", 443, p).rule == "allow_internet_access"
    d = decide("x.evil.com", 443, p)
    assert not d.allowed and d.rule == "deny_out '*.evil.com'"


def test_port_specific_deny() -> None:
    p = policy(["example.com"], deny=["example.com:25"])
    assert decide("example.com", 443, p).allowed
    assert not decide("example.com", 25, p).allowed


def test_operator_deny_beats_allow_internet_and_allow_out() -> None:
    operator = (parse_rule("*.evil.com"), parse_rule("10.0.0.0/8"))
    p = policy(["x.evil.com", "10.0.0.0/8"], internet=True)
    for host in ("x.evil.com", "10.1.2.3"):
        d = decide(host, 443, p, operator_deny=operator)
        assert (d.allowed, d.source) == (False, "operator")
        assert "cannot be overridden" in d.message
    assert decide("x.evil.com", 443, p, operator_deny=operator).rule == "deny_out '*.evil.com'"
    assert decide("pypi.org", 443, p, operator_deny=operator).allowed


def test_operator_deny_comes_before_tenant_and_sandbox_denies() -> None:
    operator = (parse_rule("evil.com"),)
    ceiling = policy(deny=["evil.com"], internet=True)
    d = decide("evil.com", 443, policy(deny=["evil.com"]), operator_deny=operator, ceiling=ceiling)
    assert d.source == "operator"
    d = decide("evil.com", 443, policy(deny=["evil.com"]), ceiling=ceiling)
    assert d.source == "tenant"
    assert "admin" in d.message


def test_ceiling_limits_what_a_sandbox_may_allow() -> None:
    ceiling = policy(["*.example.com", "pypi.org"])
    p = policy(["api.example.com", "other.org"])
    assert decide("api.example.com", 443, p, ceiling=ceiling).allowed
    d = decide("other.org", 443, p, ceiling=ceiling)
    assert (d.allowed, d.source) == (False, "tenant")
    assert "allow_out 'other.org'" in d.message
    assert "an admin must widen the tenant's ceiling" in d.message


def test_ceiling_applies_to_allow_internet_too() -> None:
    ceiling = policy(["pypi.org"])
    p = policy(internet=True)
    assert decide("pypi.org", 443, p, ceiling=ceiling).allowed
    d = decide("example.com", 443, p, ceiling=ceiling)
    assert (d.allowed, d.source) == (False, "tenant")


def test_open_ceiling_allows_whatever_the_sandbox_allows() -> None:
    ceiling = policy(internet=True)
    assert decide("example.com", 443, policy(["example.com"]), ceiling=ceiling).allowed
    assert not decide("example.com", 443, EgressPolicy.NONE, ceiling=ceiling).allowed


def test_ceiling_alone_allows_nothing() -> None:
    d = decide("pypi.org", 443, EgressPolicy.NONE, ceiling=policy(["pypi.org"]))
    assert (d.allowed, d.source) == (False, "sandbox")


def test_ipv6_destinations_are_bracketed_in_messages() -> None:
    d = decide("2001:db8::1", 443, EgressPolicy.NONE)
    assert d.message.startswith("[2001:db8::1]:443 is blocked")


# --- check_within ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("allow", "ceiling"),
    [
        ([], []),
        (["pypi.org"], ["pypi.org"]),
        (["pypi.org:443"], ["pypi.org"]),
        (["pypi.org:443"], ["pypi.org:443"]),
        (["api.example.com"], ["*.example.com"]),
        (["a.b.example.com:443"], ["*.example.com"]),
        (["*.example.com"], ["*.example.com"]),
        (["*.a.example.com"], ["*.example.com"]),
        (["*.a.example.com:443"], ["*.example.com:443"]),
        (["10.1.0.0/16"], ["10.0.0.0/8"]),
        (["10.1.2.3"], ["10.0.0.0/8"]),
        (["10.0.0.0/8"], ["10.0.0.0/8"]),
        (["2001:db8:1::/48"], ["2001:db8::/32"]),
        (["pypi.org", "10.1.0.0/16"], ["10.0.0.0/8", "pypi.org"]),
        (["anything.com"], "internet"),
    ],
)
def test_check_within_accepts(allow: list[str], ceiling: list[str] | str) -> None:
    c = policy(internet=True) if ceiling == "internet" else policy(ceiling)  # type: ignore[arg-type]
    check_within(policy(allow), c)


def test_open_ceiling_covers_allow_internet() -> None:
    check_within(policy(internet=True), policy(internet=True))


@pytest.mark.parametrize(
    ("allow", "ceiling", "offender"),
    [
        (["pypi.org"], [], "pypi.org"),
        (["pypi.org", "evil.com"], ["pypi.org"], "evil.com"),
        (["pypi.org"], ["pypi.org:443"], "pypi.org"),  # any port is wider than 443
        (["pypi.org:80"], ["pypi.org:443"], "pypi.org:80"),
        (["example.com"], ["*.example.com"], "example.com"),  # apex is not under the wildcard
        (["*.example.com"], ["api.example.com"], "*.example.com"),
        (["*.example.com"], ["*.a.example.com"], "*.example.com"),
        (["*.example.com"], ["*.other.com"], "*.example.com"),
        (["*.example.com:443"], ["*.example.com:8443"], "*.example.com:443"),
        (["10.0.0.0/8"], ["10.1.0.0/16"], "10.0.0.0/8"),
        (["10.0.0.0/8"], ["10.example.com"], "10.0.0.0/8"),
        (["::ffff:a00:1"], ["10.0.0.0/8"], "::ffff:a00:1"),
        (["10.0.0.1"], ["example.com"], "10.0.0.1"),
        (["api.example.com"], ["10.0.0.0/8"], "api.example.com"),
    ],
)
def test_check_within_names_the_first_uncovered_entry(
    allow: list[str], ceiling: list[str], offender: str
) -> None:
    with pytest.raises(RuleError) as excinfo:
        check_within(policy(allow), policy(ceiling))
    message = str(excinfo.value)
    assert f"allow_out '{offender}'" in message
    assert "tenant's network ceiling" in message


def test_check_within_refuses_allow_internet_under_a_closed_ceiling() -> None:
    with pytest.raises(RuleError, match="allow_internet_access is outside"):
        check_within(policy(internet=True), policy(["*.example.com"]))


def test_check_within_ignores_deny_lists() -> None:
    check_within(policy(["a.com"], deny=["b.com"]), policy(["a.com"], deny=["a.com"]))


def test_check_within_agrees_with_decide() -> None:
    # Whatever check_within accepts, decide must never refuse for the ceiling's sake.
    ceiling = policy(["*.example.com", "pypi.org:443", "10.0.0.0/8"])
    sandbox = policy(["*.a.example.com", "b.example.com:80", "pypi.org:443", "10.2.0.0/16"])
    check_within(sandbox, ceiling)
    for host, port in [
        ("x.a.example.com", 443),
        ("b.example.com", 80),
        ("pypi.org", 443),
        ("10.2.3.4", 22),
    ]:
        d = decide(host, port, sandbox, ceiling=ceiling)
        assert d.allowed, (host, port, d)


def test_rule_type_is_exported() -> None:
    assert isinstance(parse_rule("a.com"), Rule)
