"""Network settings of sandboxes and tenants, tenants' secrets, and the egress proxy's wiring.

The manager asks this room three things: what policy a new sandbox gets (its request, else the
tenant's default, always inside the tenant's ceiling), what goes into the sandbox for egress
(proxy variables, secret placeholders, the CA bundle), and to start or stop serving it. Secret
values are encrypted at rest with a key in the data dir and never leave this process except
towards the hosts they are bound to.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import re
import secrets as tokens
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.fernet import Fernet, InvalidToken

from agentbox.core.errors import Forbidden, InvalidRequest, NotFound
from agentbox.core.logs import LogLimits, RefusalSampler
from agentbox.egress.addresses import AddressGuard, parse_resolve_option
from agentbox.egress.policy import EgressPolicy, Rule, RuleError, check_within, parse_rule
from agentbox.egress.proxy import HTTP_PORT, SOCKS_PORT, EgressProxy
from agentbox.egress.secrets import (
    DEFAULT_HEADERS,
    MIN_VALUE_BYTES,
    PLACEHOLDER_PREFIX,
    BoundSecret,
    parse_header_names,
)
from agentbox.egress.tls import EgressCA, read_ca_file, trust_bundle
from agentbox.store.db import Store

log = logging.getLogger(__name__)

SECRET_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
MAX_SECRET_BYTES = 64 * 1024
CA_BUNDLE_PATH = "/run/agentbox/ca-bundle.pem"
SYSTEM_BUNDLE_PATH = "/etc/ssl/certs/ca-certificates.crt"
_FLUSH_S = 0.5

PROXY_ENV = {
    "HTTP_PROXY": f"http://127.0.0.1:{HTTP_PORT}",
    "HTTPS_PROXY": f"http://127.0.0.1:{HTTP_PORT}",
    "ALL_PROXY": f"socks5h://127.0.0.1:{SOCKS_PORT}",
    "NO_PROXY": "localhost,127.0.0.1,::1",
    "npm_config_proxy": f"http://127.0.0.1:{HTTP_PORT}",
    "npm_config_https_proxy": f"http://127.0.0.1:{HTTP_PORT}",
    "AGENTBOX_EGRESS_PROXY": f"http://127.0.0.1:{HTTP_PORT}",
}
for _k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
    PROXY_ENV[_k.lower()] = PROXY_ENV[_k]
# Every place common clients look for their trust store.
CA_ENV_NAMES = (
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "PIP_CERT",
    "GIT_SSL_CAINFO",
    "npm_config_cafile",
)


@dataclass(frozen=True)
class NetworkSettings:
    """The operator's network settings (`agentbox serve --egress-* --ports-*`)."""

    egress_allow_cidrs: tuple[str, ...] = ()
    egress_resolve: tuple[str, ...] = ()  # HOST=IP
    egress_deny: tuple[str, ...] = ()
    egress_upstream_ca: tuple[str, ...] = ()
    # CA files sandboxes trust besides the system's (a TLS-inspecting proxy on the way out).
    sandbox_ca: tuple[str, ...] = ()
    # Exposed ports are host-routed as {port}-{sandbox_id}.{ports_domain}; public_url is the
    # server's address as clients see it (for signed URLs).
    ports_domain: str = "localhost"
    public_url: str = ""  # "" = http://localhost:{port} of `agentbox serve`
    # Egress connections (HTTP proxy and SOCKS) open at once per sandbox and per tenant; each
    # holds two of the server's descriptors (the sandbox's side and the upstream's).
    egress_conns_per_sandbox: int = 64
    egress_conns_per_tenant: int = 256
    # Security-battery positive controls only (see EgressProxy); never set by the CLI.
    egress_weaken: frozenset[str] = frozenset()

    def parsed(self) -> tuple[AddressGuard, list[Rule], dict[str, str]]:
        """The guard, operator deny rules and static answers; ValueError names a bad one."""
        try:
            guard = AddressGuard(self.egress_allow_cidrs)
            deny = [parse_rule(r) for r in self.egress_deny]
            static = {h: str(ip) for h, ip in map(parse_resolve_option, self.egress_resolve)}
        except ValueError as e:
            raise ValueError(f"egress settings: {e}") from None
        for ca in self.egress_upstream_ca:
            if not Path(ca).is_file():
                raise ValueError(f"egress settings: CA file {ca} does not exist")
        self.sandbox_ca_pem()
        return guard, deny, static

    def sandbox_ca_pem(self) -> bytes:
        """The certificates of the `sandbox_ca` files; ValueError names a bad file."""
        return b"".join(read_ca_file(Path(p)) for p in self.sandbox_ca)


