"""The agentbox Python SDK: `Sandbox` (sync) and `AsyncSandbox`, shaped like E2B's.

    from agentbox import Sandbox

    with Sandbox.create() as sbx:
        print(sbx.commands.run("echo hi").stdout)
        sbx.files.write("notes.txt", "hello")
"""

from agentbox.sdk.async_sandbox import AsyncCommandHandle, AsyncSandbox
from agentbox.sdk.exceptions import *  # noqa: F403
from agentbox.sdk.exceptions import __all__ as _exception_names
from agentbox.sdk.models import (
    AuditEvent,
    CommandInfo,
    CommandResult,
    EntryInfo,
    Resources,
    SandboxInfo,
    Violation,
)
from agentbox.sdk.sandbox import CommandHandle, Sandbox

__all__ = [
    "Sandbox",
    "AsyncSandbox",
    "CommandHandle",
    "AsyncCommandHandle",
    "SandboxInfo",
    "CommandResult",
    "CommandInfo",
    "EntryInfo",
    "Resources",
    "Violation",
    "AuditEvent",
    *_exception_names,
]
