"""The battery's own network namespace: the host network as a sandbox would find it, faked.

The battery re-executes itself in a fresh network namespace and gives it the addresses an
attacker goes for: host loopback, a cloud metadata address (IPv4 and IPv6), Alibaba's metadata
address, a gateway and node IP on a dummy link, and the host's DNS resolver addresses. The
server and every sandbox it starts live here, so a sandbox that shares the server's network
(the positive control) reaches the oracle's listeners, and the real host network is never
touched.
"""

from __future__ import annotations

import os
import subprocess
import sys

ENV_FLAG = "AGENTBOX_BATTERY_NETNS"
METADATA_V4 = ("169.254.169.254", "100.100.100.200")
METADATA_V6 = ("fd00:ec2::254",)
GATEWAYS = ("10.254.0.1", "10.0.2.2", "172.17.0.1")
# Two listeners for the egress proxy checks: a destination the battery server lets the proxy
# reach (`--egress-allow-cidr` for exactly these addresses) under a name policies may allow, and
# one under a name they must not. Only the name policy stands between a sandbox and the second.
EGRESS_ALLOWED = ("allowed.abx.test", "10.254.0.80")
EGRESS_FORBIDDEN = ("forbidden.abx.test", "10.254.0.81")

# Static answers of the egress proxy's resolver (`--egress-resolve`): the two listeners above,
# and names that answer with internal addresses, as a rebinding DNS server would.
EGRESS_RESOLVE = {
    EGRESS_ALLOWED[0]: EGRESS_ALLOWED[1],
    EGRESS_FORBIDDEN[0]: EGRESS_FORBIDDEN[1],
    "rebind-loopback.abx.test": "127.0.0.1",
    "rebind-loopback6.abx.test": "::1",
    "rebind-mapped.abx.test": "::ffff:127.0.0.1",
    "rebind-metadata.abx.test": "169.254.169.254",
    "rebind-gateway.abx.test": GATEWAYS[0],
}


RELAY_WRITE_TIMEOUT = 5.0


def server_options() -> list[str]:
    """The operator options every battery server runs with (`agentbox serve ...`)."""
    out = []
    for _, a in (EGRESS_ALLOWED, EGRESS_FORBIDDEN):
        out += ["--egress-allow-cidr", f"{a}/32"]
    for name, a in EGRESS_RESOLVE.items():
        out += ["--egress-resolve", f"{name}={a}"]
    # A relay to a peer that stopped reading ends after this (shipped: 30 s); shorter here so
    # that gw-deaf-peer, on every tier and its control, waits seconds rather than a minute.
    return [*out, "--relay-write-timeout", f"{RELAY_WRITE_TIMEOUT:g}"]


def inside() -> bool:
    return os.environ.get(ENV_FLAG) == "1"


def reexec(argv: list[str]) -> int:
    """Run `python -m agentbox.battery ARGV` again inside new network and IPC namespaces."""
    env = dict(os.environ, **{ENV_FLAG: "1", "AGENTBOX_BATTERY_NODE_IP": _node_ip()})
    # A private IPC namespace too: positive controls that share IPC leave SysV objects behind.
    cmd = ["unshare", "--net", "--ipc", "--", sys.executable, "-m", "agentbox.battery", *argv]
    return subprocess.run(cmd, env=env).returncode


def _node_ip() -> str:
    out = subprocess.run(["ip", "-4", "route", "get", "1.1.1.1"], capture_output=True, text=True)
    words = out.stdout.split()
    return words[words.index("src") + 1] if "src" in words else ""


def resolvers() -> list[str]:
    try:
        with open("/etc/resolv.conf") as f:
            words = [ln.split() for ln in f]
        return [w[1] for w in words if len(w) > 1 and w[0] == "nameserver"]
    except OSError:
        return []


def _ip(*args: str) -> bool:
    return subprocess.run(["ip", *args], capture_output=True).returncode == 0


def setup() -> dict[str, list[str]]:
    """Bring up the fake host network; returns the addresses by role."""
    _ip("link", "set", "lo", "up")
    node = os.environ.get("AGENTBOX_BATTERY_NODE_IP", "")
    link = "abx-gw0" if _ip("link", "add", "abx-gw0", "type", "dummy") else "lo"
    _ip("link", "set", link, "up")
    roles: dict[str, list[str]] = {
        "metadata": [],
        "gateway": [],
        "resolver": [],
        "node": [],
        "egress-allowed": [],
        "egress-forbidden": [],
    }
    for a in METADATA_V4:
        if _ip("addr", "add", f"{a}/32", "dev", "lo"):
            roles["metadata"].append(a)
    for a in METADATA_V6:
        if _ip("-6", "addr", "add", f"{a}/128", "dev", "lo"):
            roles["metadata"].append(a)
    for a in GATEWAYS:
        if _ip("addr", "add", f"{a}/32", "dev", link):
            roles["gateway"].append(a)
    for role, (_, a) in (
        ("egress-allowed", EGRESS_ALLOWED),
        ("egress-forbidden", EGRESS_FORBIDDEN),
    ):
        if _ip("addr", "add", f"{a}/32", "dev", link):
            roles[role].append(a)
    if node and _ip("addr", "add", f"{node}/32", "dev", link):
        roles["node"].append(node)
    for a in resolvers():
        if a.startswith("127."):
            roles["resolver"].append(a)
        elif ":" in a:
            if _ip("-6", "addr", "add", f"{a}/128", "dev", "lo"):
                roles["resolver"].append(a)
        elif _ip("addr", "add", f"{a}/32", "dev", link) or a in roles["gateway"]:
            roles["resolver"].append(a)
    return roles
