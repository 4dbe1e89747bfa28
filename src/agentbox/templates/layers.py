"""The filesystem work of a template build: the Debian base, overlay steps, flattening.

Every command here runs as real root, each in its own mount and pid namespace
(`unshare --mount --pid --kill-child` under `setpriv --pdeathsig KILL`): the overlay mounts a
step needs exist only inside that namespace, so they vanish when the step ends however it
ends (failure, exception, the server being SIGKILLed) and nothing is ever left mounted on the
host. A step's output is streamed line by line to a callback as it is produced.

- base: `mmdebstrap --mode=root` into an empty directory, with the host's apt caches bound in.
- apt / pip / files: an overlay (the layers so far as lowerdirs, an empty upper) mounted in
  the namespace; the step's script runs in that tree under bwrap as root with the host
  network; the upper directory, once unmounted, is the new layer.
- flatten: the layers mounted read-only as one overlay and copied (`cp -a`) into a plain tree.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agentbox.vocab import ROOT_CAPS, USER_UID, USER_VENV

# Kill the whole step if the thread that started it dies, and give it private mounts and pids.
ISOLATE = (
    "setpriv", "--pdeathsig", "KILL", "--",
    "unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child", "--",
)  # fmt: skip
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Downloads in a build trust what the host trusts (a site's TLS-inspecting proxy, a private
# mirror's CA): the host's bundle is bound in for the build only and is in no layer.
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BUILD_CA_PATH = "/tmp/agentbox-host-ca.crt"
# The host's proxy settings, if it has any, apply to a build's downloads too.
PROXY_VARS = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")
# Overlay features that tie an upper dir to the exact lowers it was made on are off: a layer
# is reused under other uppers and flattened later, so it must stand on its own.
OVERLAY_OPTS = "index=off,redirect_dir=off,metacopy=off"
TAIL_LINES = 25
# A step runs package code (maintainer scripts, pip's setup.py) as real root, so it keeps only
# what installing files needs, the same set a default Docker container has minus MKNOD and
# NET_RAW: no mounting, no devices, no modules, no network configuration.
BUILD_CAPS = (*ROOT_CAPS, "CAP_AUDIT_WRITE")  # a sandbox's root's set, plus audit writes
# Empty mount points every sandbox needs in its root (the runtime mounts over them).
MOUNT_POINTS = {
    "workspace": 0o755,
    ".agentbox": 0o755,
    "tmp": 0o1777,
    "proc": 0o555,
    "dev": 0o755,
    "run": 0o755,
    "var/tmp": 0o1777,
}
ETC_HOSTS = "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"
REQUIRED_FILES = ("usr/bin/python3", "bin/bash", "etc/ssl/certs/ca-certificates.crt")

# mmdebstrap hooks run with `$1` = the target; the cache paths come through the environment so
# no path is ever spliced into shell text. The binds live in the step's private mount namespace.
_BASE_SETUP_HOOK = (
    'mkdir -p "$1/var/cache/apt/archives" "$1/var/lib/apt/lists" && '
    'mount --bind "$AGENTBOX_APT_ARCHIVES" "$1/var/cache/apt/archives" && '
    'mount --bind "$AGENTBOX_APT_LISTS" "$1/var/lib/apt/lists"'
)
_BASE_CUSTOMIZE_HOOK = 'umount "$1/var/cache/apt/archives" "$1/var/lib/apt/lists"'

# Runs as pid 1 of the step's namespace: mount the overlay, run the command, unmount.
_OVERLAY_SHELL = (
    'mount -t overlay agentbox-build -o "$1" "$2" || exit 111; m=$2; shift 2; '
    '"$@"; rc=$?; umount "$m" || rc=112; exit $rc'
)
_FLATTEN_SHELL = (
    'mount -t overlay agentbox-flatten -o "ro,lowerdir=$1" "$2" || exit 111; '
    'cp -a "$2/." "$3/"; rc=$?; umount "$2" || rc=112; exit $rc'
)

APT_SCRIPT = r"""set -eu
umask 022
# Services must not start during a build (Debian's policy-rc.d convention).
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
opts="-q -o Acquire::Languages=none"
opts="$opts ${AGENTBOX_HOST_CA:+-o Acquire::https::CAInfo=$AGENTBOX_HOST_CA}"
# A failed index download is an error, not a build on silently stale lists.
apt-get $opts --error-on=any update
apt-get $opts -y install --no-install-recommends "$@"
# The archives and lists are bind mounts of the host's cache; only apt's binary caches are here.
rm -f /var/cache/apt/*.bin
"""

# pip's HTTP cache only works when the index sends caching headers (some proxies strip them),
# so downloads go through a wheelhouse: `pip wheel` resolves against the index but fetches only
# files the wheelhouse lacks (and builds sdists once), then the install is offline from it.
PIP_SCRIPT = r"""set -eu
umask 022
wheelhouse=/tmp/agentbox-pip-cache/wheelhouse
mkdir -p "$wheelhouse"
python3 -m pip wheel --wheel-dir "$wheelhouse" "$@"
python3 -m pip install --no-index --find-links "$wheelhouse" --no-warn-script-location "$@"
"""

FILES_SCRIPT = r"""set -eu
umask 022
i=0
while [ $# -gt 0 ]; do
  dest=$1 mode=$2
  shift 2
  mkdir -p -- "$(dirname -- "$dest")"
  install -m "$mode" -T -- "/tmp/agentbox-files/$i" "$dest"
  i=$((i + 1))
done
"""


def missing_tools(names: Sequence[str]) -> list[str]:
    return [n for n in names if shutil.which(n, path=HOST_PATH) is None]


class StepFailed(Exception):
    """A step's command failed; `tail` holds its last output lines."""

    def __init__(self, message: str, tail: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.tail = list(tail)


@dataclass
class Output:
    """Where a step's output goes: each line to `emit` as it comes, the last ones kept."""

    emit: Callable[[str], None]
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))

    def line(self, text: str) -> None:
        self.tail.append(text)
        self.emit(text)


@dataclass(frozen=True)
class Bind:
    """A host path bound into a step's tree: `--bind`, or `--ro-bind` when read_only."""

    source: Path
    dest: str
    read_only: bool = False


def run(
    argv: Sequence[str], out: Output, env: dict[str, str] | None = None, cwd: Path | None = None
) -> None:
    """Run `argv`, streaming its merged stdout/stderr to `out`; StepFailed unless it exits 0.

    Any exception while it runs (the log callback raising, KeyboardInterrupt) kills it; its
    namespaces, and the mounts in them, go with it."""
    full_env = {"PATH": HOST_PATH, "LANG": "C.UTF-8", "HOME": "/root"}
    full_env.update({k: v for k, v in os.environ.items() if k in PROXY_VARS})
    full_env.update(env or {})
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=full_env,
        cwd=cwd,
        umask=0o022,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            # A '\r' redraws a progress line in a terminal: keep what a terminal would show.
            parts = [p for p in raw.decode(errors="replace").rstrip("\r\n").split("\r") if p]
            if parts:
                out.line(parts[-1])
        rc = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if rc != 0:
        raise StepFailed(f"exit status {rc}", out.tail)


def make_base(
    target: Path,
    suite: str,
    variant: str,
    mirror: str,
    include: Sequence[str],
    archives: Path,
    lists: Path,
    out: Output,
) -> None:
    """A Debian tree in the empty directory `target`, with `include` installed."""
    argv = [
        *ISOLATE,
        "mmdebstrap",
        "--mode=root",
        f"--variant={variant}",
        f"--include={','.join(include)}",
        # The downloaded .debs stay in the (bound) archive cache for the next build.
        "--skip=essential/unlink",
        '--aptopt=Acquire::Retries "3"',
        f"--setup-hook={_BASE_SETUP_HOOK}",
        f"--customize-hook={_BASE_CUSTOMIZE_HOOK}",
        suite,
        str(target),
        mirror,
    ]
    env = {"AGENTBOX_APT_ARCHIVES": str(archives), "AGENTBOX_APT_LISTS": str(lists)}
    run(argv, out, env=env)
    # mmdebstrap copies in the host's resolv.conf and hostname and creates device nodes:
    # none of that belongs in an image. An empty resolv.conf stays as a bind target; /etc/hosts
    # (which no package ships) makes `localhost` resolve for start and readiness commands.
    shutil.rmtree(target / "dev")
    (target / "dev").mkdir(mode=0o755)
    for name, text in (
        ("etc/resolv.conf", ""),
        ("etc/hostname", "sandbox\n"),
        ("etc/hosts", ETC_HOSTS),
    ):
        path = target / name
        if path.is_symlink() or path.exists():
            path.unlink()
        path.write_text(text)
        path.chmod(0o644)


def run_in_overlay(
    layers_dir: Path,
    lowers: Sequence[str],
    scratch: Path,
    script: str,
    args: Sequence[str],
    binds: Sequence[Bind],
    out: Output,
) -> Path:
    """Run `bash -c script args...` as root in the layers `lowers` (names in `layers_dir`,
    topmost first) plus an empty upper under `scratch`; returns that upper directory."""
    upper, work, merged = scratch / "upper", scratch / "work", scratch / "merged"
    for d in (upper, work, merged):
        d.mkdir(mode=0o755)
    upper.chmod(0o755)  # the upper's root becomes the image's /
    # Relative paths (cwd = layers_dir) keep the mount options short and free of the store
    # root's own characters (',' or ':' would split the option string).
    rel = os.path.relpath
    opts = (
        f"lowerdir={':'.join(lowers)},upperdir={rel(upper, layers_dir)},"
        f"workdir={rel(work, layers_dir)},{OVERLAY_OPTS}"
    )
    bwrap = [
        "bwrap",
        "--bind", str(merged), "/",
        "--proc", "/proc",
        # Host-wide knobs a root process could turn without any capability.
        "--ro-bind", "/proc/sys", "/proc/sys",
        "--dev", "/dev",
        "--perms", "1777", "--tmpfs", "/tmp",  # apt verifies signatures as _apt, in /tmp
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--hostname", "agentbox-build",
        "--die-with-parent", "--new-session",
        "--cap-drop", "ALL",
    ]  # fmt: skip
    for cap in BUILD_CAPS:
        bwrap += ["--cap-add", cap]
    if Path("/proc/sysrq-trigger").exists():
        bwrap += ["--ro-bind", "/dev/null", "/proc/sysrq-trigger"]
    if Path("/etc/resolv.conf").exists():
        bwrap += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
    for b in binds:
        bwrap += ["--ro-bind" if b.read_only else "--bind", str(b.source), b.dest]
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "DEBIAN_FRONTEND": "noninteractive",
        "APT_LISTCHANGES_FRONTEND": "none",
        # pip: install into Debian's python3 (/usr/local/lib/python3.X/dist-packages), quietly;
        # environment rather than flags so older pips that lack them just ignore them.
        "PIP_BREAK_SYSTEM_PACKAGES": "1",
        "PIP_ROOT_USER_ACTION": "ignore",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_PROGRESS_BAR": "off",
        "PIP_CACHE_DIR": "/tmp/agentbox-pip-cache",
    }
    env.update({k: v for k, v in os.environ.items() if k in PROXY_VARS})
    if HOST_CA_BUNDLE.is_file():
        bwrap += ["--ro-bind", str(HOST_CA_BUNDLE), BUILD_CA_PATH]
        env.update(AGENTBOX_HOST_CA=BUILD_CA_PATH, PIP_CERT=BUILD_CA_PATH)
    bwrap.append("--clearenv")
    for k, v in env.items():
        bwrap += ["--setenv", k, v]
    bwrap += ["--chdir", "/", "--", "/bin/bash", "-c", script, "agentbox-step", *args]
    argv = [*ISOLATE, "sh", "-c", _OVERLAY_SHELL, "agentbox-overlay", opts, str(merged), *bwrap]
    run(argv, out, cwd=layers_dir)
    return upper


def flatten(layers_dir: Path, lowers: Sequence[str], dest: Path, out: Output) -> None:
    """Copy the union of `lowers` (topmost first) into the empty directory `dest`."""
    if len(lowers) == 1:
        # One layer is a plain tree already (an overlay needs two lowers to mount read-only).
        run([*ISOLATE, "cp", "-a", f"{layers_dir / lowers[0]}/.", f"{dest}/"], out)
    else:
        merged = dest.parent / f"{dest.name}.merged"
        merged.mkdir()
        try:
            argv = [*ISOLATE, "sh", "-c", _FLATTEN_SHELL, "agentbox-flatten",
                    ":".join(lowers), str(merged), str(dest)]  # fmt: skip
            run(argv, out, cwd=layers_dir)
        finally:
            merged.rmdir()
    dest.chmod(0o755)
    for rel_path, mode in MOUNT_POINTS.items():
        p = dest / rel_path
        if p.is_symlink():
            p.unlink()  # a mount point must be a real directory, not a link out of the tree
        p.mkdir(mode=mode, parents=True, exist_ok=True)
        p.chmod(mode)
    for name in ("etc/passwd", "etc/group"):
        p = dest / name
        if not p.is_file():
            raise StepFailed(f"the image has no /{name} (the sandbox overlays it)")
    for name in REQUIRED_FILES:
        if not _exists_in(dest, name):
            raise StepFailed(f"the image has no /{name}; a sandbox cannot start without it")
    make_user_venv(dest)
    quick_login_uid(dest)


# Debian's /etc/profile asks `id` for the uid: a fork and an exec in every login shell, which
# is every command (`bash -l -c`): ~3 ms of a 5 ms `true` on the process tier, more on gVisor.
# Bash knows it already ($EUID, read-only); other shells have no EUID and still ask `id`.
_PROFILE_UID = '"$(id -u)"'
PROFILE_UID_QUICK = '"${EUID:-$(id -u)}"'


def quick_login_uid(root: Path) -> None:
    """/etc/profile reads the uid from bash's $EUID where it asked `id` (the same answer)."""
    path = root / "etc" / "profile"
    if path.is_symlink() or not path.is_file():
        return
    text = path.read_text(errors="surrogateescape")
    if _PROFILE_UID not in text:
        return
    st = path.stat()
    tmp = path.with_name(".profile.agentbox")
    tmp.write_text(text.replace(_PROFILE_UID, PROFILE_UID_QUICK), errors="surrogateescape")
    os.chown(tmp, st.st_uid, st.st_gid)
    tmp.chmod(stat.S_IMODE(st.st_mode))
    os.replace(tmp, path)


def _exists_in(root: Path, rel_path: str) -> bool:
    """Whether `rel_path` exists in the tree `root`, resolving symlinks the way a chroot would
    (an absolute link starts again at the tree's root; '..' never leaves it)."""
    resolved: list[str] = []  # components walked so far: real directories, never links
    todo = [x for x in rel_path.split("/") if x not in ("", ".")]
    hops = 0
    while todo:
        part = todo.pop(0)
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        p = root.joinpath(*resolved, part)
        if p.is_symlink():
            hops += 1
            if hops > 40:
                return False
            target = os.readlink(p)
            if target.startswith("/"):
                resolved = []
            todo = [x for x in target.split("/") if x not in ("", ".")] + todo
            continue
        if not p.exists():
            return False
        resolved.append(part)
    return True


# The sandbox user's Python environment in a built template: on PATH first, owned by `user`
# (uid 1000, which the sandbox's idmap makes its own), seeing the system's packages. So `pip
# install X` works without flags (Debian's PEP 668 marker applies to the system interpreter,
# not to a virtual environment), console scripts land on PATH, and the code interpreter's
# kernel, started from it, imports what `%pip install` adds.
VENV = USER_VENV
VENV_UID = USER_UID
PIP_SHIM = """#!/{venv}/bin/python3
import re
import sys

from pip._internal.cli.main import main

if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit(main())
"""


def make_user_venv(root: Path) -> None:
    """Lay out /opt/venv as `python3 -m venv --system-site-packages` would (without running
    the image's python): pyvenv.cfg, bin/python3 -> /usr/bin/python3, pip entry points when
    the image has pip, an empty site-packages; all owned by uid 1000."""
    target = (
        os.readlink(root / "usr/bin/python3") if (root / "usr/bin/python3").is_symlink() else ""
    )
    version = target.removeprefix("python") if target.startswith("python3.") else ""
    if not version:
        return  # not Debian's layout: no environment rather than a wrong one
    venv = root / VENV
    if venv.exists():
        shutil.rmtree(venv)
    (venv / "bin").mkdir(parents=True)
    (venv / f"lib/python{version}/site-packages").mkdir(parents=True)
    (venv / "lib64").symlink_to("lib")
    (venv / "pyvenv.cfg").write_text(
        f"home = /usr/bin\ninclude-system-site-packages = true\nversion = {version}\n"
        f"executable = /usr/bin/python{version}\n"
    )
    for name in ("python3", "python", f"python{version}"):
        (venv / "bin" / name).symlink_to("/usr/bin/python3")
    has_pip = any((root / "usr/lib/python3/dist-packages/pip").glob("__init__.py"))
    if has_pip:
        for name in ("pip", "pip3", f"pip{version}"):
            shim = venv / "bin" / name
            shim.write_text(PIP_SHIM.format(venv=VENV))
            shim.chmod(0o755)
    for d, dirs, files in os.walk(venv):
        for name in [".", *dirs, *files]:
            os.chown(os.path.join(d, name), VENV_UID, VENV_UID, follow_symlinks=False)


def tree_size(root: Path) -> int:
    """Disk use of a tree in bytes (allocated blocks, each hardlinked inode once)."""
    total = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if st.st_nlink > 1:
                ident = (st.st_dev, st.st_ino)
                if ident in seen:
                    continue
                seen.add(ident)
            total += st.st_blocks * 512
    return total


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
