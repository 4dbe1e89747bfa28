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
    control_tier: str = ""  # the tier the control ran on, when not the one attacked
    control_why: str = ""  # and why it did not run on the one attacked


def _cell(v: Verdict) -> str:
    return v.status + (f"({','.join(v.kinds)})" if v.kinds else "")


def _md(text: str, limit: int = 160) -> str:
    # Evidence may quote raw bytes (an environ's NULs): keep the file text.
    text = "".join(c if c.isprintable() else " " for c in text.replace("|", "\\|"))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_markdown(runs: list[tuple[list[Row], dict[str, str]]]) -> str:
    """The scorecard: every tier's verdicts side by side, then each tier's evidence."""
    tiers = [info["runtime"] for _, info in runs]
    first = runs[0][1]
    lines = [
        "# Security scorecard",
        "",
        "Written by `python -m agentbox.battery` (see `src/agentbox/battery/`). Each check probes",
        "from inside real sandboxes over the public API and is judged on the host by per-run",
        "canaries: a secret file outside every mount, listeners on loopback, gateway, node and",
        "metadata addresses and a DNS canary in a private network namespace, a host process,",
        "planted server secrets, and host-state snapshots. Each check also runs against a",
        "deliberately weakened sandbox (its positive control), where it must report BROKEN;",
        "where a tier cannot be weakened that way, or its own kernel has nothing the weakening",
        "would expose, the control runs on the process tier (marked `on process`, the reason in",
        "the tier's evidence): the probe is the same, and the control proves it sees the break.",
        "",
        f"- Machine: Linux {first['kernel']} {first['arch']}, {first['cpus']} CPUs, cgroups "
        f"{first['cgroups']}, Python {first['python']}",
        f"- Operator options of every battery server: `{first.get('server_options') or 'none'}`",
        "- Severity of a break: DOS low, READ/NET medium, WRITE high, ESCAPE critical.",
        "",
        "| Tier | Run | Default configuration | Positive controls | Left on the host |",
        "|---|---|---|---|---|",
    ]
    for rows, info in runs:
        counts: dict[str, int] = {}
        for r in rows:
            counts[r.default.status] = counts.get(r.default.status, 0) + 1
        broken = sum(r.control_verdict.status == "BROKEN" for r in rows)
        moved = sum(bool(r.control_tier) for r in rows)
        lines.append(
            f"| `{info['runtime']}` | {info['date']}, {info['seconds']} s | **{len(rows)} "
            f"checks**: "
            + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
            + f" | {broken} of {len(rows)} BROKEN"
            + (f" ({moved} on process)" if moved else "")
            + f" | {_md(info['leftovers'], 120)} |"
        )
    lines += [
        "",
        "Every process-tier and container-tier sandbox runs on the host kernel "
        f"({first['kernel']}): a kernel bug reachable through the allowed syscalls is an escape "
        "the battery cannot rule out. gVisor puts its own kernel between the sandbox and the "
        "host's (docs/ISOLATION.md says what it shares).",
        "",
        "| Check | Group | "
        + " | ".join(f"`{t}`" for t in tiers)
        + " | Positive control (weakening) | "
        + " | ".join(f"`{t}` control" for t in tiers)
        + " |",
        "|---|---|" + "---|" * (2 * len(tiers) + 1),
    ]
    by_tier = [{r.id: r for r in rows} for rows, _ in runs]
    for r in runs[0][0]:
        cells = [f"**{_cell(t[r.id].default)}**" for t in by_tier]
        controls = [
            _cell(t[r.id].control_verdict) + (f" on {t[r.id].control_tier}" if t[r.id].control_tier
                                              else "")
            for t in by_tier
        ]  # fmt: skip
        lines.append(
            f"| `{r.id}` {_md(r.title, 90)} | {r.group} | "
            + " | ".join(cells)
            + f" | `{r.control}` | "
            + " | ".join(controls)
            + " |"
        )
    for rows, info in runs:
        tier = info["runtime"]
        lines += [
            "",
            f"## `{tier}`: evidence",
            "",
            "| Check | Default | Evidence | Control result |",
            "|---|---|---|---|",
        ]
        for r in rows:
            on = f" (on {r.control_tier}: {r.control_why})" if r.control_tier else ""
            lines.append(
                f"| `{r.id}` | **{_cell(r.default)}** | {_md(r.default.evidence)} | "
                f"{_cell(r.control_verdict)}{on}: {_md(r.control_verdict.evidence, 100)} |"
            )
    return "\n".join(lines) + "\n"


def render_json(runs: list[tuple[list[Row], dict[str, str]]]) -> dict[str, Any]:
    def v(x: Verdict) -> dict[str, Any]:
        return {"status": x.status, "kinds": x.kinds, "evidence": x.evidence}

    return {
        "tiers": {
            info["runtime"]: {
                "info": info,
                "checks": [
                    {
                        "id": r.id,
                        "group": r.group,
                        "title": r.title,
                        "runtime": info["runtime"],
                        "default": v(r.default),
                        "control": {
                            "weakening": r.control,
                            "tier": r.control_tier or info["runtime"],
                            "why_there": r.control_why,
                            **v(r.control_verdict),
                        },
                    }
                    for r in rows
                ],
            }
            for rows, info in runs
        }
    }
