"""Benchmark 4: creates + kills per second with a few concurrent clients.

K client threads (own keep-alive httpx client each) loop `POST /v1/sandboxes` then
`DELETE /v1/sandboxes/{id}` for a fixed time. Reports completed create+kill pairs per second,
errors by status, per-call latency, and the server's CPU use. Floor, same run: as many bare
`bwrap --unshare-all --ro-bind / / /bin/true` per second as K threads can start on this host.

    .venv/bin/python bench/churn.py [--clients 4] [--seconds 20] [--disk-mb N] [--json out.json]
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

GOAL_PER_S = 100.0
BARE_BWRAP = ["bwrap", "--unshare-all", "--ro-bind", "/", "/", "/bin/true"]


def bwrap_rate(clients: int, seconds: float) -> float:
    done = [0] * clients
    deadline = time.monotonic() + seconds

    def work(i: int) -> None:
        while time.monotonic() < deadline:
            H.spawn_wait(BARE_BWRAP)
            done[i] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - t0)


def cpu_seconds(pid: int) -> float:
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = H.base_args(__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--seconds", type=float, default=20, help="measured time (default 20)")
    p.add_argument("--disk-mb", type=int, default=None,
                   help="resources.disk_mb of each sandbox (default: the server's default)")
    args = p.parse_args()
    mach = H.print_header(f"Benchmark 4: create+kill churn, {args.clients} clients")
    result: dict[str, Any] = {"name": "churn", "machine": mach,
                              "command": " ".join(["bench/churn.py", *sys.argv[1:]])}
    floor = bwrap_rate(args.clients, min(5.0, args.seconds))
    print(f"floor: bare bwrap /bin/true with {args.clients} threads: {floor:.0f}/s")
    body: dict[str, Any] = {"timeout": 600}
    if args.disk_mb:
        body["resources"] = {"disk_mb": args.disk_mb}
    creates: list[float] = []
    kills: list[float] = []
    errors: Counter[str] = Counter()
    pairs = [0] * args.clients
    lock = threading.Lock()
    with H.BenchServer("churn") as srv:
        srv.set_quota(max_sandboxes=1000)
        stop_at = [0.0]

        def work(i: int) -> None:
            with srv.client(timeout=60) as c:
                while time.monotonic() < stop_at[0]:
                    t0 = time.perf_counter()
                    try:
                        r = c.post("/v1/sandboxes", json=body)
                    except Exception as e:  # noqa: BLE001 - counted, the run goes on
                        with lock:
                            errors[f"create {type(e).__name__}"] += 1
                        continue
                    t1 = time.perf_counter()
                    if r.status_code != 201:
                        with lock:
                            errors[f"create {r.status_code} {r.json().get('code')}"] += 1
                        continue
                    sid = r.json()["sandbox_id"]
                    try:
                        r = c.delete(f"/v1/sandboxes/{sid}")
                        status = r.status_code
                    except Exception as e:  # noqa: BLE001
                        status = type(e).__name__
                    t2 = time.perf_counter()
                    with lock:
                        creates.append((t1 - t0) * 1000)
                        if status == 204:
                            kills.append((t2 - t1) * 1000)
                            pairs[i] += 1
                        else:
                            errors[f"kill {status}"] += 1

        # Warm up a little, then measure.
        stop_at[0] = time.monotonic() + 1.0
        warm = [threading.Thread(target=work, args=(i,)) for i in range(args.clients)]
        for t in warm:
            t.start()
        for t in warm:
            t.join()
        creates.clear()
        kills.clear()
        errors.clear()
        pairs = [0] * args.clients
        prof = H.Profiler(srv.pid, H.ROOT / "bench/results/churn.pyspy.txt", args.profile)
        with prof:
            cpu0 = cpu_seconds(srv.pid)
            busy0, total0 = H.host_cpu_ticks()
            stop_at[0] = time.monotonic() + args.seconds
            threads = [threading.Thread(target=work, args=(i,)) for i in range(args.clients)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            cpu = cpu_seconds(srv.pid) - cpu0
            busy1, total1 = H.host_cpu_ticks()
            host_busy = (busy1 - busy0) / max(1, total1 - total0)
        prof_rows = prof.top(20)
    rate = sum(pairs) / wall
    err_total = sum(errors.values())
    print(f"completed create+kill pairs: {sum(pairs)} in {wall:.1f} s = {rate:.1f}/s; "
          f"errors: {err_total} {dict(errors) if errors else ''}")
    print(f"  create latency {H.fmt_ms(H.summarize(creates))}")
    print(f"  kill latency   {H.fmt_ms(H.summarize(kills))}")
    print(f"  server process CPU: {100 * cpu / wall:.0f}% of one core "
          f"({cpu / max(1, sum(pairs)) * 1000:.1f} ms per create+kill); whole host: "
          f"{100 * host_busy:.0f}% of all CPUs busy")
    if prof_rows:
        print("\npy-spy on the server (inclusive %, self %):")
        for f, inc, own in prof_rows:
            print(f"  {inc:5.1f}% {own:5.1f}%  {f}")
    row = {"metric": f"creates+kills per second ({args.clients} clients, 2 cores)",
           "goal": f">= {GOAL_PER_S:.0f}/s", "p50": rate, "p99": None, "unit": "/s",
           "met": rate >= GOAL_PER_S and err_total == 0, "errors": err_total,
           "floor": f"bare bwrap /bin/true: {floor:.0f}/s with {args.clients} threads",
           "ratio": f"{rate / floor:.2f}x floor"}
    print(f"\nRESULT: {rate:.1f} creates+kills/s with {err_total} errors (goal >= "
          f"{GOAL_PER_S:.0f}/s: {'MET' if row['met'] else 'MISSED'}); floor {floor:.0f}/s")
    print(f"leftovers after cleanup: {srv.leftovers}; host bwrap processes now: "
          f"{H.host_bwrap_count()}")
    result.update(rows=[row], create_ms=H.summarize(creates), kill_ms=H.summarize(kills),
                  errors=dict(errors), server_cpu_pct=100 * cpu / wall,
                  host_busy_pct=100 * host_busy, floor_per_s=floor,
                  profile=prof_rows, leftovers=srv.leftovers)
    H.emit(result, args.json)


if __name__ == "__main__":
    H.run_isolated(main)
