"""The process tier's start context (runtimes/process/startctx.py): what bwrap is started
behind, so that the server is not forked, does what the in-fork code did, in its order."""

from __future__ import annotations

import os
import resource
import subprocess
from pathlib import Path

import pytest

from agentbox.runtimes.process import startctx

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="drops to another uid: needs root")

REPORT = (
    "echo $$; id -u; id -g; id -G; ulimit -n; ulimit -c; "
    "grep -E '^(Cap(Prm|Eff)|Cpus_allowed_list):' /proc/self/status"
)


def test_the_child_joins_is_limited_and_dropped_before_the_command(tmp_path: Path) -> None:
    joins = [tmp_path / "a.procs", tmp_path / "b.procs"]
    for f in joins:
        f.touch()
    limits = [(resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)]
    before = os.sched_getaffinity(0)
    cpus = sorted(before)[:1]
    argv = [*startctx.argv([str(f) for f in joins], limits, 65534), "sh", "-c", REPORT]
    with startctx.pinned(cpus):
        done = subprocess.run(argv, capture_output=True, text=True, cwd="/", timeout=30)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # One process from the first exec to the command: the pid written is the command's.
    assert [f.read_text().strip() for f in joins] == [lines[0]] * 2
    assert lines[1:6] == ["65534", "65534", "65534", "64", "0"], lines
    assert "CapPrm:\t0000000000000000" in lines and "CapEff:\t0000000000000000" in lines
    assert f"Cpus_allowed_list:\t{cpus[0]}" in lines
    assert os.sched_getaffinity(0) == before  # the spawning thread's own pin is restored


def test_a_cgroup_that_cannot_be_joined_stops_the_start(tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    argv = [*startctx.argv([str(tmp_path / "missing" / "cgroup.procs")], [], None),
            "touch", str(ran)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert not ran.exists()


def test_the_warming_process_joins_every_cgroup_and_is_gone_once_settled(tmp_path: Path) -> None:
    joins = [tmp_path / "memory.procs", tmp_path / "pids.procs"]
    for f in joins:
        f.touch()
    warming = startctx.warm_join([str(f) for f in joins])
    assert warming is not None
    startctx.settle(warming)
    assert warming.returncode == 0
    assert {f.read_text().strip() for f in joins} == {str(warming.pid)}
    assert startctx.warm_join([]) is None
    startctx.settle(None)
