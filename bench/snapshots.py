"""Benchmark: snapshots, creates from a snapshot and forks, per tier, beside their floors.

One server serves every tier installed here; per tier, one `base` sandbox with 100 MiB written
to its workspace (random bytes: nothing to compress or skip) and a background `sleep`:

- snapshot: `POST /v1/sandboxes/{id}/snapshots` answered (frozen, synced, image copied, thawed);
- create from snapshot -> first command: `POST /v1/sandboxes {"template": <snapshot>}` and a
  `true` run in it to its end;
- fork -> first command: `POST /v1/sandboxes/{id}/fork` (count 1) and a `true` run in the child
  to its end.

Floors, in the same run: the image copy alone (the server's own `clone_image` of that sandbox's
image, from this process: what a snapshot cannot do without), and a plain create of `base` ->
first command (what a fork adds its copy to).

    .venv/bin/python bench/snapshots.py [-n 10] [--json out.json]

Goals (issue 16): snapshot of a sandbox with 100 MiB written <= 100 ms; fork to a child that
answers a command <= 250 ms on `process`.
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

from agentbox.runtimes.diskimage import clone_image  # noqa: E402

BINARIES = {"process": "bwrap", "container": "runc", "gvisor": "runsc"}
WRITE = "head -c 104857600 /dev/urandom > /workspace/blob && sync"


def tiers() -> list[str]:
    return [t for t, b in BINARIES.items() if shutil.which(b)]


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _image(srv: H.BenchServer, sid: str) -> Path:
    found = sorted(srv.data_dir.glob(f"sandboxes*/{sid}/workspace.img"))
    assert found, f"no image of {sid}"
    return found[0]


def rounds(srv: H.BenchServer, c: httpx.Client, tier: str, n: int) -> dict[str, Any]:
    sid = H.create_sandbox(c, isolation=tier, template="base")["sandbox_id"]
    out: dict[str, list[float]] = {
        "snapshot": [],
        "floor: image copy": [],
        "create from snapshot -> command": [],
        "fork -> child's command": [],
        "floor: create -> command": [],
    }
    try:
        code, _ = H.run_command(c, sid, WRITE + "; nohup sleep 100000 >/dev/null 2>&1 &")
        assert code == 0
        image = _image(srv, sid)
        scratch = srv.data_dir / "bench-copy.img"
        for i in range(n + 2):
            warm = i < 2
            t0 = time.perf_counter()
            r = c.post(f"/v1/sandboxes/{sid}/snapshots", json={})
            r.raise_for_status()
            snap = r.json()["snapshot_id"]
            out["snapshot"].append(_ms(t0))

            t0 = time.perf_counter()
            clone_image(image, scratch)
            out["floor: image copy"].append(_ms(t0))
            scratch.unlink()

            t0 = time.perf_counter()
            child = H.create_sandbox(c, template=snap)["sandbox_id"]
            assert H.run_command(c, child, "true")[0] == 0
            out["create from snapshot -> command"].append(_ms(t0))
            c.delete(f"/v1/sandboxes/{child}")
            c.delete(f"/v1/snapshots/{snap}")

            t0 = time.perf_counter()
            r = c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 1})
            r.raise_for_status()
            kid = r.json()["sandboxes"][0]["sandbox_id"]
            assert H.run_command(c, kid, "true")[0] == 0
            out["fork -> child's command"].append(_ms(t0))
            c.delete(f"/v1/sandboxes/{kid}")

            t0 = time.perf_counter()
            plain = H.create_sandbox(c, isolation=tier, template="base")["sandbox_id"]
            assert H.run_command(c, plain, "true")[0] == 0
            out["floor: create -> command"].append(_ms(t0))
            c.delete(f"/v1/sandboxes/{plain}")
            if warm:
                for v in out.values():
                    v.pop()
        row: dict[str, Any] = {k: H.summarize(v) for k, v in out.items()}
        row["image bytes"] = image.stat().st_blocks * 512
        return row
    finally:
        c.delete(f"/v1/sandboxes/{sid}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("-n", type=int, default=10)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    served = tiers()
    H.ensure_template(H.BENCH_TEMPLATE_DIR, "base")
    m = H.machine()
    print(f"machine: {H.machine_line(m)}")
    results: dict[str, Any] = {"machine": m, "tiers": {}}
    with H.BenchServer(
        "snapshots", runtimes=",".join(served), template_dir=H.BENCH_TEMPLATE_DIR
    ) as srv:
        with srv.client() as c:
            copy = c.get("/v1/health").json().get("snapshots")
            print(f"copies: {copy}")
            results["copy"] = copy
            for tier in served:
                row = rounds(srv, c, tier, a.n)
                for label, s in row.items():
                    if isinstance(s, dict):
                        print(f"  {tier:9s} {label:34s} {H.fmt_ms(s)}", flush=True)
                print(f"  {tier:9s} {'image bytes':34s} {row['image bytes']}", flush=True)
                results["tiers"][tier] = row
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
