"""Sandboxes run by an OCI runtime binary, on the process tier's host scaffolding.

`OciRuntime` is the process runtime with another launcher. Everything a sandbox has on the host
is made the same way (its uid block, the user namespace the server makes with nested namespaces
disabled, the workspace image, the template's copy-on-write root, cgroups with the same limits,
the shared agent and /etc trees), in its own corner of the host (`host_namespace`); what differs
is the start: an OCI bundle (bundle.py) given to `<binary> run --detach`, whose first process is
the agent as its own init. The agent binds its socket in a host directory bound into the
sandbox (an OCI runtime cannot hand a listening descriptor over) and loads the seccomp filter
on itself before anything else runs.

`ContainerRuntime` (`container`) runs runc: the kernel's namespaces, as on the process tier, but
set up by an OCI runtime with a pid-1 init and a real cpuset; the server reaches the sandbox's
loopback through its network namespace exactly as on the process tier.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import json
import logging
import os
import re
import resource
import select
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any, ClassVar

from agentbox.agent import protocol as P
from agentbox.agent.client import AgentClient, AgentOpError, AgentUnavailable
from agentbox.runtimes.base import E2B_HOME, Resources, RuntimeError_, SandboxSpec
from agentbox.runtimes.oci import bundle
from agentbox.runtimes.oci.bundle import CHANNEL_DIR, CHANNEL_SOCKET, Bundle
from agentbox.runtimes.process import hostview, rootfs, startctx, userns
from agentbox.runtimes.process.cgroups import CGROUP_ROOT, CgroupLimits
from agentbox.runtimes.process.runtime import (
    AGENT_MOUNT,
    MERGED_USR_LINKS,
    NPROC_SLACK,
    RUN_ROOT,
    SANDBOX_PYTHON,
    USR_LOCAL,
    VOLUME_PREFIX,
    ProcessRuntime,
    kill_if_same,
    proc_start_time,
    sandbox_env,
    volume_flags,
)
from agentbox.runtimes.uids import BLOCK

SECCOMP_FILE = "seccomp.bpf"  # in the agent tree, which every sandbox binds read-only
CHANNEL = "chan"  # below a sandbox's bind dir: bound at CHANNEL_DIR
FILES = "files"  # below a sandbox's bind dir: generated files the bundle binds in
FENCE = "fence"  # below a sandbox's bind dir: a read-only root over a writable one
USERNS = "userns"  # below a sandbox's bind dir: the user namespace, bound while runc joins it
OCI_LOG = "oci.log"
PIDNS_FILE = "pidns.json"  # in a sandbox's dir: the init of its binary's pid namespace
_SANDBOX_ID = re.compile(r"sbx_[0-9A-Za-z]+")
# The host userland's skeleton root: every mount point the bundle uses.
_SKELETON_DIRS = [
    "/usr",
    "/etc",
    "/proc",
    "/dev",
    "/tmp",
    "/run",
    "/var",
    "/workspace",
    "/home",
    E2B_HOME,
    AGENT_MOUNT,
    "/opt",
    "/root",
]
_MS_BIND = 4096
_MS_NOSUID, _MS_NODEV = 2, 4
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
_CLONE_NEWNS = 0x00020000
_MNT_DETACH = 2
# Exit statuses of the binary's start context (binary_context in OciRuntime._spawn).
_CONTEXT_FAILED = {
    120: "cannot make a cgroup namespace for the binary",
    121: "cannot enter the user namespace made for the binary",
    122: "cannot make a mount namespace for the binary",
}
_CLONE_NEWCGROUP = 0x02000000
_CLONE_NEWUSER = 0x10000000
_libc = ctypes.CDLL(None, use_errno=True)
log = logging.getLogger(__name__)


class OciRuntime(ProcessRuntime):
    """The process runtime's sandboxes, started by an OCI runtime binary."""

    forks_agents: ClassVar[bool] = False  # the binary starts the agent, in its container
    binary: ClassVar[str]
    package: ClassVar[str]  # the Debian package that has it
    # Whether the binary joins the user namespace the server made (by path), or makes one
    # with the same mapping itself.
    joins_userns: ClassVar[bool] = True
    # Whether the sandbox's rlimits are in the bundle (a runtime with a kernel of its own
    # applies them there), or inherited from the binary.
    rlimits_in_bundle: ClassVar[bool] = False
    # Whether the sandbox's /proc is the host kernel's (the host's machine-wide files the
    # binary lets a bundle bind over get the sandbox's own figures, the rest are masked), or
    # the runtime's own (every file with the sandbox's figures is bound over its kernel's).
    host_proc: ClassVar[bool] = True
    # Whether the sandbox gets a cpuset cgroup of its CPUs (nproc tells what it may use).
    cpuset: ClassVar[bool] = True
    # Whether the agent's Landlock fence holds in the sandbox (the kernel has Landlock): if
    # not, the bundle draws the writable root's fence with mounts (not /dev's: gVisor
    # refuses `> /dev/null` on a read-only /dev).
    landlock: ClassVar[bool] = True
    # Whether `<binary> delete` runs once every process of the sandbox is gone (else its state
    # is removed here, and its cgroups by the sweep that follows either way).
    delete_after_kill: ClassVar[bool] = True
    # How many of the sandbox's block of host ids its user namespace maps.
    id_map_size: ClassVar[int] = BLOCK
    # Whether the binary runs in a cgroup namespace of its own (it would leave the host
    # processes it starts in the server's: runsc).
    cgroupns_outside: ClassVar[bool] = False
    # Whether the binary, and all it starts, runs in a pid namespace of its own (runsc on the
    # ptrace platform leaves the sentry in the namespace it is run in: the host's).
    own_pidns: ClassVar[bool] = False
    # Entries of the runtime's own /dev to cover: path -> "dir" or "file".
    hidden_devices: ClassVar[dict[str, str]] = {}

    @classmethod
    def unavailable(cls) -> str | None:
        if shutil.which(cls.binary) is None:
            return f"{cls.binary} is not installed: apt-get install {cls.package}"
        if os.geteuid() != 0:
            return f"the {cls.name} runtime needs a server running as root"
        if not rootfs.supported():
            return f"the {cls.name} runtime needs idmapped mounts (x86_64, arm64)"
        return super().unavailable()

    def __init__(self, data_dir: Path, **config: Any) -> None:
        super().__init__(data_dir=data_dir, **config)
        # The process tier's own filter: the agent loads it on itself (main.py --seccomp).
        (self.agent_dir / SECCOMP_FILE).write_bytes(self.seccomp)
        os.chmod(self.agent_dir / SECCOMP_FILE, 0o444)
        self.state_root = self.bind_root / "oci"  # the binary's --root: its container states
        self.state_root.mkdir(mode=0o700, exist_ok=True)
        self.version = self._version()  # once: health (unauthenticated) shows it

    def capabilities(self) -> dict[str, Any]:
        return {**super().capabilities(), "oci_runtime": self.binary, "version": self.version}

    def _version(self) -> str:
        try:
            argv = [self.binary, "--version"]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=10, env=self._env())
            out = done.stdout
        except (OSError, subprocess.TimeoutExpired):
            return "unknown"
        return out.splitlines()[0] if out else "unknown"

    @staticmethod
    def _env() -> dict[str, str]:
        """The binary's environment: nothing of the server's (its keys among it)."""
        return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}

    def _global_args(self, log: Path) -> list[str]:
        return [self.binary, "--root", str(self.state_root), "--log", str(log)]

    # ------------------------------------------------------------------ start

    def _spawn(
        self, spec: SandboxSpec, sdir: Path, ws: Path, uid: int, cpus: list[int], ns: int
    ) -> dict[str, Any]:
        sid = spec.sandbox_id
        bind_dir = self.bind_root / sid
        # Both on tmpfs mounts of their own, so that the sandbox's mountinfo, which shows a
        # bind's path inside its filesystem, names no host path.
        chan = _small_tmpfs(bind_dir / CHANNEL, 0o700, uid)  # the agent binds its socket here
        _small_tmpfs(bind_dir / FILES, 0o755, 0)  # generated files the bundle binds in
        sock = chan / "agent.sock"
        config = self._oci_config(self._bundle(spec, bind_dir, ws, uid, cpus).config(), spec)
        bundle_dir = sdir / "bundle"
        bundle_dir.mkdir(mode=0o700)
        (bundle_dir / "config.json").write_text(json.dumps(config))
        userns_file = bind_dir / USERNS
        joins = self.joins_userns and ns >= 0
        if joins:
            userns_file.touch(mode=0o600)
            _bind(f"/proc/self/fd/{ns}", userns_file)
        limits = [] if self.rlimits_in_bundle else self._rlimits(spec.resources)
        try:
            started = self._launch(
                sid, uid, limits, ["run", "--detach", "--bundle", str(bundle_dir)]
            )
        finally:
            if joins:
                _unbind(userns_file)  # the sandbox holds its namespace now
        init_pid, init_start = started["init_pid"], started["init_start"]
        try:
            self._wait_for_agent(sock, lambda: proc_start_time(init_pid) == init_start, sdir)
            self._hold_netns(sid, init_pid)
        except BaseException:
            # The binary's pid namespace is outside the sandbox's cgroups: not killed with them.
            kill_if_same(started.get("pidns_pid"), started.get("pidns_start"))
            raise
        return {"oci": self.binary, "socket": str(sock), **started}

    def _launch(
        self, sid: str, uid: int, limits: list[tuple[int, int]], args: list[str]
    ) -> dict[str, Any]:
        """Run `<binary> ARGS --pid-file ... SID` (run or restore, detached) as the sandbox's
        binary runs: its rlimits, the user, cgroup and pid namespaces made for it; the state
        naming the sandbox's init (and the binary's pid namespace, if it has one)."""
        sdir = self.root / sid
        bundle_dir = sdir / "bundle"
        pid_file = sdir / "init.pid"
        pid_file.unlink(missing_ok=True)
        own_cgroupns = self.cgroupns_outside
        own_pidns, own_mounts = self.own_pidns, str(self.bind_root / sid)
        # Every tier's kept-workspace mounts of this data dir (kept-mounts, kept-mounts-TIER).
        data_dir = self.layout.kept_mounts.parent
        # Kept workspaces' read-only mounts and volumes' host mounts (core/volumes.py).
        kept = tuple(_mountinfo_escaped(data_dir / d) for d in ("kept-mounts", "volumes"))
        binary_ns = self._binary_userns(uid)

        def binary_context() -> None:
            # The sandbox inherits them from the binary: it cannot set them on the sandbox's
            # init itself (a prlimit on another uid needs CAP_SYS_RESOURCE, which root may not
            # have), and the binary, run as root, is exempt from RLIMIT_NPROC.
            for res, value in limits:
                resource.setrlimit(res, (value, value))
            if own_pidns and not _without_other_sandboxes(own_mounts, kept):
                os._exit(122)
            if binary_ns is not None and _libc.setns(binary_ns, _CLONE_NEWUSER) != 0:
                os._exit(121)
            if own_cgroupns and _libc.unshare(_CLONE_NEWCGROUP) != 0:
                os._exit(120)

        argv = [*self._global_args(sdir / OCI_LOG), *args, "--pid-file", str(pid_file), sid]
        # Only rlimits to set (runc): `prlimit` sets them before the binary, and the server
        # is not forked for them (a preexec_fn forks it whole; see process/startctx.py).
        forks = own_pidns or binary_ns is not None or own_cgroupns
        if not forks:
            argv = [*startctx.limits_argv(limits, self.startctx), *argv]

        def launch() -> tuple[tuple[int, int | None] | None, int]:
            with open(sdir / "runtime.log", "ab") as log:
                if self.own_pidns:
                    record = sdir / PIDNS_FILE
                    return run_in_pidns(argv, log, bundle_dir, record, binary_context)
                return None, subprocess.run(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    timeout=60,
                    cwd=str(bundle_dir),
                    env=self._env(),
                    preexec_fn=binary_context if forks else None,
                ).returncode

        pidns: tuple[int, int | None] | None = None
        try:
            if self.clean_ns is None:
                pidns, returncode = launch()
            else:  # the binary copies the namespace it starts in (see mountns.py)
                pidns, returncode = self.clean_ns.start(self._own_trees(sid, None), launch)
        except subprocess.TimeoutExpired:
            raise RuntimeError_(f"{self.binary} did not start the sandbox within 60 s") from None
        finally:
            if binary_ns is not None:
                os.close(binary_ns)
        if returncode != 0:
            if pidns is not None:
                kill_if_same(*pidns)
            why = _CONTEXT_FAILED.get(returncode) or _tail(sdir)
            raise RuntimeError_(f"{self.binary} could not start the sandbox: {why}")
        try:
            init_pid = int(pid_file.read_text())
            if pidns is not None:
                init_pid = host_pid(pidns[0], init_pid)
        except (OSError, ValueError, RuntimeError_) as e:
            if pidns is not None:
                kill_if_same(*pidns)
            raise RuntimeError_(f"{self.binary} started no sandbox init: {e}") from None
        out: dict[str, Any] = {"init_pid": init_pid, "init_start": proc_start_time(init_pid)}
        if pidns is not None:
            out["pidns_pid"], out["pidns_start"] = pidns
        return out

    def _bundle(
        self, spec: SandboxSpec, bind_dir: Path, ws: Path, uid: int, cpus: list[int]
    ) -> Bundle:
        r = spec.resources
        writable_root = self._writable_root(spec)
        if spec.rootfs and not writable_root:
            raise RuntimeError_(f"the {self.name} runtime runs built templates copy-on-write only")
        var_tmp = bool(spec.rootfs) and not Path(spec.rootfs or "", "var/tmp").is_symlink()
        root = bind_dir / rootfs.ROOT  # the overlay the server mounted, or a skeleton
        home = self._home_mount(spec)
        if home and writable_root and not (root / E2B_HOME[1:]).exists():
            # The mount point, made here: the binary (runsc's gofer) then mounts onto it.
            (root / E2B_HOME[1:]).mkdir(mode=0o755)
            os.chown(root / E2B_HOME[1:], uid, uid)
        mounts = []
        if writable_root and self._fence_by_mounts():
            # The fence the agent draws with Landlock elsewhere, drawn with mounts: a
            # read-only root of the overlay's top-level entries, each of its directories but
            # the kept ones bound writable.
            mounts += self._fenced_root(root, bind_dir / FENCE, uid)
            root = bind_dir / FENCE
        mounts += bundle.base_mounts(r.tmp_mb, var_tmp)
        if not writable_root:
            self._skeleton(root, uid)
            mounts += self._host_userland_mounts()
        mounts += [
            bundle.bind(ws, "/workspace", writable=True),
            *([bundle.bind(ws, E2B_HOME, writable=True)] if home else []),
            # Volumes after the workspace (one may be below it), before the agent's tree.
            *(
                bundle.bind(bind_dir / f"{VOLUME_PREFIX}{n}", v.path, writable=not v.read_only)
                for n, v in enumerate(spec.volumes)
            ),
            bundle.bind(self.agent_dir, AGENT_MOUNT),
            bundle.mount(
                CHANNEL_DIR, "bind", str(bind_dir / CHANNEL), "bind", "rw", "nosuid", "nodev",
                "noexec",
            ),
        ]  # fmt: skip
        masked = []
        files = bind_dir / FILES
        if self.host_proc:
            masked += [d for d in hostview.PROC_MASKED_DIRS if os.path.isdir(d)]
            proc_files = self._proc_files(spec, cpus)
        else:
            # The runtime's kernel numbers the sandbox's CPUs from 0.
            proc_files = self._proc_files(spec, list(range(len(cpus))))
        for n, (path, data) in enumerate(proc_files.items()):
            if not self.host_proc or path in bundle.PROC_BINDABLE:
                mounts.append(bundle.bind(_write(files / f"proc{n}", data), path))
            else:
                masked.append(path)  # runc binds nothing else below the host's /proc
        for path, kind in self.hidden_devices.items():
            # What the runtime's kernel puts in /dev beyond the standard nodes: covered by an
            # empty directory or file (not a device: nothing behind it).
            if kind == "dir":
                mounts.append(bundle.tmpfs(path, 1, 0o755, "ro"))
            else:
                mounts.append(bundle.bind(_write(files / "empty", b""), path))
        for n, (path, data) in enumerate(spec.files.items()):
            mounts.append(bundle.bind(_write(files / f"file{n}", data), path))
        args = [SANDBOX_PYTHON, "-E", "-s", "-S", f"{AGENT_MOUNT}/main.py", "--init"]
        args += ["--seccomp", f"{AGENT_MOUNT}/{SECCOMP_FILE}", "--listen-path", CHANNEL_SOCKET]
        args += ["--user", self._default_user(spec)]
        if writable_root:
            args.append("--writable-root")
        args += volume_flags(spec)
        args += self._agent_flags({})
        return Bundle(
            root=root,
            root_readonly=not writable_root or self._fence_by_mounts(),
            args=args,
            env=sandbox_env(spec),
            cwd=spec.workdir,
            resources=r,
            uid_base=uid,
            size=self.id_map_size,
            userns_path=bind_dir / USERNS if self.joins_userns else None,
            rlimits=self._rlimits(r) if self.rlimits_in_bundle else [],
            cgroups_path=f"/{self.layout.cgroup_group}/{self.layout.scope}/{spec.sandbox_id}",
            cpus=cpus if self.cpuset and len(cpus) < len(self.cpus) else None,
            mounts=mounts,
            masked=masked,
        )

    def _binary_userns(self, uid: int) -> int | None:
        """A user namespace the binary runs in (a descriptor the caller closes), or None: the
        server's."""
        return None

    def _oci_config(self, config: dict[str, Any], spec: SandboxSpec) -> dict[str, Any]:
        """The bundle's config as given to the binary: as rendered."""
        return config

    def _fence_by_mounts(self) -> bool:
        """Whether a writable root's fence is drawn with mounts (no Landlock in the sandbox's
        kernel)."""
        return not self.landlock

    def _skeleton(self, root: Path, uid: int) -> None:
        """The host userland's root: the mount points, owned by the sandbox's root as bwrap's
        own root is, on a tmpfs of its own (mountinfo names no host path), then mounted
        read-only by the runtime."""
        # No nosuid/nodev of its own: runsc's gofer remounts the root read-only from a user
        # namespace, where a flag the mount has cannot be dropped (it holds only directories).
        _small_tmpfs(root, 0o755, uid, flags=0)
        dirs = [*_SKELETON_DIRS, *self._host_path_points()]
        links = {"/var/tmp": "/tmp"}
        for link in MERGED_USR_LINKS:
            if Path(link).is_symlink():
                links[link] = os.readlink(link)
            elif Path(link).is_dir():
                dirs.append(link)
        bundle.skeleton(root, dirs, links)
        for dirpath, dirnames, filenames in os.walk(root):
            os.chown(dirpath, uid, uid)
            for name in (*dirnames, *filenames):
                os.chown(os.path.join(dirpath, name), uid, uid, follow_symlinks=False)
        os.chmod(root / "root", 0o700)
        os.chmod(root / "tmp", 0o1777)  # a tmpfs takes the mode of the directory it covers

    def _fenced_root(self, overlay: Path, fence: Path, uid: int) -> list[dict[str, Any]]:
        """Fill `fence` (a tmpfs, mounted read-only by the binary) with the overlay's
        top-level entries; the mounts that bind its writable directories and files in."""
        # No nosuid/nodev of its own: runsc's gofer remounts the root read-only from a user
        # namespace, where a flag the mount has cannot be dropped (it holds only mount points
        # and symlinks; reached through the sandbox's 0710 bind dir only).
        _small_tmpfs(fence, 0o755, uid, flags=0)
        kept = {"proc", "dev", "sys", ".agentbox"}  # the agent's ROOT_KEPT (sandbox_agent.py)
        covered = {"tmp", "run", "workspace"}  # the bundle mounts these
        mounts = []
        for e in sorted(os.scandir(overlay), key=lambda e: e.name):
            target = fence / e.name
            if e.is_symlink():
                os.symlink(os.readlink(e.path), target)
                os.lchown(target, uid, uid)
            elif e.is_dir():
                target.mkdir(mode=e.stat().st_mode & 0o7777)
                os.chown(target, uid, uid)
                if e.name not in kept | covered:
                    mounts.append(bundle.bind(e.path, f"/{e.name}", writable=True))
            elif e.is_file():
                target.touch(mode=0o644)
                mounts.append(bundle.bind(e.path, f"/{e.name}"))  # as Landlock: not writable
        for d in ("proc", "dev", "tmp", "run", "workspace", AGENT_MOUNT.strip("/")):
            (fence / d).mkdir(mode=0o755, exist_ok=True)
        os.chmod(fence / "tmp", 0o1777)
        return mounts

    def _host_path_points(self) -> list[str]:
        return [p for p in self.host_paths if not p.startswith(("/etc/", "/usr/"))]

    def _host_userland_mounts(self) -> list[dict[str, Any]]:
        out = [bundle.bind("/usr", "/usr")]
        if self.etc_dir is not None:
            out.append(bundle.bind(self.etc_dir, "/etc", "noexec"))  # a noexec tmpfs
        else:
            out.append(bundle.bind("/etc", "/etc"))
        for link in MERGED_USR_LINKS:
            if not Path(link).is_symlink() and Path(link).is_dir():
                out.append(bundle.bind(link, link))
        mask = USR_LOCAL not in self.host_paths and os.path.isdir(USR_LOCAL)
        if mask:
            out.append(bundle.tmpfs(USR_LOCAL, 1, 0o755, "ro"))
        for p in self.host_paths:
            if not p.startswith(("/etc/", "/usr/")) or (mask and p.startswith(USR_LOCAL + "/")):
                out.append(bundle.bind(p, p))
        return out

    # ------------------------------------------------------------------ stop

    def _stop(self, sid: str, state: dict[str, Any]) -> None:
        # The pid namespace's init: the kernel ends everything else in it.
        kill_if_same(*self._pidns(sid, state))
        kill_if_same(state.get("init_pid"), state.get("init_start"))
        if not self._kill_everything(sid):
            raise RuntimeError_(f"could not kill every process of sandbox {sid}")
        sdir = self.root / sid
        log = sdir / OCI_LOG if sdir.is_dir() else Path(os.devnull)
        if self.delete_after_kill:
            subprocess.run(
                [*self._global_args(log), "delete", "--force", sid],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=30,
                env=self._env(),
            )
        self._remove_state(sid)  # what delete left, if anything
        # The binary joins the sandbox to every controller; ours are removed by destroy.
        if not self.cgroups.sweep(sid):
            raise RuntimeError_(f"could not remove the cgroups of sandbox {sid}")

    def _pidns(self, sid: str, state: dict[str, Any]) -> tuple[Any, Any]:
        """The init of the pid namespace the binary last ran in for the sandbox, if any: (pid,
        start time) as recorded the moment it was known (a create cut short, or a restore,
        has no state of it yet), else as the state has it."""
        try:
            pid, start = json.loads((self.root / sid / PIDNS_FILE).read_text())
        except (OSError, ValueError, TypeError):
            return state.get("pidns_pid"), state.get("pidns_start")
        return pid, start

    def binary_argv(self, sid: str, state: dict[str, Any], *args: str) -> list[str]:
        """The argv running the binary on a started sandbox: in the pid namespace it was
        started in, where it has one (its state numbers processes as that namespace does;
        run from the host's, it would signal whatever host processes have those numbers)."""
        argv = [*self._global_args(self.root / sid / OCI_LOG), *args]
        pid, start = self._pidns(sid, state)
        if pid is None:
            return argv
        if proc_start_time(pid) != start:
            raise RuntimeError_(f"sandbox {sid} is not running")
        return ["nsenter", f"--target={pid}", "--pid", "--", *argv]

    def _remove_state(self, sid: str) -> None:
        """Remove what the binary keeps of the sandbox under its --root."""
        for left in self.state_root.glob(f"{sid}*"):
            if left.is_dir() and not left.is_symlink():
                shutil.rmtree(left, ignore_errors=True)
            else:
                left.unlink(missing_ok=True)

    async def list_sandboxes(self) -> set[str]:
        ids = await super().list_sandboxes()
        if self.state_root.is_dir():
            ids |= {m[0] for p in self.state_root.iterdir() if (m := _SANDBOX_ID.match(p.name))}
        ids |= self.cgroups.list_ids(everywhere=True)
        return ids


