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

import os
import resource
import socket
from abc import ABC, abstractmethod
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable


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
class DiskSource:
    """A disk image a sandbox starts from (a snapshot, a fork's copy), and the host uids its
    files belong to: those in [uid, uid + span) become the new sandbox's own."""

    image: Path
    uid: int
    span: int
    consume: bool = False  # the image is the new sandbox's to take (moved, not copied)


@dataclass(frozen=True)
class VolumeMount:
    """A volume's filesystem (mounted on the host at `source`, its files owned by the sandbox
    model's ids 0-65535) mounted at `path` in the sandbox, its ids the sandbox's own."""

    path: str
    source: Path
    read_only: bool = False


# E2B's home, where code written for E2B keeps its files: the workspace is mounted there too
# (where the sandbox's root can take a mount point: home_mount_point).
E2B_HOME = "/home/user"

# The rlimits runtimes set on a sandbox, by their kernel names (an OCI bundle's `type`; the
# process tier's prlimit options are these, lower case, without RLIMIT_).
RLIMIT_NAMES = {
    resource.RLIMIT_NOFILE: "RLIMIT_NOFILE",
    resource.RLIMIT_FSIZE: "RLIMIT_FSIZE",
    resource.RLIMIT_CORE: "RLIMIT_CORE",
    resource.RLIMIT_NPROC: "RLIMIT_NPROC",
}


def home_mount_point(root: Path) -> bool:
    """Whether a sandbox root (a writable root, as the host sees it before the sandbox starts)
    can take the workspace at E2B_HOME: /home a directory, /home/user missing or an empty
    directory. A template's own /home/user (or one a disk it starts from holds) is left as it
    is, and no mount goes through a symlink."""
    home = root / "home"
    if home.is_symlink() or not home.is_dir():
        return False
    user = home / "user"
    if user.is_symlink():
        return False
    if not os.path.lexists(user):
        return True
    if not user.is_dir():
        return False
    with os.scandir(user) as entries:
        return next(entries, None) is None


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
    # Start from this disk (its root layer and workspace) instead of a fresh one.
    disk: DiskSource | None = None
    volumes: tuple[VolumeMount, ...] = ()


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


# Resources fields a runtime may enforce (see RuntimeFeatures.enforces).
RESOURCE_NAMES = frozenset(f.name for f in fields(Resources))


@dataclass(frozen=True)
class RuntimeFeatures:
    """What a runtime can do on this host, declared rather than assumed: the core branches on
    these and on nothing else about a runtime (no `if runtime.name == ...` outside it). The
    conformance suite (tests/unit/test_runtime_conformance.py) checks each one is honest.
    Everything defaults to "cannot": a runtime that declares nothing gets no traffic, no kept
    workspaces and no limit requests, so it fails closed."""

    # `Resources` fields it enforces on this host. A create that asks for a limit outside this
    # set is refused: a limit that would silently not hold is worse than none asked.
    enforces: frozenset[str] = frozenset()
    # It reaches a sandbox's loopback (`listen_inside`/`connect_inside`) without giving it an
    # interface: the egress proxy and exposed ports need it. Without it a sandbox has no
    # network at all, and a create that asks for egress is refused.
    network: bool = False
    # It keeps a sandbox's workspace after it ends (`keep_workspace`) and serves it back.
    kept_workspaces: bool = False
    # Every sandbox runs under host uids of its own, from the host-wide allocator (uids.py).
    own_uids: bool = False
    # How strongly its sandboxes are kept from the host's kernel, for a tenant's floor
    # (`quota.min_isolation`): ISOLATION_RANKS names the tiers; 0 is none to speak of.
    isolation: int = 0
    # Later issues: pause/resume and snapshots (a disk image and memory the core can copy).
    pause: bool = False
    snapshot: bool = False
    # Pause without memory (Parkable): only the disk kept, a fresh boot on resume.
    park: bool = False
    # It mounts volumes (`SandboxSpec.volumes`), their ids moved to the sandbox's own.
    volumes: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["enforces"] = sorted(self.enforces)
        return out


# The isolation tiers, weakest first: a shared kernel behind namespaces, seccomp and Landlock;
# an OCI container (the same kernel, set up by runc); a user-space kernel (gVisor).
ISOLATION_RANKS = {"process": 1, "container": 2, "gvisor": 3}


