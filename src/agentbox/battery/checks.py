"""The escape checks. Each runs probes inside real sandboxes and returns a verdict; the runner
adds what the oracle saw on the host (canary leaks, host changes, listener hits).

Every check names its positive control: the weakenings (runtimes/process/weaken.py) under which
the same check must come out BROKEN, or it cannot detect what it claims to.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentbox.battery import inventory
from agentbox.battery.netns import EGRESS_ALLOWED, EGRESS_FORBIDDEN
from agentbox.battery.oracle import CANARY_DOMAIN, Oracle
from agentbox.battery.target import BATTERY_RESOURCES, Box, Server
from agentbox.runtimes.base import HostFootprint
from agentbox.runtimes.process import userns
from agentbox.runtimes.process.userns import ROOT_CAP_MASK
from agentbox.runtimes.uids import BLOCK

BLOCKED_ERRNOS = {"EPERM", "ENOSYS", "SIGSYS", "EACCES", "ABSENT"}


@dataclass
class Verdict:
    status: str  # BLOCKED | BROKEN | N/A | ERROR
    kinds: list[str] = field(default_factory=list)
    evidence: str = ""

    def add_break(self, kind: str, evidence: str) -> None:
        if self.status != "BROKEN":
            self.status, self.evidence = "BROKEN", ""
        if kind not in self.kinds:
            self.kinds.append(kind)
        self.evidence = (self.evidence + "; " if self.evidence else "") + evidence


def blocked(evidence: str) -> Verdict:
    return Verdict("BLOCKED", evidence=evidence)


def na(reason: str) -> Verdict:
    return Verdict("N/A", evidence=reason)


# The battery's own built template: a Debian base with a marker file (shares the base layer
# with code-interpreter when the template dir is a test run's).
TEMPLATE_SPEC = """
name = "battery-root"
[base]
suite = "bookworm"
variant = "apt"
[[files]]
dest = "/etc/battery/marker"
content = "battery"
"""
_templates: dict[Path, Path] = {}  # template dir -> the built tree, once per run


def build_template(template_dir: Path) -> Path:
    """Build (or find, built) the battery's template in `template_dir`; its tree."""
    from agentbox.templates import TemplateStore, load_spec

    template_dir.mkdir(parents=True, exist_ok=True)
    info = TemplateStore(template_dir).build(load_spec(TEMPLATE_SPEC), lambda e: None)
    return Path(info.rootfs)


@dataclass
class Ctx:
    server: Server
    oracle: Oracle
    roles: dict[str, list[str]]
    template_dir: Path | None = None

    def template(self) -> tuple[str, Path]:
        """The battery's built template (built before the run: build_template): its name and
        its tree."""
        if self.template_dir is None:
            raise ProbeFailed("no template dir")
        if self.template_dir not in _templates:
            _templates[self.template_dir] = build_template(self.template_dir)
        return "battery-root", _templates[self.template_dir]

    def box(self, tenant: str = "battery-a", **body: Any) -> Box:
        return self.server.box(tenant, **body)

    # Where the runtime keeps things on the host: its HostFootprint, not a layout known here.

    def footprint(self) -> HostFootprint:
        return inventory.footprint(self.server.data_dir)

    def digest(self) -> str:
        return self.footprint().scope or ""

    def bind_root(self) -> Path:
        """The per-data-dir tree outside the data dir of the runtime under attack (what its
        sandboxes are bound from)."""
        data = self.server.data_dir.resolve()
        own = inventory.footprint_of(self.server.runtime, data)
        outside = [r for r in own.roots if not r.is_relative_to(data)]
        assert outside, "the runtime names no tree outside the data dir"
        return outside[0]

    def host_workspace(self, box: Box) -> Path:
        return self.bind_root() / box.id / "workspace"

    def sandbox_pids(self, box: Box) -> list[int]:
        """Host pids of the sandbox's processes, found by their cgroup (the bwrap monitor,
        outside the sandbox's namespaces, excluded)."""
        markers = [f"/{g}/{self.digest()}/{box.id}" for g in self.footprint().cgroup_groups]
        state = self.runtime_state(box)
        pids = []
        for p in os.listdir("/proc"):
            if not p.isdigit() or int(p) == state.get("bwrap_pid"):
                continue
            try:
                cgroups = Path(f"/proc/{p}/cgroup").read_text()
            except OSError:
                continue
            if any(m in cgroups for m in markers):
                pids.append(int(p))
        return pids

    def cpu_seconds(self, box: Box) -> float | None:
        """CPU time the sandbox's cgroup has used, read on the host (what the sandbox took from
        the machine, whatever its own kernel tells it); None without one."""
        root = Path("/sys/fs/cgroup")
        for group in self.footprint().cgroup_groups:
            rel = f"{group}/{self.digest()}/{box.id}"
            try:
                return int((root / "cpuacct" / rel / "cpuacct.usage").read_text()) / 1e9
            except (OSError, ValueError):
                pass
            try:
                stat = (root / rel / "cpu.stat").read_text().split()
                return int(stat[stat.index("usage_usec") + 1]) / 1e6
            except (OSError, ValueError, IndexError):
                pass
        return None

    def runtime_state(self, box: Box) -> dict[str, Any]:
        """What the runtime recorded of the sandbox (runtime.json in its dir, in whichever of
        the footprint's directories holds it)."""
        for d in self.footprint().dirs:
            try:
                return json.loads((d / box.id / "runtime.json").read_text())
            except (OSError, ValueError):
                continue
        return {}


@dataclass(frozen=True)
class Check:
    id: str
    group: str
    title: str
    control: frozenset[str]
    fn: Callable[[Ctx], Verdict]
    bind_canary: bool = False
    needs_template: bool = False  # runs in a sandbox of the battery's built template
    # Tiers on which the control cannot show the break, and why (the tier's own kernel has
    # nothing the weakening would expose): the control runs on the process tier there.
    control_elsewhere: dict[str, str] = field(default_factory=dict)
    # The check never reaches a sandbox (it attacks the API server alone): its verdict is the
    # same whatever the tier, so it runs once, on the process tier, for every tier.
    tier_free: bool = False


CHECKS: list[Check] = []


def check(
    id: str,
    group: str,
    title: str,
    control: Iterable[str],
    bind_canary: bool = False,
    needs_template: bool = False,
    control_elsewhere: dict[str, str] | None = None,
    tier_free: bool = False,
) -> Callable[[Callable[[Ctx], Verdict]], Callable[[Ctx], Verdict]]:
    def register(fn: Callable[[Ctx], Verdict]) -> Callable[[Ctx], Verdict]:
        CHECKS.append(
            Check(
                id, group, title, frozenset(control), fn, bind_canary, needs_template,
                control_elsewhere or {}, tier_free,
            )
        )  # fmt: skip
        return fn

    return register


# ------------------------------------------------------------------------- judging helpers


def results_of(out: dict[str, Any]) -> dict[str, Any]:
    if "error" in out and "results" not in out:
        raise ProbeFailed(f"probe failed: {out['error']} {out.get('_raw', '')[-300:]}")
    return out.get("results", out)


class ProbeFailed(Exception):
    pass


def reachable(results: dict[str, Any], ok: Iterable[str] = BLOCKED_ERRNOS) -> list[str]:
    """Syscalls/operations whose answer shows the kernel let them through."""
    ok = set(ok)
    return [f"{k}={v}" for k, v in results.items() if isinstance(v, str) and v not in ok]


def matching(results: dict[str, Any], prefixes: Iterable[str]) -> list[str]:
    prefixes = tuple(prefixes)
    return [
        f"{k}={str(v)[:60]}"
        for k, v in results.items()
        if isinstance(v, str) and v.startswith(prefixes)
    ]


def summary(results: dict[str, Any], limit: int = 6) -> str:
    items = [f"{k}={str(v)[:40]}" for k, v in list(results.items())[:limit]]
    more = len(results) - limit
    return ", ".join(items) + (f" (+{more} more)" if more > 0 else "")


def verdict_from(broken: list[str], kind: str, results: dict[str, Any]) -> Verdict:
    v = blocked(summary(results))
    if broken:
        v.add_break(kind, ", ".join(broken[:8]))
    return v


# The syscalls each check calls inside the sandbox, by check id: the one place the battery says
# which syscalls it probes. The seccomp deny-list and this table must agree
# (tests/unit/test_seccomp_battery_agree.py): every DENIED syscall is probed by some check, and a
# name DENIED lacks is probed only if NOT_DENIED says how seccomp stops it instead.
SYSCALL_PROBES: dict[str, tuple[str, ...]] = {
    "fs-mount-family": (
        "mount",
        "umount2",
        "pivot_root",
        "chroot",
        "open_tree",
        "move_mount",
        "fsopen",
        "fsconfig",
        "fsmount",
        "fspick",
        "mount_setattr",
    ),
    # with the namespace flags themselves (probe_ns_create), not bad arguments
    "fs-nested-userns": ("unshare", "clone"),
    "priv-clock-hostname": (
        "sethostname",
        "setdomainname",
        "settimeofday",
        "clock_settime",
        "clock_adjtime",
        "adjtimex",
    ),
    "sys-keyring": ("keyctl", "add_key", "request_key"),
    "sys-bpf-perf": ("bpf", "perf_event_open"),
    "sys-uffd-io-uring": ("userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register"),
    "sys-modules-kexec": (
        "init_module",
        "finit_module",
        "delete_module",
        "kexec_load",
        "kexec_file_load",
        "reboot",
    ),
    "sys-admin-misc": (
        "swapon",
        "swapoff",
        "acct",
        "quotactl",
        "quotactl_fd",
        "syslog",
        "iopl",
        "ioperm",
        "fanotify_init",
        "vhangup",
        "uselib",
        "lookup_dcookie",
        "nfsservctl",
    ),
    "sys-handles": ("open_by_handle_at", "name_to_handle_at"),
    "sys-cross-process": (
        "ptrace",
        "process_vm_readv",
        "process_vm_writev",
        "kcmp",
        "pidfd_getfd",
        "setns",
    ),
    "sys-personality-numa-clone3": ("personality", "move_pages", "migrate_pages", "clone3"),
}

