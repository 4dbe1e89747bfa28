"""What agentbox could leave behind on the host for one data dir, and how two snapshots differ.

`take(data_dir)` records everything of the host that a runtime creates for the sandboxes of the
server using `data_dir`, read straight from the kernel and the filesystem (not from agentbox's
own records, which are what is being checked). Where to look is each installed runtime's
`HostFootprint` (runtimes/base.py: its directories, roots, cgroup scope and uid range); this
module knows the kinds of things a Linux host holds, not any runtime's layout:

- processes: helper processes (bwrap, mkfs, mount, ...) whose argv names a directory of the
  footprint or a path below its roots; processes in a cgroup below `<group>*/<scope>` for any
  of its cgroup groups; and every process running as a uid of the sandbox range that no *other*
  data dir's cgroup accounts for (a sandbox process that left its cgroup can only be
  recognised by its uid);
- mounts at or below the footprint's roots (`/proc/self/mountinfo`);
- cgroup directories `<group>/<scope>` and below, for each of its groups, in every mounted
  hierarchy (v1 controllers, the hybrid `unified` tree, or a pure v2 root);
- loop devices whose backing file lies below the roots;
- network namespaces (other than the host's) held by those processes;
- entries of the footprint's directories (and those directories themselves, but for the data
  dir's own), and the uid leases of the data dir's runtimes.

`diff(before, after)` lists what appeared ("leaked ...") and what disappeared ("removed ...") as
human-readable lines; an empty list means the host is as it was. Standard library only and no
test framework: the escape battery and the benchmarks use it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agentbox import runtimes
from agentbox.runtimes.base import HostFootprint
from agentbox.runtimes.diskimage import unescape_mountinfo
from agentbox.runtimes.uids import UidLeases

CGROUP_ROOT = Path("/sys/fs/cgroup")

CATEGORIES = ("processes", "mounts", "cgroups", "loop_devices", "netns", "entries")
_LABELS = {
    "mounts": "mount",
    "cgroups": "cgroup",
    "loop_devices": "loop device",
    "netns": "network namespace",
    "entries": "entry",
}
_SANDBOX_ID = re.compile(r"sbx_[0-9A-Za-z]+")
T = TypeVar("T")


def footprint(data_dir: Path) -> HostFootprint:
    """Where the installed runtimes leave things for `data_dir`'s sandboxes, as one footprint:
    their paths, cgroup groups and lease owners together (each runtime has its own corner of
    the host; the data dir's scope and the uid range are the same for all)."""
    found = [
        fp
        for name in runtimes.available()
        if (fp := footprint_of(name, Path(data_dir))) != HostFootprint()
    ]
    if len(found) > 1:
        return dataclasses.replace(
            found[0],
            dirs=_union(fp.dirs for fp in found),
            roots=_union(fp.roots for fp in found),
            cgroup_groups=_union(fp.cgroup_groups for fp in found),
            lease_owners=_union(fp.lease_owners for fp in found),
        )
    return found[0] if found else HostFootprint()


def _union(parts: Iterable[tuple[T, ...]]) -> tuple[T, ...]:
    return tuple(dict.fromkeys(x for part in parts for x in part))


def footprint_of(name: str, data_dir: Path) -> HostFootprint:
    """Where the one runtime `name` leaves things for `data_dir`'s sandboxes."""
    hook = getattr(runtimes.factory(name), "host_footprint", None)
    return hook(data_dir) if hook is not None else HostFootprint()


def digest_of(data_dir: Path) -> str:
    """The scope the runtimes give a data dir (its cgroup scope, bind-root and lease owner);
    "" when no installed runtime leaves anything on the host."""
    return footprint(data_dir).scope or ""


def _scope_re(groups: tuple[str, ...]) -> re.Pattern[str]:
    """A cgroup path naming some data dir's scope: .../<group>[-suffix]/<12 hex digest>[/...],
    for this footprint's groups and every agentbox tier's (another tier's sandbox is not ours
    to report)."""
    names = "|".join(re.escape(g) for g in ("agentbox", *groups))
    return re.compile(r"/(?:" + names + r")[^/]*/([0-9a-f]{12})(?:/|$)")


@dataclass
class ProcessInfo:
    pid: int
    start: int  # clock ticks since boot: with the pid, identifies the process
    ppid: int
    uid: int
    state: str
    comm: str
    cmdline: str
    cgroup: str  # the first cgroup path that names an agentbox scope, else the pids/unified one
    sandbox: str | None  # the sandbox it belongs to, when its cgroup or argv says
    netns: str
    why: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.pid}@{self.start}"

    def describe(self) -> str:
        sbx = f" sandbox={self.sandbox}" if self.sandbox else ""
        return (
            f"pid {self.pid} uid {self.uid} state {self.state} comm {self.comm!r}{sbx} "
            f"cgroup {self.cgroup} [{', '.join(self.why)}] argv {self.cmdline!r}"
        )


