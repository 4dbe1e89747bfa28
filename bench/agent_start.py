"""Benchmark: a sandbox's agent started by exec, against one forked already imported.

What the create, churn and idle-memory goals of issue 19 hinge on, measured outside the
runtime (no server, no disk, no cgroups), on a built template tree, N sandboxes of each kind
kept alive side by side:
- exec: bwrap (every namespace, the template read-only, /proc, /dev, /tmp, the agent's tree)
  runs the template's `python3 -E -s -S`, which imports the agent (`sandbox_agent`), as the
  runtime starts it today; timed until it says so on a pipe;
- fork: bwrap sets the same sandbox up and blocks (`--block-fd`) before it would run anything;
  a zygote (the host's `python3 -E -s -S`, single-threaded, which imported the agent once,
  then `gc.freeze()`) forks a child that setns()es into the blocked bwrap's mount, pid, net,
  ipc, uts, cgroup and user namespaces, forks again (a pid namespace takes children only),
  drops to the namespace's root and no_new_privs, and says so; timed the same way from bwrap's
  start, and split into bwrap until it blocks (its read of the block fd, seen in /proc) and the
  zygote's part. Closing the block fd's write end ends the sandbox (checked once).
Then the PSS of each sandbox's processes with N of each alive (the zygote counted apart, once).
Floor in the same run: `bwrap --ro-bind / / /bin/true`.

This is a measurement of the lever, not the runtime's start path: the forked agent here does
not take the sandbox's cgroups, rlimits, capabilities, seccomp filter, Landlock or listening
socket (docs/design/agent-zygote.md lists what a real one must).

    .venv/bin/python bench/agent_start.py [--tree TEMPLATE_ROOTFS] [-n 30] [--json out.json]
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

import agentbox.agent  # noqa: E402

AGENT_DIR = str(Path(agentbox.agent.__file__).parent)


def bwrap_argv(tree: str, info_fd: int, cmd: list[str], extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "bwrap", "--unshare-all", "--unshare-user", "--disable-userns",
        "--uid", "0", "--gid", "0", "--cap-drop", "ALL",
        "--ro-bind", tree, "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
        "--ro-bind", AGENT_DIR, "/.agentbox", "--new-session", "--chdir", "/",
        "--info-fd", str(info_fd), *extra, "--", *cmd,
    ]  # fmt: skip


def read_to_end(fd: int) -> bytes:
    out = b""
    while chunk := os.read(fd, 4096):
        out += chunk
    os.close(fd)
    return out


def read_line(fd: int, timeout: float | None = None) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        if timeout is not None and not select.select([fd], [], [], timeout)[0]:
            raise RuntimeError(f"no answer from the zygote in {timeout} s")
        c = os.read(fd, 1)
        if not c:
            raise RuntimeError(f"the zygote ended after {line!r}")
        line += c
    return line


# The zygote: a fresh `python3 -E -s -S` (not a fork of this benchmark, whose memory is much
# larger and would make each fork slower), single-threaded, the agent imported once. Each
# request line is a placeholder's pid; each reply, the agent's pid and a look at its root.
ZYGOTE = """
import ctypes, gc, os, signal, sys
requests, replies = int(sys.argv[1]), int(sys.argv[2])
sys.path.insert(0, sys.argv[3])
import sandbox_agent  # the import the exec path pays per sandbox
libc = ctypes.CDLL(None, use_errno=True)
# The user namespace last: once in it (bwrap's nested one, with --disable-userns) the caller
# has no capability over the namespaces its parent owns, the mount namespace among them.
NAMESPACES = ("mnt", "pid", "net", "ipc", "uts", "cgroup", "user")

def die(msg):
    os.write(2, f"zygote: {msg}: {os.strerror(ctypes.get_errno())}\\n".encode())
    os._exit(1)

def read_line():
    line = b""
    while not line.endswith(b"\\n"):
        c = os.read(requests, 1)
        if not c:
            os._exit(0)
        line += c
    return line

