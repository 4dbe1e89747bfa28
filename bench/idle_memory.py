"""Benchmark 5: host memory per idle sandbox, with 200 idle sandboxes.

Raises the admin tenant's quota, creates N sandboxes (small disks), lets them settle, then sums
the PSS (/proc/<pid>/smaps_rollup) of every process in every sandbox's cgroup. Also reported:
RSS of the same processes (what PSS shares out), the server's own RSS growth, the cgroups'
memory.usage_in_bytes / memory.current (includes page cache and kernel memory charged to the
sandbox), and the host-wide change in used memory and slab (kernel objects for namespaces,
mounts, loop devices, which no cgroup is charged for). Floor, same run: PSS of one bare
`bwrap --unshare-all --ro-bind / / sleep` process tree.

    .venv/bin/python bench/idle_memory.py [--count 200] [--disk-mb 64] [--json out.json]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

GOAL_MIB = 3.0  # issue 19 (the original goal, issue 1, was 8)


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = int(v.split()[0])
    return out


def used_kb(mi: dict[str, int]) -> int:
    return mi["MemTotal"] - mi["MemAvailable"]


def cgroup_memory_bytes(sid: str) -> int | None:
    name = "memory.current" if H.cgroup_version() == "v2" else "memory.usage_in_bytes"
    for d in H._cgroup_dirs(sid):
        try:
            return int((d / name).read_text())
        except (OSError, ValueError):
            continue
    return None


def zygote_pids(server_pid: int) -> list[int]:
    """The server's zygote (the process the agents are forked from, AGENTBOX_AGENT_START=fork):
    a direct child of the server running Python with `-I -S -c`, not in any sandbox."""
    try:
        kids = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    except OSError:
        return []
    found = []
    for kid in kids:
        try:
            argv = Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:4] == [b"-I", b"-S", b"-c"]:
            found.append(int(kid))
    return found


def bwrap_floor() -> tuple[int, int]:
    """(PSS KiB, process count) of a bare bwrap tree idling in `sleep`."""
    p = subprocess.Popen(["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/",
                          "--", "sleep", "60"])
    try:
        time.sleep(0.5)
        pids = [p.pid]
        for _ in range(3):
            kids = []
            for pid in pids:
                try:
                    kids += [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children")
                             .read_text().split()]
                except OSError:
                    pass
            pids = sorted(set(pids + kids))
        return sum(H.pss_kb(pid) for pid in pids), len(pids)
    finally:
        p.kill()
        p.wait()


def main() -> None:
    p = H.base_args(__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=200, help="idle sandboxes (default 200)")
    p.add_argument("--disk-mb", type=int, default=64, help="resources.disk_mb (default 64)")
    p.add_argument("--clients", type=int, default=4, help="concurrent creators (default 4)")
    p.add_argument("--settle", type=float, default=3.0, help="seconds idle before measuring")
    args = p.parse_args()
    mach = H.print_header(f"Benchmark 5: host memory per idle sandbox ({args.count} sandboxes)")
    result: dict[str, Any] = {"name": "idle_memory", "machine": mach,
                              "command": " ".join(["bench/idle_memory.py", *sys.argv[1:]])}
    floor_pss, floor_procs = bwrap_floor()
    print(f"floor: bare bwrap tree idling in sleep: PSS {floor_pss / 1024:.2f} MiB "
          f"({floor_procs} processes)")
    with H.BenchServer("memory") as srv:
        srv.set_quota(max_sandboxes=max(1000, args.count + 10), max_memory_mb=4096,
                      max_total_descriptors=1 << 40)
        time.sleep(1)
        rss0 = H.rss_kb(srv.pid)
        mi0 = meminfo()
        ids: list[str] = []
        errors: list[str] = []
        lock = threading.Lock()
        todo = list(range(args.count))

        def work() -> None:
            with srv.client(timeout=120) as c:
                while True:
                    with lock:
                        if not todo:
                            return
                        todo.pop()
                    r = c.post("/v1/sandboxes", json={"timeout": 3600,
                                                      "resources": {"disk_mb": args.disk_mb}})
                    with lock:
                        if r.status_code == 201:
                            ids.append(r.json()["sandbox_id"])
                        else:
                            errors.append(f"{r.status_code} {r.text[:200]}")

        t0 = time.perf_counter()
        threads = [threading.Thread(target=work) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        made_s = time.perf_counter() - t0
        print(f"created {len(ids)} sandboxes in {made_s:.1f} s ({len(errors)} errors"
              f"{': ' + errors[0] if errors else ''})")
        time.sleep(args.settle)
        per_pss, per_rss, per_cg, per_procs = [], [], [], []
        for sid in ids:
            pids = H.cgroup_pids(sid)
            per_procs.append(len(pids))
            per_pss.append(sum(H.pss_kb(pid) for pid in pids))
            per_rss.append(sum(H.rss_kb(pid) for pid in pids))
            cg = cgroup_memory_bytes(sid)
            if cg is not None:
                per_cg.append(cg / 1024)
        rss1 = H.rss_kb(srv.pid)
        mi1 = meminfo()
        n = max(1, len(ids))
        # A forked agent shares its pages with the zygote it came from, so its PSS is lower
        # and the zygote holds the rest: the zygote's PSS is shared out over the sandboxes.
        zygote_kb = sum(H.pss_kb(pid) for pid in zygote_pids(srv.pid))
        total_pss = sum(per_pss) + zygote_kb
        print(f"\nper idle sandbox ({len(ids)} sandboxes, "
              f"{statistics.median(per_procs) if per_procs else 0:.0f} processes each):")
        print(f"  PSS of its processes: mean {total_pss / n / 1024:.2f} MiB, p50 "
              f"{H.percentile(per_pss, 50) / 1024:.2f}, p99 {H.percentile(per_pss, 99) / 1024:.2f} "
              f"MiB (total {total_pss / 1024:.0f} MiB)")
        print(f"  of which the zygote's share (its PSS {zygote_kb / 1024:.2f} MiB over {n}): "
              f"{zygote_kb / n / 1024:.3f} MiB; p50 and p99 leave it out")
        print(f"  RSS of its processes (shared pages counted each time): mean "
              f"{sum(per_rss) / n / 1024:.2f} MiB")
        if per_cg:
            print(f"  cgroup memory usage (incl. page cache, kmem): mean "
                  f"{sum(per_cg) / len(per_cg) / 1024:.2f} MiB, p99 "
                  f"{H.percentile(per_cg, 99) / 1024:.2f} MiB")
        print(f"  server RSS: {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MiB "
              f"(+{(rss1 - rss0) / n:.0f} KiB per sandbox)")
        used = used_kb(mi1) - used_kb(mi0)
        slab = (mi1["Slab"] - mi0["Slab"])
        print(f"  host used memory (MemTotal-MemAvailable) grew {used / 1024:.0f} MiB = "
              f"{used / n / 1024:.2f} MiB per sandbox, of which slab {slab / n / 1024:.2f} MiB "
              "(host-wide: includes anything else running)")
    mean = total_pss / n / 1024
    row = {"metric": f"host memory (PSS) per idle sandbox, {len(ids)} idle",
           "goal": f"<= {GOAL_MIB:g} MiB", "p50": H.percentile(per_pss, 50) / 1024,
           "p99": H.percentile(per_pss, 99) / 1024, "mean": mean, "unit": "MiB",
           "met": mean <= GOAL_MIB and not errors,
           "floor": f"bare bwrap tree PSS {floor_pss / 1024:.2f} MiB",
           "zygote_pss_kb": zygote_kb,
           "ratio": f"server +{(rss1 - rss0) / n:.0f} KiB/sandbox; host used "
                    f"+{used / n / 1024:.2f} MiB/sandbox"}
    print(f"\nRESULT: PSS per idle sandbox mean {mean:.2f} MiB (p50 {row['p50']:.2f}, p99 "
          f"{row['p99']:.2f}); goal <= {GOAL_MIB:g} MiB: {'MET' if row['met'] else 'MISSED'}")
    print(f"leftovers after cleanup: {srv.leftovers}; host bwrap processes now: "
          f"{H.host_bwrap_count()}")
    result.update(rows=[row], created=len(ids), errors=errors, create_seconds=made_s,
                  server_rss_kb=[rss0, rss1], host_used_growth_kb=used, slab_growth_kb=slab,
                  cgroup_usage_kb=H.summarize(per_cg), rss_per_sandbox_kb=sum(per_rss) / n,
                  floor_pss_kb=floor_pss, leftovers=srv.leftovers)
    H.emit(result, args.json)


if __name__ == "__main__":
    H.run_isolated(main)
