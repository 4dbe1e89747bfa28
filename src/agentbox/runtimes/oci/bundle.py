"""A sandbox as an OCI runtime bundle (config.json, runtime-spec 1.0.2).

The bundle describes what bwrap's command line describes on the process tier, in the terms an
OCI runtime takes: the same namespaces (the user namespace the server made, joined by path),
the same mounts (the template's copy-on-write root or a skeleton with the host's /usr, the
workspace, the agent tree, sized tmpfs), the sandbox root's `ROOT_CAPS`, cgroup limits and (on
a runtime with a kernel of its own) rlimits. What an OCI runtime does not
offer, the agent does itself on start (main.py): its seccomp filter (the process tier's own
program, loaded with no_new_privs before anything else runs) and the reaping init.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentbox.runtimes.base import RLIMIT_NAMES, Resources
from agentbox.vocab import ROOT_CAPS

OCI_VERSION = "1.0.2"
CHANNEL_DIR = "/run/agentbox-chan"  # where the agent binds its socket, a host dir bound in
CHANNEL_SOCKET = f"{CHANNEL_DIR}/agent.sock"

# /proc files an OCI runtime lets a bundle bind over (runc: checkProcMount); the sandbox's own
# figures go there, and the other machine-wide files the process tier replaces are masked.
PROC_BINDABLE = frozenset(
    {
        "/proc/cpuinfo",
        "/proc/diskstats",
        "/proc/meminfo",
        "/proc/stat",
        "/proc/swaps",
        "/proc/uptime",
        "/proc/loadavg",
    }
)
MASKED = (
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
)
READ_ONLY = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")


def mount(dest: str, kind: str, source: str, *options: str) -> dict[str, Any]:
    return {"destination": dest, "type": kind, "source": source, "options": list(options)}


def bind(source: Path | str, dest: str, *extra: str, writable: bool = False) -> dict[str, Any]:
    """A bind mount, nosuid and nodev; `extra` must repeat the flags the source's mount has
    locked (noexec of a noexec tmpfs): a remount in a user namespace cannot drop them."""
    mode = "rw" if writable else "ro"
    return mount(dest, "bind", str(source), "rbind", mode, "nosuid", "nodev", *extra)


def tmpfs(dest: str, size_mb: int, mode: int = 0o1777, *extra: str) -> dict[str, Any]:
    opts = ("nosuid", "nodev", f"mode={mode:o}", f"size={size_mb}m", *extra)
    return mount(dest, "tmpfs", "tmpfs", *opts)


@dataclass
class Bundle:
    """What one sandbox's config.json says, gathered by the runtime; `config()` renders it."""

    root: Path
    root_readonly: bool
    args: list[str]
    env: dict[str, str]
    cwd: str
    resources: Resources
    uid_base: int
    size: int
    userns_path: Path | None  # joined; None: a new one with the same mapping
    cgroups_path: str
    rlimits: list[tuple[int, int]]  # (resource.RLIMIT_*, value): set by the runtime itself
    cpus: list[int] | None  # a cpuset, when the sandbox gets fewer than all CPUs
    mounts: list[dict[str, Any]] = field(default_factory=list)
    masked: list[str] = field(default_factory=list)
    hostname: str = "sandbox"

    def config(self) -> dict[str, Any]:
        r = self.resources
        period = 100_000
        cpu: dict[str, Any] = {"quota": max(1000, int(r.cpu_count * period)), "period": period}
        if self.cpus is not None:
            cpu["cpus"] = ",".join(str(c) for c in self.cpus)
        memory = r.memory_mb * 1024 * 1024
        caps = list(ROOT_CAPS)
        user_ns: dict[str, str] = {"type": "user"}
        if self.userns_path is not None:
            user_ns["path"] = str(self.userns_path)
        return {
            "ociVersion": OCI_VERSION,
            "hostname": self.hostname,
            "root": {"path": str(self.root), "readonly": self.root_readonly},
            "process": {
                "terminal": False,
                "user": {"uid": 0, "gid": 0},
                "args": self.args,
                "env": [f"{k}={v}" for k, v in self.env.items()],
                "cwd": self.cwd,
                "noNewPrivileges": True,
                "rlimits": [
                    {"type": RLIMIT_NAMES[res], "hard": value, "soft": value}
                    for res, value in self.rlimits
                ],
                "capabilities": {
                    "bounding": caps,
                    "effective": caps,
                    "permitted": caps,
                    "inheritable": [],
                    "ambient": [],
                },
            },
            "mounts": self.mounts,
            "linux": {
                "namespaces": [
                    user_ns,
                    *({"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "cgroup")),
                ],
                "uidMappings": [{"containerID": 0, "hostID": self.uid_base, "size": self.size}],
                "gidMappings": [{"containerID": 0, "hostID": self.uid_base, "size": self.size}],
                "cgroupsPath": self.cgroups_path,
                "resources": {
                    "memory": {"limit": memory, "swap": memory},
                    "pids": {"limit": r.pids},
                    "cpu": cpu,
                },
                "maskedPaths": [*MASKED, *self.masked],
                "readonlyPaths": list(READ_ONLY),
            },
        }


def base_mounts(tmp_mb: int, var_tmp: bool) -> list[dict[str, Any]]:
    """/proc, /dev and the sized tmpfs every sandbox has (bwrap's --proc, --dev, --tmpfs)."""
    small = min(tmp_mb, 64)
    out = [
        mount("/proc", "proc", "proc", "nosuid", "noexec", "nodev"),
        mount("/dev", "tmpfs", "tmpfs", "nosuid", "strictatime", "mode=755", "size=65536k"),
        mount(
            "/dev/pts",
            "devpts",
            "devpts",
            "nosuid",
            "noexec",
            "newinstance",
            "ptmxmode=0666",
            "mode=0620",
        ),
        tmpfs("/dev/shm", small),
        mount("/dev/mqueue", "mqueue", "mqueue", "nosuid", "noexec", "nodev"),
        tmpfs("/tmp", tmp_mb),
    ]
    if var_tmp:
        out.append(tmpfs("/var/tmp", small))
    # /run as on a booted system: a small tmpfs (the egress CA bundle lands below it, and the
    # agent's channel directory).
    out.append(tmpfs("/run", 1, 0o755))
    return out


def skeleton(root: Path, dirs: list[str], links: dict[str, str]) -> None:
    """Fill the empty `root` of a host-userland sandbox: the mount points the bundle uses and
    the merged-/usr links (the sandbox's root cannot make mount points in it: read-only)."""
    for d in dirs:
        (root / d.lstrip("/")).mkdir(mode=0o755, parents=True, exist_ok=True)
    for link, target in links.items():
        path = root / link.lstrip("/")
        if not path.is_symlink():
            os.symlink(target, path)
