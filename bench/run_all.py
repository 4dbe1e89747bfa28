"""Run every benchmark in turn and print a Markdown summary (goal vs achieved, with floors).

    .venv/bin/python bench/run_all.py [--only create_latency,exec_latency] [--profile]

Each benchmark runs as its own process (own server, own cleanup); raw output and JSON go to
bench/results/ (git-ignored). Exits non-zero if a benchmark crashed or left anything behind.
To compare two commits in one run (before/after a change), use bench/compare.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

BENCHMARKS = ["create_latency", "exec_latency", "file_throughput", "output_throughput", "churn",
              "idle_memory", "egress_latency", "gateway"]


def fmt(v: object, unit: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f} {unit}" if unit in ("ms", "MiB") else f"{v:.0f} {unit}"
    return f"{v} {unit}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma-separated subset of: " + ", ".join(BENCHMARKS))
    p.add_argument("--profile", action="store_true", help="pass --profile to each benchmark")
    args = p.parse_args()
    names = args.only.split(",") if args.only else BENCHMARKS
    out_dir = H.ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    results, failed = [], []
    for name in names:
        js = out_dir / f"{name}.json"
        js.unlink(missing_ok=True)
        argv = [H.PYTHON, str(H.ROOT / "bench" / f"{name}.py"), "--json", str(js)]
        if args.profile:
            argv.append("--profile")
        print(f"# running {name} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        with open(out_dir / f"{name}.txt", "w") as log:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT).returncode
        print(f"#   {name}: exit {rc} after {time.monotonic() - t0:.0f} s "
              f"(output in {out_dir / (name + '.txt')})", file=sys.stderr, flush=True)
        if rc != 0 or not js.exists():
            failed.append(name)
            continue
        res = json.loads(js.read_text())
        if any(res.get("leftovers", {}).values()):
            failed.append(f"{name} (left things behind: {res['leftovers']})")
        results.append(res)
    m = H.machine()
    print("# agentbox benchmarks\n")
    print(f"- date: {m['date']}")
    print(f"- machine: {H.machine_line(m)}")
    flags = "".join(" " + a for a in sys.argv[1:])
    print(f"- command: `.venv/bin/python bench/run_all.py{flags}`\n")
    print("| benchmark | metric | goal | achieved p50 | p99 / worst | floor (same run) "
          "| vs floor | met |")
    print("|---|---|---|---|---|---|---|---|")
    for res in results:
        for row in res["rows"]:
            extra = f" ({row['errors']} errors)" if "errors" in row else ""
            print(f"| {res['name']} | {row['metric']} | {row['goal']} | "
                  f"{fmt(row['p50'], row['unit'])}{extra} | {fmt(row['p99'], row['unit'])} | "
                  f"{row['floor']} | {row['ratio']} | {'yes' if row['met'] else '**no**'} |")
    if failed:
        print(f"\nFAILED: {', '.join(failed)}")
    print(f"\nbwrap processes on the host after the run: {H.host_bwrap_count()} "
          "(includes other servers' sandboxes, if any)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
