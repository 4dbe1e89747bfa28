"""Benchmark 1: cold create -> first command done (`echo hi`), and where that time goes.

Measures, in one run on one machine:
- floors: plain fork+exec of /bin/true, bare `bwrap --unshare-all --ro-bind / / /bin/true`, and
  bwrap with agentbox's own mount set running `python3 -S -E -s -c pass`;
- the parts a create is made of: mkfs.ext4 + mount + umount of a 1 GiB sparse image, Python
  startup, importing the in-sandbox agent;
- the end-to-end number over HTTP (create call alone, first command alone, both), via the SDK
  too when `from agentbox import Sandbox` works;
- the process runtime's create and destroy steps timed in-process (same code the server runs,
  wrapped with timers; nothing in src/ is changed).

    .venv/bin/python bench/create_latency.py [-n 50] [--profile] [--json out.json]
"""

from __future__ import annotations

import asyncio
import os
import resource
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

GOAL_P50_MS = 25.0
ECHO = "echo hi"


# ---------------------------------------------------------------- floors and parts


def agentbox_like_bwrap(cmd: list[str]) -> list[str]:
    """bwrap with the namespaces and mounts a sandbox gets (no seccomp, no cgroup, no uid)."""
    argv = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--uid", "1000",
            "--gid", "1000", "--hostname", "sandbox", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for link in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        p = Path(link)
        if p.is_symlink():
            argv += ["--symlink", os.readlink(p), link]
        elif p.is_dir():
            argv += ["--ro-bind", link, link]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm",
             "--dir", "/run", "--dir", "/var", "--dir", "/workspace", "--chdir", "/workspace",
             "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--", *cmd]
    return argv


def measure_floors(n: int) -> dict[str, list[float]]:
    out = {
        "fork+exec /bin/true": H.timed_runs(lambda: H.spawn_wait(["/bin/true"]), n),
        "bwrap --unshare-all --ro-bind / / /bin/true": H.timed_runs(
            lambda: H.spawn_wait(["bwrap", "--unshare-all", "--ro-bind", "/", "/", "/bin/true"]),
            n),
        "bwrap (agentbox mounts) python3 -S -E -s -c pass": H.timed_runs(
            lambda: H.spawn_wait(agentbox_like_bwrap(["/usr/bin/python3", "-S", "-E", "-s", "-c",
                                                      "pass"])), n),
    }
    return out


def install_agent_copy(dest: Path) -> Path:
    """The agent's files, precompiled the way the runtime installs them."""
    import py_compile

    src = H.ROOT / "src/agentbox/agent"
    dest.mkdir()
    for name in ("main.py", "sandbox_agent.py", "protocol.py", "users.py"):
        shutil.copyfile(src / name, dest / name)
        if name != "main.py":
            py_compile.compile(str(dest / name), doraise=True,
                               invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    return dest


def measure_parts(n: int, scratch: Path) -> dict[str, list[float]]:
    agent_dir = install_agent_copy(scratch / "agent-copy")
    mkfs, mount, umount, total = [], [], [], []
    for i in range(n):
        img = scratch / f"img{i}.img"
        mnt = scratch / f"mnt{i}"
        mnt.mkdir()
        t0 = time.perf_counter()
        with open(img, "wb") as f:
            f.truncate(1024 * 1024 * 1024)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal,^resize_inode",
                        "-E", "lazy_itable_init=1,root_owner=200000:200000", str(img)],
                       check=True, capture_output=True)
        t1 = time.perf_counter()
        subprocess.run(["mount", "-o", "loop,nosuid,nodev,noatime", str(img), str(mnt)],
                       check=True, capture_output=True)
        t2 = time.perf_counter()
        subprocess.run(["umount", "-d", str(mnt)], check=True, capture_output=True)
        t3 = time.perf_counter()
        img.unlink()
        mnt.rmdir()
        mkfs.append((t1 - t0) * 1000)
        mount.append((t2 - t1) * 1000)
        umount.append((t3 - t2) * 1000)
        total.append((t3 - t0) * 1000)
    py = ["/usr/bin/python3", "-S", "-E", "-s", "-c", "pass"]
    agent_import = ["/usr/bin/python3", "-E", "-s", "-S", "-c",
                    f"import sys; sys.path.insert(0, {str(agent_dir)!r}); import sandbox_agent"]
    return {
        "truncate + mkfs.ext4 (1 GiB sparse, as workspace.py)": mkfs,
        "mount -o loop": mount,
        "umount -d": umount,
        "mkfs + mount + umount": total,
        "python3 -S -E -s -c pass": H.timed_runs(lambda: H.spawn_wait(py), max(n, 30)),
        "python3 -S: import the agent (precompiled)": H.timed_runs(
            lambda: H.spawn_wait(agent_import), max(n, 30)),
        "subprocess.run(['true']) (how mkfs/mount are spawned)": H.timed_runs(
            lambda: subprocess.run(["true"], capture_output=True, text=True), max(n, 30)),
    }


