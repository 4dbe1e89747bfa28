"""A sandbox's user namespace: its own 0–65535 mapped onto its block of host uids.

bwrap alone can map one id (it runs unprivileged), so the server makes the namespace and bwrap
joins it (`--userns FD`). A short-lived process, a child of the server's one long-lived helper
that has taken the block's first host uid (so that the namespace is owned by the sandbox and
not by host root), unshares a user namespace; the server (host root, which may map any range)
writes its uid and gid maps; the child, now the namespace's root with full capabilities *in
it*, sets the namespace's nesting limit to 0 and exits. The server keeps only a descriptor;
bwrap checks (`--assert-userns-disabled`) that no user namespace can be made inside. Nothing
holds the namespace after bwrap started but the sandbox's own processes: no holder process to
find, adopt or kill after a restart.

The sandbox's root (uid 0 inside) gets only `ROOT_CAPS`, enough to administer its own files and
processes; the kernel honours them only for ids mapped in the namespace, so they reach nothing
of the host or of another sandbox (those ids are unmapped there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

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


# The helper: a small single-threaded process the server starts once (forking the server,
# large and threaded, would cost milliseconds per sandbox). Per request it forks a child that
# takes the block's first uid, unshares a user namespace and waits; once the server has written
# the maps, the child (root of the new namespace, with the capabilities unshare gave it: no
# exec in between to lose them) lowers the nesting limit and exits. Its exit status says which
# step failed. The helper dies with the server (PR_SET_PDEATHSIG, and EOF on its stdin).
_HELPER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG SIGKILL
STEPS = {10: "setting its ids", 11: "unshare", 12: "waiting for the maps",
         13: "the nesting limit"}
def child(base, nesting, ready, go):
    try:
        os.setgroups([])
        os.setresgid(base, base, base)
        os.setresuid(base, base, base)
    except OSError:
        return 10
    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
        return 11
    os.write(ready, b"u")
    if os.read(go, 1) != b"g":
        return 12
    if not nesting:
        try:
            with open("/proc/sys/user/max_user_namespaces", "w") as f:
                f.write("0")
        except OSError:
            return 13
    return 0
for line in sys.stdin:
    base, nesting = (int(x) for x in line.split())
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r); os.close(go_w)
        os.close(0); os.close(1)  # the server's pipes: nothing running as the block's uid has them
        os._exit(child(base, nesting, ready_w, go_r))
    os.close(ready_w); os.close(go_r)
    if os.read(ready_r, 1) == b"u":
        print("pid", pid, flush=True)
        if sys.stdin.readline().strip() == "go":
            os.write(go_w, b"g")
    os.close(ready_r); os.close(go_w)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    print("ok" if code == 0 else "failed " + STEPS.get(code, f"status {code}"), flush=True)
"""


class _Helper:
    """The server's one helper process, started on first use, restarted if it died."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None

    def make(self, base: int, size: int, nesting: bool, maps: str = "") -> int:
        with self._lock:  # one request at a time: each takes about a millisecond
            for attempt in (1, 2):
                proc = self._running()
                try:
                    return self._ask(proc, base, size, nesting, maps)
                except (BrokenPipeError, _HelperGone):
                    self._stop()
                    if attempt == 2:
                        raise UsernsError("the user-namespace helper keeps dying") from None
            raise AssertionError("unreachable")

    def _running(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _HELPER],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    close_fds=True,
                    text=True,
                    env={},
                )
            except OSError as e:
                raise UsernsError(f"could not start the user-namespace helper: {e}") from None
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    @staticmethod
    def _line(proc: subprocess.Popen[str]) -> str:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise _HelperGone
        return line.strip()

    def _ask(
        self, proc: subprocess.Popen[str], base: int, size: int, nesting: bool, maps: str = ""
    ) -> int:
        assert proc.stdin is not None
        proc.stdin.write(f"{base} {int(nesting)}\n")
        proc.stdin.flush()
        first = self._line(proc)
        if not first.startswith("pid "):
            raise UsernsError(f"the user-namespace helper failed: {first}")
        pid = int(first.split()[1])
        ns = -1
        try:
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(maps or f"0 {base} {size}\n")
            ns = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
            go = "go"
        except OSError as e:
            go, failed = "stop", e
        try:
            proc.stdin.write(go + "\n")
            proc.stdin.flush()
            last = self._line(proc)
        except BaseException:
            if ns >= 0:
                os.close(ns)  # the request is retried whole
            raise
        if go != "go":
            raise UsernsError(f"could not map the user namespace's ids: {failed}")
        if last != "ok":
            os.close(ns)
            raise UsernsError(f"the user-namespace helper failed at {last.removeprefix('failed ')}")
        return ns


class _HelperGone(Exception):
    pass


_helper = _Helper()


def make(base: int, size: int = BLOCK, nesting: bool = False) -> int:
    """A descriptor of a new user namespace owned by host uid `base` that maps its ids
    0..size-1 onto host ids base..base+size-1 (uids and gids). Unless `nesting` (a battery
    weakening), no user namespace can be created inside it. The caller closes the fd."""
    return _helper.make(base, size, nesting)


def make_mapped(lines: list[tuple[int, int, int]]) -> int:
    """A descriptor of a new user namespace owned by host root, nesting allowed, that maps
    each (inside, host, count) of `lines` (uids and gids alike): the namespace an OCI runtime
    binary runs in, so that the ids it hands out are the sandbox's own host ids. The caller
    closes the fd."""
    maps = "".join(f"{inside} {host} {count}\n" for inside, host, count in lines)
    return _helper.make(0, 0, True, maps)


def mapped_range(pid: int) -> tuple[int, int] | None:
    """(first host uid, count) of the single uid_map line of `pid`'s user namespace (whichever
    id it maps them to: gVisor's sentry maps one, as its `nobody`); None for the host's own
    namespace, several lines, or a process gone."""
    try:
        with open(f"/proc/{pid}/uid_map") as f:
            lines = f.read().split("\n")
    except OSError:
        return None
    lines = [ln for ln in lines if ln.strip()]
    if len(lines) != 1:
        return None
    inside, outside, count = (int(x) for x in lines[0].split())
    if outside == 0 and count == 4294967295:
        return None
    return outside, count
