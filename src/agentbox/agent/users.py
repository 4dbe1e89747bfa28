"""Who the agent acts as: the sandbox's `user` (uid 1000) or its `root` (uid 0).

The agent runs as the sandbox's root, holding only the few capabilities the runtime granted
(chown, fowner, setuid, kill, ...; never sys_admin). Commands run as `user` unless a request
says "root": the child drops to uid 1000 before exec and, as the uid changes from 0 to non-zero
with no_new_privs set, loses every capability for good. File operations run in the serving
thread with fsuid/fsgid 1000, so their permission checks and new files are `user`'s (the
kernel drops the file capabilities from a thread whose fsuid is not 0).

`sudo` inside the sandbox is not a setuid binary (no_new_privs would ignore one): it is a small
client (`bin/sudo`) asking the agent, on an abstract unix socket of the sandbox's own network
namespace, to run its arguments as root with its own stdin/stdout/stderr, passwordless, as on
E2B. Standard library only; imported by the agent at start.
"""

from __future__ import annotations

import _socket
import array
import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator

NAMES = ("user", "root")
IDS = {"user": 1000, "root": 0}
HOMES = {"user": "/workspace", "root": "/root"}
SUDO_SOCKET = b"\0agentbox-sudo"  # abstract: scoped to the sandbox's network namespace
SUDO_REQUEST_MAX = 1 << 20
CAP_SETUID = 7

# Set by `configure` at the agent's start.
DEFAULT = "user"
CAN_SWITCH = False  # the agent is its sandbox's root: it can run as either
OOM_FD = -1  # the agent's own /proc/self/oom_score_adj, opened before Landlock closes /proc

_libc = ctypes.CDLL(None, use_errno=True)


class UserError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def configure(default: str) -> None:
    global DEFAULT, CAN_SWITCH, OOM_FD
    DEFAULT = default if default in NAMES else "user"
    try:
        OOM_FD = os.open("/proc/self/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        OOM_FD = -1
    # Root of its own user namespace with CAP_SETUID (not the capability-less uid 0 a server
    # without root gives a template whose user is root).
    CAN_SWITCH = os.getuid() == 0 and _has_cap(CAP_SETUID)
    if CAN_SWITCH:
        os.setgroups([])  # root's supplementary groups are none of the commands' business
        _clear_inheritable()


def _has_cap(bit: int) -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError):
        pass
    return False