def measure_spawn_styles(n: int) -> dict[str, list[float]]:
    """What joining cgroups from preexec_fn costs, next to cheaper ways to spawn (the process
    tier's own: startctx.py)."""
    dirs = [b / "agentbox" / "bench-join" for b in H._cgroup_bases()]
    for d in dirs:
        d.mkdir(exist_ok=True)
    join = [str(d / "cgroup.procs") for d in dirs]

    def join_cgroups() -> None:
        pid = str(os.getpid()).encode()
        for path in join:
            fd = os.open(path, os.O_WRONLY)
            os.write(fd, pid)
            os.close(fd)

    def popen(**kw: Any) -> None:
        popen_argv(["/bin/true"], **kw)

    def popen_argv(argv: list[str], **kw: Any) -> None:
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, close_fds=True,
                         start_new_session=True, **kw).wait()

    from agentbox.runtimes.process import startctx

    limits = [(resource.RLIMIT_NOFILE, 1024), (resource.RLIMIT_CORE, 0)]

    try:
        return {
            "Popen(/bin/true) (vfork/posix_spawn path)": H.timed_runs(lambda: popen(), n),
            "Popen(/bin/true, preexec_fn=noop) (forces fork)": H.timed_runs(
                lambda: popen(preexec_fn=lambda: None), n),
            f"Popen(/bin/true, preexec_fn=join {len(join)} cgroups)": H.timed_runs(
                lambda: popen(preexec_fn=join_cgroups), n),
            # What the process tier runs now: the same work in small programs, no fork.
            f"Popen(sh joins {len(join)} cgroups, prlimit, setpriv, /bin/true)": H.timed_runs(
                lambda: popen_argv([*startctx.argv(join, limits, 65534), "/bin/true"]), n),
        }
    finally:
        for d in dirs:
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


# ---------------------------------------------------------------- end to end over HTTP


def measure_http(
    srv: H.BenchServer, n: int, profile: bool, template: str | None = None
) -> dict[str, Any]:
    """`template`: None for the server's default."""
    create, first, both, kill = [], [], [], []
    ids = []
    body = {"template": template} if template else {}
    prof = H.Profiler(srv.pid, H.ROOT / "bench/results/create_latency.pyspy.txt", profile)
    with srv.client() as c:
        for _ in range(3):  # warm the server's code paths
            sid = H.create_sandbox(c, **body)["sandbox_id"]
            H.run_command(c, sid, ECHO)
            c.delete(f"/v1/sandboxes/{sid}")
        with prof:
            for _ in range(n):
                t0 = time.perf_counter()
                sid = H.create_sandbox(c, **body)["sandbox_id"]
                t1 = time.perf_counter()
                code, out = H.run_command(c, sid, ECHO)
                t2 = time.perf_counter()
                assert code == 0 and out == "hi\n", (code, out)
                r = c.delete(f"/v1/sandboxes/{sid}")
                t3 = time.perf_counter()
                assert r.status_code == 204, r.text
                ids.append(sid)
                create.append((t1 - t0) * 1000)
                first.append((t2 - t1) * 1000)
                both.append((t2 - t0) * 1000)
                kill.append((t3 - t2) * 1000)
        # The server's own view of each create (manager.create, without HTTP).
        r = c.get("/v1/audit", params={"action": "sandbox.create", "limit": 10_000})
        server_side = [e["duration_ms"] for e in r.json()["events"]
                       if e["sandbox_id"] in set(ids) and e["duration_ms"] is not None]
    return {"create": create, "first": first, "both": both, "kill": kill,
            "server_create": server_side, "profile": prof.top(20)}


def measure_sdk(srv: H.BenchServer, n: int) -> dict[str, Any]:
    Sandbox, why = H.sdk_sandbox_class()
    if Sandbox is None:
        return {"available": False, "why": why}
    import inspect

    os.environ.setdefault("AGENTBOX_API_KEY", H.ADMIN_KEY)
    os.environ.setdefault("AGENTBOX_API_URL", srv.url)
    os.environ.setdefault("AGENTBOX_URL", srv.url)
    params = inspect.signature(Sandbox.create).parameters
    kw: dict[str, Any] = {}
    for name in ("api_key",):
        if name in params:
            kw[name] = H.ADMIN_KEY
    for name in ("api_url", "base_url", "url", "server_url", "domain"):
        if name in params:
            kw[name] = srv.url
            break
    both = []
    try:
        for i in range(n + 3):
            t0 = time.perf_counter()
            sbx = Sandbox.create(**kw)
            res = sbx.commands.run(ECHO)
            t1 = time.perf_counter()
            sbx.kill()
            if hasattr(sbx, "close"):
                sbx.close()
            out = getattr(res, "stdout", None)
            assert out in (None, "hi\n"), out
            if i >= 3:
                both.append((t1 - t0) * 1000)
    except Exception as e:  # noqa: BLE001 - an SDK still in progress must not sink the run
        return {"available": False, "why": f"SDK imported but failed: {type(e).__name__}: {e}"}
    return {"available": True, "both": both, "kwargs": sorted(kw)}


