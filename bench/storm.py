"""Create storm and capacity cliff: how creates behave under concurrency and as sandboxes pile up.

1. Create storm: for each concurrency level (default 1, 2, 5, 10, 25, 50), that many clients
   (own keep-alive httpx client each) fire creates at once until the step's count is done
   (default max(20, 3 x concurrency)); reported per step: create latency p50/p90/p99/max, error
   rate (and errors by status/code), completed creates per second, server RSS. Each step's
   sandboxes are killed before the next step.
2. Capacity cliff: live sandboxes are added `--cliff-step` at a time (default 50, created by
   `--cliff-concurrency` clients) and kept. Per step: create latency, errors, how long the step
   took, an exec round trip on a live sandbox, server RSS, host available memory, mounts. It
   stops at the cliff (a create fails, or a step does not converge within `--converge-s`), at
   `--cliff-max` live sandboxes, or when the host's available memory falls below
   `--min-avail-gib` (a safety stop, not a cliff), and reports which.

Prints Markdown tables and writes JSON (default bench/results/storm.json). Uses the harness's
private server (own data dir, isolated cgroups, leak-proof cleanup).

    .venv/bin/python bench/storm.py [--levels 1,2,5,10,25,50] [--per-level N]
        [--cliff-step 50] [--cliff-max 500] [--cliff-concurrency 10] [--converge-s 120]
        [--disk-mb N] [--no-storm] [--no-cliff] [--json PATH]
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

DEFAULT_JSON = H.ROOT / "bench" / "results" / "storm.json"


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024 / 1024
    return float("nan")


def mount_count() -> int:
    return len(Path("/proc/self/mountinfo").read_text().splitlines())


def create_batch(
    srv: H.BenchServer, n: int, concurrency: int, body: dict[str, Any], timeout: float
) -> dict[str, Any]:
    """`n` creates by `concurrency` clients at once: latencies, errors, ids, wall time."""
    lock = threading.Lock()
    todo = [n]
    lat: list[float] = []
    errors: Counter[str] = Counter()
    ids: list[str] = []

    def work() -> None:
        with srv.client(timeout=timeout) as c:
            while True:
                with lock:
                    if todo[0] <= 0:
                        return
                    todo[0] -= 1
                t0 = time.perf_counter()
                try:
                    r = c.post("/v1/sandboxes", json=body)
                except httpx.HTTPError as e:
                    with lock:
                        errors[type(e).__name__] += 1
                    continue
                ms = (time.perf_counter() - t0) * 1000
                with lock:
                    if r.status_code == 201:
                        lat.append(ms)
                        ids.append(r.json()["sandbox_id"])
                    else:
                        try:
                            code = r.json().get("code")
                        except ValueError:
                            code = "?"
                        errors[f"{r.status_code} {code}"] += 1

    threads = [threading.Thread(target=work) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {
        "n": n,
        "ok": len(ids),
        "ids": ids,
        "latency_ms": lat,
        "errors": dict(errors),
        "wall_s": wall,
    }


def kill_batch(srv: H.BenchServer, ids: list[str], concurrency: int) -> dict[str, Any]:
    lock = threading.Lock()
    todo = list(ids)
    lat: list[float] = []
    errors: Counter[str] = Counter()

    def work() -> None:
        with srv.client(timeout=120) as c:
            while True:
                with lock:
                    if not todo:
                        return
                    sid = todo.pop()
                t0 = time.perf_counter()
                try:
                    status: int | str = c.delete(f"/v1/sandboxes/{sid}").status_code
                except httpx.HTTPError as e:
                    status = type(e).__name__
                with lock:
                    if status == 204:
                        lat.append((time.perf_counter() - t0) * 1000)
                    else:
                        errors[str(status)] += 1

    threads = [threading.Thread(target=work) for _ in range(max(1, concurrency))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "n": len(ids),
        "latency_ms": H.summarize(lat),
        "errors": dict(errors),
        "wall_s": time.perf_counter() - t0,
    }


def exec_probe(srv: H.BenchServer, ids: list[str], n: int = 5) -> dict[str, float]:
    out = []
    with srv.client(timeout=60) as c:
        for sid in random.sample(ids, min(n, len(ids))):
            t0 = time.perf_counter()
            try:
                code, _ = H.run_command(c, sid, "true")
            except RuntimeError:
                continue
            if code == 0:
                out.append((time.perf_counter() - t0) * 1000)
    return H.summarize(out)


def _ms(s: dict[str, float], key: str) -> str:
    return f"{s[key]:.0f}" if s.get("n") else "-"


def storm(
    srv: H.BenchServer, levels: list[int], per_level: int | None, body: dict[str, Any]
) -> list[dict[str, Any]]:
    rows = []
    print("### Create storm\n")
    print(
        "| concurrency | creates | ok | error rate | p50 ms | p90 ms | p99 ms | max ms "
        "| creates/s | errors | server RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in levels:
        n = per_level or max(20, 3 * c)
        res = create_batch(srv, n, c, body, timeout=300)
        s = H.summarize(res["latency_ms"])
        rss = H.rss_kb(srv.pid) / 1024
        kill = kill_batch(srv, res["ids"], min(c, 10))
        row = {
            "concurrency": c,
            "creates": n,
            "ok": res["ok"],
            "error_rate": 1 - res["ok"] / n,
            "latency_ms": s,
            "errors": res["errors"],
            "creates_per_s": res["ok"] / res["wall_s"],
            "wall_s": res["wall_s"],
            "server_rss_mib": rss,
            "kill": kill,
        }
        rows.append(row)
        print(
            f"| {c} | {n} | {res['ok']} | {100 * row['error_rate']:.1f}% | {_ms(s, 'p50')} "
            f"| {_ms(s, 'p90')} | {_ms(s, 'p99')} | {_ms(s, 'max')} "
            f"| {row['creates_per_s']:.1f} | {res['errors'] or '-'} | {rss:.0f} |",
            flush=True,
        )
    return rows


def cliff(
    srv: H.BenchServer,
    step: int,
    concurrency: int,
    max_live: int,
    converge_s: float,
    min_avail_gib: float,
    body: dict[str, Any],
) -> dict[str, Any]:
    print("\n### Capacity cliff\n")
    print(
        "| live before | step creates | ok | errors | p50 ms | p99 ms | max ms | step s "
        "| exec p50 ms | server RSS MiB | host avail GiB | mounts |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    live: list[str] = []
    steps = []
    verdict = f"no cliff up to {max_live} live sandboxes (--cliff-max)"
    while len(live) < max_live:
        avail = mem_available_gib()
        if avail < min_avail_gib:
            verdict = (
                f"safety stop at {len(live)} live: host available memory {avail:.1f} GiB "
                f"< {min_avail_gib} GiB (not a cliff)"
            )
            break
        n = min(step, max_live - len(live))
        before = len(live)
        res = create_batch(srv, n, concurrency, body, timeout=converge_s)
        live += res["ids"]
        s = H.summarize(res["latency_ms"])
        probe = exec_probe(srv, live) if live else {"n": 0}
        row = {
            "live_before": before,
            "creates": n,
            "ok": res["ok"],
            "errors": res["errors"],
            "latency_ms": s,
            "step_s": res["wall_s"],
            "exec_ms": probe,
            "server_rss_mib": H.rss_kb(srv.pid) / 1024,
            "host_avail_gib": mem_available_gib(),
            "mounts": mount_count(),
        }
        steps.append(row)
        print(
            f"| {before} | {n} | {res['ok']} | {res['errors'] or '-'} | {_ms(s, 'p50')} "
            f"| {_ms(s, 'p99')} | {_ms(s, 'max')} | {res['wall_s']:.1f} "
            f"| {_ms(probe, 'p50')} | {row['server_rss_mib']:.0f} "
            f"| {row['host_avail_gib']:.1f} | {row['mounts']} |",
            flush=True,
        )
        if res["ok"] < n:
            verdict = (
                f"cliff: creates failed going from {before} to {before + n} live ({res['errors']})"
            )
            break
        if res["wall_s"] > converge_s:
            verdict = (
                f"cliff: {n} creates took {res['wall_s']:.0f} s (> {converge_s:.0f} s) "
                f"going from {before} to {len(live)} live"
            )
            break
    print(f"\n{verdict}")
    t0 = time.perf_counter()
    kill = kill_batch(srv, live, concurrency)
    print(
        f"killed {len(live)} live sandboxes in {time.perf_counter() - t0:.1f} s "
        f"(kill p50 {_ms(kill['latency_ms'], 'p50')} ms, p99 "
        f"{_ms(kill['latency_ms'], 'p99')} ms, errors {kill['errors'] or 'none'})"
    )
    return {"steps": steps, "verdict": verdict, "max_live": len(live), "kill": kill}


def main() -> None:
    p = H.base_args(__doc__.splitlines()[0])
    p.add_argument("--levels", default="1,2,5,10,25,50", help="storm concurrency levels")
    p.add_argument(
        "--per-level",
        type=int,
        default=None,
        help="creates per level (default max(20, 3 x concurrency))",
    )
    p.add_argument("--cliff-step", type=int, default=50, help="live sandboxes added per step")
    p.add_argument("--cliff-max", type=int, default=500, help="stop the cliff test here")
    p.add_argument("--cliff-concurrency", type=int, default=10, help="clients per cliff step")
    p.add_argument(
        "--converge-s",
        type=float,
        default=120,
        help="a cliff step that takes longer than this has not converged",
    )
    p.add_argument(
        "--min-avail-gib",
        type=float,
        default=3.0,
        help="safety stop when the host's available memory falls below this",
    )
    p.add_argument("--disk-mb", type=int, default=None, help="resources.disk_mb per sandbox")
    p.add_argument("--no-storm", action="store_true")
    p.add_argument("--no-cliff", action="store_true")
    p.set_defaults(json=DEFAULT_JSON)
    args = p.parse_args()
    mach = H.print_header("Create storm and capacity cliff")
    print(f"command: `.venv/bin/python bench/storm.py {' '.join(sys.argv[1:])}`\n")
    body: dict[str, Any] = {"timeout": 3600}
    if args.disk_mb:
        body["resources"] = {"disk_mb": args.disk_mb}
    result: dict[str, Any] = {
        "name": "storm",
        "machine": mach,
        "command": " ".join(["bench/storm.py", *sys.argv[1:]]),
        "body": body,
    }
    with H.BenchServer("storm") as srv:
        srv.set_quota(max_sandboxes=100_000)
        with srv.client() as c:  # warm up the server and the page cache
            for _ in range(3):
                sid = H.create_sandbox(c, **body)["sandbox_id"]
                c.delete(f"/v1/sandboxes/{sid}")
        if not args.no_storm:
            levels = [int(x) for x in args.levels.split(",") if x]
            result["storm"] = storm(srv, levels, args.per_level, body)
        if not args.no_cliff:
            result["cliff"] = cliff(
                srv,
                args.cliff_step,
                args.cliff_concurrency,
                args.cliff_max,
                args.converge_s,
                args.min_avail_gib,
                body,
            )
    result["leftovers"] = srv.leftovers
    print(f"\nleftovers after cleanup: {srv.leftovers or 'none'}")
    H.emit(result, args.json)
    print(f"JSON: {args.json}")
    if any(srv.leftovers.values()):
        sys.exit(1)


if __name__ == "__main__":
    H.run_isolated(main)
