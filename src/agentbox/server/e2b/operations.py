"""E2B's control plane beyond a sandbox's life and death (issue 17, slice 4): metrics, fork,
snapshots and network updates, each one call of the agentbox feature of the same name.

Where the two differ: agentbox snapshots and forks hold a sandbox's disk, not its memory (a
sandbox started from one boots fresh on a copy of the disk; E2B's `mode="filesystem"`), on
every tier; E2B's default is a full memory snapshot. agentbox's fork is all or none (E2B
reports each fork's success on its own): one that cannot start ends the others, and the
request fails as a whole.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from pydantic import Field

from agentbox.core.errors import InvalidRequest, NotFound
from agentbox.server.e2b.common import Body, E2BRoute, Str, created, e2b_state, rfc3339
from agentbox.server.routes.deps import Mgr, Who
from agentbox.server.surfaces import Core
from agentbox.store.db import SnapshotRow


class ForkBody(Body):
    timeout: int = Field(15, ge=1, le=10**9)
    count: int = Field(1, ge=1, le=16)


class SnapshotBody(Body):
    name: Annotated[str | None, Field(max_length=64)] = None
    memory: bool | None = None


class NetworkUpdate(Body):
    """E2B's `SandboxNetworkUpdateConfig`: the whole egress configuration, an omitted field
    cleared."""

    allowOut: list[Str] | None = Field(None, max_length=256)
    denyOut: list[Str] | None = Field(None, max_length=256)
    allowInternetAccess: bool | None = None
    dnsServers: Any = None
    egressProxy: Any = None
    rules: Any = None


def snapshot_info(snap: SnapshotRow) -> dict[str, Any]:
    """E2B's `SnapshotInfo`: the id a create names it by, and its names."""
    return {"snapshotID": snap.snapshot_id, "names": [snap.name] if snap.name else []}


LOGS_MAX = 1000  # entries in one answer
LEVELS = ("debug", "info", "warn", "error")


def log_entry(event: dict[str, Any]) -> dict[str, Any]:
    """An audit event as E2B's `SandboxLogEntry`: its action (and command) as the message,
    the rest as string fields; a refusal is `warn`, a server failure `error`."""
    detail = event.get("detail") or {}
    status = event.get("status") or 200
    failed = detail.get("error") or detail.get("violation")
    level = "error" if status >= 500 else "warn" if status >= 400 or failed else "info"
    message = event["action"]
    if detail.get("cmd"):
        message += f": {str(detail['cmd'])[:200]}"
    if detail.get("exit_code") not in (None, 0):
        message += f" (exit code {detail['exit_code']})"
    fields = {"action": event["action"], "status": str(status)}
    if event.get("duration_ms") is not None:
        fields["duration_ms"] = str(event["duration_ms"])
    for k, v in detail.items():
        fields[str(k)] = (v if isinstance(v, str) else json.dumps(v, default=str))[:500]
    return {
        "timestamp": rfc3339(event["time"]),
        "level": level,
        "message": message,
        "fields": fields,
    }


def _snapshot_place(snap: SnapshotRow) -> tuple[int, str]:
    """A snapshot's place in the listing's order: its creation time (µs), then its id."""
    return int(snap.created_at * 1_000_000), snap.snapshot_id


def _snapshot_cursor(token: str) -> tuple[int, str]:
    at, _, snapshot_id = token.partition(".")
    if not (at.isdigit() and snapshot_id):
        raise InvalidRequest("nextToken: not a token this listing gave")
    return int(at), snapshot_id


def network_of(body: NetworkUpdate, current: dict[str, Any]) -> dict[str, Any] | None:
    """agentbox's network settings for E2B's update, mapped as at create: allowOut is what
    the sandbox may reach (beating its own denyOut), everything else stays denied unless
    `allowInternetAccess` is true (within the tenant's ceiling); an empty update is the
    tenant's default policy. Public traffic to exposed ports is not E2B's to change here."""
    for name in ("dnsServers", "egressProxy", "rules"):
        if getattr(body, name) not in (None, [], {}):
            raise InvalidRequest(f"network.{name} is not supported by agentbox")
    if body.allowOut is None and body.denyOut is None and body.allowInternetAccess is None:
        return None
    allow = list(body.allowOut or [])
    deny = [d for d in body.denyOut or [] if d not in allow and d not in ("0.0.0.0/0", "::/0")]
    return {
        "allow_out": allow,
        "deny_out": deny,
        "allow_internet_access": body.allowInternetAccess is True,
        "allow_public_traffic": bool(current.get("allow_public_traffic")),
    }


