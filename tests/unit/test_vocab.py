"""Words the server and the SDK share are written down once, in agentbox.vocab."""

from __future__ import annotations

import subprocess
import sys

from agentbox import vocab
from agentbox.agent import code_host
from agentbox.core import errors, requests, states
from agentbox.sdk import protocol
from agentbox.templates import spec


def test_languages_are_one_list() -> None:
    assert requests.LANGUAGES is vocab.LANGUAGES
    assert spec.WARM_LANGUAGES is vocab.LANGUAGES
    # The in-sandbox code host runs alone (stdlib only), so it keeps a copy: it must agree.
    assert code_host.LANGUAGES == vocab.LANGUAGES
    assert vocab.DEFAULT_LANGUAGE == "python"


def test_states_are_one_enum() -> None:
    assert states.SandboxState is vocab.SandboxState
    assert (states.UNHEALTHY, states.LIVE_FILTER) == (vocab.UNHEALTHY, vocab.LIVE_FILTER)
    assert set(states.TRANSITIONS) == set(vocab.SandboxState)


def _subclasses(cls: type) -> list[type]:
    return [cls, *(s for sub in cls.__subclasses__() for s in _subclasses(sub))]


def test_every_code_the_server_declares_is_in_the_vocabulary() -> None:
    import agentbox.server.app  # noqa: F401 - every error class the server declares, loaded

    declared = {cls.code for cls in _subclasses(errors.AgentboxError)}
    declared |= set(errors.AGENT_CODE_STATUS)
    assert declared - set(vocab.ErrorCode) == set()


def test_every_code_the_sdk_maps_is_in_the_vocabulary() -> None:
    assert set(protocol._BY_CODE) - set(vocab.ErrorCode) == set()
    assert all(isinstance(code, vocab.ErrorCode) for code in protocol._BY_CODE)


def test_the_sdk_imports_without_the_server() -> None:
    # fastapi set to None makes any import of it fail; nothing of the server may load either.
    probe = (
        "import sys; sys.modules['fastapi'] = None\n"
        "from agentbox import Sandbox, AsyncSandbox\n"
        "import agentbox.sdk.keys, agentbox.sdk.audit\n"
        "loaded = [m for m in sys.modules if m.split('.')[:2] in "
        "(['agentbox', 'core'], ['agentbox', 'server'], ['agentbox', 'store'])]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
