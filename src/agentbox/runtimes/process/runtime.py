"""The `process` runtime: each sandbox is a bubblewrap process tree on this host.

Layers, outermost first: a block of 65,536 host uids of its own, onto which its user namespace
(made by the server: userns.py) maps its 0-65535, so its root and `user` are host ids that own
nothing else; a cgroup with memory/pids/CPU limits joined before exec, rlimits, a new session,
every namespace unshared (user, pid, mount, net, ipc, uts, cgroup) with only loopback inside; on
the `host` template a minimal read-only view of the host userland (an allow-listed /etc, no
/usr/local, /proc files with the sandbox's own figures: hostview.py), on a built one the
template copy-on-write (rootfs.py); a writable /workspace on its own size-limited filesystem and
a size-limited tmpfs /tmp; the sandbox's root holding only userns.ROOT_CAPS, `user` none; no
new user namespaces, a seccomp filter, and Landlock (applied by the agent on itself before it
serves).

The sandbox does not depend on the server process: bwrap is started without --die-with-parent
and its agent listens on a socket inherited from the server whose path stays valid, so a
restarted server finds and re-adopts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import resource
import select
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from agentbox.runtimes import diskimage
from agentbox.runtimes.base import (
    E2B_HOME,
    ISOLATION_RANKS,
    AgentAddress,
    Ceiling,
    DiskSource,
    HostFootprint,
    KeptWorkspace,
    Resources,
    Runtime,
    RuntimeError_,
    RuntimeFeatures,
    RuntimeRefused,
    SandboxSpec,
    home_mount_point,
)
from agentbox.runtimes.process import (
    hold,
    hostview,
    mountns,
    rootfs,
    startctx,
    userns,
    workspace,
)
from agentbox.runtimes.process.cgroups import GROUP, CgroupError, CgroupLimits, Cgroups
from agentbox.runtimes.process.netns import NamespaceSockets, NetnsError
from agentbox.runtimes.process.seccomp import build_filter
from agentbox.runtimes.process.zygote import LISTEN_FD, Zygote, ZygoteError
from agentbox.runtimes.uids import BLOCK, LEASES, UID_RANGE, NoFreeUid, UidLeases

RUN_ROOT = Path("/run/agentbox")
TEMPLATE_BINDS = "templates"  # below the bind root: template trees a sandbox uid can resolve
AGENT_SRC = Path(__file__).resolve().parent.parent.parent / "agent"
AGENT_FILES = (
    "main.py",
    "sandbox_agent.py",
    "protocol.py",
    "code_bridge.py",
    "code_host.py",
    "js_repl.js",
    "login_path.sh",
    "users.py",
    "relay.py",
    "confine.py",
    "zygote.py",
)
SUDO_SRC = "sudo.py"  # installed as bin/sudo
AGENT_MOUNT = "/.agentbox"
VOLUME_PREFIX = "vol"  # bind_dir/vol<n>: the sandbox's idmapped mount of its n-th volume
AGENT_BIN = f"{AGENT_MOUNT}/bin"  # the `sudo` that asks the agent (see agent/sudo.py)
SANDBOX_PYTHON = "/usr/bin/python3"
SOCKET_NAME = "agent.sock"
STATE_FILE = "runtime.json"
NPROC_SLACK = 16  # RLIMIT_NPROC is the sandbox's pids plus this (see _spawn)
CAP_SYS_RESOURCE = 24

# What of the host a sandbox sees, read-only: /usr (but not /usr/local, unless the operator
# lists it) and a generated /etc (hostview.py). Deliberately not /home, /root, /opt, /srv, /mnt,
# /var or /run: user data, credentials and the server's own data live there.
MERGED_USR_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
USR_LOCAL = "/usr/local"
SANDBOX_PATH = f"/usr/local/sbin:/usr/local/bin:{AGENT_BIN}:/usr/sbin:/usr/bin:/sbin:/bin"
_T = TypeVar("_T")
_PIPE_PAYLOAD_MAX = 16384  # well below a pipe's buffer: the write must not block


def _data_fd(data: bytes) -> int:
    """A readable fd holding `data`: a pipe for small payloads, else an unlinked file."""
    if len(data) > _PIPE_PAYLOAD_MAX:
        return _data_file_fd(data)
    r, w = os.pipe()
    os.write(w, data)
    os.close(w)
    return r


def _data_file_fd(data: bytes) -> int:
    """A readable fd holding `data` of any size (an unlinked temporary file, at offset 0)."""
    fd = os.open("/tmp", os.O_TMPFILE | os.O_RDWR, 0o600)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _can_raise_rlimits() -> bool:
    """Whether this process may raise hard rlimits (CAP_SYS_RESOURCE in its effective set)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    except (OSError, ValueError):
        pass
    return False


def proc_start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a live, non-zombie process; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def kill_if_same(pid: Any, start: Any) -> None:
    """SIGKILL `pid` if it is still the process that started at `start` (not a reused pid)."""
    if isinstance(pid, int) and start is not None and proc_start_time(pid) == start:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass(frozen=True)
class HostLayout:
    """Where one runtime keeps the sandboxes of one data dir on the host. Each runtime over a
    data dir has its own (its `host_namespace`): several can serve one data dir side by side
    and none ever lists, adopts, unmounts or removes another's sandboxes or shared trees."""

    sandboxes: Path  # per sandbox: its dir (image, state, log), private to root
    kept: Path  # the workspaces kept after their sandbox ended
    kept_mounts: Path  # read-only mounts of kept workspaces while someone reads them
    bind_root: Path  # the root-owned, traverse-only tree sandboxes bind from (see __init__)
    cgroup_group: str  # cgroups are <controller>/<group>/<scope>/<sandbox id>
    scope: str  # the data dir's name on the host (its digest)
    lease_owner: str  # the owner of its uid leases (uids.py)

    @classmethod
    def of(cls, data_dir: Path, namespace: str = "") -> HostLayout:
        data_dir = Path(data_dir).resolve()
        digest = _digest(data_dir)
        sfx = f"-{namespace}" if namespace else ""
        return cls(
            sandboxes=data_dir / f"sandboxes{sfx}",
            kept=data_dir / f"kept-workspaces{sfx}",
            kept_mounts=data_dir / f"kept-mounts{sfx}",
            bind_root=RUN_ROOT / f"{digest}{sfx}",
            cgroup_group=f"{GROUP}{sfx}",
            scope=digest,
            lease_owner=f"{digest}{sfx}",
        )


