"""The runtime contract: the one narrow interface between the control plane and isolation.

A runtime makes sandboxes exist on some substrate (bubblewrap processes today; gVisor, OCI
containers and Kubernetes later) and hands back a channel to the in-sandbox agent. Everything
else — commands, files, TTLs, tenants — is the control plane's business and goes through the
agent, so it works the same on every runtime.

The control plane persists the `state` dict a runtime returns from `create` and gives it back on
every later call (also after a restart of the server): a runtime keeps no state it cannot rebuild
from that dict and from the host.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


@dataclass(frozen=True)
class Resources:
    cpu_count: float = 1.0
    memory_mb: int = 512
    pids: int = 256
    nofile: int = 1024
    file_size_mb: int = 1024
    disk_mb: int = 1024
    tmp_mb: int = 64


@dataclass(frozen=True)
class SandboxSpec:
    sandbox_id: str
    template: str
    resources: Resources
    envs: dict[str, str] = field(default_factory=dict)
    # The template's root filesystem, seen read-only; None = the host's userland.
    rootfs: str | None = None
    workdir: str = "/workspace"
    user: str = "user"  # "user" (uid 1000) or "root" (uid 0 of the sandbox, no capabilities)
    # Read-only files placed in the sandbox: absolute sandbox path -> content (CA bundles).
    files: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Ceiling:
    """The most of one resource a runtime can give a sandbox on this host, whatever the quota
    says (a hard limit the server itself cannot raise), and what to change to get more."""

    limit: int
    setting: str  # what names it in errors, e.g. "server.rlimit_nofile"
    reason: str  # "the server's hard descriptor limit (RLIMIT_NOFILE) 20000; ..."


@dataclass(frozen=True)
class KeptWorkspace:
    """The workspace of an ended sandbox created with `keep_workspace`, as the host holds it."""

    sandbox_id: str
    used_bytes: int  # what it really takes on the host's disk (blocks, not apparent size)
    kept_at: float  # unix time it was kept


@dataclass(frozen=True)
class AgentAddress:
    """Where the control plane reaches a sandbox's agent: a Unix socket on the host."""

    socket_path: Path


class RuntimeError_(Exception):
    """A runtime could not do what was asked; the message says why."""


class Runtime(ABC):
    """What the control plane needs from an isolation backend, and nothing more."""

    name: ClassVar[str]

    @abstractmethod
    async def create(self, spec: SandboxSpec) -> dict[str, Any]:
        """Start a sandbox whose agent is ready to serve; return the state to persist."""

    @abstractmethod
    async def destroy(
        self, sandbox_id: str, state: dict[str, Any] | None, keep_workspace: bool
    ) -> None:
        """End every process of the sandbox and remove everything it had on the host.

        Must work with `state=None` (a leftover found by `list_sandboxes` with no record) and be
        idempotent.
        """

    @abstractmethod
    async def is_alive(self, sandbox_id: str, state: dict[str, Any]) -> bool:
        """Whether the sandbox's processes still run."""

    @abstractmethod
    async def list_sandboxes(self) -> set[str]:
        """Ids of every sandbox that has anything on the host (for reconciliation)."""

    @abstractmethod
    def agent_address(self, sandbox_id: str, state: dict[str, Any]) -> AgentAddress:
        """The channel to the sandbox's agent."""

    async def listen_inside(
        self, sandbox_id: str, state: dict[str, Any], port: int
    ) -> socket.socket:
        """A listening TCP socket on the sandbox's own loopback, held by this server process.

        The egress proxy serves the sandbox through it: the sandbox reaches it at
        127.0.0.1:`port` and has no other way out. It closes with this process (fail closed)."""
        raise RuntimeError_(f"the {self.name} runtime cannot reach into a sandbox's network")

    async def connect_inside(
        self, sandbox_id: str, state: dict[str, Any], port: int, timeout: float = 10.0
    ) -> socket.socket:
        """A connected, non-blocking TCP socket to `port` on the sandbox's loopback (for
        exposed ports), without giving the sandbox a network interface.

        Raises ConnectionRefusedError when nothing listens there."""
        raise RuntimeError_(f"the {self.name} runtime cannot reach into a sandbox's network")

    def adopt(self, sandbox_id: str, state: dict[str, Any]) -> None:  # noqa: B027
        """Take over a live sandbox found after a restart (state this process must rebuild)."""

    def limit_counters(self, sandbox_id: str) -> dict[str, int]:
        """Counters of limits hit so far (`oom_kill`, `pids_max`), to explain a failure."""
        return {}

    def capabilities(self) -> dict[str, Any]:
        """What this runtime enforces on this host (shown in health and sandbox info)."""
        return {}

    def resource_ceilings(self) -> dict[str, Ceiling]:
        """Per resource (a `Resources` field), the most this runtime can give any sandbox."""
        return {}

    # Disk: what sandboxes take on the host, and the workspaces kept after they end.

    def storage_path(self) -> Path | None:
        """A path on the filesystem that holds sandboxes' workspaces (None: not on this host)."""
        return None

    def workspace_bytes(self, sandbox_id: str, state: dict[str, Any]) -> int | None:
        """Bytes a live sandbox's workspace really takes on the host (None: unknown)."""
        return None

    def kept_workspaces(self) -> list[KeptWorkspace]:
        """Every kept workspace on the host."""
        return []

    def kept_workspace_files(self, sandbox_id: str) -> AbstractAsyncContextManager[Path]:
        """A read-only view of a kept workspace's files for the length of the context (what
        the sandbox saw as /workspace). Its content is the sandbox's: untrusted."""
        raise RuntimeError_(f"the {self.name} runtime keeps no workspaces")

    async def remove_kept_workspace(self, sandbox_id: str) -> bool:
        """Delete a kept workspace; False if there was none."""
        return False

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release runtime resources held by this server process (sandboxes keep running)."""
