"""The seccomp filter for process-tier sandboxes, assembled as classic BPF in pure Python.

bwrap loads it (`--seccomp FD`) right before it execs the sandbox's first process, so it covers
every process and thread in the sandbox. It is a deny-list: sandboxed code keeps the syscalls a
normal Linux userland needs and loses the ones that only serve to attack the kernel or leave the
sandbox. Denied calls fail with EPERM (not a kill) so programs can report a clean error.
"""

from __future__ import annotations

import errno
import platform
import struct
from dataclasses import dataclass

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
_OFF_NR = 0
_OFF_ARCH = 4


def _off_arg_low(n: int) -> int:
    return 16 + 8 * n  # little-endian: the low 32 bits come first


_BPF_LD_W_ABS = 0x20
_BPF_JEQ_K = 0x15
_BPF_JGE_K = 0x35
_BPF_JSET_K = 0x45
_BPF_RET_K = 0x06

RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000

_ARCH = {
    "x86_64": 0xC000003E,  # AUDIT_ARCH_X86_64
    "aarch64": 0xC00000B7,  # AUDIT_ARCH_AARCH64
}
_X32_SYSCALL_BIT = 0x40000000

# Syscalls sandboxed code never needs. Numbers per architecture (x86_64, aarch64); None = absent.
DENIED: dict[str, tuple[int | None, int | None]] = {
    # mounts and filesystem views
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
    # namespaces: new user namespaces are the classic kernel attack surface
    "unshare": (272, 97),
    "setns": (308, 268),
    # cross-process inspection and tampering
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "kcmp": (312, 272),
    "pidfd_getfd": (438, 438),
    # kernel attack surface
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    # host-handle tricks (Shocker-style escapes)
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    # module loading, kexec, reboot, swap, accounting, quotas
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
    # host identity and clocks
    "sethostname": (170, 161),
    "setdomainname": (171, 162),
    "settimeofday": (164, 170),
    "clock_settime": (227, 112),
    "clock_adjtime": (305, 266),
    "adjtimex": (159, 171),
    # misc privileged or obsolete
    "syslog": (103, 116),
    "vhangup": (153, 58),
    "iopl": (172, None),
    "ioperm": (173, None),
    "uselib": (134, None),
    "lookup_dcookie": (212, 18),
    "fanotify_init": (300, 262),
    "nfsservctl": (180, 42),
    # moving another process's pages between NUMA nodes (CAP_SYS_NICE territory)
    "move_pages": (279, 239),
    "migrate_pages": (256, 238),
}
_CLONE = (56, 220)
_CLONE3 = (435, 435)
_IOCTL = (16, 29)
_SOCKET = (41, 198)
_SOCKETPAIR = (53, 199)
_PERSONALITY = (135, 92)
# mknod(path, mode, dev) and mknodat(dirfd, path, mode, dev): arm64 has only mknodat.
_MKNOD: tuple[int, int | None] = (133, None)
_MKNODAT = (259, 33)
_S_IFMT, _S_IFCHR, _S_IFBLK = 0o170000, 0o020000, 0o060000
_BPF_ALU_AND_K = 0x54

# Socket families a userland needs: unix, inet, inet6, netlink (getaddrinfo, `ip`). The rest
# (vsock to the hypervisor, AF_ALG, packet, bluetooth, ...) are attack surface, and on kernels
# with modules a socket() of an unknown family makes the kernel load its module.
ALLOWED_SOCKET_FAMILIES = (1, 2, 10, 16)
# personality(): Linux, 32-bit and uname26 personas, and the query. Not ADDR_NO_RANDOMIZE or
# READ_IMPLIES_EXEC, which switch off exploit mitigations.
ALLOWED_PERSONAS = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

# clone() flags that create namespaces; only bwrap (before the filter) may create them.
CLONE_NS_FLAGS = (
    0x10000000  # CLONE_NEWUSER
    | 0x00020000  # CLONE_NEWNS
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
    | 0x08000000  # CLONE_NEWIPC
    | 0x04000000  # CLONE_NEWUTS
    | 0x02000000  # CLONE_NEWCGROUP
    | 0x00000080  # CLONE_NEWTIME
)
# Terminal injection: TIOCSTI pushes keystrokes into another process's input.
DENIED_IOCTLS = (0x5412, 0x541C)  # TIOCSTI, TIOCLINUX


@dataclass(frozen=True)
class _Insn:
    code: int
    k: int
    jt: str | int = 0
    jf: str | int = 0
    label: str | None = None


def _assemble(insns: list[_Insn]) -> bytes:
    where = {ins.label: i for i, ins in enumerate(insns) if ins.label}
    out = bytearray()

    def rel(i: int, target: str | int) -> int:
        if isinstance(target, int):
            return target
        off = where[target] - i - 1
        if not 0 <= off < 256:
            raise ValueError(f"seccomp jump to {target} out of range")
        return off

    for i, ins in enumerate(insns):
        out += struct.pack("<HBBI", ins.code, rel(i, ins.jt), rel(i, ins.jf), ins.k)
    return bytes(out)


