"""The security scorecard: check x runtime -> BLOCKED / BROKEN(kind) / N/A / ERROR + evidence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentbox.battery.checks import Verdict

SEVERITY = {"DOS": "low", "READ": "medium", "NET": "medium", "WRITE": "high", "ESCAPE": "critical"}


@dataclass
class Row:
    id: str
    group: str
    title: str
    control: str
    default: Verdict = field(default_factory=lambda: Verdict("N/A", evidence="not run"))
    control_verdict: Verdict = field(default_factory=lambda: Verdict("N/A", evidence="not run"))


def _cell(v: Verdict) -> str:
    return v.status + (f"({','.join(v.kinds)})" if v.kinds else "")


def _md(text: str, limit: int = 160) -> str:
    # Evidence may quote raw bytes (an environ's NULs): keep the file text.
    text = "".join(c if c.isprintable() else " " for c in text.replace("|", "\\|"))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_markdown(rows: list[Row], info: dict[str, str]) -> str:
    runtime = info["runtime"]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.default.status] = counts.get(r.default.status, 0) + 1
    controls_broken = sum(r.control_verdict.status == "BROKEN" for r in rows)
    lines = [
        "# Security scorecard",
        "",
        "Written by `python -m agentbox.battery` (see `src/agentbox/battery/`). Each check probes",
        "from inside real sandboxes over the public API and is judged on the host by per-run",
        "canaries: a secret file outside every mount, listeners on loopback, gateway, node and",
        "metadata addresses and a DNS canary in a private network namespace, a host process,",
        "planted server secrets, and host-state snapshots. Each check also runs against a",
        "deliberately weakened sandbox (its positive control), where it must report BROKEN.",
        "",
        f"- Run: {info['date']}, {info['seconds']} s; runtime `{runtime}`",
        f"- Machine: Linux {info['kernel']} {info['arch']}, {info['cpus']} CPUs, cgroups "
        f"{info['cgroups']}, Python {info['python']}",
        f"- Default configuration: **{len(rows)} checks**, "
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
        f"- Positive controls: **{controls_broken} of {len(rows)} BROKEN** as they must be",
        f"- Operator options of every battery server: `{info.get('server_options') or 'none'}`",
        f"- Host inventory after the default run (processes, mounts, cgroups, loop devices, "
        f"network namespaces, data-dir entries): {info['leftovers']}",
        f"- Shared-kernel risk: every process-tier sandbox runs on the host kernel "
        f"({info['kernel']}); a kernel bug reachable through the allowed syscalls is an escape "
        "the battery cannot rule out. Stronger tiers (gVisor, microVMs) address that.",
        "",
        "Severity of a break: DOS low, READ/NET medium, WRITE high, ESCAPE critical.",
        "",
        f"| Check | Group | `{runtime}` default | Evidence | Positive control (weakening) "
        "| Control result |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r.id}` {_md(r.title, 90)} | {r.group} | **{_cell(r.default)}** | "
            f"{_md(r.default.evidence)} | `{r.control}` | {_cell(r.control_verdict)}: "
            f"{_md(r.control_verdict.evidence, 100)} |"
        )
    return "\n".join(lines) + "\n"


def render_json(rows: list[Row], info: dict[str, str]) -> dict[str, Any]:
    def v(x: Verdict) -> dict[str, Any]:
        return {"status": x.status, "kinds": x.kinds, "evidence": x.evidence}

    return {
        "info": info,
        "checks": [
            {
                "id": r.id,
                "group": r.group,
                "title": r.title,
                "runtime": info["runtime"],
                "default": v(r.default),
                "control": {"weakening": r.control, **v(r.control_verdict)},
            }
            for r in rows
        ],
    }
