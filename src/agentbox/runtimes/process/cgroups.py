"""Per-sandbox cgroups on v1 (one directory per controller) and v2 (one unified directory).

Every sandbox gets `agentbox/<scope>/<sandbox_id>` under each controller it uses. The server (root)
creates it, writes the limits, and the sandbox's first process joins it before it execs bwrap,
so nothing the sandbox ever forks is outside. Killing a sandbox kills what is left in the group
and removes the directories: nothing stays behind untracked.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
GROUP = "agentbox"
# cpuacct: the CPU a sandbox used (metrics); no limit of its own.
_V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer")


@dataclass(frozen=True)
class CgroupLimits:
    memory_bytes: int
    pids: int
    cpu_count: float  # CPU time per wall second, in CPUs


class CgroupError(RuntimeError):
    pass


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_kv(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            key, _, val = line.partition(" ")
            if val.strip().lstrip("-").isdigit():
                out[key] = int(val)
    except OSError:
        pass
    return out


class Cgroups:
    """The agentbox part of the host's cgroup tree, whichever version the host runs."""

    def __init__(self, scope: str, root: Path = CGROUP_ROOT, group: str = GROUP) -> None:
        """`scope` names this server's subtree (`<group>/<scope>/<sandbox_id>`): servers with
        different data dirs on one host must never see each other's sandboxes as strays, nor
        runtimes sharing a data dir each other's (each has its own `group`)."""
        self.root = root
        self.group = group
        self.v2 = (root / "cgroup.controllers").exists()
        if self.v2:
            self.base = {"unified": root / group / scope}
        else:
            self.base = {
                c: root / c / group / scope for c in _V1_CONTROLLERS if (root / c).is_dir()
            }
        self.available = bool(self.base) and os.geteuid() == 0
        if self.available:
            self._prepare()

    def _prepare(self) -> None:
        for ctrl, base in self.base.items():
            base.mkdir(parents=True, exist_ok=True)
            if self.v2:
                # Controllers must be enabled on every level above the sandbox groups.
                wanted = {"memory", "pids", "cpu"}
                have = set((self.root / "cgroup.controllers").read_text().split())
                enable = " ".join(f"+{c}" for c in sorted(wanted & have))
                for level in (self.root, base.parent, base):
                    try:
                        _write(level / "cgroup.subtree_control", enable)
                    except OSError:
                        pass
            elif ctrl == "memory":
                # v1 hierarchies ignore parent limits unless hierarchy accounting is on.
                for level in (base.parent, base):
                    try:
                        _write(level / "memory.use_hierarchy", "1")
                    except OSError:
                        pass

    def paths(self, sandbox_id: str) -> list[Path]:
        return [base / sandbox_id for base in self.base.values()]

    def create(self, sandbox_id: str, limits: CgroupLimits) -> list[Path]:
        if not self.available:
            return []
        made = []
        try:
            for ctrl, base in self.base.items():
                path = base / sandbox_id
                path.mkdir(exist_ok=True)
                made.append(path)
                self._limit(ctrl, path, limits)
        except OSError as e:
            for path in made:
                self._rmdir(path)
            raise CgroupError(f"cannot set up cgroup for {sandbox_id}: {e}") from e
        return made

    def _limit(self, ctrl: str, path: Path, lim: CgroupLimits) -> None:
        period = 100_000
        quota = max(1000, int(lim.cpu_count * period))
        if self.v2:
            _write(path / "memory.max", str(lim.memory_bytes))
            if (path / "memory.swap.max").exists():
                _write(path / "memory.swap.max", "0")
            _write(path / "pids.max", str(lim.pids))
            _write(path / "cpu.max", f"{quota} {period}")
        elif ctrl == "memory":
            _write(path / "memory.limit_in_bytes", str(lim.memory_bytes))
            if (path / "memory.memsw.limit_in_bytes").exists():
                # Without this a sandbox could push its memory out to swap past its limit.
                _write(path / "memory.memsw.limit_in_bytes", str(lim.memory_bytes))
        elif ctrl == "pids":
            _write(path / "pids.max", str(lim.pids))
        elif ctrl == "cpu":
            _write(path / "cpu.cfs_period_us", str(period))
            _write(path / "cpu.cfs_quota_us", str(quota))

    def join_files(self, sandbox_id: str) -> list[str]:
        """The cgroup.procs files a new process writes its pid into to join the sandbox."""
        if not self.available:
            return []
        return [str(p / "cgroup.procs") for p in self.paths(sandbox_id)]

    def pids(self, sandbox_id: str) -> set[int]:
        found: set[int] = set()
        for path in self.paths(sandbox_id):
            try:
                found.update(int(x) for x in (path / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return found

    def counters(self, sandbox_id: str) -> dict[str, int]:
        """Limit-hit counters used to explain why a command died (OOM kill, pids limit)."""
        out = {"oom_kill": 0, "pids_max": 0}
        if not self.available:
            return out
        if self.v2:
            path = self.base["unified"] / sandbox_id
            out["oom_kill"] = _read_kv(path / "memory.events").get("oom_kill", 0)
            out["pids_max"] = _read_kv(path / "pids.events").get("max", 0)
        else:
            if "memory" in self.base:
                oc = _read_kv(self.base["memory"] / sandbox_id / "memory.oom_control")
                out["oom_kill"] = oc.get("oom_kill", 0)
            if "pids" in self.base:
                out["pids_max"] = _read_kv(self.base["pids"] / sandbox_id / "pids.events").get(
                    "max", 0
                )
        return out

    def cpu_seconds(self, sandbox_id: str) -> float | None:
        """CPU time every process of the sandbox has used, in seconds."""
        try:
            if self.v2:
                stat = _read_kv(self.base["unified"] / sandbox_id / "cpu.stat")
                return stat["usage_usec"] / 1e6 if "usage_usec" in stat else None
            for key in ("cpuacct", "cpu"):  # co-mounted as cpu,cpuacct on many hosts
                usage = self.base.get(key)
                if usage is not None and (usage / sandbox_id / "cpuacct.usage").exists():
                    return int((usage / sandbox_id / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError, KeyError):
            return None
        return None

    def memory_usage(self, sandbox_id: str) -> int | None:
        name = "memory.current" if self.v2 else "memory.usage_in_bytes"
        key = "unified" if self.v2 else "memory"
        if key not in self.base:
            return None
        try:
            return int((self.base[key] / sandbox_id / name).read_text())
        except (OSError, ValueError):
            return None

    def kill_all(self, sandbox_id: str, timeout: float = 5.0) -> bool:
        """SIGKILL every process in the sandbox's groups; True once they are all gone."""
        if not self.available:
            return True
        if self.v2:
            kill_file = self.base["unified"] / sandbox_id / "cgroup.kill"
            if kill_file.exists():
                try:
                    _write(kill_file, "1")
                except OSError:
                    pass
        freezer = self.base.get("freezer")
        frozen = False
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids(sandbox_id)
            if not pids:
                break
            if freezer is not None and not frozen and (freezer / sandbox_id).is_dir():
                # Freeze first so a fork loop cannot outrun the kill loop.
                try:
                    _write(freezer / sandbox_id / "freezer.state", "FROZEN")
                    frozen = True
                except OSError:
                    pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if frozen and freezer is not None:
                try:
                    _write(freezer / sandbox_id / "freezer.state", "THAWED")
                    frozen = False
                except OSError:
                    pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    @property
    def can_freeze(self) -> bool:
        """Whether a sandbox's processes can be frozen (v1's freezer, v2's cgroup.freeze)."""
        return self.available and (self.v2 or "freezer" in self.base)

    def freeze(self, sandbox_id: str, timeout: float = 5.0) -> None:
        """Freeze every process of the sandbox (memory kept, no CPU), new ones it forks
        meanwhile included; raises CgroupError (and thaws) if they are not all frozen within
        `timeout`."""
        self._set_frozen(sandbox_id, True, timeout)

    def thaw(self, sandbox_id: str, timeout: float = 5.0) -> None:
        self._set_frozen(sandbox_id, False, timeout)

    def is_frozen(self, sandbox_id: str) -> bool:
        """Whether the sandbox's processes are frozen (or being frozen) now."""
        if not self.can_freeze:
            return False
        try:
            if self.v2:
                group = self.base["unified"] / sandbox_id
                return (group / "cgroup.freeze").read_text().strip() == "1"
            state = (self.base["freezer"] / sandbox_id / "freezer.state").read_text().strip()
        except OSError:
            return False
        return state != "THAWED"

    def _set_frozen(self, sandbox_id: str, frozen: bool, timeout: float) -> None:
        if not self.can_freeze:
            raise CgroupError("this host has no cgroup freezer")
        if self.v2:
            group = self.base["unified"] / sandbox_id
            control, value = group / "cgroup.freeze", "1" if frozen else "0"
            done = lambda: f"frozen {value}" in (group / "cgroup.events").read_text()  # noqa: E731
        else:
            control = self.base["freezer"] / sandbox_id / "freezer.state"
            value = "FROZEN" if frozen else "THAWED"
            done = lambda: control.read_text().strip() == value  # noqa: E731
        deadline = time.monotonic() + timeout
        try:
            _write(control, value)
            while not done():
                if time.monotonic() > deadline:
                    verb = "freeze" if frozen else "thaw"
                    raise CgroupError(f"sandbox {sandbox_id} did not {verb} within {timeout:g} s")
                time.sleep(0.001)
                _write(control, value)  # v1 may stay FREEZING until asked again
        except OSError as e:
            verb = "freeze" if frozen else "thaw"
            raise CgroupError(f"cannot {verb} sandbox {sandbox_id}: {e}") from None
        except CgroupError:
            if frozen:
                try:
                    _write(control, "0" if self.v2 else "THAWED")
                except OSError:
                    pass
            raise

    def remove(self, sandbox_id: str) -> bool:
        ok = True
        for path in self.paths(sandbox_id):
            ok = self._rmdir(path) and ok
        return ok

    @staticmethod
    def _rmdir(path: Path) -> bool:
        for _ in range(100):
            try:
                path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError:
                time.sleep(0.01)  # the last processes are still being torn down
        return False

    def _everywhere(self) -> list[Path]:
        """This scope's group in every mounted hierarchy, not only the controllers it limits
        with (an OCI runtime joins a sandbox to all of them)."""
        if self.v2:
            return list(self.base.values())
        try:
            hierarchies = [h for h in self.root.iterdir() if h.is_dir() and not h.is_symlink()]
        except OSError:
            return list(self.base.values())
        scope = next(iter(self.base.values())).name if self.base else None
        if scope is None:
            return []
        return [h / self.group / scope for h in sorted(hierarchies)]

    def sweep(self, sandbox_id: str) -> bool:
        """Remove the sandbox's groups in every hierarchy; False if one would not go."""
        ok = True
        for base in self._everywhere():
            ok = self._rmdir(base / sandbox_id) and ok
        return ok

    def remove_scope(self) -> None:
        """Remove this server's (empty) scope groups, in every hierarchy."""
        for base in {*self.base.values(), *self._everywhere()}:
            try:
                base.rmdir()
            except OSError:
                pass

    def list_ids(self, everywhere: bool = False) -> set[str]:
        """Sandboxes with a group here: in the controllers it limits with, or (`everywhere`) in
        any mounted hierarchy."""
        ids: set[str] = set()
        for base in self._everywhere() if everywhere else self.base.values():
            try:
                ids.update(p.name for p in base.iterdir() if p.is_dir())
            except OSError:
                pass
        return ids
