"""A sandbox learns nothing about the host or its neighbours (issue 11).

Each requirement is judged against the host's own view, read on the host during the test: an
allow-listed /etc (files planted on the host after the server started stay invisible), no
/usr/local unless the operator lists it, /proc files showing the sandbox's own figures (memory
limit, CPU quota, a boot id of its own) instead of the machine's, and a mountinfo that names no
host path. Real servers, real sandboxes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ServerHandle, start_server

from agentbox.runtimes.process import hostview

try:
    from . import _http as h
except ImportError:  # tests/integration is not a package
    import _http as h

pytestmark = pytest.mark.security

BOOT_ID = "/proc/sys/kernel/random/boot_id"
SEP = "@@''SEP@@"  # printed as @@SEP@@: the command's own text never contains the separator


@pytest.fixture
def client(server: ServerHandle, tenant_key: str) -> Iterator[httpx.Client]:
    with server.client(tenant_key) as c:
        yield c


@pytest.fixture
def boxes(client: httpx.Client) -> Iterator[h.Sandboxes]:
    b = h.Sandboxes(client)
    yield b
    b.close()


@pytest.fixture
def planted() -> Iterator[list[Path]]:
    """Files the test plants on the host (world-readable), removed afterwards."""
    paths: list[Path] = []
    yield paths
    for p in paths:
        p.unlink(missing_ok=True)


def plant(paths: list[Path], directory: str) -> Path:
    p = Path(directory) / f"agentbox-test-canary-{secrets.token_hex(6)}"
    p.write_text(p.name + "\n")
    os.chmod(p, 0o644)
    paths.append(p)
    return p


def outputs(client: httpx.Client, sid: str, *cmds: str) -> list[str]:
    """Run each shell command in one go; their outputs in order."""
    script = f"; echo {SEP}; ".join(f"{{ {c}; }} 2>&1" for c in cmds)
    r = h.run(client, sid, script)
    assert r.exit_code == 0, r
    return r.stdout.split("@@SEP@@\n")


def read(client: httpx.Client, sid: str, *paths: str) -> dict[str, str]:
    """What the sandbox reads at each path ("ENOENT"/"EACCES"/... when it cannot)."""
    code = (
        "import json, sys\nout = {}\nfor p in sys.argv[1:]:\n"
        "    try:\n        out[p] = open(p, errors='replace').read()\n"
        "    except OSError as e:\n        out[p] = __import__('errno').errorcode[e.errno]\n"
        "print(json.dumps(out))"
    )
    r = h.run(client, sid, f'python3 -c "$CODE" {" ".join(paths)}', envs={"CODE": code})
    assert r.exit_code == 0, r
    return json.loads(r.stdout)


# ---------------------------------------------------------------- /etc and /usr/local


def test_etc_is_an_allow_list(client, boxes, planted) -> None:
    canary = plant(planted, "/etc")  # an operator adds a file after the server started
    sid = boxes.new()
    host_only = [
        p
        for p in ("/etc/machine-id", "/etc/passwd-", "/etc/group-", "/etc/shadow-")
        + ("/etc/pip.conf", "/etc/npmrc", "/etc/gitconfig", "/etc/apt/sources.list")
        if os.path.lexists(p)
    ]
    assert "/etc/machine-id" in host_only and "/etc/passwd-" in host_only  # a Debian host
    seen = read(client, sid, str(canary), *host_only, "/etc/passwd", "/etc/hostname")
    for p in (str(canary), *host_only):
        assert seen[p] == "ENOENT", (p, seen[p][:80])
    assert seen["/etc/passwd"] == hostview.PASSWD.decode()
    assert seen["/etc/hostname"] == "sandbox\n"

    listing, login, programs = outputs(
        client,
        sid,
        "ls -A /etc",
        "bash -lc 'echo login-ok'",
        "python3 -c 'import ssl; print(len(ssl.create_default_context().get_ca_certs()))'"
        " && getent passwd user && git --version && python3 -m pip --version",
    )
    # Every name is one the allow list or the generator gives: nothing else of the host's.
    allowed = {
        p.relative_to("/etc").parts[0] for e in hostview.ETC_ALLOWED for p in Path("/etc").glob(e)
    }
    allowed |= set(hostview.ETC_GENERATED) | set(hostview.ETC_ROOT_ONLY)
    allowed |= set(hostview.ETC_SYMLINKS)
    assert set(listing.split()) <= allowed, set(listing.split()) - allowed
    assert login == "login-ok\n"
    assert int(programs.split()[0]) > 10, programs  # the host's CA store is there
    assert "user:x:1000:1000" in programs and "git version" in programs, programs


def test_usr_local_hidden_unless_the_operator_lists_it(client, boxes, planted, tmp_path) -> None:
    assert os.path.isdir("/usr/local")
    canary = plant(planted, "/usr/local")
    etc_extra = plant(planted, "/etc")
    sid = boxes.new()
    listing, write = outputs(
        client, sid, "ls -A /usr/local", "touch /usr/local/x && echo WROTE; true"
    )
    assert listing == "", listing
    assert "WROTE" not in write and "Read-only file system" in write, write

    # The operator's --host-path: /usr/local bound, an /etc file copied into the /etc copy.
    srv = start_server(tmp_path, ["--host-path", "/usr/local", "--host-path", str(etc_extra)])
    try:
        with srv.client(srv.make_key("host-path")) as c:
            sid2 = h.create(c)["sandbox_id"]
            seen = read(c, sid2, str(canary), str(etc_extra))
            assert seen == {str(canary): canary.name + "\n", str(etc_extra): etc_extra.name + "\n"}
    finally:
        srv.kill_all_sandboxes()
        srv.stop()


# ---------------------------------------------------------------- /proc


def test_proc_shows_the_sandbox_own_memory_and_cpus(client, boxes) -> None:
    host_cpus = len(os.sched_getaffinity(0))
    for memory_mb, cpu_count in ((256, 0.5), (200, 1.5)):
        sid = boxes.new(resources={"memory_mb": memory_mb, "cpu_count": cpu_count})
        want = min(host_cpus, math.ceil(cpu_count))
        meminfo, nproc, py, processors, stat_cpus = outputs(
            client,
            sid,
            "cat /proc/meminfo",
            "nproc",
            "python3 -c 'import os; print(os.cpu_count(), len(os.sched_getaffinity(0)))'",
            "grep -c ^processor /proc/cpuinfo",
            "grep -c '^cpu[0-9]' /proc/stat",
        )
        assert re.search(rf"^MemTotal:\s+{memory_mb * 1024} kB$", meminfo, re.M), meminfo
        assert re.search(rf"^MemAvailable:\s+{memory_mb * 1024} kB$", meminfo, re.M), meminfo
        assert [nproc, processors, stat_cpus] == [f"{want}\n"] * 3
        assert py.split() == [str(want), str(want)]


def test_proc_machine_wide_files_are_masked(client, boxes) -> None:
    sid = boxes.new()
    host = {p: Path(p).read_text() for p in ("/proc/cmdline", "/proc/stat", "/proc/loadavg")}
    assert Path("/proc/diskstats").read_text().strip()  # the host's are not empty
    seen = read(
        client,
        sid,
        "/proc/cmdline",
        "/proc/diskstats",
        "/proc/partitions",
        "/proc/loadavg",
        "/proc/stat",
        "/proc/sys/fs/file-nr",
        "/proc/pressure/cpu",
        "/proc/pressure/memory",
        "/proc/pressure/io",
    )
    assert seen["/proc/cmdline"] != host["/proc/cmdline"]
    assert seen["/proc/diskstats"] == ""
    assert seen["/proc/partitions"].split() == ["major", "minor", "#blocks", "name"]
    assert seen["/proc/loadavg"].split()[3] == "1/1", seen["/proc/loadavg"]
    assert re.search(r"^processes 0$", seen["/proc/stat"], re.M), seen["/proc/stat"]
    assert re.search(r"^ctxt 0$", seen["/proc/stat"], re.M)
    assert seen["/proc/sys/fs/file-nr"].split()[:2] == ["0", "0"]
    for p in ("/proc/pressure/cpu", "/proc/pressure/memory", "/proc/pressure/io"):
        assert seen[p] == "ENOENT", (p, seen[p])
    # What reads them still works.
    top, free = outputs(client, sid, "top -bn1 | head -3", "free -m | head -2")
    assert "load average: 0.00, 0.00, 0.00" in top, top
    assert free.split()[7] == "512", free  # Mem: total = the default 512 MiB limit


def test_boot_id_is_the_sandbox_own_and_kept_on_readoption(fresh_server: ServerHandle) -> None:
    host = Path(BOOT_ID).read_text()
    key = fresh_server.make_key("boot")
    with fresh_server.client(key) as c:
        a, b = h.create(c)["sandbox_id"], h.create(c)["sandbox_id"]
        ids = [read(c, sid, BOOT_ID)[BOOT_ID] for sid in (a, b)]
    assert len(set(ids)) == 2 and host not in ids, (ids, host)
    assert all(re.fullmatch(r"[0-9a-f-]{36}\n", i) for i in ids), ids
    # A re-adopted running sandbox keeps its boot id: it did not boot again.
    fresh_server.stop()
    fresh_server.start()
    with fresh_server.client(key) as c:
        assert read(c, a, BOOT_ID)[BOOT_ID] == ids[0]
        assert read(c, a, "/proc/meminfo")["/proc/meminfo"].startswith("MemTotal:")


# ---------------------------------------------------------------- mountinfo


def test_mountinfo_names_no_host_path(server, client, boxes) -> None:
    sid = boxes.new()
    data_dir = str(server.data_dir.resolve())
    digest = hashlib.sha256(data_dir.encode()).hexdigest()[:12]
    uid = json.loads((server.data_dir / "sandboxes" / sid / "runtime.json").read_text())["uid"]
    seen = read(client, sid, "/proc/self/mountinfo", "/proc/1/mountinfo", "/proc/mounts")
    for path, text in seen.items():
        assert text.count("\n") > 10, (path, text)
        for needle in ("/run/agentbox", digest, data_dir):
            assert needle not in text, (path, needle, text)
        # Known, kernel-bound: a tmpfs mounted inside the sandbox's user namespace (bwrap's
        # root, /dev, /tmp) shows its owner as the initial namespace sees it. Nowhere else.
        rest = re.sub(rf"\b[ug]id={uid}\b", "", text)
        assert not re.search(rf"\b{uid}\b", rest), (path, text)
