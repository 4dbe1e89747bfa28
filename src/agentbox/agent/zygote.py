"""The agent's zygote: one host process that imported the agent once and forks a copy of it
into each new sandbox (the process runtime's agent start `fork`; docs/design/agent-zygote.md).

Run by the server as `python3 -I -S zygote.py FD`, FD a SOCK_SEQPACKET socket to it. It is the
host's Python and the host's copy of the agent, never a template's: it holds capabilities over
every sandbox's namespaces. Single-threaded (fork and setns(user) need it), it imports, before
its first fork, every module the agent can ever import (PRELOAD: the agent's lazy imports are a
closed list, checked by a test), so that a forked agent, whose `/` is its sandbox's, never has
to load one.

Per request (a JSON message, the sandbox's init's pid; and by SCM_RIGHTS: a pidfd of that init,
the agent's listening socket, the write end of the sandbox's hold pipe, the sandbox's log, its
seccomp program, its spec, read by the agent alone: nothing of a tenant's, its environment
say, is ever in the zygote's memory to be copied into the next sandbox's agent; and the read
end of the pipe bwrap's first process says on that the sandbox is set up) it joins the
sandbox's pid namespace for its children, forks the agent (its child, which it reaps) and
leaves that namespace again. It is asked as soon as bwrap has made the namespaces, while bwrap
still makes the sandbox's mounts. The agent, still in the host's other namespaces and as root,
joins the sandbox's cgroups, takes its rlimits and CPUs, drops its supplementary groups and
takes a process group of its own (all of which overlaps bwrap's work); waits until bwrap's
first process says the sandbox is set up; joins the init's other namespaces (the user
namespace with them, by the pidfd); and then does for itself what bwrap does for the sandbox's
first process: the sandbox's root ids, its capabilities (bounding, permitted, effective,
inheritable; no ambient), its working directory, environment and descriptors (0 /dev/null, 1
and 2 the log, 3 the listener, 4 the hold pipe), no_new_privs and the seccomp filter last; then
the agent's own start (Landlock and the rest) as ever. What fails there is said in the
sandbox's log, and the agent exits: the sandbox ends with it.

It says `{"ready": true}` once it has imported everything. The reply is `{"pid": N}` (the
agent's host pid) or `{"error": "..."}`. The zygote exits when the server's end of its socket
closes.
"""

import ctypes
import fcntl
import gc
import json
import os
import resource
import select
import signal
import socket
import sys

AGENT_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, AGENT_DIR)

# Every module the agent imports after it starts (inside functions), and the codecs it names:
# tests/unit/test_zygote.py fails when the agent's sources import one not listed here.
PRELOAD = (
    "_json",
    "code_bridge",
    "encodings.ascii",
    "encodings.latin_1",
    "encodings.utf_8",
    "fcntl",
    "json",
    "queue",
    "relay",
    "select",
    "shutil",
    "signal",
    "struct",
    "subprocess",
    "termios",
    "typing",
)

import confine  # noqa: E402
import sandbox_agent  # noqa: E402
import users  # noqa: E402

for _name in PRELOAD:
    __import__(_name)

SANDBOX_AGENT_DIR = "/.agentbox"  # where the sandbox sees the agent's tree
SANDBOX_PYTHON = "/usr/bin/python3"  # the sandbox's, as runtime.py starts an exec'd agent on
LISTEN_FD, HOLD_FD = 3, 4
MAX_FDS = 7
SET_UP_SECONDS = 15  # as long as the server waits for the agent's first answer
MESSAGE_MAX = 1 << 20

PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522

# The namespaces joined, as setns(2) flags, by their names under /proc/PID/ns.
NAMESPACES = {
    "mnt": 0x00020000,
    "pid": 0x20000000,
    "net": 0x40000000,
    "ipc": 0x08000000,
    "uts": 0x04000000,
    "cgroup": 0x02000000,
    "user": 0x10000000,
}
REQUIRED = ("mnt", "user")  # and pid (fork_agent): an agent in the host's is never started

libc = ctypes.CDLL(None, use_errno=True)


class StepFailed(Exception):
    pass


def _check(ret: int, step: str) -> None:
    if ret != 0:
        raise StepFailed(f"{step}: {os.strerror(ctypes.get_errno())}")


def _last_cap() -> int:
    with open("/proc/sys/kernel/cap_last_cap") as f:
        return int(f.read())


LAST_CAP = _last_cap()
OWN_PID_NS_FD = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
OWN_PID_NS = os.fstat(OWN_PID_NS_FD).st_ino


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


_CapDataPair = _CapData * 2  # a type made once here, not in each agent


