"""The battery's weakenings live in weaken.py only (issue 13): the production process runtime
takes none and builds its sandbox with no weakening logic; `WeakenedProcessRuntime` overrides
its hooks, builds exactly the production sandbox when given none, takes away exactly the layer
named otherwise, and declares honestly what it no longer enforces."""

from __future__ import annotations

import ast
import inspect
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from agentbox import runtimes
from agentbox.battery.server import weakened_runtime
from agentbox.runtimes.base import Resources, SandboxSpec
from agentbox.runtimes.process import runtime as process_runtime
from agentbox.runtimes.process.runtime import ProcessRuntime
from agentbox.runtimes.process.weaken import WeakenedProcessRuntime
from agentbox.server.app import open_runtimes

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0, reason="needs bubblewrap and root"
)
SPEC = SandboxSpec("sbx_weak0000000001", "default", Resources(tmp_mb=32))
# Stand-ins for the descriptors _spawn opens; only their numbers reach the argv.
FDS = {"seccomp": 3, "info": 4, "listen": 5, "proc:/proc/loadavg": 6, "leak": 7, "userns": 8}


def test_the_production_runtime_has_no_weakening() -> None:
    params = inspect.signature(ProcessRuntime.__init__).parameters
    assert not {"weaken", "bind_host"} & params.keys()
    tree = ast.parse(Path(process_runtime.__file__).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not {n for n in names if "weak" in n.lower()}
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    assert "--weaken" not in strings and "--leak-fd" not in strings



@pytest.fixture
def argv_of(data_dir: Path) -> Callable[..., list[str]]:
    """argv_of(ProcessRuntime) or argv_of(WeakenedProcessRuntime, weaken=...) -> bwrap argv,
    each runtime opened and closed over the same data dir (so the same host paths)."""
    import asyncio

    def argv_of(cls: type[ProcessRuntime], **config: object) -> list[str]:
        rt = cls(data_dir, **config)  # type: ignore[arg-type]
        try:
            argv, _ = rt._command(SPEC, data_dir / "ws", dict(FDS))
            return argv
        finally:
            asyncio.run(rt.close())

    return argv_of


@needs_bwrap
def test_with_no_weakening_the_sandbox_is_the_production_one(
    argv_of: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same bwrap command to the letter; only the agent's start differs where the
    production one forks its agent (the weakened one runs it, as with AGENTBOX_AGENT_START=exec):
    bwrap then runs the hold program in its place."""
    monkeypatch.setenv("AGENTBOX_AGENT_START", "exec")
    prod = argv_of(ProcessRuntime)
    assert argv_of(WeakenedProcessRuntime) == prod
    assert "--weaken" not in prod and "--leak-fd" not in prod
    assert {"--userns", "--assert-userns-disabled", "--seccomp", "--size"} <= set(prod)
    assert prod[prod.index("--userns") + 1] == "8" and "--cap-drop" in prod
    monkeypatch.setenv("AGENTBOX_AGENT_START", "fork")
    forked = argv_of(ProcessRuntime)
    if forked != prod:  # forked (as root, on x86_64)
        assert forked[-1] == "/.agentbox/hold" and forked[-2] == "--"
        assert forked[:-1] == prod[: len(forked) - 1]


@needs_bwrap
def test_each_weakening_takes_away_its_layer(argv_of: Callable) -> None:
    prod = argv_of(ProcessRuntime)

    def weak(*flags: str, **kw: object) -> list[str]:
        return argv_of(WeakenedProcessRuntime, weaken=flags, **kw)

    assert "--seccomp" in prod and "--seccomp" not in weak("no-seccomp")
    assert "--unshare-net" not in weak("share-net") and "--unshare-net" in weak("share-ipc")
    assert "--assert-userns-disabled" not in weak("allow-userns")
    root = weak("host-root")
    assert root[root.index("--cap-add") + 1] == "ALL" and "--userns" not in root
    shared = weak("share-pid")
    assert shared[shared.index("/proc") - 1] == "--bind" and "--proc" not in shared
    assert "--size" not in weak("no-limits")
    assert not any(a.startswith("/proc/") for a in weak("host-info"))
    agent = weak("no-landlock", "leak-fd")[-4:]
    assert agent == ["--weaken", "leak-fd,no-landlock", "--leak-fd", "7"]
    bound = weak(bind_host=["/srv/canary"])
    i = bound.index("/srv/canary")
    assert bound[i - 1 : i + 2] == ["--bind", "/srv/canary", "/srv/canary"]


@needs_bwrap
def test_the_unsandboxed_control_runs_the_agent_bare(data_dir: Path) -> None:
    import asyncio

    rt = WeakenedProcessRuntime(data_dir, weaken=["unsandboxed"])
    try:
        argv, env = rt._command(SPEC, data_dir / "ws", dict(FDS))
    finally:
        asyncio.run(rt.close())
    assert argv[0] == process_runtime.SANDBOX_PYTHON and "bwrap" not in argv
    assert argv[argv.index("--workspace") + 1] == str(data_dir / "ws")
    assert env["HOME"] == str(data_dir / "ws")


@needs_bwrap
def test_features_stay_honest(data_dir: Path) -> None:
    import asyncio

    prod = ProcessRuntime(data_dir)
    assert prod.features().enforces and prod.features().own_uids
    asyncio.run(prod.close())
    rt = WeakenedProcessRuntime(data_dir, weaken=["no-limits", "same-uid"])
    try:
        feats = rt.features()
        assert feats.enforces == frozenset() and not feats.own_uids
        assert rt.resource_ceilings() == {}
        assert feats.network and feats.kept_workspaces
    finally:
        asyncio.run(rt.close())


def test_the_battery_server_serves_the_weakened_runtime_only_when_asked() -> None:
    assert weakened_runtime("process", {"egress-open"}, []) == ("process", None)
    name, config = weakened_runtime("process", {"no-seccomp", "egress-open"}, ["/srv/x"])
    assert name == WeakenedProcessRuntime.name == "process-weakened"
    assert config == {"weaken": ["no-seccomp"], "bind_host": ["/srv/x"]}
    assert runtimes.factory(name) is WeakenedProcessRuntime
    assert weakened_runtime("process,fake", {"share-net"}, [])[0] == "process-weakened,fake"
    with pytest.raises(ValueError, match="no weakened version of the 'fake' runtime"):
        weakened_runtime("fake", {"share-net"}, [])
    # Never installed: only the battery's server, in its own process, registers them.
    installed = runtimes._entry_points()
    assert not {"process-weakened", "container-weakened", "gvisor-weakened"} & set(installed)


@needs_bwrap
def test_the_server_opens_it_under_its_own_name(data_dir: Path) -> None:
    import asyncio

    name, config = weakened_runtime("process", {"no-limits"}, [])
    served = open_runtimes(name, data_dir, config)
    try:
        assert served.default == "process-weakened"
        assert served.features("process-weakened").enforces == frozenset()
    finally:
        asyncio.run(served.close())
