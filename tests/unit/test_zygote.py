"""The agent's forked start, the parts that need no sandbox: the hold program bwrap runs while
the agent is forked in, and the zygote's closed list of modules it imports ahead for agents."""

from __future__ import annotations

import ast
import os
import platform
import select
import subprocess
import time
from pathlib import Path

import pytest

from agentbox.runtimes.process import hold

AGENT = Path(__file__).resolve().parents[2] / "src" / "agentbox" / "agent"
# The modules a running agent's process has loaded (code_host.py and sudo.py run in processes
# of their own, on the sandbox's Python).
AGENT_PROCESS_MODULES = (
    "sandbox_agent.py",
    "users.py",
    "relay.py",
    "code_bridge.py",
    "protocol.py",
    "confine.py",
)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the hold program is x86_64 only")
def test_the_hold_program_says_ready_then_waits_for_the_end_of_its_stdin(tmp_path: Path) -> None:
    program = tmp_path / "hold"
    code = hold.code()
    assert code is not None
    program.write_bytes(code)
    program.chmod(0o555)
    stdin_r, stdin_w = os.pipe()
    proc = subprocess.Popen([str(program)], stdin=stdin_r, stdout=subprocess.PIPE)
    os.close(stdin_r)
    try:
        assert proc.stdout is not None
        ready = select.select([proc.stdout], [], [], 5)[0]
        assert ready, "no ready byte"
        assert len(proc.stdout.read(1)) == 1
        time.sleep(0.2)
        assert proc.poll() is None, "it must wait while the write end is open"
        os.close(stdin_w)
        stdin_w = -1
        assert proc.wait(timeout=5) == 0
    finally:
        if stdin_w >= 0:
            os.close(stdin_w)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_there_is_no_hold_program_for_an_unknown_machine() -> None:
    assert hold.code("sparc64") is None


def _preload() -> set[str]:
    tree = ast.parse((AGENT / "zygote.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "PRELOAD" for t in node.targets
        ):
            return {ast.literal_eval(e) for e in node.value.elts}  # type: ignore[attr-defined]
    raise AssertionError("zygote.py has no PRELOAD")


def _imports(node: ast.AST) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Import):
            names |= {alias.name for alias in sub.names}
        elif isinstance(sub, ast.ImportFrom) and sub.module and not sub.level:
            names.add(sub.module)
    return names


def test_every_import_a_running_agent_makes_is_preloaded_by_the_zygote() -> None:
    """A forked agent's `/` is its sandbox's: a module the zygote did not import before it
    forked cannot be loaded (the host's standard library is not there). So every import
    inside a function of the agent's process (made after its start) must be in PRELOAD,
    or be imported at the top of one of its modules (loaded by the zygote with them)."""
    top: set[str] = set()
    late: dict[str, set[str]] = {}
    for name in AGENT_PROCESS_MODULES:
        tree = ast.parse((AGENT / name).read_text())
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                top |= _imports(node)
            else:
                for found in _imports(node):
                    late.setdefault(found, set()).add(name)
    missing = {m: sorted(where) for m, where in late.items() if m not in top | _preload()}
    assert not missing, f"imported after the agent starts, not preloaded: {missing}"


def test_the_preloaded_modules_are_all_the_agents_or_the_standard_librarys() -> None:
    """The zygote holds capabilities over every sandbox: it imports nothing from outside
    the host's standard library and the agent's own tree (never the server's packages)."""
    import sys

    ours = {p.stem for p in AGENT.glob("*.py")}
    for name in _preload():
        root = name.split(".")[0]
        assert root in ours or root in sys.stdlib_module_names, name
