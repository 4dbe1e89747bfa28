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

import ctypes
import json
import os
import resource
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, ClassVar

from agentbox.runtimes.base import RuntimeError_, SandboxSpec
from agentbox.runtimes.oci import bundle
from agentbox.runtimes.oci.bundle import CHANNEL_DIR, CHANNEL_SOCKET, Bundle
from agentbox.runtimes.process import hostview, rootfs
from agentbox.runtimes.process.runtime import (
    AGENT_MOUNT,
    MERGED_USR_LINKS,
    SANDBOX_PYTHON,
    USR_LOCAL,
    ProcessRuntime,
    proc_start_time,
    sandbox_env,
)
from agentbox.runtimes.uids import BLOCK

SECCOMP_FILE = "seccomp.bpf"  # in the agent tree, which every sandbox binds read-only
CHANNEL = "chan"  # below a sandbox's bind dir: bound at CHANNEL_DIR
FILES = "files"  # below a sandbox's bind dir: generated files the bundle binds in
USERNS = "userns"  # below a sandbox's bind dir: the user namespace, bound while runc joins it
OCI_LOG = "oci.log"
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
    AGENT_MOUNT,
    "/opt",
    "/root",
]
_MS_BIND = 4096
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


class OciRuntime(ProcessRuntime):
    """The process runtime's sandboxes, started by an OCI runtime binary."""

    binary: ClassVar[str]
    package: ClassVar[str]  # the Debian package that has it

    def _require_tools(self) -> None:
        if shutil.which(self.binary) is None:
            raise RuntimeError_(
                f"{self.binary} is not installed: apt-get install {self.package} "
                "(or scripts/install.sh)"
            )
        if os.geteuid() != 0:
            raise RuntimeError_(f"the {self.name} runtime needs a server running as root")
        if not rootfs.supported():
            raise RuntimeError_(f"the {self.name} runtime needs idmapped mounts (x86_64, arm64)")

    def __init__(self, data_dir: Path, **config: Any) -> None:
        super().__init__(data_dir=data_dir, **config)
        # The process tier's own filter: the agent loads it on itself (main.py --seccomp).
        (self.agent_dir / SECCOMP_FILE).write_bytes(self.seccomp)
        os.chmod(self.agent_dir / SECCOMP_FILE, 0o444)
        self.state_root = self.bind_root / "oci"  # the binary's --root: its container states
        self.state_root.mkdir(mode=0o700, exist_ok=True)

    def capabilities(self) -> dict[str, Any]:
        return {**super().capabilities(), "oci_runtime": self.binary, "version": self._version()}

    def _version(self) -> str:
        try:
            out = subprocess.run(
                [self.binary, "--version"], capture_output=True, text=True, timeout=10
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return "unknown"
        return out.splitlines()[0] if out else "unknown"

    def _global_args(self, log: Path) -> list[str]:
        return [self.binary, "--root", str(self.state_root), "--log", str(log)]

    # ------------------------------------------------------------------ start

    def _spawn(
        self, spec: SandboxSpec, sdir: Path, ws: Path, uid: int, cpus: list[int], ns: int
    ) -> dict[str, Any]:
        sid = spec.sandbox_id
        bind_dir = self.bind_root / sid
        chan = bind_dir / CHANNEL
        chan.mkdir(mode=0o700)
        os.chown(chan, uid, uid)  # the sandbox's root binds the agent's socket in it
        files = bind_dir / FILES
        files.mkdir(mode=0o755)
        sock = chan / "agent.sock"
        config = self._bundle(spec, bind_dir, ws, uid, cpus).config()
        bundle_dir = sdir / "bundle"
        bundle_dir.mkdir(mode=0o700)
        (bundle_dir / "config.json").write_text(json.dumps(config))
        userns_file = bind_dir / USERNS
        userns_file.touch(mode=0o600)
        _bind(f"/proc/self/fd/{ns}", userns_file)
        pid_file = sdir / "init.pid"
        limits = self._rlimits(spec.resources)

        def inherited_limits() -> None:
            # The sandbox inherits them from the binary: it cannot set them on the sandbox's
            # init itself (a prlimit on another uid needs CAP_SYS_RESOURCE, which root may not
            # have), and the binary, run as root, is exempt from RLIMIT_NPROC.
            for res, value in limits:
                resource.setrlimit(res, (value, value))

        try:
            with open(sdir / "runtime.log", "ab") as log:
                argv = [*self._global_args(sdir / OCI_LOG), "run", "--detach"]
                argv += ["--pid-file", str(pid_file), "--bundle", str(bundle_dir), sid]
                done = subprocess.run(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    timeout=60,
                    cwd=str(bundle_dir),
                    preexec_fn=inherited_limits,
                )
        except subprocess.TimeoutExpired:
            raise RuntimeError_(f"{self.binary} did not start the sandbox within 60 s") from None
        finally:
            _unbind(userns_file)  # the sandbox holds its namespace now
        if done.returncode != 0:
            raise RuntimeError_(f"{self.binary} could not start the sandbox: {_tail(sdir)}")
        init_pid = int(pid_file.read_text())
        init_start = proc_start_time(init_pid)
        self._wait_for_agent(sock, lambda: proc_start_time(init_pid) == init_start, sdir)
        self._hold_netns(sid, init_pid)
        return {
            "oci": self.binary,
            "init_pid": init_pid,
            "init_start": init_start,
            "socket": str(sock),
        }

    def _bundle(
        self, spec: SandboxSpec, bind_dir: Path, ws: Path, uid: int, cpus: list[int]
    ) -> Bundle:
        r = spec.resources
        writable_root = self._writable_root(spec)
        if spec.rootfs and not writable_root:
            raise RuntimeError_(f"the {self.name} runtime runs built templates copy-on-write only")
        var_tmp = bool(spec.rootfs) and not Path(spec.rootfs or "", "var/tmp").is_symlink()
        mounts = bundle.base_mounts(r.tmp_mb, var_tmp)
        root = bind_dir / rootfs.ROOT  # the overlay the server mounted, or a skeleton
        if not writable_root:
            self._skeleton(root, uid)
            mounts += self._host_userland_mounts()
        mounts += [
            bundle.bind(ws, "/workspace", writable=True),
            bundle.bind(self.agent_dir, AGENT_MOUNT),
            bundle.mount(
                CHANNEL_DIR, "bind", str(bind_dir / CHANNEL), "bind", "rw", "nosuid", "nodev",
                "noexec",
            ),
        ]  # fmt: skip
        masked = [d for d in hostview.PROC_MASKED_DIRS if os.path.isdir(d)]
        files = bind_dir / FILES
        for n, (path, data) in enumerate(self._proc_files(spec, cpus).items()):
            if path in bundle.PROC_BINDABLE:
                mounts.append(bundle.bind(_write(files / f"proc{n}", data), path))
            else:
                masked.append(path)  # an OCI runtime binds nothing else below /proc
        for n, (path, data) in enumerate(spec.files.items()):
            mounts.append(bundle.bind(_write(files / f"file{n}", data), path))
        args = [SANDBOX_PYTHON, "-E", "-s", "-S", f"{AGENT_MOUNT}/main.py", "--init"]
        args += ["--seccomp", f"{AGENT_MOUNT}/{SECCOMP_FILE}", "--listen-path", CHANNEL_SOCKET]
        args += ["--user", self._default_user(spec)]
        if writable_root:
            args.append("--writable-root")
        args += self._agent_flags({})
        return Bundle(
            root=root,
            root_readonly=not writable_root,
            args=args,
            env=sandbox_env(spec),
            cwd=spec.workdir,
            resources=r,
            uid_base=uid,
            size=BLOCK,
            userns_path=bind_dir / USERNS,
            cgroups_path=f"/{self.layout.cgroup_group}/{self.layout.scope}/{spec.sandbox_id}",
            cpus=cpus if len(cpus) < len(self.cpus) else None,
            mounts=mounts,
            masked=masked,
        )

    def _skeleton(self, root: Path, uid: int) -> None:
        """The host userland's root: the mount points, owned by the sandbox's root as bwrap's
        own root is, then mounted read-only by the runtime."""
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
        pid, start = state.get("init_pid"), state.get("init_start")
        if isinstance(pid, int) and start is not None and proc_start_time(pid) == start:
            # The pid namespace's init: the kernel ends everything else in it.
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not self._kill_everything(sid):
            raise RuntimeError_(f"could not kill every process of sandbox {sid}")
        sdir = self.root / sid
        log = sdir / OCI_LOG if sdir.is_dir() else Path(os.devnull)
        subprocess.run(
            [*self._global_args(log), "delete", "--force", sid],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
        )
        shutil.rmtree(self.state_root / sid, ignore_errors=True)  # what delete left, if any
        # The binary joins the sandbox to every controller; ours are removed by destroy.
        if not self.cgroups.sweep(sid):
            raise RuntimeError_(f"could not remove the cgroups of sandbox {sid}")

    async def list_sandboxes(self) -> set[str]:
        ids = await super().list_sandboxes()
        if self.state_root.is_dir():
            ids |= {p.name for p in self.state_root.iterdir() if p.name.startswith("sbx_")}
        ids |= self.cgroups.list_ids(everywhere=True)
        return ids


class ContainerRuntime(OciRuntime):
    """`container`: an OCI container run by runc."""

    name: ClassVar[str] = "container"
    host_namespace: ClassVar[str] = "container"
    binary: ClassVar[str] = "runc"
    package: ClassVar[str] = "runc"


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