class ProcessRuntime(Runtime):
    name: ClassVar[str] = "process"
    # The runtime's own corner of the host for a data dir (HostLayout): "" for this one, the
    # tier's name for the runtimes built on it.
    host_namespace: ClassVar[str] = ""
    # Whether its agent may be forked from the zygote (AGENTBOX_AGENT_START=fork): the runtimes
    # built on this one start theirs otherwise (their own entry, a weakened sandbox's flags).
    forks_agents: ClassVar[bool] = True

    def __init__(
        self,
        data_dir: Path,
        use_loop: bool | None = None,
        host_paths: Iterable[str] = (),
        clean_mount_ns: bool | None = None,
    ) -> None:
        """`host_paths`: host paths the operator lets sandboxes of the host userland see
        read-only (`agentbox serve --host-path`): below /etc copied into the generated /etc,
        elsewhere bound at the same place (/usr/local shows only when listed).
        `clean_mount_ns`: start sandboxes from a mount namespace without the other
        sandboxes' mounts where the host allows (mountns.py); False starts them from the
        server's. Default: yes, unless the environment has AGENTBOX_CLEAN_MOUNT_NS=0."""
        self._require_tools()
        agent_start = os.environ.get("AGENTBOX_AGENT_START", "fork")
        if agent_start not in ("exec", "fork"):
            raise RuntimeError_(f"AGENTBOX_AGENT_START={agent_start!r}: it is exec or fork")
        if not Path(SANDBOX_PYTHON).exists():
            raise RuntimeError_(f"{SANDBOX_PYTHON} is missing: apt-get install python3")
        self.layout = HostLayout.of(data_dir, self.host_namespace)
        self.root = self.layout.sandboxes
        self.kept_root = self.layout.kept
        self.kept_mounts = self.layout.kept_mounts
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(data_dir, 0o700)
        os.chmod(self.root, 0o700)
        self.is_root = os.geteuid() == 0
        try:
            self.host_paths = hostview.check_host_paths(host_paths, data_dir)
        except hostview.HostPathError as e:
            raise RuntimeError_(str(e)) from None
        # bwrap already runs as the sandbox's uid when it resolves its bind sources, and the
        # data dir is private to root (and may sit below other private dirs). So what bwrap
        # binds lives in a root-owned, traverse-only tree of its own, one per data dir.
        if self.is_root:
            self.bind_root = self.layout.bind_root
            for d in (RUN_ROOT, self.bind_root):
                d.mkdir(mode=0o711, exist_ok=True)
                os.chmod(d, 0o711)
        else:
            self.bind_root = self.root
        # What every sandbox shares, each tree on a tmpfs of its own (see hostview.py).
        self.own_mounts = self._mounts_shared_trees()
        self.template_lock = threading.Lock()
        self._drop_template_binds()  # a previous server's
        self.agent_dir = self._install_agent(self._shared_tree("agent", 16, executable=True))
        self.etc_dir = self._etc_tree()
        self.proc_view = hostview.ProcView.of_host()
        self.cpus = sorted(os.sched_getaffinity(0))
        self.cpus_of: dict[str, list[int]] = {}
        self.cpu_lock = threading.Lock()  # create runs in worker threads: one pick at a time
        self.cgroups = Cgroups(scope=self.layout.scope, group=self.layout.cgroup_group)
        if use_loop is None:
            use_loop = (
                self.is_root
                and shutil.which("mkfs.ext4") is not None
                and Path("/dev/loop-control").exists()
            )
        self.use_loop = use_loop
        if use_loop:
            # Not on every destroy: it reads every loop device's backing file (O(live sandboxes)).
            diskimage.detach_orphan_loops(self.root)
        self._drop_kept_mounts()
        self.seccomp = build_filter()
        self.children: dict[str, subprocess.Popen] = {}
        self.uids = UidLeases(owner=self.layout.lease_owner)
        self.netns = NamespaceSockets()
        # Sandboxes start from a mount namespace without the other sandboxes' mounts.
        if clean_mount_ns is None:
            clean_mount_ns = os.environ.get("AGENTBOX_CLEAN_MOUNT_NS", "1") != "0"
        self.clean_ns = (
            mountns.CleanNamespace.try_make(mountns.agentbox_mount(RUN_ROOT), self.agent_dir)
            if clean_mount_ns and self._starts_clean()
            else None
        )
        # The start context in one exec where it builds (startctx.py), else the programs.
        self.startctx = startctx.build(Path(data_dir) / "cache") if self.is_root else None
        self.zygote: Zygote | None = None
        if self._agent_start(agent_start) == "fork":
            zygote = Zygote(self.agent_dir)
            try:
                zygote.start()  # its imports are paid now, not by the first create
                self.zygote = zygote
            except ZygoteError as e:
                logging.getLogger(__name__).warning("agent start: exec, not fork (%s)", e)

    def _agent_start(self, wanted: str) -> str:
        """How the agent starts: `fork` (from the zygote, docs/design/agent-zygote.md; the
        default), which only this runtime, as root, on x86_64 gives, or `exec` (bwrap runs
        it: AGENTBOX_AGENT_START=exec, and everywhere else, said in the log; also when the
        zygote does not start)."""
        if wanted == "exec":
            return "exec"
        why = None
        if not type(self).forks_agents:
            why = f"the {self.name} runtime starts its agent its own way"
        elif not self.is_root:
            why = "the server does not run as root"
        elif hold.code() is None:
            why = f"no hold program for {os.uname().machine}"
        if why is not None:
            logging.getLogger(__name__).info("agent start: exec, not fork (%s)", why)
            return "exec"
        return "fork"

    # ------------------------------------------------------------------ setup

    def _require_tools(self) -> None:
        """Refuse to start without what this runtime runs sandboxes with."""
        why = self.unavailable()
        if why is not None:
            raise RuntimeError_(why)

    @classmethod
    def unavailable(cls) -> str | None:
        if shutil.which("bwrap") is None:
            return "bubblewrap (bwrap) is not installed: apt-get install bubblewrap"
        return startctx.missing()

    def _starts_clean(self) -> bool:
        """Whether sandboxes may start from a clean mount namespace (root only: the
        sandboxes' mounts are the server's own)."""
        return self.is_root and self.bind_root != self.root

    def _mounts_shared_trees(self) -> bool:
        """Whether the trees every sandbox shares get tmpfs mounts of their own (root only)."""
        return self.is_root

    def _etc_tree(self) -> Path | None:
        """The /etc sandboxes of the host userland see; None binds the host's own."""
        return self._build_etc()

    def _shared_tree(self, name: str, size_mb: int, executable: bool = False) -> Path:
        """A directory every sandbox binds read-only; as root a fresh tmpfs, whose root shows
        in a sandbox's mountinfo as "/" where a plain directory would show its host path."""
        path = self.bind_root / name
        if self.own_mounts:
            hostview.fresh_tmpfs(path, size_mb, executable)
        return path

    def _build_etc(self) -> Path:
        if self.own_mounts:
            path = self._shared_tree("etc", 64)
            hostview.build_etc(path, self.host_paths)
            return path
        # No mounts without root: build aside and swap, live sandboxes keeping the old tree.
        path, new, old = (self.bind_root / n for n in ("etc", "etc.new", "etc.old"))
        for d in (new, old):
            shutil.rmtree(d, ignore_errors=True)
        new.mkdir(mode=0o755)
        hostview.build_etc(new, self.host_paths)
        if path.exists():
            path.rename(old)
        new.rename(path)
        return path

    @staticmethod
    def _install_agent(dest: Path) -> Path:
        """Copy the agent where every sandbox uid can read it, precompiled for a fast start."""
        import py_compile

        dest.mkdir(exist_ok=True)
        os.chmod(dest, 0o755)
        for name in AGENT_FILES:
            target = dest / name
            _install_file(AGENT_SRC / name, target, 0o644)
            if name.endswith(".py") and name != "main.py":
                try:
                    py_compile.compile(
                        str(target),
                        doraise=True,
                        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
                    )
                except (py_compile.PyCompileError, OSError):
                    pass
        _install_file(AGENT_SRC / SUDO_SRC, dest / "bin" / "sudo", 0o755)
        program = hold.code()
        if program is not None:
            tmp = dest / f".{hold.NAME}.tmp"
            tmp.write_bytes(program)
            os.chmod(tmp, 0o555)
            tmp.replace(dest / hold.NAME)
        cache = dest / "__pycache__"
        if cache.is_dir():
            os.chmod(cache, 0o755)
            for f in cache.iterdir():
                os.chmod(f, 0o644)
        return dest

    def capabilities(self) -> dict[str, Any]:
        return {
            "runtime": self.name,
            "cgroups": ("v2" if self.cgroups.v2 else "v1") if self.cgroups.available else None,
            "disk_limit": self.use_loop,
            "seccomp": True,
            "per_sandbox_uid": self.is_root,
            # A paused sandbox's memory: frozen in RAM (the cgroup freezer), None: no pause.
            "pause_memory": "ram" if self.cgroups.can_freeze else None,
            # A pause without memory (keep_memory false): only the disk kept.
            "pause_without_memory": self.use_loop,
            "agent_start": "fork" if self.zygote is not None else "exec",
        }

    def features(self) -> RuntimeFeatures:
        enforced = {"nofile", "file_size_mb", "tmp_mb"}
        if self.cgroups.available:
            enforced |= {"cpu_count", "memory_mb", "pids"}
        if self.use_loop:
            enforced.add("disk_mb")
        return RuntimeFeatures(
            enforces=frozenset(enforced),
            network=True,
            kept_workspaces=True,
            own_uids=self.is_root,
            isolation=ISOLATION_RANKS.get(self.name, 0),
            pause=self.cgroups.can_freeze,
            snapshot=self.use_loop and self.cgroups.can_freeze,
            park=self.use_loop,
            volumes=self._own_userns() and rootfs.supported(),
        )

    @classmethod
    def host_footprint(cls, data_dir: Path) -> HostFootprint:
        data_dir = Path(data_dir).resolve()
        at = HostLayout.of(data_dir, cls.host_namespace)
        return HostFootprint(
            dirs=(at.sandboxes, at.kept, at.bind_root),
            roots=(data_dir, at.bind_root),
            cgroup_groups=(at.cgroup_group,),
            scope=at.scope,
            uid_range=UID_RANGE,
            uid_leases=LEASES,
            lease_owners=(at.lease_owner,),
        )

    def resource_ceilings(self) -> dict[str, Ceiling]:
        """The rlimits `_spawn` sets cannot go above the server's own hard limits, unless it may
        raise them (CAP_SYS_RESOURCE); asking more must be a refusal, not a failed spawn."""
        if _can_raise_rlimits():
            nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
            reason = f"the host's per-process descriptor ceiling (fs.nr_open) {nr_open}"
            return {"nofile": Ceiling(nr_open, "host.fs.nr_open", reason)}
        out: dict[str, Ceiling] = {}
        _, nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
        if nofile != resource.RLIM_INFINITY:
            out["nofile"] = Ceiling(
                nofile,
                "server.rlimit_nofile",
                f"the server's hard descriptor limit (RLIMIT_NOFILE) {nofile}; start the "
                "server with a higher one (ulimit -Hn, systemd LimitNOFILE=)",
            )
        _, fsize = resource.getrlimit(resource.RLIMIT_FSIZE)
        if fsize != resource.RLIM_INFINITY:
            out["file_size_mb"] = Ceiling(
                fsize // 2**20,
                "server.rlimit_fsize",
                f"the server's hard file size limit (RLIMIT_FSIZE) {fsize // 2**20} MiB",
            )
        _, nproc = resource.getrlimit(resource.RLIMIT_NPROC)
        if self.is_root and nproc != resource.RLIM_INFINITY:
            out["pids"] = Ceiling(
                nproc - NPROC_SLACK,
                "server.rlimit_nproc",
                f"the server's hard process limit (RLIMIT_NPROC) {nproc} less {NPROC_SLACK}; "
                "start the server with a higher one (ulimit -Hu, systemd LimitNPROC=)",
            )
        return out

    # ------------------------------------------------------------------ create

    def _allocate_uid(self, sandbox_id: str) -> int:
        if not self.is_root:
            return os.geteuid()
        try:
            return self.uids.take(sandbox_id)
        except NoFreeUid as e:
            raise RuntimeError_(str(e)) from None

    def _bwrap_argv(self, spec: SandboxSpec, ws: Path, fds: dict[str, int]) -> list[str]:
        r = spec.resources
        argv = ["bwrap", *self._namespace_args(spec, fds), "--hostname", "sandbox"]
        argv.append("--new-session")
        if spec.rootfs and self._writable_root(spec):
            # The template copy-on-write (rootfs.py), mounted by the server.
            argv += ["--bind", str(self.bind_root / spec.sandbox_id / rootfs.ROOT), "/"]
        elif spec.rootfs:
            # A template: its whole tree read-only, then the sandbox's own mounts on top
            # (by fd, opened by the server, on a path bwrap can resolve: see
            # _reachable_template).
            argv += ["--ro-bind-fd", str(fds["rootfs"]), "/"]
        else:
            # bwrap makes a mount point's missing parents 0700: /opt is made first, 0755.
            argv += self._host_userland_args()
            argv += ["--dir", "/opt", "--perms", "0700", "--dir", "/root"]
        small_mb = min(r.tmp_mb, 64)
        argv += [*self._proc_mount_args(), *self._proc_args(fds), "--dev", "/dev"]
        argv += self._tmpfs_args("/tmp", r.tmp_mb) + self._tmpfs_args("/dev/shm", small_mb)
        argv += ["--dir", "/run", "--dir", "/var"]
        if spec.rootfs and any(path.startswith("/run/") for path in spec.files):
            # A template's /run is part of its read-only tree; files placed below it (the CA
            # bundle) need a tmpfs to land on, as /run is on a booted system.
            argv += self._tmpfs_args("/run", 1, 0o755)
        if spec.rootfs and not Path(spec.rootfs, "var/tmp").is_symlink():
            argv += self._tmpfs_args("/var/tmp", small_mb)
        else:
            argv += ["--symlink", "/tmp", "/var/tmp"]
        argv += ["--bind", str(ws), "/workspace"]
        if self._home_mount(spec):
            # The workspace at E2B's home too (a root bwrap makes gets /home first, 0755).
            argv += [*([] if spec.rootfs else ["--dir", "/home"]), "--bind", str(ws), E2B_HOME]
        argv += [
            # Volumes before the agent's tree: nothing can be mounted over it.
            *self._volume_args(spec),
            "--ro-bind",
            str(self.agent_dir),
            AGENT_MOUNT,
        ]
        if "passwd" in fds:  # a template's /etc, or the host's own
            argv += ["--perms", "0444", "--ro-bind-data", str(fds["passwd"]), "/etc/passwd"]
            argv += ["--perms", "0444", "--ro-bind-data", str(fds["group"]), "/etc/group"]
        argv += ["--chdir", spec.workdir, "--clearenv"]
        for k, v in sandbox_env(spec).items():
            argv += ["--setenv", k, v]
        for path in spec.files:
            argv += ["--perms", "0444", "--ro-bind-data", str(fds[f"file:{path}"]), path]
        argv += [*self._extra_binds(), *self._seccomp_args(fds)]
        argv += ["--info-fd", str(fds["info"]), "--"]
        if self.zygote is not None:  # the agent is forked in once the sandbox is set up
            return [*argv, f"{AGENT_MOUNT}/{hold.NAME}"]
        return argv + self._agent_argv(AGENT_MOUNT, spec, fds)

    def _namespace_args(self, spec: SandboxSpec, fds: dict[str, int]) -> list[str]:
        """Every namespace unshared, no nested user namespaces. As root: the sandbox's own
        user namespace (made by the server, mapping its 0-65535 onto its uid block, see
        userns.py), joined as its root holding only `ROOT_CAPS`. Without root: a namespace
        bwrap makes, mapping the one uid the server runs as to `user`, no capabilities."""
        if "userns" not in fds:
            uid = "0" if spec.user == "root" else "1000"
            argv = ["--unshare-all", "--unshare-user", "--disable-userns"]
            return [*argv, "--uid", uid, "--gid", uid, "--cap-drop", "ALL"]
        argv = ["--userns", str(fds["userns"]), *self._userns_assert()]
        argv += [f"--unshare-{ns}" for ns in self._unshared()]
        argv += ["--uid", "0", "--gid", "0", "--cap-drop", "ALL"]
        return argv + [arg for cap in userns.ROOT_CAPS for arg in ("--cap-add", cap)]

    def _unshared(self) -> tuple[str, ...]:
        """The namespaces a sandbox gets besides its user namespace."""
        return ("pid", "net", "ipc", "uts", "cgroup")

    def _userns_assert(self) -> list[str]:
        """bwrap refuses to start unless no user namespace can be made inside."""
        return ["--assert-userns-disabled"]

    def _userns_nesting(self) -> bool:
        """Whether the sandbox's user namespace may hold nested ones: never."""
        return False

    def _own_userns(self) -> bool:
        """Whether sandboxes get a user namespace of the server's making (see userns.py)."""
        return self.is_root

    def _proc_mount_args(self) -> list[str]:
        return ["--proc", "/proc"]  # the sandbox's own pid namespace

    def _tmpfs_args(self, path: str, size_mb: int, mode: int = 0o1777) -> list[str]:
        """A sized tmpfs; sticky and world-writable by default (/tmp, /dev/shm, /var/tmp), as
        the sandbox's root makes it and `user` must write it too."""
        return ["--perms", f"{mode:04o}", "--size", str(size_mb * 1024 * 1024), "--tmpfs", path]

    def _extra_binds(self) -> list[str]:
        """Host paths bound read-write: none (the workspace is the sandbox's only one)."""
        return []

    def _seccomp_args(self, fds: dict[str, int]) -> list[str]:
        return ["--seccomp", str(fds["seccomp"])]

    def _host_userland_args(self) -> list[str]:
        args = ["--ro-bind", "/usr", "/usr"]
        if self.etc_dir is None:
            args += ["--ro-bind", "/etc", "/etc"]
        else:
            args += ["--ro-bind", str(self.etc_dir), "/etc", *self._host_path_args()]
        for link in MERGED_USR_LINKS:
            p = Path(link)
            if p.is_symlink():
                args += ["--symlink", os.readlink(p), link]
            elif p.is_dir():
                args += ["--ro-bind", link, link]
        return args

    def _host_path_args(self) -> list[str]:
        """/usr/local hidden under an empty read-only tmpfs unless the operator lists it; the
        operator's other host paths bound read-only (those below /etc are in its copy, the rest
        of /usr is visible anyway)."""
        mask = USR_LOCAL not in self.host_paths and os.path.isdir(USR_LOCAL)
        args = ["--tmpfs", USR_LOCAL] if mask else []
        for p in self.host_paths:
            if not p.startswith(("/etc/", "/usr/")) or (mask and p.startswith(USR_LOCAL + "/")):
                args += [*parent_dirs(p), "--ro-bind", p, p]
        return [*args, "--remount-ro", USR_LOCAL] if mask else args

    def _proc_args(self, fds: dict[str, int]) -> list[str]:
        """The sandbox's own figures over /proc's machine-wide files (see hostview.py)."""
        args = []
        for name, fd in fds.items():
            if name.startswith("proc:"):
                args += ["--perms", "0444", "--ro-bind-data", str(fd), name.removeprefix("proc:")]
        for d in hostview.PROC_MASKED_DIRS:
            if os.path.isdir(d):
                args += ["--tmpfs", d, "--remount-ro", d]
        return args

    def _agent_argv(self, agent_dir: str, spec: SandboxSpec, fds: dict[str, int]) -> list[str]:
        argv = [SANDBOX_PYTHON, "-E", "-s", "-S", f"{agent_dir}/main.py"]
        return argv + self._agent_options(spec, fds["listen"], fds)

    def _agent_options(self, spec: SandboxSpec, listen_fd: int, fds: dict[str, int]) -> list[str]:
        argv = ["--listen-fd", str(listen_fd), "--user", self._default_user(spec)]
        if self._writable_root(spec):
            argv.append("--writable-root")
        argv += volume_flags(spec)
        return [*argv, *self._agent_flags(fds)]

    def _default_user(self, spec: SandboxSpec) -> str:
        """Who commands run as unless they say (the template's `run.user`)."""
        return spec.user

    def _agent_flags(self, fds: dict[str, int]) -> list[str]:
        """Further agent options: none (the agent confines itself fully by default)."""
        return []

    async def create(self, spec: SandboxSpec) -> dict[str, Any]:
        return await asyncio.to_thread(self._create_sync, spec)

    def _create_sync(self, spec: SandboxSpec) -> dict[str, Any]:
        sid = spec.sandbox_id
        sdir = self.root / sid
        bind_dir = self.bind_root / sid
        uid = self._allocate_uid(sid)
        cpus = self._assign_cpus(sid, spec.resources.cpu_count)
        state: dict[str, Any] = {"uid": uid, "dir": str(sdir), "cpus": cpus}
        writable_root = self._writable_root(spec)
        ns = -1
        warming: subprocess.Popen | None = None
        try:
            if self._own_userns():
                state["range"] = [uid, BLOCK]
                ns = userns.make(uid, nesting=self._userns_nesting())
            # A parked sandbox's dir holds its image, which it starts from again (park).
            sdir.mkdir(mode=0o711, exist_ok=self._resuming(spec))
            os.chmod(sdir, 0o711)
            owner = uid + userns.USER_UID if self._own_userns() else uid
            layer = None
            if writable_root:
                layer = lambda disk: rootfs.prepare_disk(disk, uid, owner)  # noqa: E731
            if spec.disk is not None:
                self._check_disk_source(spec.disk)
            # Made first, and a throwaway process moved through them while the disk is made:
            # the sandbox's first process then joins without waiting (startctx.warm_join).
            self.cgroups.create(sid, self._cgroup_limits(spec.resources))
            warming = startctx.warm_join(self.cgroups.join_files(sid))
            ws = workspace.create(
                sdir, bind_dir, spec.resources.disk_mb, owner, self.use_loop, root_layer=layer,
                source=spec.disk, base=uid, tools=self._in_clean_ns,
            )  # fmt: skip
            if self._own_userns():
                # Only this sandbox's bwrap (its host uid) may go through: 0710 root:base.
                os.chown(bind_dir, 0, uid)
                os.chmod(bind_dir, 0o710)
            state["disk_limit_enforced"] = ws.disk_limit_enforced
            if writable_root and spec.disk is not None:
                self._check_boot_path(spec, bind_dir / rootfs.DISK / rootfs.UPPER)
            if writable_root:
                state["root"] = self._mount_root(spec, bind_dir, uid, ns)
            self._check_volume_paths(spec, bind_dir, ws.path, writable_root)
            self._mount_volumes(spec, bind_dir, ns)
            startctx.settle(warming)
            if self._home_mount(spec):
                state["home"] = E2B_HOME
            state.update(self._spawn(spec, sdir, ws.path, uid, cpus, ns))
            self._write_state(sdir, state)
            return state
        except BaseException as e:
            startctx.settle(warming)  # out of the cgroups before they are removed
            # A parked sandbox that cannot start again keeps its disk, parked as it was.
            self._destroy_sync(sid, state, keep_workspace=False, park=self._resuming(spec))
            if isinstance(e, (userns.UsernsError, rootfs.RootfsError)):
                raise RuntimeError_(str(e)) from None
            raise
        finally:
            if ns >= 0:
                os.close(ns)

    def _check_boot_path(self, spec: SandboxSpec, upper: Path) -> None:
        """A disk to start from must not have changed what the agent runs before it confines
        itself (rootfs.BOOT_PATHS): it would run the tenant's code unconfined."""
        changed = rootfs.boot_path_changes(upper, self._boot_allowances(spec))
        if changed:
            raise RuntimeRefused(
                "this disk's root changed what the sandbox's agent loads before it confines "
                f"itself ({', '.join('/' + c for c in changed[:6])}): a sandbox is not started "
                "from it. Start a fresh sandbox and copy the files it needs (its /workspace "
                "can be kept or snapshotted), or install such packages in a template"
            )

    def _boot_allowances(self, spec: SandboxSpec) -> dict[str, bytes]:
        """Boot paths the runtime itself writes into a sandbox's root, with their content."""
        return {}

    def _check_volume_paths(
        self, spec: SandboxSpec, bind_dir: Path, ws: Path, writable_root: bool
    ) -> None:
        """No component of a volume's mount point may be a symlink (the tenant's, in its root
        or workspace): the mount would land wherever it points (over the agent's own tree)."""
        for vol in spec.volumes:
            if vol.path.startswith("/workspace/"):
                base, rel = ws, vol.path[len("/workspace/") :]
            elif writable_root:
                base, rel = bind_dir / rootfs.ROOT, vol.path[1:]
            else:
                continue  # the host's userland: a root bwrap makes, no tenant file in it
            here = base
            for part in rel.split("/"):
                here = here / part
                if here.is_symlink() or (os.path.lexists(here) and not here.is_dir()):
                    raise RuntimeRefused(
                        f"volume mount point {vol.path}: {here.relative_to(base)} is a "
                        "symlink or not a directory in the sandbox; mount the volume elsewhere"
                    )
                if not os.path.lexists(here):
                    break

    def _mount_volumes(self, spec: SandboxSpec, bind_dir: Path, ns: int) -> None:
        """Each volume, its ids moved into the sandbox's block (an idmapped mount of the
        volume's host mount), at bind_dir/vol<n>: bound where the sandbox asked."""
        if spec.volumes and ns < 0:
            raise RuntimeError_("volumes need a user namespace of the sandbox's own")
        for n, vol in enumerate(spec.volumes):
            target = bind_dir / f"{VOLUME_PREFIX}{n}"
            target.mkdir(mode=0o755)
            rootfs.mount_idmapped(vol.source, target, ns, read_only=vol.read_only)

    def _volume_args(self, spec: SandboxSpec) -> list[str]:
        out = []
        for n, vol in enumerate(spec.volumes):
            out += parent_dirs(vol.path)  # made first, 0755 (bwrap would make them 0700)
            source = str(self.bind_root / spec.sandbox_id / f"{VOLUME_PREFIX}{n}")
            out += ["--ro-bind" if vol.read_only else "--bind", source, vol.path]
        return out

    def _unmount_volumes(self, bind_dir: Path) -> None:
        """Detach the sandbox's volume mounts (never `umount -d`: the loop device behind one
        is the volume's, not the sandbox's)."""
        for mnt in diskimage.mounts_at(bind_dir):
            if mnt.parent == bind_dir and mnt.name.startswith(VOLUME_PREFIX):
                with contextlib.suppress(OSError):
                    hostview.detach(mnt)

    def _resuming(self, spec: SandboxSpec) -> bool:
        """Whether the sandbox starts again from its own parked disk."""
        d = spec.disk
        return d is not None and d.consume and d.image.parent == self.root / spec.sandbox_id

    # ------------------------------------------------------------------ park

    async def park(self, sandbox_id: str, state: dict[str, Any] | None) -> dict[str, Any]:
        """End every process of the sandbox and give back all it holds on the host but its
        disk image (trimmed), which stays in its dir; returns the state to persist, from which
        `parked_disk` gives what a create starts from to run it again. Idempotent."""
        return await asyncio.to_thread(self._park_sync, sandbox_id, state)

    def _park_sync(self, sid: str, state: dict[str, Any] | None) -> dict[str, Any]:
        if state is None or state.get("parked"):
            try:
                state = json.loads((self.root / sid / STATE_FILE).read_text())
            except (OSError, ValueError):
                state = dict(state or {})
        image = self.root / sid / workspace.IMAGE_NAME
        if not image.exists():
            raise RuntimeError_(f"sandbox {sid} has no disk image to keep")
        self._destroy_sync(sid, state, keep_workspace=False, park=True)
        self.uids.release(sid)  # a start cut short may hold a lease its state does not name
        # Whose uids the disk's files have: any block's base will do for a whole-block move
        # (workspace.reown), which also finishes one a crash cut short.
        uid = state.get("uid") if isinstance(state.get("uid"), int) else UID_RANGE[0]
        parked = {"parked": True, "dir": str(self.root / sid), "uid": uid}
        parked["span"] = self._uid_span()
        self._write_state(self.root / sid, parked)
        return parked

    def parked_disk(self, sandbox_id: str, state: dict[str, Any]) -> DiskSource:
        """What `park` kept, as a create's `disk` (moved back into place, not copied)."""
        image = self.root / sandbox_id / workspace.IMAGE_NAME
        return DiskSource(image, int(state["uid"]), int(state["span"]), consume=True)

    def _home_mount(self, spec: SandboxSpec) -> bool:
        """Whether the workspace is mounted at E2B_HOME as well: in a root bwrap makes (the
        host's userland), and in a writable root that can take it (home_mount_point); a
        read-only template tree can take no new mount point."""
        if not spec.rootfs:
            return True
        if not self._writable_root(spec):
            return False
        return home_mount_point(self.bind_root / spec.sandbox_id / rootfs.ROOT)

    def _writable_root(self, spec: SandboxSpec) -> bool:
        """Whether the sandbox gets its template copy-on-write (rootfs.py): a built template,
        its own user namespace (for the idmap) and a server that may mount."""
        return bool(spec.rootfs) and self._own_userns() and rootfs.supported()

    def _mount_root(self, spec: SandboxSpec, bind_dir: Path, base: int, ns: int) -> dict[str, Any]:
        """Mount the template under the sandbox's upper layer; what the state records of it
        (the template's inode pins the version its overlay was made on). A disk it starts from
        (`spec.disk`) has its accounts already, maybe changed since: left alone."""
        assert spec.rootfs is not None
        template = Path(spec.rootfs)
        if spec.disk is None:
            rootfs.add_accounts(template, bind_dir / rootfs.DISK / rootfs.UPPER, base)
        rootfs.mount(bind_dir, template, ns)
        st = os.stat(template)
        return {"mode": "overlay", "template": str(template), "dev": st.st_dev, "ino": st.st_ino}

    def _uid_span(self) -> int:
        """How many host uids a sandbox's files may have: its whole block with a user namespace
        of its own, else the one uid it runs as."""
        return BLOCK if self._own_userns() else 1

    def _check_disk_source(self, source: DiskSource) -> None:
        if not self.use_loop:
            raise RuntimeError_("sandboxes start from a disk image only where loop devices work")
        if source.span != self._uid_span():
            raise RuntimeError_(
                "the disk image was taken under another uid layout (a server with and one "
                "without user namespaces); start from a snapshot taken on this one"
            )
        try:
            size = source.image.stat().st_size
        except OSError:
            size = 0
        if size == 0:
            raise RuntimeError_(f"the disk image {source.image.name} is gone or empty")
        if not source.consume:
            return  # a snapshot's image, only ever copied from
        try:  # a parked disk, mounted again in place: never while something still holds it
            diskimage.check_detached(source.image, "a sandbox cannot start from it")
        except diskimage.ImageError as e:
            raise RuntimeError_(str(e)) from None

    # ------------------------------------------------------------------ snapshots

    async def snapshot(self, sandbox_id: str, state: dict[str, Any], dest: Path) -> DiskSource:
        return await asyncio.to_thread(self._snapshot_sync, sandbox_id, state, dest)

    def _snapshot_sync(self, sid: str, state: dict[str, Any], dest: Path) -> DiskSource:
        image = Path(state.get("dir") or self.root / sid) / workspace.IMAGE_NAME
        if not image.exists():
            raise RuntimeError_(
                f"sandbox {sid} has no disk image to copy (loop devices were unavailable)"
            )
        if state.get("parked"):  # nothing runs, nothing is mounted: the image as it is
            try:
                diskimage.check_detached(image, f"no copy of sandbox {sid}'s disk")
                diskimage.clone_image(image, dest)
            except (OSError, diskimage.ImageError) as e:
                raise RuntimeError_(f"cannot copy the disk of sandbox {sid}: {e}") from None
            return DiskSource(image=dest, uid=int(state["uid"]), span=int(state["span"]))
        bind_dir = self.bind_root / sid
        disk = bind_dir / rootfs.DISK
        mnt = disk if os.path.ismount(disk) else bind_dir / workspace.MOUNT_NAME
        try:
            # syncfs of a path that is not the image's mount would sync some other filesystem
            # and say nothing: the copy would silently miss what the sandbox last wrote.
            diskimage.check_mounted_from(mnt, image)
        except diskimage.ImageError as e:
            raise RuntimeError_(f"cannot copy the disk of sandbox {sid}: {e}") from None
        was_frozen = self.cgroups.is_frozen(sid)
        try:
            if not was_frozen:
                self.cgroups.freeze(sid)
            # What the sandbox wrote is in its filesystem's cache: onto the image first.
            diskimage.syncfs(mnt)
            diskimage.clone_image(image, dest)
        except (CgroupError, OSError) as e:
            raise RuntimeError_(f"cannot copy the disk of sandbox {sid}: {e}") from None
        finally:
            if not was_frozen:
                with contextlib.suppress(CgroupError):
                    self.cgroups.thaw(sid)
        return DiskSource(image=dest, uid=int(state["uid"]), span=self._uid_span())

    def _cgroup_limits(self, r: Resources) -> CgroupLimits:
        return CgroupLimits(
            memory_bytes=r.memory_mb * 1024 * 1024, pids=r.pids, cpu_count=r.cpu_count
        )

    def _reachable_template(self, rootfs: str) -> str:
        """A template tree's path as bwrap can resolve it. bwrap runs as the sandbox's uid and
        resolves the path of every bind source (even one given by fd), which a private data
        dir (the default /var/lib/agentbox is 0700) keeps from that uid. Such a tree is bound
        read-only below the traverse-only bind root, once per tree while the server runs."""
        if not self.is_root or _others_can_reach(Path(rootfs)):
            return rootfs
        st = os.stat(rootfs)
        # A tree rebuilt at the same path is another inode: a fresh bind, never a stale one.
        key = hashlib.sha256(f"{rootfs}\0{st.st_dev}\0{st.st_ino}".encode()).hexdigest()[:16]
        dest = self.bind_root / TEMPLATE_BINDS / key
        with self.template_lock:
            # (Not os.path.ismount: a bind from the filesystem /run is on does not show there.)
            if not diskimage.mounted_under(dest):
                dest.parent.mkdir(mode=0o711, exist_ok=True)
                dest.mkdir(mode=0o755, exist_ok=True)
                hostview.bind_readonly(Path(rootfs), dest)
        return str(dest)

    def _drop_template_binds(self) -> None:
        """Started sandboxes hold their own copy of the bind: the host's can go at any time."""
        binds = self.bind_root / TEMPLATE_BINDS
        if self.bind_root == self.root or not binds.is_dir():
            return
        for mnt in diskimage.mounted_under(binds):
            with contextlib.suppress(OSError):
                hostview.detach(mnt)
        for d in binds.iterdir():
            with contextlib.suppress(OSError):
                d.rmdir()  # never rmtree: a bind that would not go still shows a template

    def _assign_cpus(self, sid: str, cpu_count: float) -> list[int]:
        """The CPUs a sandbox may run on: one per started unit of its quota, so that nproc and
        sched_getaffinity tell it what it gets (the cgroup quota is what enforces it)."""
        with self.cpu_lock:
            cpus = hostview.pick_cpus(cpu_count, self.cpus, self.cpus_of.values())
            self.cpus_of[sid] = cpus
        return cpus

    def _spawn(
        self, spec: SandboxSpec, sdir: Path, ws: Path, uid: int, cpus: list[int], ns: int
    ) -> dict[str, Any]:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Short path (AF_UNIX allows ~107 bytes); 0600 root: no sandbox uid may connect.
        sock_path = self.bind_root / spec.sandbox_id / SOCKET_NAME
        listener.bind(str(sock_path))
        os.chmod(sock_path, 0o600)
        listener.listen(128)
        info_r, info_w = os.pipe()
        fds: dict[str, int] = {
            "seccomp": _data_fd(self.seccomp),
            "info": info_w,
            "listen": listener.fileno(),
        }
        # Forked in: the agent gets the listener from the zygote; bwrap's first process (the
        # hold program) says on `ready` that the sandbox is set up and lives until the agent,
        # who holds the only write end of `hold`, is gone.
        forked = self.zygote is not None
        hold_r = hold_w = ready_r = ready_w = -1
        if forked:
            del fds["listen"]
            hold_r, hold_w = os.pipe()
            ready_r, ready_w = os.pipe()
        if (spec.rootfs and not self._writable_root(spec)) or (
            not spec.rootfs and self.etc_dir is None
        ):
            fds["passwd"] = _data_fd(hostview.PASSWD)
            fds["group"] = _data_fd(hostview.GROUP)
        for path, data in self._proc_files(spec, cpus).items():
            fds[f"proc:{path}"] = _data_fd(data)
        fds |= self._extra_fds()
        if ns >= 0:
            fds["userns"] = ns
        tree = None
        if spec.rootfs and not self._writable_root(spec):
            tree = self._reachable_template(spec.rootfs)
            fds["rootfs"] = os.open(tree, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        for path, data in spec.files.items():
            fds[f"file:{path}"] = _data_file_fd(data)
        join_files = self.cgroups.join_files(spec.sandbox_id)
        limits = self._rlimits(spec.resources)
        drop_to = self._drop_to(uid)
        pin = cpus if len(cpus) < len(self.cpus) else None

        argv, env = self._command(spec, ws, fds)
        # Joined, limited and dropped by the programs startctx puts before bwrap: no
        # preexec_fn, so the server is not forked (startctx.py).
        argv = [*startctx.argv(join_files, limits, drop_to, self.startctx), *argv]
        log = open(sdir / "runtime.log", "ab")

        def start() -> subprocess.Popen:
            with startctx.pinned(pin):
                return subprocess.Popen(
                    argv,
                    stdin=hold_r if forked else subprocess.DEVNULL,
                    stdout=ready_w if forked else log,
                    stderr=log,
                    close_fds=True,
                    pass_fds=tuple(fds.values()),
                    start_new_session=True,
                    env=env,
                    cwd=str(ws),
                )

        try:
            if self.clean_ns is None:
                proc = start()
            else:
                proc = self.clean_ns.start(self._own_trees(spec.sandbox_id, tree), start)
        except BaseException:
            for fd in (hold_w, ready_r):
                if fd >= 0:
                    os.close(fd)
            listener.close()
            raise
        finally:
            log.close()
            for name, fd in fds.items():
                if name not in ("listen", "userns"):  # the caller closes the namespace
                    os.close(fd)
            for fd in (hold_r, ready_w):
                if fd >= 0:
                    os.close(fd)
            if not forked:
                listener.close()  # the agent owns the listening socket now
        self.children[spec.sandbox_id] = proc
        state: dict[str, Any] = {"bwrap_pid": proc.pid, "bwrap_start": proc_start_time(proc.pid)}
        try:
            init_pid = self._init_pid(info_r, proc)
            if forked:
                state["agent_pid"] = self._fork_agent(
                    spec, sdir, proc, init_pid, ready_r, hold_w, listener, join_files, limits, pin
                )
        finally:
            os.close(info_r)
            if forked:
                os.close(ready_r)
                os.close(hold_w)  # the agent's is the only one left
                listener.close()
        self._wait_for_agent(sock_path, lambda: proc.poll() is None, sdir)
        self._hold_netns(spec.sandbox_id, init_pid)
        return state | {
            "init_pid": init_pid,
            "init_start": proc_start_time(init_pid),
            "socket": str(sock_path),
        }

    def _fork_agent(
        self,
        spec: SandboxSpec,
        sdir: Path,
        proc: subprocess.Popen,
        init_pid: int,
        ready: int,
        hold_w: int,
        listener: socket.socket,
        join_files: list[str],
        limits: list[tuple[int, int]],
        pin: list[int] | None,
    ) -> int:
        """The agent forked into the sandbox by the zygote as soon as bwrap has made its
        namespaces (agent/zygote.py does there what bwrap does for its first process): it does
        the host's steps while bwrap makes the mounts, then waits on `ready` for bwrap's first
        process to say the sandbox is set up. Its host pid."""
        assert self.zygote is not None
        # What the agent alone reads, after the fork (tenants' data never in the zygote).
        spec_data = {
            "cgroups": join_files,
            "rlimits": [[res, value, value] for res, value in limits],
            "cpus": pin,
            "caps": userns.ROOT_CAP_MASK,
            "env": sandbox_env(spec),
            "cwd": spec.workdir,
            "argv": self._agent_options(spec, LISTEN_FD, {}),
        }
        opened: list[int] = []
        try:
            opened.append(os.pidfd_open(init_pid))
            opened.append(os.open(sdir / "runtime.log", os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC))
            opened.append(_data_fd(self.seccomp))
            opened.append(_data_fd(json.dumps(spec_data).encode()))
            pidfd, log, seccomp, data = opened
            fds = [pidfd, listener.fileno(), hold_w, log, seccomp, data, ready]
            return self.zygote.fork_agent({"pid": init_pid}, fds)
        except (OSError, ZygoteError) as e:
            if proc.poll() is not None:  # bwrap failed: the zygote found no sandbox to join
                tail = self._log_tail(sdir)
                raise RuntimeError_(f"the sandbox failed to start: {tail}") from None
            raise RuntimeError_(f"the sandbox's agent could not be started: {e}") from None
        finally:
            for fd in opened:
                os.close(fd)

    @staticmethod
    def _log_tail(sdir: Path) -> str:
        return (sdir / "runtime.log").read_text(errors="replace")[-2000:].strip() or "no output"

    def _in_clean_ns(self, fn: Callable[[], _T]) -> _T:
        """`fn()` in a copy of the clean mount namespace, where there is one (the disk tools,
        which look at every mounted block device: workspace.create)."""
        return fn() if self.clean_ns is None else self.clean_ns.start((), fn)

    def _own_trees(self, sid: str, template: str | None) -> list[Path]:
        """What a sandbox started from the clean mount namespace needs of the server's: its
        own directory (disk, root, volumes), the shared trees and its template's bind."""
        trees = [self.bind_root / sid]
        if self.own_mounts:  # tmpfs mounts of their own (else plain directories, there too)
            trees += [tree for tree in (self.agent_dir, self.etc_dir) if tree is not None]
        if template is not None and Path(template).is_relative_to(self.bind_root):
            trees.append(Path(template))
        return trees

    def _proc_files(self, spec: SandboxSpec, cpus: list[int]) -> dict[str, bytes]:
        """/proc files with the sandbox's own figures, bound over the host's (hostview.py)."""
        memory = spec.resources.memory_mb * 1024 * 1024
        # A new boot id at every start: a sandbox is a machine that booted just now.
        return self.proc_view.files(memory, cpus, str(uuid.uuid4()))

    def _extra_fds(self) -> dict[str, int]:
        """Further fds the sandbox inherits: none."""
        return {}

    def _rlimits(self, r: Resources) -> list[tuple[int, int]]:
        limits = [
            (resource.RLIMIT_NOFILE, r.nofile),
            (resource.RLIMIT_FSIZE, r.file_size_mb * 1024 * 1024),
            (resource.RLIMIT_CORE, 0),
        ]
        if self.is_root:
            # Per-uid process count: a second fence behind the pids cgroup.
            limits.append((resource.RLIMIT_NPROC, r.pids + NPROC_SLACK))
        return limits

    def _drop_to(self, uid: int) -> int | None:
        """The uid bwrap starts as: the sandbox's own, when the server may switch to it."""
        return uid if self.is_root else None

    def _command(
        self, spec: SandboxSpec, ws: Path, fds: dict[str, int]
    ) -> tuple[list[str], dict[str, str]]:
        """What runs the sandbox (bwrap, then the agent inside it) and bwrap's environment."""
        return self._bwrap_argv(spec, ws, fds), {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}

    def _init_pid(self, info_fd: int, proc: subprocess.Popen) -> int:
        """The pid of the sandbox's pid-namespace init, as bwrap reports it."""
        return self._read_info(info_fd, proc)

    @staticmethod
    def _read_info(fd: int, proc: subprocess.Popen) -> int:
        """bwrap's JSON on its info fd; woken by the data (not a polling sleep), and by the
        end of file when bwrap exits without it (its copy of the pipe's end closes)."""
        buf = b""
        deadline = time.monotonic() + 10
        waiting = select.poll()
        waiting.register(fd, select.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            if not waiting.poll(min(left, 0.1) * 1000):
                if proc.poll() is not None:
                    break
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
            try:
                return int(json.loads(buf)["child-pid"])
            except (ValueError, KeyError):
                continue
        raise RuntimeError_("the sandbox failed to start (bwrap gave no child pid)")

    @staticmethod
    def _wait_for_agent(sock_path: Path, alive: Callable[[], bool], sdir: Path) -> None:
        """Until the agent answers a ping on `sock_path`; an error with the sandbox's log when
        it stops being `alive` or does not answer within 15 s."""
        from agentbox.agent import protocol as P

        deadline = time.monotonic() + 15
        while True:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(max(0.1, deadline - time.monotonic()))
                    s.connect(str(sock_path))
                    s.sendall(P.encode_json({"op": "ping"}))
                    head = s.recv(P.HEADER.size, socket.MSG_WAITALL)
                    if len(head) == P.HEADER.size:
                        return
            except OSError:
                pass
            if not alive() or time.monotonic() > deadline:
                raise RuntimeError_(
                    f"the sandbox agent did not start: {ProcessRuntime._log_tail(sdir)}"
                )
            time.sleep(0.001)

    @staticmethod
    def _write_state(sdir: Path, state: dict[str, Any]) -> None:
        tmp = sdir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(sdir / STATE_FILE)

    # ------------------------------------------------------------------ status

    async def is_alive(self, sandbox_id: str, state: dict[str, Any]) -> bool:
        # The namespace's init alone is not enough: bwrap's init outlives the agent as long as
        # any daemon does, leaving a sandbox nothing can reach. The outer bwrap exits when the
        # agent (its first process) does, so it stands for the agent.
        for pid_key, start_key in (("init_pid", "init_start"), ("bwrap_pid", "bwrap_start")):
            pid, start = state.get(pid_key), state.get(start_key)
            if pid_key == "bwrap_pid" and pid_key not in state:
                continue
            if not (isinstance(pid, int) and start is not None and proc_start_time(pid) == start):
                return False
        return True

    def exit_fd(self, sandbox_id: str, state: dict[str, Any]) -> int | None:
        # The outer bwrap exits when the agent does, and the agent dies with the namespace's
        # init: a pidfd of bwrap (of the init, in states that have no bwrap) is readable once
        # is_alive would be False.
        keys = ("bwrap_pid", "bwrap_start") if "bwrap_pid" in state else ("init_pid", "init_start")
        pid, start = state.get(keys[0]), state.get(keys[1])
        if not isinstance(pid, int) or start is None:
            return None
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone, or no descriptor to spare: is_alive says which
            return None
        if proc_start_time(pid) != start:  # the pid was reused, or the process is a zombie
            os.close(fd)
            return None
        return fd

    # ------------------------------------------------------------------ pause

    async def pause(self, sandbox_id: str, state: dict[str, Any]) -> dict[str, Any]:
        """Freeze every process of the sandbox in its cgroup: its memory stays where it is (in
        RAM, counted as before), it gets no CPU. Idempotent."""
        try:
            await asyncio.to_thread(self.cgroups.freeze, sandbox_id)
        except CgroupError as e:
            raise RuntimeError_(str(e)) from None
        return state

    async def resume(self, sandbox_id: str, state: dict[str, Any]) -> dict[str, Any]:
        try:
            await asyncio.to_thread(self.cgroups.thaw, sandbox_id)
        except CgroupError as e:
            raise RuntimeError_(str(e)) from None
        return state

    def _hold_netns(self, sandbox_id: str, init_pid: int | None) -> None:
        if not init_pid:
            return
        start = proc_start_time(init_pid)
        try:
            self.netns.open(sandbox_id, init_pid, lambda: proc_start_time(init_pid) == start)
        except (OSError, NetnsError) as e:
            logging.getLogger(__name__).warning("sandbox %s: no netns handle: %s", sandbox_id, e)

    async def listen_inside(
        self, sandbox_id: str, state: dict[str, Any], port: int
    ) -> socket.socket:
        try:
            return await self.netns.listen(sandbox_id, port)
        except NetnsError as e:
            raise RuntimeError_(str(e)) from None

    async def connect_inside(
        self, sandbox_id: str, state: dict[str, Any], port: int, timeout: float = 10.0
    ) -> socket.socket:
        try:
            return await self.netns.connect(sandbox_id, port, timeout)
        except NetnsError as e:
            raise RuntimeError_(str(e)) from None

    def agent_address(self, sandbox_id: str, state: dict[str, Any]) -> AgentAddress:
        return AgentAddress(socket_path=Path(state["socket"]))

    def limit_counters(self, sandbox_id: str) -> dict[str, int]:
        return self.cgroups.counters(sandbox_id)

    # ------------------------------------------------------------------ disk

    def storage_path(self) -> Path:
        return self.root

    def usage(self, sandbox_id: str, state: dict[str, Any]) -> dict[str, float] | None:
        if not self.cgroups.available:
            return None
        cpu, memory = self.cgroups.cpu_seconds(sandbox_id), self.cgroups.memory_usage(sandbox_id)
        out = {}
        if cpu is not None:
            out["cpu_seconds"] = cpu
        if memory is not None:
            out["memory_bytes"] = float(memory)
        bind_dir = self.bind_root / sandbox_id
        try:  # what its files take now (the image's blocks lag behind the page cache)
            # Its own filesystem (not a directory of the host's): the disk, which holds the
            # root's upper layer beside /workspace (`workspace` is then a symlink into it), or
            # for a host-userland sandbox the workspace itself.
            mount = next(
                (
                    m
                    for m in (bind_dir / rootfs.DISK, bind_dir / workspace.MOUNT_NAME)
                    if os.path.ismount(m)
                ),
                None,
            )
            if mount is not None:
                fs = os.statvfs(mount)
                out["disk_bytes"] = float((fs.f_blocks - fs.f_bfree) * fs.f_frsize)
        except OSError:
            pass
        return out or None

    def workspace_bytes(self, sandbox_id: str, state: dict[str, Any]) -> int | None:
        image = Path(state.get("dir") or self.root / sandbox_id) / workspace.IMAGE_NAME
        try:
            if image.exists():
                return diskimage.used_bytes(image)
            return diskimage.used_bytes(
                (self.bind_root / sandbox_id / workspace.MOUNT_NAME).resolve()
            )
        except OSError:
            return None

    def kept_workspaces(self) -> list[KeptWorkspace]:
        try:
            entries = list(os.scandir(self.kept_root))
        except FileNotFoundError:
            return []
        found = []
        for e in entries:
            if e.name.startswith("sbx_") and e.is_dir(follow_symlinks=False):
                try:
                    used = diskimage.used_bytes(Path(e.path))
                    kept_at = e.stat(follow_symlinks=False).st_mtime
                except OSError:
                    continue  # removed meanwhile
                found.append(KeptWorkspace(e.name, used, kept_at))
        return found

    def _kept_dir(self, sandbox_id: str) -> Path:
        if not sandbox_id.startswith("sbx_") or Path(sandbox_id).name != sandbox_id:
            raise RuntimeError_(f"{sandbox_id!r} is not a sandbox id")
        return self.kept_root / sandbox_id

    @contextlib.asynccontextmanager
    async def kept_workspace_files(self, sandbox_id: str) -> AsyncIterator[Path]:
        kept = self._kept_dir(sandbox_id)
        image = kept / workspace.IMAGE_NAME
        if not image.exists():
            plain = kept / workspace.MOUNT_NAME
            if not plain.is_dir() or plain.is_symlink():
                raise RuntimeError_(f"sandbox {sandbox_id} has no kept workspace")
            yield plain
            return
        self.kept_mounts.mkdir(mode=0o700, exist_ok=True)
        # A mount of its own per reader: a removal or a second reader never pulls it away.
        mnt = self.kept_mounts / f"{sandbox_id}.{uuid.uuid4().hex[:8]}"
        try:
            await asyncio.to_thread(diskimage.mount_readonly, image, mnt)
        except diskimage.ImageError as e:
            raise RuntimeError_(f"the kept workspace of {sandbox_id} cannot be read: {e}") from None
        try:
            # A disk that also held the sandbox's root layer: the workspace is a dir on it.
            yield mnt / workspace.MOUNT_NAME if (mnt / rootfs.MARKER).exists() else mnt
        finally:
            await asyncio.to_thread(diskimage.unmount, mnt)

    async def remove_kept_workspace(self, sandbox_id: str) -> bool:
        kept = self._kept_dir(sandbox_id)
        # Out of the listing at once (a rename), then deleted; a reader's mount keeps its image.
        doomed = self.kept_root / f".removing-{sandbox_id}-{uuid.uuid4().hex[:8]}"
        try:
            kept.rename(doomed)
        except FileNotFoundError:
            return False
        await asyncio.to_thread(shutil.rmtree, doomed, True)
        return True

    def _drop_kept_mounts(self) -> None:
        """What a server that stopped mid-read (or mid-removal) left: read-only mounts of kept
        workspaces with their loop devices, half-removed kept workspaces."""
        for mnt in diskimage.mounted_under(self.kept_mounts):
            diskimage.unmount(mnt)
        if self.kept_mounts.is_dir():
            for d in self.kept_mounts.iterdir():
                with contextlib.suppress(OSError):
                    d.rmdir()  # never rmtree: a mount that would not go still holds files
        if self.kept_root.is_dir():
            for d in self.kept_root.glob(".removing-*"):
                shutil.rmtree(d, ignore_errors=True)

    async def list_sandboxes(self) -> set[str]:
        # A root may be gone: /run is emptied by a reboot, and close() removes an unused one.
        ids = {
            p.name
            for root in (self.root, self.bind_root)
            if root.is_dir()
            for p in root.iterdir()
            if p.is_dir() and p.name.startswith("sbx_")
        }
        ids |= self.cgroups.list_ids()
        ids |= set(self.uids.held().values())  # a crash between lease and sandbox dir
        for root in (self.root, self.bind_root):
            ids |= {m.relative_to(root).parts[0] for m in diskimage.mounted_under(root)}
        return {i for i in ids if i.startswith("sbx_")}  # not the shared trees' mounts

    def adopt(self, sandbox_id: str, state: dict[str, Any]) -> None:
        if isinstance(state.get("cpus"), list):
            with self.cpu_lock:
                self.cpus_of[sandbox_id] = state["cpus"]
        pid, start = state.get("init_pid"), state.get("init_start")
        if isinstance(pid, int) and start is not None and proc_start_time(pid) == start:
            self._hold_netns(sandbox_id, pid)

    async def close(self) -> None:
        """On server stop, drop this data dir's host scaffolding if no sandbox still uses it
        (live sandboxes keep theirs: a restarted server re-adopts them)."""
        self.netns.shutdown()
        if self.clean_ns is not None:
            self.clean_ns.close()
        if self.zygote is not None:
            self.zygote.close()  # the agents it forked live on: they need it no more
        self._drop_kept_mounts()
        self._drop_template_binds()
        if self.use_loop:
            diskimage.detach_orphan_loops(self.root)
        if await self.list_sandboxes():
            return
        self.cgroups.remove_scope()
        if self.bind_root != self.root:
            for tree in (self.agent_dir, self.etc_dir):
                if tree is not None and os.path.ismount(tree):
                    hostview.detach(tree)
            shutil.rmtree(self.bind_root, ignore_errors=True)

    # ------------------------------------------------------------------ destroy

    async def destroy(
        self, sandbox_id: str, state: dict[str, Any] | None, keep_workspace: bool
    ) -> None:
        await asyncio.to_thread(self._destroy_sync, sandbox_id, state, keep_workspace)

    def _destroy_sync(
        self, sid: str, state: dict[str, Any] | None, keep_workspace: bool, park: bool = False
    ) -> None:
        """Remove the sandbox from the host; with `park`, all but its disk image, which stays
        in its dir (the rest of the dir goes)."""
        sdir = self.root / sid
        self.netns.close(sid)
        if state is None:
            try:
                state = json.loads((sdir / STATE_FILE).read_text())
            except (OSError, ValueError):
                state = {}
        self._stop(sid, state)
        self._unmount_volumes(self.bind_root / sid)
        if not rootfs.unmount(self.bind_root / sid):
            raise RuntimeError_(f"could not unmount the root filesystem of sandbox {sid}")
        if not workspace.destroy(sdir, self.bind_root / sid, keep=keep_workspace or park):
            raise RuntimeError_(f"could not unmount the workspace of sandbox {sid}")
        if not self.cgroups.remove(sid):
            raise RuntimeError_(f"could not remove the cgroups of sandbox {sid}")
        if park:
            for entry in sdir.iterdir() if sdir.is_dir() else ():
                if entry.name != workspace.IMAGE_NAME:
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)
        elif keep_workspace and sdir.exists():
            # Kept workspaces leave the sandboxes tree so reconciliation never mistakes them
            # for a leftover sandbox.
            kept = self.kept_root / sid
            kept.parent.mkdir(mode=0o700, exist_ok=True)
            for name in (SOCKET_NAME, STATE_FILE, "runtime.log"):
                try:
                    (sdir / name).unlink()
                except FileNotFoundError:
                    pass
            sdir.rename(kept)
        else:
            shutil.rmtree(sdir, ignore_errors=True)
        uid = state.get("uid")
        self.uids.release(sid, uid if isinstance(uid, int) else None)
        with self.cpu_lock:
            self.cpus_of.pop(sid, None)

    def _stop(self, sid: str, state: dict[str, Any]) -> None:
        """End every process of the sandbox, and the launcher that started it."""
        # Killing the pid namespace's init takes every process in the namespace with it.
        kill_if_same(state.get("init_pid"), state.get("init_start"))
        kill_if_same(state.get("bwrap_pid"), state.get("bwrap_start"))
        if not self._kill_everything(sid):
            raise RuntimeError_(f"could not kill every process of sandbox {sid}")
        child = self.children.pop(sid, None)
        if child is not None:
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        else:
            pid = state.get("bwrap_pid")
            deadline = time.monotonic() + 5
            while pid and proc_start_time(pid) == state.get("bwrap_start"):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.005)

    def _kill_everything(self, sid: str) -> bool:
        """Kill every process of the sandbox (its cgroup), daemons that left its pid
        namespace's reach included; False if some would not die."""
        return self.cgroups.kill_all(sid)