@dataclass
class Inventory:
    data_dir: str
    bind_root: str
    digest: str
    taken_at: float
    processes: list[ProcessInfo] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    loop_devices: list[str] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    entries: list[str] = field(default_factory=list)

    # -------------------------------------------------------------- views

    def items(self) -> dict[str, list[str]]:
        """Every recorded item as a comparable string, per category."""
        return {
            "processes": sorted(p.key for p in self.processes),
            "mounts": sorted(self.mounts),
            "cgroups": sorted(self.cgroups),
            "loop_devices": sorted(self.loop_devices),
            "netns": sorted(self.netns),
            "entries": sorted(self.entries),
        }

    def is_empty(self) -> bool:
        return not any(self.items().values())

    def about(self, sandbox_id: str) -> list[str]:
        """Every item that belongs to one sandbox (its processes, mounts, groups, files)."""
        out = [
            f"process: {p.describe()}"
            for p in self.processes
            if p.sandbox == sandbox_id or sandbox_id in p.cmdline
        ]
        for cat in ("mounts", "cgroups", "loop_devices", "netns", "entries"):
            out += [f"{cat}: {x}" for x in getattr(self, cat) if sandbox_id in x]
        return out

    def sandbox_ids(self) -> set[str]:
        """Sandboxes that have anything at all on the host."""
        found: set[str] = set()
        for p in self.processes:
            if p.sandbox:
                found.add(p.sandbox)
        for cat in ("mounts", "cgroups", "loop_devices", "netns", "entries"):
            for x in getattr(self, cat):
                found.update(_SANDBOX_ID.findall(x))
        return found

    def summary(self) -> str:
        return ", ".join(f"{len(v)} {k}" for k, v in self.items().items())

    # -------------------------------------------------------------- JSON

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Inventory:
        d = dict(d)
        d["processes"] = [ProcessInfo(**p) for p in d.get("processes", [])]
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> Inventory:
        return cls.from_dict(json.loads(text))


