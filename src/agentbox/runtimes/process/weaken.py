"""Deliberately weakened process sandboxes, for the security battery's positive controls.

A probe that cannot see a break proves nothing, so the battery runs every probe a second time
against a sandbox with one layer taken away and requires it to report BROKEN there. This module
names those layers and holds every one of them: `WeakenedProcessRuntime` overrides the process
runtime's hooks, so the production spawn path carries no weakening at all. It is reachable only
from Python (the battery's own server, `agentbox.battery.server`, registers it in code), never
from the HTTP API, the CLI, a server config file or an installed entry point.
"""

from __future__ import annotations

import logging
import os
import resource
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from agentbox.runtimes.base import Ceiling, Resources, RuntimeFeatures, SandboxSpec
from agentbox.runtimes.process import rootfs
from agentbox.runtimes.process.cgroups import CgroupLimits
from agentbox.runtimes.process.runtime import SANDBOX_PATH, ProcessRuntime, parent_dirs
from agentbox.runtimes.uids import UID_RANGE

WEAKENINGS: dict[str, str] = {
    "share-net": "the sandbox shares the server's network namespace",
    "share-pid": "the sandbox shares the host pid namespace and sees the host's /proc",
    "share-ipc": "the sandbox shares the host IPC namespace (SysV, mqueues)",
    "no-seccomp": "no seccomp filter",
    "allow-userns": "nested user namespaces are not disabled",
    "host-root": "bwrap runs as host root with every capability, no user namespace",
    "no-landlock": "the agent does not confine itself with Landlock",
    "no-limits": "no cgroup limits, no rlimits, unsized tmpfs, no disk-limited workspace",
    "no-cgroup-kill": "destroy kills only the sandbox's init, not its whole cgroup",
    "same-uid": "every sandbox runs under the same host uid",
    "bind-host": "the paths in bind_host are bound read-write at the same place",
    "unconfined-paths": "the files API follows symlinks, accepts '..', reads any file type",
    "leak-fd": "a directory fd of the host's / is inherited by every command",
    "unsandboxed": "no bwrap at all: the agent runs as a plain host process",
    "host-info": "the sandbox sees the host's /etc, /usr/local and machine-wide /proc files, "
    "all CPUs, and host paths in its mountinfo",
    "template-rw": "a built template's tree is the sandbox's root, writable (no copy-on-write)",
    "boot-path-open": "a sandbox starts from a disk (snapshot, fork, resume without memory) "
    "whose root changed what its agent loads before it confines itself",
}

# Weakenings the agent itself applies (passed on its command line).
AGENT_WEAKENINGS = frozenset({"no-landlock", "unconfined-paths", "leak-fd"})


@dataclass(frozen=True)
class Weakening:
    flags: frozenset[str] = frozenset()
    bind_host: tuple[str, ...] = field(default=())

    @classmethod
    def of(cls, flags: Iterable[str] = (), bind_host: Iterable[str] = ()) -> Weakening:
        flags = frozenset(flags)
        unknown = flags - WEAKENINGS.keys()
        if unknown:
            raise ValueError(f"unknown weakening(s): {', '.join(sorted(unknown))}")
        if "unsandboxed" in flags:
            # Without bwrap there is nothing for these to switch off or on.
            flags |= {"no-seccomp", "no-landlock", "share-net", "share-pid", "share-ipc"}
            flags |= {"host-info"}
        bind_host = tuple(bind_host)
        if bind_host and "bind-host" not in flags:
            flags |= {"bind-host"}
        for p in bind_host:
            if not p.startswith("/") or ".." in p.split("/"):
                raise ValueError(f"bind_host paths must be absolute and normalised: {p!r}")
        return cls(flags, bind_host)

    def __contains__(self, flag: str) -> bool:
        return flag in self.flags

    def __bool__(self) -> bool:
        return bool(self.flags)

    def agent_flags(self) -> list[str]:
        return sorted(self.flags & AGENT_WEAKENINGS)