# Probed, though not in DENIED: the filter stops them another way (runtimes/process/seccomp.py).
NOT_DENIED = {
    "clone": "the filter refuses namespace flags (CLONE_NS_FLAGS) with EPERM",
    "clone3": "the filter answers ENOSYS to every clone3, so libc falls back to clone",
    "personality": "the filter allows only ALLOWED_PERSONAS, not ADDR_NO_RANDOMIZE",
}


def syscall_check(ctx: Ctx, check_id: str) -> Verdict:
    """Call the check's syscalls with harmless bad arguments; any answer but a block breaks."""
    res = results_of(ctx.box().probe("syscalls", names=list(SYSCALL_PROBES[check_id])))
    return verdict_from(reachable(res), "ESCAPE", res)


# ------------------------------------------------------------------------- A. filesystem


@check("fs-canary-absolute", "filesystem", "host canary by absolute and '..' paths", ["bind-host"])
def _fs_canary(ctx: Ctx) -> Verdict:
    c = str(ctx.oracle.canary_file)
    paths = [c, f"/workspace/../../../..{c}", f"/tmp/../..{c}", f"//{c}", f"/proc/self/root{c}"]
    res = results_of(ctx.box().probe("read", paths=paths))
    return verdict_from(matching(res, ["DATA:"]), "READ", res)


@check(
    "fs-proc-root",
    "filesystem",
    "/proc/<pid>/root and cwd links to the host",
    ["share-pid", "host-root", "no-landlock"],
)
def _fs_proc_root(ctx: Ctx) -> Verdict:
    res = results_of(ctx.box().probe("proc_roots", rel=str(ctx.oracle.canary_file)))
    return verdict_from(matching(res, ["DATA:"]), "READ", res)


@check(
    "fs-open-by-handle",
    "filesystem",
    "open_by_handle_at 'shocker' to the host root",
    ["host-root", "no-seccomp"],
)
def _fs_shocker(ctx: Ctx) -> Verdict:
    res = results_of(ctx.box().probe("shocker", rel=str(ctx.oracle.canary_file)))
    return verdict_from(matching(res, ["DATA:", "ROOT_OPENED"]), "READ", res)


@check("fs-root-only-files", "filesystem", "/etc/shadow and other root-only files", ["host-root"])
def _fs_shadow(ctx: Ctx) -> Verdict:
    paths = ["/etc/shadow", "/etc/gshadow", "/etc/ssl/private", "/root/.bash_history"]
    paths += [str(p) for p in Path("/etc/ssh").glob("ssh_host_*_key")]
    existing = [p for p in paths if os.path.exists(p)]
    if not existing:
        return na("no root-only files on this host")
    res = results_of(ctx.box().probe("read", paths=existing))
    res = {k: v for k, v in res.items() if v != "EISDIR"}
    return verdict_from(matching(res, ["DATA:"]), "READ", res)


@check(
    "fs-write-outside",
    "filesystem",
    "create/rename/link/chmod/append outside the workspace",
    ["bind-host", "no-landlock"],
)
def _fs_write(ctx: Ctx) -> Verdict:
    o = ctx.oracle
    targets = [
        str(o.drop_dir),
        str(o.canary_dir),
        "/etc",
        "/usr",
        "/usr/bin",
        "/",
        "/var/lib",
        "/root",
        "/.agentbox",
    ]
    box = ctx.box()
    res = results_of(box.probe("write", targets=targets, nonce=o.nonce))
    res2 = results_of(box.probe("write_existing", paths=[str(o.canary_file), "/.agentbox/main.py"]))
    # What a sandbox may do inside its own view (e.g. /var/lib is its own empty dir) is not a
    # break; the oracle's host listing decides. Report host-visible success only.
    v = blocked(summary(res))
    for k, val in res2.items():
        if val == "OK":
            v.add_break("WRITE", f"{k}=OK")
    return v


@check(
    "fs-mount-family",
    "filesystem",
    "mount, umount2, pivot_root, chroot and the new mount API",
    ["host-root", "no-seccomp"],
)
def _fs_mount(ctx: Ctx) -> Verdict:
    return syscall_check(ctx, "fs-mount-family")


@check(
    "fs-nested-userns",
    "filesystem",
    "new user/mount/net namespaces (unshare, clone)",
    ["no-seccomp", "allow-userns"],
)
def _fs_userns(ctx: Ctx) -> Verdict:
    res = results_of(ctx.box().probe("ns_create", names=SYSCALL_PROBES["fs-nested-userns"]))
    broken = [f"{k}={v}" for k, v in res.items() if str(v).startswith("OK")]
    return verdict_from(broken, "ESCAPE", res)


@check(
    "fs-cgroup-release-agent",
    "filesystem",
    "cgroup v1 mount, release_agent and parent cgroup.procs",
    ["host-root", "no-seccomp", "no-landlock"],
)
def _fs_cgroup(ctx: Ctx) -> Verdict:
    res = results_of(ctx.box().probe("cgroup_escape", nonce=ctx.oracle.nonce))
    return verdict_from(matching(res, ["MOUNTED", "OPENED"]), "ESCAPE", res)


KNOBS = [
    "/proc/sys/kernel/core_pattern",
    "/proc/sys/kernel/modprobe",
    "/proc/sysrq-trigger",
    "/proc/sys/vm/panic_on_oom",
    "/proc/sys/fs/suid_dumpable",
    "/proc/sys/kernel/sysrq",
    "/proc/sys/fs/binfmt_misc/register",
    "/sys/kernel/uevent_helper",
    "/sys/fs/cgroup/release_agent",
    "/sys/kernel/mm/transparent_hugepage/enabled",
]


@check(
    "fs-kernel-knobs",
    "filesystem",
    "/proc/sys and /sys write surfaces (zero-byte open)",
    ["unsandboxed", "host-root"],
)
def _fs_knobs(ctx: Ctx) -> Verdict:
    res = results_of(ctx.box().probe("open_wr", paths=KNOBS))
    return verdict_from(matching(res, ["OPENED"]), "ESCAPE", res)


MASKED = [
    "/proc/kcore",
    "/proc/keys",
    "/proc/timer_list",
    "/proc/sched_debug",
    "/proc/latency_stats",
    "/proc/kallsyms",
    "/sys/kernel/debug",
    "/sys/firmware",
    "/proc/acpi",
    "/proc/scsi",
]


@check(
    "fs-masked-kernel-info",
    "filesystem",
    "kcore, keys, timer_list, kallsyms, debugfs, firmware, dmesg",
    ["unsandboxed", "host-root"],
)
def _fs_masked(ctx: Ctx) -> Verdict:
    res = results_of(ctx.box().probe("masked", paths=MASKED))
    broken = [
        f"{k}={v}"
        for k, v in res.items()
        if (v.startswith("READ:") and v != "READ:0")
        or v == "ADDRESSES"
        or (v.startswith("LISTED:") and v != "LISTED:0")
    ]
    return verdict_from(broken, "READ", res)


STANDARD_DEV = {
    "null",
    "zero",
    "full",
    "random",
    "urandom",
    "tty",
    "pts",
    "ptmx",
    "shm",
    "fd",
    "stdin",
    "stdout",
    "stderr",
    "core",
    "console",
    "mqueue",
}


@check(
    "fs-device-nodes",
    "filesystem",
    "/dev holds standard nodes only; mknod; mem/kmsg/disk/kvm/vsock",
    ["unsandboxed", "host-root"],
)
def _fs_devices(ctx: Ctx) -> Verdict:
    res = ctx.box().probe("devices", nonce=ctx.oracle.nonce)
    if "dev" not in res:
        raise ProbeFailed(str(res)[:300])
    extra = sorted(set(res.pop("dev")) - STANDARD_DEV)
    res = {k: v for k, v in res.items() if not k.startswith("_")}
    broken = matching(res, ["OPENED", "OK"])
    if extra:
        broken.append(f"extra /dev entries: {' '.join(extra[:10])}")
    return verdict_from(broken, "ESCAPE", res)


@check(
    "fs-leaked-fds", "filesystem", "inherited descriptors: only 0-2, no directory fds", ["leak-fd"]
)
def _fs_fds(ctx: Ctx) -> Verdict:
    out = ctx.box().probe("fds", rel=str(ctx.oracle.canary_file))
    fds = out.get("fds")
    if fds is None:
        raise ProbeFailed(str(out)[:300])
    extra = {fd: e for fd, e in fds.items() if fd not in ("0", "1", "2")}
    v = blocked("fds: " + ", ".join(f"{fd}->{e['target']}" for fd, e in fds.items()))
    for fd, e in extra.items():
        kind = "READ" if e["canary"].startswith("DATA:") else "ESCAPE"
        v.add_break(kind, f"fd {fd} -> {e['target']} ({e['canary'][:40]})")
    return v


def _tree_state(root: Path) -> dict[str, tuple[int, int, int, int]]:
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns)
    return out


@check(
    "fs-template-writes",
    "filesystem",
    "a writable root's writes (as its root) reach neither the template tree nor another sandbox",
    ["template-rw"],
    needs_template=True,
)
def _fs_template_writes(ctx: Ctx) -> Verdict:
    name, tree = ctx.template()
    n = ctx.oracle.nonce[:12]
    made = [f"/etc/abx-{n}", f"/usr/local/bin/abx-{n}", f"/opt/abx-{n}", f"/var/lib/abx-{n}"]
    before = _tree_state(tree)
    a, b = ctx.box(template=name), ctx.box(template=name)
    try:
        script = " && ".join(f"echo {n} > {p}" for p in made)
        wrote = a.run(f"{script} && chown 1000 {made[0]} && echo WROTE")
        if "WROTE" not in wrote.stdout:
            return Verdict("ERROR", evidence=f"the sandbox could not write its root: {wrote.text}")
        after = _tree_state(tree)
        seen = b.run(f"cat {' '.join(made)} 2>/dev/null; true").stdout
    finally:
        for p in made:  # a control wrote into the tree itself: take it out again
            with contextlib.suppress(OSError):
                os.unlink(tree / p.lstrip("/"))
    v = blocked(f"{len(made)} files written in sandbox A's root; template {len(before)} entries")
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        v.add_break("WRITE", f"the template tree changed: {changed[:6]}")
    if n in seen:
        v.add_break("WRITE", "sandbox B sees what sandbox A wrote in its root")
    return v


