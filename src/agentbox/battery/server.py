"""`python -m agentbox.battery.server`: an agentbox server on a deliberately weakened runtime.

For the battery's positive controls only. This entry point exists so that weakenings never
appear among the product's own CLI options or API fields.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from agentbox import runtimes
from agentbox.core.logs import LogLimits
from agentbox.core.network import NetworkSettings
from agentbox.runtimes.base import Runtime
from agentbox.runtimes.oci.weaken import WEAKENED_TIERS
from agentbox.runtimes.process.weaken import WEAKENINGS, WeakenedProcessRuntime
from agentbox.server.app import serve
from agentbox.server.gateway import RelayLimits
from agentbox.server.limits import ServerLimits

# Weakenings of the server's egress proxy rather than of the runtime.
EGRESS_WEAKENINGS: dict[str, str] = {
    "egress-open": "the egress proxy skips its address guard (internal addresses, loopback and "
    "metadata names) and its SNI and Host checks; the policy still decides on names",
    "secrets-loose": "the egress proxy puts a secret's value into any header of a request to a "
    "bound host, over plain HTTP too, and neither scrubs nor refuses what comes back",
}


# Weakenings of the server's own budgets (what an HTTP client or a sandbox's server may make it
# spend) rather than of the runtime.
SERVER_WEAKENINGS: dict[str, str] = {
    "server-unguarded": "the API reads request bodies before checking the key, caps no body, "
    "times out no slow headers and budgets no connections",
    "gateway-unbounded": "the port gateway relays the ASGI way only, without yielding to the "
    "event loop, without idle or write timeouts, caps or ping rationing, passes a sandbox's "
    "Set-Cookie untouched, WebSocket clients get no keepalive pings, and repeated log lines "
    "are not counted",
    "gateway-splice": "the port gateway's fast path relays a sandbox's answers as a naive "
    "splice would: bytes as they come, the head unchecked, what follows the answer passed on",
    "budgets-open": "the egress proxy caps no sandbox's or tenant's connections, and every "
    "refused egress attempt is written to the egress log one by one",
    "e2b-envd-open": "E2B's sandbox traffic (envd) takes any token as the sandbox's envd token, "
    "and any signature as a signed file URL's",
    "mcp-sessions-open": "an MCP session over HTTP (/mcp) answers any tenant's key, not only "
    "its own tenant's",
    "host-files-follow": "the files APIs the server serves on the host (volumes, kept "
    "workspaces) follow the symlinks a sandbox left there",
    "quota-open": "tenants get the quota they had before every resource was capped: no cap on "
    "nofile, file size or /tmp, no descriptor budget (pids × nofile) per sandbox or tenant, no "
    "total disk",
}

# The default tenant quota values `quota-open` puts back (the server's own hard limits stay).
OPEN_QUOTA = {
    "max_nofile": 1 << 20,
    "max_file_size_mb": 1 << 30,
    "max_tmp_mb": 1 << 20,
    "max_descriptors": 1 << 42,
    "max_total_descriptors": 1 << 62,
    "max_total_disk_mb": 1 << 40,
}


def weakened_limits(flags: set[str], relay_write_timeout: float = 30.0) -> ServerLimits:
    limits = ServerLimits(relay=RelayLimits(write_timeout=relay_write_timeout))
    forever = 10.0**9
    if "server-unguarded" in flags:
        limits = dataclasses.replace(
            limits,
            json_body=2**40,
            template_body=2**40,
            header_timeout=forever,
            body_idle_timeout=forever,
            max_connections=2**20,
            anonymous_share=1.0,
            key_first=False,
        )
    if "gateway-unbounded" in flags:
        relay = RelayLimits(
            idle_timeout=forever,
            write_timeout=forever,
            per_sandbox=2**20,
            per_tenant=2**20,
            ws_ping_burst=2**30,
            ws_pings_per_second=forever,
            ws_write_buffer=2**40,
            fair=False,
            confine_cookies=False,
            # The fast path parses a bounded share of an answer a turn whatever `fair` says:
            # the control relays the ASGI way only, which `fair=False` does starve the loop.
            fast_path=False,
        )
        limits = dataclasses.replace(limits, relay=relay, log_repeats=0, ws_ping_interval=None)
    if "gateway-splice" in flags:
        relay = dataclasses.replace(limits.relay, check_answers=False)
        limits = dataclasses.replace(limits, relay=relay)
    if "budgets-open" in flags:
        limits = dataclasses.replace(limits, logs=LogLimits(refused_sampled=2**40))
    if "quota-open" in flags:
        limits = dataclasses.replace(limits, tenant_quota=OPEN_QUOTA)
    if "host-files-follow" in flags:
        limits = dataclasses.replace(limits, host_files_nofollow=False)
    if "e2b-envd-open" in flags:
        limits = dataclasses.replace(limits, e2b_envd_tokens=False)
    if "mcp-sessions-open" in flags:
        limits = dataclasses.replace(limits, mcp=dataclasses.replace(limits.mcp, owner_check=False))
    return limits


def weakened_network(flags: set[str], **settings: Any) -> NetworkSettings:
    if "budgets-open" in flags:
        settings.update(egress_conns_per_sandbox=2**20, egress_conns_per_tenant=2**20)
    return NetworkSettings(egress_weaken=frozenset(flags & EGRESS_WEAKENINGS.keys()), **settings)


def control_tier(tier: str, flags: Iterable[str]) -> tuple[str, str]:
    """The tier a positive control with `flags` runs on, and why if not `tier`: a tier is
    weakened only in the ways it can be built (runtimes/oci/weaken.py); a control that needs
    another runs on the process tier (its probe is the same; what it proves is that the probe
    sees the break)."""
    wanted = set(flags) & WEAKENINGS.keys()
    if tier == "process" or not wanted:
        return tier, ""
    cls = WEAKENED_TIERS.get(tier)
    missing = wanted - (cls.WEAKENABLE if cls is not None else frozenset())
    if not missing:
        return tier, ""
    return "process", f"the {tier} tier cannot be weakened with {', '.join(sorted(missing))}"


def weakened_runtime(
    names: str, flags: set[str], bind_host: list[str], host_paths: Sequence[str] = ()
) -> tuple[str, dict[str, Any] | None]:
    """The runtimes to serve and the default one's config: with runtime weakenings, the
    weakened version of the first (registered here, in code, so no installation ever offers
    it) in its place. `host_paths`: as `agentbox serve --host-path`."""
    weaken = sorted(flags & WEAKENINGS.keys())
    shown = {"host_paths": list(host_paths)} if host_paths else {}
    if not weaken and not bind_host:
        return names, shown or None
    first, *rest = names.split(",")
    weakened: dict[str, type[Runtime]] = {"process": WeakenedProcessRuntime, **WEAKENED_TIERS}
    if first not in weakened:
        raise ValueError(f"no weakened version of the {first!r} runtime")
    _, why = control_tier(first, [*weaken, *(["bind-host"] if bind_host else [])])
    if why:
        raise ValueError(why)
    cls = weakened[first]
    if cls.name not in runtimes.available():
        runtimes.register(cls.name, cls)
    return ",".join([cls.name, *rest]), {"weaken": weaken, "bind_host": bind_host, **shown}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runtime", default="process")
    p.add_argument("--weaken", default="", help="comma-separated weakenings")
    p.add_argument("--bind-host", action="append", default=[])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--egress-allow-cidr", action="append", default=[])
    p.add_argument("--egress-resolve", action="append", default=[])
    p.add_argument("--host-path", action="append", default=[])
    p.add_argument("--template-dir", type=Path, default=None)
    p.add_argument("--default-template", default="host")
    p.add_argument("--relay-write-timeout", type=float, default=30.0)
    a = p.parse_args()
    flags = {w for w in a.weaken.split(",") if w}
    unknown = flags - WEAKENINGS.keys() - EGRESS_WEAKENINGS.keys() - SERVER_WEAKENINGS.keys()
    if unknown:
        p.error(f"unknown weakening(s): {', '.join(sorted(unknown))}")
    try:
        runtime, config = weakened_runtime(a.runtime, flags, a.bind_host, a.host_path)
    except ValueError as e:
        p.error(str(e))
    network = weakened_network(
        flags,
        egress_allow_cidrs=tuple(a.egress_allow_cidr),
        egress_resolve=tuple(a.egress_resolve),
    )
    limits = weakened_limits(flags, a.relay_write_timeout)
    serve(
        a.host,
        a.port,
        a.data_dir,
        runtime,
        config,
        template_dir=a.template_dir,
        network=network,
        limits=limits,
        default_template=a.default_template,
        # The start-up check of every template is the shipped server's: a weakened one skips
        # it (a sandbox it started and, weakened so, could not end would outlive the run).
        check_templates=False,
    )


if __name__ == "__main__":
    main()
