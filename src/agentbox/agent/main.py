"""Entry point of the in-sandbox agent: `python3 -E -s -S /.agentbox/main.py --listen-fd N`
(a listening socket it inherits) or `--listen-path P` (one it binds itself).

Two options act before the agent is even imported, for runtimes that start it as the first
process of a container, where no bwrap does this for it:

- `--seccomp FILE`: load the sandbox's seccomp filter (the classic BPF program bwrap's
  `--seccomp` takes) on this process and all its threads, with no_new_privs. Nothing in the
  sandbox runs before it, so it covers everything the sandbox ever runs. A filter that will not
  load stops the agent: never a sandbox without one.
- `--init`: stay behind as the sandbox's init, reaping orphaned processes (as pid 1, or as a
  child subreaper elsewhere), and run the agent as its child; exit with the agent's status when
  it exits (the kernel then ends whatever is left in the pid namespace).
"""

import os
import sys

PR_SET_CHILD_SUBREAPER = 36
PR_SET_DUMPABLE = 4


def _fail(msg: str) -> None:
    sys.stderr.write(f"agentbox agent: {msg}\n")
    sys.stderr.flush()
    os._exit(126)


def _load_seccomp(path: str) -> None:
    from confine import ConfineError, load_seccomp

    try:
        with open(path, "rb") as f:
            prog = f.read()
    except OSError as e:
        _fail(f"cannot read the seccomp filter {path}: {e}")
    try:
        load_seccomp(prog)
    except ConfineError as e:
        _fail(f"{path}: {e}")


def _run_as_init() -> None:
    """Fork: the child returns and becomes the agent; this process reaps until it ends."""
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    agent = os.fork()
    if agent == 0:
        return
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(agent, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):
        signal.signal(sig, forward)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            os._exit(1)
        if pid == agent:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)


def _arg(name: str) -> "str | None":
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


_filter = _arg("--seccomp")
if _filter is not None:
    _load_seccomp(_filter)
if "--init" in sys.argv:
    _run_as_init()

import sandbox_agent  # noqa: E402  (after the filter: it covers the agent's own start too)

sandbox_agent.main()