@check(
    "fs-root-fence",
    "filesystem",
    "a writable root's root may not write /dev, /proc or the agent's files (Landlock)",
    ["no-landlock"],
    needs_template=True,
)
def _fs_root_fence(ctx: Ctx) -> Verdict:
    name, _ = ctx.template()
    box = ctx.box(template=name)
    n = ctx.oracle.nonce[:12]
    # /dev is a tmpfs the sandbox's root owns: only Landlock keeps it from adding entries.
    targets = [f"/dev/abx-{n}", f"/.agentbox/abx-{n}", f"/proc/abx-{n}", f"/abx-{n}"]
    out = box.run(
        " ; ".join(f"(echo x > {t}) 2>/dev/null && echo MADE:{t}" for t in targets)
        + f" ; echo x > /etc/abx-{n} && echo CONTROL-OK"
    ).stdout
    if "CONTROL-OK" not in out:
        return Verdict("ERROR", evidence=f"the root is not writable at all: {out[:200]}")
    made = [ln.removeprefix("MADE:") for ln in out.splitlines() if ln.startswith("MADE:")]
    v = blocked(f"{len(targets)} paths refused; /etc written (the root is writable)")
    if made:
        v.add_break("WRITE", f"created {made}")
    return v


@check(
    "fs-exe-overwrite",
    "filesystem",
    "open own or runtime executables for writing",
    ["unsandboxed", "host-root"],
)
def _fs_exe(ctx: Ctx) -> Verdict:
    paths = [
        "/proc/self/exe",
        "/proc/1/exe",
        "/usr/bin/bwrap",
        "/usr/bin/bash",
        "/.agentbox/sandbox_agent.py",
        f"{ctx.bind_root()}/agent/sandbox_agent.py",  # its host path
    ]
    res = results_of(ctx.box().probe("open_wr", paths=paths))
    return verdict_from(matching(res, ["OPENED"]), "WRITE", res)


@check(
    "fs-shared-template",
    "filesystem",
    "writes to the shared userland and agent code reach no other sandbox",
    ["unsandboxed", "host-root"],
)
def _fs_template(ctx: Ctx) -> Verdict:
    host_agent = f"{ctx.bind_root()}/agent/sandbox_agent.py"
    before = hashlib.sha256(Path(host_agent).read_bytes()).hexdigest()
    a = ctx.box()
    res = results_of(a.probe("write_existing", paths=["/.agentbox/sandbox_agent.py", host_agent]))
    b = ctx.box(tenant="battery-b")
    seen = b.run("sha256sum /.agentbox/sandbox_agent.py 2>/dev/null || sha256sum " + host_agent)
    after = hashlib.sha256(Path(host_agent).read_bytes()).hexdigest()
    v = blocked(summary(res))
    if after != before:
        v.add_break("WRITE", "the shared agent code on the host changed")
    if before not in seen.stdout:
        v.add_break("WRITE", f"sandbox B sees modified agent code: {seen.stdout[:80]}")
    return v


# ------------------------------------------------------------------------- B. privilege


def _threads(ctx: Ctx) -> tuple[Box, dict[str, dict[str, str]]]:
    box = ctx.box()
    out = box.probe("status", threads=4)
    if "threads" not in out:
        raise ProbeFailed(str(out)[:300])
    return box, out["threads"]


def _host_tasks(ctx: Ctx, box: Box) -> dict[str, dict[str, str]]:
    """/proc/<pid>/task/<tid>/status of every sandbox thread, read from the host."""
    out = {}
    for pid in ctx.sandbox_pids(box):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            except OSError:
                continue
            out[f"{pid}/{tid}"] = dict(
                (k, v.strip()) for k, _, v in (ln.partition(":") for ln in text.splitlines())
            )
    return out


CAP_SETS = ("CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb")


@check(
    "priv-capabilities",
    "privilege",
    "`user` holds no capability; the sandbox's root only its granted set, in its own userns",
    ["host-root"],
)
def _priv_caps(ctx: Ctx) -> Verdict:
    box = ctx.box()
    v = blocked(
        "user: all sets 0 but Bnd; root: within the granted set; both in the sandbox's userns"
    )
    ran = 0
    for user in ("user", "root"):
        out = box.probe("status", threads=4, user=user)
        if "threads" not in out:
            # (A host-root control's `user` is host uid 1000, which cannot enter the
            # workspace: its root's probe is the one that must show the break.)
            v.evidence += f"; {user}'s probe did not run: {str(out)[:120]}"
            continue
        ran += 1
        for tid, f in out["threads"].items():
            for k in CAP_SETS:
                # `user` keeps root's bounding set (no_new_privs: it never regains any of it).
                allowed = ROOT_CAP_MASK if user == "root" or k == "CapBnd" else 0
                if user == "root" and k in ("CapInh", "CapAmb"):
                    allowed = 0
                extra = int(f.get(k, "0"), 16) & ~allowed
                if extra:
                    v.add_break(
                        "ESCAPE", f"{user} thread {tid} {k} has {extra:#x} beyond {allowed:#x}"
                    )
                    break
    if ran < 2 and v.status != "BROKEN":
        raise ProbeFailed(v.evidence)  # a probe that did not run proves nothing
    # Capabilities count only in the user namespace that holds them: none may be the host's.
    host_ns = os.readlink("/proc/self/ns/user")
    for pid in ctx.sandbox_pids(box):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            ns = os.readlink(f"/proc/{pid}/ns/user")
        except OSError:
            continue
        eff = int(re.search(r"^CapEff:\s+(\w+)", status, re.M)[1], 16)  # type: ignore[index]
        if eff and ns == host_ns:
            v.add_break("ESCAPE", f"pid {pid} holds capabilities {eff:#x} in the host's userns")
    return v


@check(
    "priv-root-reach",
    "privilege",
    "the sandbox's root: no mount, no host-root or other-range files, no host process",
    ["host-root"],
)
def _priv_root_reach(ctx: Ctx) -> Verdict:
    """Its capabilities (dac_override, fowner, kill, setuid, ...) hold only for ids its user
    namespace maps: the oracle shows it, read-only (--host-path), a host-root 0600 file and a
    0700 dir of an id outside every sandbox's range."""
    box = ctx.box()
    files = ctx.oracle.foreign_files()
    read = results_of(box.probe("read", paths=files, user="root"))
    v = blocked(summary(read))
    for path, got in read.items():
        if isinstance(got, str) and got.startswith("DATA:"):
            v.add_break("READ", f"{path} read by the sandbox's root")
        elif got not in ("EACCES", "EPERM"):
            v.add_break("READ", f"{path}={got}: not shown, so nothing was tested")
    calls = results_of(box.probe("syscalls", names=["mount", "umount2", "pivot_root"], user="root"))
    for name in reachable(calls):
        v.add_break("ESCAPE", f"root: {name}")
    ns = results_of(box.probe("ns_create", names=["unshare", "clone"], user="root"))
    for name in matching(ns, ("OK",)):
        v.add_break("ESCAPE", f"root: new namespace {name}")
    kill = box.probe("kill", pid=ctx.oracle.canary_pid, user="root")
    if kill.get("kill") == "OK" or ctx.oracle.signal_log.read_text():
        v.add_break("ESCAPE", "the sandbox's root signalled a host process")
    v.evidence += f"; mount family {summary(calls)}; kill {kill.get('kill')}"
    return v


@check(
    "priv-agent-memory",
    "privilege",
    "the agent's memory and ptrace, and pid 1's, from the sandbox's root",
    ["host-root"],
)
def _priv_agent_memory(ctx: Ctx) -> Verdict:
    """The agent holds the sandbox's control channel: a process of the sandbox that could
    read or write its memory could answer the server in its place, or run system calls
    outside the filter through pid 1. Whether the agent was started by exec or forked from
    the zygote (whose memory is the host user namespace's), its root reaches neither."""
    out = ctx.box().probe("agent_access", user="root")
    if not out.get("agents"):
        raise ProbeFailed(f"no agent found: {str(out)[:300]}")
    res = {k: v for k, v in out.items() if not k.startswith("_") and k != "agents"}
    # Its environment is the sandbox's own (what every command gets): shown, not judged.
    judged = {k: v for k, v in res.items() if not k.endswith(" environ")}
    broken = [f"{k}={v}" for k, v in judged.items() if v == "OK"]
    return verdict_from(broken, "ESCAPE", res)


@check(
    "priv-no-new-privs",
    "privilege",
    "NoNewPrivs on every thread (setuid binaries give nothing)",
    ["unsandboxed"],
)
def _priv_nnp(ctx: Ctx) -> Verdict:
    box, threads = _threads(ctx)
    v = blocked(f"NoNewPrivs=1 on {len(threads)} threads")
    for tid, f in threads.items():
        if f.get("NoNewPrivs") != "1":
            v.add_break("ESCAPE", f"thread {tid} NoNewPrivs={f.get('NoNewPrivs')}")
    host = _host_tasks(ctx, box)
    for tid, f in host.items():
        if f.get("NoNewPrivs") != "1":
            v.add_break("ESCAPE", f"host view: task {tid} NoNewPrivs={f.get('NoNewPrivs')}")
    return v


