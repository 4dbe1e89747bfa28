"""Checks of what a sandbox learns about the host and its neighbours (group "host-info").

None of these is an escape: they are what a sandbox could fingerprint the machine with, watch
its neighbours through (their disk I/O, the machine's load and memory pressure), or map the
server's layout on the host with. Each is judged against the host's own view, read on the host at
the same time, or against a file planted on the host for the check.

Known and not checked: tmpfs mounts made inside the sandbox's user namespace show its host uid
in mountinfo's options (the kernel prints a tmpfs owner as the initial namespace sees it).
"""

from __future__ import annotations

import math
import os
import re
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agentbox.battery.checks import Ctx, ProbeFailed, Verdict, blocked, check, na
from agentbox.battery.target import BATTERY_RESOURCES, Box

GROUP = "host-info"
CONTROL = ["host-info"]
BOOT_ID = "/proc/sys/kernel/random/boot_id"
# Why a host-info control cannot break on gVisor: its /proc is the sentry's, and shows nothing
# of the host's whatever the bundle binds or leaves out.
OWN_KERNEL = "gVisor's /proc and mountinfo are its kernel's own, with nothing of the host's"

# Host /etc entries that identify the machine, back up its accounts, or configure package
# mirrors, credentials and services: a sandbox's /etc has none of them.
HOST_ETC = (
    "machine-id",
    "passwd-",
    "group-",
    "shadow-",
    "gshadow-",
    "subuid",
    "subgid",
    "fstab",
    "apt/sources.list",
    "apt/sources.list.d",
    "yum.repos.d",
    "pip.conf",
    "npmrc",
    "gitconfig",
    "ssh",
)

MACHINE_WIDE = (
    "/proc/cmdline",
    "/proc/diskstats",
    "/proc/partitions",
    "/proc/loadavg",
    "/proc/stat",
    "/proc/sys/fs/file-nr",
    "/proc/pressure/cpu",
    "/proc/pressure/memory",
    "/proc/pressure/io",
)


def _view(box: Box, files: Iterable[str], dirs: Iterable[str] = ()) -> dict[str, Any]:
    out = box.probe("host_view", files=list(files), dirs=list(dirs))
    if "files" not in out:
        raise ProbeFailed(f"probe failed: {str(out)[:300]}")
    return out


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _number(pattern: str, text: str) -> int | None:
    m = re.search(pattern, text, re.M)
    return int(m[1]) if m else None


class _Planted:
    """A world-readable file planted on the host for one check (never with the oracle's nonce:
    the oracle reports new host entries carrying it as a sandbox's writes)."""

    def __init__(self, directory: str) -> None:
        self.token = f"abx-hostinfo-{secrets.token_hex(8)}"
        self.path = Path(directory) / self.token

    def __enter__(self) -> _Planted:
        self.path.write_text(self.token + "\n")
        os.chmod(self.path, 0o644)
        return self

    def __exit__(self, *exc: object) -> None:
        self.path.unlink(missing_ok=True)


@check(
    "info-etc-allowlist",
    GROUP,
    "/etc has no machine-id, account backups, mirror configs or files the operator adds",
    CONTROL,
)
def _info_etc(ctx: Ctx) -> Verdict:
    present = [f"/etc/{n}" for n in HOST_ETC if os.path.lexists(f"/etc/{n}")]
    box = ctx.box()
    with _Planted("/etc") as planted:
        out = _view(box, [str(planted.path), *present], ["/etc"])
    v = blocked(f"{len(present)} host-only /etc entries and a file planted in host /etc absent")
    for path, seen in out["files"].items():
        if seen != "ERR:ENOENT":
            v.add_break("READ", f"{path}: {seen.strip()[:40]}")
    if planted.token in out["dirs"]["/etc"]:
        v.add_break("READ", f"/etc lists {planted.token}, planted on the host")
    return v


@check("info-usr-local", GROUP, "/usr/local shows nothing of the host's", CONTROL)
def _info_usr_local(ctx: Ctx) -> Verdict:
    if not os.path.isdir("/usr/local"):
        return na("no /usr/local on this host")
    box = ctx.box()
    with _Planted("/usr/local") as planted:
        out = _view(box, [str(planted.path)], ["/usr/local"])
    listing = out["dirs"]["/usr/local"]
    v = blocked(f"/usr/local lists {listing!r}"[:120])
    if isinstance(listing, list) and listing:
        v.add_break("READ", f"/usr/local lists {', '.join(listing[:8])}")
    if planted.token in out["files"][str(planted.path)]:
        v.add_break("READ", f"read {planted.path}, planted on the host")
    return v


