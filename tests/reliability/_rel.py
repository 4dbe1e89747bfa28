"""Helpers of the reliability suite: a private server that can be crashed, host inventories,
and a check that every sandbox is either fully usable or cleanly gone."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ServerHandle, free_port

from agentbox.battery import inventory as inv

# Every state a sandbox not yet ended is shown in (`unhealthy`: running, its agent silent).
LIVE = ("building", "starting", "running", "paused", "unhealthy")
# The tiers this host runs (the process tier always; the others where their binary is installed).
LAUNCHER = {"process": "bwrap", "container": "runc", "gvisor": "runsc"}
TIERS = ["process"] + [t for t in ("container", "gvisor") if shutil.which(LAUNCHER[t])]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: an observed value, never an interpolation."""
    xs = sorted(values)
    return xs[max(1, math.ceil(q / 100 * len(xs))) - 1]


@dataclass
class RelServer:
    """A private `agentbox serve` on its own data dir, with the host's state before it."""

    handle: ServerHandle
    pre: inv.Inventory  # before the server first started: nothing of it on the host
    base: inv.Inventory | None = None  # right after it started, no sandboxes yet
    keys: dict[str, str] = field(default_factory=dict)  # tenant -> key
    tier: str = "process"  # the runtime it serves

    @property
    def data_dir(self) -> Path:
        return self.handle.data_dir

    @property
    def url(self) -> str:
        return self.handle.url

    @property
    def pid(self) -> int:
        assert self.handle.proc is not None
        return self.handle.proc.pid

    def key(self, tenant: str = "rel") -> str:
        if tenant not in self.keys:
            self.keys[tenant] = self.handle.make_key(tenant)
            with self.handle.client() as c:
                # Many sandboxes at once: no tenant budget may be what a test runs into.
                unlimited = {"max_sandboxes": 1000, "max_total_descriptors": 1 << 40}
                r = c.put(f"/v1/tenants/{tenant}/quota", json=unlimited)
                r.raise_for_status()
        return self.keys[tenant]

    def client(self, tenant: str = "rel", timeout: float = 60) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"X-API-Key": self.key(tenant)}, timeout=timeout
        )

    @property
    def digest(self) -> str:
        return inv.digest_of(self.data_dir)

    def crash(self) -> None:
        """SIGKILL the server (its sandboxes live on)."""
        proc = self.handle.proc
        assert proc is not None
        proc.kill()
        proc.wait()
        self.handle.proc = None

    def restart(self) -> None:
        self.handle.start()  # answers health only once reconcile has run

    def runtime_state(self, sandbox_id: str) -> dict[str, Any] | None:
        """What the runtime recorded of the sandbox (in whichever tier's sandboxes dir)."""
        for d in sorted(self.data_dir.glob("sandboxes*")):
            try:
                return json.loads((d / sandbox_id / "runtime.json").read_text())
            except (OSError, ValueError):
                continue
        return None

    def inventory(self) -> inv.Inventory:
        return inv.take(self.data_dir)

    def all_sandboxes(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for tenant in self.keys:
            with self.client(tenant) as c:
                token = None
                while True:
                    params: dict[str, Any] = {"limit": 1000}
                    if token:
                        params["next_token"] = token
                    r = c.get("/v1/sandboxes", params=params)
                    r.raise_for_status()
                    out += r.json()["sandboxes"]
                    token = r.json()["next_token"]
                    if not token:
                        break
        return out

    def kill_everything(self) -> None:
        """DELETE every live sandbox of every tenant, retrying what answers 503."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            live = [s for s in self.all_sandboxes() if s["state"] in LIVE]
            if not live:
                return
            for s in live:
                with self.client(s["tenant"]) as c:
                    r = c.delete(f"/v1/sandboxes/{s['sandbox_id']}")
                    assert r.status_code in (204, 503), f"kill {s['sandbox_id']}: {r.text}"
            time.sleep(0.05)
        raise AssertionError(f"sandboxes still live: {self.all_sandboxes()}")

    def settle(self, against: inv.Inventory, timeout: float = 10.0) -> list[str]:
        """What appeared since `against`, once orphans are reaped (what disappeared meanwhile
        is no leak: e.g. another server's orphaned sandbox process that nobody could attribute
        to a data dir, present before this server started and reaped since)."""
        deadline = time.monotonic() + timeout
        while True:
            changes = inv.leaks(against, self.inventory())
            if not changes or time.monotonic() > deadline:
                return changes
            time.sleep(0.1)


def sweep(snapshot: inv.Inventory) -> None:
    """Remove by hand what a failed test left for this data dir (processes of its sandboxes,
    mounts, loop devices, cgroups, directories). Never touches other servers' sandboxes."""
    for p in snapshot.processes:
        if "cgroup" in p.why or "argv" in p.why:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    time.sleep(0.2)
    for m in sorted(snapshot.mounts, key=lambda m: -len(m.split(" ")[0])):
        mnt = m.split(" (")[0]
        if subprocess.run(["umount", "-d", mnt], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", "-d", mnt], capture_output=True)
    for loop in snapshot.loop_devices:
        subprocess.run(["losetup", "-d", loop.split(" ")[0]], capture_output=True)
    for d in sorted(snapshot.cgroups, key=len, reverse=True):
        for _ in range(50):
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.02)
    for e in snapshot.entries:
        shutil.rmtree(e.rstrip("/"), ignore_errors=True)


@contextmanager
def private_server(
    tmp: Path, check_clean: bool = True, runtime: str = "process"
) -> Iterator[RelServer]:
    """A server of the test's own, serving `runtime`; at the end everything is killed and the
    host must be exactly as before the server started (checked, then swept either way)."""
    port = free_port()
    data_dir = tmp / f"data-{port}"
    handle = ServerHandle(
        url=f"http://127.0.0.1:{port}",
        data_dir=data_dir,
        port=port,
        extra_args=["--runtime", runtime],
    )
    srv = RelServer(handle=handle, pre=inv.take(data_dir), tier=runtime)
    # Nothing of this data dir yet; at most processes no data dir can be told to own (sandbox
    # uids outside every agentbox cgroup: another server's leftovers, if anything).
    owned = [p.describe() for p in srv.pre.processes if p.why != ["sandbox-uid"]]
    other = {k: v for k, v in srv.pre.items().items() if k != "processes" and v}
    assert not owned and not other, (owned, other)
    handle.start()
    srv.base = srv.inventory()
    failed = True
    try:
        yield srv
        failed = False
    finally:
        problems: list[str] = []
        try:
            if handle.proc is None:
                handle.start()
            srv.kill_everything()
            problems = [f"while running: {x}" for x in srv.settle(srv.base)]
            handle.stop()
            problems += [f"after stop: {x}" for x in srv.settle(srv.pre, timeout=5)]
        except Exception as e:  # noqa: BLE001 - report it with the leftovers
            problems.append(f"cleanup failed: {type(e).__name__}: {e}")
            handle.stop(signal.SIGKILL)
        left = srv.inventory()
        if not left.is_empty():
            sweep(left)
        if check_clean and not failed:
            log = handle.log_path.read_text()[-3000:] if handle.log_path else ""
            assert not problems, "host not clean:\n" + "\n".join(problems) + "\n" + log


def assert_usable_or_gone(srv: RelServer, snapshot: inv.Inventory | None = None) -> dict[str, int]:
    """Every sandbox the API knows is either running and fully usable (commands, files), or
    ended with nothing of it left on the host; nothing on the host belongs to no record."""
    snapshot = snapshot or srv.inventory()
    seen: dict[str, int] = {"running": 0, "ended": 0}
    known = set()
    for s in srv.all_sandboxes():
        sid = s["sandbox_id"]
        known.add(sid)
        assert s["state"] != "starting", f"{sid} stuck in starting: {s}"
        if s["state"] == "running":
            seen["running"] += 1
            with srv.client(s["tenant"]) as c:
                probe = run_ok(c, sid, "echo alive")
                assert probe == "alive\n", f"{sid} is running but not usable: {probe!r}"
                r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": "probe"}, content=b"ok")
                assert r.status_code == 200, f"{sid} file write: {r.status_code} {r.text}"
            parts = snapshot.about(sid)
            assert any(p.startswith("process:") for p in parts), f"{sid}: no process: {parts}"
        else:
            seen["ended"] += 1
            left = snapshot.about(sid)
            assert not left, f"{sid} is {s['state']} ({s['end_reason']}) but left: {left}"
    unexplained = snapshot.sandbox_ids() - known
    assert not unexplained, f"on the host but unknown to the API: {unexplained}"
    return seen


def run_ok(c: httpx.Client, sid: str, cmd: str, timeout: float = 30) -> str:
    """Run a foreground command; its stdout (asserting exit 0)."""
    events = []
    with c.stream(
        "POST", f"/v1/sandboxes/{sid}/commands", json={"cmd": cmd, "timeout": timeout}
    ) as r:
        if r.status_code != 200:
            r.read()
            raise AssertionError(f"{cmd!r} in {sid}: HTTP {r.status_code} {r.text}")
        events = [json.loads(x) for x in r.iter_lines() if x]
    end = events[-1] if events else {}
    assert end.get("type") == "end" and end.get("exit_code") == 0, (cmd, events[-3:])
    return "".join(e["data"] for e in events if e["type"] == "stdout")


class Background:
    """Run `fn` in a thread; `.result()` re-raises what it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.value = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.error = e

    def result(self, timeout: float = 60) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "background call did not finish"
        if self.error is not None:
            raise self.error
        return self.value


def agent_pids(srv: RelServer, sandbox_id: str) -> list[int]:
    """The sandbox's agent: the pid its runtime state names when the zygote forked it (its
    command is the server's Python then), else its `python3` processes (an exec start)."""
    state = srv.runtime_state(sandbox_id)
    if state is not None and "agent_pid" in state:
        return [int(state["agent_pid"])]
    return sandbox_pids(srv.inventory(), sandbox_id, comm="python3")


def sandbox_pids(snapshot: inv.Inventory, sandbox_id: str, comm: str | None = None) -> list[int]:
    return [
        p.pid
        for p in snapshot.processes
        if p.sandbox == sandbox_id
        and p.state not in ("Z", "X")
        and (comm is None or p.comm == comm)
    ]


@pytest.fixture(params=TIERS)
def tier_srv(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RelServer]:
    """A private server (private_server) of each tier in turn."""
    with private_server(tmp_path, runtime=request.param) as s:
        yield s
