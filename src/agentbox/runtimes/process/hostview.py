"""What a sandbox learns of the host: an allow-listed /etc, no /usr/local, and /proc files that
describe the sandbox rather than the machine and its neighbours.

The host-userland template binds the host's /usr read-only, but not its /etc: that holds what
identifies the machine (machine-id), backups of its accounts (passwd-, shadow-), package-mirror
and credential configs, and whatever an operator drops there later. The sandbox gets a generated
/etc instead: an explicit allow list of what programs read, copied (never a live view), plus
generated accounts, hosts, resolver and NSS config.

/proc is the sandbox's own procfs (its pid namespace), but some of its files are machine-wide:
memory, load, CPU counters, disk I/O of every neighbour, pressure, open file handles, the
kernel's command line, the boot id. Those are replaced by static files written at create, which
report the sandbox's own limits where programs size their work by them (MemTotal = the memory
limit, one CPU per started unit of CPU quota).

Both trees the server shares with its sandboxes (the /etc copy and the agent's code) live on
tmpfs mounts of their own, so a sandbox's mountinfo names no host path: a bind mount's "root"
field is the source's path inside its filesystem, which for a filesystem's root is just "/".
"""

from __future__ import annotations

import ctypes
import glob
import math
import os
import re
import shutil
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

PASSWD = (
    b"root:x:0:0:root:/root:/usr/sbin/nologin\n"
    b"user:x:1000:1000:sandbox user:/workspace:/bin/bash\n"
    b"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
GROUP = b"root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n"

# What of the host's /etc a sandbox sees (copies; globs allowed). What programs read, and what
# packages in /usr point back to (their symlinks into /etc: alternatives, java, python, ssl).
# Deliberately not: machine-id, the *- backups, shadow files, apt/pip/npm/git/maven configs
# (mirrors and credentials), ssh, cron, systemd, PAM, environment, ld.so.preload.
ETC_ALLOWED = (
    # the dynamic loader, the C library, locales and time
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "gai.conf",
    "host.conf",
    "locale.alias",
    "locale.conf",
    "localtime",
    "timezone",
    # shells and the login environment
    "bash.bashrc",
    "profile",
    "profile.d",
    "inputrc",
    "shells",
    "login.defs",
    "nanorc",
    "vim",
    "terminfo",
    # name databases
    "protocols",
    "services",
    "rpc",
    "ethertypes",
    "mime.types",
    "mailcap",
    "magic",
    "magic.mime",
    "manpath.config",
    # what system this is
    "os-release",
    "debian_version",
    "lsb-release",
    # TLS trust (Debian and RHEL layouts; never the private keys: they are not world-readable)
    "ssl/certs",
    "ssl/openssl.cnf",
    "ca-certificates.conf",
    "pki/tls/certs",
    "pki/tls/openssl.cnf",
    "pki/ca-trust/extracted",
    "crypto-policies/back-ends",
    # targets of /usr's symlinks into /etc
    "alternatives",
    "python3",
    "python3.*",
    "java-*",
    "perl",
    "groff",
    "fonts",
)

ETC_GENERATED: dict[str, bytes] = {
    "passwd": PASSWD,
    "group": GROUP,
    "hostname": b"sandbox\n",
    "hosts": (
        b"127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    ),
    # No DNS inside: with no nameserver line the resolver asks the sandbox's own loopback and
    # fails at once; programs reach the network through the proxy in $HTTP_PROXY.
    "resolv.conf": b"# no DNS in a sandbox: the egress proxy ($HTTP_PROXY) resolves names\n",
    # Files only: NSS modules of the host (ldap, sss, systemd) would reach for host sockets.
    "nsswitch.conf": (
        b"passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\n"
        b"protocols: files\nservices: files\nethers: files\nrpc: files\n"
    ),
}
# Present as on any system, and as unreadable: the host's root owns them, whom no sandbox is.
ETC_ROOT_ONLY: dict[str, bytes] = {
    "shadow": b"root:*:1::::::\nuser:*:1::::::\nnobody:*:1::::::\n",
    "gshadow": b"root:*::\nuser:*::\nnogroup:*::\n",
}
ETC_SYMLINKS = {"mtab": "../proc/self/mounts"}

# Sandbox paths a host path listed by the operator may not cover or sit in.
_RESERVED = ("/proc", "/dev", "/sys", "/tmp", "/workspace", "/run", "/home/user")


class HostPathError(ValueError):
    pass


def check_host_paths(paths: Iterable[str], data_dir: Path) -> tuple[str, ...]:
    """The operator's extra host paths, validated: absolute, normalised, present, and neither
    the whole host, a sandbox-owned mount, nor anything holding the server's own data."""
    out = []
    data = str(data_dir.resolve())
    for p in paths:
        if not p.startswith("/") or os.path.normpath(p) != p or p == "/":
            raise HostPathError(f"host path {p!r} must be absolute and normalised (not '/')")
        if not os.path.exists(p):
            raise HostPathError(f"host path {p} does not exist")
        if p in ("/etc", "/usr"):
            raise HostPathError(f"host path {p}: list the paths below it sandboxes should see")
        for r in (*_RESERVED, data):
            if p == r or p.startswith(r + "/") or r.startswith(p + "/"):
                raise HostPathError(f"host path {p} overlaps {r}, which sandboxes may not see")
        out.append(p)
    return tuple(out)


# ------------------------------------------------------------------------ /etc


def build_etc(dest: Path, host_paths: Sequence[str] = ()) -> None:
    """Fill the empty directory `dest` with a sandbox's /etc: the allow list and the operator's
    host paths below /etc copied from the host, plus the generated files."""
    wanted = {p for e in ETC_ALLOWED for p in glob.glob(f"/etc/{e}")}
    wanted |= {p for p in host_paths if p.startswith("/etc/")}
    visible = (*sorted(wanted), *host_paths)
    for src in sorted(wanted):
        rel = os.path.relpath(src, "/etc")
        _mkdirs(dest, os.path.dirname(rel))
        _copy(Path(src), dest / rel, visible)
    for name, data in (*ETC_GENERATED.items(), *ETC_ROOT_ONLY.items()):
        (dest / name).write_bytes(data)
        os.chmod(dest / name, 0o600 if name in ETC_ROOT_ONLY else 0o644)
    for name, target in ETC_SYMLINKS.items():
        os.symlink(target, dest / name)


def _mkdirs(dest: Path, rel: str) -> None:
    d = dest
    for part in Path(rel).parts:
        d = d / part
        if not d.is_dir():
            d.mkdir(mode=0o755)


def _copy(src: Path, dest: Path, visible: tuple[str, ...]) -> None:
    """Copy one entry. A symlink stays a symlink when the sandbox sees its target (/usr, or the
    /etc copy itself); otherwise the file it points to is copied. Only what every user may read
    is copied: the copy must never show a sandbox more than the host would."""
    if src.is_symlink():
        hop = os.path.normpath(os.path.join(src.parent, os.readlink(src)))
        target = os.path.realpath(src)
        if _sandbox_sees(hop, visible) and _sandbox_sees(target, visible):
            os.symlink(os.readlink(src), dest)
            return
        if not os.path.isfile(target):
            return  # never follow a link into a directory the sandbox does not see
        src = Path(target)
    try:
        st = os.stat(src)
    except OSError:
        return
    if not st.st_mode & stat.S_IROTH:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IXOTH:
        dest.mkdir(mode=0o755)
        for child in sorted(os.listdir(src)):
            _copy(src / child, dest / child, visible)
    elif stat.S_ISREG(st.st_mode):
        shutil.copyfile(src, dest)
        os.chmod(dest, st.st_mode & 0o755)


def _sandbox_sees(path: str, visible: tuple[str, ...]) -> bool:
    if path.startswith("/usr/") and not path.startswith("/usr/local/"):
        return True
    return any(path == v or path.startswith(v + "/") for v in visible)


# ------------------------------------------------------------------------ shared trees

_libc = ctypes.CDLL(None, use_errno=True)
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND = 32, 4096
_MNT_DETACH = 2


def fresh_tmpfs(path: Path, size_mb: int, executable: bool = False) -> None:
    """Mount a new, empty, root-owned tmpfs at `path` (noexec unless `executable`). One a
    previous server left there is detached, not emptied: the sandboxes it still serves keep
    it until they end."""
    path.mkdir(mode=0o755, exist_ok=True)
    if os.path.ismount(path):
        detach(path)
    opts = f"mode=0755,size={size_mb}m".encode()
    flags = _MS_NOSUID | _MS_NODEV | (0 if executable else _MS_NOEXEC)
    if _libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", flags, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {path}: {os.strerror(err)}")


def bind_readonly(src: Path, dest: Path) -> None:
    """Bind `src` read-only (and nosuid, nodev) at `dest`, an existing empty directory."""
    flags = _MS_BIND | _MS_NOSUID | _MS_NODEV
    if _libc.mount(str(src).encode(), str(dest).encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bind {src} on {dest}: {os.strerror(err)}")
    # A bind takes the read-only flag only on a remount of itself.
    flags |= _MS_REMOUNT | _MS_RDONLY
    if _libc.mount(b"none", str(dest).encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        detach(dest)
        raise OSError(err, f"remount {dest} read-only: {os.strerror(err)}")


def detach(path: Path) -> None:
    if _libc.umount2(str(path).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {path}: {os.strerror(err)}")


# ------------------------------------------------------------------------ CPUs


def pick_cpus(count: float, allowed: Sequence[int], taken: Iterable[Sequence[int]]) -> list[int]:
    """ceil(count) CPUs of `allowed`, the least taken by other sandboxes first (all of them
    when the quota covers them all)."""
    n = min(len(allowed), max(1, math.ceil(count)))
    load = dict.fromkeys(allowed, 0)
    for cpus in taken:
        for c in cpus:
            if c in load:
                load[c] += 1
    return sorted(sorted(allowed, key=lambda c: (load[c], c))[:n])


# ------------------------------------------------------------------------ /proc

# Shown instead of the machine's: no neighbour's I/O, load, pressure or boot parameters.
_STATIC_PROC = {
    "/proc/loadavg": b"0.00 0.00 0.00 1/1 1\n",
    "/proc/diskstats": b"",
    "/proc/partitions": b"major minor  #blocks  name\n\n",
    "/proc/swaps": b"Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n",
    "/proc/cmdline": b"ro quiet\n",
}
# Hidden altogether, as on a kernel without pressure stall information.
PROC_MASKED_DIRS = ("/proc/pressure",)
_KB_KEPT = ("Hugepagesize", "VmallocTotal")  # constants of the kernel, not of the load


@dataclass(frozen=True)
class ProcView:
    """The host facts a sandbox's /proc files are made from, read once per server."""

    cpu_blocks: dict[int, str]  # /proc/cpuinfo, per processor
    meminfo: list[tuple[str, int, str]]  # key, host value, unit
    btime: int
    file_max: int

    @classmethod
    def of_host(cls) -> ProcView:
        blocks = {}
        for block in Path("/proc/cpuinfo").read_text().split("\n\n"):
            m = re.match(r"processor\s*:\s*(\d+)", block)
            if m:
                blocks[int(m[1])] = block.strip("\n")
        meminfo = []
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            value, _, unit = rest.strip().partition(" ")
            meminfo.append((key, int(value), unit))
        m = re.search(r"^btime (\d+)", Path("/proc/stat").read_text(), re.M)
        btime = int(m[1]) if m else 0
        file_max = int(Path("/proc/sys/fs/file-max").read_text())
        return cls(blocks, meminfo, btime, file_max)

    def files(self, memory_bytes: int, cpus: Sequence[int], boot_id: str) -> dict[str, bytes]:
        """Sandbox path -> content of every /proc file replaced (only those this kernel has)."""
        out = {
            **_STATIC_PROC,
            "/proc/meminfo": self._meminfo(memory_bytes // 1024),
            "/proc/cpuinfo": self._cpuinfo(cpus),
            "/proc/stat": self._stat(cpus),
            "/proc/sys/fs/file-nr": f"0\t0\t{self.file_max}\n".encode(),
            "/proc/sys/kernel/random/boot_id": f"{boot_id}\n".encode(),
        }
        return {p: data for p, data in out.items() if os.path.exists(p)}

    def _meminfo(self, limit_kb: int) -> bytes:
        # The host's keys (parsers expect them all), the sandbox's figures: its limit free.
        lines = []
        for key, value, unit in self.meminfo:
            if key in ("MemTotal", "MemFree", "MemAvailable", "CommitLimit"):
                value = limit_kb
            elif key not in _KB_KEPT:
                value = 0
            lines.append(f"{key + ':':<15} {value:>8}" + (f" {unit}" if unit else ""))
        return ("\n".join(lines) + "\n").encode()

    def _cpuinfo(self, cpus: Sequence[int]) -> bytes:
        blocks = []
        for c in cpus:
            block = self.cpu_blocks.get(c, f"processor\t: {c}")
            for field in ("siblings", "cpu cores"):
                block = re.sub(rf"^({field}\s*:) \d+$", rf"\g<1> {len(cpus)}", block, flags=re.M)
            blocks.append(block)
        return ("\n\n".join(blocks) + "\n\n").encode()

    def _stat(self, cpus: Sequence[int]) -> bytes:
        # glibc counts these cpuN lines for sysconf(_SC_NPROCESSORS_ONLN) when /sys is absent.
        zeros = " 0" * 10
        lines = [f"cpu {zeros}", *(f"cpu{c}{zeros}" for c in cpus)]
        lines += ["intr 0", "ctxt 0", f"btime {self.btime}", "processes 0"]
        lines += ["procs_running 1", "procs_blocked 0", "softirq" + " 0" * 11]
        return ("\n".join(lines) + "\n").encode()