# ---------------------------------------------------------------- inside the runtime


class StepTimer:
    def __init__(self) -> None:
        self.steps: dict[str, list[float]] = {}

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.steps.setdefault(name, []).append((time.perf_counter() - t0) * 1000)
        return timed


def measure_runtime_steps(n: int, scratch: Path) -> dict[str, list[float]]:
    """Run ProcessRuntime's create/destroy in this process with each step timed."""
    from agentbox.runtimes import diskimage
    from agentbox.runtimes.base import Resources, SandboxSpec
    from agentbox.runtimes.process import runtime as rt_mod
    from agentbox.runtimes.process import workspace

    t = StepTimer()
    rt = rt_mod.ProcessRuntime(scratch / "runtime-data")
    real_run = diskimage.run

    def run(argv: list[str]) -> None:
        return t.wrap(f"  workspace: {argv[0]}", real_run)(argv)

    class TimedSubprocess:
        """`subprocess` as seen by runtime.py, with Popen (fork + preexec + exec) timed."""

        def __getattr__(self, name: str) -> Any:
            return getattr(subprocess, name)

        Popen = staticmethod(t.wrap("  spawn: subprocess.Popen(start context + bwrap)",
                                    subprocess.Popen))

    saved = (diskimage.run, workspace.create, workspace.destroy, diskimage.umount,
             rt_mod.subprocess)
    diskimage.run = run
    workspace.create = t.wrap("workspace.create (mkdir, truncate, mkfs, mount, chown)",
                              workspace.create)
    workspace.destroy = t.wrap("destroy: workspace.destroy (umount -d, rm)", workspace.destroy)
    rt_mod.subprocess = TimedSubprocess()
    rt.cgroups.create = t.wrap("cgroups.create (mkdir + limits, 4 controllers)",
                               rt.cgroups.create)
    rt._spawn = t.wrap("_spawn (total)", rt._spawn)
    rt._read_info = t.wrap("  spawn: wait for bwrap's child pid (info fd)", rt._read_info)
    rt._wait_for_agent = t.wrap("  spawn: wait for the agent to answer ping",
                                rt._wait_for_agent)
    rt._write_state = t.wrap("_write_state", rt._write_state)
    rt.cgroups.kill_all = t.wrap("destroy: cgroups.kill_all", rt.cgroups.kill_all)
    rt.cgroups.remove = t.wrap("destroy: cgroups.remove (rmdir)", rt.cgroups.remove)
    created: list[str] = []
    try:
        for i in range(n + 2):
            sid = "sbx_bench" + secrets.token_hex(6)
            spec = SandboxSpec(sandbox_id=sid, template="default", resources=Resources())
            t0 = time.perf_counter()
            state = rt._create_sync(spec)
            t1 = time.perf_counter()
            created.append(sid)
            rt._destroy_sync(sid, state, keep_workspace=False)
            t2 = time.perf_counter()
            created.remove(sid)
            if i < 2:  # warm-up: drop what was recorded
                t.steps.clear()
                continue
            t.steps.setdefault("CREATE TOTAL (_create_sync)", []).append((t1 - t0) * 1000)
            t.steps.setdefault("DESTROY TOTAL (_destroy_sync)", []).append((t2 - t1) * 1000)
    finally:
        (diskimage.run, workspace.create, workspace.destroy, diskimage.umount,
         rt_mod.subprocess) = saved
        for sid in created:
            try:
                rt._destroy_sync(sid, None, keep_workspace=False)
            except Exception:  # noqa: BLE001 - the harness sweep still runs
                pass
        asyncio.run(rt.close())
    return t.steps


# ---------------------------------------------------------------- main


