"""Confinement steps the agent's starters share (main.py for the OCI tiers, zygote.py for the
forked start): no_new_privs and the sandbox's seccomp filter. Standard library only, and
nothing else of the agent: it runs before the agent is imported, or loaded."""

import ctypes
import os

PR_SET_NO_NEW_PRIVS = 38
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_TSYNC = 1
SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}


_libc = ctypes.CDLL(None, use_errno=True)


class ConfineError(Exception):
    pass


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_seccomp(prog: bytes) -> None:
    """Load `prog` (a classic BPF program, as bwrap's `--seccomp` takes) on this process and
    all its threads, with no_new_privs first. A filter that will not load is an error."""
    if not prog or len(prog) % 8:
        raise ConfineError("not a seccomp filter program")
    nr = SYS_SECCOMP.get(os.uname().machine)
    if nr is None:
        raise ConfineError(f"no seccomp for {os.uname().machine}")
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _SockFprog(len(prog) // 8, ctypes.addressof(buf))
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise ConfineError(f"no_new_privs: {os.strerror(ctypes.get_errno())}")
    flags = SECCOMP_FILTER_FLAG_TSYNC
    if _libc.syscall(nr, SECCOMP_SET_MODE_FILTER, flags, ctypes.byref(fprog)) != 0:
        raise ConfineError(f"cannot load the seccomp filter: {os.strerror(ctypes.get_errno())}")