@dataclass(frozen=True)
class SandboxNetwork:
    """What a sandbox runs with: its egress policy and whether its ports are public."""

    policy: EgressPolicy
    public_ports: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {**self.policy.to_dict(), "allow_public_traffic": self.public_ports}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SandboxNetwork:
        d = dict(d or {})
        public = bool(d.pop("allow_public_traffic", False))
        return cls(EgressPolicy.from_dict(d), public)


@dataclass
class SandboxEgressSetup:
    """What goes into a new sandbox for egress."""

    envs: dict[str, str]
    files: dict[str, bytes]
    placeholders: dict[str, str]  # secret name -> placeholder
    ca: EgressCA | None


def _policy(d: dict[str, Any] | None, what: str) -> EgressPolicy:
    try:
        return EgressPolicy.from_dict(d or {})
    except RuleError as e:
        raise InvalidRequest(f"{what}: {e}") from None


def _network(d: dict[str, Any] | None, what: str) -> SandboxNetwork:
    try:
        return SandboxNetwork.from_dict(d)
    except RuleError as e:
        raise InvalidRequest(f"{what}: {e}") from None


class NetworkService:
    def __init__(
        self,
        store: Store,
        data_dir: Path,
        settings: NetworkSettings,
        logs: LogLimits | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.workdir = data_dir / "egress"
        self.workdir.mkdir(mode=0o700, exist_ok=True)
        guard, deny, static = settings.parsed()
        self.sandbox_ca_pem = settings.sandbox_ca_pem()
        self.proxy = EgressProxy(
            guard=guard,
            operator_deny=deny,
            static_hosts=static,
            # The sandboxes' extra CAs vouch for upstreams the proxy inspects too.
            upstream_ca_files=[
                Path(p) for p in (*settings.egress_upstream_ca, *settings.sandbox_ca)
            ],
            ceiling=self.ceiling,
            secret=self.bound_secret,
            record=self._record,
            weaken=settings.egress_weaken,
            conns_per_sandbox=settings.egress_conns_per_sandbox,
            conns_per_tenant=settings.egress_conns_per_tenant,
        )
        self._master = self._key(data_dir / "secrets.key")
        self._fernet = Fernet(self._master)
        self._secrets: dict[tuple[str, str], BoundSecret | None] = {}
        # Tenant settings are read on every create and egress decision; this process is their
        # only writer (embedded mode), so the caches are dropped on every change.
        self._tenant_settings: dict[str, dict[str, Any]] = {}
        self._ceilings: dict[str, EgressPolicy | None] = {}
        self._pending: list[dict[str, Any]] = []
        self._flusher: asyncio.Task[None] | None = None
        # A sandbox decides how often it is refused: past a few per window, only counted.
        self._sampler = RefusalSampler(logs or LogLimits())

    @staticmethod
    def _key(path: Path) -> bytes:
        try:
            return path.read_bytes().strip()
        except FileNotFoundError:
            key = Fernet.generate_key()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key)
            return key

    def derived_key(self, purpose: str) -> bytes:
        """A key for `purpose` (an HMAC of it under the server's secrets key, which never
        leaves the data dir): each use of the secret gets its own."""
        return hmac.new(self._master, f"agentbox:{purpose}".encode(), hashlib.sha256).digest()

    async def close(self) -> None:
        await self.proxy.close()
        if self._flusher is not None:
            self._flusher.cancel()
        self.flush()

    # ------------------------------------------------------------------ tenant settings

    def _stored(self, tenant: str) -> dict[str, Any]:
        if tenant not in self._tenant_settings:
            self._tenant_settings[tenant] = self.store.get_tenant_network(tenant)
        return self._tenant_settings[tenant]

    def _save(self, tenant: str, key: str, value: dict[str, Any] | None) -> dict[str, Any]:
        self.store.set_tenant_network(tenant, {**self._stored(tenant), key: value})
        self._tenant_settings.pop(tenant, None)
        self._ceilings.pop(tenant, None)
        return self.tenant_network(tenant)

    def tenant_network(self, tenant: str) -> dict[str, Any]:
        stored = self._stored(tenant)
        return {"default": stored.get("default"), "ceiling": stored.get("ceiling")}

    def ceiling(self, tenant: str) -> EgressPolicy | None:
        if tenant not in self._ceilings:
            raw = self._stored(tenant).get("ceiling")
            self._ceilings[tenant] = EgressPolicy.from_dict(raw) if raw is not None else None
        return self._ceilings[tenant]

    def _check_ceiling(self, tenant: str, policy: EgressPolicy) -> None:
        ceiling = self.ceiling(tenant)
        if ceiling is None:
            return
        try:
            check_within(policy, ceiling)
        except RuleError as e:
            raise Forbidden(
                f"the network policy is outside tenant {tenant}'s ceiling: {e}; an admin can "
                f"widen it with PUT /v1/tenants/{tenant}/network"
            ) from None

    def set_tenant_ceiling(self, tenant: str, ceiling: dict[str, Any] | None) -> dict[str, Any]:
        parsed = _policy(ceiling, "ceiling") if ceiling is not None else None
        return self._save(tenant, "ceiling", parsed.to_dict() if parsed is not None else None)

    def set_tenant_default(self, tenant: str, default: dict[str, Any] | None) -> dict[str, Any]:
        net = _network(default, "default") if default is not None else None
        if net is not None:
            self._check_ceiling(tenant, net.policy)
        return self._save(tenant, "default", net.to_dict() if net is not None else None)

    def sandbox_network(self, tenant: str, requested: dict[str, Any] | None) -> SandboxNetwork:
        """The network a new sandbox gets: what it asked for, else the tenant's default."""
        if requested is None:
            requested = self._stored(tenant).get("default")
        net = _network(requested, "network")
        self._check_ceiling(tenant, net.policy)
        return net

    # ------------------------------------------------------------------ secrets

    def set_secret(
        self,
        tenant: str,
        name: str,
        value: str,
        hosts: list[str],
        in_url: bool = False,
        headers: list[str] | None = None,
        allow_plaintext: bool = False,
    ) -> dict[str, Any]:
        """Create or replace a secret. Its value goes only to `hosts`, only in `headers`
        (default Authorization) and the URL if `in_url`, and only over TLS the proxy verified
        unless `allow_plaintext`."""
        if not SECRET_NAME.match(name):
            raise InvalidRequest(
                f"secret name {name!r} must be an environment variable name "
                "(letters, digits, _; at most 64)"
            )
        size = len(value.encode())
        if not MIN_VALUE_BYTES <= size <= MAX_SECRET_BYTES or "\0" in value:
            raise InvalidRequest(
                f"secret value must be {MIN_VALUE_BYTES} bytes to {MAX_SECRET_BYTES} bytes, no "
                "NUL (shorter values cannot be kept out of responses without mangling them)"
            )
        if any(c in value for c in "\r\n"):
            raise InvalidRequest("secret value must not contain line breaks (it goes in headers)")
        if not hosts:
            raise InvalidRequest("a secret needs at least one host it may be sent to")
        try:
            rules = [parse_rule(h) for h in hosts]
        except RuleError as e:
            raise InvalidRequest(f"hosts: {e}") from None
        if any(r.kind == "cidr" for r in rules):
            raise InvalidRequest("hosts: bind secrets to host names, not addresses")
        try:
            names = list(parse_header_names(headers))
        except ValueError as e:
            raise InvalidRequest(f"headers: {e}") from None
        token = self._fernet.encrypt(value.encode()).decode()
        self.store.put_secret(
            tenant, name, token, [r.text for r in rules], in_url, names, allow_plaintext
        )
        self._secrets.pop((tenant, name), None)
        return self._info(self.store.get_secret(tenant, name) or {})

    @staticmethod
    def _info(row: dict[str, Any]) -> dict[str, Any]:
        return {
            "name": row.get("name"),
            "hosts": row.get("hosts"),
            "headers": row.get("headers") or list(DEFAULT_HEADERS),
            "in_url": row.get("in_url"),
            "allow_plaintext": bool(row.get("allow_plaintext")),
            "created_at": row.get("created_at"),
            "updated_at": row.get("updated_at"),
        }

    def list_secrets(self, tenant: str) -> list[dict[str, Any]]:
        return [self._info(r) for r in self.store.list_secrets(tenant)]

    def remove_secret(self, tenant: str, name: str) -> None:
        if not self.store.delete_secret(tenant, name):
            raise NotFound(f"secret {name} not found")
        self._secrets.pop((tenant, name), None)

    def bound_secret(self, tenant: str, name: str) -> BoundSecret | None:
        key = (tenant, name)
        if key not in self._secrets:
            row = self.store.get_secret(tenant, name)
            found = None
            if row is not None:
                try:
                    value = self._fernet.decrypt(row["value"].encode()).decode()
                    rules = tuple(parse_rule(h) for h in row["hosts"])
                    found = BoundSecret(
                        name,
                        value,
                        rules,
                        in_url=bool(row["in_url"]),
                        # Rows written before bindings had headers: the default binding.
                        headers=parse_header_names(row.get("headers")),
                        allow_plaintext=bool(row.get("allow_plaintext")),
                    )
                except (InvalidToken, RuleError, ValueError):
                    log.error("secret %s of tenant %s cannot be read", name, tenant)
            self._secrets[key] = found
        return self._secrets[key]

    # ------------------------------------------------------------------ sandboxes

    def setup(
        self, tenant: str, sandbox_id: str, secret_names: list[str], rootfs: str | None
    ) -> SandboxEgressSetup:
        """Proxy variables for every sandbox; placeholders and a trusted CA for secrets; the
        operator's extra CAs (`--sandbox-ca`) in the trust store of every sandbox."""
        envs = dict(PROXY_ENV)
        if not secret_names and not self.sandbox_ca_pem:
            return SandboxEgressSetup(envs, {}, {}, None)
        if len(set(secret_names)) != len(secret_names):
            raise InvalidRequest("secrets: a name is listed twice")
        placeholders = {}
        for name in secret_names:
            if self.store.get_secret(tenant, name) is None:
                raise NotFound(
                    f"secret {name} not found; create it with `agentbox secrets set {name} "
                    "VALUE --hosts HOST`"
                )
            placeholders[name] = PLACEHOLDER_PREFIX + tokens.token_hex(16)
        ca = EgressCA.generate(sandbox_id, self.workdir / sandbox_id) if secret_names else None
        system = Path(rootfs or "/", SYSTEM_BUNDLE_PATH.lstrip("/"))
        extra = self.sandbox_ca_pem + (ca.cert_pem if ca is not None else b"")
        bundle = trust_bundle(extra, system if system.is_file() else None)
        files = {CA_BUNDLE_PATH: bundle}
        if system.is_file() and not system.is_symlink():
            files[SYSTEM_BUNDLE_PATH] = bundle  # the distribution's own trust store too
        envs.update(placeholders)
        envs.update({name: CA_BUNDLE_PATH for name in CA_ENV_NAMES})
        return SandboxEgressSetup(envs, files, placeholders, ca)

    def restore(self, sandbox_id: str, placeholders: dict[str, str]) -> SandboxEgressSetup:
        """The egress setup of a sandbox found running after a restart (its CA from disk)."""
        ca = None
        if placeholders:
            try:
                ca = EgressCA.load(self.workdir / sandbox_id)
            except (OSError, ValueError) as e:
                log.warning(
                    "sandbox %s: its egress CA is gone (%s): secrets stay placeholders",
                    sandbox_id,
                    e,
                )
        return SandboxEgressSetup({}, {}, dict(placeholders), ca)

    async def forget(self, sandbox_id: str) -> None:
        """Stop serving a sandbox's egress and drop its CA."""
        await self.proxy.detach(sandbox_id)
        self._sampler.forget(sandbox_id)
        shutil.rmtree(self.workdir / sandbox_id, ignore_errors=True)

    # ------------------------------------------------------------------ egress log

    def _record(self, event: dict[str, Any]) -> None:
        if self._sampler.admit(event):
            self._pending.append(event)
        if self._flusher is None or self._flusher.done():
            try:
                self._flusher = asyncio.get_running_loop().create_task(self._flush_later())
            except RuntimeError:
                self.flush()

    async def _flush_later(self) -> None:
        await asyncio.sleep(_FLUSH_S)
        self.flush()

    def flush(self) -> None:
        """Write the recorded egress events (batched: one transaction per half second) and the
        counts of the refusals that were only counted."""
        events, self._pending = self._pending, []
        try:
            self.store.add_egress_events(events)
            for tally in self._sampler.changed():
                tally.row["suppressed"] = tally.count
                tally.row_id = self.store.put_egress_summary(tally.row_id, tally.row)
                tally.written = tally.count
        except Exception:  # noqa: BLE001 - the log must never break egress
            log.exception("could not write %d egress events", len(events))

    def egress_events(
        self,
        tenant: str | None,
        sandbox_id: str | None,
        host: str | None,
        allowed: bool | None,
        since: float | None,
        limit: int,
    ) -> list[dict[str, Any]]:
        self.flush()
        return self.store.list_egress(tenant, sandbox_id, host, allowed, since, limit)


def new_access_token() -> str:
    return tokens.token_urlsafe(24)