def main() -> None:
    p = H.base_args(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=50, help="create+command iterations (default 50)")
    p.add_argument("--floor-n", type=int, default=100, help="floor iterations (default 100)")
    p.add_argument("--parts-n", type=int, default=10, help="mkfs/mount iterations (default 10)")
    p.add_argument("--no-runtime-steps", action="store_true")
    args = p.parse_args()
    mach = H.print_header("Benchmark 1: cold create -> first command (`echo hi`)")
    result: dict[str, Any] = {"name": "create_latency", "machine": mach,
                              "command": "  ".join(["bench/create_latency.py", *sys.argv[1:]])}
    rows: list[dict[str, Any]] = []

    floors = measure_floors(args.floor_n)
    print("Floors (same run):")
    H.print_timings(floors, 58)

    with H.BenchServer("create") as srv:
        parts = measure_parts(args.parts_n, srv.root)
        parts.update(measure_spawn_styles(max(args.parts_n, 30)))
        print("\nParts of a create, measured alone:")
        H.print_timings(parts, 58)

        http = measure_http(srv, args.n, args.profile)
        print(f"\nEnd to end over HTTP (httpx, keep-alive client, default resources, the "
              f"default template: {srv.default_template}):")
        for key, label in (("both", "create + first command (TOTAL)"),
                           ("create", "POST /v1/sandboxes alone"),
                           ("server_create", "  server-side manager.create (audit duration)"),
                           ("first", "first command `echo hi` (POST .../commands, NDJSON)"),
                           ("kill", "DELETE /v1/sandboxes/{id} (not in total)")):
            print(f"  {label:58s} {H.fmt_ms(H.summarize(http[key]))}")
        host = measure_http(srv, args.n, False, "host") if srv.default_template != "host" else {}
        if host:
            print(f"  {'create + first command, the host template':58s} "
                  f"{H.fmt_ms(H.summarize(host['both']))}")
        sdk = measure_sdk(srv, args.n)
        if sdk["available"]:
            print(f"\nVia the SDK (Sandbox.create + commands.run): "
                  f"{H.fmt_ms(H.summarize(sdk['both']))}")
        else:
            print(f"\nSDK not usable yet ({sdk['why']}); headline number is via httpx")
        if http["profile"]:
            print("\npy-spy on the server during the HTTP loop (inclusive %, self %):")
            for f, inc, own in http["profile"]:
                print(f"  {inc:5.1f}% {own:5.1f}%  {f}")

    steps: dict[str, list[float]] = {}
    if not args.no_runtime_steps:
        with H.scratch_dir("create-steps") as scratch:
            steps = measure_runtime_steps(min(args.n, 30), scratch)
        print("\nProcessRuntime steps, in-process (same code as the server, timed wrappers):")
        H.print_timings(steps, 66)

    total = H.summarize(sdk["both"] if sdk["available"] else http["both"])
    via = "SDK" if sdk["available"] else "httpx"
    bw = H.summarize(floors["bwrap --unshare-all --ro-bind / / /bin/true"])
    fe = H.summarize(floors["fork+exec /bin/true"])
    rows.append({
        "metric": f"cold create -> first `echo hi` done (via {via})",
        "goal": f"p50 <= {GOAL_P50_MS:.0f} ms", "p50": total["p50"], "p99": total["p99"],
        "unit": "ms", "met": total["p50"] <= GOAL_P50_MS,
        "floor": f"bare bwrap p50 {bw['p50']:.2f} ms / p99 {bw['p99']:.2f}; fork+exec "
                 f"p50 {fe['p50']:.2f} / p99 {fe['p99']:.2f}",
        "ratio": f"{total['p50'] / bw['p50']:.0f}x bare bwrap",
    })
    if host:
        h = H.summarize(host["both"])
        rows.append({
            "metric": "cold create -> first `echo hi` done, host template (via httpx)",
            "p50": h["p50"], "p99": h["p99"], "unit": "ms",
        })
    print(f"\nRESULT: {rows[0]['metric']}: p50 {total['p50']:.1f} ms, p99 {total['p99']:.1f} ms "
          f"(goal p50 <= {GOAL_P50_MS:.0f} ms: {'MET' if rows[0]['met'] else 'MISSED'}); "
          f"{rows[0]['ratio']}")
    print(f"leftovers after cleanup: {srv.leftovers}; host bwrap processes now: "
          f"{H.host_bwrap_count()}")
    result.update(rows=rows, floors={k: H.summarize(v) for k, v in floors.items()},
                  parts={k: H.summarize(v) for k, v in parts.items()},
                  http={k: H.summarize(v) for k, v in http.items() if k != "profile"},
                  profile=http["profile"], sdk={k: (H.summarize(v) if k == "both" else v)
                                                for k, v in sdk.items()},
                  runtime_steps={k: H.summarize(v) for k, v in steps.items()},
                  leftovers=srv.leftovers)
    H.emit(result, args.json)


if __name__ == "__main__":
    H.run_isolated(main)