# ------------------------------------------------------------------ readers


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def _processes(
    fp: HostFootprint, needles: list[str], host_netns: set[str]
) -> tuple[list[ProcessInfo], list[str]]:
    procs: list[ProcessInfo] = []
    me = os.getpid()
    digest = fp.scope or ""
    uid_lo, uid_hi = fp.uid_range or (0, 0)
    scope_re = _scope_re(fp.cgroup_groups)
    # Every process's parent and the data dir (digest) its cgroup or argv names, if any: a
    # sandbox-uid process outside every scope's cgroup is told apart by its ancestors. A root
    # named after the scope (a per-data-dir tree such as /run/agentbox/<digest>) names the
    # owner of any process whose argv has a path below a sibling of it.
    family: dict[int, tuple[int, str | None]] = {}
    parents = sorted({str(r.parent) for r in fp.roots if r.name.split("-")[0] == digest})
    bind_re = re.compile(
        "(?:" + "|".join(re.escape(p) for p in parents) + r")/([0-9a-f]{12})(?:-[a-z]+)?/"
        if parents
        else r"(?!)"
    )
    unattributed: list[ProcessInfo] = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        stat = _read(f"/proc/{pid}/stat")
        status = _read(f"/proc/{pid}/status")
        if stat is None or status is None:
            continue  # gone meanwhile
        try:
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            rest = stat[stat.rindex(")") + 2 :].split()
            state, ppid, start = rest[0], int(rest[1]), int(rest[19])
        except (ValueError, IndexError):
            continue
        if state in ("Z", "X") and ppid == 1:
            # An orphan zombie: the kernel has freed everything but its pid, and init reaps
            # it on its own schedule (about a second on some VM inits). Not a leak.
            continue
        uid = -1
        for line in status.splitlines():
            if line.startswith("Uid:"):
                uids = [int(x) for x in line.split()[1:]]
                inside = [u for u in uids if uid_lo <= u < uid_hi]
                uid = inside[0] if inside else uids[0]
                break
        raw = _read(f"/proc/{pid}/cmdline") or ""
        cmdline = " ".join(x for x in raw.split("\0") if x)
        cgroups = _read(f"/proc/{pid}/cgroup") or ""
        why: list[str] = []
        chosen = ""
        other_scope = False
        sandbox: str | None = None
        owner: str | None = None
        for line in cgroups.splitlines():
            path = line.split(":", 2)[-1]
            m = scope_re.search(path)
            if m is None:
                continue
            owner = owner or m.group(1)
            if m.group(1) == digest:
                if "cgroup" not in why:
                    why.append("cgroup")
                chosen = chosen or path
                ids = _SANDBOX_ID.findall(path)
                sandbox = sandbox or (ids[0] if ids else None)
            else:
                other_scope = True
                chosen = chosen or path
        if owner is None:
            m = bind_re.search(cmdline)
            owner = m.group(1) if m else None
        family[pid] = (ppid, owner)
        if any(n in cmdline for n in needles):
            why.append("argv")
            if sandbox is None:
                ids = _SANDBOX_ID.findall(cmdline)
                sandbox = ids[0] if ids else None
        in_range = uid_lo <= uid < uid_hi
        if in_range and not other_scope:
            why.append("sandbox-uid")
        if not why:
            continue
        if not chosen:
            for line in cgroups.splitlines():
                parts = line.split(":", 2)
                if len(parts) == 3 and (parts[1] in ("pids", "") or "pids" in parts[1]):
                    chosen = parts[2]
                    break
        netns = ""
        try:
            netns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            pass
        info = ProcessInfo(
            pid=pid,
            start=start,
            ppid=ppid,
            uid=uid,
            state=state,
            comm=comm,
            cmdline=cmdline[:300],
            cgroup=chosen,
            sandbox=sandbox,
            netns=netns,
            why=why,
        )
        if why == ["sandbox-uid"]:
            unattributed.append(info)
        else:
            procs.append(info)
    for info in unattributed:
        # Outside every agentbox cgroup: another data dir's if an ancestor says so (a sandbox
        # of a server run without cgroups); else ours to report (it may have escaped ours).
        pid, seen = info.ppid, 0
        owner = None
        while pid > 1 and seen < 64 and owner is None:
            pid, owner = family.get(pid, (0, None))
            seen += 1
        if owner is None or owner == digest:
            procs.append(info)
    procs.sort(key=lambda p: p.pid)
    holders: dict[str, set[str]] = {}
    for p in procs:
        if p.netns and p.netns not in host_netns and p.state not in ("Z", "X"):
            holders.setdefault(p.netns, set()).add(p.sandbox or "?")
    held = [f"{ns} held by {','.join(sorted(who))}" for ns, who in sorted(holders.items())]
    return procs, held


def _mounts(roots: list[str], mountinfo: str) -> list[str]:
    out = []
    text = _read(mountinfo) or ""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        mnt = unescape_mountinfo(fields[4])
        if not _under(mnt, roots):
            continue
        try:
            sep = fields.index("-")
            fstype, source = fields[sep + 1], unescape_mountinfo(fields[sep + 2])
        except (ValueError, IndexError):
            fstype, source = "?", "?"
        out.append(f"{mnt} ({fstype} from {source})")
    return sorted(out)


def _cgroup_dirs(fp: HostFootprint, root: Path) -> list[str]:
    if not fp.cgroup_groups or fp.scope is None:
        return []
    digest = fp.scope
    try:
        hierarchies = sorted(os.listdir(root))
    except OSError:
        hierarchies = []
    bases = []
    for group in fp.cgroup_groups:
        bases += [root / group / digest, *(root / c / group / digest for c in hierarchies)]
    out: set[str] = set()
    for base in bases:
        if not base.is_dir():
            continue
        # cpu,cpuacct and friends are often one hierarchy under several names: resolve.
        for d, subdirs, _ in os.walk(base):
            out.add(os.path.realpath(d))
            subdirs.sort()
    return sorted(out)


def _loop_devices(roots: list[str]) -> list[str]:
    out: list[str] = []
    try:
        names = sorted(os.listdir("/sys/block"))
    except OSError:
        return out
    for name in names:
        if not name.startswith("loop"):
            continue
        backing = _read(f"/sys/block/{name}/loop/backing_file")
        if backing is None:
            continue
        backing = backing.strip()
        path = backing.removesuffix(" (deleted)")
        if _under(path, roots):
            out.append(f"/dev/{name} -> {backing}")
    return out


