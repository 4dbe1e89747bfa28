"""What every benchmark shares: a private server, leak-proof cleanup, statistics, the machine.

Each benchmark starts its own `agentbox` server on a free port with a temporary data dir and an
admin key, and must leave nothing behind: on the way out (normal end, exception, Ctrl-C or
SIGTERM) it kills its sandboxes through the API, stops the server, then removes by hand whatever
the server did not (processes in the sandboxes' cgroups, loop mounts, cgroup directories). Only
sandboxes under this run's data dir are touched, so a benchmark never disturbs other servers on
the same host.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentbox.battery.target import wait_healthy

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
ADMIN_KEY = "bench-admin-key-0123456789abcdef"
CGROUP_ROOT = Path("/sys/fs/cgroup")
_V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")


# ---------------------------------------------------------------- statistics


# The process tier's floor: bare bwrap with its namespace set running /bin/true, the host's /usr
# read-only (bench/tiers.py, bench/idle_scale.py).
BARE_BWRAP = ["bwrap", "--unshare-all", "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib",
              "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/bin", "/bin", "--proc", "/proc",
              "--dev", "/dev", "/bin/true"]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): an observed value, never an interpolation."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    rank = max(1, math.ceil(q / 100 * len(xs)))
    return xs[rank - 1]


def summarize(values: Sequence[float]) -> dict[str, float]:
    xs = list(values)
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50": percentile(xs, 50), "p90": percentile(xs, 90),
            "p99": percentile(xs, 99), "min": min(xs), "max": max(xs),
            "mean": sum(xs) / len(xs)}


def fmt_ms(s: dict[str, float]) -> str:
    if not s.get("n"):
        return "n/a"
    return (f"p50 {s['p50']:.2f} ms, p99 {s['p99']:.2f} ms "
            f"(min {s['min']:.2f}, max {s['max']:.2f}, n={s['n']})")


def print_timings(timings: dict[str, list[float]], width: int) -> None:
    """One line per measurement that has samples: its name, then p50/p99/min/max/n."""
    for name, xs in timings.items():
        if xs:
            print(f"  {name:{width}s} {fmt_ms(summarize(xs))}")


def timed_runs(fn: Callable[[], Any], n: int, warmup: int = 3) -> list[float]:
    """Call fn n times (after `warmup` untimed calls); wall time of each call in ms."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def spawn_wait(argv: list[str], env: dict[str, str] | None = None) -> None:
    """fork+exec and wait, the cheapest way Python has (posix_spawn, no pipes)."""
    path = argv[0] if "/" in argv[0] else shutil.which(argv[0])
    assert path, argv[0]
    pid = os.posix_spawn(path, argv, env if env is not None else os.environ)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{argv} exited with {os.waitstatus_to_exitcode(status)}")


# ---------------------------------------------------------------- machine