@check(
    "priv-seccomp-all-threads",
    "privilege",
    "Seccomp: 2 on every thread, seen from the host",
    ["no-seccomp"],
)
def _priv_seccomp(ctx: Ctx) -> Verdict:
    box, threads = _threads(ctx)
    box.start(
        "python3 -c 'import threading,time\n"
        "for _ in range(3): threading.Thread(target=time.sleep,args=(5,)).start()'"
    )
    time.sleep(0.5)
    host = _host_tasks(ctx, box)
    v = blocked(f"Seccomp=2 on {len(threads)} threads inside and {len(host)} tasks from the host")
    for tid, f in {**threads, **{f"host {k}": x for k, x in host.items()}}.items():
        if f.get("Seccomp") != "2":
            v.add_break("ESCAPE", f"{tid} Seccomp={f.get('Seccomp')}")
    if not host:
        v.add_break("ESCAPE", "no sandbox task found from the host")
    return v


NAMESPACES = ("net", "pid", "mnt", "ipc", "uts", "user", "cgroup")


@check("priv-namespaces", "privilege", "every namespace differs from the server's", ["share-net"])
def _priv_ns(ctx: Ctx) -> Verdict:
    box = ctx.box()
    box.run("true")
    assert ctx.server.proc is not None
    mine = {ns: os.readlink(f"/proc/{ctx.server.proc.pid}/ns/{ns}") for ns in NAMESPACES}
    v = blocked("net, pid, mnt, ipc, uts, user, cgroup all new")
    pids = ctx.sandbox_pids(box)
    if not pids:
        return Verdict("ERROR", evidence="no sandbox process found from the host")
    for pid in pids:
        for ns in NAMESPACES:
            try:
                if os.readlink(f"/proc/{pid}/ns/{ns}") == mine[ns]:
                    v.add_break("ESCAPE", f"pid {pid} shares the server's {ns} namespace")
            except OSError:
                pass
    return v


@check(
    "priv-host-uid",
    "privilege",
    "sandbox processes run as an unprivileged per-sandbox host uid",
    ["host-root"],
)
def _priv_uid(ctx: Ctx) -> Verdict:
    a, b = ctx.box(), ctx.box(tenant="battery-b")
    uids: dict[str, set[int]] = {}
    for box in (a, b):
        box.run("true")
        for pid in ctx.sandbox_pids(box):
            try:
                uids.setdefault(box.id, set()).add(os.stat(f"/proc/{pid}").st_uid)
            except OSError:
                pass
    v = blocked(f"host uids {uids}")
    all_uids = set().union(*uids.values()) if uids else set()
    if 0 in all_uids:
        v.add_break("ESCAPE", "a sandbox process runs as host root")
    if len(uids) == 2 and uids[a.id] & uids[b.id]:
        v.add_break("ESCAPE", "two sandboxes share a host uid")
    return v


@check(
    "priv-uid-ranges",
    "privilege",
    "every live sandbox maps its own block of host ids, shared with no other sandbox",
    ["same-uid"],
)
def _priv_uid_ranges(ctx: Ctx) -> Verdict:
    boxes = [ctx.box(), ctx.box(), ctx.box(tenant="battery-b")]
    ranges: dict[str, set[tuple[int, int]]] = {}
    v = blocked("")
    for box in boxes:
        box.run("true")
        for pid in ctx.sandbox_pids(box):
            r = userns.mapped_range(pid)
            try:
                uid = os.stat(f"/proc/{pid}").st_uid
            except OSError:
                continue
            if r is None:
                v.add_break("ESCAPE", f"{box.id}: pid {pid} has no range of its own")
                continue
            ranges.setdefault(box.id, set()).add(r)
            if not r[0] <= uid < r[0] + r[1]:
                v.add_break("ESCAPE", f"{box.id}: pid {pid} runs as host uid {uid} outside {r}")
    spans = []
    for box_id, found in ranges.items():
        # One block per sandbox: its processes may map parts of it (gVisor's kernel runs as
        # the block's last id, its file server maps the rest), never more than a block.
        lo, hi = min(r[0] for r in found), max(r[0] + r[1] for r in found)
        if hi - lo > BLOCK:
            v.add_break("ESCAPE", f"{box_id} has processes in several ranges {sorted(found)}")
        spans.append((lo, hi, box_id))
    spans.sort()
    for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:], strict=False):
        if b0 < a1:
            v.add_break("ESCAPE", f"{a} [{a0}, {a1}) and {b} [{b0}, {b1}) overlap")
    if len(ranges) != len(boxes):
        return Verdict("ERROR", evidence=f"processes found for {len(ranges)} of {len(boxes)}")
    if v.status == "BLOCKED":
        v.evidence = ", ".join(f"{b}: {sorted(r)}" for b, r in ranges.items())
    return v


@check("sys-keyring", "syscalls", "keyctl, add_key, request_key", ["host-root", "no-seccomp"])
def _sys_keys(ctx: Ctx) -> Verdict:
    return syscall_check(ctx, "sys-keyring")


@check("sys-bpf-perf", "syscalls", "bpf, perf_event_open", ["host-root", "no-seccomp"])
def _sys_bpf(ctx: Ctx) -> Verdict:
    return syscall_check(ctx, "sys-bpf-perf")


@check(
    "sys-uffd-io-uring",
    "syscalls",
    "userfaultfd, io_uring_setup/enter/register",
    ["host-root", "no-seccomp"],
)
def _sys_uring(ctx: Ctx) -> Verdict:
    return syscall_check(ctx, "sys-uffd-io-uring")


@check(
    "sys-modules-kexec",
    "syscalls",
    "init/finit/delete_module, kexec_load, kexec_file_load, reboot",
    ["host-root", "no-seccomp"],
)
def _sys_modules(ctx: Ctx) -> Verdict:
    return syscall_check(ctx, "sys-modules-kexec")


@check(
    "sys-admin-misc",
    "syscalls",
    "swap, acct, quotas, syslog, iopl/ioperm, fanotify, vhangup, uselib, nfsservctl, dcookie",
    ["host-root", "no-seccomp"],
)
def _sys_admin(ctx: Ctx) -> Verdict:
    return syscall_check(ctx, "sys-admin-misc")


@check(
    "sys-handles", "syscalls", "open_by_handle_at, name_to_handle_at", ["host-root", "no-seccomp"]
)
def _sys_handles(ctx: Ctx) -> Verdict:
    return syscall_check(ctx, "sys-handles")


@check(
    "sys-cross-process",
    "syscalls",
    "ptrace, process_vm_readv/writev, kcmp, pidfd_getfd, setns",
    ["host-root", "no-seccomp"],
)
def _sys_process(ctx: Ctx) -> Verdict:
    return syscall_check(ctx, "sys-cross-process")


@check(
    "sys-personality-numa-clone3",
    "syscalls",
    "personality(ADDR_NO_RANDOMIZE), move/migrate_pages, clone3",
    ["host-root", "no-seccomp"],
)
def _sys_misc(ctx: Ctx) -> Verdict:
    return syscall_check(ctx, "sys-personality-numa-clone3")


@check(
    "priv-ptrace-host",
    "privilege",
    "ptrace, process_vm_readv and environ of a host process",
    ["share-pid", "host-root", "no-seccomp"],
)
def _priv_ptrace(ctx: Ctx) -> Verdict:
    res = ctx.box().probe("ptrace", pid=ctx.oracle.canary_pid)
    res = {k: v for k, v in res.items() if not k.startswith("_")}
    broken = [
        f"{k}={str(v)[:40]}" for k, v in res.items() if v == "OK" or str(v).startswith("DATA:")
    ]
    return verdict_from(broken, "ESCAPE", res)


@check(
    "priv-host-processes", "privilege", "host processes invisible (pid namespace)", ["share-pid"]
)
def _priv_pids(ctx: Ctx) -> Verdict:
    out = ctx.box().probe("pids")
    if "processes" not in out:
        raise ProbeFailed(str(out)[:300])
    v = blocked(f"{out['count']} processes visible")
    if any(ctx.oracle.nonce in p for p in out["processes"]):
        v.add_break("READ", f"the host canary process is visible among {out['count']}")
    return v


@check(
    "priv-signal-host",
    "privilege",
    "signal a host process",
    ["share-pid", "host-root", "no-landlock"],
)
def _priv_kill(ctx: Ctx) -> Verdict:
    res = ctx.box().probe("kill", pid=ctx.oracle.canary_pid)
    time.sleep(0.2)  # the oracle's signal log decides
    return blocked(f"kill -> {res.get('kill')}")


@check(
    "priv-tiocsti",
    "privilege",
    "TIOCSTI (and its 64-bit form), TIOCLINUX",
    ["host-root", "no-seccomp"],
)
def _priv_tty(ctx: Ctx) -> Verdict:
    res = ctx.box().probe("tty")
    res = {k: v for k, v in res.items() if not k.startswith("_")}
    broken = [f"{k}={v}" for k, v in res.items() if k.startswith("TIOCSTI") and v == "OK"]
    return verdict_from(broken, "ESCAPE", res)


@check(
    "priv-clock-hostname",
    "privilege",
    "settimeofday, clock_settime/adjtime, adjtimex, sethostname, setdomainname",
    ["host-root", "no-seccomp"],
)
def _priv_clock(ctx: Ctx) -> Verdict:
    names = SYSCALL_PROBES["priv-clock-hostname"]
    res = ctx.box().probe("identity", nonce=ctx.oracle.nonce, names=names)
    res = {k: v for k, v in res.items() if not k.startswith("_")}
    broken = [f"{k}={v}" for k, v in res.items() if k != "uname" and v not in BLOCKED_ERRNOS]
    return verdict_from(broken, "ESCAPE", res)


# ------------------------------------------------------------------------- C. network


@check("net-interfaces", "network", "only a loopback interface", ["share-net"])
def _net_ifaces(ctx: Ctx) -> Verdict:
    out = ctx.box().probe("interfaces")
    ifs = out.get("interfaces")
    if ifs is None:
        raise ProbeFailed(str(out)[:300])
    addrs = sorted(set(out.get("addresses", [])) - {"127.0.0.1", "::1"})
    v = blocked(f"interfaces: {ifs}, addresses 127.0.0.1 ::1")
    if set(ifs) - {"lo"}:
        v.add_break("NET", f"interfaces besides lo: {ifs}")
    if addrs:
        v.add_break("NET", f"addresses besides loopback: {addrs}")
    return v


