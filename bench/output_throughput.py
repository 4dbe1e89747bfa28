"""Benchmark 6: 1 GiB of command output streamed from a sandbox to a client, in MB/s.

A foreground command in a default sandbox (1 CPU) prints `--size-mb` MiB; the client counts
what it receives and checks it is all there (the agent holds the command back while a client is
attached, so nothing may be dropped). Producers: NUL bytes (`head -c N /dev/zero`, the worst
case for JSON: each byte becomes `\\u0000`), `yes` (2-byte lines) and `seq` (numbers, one per
line). Paths, each timed from the request to the `end` event:

- SDK: `Sandbox.commands.run(cmd, on_stdout=cb)` (sync), `cb` counting characters (the
  producers print ASCII, so characters are bytes);
- HTTP: `POST /v1/sandboxes/{id}/commands` read raw with httpx, split into NDJSON lines and
  `json.loads`-ed, the minimum a client must do;
- HTTP bytes: the same response only counted, not parsed (the server's relay without the
  client's decoding; completeness is not checked on this path, only the exit code);
- agent socket: `exec.run` straight on the sandbox agent's Unix socket (no HTTP, no JSON per
  chunk), to separate the agent from the server's relay.

Floors, same run: the host running the same producer into `cat > /dev/null`, free and pinned to
one CPU (a default sandbox's share), and into a pipe read by Python with 64 KiB `os.read`s (what
the agent does). CPU seconds of the client, the server and the agent (with the producer) are
reported per path, which is where the time goes on 2 cores.

    .venv/bin/python bench/output_throughput.py [--size-mb 1024] [--reps 3]
        [--producers zero,yes,seq] [--paths sdk,http,agent] [--cpus 1] [--json out.json]
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

MiB = 1 << 20
MB = 1_000_000
PRODUCERS = {
    "zero": "head -c {n} /dev/zero",
    "yes": "yes | head -c {n}",
    "seq": "seq 1000000000 | head -c {n}",
}
PATHS = ("sdk", "http", "http-bytes", "agent")


@dataclass
class Run:
    """One transfer: bytes of output received, wall seconds, CPU seconds by process."""

    got: int
    seconds: float
    wire: int = 0  # bytes on the HTTP response (NDJSON), when known
    cpu: dict[str, float] | None = None


# ---------------------------------------------------------------- floors


def host_cat(cmd: str, pin: bool) -> Run:
    """The producer into `cat > /dev/null` on the host; `pin` = on one CPU, as a sandbox."""
    argv = ["bash", "-c", f"{cmd} | cat > /dev/null"]
    if pin:
        argv = ["taskset", "-c", "0", *argv]
    t0 = time.perf_counter()
    subprocess.run(argv, check=True)
    return Run(-1, time.perf_counter() - t0)


def host_python_pipe(cmd: str) -> Run:
    """The producer into a pipe that this process drains with 64 KiB reads, like the agent."""
    t0 = time.perf_counter()
    p = subprocess.Popen(["bash", "-c", cmd], stdout=subprocess.PIPE)
    assert p.stdout is not None
    fd, got = p.stdout.fileno(), 0
    while data := os.read(fd, 65536):
        got += len(data)
    p.wait()
    return Run(got, time.perf_counter() - t0)


# ---------------------------------------------------------------- through a sandbox


def via_sdk(sbx: Any, cmd: str) -> Run:
    got = 0

    def count(text: str) -> None:
        nonlocal got
        got += len(text)

    t0 = time.perf_counter()
    result = sbx.commands.run(cmd, on_stdout=count, timeout=0)
    dt = time.perf_counter() - t0
    assert result.exit_code == 0 and not result.dropped_bytes, result.error
    return Run(got, dt)


def via_http(c: httpx.Client, sid: str, cmd: str) -> Run:
    """NDJSON off the wire: split lines, json.loads each, count the output characters."""
    got = wire = 0
    end: dict[str, Any] | None = None
    rest = b""
    t0 = time.perf_counter()
    with c.stream("POST", f"/v1/sandboxes/{sid}/commands", json={"cmd": cmd, "timeout": 0}) as r:
        r.raise_for_status()
        for chunk in r.iter_raw(MiB):
            wire += len(chunk)
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            for line in lines:
                ev = json.loads(line)
                if ev["type"] == "stdout":
                    got += len(ev["data"])
                elif ev["type"] == "end":
                    end = ev
                elif ev["type"] in ("error", "truncated"):
                    raise AssertionError(f"output lost: {ev}")
    dt = time.perf_counter() - t0
    assert end is not None and end["exit_code"] == 0, end
    return Run(got, dt, wire)


def via_http_bytes(c: httpx.Client, sid: str, cmd: str) -> Run:
    """The same response, only counted (not parsed): what the server alone can relay.
    Output is not checked byte by byte here, only the exit code in the final `end` event."""
    wire = 0
    tail = b""
    t0 = time.perf_counter()
    with c.stream("POST", f"/v1/sandboxes/{sid}/commands", json={"cmd": cmd, "timeout": 0}) as r:
        r.raise_for_status()
        for chunk in r.iter_raw(MiB):
            wire += len(chunk)
            tail = (tail + chunk)[-4096:]
    dt = time.perf_counter() - t0
    end = json.loads(tail.rstrip(b"\n").rsplit(b"\n", 1)[-1])
    assert end["type"] == "end" and end["exit_code"] == 0, end
    return Run(-1, dt, wire)


async def _agent_exec(sock: Path, cmd: str) -> Run:
    from agentbox.agent.client import AgentClient, OutputChunk

    got = 0
    end = None
    t0 = time.perf_counter()
    _, events = await AgentClient(sock).command_stream({"op": "exec.run", "cmd": cmd, "timeout": 0})
    async for ev in events:
        if isinstance(ev, OutputChunk):
            got += len(ev.data)
        elif ev.get("type") == "end":
            end = ev
    dt = time.perf_counter() - t0
    assert end is not None and end["exit_code"] == 0, end
    return Run(got, dt)


def via_agent(sock: Path, cmd: str) -> Run:
    return asyncio.run(_agent_exec(sock, cmd))


# ---------------------------------------------------------------- CPU accounting


def proc_cpu(pid: int | None, children: bool = False) -> float:
    """User + system CPU seconds of a process (all its threads), or of its reaped children."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    first = 13 if children else 11  # cutime, cstime: the command, once the agent reaped it
    return (int(fields[first]) + int(fields[first + 1])) / os.sysconf("SC_CLK_TCK")