def operations_routes(core: Core) -> APIRouter:
    r = APIRouter(route_class=E2BRoute, include_in_schema=False)

    def alive(mgr: Any, who: Any, sandbox_id: str) -> None:
        if e2b_state(mgr.get(who, sandbox_id)) is None:
            raise NotFound(f"sandbox {sandbox_id} not found (it ended)")

    @r.get("/sandboxes/{sandbox_id}/metrics")
    async def metrics(
        sandbox_id: str,
        mgr: Mgr,
        who: Who,
        start: Annotated[int | None, Query(ge=0, le=10**11)] = None,
        end: Annotated[int | None, Query(ge=0, le=10**11)] = None,
    ) -> list[dict[str, Any]]:
        """E2B's `SandboxMetric`s, oldest first. `memCache` is 0: agentbox counts the page
        cache a sandbox is charged for in `memUsed`."""
        alive(mgr, who, sandbox_id)
        samples = mgr.get_metrics(who, sandbox_id, start, end)
        return [
            {
                "timestamp": rfc3339(s["timestamp"]),
                "timestampUnix": int(s["timestamp"]),
                "cpuCount": max(1, round(s["cpu_count"])),
                "cpuUsedPct": s["cpu_used_pct"],
                "memUsed": s["mem_used"],
                "memTotal": s["mem_total"],
                "memCache": 0,
                "diskUsed": s["disk_used"],
                "diskTotal": s["disk_total"],
            }
            for s in samples
        ]

    @r.post("/sandboxes/{sandbox_id}/fork", status_code=201)
    async def fork(
        sandbox_id: str, mgr: Mgr, who: Who, body: ForkBody | None = None
    ) -> list[dict[str, Any]]:
        """E2B's `SandboxForkResult`s: each a running sandbox with a copy of this one's disk."""
        alive(mgr, who, sandbox_id)
        body = body or ForkBody(timeout=15, count=1)
        rows = await mgr.snapshots.fork(who, sandbox_id, body.count, body.timeout)
        return [{"sandbox": created(row, core)} for row in rows]

    @r.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
    async def create_snapshot(
        sandbox_id: str, mgr: Mgr, who: Who, body: SnapshotBody | None = None
    ) -> dict[str, Any]:
        """A snapshot of the sandbox's disk (whatever `memory` asks: see the module's note);
        `Sandbox.create(snapshotID)` starts from it."""
        alive(mgr, who, sandbox_id)
        name = body.name if body is not None else None
        return snapshot_info(await mgr.snapshots.create(who, sandbox_id, name or None))

    @r.get("/snapshots")
    async def list_snapshots(
        mgr: Mgr,
        who: Who,
        response: Response,
        sandboxID: Annotated[str | None, Query(max_length=128)] = None,  # noqa: N803
        name: Annotated[str | None, Query(max_length=64)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        nextToken: Annotated[str | None, Query(max_length=160)] = None,  # noqa: N803
    ) -> list[dict[str, Any]]:
        """The tenant's ready snapshots, newest first; the next page's token in
        `x-next-token` (the last one's place in that order, so a page is not shifted by
        snapshots made or deleted meanwhile)."""
        after = _snapshot_cursor(nextToken) if nextToken else None
        snaps = await asyncio.to_thread(mgr.snapshots.of_tenant, who)
        chosen = [
            s
            for s in sorted(snaps, key=_snapshot_place, reverse=True)
            if s.state == "ready"
            and (sandboxID is None or s.sandbox_id == sandboxID)
            and (name is None or s.name == name)
            and (after is None or _snapshot_place(s) < after)
        ]
        page = chosen[:limit]
        if len(chosen) > limit:
            at, snapshot_id = _snapshot_place(page[-1])
            response.headers["x-next-token"] = f"{at}.{snapshot_id}"
        return [snapshot_info(s) for s in page]

    @r.get("/sandboxes/{sandbox_id}/logs")
    async def logs_v1(
        sandbox_id: str,
        mgr: Mgr,
        who: Who,
        start: Annotated[int | None, Query(ge=0, le=10**15)] = None,
        limit: Annotated[int, Query(ge=0, le=LOGS_MAX)] = LOGS_MAX,
    ) -> dict[str, Any]:
        """The sandbox's log: its audit events (what was done to and in it), oldest first
        from `start` (Unix ms)."""
        mgr.get(who, sandbox_id)  # the caller's (404 for anyone else's)
        since = start / 1000 if start is not None else None
        events = await asyncio.to_thread(
            mgr.tenants.audit_events, who, None, sandbox_id, None, since, limit, None, True
        )
        entries = [log_entry(e) for e in events]
        lines = [{"timestamp": e["timestamp"], "line": e["message"]} for e in entries]
        return {"logs": lines, "logEntries": entries}

    @r.get("/v2/sandboxes/{sandbox_id}/logs")
    async def logs_v2(
        sandbox_id: str,
        mgr: Mgr,
        who: Who,
        cursor: Annotated[int | None, Query(ge=0, le=10**15)] = None,
        limit: Annotated[int, Query(ge=0, le=LOGS_MAX)] = LOGS_MAX,
        direction: Annotated[str, Query(pattern="^(forward|backward)$")] = "forward",
        level: Annotated[str | None, Query(pattern="^(debug|info|warn|error)$")] = None,
        search: Annotated[str | None, Query(max_length=256)] = None,
    ) -> dict[str, Any]:
        """The same log, from `cursor` (Unix ms) onwards, or before it going back; `level`
        keeps entries at that level or above, `search` those whose message holds it (both
        among the `limit` entries read, so a page may hold fewer)."""
        mgr.get(who, sandbox_id)
        at = cursor / 1000 if cursor is not None else None
        forward = direction == "forward"
        events = await asyncio.to_thread(
            mgr.tenants.audit_events, who, None, sandbox_id, None,
            at if forward else None, limit, None if forward else at, forward,
        )  # fmt: skip
        entries = [log_entry(e) for e in events]
        floor = LEVELS.index(level) if level else 0
        kept = [
            e
            for e in entries
            if LEVELS.index(e["level"]) >= floor and (not search or search in e["message"])
        ]
        return {"logs": kept}

    @r.delete("/templates/{template_id}", status_code=204)
    async def delete_snapshot(template_id: str, mgr: Mgr, who: Who) -> Response:
        """E2B deletes snapshots as templates; here only snapshots go this way (404 for
        anything else)."""
        await mgr.snapshots.delete(who, template_id)
        return Response(status_code=204)

    @r.put("/sandboxes/{sandbox_id}/network", status_code=204)
    async def update_network(sandbox_id: str, body: NetworkUpdate, mgr: Mgr, who: Who) -> Response:
        row = mgr.get(who, sandbox_id)
        if e2b_state(row) is None:
            raise NotFound(f"sandbox {sandbox_id} not found (it ended)")
        await mgr.set_network(who, sandbox_id, network_of(body, row.network or {}))
        return Response(status_code=204)

    return r