def _connect(ctx: Ctx, hosts: list[str], ports: Iterable[int] = (80, 8080)) -> Verdict:
    targets = [("tcp", h, p) for h in hosts for p in ports] + [("udp", h, 8080) for h in hosts]
    res = results_of(ctx.box().probe("connect", targets=targets, payload=f"ABX-{ctx.oracle.nonce}"))
    return blocked(summary(res))  # hits on the oracle's listeners decide


@check("net-host-loopback", "network", "host loopback services (TCP/UDP, IPv4/IPv6)", ["share-net"])
def _net_lo(ctx: Ctx) -> Verdict:
    return _connect(ctx, ["127.0.0.1", "::1", "127.0.0.53"])


@check(
    "net-gateway-node",
    "network",
    "gateway and node addresses (10.0.2.2, 172.17.0.1, node IP)",
    ["share-net"],
)
def _net_gw(ctx: Ctx) -> Verdict:
    hosts = ctx.roles.get("gateway", []) + ctx.roles.get("node", [])
    return _connect(ctx, hosts or ["10.0.2.2"])


@check(
    "net-metadata", "network", "cloud metadata by address, name and odd spellings", ["share-net"]
)
def _net_metadata(ctx: Ctx) -> Verdict:
    urls = [
        "http://169.254.169.254/",
        "http://[fd00:ec2::254]/",
        "http://100.100.100.200/",
        "http://metadata.google.internal/",
        "http://0xa9fea9fe/",
        "http://2852039166/",
        "http://0251.0376.0251.0376/",
        "http://169.254.43518/",
    ]
    res = results_of(ctx.box().probe("http", urls=urls))
    broken = [k for k, v in res.items() if "ABX-CANARY-LISTENER" in str(v)]
    return verdict_from(broken, "NET", res)


@check(
    "net-dns-exfiltration",
    "network",
    "DNS lookups, raw :53 UDP/TCP, TXT, public resolvers",
    ["share-net"],
)
def _net_dns(ctx: Ctx) -> Verdict:
    n = ctx.oracle.nonce
    names = [f"{n}.{CANARY_DOMAIN}", f"exfil-{n[:8]}.{CANARY_DOMAIN}"]
    resolvers = ctx.roles.get("resolver", []) + ["8.8.8.8", "1.1.1.1", "127.0.0.53", "::1"]
    res = results_of(ctx.box().probe("dns", names=names, resolvers=resolvers))
    broken = [k for k, v in res.items() if v in ("RESOLVED", "ANSWERED", "CONNECTED")]
    return verdict_from(broken, "NET", res)


@check(
    "net-platform-api",
    "network",
    "the agentbox API and other sandboxes' agent sockets",
    ["share-net"],
)
def _net_api(ctx: Ctx) -> Verdict:
    box = ctx.box()
    res = results_of(
        box.probe(
            "connect",
            targets=[("tcp", "127.0.0.1", ctx.server.port)],
            payload="GET /v1/health HTTP/1.0\r\n\r\n",
        )
    )
    ls = box.run(f"ls -A {ctx.bind_root().parent} {ctx.bind_root()} 2>/dev/null | head -5")
    v = verdict_from([k for k, v in res.items() if v == "CONNECTED"], "NET", res)
    if ls.stdout.strip():
        v.add_break("NET", f"agent sockets visible: {ls.stdout[:100]}")
    return v


@check(
    "net-abstract-unix",
    "network",
    "abstract Unix sockets of the host",
    ["share-net", "no-landlock"],
)
def _net_abstract(ctx: Ctx) -> Verdict:
    res = ctx.box().probe("abstract", sock=ctx.oracle.abstract_name)
    return blocked(f"connect -> {res.get('connect')}")


@check(
    "net-raw-packet",
    "network",
    "AF_PACKET, raw sockets, route and link changes",
    ["host-root", "no-seccomp"],
)
def _net_raw(ctx: Ctx) -> Verdict:
    res = ctx.box().probe("sockets")
    if "families" not in res:
        raise ProbeFailed(str(res)[:300])
    pick = {
        k: res[k]
        for k in ("AF_PACKET raw", "AF_INET raw icmp", "AF_INET6 raw", "ip link add", "ip addr add")
    }
    broken = [f"{k}={v[:30]}" for k, v in pick.items() if v in ("OPENED", "OK")]
    return verdict_from(broken, "ESCAPE", pick)


@check(
    "net-socket-families",
    "network",
    "vsock, AF_ALG and other non-IP socket families",
    ["no-seccomp"],
    control_elsewhere={"gvisor": "gVisor's kernel has none of these families, seccomp or not"},
)
def _net_families(ctx: Ctx) -> Verdict:
    res = ctx.box().probe("sockets")
    if "families" not in res:
        raise ProbeFailed(str(res)[:300])
    opened = [f"family {f}" for f, v in res["families"].items() if v == "OPENED"]
    opened += [k for k in ("AF_VSOCK stream", "AF_ALG seqpacket") if res[k] == "OPENED"]
    return verdict_from(
        opened,
        "ESCAPE",
        {"vsock": res["AF_VSOCK stream"], "alg": res["AF_ALG seqpacket"], **res["families"]},
    )


# The egress proxy (HTTP_PROXY / ALL_PROXY inside every sandbox) is the only way out. These
# checks attack it with sandboxes whose policies allow everything they ask for, so only the
# proxy's own guards (internal addresses, SNI/Host consistency) stand in the way.

EGRESS_CONTROL = ["egress-open"]


def _proxy_answers(box: Box, attempts: list[dict[str, Any]], nonce: str) -> dict[str, Any]:
    res = results_of(box.probe("egress", attempts=attempts, payload=f"ABX-{nonce}", timeout=180))
    down = [k for k, v in res.items() if v == "NO_PROXY_VARIABLE" or v == "ECONNREFUSED"]
    if len(down) == len(res):
        raise ProbeFailed(f"the sandbox's egress proxy is unreachable: {summary(res)}")
    return res


def _ask(key: str, via: str, **attempt: Any) -> dict[str, Any]:
    """One request for probe_egress (port 80 unless given)."""
    return {"key": key, "via": via, "port": 80, **attempt}


def _refused(answer: str) -> bool:
    """Whether the proxy turned an attempt down before connecting anywhere."""
    return answer.startswith("HTTP 4") or (answer.startswith("SOCKS ") and not _carried(answer))


def _carried(answer: str) -> bool:
    """Whether the proxy opened (or tried to open) a connection for an attempt: 200 / SOCKS
    success, or 502 / SOCKS 5 (it connected to nothing there, but it tried)."""
    return answer.startswith(("HTTP 200", "HTTP 502", "SOCKS 0", "SOCKS 5"))


def _allowed_egress(box: Box) -> list[dict[str, Any]]:
    """The attempts of `box` the server's egress log records as allowed."""
    r = box.client.get(
        "/v1/audit/egress", params={"sandbox_id": box.id, "allowed": "true", "limit": 1000}
    )
    r.raise_for_status()
    return list(r.json()["events"])


def _spellings(ctx: Ctx) -> dict[str, list[str]]:
    """Internal destinations in the spellings clients and resolvers accept, by what they are."""
    private = ctx.roles.get("gateway", []) + ctx.roles.get("node", [])
    return {
        "loopback": [
            "127.0.0.1",
            "127.1",
            "2130706433",
            "0x7f000001",
            "0177.0.0.1",
            "0x7f.1",
            "127.0.0.1.",
            "[::1]",
            "[::ffff:127.0.0.1]",
            "[::ffff:7f00:1]",
            "[64:ff9b::7f00:1]",
            "localhost",
            "LOCALHOST.",
            "abx.localhost",
            "rebind-loopback.abx.test",
            "rebind-loopback6.abx.test",
            "rebind-mapped.abx.test",
        ],
        "metadata": [
            "169.254.169.254",
            "2852039166",
            "0xa9fea9fe",
            "0251.0376.0251.0376",
            "169.254.43518",
            "[::ffff:169.254.169.254]",
            "[::ffff:a9fe:a9fe]",
            "[fd00:ec2::254]",
            "100.100.100.200",
            "metadata.google.internal",
            "rebind-metadata.abx.test",
        ],
        "private": private + ["rebind-gateway.abx.test"],
    }