def measured(fn: Callable[[], Run], server: int, agent: int | None) -> Run:
    """Run fn with the CPU of this process, the server, the agent and the command around it."""

    def snap() -> dict[str, float]:
        t = os.times()
        return {
            "client": t.user + t.system,
            "server": proc_cpu(server),
            "agent": proc_cpu(agent),
            "command": proc_cpu(agent, children=True),
        }

    before = snap()
    run = fn()
    after = snap()
    run.cpu = {k: after[k] - before[k] for k in before}
    return run


def agent_pid(sid: str) -> int | None:
    for pid in sorted(H.cgroup_pids(sid)):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip().startswith("python"):
                return pid
        except OSError:
            pass
    return None


# ---------------------------------------------------------------- main


def main() -> None:
    p = H.base_args(__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024, help="output per command, MiB")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each path (default 3)")
    p.add_argument(
        "--producers",
        default=",".join(PRODUCERS),
        help=f"comma-separated subset of {', '.join(PRODUCERS)}",
    )
    p.add_argument(
        "--paths", default=",".join(PATHS), help=f"comma-separated subset of {', '.join(PATHS)}"
    )
    p.add_argument(
        "--cpus",
        type=float,
        default=None,
        help="the sandbox's cpu_count (default: the server's default, 1)",
    )
    args = p.parse_args()
    producers = args.producers.split(",")
    paths = args.paths.split(",")
    nbytes = args.size_mb * MiB
    mach = H.print_header(f"Benchmark 6: {args.size_mb} MiB of command output to a client")
    result: dict[str, Any] = {
        "name": "output_throughput",
        "machine": mach,
        "command": " ".join(["bench/output_throughput.py", *sys.argv[1:]]),
    }
    runs: dict[tuple[str, str], list[Run]] = {}

    def record(producer: str, path: str, run: Run) -> None:
        if run.got >= 0:
            assert run.got == nbytes, f"{producer}/{path}: got {run.got} of {nbytes} bytes"
        runs.setdefault((producer, path), []).append(run)
        cpu = "".join(f", {k} {v:.2f} s" for k, v in (run.cpu or {}).items())
        wire = f", {run.wire / nbytes:.2f} wire bytes per byte" if run.wire else ""
        print(
            f"  {producer:5s} {path:24s} {nbytes / MB / run.seconds:8.0f} MB/s "
            f"({run.seconds:.2f} s{cpu}{wire})",
            flush=True,
        )

    body: dict[str, Any] = {"timeout": 3600}
    if args.cpus:
        body["resources"] = {"cpu_count": args.cpus}
    with H.BenchServer("output") as srv, srv.client(timeout=600) as c:
        sid = H.create_sandbox(c, **body)["sandbox_id"]
        state = json.loads((srv.data_dir / "sandboxes" / sid / "runtime.json").read_text())
        sock = Path(state["socket"])
        apid = agent_pid(sid)
        Sandbox, why = H.sdk_sandbox_class()
        if Sandbox is None:
            raise SystemExit(f"the SDK does not import: {why}")
        sbx = Sandbox.connect(sid, api_key=H.ADMIN_KEY, api_url=srv.url)
        sbx.commands.run("true")  # the agent's lazy imports, the SDK's connection
        ways: dict[str, Callable[[str], Run]] = {
            "sdk": lambda cmd: via_sdk(sbx, cmd),
            "http": lambda cmd: via_http(c, sid, cmd),
            "http-bytes": lambda cmd: via_http_bytes(c, sid, cmd),
            "agent": lambda cmd: via_agent(sock, cmd),
        }
        prof = H.Profiler(
            srv.pid, H.ROOT / "bench/results/output_throughput.pyspy.txt", args.profile
        )
        with prof:
            for rep in range(args.reps):
                print(f"rep {rep + 1}:")
                for producer in producers:
                    cmd = PRODUCERS[producer].format(n=nbytes)
                    record(producer, "host: | cat", host_cat(cmd, pin=False))
                    record(producer, "host: | cat, 1 CPU", host_cat(cmd, pin=True))
                    record(producer, "host: pipe read by Python", host_python_pipe(cmd))
                    for path in paths:
                        record(producer, path, measured(partial(ways[path], cmd), srv.pid, apid))
        sbx.close()
    rows = report(runs, producers, paths, nbytes)
    if prof_rows := prof.top(20):
        print("\npy-spy on the server, all paths (inclusive %, self %):")
        for frame, inc, own in prof_rows:
            print(f"  {inc:5.1f}% {own:5.1f}%  {frame}")
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"\nbenchmark process peak RSS: {maxrss:.0f} MiB (the SDK keeps a foreground "
        "command's whole output for its result)"
    )
    print(
        f"leftovers after cleanup: {srv.leftovers}; host bwrap processes now: "
        f"{H.host_bwrap_count()}"
    )
    result.update(
        rows=rows,
        size_bytes=nbytes,
        client_peak_rss_mib=maxrss,
        runs={f"{k[0]}/{k[1]}": [r.__dict__ for r in v] for k, v in runs.items()},
        leftovers=srv.leftovers,
    )
    H.emit(result, args.json)