def set_capabilities(mask: int) -> None:
    """Bounding set, then permitted, effective and inheritable to `mask`; ambient empty."""
    for cap in range(LAST_CAP + 1):
        if not mask >> cap & 1:
            _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap}")
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "ambient capabilities")
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = _CapDataPair()
    for i in (0, 1):
        part = (mask >> (32 * i)) & 0xFFFFFFFF
        data[i].effective = data[i].permitted = data[i].inheritable = part
    _check(libc.capset(ctypes.byref(header), data), "capset")


def _namespaces_to_join(pid: int) -> int:
    """setns flags for every namespace of `pid` that is not this process's own (the pid
    namespace is already joined for children: fork_agent)."""
    flags = 0
    for name, flag in NAMESPACES.items():
        if name == "pid":
            continue
        theirs = os.stat(f"/proc/{pid}/ns/{name}").st_ino
        if theirs != os.stat(f"/proc/self/ns/{name}").st_ino:
            flags |= flag
        elif name in REQUIRED:
            raise StepFailed(f"the sandbox shares the host's {name} namespace")
    return flags


def _become_agent(pid: int, fds: list[int]) -> None:
    """In the sandbox's pid namespace, the rest still the host's, as root: the sandbox's
    cgroups, limits and CPUs; then its other namespaces; then what bwrap does for its first
    process; then the agent."""
    pidfd, listener, hold, log, seccomp, spec, ready = fds
    with os.fdopen(spec, "rb", closefd=True) as f:
        req = json.loads(f.read())
    me = str(os.getpid())
    for path in req["cgroups"]:
        try:
            with open(path, "w") as f:
                f.write(me)
        except OSError as e:
            raise StepFailed(f"joining {path}: {e}") from None
    for res, soft, hard in req["rlimits"]:
        resource.setrlimit(res, (soft, hard))
    if req.get("cpus"):
        os.sched_setaffinity(0, req["cpus"])
    os.setgroups([])
    # Not the server's session (bwrap's --new-session: no terminal of the server's to reach)
    # but the zygote's own, which it started and has no terminal; not its leader either (so
    # the agent cannot acquire one), as under bwrap. A process group of its own.
    os.setpgid(0, 0)
    _wait_until_set_up(ready)
    _check(libc.setns(pidfd, _namespaces_to_join(pid)), "joining the namespaces")
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    os.chdir(req["cwd"])
    set_capabilities(req["caps"])
    with os.fdopen(seccomp, "rb", closefd=True) as f:
        prog = f.read()
    # Descriptors: 0 /dev/null, 1 and 2 the log, 3 the listener, 4 the hold pipe; no other.
    # Each first above them all, so that no target number is one of the sources.
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 16) for fd in (null, log, listener, hold)]
    for fd, target in zip(high, (0, 1, LISTEN_FD, HOLD_FD), strict=True):
        os.dup2(fd, target, inheritable=target < LISTEN_FD)
    os.dup2(1, 2)
    os.closerange(HOLD_FD + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    os.environ.clear()
    os.environ.update(req["env"])
    users._FSUID_WORKS = users._fsuid_works()  # computed at import, in the zygote
    # Each change of ids above made it undumpable, and so its /proc files the host root's
    # (its memory is the zygote's, of the host's user namespace): the agent could not open
    # its own oom_score_adj. It makes itself undumpable again first thing (sandbox_agent.main),
    # before anything of the sandbox's runs.
    _check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")
    sys.argv = [f"{SANDBOX_AGENT_DIR}/main.py", *req["argv"]]
    set_cmdline(" ".join(sys.argv))
    confine.load_seccomp(prog)
    sandbox_agent.main()


def _wait_until_set_up(ready: int) -> None:
    """Until bwrap's first process (the hold program) says the sandbox is set up: it runs only
    once bwrap has made the sandbox's mounts and pivoted its root, so the namespaces joined
    next are the sandbox's as they stay. The steps above, the host's, run meanwhile. The end
    of the pipe (every bwrap gone) or SET_UP_SECONDS without a word: nothing to join."""
    waiting = select.poll()
    waiting.register(ready, select.POLLIN)
    if not waiting.poll(SET_UP_SECONDS * 1000):
        raise StepFailed(f"the sandbox was not set up within {SET_UP_SECONDS} s")
    if not os.read(ready, 1):
        raise StepFailed("the sandbox ended before it was set up")
    os.close(ready)


class _LateImport:
    """Last on the meta path: an import nothing could find, told in the sandbox's log (a module
    missing from PRELOAD; the import then fails as any missing module does)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        os.write(2, f"agentbox agent (forked): {name} was not preloaded\n".encode())
        return None


def set_cmdline(text: str) -> None:
    """What `ps` shows for this process: `text`, cut to the room the zygote's own command
    line left (it would show the host's paths to the agent's and the server's Python)."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49
    room = end - start
    if room <= 0:
        return
    data = text.encode()[: room - 1]
    ctypes.memmove(start, data + bytes(room - len(data)), room)


def _host_paths() -> list[tuple[object, str, str]]:
    """(module, name, value) of the agent's module attributes that are paths into the host's
    copy of the agent (computed from `__file__` at import), as the sandbox must see them."""
    prefix = AGENT_DIR + "/"
    out: list[tuple[object, str, str]] = []
    for module in list(sys.modules.values()):
        where = getattr(module, "__file__", None)
        if not (isinstance(where, str) and where.startswith(prefix)):
            continue
        for key, value in vars(module).items():
            if isinstance(value, str) and value.startswith(prefix):
                out.append((module, key, SANDBOX_AGENT_DIR + "/" + value[len(prefix) :]))
    return out


HOST_PATHS = _host_paths()


def as_the_sandbox_sees_it() -> None:
    """The interpreter's paths made those a forked agent sees, once and in the zygote, which
    imports nothing after its start (the agent's own steps, after the fork, copy every page
    they write: what is the same for all agents is done here). Its import path is the agent's
    tree in the sandbox (the host's standard library is not there), with a last finder that
    says what was not preloaded; its interpreter the one an exec start runs on (the fallback
    the code bridge names when a template has no python3 on its PATH), never the host's path
    to the zygote's; the module attributes that were paths into the host's copy of the agent
    (`__file__` and those computed from it) are `/.agentbox`'s."""
    sys.path[:] = [SANDBOX_AGENT_DIR]
    sys.path_importer_cache.clear()
    sys.meta_path.append(_LateImport())
    sys.executable = sys._base_executable = SANDBOX_PYTHON  # type: ignore[attr-defined]
    for module, key, value in HOST_PATHS:
        setattr(module, key, value)


def fork_agent(req: dict, fds: list[int]) -> dict:
    """Fork the agent straight into the sandbox's pid namespace (joined for children only,
    and left again at once); it does the rest itself and says in the sandbox's log what
    failed, if something does (the server then finds the sandbox ended)."""
    if len(fds) != MAX_FDS:
        return {"error": f"{len(fds)} descriptors, not {MAX_FDS}"}
    pid, pidfd, log = int(req["pid"]), fds[0], fds[3]
    if os.stat(f"/proc/{pid}/ns/pid").st_ino == OWN_PID_NS:
        return {"error": "the sandbox shares the host's pid namespace"}
    _check(libc.setns(pidfd, NAMESPACES["pid"]), "joining the sandbox's pid namespace")
    try:
        child = os.fork()
    except OSError as e:
        child = -1
        failed: OSError | None = e
    else:
        failed = None
    if child != 0:  # the zygote's next children are its own again (never the agent's)
        _check(libc.setns(OWN_PID_NS_FD, NAMESPACES["pid"]), "leaving the pid namespace")
        if failed is not None:
            return {"error": f"fork: {failed}"}
    if child == 0:
        try:
            # Nothing of the zygote's own goes on: its socket and wakeup pipe are closed with
            # the other descriptors; its signal handlers are the default again.
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _become_agent(pid, fds)
        except BaseException as e:  # noqa: BLE001  (anything: the agent must not start)
            os.write(log, f"agentbox agent (forked): {e}\n".encode())
        os._exit(126)
    return {"pid": child}


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def serve(sock: socket.socket) -> None:
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)
    waiting = select.poll()
    waiting.register(sock.fileno(), select.POLLIN)
    waiting.register(wake_r, select.POLLIN)
    as_the_sandbox_sees_it()
    gc.freeze()  # what is imported stays in pages every agent shares
    # What every fork needs of the kernel: setns taking a pidfd (Linux 5.8), tried on its own
    # pid namespace (which it may always join). Without it the server starts agents by exec.
    own = os.pidfd_open(os.getpid())
    try:
        _check(libc.setns(own, NAMESPACES["pid"]), "setns by pidfd")
    finally:
        os.close(own)
    sock.send(b'{"ready": true}')  # its imports and the kernel went well: the server may ask
    while True:
        ready = {fd for fd, _ in waiting.poll()}
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
            _reap()
        if sock.fileno() not in ready:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, MESSAGE_MAX, MAX_FDS)
        if not msg:
            return  # the server is gone
        try:
            reply = fork_agent(json.loads(msg), fds)
        except Exception as e:  # noqa: BLE001  (a bad request: the zygote goes on)
            reply = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(json.dumps(reply).encode())
        _reap()


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