class ContainerRuntime(OciRuntime):
    """`container`: an OCI container run by runc."""

    name: ClassVar[str] = "container"
    host_namespace: ClassVar[str] = "container"
    binary: ClassVar[str] = "runc"
    package: ClassVar[str] = "runc"


def _small_tmpfs(path: Path, mode: int, owner: int, flags: int = _MS_NOSUID | _MS_NODEV) -> Path:
    """A fresh 4 MiB tmpfs at `path` (made), owned by `owner`; unmounted by destroy with
    everything else below the sandbox's bind dir."""
    path.mkdir(mode=0o700)
    opts = f"size=4m,mode={mode:o},uid={owner},gid={owner}".encode()
    if _libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", flags, opts) != 0:
        err = ctypes.get_errno()
        raise RuntimeError_(f"cannot mount a tmpfs at {path}: {os.strerror(err)}")
    return path


# The first process of a pid namespace made for the binary (`sh -c SCRIPT sh RECORD ARGV...`),
# in a mount namespace of its own with that pid namespace's /proc (runsc writes its gofer's id
# maps there by the pid it sees). It records its host pid and start time in RECORD (before
# anything can start: a server that dies meanwhile leaves the next one what to kill), tells its
# pid, runs the binary, tells its status, then stays as the namespace's init: the binary's
# daemons are reparented to it, and killing it from the host ends them all.
_PIDNS_INIT = """read -r me _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ start _ < /proc/self/stat
record=$1; shift
printf '[%s, %s]' "$me" "$start" > "$record.new" && mv -f "$record.new" "$record" || exit 126
echo "$me"
mount -t proc -o nosuid,nodev,noexec proc /proc || exit 125
"$@" </dev/null >&2; rc=$?; echo "$rc"
[ "$rc" = 0 ] || exit "$rc"
exec sleep infinity </dev/null >/dev/null 2>&1"""
_SANDBOX_MOUNT = re.compile(re.escape(str(RUN_ROOT)).encode() + rb"/[^/]+/sbx_[0-9A-Za-z]+(/|$)")


