"""The agentbox Python SDK: `Sandbox` (sync) and `AsyncSandbox`, shaped like E2B's.

    from agentbox import Sandbox

    with Sandbox.create() as sbx:
        print(sbx.commands.run("echo hi").stdout)
        sbx.files.write("notes.txt", "hello")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentbox.sdk.exceptions import *  # noqa: F403
from agentbox.sdk.exceptions import __all__ as _exception_names
from agentbox.sdk.models import (
    AuditEvent,
    BlockedAttempt,
    BuildProgress,
    CommandInfo,
    CommandResult,
    Context,
    EgressEvent,
    EntryInfo,
    EntryList,
    Execution,
    ExecutionError,
    FilesystemEvent,
    KeptWorkspace,
    KeyInfo,
    Logs,
    NetworkInfo,
    OutputMessage,
    PoolStats,
    Resources,
    Result,
    SandboxInfo,
    SandboxMetrics,
    SecretInfo,
    SnapshotInfo,
    TemplateInfo,
    Violation,
    VolumeInfo,
)
from agentbox.sdk.sandbox import (
    CommandHandle,
    Sandbox,
    Secrets,
    Templates,
    Volumes,
    Workspaces,
)

__all__ = [
    "Sandbox",
    "AsyncSandbox",
    "CommandHandle",
    "AsyncCommandHandle",
    "SandboxInfo",
    "SandboxMetrics",
    "SnapshotInfo",
    "VolumeInfo",
    "BuildProgress",
    "CommandResult",
    "CommandInfo",
    "EntryInfo",
    "EntryList",
    "FilesystemEvent",
    "Resources",
    "Violation",
    "AuditEvent",
    "Templates",
    "AsyncTemplates",
    "Secrets",
    "AsyncSecrets",
    "SecretInfo",
    "NetworkInfo",
    "BlockedAttempt",
    "EgressEvent",
    "Execution",
    "Result",
    "Logs",
    "ExecutionError",
    "OutputMessage",
    "Context",
    "TemplateInfo",
    "PoolStats",
    "Workspaces",
    "AsyncWorkspaces",
    "Volumes",
    "AsyncVolumes",
    "KeptWorkspace",
    "KeyInfo",
    *_exception_names,
]

# The async half (and asyncio with it) loads on first use: the CLI and sync callers do not pay
# for it (~35 ms of an `agentbox` command's start).
_ASYNC_NAMES = frozenset(
    (
        "AsyncCommandHandle",
        "AsyncSandbox",
        "AsyncSecrets",
        "AsyncTemplates",
        "AsyncVolumes",
        "AsyncWorkspaces",
    )
)

if TYPE_CHECKING:
    from agentbox.sdk.async_sandbox import (
        AsyncCommandHandle,
        AsyncSandbox,
        AsyncSecrets,
        AsyncTemplates,
        AsyncVolumes,
        AsyncWorkspaces,
    )


def __getattr__(name: str) -> Any:
    if name in _ASYNC_NAMES:
        from agentbox.sdk import async_sandbox

        return getattr(async_sandbox, name)
    raise AttributeError(f"module 'agentbox.sdk' has no attribute {name!r}")
