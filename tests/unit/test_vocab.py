"""Words the server and the SDK share are written down once, in agentbox.vocab."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

# The agent's modules import each other as top-level modules, as inside a sandbox.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src/agentbox/agent"))

from agentbox import vocab  # noqa: E402
from agentbox.agent import code_host  # noqa: E402
from agentbox.core import errors, requests, states  # noqa: E402
from agentbox.sdk import protocol  # noqa: E402
from agentbox.templates import spec  # noqa: E402


def test_languages_are_one_list() -> None:
    assert requests.LANGUAGES is vocab.LANGUAGES
    assert spec.WARM_LANGUAGES is vocab.LANGUAGES
    # The in-sandbox code host runs alone (stdlib only), so it keeps a copy: it must agree.
    assert code_host.LANGUAGES == vocab.LANGUAGES
    assert vocab.DEFAULT_LANGUAGE == "python"


def test_the_agent_knows_the_users_the_runtime_makes() -> None:
    # The agent's modules import each other as top-level modules (it runs alone in the
    # sandbox): its literal is read, not imported.
    tree = ast.parse((Path(code_host.__file__).parent / "users.py").read_text())
    (ids,) = [
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "IDS"
    ]
    assert ids == {"user": vocab.USER_UID, "root": 0}


def test_states_are_one_enum() -> None:
    assert states.SandboxState is vocab.SandboxState
    assert (states.UNHEALTHY, states.LIVE_FILTER) == (vocab.UNHEALTHY, vocab.LIVE_FILTER)
    assert set(states.TRANSITIONS) == set(vocab.SandboxState)


def _subclasses(cls: type) -> list[type]:
    return [cls, *(s for sub in cls.__subclasses__() for s in _subclasses(sub))]


def test_every_code_the_server_declares_is_in_the_vocabulary() -> None:
    import agentbox.server.app  # noqa: F401 - every error class the server declares, loaded

    declared = {cls.code for cls in _subclasses(errors.AgentboxError)}
    assert declared - set(vocab.ErrorCode) == set()


def test_every_code_has_its_status_once() -> None:
    # Each code an answer or an audit record can carry has one status; only the SDK's own
    # codes, for errors that never reached a server, have none.
    assert set(vocab.STATUS) | vocab.CLIENT_SIDE == set(vocab.ErrorCode)
    assert set(vocab.STATUS) <= set(vocab.ErrorCode)
    assert all(100 <= status <= 599 for status in vocab.STATUS.values())
    assert all(vocab.status_of(code) == s for code, s in vocab.STATUS.items())


def test_every_code_the_agent_returns_has_a_status() -> None:
    # The agent runs alone in the sandbox (stdlib only, not importable here) and names its
    # codes where it fails; one missing from vocab.STATUS would be recorded and answered 500.
    from agentbox.agent import code_bridge

    source = (Path(code_bridge.__file__).parent / "sandbox_agent.py").read_text()
    agent_codes = set(re.findall(r'OpError\(\s*"([a-z_]+)"', source))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and "_ERRNO_CODES" in _names(node):
            assert isinstance(node.value, ast.Dict)
            agent_codes |= {ast.literal_eval(v)[0] for v in node.value.values}
    # Named in expressions the scan does not read: a failed syscall's fallback, the limits
    # and read-only paths a sandbox runs into, the code host's unknown failures.
    agent_codes |= {"io_error", "limit_exceeded", "read_only_path", "code_host_error"}
    agent_codes |= set(code_bridge.CODES.values())
    assert {"path_not_found", "read_only_path", "kernel_dead"} <= agent_codes
    assert agent_codes - set(vocab.STATUS) == set()


def _names(node: ast.Assign) -> set[str]:
    return {t.id for t in node.targets if isinstance(t, ast.Name)}


def test_every_code_the_sdk_maps_is_in_the_vocabulary() -> None:
    assert set(protocol._BY_CODE) - set(vocab.ErrorCode) == set()
    assert all(isinstance(code, vocab.ErrorCode) for code in protocol._BY_CODE)


def _in_a_fresh_interpreter(probe: str) -> None:
    """Run `probe` in a new Python (imports start from nothing); its assertions must hold."""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_sdk_imports_without_the_server() -> None:
    # fastapi set to None makes any import of it fail; nothing of the server may load either.
    _in_a_fresh_interpreter(
        "import sys; sys.modules['fastapi'] = None\n"
        "from agentbox import Sandbox, AsyncSandbox\n"
        "import agentbox.sdk.keys, agentbox.sdk.audit\n"
        "loaded = [m for m in sys.modules if m.split('.')[:2] in "
        "(['agentbox', 'core'], ['agentbox', 'server'], ['agentbox', 'store'])]\n"
        "assert not loaded, loaded\n"
    )


def test_the_cli_and_the_sync_sdk_do_not_load_asyncio() -> None:
    """asyncio is ~35 ms of an `agentbox` command's start: only the async face loads it."""
    _in_a_fresh_interpreter(
        "import sys\n"
        "import agentbox.cli.app, agentbox.sdk.keys, agentbox.sdk.audit\n"
        "from agentbox import Sandbox\n"
        "assert 'asyncio' not in sys.modules, 'asyncio loaded'\n"
        "from agentbox import AsyncSandbox\n"
        "from agentbox.sdk import AsyncSandbox as same\n"
        "assert AsyncSandbox is same and 'asyncio' in sys.modules\n"
    )


def test_the_cli_parses_a_command_without_pydantic() -> None:
    """typer 0.29 coerces every parameter through pydantic, ~120 ms of `agentbox exec`'s
    ~330 (hence `typer<0.29`): running a command line must not load it."""
    _in_a_fresh_interpreter(
        "import sys\n"
        "sys.argv = ['agentbox', '--api-url', 'http://127.0.0.1:9', '--api-key', 'k', 'exec',\n"
        "            'sbx-1', '--cwd', '/tmp', '-e', 'A=1', '--timeout', '5', '--', 'true']\n"
        "from agentbox.cli.app import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as e:\n"
        "    assert e.code == 1, e.code  # the server is not there: the command was parsed\n"
        "assert 'pydantic' not in sys.modules, 'pydantic loaded'\n"
    )