def _without_other_sandboxes(own: str, kept: tuple[bytes, ...]) -> bool:
    """In a child about to start the binary: move to a mount namespace of its own (private, a
    copy of the host's) without the mounts of other sandboxes. The launcher's mount namespace, whose
    copy of the host's mounts is also the gofer's (runsc runs it with --setup-root=false), lives
    as long as the sandbox: it would keep every other sandbox's workspace of the moment mounted
    after that sandbox ended. `kept`: prefixes of the read-only mounts of kept workspaces
    (escaped as mountinfo escapes them). (Detached here, in the host's user namespace: in the
    copy the launcher makes from its own user namespace, they would be locked in.)"""
    if _libc.unshare(_CLONE_NEWNS) != 0:
        return False
    # Private: no mount the host makes from now on reaches it (the copy the launcher makes
    # would hold it for the sandbox's life).
    if _libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return False
    mine = own.encode()
    with open("/proc/self/mountinfo", "rb") as f:
        points = [line.split()[4] for line in f]
    for point in reversed(points):  # the deepest first
        if point == mine or point.startswith(mine + b"/"):
            continue
        if _SANDBOX_MOUNT.match(point) or any(point.startswith(p) for p in kept):
            _libc.umount2(point, _MNT_DETACH)
    return True


def _mountinfo_escaped(path: Path) -> bytes:
    """`path` as /proc/self/mountinfo writes it (space, tab, newline and backslash octal)."""
    out = os.fsencode(str(path))
    for ch in (b"\\", b" ", b"\t", b"\n"):
        out = out.replace(ch, b"\\%03o" % ord(ch))
    return out


