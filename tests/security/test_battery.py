"""The escape battery, run as CI runs it: every check BLOCKED on the shipped configuration, every
positive control BROKEN, at least 40 checks (issue 3). The run writes its scorecard to a temp
dir; the committed SECURITY-SCORECARD.md comes from the documented full command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import seed_template_store

from agentbox.battery.checks import CHECKS
from agentbox.battery.server import EGRESS_WEAKENINGS, SERVER_WEAKENINGS
from agentbox.runtimes.process.weaken import WEAKENINGS, Weakening

pytestmark = pytest.mark.security


@pytest.mark.timeout(1500)
@pytest.mark.skipif(os.geteuid() != 0, reason="the battery needs root")
def test_escape_battery(tmp_path: Path) -> None:
    md, js = tmp_path / "scorecard.md", tmp_path / "scorecard.json"
    templates = tmp_path / "templates"
    seed_template_store(templates)
    proc = subprocess.run(
        [
            sys.executable, "-m", "agentbox.battery", "--markdown", str(md), "--json", str(js),
            # The battery's template shares its Debian base with the test run's templates,
            # in a store of its own (the shared one's index stays the test run's).
            "--template-dir", str(templates),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert js.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    card = json.loads(js.read_text())
    checks = card["checks"]
    report = "\n".join(
        f"{c['id']}: default {c['default']['status']} {c['default']['evidence'][:200]} | "
        f"control {c['control']['status']} {c['control']['evidence'][:200]}"
        for c in checks
        if c["default"]["status"] not in ("BLOCKED", "N/A") or c["control"]["status"] != "BROKEN"
    )
    assert len(checks) >= 40
    assert not report, report
    assert proc.returncode == 0, proc.stdout[-3000:]
    groups = {c["group"] for c in checks}
    assert {
        "filesystem",
        "privilege",
        "syscalls",
        "network",
        "cross-sandbox",
        "secrets",
        "persistence",
        "exhaustion",
        "files-api",
        "host-info",
        "control-plane",
    } <= groups
    assert f"**{len(checks)} checks**" in md.read_text()


@pytest.mark.timeout(900)
@pytest.mark.skipif(os.geteuid() != 0, reason="the battery needs root")
@pytest.mark.skipif(shutil.which("runc") is None, reason="runc is not installed")
def test_escape_battery_on_the_container_tier(tmp_path: Path) -> None:
    """Every check BLOCKED (or N/A) on the container tier's shipped configuration. Positive
    controls exist for the process tier only so far (docs/ISOLATION.md)."""
    js = tmp_path / "scorecard.json"
    templates = tmp_path / "templates"
    seed_template_store(templates)
    argv = [sys.executable, "-m", "agentbox.battery", "--runtime", "container", "--no-controls"]
    argv += ["--markdown", str(tmp_path / "scorecard.md"), "--json", str(js)]
    argv += ["--template-dir", str(templates)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert js.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = json.loads(js.read_text())["checks"]
    report = "\n".join(
        f"{c['id']}: {c['default']['status']} {c['default']['evidence'][:300]}"
        for c in checks
        if c["default"]["status"] not in ("BLOCKED", "N/A")
    )
    assert len(checks) >= 40
    assert not report, report
    assert proc.returncode == 0, proc.stdout[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0, reason="the battery needs root")
def test_a_control_without_limits_gets_its_sandbox(tmp_path: Path) -> None:
    """The no-limits control's runtime declares it enforces no limit, so its sandboxes ask for
    none (rather than being refused) and the exhaustion probe breaks out there."""
    js = tmp_path / "scorecard.json"
    argv = [sys.executable, "-m", "agentbox.battery", "--only", "^res-fd-exhaustion$"]
    argv += ["--markdown", str(tmp_path / "scorecard.md"), "--json", str(js)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=280)
    assert js.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    (check,) = json.loads(js.read_text())["checks"]
    assert check["control"]["weakening"] == "no-limits"
    assert check["default"]["status"] == "BLOCKED", check["default"]["evidence"]
    assert check["control"]["status"] == "BROKEN", check["control"]["evidence"]
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_weakenings_are_named_and_validated() -> None:
    assert Weakening.of([]).flags == frozenset()
    with pytest.raises(ValueError, match="unknown weakening"):
        Weakening.of(["no-such-thing"])
    with pytest.raises(ValueError):
        Weakening.of([], bind_host=["relative/path"])
    # Switching off the sandbox switches off what only exists inside it.
    assert {"no-seccomp", "share-net"} <= Weakening.of(["unsandboxed"]).flags
    assert "bind-host" in Weakening.of([], bind_host=["/srv/x"]).flags
    assert set(WEAKENINGS) >= {"share-net", "no-seccomp", "bind-host", "host-root"}


def test_every_control_names_known_weakenings() -> None:
    assert not EGRESS_WEAKENINGS.keys() & WEAKENINGS.keys()
    assert not SERVER_WEAKENINGS.keys() & (WEAKENINGS.keys() | EGRESS_WEAKENINGS.keys())
    known = WEAKENINGS.keys() | EGRESS_WEAKENINGS.keys() | SERVER_WEAKENINGS.keys()
    for c in CHECKS:
        assert c.control, f"{c.id} has no positive control"
        assert c.control <= known, f"{c.id}: unknown weakening(s) {c.control - known}"
    ids = {c.id for c in CHECKS}
    assert {"net-proxy-internal", "net-proxy-bypass", "net-proxy-mismatch"} <= ids
    assert {"secrets-plaintext", "secrets-reflection"} <= ids
    server = {"srv-anonymous-body", "srv-slowloris", "gw-trickle-starvation", "gw-ping-flood"}
    server |= {"gw-cookie-tossing", "gw-deaf-peer"}
    assert server <= ids
    budgets = {"budget-descriptors", "budget-log-amplification"}
    assert budgets <= ids
    assert all(c.control == {"budgets-open"} for c in CHECKS if c.id in budgets)
    host_info = {"info-etc-allowlist", "info-usr-local", "info-proc-machine-wide"}
    host_info |= {"info-proc-own-figures", "info-boot-id", "info-mountinfo"}
    assert host_info <= ids
    assert all(c.control == {"host-info"} for c in CHECKS if c.id in host_info)
    assert {c.id for c in CHECKS if c.control == {"quota-open"}} == {"res-file-table"}


def test_egress_open_switches_off_the_proxy_guards() -> None:
    """The egress-open control reaches the proxy (through NetworkSettings, never the CLI)."""
    import asyncio

    from agentbox.core.network import NetworkSettings
    from agentbox.egress.addresses import AddressGuard
    from agentbox.egress.proxy import EgressProxy, Refused

    async def resolve(weaken: frozenset[str]) -> object:
        proxy = EgressProxy(guard=AddressGuard(), weaken=weaken)
        try:
            return await proxy._resolve("169.254.169.254", 80)
        except Refused as e:
            return e.rule

    assert asyncio.run(resolve(frozenset())) == "address_guard"
    assert asyncio.run(resolve(frozenset({"egress-open"}))) != "address_guard"
    assert NetworkSettings().egress_weaken == frozenset()
    cli = (Path(__file__).parents[2] / "src/agentbox/cli/app.py").read_text()
    assert "weaken" not in cli
