"""Benchmark: `run_code("x = 6*7\\nprint(x)")` in a warm context vs the seed_reference peer.

agentbox: one code-interpreter sandbox (its python kernel warm), one keep-alive client,
`POST /v1/sandboxes/{id}/code/execute` read to its end event; state persists between calls.
Peer (same run, same machine, same code string): `../shared/peers/seed_reference/server.py`
under uvicorn, `POST /execute`, which starts and stops a fresh Jupyter kernel per request.
Also, as floors: `GET /v1/health` and `true` as a command in the same sandbox.

    .venv/bin/python bench/run_code_latency.py --template-dir DIR [-n 500] [--peer-n 30]

Goal: p50 <= 5 ms, and >= 100x faster than the peer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402
from warm_pool import run_code  # noqa: E402

CODE = "x = 6*7\nprint(x)"
PEER_DIR = H.ROOT.parent / "shared" / "peers" / "seed_reference"
GOAL_P50_MS, GOAL_RATIO = 5.0, 100.0


def peer_runs(n: int) -> list[float]:
    if not (PEER_DIR / "server.py").exists():
        raise SystemExit(f"the peer is missing: {PEER_DIR}")
    port = H.free_port()
    log = open(Path("/tmp") / f"seed-reference-{port}.log", "wb")
    proc = subprocess.Popen(
        [H.PYTHON, "-m", "uvicorn", "server:app", "--app-dir", str(PEER_DIR), "--port",
         str(port), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=dict(os.environ, JUPYTER_PLATFORM_DIRS="1"))
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        with httpx.Client(base_url=url, timeout=60) as c:
            while True:
                try:
                    c.get("/docs")
                    break
                except httpx.HTTPError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise SystemExit("the peer server did not start") from None
                    time.sleep(0.1)

            def once() -> None:
                r = c.post("/execute", json={"code": CODE})
                r.raise_for_status()
                assert r.json()["output"] == "42\n", r.text

            return H.timed_runs(once, n, 2)
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def main() -> None:
    p = H.base_args(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=500)
    p.add_argument("--peer-n", type=int, default=30)
    p.add_argument("--template-dir", type=Path, help="where code-interpreter is built")
    args = p.parse_args()
    mach = H.print_header("Benchmark: run_code in a warm context vs a fresh kernel per request")
    m: dict[str, list[float]] = {}
    with H.BenchServer("code", template_dir=args.template_dir) as srv, srv.client() as c:
        sid = H.create_sandbox(c, template="code-interpreter", timeout=3600)["sandbox_id"]
        m["HTTP: GET /v1/health"] = H.timed_runs(lambda: c.get("/v1/health"), 200, 20)
        m["command `true` in the same sandbox"] = H.timed_runs(
            lambda: H.run_command(c, sid, "true"), 200, 10)

        def once() -> None:
            events = run_code(c, sid, CODE)
            assert "".join(e["text"] for e in events if e["type"] == "stdout") == "42\n", events

        m["agentbox run_code, warm context (RESULT)"] = H.timed_runs(once, args.n, 20)
        c.delete(f"/v1/sandboxes/{sid}")
    m["peer: seed_reference, fresh kernel per request"] = peer_runs(args.peer_n)
    print()
    H.print_timings(m, 62)
    ours = H.summarize(m["agentbox run_code, warm context (RESULT)"])
    peer = H.summarize(m["peer: seed_reference, fresh kernel per request"])
    ratio = peer["p50"] / ours["p50"]
    ok = ours["p50"] <= GOAL_P50_MS and ratio >= GOAL_RATIO
    print(f"\nRESULT: run_code p50 {ours['p50']:.2f} ms, p99 {ours['p99']:.2f} ms; peer p50 "
          f"{peer['p50']:.0f} ms; ratio {ratio:.0f}x (goal p50 <= {GOAL_P50_MS} ms and >= "
          f"{GOAL_RATIO:.0f}x: {'met' if ok else 'NOT met'})")
    H.emit({"benchmark": "run_code_latency", "machine": mach,
            "measurements": {k: H.summarize(v) for k, v in m.items()},
            "rows": [{"name": "run_code warm context", "goal": "p50 5 ms, >= 100x peer",
                      "achieved_ms": ours["p50"], "p99_ms": ours["p99"], "ratio": ratio,
                      "met": ok}]}, args.json)


if __name__ == "__main__":
    H.run_isolated(main)