def run_in_pidns(
    argv: list[str], log: Any, cwd: Path, record: Path, preexec: Any = None
) -> tuple[tuple[int, int | None] | None, int]:
    """Run the binary's `argv` in a pid namespace of its own whose init outlives it (see
    _PIDNS_INIT, which writes `record`); the init's host pid and start time (None if it never
    said), and the binary's exit status."""
    wrapped = ["setsid", "--fork", "unshare", "--pid", "--fork", "--mount", "sh", "-c"]
    record.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [*wrapped, _PIDNS_INIT, "sh", str(record), *argv],
        bufsize=0,  # unbuffered: select() must see what readline() has not taken yet
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log,
        cwd=str(cwd),
        env=OciRuntime._env(),
        preexec_fn=preexec,
    )
    assert proc.stdout is not None
    init: tuple[int, int | None] | None = None
    try:
        # setsid returns at once: its child (unshare) goes on, a child of the host's init.
        if proc.wait(10) != 0:
            return None, proc.returncode
        words = []
        for _ in range(2):
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            if not ready:
                if init is not None:
                    kill_if_same(*init)
                raise subprocess.TimeoutExpired(argv, 60)
            word = proc.stdout.readline().decode(errors="replace").strip()
            if not word.isdigit():
                break
            words.append(int(word))
            if len(words) == 1:
                init = (words[0], proc_start_time(words[0]))
    finally:
        proc.stdout.close()
    if len(words) != 2:
        return init, 1
    return init, words[1]


