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
    "echo $$; id -u; id -g; id -G; ulimit -n; ulimit -c; ulimit -Hf; "
    "grep -E '^(Cap(Prm|Eff)|Cpus_allowed_list):' /proc/self/status"
)


@pytest.fixture(params=["programs", "built"])
def helper(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str | None:
    """Each form of the start context: sh, prlimit and setpriv, or startctx.c built."""
    if request.param == "programs":
        return None
    built = startctx.build(tmp_path_factory.mktemp("cache"))
    if built is None:
        pytest.skip("no C compiler here")
    return built


def test_the_child_joins_is_limited_and_dropped_before_the_command(
    tmp_path: Path, helper: str | None
) -> None:
    joins = [tmp_path / "a.procs", tmp_path / "b.procs"]
    for f in joins:
        f.touch()
    limits = [
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_FSIZE, resource.RLIM_INFINITY),
    ]
    before = os.sched_getaffinity(0)
    cpus = sorted(before)[:1]
    argv = [*startctx.argv([str(f) for f in joins], limits, 65534, helper), "sh", "-c", REPORT]
    with startctx.pinned(cpus):
        done = subprocess.run(argv, capture_output=True, text=True, cwd="/", timeout=30)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # One process from the first exec to the command: the pid written is the command's.
    assert [f.read_text().strip() for f in joins] == [lines[0]] * 2
    assert lines[1:7] == ["65534", "65534", "65534", "64", "0", "unlimited"], lines
    assert "CapPrm:\t0000000000000000" in lines and "CapEff:\t0000000000000000" in lines
    assert f"Cpus_allowed_list:\t{cpus[0]}" in lines
    assert os.sched_getaffinity(0) == before  # the spawning thread's own pin is restored


def test_a_cgroup_that_cannot_be_joined_stops_the_start(tmp_path: Path, helper: str | None) -> None:
    ran = tmp_path / "ran"
    argv = [*startctx.argv([str(tmp_path / "missing" / "cgroup.procs")], [], None, helper),
            "touch", str(ran)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert not ran.exists()


def test_a_limit_or_uid_that_cannot_be_set_stops_the_start(
    tmp_path: Path, helper: str | None
) -> None:
    ran = tmp_path / "ran"
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    for limits, uid in (
        ([(resource.RLIMIT_NOFILE, 1 << 40)], None),  # above the kernel's nr_open
        ([], -5),
    ):
        argv = [*startctx.argv([], limits, uid, helper), "touch", str(ran)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert done.returncode != 0, (limits, uid, done)
        assert not ran.exists()
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[1] == hard


def test_the_built_form_is_kept_and_rebuilt_only_for_another_source(tmp_path: Path) -> None:
    first = startctx.build(tmp_path)
    if first is None:
        pytest.skip("no C compiler here")
    assert startctx.build(tmp_path) == first
    assert os.stat(first).st_mode & 0o777 == 0o700  # run as root only by the server
    assert [p.name for p in tmp_path.iterdir()] == [Path(first).name]


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