def _clear_inheritable() -> None:
    """Empty the inheritable (and so the ambient) capability set: root's commands still get
    the bounding set at exec (they are uid 0), `user`'s then hold no capability in any set
    but the bounding one."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]

    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if _libc.capget(ctypes.byref(header), data) != 0:
        return
    for d in data:
        d.inheritable = 0
    _libc.capset(ctypes.byref(header), data)


def resolve(name: object) -> str:
    """The user a request asks for (None: the sandbox's default), checked."""
    if name is None or name == "":
        return DEFAULT
    if name not in NAMES:
        raise UserError("invalid_request", f'user must be "user" or "root", not {name!r}')
    if name != DEFAULT and not CAN_SWITCH:
        raise UserError(
            "unsupported",
            f"this sandbox runs everything as {DEFAULT!r}: it has no separate root (the server "
            "runs without root, so sandboxes get one uid and no capabilities)",
        )
    return str(name)


_SYS = {  # (x86_64, aarch64)
    "setgroups": (116, 159),
    "setresuid": (117, 147),
    "setresgid": (119, 149),
}
_COL = 0 if os.uname().machine == "x86_64" else 1


def _sys(name: str, *args: int) -> None:
    if _libc.syscall(_SYS[name][_COL], *args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{name}: {os.strerror(e)}")


# The out-of-memory score every process the agent starts is born with (half the memory
# limit's worth above the agent's 0): under memory pressure a sandbox loses a command, not its
# agent (which would end the whole sandbox). The agent raises its own score while it starts
# one (the child copies it at fork) and lowers it again: lowering the agent's below 0 for good
# would need CAP_SYS_RESOURCE, which a server's root may lack (in a container, say), and
# Landlock keeps the agent from writing a child's (and a command from lowering its own).
CHILD_OOM_SCORE_ADJ = b"500"
_spawn_lock = threading.Lock()


@contextlib.contextmanager
def spawning_as(name: str) -> Iterator[None]:
    """Children the agent starts meanwhile (in this thread) run as `name`, with the raised
    out-of-memory score. One spawn at a time: the score is the whole process's."""
    with _spawn_lock:
        _oom_score(CHILD_OOM_SCORE_ADJ)
        try:
            with _as(name):
                yield
        finally:
            _oom_score(b"0")


def _oom_score(value: bytes) -> None:
    if OOM_FD >= 0:
        try:
            os.write(OOM_FD, value)
        except OSError:
            pass


@contextlib.contextmanager
def _as(name: str) -> Iterator[None]:
    """Children this thread starts meanwhile run as `name`.

    The kernel keeps credentials per thread, and the raw syscalls (not glibc's wrappers, which
    would change every thread) switch this thread alone: its real and effective ids become
    `name`'s, its saved ones stay 0, so it can switch back. A child it starts inherits them;
    at exec its saved ids become `name`'s and, no id being 0 any more, it holds no capability.
    Done so rather than with Popen(user=...), which forks the agent (a vfork child may not
    change ids): a `user` command starts as fast as a root one."""
    if not CAN_SWITCH or name == "root":
        yield
        return
    uid = IDS[name]
    _sys("setgroups", 0, 0)
    _sys("setresgid", uid, uid, 0)
    _sys("setresuid", uid, uid, 0)
    try:
        yield
    finally:
        _sys("setresuid", 0, 0, 0)  # the saved uid 0 allows it; the permitted caps come back
        _sys("setresgid", 0, 0, 0)


def environment(name: str, env: dict) -> dict:
    """`env` with HOME, USER and LOGNAME of `name` where the agent's own were inherited."""
    if name == "user" or not CAN_SWITCH:
        return env
    out = dict(env)
    for key, value in (("HOME", HOMES[name]), ("USER", name), ("LOGNAME", name)):
        if env.get(key) == os.environ.get(key):
            out[key] = value
    return out


def files_as(name: str) -> contextlib.AbstractContextManager[None]:
    """Run this thread's file operations as `name` (fsuid/fsgid are per thread)."""
    return fs_ids(IDS[name], IDS[name])


@contextlib.contextmanager
def fs_ids(uid: int, gid: int) -> Iterator[None]:
    """This thread's filesystem ids set to (uid, gid) for a while: the kernel checks its file
    accesses, and reads of /proc/PID files of that uid's processes, as theirs."""
    if not CAN_SWITCH or (uid, gid) == (0, 0):
        yield
        return
    if not _FSUID_WORKS:
        # A kernel that keeps the filesystem ids at the effective ones (gVisor's): switch this
        # thread's effective ids instead (the saved ids stay 0, so they come back, caps too).
        _sys("setresgid", -1, gid, -1)
        _sys("setresuid", -1, uid, -1)
        try:
            yield
        finally:
            _sys("setresuid", -1, 0, -1)
            _sys("setresgid", -1, 0, -1)
        return
    _libc.setfsgid(gid)
    _libc.setfsuid(uid)
    try:
        yield
    finally:
        _libc.setfsuid(0)
        _libc.setfsgid(0)


def _fsuid_works() -> bool:
    """Whether setfsuid changes this thread's filesystem uid here (set, read back, restore)."""
    if os.geteuid() != 0:
        return True  # nothing will be switched
    _libc.setfsuid(IDS["user"])
    now = _libc.setfsuid(-1)  # an invalid id changes nothing and returns the current one
    _libc.setfsuid(0)
    return bool(now == IDS["user"])


_FSUID_WORKS = _fsuid_works()


# ---------------------------------------------------------------- sudo


def serve_sudo() -> _socket.socket | None:
    """The socket `sudo` requests come on, listening (the agent's accept loop takes them:
    accept_sudo); None if the socket is taken (a sandbox sharing its network namespace, only
    ever a weakened one) or the agent cannot run as root. No thread of its own: each one the
    agent keeps copies its share of the pages it inherited and takes one of the sandbox's
    processes."""
    if not CAN_SWITCH:
        return None
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        sock.bind(SUDO_SOCKET)
        sock.listen(64)
    except OSError:
        sock.close()
        return None
    sock.setblocking(False)  # a connection gone before its accept must not stop the loop
    return sock


def accept_sudo(listener: _socket.socket) -> None:
    """Serve the `sudo` connection waiting on `listener`, on a thread of its own."""
    try:
        fd, _ = listener._accept()  # type: ignore[attr-defined]
    except OSError:
        return
    conn = _socket.socket(fileno=fd)
    conn.setblocking(True)
    try:
        threading.Thread(target=_serve_sudo, args=(conn,), daemon=True).start()
    except RuntimeError:  # no thread: the sandbox is at its process limit
        conn.close()


def _recv_request(conn: _socket.socket) -> tuple[dict, list[int]]:
    """The request (one JSON line) and the caller's stdin/stdout/stderr (SCM_RIGHTS)."""
    import json  # here: most sandboxes never use sudo, and json costs every start ~12 ms

    fds = array.array("i")
    data = b""
    while not data.endswith(b"\n"):
        msg, anc, _, _ = conn.recvmsg(65536, _socket.CMSG_SPACE(3 * fds.itemsize))
        for level, kind, payload in anc:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        if not msg:
            break
        data += msg
        if len(data) > SUDO_REQUEST_MAX:
            break
    return json.loads(data), list(fds)


def _serve_sudo(conn: _socket.socket) -> None:
    import json
    import subprocess

    fds: list[int] = []
    try:
        try:
            req, fds = _recv_request(conn)
            argv, env, cwd = req["argv"], req["env"], req["cwd"]
            name = resolve(req.get("user") or "root")
            if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
                raise UserError("invalid_request", "no command")
            if len(fds) != 3:
                raise UserError("invalid_request", "stdin, stdout and stderr are needed")
            with spawning_as(name):
                proc = subprocess.Popen(
                    argv,
                    stdin=fds[0],
                    stdout=fds[1],
                    stderr=fds[2],
                    cwd=cwd if isinstance(cwd, str) and os.path.isdir(cwd) else "/",
                    env={str(k): str(v) for k, v in dict(env).items()},
                    start_new_session=True,
                    close_fds=True,
                )
        except (ValueError, KeyError, TypeError, OSError, UserError) as e:
            message = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
            if isinstance(e, FileNotFoundError):
                message = f"{e.filename}: command not found"
            conn.sendall(json.dumps({"error": message}).encode() + b"\n")
            return
        finally:
            for fd in fds:
                os.close(fd)
        threading.Thread(target=_relay_signals, args=(conn, proc), daemon=True).start()
        code = proc.wait()
        conn.sendall(json.dumps({"exit": code if code >= 0 else 128 - code}).encode() + b"\n")
    except OSError:
        pass
    finally:
        conn.close()


def _relay_signals(conn: _socket.socket, proc: object) -> None:
    """Signals the caller forwards ({"signal": N} lines); the caller gone kills the command."""
    import json
    import signal

    buf = b""
    while True:
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        sig: int
        if not data:
            sig = signal.SIGKILL
        else:
            buf += data
            if b"\n" not in buf:
                continue
            line, _, buf = buf.partition(b"\n")
            try:
                sig = int(json.loads(line)["signal"])
            except (ValueError, KeyError, TypeError):
                continue
        if proc.poll() is not None:  # type: ignore[attr-defined]
            return
        try:
            os.killpg(proc.pid, sig)  # type: ignore[attr-defined]
        except OSError:
            return
        if not data:
            return