def build_filter(machine: str | None = None) -> bytes:
    """The filter program (an array of struct sock_filter) for this machine's architecture."""
    machine = machine or platform.machine()
    if machine not in _ARCH:
        raise RuntimeError(f"no seccomp filter for architecture {machine}")
    col = 0 if machine == "x86_64" else 1
    eperm = RET_ERRNO | errno.EPERM
    p: list[_Insn] = [
        _Insn(_BPF_LD_W_ABS, _OFF_ARCH),
        # A foreign ABI (i386 via int 0x80) would bypass every number below: kill it.
        _Insn(_BPF_JEQ_K, _ARCH[machine], jt=0, jf="kill"),
        _Insn(_BPF_LD_W_ABS, _OFF_NR),
    ]
    if machine == "x86_64":
        p.append(_Insn(_BPF_JGE_K, _X32_SYSCALL_BIT, jt="eperm", jf=0))
    for nums in DENIED.values():
        nr = nums[col]
        if nr is not None:
            p.append(_Insn(_BPF_JEQ_K, nr, jt="eperm", jf=0))
    p += [
        # clone3 passes flags in memory BPF cannot read; ENOSYS makes libc fall back to clone.
        _Insn(_BPF_JEQ_K, _CLONE3[col], jt="enosys", jf=0),
        _Insn(_BPF_JEQ_K, _CLONE[col], jt="clone", jf=0),
        _Insn(_BPF_JEQ_K, _IOCTL[col], jt="ioctl", jf=0),
        _Insn(_BPF_JEQ_K, _SOCKET[col], jt="socket", jf=0),
        _Insn(_BPF_JEQ_K, _SOCKETPAIR[col], jt="socket", jf=0),
        _Insn(_BPF_JEQ_K, _PERSONALITY[col], jt="personality", jf=0),
        _Insn(_BPF_JEQ_K, _MKNODAT[col], jt="mknodat", jf=0),
    ]
    mknod = _MKNOD[col]
    if mknod is not None:
        p.append(_Insn(_BPF_JEQ_K, mknod, jt="mknod", jf=0))
    p += [
        _Insn(_BPF_RET_K, RET_ALLOW),
        # Device nodes: the user namespace refuses them on the host kernel (no CAP_MKNOD
        # there); a runtime with a kernel of its own may not (gVisor's tmpfs makes them).
        # FIFOs, sockets and regular files stay allowed.
        _Insn(_BPF_LD_W_ABS, _off_arg_low(1), label="mknod"),
        _Insn(_BPF_JEQ_K, 0, jt="mknode", jf="mknode"),
        _Insn(_BPF_LD_W_ABS, _off_arg_low(2), label="mknodat"),
        _Insn(_BPF_ALU_AND_K, _S_IFMT, label="mknode"),
        _Insn(_BPF_JEQ_K, _S_IFCHR, jt="eperm", jf=0),
        _Insn(_BPF_JEQ_K, _S_IFBLK, jt="eperm", jf=0),
        _Insn(_BPF_RET_K, RET_ALLOW),
        _Insn(_BPF_LD_W_ABS, _off_arg_low(0), label="clone"),
        _Insn(_BPF_JSET_K, CLONE_NS_FLAGS, jt="eperm", jf=0),
        _Insn(_BPF_RET_K, RET_ALLOW),
        _Insn(_BPF_LD_W_ABS, _off_arg_low(1), label="ioctl"),
    ]
    for req in DENIED_IOCTLS:
        p.append(_Insn(_BPF_JEQ_K, req, jt="eperm", jf=0))
    p += [_Insn(_BPF_RET_K, RET_ALLOW), _Insn(_BPF_LD_W_ABS, _off_arg_low(0), label="socket")]
    for fam in ALLOWED_SOCKET_FAMILIES:
        p.append(_Insn(_BPF_JEQ_K, fam, jt="allow", jf=0))
    p += [
        _Insn(_BPF_RET_K, RET_ERRNO | errno.EAFNOSUPPORT),
        _Insn(_BPF_LD_W_ABS, _off_arg_low(0), label="personality"),
    ]
    for persona in ALLOWED_PERSONAS:
        p.append(_Insn(_BPF_JEQ_K, persona, jt="allow", jf=0))
    p += [
        _Insn(_BPF_RET_K, eperm),
        _Insn(_BPF_RET_K, RET_ALLOW, label="allow"),
        _Insn(_BPF_RET_K, eperm, label="eperm"),
        _Insn(_BPF_RET_K, RET_ERRNO | errno.ENOSYS, label="enosys"),
        _Insn(_BPF_RET_K, RET_KILL_PROCESS, label="kill"),
    ]
    return _assemble(p)
