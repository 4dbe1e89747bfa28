"""Benchmark: the isolation tiers side by side, each beside its floor, in one run.

One server serves every tier installed here (`process`, `container`, `gvisor`); per tier:

- cold create -> first command done (`echo hi`, the default template `base`), then kill;
- exec round trip of `true` in a live sandbox (native API, one keep-alive client);
- run_code `1+1` in a live code-interpreter sandbox (its kernel started);
- warm-pool claim -> first command done (a pool `base@TIER` of 2, refills not timed);
- idle memory per sandbox: the PSS of every host process in the cgroups of 5 idle sandboxes
  (on gvisor the sentry, the gofer and the ptrace stubs), divided by 5.

Floors, in the same run: bare `bwrap` running /bin/true with the process tier's namespace set;
bare `runc run` and bare `runsc run` (the gvisor tier's flags) of /bin/true in a minimal bundle
(the host's /usr read-only).

    .venv/bin/python bench/tiers.py [-n 20] [--json out.json]

Goal (issue 15): gvisor warm-pool claim -> first command p50 <= 30 ms, or a profile saying
what the ptrace platform costs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

BINARIES = {"process": "bwrap", "container": "runc", "gvisor": "runsc"}
ECHO = "echo hi"


def tiers() -> list[str]:
    return [t for t, b in BINARIES.items() if shutil.which(b)]


def cold(c: httpx.Client, tier: str, n: int) -> list[float]:
    out = []
    for i in range(n + 2):
        t0 = time.perf_counter()
        sid = H.create_sandbox(c, isolation=tier)["sandbox_id"]
        code, text = H.run_command(c, sid, ECHO)
        t1 = time.perf_counter()
        assert code == 0 and text == "hi\n", (code, text)
        c.delete(f"/v1/sandboxes/{sid}")
        if i >= 2:
            out.append((t1 - t0) * 1000)
    return out


def exec_rtt(c: httpx.Client, tier: str, n: int) -> list[float]:
    sid = H.create_sandbox(c, isolation=tier)["sandbox_id"]
    try:
        return H.timed_runs(lambda: H.run_command(c, sid, "true"), n, warmup=5)
    finally:
        c.delete(f"/v1/sandboxes/{sid}")


def run_code(c: httpx.Client, tier: str, n: int) -> list[float]:
    sid = H.create_sandbox(c, isolation=tier, template="code-interpreter")["sandbox_id"]

    def once() -> None:
        with c.stream("POST", f"/v1/sandboxes/{sid}/code/execute", json={"code": "1+1"}) as r:
            body = r.read().decode()
        assert r.status_code == 200 and '"2"' in body, body[-300:]

    try:
        return H.timed_runs(once, n, warmup=3)
    finally:
        c.delete(f"/v1/sandboxes/{sid}")


def claims(c: httpx.Client, tier: str, default: str, n: int) -> list[float]:
    name = "base" if tier == default else f"base@{tier}"
    c.put(f"/v1/pools/{name}", json={"size": 2}).raise_for_status()
    out = []
    try:
        for _ in range(n):
            deadline = time.monotonic() + 120
            while True:
                pool = next(p for p in c.get("/v1/pools").json()["pools"] if p["template"] == name)
                if pool["ready"] >= 2 and pool["starting"] == 0:
                    break
                assert time.monotonic() < deadline, pool
                time.sleep(0.02)
            t0 = time.perf_counter()
            sid = H.create_sandbox(c, isolation=tier)["sandbox_id"]
            code, _ = H.run_command(c, sid, "true")
            out.append((time.perf_counter() - t0) * 1000)
            assert code == 0
            c.delete(f"/v1/sandboxes/{sid}")
    finally:
        c.put(f"/v1/pools/{name}", json={"size": 0})
    return out


def idle_memory(c: httpx.Client, tier: str, k: int = 5) -> float:
    """MiB of PSS per idle sandbox: every host process in its cgroups."""
    ids = [H.create_sandbox(c, isolation=tier)["sandbox_id"] for _ in range(k)]
    try:
        time.sleep(2)
        pids: set[int] = set()
        for sid in ids:
            pids |= H.cgroup_pids(sid)
        return sum(H.pss_kb(p) for p in pids) / 1024 / k
    finally:
        for sid in ids:
            c.delete(f"/v1/sandboxes/{sid}")


# ---------------------------------------------------------------- floors


def _bundle(root: Path, binary: str) -> list[str]:
    """A minimal OCI bundle running /bin/true (the host's /usr, read-only); its run argv."""
    rootfs = root / "rootfs"
    for d in ("usr", "proc", "dev", "tmp"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        target = os.readlink(f"/{link}") if os.path.islink(f"/{link}") else f"usr/{link}"
        if not (rootfs / link).is_symlink():
            os.symlink(target, rootfs / link)
    spec = {
        "ociVersion": "1.0.2",
        "root": {"path": str(rootfs), "readonly": True},
        "process": {"user": {"uid": 0, "gid": 0}, "args": ["/bin/true"], "cwd": "/",
                    "env": ["PATH=/usr/bin:/bin"], "noNewPrivileges": True},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
        ],
        "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]},
    }
    (root / "config.json").write_text(json.dumps(spec))
    state = root / "state"
    if binary == "runsc":
        flags = ["--platform=ptrace", "--network=none"]
        return ["runsc", "--root", str(state), *flags, "run", "--bundle", str(root)]
    return ["runc", "--root", str(state), "run", "--bundle", str(root)]


def floor(binary: str, n: int) -> list[float]:
    with tempfile.TemporaryDirectory(prefix=f"agentbox-bench-floor-{binary}-") as tmp:
        if binary == "bwrap":
            argv = H.BARE_BWRAP
        else:
            argv = _bundle(Path(tmp), binary)
        times = []
        for i in range(n + 2):
            name = f"floor{i}"
            full = argv if binary == "bwrap" else [*argv, name]
            t0 = time.perf_counter()
            subprocess.run(full, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            if i >= 2:
                times.append((time.perf_counter() - t0) * 1000)
        return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("-n", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    served = tiers()
    H.ensure_template(H.BENCH_TEMPLATE_DIR, "base")
    H.ensure_template(H.BENCH_TEMPLATE_DIR, "code-interpreter")
    m = H.machine()
    print(f"machine: {H.machine_line(m)}")
    results: dict[str, Any] = {"machine": m, "tiers": {}, "floors": {}}
    for binary in ("bwrap", "runc", "runsc"):
        if shutil.which(binary):
            s = H.summarize(floor(binary, a.n))
            results["floors"][binary] = s
            print(f"  floor: bare {binary} of /bin/true: {H.fmt_ms(s)}")
    with H.BenchServer("tiers", runtimes=",".join(served),
                       template_dir=H.BENCH_TEMPLATE_DIR) as srv:
        srv.set_quota(max_total_descriptors=1 << 40, max_sandboxes=100)
        with srv.client() as c:
            for tier in served:
                row: dict[str, Any] = {}
                for label, fn in (
                    ("cold create -> first command", lambda t=tier: cold(c, t, a.n)),
                    ("exec round trip of true", lambda t=tier: exec_rtt(c, t, a.n * 5)),
                    ("run_code 1+1", lambda t=tier: run_code(c, t, a.n * 2)),
                    ("warm-pool claim -> first command",
                     lambda t=tier: claims(c, t, served[0], a.n)),
                ):
                    row[label] = H.summarize(fn())
                    print(f"  {tier:9s} {label:34s} {H.fmt_ms(row[label])}", flush=True)
                row["idle MiB PSS per sandbox"] = idle_memory(c, tier)
                print(f"  {tier:9s} {'idle memory per sandbox':34s} "
                      f"{row['idle MiB PSS per sandbox']:.1f} MiB PSS", flush=True)
                results["tiers"][tier] = row
    if a.json:
        results["rows"] = rows(results)
        a.json.write_text(json.dumps(results, indent=2))


def rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every figure as a row (metric, unit, p50, p99), the form bench/compare.py reads."""
    out = [{"metric": f"floor: bare {binary}", "unit": "ms", "p50": s["p50"], "p99": s["p99"]}
           for binary, s in results["floors"].items()]
    for tier, row in results["tiers"].items():
        for label, s in row.items():
            if isinstance(s, dict):
                out.append({"metric": f"{tier} {label}", "unit": "ms", "p50": s["p50"],
                            "p99": s["p99"]})
            else:
                out.append({"metric": f"{tier} {label}", "unit": "MiB", "p50": s})
    return out


if __name__ == "__main__":
    main()