@check(
    "net-proxy-internal",
    "network",
    "egress proxy to loopback, metadata and private addresses in every spelling",
    EGRESS_CONTROL,
)
def _net_proxy_internal(ctx: Ctx) -> Verdict:
    spellings = _spellings(ctx)
    everything = [h for hosts in spellings.values() for h in hosts]
    # Allowlisted in every form a policy accepts, and the internet allowed too: only the
    # proxy's address guard may refuse.
    allow = ["127.0.0.0/8", "::1", "::ffff:0:0/96", "64:ff9b::/96", "169.254.0.0/16"]
    allow += ["100.64.0.0/10", "fd00::/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]
    allow += ["localhost", "abx.localhost", "metadata.google.internal", "*.abx.test"]
    allow += [h for h in spellings["private"] if h[0].isdigit()]
    box = ctx.box(network={"allow_internet_access": True, "allow_out": allow})
    attempts = []
    for h in everything:
        bare = h[1:-1] if h.startswith("[") else h
        attempts.append(_ask(f"CONNECT {h}:443", "connect", target=f"{h}:443"))
        attempts.append(_ask(f"GET http://{h}/", "http", url=f"http://{h}/"))
        attempts.append(_ask(f"SOCKS5 name {bare}:80", "socks", atyp="domain", host=bare))
    addrs = ["127.0.0.1", "::1", "::ffff:127.0.0.1", *ctx.roles.get("metadata", [])]
    addrs += [h for h in spellings["private"] if h[0].isdigit()]
    for a in dict.fromkeys(addrs):
        atyp = "ipv6" if ":" in a else "ipv4"
        attempts.append(_ask(f"SOCKS5 {atyp} {a}:80", "socks", atyp=atyp, host=a))
    res = _proxy_answers(box, attempts, ctx.oracle.nonce)
    refused = sum(v.startswith("HTTP 403") or v == "SOCKS 2" for v in res.values())
    v = blocked(f"{refused} of {len(res)} refused (403 / SOCKS 2): {summary(res, 3)}")
    for k, answer in res.items():
        if _carried(answer):
            v.add_break("NET", f"{k} -> {answer[:50]}")
    for e in _allowed_egress(box):
        v.add_break("NET", f"the egress log shows {e['protocol']} {e['host']}:{e['port']} allowed")
    odd = {k: a for k, a in res.items() if not _refused(a) and not _carried(a)}
    if odd and v.status != "BROKEN":
        v.evidence += f"; other answers: {summary(odd, 3)}"
    return v


@check(
    "net-proxy-bypass",
    "network",
    "programs that skip the proxy: raw sockets, HTTPS by IP, QUIC, IPv6, DNS, /etc/hosts",
    ["share-net"],
)
def _net_proxy_bypass(ctx: Ctx) -> Verdict:
    o = ctx.oracle
    r = ctx.roles
    hosts = r.get("egress-allowed", []) + r.get("egress-forbidden", []) + r.get("gateway", [])
    hosts += r.get("node", []) + r.get("metadata", []) + r.get("resolver", [])
    hosts += ["127.0.0.1", "::1"]
    hosts = list(dict.fromkeys(hosts))
    # Internet access allowed: whatever the policy says, a sandbox has no route of its own.
    box = ctx.box(network={"allow_internet_access": True})
    targets = [("tcp", h, p) for h in hosts for p in (80, 443)]
    targets += [("udp", h, p) for h in hosts for p in (443, 8080)]
    direct = results_of(box.probe("connect", targets=targets, payload=f"ABX-{o.nonce}"))
    bypass = results_of(box.probe("bypass", hosts=hosts, payload=f"ABX-{o.nonce}"))
    names = [f"{o.nonce}.{CANARY_DOMAIN}", f"bypass-{o.nonce[:8]}.{CANARY_DOMAIN}"]
    resolvers = r.get("resolver", []) + ["8.8.8.8", "1.1.1.1", "::1"]
    dns = results_of(box.probe("dns", names=names, resolvers=resolvers))
    # Names go to the proxy's resolver only once the policy allows them: a sandbox with no
    # egress cannot use the proxy's lookups as a DNS channel.
    closed = ctx.box()
    name = f"via-proxy-{o.nonce}.{CANARY_DOMAIN}"
    ask = [
        _ask(f"CONNECT {name}", "connect", target=f"{name}:443"),
        _ask(f"GET http://{name}/", "http", url=f"http://{name}/"),
        _ask(f"SOCKS5 {name}", "socks", atyp="domain", host=name),
    ]
    proxied = results_of(closed.probe("egress", attempts=ask, payload=f"ABX-{o.nonce}"))
    res = {**direct, **bypass, **dns, **proxied}
    reached = [k for k, val in direct.items() if val == "CONNECTED"]
    reached += [k for k, val in bypass.items() if val == "CONNECTED" or val.startswith("HTTP")]
    reached += [
        k for k, val in bypass.items() if val.startswith("exit") and not val.endswith("code 000")
    ]
    reached += [k for k, val in dns.items() if val in ("RESOLVED", "ANSWERED", "CONNECTED")]
    reached += [f"{k} -> {val[:40]}" for k, val in proxied.items() if _carried(val)]
    v = verdict_from(reached, "NET", res)
    v.evidence += f"; /etc/hosts {bypass.get('/etc/hosts')}"
    return v


@check(
    "net-proxy-mismatch",
    "network",
    "allowed name fronting a forbidden one: SNI, Host header, requests inside a tunnel",
    EGRESS_CONTROL,
)
def _net_proxy_mismatch(ctx: Ctx) -> Verdict:
    allowed_addrs = ctx.roles.get("egress-allowed", [])
    if not allowed_addrs or not ctx.roles.get("egress-forbidden"):
        return Verdict("ERROR", evidence="the egress listener addresses could not be set up")
    ok, bad = EGRESS_ALLOWED[0], EGRESS_FORBIDDEN[0]
    bad_ip = EGRESS_FORBIDDEN[1]
    url = f"http://{ok}/"
    inner = f"GET / HTTP/1.1\r\nHost: {bad}\r\nConnection: close\r\n\r\n"
    # Servers skip empty lines before a request and answer pipelined requests in order: a
    # check of the first request line alone would miss these.
    pipelined = f"GET / HTTP/1.1\r\nHost: {ok}\r\n\r\n{inner}"
    box = ctx.box(network={"allow_out": [ok]})
    baseline = [
        _ask("GET allowed", "http", url=url),
        _ask("CONNECT allowed, SNI allowed", "connect", target=f"{ok}:443", sni=ok),
        _ask("SOCKS5 allowed, SNI allowed", "socks", atyp="domain", host=ok, port=443, sni=ok),
    ]
    # The proxy must refuse these outright.
    refused = [
        _ask("GET allowed, Host forbidden", "http", url=url, host_headers=[bad]),
        _ask("GET forbidden, Host allowed", "http", url=f"http://{bad}/", host_headers=[ok]),
        _ask("GET allowed@forbidden", "http", url=f"http://{ok}@{bad}/"),
        _ask("CONNECT forbidden", "connect", target=f"{bad}:443", sni=bad),
        # What a client sends after a hosts-file spoof: the forbidden address, the allowed SNI.
        _ask("CONNECT forbidden IP, SNI allowed", "connect", target=f"{bad_ip}:443", sni=ok),
        _ask("SOCKS5 forbidden", "socks", atyp="domain", host=bad, port=443, sni=bad),
        _ask("SOCKS5 forbidden IP, SNI allowed", "socks", atyp="ipv4", host=bad_ip, sni=ok),
    ]
    # Tunnels to the allowed name carrying the forbidden one: judged by what the allowed
    # listener receives (it must never see the forbidden name).
    fronted = [
        _ask("CONNECT allowed, SNI forbidden", "connect", target=f"{ok}:443", sni=bad),
        _ask("SOCKS5 allowed, SNI forbidden", "socks", atyp="domain", host=ok, port=443, sni=bad),
        _ask("GET allowed, Host forbidden+allowed", "http", url=url, host_headers=[bad, ok]),
        _ask("CONNECT allowed:80, HTTP for forbidden", "connect", target=f"{ok}:80", inner=inner),
        _ask("SOCKS5 allowed:80, HTTP for forbidden", "socks", atyp="domain", host=ok, inner=inner),
        _ask("CONNECT allowed:80, CRLF+HTTP", "connect", target=f"{ok}:80", inner="\r\n" + inner),
        _ask("CONNECT allowed:80, pipelined", "connect", target=f"{ok}:80", inner=pipelined),
    ]
    with ctx.oracle.expecting(allowed_addrs) as seen:
        base = _proxy_answers(box, baseline, ctx.oracle.nonce)
        time.sleep(0.6)  # the listener reads each hello until the client pauses
        reached = b"\n".join(h.data for h in seen)
        n_base = len(seen)
        res = _proxy_answers(box, refused + fronted, ctx.oracle.nonce)
        time.sleep(0.6)
    failed = [k for k, a in base.items() if not a.startswith(("HTTP 200", "SOCKS 0"))]
    if failed or reached.count(ok.encode()) < len(baseline):
        return Verdict(
            "ERROR",
            evidence=f"baseline to {ok} failed, so refusals prove nothing: {summary(base)}; "
            f"its listener received {reached[:200]!r}",
        )
    v = blocked(f"baseline reached {ok} {len(baseline)} ways; {summary(res, 4)}")
    for a in refused:
        if not _refused(res[a["key"]]):
            v.add_break("NET", f"{a['key']} -> {res[a['key']][:50]}")
    fronts = {
        "a TLS hello for " + bad if h.data[:1] == b"\x16" else repr(h.data[:70])
        for h in seen[n_base:]
        if bad.encode() in h.data
    }
    for what in sorted(fronts):
        v.add_break("NET", f"{ok}'s listener received {what}")
    return v


# ------------------------------------------------------------------------- D. neighbours, secrets


def _plant(ctx: Ctx, port: int) -> tuple[Box, str]:
    a = ctx.box(tenant="battery-a")
    probe = a.probe("interfaces")  # uploads probes.py
    if "interfaces" not in probe:
        raise ProbeFailed(str(probe)[:300])
    arg = json.dumps({"nonce": ctx.oracle.nonce, "port": port})
    cmd_id = a.start(f"python3 /tmp/.abx-probe-{a.id}.py plant '{arg}'")
    text = a.wait_output(cmd_id, '"planted"')
    if '"planted"' not in text:
        raise ProbeFailed(f"plant did not start: {text[-300:]}")
    return a, cmd_id


def _plant_host_pid(ctx: Ctx, box: Box) -> int:
    for pid in ctx.sandbox_pids(box):
        try:
            if b" plant " in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "):
                return pid
        except OSError:
            pass
    return -1


def _cross(ctx: Ctx, want: Callable[[dict[str, Any]], list[str]], kind: str) -> Verdict:
    # Below the ephemeral range (32768-60999): with the network shared (the control), a client
    # connection of the battery's own may hold any port in it.
    port = 20000 + int(ctx.oracle.nonce[:4], 16) % 10000
    a, cmd_id = _plant(ctx, port)
    b = ctx.box(tenant="battery-b")
    res = results_of(
        b.probe("find", nonce=ctx.oracle.nonce, port=port, pid=_plant_host_pid(ctx, a))
    )
    time.sleep(0.3)
    hits = [line for line in a.output_so_far(cmd_id).splitlines() if '"hit"' in line]
    v = verdict_from(want(res), kind, res)
    for h in hits:
        v.add_break("NET" if "SIGUSR1" not in h else "ESCAPE", f"sandbox A saw {h[:80]}")
    return v


@check(
    "cross-files",
    "cross-sandbox",
    "files another tenant's sandbox left in /tmp, /dev/shm, workspace",
    ["unsandboxed"],
)
def _cross_files(ctx: Ctx) -> Verdict:
    return _cross(
        ctx,
        lambda r: [
            k
            for k, v in r.items()
            if (k.startswith("ls") and v and isinstance(v, list)) or str(v).startswith("DATA:")
        ],
        "READ",
    )


@check(
    "cross-ipc",
    "cross-sandbox",
    "SysV shared memory, message queues, semaphores of another sandbox",
    ["share-ipc"],
)
def _cross_ipc(ctx: Ctx) -> Verdict:
    return _cross(
        ctx, lambda r: [k for k in ("shmget", "msgget", "semget") if r.get(k) == "FOUND"], "READ"
    )


@check(
    "cross-network",
    "cross-sandbox",
    "another sandbox's TCP listener and abstract socket",
    ["share-net", "no-landlock"],
)
def _cross_net(ctx: Ctx) -> Verdict:
    return _cross(ctx, lambda r: [k for k, v in r.items() if v == "CONNECTED"], "NET")


@check(
    "cross-signals",
    "cross-sandbox",
    "signal another sandbox's process",
    ["share-pid", "host-root", "no-landlock"],
)
def _cross_signal(ctx: Ctx) -> Verdict:
    return _cross(ctx, lambda r: ["kill=OK"] if r.get("kill") == "OK" else [], "ESCAPE")


SECRET_PATTERNS = [r"abx_[A-Za-z0-9_]{8,}", r"ABX-CANARY-[A-Z]+-[0-9a-f]{32}", r"AKIA[0-9A-Z]{16}"]


@check(
    "secrets-visible",
    "secrets",
    "server environment, API keys and admin key invisible",
    ["unsandboxed", "host-root"],
)
def _secrets(ctx: Ctx) -> Verdict:
    ctx.server.key("battery-b")  # a second tenant's key exists
    ctx.oracle.extra_secrets.update(
        {
            "admin key": ctx.server.admin_key,
            **{f"API key of {t}": k for t, k in ctx.server.keys.items()},
        }
    )
    out = ctx.box().probe("scan_secrets", patterns=SECRET_PATTERNS, timeout=120)
    if "matches" not in out:
        raise ProbeFailed(str(out)[:300])
    v = blocked(f"{len(out['matches'])} credential-shaped strings, none real")
    for s, where in out["matches"].items():
        for name in ctx.oracle.leaks(s):
            v.add_break("READ", f"{name} found in {where[0]}")
    return v


@check(
    "persistence-flock",
    "persistence",
    "no process survives kill (a daemon's flock is released)",
    ["share-pid", "no-cgroup-kill"],
)
def _persistence(ctx: Ctx) -> Verdict:
    box = ctx.box()
    out = box.probe("daemon", path="/workspace/.abx-lock", nonce=ctx.oracle.nonce)
    lock = ctx.host_workspace(box) / ".abx-lock"
    try:
        st = os.stat(lock)
    except OSError as e:
        return Verdict("ERROR", evidence=f"lock file not visible from the host: {e}")
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"

    def held() -> bool:
        return any(key in line for line in Path("/proc/locks").read_text().splitlines())

    where = "lock released"
    if not held():
        # A kernel of the sandbox's own (gVisor's) keeps its locks: the host's list never
        # shows them. The daemon must be alive in there, and after kill no host process of
        # the sandbox (the kernel holding it) may be left.
        pid = int(out.get("daemon_pid") or 0)
        probe = f"kill -0 {pid} && {{ flock -n /workspace/.abx-lock true; echo held=$?; }}"
        if not pid or "held=1" not in box.run(probe).stdout:
            return Verdict("ERROR", evidence=f"the daemon's lock never showed up ({out})")
        where = "the lock held inside the sandbox's own kernel, gone with it"
    r = box.kill()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (held() or ctx.sandbox_pids(box)):
        time.sleep(0.05)
    v = blocked(f"kill -> HTTP {r.status_code}; {where}, no process left")
    if held():
        v.add_break("ESCAPE", "the daemon still holds its flock 5 s after kill")
    left = ctx.sandbox_pids(box)
    if left:
        v.add_break("ESCAPE", f"processes left in the sandbox cgroup: {left[:5]}")
    return v


@check(
    "persistence-host-leftovers",
    "persistence",
    "after kill the host holds nothing of the sandbox (inventory diff)",
    ["share-pid", "no-cgroup-kill"],
)
def _leftovers(ctx: Ctx) -> Verdict:
    before = inventory.take(ctx.server.data_dir)
    box = ctx.box()
    box.probe("daemon", path="/workspace/.abx-lock2", nonce=ctx.oracle.nonce)
    box.start("(setsid nohup sleep 300 >/dev/null 2>&1 &) ; sleep 300 &")
    box.put("/workspace/data.bin", b"x" * 100_000)
    time.sleep(0.3)
    r = box.kill()
    deadline = time.monotonic() + 5
    leaks = inventory.leaks(before, inventory.take(ctx.server.data_dir))
    while leaks and time.monotonic() < deadline:
        time.sleep(0.1)
        leaks = inventory.leaks(before, inventory.take(ctx.server.data_dir))
    v = blocked(f"kill -> HTTP {r.status_code}; host inventory unchanged")
    for item in leaks[:5]:
        v.add_break("ESCAPE", item[:150])
    return v


# ------------------------------------------------------------------------- E. exhaustion

R = BATTERY_RESOURCES


@check(
    "res-fork-bomb",
    "exhaustion",
    "fork bomb stops at pids.max; server and sandbox stay usable",
    ["no-limits"],
)
def _res_fork(ctx: Ctx) -> Verdict:
    # Memory enough for pids processes on every tier (a process costs gVisor's kernel about
    # 4.5 MiB of the sandbox's memory): the pids limit is what this check tries.
    box = ctx.box(resources={"memory_mb": 512})
    out = box.probe("fork", limit=3 * R["pids"])
    if "forked" not in out:
        raise ProbeFailed(str(out)[:300])
    v = blocked(f"forked {out['forked']}, stopped by {out['stopped_by']}")
    if out["forked"] >= R["pids"]:
        v.add_break("DOS", f"forked {out['forked']} processes with pids={R['pids']}")
    if box.run("echo alive").stdout != "alive\n" or not ctx.server.alive():
        v.add_break("DOS", "sandbox or server unusable after the bomb")
    return v


@check(
    "res-memory-bomb", "exhaustion", "memory bomb is OOM-killed at the memory limit", ["no-limits"]
)
def _res_memory(ctx: Ctx) -> Verdict:
    box = ctx.box()
    out = box.probe("memory", mb=3 * R["memory_mb"])
    got = out.get("allocated_mb")
    last = re.findall(r'"progress_mb": (\d+)', out.get("_raw", ""))
    v = blocked(f"stopped after {last[-1] if last else 0} MiB (exit {out.get('_exit')})")
    if got is not None and got >= 2 * R["memory_mb"]:
        v.add_break("DOS", f"allocated {got} MiB with memory_mb={R['memory_mb']}")
    return v


@check("res-tmpfs-fill", "exhaustion", "/tmp and /dev/shm stop at their size", ["no-limits"])
def _res_tmpfs(ctx: Ctx) -> Verdict:
    box = ctx.box()
    v = blocked("")
    for path in ("/tmp/abx-fill", "/dev/shm/abx-fill"):
        out = box.probe("fill", path=path, mb=3 * R["tmp_mb"])
        if "written_mb" not in out:
            raise ProbeFailed(str(out)[:300])
        v.evidence += f"{path}: {out['written_mb']} MiB, {out['stopped_by']}; "
        if out["written_mb"] >= 2 * R["tmp_mb"]:
            v.add_break("DOS", f"{path}: wrote {out['written_mb']} MiB with tmp_mb={R['tmp_mb']}")
    return v


@check("res-disk-fill", "exhaustion", "the workspace stops at its disk limit", ["no-limits"])
def _res_disk(ctx: Ctx) -> Verdict:
    out = ctx.box().probe("fill", path="/workspace/abx-fill", mb=3 * R["disk_mb"])
    if "written_mb" not in out:
        raise ProbeFailed(str(out)[:300])
    v = blocked(f"wrote {out['written_mb']} MiB, stopped by {out['stopped_by']}")
    if out["written_mb"] >= 2 * R["disk_mb"]:
        v.add_break("DOS", f"wrote {out['written_mb']} MiB with disk_mb={R['disk_mb']}")
    return v


@check("res-fd-exhaustion", "exhaustion", "open files stop at nofile", ["no-limits"])
def _res_fds(ctx: Ctx) -> Verdict:
    out = ctx.box().probe("fds_exhaust", limit=4 * R["nofile"])
    if "opened" not in out:
        raise ProbeFailed(str(out)[:300])
    v = blocked(f"opened {out['opened']}, stopped by {out['stopped_by']}")
    if out["opened"] >= R["nofile"]:
        v.add_break("DOS", f"opened {out['opened']} fds with nofile={R['nofile']}")
    return v


@check(
    "res-per-user-kernel-limits",
    "exhaustion",
    "inotify exhaustion in one sandbox leaves another unaffected",
    ["same-uid"],
)
def _res_inotify(ctx: Ctx) -> Verdict:
    a = ctx.box()
    a.probe("interfaces")
    cmd_id = a.start(
        f'python3 /tmp/.abx-probe-{a.id}.py inotify \'{{"limit": 100000, "hold": 8}}\''
    )
    text = a.wait_output(cmd_id, '"inotify"')
    b = ctx.box(tenant="battery-b")
    out = b.probe("inotify", limit=1, hold=0)
    v = blocked(f"A: {text.strip()[:80]}; B created {out.get('inotify')}")
    if out.get("inotify") != 1:
        v.add_break("DOS", f"sandbox B cannot create an inotify instance ({out.get('stopped_by')})")
    return v


@check("res-cpu-spin", "exhaustion", "CPU spin stays within cpu_count", ["no-limits"])
def _res_cpu(ctx: Ctx) -> Verdict:
    if (os.cpu_count() or 1) < 2:
        return na("needs at least 2 CPUs to tell a limit from the machine")
    # A quarter of a CPU: an unlimited spinner gets more than that even on a busy 2-CPU host
    # (beside CI's other tests it got 0.39 CPUs; its group weighs the same however many
    # threads spin in it).
    limit = 0.25
    box = ctx.box(resources={"cpu_count": limit})
    box.run("true")
    before, t0 = ctx.cpu_seconds(box), time.monotonic()
    out = box.probe("cpu", workers=4, seconds=2.0)
    if "cpu_s" not in out:
        raise ProbeFailed(str(out)[:300])
    after, t1 = ctx.cpu_seconds(box), time.monotonic()
    # The host's count when there is a cpuacct group (a kernel of the sandbox's own, gVisor's,
    # counts its own way): the cgroup's CPU time over the host's time between the two
    # readings (the probe's start and the request included in both), else what the sandbox
    # counted over the spin.
    if before is not None and after is not None:
        used, seen = (after - before) / (t1 - t0), "host cgroup"
    else:
        used, seen = out["cpu_s"] / out["wall_s"], "sandbox"
    v = blocked(f"{used:.2f} CPUs used with cpu_count={limit} ({seen})")
    if used > limit * 1.25:
        v.add_break("DOS", f"{used:.2f} CPUs used with cpu_count={limit}")
    return v


# ------------------------------------------------------------------------- F. files API attacks

FILE_API_CONTROL = ["bind-host", "unconfined-paths", "no-landlock"]


def _api_requests(ctx: Ctx, box: Box, paths: list[str], raw: tuple[str, ...] = ()) -> Verdict:
    """GET and PUT each path through the HTTP files API; judge bodies and status codes."""
    v = blocked("")
    codes: dict[int, int] = {}
    o = ctx.oracle

    def judge(label: str, r: httpx.Response) -> None:
        codes[r.status_code] = codes.get(r.status_code, 0) + 1
        if r.status_code >= 500:
            v.add_break("DOS", f"{label} -> HTTP {r.status_code}")
        for name in o.leaks(r.text):
            v.add_break("READ", f"{label} leaked the {name}")

    base = f"/v1/sandboxes/{box.id}/files"
    for p in paths:
        judge(f"GET {p!r}", box.get(p, timeout=10))
        target = p.rsplit("/", 1)[0] + f"/abx-{o.nonce}-put" if "/" in p else p
        judge(f"PUT {target!r}", box.put(target, b"PWNED"))
    for q in raw:  # already percent-encoded by hand: the server must decode exactly once
        judge(f"GET ?path={q}", box.client.get(f"{base}?path={q}", timeout=10))
        judge(
            f"PUT ?path={q}",
            box.client.put(f"{base}?path={q}-abx-{o.nonce}", content=b"PWNED", timeout=10),
        )
    v.evidence = v.evidence or f"HTTP codes {dict(sorted(codes.items()))}"
    return v


@check(
    "api-traversal",
    "files-api",
    "traversal in every encoding, backslashes, NUL bytes",
    FILE_API_CONTROL,
    bind_canary=True,
)
def _api_traversal(ctx: Ctx) -> Verdict:
    c = str(ctx.oracle.canary_file)
    d = c.lstrip("/")
    paths = [
        f"../../../../{d}",
        f"/workspace/../../{d}",
        f"/workspace/./../{d}",
        f"....//....//{d}",
        f"..\\..\\{d.replace('/', chr(92))}",
        f"\uff0e\uff0e/\uff0e\uff0e/{d}",
        f"/workspace/x\x00/../../{d}",
        f"{c}\x00.txt",
    ]
    raw = [
        f"..%2f..%2f..%2f{d}",
        f"%2e%2e/%2e%2e/%2e%2e/{d}",
        f"%252e%252e%252f{d}",
        f"..%c0%af..%c0%af{d}",
    ]
    return _api_requests(ctx, ctx.box(), paths, tuple(raw))


@check(
    "api-absolute-paths",
    "files-api",
    "absolute host paths through the files API",
    FILE_API_CONTROL,
    bind_canary=True,
)
def _api_absolute(ctx: Ctx) -> Verdict:
    o = ctx.oracle
    paths = [
        str(o.canary_file),
        f"{o.drop_dir}/abx-{o.nonce}-abs",
        "/proc/1/root" + str(o.canary_file),
        "/proc/self/cwd/../../" + str(o.canary_file).lstrip("/"),
    ]
    return _api_requests(ctx, ctx.box(), paths)


@check(
    "api-symlinks",
    "files-api",
    "symlinked parents and finals, symlink loops",
    FILE_API_CONTROL,
    bind_canary=True,
)
def _api_symlinks(ctx: Ctx) -> Verdict:
    o = ctx.oracle
    box = ctx.box()
    setup = box.run(
        f"ln -s {o.canary_dir} dirlink && ln -s {o.canary_file} filelink"
        f" && ln -s {o.drop_dir} droplink && ln -s loop1 loop2 && ln -s loop2 loop1"
        " && ln -s . self && mkdir real && ln -s ../dirlink real/up"
    )
    if setup.exit_code != 0:
        return Verdict("ERROR", evidence=f"setup failed: {setup.text[:200]}")
    paths = [
        "dirlink/secret.txt",
        "filelink",
        "droplink/x",
        "real/up/secret.txt",
        "loop1/x",
        "self/" * 40 + "filelink",
    ]
    t0 = time.monotonic()
    v = _api_requests(ctx, box, paths)
    if time.monotonic() - t0 > 30:
        v.add_break("DOS", "symlink requests took over 30 s")
    return v


@check(
    "api-swap-race",
    "files-api",
    "directory/symlink swap race during uploads and downloads",
    FILE_API_CONTROL,
    bind_canary=True,
)
def _api_race(ctx: Ctx) -> Verdict:
    o = ctx.oracle
    box = ctx.box()
    swapper = (
        "import os,time\n"
        "os.makedirs('r/dir0', exist_ok=True)\n"
        "open('r/dir0/secret.txt','w').write('decoy')\n"
        f"os.symlink({str(o.canary_dir)!r}, 'r/lnk0')\n"
        "end, n = time.monotonic()+12, 0\n"
        "while time.monotonic()<end:\n"
        "    for src in ('r/dir0', 'r/lnk0'):\n"
        "        try:\n"
        "            os.rename(src, 'r/d'); os.rename('r/d', src)\n"
        "        except OSError:\n"
        "            n += 1  # an upload made r/d a real directory: move it aside\n"
        "            try: os.rename('r/d', f'r/junk{n}')\n"
        "            except OSError: pass\n"
    )
    r = box.put("/workspace/swap.py", swapper.encode())
    if r.status_code >= 300:
        return Verdict("ERROR", evidence=f"upload failed: {r.status_code}")
    box.start("python3 /workspace/swap.py")
    time.sleep(0.3)
    codes: dict[int, int] = {}
    v = blocked("")
    stop = time.monotonic() + 8

    def hammer(i: int) -> None:
        n = 0
        while time.monotonic() < stop:
            n += 1
            g = box.get("r/d/secret.txt", timeout=10)
            p = box.put(f"r/d/abx-{o.nonce}-{i}-{n}", b"PWNED")
            for resp in (g, p):
                codes[resp.status_code] = codes.get(resp.status_code, 0) + 1
                if resp.status_code >= 500:
                    v.add_break("DOS", f"HTTP {resp.status_code}")
            for name in o.leaks(g.text):
                v.add_break("READ", f"download through the swapped link leaked the {name}")

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    v.evidence = (
        v.evidence or f"{sum(codes.values())} requests, codes {dict(sorted(codes.items()))}"
    )
    return v


@check(
    "api-special-files",
    "files-api",
    "FIFOs, /dev/zero, proc files and oversized downloads stay bounded",
    FILE_API_CONTROL,
    bind_canary=True,
)
def _api_special(ctx: Ctx) -> Verdict:
    box = ctx.box()
    box.run("mkfifo /workspace/fifo && truncate -s 200M /workspace/huge && echo grow > growing")
    # A writer that never writes: a download that opens the FIFO and reads would hang.
    box.start("python3 -c \"import os,time; fd=os.open('fifo', os.O_RDWR); time.sleep(60)\"")
    box.start("python3 -c \"import time; f=open('growing','a')\nwhile True: f.write('x'*65536)\"")
    time.sleep(0.3)
    v = blocked("")
    notes = []
    paths = ["/workspace/fifo", "/dev/zero", "/dev/urandom", "/proc/self/mem", "/proc/kmsg"]
    for p in [*paths, "/workspace/huge", "/workspace/growing"]:
        t0 = time.monotonic()
        got = 0
        status = 0
        try:
            with box.client.stream(
                "GET", f"/v1/sandboxes/{box.id}/files", params={"path": p}, timeout=10
            ) as r:
                status = r.status_code
                for chunk in r.iter_bytes():
                    got += len(chunk)
                    if got > 256 * 1024 * 1024:
                        break
        except httpx.TimeoutException:
            v.add_break("DOS", f"{p}: no answer within 10 s")
            continue
        except httpx.HTTPError as e:
            v.add_break("DOS", f"{p}: broken response ({type(e).__name__})")
            continue
        notes.append(f"{p}: {status} {got >> 20} MiB {time.monotonic() - t0:.1f}s")
        if status >= 500:
            v.add_break("DOS", f"{p} -> HTTP {status}")
        if p in paths and status == 200:
            v.add_break("DOS", f"{p}: served a non-regular file ({got >> 20} MiB)")
    if not ctx.server.alive() or box.run("echo ok").stdout != "ok\n":
        v.add_break("DOS", "server or sandbox unusable afterwards")
    v.evidence = v.evidence or "; ".join(notes)
    return v


# The check families in modules of their own register themselves on import.
from agentbox.battery import (  # noqa: E402
    checks_budget,  # noqa: F401
    checks_hostinfo,  # noqa: F401
    checks_lifecycle,  # noqa: F401
    checks_quota,  # noqa: F401
    checks_secrets,  # noqa: F401
    checks_server,  # noqa: F401
)
