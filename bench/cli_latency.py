"""Benchmark: the whole `agentbox exec ID -- true` process, beside what Python alone costs.

A server with one live sandbox; the CLI (`.venv/bin/agentbox`, as installed) is run N times
against it, and with it, interleaved so that host noise falls on every row alike:

- floor: the venv's Python doing nothing (`python -c pass`);
- the CLI module's import alone (`python -c "import agentbox.cli.app"`);
- `agentbox exec ID -- true`, start to exit: the short path (`agentbox.cli.quick`: argument
  parsing, the command's POST streamed to its end, stdin's end sent);
- the same through the full CLI (`AGENTBOX_CLI_QUICK=0`: typer, the SDK, one GET of the sandbox,
  then the POST).

Byte-code is written where it can be (PYTHONDONTWRITEBYTECODE is dropped), as an installed
package has it.

    .venv/bin/python bench/cli_latency.py [-n 30] [--json out.json]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

GOAL_P50_MS = 80.0


def main() -> None:
    p = H.base_args(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=30)
    args = p.parse_args()
    mach = H.print_header("CLI: `agentbox exec ID -- true`, the whole process")
    cli = str(Path(H.PYTHON).parent / "agentbox")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with H.BenchServer("cli") as srv:
        with srv.client() as c:
            sid = H.create_sandbox(c, timeout=3600)["sandbox_id"]
        env |= {"AGENTBOX_API_URL": srv.url, "AGENTBOX_API_KEY": H.ADMIN_KEY}
        full = env | {"AGENTBOX_CLI_QUICK": "0"}
        runs = {
            "floor: python -c pass": ([H.PYTHON, "-c", "pass"], env),
            "import agentbox.cli.app": ([H.PYTHON, "-c", "import agentbox.cli.app"], env),
            "agentbox exec ID -- true (RESULT)": ([cli, "exec", sid, "--", "true"], env),
            "the same, full CLI (AGENTBOX_CLI_QUICK=0)": ([cli, "exec", sid, "--", "true"], full),
        }
        for argv, run_env in runs.values():  # byte-code written, caches warm
            subprocess.run(argv, env=run_env, check=True, capture_output=True)
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.n):
            for name, (argv, run_env) in runs.items():
                t0 = time.perf_counter()
                subprocess.run(argv, env=run_env, check=True, capture_output=True)
                times[name].append((time.perf_counter() - t0) * 1000)
    print()
    H.print_timings(times, 40)
    res = H.summarize(times["agentbox exec ID -- true (RESULT)"])
    floor = H.summarize(times["floor: python -c pass"])
    row: dict[str, Any] = {
        "metric": "`agentbox exec ID -- true`, whole process",
        "goal": f"p50 <= {GOAL_P50_MS:g} ms",
        "p50": res["p50"],
        "p99": res["p99"],
        "unit": "ms",
        "met": res["p50"] <= GOAL_P50_MS,
        "floor": f"python -c pass p50 {floor['p50']:.1f} ms",
        "ratio": f"{res['p50'] / floor['p50']:.1f}x floor",
    }
    print(f"\nRESULT: {row['metric']}: p50 {res['p50']:.1f} ms, p99 {res['p99']:.1f} ms (goal "
          f"{row['goal']}: {'MET' if row['met'] else 'MISSED'}); {row['ratio']}")
    print(f"leftovers after cleanup: {srv.leftovers}")
    H.emit({"name": "cli_latency", "machine": mach, "rows": [row],
            "measurements": {k: H.summarize(v) for k, v in times.items()},
            "leftovers": srv.leftovers}, args.json)


if __name__ == "__main__":
    H.run_isolated(main)
