"""Checks that a sandbox cannot make the server hold without bound what the server keeps on its
behalf: descriptors (egress-proxy connections, the watch on its background commands) and rows in
the egress log (refused attempts).

Judged on the host: the server's own descriptor count (/proc/PID/fd) and the rows the API
returns. Positive control: `budgets-open` (battery/server.py) lifts the proxy's connection caps
and writes every refused attempt to the log.
"""

from __future__ import annotations

import json
import os
import socket
import time

import httpx

from agentbox.battery.checks import Ctx, Verdict, blocked, check
from agentbox.battery.netns import EGRESS_ALLOWED
from agentbox.battery.target import Box

CONTROL = {"budgets-open"}
TUNNELS = 300  # tried from one sandbox; the shipped cap is 64 per sandbox
COMMANDS = 150  # background commands left running in one sandbox
REFUSALS = 3000  # refused attempts of one sandbox; the shipped log writes 20 per minute in full

_TUNNELS = r"""
import json, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
held, answers = [], {}
for i in range(n):
    try:
        s = socket.create_connection(("127.0.0.1", 3128))
        s.sendall(b"CONNECT %s:%d HTTP/1.1\r\nHost: x\r\n\r\n" % (sys.argv[3].encode(), port))
        head = s.recv(4096)
    except OSError as e:
        head = type(e).__name__.encode()
    code = head[9:12].decode() if head.startswith(b"HTTP/") else "closed"
    answers[code] = answers.get(code, 0) + 1
    held.append(s)
with open("/tmp/.abx-tunnels.json", "w") as f:
    json.dump(answers, f)
time.sleep(60)
"""

_REFUSALS = r"""
import socket, sys
for i in range(int(sys.argv[1])):
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(b"CONNECT refused-%d.abx.test:443 HTTP/1.1\r\nHost: x\r\n\r\n" % i)
    s.recv(64)
    s.close()
print("done")
"""


def _server_fds(ctx: Ctx) -> int:
    assert ctx.server.proc is not None
    last = -1
    for _ in range(20):  # until it settles: closed connections go lazily
        now = len(os.listdir(f"/proc/{ctx.server.proc.pid}/fd"))
        if now == last:
            return now
        last = now
        time.sleep(0.1)
    return last


def _tunnels(ctx: Ctx, box: Box, port: int) -> tuple[int, dict[str, int]]:
    """Server descriptors gained while the sandbox holds as many tunnels as it gets."""
    before = _server_fds(ctx)
    box.put("/tmp/.abx-tunnels.py", _TUNNELS.encode()).raise_for_status()
    box.start(f"python3 /tmp/.abx-tunnels.py {port} {TUNNELS} {EGRESS_ALLOWED[0]}")
    deadline = time.monotonic() + 60
    answers: dict[str, int] = {}
    while time.monotonic() < deadline:
        r = box.get("/tmp/.abx-tunnels.json")
        if r.status_code == 200:
            answers = json.loads(r.content)
            break
        time.sleep(0.3)
    return _server_fds(ctx) - before, answers


def _background(ctx: Ctx, box: Box) -> int:
    """Server descriptors gained while the sandbox runs many background commands."""
    before = _server_fds(ctx)
    for _ in range(COMMANDS):
        # A sandbox busy with the last ones (gVisor's ptrace kernel with a hundred processes on
        # a loaded 2-core host) may miss a health check and be `unhealthy` until the next one
        # (503): what counts is the descriptors of the commands it runs, not how fast it takes
        # them, so a 503 is waited out for a minute; the last one's body says which it was.
        deadline = time.monotonic() + 60
        while True:
            try:
                box.start("sleep 120")
                break
            except httpx.HTTPStatusError as e:
                if e.response.status_code != 503 or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"HTTP {e.response.status_code}: {e.response.text[:300]}"
                    ) from None
                time.sleep(1)
    return _server_fds(ctx) - before


@check(
    "budget-descriptors",
    "control-plane",
    "a sandbox holding hundreds of egress connections and background commands cannot run the "
    "server out of descriptors (connections past the cap refused, the server's fds bounded)",
    CONTROL,
)
def _budget_descriptors(ctx: Ctx) -> Verdict:
    upstream = socket.create_server((EGRESS_ALLOWED[1], 0), backlog=1024)  # never accepts
    try:
        # The sandbox's own limits are not the point: its tenant may hold more descriptors
        # (pids × nofile) than the default share, set by the admin as an operator would.
        # Memory for 150 idle commands on every tier (a process costs gVisor's kernel about
        # 4.5 MiB of the sandbox's memory).
        tenant, roomy = "battery-budget", {"nofile": 1024, "pids": 1024, "memory_mb": 2048}
        quota = {"max_descriptors": 2**21, "max_total_descriptors": 2**22}
        with ctx.server.client(ctx.server.admin_key) as admin:
            admin.put(f"/v1/tenants/{tenant}/quota", json=quota).raise_for_status()
        box = ctx.box(tenant, network={"allow_out": [EGRESS_ALLOWED[0]]}, resources=roomy)
        gained, answers = _tunnels(ctx, box, upstream.getsockname()[1])
        box.kill()
        commands = _background(ctx, ctx.box(tenant, resources=roomy))
    finally:
        upstream.close()
    if not answers:
        return Verdict("ERROR", evidence="the sandbox's tunnel script never reported")
    v = blocked(
        f"{TUNNELS} tunnels tried: {answers}, server fds +{gained}; {COMMANDS} background "
        f"commands: server fds +{commands}"
    )
    if answers.get("200", 0) > 64 or gained > 2 * 64 + 40:
        v.add_break("DOS", f"{answers.get('200', 0)} tunnels served, server fds +{gained}")
    if commands > COMMANDS // 2:
        v.add_break("DOS", f"{COMMANDS} background commands cost the server {commands} fds")
    return v


@check(
    "budget-log-amplification",
    "control-plane",
    "a sandbox hammering a refused host cannot fill the egress log (a few rows and a count)",
    CONTROL,
)
def _budget_log_amplification(ctx: Ctx) -> Verdict:
    box = ctx.box()  # no egress: every attempt is refused
    box.put("/tmp/.abx-refusals.py", _REFUSALS.encode()).raise_for_status()
    res = box.run(f"python3 /tmp/.abx-refusals.py {REFUSALS}", timeout=120)
    if "done" not in res.stdout:
        return Verdict("ERROR", evidence=f"the refusal loop failed: {res.text[-300:]}")
    time.sleep(1)  # the proxy writes its log every half second
    r = box.client.get(
        "/v1/audit/egress", params={"sandbox_id": box.id, "limit": 10_000}, timeout=30
    )
    if r.status_code != 200:
        return Verdict("ERROR", evidence=f"HTTP {r.status_code}: {r.text[:200]}")
    events = r.json()["events"]
    counted = sum(e.get("suppressed") or 0 for e in events)
    v = blocked(f"{REFUSALS} refused attempts: {len(events)} rows, {counted} counted in them")
    if len(events) > 100:
        v.add_break("LOG", f"{REFUSALS} refused attempts wrote {len(events)} egress log rows")
    return v