def _cmd(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def cgroup_version() -> str:
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return "v2"
    if (CGROUP_ROOT / "pids").is_dir() or (CGROUP_ROOT / "memory").is_dir():
        return "v1"
    return "none"


def machine() -> dict[str, Any]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kb = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kb = int(line.split()[1])
    os_name = "?"
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return {
        "nproc": _cmd(["nproc"]), "cpu": cpu, "mem_gib": round(mem_kb / 1024 / 1024, 1),
        "free_g": _cmd(["free", "-g"]), "kernel": platform.release(), "os": os_name,
        "cgroup": cgroup_version(), "python": platform.python_version(),
        "bwrap": _cmd(["bwrap", "--version"]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "other_bwrap_processes": host_bwrap_count(),
    }


def machine_line(m: dict[str, Any]) -> str:
    return (f"{m['nproc']} CPUs ({m['cpu']}), {m['mem_gib']} GiB RAM, kernel {m['kernel']}, "
            f"{m['os']}, cgroup {m['cgroup']}, Python {m['python']}, {m['bwrap']}; "
            f"load {' '.join(m['loadavg'])}, {m['other_bwrap_processes']} bwrap processes "
            "already running on the host")


# ---------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# Where benchmarks keep the default template (`base`), built once per machine (a minute or two
# from Debian's mirror the first time). AGENTBOX_BENCH_DEFAULT_TEMPLATE=host benchmarks the
# host's userland instead.
BENCH_TEMPLATE_DIR = Path(
    os.environ.get("AGENTBOX_BENCH_TEMPLATE_DIR", "/var/tmp/agentbox-bench-templates")
)


def default_template() -> str:
    return os.environ.get("AGENTBOX_BENCH_DEFAULT_TEMPLATE", "base")


def ensure_template(template_dir: Path, name: str) -> None:
    """Build the shipped template `name` in `template_dir` (found in its cache when built)."""
    from agentbox.templates import TemplateStore, builtin_spec_path, load_spec

    spec = builtin_spec_path(name)
    if spec is None:
        raise RuntimeError(f"{name} is not a shipped template")
    t0 = time.monotonic()
    TemplateStore(template_dir).build(load_spec(spec.read_text(), spec.parent))
    if time.monotonic() - t0 > 5:
        print(f"[setup] built template {name} in {template_dir} "
              f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)


@dataclass
class BenchServer:
    """One `agentbox` server process with a private data dir; a context manager. Sandboxes
    that name no template get `default_template` (built ahead in the template dir)."""

    name: str
    warm_pools: dict[str, int] | None = None
    runtimes: str = "process"  # `serve --runtime`: the tiers served, the first the default
    template_dir: Path | None = None
    default_template: str = field(default_factory=default_template)
    network: dict[str, Any] | None = None  # NetworkSettings fields (`serve --egress-*`)
    root: Path = field(init=False)
    data_dir: Path = field(init=False)
    port: int = field(init=False)
    proc: subprocess.Popen | None = None
    leftovers: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client(self, **kw: Any) -> httpx.Client:
        kw.setdefault("timeout", 120)
        return httpx.Client(base_url=self.url, headers={"X-API-Key": ADMIN_KEY}, **kw)

    def __enter__(self) -> BenchServer:
        # The sandboxes' uids must traverse the data dir: mkdtemp's 0700 is widened by the
        # runtime itself (0711); its parent /tmp is world-traversable.
        if self.default_template != "host":
            self.template_dir = self.template_dir or BENCH_TEMPLATE_DIR
            ensure_template(self.template_dir, self.default_template)
        self.root = Path(tempfile.mkdtemp(prefix=f"agentbox-bench-{self.name}-"))
        self.data_dir = self.root
        self.port = free_port()
        _install_signal_handlers()
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        env = dict(os.environ, AGENTBOX_ADMIN_KEY=ADMIN_KEY,
                   AGENTBOX_LOG_LEVEL=os.environ.get("AGENTBOX_LOG_LEVEL", "WARNING"))
        tdir = None if self.template_dir is None else str(self.template_dir)
        code = ("from agentbox.server.app import serve; from pathlib import Path; "
                "from agentbox.core.network import NetworkSettings; "
                f"serve('127.0.0.1', {self.port}, Path({str(self.data_dir)!r}), "
                f"template_dir=None if {tdir!r} is None else Path({tdir!r}), "
                f"warm_pools={self.warm_pools!r}, default_template={self.default_template!r}, "
                f"runtime_name={self.runtimes!r}, "
                f"network=NetworkSettings(**{self.network!r}) if {self.network!r} else None)")
        self.log_path = Path(tempfile.gettempdir()) / f"{self.root.name}.server.log"
        log = open(self.log_path, "ab")
        # Own session: a Ctrl-C in the terminal reaches the benchmark, which then cleans up
        # through this still-running server.
        self.proc = subprocess.Popen([PYTHON, "-c", code], env=env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=str(ROOT))
        log.close()
        wait_healthy(self.url, self.proc, self.log_path)

    def set_quota(self, **quota: Any) -> None:
        with self.client() as c:
            r = c.put("/v1/tenants/admin/quota", json=quota)
            r.raise_for_status()

    def kill_all_sandboxes(self) -> int:
        """DELETE every live sandbox of this server through the API; how many were killed."""
        killed = 0
        with self.client(timeout=30) as c:
            # Warm pool members belong to no tenant: shrinking the pools ends them.
            pools = c.get("/v1/pools")
            for pool in pools.json().get("pools", []) if pools.status_code == 200 else []:
                c.put(f"/v1/pools/{pool['template']}", json={"size": 0})
            for _ in range(20):
                r = c.get("/v1/sandboxes", params={"state": "running,starting", "limit": 1000})
                r.raise_for_status()
                ids = [s["sandbox_id"] for s in r.json()["sandboxes"]]
                if not ids:
                    break
                for sid in ids:
                    if c.delete(f"/v1/sandboxes/{sid}").status_code == 204:
                        killed += 1
        return killed

    def __exit__(self, *exc: Any) -> None:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # let cleanup finish
        try:
            if self.proc is not None and self.proc.poll() is None:
                try:
                    self.kill_all_sandboxes()
                except Exception as e:  # noqa: BLE001 - the manual sweep below still runs
                    print(f"[cleanup] API kill failed ({e}); sweeping by hand", file=sys.stderr)
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(20)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            sweep(self.root)
            self.leftovers = leftovers(self.root)
            if any(self.leftovers.values()):
                print(f"[cleanup] LEFTOVERS: {self.leftovers}", file=sys.stderr)
            else:
                for r in owned_roots(self.root):
                    shutil.rmtree(r, ignore_errors=True)
                try:
                    self.log_path.unlink()
                except (OSError, AttributeError):
                    pass
        finally:
            signal.signal(signal.SIGINT, old)


def _install_signal_handlers() -> None:
    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)


# ---------------------------------------------------------------- leak-proof cleanup


def _cgroup_dirs(sid: str) -> list[Path]:
    """A sandbox's cgroup directories, of every tier (agentbox[-tier]/<digest>/<sid>) in every
    hierarchy (an OCI runtime joins them all)."""
    hierarchies = ([CGROUP_ROOT] if cgroup_version() == "v2"
                   else [h for h in CGROUP_ROOT.iterdir() if h.is_dir() and not h.is_symlink()])
    out = []
    for h in hierarchies:
        for base in h.glob("agentbox*"):
            out.append(base / sid)
            out += [d for d in base.glob(f"*/{sid}")]
    return out


def owned_roots(root: Path) -> list[Path]:
    """`root` and the runtime's bind tree for a data dir at `root`, if there is one.

    The process runtime mounts workspaces and keeps sockets below /run/agentbox/<digest>, the
    digest naming the data dir (runtime.py). Older versions kept everything in the data dir.
    """
    import hashlib

    roots = [root]
    data_dirs = [root]
    if root.is_dir():
        data_dirs += [d for d in root.iterdir() if d.is_dir() and not d.is_symlink()]
    for d in data_dirs:
        digest = hashlib.sha256(str(d.resolve()).encode()).hexdigest()[:12]
        # One per tier: <digest> (process), <digest>-container, <digest>-gvisor.
        roots += sorted(Path("/run/agentbox").glob(f"{digest}*"))
    return roots


def sandbox_ids(root: Path) -> set[str]:
    """Sandboxes created under `root` (its data dir and the runtime's bind tree for it)."""
    ids: set[str] = set()
    for r in owned_roots(root):
        for sdir in (r / "sandboxes", r, *r.glob("sandboxes-*")):
            if sdir.is_dir():
                ids |= {p.name for p in sdir.iterdir() if p.is_dir() and p.name.startswith("sbx")}
    return ids


def cgroup_pids(sid: str) -> set[int]:
    pids: set[int] = set()
    for d in _cgroup_dirs(sid):
        try:
            pids |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
        except (OSError, ValueError):
            pass
    return pids


def mounts_under(root: Path) -> list[str]:
    prefix = str(root).rstrip("/") + "/"
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mnt = line.split()[4].replace("\\040", " ")
            if (mnt + "/").startswith(prefix):
                found.append(mnt)
    return sorted(found, key=lambda m: m.count("/"), reverse=True)


def bwrap_pids_under(root: Path) -> list[int]:
    """bwrap processes whose command line names a path under `root` (their workspace bind)."""
    out = []
    needles = [str(r).encode() for r in owned_roots(root)]
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if os.path.basename(cmdline.split(b"\0", 1)[0]) == b"bwrap" and any(
                n in cmdline for n in needles):
            out.append(int(name))
    return out


def sweep(root: Path) -> None:
    """Kill, unmount and remove whatever sandboxes under `root` left behind."""
    ids = sandbox_ids(root)
    for pid in bwrap_pids_under(root):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for sid in ids:
        deadline = time.monotonic() + 5
        while (pids := cgroup_pids(sid)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
    for mnt in [m for r in owned_roots(root) for m in mounts_under(r)]:
        if subprocess.run(["umount", "-d", mnt], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", "-d", mnt], capture_output=True)
    for sid in ids:
        for d in _cgroup_dirs(sid):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def leftovers(root: Path) -> dict[str, Any]:
    ids = sandbox_ids(root)
    return {
        "bwrap_processes": bwrap_pids_under(root),
        "cgroup_processes": sorted(p for sid in ids for p in cgroup_pids(sid)),
        "mounts": [m for r in owned_roots(root) for m in mounts_under(r)],
        "cgroups": [str(d) for sid in ids for d in _cgroup_dirs(sid) if d.exists()],
        "loop_devices": loop_devices_under(root),
    }


@contextmanager
def scratch_dir(name: str) -> Iterator[Path]:
    """A temp dir swept like a server's data dir (for in-process runtime measurements)."""
    root = Path(tempfile.mkdtemp(prefix=f"agentbox-bench-{name}-"))
    _install_signal_handlers()
    try:
        yield root
    finally:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            sweep(root)
            left = leftovers(root)
            if any(left.values()):
                print(f"[cleanup] LEFTOVERS in {root}: {left}", file=sys.stderr)
            else:
                for r in owned_roots(root):
                    shutil.rmtree(r, ignore_errors=True)
        finally:
            signal.signal(signal.SIGINT, old)


# ---------------------------------------------------------------- HTTP helpers


def create_sandbox(c: httpx.Client, **body: Any) -> dict[str, Any]:
    r = c.post("/v1/sandboxes", json=body)
    if r.status_code != 201:
        raise RuntimeError(f"create failed: {r.status_code} {r.text[:500]}")
    return r.json()


def run_command(c: httpx.Client, sid: str, cmd: str) -> tuple[int | None, str]:
    """Foreground command over the NDJSON stream; (exit_code, stdout)."""
    out = []
    end: dict[str, Any] | None = None
    with c.stream("POST", f"/v1/sandboxes/{sid}/commands", json={"cmd": cmd}) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"command failed: {r.status_code} {r.text[:500]}")
        for line in r.iter_lines():
            if not line:
                continue
            ev = json.loads(line)
            if ev["type"] == "stdout":
                out.append(ev["data"])
            elif ev["type"] == "end":
                end = ev
            elif ev["type"] == "error":
                raise RuntimeError(f"command stream error: {ev}")
    if end is None:
        raise RuntimeError("command stream ended without an end event")
    return end["exit_code"], "".join(out)


def sdk_sandbox_class() -> tuple[Any, str]:
    """(Sandbox class, "") if the SDK imports, else (None, why not)."""
    try:
        from agentbox import Sandbox  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001 - any import failure means "no SDK yet"
        return None, f"{type(e).__name__}: {e}"
    return Sandbox, ""


# ---------------------------------------------------------------- profiling


class Profiler:
    """py-spy attached to the server for the duration of a `with` block (optional)."""

    def __init__(self, pid: int, out: Path, enabled: bool, rate: int = 250,
                 idle: bool = False) -> None:
        self.pid, self.out, self.enabled, self.rate, self.idle = pid, out, enabled, rate, idle
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Profiler:
        if not self.enabled:
            return self
        spy = Path(PYTHON).parent / "py-spy"
        if not spy.exists():
            print("py-spy is not installed (.venv/bin/pip install py-spy); not profiling",
                  file=sys.stderr)
            self.enabled = False
            return self
        self.out.parent.mkdir(parents=True, exist_ok=True)
        argv = [str(spy), "record", "-p", str(self.pid), "-r", str(self.rate), "--format",
                "raw", "-o", str(self.out), "--threads", "--nonblocking"]
        if self.idle:
            argv.append("--idle")
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def top(self, n: int = 15) -> list[tuple[str, float, float]]:
        """(frame, inclusive %, self %) of the busiest frames, as % of non-idle samples.

        Samples whose innermost frame is the event loop's or a worker's wait are idle and
        dropped; frames on (nearly) every remaining stack (the uvicorn/asyncio runner) are
        skipped because they say nothing.
        """
        if not self.enabled or not self.out.exists():
            return []
        idle_leaves = ("EpollSelector.select", "select (selectors", "_worker (concurrent",
                       "wait (threading.py", "_wait_for_tstate_lock", "get (queue.py")
        incl: dict[str, int] = {}
        own: dict[str, int] = {}
        total = 0
        for line in self.out.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            frames = [f for f in stack.split(";") if not f.startswith("thread (")
                      and not f.startswith("process ")]
            if not frames or frames[-1].startswith(idle_leaves):
                continue
            k = int(count)
            total += k
            for f in set(frames):
                incl[f] = incl.get(f, 0) + k
            own[frames[-1]] = own.get(frames[-1], 0) + k
        if not total:
            return []
        ours = [(f, 100 * c / total, 100 * own.get(f, 0) / total)
                for f, c in sorted(incl.items(), key=lambda kv: -kv[1])
                if "agentbox/" in f and c < 0.9 * total]
        leaves = [(f, 100 * incl[f] / total, 100 * c / total)
                  for f, c in sorted(own.items(), key=lambda kv: -kv[1])]
        return [(f"== {total} non-idle samples; agentbox frames by inclusive time ==", 0.0, 0.0),
                *ours[:n], ("== hottest leaf frames (self time) ==", 0.0, 0.0), *leaves[:n]]


# ---------------------------------------------------------------- reporting


def base_args(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", type=Path, help="also write the results here as JSON")
    p.add_argument("--profile", action="store_true",
                   help="attach py-spy to the server during the measured phase")
    return p


def emit(result: dict[str, Any], json_path: Path | None) -> None:
    result.setdefault("machine", machine())
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2, default=str))


def print_header(title: str) -> dict[str, Any]:
    m = machine()
    print(f"## {title}\n")
    print(f"machine: {machine_line(m)}")
    print(f"date: {m['date']}\n")
    return m


def memory_sampler(pid: int, interval: float = 0.02) -> tuple[threading.Event, list[int]]:
    """Start sampling a process's RSS (KiB) in a thread; set the event to stop."""
    stop = threading.Event()
    samples: list[int] = []

    def run() -> None:
        while not stop.is_set():
            samples.append(rss_kb(pid))
            stop.wait(interval)

    threading.Thread(target=run, daemon=True).start()
    return stop, samples


def host_bwrap_pids() -> list[int]:
    """Every bwrap process on the host (ours and anyone else's), like `pgrep bwrap`."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if Path(f"/proc/{name}/comm").read_text().strip() == "bwrap":
                    pids.append(int(name))
            except OSError:
                pass
    return pids


def host_bwrap_count() -> int:
    return len(host_bwrap_pids())


# ---------------------------------------------------------------- isolation from other servers

_CLONE_NEWNS = 0x00020000


def _cgroup_bases() -> list[Path]:
    if cgroup_version() == "v2":
        return [CGROUP_ROOT]
    return [CGROUP_ROOT / c for c in _V1_CONTROLLERS if (CGROUP_ROOT / c).is_dir()]


def loop_devices_under(root: Path) -> list[str]:
    """Loop devices whose backing file lives under `root` (a leaked workspace mount)."""
    out = []
    for f in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            backing = f.read_text().strip()
        except OSError:
            continue
        if any(backing.startswith(str(r) + "/") for r in owned_roots(root)):
            out.append(f"/dev/{f.parent.parent.name} -> {backing}")
    return out


def run_isolated(main: Callable[[], None]) -> None:
    """Run `main` in a private mount namespace whose `agentbox` cgroups are its own.

    A starting agentbox server treats every group under <cgroup>/agentbox/ that its database
    does not know as a stray and kills it (runtime.list_sandboxes reads the host-wide cgroup
    tree). Benchmarks sharing a host with other servers would kill their sandboxes, and have
    theirs killed. So this process unshares its mount namespace and binds a fresh
    `agentbox-bench-<pid>` group over `agentbox` in each controller; the server and the
    sandboxes it starts inherit that view. Everything else (kernel, cgroup controllers, loop
    devices, disks) is the host's, so the numbers are unaffected.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    mine: list[tuple[Path, Path]] = []
    if os.geteuid() == 0 and libc.unshare(_CLONE_NEWNS) == 0:
        subprocess.run(["mount", "--make-rprivate", "/"], check=True)
        for base in _cgroup_bases():
            target = base / "agentbox"
            target.mkdir(exist_ok=True)
            own = base / f"agentbox-bench-{os.getpid()}"
            own.mkdir(exist_ok=True)
            subprocess.run(["mount", "--bind", str(own), str(target)], check=True)
            mine.append((own, target))
    else:
        print("warning: cannot isolate the benchmark's cgroups from other agentbox servers",
              file=sys.stderr)
    try:
        main()
    finally:
        for own, target in mine:
            subprocess.run(["umount", "-l", str(target)], capture_output=True)
            for d in sorted(own.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                if d.is_dir():
                    try:
                        d.rmdir()
                    except OSError as e:
                        print(f"[cleanup] could not remove cgroup {d}: {e}", file=sys.stderr)
            try:
                own.rmdir()
            except OSError as e:
                print(f"[cleanup] could not remove cgroup {own}: {e}", file=sys.stderr)


def host_cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)
