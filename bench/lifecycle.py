"""Benchmark: pause and resume with memory kept, per tier, beside the freezer itself.

One server serves every tier installed here; per tier, one sandbox (its agent and a background
`sleep`) paused and resumed n times through the API:

- pause: `POST /v1/sandboxes/{id}/pause` answered (every process frozen);
- resume: `POST /v1/sandboxes/{id}/resume` answered (thawed, serving);
- resume -> first command: the resume and a `true` run to its end.

Floor, in the same run: the cgroup freezer alone on the same sandbox (v1 `freezer.state` FROZEN
until it reads FROZEN, then THAWED; v2 `cgroup.freeze`), from this process.

    .venv/bin/python bench/lifecycle.py [-n 50] [--json out.json]

Goal (issue 16): pause and resume p50 <= 20 ms each on `process`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

BINARIES = {"process": "bwrap", "container": "runc", "gvisor": "runsc"}


def tiers() -> list[str]:
    return [t for t, b in BINARIES.items() if shutil.which(b)]


def _freezer(sid: str) -> tuple[Path, str, str, Path, str]:
    """(control file, frozen value, thawed value, state file, frozen state text)."""
    for d in H._cgroup_dirs(sid):
        if (d / "freezer.state").exists():
            return d / "freezer.state", "FROZEN", "THAWED", d / "freezer.state", "FROZEN"
        if (d / "cgroup.freeze").exists():
            return d / "cgroup.freeze", "1", "0", d / "cgroup.events", "frozen 1"
    raise RuntimeError(f"no freezer cgroup for {sid}")


def floor(sid: str, n: int) -> tuple[list[float], list[float]]:
    control, frozen, thawed, state, frozen_text = _freezer(sid)
    freezes, thaws = [], []
    for _ in range(n + 3):
        t0 = time.perf_counter()
        control.write_text(frozen)
        while frozen_text not in state.read_text():
            time.sleep(0.0002)
        t1 = time.perf_counter()
        control.write_text(thawed)
        while frozen_text in state.read_text():
            time.sleep(0.0002)
        t2 = time.perf_counter()
        freezes.append((t1 - t0) * 1000)
        thaws.append((t2 - t1) * 1000)
    return freezes[3:], thaws[3:]


def cycles(c: httpx.Client, sid: str, n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"pause": [], "resume": [], "resume -> first command": []}
    for i in range(n + 3):
        t0 = time.perf_counter()
        c.post(f"/v1/sandboxes/{sid}/pause").raise_for_status()
        t1 = time.perf_counter()
        c.post(f"/v1/sandboxes/{sid}/resume").raise_for_status()
        t2 = time.perf_counter()
        code, _ = H.run_command(c, sid, "true")
        t3 = time.perf_counter()
        assert code == 0
        if i >= 3:
            out["pause"].append((t1 - t0) * 1000)
            out["resume"].append((t2 - t1) * 1000)
            out["resume -> first command"].append((t3 - t1) * 1000)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("-n", type=int, default=50)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    served = tiers()
    H.ensure_template(H.BENCH_TEMPLATE_DIR, "base")
    m = H.machine()
    print(f"machine: {H.machine_line(m)}")
    results: dict[str, Any] = {"machine": m, "tiers": {}}
    with H.BenchServer("lifecycle", runtimes=",".join(served),
                       template_dir=H.BENCH_TEMPLATE_DIR) as srv:
        with srv.client() as c:
            for tier in served:
                sid = H.create_sandbox(c, isolation=tier)["sandbox_id"]
                H.run_command(c, sid, "nohup sleep 100000 >/dev/null 2>&1 &")
                try:
                    row = {k: H.summarize(v) for k, v in cycles(c, sid, a.n).items()}
                    freezes, thaws = floor(sid, a.n)
                    row["floor: freezer freeze"] = H.summarize(freezes)
                    row["floor: freezer thaw"] = H.summarize(thaws)
                    row["host processes"] = len(H.cgroup_pids(sid))
                finally:
                    c.delete(f"/v1/sandboxes/{sid}")
                for label, s in row.items():
                    if isinstance(s, dict):
                        print(f"  {tier:9s} {label:26s} {H.fmt_ms(s)}", flush=True)
                print(f"  {tier:9s} {'host processes':26s} {row['host processes']}", flush=True)
                results["tiers"][tier] = row
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