gc.freeze()
while True:
    pid = int(read_line())
    fds = [os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY) for ns in NAMESPACES]
    child = os.fork()
    if child == 0:
        for fd in fds:
            if libc.setns(fd, 0) != 0:
                die("setns")
        agent = os.fork()  # the pid namespace takes children only
        if agent == 0:
            # setns(mnt) put us at the namespace's root, which bwrap pivoted to the sandbox's.
            os.chdir("/")
            os.setresgid(0, 0, 0)
            os.setresuid(0, 0, 0)
            if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
                die("no_new_privs")
            for fd in (requests, *fds):
                os.close(fd)
            # getpid() is the agent's pid in the sandbox's namespace (2); the host's is the
            # fork's answer in the intermediate child, which is not in that namespace.
            os.write(replies, f"ready {os.getpid()} {sorted(os.listdir('/'))[:3]}\\n".encode())
            os.close(replies)
            signal.pause()
        os.write(replies, f"pid {agent}\\n".encode())
        os._exit(0)
    os.waitpid(child, 0)
    for fd in fds:
        os.close(fd)
"""


class Zygote:
    def __init__(self, python: str) -> None:
        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        self.proc = subprocess.Popen(
            [python, "-E", "-s", "-S", "-c", ZYGOTE, str(req_r), str(rep_w), AGENT_DIR],
            pass_fds=(req_r, rep_w),
        )
        self.pid = self.proc.pid
        os.close(req_r)
        os.close(rep_w)

    def start(self, placeholder: int) -> tuple[int, str]:
        """(the agent's pid on the host, what it saw) once it says it is ready."""
        os.write(self.req_w, f"{placeholder}\n".encode())
        said = dict(read_line(self.rep_r, 10.0).decode().split(" ", 1) for _ in range(2))
        return int(said["pid"]), said["ready"].strip()

    def close(self) -> None:
        os.close(self.req_w)
        os.close(self.rep_r)
        self.proc.wait()


def exec_start(tree: str) -> tuple[float, subprocess.Popen[bytes]]:
    info_r, info_w = os.pipe()
    ready_r, ready_w = os.pipe()
    code = (
        "import os, signal, sys; sys.path.insert(0, '/.agentbox'); import sandbox_agent; "
        f"os.write({ready_w}, b'ok'); os.close({ready_w}); signal.pause()"
    )
    t0 = time.perf_counter()
    p = subprocess.Popen(
        bwrap_argv(tree, info_w, ["/usr/bin/python3", "-E", "-s", "-S", "-c", code]),
        pass_fds=(info_w, ready_w),
    )
    os.close(info_w)
    os.close(ready_w)
    read_to_end(info_r)
    if read_to_end(ready_r) != b"ok":
        raise RuntimeError("the exec'd agent did not start")
    return (time.perf_counter() - t0) * 1000, p


def fork_start(
    tree: str, zygote: Zygote
) -> tuple[float, float, float, subprocess.Popen[bytes], int, str, int]:
    """The placeholder is bwrap itself, blocked on `--block-fd` once the sandbox is set up
    (its mounts made, its root pivoted), before it forks its init's child: no program of the
    template runs. When the pipe's write end closes, bwrap goes on to exec a command that does
    not exist and the sandbox ends. The write end is returned (a real agent would hold it)."""
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe()
    t0 = time.perf_counter()
    argv = bwrap_argv(tree, info_w, ["/.agentbox/ended"], ("--block-fd", str(block_r)))
    p = subprocess.Popen(argv, pass_fds=(info_w, block_r))
    os.close(info_w)
    os.close(block_r)
    placeholder = json.loads(read_to_end(info_r))["child-pid"]
    # bwrap reports the pid before its mounts are made: joined then, the namespace's root would
    # still be bwrap's scratch tmpfs. Its read of the block fd is the end of its setup.
    syscall = Path(f"/proc/{placeholder}/syscall")
    deadline = time.monotonic() + 10
    while syscall.read_text().split()[:2] != ["0", hex(block_r)]:
        if time.monotonic() > deadline:
            raise RuntimeError("bwrap did not reach its block fd")
        time.sleep(0.0001)
    t1 = time.perf_counter()
    agent, seen = zygote.start(placeholder)
    t2 = time.perf_counter()
    return (t2 - t0) * 1000, (t1 - t0) * 1000, (t2 - t1) * 1000, p, agent, seen, block_w


def tree_pids(pid: int) -> list[int]:
    out = [pid]
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
            for c in children:
                out += tree_pids(int(c))
    return out


def default_tree() -> Path:
    roots = sorted(
        (p for p in (H.BENCH_TEMPLATE_DIR / "rootfs").glob("*") if p.is_dir()),
        key=lambda p: p.stat().st_mtime,
    )
    if not roots:
        raise SystemExit(f"no built template under {H.BENCH_TEMPLATE_DIR}: pass --tree")
    return roots[-1]


def main() -> None:
    p = H.base_args(__doc__.splitlines()[0])
    p.add_argument("--tree", type=Path, help="a built template's rootfs (default: the newest "
                   f"under {H.BENCH_TEMPLATE_DIR}/rootfs)")  # fmt: skip
    p.add_argument("-n", type=int, default=30)
    args = p.parse_args()
    tree = str(args.tree or default_tree())
    if not Path(tree, "usr/bin/python3").exists():
        raise SystemExit(f"{tree} has no usr/bin/python3")
    mach = H.print_header("Benchmark: the agent's start, exec'd against forked already imported")
    floor = H.timed_runs(lambda: H.spawn_wait(["bwrap", "--ro-bind", "/", "/", "/bin/true"]), 50)
    before = set(H.host_bwrap_pids())
    zygote = Zygote("/usr/bin/python3")
    live: list[tuple[subprocess.Popen[bytes], int | None]] = []
    blocks: list[int] = []
    t: dict[str, list[float]] = {}
    seen = ""
    try:
        for i in range(args.n + 3):
            ms_exec, p_exec = exec_start(tree)
            live.append((p_exec, None))
            ms_fork, ms_bwrap, ms_zyg, p_fork, agent, seen, block_w = fork_start(tree, zygote)
            blocks.append(block_w)
            live.append((p_fork, agent))
            if i >= 3:  # warm-up rounds not counted
                for name, ms in (
                    ("exec: bwrap -> python3 imports the agent -> ready", ms_exec),
                    ("fork: placeholder + zygote -> ready", ms_fork),
                    ("  bwrap until it blocks, set up", ms_bwrap),
                    ("  zygote: fork, setns x7, fork -> ready", ms_zyg),
                ):
                    t.setdefault(name, []).append(ms)
        time.sleep(0.5)
        pss: dict[str, list[float]] = {"exec": [], "fork": []}
        for proc, agent in live:
            kib = sum(H.pss_kb(x) for x in tree_pids(proc.pid))
            kib += H.pss_kb(agent) if agent else 0
            pss["fork" if agent else "exec"].append(kib / 1024)
        zygote_mib = H.pss_kb(zygote.pid) / 1024
        # The sandbox's lifetime: the block fd's write end closed (as by an agent that ends),
        # bwrap goes on, fails to exec, and its pid namespace's end takes the agent with it.
        first, first_agent = next((p, a) for p, a in live if a)
        os.close(blocks.pop(0))
        first.wait(5)
        time.sleep(0.1)
        try:
            state = Path(f"/proc/{first_agent}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        ended = state in ("gone", "Z")
        print(f"closing a fork sandbox's block fd ended bwrap and its agent: {ended} ({state})")
    finally:
        for proc, agent in live:
            # bwrap's init (a child of the outer bwrap) outlives it: kill the whole tree.
            for pid in [*tree_pids(proc.pid), *([agent] if agent else [])]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
        for fd in blocks:
            os.close(fd)
        zygote.close()
        deadline = time.monotonic() + 5  # SIGKILLed inits take their namespaces down first
        while (
            left := [p for p in H.host_bwrap_pids() if p not in before]
        ) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left:
            print(f"leftover bwrap processes: {left}", file=sys.stderr)
    print(f"template tree: {tree}\nthe forked agent saw / as: {seen}\n")
    print("Floor (same run):")
    H.print_timings({"bwrap --ro-bind / / /bin/true": floor}, 52)
    print(f"\nStart until the agent is imported and says so ({args.n} of each, alternated):")
    H.print_timings(t, 52)
    print(f"\nPSS per sandbox, {len(pss['exec'])} of each alive:")
    rows = [{"metric": k, **H.summarize(v), "unit": "ms"} for k, v in t.items()]
    for kind, xs in pss.items():
        s = H.summarize(xs)
        print(f"  {kind:6s} p50 {s['p50']:.2f} MiB")
        rows.append({"metric": f"pss {kind}", **s, "unit": "MiB"})
    print(f"  the zygote itself, once: {zygote_mib:.2f} MiB")
    H.emit(
        {
            "name": "agent_start",
            "machine": mach,
            "command": " ".join(["bench/agent_start.py", *sys.argv[1:]]),
            "floors": {"bwrap --ro-bind / / /bin/true": H.summarize(floor)},
            "rows": rows,
            "zygote_pss_mib": zygote_mib,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
