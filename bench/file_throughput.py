"""Benchmark 3: 1 GiB written then read through the files API, and the server's memory meanwhile.

`PUT /v1/sandboxes/{id}/files?path=...` with the body streamed from a generator (chunked, 1 MiB
pieces), then `GET` of the same file streamed to /dev/null. The server's RSS (and the in-sandbox
agent's) is sampled every 20 ms during each transfer and compared with its idle RSS: a server
that buffers files would grow by about the file size. Floor, same run: the host writing and
reading the same amount straight into the sandbox's workspace filesystem (same loop-mounted
ext4 image), no API.

    .venv/bin/python bench/file_throughput.py [--size-mb 1024] [--reps 2] [--json out.json]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

GOAL_MBPS = 300.0
CHUNK = 1 << 20
MB = 1_000_000


def body(size_mb: int) -> Iterator[bytes]:
    block = os.urandom(CHUNK)
    for _ in range(size_mb):
        yield block


def agent_pid(sid: str) -> int | None:
    for pid in sorted(H.cgroup_pids(sid)):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip().startswith("python"):
                return pid
        except OSError:
            pass
    return None


def host_floor(ws: Path, size_mb: int) -> tuple[float, float]:
    """MB/s writing then reading `size_mb` MiB straight into the workspace filesystem."""
    path = ws / "floor.bin"
    block = os.urandom(CHUNK)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(size_mb):
            f.write(block)
    t1 = time.perf_counter()
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            n += len(chunk)
    t2 = time.perf_counter()
    path.unlink()
    assert n == size_mb * CHUNK
    return n / MB / (t1 - t0), n / MB / (t2 - t1)


def main() -> None:
    p = H.base_args(__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024, help="file size in MiB (default 1024)")
    p.add_argument("--reps", type=int, default=2, help="write+read repetitions (default 2)")
    args = p.parse_args()
    mach = H.print_header(f"Benchmark 3: {args.size_mb} MiB write then read via the files API")
    result: dict[str, Any] = {"name": "file_throughput", "machine": mach,
                              "command": " ".join(["bench/file_throughput.py", *sys.argv[1:]])}
    disk = max(2048, args.size_mb * 2)
    nbytes = args.size_mb * CHUNK
    writes, reads, peaks_w, peaks_r, agent_peaks = [], [], [], [], []
    floors: list[tuple[float, float]] = []
    plain: list[tuple[float, float]] = []  # same disk, no loop device
    with H.BenchServer("files") as srv:
        with srv.client(timeout=600) as c:
            sid = H.create_sandbox(c, timeout=3600, resources={
                "disk_mb": disk, "file_size_mb": disk})["sandbox_id"]
            state = json.loads((srv.data_dir / "sandboxes" / sid / "runtime.json").read_text())
            ws = Path(state["socket"]).parent / "workspace"
            apid = agent_pid(sid)
            # Warm the path once with a small file, then measure idle RSS for a second.
            c.put(f"/v1/sandboxes/{sid}/files", params={"path": "warm.bin"},
                  content=body(8)).raise_for_status()
            c.get(f"/v1/sandboxes/{sid}/files", params={"path": "warm.bin"}).raise_for_status()
            time.sleep(0.5)
            stop, idle_samples = H.memory_sampler(srv.pid)
            time.sleep(1.0)
            stop.set()
            idle = int(statistics.median(idle_samples))
            agent_idle = H.rss_kb(apid) if apid else 0
            for rep in range(args.reps):
                floors.append(host_floor(ws, args.size_mb))
                plain.append(host_floor(srv.root, args.size_mb))
                stop, samples = H.memory_sampler(srv.pid)
                astop, asamples = H.memory_sampler(apid) if apid else (None, [])
                t0 = time.perf_counter()
                r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": "big.bin"},
                          content=body(args.size_mb))
                t1 = time.perf_counter()
                stop.set()
                r.raise_for_status()
                assert r.json()["size"] == nbytes, r.json()
                writes.append(nbytes / MB / (t1 - t0))
                peaks_w.append(max(samples))
                stop, samples = H.memory_sampler(srv.pid)
                got = 0
                t0 = time.perf_counter()
                with c.stream("GET", f"/v1/sandboxes/{sid}/files",
                              params={"path": "big.bin"}) as resp:
                    resp.raise_for_status()
                    for chunk in resp.iter_raw(CHUNK):
                        got += len(chunk)
                t1 = time.perf_counter()
                stop.set()
                if astop:
                    astop.set()
                assert got == nbytes, (got, nbytes)
                reads.append(nbytes / MB / (t1 - t0))
                peaks_r.append(max(samples))
                agent_peaks.append(max(asamples) if asamples else 0)
                c.delete(f"/v1/sandboxes/{sid}/files", params={"path": "big.bin"})
                print(f"  rep {rep + 1}: write {writes[-1]:.0f} MB/s (server peak RSS "
                      f"{peaks_w[-1] / 1024:.0f} MiB), read {reads[-1]:.0f} MB/s (peak "
                      f"{peaks_r[-1] / 1024:.0f} MiB); host floor write {floors[-1][0]:.0f} "
                      f"/ read {floors[-1][1]:.0f} MB/s; host, plain dir on the same disk "
                      "(no loop): "
                      f"write {plain[-1][0]:.0f} / read {plain[-1][1]:.0f} MB/s")
    w, rd = statistics.median(writes), statistics.median(reads)
    fw = statistics.median(f[0] for f in floors)
    fr = statistics.median(f[1] for f in floors)
    pw = statistics.median(f[0] for f in plain)
    peak = max(peaks_w + peaks_r)
    print(f"\nserver RSS: idle {idle / 1024:.1f} MiB, peak during transfers {peak / 1024:.1f} MiB "
          f"(+{(peak - idle) / 1024:.1f} MiB for a {args.size_mb} MiB file)")
    if apid:
        print(f"agent RSS: idle {agent_idle / 1024:.1f} MiB, "
              f"peak {max(agent_peaks) / 1024:.1f} MiB")
    rows = []
    for label, val, floor in (("write", w, fw), ("read", rd, fr)):
        rows.append({"metric": f"files API {label}, {args.size_mb} MiB streamed",
                     "goal": f">= {GOAL_MBPS:.0f} MB/s", "p50": val,
                     "p99": min(writes if label == "write" else reads), "unit": "MB/s",
                     "met": val >= GOAL_MBPS,
                     "floor": f"host {label} into the same loop-mounted workspace fs: "
                              f"{floor:.0f} MB/s"
                              + (f" (plain dir, no loop: {pw:.0f} MB/s)" if label == "write"
                                 else ""),
                     "ratio": f"{val / floor:.2f}x floor"})
        print(f"RESULT: {label}: median {val:.0f} MB/s over {args.reps} reps (worst "
              f"{rows[-1]['p99']:.0f}); goal >= {GOAL_MBPS:.0f} MB/s: "
              f"{'MET' if val >= GOAL_MBPS else 'MISSED'}; host floor {floor:.0f} MB/s")
    grew = (peak - idle) / 1024
    rows.append({"metric": "server RSS growth during 1 GiB transfers", "goal": "flat",
                 "p50": grew, "p99": grew, "unit": "MiB", "met": grew < 64,
                 "floor": f"idle RSS {idle / 1024:.0f} MiB", "ratio": ""})
    print(f"leftovers after cleanup: {srv.leftovers}; host bwrap processes now: "
          f"{H.host_bwrap_count()}")
    result.update(rows=rows, writes_mbps=writes, reads_mbps=reads, floors_mbps=floors,
                  plain_dir_floors_mbps=plain,
                  idle_rss_kb=idle, peak_rss_kb=peak, agent_idle_rss_kb=agent_idle,
                  agent_peak_rss_kb=max(agent_peaks) if agent_peaks else None,
                  leftovers=srv.leftovers)
    H.emit(result, args.json)


if __name__ == "__main__":
    H.run_isolated(main)