def _machine_wide(host: dict[str, str], seen: dict[str, str], tasks: int) -> list[str]:
    """Which of the sandbox's /proc files show the machine's figures rather than its own."""
    out = []
    if host["/proc/cmdline"] and seen["/proc/cmdline"] == host["/proc/cmdline"]:
        out.append("/proc/cmdline is the host kernel's")
    if seen["/proc/diskstats"].strip():
        out.append(f"/proc/diskstats lists {len(seen['/proc/diskstats'].splitlines())} devices")
    if re.search(r"^\s*\d+\s+\d+\s+\d+\s+\S+", seen["/proc/partitions"], re.M):
        out.append("/proc/partitions lists the host's block devices")
    total = _number(r"^\S+ \S+ \S+ \d+/(\d+)", seen["/proc/loadavg"])
    if total is not None and total > tasks:
        out.append(f"/proc/loadavg counts {total} tasks, the sandbox has {tasks}")
    forks = _number(r"^processes (\d+)", seen["/proc/stat"])
    host_forks = _number(r"^processes (\d+)", host["/proc/stat"]) or 0
    if forks is not None and host_forks and forks >= host_forks:
        out.append(f"/proc/stat counts {forks} forks since the host booted")
    files = _number(r"^(\d+)", seen["/proc/sys/fs/file-nr"])
    host_files = _number(r"^(\d+)", host["/proc/sys/fs/file-nr"]) or 0
    if files and host_files and abs(files - host_files) <= max(64, host_files // 4):
        out.append(f"/proc/sys/fs/file-nr: {files} open files (the host has {host_files})")
    for p in ("/proc/pressure/cpu", "/proc/pressure/memory", "/proc/pressure/io"):
        if "avg10=" in seen[p]:
            out.append(f"{p}: {seen[p].splitlines()[0][:40]}")
    return out


@check(
    "info-proc-machine-wide",
    GROUP,
    "/proc shows no machine-wide load, disk I/O, pressure, open files or boot parameters",
    CONTROL,
    control_elsewhere={"gvisor": OWN_KERNEL},
)
def _info_proc(ctx: Ctx) -> Verdict:
    box = ctx.box()
    host = {p: _read(p) for p in MACHINE_WIDE}
    out = _view(box, MACHINE_WIDE)
    seen = {p: ("" if v.startswith("ERR:") else v) for p, v in out["files"].items()}
    v = blocked(
        f"loadavg {seen['/proc/loadavg'].strip()!r}, diskstats {len(seen['/proc/diskstats'])} "
        f"bytes, pressure {out['files']['/proc/pressure/cpu'][:12]!r}"
    )
    for why in _machine_wide(host, seen, out["tasks"]):
        v.add_break("READ", why)
    return v


@check(
    "info-proc-own-figures",
    GROUP,
    "meminfo, cpuinfo, /proc/stat and nproc show the sandbox's own limits",
    CONTROL,
)
def _info_own(ctx: Ctx) -> Verdict:
    out = _view(ctx.box(), ["/proc/meminfo", "/proc/cpuinfo", "/proc/stat"])
    files = out["files"]
    limit_kb = BATTERY_RESOURCES["memory_mb"] * 1024
    want = min(math.ceil(BATTERY_RESOURCES["cpu_count"]), len(os.sched_getaffinity(0)))
    mem = _number(r"^MemTotal:\s+(\d+) kB", files["/proc/meminfo"])
    shown = {
        "cpuinfo processors": len(re.findall(r"^processor\s*:", files["/proc/cpuinfo"], re.M)),
        "/proc/stat cpus": len(re.findall(r"^cpu\d+ ", files["/proc/stat"], re.M)),
        "nproc (affinity)": out["affinity"],
    }
    v = blocked(f"MemTotal {mem} kB; " + ", ".join(f"{k} {n}" for k, n in shown.items()))
    if mem != limit_kb:
        v.add_break("READ", f"MemTotal {mem} kB, the sandbox's limit is {limit_kb} kB")
    for what, n in shown.items():
        if n != want:
            v.add_break("READ", f"{what}: {n}, the sandbox's quota is {want}")
    return v


@check(
    "info-boot-id",
    GROUP,
    "boot_id is the sandbox's own: not the host's, not shared",
    CONTROL,
    control_elsewhere={"gvisor": OWN_KERNEL},
)
def _info_boot_id(ctx: Ctx) -> Verdict:
    host = _read(BOOT_ID).strip()
    ids = [
        _view(ctx.box(tenant=t), [BOOT_ID])["files"][BOOT_ID].strip()
        for t in ("battery-a", "battery-b")
    ]
    ids = ["" if i.startswith("ERR:") else i for i in ids]  # unreadable names nothing
    v = blocked(f"boot ids {ids[0][:8]}…, {ids[1][:8]}…; the host's {host[:8]}…")
    if host in ids:
        v.add_break("READ", "a sandbox reads the host's boot id")
    if ids[0] == ids[1] and ids[0]:
        v.add_break("READ", "two sandboxes share a boot id")
    if not any(ids):
        # Masked or absent (a tier that cannot give each sandbox one): it names nothing,
        # neither the host nor a neighbour.
        v.evidence = f"boot_id reads empty in both sandboxes; the host's {host[:8]}…"
    return v


@check(
    "info-mountinfo",
    GROUP,
    "mountinfo and /proc/mounts name no host path, data dir or its digest",
    CONTROL,
    control_elsewhere={"gvisor": OWN_KERNEL},
)
def _info_mountinfo(ctx: Ctx) -> Verdict:
    box = ctx.box()
    out = _view(box, ["/proc/self/mountinfo", "/proc/1/mountinfo", "/proc/mounts"])
    needles = {
        "the bind root": f"{ctx.bind_root().parent}/",
        "the data dir's digest": ctx.digest(),
        "the data dir": str(ctx.server.data_dir.resolve()),
    }
    lines = sum(len(t.splitlines()) for t in out["files"].values())
    v = blocked(f"{lines} mount lines, none naming a host path")
    for path, text in out["files"].items():
        if text.startswith("ERR:"):
            raise ProbeFailed(f"{path}: {text}")
        for what, needle in needles.items():
            hit = next((ln for ln in text.splitlines() if needle in ln), None)
            if hit:
                v.add_break("READ", f"{path} names {what}: {hit[:100]}")
    return v
