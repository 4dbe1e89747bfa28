"""Benchmark: what a sandbox's own user namespace and writable root cost, step by step.

The steps the process runtime adds for issue 14, each timed alone with the runtime's own code
(runtimes/process/userns.py, rootfs.py, workspace.py), on a built template tree:
- the user namespace (a child of the long-lived helper takes the block's first uid and
  unshares; the maps; the nesting limit);
- the disk image with its root layer (mkfs + mount + the upper/work/workspace dirs), beside
  the plain workspace image it replaces;
- the accounts written into the upper layer, the idmapped lower and the overlay mount;
- the teardown (overlay, then image) and the namespace's descriptor closed.
Floors in the same run: fork+exec of /bin/true, and `bwrap --ro-bind / / true`.

    .venv/bin/python bench/rootfs_setup.py --tree TEMPLATE_ROOTFS [-n 30] [--json out.json]

TEMPLATE_ROOTFS is a built template's tree, e.g. /var/tmp/agentbox-test-templates/rootfs/<key>.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

from agentbox.runtimes.process import rootfs, userns, workspace  # noqa: E402

BASE = 0x6FFE0000  # the pool's last block: a live server leases it last (random order)


def one_round(scratch: Path, tree: Path, i: int, t: dict[str, list[float]]) -> None:
    def timed(name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        out = fn()
        t.setdefault(name, []).append((time.perf_counter() - t0) * 1000)
        return out

    sdir, bind = scratch / f"s{i}", scratch / f"b{i}"
    sdir.mkdir()
    ns = timed("user namespace (helper, maps, nesting limit)", lambda: userns.make(BASE))
    try:
        timed(
            "disk image with root layer (mkfs, mount, dirs)",
            lambda: workspace.create(
                sdir, bind, 1024, BASE + 1000, True,
                root_layer=lambda d: rootfs.prepare_disk(d, BASE, BASE + 1000),
            ),
        )  # fmt: skip
        upper = bind / rootfs.DISK / rootfs.UPPER
        timed("accounts into the upper layer", lambda: rootfs.add_accounts(tree, upper, BASE))
        timed("idmapped lower + overlay mount", lambda: rootfs.mount(bind, tree, ns))
        timed("teardown: unmount the overlay", lambda: rootfs.unmount(bind))
        timed("teardown: workspace.destroy (umount -d, rm)",
              lambda: workspace.destroy(sdir, bind, keep=False))  # fmt: skip
    finally:
        timed("close the namespace's fd", lambda: os.close(ns))
    sdir.rmdir()
    # The image alone, as a default-template sandbox has it (for comparison).
    sdir.mkdir()
    timed("plain workspace image (mkfs, mount) [before]",
          lambda: workspace.create(sdir, bind, 1024, BASE + 1000, True))  # fmt: skip
    workspace.destroy(sdir, bind, keep=False)
    sdir.rmdir()


def main() -> None:
    p = H.base_args(__doc__.splitlines()[0])
    p.add_argument("--tree", type=Path, required=True, help="a built template's rootfs")
    p.add_argument("-n", type=int, default=30)
    p.add_argument("--floor-n", type=int, default=100)
    args = p.parse_args()
    mach = H.print_header("Benchmark: user namespace and writable root, step by step")
    floors = {
        "fork+exec /bin/true": H.timed_runs(lambda: H.spawn_wait(["/bin/true"]), args.floor_n),
        "bwrap --ro-bind / / /bin/true": H.timed_runs(
            lambda: H.spawn_wait(["bwrap", "--ro-bind", "/", "/", "/bin/true"]), args.floor_n
        ),
    }
    steps: dict[str, list[float]] = {}
    with H.scratch_dir("rootfs-setup") as scratch:
        for i in range(args.n + 3):
            t: dict[str, list[float]] = {}
            one_round(scratch, args.tree, i, t)
            if i >= 3:  # warm-up rounds not counted
                for k, v in t.items():
                    steps.setdefault(k, []).extend(v)
    print("Floors (same run):")
    H.print_timings(floors, 52)
    print(f"\nSteps ({args.n} rounds, template {args.tree}):")
    rows = []
    for name, xs in steps.items():
        s = H.summarize(xs)
        print(f"  {name:52s} {H.fmt_ms(s)}")
        rows.append({"metric": name, "p50": s["p50"], "p99": s["p99"], "unit": "ms"})
    H.emit(
        {
            "name": "rootfs_setup",
            "machine": mach,
            "command": " ".join(["bench/rootfs_setup.py", *sys.argv[1:]]),
            "floors": {k: H.summarize(v) for k, v in floors.items()},
            "rows": rows,
        },
        args.json,
    )


if __name__ == "__main__":
    H.run_isolated(main)
