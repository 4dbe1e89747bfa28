"""Checks that a tenant cannot ask for more of the host than its quota allows (group
"exhaustion"): what a sandbox is granted at create, judged against the host's own limits.

The host's file table (fs.file-max) is shared by every sandbox, tenant and host process, and each
of a sandbox's `pids` processes may open `nofile` files: a sandbox granted `pids × nofile` near
the table's size can starve everyone of files. Nothing is opened here: being granted the budget
is the break. The positive control (`quota-open`, battery/server.py) gives tenants the quota they
had before these caps existed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx

from agentbox.battery.checks import Ctx, Verdict, blocked, check

_TENANT = "battery-files"
_SMALL = {"memory_mb": 64, "disk_mb": 16, "tmp_mb": 4, "cpu_count": 0.1}


def _server_hard_nofile(ctx: Ctx) -> int:
    assert ctx.server.proc is not None
    limits = Path(f"/proc/{ctx.server.proc.pid}/limits").read_text()
    hard = re.search(r"^Max open files\s+\S+\s+(\S+)", limits, re.M)
    return int(hard.group(1)) if hard and hard.group(1).isdigit() else 1 << 20


def _create(c: httpx.Client, pids: int, nofile: int, made: list[str]) -> httpx.Response:
    body: dict[str, Any] = {"timeout": 300, "resources": {**_SMALL, "pids": pids, "nofile": nofile}}
    r = c.post("/v1/sandboxes", json=body)
    if r.status_code == 201:
        made.append(r.json()["sandbox_id"])
    return r


def _answer(r: httpx.Response) -> str:
    try:
        setting = r.json().get("detail", {}).get("setting")
    except ValueError:
        setting = None
    return f"{r.status_code} {setting or r.text[:80]}"


@check(
    "res-file-table",
    "exhaustion",
    "host file-table exhaustion through nofile: pids × nofile beyond the caps is refused (4xx)",
    ["quota-open"],
)
def _res_file_table(ctx: Ctx) -> Verdict:
    table = int(Path("/proc/sys/fs/file-max").read_text())
    hard = _server_hard_nofile(ctx)
    c = ctx.server.client(ctx.server.key(_TENANT))
    made: list[str] = []
    v = blocked("")
    notes = []
    try:
        # nofile above what the server itself may hand out: refused, not a failed spawn.
        r = _create(c, 16, min(hard + 1, 1 << 20), made)
        notes.append(f"nofile={hard + 1} (server hard limit {hard}): {_answer(r)}")
        if r.status_code >= 500:
            v.add_break("DOS", f"nofile above the server's hard limit: HTTP {r.status_code}")
        # One sandbox that may hold a quarter of the host's table or more.
        nofile = min(hard, max(1024, table // 4096 + 1))
        r = _create(c, 4096, nofile, made)
        notes.append(f"pids=4096 × nofile={nofile}: {_answer(r)}")
        if r.status_code >= 500:
            v.add_break("DOS", f"4096 × {nofile}: HTTP {r.status_code}")
        elif r.status_code == 201 and 4096 * nofile >= table // 4:
            v.add_break(
                "DOS",
                f"granted 4096 × {nofile} = {4096 * nofile} open files, "
                f"{100 * 4096 * nofile // table} % of the host's table ({table})",
            )
        for sid in made:
            c.delete(f"/v1/sandboxes/{sid}")
        made.clear()
        # One tenant's live sandboxes, each within an eighth of the table, past half of it.
        pids = min(4096, max(16, table // 8 // 1024))
        each = pids * min(1024, hard)
        granted = 0
        for _ in range(table // 2 // each + 1):
            r = _create(c, pids, min(1024, hard), made)
            if r.status_code != 201:
                notes.append(f"tenant: {len(made)} × {each} granted, then {_answer(r)}")
                if r.status_code >= 500:
                    v.add_break("DOS", f"tenant budget: HTTP {r.status_code}")
                break
            granted += each
        if granted > table // 2:
            v.add_break(
                "DOS",
                f"one tenant was granted {len(made)} sandboxes of {each} open files, "
                f"{100 * granted // table} % of the host's table ({table})",
            )
    finally:
        for sid in made:
            c.delete(f"/v1/sandboxes/{sid}")
    if not ctx.server.alive():
        v.add_break("DOS", "the server stopped answering")
    v.evidence = v.evidence or "; ".join(notes)
    return v
