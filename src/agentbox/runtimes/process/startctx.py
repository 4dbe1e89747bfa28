"""A sandbox's first process, started without forking the server.

A `preexec_fn` makes `subprocess` fork the whole server (page tables of a process of ~160 MiB:
~18 ms on the 2-core host, against ~0.7 ms for the vfork it uses otherwise) just to run a few
system calls before exec. The same calls are made here by small programs the child execs
before bwrap, each in the order the old in-fork code made them:

1. `sh`: write its own pid into each of the sandbox's `cgroup.procs` (every process the sandbox
   will ever make starts inside its cgroups); a write that fails ends the start (`set -e`).
2. `prlimit` (util-linux): the rlimits, hard and soft alike.
3. `setpriv` (util-linux): drop to the sandbox's uid and gid with no supplementary groups
   (real, effective and saved ids; no capabilities are left across the exec).

The CPU affinity, a per-thread setting the child inherits, is set on the spawning thread for
the duration of the spawn (`pinned`).

Where the host has a C compiler, `build` makes startctx.c, which makes the same calls in the
same order in one exec (each of `sh`, `prlimit` and `setpriv` costs ~0.6-1.2 ms of exec,
libraries and locale on the 2-core host: ~2.5 ms of every create's path); the programs above
are the form used without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import resource
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from agentbox.runtimes.base import RLIMIT_NAMES

TOOLS = ("prlimit", "setpriv")

_JOIN = 'set -e; while [ "$1" != -- ]; do echo $$ > "$1"; shift; done; shift; exec "$@"'


def _option(res: int) -> str:
    return "--" + RLIMIT_NAMES[res].removeprefix("RLIMIT_").lower()


def missing() -> str | None:
    """Why sandboxes cannot be started this way here, or None."""
    absent = [t for t in TOOLS if shutil.which(t) is None]
    if absent:
        return f"{' and '.join(absent)} not found: apt-get install util-linux"
    return None


SOURCE = Path(__file__).with_name("startctx.c")


def build(cache_dir: Path) -> str | None:
    """startctx.c built (once per source, kept in `cache_dir`): its path, or None where there
    is no C compiler or it does not build (the programs' form is used then)."""
    try:
        source = SOURCE.read_bytes()
    except OSError:  # an install without it: the programs' form
        return None
    binary = cache_dir / f"startctx-{hashlib.sha256(source).hexdigest()[:16]}"
    if binary.exists():
        return str(binary)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = binary.with_suffix(".tmp")
    try:
        done = subprocess.run(
            [cc, "-O2", "-Wall", "-Werror", "-o", str(tmp), str(SOURCE)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        done = subprocess.CompletedProcess([], 1, "", str(e))
    if done.returncode != 0:
        logging.getLogger(__name__).warning(
            "cannot build %s (sandboxes start through sh, prlimit and setpriv): %s",
            SOURCE.name, done.stderr[-500:],
        )  # fmt: skip
        tmp.unlink(missing_ok=True)
        return None
    os.chmod(tmp, 0o700)
    tmp.replace(binary)
    return str(binary)


def argv(
    join_files: Sequence[str],
    limits: Sequence[tuple[int, int]],
    uid: int | None,
    helper: str | None = None,
) -> list[str]:
    """What to exec before the sandbox's own command: the command is appended to it.
    `helper`: startctx.c built (`build`), else the programs' form."""
    if helper is not None:
        pairs = [str(x) for r, v in limits for x in (r, _value(v))]
        return [helper, *join_files, "--", *pairs, "--", "-" if uid is None else str(uid), "--"]
    out = ["/bin/sh", "-c", _JOIN, "sh", *join_files, "--", *limits_argv(limits)]
    if uid is not None:
        out += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return out


def limits_argv(limits: Sequence[tuple[int, int]], helper: str | None = None) -> list[str]:
    """Set `limits` (resource, value), hard and soft alike, before the command appended to
    it (with `helper`, or `prlimit`); nothing when there are none."""
    if not limits:
        return []
    if helper is not None:
        return argv([], limits, None, helper)
    return ["prlimit", *(f"{_option(r)}={_value(v)}:{_value(v)}" for r, v in limits), "--"]


def _value(v: int) -> str:
    return "unlimited" if v == resource.RLIM_INFINITY else str(v)


@contextlib.contextmanager
def pinned(cpus: Sequence[int] | None) -> Iterator[None]:
    """This thread on `cpus` (None: unchanged) while the block runs; a child started in the
    block inherits them. Not a fence (a process may widen its own affinity): a truthful nproc."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def warm_join(join_files: Sequence[str]) -> subprocess.Popen | None:
    """A throwaway process that joins the sandbox's cgroups and exits, started while the
    server still makes the sandbox's disk (settle() waits for it, before the first process).

    Moving a process into a cgroup takes the kernel's cgroup_threadgroup_rwsem for writing, a
    per-CPU rwsem whose writer waits for an RCU grace period unless another writer took it
    within about one grace period before (rcu_sync). On the 2-core host at rest that wait is
    ~5 ms (a `sh` joining four cgroups after a 0.3 s pause: 7.2 ms; joining none: 1.9), and
    the `sh` of argv() paid it on every create: 13-15 ms (p99 33-45) until bwrap's child pid.
    Paid here, off that path, the first process joins in the window it leaves: 4-6 ms (p99
    5-7).
    cgroup v2 has CLONE_INTO_CGROUP and the `favordynmods` mount option for this; on v1
    neither is there (a remount with favordynmods is refused on the development host)."""
    if not join_files:
        return None
    try:
        return subprocess.Popen(
            ["/bin/sh", "-c", 'for f; do echo $$ > "$f"; done', "sh", *join_files],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
    except OSError:
        return None  # only an optimisation: the first process joins all the same


def settle(warming: subprocess.Popen | None) -> None:
    """Wait for warm_join's process (gone from the cgroups once it has exited)."""
    if warming is not None:
        warming.wait()
