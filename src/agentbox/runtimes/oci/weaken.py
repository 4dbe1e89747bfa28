"""Deliberately weakened OCI sandboxes, for the security battery's positive controls on the
`container` and `gvisor` tiers.

The process tier's weakenings (runtimes/process/weaken.py) name the layers; the hooks they
override on the process runtime (uids, cgroup limits, the agent's flags, the template's root,
the host-info views) are the OCI runtimes' too, and what an OCI runtime takes from its bundle
instead of bwrap's command line is taken away here, in the rendered config. A tier states
which weakenings it can build (`WEAKENABLE`); a control that needs another one runs on the
process tier (the battery says so). Like the process tier's, these classes are registered only
by the battery's own server, in code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

from agentbox.runtimes.base import SandboxSpec
from agentbox.runtimes.oci import bundle
from agentbox.runtimes.oci.runtime import ContainerRuntime, GvisorRuntime, OciRuntime
from agentbox.runtimes.process.runtime import kill_if_same
from agentbox.runtimes.process.weaken import WeakenedProcessRuntime

# Every capability, by number (CAP_CHOWN is 0).
ALL_CAPS = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
    "CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW",
    "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ",
    "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
)  # fmt: skip


def _bounding_caps() -> list[str]:
    """Every capability the server may hold (its bounding set): host root's, here."""
    with open("/proc/self/status") as f:
        mask = next(int(ln.split()[1], 16) for ln in f if ln.startswith("CapBnd:"))
    return [name for n, name in enumerate(ALL_CAPS) if mask >> n & 1]


_SHARED = {"share-net": "network", "share-pid": "pid", "share-ipc": "ipc"}


class _WeakenedOci(WeakenedProcessRuntime, OciRuntime):
    """The OCI runtime with the weakenings in `weaken`: the process tier's hooks, and the
    bundle's config with the named layers taken out."""

    WEAKENABLE: ClassVar[frozenset[str]]

    def __init__(self, data_dir: Path, **config: Any) -> None:
        flags = set(config.get("weaken", ()))
        if config.get("bind_host"):
            flags.add("bind-host")
        missing = flags - self.WEAKENABLE
        if missing:
            raise ValueError(f"the {self.name} tier cannot be built with {sorted(missing)}")
        super().__init__(data_dir, **config)

    def _oci_config(self, config: dict[str, Any], spec: SandboxSpec) -> dict[str, Any]:
        config = super()._oci_config(config, spec)
        w = self.weak
        linux, process = config["linux"], config["process"]
        shared = {ns for flag, ns in _SHARED.items() if flag in w}
        linux["namespaces"] = [ns for ns in linux["namespaces"] if ns["type"] not in shared]
        # A namespace shared is one the sandbox does not own: what it would mount of its own
        # (proc, mqueue) is the host's, bound in.
        own = {"pid": "/proc", "ipc": "/dev/mqueue"}
        hosts = {path for ns, path in own.items() if ns in shared}
        bound = ["rbind", "nosuid", "nodev", "noexec"]
        config["mounts"] = [
            dict(m, type="bind", source=m["destination"], options=bound)
            if m["destination"] in hosts
            else m
            for m in config["mounts"]
            if m["destination"] not in hosts or os.path.exists(m["destination"])
        ]
        if "no-seccomp" in w:
            args = process["args"]
            i = args.index("--seccomp")
            del args[i : i + 2]
        if "host-root" in w:
            linux["namespaces"] = [ns for ns in linux["namespaces"] if ns["type"] != "user"]
            linux.pop("uidMappings", None)
            linux.pop("gidMappings", None)
            caps = _bounding_caps()
            process["capabilities"] = {k: caps for k in ("bounding", "effective", "permitted")}
            process["noNewPrivileges"] = False
        if "no-limits" in w:
            linux.pop("resources", None)
            process["rlimits"] = []
            for m in config["mounts"]:
                if m["type"] == "tmpfs":
                    m["options"] = [o for o in m["options"] if not o.startswith("size=")]
        if "host-info" in w:
            linux["maskedPaths"] = [p for p in linux["maskedPaths"] if not p.startswith("/proc")]
            config["mounts"] = [m for m in config["mounts"] if m["destination"] != "/usr/local"]
        for p in self.weak.bind_host:
            config["mounts"].append(bundle.bind(p, p, writable=True))
        return config

    def _host_path_points(self) -> list[str]:
        # Mount points in a host userland's skeleton root (made with their parents).
        return [*super()._host_path_points(), *self.weak.bind_host]

    def _stop(self, sid: str, state: dict[str, Any]) -> None:
        if "no-cgroup-kill" not in self.weak:
            return super()._stop(sid, state)
        # Only the sandbox's init: what it started lives on (the break the control shows),
        # until the battery's clean-up kills it. The binary's state goes (its delete would
        # kill the rest). A pid namespace made for the binary goes (gvisor: its sandbox's
        # processes are the sentry's, which end with it anyway).
        kill_if_same(*self._pidns(sid, state))
        kill_if_same(state.get("init_pid"), state.get("init_start"))
        self._remove_state(sid)


class WeakenedContainerRuntime(_WeakenedOci, ContainerRuntime):
    name: ClassVar[str] = "container-weakened"
    WEAKENABLE = frozenset(
        {
            "share-net", "share-pid", "share-ipc", "no-seccomp", "allow-userns", "host-root",
            "no-landlock", "unconfined-paths", "no-limits", "no-cgroup-kill", "same-uid",
            "bind-host", "host-info", "template-rw", "boot-path-open",
        }
    )  # fmt: skip


class WeakenedGvisorRuntime(_WeakenedOci, GvisorRuntime):
    name: ClassVar[str] = "gvisor-weakened"
    # Not share-pid, share-ipc, host-root, same-uid: the sandbox's processes live in the
    # sentry's own pid and IPC namespaces, run as its users and count against its per-user
    # limits, whatever the bundle and the host uid say. Not share-net: runsc's host-network
    # mode does not start here (its sandbox process, given the sandbox's capabilities, cannot
    # set up its root). allow-userns takes nothing away: gVisor has no nesting limit, only the
    # seccomp filter stops unshare.
    WEAKENABLE = frozenset(
        {
            "no-seccomp", "allow-userns", "no-landlock", "unconfined-paths", "no-limits",
            "no-cgroup-kill", "bind-host", "host-info", "template-rw", "boot-path-open",
        }
    )  # fmt: skip

    def _fence_by_mounts(self) -> bool:
        return "no-landlock" not in self.weak and super()._fence_by_mounts()


WEAKENED_TIERS: dict[str, type[_WeakenedOci]] = {
    "container": WeakenedContainerRuntime,
    "gvisor": WeakenedGvisorRuntime,
}
