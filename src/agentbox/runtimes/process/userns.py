"""A sandbox's user namespace: its own 0–65535 mapped onto its block of host uids.

bwrap alone can map one id (it runs unprivileged), so the server makes the namespace and bwrap
joins it (`--userns FD`). A short-lived helper, started as the block's first host uid so that
the namespace is owned by the sandbox and not by host root, unshares a user namespace; the
server (host root, which may map any range) writes its uid and gid maps; the helper, now the
namespace's root with full capabilities *in it*, sets the namespace's nesting limit to 0 and
exits. The server keeps only a descriptor; bwrap checks (`--assert-userns-disabled`) that no
user namespace can be made inside. Nothing holds the namespace after bwrap started but the
sandbox's own processes: no holder process to find, adopt or kill after a restart.

The sandbox's root (uid 0 inside) gets only `ROOT_CAPS`, enough to administer its own files and
processes; the kernel honours them only for ids mapped in the namespace, so they reach nothing
of the host or of another sandbox (those ids are unmapped there).
"""

from __future__ import annotations

import os
import subprocess

from agentbox.runtimes.uids import BLOCK
from agentbox.vocab import ROOT_CAPS, USER_UID, USER_VENV

__all__ = ["ROOT_CAPS", "USER_UID", "USER_VENV"]  # the sandbox model's, used with these

CAP_NUMBERS = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_FOWNER": 3,
    "CAP_FSETID": 4,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
    "CAP_SETPCAP": 8,
    "CAP_NET_BIND_SERVICE": 10,
    "CAP_SYS_CHROOT": 18,
    "CAP_SETFCAP": 31,
}
ROOT_CAP_MASK = sum(1 << CAP_NUMBERS[c] for c in ROOT_CAPS)


class UsernsError(Exception):
    pass


def make(base: int, size: int = BLOCK, nesting: bool = False) -> int:
    """A descriptor of a new user namespace owned by host uid `base` that maps its ids
    0..size-1 onto host ids base..base+size-1 (uids and gids). Unless `nesting` (a battery
    weakening), no user namespace can be created inside it. The caller closes the fd."""
    inner = "echo 0 > /proc/sys/user/max_user_namespaces && " if not nesting else ""
    # The first shell exec'd while its uid was unmapped and so holds no capability in the new
    # namespace; once mapped it is uid 0 there, and a fresh exec regains them (needed to lower
    # the nesting limit, which the sandbox's root, without CAP_SYS_RESOURCE, cannot raise).
    script = f"echo u; read _; exec sh -c '{inner}echo k'"
    try:
        p = subprocess.Popen(
            ["unshare", "--user", "sh", "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=True,
            user=base,
            group=base,
            extra_groups=[],
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        )
    except OSError as e:
        raise UsernsError(f"could not start the user-namespace helper: {e}") from None
    assert p.stdin is not None and p.stdout is not None and p.stderr is not None
    ns = -1
    try:
        if p.stdout.readline() != b"u\n":
            raise UsernsError(_helper_failed(p, "unshare"))
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{p.pid}/{name}", "w") as f:
                f.write(f"0 {base} {size}\n")
        ns = os.open(f"/proc/{p.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        p.stdin.write(b"go\n")
        p.stdin.flush()
        if p.stdout.readline() != b"k\n":
            raise UsernsError(_helper_failed(p, "the nesting limit"))
        return ns
    except BaseException:
        if ns >= 0:
            os.close(ns)
        p.kill()
        raise
    finally:
        for pipe in (p.stdin, p.stdout, p.stderr):
            try:
                pipe.close()
            except OSError:
                pass
        p.wait()


def _helper_failed(p: subprocess.Popen, step: str) -> str:
    try:
        p.wait(2)
        err = p.stderr.read(2000).decode(errors="replace").strip() if p.stderr else ""
    except (OSError, subprocess.TimeoutExpired):
        err = ""
    return f"the user-namespace helper failed at {step}: {err or 'no output'}"


def mapped_range(pid: int) -> tuple[int, int] | None:
    """(first host uid, count) of the single uid_map line of `pid`'s user namespace; None for
    the host's own namespace, several lines, or a process gone."""
    try:
        with open(f"/proc/{pid}/uid_map") as f:
            lines = f.read().split("\n")
    except OSError:
        return None
    lines = [ln for ln in lines if ln.strip()]
    if len(lines) != 1:
        return None
    inside, outside, count = (int(x) for x in lines[0].split())
    if inside != 0 or (outside == 0 and count == 4294967295):
        return None
    return outside, count
