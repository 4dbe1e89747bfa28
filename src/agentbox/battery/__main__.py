"""`python -m agentbox.battery`: attack a runtime, write the security scorecard.

Runs every escape check against the runtime as shipped, then each check again against a
deliberately weakened sandbox (its positive control). Exit status: 0 when every default check is
BLOCKED (or N/A) and every positive control BROKEN; 1 when a default check is BROKEN; 2 when a
check errored or a positive control did not break (the probe proves nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

from agentbox.battery import inventory, netns
from agentbox.battery.checks import CHECKS, Check, Ctx, ProbeFailed, Verdict, build_template
from agentbox.battery.oracle import Oracle
from agentbox.battery.scorecard import Row, render_json, render_markdown
from agentbox.battery.server import control_tier
from agentbox.battery.target import Server


def run_check(c: Check, ctx: Ctx) -> Verdict:
    o = ctx.oracle
    o.host_changes()
    o.take_hits()
    t0 = time.monotonic()
    try:
        v = c.fn(ctx)
    except ProbeFailed as e:
        v = Verdict("ERROR", evidence=str(e)[:400])
    except Exception as e:  # a crashed check is reported, never hidden
        tb = traceback.format_exception(e)[-3:]
        v = Verdict("ERROR", evidence=f"{type(e).__name__}: {e} | {''.join(tb)[-400:]}")
    # Let late packets reach the listeners (a network probe's, or one that left a process
    # behind); other checks' probes have ended when they return.
    time.sleep(0.25 if c.group in ("network", "cross-sandbox", "secrets") else 0.05)
    for h in o.take_hits():
        v.add_break("NET", f"{h.what} {h.detail}"[:160])
    for change in o.host_changes():
        kind, _, what = change.partition(": ")
        v.add_break(kind, what)
    v.evidence = f"{v.evidence} [{time.monotonic() - t0:.1f}s]"
    return v


def profiles(checks: list[Check], controls: bool) -> list[tuple[str, frozenset[str]]]:
    out = [("default", frozenset[str]())]
    if controls:
        seen = sorted({c.control for c in checks}, key=lambda s: sorted(s))
        out += [("+".join(sorted(s)), s) for s in seen]
    return out


def machine() -> dict[str, str]:
    cg = (
        "v2"
        if Path("/sys/fs/cgroup/cgroup.controllers").exists()
        and not Path("/sys/fs/cgroup/memory").is_dir()
        else "v1 (hybrid)"
    )
    return {
        "kernel": platform.release(),
        "arch": platform.machine(),
        "cpus": str(os.cpu_count()),
        "cgroups": cg,
        "python": platform.python_version(),
        "bwrap": shutil.which("bwrap") or "missing",
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m agentbox.battery", description=__doc__)
    p.add_argument("--runtime", default="process", help="a tier, or several: process,gvisor")
    p.add_argument("--markdown", type=Path, default=Path("SECURITY-SCORECARD.md"))
    p.add_argument("--json", type=Path, default=Path("security-scorecard.json"))
    p.add_argument("--only", default="", help="regex on check ids")
    p.add_argument("--no-controls", action="store_true", help="skip the positive controls")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument(
        "--template-dir",
        type=Path,
        default=Path("/var/tmp/agentbox-battery-templates"),
        help="where the battery's own template is built and kept between runs",
    )
    a = p.parse_args(argv)
    if os.geteuid() != 0:
        print("the battery needs root (per-sandbox uids, cgroups, a network namespace)")
        return 2
    checks = [c for c in CHECKS if re.search(a.only, c.id)]
    if not netns.inside():
        if any(c.needs_template for c in checks):
            # Built here, on the host's network: inside the battery's namespace its downloads
            # would reach only the oracle's listeners (and count as a sandbox's traffic).
            print(f"preparing the battery's template in {a.template_dir}", flush=True)
            build_template(a.template_dir)
        return netns.reexec(argv)

    roles = netns.setup()
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="abx-battery-"))
    oracle = Oracle()
    oracle.plant()
    oracle.listen()
    shadow = Path("/etc/shadow")
    if shadow.exists():
        oracle.extra_secrets["/etc/shadow"] = shadow.read_text().splitlines()[0]
    runs: list[TierRun] = []
    # Controls run on the process tier, by profile: a later tier whose control falls back to
    # the process tier takes the verdicts of the same run (the same experiment) from here.
    on_process: dict[str, dict[str, Verdict]] = {}
    try:
        for tier in a.runtime.split(","):
            run = TierRun(tier, checks, [Row(c.id, c.group, c.title, "+".join(sorted(c.control)))
                                         for c in checks])  # fmt: skip
            run.attack(oracle, roles, workdir / tier, a.template_dir, not a.no_controls, on_process)
            runs.append(run)
    finally:
        oracle.remove()
        for data_dir in workdir.glob("*/data-*"):  # every profile's server is stopped
            inventory.sweep_bind_roots(data_dir)
        if a.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    a.markdown.write_text(render_markdown([(r.rows, r.info) for r in runs]))
    a.json.write_text(json.dumps(render_json([(r.rows, r.info) for r in runs]), indent=2))
    statuses = [run.report(a.markdown, controls=not a.no_controls) for run in runs]
    return 1 if 1 in statuses else max(statuses)


# How long the host may take to finish a stopped server's sandboxes' exits before what is
# still there counts as left behind.
SETTLE_S = 10.0

# Weakenings of the API and the port gateway alone: their code is the same whatever the tier,
# so their positive controls run once, on the process tier (the default runs on every tier).
CONTROL_PLANE_ONLY = frozenset(
    {
        "server-unguarded",
        "gateway-unbounded",
        "gateway-splice",
        "host-files-follow",
        "e2b-envd-open",
        "mcp-sessions-open",
    }
)


def control_where(tier: str, c: Check) -> tuple[str, str]:
    """The tier `c`'s positive control runs on when the battery attacks `tier`, and why if not
    that one (control_tier, then what the check itself says)."""
    where = control_tier(tier, c.control)
    if where[0] != tier or tier == "process":
        return where
    if tier in c.control_elsewhere:
        return "process", c.control_elsewhere[tier]
    if c.control <= CONTROL_PLANE_ONLY:
        return "process", "the weakening is the control plane's, the same whatever the tier"
    return where


class TierRun:
    """The battery against one tier: its shipped configuration, then each positive control
    (on the tier, weakened, or where the tier cannot be weakened so, on the process tier)."""

    def __init__(self, tier: str, checks: list[Check], rows: list[Row]) -> None:
        self.tier = tier
        self.checks = checks
        self.rows = rows
        self.info: dict[str, str] = {}
        self.status = 0

    def attack(
        self,
        oracle: Oracle,
        roles: dict[str, list[str]],
        workdir: Path,
        template_dir: Path,
        controls: bool,
        on_process: dict[str, dict[str, Verdict]],
    ) -> None:
        rows = {r.id: r for r in self.rows}
        started = time.monotonic()
        leftovers: list[str] = []
        workdir.mkdir(parents=True, exist_ok=True)
        for name, flags in profiles(self.checks, controls):
            todo = (
                self.checks if name == "default" else [c for c in self.checks if c.control == flags]
            )
            for (tier, why), group in self._by_tier(name, flags, todo).items():
                if tier == "process" and all(c.id in on_process.get(name, {}) for c in group):
                    print(
                        f"== {self.tier} / {name}: {why}: the process tier's verdicts", flush=True
                    )
                    for c in group:
                        v = on_process[name][c.id]
                        if name == "default":
                            rows[c.id].default = Verdict(
                                v.status, list(v.kinds), f"(the process tier's run) {v.evidence}"
                            )
                            continue
                        rows[c.id].control_verdict = v
                        rows[c.id].control_tier, rows[c.id].control_why = "process", why
                    continue
                bind = [str(oracle.canary_dir)] if "bind-host" in flags else []
                options = [*netns.server_options(), *oracle.server_options()]
                options += ["--template-dir", str(template_dir)]
                server = Server(workdir, name, flags, bind, oracle.server_env(), tier, options)
                server.start()
                print(f"== {self.tier} / {name}: {len(group)} checks {why}", flush=True)
                try:
                    for c in group:
                        ctx = Ctx(server, oracle, roles, template_dir)
                        v = run_check(c, ctx)
                        server.kill_boxes()
                        if name == "default":
                            rows[c.id].default = v
                            if tier == "process":
                                on_process.setdefault(name, {})[c.id] = v
                        else:
                            rows[c.id].control_verdict = v
                            if tier != self.tier:
                                rows[c.id].control_tier, rows[c.id].control_why = tier, why
                            if tier == "process":
                                on_process.setdefault(name, {})[c.id] = v
                        mark = v.status + (f"({','.join(v.kinds)})" if v.kinds else "")
                        print(f"  {c.id:32s} {mark:22s} {v.evidence[:110]}", flush=True)
                finally:
                    server.stop()
                if name == "default":
                    # After the shipped configuration's run the host must hold nothing of it.
                    left = inventory.take(server.data_dir)
                    # A sandbox's last processes may still be exiting: a pid namespace's init
                    # (bwrap) waits in the kernel for the rest of its namespace to die, its
                    # memory already gone (no argv) and, on cgroup v1, already moved to the
                    # root cgroup, after its cgroup looked empty to the destroy. A leak stays;
                    # those go within moments.
                    settle = time.monotonic() + SETTLE_S
                    while left.processes and time.monotonic() < settle:
                        exiting = "; ".join(p.describe() for p in left.processes)
                        print(f"  still on the host, looking again: {exiting[:300]}", flush=True)
                        time.sleep(0.5)
                        left = inventory.take(server.data_dir)
                    # Processes described (what, which state, whose), not by pid alone: one
                    # seen once is gone by the time anyone looks.
                    leftovers += [p.describe() for p in left.processes]
                    leftovers += [
                        line for cat, items in left.items().items() if cat != "processes"
                        for line in items
                    ]  # fmt: skip
        self.info = {
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "runtime": self.tier,
            "seconds": f"{time.monotonic() - started:.0f}",
            "leftovers": "; ".join(leftovers)[:1000] or "none",
            "server_options": " ".join(netns.server_options()),
            **machine(),
        }

    def _by_tier(
        self, name: str, flags: frozenset[str], todo: list[Check]
    ) -> dict[tuple[str, str], list[Check]]:
        """The profile's checks by the tier they run on (and why not this one): the default
        profile on this tier (but checks that reach no sandbox, `tier_free`: the process
        tier's); a control on this tier weakened, unless it cannot be weakened so or the check
        says its control cannot show a break here (control_elsewhere)."""
        out: dict[tuple[str, str], list[Check]] = {}
        for c in todo:
            where = (self.tier, "")
            if name != "default":
                where = control_where(self.tier, c)
            elif c.tier_free and self.tier != "process":
                where = ("process", "the check reaches no sandbox: the same whatever the tier")
            out.setdefault(where, []).append(c)
        return out

    def report(self, markdown: Path, controls: bool) -> int:
        """Print the tier's outcome; its exit status (see the module's doc)."""
        broken = [r.id for r in self.rows if r.default.status == "BROKEN"]
        errors = [r.id for r in self.rows if r.default.status == "ERROR"]
        weak = [r.id for r in self.rows if r.control_verdict.status != "BROKEN"] if controls else []
        print(
            f"{self.tier}: {len(self.rows)} checks: {len(broken)} BROKEN, {len(errors)} ERROR by "
            f"default; {len(weak)} positive controls did not break. Scorecard: {markdown}",
            flush=True,
        )
        for label, ids in (("BROKEN", broken), ("ERROR", errors), ("control not broken", weak)):
            if ids:
                print(f"  {label}: {', '.join(ids)}")
        if self.info["leftovers"] != "none":
            print(f"  the default run left on the host: {self.info['leftovers'][:300]}")
        if broken or self.info["leftovers"] != "none":
            self.status = 1
        else:
            self.status = 2 if errors or weak else 0
        return self.status


if __name__ == "__main__":
    sys.exit(main())
