"""agentbox: self-hosted sandboxes for AI agents that write and run code.

`from agentbox import Sandbox, AsyncSandbox` loads the SDK on first use, so the server and the
runtimes do not pay for importing it.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing is ~10 ms to import on a small host; `agentbox exec` needs none
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"

_SDK_NAMES = frozenset(
    {"Sandbox", "Templates", "Secrets", "Workspaces", "Volumes"}
    | {"AsyncSandbox", "AsyncTemplates", "AsyncSecrets", "AsyncWorkspaces", "AsyncVolumes"}
)


def __getattr__(name: str) -> Any:
    if name in _SDK_NAMES:
        from agentbox import sdk

        return getattr(sdk, name)
    from agentbox.sdk import exceptions

    if name in getattr(exceptions, "__all__", ()):
        return getattr(exceptions, name)
    raise AttributeError(f"module 'agentbox' has no attribute {name!r}")
