"""The escape battery, run as CI runs it: every check BLOCKED on the shipped configuration, every
positive control BROKEN, at least 40 checks (issue 3). The run writes its scorecard to a temp
dir; the committed SECURITY-SCORECARD.md comes from the documented full command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentbox.runtimes.process.weaken import WEAKENINGS, Weakening

pytestmark = pytest.mark.security


@pytest.mark.timeout(1500)
@pytest.mark.skipif(os.geteuid() != 0, reason="the battery needs root")
def test_escape_battery(tmp_path: Path) -> None:
    md, js = tmp_path / "scorecard.md", tmp_path / "scorecard.json"
    proc = subprocess.run(
        [sys.executable, "-m", "agentbox.battery", "--markdown", str(md), "--json", str(js)],
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
    } <= groups
    assert f"**{len(checks)} checks**" in md.read_text()


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
