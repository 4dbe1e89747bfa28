"""Deliberately weakened process sandboxes, for the security battery's positive controls.

A probe that cannot see a break proves nothing, so the battery runs every probe a second time
against a sandbox with one layer taken away and requires it to report BROKEN there. This module
names those layers. It is reachable only from Python (`ProcessRuntime(weaken=...)`), never from
the HTTP API, the CLI or a server config file.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

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
