"""The API beside many idle sandboxes: its latencies with 10 idle, then with 2,000.

Issue 19's idle-memory goal has a second half: 2,000 idle sandboxes with the API's p99 within
1.5x of its p99 at 10 idle. One server; its admin tenant's quota raised; the same probes run
twice, first with `--low` idle sandboxes (default 10), then after more are created (4 clients)
until `--count` are idle (default 2,000), or until the host's available memory falls below
`--min-avail-gib` (a safety stop, reported). The probes, in the tenant that holds the idle
sandboxes (the harder case: its quota checks sum over all of them):

- `GET /v1/sandboxes/{id}` of one sandbox (`--gets`, default 200);
- an exec round trip of `true` in it (`--execs`, default 200);
- the first page of `GET /v1/sandboxes?limit=10` (`--lists`, default 50): a full page in both
  phases;
- a cold create (answer of the POST) and its DELETE (`--creates`, default 20).

Also per phase: the server's CPU while nothing is asked of it (5 s), its RSS, the mounts in its
mount namespace, and a floor: bare `bwrap` running /bin/true from that namespace (the benchmark
shares it), which copies every mount in it, as each sandbox's bwrap does. The result is each
probe's p99 at N over its p99 at `--low`; the goal is every ratio <= 1.5.

    .venv/bin/python bench/idle_scale.py [--count 2000] [--low 10] [--disk-mb 64]
        [--min-avail-gib 3] [--json out.json]
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

GOAL_RATIO = 1.5
PROBES = ("GET sandbox", "exec true", "list first page", "create (cold)", "delete")
FLOOR = "floor: bare bwrap /bin/true"


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fill(srv: H.BenchServer, ids: list[str], target: int, body: dict[str, Any],
         min_avail: float, clients: int = 4) -> tuple[list[str], str | None]:
    """Create idle sandboxes until `target` are live; (errors, why it stopped early)."""
    lock = threading.Lock()
    errors: list[str] = []
    stop: list[str] = []

    def work() -> None:
        with srv.client(timeout=300) as c:
            while True:
                with lock:
                    if stop or len(ids) + len(errors) >= target or len(errors) > 5:
                        return
                    if len(ids) % 50 == 0 and mem_available_gib() < min_avail:
                        stop.append(f"host available memory below {min_avail} GiB")
                        return
                    ids.append("")  # a place held
                r = c.post("/v1/sandboxes", json=body)
                with lock:
                    ids.remove("")
                    if r.status_code == 201:
                        ids.append(r.json()["sandbox_id"])
                    else:
                        errors.append(f"{r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=work) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors, stop[0] if stop else None


def probe(c: httpx.Client, sid: str, args: Any, body: dict[str, Any]) -> dict[str, list[float]]:
    """Every probe, interleaved where they are cheap; milliseconds."""
    out: dict[str, list[float]] = {k: [] for k in PROBES}

    def timed(name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        value = fn()
        out[name].append((time.perf_counter() - t0) * 1000)
        return value

    def get() -> None:
        c.get(f"/v1/sandboxes/{sid}").raise_for_status()

    def run() -> None:
        code, _ = H.run_command(c, sid, "true")
        assert code == 0

    def listed() -> None:
        c.get("/v1/sandboxes", params={"limit": 10}).raise_for_status()

    for _ in range(3):  # warm-up
        get(), run(), listed()
    for i in range(max(args.gets, args.execs, args.lists)):
        if i < args.gets:
            timed("GET sandbox", get)
        if i < args.execs:
            timed("exec true", run)
        if i < args.lists:
            timed("list first page", listed)
    out[FLOOR] = []
    for _ in range(args.creates):
        new = timed("create (cold)", lambda: H.create_sandbox(c, **body))["sandbox_id"]
        timed("delete", lambda new=new: c.delete(f"/v1/sandboxes/{new}").raise_for_status())
        timed(FLOOR, lambda: subprocess.run(H.BARE_BWRAP, check=True))
    return out


def phase(srv: H.BenchServer, sid: str, live: int, args: Any,
          body: dict[str, Any]) -> dict[str, Any]:
    time.sleep(args.settle)
    cpu0, t0 = cpu_seconds(srv.pid), time.monotonic()
    time.sleep(5)
    idle_cpu = (cpu_seconds(srv.pid) - cpu0) / (time.monotonic() - t0)
    with srv.client(timeout=120) as c:
        times = probe(c, sid, args, body)
    mounts = len(Path(f"/proc/{srv.pid}/mountinfo").read_text().splitlines())
    print(f"\nwith {live} idle sandboxes: server CPU while idle {idle_cpu * 100:.1f} % of a "
          f"core, RSS {H.rss_kb(srv.pid) / 1024:.0f} MiB, {mounts} mounts in its namespace, "
          f"host available {mem_available_gib():.1f} GiB")
    H.print_timings(times, 28)
    return {"live": live, "idle_cpu": idle_cpu, "rss_kb": H.rss_kb(srv.pid), "mounts": mounts,
            "timings": {k: H.summarize(v) for k, v in times.items()}}


def main() -> None:
    p = H.base_args(__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=2000, help="idle sandboxes at the end")
    p.add_argument("--low", type=int, default=10, help="idle sandboxes at the start")
    p.add_argument("--disk-mb", type=int, default=64, help="resources.disk_mb of each")
    p.add_argument("--min-avail-gib", type=float, default=3.0,
                   help="stop creating when the host's available memory falls below this")
    p.add_argument("--gets", type=int, default=200)
    p.add_argument("--execs", type=int, default=200)
    p.add_argument("--lists", type=int, default=50)
    p.add_argument("--creates", type=int, default=20)
    p.add_argument("--settle", type=float, default=3.0, help="seconds idle before probing")
    args = p.parse_args()
    mach = H.print_header(f"The API beside idle sandboxes: {args.low}, then {args.count}")
    result: dict[str, Any] = {"name": "idle_scale", "machine": mach,
                              "command": " ".join(["bench/idle_scale.py", *sys.argv[1:]])}
    body = {"timeout": 7200, "resources": {"disk_mb": args.disk_mb}}
    with H.BenchServer("idle-scale") as srv:
        room = args.count + args.creates + 10
        srv.set_quota(max_sandboxes=room, max_total_disk_mb=room * args.disk_mb * 2,
                      max_total_descriptors=2**40)
        ids: list[str] = []
        errors, stopped = fill(srv, ids, args.low, body, args.min_avail_gib)
        if errors or not ids:
            raise SystemExit(f"could not create the first sandboxes: {errors}")
        low = phase(srv, ids[0], len(ids), args, body)
        t0 = time.perf_counter()
        errors, stopped = fill(srv, ids, args.count, body, args.min_avail_gib)
        made_s = time.perf_counter() - t0
        print(f"\ncreated {len(ids) - args.low} more in {made_s:.0f} s ({len(errors)} errors"
              f"{': ' + errors[0] if errors else ''}){'; stopped: ' + stopped if stopped else ''}")
        high = phase(srv, ids[0], len(ids), args, body)
        t0 = time.perf_counter()
        killed = srv.kill_all_sandboxes()
        print(f"killed {killed} sandboxes in {time.perf_counter() - t0:.1f} s")
    rows = []
    lo, hi = low["timings"][FLOOR], high["timings"][FLOOR]
    print(f"floor: bare bwrap p50 {lo['p50']:.2f} -> {hi['p50']:.2f} ms, p99 {lo['p99']:.2f} -> "
          f"{hi['p99']:.2f} with {low['mounts']} -> {high['mounts']} mounts in the namespace")
    for name in PROBES:
        lo, hi = low["timings"][name], high["timings"][name]
        ratio = hi["p99"] / lo["p99"]
        rows.append({"metric": f"{name}: p99 with {high['live']} idle over p99 with "
                     f"{low['live']}", "p50": hi["p50"], "p99": hi["p99"], "unit": "ms",
                     "floor": f"p50 {lo['p50']:.2f}, p99 {lo['p99']:.2f} ms at {low['live']}",
                     "ratio": f"{ratio:.2f}x", "goal": f"<= {GOAL_RATIO}x",
                     "met": ratio <= GOAL_RATIO and not errors and high["live"] >= args.count})
        print(f"RESULT: {name}: p99 {lo['p99']:.2f} -> {hi['p99']:.2f} ms ({ratio:.2f}x; p50 "
              f"{lo['p50']:.2f} -> {hi['p50']:.2f}) with {low['live']} -> {high['live']} idle;"
              f" goal <= {GOAL_RATIO}x: {'MET' if rows[-1]['met'] else 'MISSED'}")
    print(f"leftovers after cleanup: {srv.leftovers}; host bwrap processes now: "
          f"{H.host_bwrap_count()}")
    result.update(rows=rows, low=low, high=high, errors=errors, stopped=stopped,
                  fill_seconds=made_s, leftovers=srv.leftovers)
    H.emit(result, args.json)


if __name__ == "__main__":
    H.run_isolated(main)