def volume_flags(spec: SandboxSpec) -> list[str]:
    """The agent's flags for the sandbox's read-write volumes (Landlock lets it write there)."""
    return [a for v in spec.volumes if not v.read_only for a in ("--writable", v.path)]


def sandbox_env(spec: SandboxSpec) -> dict[str, str]:
    """The environment the sandbox's agent starts with (and hands on to what it runs)."""
    env = {
        "PATH": SANDBOX_PATH,
        "HOME": "/workspace",
        "USER": "user",
        "LOGNAME": "user",
        "SHELL": "/bin/bash",
        "LANG": "C.UTF-8",
        "TERM": "xterm-256color",
        "TMPDIR": "/tmp",
        "AGENTBOX_SANDBOX_ID": spec.sandbox_id,
    }
    if spec.rootfs and Path(spec.rootfs, userns.USER_VENV, "pyvenv.cfg").is_file():
        # `user`'s Python environment first (pip, console scripts, the kernel's python).
        env["PATH"] = f"/{userns.USER_VENV}/bin:{SANDBOX_PATH}"
        env["VIRTUAL_ENV"] = f"/{userns.USER_VENV}"
    return env | spec.envs


def parent_dirs(path: str) -> list[str]:
    """bwrap arguments making `path`'s parents 0755 first: bwrap makes a mount point's missing
    parents 0700, owned by the sandbox's root, where its `user` could not reach the mount."""
    return [arg for d in reversed(Path(path).parents[:-1]) for arg in ("--dir", str(d))]


def _install_file(src: Path, target: Path, mode: int) -> None:
    """Copy `src` to `target` (atomically, only if it changed) with `mode`."""
    target.parent.mkdir(mode=0o755, exist_ok=True)
    os.chmod(target.parent, 0o755)
    if target.exists() and target.read_bytes() == src.read_bytes():
        os.chmod(target, mode)
        return
    tmp = target.with_suffix(".tmp")
    shutil.copyfile(src, tmp)
    os.chmod(tmp, mode)
    tmp.replace(target)


def _digest(data_dir: Path) -> str:
    """A data dir's name on the host: its cgroup scope, bind root and uid-lease owner."""
    return hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:12]


def _others_can_reach(path: Path) -> bool:
    """Whether a uid that owns nothing on the way may resolve `path` (search on every dir)."""
    path = path.resolve()
    for d in (path, *path.parents):
        try:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    return True
