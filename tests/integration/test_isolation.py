"""Isolation of the process runtime, judged from the host wherever possible.

Every probe runs inside a real sandbox and the verdict comes from host-side evidence (canary
nonces, host files, a host TCP listener, /proc, cgroupfs, mountinfo). Where it is cheap, the same
probe is first shown to succeed on the host (positive control), so a pass means something.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentbox.runtimes.process.userns import ROOT_CAP_MASK

try:
    from . import _http as h
except ImportError:  # tests/integration is not a package
    import _http as h

pytestmark = pytest.mark.security

# What a sandbox can see of the host tree that is worth searching (bounded on purpose).
SEARCH_ROOTS = "/etc /usr/local /opt /home /root /var /srv /mnt /workspace /tmp /run"
# Output separator; commands print it as `echo @@''SEP@@` so their own argv (visible to `ps`)
# never contains it.
SEP = "@@SEP@@"


# ---------------------------------------------------------------- fixtures and host helpers


@pytest.fixture
def client(server, tenant_key: str) -> Iterator[httpx.Client]:
    with server.client(tenant_key) as c:
        yield c


@pytest.fixture
def boxes(client: httpx.Client) -> Iterator[h.Sandboxes]:
    b = h.Sandboxes(client)
    yield b
    b.close()


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def host_pids_of(sandbox_id: str, uid: int | None = None) -> dict[int, str]:
    """Host pids that belong to a sandbox: by cgroup, by command line, or by its host uid."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            cg = Path(f"/proc/{pid}/cgroup").read_text()
            cmdline = (
                Path(f"/proc/{pid}/cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if "State:\tZ" in status and sandbox_id not in cg:
            continue
        uids = re.search(r"^Uid:\s+(\d+)\s+(\d+)", status, re.M)
        if (
            sandbox_id in cg
            or sandbox_id in cmdline
            or (uid is not None and uids and uid in (int(uids[1]), int(uids[2])))
        ):
            found[pid] = cmdline.strip()
    return found


def mounts_matching(*needles: str) -> list[str]:
    """Host mount points (from /proc/self/mountinfo) whose path contains any needle."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mnt = line.split()[4].replace("\\040", " ")
        if any(n in mnt for n in needles):
            out.append(mnt)
    return out


def cgroup_dirs(sandbox_id: str) -> list[Path]:
    """The sandbox's cgroup directories (v1 per controller or v2; scoped per server or not)."""
    root = Path("/sys/fs/cgroup")
    found: set[Path] = set()
    for pattern in (
        f"agentbox/{sandbox_id}",
        f"agentbox/*/{sandbox_id}",
        f"*/agentbox/{sandbox_id}",
        f"*/agentbox/*/{sandbox_id}",
    ):
        found.update(p for p in root.glob(pattern) if p.is_dir())
    return sorted(found)


def runtime_state(server, sandbox_id: str) -> dict:
    return json.loads((server.data_dir / "sandboxes" / sandbox_id / "runtime.json").read_text())


def host_binds(server, sandbox_id: str) -> dict[str, Path]:
    """Sandbox path -> host path of every bind mount, read from the live bwrap's argv."""
    pid = runtime_state(server, sandbox_id)["bwrap_pid"]
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    assert argv[0].endswith("bwrap"), argv
    binds = {}
    for i, arg in enumerate(argv[:-2]):
        if arg in ("--bind", "--ro-bind", "--dev-bind"):
            binds[argv[i + 2]] = Path(argv[i + 1])
    assert "/workspace" in binds, argv
    return binds


def wait_until(pred, timeout: float = 5.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


# ---------------------------------------------------------------- filesystem: read


def test_host_canaries_are_unreadable(server, client, boxes) -> None:
    sid = boxes.new()
    canary = "CANARY-" + secrets.token_hex(16)
    sdir = server.data_dir / "sandboxes" / sid
    binds = host_binds(server, sid)
    bind_dir = binds["/workspace"].parent  # holds the workspace mount point on the host
    planted: list[Path] = []
    made_dirs: list[Path] = []
    # Outside every mount of the sandbox: user homes, /var/tmp, /opt, host /tmp, the server's
    # data dir and the sandbox's own state directory right next to its workspace mount.
    for base in (
        "/root",
        "/home",
        "/var/tmp",
        "/opt",
        "/srv",
        "/mnt",
        "/tmp",
        "/run",
        str(server.data_dir),
        str(sdir),
        str(bind_dir),
        str(bind_dir.parent),
    ):
        b = Path(base)
        if not b.is_dir():
            continue
        d = b / f".agentbox-canary-{secrets.token_hex(4)}"
        d.mkdir()
        os.chmod(d, 0o755)
        made_dirs.append(d)
        f = d / "canary.txt"
        f.write_text(canary + "\n")
        os.chmod(f, 0o644)  # world-readable: only the sandbox boundary stands in the way
        planted.append(f)
    try:
        assert len(planted) >= 6, planted
        # Positive control: the very same probe finds every canary on the host.
        host = subprocess.run(
            ["grep", "-rl", "--no-messages", canary, *map(str, made_dirs)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert sorted(host.stdout.split()) == sorted(map(str, planted)), host

        r = h.run(
            client,
            sid,
            f'timeout 40 grep -rl --no-messages -I -D skip "$CANARY" {SEARCH_ROOTS}; '
            "echo grep-rc=$?",
            timeout=60,
            envs={"CANARY": canary},
        )
        assert "grep-rc=" in r.stdout, r
        assert canary not in r.stdout and canary not in r.stderr, r
        assert "canary.txt" not in r.stdout, r
        # 1 = nothing found; 2 = also some unreadable or missing roots; 124 = timed out.
        assert re.search(r"grep-rc=[12]\b", r.stdout), f"grep did not finish cleanly: {r}"

        # In-sandbox control: the same search does find the nonce where the sandbox can see it.
        ctl = h.run(
            client,
            sid,
            "printf '%s\\n' \"$CANARY\" > /workspace/control.txt; "
            f'timeout 40 grep -rl --no-messages -I -D skip "$CANARY" {SEARCH_ROOTS}; '
            "rm /workspace/control.txt",
            timeout=60,
            envs={"CANARY": canary},
        )
        # (the workspace is E2B's /home/user too: the same file through both mounts)
        assert sorted(ctl.stdout.split()) == ["/home/user/control.txt", "/workspace/control.txt"]

        paths = " ".join(f"'{p}' '/proc/1/root{p}' '/proc/self/root{p}'" for p in planted)
        r = h.run(
            client,
            sid,
            f'for p in {paths}; do if cat "$p"; then echo "READ $p"; fi; done',
            timeout=30,
        )
        assert canary not in r.stdout, r
        assert "READ " not in r.stdout, r
        assert (
            r.stderr.count("No such file or directory") + r.stderr.count("Permission denied")
            >= len(planted) * 3
        ), r
    finally:
        for d in made_dirs:
            shutil.rmtree(d, ignore_errors=True)


def test_root_only_host_files_unreadable(client, boxes) -> None:
    sid = boxes.new()
    assert os.path.exists("/etc/shadow")
    # Positive control: root on the host reads it.
    Path("/etc/shadow").read_bytes()
    r = h.run(client, sid, "cat /etc/shadow; echo rc=$?")
    assert "rc=0" not in r.stdout, r
    assert "Permission denied" in r.stderr, r


# ---------------------------------------------------------------- filesystem: write


def test_cannot_write_outside_workspace_and_tmp(server, client, boxes) -> None:
    sid = boxes.new()
    name = f"agentbox-probe-{secrets.token_hex(4)}"
    binds = host_binds(server, sid)
    agent_main = binds["/.agentbox"] / "main.py"
    watched = ["/etc/hostname", "/etc/passwd", "/usr/bin/env", str(agent_main)]
    before = {p: sha256(p) for p in watched}
    targets = [
        "/etc",
        "/usr",
        "/usr/local",
        "",
        "/var",
        "/opt",
        "/.agentbox",
        "/run",
        "/dev",
        "/proc",
    ]
    script = "; ".join(f"(echo pwned > {t}/{name}) && echo 'WROTE {t}/{name}'" for t in targets)
    script += (
        "; (echo pwned >> /etc/hostname) && echo WROTE-hostname"
        "; (echo pwned >> /.agentbox/main.py) && echo WROTE-agent"
        "; touch -d 2001-01-01 /etc/passwd && echo WROTE-touch"
        "; chmod 777 /usr/bin/env && echo WROTE-chmod"
        "; ln /etc/passwd /workspace/hardlink && echo WROTE-hardlink"
        "; mv /etc/hostname /workspace/h && echo WROTE-mv; true"
    )
    r = h.run(client, sid, script)
    assert "WROTE" not in r.stdout, r
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(errors) >= len(targets) + 5, r
    for ln in errors:
        assert re.search(
            r"Read-only file system|Permission denied|Operation not permitted|"
            r"No such file or directory|cross-device",
            ln,
        ), f"unexpected: {ln}\n{r}"
    assert "Read-only file system" in r.stderr and "Permission denied" in r.stderr, r

    # Host side: nothing appeared, nothing changed.
    for t in ("/etc", "/usr", "/usr/local", "/var", "/opt", "/run", "/"):
        assert not (Path(t) / name).exists(), t
    assert not (binds["/.agentbox"] / name).exists()
    for p in watched:
        assert sha256(p) == before[p], p
    assert os.stat("/etc/passwd").st_mtime > 978307200 + 86400  # not touched to 2001

    # Control: /workspace and /tmp are writable, and /workspace lands in the sandbox's own dir.
    r = h.run(
        client,
        sid,
        f"echo ok > /workspace/{name} && echo ok > /tmp/{name} && "
        f"cat /workspace/{name} /tmp/{name}",
    )
    assert r.ok and r.stdout.split() == ["ok", "ok"], r
    ws_file = binds["/workspace"] / name
    assert ws_file.read_text() == "ok\n"
    assert not (Path("/tmp") / name).exists()  # the sandbox /tmp is its own tmpfs


# ---------------------------------------------------------------- network


class Listener:
    """A TCP listener on the host counting every connection it accepts."""

    def __init__(self, host: str = "0.0.0.0") -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.hits = 0
        self.stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.hits += 1
            conn.close()

    def close(self) -> None:
        self.stop = True
        self.thread.join(2)
        self.sock.close()


def _host_ips() -> list[str]:
    ips = {"127.0.0.1"}
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout
        ips |= {ip for ip in out.split() if ":" not in ip}
    except (OSError, subprocess.SubprocessError):
        pass
    return sorted(ips)


def test_no_network_to_host(server, client, boxes) -> None:
    sid = boxes.new()
    lst = Listener()
    try:
        ips = _host_ips()
        # Positive control: the probe connects from the host.
        for ip in ips:
            socket.create_connection((ip, lst.port), timeout=2).close()
        assert wait_until(lambda: lst.hits == len(ips)), lst.hits
        lst.hits = 0

        py = (
            "import socket,sys\n"
            "for ip in sys.argv[2:]:\n"
            "    try:\n"
            "        socket.create_connection((ip, int(sys.argv[1])), timeout=2).close()\n"
            "        print('CONNECTED', ip)\n"
            "    except OSError as e:\n"
            "        print('refused', ip, e)\n"
        )
        api_port = server.port
        ip_args = " ".join(ips)
        r = h.run(
            client,
            sid,
            f'python3 -c "$PY" {lst.port} {ip_args}; '
            f'python3 -c "$PY" {api_port} 127.0.0.1; '
            f"for ip in {ip_args}; do "
            f'  (timeout 3 bash -c "exec 3<>/dev/tcp/$ip/{lst.port}") '
            "&& echo CONNECTED-tcp $ip; done; true",
            timeout=60,
            envs={"PY": py},
        )
        assert "CONNECTED" not in r.stdout, r
        assert len(re.findall(r"^refused ", r.stdout, re.M)) == len(ips) + 1, r
        time.sleep(0.3)
        assert lst.hits == 0, f"the host listener got {lst.hits} connection(s) from the sandbox"
    finally:
        lst.close()

    r = h.run(client, sid, "cat /proc/net/dev; ls /sys/class/net 2>/dev/null; true")
    ifaces = [ln.split(":")[0].strip() for ln in r.stdout.splitlines() if ":" in ln]
    assert ifaces == ["lo"], r
    # Sanity: the host itself has more than loopback in its own /proc/net/dev, or at least lo.
    host_ifaces = [
        ln.split(":")[0].strip()
        for ln in Path("/proc/net/dev").read_text().splitlines()
        if ":" in ln
    ]
    assert "lo" in host_ifaces


# ---------------------------------------------------------------- processes


def test_cannot_see_host_processes(server, client, boxes) -> None:
    sid = boxes.new()
    marker = f"{secrets.randbelow(10**6) + 10**6}.{secrets.randbelow(1000)}"
    host_sleep = subprocess.Popen(["sleep", marker])
    try:
        # Positive control: the host sees the marker process by its command line.
        host_cmds = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert f"sleep {marker}" in host_cmds
        host_init = Path("/proc/1/cmdline").read_bytes()
        r = h.run(
            client,
            sid,
            "ls /proc | grep -E '^[0-9]+$' | wc -l; echo @@''SEP@@; ps -eo pid,args; "
            "echo @@''SEP@@; for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; "
            "done; echo @@''SEP@@; "
            f"kill -0 {os.getpid()} {server.proc.pid} {host_sleep.pid} 2>&1; "
            "echo kill-rc=$?; echo @@''SEP@@; cat /proc/1/cmdline | base64 -w0",
        )
        count, ps_out, cmdlines, kill_out, init_b64 = r.stdout.split(SEP)
        n = int(count.strip())
        assert 0 < n <= 10, f"{n} processes visible in the sandbox:\n{r}"
        assert f"sleep {marker}" not in r.stdout, r
        for needle in ("pytest", "agentbox.cli", "uvicorn", "systemd", "serve --host"):
            assert needle not in ps_out and needle not in cmdlines, (needle, r)
        assert "kill-rc=0" not in kill_out and "No such process" in kill_out, r
        import base64

        sandbox_init = base64.b64decode(init_b64.strip())
        assert sandbox_init != host_init, sandbox_init
        assert sandbox_init.startswith(b"bwrap"), sandbox_init
        assert host_sleep.poll() is None  # still alive, untouched
    finally:
        host_sleep.kill()
        host_sleep.wait()


# ---------------------------------------------------------------- secrets


def test_server_secrets_not_visible(server, client, tenant_key, boxes) -> None:
    sid = boxes.new(envs={"USER_SECRET": "visible-by-design"})
    secrets_to_hide = [server.admin_key, tenant_key]
    boot = server.data_dir / "admin.key"
    if boot.exists():
        secrets_to_hide.append(boot.read_text().strip())
    # Positive control: the server process on the host does hold the admin key in its env.
    assert server.admin_key.encode() in Path(f"/proc/{server.proc.pid}/environ").read_bytes()

    r = h.run(
        client,
        sid,
        "env; echo @@''SEP@@; for p in /proc/[0-9]*; do "
        "tr '\\0' '\\n' < $p/environ 2>/dev/null; done; echo; echo environ-done",
    )
    assert "USER_SECRET=visible-by-design" in r.stdout, r  # control: user envs do arrive
    assert "environ-done" in r.stdout, r
    assert "AGENTBOX_ADMIN_KEY" not in r.stdout, r
    for s in secrets_to_hide:
        assert s not in r.stdout and s not in r.stderr, r

    # Search the visible tree for the values. They travel reversed (so the probe's own
    # environment is no false hit) and are turned back into unexported shell variables.
    r = h.run(
        client,
        sid,
        'k1=$(printf %s "$K1" | rev); k2=$(printf %s "$K2" | rev); '
        f'timeout 40 grep -rl --no-messages -I -D skip -F -e "$k1" -e "$k2" '
        f"{SEARCH_ROOTS} /proc/1/cmdline /proc/1/environ /proc/2/cmdline /proc/3/cmdline;"
        " echo grep-rc=$?",
        timeout=60,
        envs={"K1": server.admin_key[::-1], "K2": tenant_key[::-1]},
    )
    assert re.search(r"grep-rc=[12]\b", r.stdout), r
    assert "/" not in r.stdout.replace("grep-rc", ""), r


# ---------------------------------------------------------------- privileges


@pytest.mark.parametrize("user", ["user", "root"])
def test_privileges_seccomp_and_no_new_namespaces(server, client, boxes, user: str) -> None:
    """`user` holds no capability; the sandbox's root holds exactly ROOT_CAPS, in its own user
    namespace only: neither can mount, make a user namespace or (user) become root."""
    sid = boxes.new()
    mount_py = (
        "import ctypes\n"
        "l = ctypes.CDLL(None, use_errno=True)\n"
        "rc = l.mount(b'none', b'/workspace', b'tmpfs', 0, None)\n"
        "print('mount', rc, ctypes.get_errno())\n"
        "rc = l.unshare(0x10000000)\n"  # CLONE_NEWUSER
        "print('unshare', rc, ctypes.get_errno())\n"
        "rc = l.setuid(0 if l.getuid() else 1234)\n"
        "print('setuid', rc, ctypes.get_errno())\n"
    )
    r = h.run(
        client,
        sid,
        "grep -E '^(Uid|Gid|Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs|Seccomp):' /proc/self/status;"
        " echo @@''SEP@@; id -u; echo @@''SEP@@; unshare -U true; echo unshare-rc=$?; "
        "unshare -r true; echo unshare-r-rc=$?; echo @@''SEP@@; python3 -c \"$PY\"",
        envs={"PY": mount_py},
        user=user,
    )
    status, uid, unshare_out, py_out = r.stdout.split(SEP)
    fields = dict(re.findall(r"^(\w+):\s+(.*)$", status, re.M))
    assert fields["Seccomp"] == "2", r
    assert fields["NoNewPrivs"] == "1", r
    granted = ROOT_CAP_MASK if user == "root" else 0
    for cap in ("CapPrm", "CapEff"):
        assert int(fields[cap], 16) == granted, (cap, r)
    for cap in ("CapInh", "CapAmb"):
        assert int(fields[cap], 16) == 0, (cap, r)
    # The bounding set is the root's (a uid-1000 process under no_new_privs never regains any).
    assert int(fields["CapBnd"], 16) == ROOT_CAP_MASK, r
    assert int(uid) == (0 if user == "root" else 1000), r
    assert "unshare-rc=0" not in unshare_out and "unshare-r-rc=0" not in unshare_out, r
    m = dict((k, (int(a), int(b))) for k, a, b in re.findall(r"(\w+) (-?\d+) (\d+)", py_out))
    assert m["mount"][0] == -1 and m["mount"][1] in (1, 38), r  # EPERM / ENOSYS
    assert m["unshare"][0] == -1 and m["unshare"][1] in (1, 22, 28, 38), r
    assert m["setuid"][0] == (0 if user == "root" else -1), r

    # Host side: the sandbox's processes run as its own block of host uids, its root's
    # capabilities belong to its own user namespace (mapped onto that block), none to the host's.
    state = runtime_state(server, sid)
    base, count = state["range"]
    pid = state["init_pid"]
    assert Path(f"/proc/{pid}/uid_map").read_text().split() == ["0", str(base), str(count)]
    assert os.readlink(f"/proc/{pid}/ns/user") != os.readlink("/proc/self/ns/user")
    st = Path(f"/proc/{pid}/status").read_text()
    host = dict(re.findall(r"^(\w+):\s+(.*)$", st, re.M))
    assert all(base <= int(u) < base + count for u in host["Uid"].split()), host["Uid"]
    assert int(host["CapEff"], 16) & ~ROOT_CAP_MASK == 0, host
    assert host["NoNewPrivs"] == "1" and host["Seccomp"] == "2", host


# ---------------------------------------------------------------- resource exhaustion


def _probe_latency(
    client: httpx.Client, sid: str, stop: threading.Event, samples: list[float], errors: list[str]
) -> None:
    while not stop.is_set():
        try:
            r = h.run(client, sid, "echo ok", timeout=10, http_timeout=30)
            if r.stdout.strip() != "ok":
                errors.append(str(r))
            samples.append(r.elapsed)
        except (AssertionError, httpx.HTTPError) as e:
            errors.append(repr(e))
        time.sleep(0.1)


class Prober:
    """Runs `echo ok` in a neighbour sandbox in a loop and records each round trip."""

    def __init__(self, server, key: str, sid: str) -> None:
        self.client = server.client(key)
        self.samples: list[float] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=_probe_latency,
            daemon=True,
            args=(self.client, sid, self.stop, self.samples, self.errors),
        )

    def __enter__(self) -> Prober:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(40)
        self.client.close()

    def check(self, min_samples: int = 3) -> None:
        assert not self.errors, self.errors[:3]
        assert len(self.samples) >= min_samples, self.samples
        assert max(self.samples) < 2.0, f"neighbour latency under attack: {self.samples}"


def _pids_files(sid: str) -> tuple[Path, Path]:
    for d in cgroup_dirs(sid):
        if (d / "pids.max").exists():
            return d / "pids.current", d / "pids.max"
    raise AssertionError(f"no pids cgroup for {sid}: {cgroup_dirs(sid)}")


def test_fork_bomb_is_contained(server, client, boxes) -> None:
    a = boxes.new(resources={"memory_mb": 256, "pids": 128})
    b = boxes.new()
    state_a = runtime_state(server, a)
    current, pmax = _pids_files(a)
    assert pmax.read_text().strip() == "128"
    peak = 0
    with Prober(server, client.headers["X-API-Key"], b) as probe:
        # The short sleep lets the command start cleanly first: a bomb that fills the pids
        # cgroup before the agent has its reader threads is refused as "could not start".
        h.run_bg(client, a, "sleep 0.3; bash -c ':(){ :|:& };:'", timeout=5)
        deadline = time.monotonic() + 6
        host_worst = 0.0
        while time.monotonic() < deadline:
            peak = max(peak, int(current.read_text()))
            t0 = time.monotonic()
            subprocess.run(["true"], check=True, timeout=5)
            assert httpx.get(f"{server.url}/v1/health", timeout=5).status_code == 200
            host_worst = max(host_worst, time.monotonic() - t0)
            time.sleep(0.2)
    # The bomb really went off and hit the fence, and the fence held. Sampling the count misses
    # the peaks of a bomb whose refused forks make processes exit (more so on the one CPU a
    # one-CPU sandbox is pinned to); the cgroup counts every fork it refused at the limit.
    events = current.with_name("pids.events")
    refused = int(events.read_text().split()[1]) if events.exists() else 0
    assert peak >= 100 or refused > 0, f"the fork bomb never got going (peak {peak} pids)"
    assert peak <= 128, f"pids cgroup exceeded its limit: {peak}"
    assert host_worst < 2, f"host stalled for {host_worst:.2f} s"
    probe.check()
    # Whatever state A is in, killing it takes every bomb process with it.
    assert h.kill(client, a).status_code == 204
    left = wait_until(lambda: not host_pids_of(a, state_a["uid"]), 3) or host_pids_of(
        a, state_a["uid"]
    )
    assert left is True, f"fork bomb processes survived the kill: {len(left)}"


def test_sandbox_survives_its_own_fork_bomb(client, boxes) -> None:
    a = boxes.new(resources={"memory_mb": 256, "pids": 128})
    h.run_bg(client, a, "bash -c ':(){ :|:& };:'", timeout=5)
    time.sleep(0.5)
    # Requests while the pids limit is exhausted may be refused, but must not be fatal.
    codes = []
    until = time.monotonic() + 3
    while time.monotonic() < until:
        r = client.get(f"/v1/sandboxes/{a}/files/stat", params={"path": "/workspace"})
        codes.append(r.status_code)
        time.sleep(0.03)
    # The bomb's own command returned at once; its processes live on like any daemon it
    # started. Killing the command kills what it left behind, and the sandbox recovers.
    cmd_id = client.get(f"/v1/sandboxes/{a}/commands").json()["commands"][0]["cmd_id"]
    r = client.post(f"/v1/sandboxes/{a}/commands/{cmd_id}/kill", json={})
    assert r.status_code == 204, r.text
    r = h.run(client, a, "ps -e --no-headers | wc -l; echo alive", timeout=10)
    assert r.ok and "alive" in r.stdout, (r, sorted(set(codes)))
    assert int(r.stdout.split()[0]) < 10, f"the bomb outlived the kill: {r}"


def test_memory_bomb_is_contained(server, client, boxes) -> None:
    a = boxes.new(resources={"memory_mb": 256})
    b = boxes.new()
    with Prober(server, client.headers["X-API-Key"], b) as probe:
        t0 = time.monotonic()
        mem = h.run(
            client,
            a,
            "python3 -c \"x = b'\\x01' * (2 * 1024**3); print('ALLOCATED', len(x))\"",
            timeout=60,
        )
        elapsed = time.monotonic() - t0
        time.sleep(max(0.0, 1.0 - elapsed))
    assert "ALLOCATED" not in mem.stdout, mem
    assert mem.exit_code not in (0, None), mem
    assert mem.violation and mem.violation["code"] == "memory_limit", mem
    assert mem.violation["setting"] == "resources.memory_mb", mem
    probe.check(min_samples=2)
    # A recovers: only the offending process died.
    r = h.run(client, a, "echo alive")
    assert r.ok and r.stdout.strip() == "alive", r
    for d in cgroup_dirs(a):
        usage = d / "memory.usage_in_bytes"
        if usage.exists():
            assert int(usage.read_text()) <= 256 * 1024 * 1024


def test_the_agent_is_the_out_of_memory_killers_last_choice(client, boxes) -> None:
    # Every command (and sudo's root process, and what they fork) is born with a raised
    # score, so under memory pressure a sandbox loses a command, not the agent (which would
    # end it). $PPID of the command's shell is the agent. No command can lower its own.
    a = boxes.new()
    r = h.run(
        client,
        a,
        "cat /proc/$PPID/oom_score_adj /proc/self/oom_score_adj; "
        "sudo cat /proc/self/oom_score_adj; (sleep 0; cat /proc/self/oom_score_adj); "
        "sudo sh -c 'echo 0 > /proc/self/oom_score_adj' 2>/dev/null || echo refused",
    )
    assert r.ok and r.stdout.split() == ["0", "500", "500", "500", "refused"], r


# ---------------------------------------------------------------- kill leaves nothing behind


def test_kill_leaves_nothing_behind(server, client) -> None:
    sid = h.create(client)["sandbox_id"]
    try:
        state = runtime_state(server, sid)
        sdir = server.data_dir / "sandboxes" / sid
        ws = host_binds(server, sid)["/workspace"]
        h.run_bg(
            client,
            sid,
            "setsid nohup sleep 1000 >/dev/null 2>&1 & "
            "( ( sleep 1001 </dev/null >/dev/null 2>&1 & ) & ); "
            "python3 -c 'import os,time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            '        os.execvp("sleep", ["sleep", "1002"])\n'
            "    os._exit(0)\n'; "
            "exec sleep 1003",
        )

        # Positive control: before the kill the host sees all of it.
        def sleeps() -> set[str]:
            return {c for c in host_pids_of(sid, state["uid"]).values() if c.startswith("sleep")}

        want = {"sleep 1000", "sleep 1001", "sleep 1002", "sleep 1003"}
        assert wait_until(lambda: sleeps() >= want, 5), sleeps()
        pids = host_pids_of(sid, state["uid"])
        assert state["init_pid"] in pids and state["bwrap_pid"] in pids, (state, pids)
        assert str(ws) in mounts_matching(sid), "expected the workspace mount before the kill"
        assert cgroup_dirs(sid), "expected the sandbox cgroups before the kill"
        assert sdir.is_dir()
    finally:
        r = h.kill(client, sid)
    assert r.status_code == 204, r.text

    left = wait_until(lambda: not host_pids_of(sid, state["uid"]), 3) or host_pids_of(
        sid, state["uid"]
    )
    assert left is True, f"processes of {sid} survived the kill: {left}"
    for key in ("init_pid", "bwrap_pid"):
        pid = state[key]
        alive = Path(f"/proc/{pid}").exists() and sid in Path(
            f"/proc/{pid}/cmdline"
        ).read_bytes().decode(errors="replace")
        assert not alive, f"{key} {pid} still alive"
    assert mounts_matching(sid) == []
    assert cgroup_dirs(sid) == []
    assert not sdir.exists()
    assert not ws.exists() and not ws.parent.exists() if sid in str(ws) else not ws.exists()
    r = client.get(f"/v1/sandboxes/{sid}")
    assert r.status_code == 200 and r.json()["state"] == "killed", r.text
    # Idempotent.
    assert h.kill(client, sid).status_code == 204


def test_command_timeout_kills_daemonized_grandchildren(client, boxes) -> None:
    sid = boxes.new()
    info = h.run_bg(client, sid, "bash -c 'setsid sleep 301 & sleep 302'; sleep 303", timeout=2)
    # Positive control: while it runs, the sandbox shows the sleeps.
    r = h.run(client, sid, "sleep 0.5; ps -eo args")
    assert "sleep 301" in r.stdout and "sleep 302" in r.stdout, r
    with client.stream(
        "GET", f"/v1/sandboxes/{sid}/commands/{info['cmd_id']}/events", timeout=30
    ) as resp:
        assert resp.status_code == 200, resp.read()
        events = [json.loads(ln) for ln in resp.iter_lines() if ln.strip()]
    end = events[-1]
    assert end["type"] == "end" and end["timed_out"] is True, events
    assert (end.get("violation") or {}).get("code") == "command_timeout", end
    r = h.run(client, sid, "sleep 0.3; ps -eo args")
    assert "sleep 30" not in r.stdout, r

    # The foreground form with a 1 s timeout, as the HTTP stream reports it.
    t0 = time.monotonic()
    fg = h.run(client, sid, "bash -c 'setsid sleep 304 & sleep 305'", timeout=1)
    assert time.monotonic() - t0 < 10, fg
    assert fg.end["timed_out"] is True, fg
    r = h.run(client, sid, "sleep 0.3; ps -eo args")
    assert "sleep 30" not in r.stdout, r


# ---------------------------------------------------------------- cross-tenant


def test_tenants_cannot_see_or_signal_each_other(server, client, boxes) -> None:
    key_b = server.make_key(f"other-{secrets.token_hex(4)}")
    with server.client(key_b) as client_b:
        a = boxes.new()
        b = boxes.new(client=client_b)
        canary = "B-CANARY-" + secrets.token_hex(16)
        r = h.run(
            client_b,
            b,
            f"echo {canary} > /workspace/secret.txt; "
            f"echo {canary} > /tmp/secret.txt; echo {canary} > /dev/shm/secret.txt; "
            "cat /workspace/secret.txt",
        )
        assert r.stdout.strip() == canary, r
        boxes.owners[b] = client  # B is killed below, while client_b is still open
        h.run_bg(client_b, b, "exec sleep 777")
        state_b = runtime_state(server, b)

        def b_sleep_pid() -> int | None:
            for pid, cmd in host_pids_of(b, state_b["uid"]).items():
                if cmd == "sleep 777":
                    return pid
            return None

        host_pid = wait_until(b_sleep_pid, 5)
        assert host_pid, "control: B's sleep is visible from the host"
        a_uid = runtime_state(server, a)["uid"]
        assert a_uid != state_b["uid"], "two sandboxes share a host uid"

        r = h.run(
            client,
            a,
            "ls -A /workspace; echo @@''SEP@@; cat /workspace/secret.txt /tmp/secret.txt "
            "/dev/shm/secret.txt 2>&1; echo @@''SEP@@; "
            f'timeout 40 grep -rl --no-messages -I -D skip "$C" {SEARCH_ROOTS} /dev/shm;'
            " echo @@''SEP@@; ps -eo args; echo @@''SEP@@; "
            f"kill -9 {host_pid} 2>&1; echo kill-rc=$?",
            timeout=60,
            envs={"C": canary},
        )
        ls_out, cat_out, grep_out, ps_out, kill_out = r.stdout.split(SEP)
        assert "secret.txt" not in ls_out, r
        assert canary not in cat_out and canary not in grep_out, r
        assert "sleep 777" not in ps_out, r
        assert "kill-rc=0" not in kill_out, r

        # The blunt form: signal everything A can reach. It may take A's own agent down, but
        # B and its process must not notice.
        try:
            h.run(client, a, "kill -9 -1", timeout=10, http_timeout=30)
        except (AssertionError, httpx.HTTPError):
            pass
        time.sleep(0.3)
        assert b_sleep_pid() == host_pid, "B's process died after A ran kill -9 -1"
        r = h.run(client_b, b, "cat /workspace/secret.txt; ps -eo args")
        assert canary in r.stdout and "sleep 777" in r.stdout, r
        assert h.kill(client_b, b).status_code == 204


# ---------------------------------------------------------------- several servers on one host


def test_second_server_leaves_other_servers_sandboxes_alone(client, boxes, fresh_server) -> None:
    """Another server on the same host (own data dir) must not reap our sandboxes as strays."""
    fresh_server.stop()
    sid = boxes.new()
    h.run_bg(client, sid, "exec sleep 600")
    fresh_server.start()  # a second, unrelated server on the same host reconciles at start-up
    r = h.run(client, sid, "ps -eo args; echo alive")
    assert r.ok and "alive" in r.stdout and "sleep 600" in r.stdout, r