def report(
    runs: dict[tuple[str, str], list[Run]], producers: list[str], paths: list[str], nbytes: int
) -> list[dict[str, Any]]:
    """Medians per producer and path; one summary row per producer for run_all."""

    def med(producer: str, path: str) -> float:
        return statistics.median(nbytes / MB / r.seconds for r in runs[(producer, path)])

    def worst(producer: str, path: str) -> float:
        return min(nbytes / MB / r.seconds for r in runs[(producer, path)])

    print("\nmedian MB/s (worst), CPU seconds per GiB (median): client / server / agent / command")
    rows = []
    for producer in producers:
        print(f"  {PRODUCERS[producer].format(n=nbytes)}")
        for path in ["host: | cat", "host: | cat, 1 CPU", "host: pipe read by Python", *paths]:
            rs = runs[(producer, path)]
            line = f"    {path:26s} {med(producer, path):7.0f} ({worst(producer, path):.0f})"
            if rs[0].cpu:
                per_gib = {
                    k: statistics.median(r.cpu[k] for r in rs if r.cpu) * (1 << 30) / nbytes
                    for k in rs[0].cpu
                }
                line += "   cpu/GiB " + " / ".join(
                    f"{per_gib[k]:.1f}" for k in ("client", "server", "agent", "command")
                )
            if rs[0].wire:
                line += f"   NDJSON {rs[0].wire / nbytes:.2f} bytes per output byte"
            print(line)
        main_path = paths[0]
        floor, pinned = med(producer, "host: | cat"), med(producer, "host: | cat, 1 CPU")
        # Rows are cells of run_all's Markdown table: a bare `|` would split them.
        shown = PRODUCERS[producer].format(n=nbytes).replace("|", "\\|")
        rows.append(
            {
                "metric": f"`{shown}` to a client via {main_path} (all bytes checked)",
                "goal": "-",
                "p50": med(producer, main_path),
                "p99": worst(producer, main_path),
                "unit": "MB/s",
                "met": True,
                "floor": f"host `producer \\| cat > /dev/null`: {floor:.0f} MB/s "
                f"(1 CPU: {pinned:.0f})",
                "ratio": f"{med(producer, main_path) / floor:.3f}x floor",
            }
        )
    return rows


if __name__ == "__main__":
    H.run_isolated(main)
