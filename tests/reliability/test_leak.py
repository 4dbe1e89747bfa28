"""Leak test: create -> exec -> kill cycles with faults injected mid-create and mid-kill.

Faults: the sandbox's agent or its pid-namespace init SIGKILLed right after create, its bwrap
process killed (idle, and in the middle of a kill), the server SIGKILLed in the middle of a
create and of a kill (then restarted, so reconciliation runs), a kill that arrives while the
sandbox is still starting, a kill of a paused (or pausing) sandbox, and a server crash while a
sandbox is paused (it must stay paused, then resume whole), and in the middle of a snapshot and
of a fork (the sandbox runs on, thawed; a half-made snapshot or fork copy is removed, a whole one
stays), and while a sandbox paused without memory resumes (it is paused again, its disk whole).
After every cycle each sandbox must be fully usable or cleanly gone; at the end, with everything
killed, the host inventory must equal the one before the server started.

    AGENTBOX_LEAK_CYCLES=200 AGENTBOX_LEAK_SEED=7 .venv/bin/pytest -q tests/reliability/test_leak.py
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from _rel import (
    LAUNCHER,
    TIERS,
    Background,
    RelServer,
    agent_pids,
    assert_usable_or_gone,
    private_server,
    run_ok,
)

from agentbox.battery import inventory

pytestmark = pytest.mark.reliability

FAULTS = (
    "none",
    "agent_killed",
    "init_killed",
    "bwrap_killed",
    "bwrap_killed_mid_kill",
    "server_killed_mid_create",
    "server_killed_mid_kill",
    "kill_while_starting",
    "runtime_killed_mid_create",
    "paused_then_killed",
    "server_killed_while_paused",
    "server_killed_mid_snapshot",
    "server_killed_mid_fork",
    "server_killed_mid_unpark",
)
# The other tiers have no bwrap: their init is the runtime's (on `container` the agent itself,
# pid 1 of the sandbox; on `gvisor` the sentry, whose processes are no host processes at all),
# and their launcher (runc, runsc) is what a create may lose mid-way.
TIER_FAULTS = {
    "process": FAULTS,
    "container": tuple(f for f in FAULTS if not f.startswith("bwrap")),
    "gvisor": tuple(f for f in FAULTS if not f.startswith("bwrap") and f != "agent_killed"),
}
CYCLES = int(os.environ.get("AGENTBOX_LEAK_CYCLES", str(2 * len(FAULTS))))
SEED = int(os.environ.get("AGENTBOX_LEAK_SEED", str(int(time.time()) % 100_000)))
BODY = {"timeout": 300, "resources": {"disk_mb": 64, "memory_mb": 128}}
WORK = "echo data > /workspace/f; (sleep 600 &); sleep 600 & echo started"


@pytest.fixture(params=TIERS)
def srv(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RelServer]:
    with private_server(tmp_path, runtime=request.param) as s:
        yield s


def _kill(pid: int | None) -> None:
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _delete(c: httpx.Client, sid: str) -> int:
    """DELETE until it sticks: 503 means "torn down only partly, retry"; anything else but
    204 is a bug."""
    for _ in range(20):
        r = c.delete(f"/v1/sandboxes/{sid}")
        if r.status_code == 204:
            return 204
        assert r.status_code == 503, f"kill {sid}: {r.status_code} {r.text}"
        assert r.json()["code"] == "sandbox_unavailable", r.text
        time.sleep(0.1)
    raise AssertionError(f"kill {sid} kept answering 503")


def _state(c: httpx.Client, sid: str) -> dict:
    r = c.get(f"/v1/sandboxes/{sid}")
    assert r.status_code == 200, r.text
    return r.json()


def _create_and_work(srv: RelServer, c: httpx.Client) -> str:
    r = c.post("/v1/sandboxes", json=BODY)
    assert r.status_code == 201, r.text
    sid = r.json()["sandbox_id"]
    assert run_ok(c, sid, WORK).strip() == "started"
    r = c.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "sleep 600", "background": True})
    assert r.status_code == 201, r.text
    return sid


def _probe_dead(c: httpx.Client, sid: str) -> None:
    """A sandbox whose processes died answers a clean 409/503, never 500 or a hang."""
    r = c.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "true", "background": True})
    assert r.status_code in (201, 409, 503), f"{r.status_code} {r.text}"
    if r.status_code != 201:
        assert r.json()["code"] in ("sandbox_not_running", "sandbox_unavailable"), r.text


def _wait_ended(c: httpx.Client, sid: str, within: float) -> dict:
    deadline = time.monotonic() + within
    while True:
        info = _state(c, sid)
        if info["state"] not in ("starting", "running") or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def _first_runtime_process(srv: RelServer, create: Background, comm: str) -> str | None:
    """SIGKILL the first process named `comm` whose argv names this server's sandbox trees,
    while `create` runs; what was killed (None if the create finished first)."""
    fp = inventory.footprint(srv.data_dir)
    needles = [f"{d.resolve()}/" for d in (*fp.dirs, *fp.roots)]
    while create.thread.is_alive():
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    argv = f.read().decode(errors="replace").split("\0")
            except OSError:
                continue
            if os.path.basename(argv[0]) == comm and any(n in a for a in argv for n in needles):
                _kill(int(name))
                return comm
    return None


def _cycle(srv: RelServer, fault: str, rng: random.Random, round_: int) -> str:
    """One create/exec/kill cycle with `fault`; returns what happened, for the summary.
    Faults that leave a dead sandbox are cleaned up by a kill on even rounds and by the health
    loop on odd ones (so the default two rounds cover both)."""
    with srv.client() as c:
        if fault == "server_killed_mid_create":
            bg = Background(lambda: c.post("/v1/sandboxes", json=BODY))
            time.sleep(rng.uniform(0, 0.12))  # a create takes ~60-150 ms here
            srv.crash()
            try:
                outcome = f"create answered {bg.result().status_code}"
            except httpx.HTTPError:
                outcome = "create lost"
            srv.restart()
            assert_usable_or_gone(srv)  # a create that completed left a usable sandbox
            srv.kill_everything()
            return outcome
        if fault == "runtime_killed_mid_create":
            # Kill the first runtime process of the new sandbox seen: mkfs, losetup, mount, bwrap.
            bg = Background(lambda: c.post("/v1/sandboxes", json=BODY))
            victim = _first_runtime_process(
                srv, bg, rng.choice(("mkfs.ext4", "losetup", "mount", LAUNCHER[srv.tier]))
            )
            created = bg.result()
            assert created.status_code in (201, 503), created.text
            if created.status_code == 503:
                assert created.json()["code"] == "sandbox_unavailable", created.text
            else:
                srv.kill_everything()  # too late to hurt it: it must be whole (checked after)
            return f"{victim or 'nothing caught'} killed, create answered {created.status_code}"
        if fault == "kill_while_starting":
            bg = Background(lambda: c.post("/v1/sandboxes", json=BODY))
            sid = None
            deadline = time.monotonic() + 10
            while sid is None and time.monotonic() < deadline:
                r = c.get("/v1/sandboxes", params={"state": "starting"})
                starting = r.json()["sandboxes"]
                sid = starting[0]["sandbox_id"] if starting else None
            if sid is None:  # it started before we saw it: kill it running instead
                sid = bg.result().json()["sandbox_id"]
            assert _delete(c, sid) == 204
            created = bg.result()
            # The start gives up and the kill ends a whole sandbox: it is killed, not failed
            # (the record of a kill is never overwritten) nor running again, and the create
            # says so (201 only if the start had finished when the kill reached the server).
            assert created.status_code in (201, 409), created.text
            if created.status_code == 409:
                assert created.json()["code"] == "sandbox_not_running", created.text
            info = _state(c, sid)
            assert info["state"] == "killed" and info["end_reason"] == "killed", info
            return f"create answered {created.status_code}, sandbox {info['state']}"

        sid = _create_and_work(srv, c)
        state = srv.runtime_state(sid)
        assert state is not None
        if fault == "none":
            assert _delete(c, sid) == 204
        elif fault in ("agent_killed", "init_killed"):
            if fault == "agent_killed":
                agents = agent_pids(srv, sid)
                assert agents, srv.inventory().about(sid)
                _kill(min(agents))
            else:
                _kill(state["init_pid"])
            _probe_dead(c, sid)
            if round_ % 2 == 0:
                assert _delete(c, sid) == 204
            else:  # the health loop must notice on its own
                info = _wait_ended(c, sid, within=10)
                assert info["state"] == "killed" and info["end_reason"] == "vanished", info
        elif fault == "bwrap_killed":
            # The runtime process died: the sandbox is ended as vanished (or killed first).
            _kill(state["bwrap_pid"])
            if round_ % 2 == 0:
                assert _delete(c, sid) == 204
            else:
                info = _wait_ended(c, sid, within=10)
                assert info["state"] == "killed" and info["end_reason"] == "vanished", info
        elif fault == "bwrap_killed_mid_kill":
            bg = Background(lambda: _delete(c, sid))
            time.sleep(rng.uniform(0, 0.03))
            _kill(state["bwrap_pid"])
            _kill(state["init_pid"])
            assert bg.result() == 204
        elif fault == "paused_then_killed":
            # Killed frozen (on even rounds mid-pause): nothing of it may stay behind frozen.
            if round_ % 2 == 0:
                r = c.post(f"/v1/sandboxes/{sid}/pause")
                assert r.status_code == 200, r.text
            else:
                bg = Background(lambda: c.post(f"/v1/sandboxes/{sid}/pause"))
                time.sleep(rng.uniform(0, 0.02))
                assert _delete(c, sid) == 204
                assert bg.result().status_code in (200, 409), bg.result().text
            assert _delete(c, sid) == 204
        elif fault == "server_killed_while_paused":
            r = c.post(f"/v1/sandboxes/{sid}/pause")
            assert r.status_code == 200, r.text
            srv.crash()
            srv.restart()
            assert _state(c, sid)["state"] == "paused"
            r = c.post(f"/v1/sandboxes/{sid}/resume")
            assert r.status_code == 200 and r.json()["state"] == "running", r.text
            assert run_ok(c, sid, "cat /workspace/f").strip() == "data"
            assert _delete(c, sid) == 204
        elif fault in ("server_killed_mid_snapshot", "server_killed_mid_fork"):
            what = "snapshots" if fault.endswith("snapshot") else "fork"
            first = _crash_during(
                srv, lambda: c.post(f"/v1/sandboxes/{sid}/{what}", json={}),
                rng.uniform(0, 0.06 if what == "snapshots" else 0.25),
            )  # fmt: skip
            # Thawed (a crash mid-copy left it frozen), and nothing half-made is kept.
            assert run_ok(c, sid, "cat /workspace/f").strip() == "data"
            snaps = c.get("/v1/snapshots").json()["snapshots"]
            kept = {d.name for d in (srv.data_dir / "snapshots").glob("*")}
            assert kept == {s["snapshot_id"] for s in snaps}, (kept, snaps)
            for snap in snaps:
                assert c.delete(f"/v1/snapshots/{snap['snapshot_id']}").status_code == 204
            srv.kill_everything()  # children of the fork: whole (checked after) or gone
            return f"{what} answered {first}, {len(snaps)} snapshots kept"
        elif fault == "server_killed_mid_unpark":
            r = c.post(f"/v1/sandboxes/{sid}/pause", json={"keep_memory": False})
            assert r.status_code == 200, r.text
            first = _crash_during(
                srv, lambda: c.post(f"/v1/sandboxes/{sid}/resume"), rng.uniform(0, 0.1)
            )
            state = _state(c, sid)["state"]
            if state == "paused":
                r = c.post(f"/v1/sandboxes/{sid}/resume")
                assert r.status_code == 200 and r.json()["state"] == "running", r.text
            assert run_ok(c, sid, "cat /workspace/f").strip() == "data"
            assert _delete(c, sid) == 204
            return f"resume answered {first}, then {state}"
        elif fault == "server_killed_mid_kill":
            first = _crash_during(
                srv, lambda: c.delete(f"/v1/sandboxes/{sid}"), rng.uniform(0, 0.05)
            )
            assert _delete(c, sid) == 204
            return f"first kill {first}, then {_state(c, sid)['end_reason']}"
        info = _state(c, sid)
        assert info["state"] == "killed", info
        return info["end_reason"]


def _crash_during(srv: RelServer, request: Callable[[], httpx.Response], after: float) -> str:
    """The server SIGKILLed `after` seconds into `request`, then started again; the status
    the request got ("lost" without an answer)."""
    bg = Background(request)
    time.sleep(after)
    srv.crash()
    try:
        first = str(bg.result().status_code)
    except httpx.HTTPError:
        first = "lost"
    srv.restart()
    return first


def test_leak_cycles_with_faults(srv: RelServer) -> None:
    """On every tier; the other tiers one round of their faults unless AGENTBOX_LEAK_CYCLES
    says (each round takes a few seconds more there)."""
    rng = random.Random(SEED)
    faults = TIER_FAULTS[srv.tier]
    cycles = (
        CYCLES if srv.tier == "process" or "AGENTBOX_LEAK_CYCLES" in os.environ else len(faults)
    )
    print(f"\nleak test, {srv.tier}: {cycles} cycles, seed {SEED} (AGENTBOX_LEAK_SEED to replay)")
    outcomes: Counter[str] = Counter()
    for i in range(cycles):
        fault = faults[i % len(faults)]
        try:
            outcome = _cycle(srv, fault, rng, i // len(faults))
            seen = assert_usable_or_gone(srv)
        except AssertionError as e:
            raise AssertionError(f"cycle {i} ({fault}, seed {SEED}): {e}") from None
        outcomes[f"{fault}: {outcome}"] += 1
        assert seen["running"] == 0, seen  # every cycle ends with its sandbox killed
    for line, n in sorted(outcomes.items()):
        print(f"  {n:3d} x {line}")
    # private_server kills what is left and checks the inventory against the start