def host_pid(init: int, ns_pid: int) -> int:
    """The host pid of the process numbered `ns_pid` in the pid namespace whose init is `init`
    (a child of it: the binary's daemons are reparented to it)."""
    try:
        children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
    except OSError:
        children = []
    for child in children:
        try:
            status = Path(f"/proc/{child}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:") and line.split()[-1] == str(ns_pid):
                return int(child)
    raise RuntimeError_(f"no process {ns_pid} in the pid namespace of process {init}")


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    os.chmod(path, 0o444)
    return path


def _bind(src: str, dest: Path) -> None:
    if _libc.mount(src.encode(), str(dest).encode(), None, _MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise RuntimeError_(f"cannot bind the sandbox's user namespace: {os.strerror(err)}")


def _unbind(path: Path) -> None:
    _libc.umount2(str(path).encode(), _MNT_DETACH)
    try:
        path.unlink()
    except OSError:
        pass


def _tail(sdir: Path) -> str:
    """The end of what the binary and the sandbox logged, for an error message."""
    parts = []
    for name in (OCI_LOG, "runtime.log"):
        try:
            text = (sdir / name).read_text(errors="replace").strip()
        except OSError:
            continue
        if text:
            parts.append(text[-1500:])
    return " | ".join(parts) or "no output"


# runsc as Debian 12 has it (0.0~20221219): only the ptrace platform works on hosts like ours
# (no systrap in that build; kvm needs a real KVM). No network of its own: the sandbox's
# netstack has loopback only, reached through the agent (relay.py). Host Unix sockets: the
# agent binds its own and connects to the egress proxy's, both in the channel directory.
GVISOR_FLAGS = ("--platform=ptrace", "--network=none", "--host-uds=all", "--cpu-num-from-quota")
COMPAT_SRC = Path(__file__).with_name("gvisor_compat.c")
COMPAT_LIB = "lib/gvisor-compat.so"  # below the agent tree
# Host memory the sentry and the gofer take beside what the sandbox's programs use: the host
# cgroup allows this much more than the sandbox's limit (which the sandbox sees as its RAM).
SENTRY_MEMORY_MB = 160
NOBODY = 65534  # the id runsc runs the sentry as, in the namespace it runs in


# The sandbox's process limit is RLIMIT_NPROC, enforced by its own kernel. The host pids cgroup
# is a backstop above it: on the ptrace platform one sandbox process costs the host about a
# dozen tasks (its stub process's threads, the sentry's threads serving it; measured: 78
# sleeping processes, 1,012 host tasks), and an idle sandbox about 60.
def _host_pids(pids: int) -> int:
    return 16 * (pids + NPROC_SLACK) + 128


class GvisorRuntime(OciRuntime):
    """`gvisor`: an OCI sandbox run by runsc, whose programs talk to gVisor's user-space kernel
    (the sentry) instead of the host's."""

    name: ClassVar[str] = "gvisor"
    host_namespace: ClassVar[str] = "gvisor"
    binary: ClassVar[str] = "runsc"
    package: ClassVar[str] = "runsc"
    joins_userns: ClassVar[bool] = False  # runsc makes its own (same mapping) for the gofer
    rlimits_in_bundle: ClassVar[bool] = True
    # The sentry's /proc shows only the sandbox (files with its own figures bound over it).
    host_proc: ClassVar[bool] = False
    # On cgroup v1 the sandbox gets a cpuset, in groups made ready for it (cpuset_parents):
    # the sentry's CPU count follows it (from the quota alone it would be at least 2).
    cpuset: ClassVar[bool] = (
        not (CGROUP_ROOT / "cgroup.controllers").exists() and (CGROUP_ROOT / "cpuset").is_dir()
    )
    # The sentry's own tun and FUSE devices (inert without CAP_NET_ADMIN or a mount, but
    # sentry code a sandbox has no use for).
    hidden_devices: ClassVar[dict[str, str]] = {"/dev/net": "dir", "/dev/fuse": "file"}
    landlock: ClassVar[bool] = False  # not in gVisor's kernel (2022)
    cgroupns_outside: ClassVar[bool] = True
    own_pidns: ClassVar[bool] = True
    # runsc delete polls until the sentry's pid is gone, zombie included: as long as the host's
    # init takes to reap an orphan (1-2 s measured here). With every process of the sandbox
    # gone, what else it does is remove its state and cgroups, done here without the wait.
    delete_after_kill: ClassVar[bool] = False
    # The block's last id is the sentry's (see _binary_userns): the sandbox maps the rest.
    id_map_size: ClassVar[int] = BLOCK - 1

    def __init__(self, data_dir: Path, **config: Any) -> None:
        super().__init__(data_dir, **config)
        if self.cpuset:
            cpuset_parents(CGROUP_ROOT / "cpuset", self.layout.cgroup_group, self.layout.scope)
        self.compat = self._install_compat(Path(data_dir))
        if self.compat is not None and self.etc_dir is not None:
            # The host userland's /etc (this runtime's own copy).
            (self.etc_dir / "ld.so.preload").write_text(self.compat + "\n")

    def _global_args(self, log: Path) -> list[str]:
        return [*super()._global_args(log), *GVISOR_FLAGS]

    def _install_compat(self, data_dir: Path) -> str | None:
        """Build (once per source) and install the statx shim (gvisor_compat.c); None, with a
        warning, when there is no C compiler."""
        source = COMPAT_SRC.read_bytes()
        digest = hashlib.sha256(source).hexdigest()[:16]
        cache = data_dir / "cache" / f"gvisor-compat-{digest}.so"
        if not cache.exists():
            cc = shutil.which("cc") or shutil.which("gcc")
            if cc is None:
                log.warning("no C compiler: gvisor sandboxes lack %s (ls, stat fail)", COMPAT_LIB)
                return None
            cache.parent.mkdir(mode=0o700, exist_ok=True)
            tmp = cache.with_suffix(".tmp")
            done = subprocess.run(
                [cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(COMPAT_SRC)],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            if done.returncode != 0:
                log.warning("cannot build %s: %s", COMPAT_LIB, done.stderr[-500:])
                return None
            tmp.replace(cache)
        target = self.agent_dir / COMPAT_LIB
        target.parent.mkdir(mode=0o755, exist_ok=True)
        shutil.copyfile(cache, target)
        os.chmod(target, 0o644)
        return f"{AGENT_MOUNT}/{COMPAT_LIB}"

    def capabilities(self) -> dict[str, Any]:
        return {
            **super().capabilities(),
            "platform": "ptrace",
            "compat_shim": self.compat is not None,
            # The last id of each sandbox's own block (not the host's nobody).
            "sentry_uid": "own",
        }

    def _binary_userns(self, uid: int) -> int | None:
        """runsc, run as root, starts each sandbox's kernel (the sentry, and the stub processes
        the sandbox's code runs in) as host `nobody`, one uid for every sandbox on the host. In
        this namespace its root is host root, its `nobody` the last id of the sandbox's own
        block and the block maps to itself: the sentry runs as a uid no other sandbox has."""
        return userns.make_mapped(
            [(0, 0, 1), (NOBODY, uid + BLOCK - 1, 1), (uid, uid, self.id_map_size)]
        )

    def _cgroup_limits(self, r: Resources) -> CgroupLimits:
        return CgroupLimits(
            memory_bytes=(r.memory_mb + SENTRY_MEMORY_MB) * 1024 * 1024,
            pids=_host_pids(r.pids),
            cpu_count=r.cpu_count,
        )

    def _rlimits(self, r: Resources) -> list[tuple[int, int]]:
        # The sandbox's process count, kept by its own kernel (the host's pids cgroup counts
        # the sentry's tasks): exactly the limit, no slack for host helpers.
        return [
            (res, r.pids if res == resource.RLIMIT_NPROC else value)
            for res, value in super()._rlimits(r)
        ]

    def _boot_allowances(self, spec: SandboxSpec) -> dict[str, bytes]:
        """The compatibility library this runtime adds to /etc/ld.so.preload (`_preload`)."""
        if self.compat is None or not spec.rootfs:
            return {}
        try:
            lines = Path(spec.rootfs, "etc/ld.so.preload").read_text().splitlines()
        except OSError:
            lines = []
        if self.compat not in lines:
            lines.append(self.compat)
        return {"etc/ld.so.preload": ("\n".join(lines) + "\n").encode()}

    def _mount_root(self, spec: SandboxSpec, bind_dir: Path, base: int, ns: int) -> dict[str, Any]:
        out = super()._mount_root(spec, bind_dir, base, ns)
        if self.compat is not None:
            _preload(bind_dir / rootfs.ROOT, self.compat, base)
        return out

    def _hold_netns(self, sandbox_id: str, init_pid: int | None) -> None:
        """Nothing to hold: the sandbox's network is the sentry's, reached through the agent."""

    async def listen_inside(
        self, sandbox_id: str, state: dict[str, Any], port: int
    ) -> socket.socket:
        """A host Unix listener in the sandbox's channel directory, which the agent relays the
        sandbox's 127.0.0.1:`port` to (only the sandbox's root may enter the directory)."""
        chan = Path(state["socket"]).parent
        path = chan / f"egress-{port}.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            path.unlink(missing_ok=True)  # a previous server's
            listener.bind(str(path))
            os.chown(path, state["uid"], state["uid"])
            os.chmod(path, 0o600)
            listener.listen(128)
            client = AgentClient(Path(state["socket"]), connect_timeout=5)
            await client.call(
                {"op": "net.listen", "port": port, "to": f"{CHANNEL_DIR}/{path.name}"}, 10
            )
        except (OSError, AgentUnavailable, AgentOpError) as e:
            listener.close()
            raise RuntimeError_(f"cannot serve port {port} in sandbox {sandbox_id}: {e}") from None
        return listener

    async def connect_inside(
        self, sandbox_id: str, state: dict[str, Any], port: int, timeout: float = 10.0
    ) -> socket.socket:
        """A connection to the agent that, once it answers, carries the bytes of its own
        connection to `port` on the sandbox's loopback."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(timeout + 1):
                await loop.sock_connect(sock, state["socket"])
                request = {"op": "net.connect", "port": port, "timeout": timeout}
                await loop.sock_sendall(sock, P.encode_json(request))
                kind, length = P.HEADER.unpack(await _recv_exact(loop, sock, P.HEADER.size))
                if kind != P.KIND_JSON or length > 65536:
                    raise RuntimeError_("the sandbox's agent answered a relay with nonsense")
                reply = P.decode_json(await _recv_exact(loop, sock, length))
        except (OSError, TimeoutError, P.ProtocolError, EOFError) as e:
            sock.close()
            if isinstance(e, ConnectionRefusedError):
                raise RuntimeError_(f"the agent of sandbox {sandbox_id} is not answering") from None
            raise RuntimeError_(f"cannot reach port {port} in sandbox {sandbox_id}: {e}") from None
        except BaseException:
            sock.close()
            raise
        if reply.get("ok") is True:
            return sock
        sock.close()
        if reply.get("code") == "port_not_open":
            raise ConnectionRefusedError(f"nothing listens on port {port} in sandbox {sandbox_id}")
        why = reply.get("message")
        raise RuntimeError_(f"cannot reach port {port} in sandbox {sandbox_id}: {why}")

    # ------------------------------------------------------------------ checkpoint-safe

    async def quiesce(self, sandbox_id: str, state: dict[str, Any]) -> None:
        """Close every host socket the sandbox holds (the agent's own, its connections, the
        relays): `runsc checkpoint` fails, and ends the sandbox, while one is open. Commands
        keep running. `reopen` undoes it. (Snapshots themselves are the lifecycle's.)"""
        client = AgentClient(Path(state["socket"]), connect_timeout=5)
        try:
            await client.call({"op": "quiesce"}, 10)
        except (AgentUnavailable, AgentOpError) as e:
            raise RuntimeError_(f"sandbox {sandbox_id} could not close its channels: {e}") from None

    async def reopen(self, sandbox_id: str, state: dict[str, Any]) -> None:
        """After a checkpoint (or one that failed): the agent binds its socket again, told by a
        signal the runtime delivers (nothing can reach it through the host meanwhile)."""
        sdir = self.root / sandbox_id
        argv = self.binary_argv(sandbox_id, state, "kill", sandbox_id, "USR2")
        done = await asyncio.to_thread(
            subprocess.run,
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
            env=self._env(),
        )
        if done.returncode != 0:
            raise RuntimeError_(f"cannot signal sandbox {sandbox_id}: {_tail(sdir)}")
        sock = Path(state["socket"])
        await asyncio.to_thread(self._wait_for_agent, sock, lambda: True, sdir)


def cpuset_parents(root: Path, group: str, scope: str) -> None:
    """Make the v1 cpuset groups above the sandboxes' with every CPU and memory node of the
    host (a new cpuset group starts with none, and runsc 2022 fills in only the group it is
    given, which cannot then take CPUs its parent lacks)."""
    if not root.is_dir():
        return
    cpus = (root / "cpuset.cpus").read_text().strip()
    mems = (root / "cpuset.mems").read_text().strip()
    level = root
    for part in (group, scope):
        level = level / part
        level.mkdir(exist_ok=True)
        for name, value in (("cpuset.cpus", cpus), ("cpuset.mems", mems)):
            if not (level / name).read_text().strip():
                (level / name).write_text(value)


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise EOFError("the sandbox's agent closed the connection")
        buf += chunk
    return buf


def _preload(root: Path, lib: str, base: int) -> None:
    """Add `lib` to the sandbox's /etc/ld.so.preload (through its mounted root, following no
    symlink a template may hold there: the sandbox's root owns the file and may drop the line)."""
    nofollow = os.O_NOFOLLOW | os.O_CLOEXEC
    etc = os.open(root / "etc", os.O_RDONLY | os.O_DIRECTORY | nofollow)
    try:
        fd = os.open("ld.so.preload", os.O_RDWR | os.O_CREAT | nofollow, 0o644, dir_fd=etc)
    finally:
        os.close(etc)
    with open(fd, "r+") as f:
        lines = f.read().splitlines()
        if lib in lines:
            return
        f.seek(0)
        f.write("\n".join([*lines, lib]) + "\n")
        f.truncate()
        os.fchown(f.fileno(), base, base)
        os.fchmod(f.fileno(), 0o644)
