"""What agentbox could leave behind on the host for one data dir, and how two snapshots differ.

`take(data_dir)` records everything of the host that the process runtime creates for the
sandboxes of the server using `data_dir`, read straight from the kernel and the filesystem (not
from agentbox's own records, which are what is being checked):

- processes: bwrap and helper processes (mkfs, mount, ...) whose argv names the data dir's
  sandbox trees or its bind root `/run/agentbox/<digest>`; processes in a cgroup below
  `agentbox*/<digest>`; and every process running as a uid of the sandbox range that no *other*
  agentbox data dir's cgroup accounts for (a sandbox process that left its cgroup can only be
  recognised by its uid);
- mounts at or below the data dir and the bind root (`/proc/self/mountinfo`);
- cgroup directories `agentbox/<digest>` and below, in every mounted hierarchy (v1 controllers,
  the hybrid `unified` tree, or a pure v2 root);
- loop devices whose backing file lies below the data dir or the bind root;
- network namespaces (other than the host's) held by those processes;
- entries of `<data>/sandboxes`, `<data>/kept-workspaces` and the bind root (plus the bind root
  itself).

`diff(before, after)` lists what appeared ("leaked ...") and what disappeared ("removed ...") as
human-readable lines; an empty list means the host is as it was. Standard library only and no
test framework: the escape battery and the benchmarks use it too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentbox.runtimes.process.cgroups import CGROUP_ROOT, GROUP
from agentbox.runtimes.process.runtime import RUN_ROOT, UID_RANGE

CATEGORIES = ("processes", "mounts", "cgroups", "loop_devices", "netns", "entries")
_LABELS = {
    "mounts": "mount",
    "cgroups": "cgroup",
    "loop_devices": "loop device",
    "netns": "network namespace",
    "entries": "entry",
}
_SANDBOX_ID = re.compile(r"sbx_[0-9A-Za-z]+")
# A cgroup path naming some data dir's scope: .../agentbox[-suffix]/<12 hex digest>[/...]
_SCOPE = re.compile(r"/" + re.escape(GROUP) + r"[^/]*/([0-9a-f]{12})(?:/|$)")


def digest_of(data_dir: Path) -> str:
    """The id the process runtime gives a data dir (its cgroup scope and bind-root name)."""
    return hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:12]


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


def _unescape(s: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def _processes(
    digest: str, needles: list[str], host_netns: set[str], run_root: Path
) -> tuple[list[ProcessInfo], list[str]]:
    procs: list[ProcessInfo] = []
    me = os.getpid()
    # Every process's parent and the data dir (digest) its cgroup or argv names, if any: a
    # sandbox-uid process outside every scope's cgroup is told apart by its ancestors.
    family: dict[int, tuple[int, str | None]] = {}
    bind_re = re.compile(re.escape(str(run_root)) + r"/([0-9a-f]{12})/")
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
                inside = [u for u in uids if UID_RANGE[0] <= u < UID_RANGE[1]]
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
            m = _SCOPE.search(path)
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
        in_range = UID_RANGE[0] <= uid < UID_RANGE[1]
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
        mnt = _unescape(fields[4])
        if not _under(mnt, roots):
            continue
        try:
            sep = fields.index("-")
            fstype, source = fields[sep + 1], _unescape(fields[sep + 2])
        except (ValueError, IndexError):
            fstype, source = "?", "?"
        out.append(f"{mnt} ({fstype} from {source})")
    return sorted(out)


def _cgroup_dirs(digest: str, root: Path) -> list[str]:
    bases = [root / GROUP / digest]
    try:
        bases += [root / c / GROUP / digest for c in sorted(os.listdir(root))]
    except OSError:
        pass
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


def _entries(data_dir: Path, bind_root: Path) -> list[str]:
    out = []
    if bind_root.exists():
        out.append(f"{bind_root}/")
    for base in (data_dir / "sandboxes", data_dir / "kept-workspaces", bind_root):
        try:
            out += [str(base / n) for n in sorted(os.listdir(base))]
        except OSError:
            pass
    return sorted(set(out))


def take(
    data_dir: Path,
    *,
    run_root: Path = RUN_ROOT,
    cgroup_root: Path = CGROUP_ROOT,
    mountinfo: str = "/proc/self/mountinfo",
) -> Inventory:
    """Snapshot what the host holds for the agentbox server using `data_dir`."""
    data_dir = Path(data_dir).resolve()
    digest = digest_of(data_dir)
    bind_root = run_root / digest
    roots = [str(data_dir), str(bind_root)]
    needles = [f"{data_dir}/sandboxes/", f"{data_dir}/kept-workspaces/", f"{bind_root}/"]
    host_netns: set[str] = set()
    for holder in ("/proc/1/ns/net", "/proc/self/ns/net"):
        try:
            host_netns.add(os.readlink(holder))
        except OSError:
            pass
    procs, netns = _processes(digest, needles, host_netns, run_root)
    return Inventory(
        data_dir=str(data_dir),
        bind_root=str(bind_root),
        digest=digest,
        taken_at=time.time(),
        processes=procs,
        mounts=_mounts(roots, mountinfo),
        cgroups=_cgroup_dirs(digest, cgroup_root),
        loop_devices=_loop_devices(roots),
        netns=netns,
        entries=_entries(data_dir, bind_root),
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
