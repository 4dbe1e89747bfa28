"""Exposed ports: throughput and latency through the port gateway vs the same server direct.

One sandbox runs `TINY_HTTP_SERVER` (stdlib asyncio HTTP/1.1, keep-alive, 13-byte answer, see
egress_latency.py) on its port 8080; the very same code runs on the host's loopback as the
floor. wrk (`apt-get install -y wrk`; without it a Python load generator stands in, slower)
loads three targets:
- direct: http://127.0.0.1:<floor port>/
- path-routed: http://127.0.0.1:<api port>/v1/sandboxes/<id>/ports/8080/ (X-Access-Token)
- host-routed: the same server, `Host: 8080-<id>.localhost:<api port>` (X-Access-Token)
- api-health (load runs only): `GET /v1/health` of the same API server, its cheapest answer
  (no relay, no key): the floor of what one request through this server can cost
First the raw-socket client of egress_latency.py times single sequential requests to all three,
interleaved, on one kept-alive connection and on a new connection each; then wrk -t1 -c1 per
target; then -t2 -c16 rounds (direct, then the gateway two, alternating) for load; last, one
more path-routed -c1 run right after the load. Each run also counts the connections the sandbox's
loopback accepted (its netns's TCP PassiveOpens): how often the gateway dialled upstream anew.

    .venv/bin/python bench/gateway.py [--duration 6] [--rounds 2] [-c 16] [-t 2] [-n 500]
                                      [--python-load] [--profile] [--json out.json]
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402
from egress_latency import (  # noqa: E402
    HTTP_CLIENT,
    SANDBOX_DIR,
    SANDBOX_PYTHON,
    SYSTEM_PYTHON,
    TINY_HTTP_SERVER,
    cpu_seconds,
    put_file,
    run_client_on_host,
    start_in_sandbox,
    tiny_server_on_host,
)

SANDBOX_PORT = 8080
NO_GOAL = "no errors (no speed goal)"
TARGETS = ("direct", "path-routed", "host-routed")
LOAD_TARGETS = (*TARGETS, "api-health")
WRK_HINT = "wrk is not installed (apt-get install -y wrk); using the Python load generator"

# The fallback load generator: `threads` processes, each with an asyncio loop keeping its share
# of `connections` busy for `duration` seconds. argv: a JSON config {"host", "port",
# "request", "connections", "duration"}; prints {"requests", "errors", "latencies_ms": [...]}.
LOADGEN = r'''
import asyncio, json, sys, time


async def conn(cfg, stop, lat, errors):
    raw = cfg["request"].encode("latin-1")
    reader, writer = await asyncio.open_connection(cfg["host"], cfg["port"])
    clock = time.perf_counter
    while clock() < stop:
        t0 = clock()
        writer.write(raw)
        head = await reader.readuntil(b"\r\n\r\n")
        lower = head.lower()
        at = lower.find(b"\r\ncontent-length:")
        await reader.readexactly(int(lower[at + 17:].split(b"\r\n", 1)[0]))
        if not head.startswith(b"HTTP/1.1 200"):
            errors[0] += 1
        lat.append((clock() - t0) * 1000)
    writer.close()


async def main(cfg):
    lat, errors = [], [0]
    stop = time.perf_counter() + cfg["duration"]
    await asyncio.gather(*(conn(cfg, stop, lat, errors) for _ in range(cfg["connections"])))
    print(json.dumps({"requests": len(lat), "errors": errors[0], "latencies_ms": lat}))


asyncio.run(main(json.loads(sys.argv[1])))
'''


def _wrk_ms(value: str, unit: str) -> float:
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}[unit]


def run_wrk(url: str, headers: list[str], threads: int, conns: int, duration: float
            ) -> dict[str, Any]:
    argv = ["wrk", f"-t{threads}", f"-c{conns}", f"-d{duration:g}s", "--latency"]
    for h in headers:
        argv += ["-H", h]
    p = subprocess.run([*argv, url], capture_output=True, text=True, timeout=duration + 60)
    out = p.stdout
    if p.returncode != 0 or "Requests/sec" not in out:
        raise RuntimeError(f"wrk failed ({p.returncode}): {out} {p.stderr}")
    pct = {int(q): _wrk_ms(v, u) for q, v, u in
           re.findall(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.M)}
    errors = sum(int(x) for x in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if sock:
        errors += sum(int(x) for x in sock.groups())
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    requests = re.search(r"(\d+) requests in", out)
    assert rps and requests, out
    return {"rps": float(rps.group(1)), "requests": int(requests.group(1)),
            "p50": pct.get(50), "p90": pct.get(90), "p99": pct.get(99), "errors": errors,
            "raw": out}


def run_loadgen(script: Path, port: int, request: str, threads: int, conns: int,
                duration: float) -> dict[str, Any]:
    share = [conns // threads + (i < conns % threads) for i in range(threads)]
    procs = [subprocess.Popen(
        [SYSTEM_PYTHON, str(script), json.dumps(
            {"host": "127.0.0.1", "port": port, "request": request, "connections": c,
             "duration": duration})], stdout=subprocess.PIPE, text=True)
        for c in share if c]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=duration + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"load generator failed ({proc.returncode})")
        results.append(json.loads(out))
    lat = [x for r in results for x in r["latencies_ms"]]
    s = H.summarize(lat)
    return {"rps": len(lat) / duration, "requests": len(lat), "p50": s.get("p50"),
            "p90": s.get("p90"), "p99": s.get("p99"),
            "errors": sum(r["errors"] for r in results)}


def sandbox_tcp_opens(c: httpx.Client, sid: str) -> int:
    """Connections the sandbox's loopback has accepted so far (its netns's TCP PassiveOpens):
    how often the gateway had to open a new upstream connection."""
    _, out = H.run_command(c, sid, "cat /proc/net/snmp")
    names, values = [line.split() for line in out.splitlines() if line.startswith("Tcp:")][:2]
    return int(values[names.index("PassiveOpens")])


def request_text(host: str, path: str, extra: list[str]) -> str:
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}", "User-Agent: agentbox-bench", *extra]
    return "\r\n".join(lines) + "\r\n\r\n"


def wait_for_gateway(url: str, token: str, deadline_s: float = 15.0) -> None:
    deadline = time.monotonic() + deadline_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, headers={"X-Access-Token": token}, timeout=5)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:300]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.05)
    raise RuntimeError(f"the sandbox's server did not answer through the gateway: {last}")


def main() -> None:
    p = H.base_args(__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=6, help="seconds per wrk run (default 6)")
    p.add_argument("--rounds", type=int, default=2,
                   help="-c16 runs per target (default 2)")
    p.add_argument("-c", "--connections", type=int, default=16, help="wrk -c (default 16)")
    p.add_argument("-t", "--threads", type=int, default=2, help="wrk -t (default 2)")
    p.add_argument("--c1-duration", type=float, default=3,
                   help="seconds per wrk -t1 -c1 run (default 3)")
    p.add_argument("-n", type=int, default=500,
                   help="sequential requests per mode for the latency client (default 500)")
    p.add_argument("--python-load", action="store_true",
                   help="use the Python load generator even if wrk is installed")
    p.set_defaults(json=H.ROOT / "bench/results/gateway.json")
    args = p.parse_args()
    mach = H.print_header("Exposed ports: the port gateway vs the same server direct")
    result: dict[str, Any] = {"name": "gateway", "machine": mach,
                              "command": " ".join(["bench/gateway.py", *sys.argv[1:]])}
    have_wrk = shutil.which("wrk") is not None and not args.python_load
    if shutil.which("wrk") is None:
        print(WRK_HINT, file=sys.stderr)
    load: dict[str, list[dict[str, Any]]] = {t: [] for t in LOAD_TARGETS}
    c1: dict[str, dict[str, Any]] = {}
    prof_rows: list[tuple[str, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="agentbox-bench-gateway-") as tmp, \
            tiny_server_on_host() as direct_port, \
            H.BenchServer("gateway") as srv, srv.client() as c:
        client_py, loadgen_py = Path(tmp) / "http_client.py", Path(tmp) / "loadgen.py"
        client_py.write_text(HTTP_CLIENT)
        loadgen_py.write_text(LOADGEN)
        box = H.create_sandbox(c, timeout=3600)
        sid, token = box["sandbox_id"], box["access_token"]
        put_file(c, sid, f"{SANDBOX_DIR}/tiny_http_server.py", TINY_HTTP_SERVER)
        start_in_sandbox(c, sid, f"exec {SANDBOX_PYTHON} {SANDBOX_DIR}/tiny_http_server.py "
                                 f"{SANDBOX_PORT} >/dev/null")
        prefix = f"/v1/sandboxes/{sid}/ports/{SANDBOX_PORT}"
        routed_host = f"{SANDBOX_PORT}-{sid}.localhost:{srv.port}"
        wait_for_gateway(f"{srv.url}{prefix}/", token)
        auth = f"X-Access-Token: {token}"
        # (port, path, Host header, extra headers) of each target
        where = {
            "direct": (direct_port, "/", f"127.0.0.1:{direct_port}", []),
            "path-routed": (srv.port, f"{prefix}/", f"127.0.0.1:{srv.port}", [auth]),
            "host-routed": (srv.port, "/", routed_host, [auth]),
            "api-health": (srv.port, "/v1/health", f"127.0.0.1:{srv.port}", []),
        }

        def load_once(target: str, threads: int, conns: int, duration: float) -> dict[str, Any]:
            port, path, host, extra = where[target]
            opens0 = sandbox_tcp_opens(c, sid)
            cpu0, t0 = cpu_seconds(srv.pid), time.perf_counter()
            if have_wrk:
                headers = ([f"Host: {host}"] if target == "host-routed" else []) + extra
                r = run_wrk(f"http://127.0.0.1:{port}{path}", headers, threads, conns, duration)
            else:
                r = run_loadgen(loadgen_py, port, request_text(host, path, extra), threads,
                                conns, duration)
            cpu, wall = cpu_seconds(srv.pid) - cpu0, time.perf_counter() - t0
            r["server_cpu_pct"] = 100 * cpu / wall
            r["server_cpu_ms_per_request"] = 1000 * cpu / max(1, r["requests"])
            r["upstream_conns"] = sandbox_tcp_opens(c, sid) - opens0
            return r

        modes = []
        for target in TARGETS:
            port, path, host, extra = where[target]
            req = request_text(host, path, extra)
            for keep in (True, False):
                modes.append({"name": f"{target} {'keep-alive' if keep else 'new connection'}",
                              "host": "127.0.0.1", "port": port, "request": req,
                              "keepalive": keep})
        prof = H.Profiler(srv.pid, H.ROOT / "bench/results/gateway.pyspy.txt", args.profile)
        with prof:
            # Light load first: what the heavy runs leave in the gateway's upstream pool (for
            # KEEPALIVE_EXPIRY after them) must not colour it. The last run shows that state.
            got = run_client_on_host(client_py, {"n": args.n, "warmup": 20, "modes": modes})
            seq, seq_failed = got["ms"], got["failed"]
            for target in LOAD_TARGETS:
                c1[target] = load_once(target, 1, 1, args.c1_duration)
            for rnd in range(args.rounds):
                # direct first, the gateway's two in turn: the last run before `after` is one
                # of the gateway's, so `after` sees the pool that load left.
                for target in ("direct", "api-health", *TARGETS[1:][:: 1 if rnd % 2 else -1]):
                    load[target].append(
                        load_once(target, args.threads, args.connections, args.duration))
            after = load_once("path-routed", 1, 1, args.c1_duration)
        prof_rows = prof.top(25)
    rows = report(load, c1, after, seq, seq_failed, args, have_wrk, prof_rows)
    print(f"leftovers after cleanup: {srv.leftovers}; host bwrap processes now: "
          f"{H.host_bwrap_count()}")
    for runs in [*load.values(), list(c1.values()), [after]]:
        for r in runs:
            r.pop("raw", None)
    result.update(rows=rows, load_generator="wrk" if have_wrk else "python", wrk_c16=load,
                  wrk_c1=c1, wrk_c1_after_load=after,
                  sequential={k: H.summarize(v) for k, v in seq.items()},
                  sequential_failed=seq_failed,
                  profile=prof_rows, leftovers=srv.leftovers)
    H.emit(result, args.json)


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report(load: dict[str, list[dict[str, Any]]], c1: dict[str, dict[str, Any]],
           after: dict[str, Any], seq: dict[str, list[float]], seq_failed: dict[str, str],
           args: Any, have_wrk: bool,
           prof_rows: list[tuple[str, float, float]]) -> list[dict[str, Any]]:
    gen = "wrk" if have_wrk else "python load generator"
    print(f"load: {gen} -t1 -c1 {args.c1_duration:g} s per target; then -t{args.threads} "
          f"-c{args.connections}, {args.rounds} x {args.duration:g} s per target (medians of the "
          f"rounds); then path-routed -t1 -c1 again right after that load\n")
    print("| target | connections | req/s | vs direct | p50 ms | p90 ms | p99 ms | p50 vs direct "
          "| API server CPU: % of a core, ms/req | new upstream conns per 1000 req | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, table, direct in (
            ("-c1", {t: [c1[t]] for t in LOAD_TARGETS}, [c1["direct"]]),
            (f"-c{args.connections}", {t: load[t] for t in LOAD_TARGETS}, load["direct"]),
            ("-c1 right after load", {"path-routed": [after]}, [c1["direct"]])):
        d_rps, d_p50 = _median(direct, "rps"), _median(direct, "p50")
        for t, runs in table.items():
            rps, p50 = _median(runs, "rps"), _median(runs, "p50")
            requests = sum(r["requests"] for r in runs)
            print(f"| {t} | {label} | {rps:.0f} | {rps / d_rps:.2f}x | {p50:.3f} | "
                  f"{_median(runs, 'p90'):.3f} | {_median(runs, 'p99'):.3f} | "
                  f"{p50 / d_p50:.1f}x | {_median(runs, 'server_cpu_pct'):.0f}%, "
                  f"{_median(runs, 'server_cpu_ms_per_request'):.3f} | "
                  f"{1000 * sum(r['upstream_conns'] for r in runs) / requests:.1f} | "
                  f"{sum(r['errors'] for r in runs)} |")
    print(f"\nsequential single requests (raw-socket client on the host, modes interleaved, "
          f"n={args.n} each):\n")
    print("| target | connection | n | p50 ms | p90 ms | p99 ms | p50 vs direct |")
    print("|---|---|---|---|---|---|---|")
    stats = {k: H.summarize(v) for k, v in seq.items()}
    for name, s in stats.items():
        target, _, style = name.partition(" ")
        floor = stats[f"direct {style}"]
        if name in seq_failed or not s["n"] or not floor["n"]:
            why = seq_failed.get(name) or seq_failed.get(f"direct {style}")
            print(f"| {target} | {style} | {s['n']} | FAILED: {why} | | | |")
            continue
        print(f"| {target} | {style} | {s['n']} | {s['p50']:.3f} | {s['p90']:.3f} | "
              f"{s['p99']:.3f} | {s['p50'] / floor['p50']:.1f}x |")
    if prof_rows:
        print("\npy-spy on the server during the load runs (inclusive %, self %):")
        for f, inc, own in prof_rows:
            print(f"  {inc:5.1f}% {own:5.1f}%  {f}")
    rows = []
    direct, api = load["direct"], load["api-health"]
    for t in ("path-routed", "host-routed"):
        runs = load[t]
        errors = sum(r["errors"] for r in runs)
        rows.append({
            "metric": f"exposed port {t}, {gen} -t{args.threads} -c{args.connections}: req/s",
            "goal": NO_GOAL, "p50": _median(runs, "rps"),
            "p99": min(r["rps"] for r in runs), "unit": "req/s", "met": errors == 0,
            "errors": errors,
            "floor": (f"same server direct: {_median(direct, 'rps'):.0f} req/s; the API "
                      f"server's own GET /v1/health: {_median(api, 'rps'):.0f} req/s"),
            "ratio": (f"{_median(runs, 'rps') / _median(direct, 'rps'):.2f}x direct, "
                      f"{_median(runs, 'rps') / _median(api, 'rps'):.2f}x the API's health")})
        rows.append({
            "metric": f"exposed port {t}, latency under -c{args.connections} load",
            "goal": NO_GOAL, "p50": _median(runs, "p50"), "p99": _median(runs, "p99"),
            "unit": "ms", "met": errors == 0,
            "floor": (f"direct p50 {_median(direct, 'p50'):.3f} ms / p99 "
                      f"{_median(direct, 'p99'):.3f}"),
            "ratio": f"{_median(runs, 'p50') / _median(direct, 'p50'):.1f}x direct"})
        s, f = stats[f"{t} keep-alive"], stats["direct keep-alive"]
        if not s["n"] or not f["n"]:
            why = seq_failed.get(f"{t} keep-alive") or seq_failed.get("direct keep-alive")
            rows.append({"metric": f"exposed port {t}, one sequential request (keep-alive)",
                         "goal": NO_GOAL, "p50": None, "p99": None, "unit": "ms", "met": False,
                         "floor": f"FAILED: {why}", "ratio": "-"})
            continue
        rows.append({
            "metric": f"exposed port {t}, one sequential request (keep-alive)",
            "goal": NO_GOAL, "p50": s["p50"], "p99": s["p99"], "unit": "ms", "met": True,
            "floor": f"direct p50 {f['p50']:.3f} ms / p99 {f['p99']:.3f}",
            "ratio": f"{s['p50'] / f['p50']:.1f}x direct"})
    print()
    for row in rows:
        if row["p50"] is None:
            print(f"RESULT: {row['metric']}: {row['floor']}")
            continue
        print(f"RESULT: {row['metric']}: p50 {row['p50']:.3f} {row['unit']} "
              f"(p99/worst {row['p99']:.3f}); {row['floor']}; {row['ratio']}")
    return rows


if __name__ == "__main__":
    H.run_isolated(main)
