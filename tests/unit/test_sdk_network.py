"""The SDK's network surface without a server: requests built, answers read, faces wired."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from agentbox.sdk import (
    AgentboxError,
    AsyncSandbox,
    BlockedAttempt,
    CommandExitException,
    EgressEvent,
    InvalidArgumentError,
    NetworkInfo,
    Sandbox,
    SandboxInfo,
    SecretInfo,
    Secrets,
)
from agentbox.sdk import protocol as p
from agentbox.sdk.async_sandbox import AsyncTransport
from agentbox.sdk.sandbox import Transport

SANDBOX_JSON: dict[str, Any] = {
    "sandbox_id": "sbx1",
    "tenant": "acme",
    "template": "default",
    "state": "running",
    "metadata": {},
    "created_at": "2025-01-02T03:04:05Z",
    "end_at": "2025-01-02T03:09:05Z",
    "ended_at": None,
    "end_reason": None,
    "resources": {"memory_mb": 512},
    "keep_workspace": False,
    "network": {
        "allow_out": ["pypi.org", "*.pythonhosted.org"],
        "deny_out": ["10.0.0.0/8"],
        "allow_internet_access": False,
        "allow_public_traffic": True,
    },
    "secrets": ["GITHUB_TOKEN"],
    "access_token": "tok-secret-123",
    "domain": "localhost:8000",
}

EGRESS_JSON: dict[str, Any] = {
    "id": 7,
    "time": "2025-01-02T03:04:05.5Z",
    "tenant": "acme",
    "sandbox_id": "sbx1",
    "protocol": "https-inspected",
    "host": "api.github.com",
    "port": 443,
    "method": "GET",
    "path": "/user",
    "status": 200,
    "bytes_out": 120,
    "bytes_in": 2048,
    "allowed": True,
    "rule": "allow_out: api.github.com",
    "reason": None,
    "duration_ms": 12.5,
}


def response(body: Any, status: int = 200) -> httpx.Response:
    return httpx.Response(status, json=body)


# ---------------------------------------------------------------------------- models


def test_sandbox_info_reads_network_fields() -> None:
    info = SandboxInfo.from_json(SANDBOX_JSON)
    assert info.network == NetworkInfo(
        allow_out=["pypi.org", "*.pythonhosted.org"],
        deny_out=["10.0.0.0/8"],
        allow_internet_access=False,
        allow_public_traffic=True,
    )
    assert info.secrets == ["GITHUB_TOKEN"]
    assert info.access_token == "tok-secret-123"
    assert info.domain == "localhost:8000"


def test_sandbox_info_repr_hides_access_token() -> None:
    assert "tok-secret-123" not in repr(SandboxInfo.from_json(SANDBOX_JSON))


def test_sandbox_info_from_older_or_ended_server_answers() -> None:
    old = {k: v for k, v in SANDBOX_JSON.items() if k not in ("network", "secrets", "domain")}
    info = SandboxInfo.from_json({**old, "access_token": None})
    assert info.network is None
    assert info.secrets == []
    assert info.access_token is None
    assert info.domain is None


def test_network_info_round_trips() -> None:
    net = NetworkInfo.from_json(SANDBOX_JSON["network"])
    assert net is not None
    assert net.to_json() == SANDBOX_JSON["network"]
    assert NetworkInfo.from_json(None) is None
    assert NetworkInfo.from_json({}) == NetworkInfo()


def test_egress_event_from_json() -> None:
    e = EgressEvent.from_json(EGRESS_JSON)
    assert e.time == datetime(2025, 1, 2, 3, 4, 5, 500000, tzinfo=UTC)
    assert (e.protocol, e.host, e.port, e.method, e.path) == (
        "https-inspected",
        "api.github.com",
        443,
        "GET",
        "/user",
    )
    assert (e.bytes_out, e.bytes_in, e.allowed, e.duration_ms) == (120, 2048, True, 12.5)
    denied = EgressEvent.from_json(
        {
            "host": "evil.example",
            "port": 443,
            "protocol": "connect",
            "allowed": False,
            "rule": "default: deny",
            "reason": "not in allow_out",
            "bytes_out": None,
        }
    )
    assert not denied.allowed and denied.method is None and denied.bytes_out == 0


def test_secret_info_from_json() -> None:
    s = SecretInfo.from_json(
        {
            "name": "TOKEN",
            "hosts": ["api.github.com"],
            "in_url": True,
            "created_at": "2025-01-02T03:04:05Z",
            "updated_at": None,
        }
    )
    assert s.name == "TOKEN" and s.hosts == ["api.github.com"] and s.in_url
    assert s.created_at == datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC) and s.updated_at is None


def test_blocked_attempts_skip_junk() -> None:
    got = BlockedAttempt.list_from_json(
        [{"host": "a.example", "port": 80, "protocol": "http", "rule": "r", "message": "m"}, 3]
    )
    assert got == [BlockedAttempt("a.example", 80, "http", "r", "m")]
    assert BlockedAttempt.list_from_json(None) == []


# ---------------------------------------------------------------------------- calls


def test_create_sandbox_sends_network_secrets_and_shorthand() -> None:
    call = p.create_sandbox(
        None,
        60,
        None,
        None,
        None,
        False,
        network={"allow_out": ["pypi.org"]},
        secrets=["A", "B"],
        allow_internet_access=True,
    )
    assert (call.method, call.path) == ("POST", "/v1/sandboxes")
    assert call.json["network"] == {"allow_out": ["pypi.org"]}
    assert call.json["secrets"] == ["A", "B"]
    assert call.json["allow_internet_access"] is True


def test_create_sandbox_without_network_leaves_the_tenant_default() -> None:
    body = p.create_sandbox("t", 60, None, None, None, False).json
    assert "network" not in body and "secrets" not in body
    assert "allow_internet_access" not in body


def test_create_sandbox_takes_a_network_info_and_a_lone_secret_name() -> None:
    body = p.create_sandbox(
        None,
        60,
        None,
        None,
        None,
        False,
        network=NetworkInfo(allow_out=["x.example"]),
        secrets="ONLY",  # type: ignore[arg-type]
    ).json
    assert body["network"] == {
        "allow_out": ["x.example"],
        "deny_out": [],
        "allow_internet_access": False,
        "allow_public_traffic": False,
    }
    assert body["secrets"] == ["ONLY"]


def test_network_body_keywords_override_and_replace() -> None:
    base = NetworkInfo(allow_out=["a.example"], allow_public_traffic=True)
    assert p.network_body(base, allow_out="b.example", allow_internet_access=True) == {
        "allow_out": ["b.example"],
        "deny_out": [],
        "allow_internet_access": True,
        "allow_public_traffic": True,
    }
    # Keywords alone describe the whole policy: fields not named are not sent (server defaults).
    assert p.network_body(allow_out=["a.example"]) == {"allow_out": ["a.example"]}
    assert p.network_body() == {}
    with pytest.raises(InvalidArgumentError):
        p.network_body(allow_out=[1])  # type: ignore[list-item]


def test_set_network_call() -> None:
    call = p.set_network("a/b", {"allow_out": ["x"]})
    assert (call.method, call.path, call.json) == (
        "PUT",
        "/v1/sandboxes/a%2Fb/network",
        {"allow_out": ["x"]},
    )
    assert call.parse(response(SANDBOX_JSON)).network is not None


def test_port_url_call() -> None:
    call = p.port_url("sbx1", 8080, expires_in=60, path="/api?x=1", routing="host")
    assert (call.method, call.path) == ("POST", "/v1/sandboxes/sbx1/port-url")
    assert call.json == {"port": 8080, "expires_in": 60, "path": "/api?x=1", "routing": "host"}
    answer = {
        "url": "http://8080-sbx1.localhost:8000/api?x=1&abx_exp=0&abx_sig=s",
        "port": 8080,
        "expires_at": None,
    }
    assert call.parse(response(answer)) == answer["url"]
    assert p.port_url("sbx1", 3000).json == {
        "port": 3000,
        "expires_in": None,
        "path": "/",
        "routing": "path",
    }
    with pytest.raises(InvalidArgumentError):
        p.port_url("sbx1", 3000, routing="subdomain")  # type: ignore[arg-type]


def test_sandbox_host() -> None:
    info = SandboxInfo.from_json(SANDBOX_JSON)
    assert p.sandbox_host(info, 3000) == "3000-sbx1.localhost:8000"
    for bad in (0, 65536, True, "80"):
        with pytest.raises(InvalidArgumentError):
            p.sandbox_host(info, bad)  # type: ignore[arg-type]
    with pytest.raises(AgentboxError) as e:
        p.sandbox_host(SandboxInfo.from_json({**SANDBOX_JSON, "domain": None}), 3000)
    assert e.value.code == "unsupported"


def test_secret_calls() -> None:
    call = p.set_secret("GH/TOKEN", "v", "api.github.com", in_url=True)
    assert (call.method, call.path) == ("PUT", "/v1/secrets/GH%2FTOKEN")
    assert call.json == {"value": "v", "hosts": ["api.github.com"], "in_url": True}
    assert call.parse(response({"name": "GH", "hosts": ["api.github.com"]})).name == "GH"

    listed = p.list_secrets()
    assert (listed.method, listed.path) == ("GET", "/v1/secrets")
    got = listed.parse(response({"secrets": [{"name": "A", "hosts": ["a"], "in_url": False}]}))
    assert [s.name for s in got] == ["A"]

    removed = p.remove_secret("A")
    assert (removed.method, removed.path) == ("DELETE", "/v1/secrets/A")


def test_list_egress_call() -> None:
    since = datetime(2025, 1, 1, tzinfo=UTC)
    call = p.list_egress("sbx1", "api.github.com", False, None, since, 50)
    assert (call.method, call.path) == ("GET", "/v1/audit/egress")
    assert call.params == [
        ("limit", 50),
        ("sandbox_id", "sbx1"),
        ("host", "api.github.com"),
        ("allowed", False),
        ("since", since.timestamp()),
    ]
    assert p.list_egress(None, None, None, None, None, 100).params == [("limit", 100)]
    events = call.parse(response({"events": [EGRESS_JSON]}))
    assert [e.host for e in events] == ["api.github.com"]


def test_egress_allowed_is_sent_as_a_boolean_query_value() -> None:
    call = p.list_egress(None, None, False, None, None, 10)
    request = httpx.Client(base_url="http://x").build_request("GET", call.path, params=call.params)
    assert request.url.params["allowed"] == "false"


def test_list_audit_params_unchanged() -> None:
    call = p.list_audit("sbx1", "command.run", "", 12.5, 5)
    assert call.params == [
        ("limit", 5),
        ("sandbox_id", "sbx1"),
        ("action", "command.run"),
        ("since", 12.5),
    ]


# ---------------------------------------------------------------------------- command end


def _ended(end: dict[str, Any]) -> p.CommandProgress:
    progress = p.CommandProgress("sbx1", "c1")
    progress.feed({"type": "stderr", "data": "curl: (56) CONNECT tunnel failed, response 403\n"})
    progress.feed({"type": "end", **end})
    return progress


BLOCKED = [
    {
        "host": "evil.example",
        "port": 443,
        "protocol": "connect",
        "rule": "default: deny",
        "message": "evil.example is not in the sandbox's allow_out",
    }
]


def test_command_result_carries_blocked_attempts() -> None:
    result = _ended({"exit_code": 0, "network_blocked": BLOCKED, "violation": None}).result()
    assert result.network_blocked == [
        BlockedAttempt(
            "evil.example",
            443,
            "connect",
            "default: deny",
            "evil.example is not in the sandbox's allow_out",
        )
    ]
    assert _ended({"exit_code": 0}).result().network_blocked == []


def test_failed_command_reports_the_network_violation() -> None:
    violation = {
        "code": "network_blocked",
        "setting": "network",
        "message": "the sandbox's egress proxy refused evil.example:443",
    }
    progress = _ended({"exit_code": 56, "network_blocked": BLOCKED, "violation": violation})
    with pytest.raises(CommandExitException) as e:
        progress.outcome()
    assert e.value.violation is not None and e.value.violation.code == "network_blocked"
    assert "evil.example:443" in str(e.value)


# ---------------------------------------------------------------------------- faces

Handler = Callable[[httpx.Request], httpx.Response]
CONFIG = p.ClientConfig(api_url="http://agentbox.test", api_key="k", request_timeout=5)


def _router(seen: list[httpx.Request]) -> Handler:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        route = (request.method, request.url.path)
        if route == ("POST", "/v1/sandboxes"):
            return httpx.Response(201, json=SANDBOX_JSON)
        if route == ("GET", "/v1/sandboxes/sbx1"):
            return httpx.Response(200, json=SANDBOX_JSON)
        if route == ("PUT", "/v1/sandboxes/sbx1/network"):
            net = {
                "allow_out": [],
                "deny_out": [],
                "allow_internet_access": False,
                "allow_public_traffic": False,
                **json.loads(request.content),
            }
            return httpx.Response(200, json={**SANDBOX_JSON, "network": net})
        if route == ("POST", "/v1/sandboxes/sbx1/port-url"):
            return httpx.Response(200, json={"url": "http://u/", "port": 1, "expires_at": None})
        if route == ("PUT", "/v1/secrets/TOKEN"):
            return httpx.Response(200, json={"name": "TOKEN", "hosts": ["h"], "in_url": False})
        if route == ("DELETE", "/v1/secrets/TOKEN"):
            return httpx.Response(204)
        if route == ("DELETE", "/v1/secrets/NOPE"):
            return httpx.Response(404, json={"code": "not_found", "message": "secret NOPE"})
        return httpx.Response(500, json={"code": "unexpected", "message": str(route)})

    return handle


def _sync_transport(seen: list[httpx.Request]) -> Transport:
    transport = Transport(CONFIG)
    transport.client.close()
    transport.client = httpx.Client(
        **{**p.client_options(CONFIG), "transport": httpx.MockTransport(_router(seen))}
    )
    return transport


def test_sync_sandbox_network_methods() -> None:
    seen: list[httpx.Request] = []
    transport = _sync_transport(seen)
    info = transport.call(p.create_sandbox(None, 60, None, None, None, False))
    sbx = Sandbox(info.sandbox_id, transport, info)
    assert sbx.access_token == "tok-secret-123"
    assert sbx.get_host(5000) == "5000-sbx1.localhost:8000"
    assert sbx.get_url(5000, expires_in=30) == "http://u/"
    updated = sbx.update_network(allow_out=["pypi.org"], allow_public_traffic=False)
    assert json.loads(seen[-1].content) == {
        "allow_out": ["pypi.org"],
        "allow_public_traffic": False,
    }
    assert updated.network == NetworkInfo(allow_out=["pypi.org"])
    sbx.close()


def test_sync_secrets() -> None:
    seen: list[httpx.Request] = []
    secrets = Secrets(api_key="k", api_url=CONFIG.api_url)
    secrets.close()
    secrets._transport = _sync_transport(seen)
    with secrets:
        assert secrets.set("TOKEN", "v", ["h"]).hosts == ["h"]
        secrets.remove("TOKEN")
        with pytest.raises(AgentboxError) as e:
            secrets.remove("NOPE")
    assert e.value.status == 404
    assert seen[0].headers["X-API-Key"] == "k"


def test_async_sandbox_network_methods() -> None:
    async def main() -> None:
        seen: list[httpx.Request] = []
        transport = AsyncTransport(CONFIG)
        await transport.client.aclose()
        transport.client = httpx.AsyncClient(
            **{**p.client_options(CONFIG), "transport": httpx.MockTransport(_router(seen))}
        )
        info = await transport.call(p.get_sandbox("sbx1"))
        sbx = AsyncSandbox(info.sandbox_id, transport, info)
        assert sbx.get_host(80) == "80-sbx1.localhost:8000"
        assert sbx.access_token == "tok-secret-123"
        assert await sbx.get_url(80, routing="host") == "http://u/"
        assert json.loads(seen[-1].content)["routing"] == "host"
        updated = await sbx.update_network({"deny_out": ["x"]}, allow_internet_access=True)
        assert updated.network == NetworkInfo(deny_out=["x"], allow_internet_access=True)
        await sbx.close()

    asyncio.run(main())


def test_tls_context_verifies_https_and_trusts_nothing_for_plain_http() -> None:
    """A client of an http:// server does not load the CA bundle, and its context fails closed:
    certificates and host names are required, and no authority is trusted."""
    import ssl

    for url in ("http://127.0.0.1:8000", "HTTP://localhost"):
        ctx = p.tls_context(url)
        assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname, url
        assert ctx.cert_store_stats()["x509_ca"] == 0, url
    for url in ("https://sandbox.example", "wss://sandbox.example"):
        ctx = p.tls_context(url)
        assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname, url
        assert ctx.cert_store_stats()["x509_ca"] > 0, url
    assert p.client_options(p.ClientConfig("https://a.example", "k", 5))["verify"] is (
        p.tls_context("https://b.example")
    )