class WeakenedProcessRuntime(ProcessRuntime):
    """The process runtime with the layers named in `weaken` taken away (and `bind_host` paths
    bound read-write). With no weakening it builds exactly the production sandbox, but for its
    agent's start: by exec (the production one forks it from the zygote: zygote.py)."""

    name: ClassVar[str] = "process-weakened"
    forks_agents: ClassVar[bool] = False  # its agents' flags and fds are its own: exec

    def __init__(
        self,
        data_dir: Path,
        weaken: Iterable[str] = (),
        bind_host: Iterable[str] = (),
        use_loop: bool | None = None,
        host_paths: Iterable[str] = (),
    ) -> None:
        # Set before the base constructor: it asks the hooks below which trees to build.
        self.weak = Weakening.of(weaken, bind_host)
        if self.weak:
            logging.getLogger(__name__).warning(
                "WEAKENED sandboxes for security testing: %s", ", ".join(sorted(self.weak.flags))
            )
        if "no-limits" in self.weak:
            use_loop = False  # a plain directory: no disk limit
        super().__init__(data_dir, use_loop=use_loop, host_paths=host_paths)

    # ------------------------------------------------------------ what it declares

    def features(self) -> RuntimeFeatures:
        feats = super().features()
        if "no-limits" in self.weak:
            feats = replace(feats, enforces=frozenset())
        if "same-uid" in self.weak:
            feats = replace(feats, own_uids=False)
        return feats

    def resource_ceilings(self) -> dict[str, Ceiling]:
        return {} if "no-limits" in self.weak else super().resource_ceilings()

    # ------------------------------------------------------------ host-info

    def _mounts_shared_trees(self) -> bool:
        # Plain directories: their host paths show in a sandbox's mountinfo.
        return super()._mounts_shared_trees() and "host-info" not in self.weak

    def _etc_tree(self) -> Path | None:
        return None if "host-info" in self.weak else super()._etc_tree()

    def _proc_files(self, spec: SandboxSpec, cpus: list[int]) -> dict[str, bytes]:
        return {} if "host-info" in self.weak else super()._proc_files(spec, cpus)

    def _proc_args(self, fds: dict[str, int]) -> list[str]:
        return [] if "host-info" in self.weak else super()._proc_args(fds)

    def _assign_cpus(self, sid: str, cpu_count: float) -> list[int]:
        if "host-info" in self.weak or "no-limits" in self.weak:
            cpu_count = len(self.cpus)
        return super()._assign_cpus(sid, cpu_count)

    # ------------------------------------------------------------ bwrap's arguments

    def _namespace_args(self, spec: SandboxSpec, fds: dict[str, int]) -> list[str]:
        if "host-root" not in self.weak:
            return super()._namespace_args(spec, fds)
        return [f"--unshare-{ns}" for ns in self._unshared()] + ["--cap-add", "ALL"]

    def _unshared(self) -> tuple[str, ...]:
        shared = {"net": "share-net", "pid": "share-pid", "ipc": "share-ipc"}
        return tuple(ns for ns in super()._unshared() if shared.get(ns, "") not in self.weak)

    def _userns_assert(self) -> list[str]:
        return [] if "allow-userns" in self.weak else super()._userns_assert()

    def _userns_nesting(self) -> bool:
        return "allow-userns" in self.weak

    def _own_userns(self) -> bool:
        no_userns = "host-root" in self.weak or "unsandboxed" in self.weak
        return super()._own_userns() and not no_userns

    def _default_user(self, spec: SandboxSpec) -> str:
        # Host root's commands are host root's: the break the positive controls look for.
        if "host-root" in self.weak:
            return "root"
        return super()._default_user(spec)

    def _proc_mount_args(self) -> list[str]:
        if "share-pid" in self.weak:
            return ["--bind", "/proc", "/proc"]
        return super()._proc_mount_args()

    def _tmpfs_args(self, path: str, size_mb: int, mode: int = 0o1777) -> list[str]:
        if "no-limits" in self.weak:
            return ["--perms", f"{mode:04o}", "--tmpfs", path]
        return super()._tmpfs_args(path, size_mb, mode)

    def _extra_binds(self) -> list[str]:
        return [arg for p in self.weak.bind_host for arg in (*parent_dirs(p), "--bind", p, p)]

    def _check_boot_path(self, spec: SandboxSpec, upper: Path) -> None:
        if "boot-path-open" not in self.weak:
            super()._check_boot_path(spec, upper)

    def _seccomp_args(self, fds: dict[str, int]) -> list[str]:
        return [] if "no-seccomp" in self.weak else super()._seccomp_args(fds)

    def _extra_fds(self) -> dict[str, int]:
        if "leak-fd" not in self.weak:
            return {}
        return {"leak": os.open("/", os.O_PATH | os.O_DIRECTORY)}

    def _agent_flags(self, fds: dict[str, int]) -> list[str]:
        flags = self.weak.agent_flags()
        args = ["--weaken", ",".join(flags)] if flags else []
        return args + (["--leak-fd", str(fds["leak"])] if "leak-fd" in self.weak else [])

    # ------------------------------------------------------------ limits and uids

    def _cgroup_limits(self, r: Resources) -> CgroupLimits:
        if "no-limits" in self.weak:
            return CgroupLimits(1 << 40, 4_194_304, float(os.cpu_count() or 1))
        return super()._cgroup_limits(r)

    def _rlimits(self, r: Resources) -> list[tuple[int, int]]:
        if "no-limits" in self.weak:
            return [(resource.RLIMIT_CORE, 0)]
        return super()._rlimits(r)

    def _allocate_uid(self, sandbox_id: str) -> int:
        if self.is_root and "same-uid" in self.weak:
            return UID_RANGE[0] - 1
        return super()._allocate_uid(sandbox_id)

    def _drop_to(self, uid: int) -> int | None:
        return None if "host-root" in self.weak else super()._drop_to(uid)

    # ------------------------------------------------------------ no sandbox at all

    def _command(
        self, spec: SandboxSpec, ws: Path, fds: dict[str, int]
    ) -> tuple[list[str], dict[str, str]]:
        if "unsandboxed" not in self.weak:
            return super()._command(spec, ws, fds)
        argv = [*self._agent_argv(str(self.agent_dir), spec, fds), "--workspace", str(ws)]
        env = {"PATH": SANDBOX_PATH, "HOME": str(ws), "AGENTBOX_SANDBOX_ID": spec.sandbox_id}
        return argv, env

    def _init_pid(self, info_fd: int, proc: subprocess.Popen) -> int:
        return proc.pid if "unsandboxed" in self.weak else super()._init_pid(info_fd, proc)

    def _hold_netns(self, sandbox_id: str, init_pid: int | None) -> None:
        if "share-net" in self.weak or "unsandboxed" in self.weak:
            return  # no namespace of its own: nothing may be put on the host's loopback
        super()._hold_netns(sandbox_id, init_pid)

    def _mount_root(self, spec: SandboxSpec, bind_dir: Path, base: int, ns: int) -> dict:
        if "template-rw" not in self.weak:
            return super()._mount_root(spec, bind_dir, base, ns)
        assert spec.rootfs is not None
        root = bind_dir / rootfs.ROOT
        root.mkdir(mode=0o755, exist_ok=True)
        rootfs.mount_idmapped(Path(spec.rootfs), root, ns, read_only=False)
        return {"mode": "template-rw", "template": spec.rootfs}

    def _kill_everything(self, sid: str) -> bool:
        return True if "no-cgroup-kill" in self.weak else super()._kill_everything(sid)