@dataclass(frozen=True)
class HostFootprint:
    """Where a runtime leaves things on the host for the sandboxes of one data dir, so leak
    checks (the battery's inventory, the benchmarks) look there instead of knowing any
    runtime's layout. Paths are absolute; every field may be empty."""

    # Directories whose entries are the runtime's (one per sandbox or kept workspace), and
    # which are themselves its when they exist.
    dirs: tuple[Path, ...] = ()
    # Trees below which mounts, loop-device backing files and process arguments are its.
    roots: tuple[Path, ...] = ()
    # cgroup directories are `<controller root>/<group>/<scope>` for each of cgroup_groups.
    cgroup_groups: tuple[str, ...] = ()
    scope: str | None = None
    # Host uids its sandboxes run as ([start, end)), where their leases live and the owners
    # they are leased to (uids.py).
    uid_range: tuple[int, int] | None = None
    uid_leases: Path | None = None
    lease_owners: tuple[str, ...] = ()


@dataclass(frozen=True)
class AgentAddress:
    """Where the control plane reaches a sandbox's agent: a Unix socket on the host."""

    socket_path: Path


class RuntimeError_(Exception):
    """A runtime could not do what was asked; the message says why."""


class RuntimeRefused(RuntimeError_):
    """A runtime will not do what was asked, for a reason the caller can act on (a 409): e.g.
    a disk to start from whose root changed what the agent runs before it confines itself."""


# Optional capabilities: a runtime that can do one implements its methods and declares it in
# RuntimeFeatures (the conformance suite checks the two agree). The core reaches them only
# after checking the feature, so a runtime without them needs nothing.


@runtime_checkable
class Pausable(Protocol):
    """Freeze a sandbox's processes (memory kept, no CPU) and thaw them (`features.pause`)."""

    async def pause(self, sandbox_id: str, state: dict[str, Any]) -> dict[str, Any]:
        """Freeze every process; returns the state to persist. Idempotent."""
        ...

    async def resume(self, sandbox_id: str, state: dict[str, Any]) -> dict[str, Any]:
        """Thaw what `pause` froze; returns the state to persist. Idempotent."""
        ...


@runtime_checkable
class Parkable(Protocol):
    """Pause without memory (`features.park`): every process ends and everything the sandbox
    holds on the host goes but its disk image, from which a create starts it again (a fresh
    boot on the same files)."""

    async def park(self, sandbox_id: str, state: dict[str, Any] | None) -> dict[str, Any]:
        """End its processes, keep its disk; the state to persist. Idempotent; also for a
        sandbox a crash left half-started from its parked disk (`state` None: from the host)."""
        ...

    def parked_disk(self, sandbox_id: str, state: dict[str, Any]) -> DiskSource:
        """What a create (`SandboxSpec.disk`) starts the parked sandbox from, under its id."""
        ...


@runtime_checkable
class Snapshottable(Protocol):
    """A running or paused sandbox's disk (root layer and workspace) copied consistently as one
    image the core keeps, and a new sandbox started from such a copy (`SandboxSpec.disk`):
    `features.snapshot`. Memory is not part of it."""

    async def snapshot(self, sandbox_id: str, state: dict[str, Any], dest: Path) -> DiskSource:
        """Write the sandbox's disk image to the new file `dest`: its processes are frozen
        only for the copy (a paused sandbox stays frozen). Returns how to start from it."""
        ...


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

    def exit_fd(self, sandbox_id: str, state: dict[str, Any]) -> int | None:
        """A descriptor that becomes readable once `is_alive` would say False (a pidfd), for
        the server to wait on instead of asking `is_alive` every round; the caller closes it.
        None: ask `is_alive` (the default)."""
        return None

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

    def features(self) -> RuntimeFeatures:
        """What it can do on this host (see RuntimeFeatures); the default declares nothing."""
        return RuntimeFeatures()

    @classmethod
    def unavailable(cls) -> str | None:
        """Why it cannot run sandboxes on this host (a missing tool, no root), or None;
        callable without an instance, and cheap (health asks it)."""
        return None

    @classmethod
    def host_footprint(cls, data_dir: Path) -> HostFootprint:
        """Where its sandboxes of `data_dir` leave things on this host; callable without an
        instance (a leak check runs beside the server, not in it)."""
        return HostFootprint()

    def adopt(self, sandbox_id: str, state: dict[str, Any]) -> None:  # noqa: B027
        """Take over a live sandbox found after a restart (state this process must rebuild)."""

    def usage(self, sandbox_id: str, state: dict[str, Any]) -> dict[str, float] | None:
        """What the sandbox uses now, for its metrics: `cpu_seconds` (its CPU time so far),
        `memory_bytes` (on the host: a gVisor sentry's own included) and `disk_bytes` (its
        workspace's files); None if unknown.
        Called from a worker thread, for every sandbox every few seconds: cheap."""
        return None

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
