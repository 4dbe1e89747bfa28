"""The seccomp program: well-formed, and it really blocks (loaded by a real bwrap)."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys

import pytest

from agentbox.runtimes.process.seccomp import DENIED, RET_ALLOW, build_filter


def test_program_shape() -> None:
    prog = build_filter("x86_64")
    assert len(prog) % 8 == 0
    insns = [struct.unpack("<HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    assert insns[0] == (0x20, 0, 0, 4)  # load arch first
    assert any(k == RET_ALLOW for code, _, _, k in insns if code == 0x06)
    assert len(insns) < 4096
    assert "ptrace" in DENIED and "unshare" in DENIED and "io_uring_setup" in DENIED
    assert build_filter("aarch64") != prog
    with pytest.raises(RuntimeError):
        build_filter("sparc")


PROBE = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def probe(nr, *args):
    r = libc.syscall(nr, *args)
    return errno.errorcode.get(ctypes.get_errno(), "OK") if r < 0 else "OK"
print("unshare", probe(272, 0x10000000))
print("ptrace", probe(101, 0, 0, 0, 0))
print("bpf", probe(321, 0, 0, 0))
print("io_uring_setup", probe(425, 1, 0))
print("clone_newuser", probe(56, 0x10000000 | 17, 0, 0, 0, 0))
print("getpid", probe(39))
import socket
def sock(fam, kind):
    try:
        socket.socket(fam, kind).close()
        return "OK"
    except OSError as e:
        return errno.errorcode[e.errno]
print("af_inet", sock(socket.AF_INET, socket.SOCK_STREAM))
print("af_unix", sock(socket.AF_UNIX, socket.SOCK_STREAM))
print("af_netlink", sock(socket.AF_NETLINK, socket.SOCK_DGRAM))
print("af_vsock", sock(40, socket.SOCK_STREAM))
print("af_alg", sock(38, socket.SOCK_SEQPACKET))
print("socketpair_inet6", probe(53, 10, 1, 0, 0))
print("personality_query", probe(135, 0xFFFFFFFF))
print("personality_no_aslr", probe(135, 0x0040000))
# Device nodes are refused, FIFOs are not (here the caller is host root: only the filter stops it)
import sys
d = sys.argv[1].encode()
print("mknod_chr", probe(133, d + b"/c", 0o020600, os.makedev(1, 3)))
print("mknodat_blk", probe(259, -100, d + b"/b", 0o060600, os.makedev(7, 0)))
print("mknodat_fifo", probe(259, -100, d + b"/f", 0o010600, 0))
"""


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_filter_blocks_under_bwrap(tmp_path) -> None:
    bpf = tmp_path / "f.bpf"
    bpf.write_bytes(build_filter())
    nodes = tmp_path / "nodes"  # where the probe tries its device nodes (and a FIFO)
    nodes.mkdir()
    with open(bpf, "rb") as f:
        out = subprocess.run(
            ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
             "--bind", str(nodes), str(nodes), "--seccomp",
             str(f.fileno()), "--", sys.executable, "-c", PROBE, str(nodes)],
            pass_fds=[f.fileno()], capture_output=True, text=True, timeout=30,
        )
    results = dict(line.split() for line in out.stdout.splitlines())
    assert results == {
        "unshare": "EPERM", "ptrace": "EPERM", "bpf": "EPERM", "io_uring_setup": "EPERM",
        "clone_newuser": "EPERM", "getpid": "OK",
        "af_inet": "OK", "af_unix": "OK", "af_netlink": "OK",
        "af_vsock": "EAFNOSUPPORT", "af_alg": "EAFNOSUPPORT",
        # socketpair(AF_INET6) passes the filter and fails in the kernel (EOPNOTSUPP/EFAULT)
        "socketpair_inet6": results.get("socketpair_inet6"),
        "personality_query": "OK", "personality_no_aslr": "EPERM",
        "mknod_chr": "EPERM", "mknodat_blk": "EPERM", "mknodat_fifo": "OK",
    }, out.stderr
    assert results["socketpair_inet6"] != "EAFNOSUPPORT"