def _entries(data_dir: Path, fp: HostFootprint) -> list[str]:
    out = []
    for base in fp.dirs:
        # A per-data-dir tree outside the data dir is itself something left behind.
        if base.exists() and not base.is_relative_to(data_dir):
            out.append(f"{base}/")
        try:
            out += [str(base / n) for n in sorted(os.listdir(base))]
        except OSError:
            pass
    if fp.uid_leases is not None:
        for owner in fp.lease_owners:
            held = UidLeases(owner, fp.uid_leases).held()
            out += [f"uid lease {uid} -> {sid}" for uid, sid in sorted(held.items())]
    return sorted(set(out))


def take(
    data_dir: Path,
    *,
    at: HostFootprint | None = None,
    cgroup_root: Path = CGROUP_ROOT,
    mountinfo: str = "/proc/self/mountinfo",
) -> Inventory:
    """Snapshot what the host holds for the agentbox server using `data_dir` (looking where
    `at` says, by default where the installed runtimes say they leave things)."""
    data_dir = Path(data_dir).resolve()
    fp = at or footprint(data_dir)
    roots = [str(r) for r in fp.roots]
    needles = [f"{d}/" for d in fp.dirs]
    host_netns: set[str] = set()
    for holder in ("/proc/1/ns/net", "/proc/self/ns/net"):
        try:
            host_netns.add(os.readlink(holder))
        except OSError:
            pass
    procs, netns = _processes(fp, needles, host_netns)
    outside = [r for r in fp.roots if not r.is_relative_to(data_dir)]
    return Inventory(
        data_dir=str(data_dir),
        bind_root=str(outside[0]) if outside else "",
        digest=fp.scope or "",
        taken_at=time.time(),
        processes=procs,
        mounts=_mounts(roots, mountinfo),
        cgroups=_cgroup_dirs(fp, cgroup_root),
        loop_devices=_loop_devices(roots),
        netns=netns,
        entries=_entries(data_dir, fp),
    )


def diff(before: Inventory, after: Inventory) -> list[str]:
    """What appeared ("leaked ...") and disappeared ("removed ...") between two snapshots."""
    out: list[str] = []
    procs_before = {p.key: p for p in before.processes}
    procs_after = {p.key: p for p in after.processes}
    for key in sorted(procs_after.keys() - procs_before.keys()):
        out.append(f"leaked process: {procs_after[key].describe()}")
    for key in sorted(procs_before.keys() - procs_after.keys()):
        out.append(f"removed process: {procs_before[key].describe()}")
    for cat in CATEGORIES[1:]:
        b, a = Counter(getattr(before, cat)), Counter(getattr(after, cat))
        label = _LABELS[cat]
        for item in sorted((a - b).elements()):
            out.append(f"leaked {label}: {item}")
        for item in sorted((b - a).elements()):
            out.append(f"removed {label}: {item}")
    return out


def leaks(before: Inventory, after: Inventory) -> list[str]:
    """Only what appeared: the part of `diff` that is a leak."""
    return [line for line in diff(before, after) if line.startswith("leaked ")]


def sweep_bind_roots(data_dir: Path) -> None:
    """Unmount and remove what the runtimes keep for `data_dir` outside it (its bind roots
    under /run/agentbox, its cgroup groups once empty), once no server will use the data dir
    again: the host keeps no scaffolding of data dirs that no longer exist."""
    from agentbox.runtimes.process import hostview

    data = data_dir.resolve()
    fp = footprint(data_dir)
    for group in reversed(_cgroup_dirs(fp, CGROUP_ROOT)):  # deepest first
        with contextlib.suppress(OSError):
            os.rmdir(group)
    for root in fp.roots:
        if root.is_relative_to(data) or not root.is_dir():
            continue
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
        for point in sorted((p for p in points if Path(p).is_relative_to(root)), reverse=True):
            with contextlib.suppress(OSError):
                hostview.detach(Path(point))
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m agentbox.battery.inventory DATA_DIR [BEFORE.json]`: print a snapshot as
    JSON, or, given an earlier snapshot, the differences (exit 1 if any)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(main.__doc__, file=sys.stderr)
        return 2
    now = take(Path(args[0]))
    if len(args) == 1:
        print(now.to_json(indent=2))
        return 0
    changes = diff(Inventory.from_json(Path(args[1]).read_text()), now)
    for line in changes:
        print(line)
    return 1 if changes else 0


if __name__ == "__main__":
    raise SystemExit(main())
