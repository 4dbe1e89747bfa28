"""Every isolation tier end to end, through one real server that serves them all: commands as
`user` and as root, files, code, egress through the proxy (allowed and refused), an exposed
port, limits, a kept workspace and re-adoption after a restart. The same checks for each tier
(`isolation` on create); a tier whose runtime binary this machine lacks is skipped, saying so.
"""

from __future__ import annotations

import json
import shlex
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from conftest import ServerHandle, create_sandbox, run, start_server

from agentbox.runtimes.base import Resources
from agentbox.runtimes.uids import UID_RANGE

pytestmark = pytest.mark.timeout(240)

FORK_BOMB = """
import subprocess
procs = []
try:
    while len(procs) < 200:
        procs.append(subprocess.Popen(["sleep", "30"]))
except OSError as e:
    print("refused after", len(procs), e.strerror)
for p in procs:
    p.kill()
"""
LIVE = ("running", "unhealthy")
BINARIES = {"process": "bwrap", "container": "runc", "gvisor": "runsc"}
TIERS = [t for t, b in BINARIES.items() if shutil.which(b)]
MISSING = [t for t, b in BINARIES.items() if not shutil.which(b)]


class Upstream:
    """An HTTP server on 127.0.0.1 counting the requests it got."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.paths.append(self.path)
                out = b"upstream says hi\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    yield up
    up.httpd.shutdown()


@pytest.fixture(scope="module")
def tiers_server(
    tmp_path_factory: pytest.TempPathFactory, code_template: Path
) -> Iterator[ServerHandle]:
    args = ["--runtime", ",".join(TIERS), "--template-dir", str(code_template)]
    args += ["--egress-allow-cidr", "127.0.0.0/8", "--egress-resolve", "up.test=127.0.0.1"]
    handle = start_server(tmp_path_factory.mktemp("tiers"), args)
    yield handle
    handle.kill_all_sandboxes()
    handle.stop()


@pytest.fixture(params=[*TIERS, *MISSING])
def tier(request: pytest.FixtureRequest) -> str:
    if request.param in MISSING:
        pytest.skip(f"{BINARIES[request.param]} is not installed (scripts/install.sh installs it)")
    return str(request.param)


@pytest.fixture
def client(tiers_server: ServerHandle) -> Iterator[httpx.Client]:
    key = tiers_server.make_key(f"tiers-{time.monotonic_ns() % 10**9}")
    with tiers_server.client(key) as c:
        yield c


def test_health_lists_every_tier(tiers_server: ServerHandle) -> None:
    body = httpx.get(f"{tiers_server.url}/v1/health").json()
    assert sorted(body["runtimes"]) == sorted(TIERS), body["runtimes"]


def test_commands_files_and_users(client: httpx.Client, tier: str) -> None:
    info = create_sandbox(client, template="base", runtime=tier)
    sid = info["sandbox_id"]
    assert info["runtime"] == tier
    res = run(client, sid, "id -un; sudo id -un; grep ^Seccomp: /proc/self/status; pwd")
    assert res.exit_code == 0, res
    assert res.stdout.split() == ["user", "root", "Seccomp:", "2", "/workspace"], res.stdout
    # Files through the API land where commands see them, owned by `user`.
    r = client.put(f"/v1/sandboxes/{sid}/files", params={"path": "/workspace/a.txt"}, content=b"hi")
    assert r.status_code in (200, 201), r.text
    res = run(client, sid, "stat -c '%U %s' /workspace/a.txt; echo more >> /workspace/a.txt")
    assert res.stdout.strip() == "user 2", res
    r = client.get(f"/v1/sandboxes/{sid}/files", params={"path": "/workspace/a.txt"})
    assert r.content == b"himore\n"
    # On the host, `user` is a uid of the sandbox's own block (not 1000, not root).
    (host_file,) = Path("/run/agentbox").glob(f"*/{sid}/workspace/a.txt")
    owner = host_file.stat().st_uid
    assert owner >= UID_RANGE[0] and owner % 65536 == 1000, owner
    # The writable root: root installs system-wide, `user` cannot.
    assert run(client, sid, "sudo touch /usr/local/bin/x && echo ok").stdout.strip() == "ok"
    assert run(client, sid, "touch /usr/local/bin/y").exit_code != 0
    # Its fence (Landlock, or mounts where the kernel has none): nothing new directly in /.
    res = run(client, sid, "sudo touch /abx-top; sudo touch /etc/abx-etc && echo etc")
    assert res.stdout.strip() == "etc" and "/abx-top" in res.stderr, res
    # No new user namespaces, no mounts, however asked.
    res = run(client, sid, "sudo unshare -U true; sudo unshare -m true", user="root")
    assert res.exit_code != 0 and "Operation not permitted" in res.stderr, res
    client.delete(f"/v1/sandboxes/{sid}")


def test_host_userland(client: httpx.Client, tier: str) -> None:
    sid = create_sandbox(client, template="host", runtime=tier)["sandbox_id"]
    res = run(client, sid, "ls /usr/bin/python3 && touch /tmp/t /var/tmp/v && ls / | tr '\\n' ' '")
    assert res.exit_code == 0, res
    assert "workspace" in res.stdout, res.stdout
    # Nothing of the host's /home: it holds only E2B's home, the workspace mounted again.
    res = run(client, sid, "ls -A /home; echo x > /home/user/h; cat /workspace/h")
    assert res.stdout.split() == ["user", "x"], res
    assert run(client, sid, "touch /usr/x").exit_code != 0  # the host's /usr, read-only
    assert run(client, sid, "cat /etc/machine-id").exit_code != 0  # not in the generated /etc
    client.delete(f"/v1/sandboxes/{sid}")


def test_run_code(client: httpx.Client, tier: str) -> None:
    sid = create_sandbox(client, template="code-interpreter", runtime=tier)["sandbox_id"]
    with client.stream(
        "POST", f"/v1/sandboxes/{sid}/code/execute", json={"code": "x = 6 * 7\nprint(x)"}
    ) as r:
        assert r.status_code == 200, r.read()
        body = r.read().decode()
    assert "42" in body, body
    client.delete(f"/v1/sandboxes/{sid}")


def test_egress_through_the_proxy(client: httpx.Client, tier: str, upstream: Upstream) -> None:
    allowed = create_sandbox(client, runtime=tier, network={"allow_out": ["up.test"]})
    url = f"http://up.test:{upstream.port}/from-{tier}"
    res = run(client, allowed["sandbox_id"], f"curl -sS -m 10 {url}")
    assert res.stdout == "upstream says hi\n", res
    assert f"/from-{tier}" in upstream.paths
    denied = create_sandbox(client, runtime=tier)
    res = run(client, denied["sandbox_id"], f"curl -sS -m 10 -i {url}-denied")
    assert "403" in res.stdout and "network policy" in res.stdout, res
    assert f"/from-{tier}-denied" not in upstream.paths
    # No way around the proxy: no interface but loopback.
    res = run(client, denied["sandbox_id"], "ls /sys/class/net 2>/dev/null || ip -o link")
    assert "eth" not in res.stdout and "veth" not in res.stdout, res
    for info in (allowed, denied):
        client.delete(f"/v1/sandboxes/{info['sandbox_id']}")


def test_an_exposed_port(client: httpx.Client, tier: str, tiers_server: ServerHandle) -> None:
    info = create_sandbox(client, runtime=tier)
    sid = info["sandbox_id"]
    run(client, sid, "echo served > /workspace/index.html", timeout=5)
    run(client, sid, "nohup python3 -m http.server -d /workspace 8000 >/tmp/h.log 2>&1 &")
    deadline = time.monotonic() + 15
    while True:
        r = httpx.get(
            f"{tiers_server.url}/v1/sandboxes/{sid}/ports/8000/index.html",
            headers={"X-Access-Token": info["access_token"]},
        )
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200 and r.text == "served\n", r.text
    client.delete(f"/v1/sandboxes/{sid}")


def test_limits_hold(client: httpx.Client, tier: str) -> None:
    sid = create_sandbox(
        client, runtime=tier, resources={"memory_mb": 128, "pids": 64, "disk_mb": 64}
    )["sandbox_id"]
    bomb = "python3 -c 'b = bytearray(512 * 2**20); print(len(b))'"
    if tier == "gvisor":
        # Its kernel is one process to the host: going over the limit ends the whole sandbox,
        # which then says why. The command hears it as its agent's connection breaking, or, if
        # the server noticed the sandbox's end first (it waits on its init), as that end.
        with client.stream("POST", f"/v1/sandboxes/{sid}/commands", json={"cmd": bomb}) as r:
            events = [json.loads(line) for line in r.iter_lines() if line]
        last = events[-1]
        assert last.get("code") == "sandbox_unavailable" or (
            last["type"] == "end" and last["violation"]["code"] == "memory_limit"
            and "resources.memory_mb" in last["violation"]["message"]
        ), events
        deadline = time.monotonic() + 30
        while (info := client.get(f"/v1/sandboxes/{sid}").json())["state"] in LIVE:
            assert time.monotonic() < deadline, info
            time.sleep(0.5)
        assert info["end_reason"] == "memory_limit", info
        sid = create_sandbox(
            client, runtime=tier, resources={"memory_mb": 128, "pids": 64, "disk_mb": 64}
        )["sandbox_id"]
    else:
        res = run(client, sid, bomb)
        assert res.exit_code != 0 and res.end.get("violation", {}).get("code") == "memory_limit"
    # The rlimits each tier sets, soft and hard alike (runc inherits them from the
    # `prlimit` it is started under, gVisor's bundle names them).
    res = run(client, sid, "ulimit -Sn; ulimit -Hn; ulimit -Sf; ulimit -Hf; ulimit -Sc; ulimit -Hc")
    r = Resources()
    blocks = str(r.file_size_mb * 1024)  # ulimit -f counts 1024-byte blocks
    assert res.stdout.split() == [str(r.nofile)] * 2 + [blocks] * 2 + ["0"] * 2, res
    res = run(client, sid, f"python3 -c {shlex.quote(FORK_BOMB)}")
    assert "refused after" in res.stdout and "Resource temporarily unavailable" in res.stdout, res
    # The pids limit (64) counts the sandbox's every process; a kernel of its own (gVisor)
    # counts the user's processes against RLIMIT_NPROC, 16 above it (NPROC_SLACK).
    assert int(res.stdout.split()[2]) < 64 + 16, res.stdout
    res = run(client, sid, "dd if=/dev/zero of=/workspace/big bs=1M count=200 2>&1; true")
    assert "No space left on device" in res.stdout, res
    assert run(client, sid, "echo alive").stdout == "alive\n"  # the sandbox survived all three
    # A command's timeout ends it with its tree, also where the kernel has no pidfd (gVisor's).
    started = time.monotonic()
    res = run(client, sid, "sleep 30 && echo late", timeout=1)
    assert res.end["timed_out"] is True and "late" not in res.stdout, res
    assert res.end["violation"]["code"] == "command_timeout", res.end
    assert time.monotonic() - started < 10
    client.delete(f"/v1/sandboxes/{sid}")


def test_kept_workspace(client: httpx.Client, tier: str) -> None:
    sid = create_sandbox(client, runtime=tier, keep_workspace=True)["sandbox_id"]
    run(client, sid, "echo kept > /workspace/k.txt")
    assert client.delete(f"/v1/sandboxes/{sid}").status_code == 204
    r = client.get(f"/v1/workspaces/{sid}/files", params={"path": "/workspace/k.txt"})
    assert r.status_code == 200 and r.content == b"kept\n", r.text
    assert client.delete(f"/v1/workspaces/{sid}").status_code == 204


def test_restart_readopts(tmp_path: Path, tier: str) -> None:
    srv = start_server(tmp_path, ["--runtime", ",".join(TIERS)])
    try:
        with srv.client() as c:
            sid = create_sandbox(c, runtime=tier)["sandbox_id"]
            run(c, sid, "nohup sleep 300 >/dev/null 2>&1 & echo $! > /workspace/pid")
            # And one paused through the restart: it stays paused, then resumes whole.
            paused = create_sandbox(c, runtime=tier)["sandbox_id"]
            run(c, paused, "nohup sleep 300 >/dev/null 2>&1 & echo $! > /workspace/pid")
            r = c.post(f"/v1/sandboxes/{paused}/pause")
            assert r.status_code == 200, r.text
        srv.stop()
        srv.start()
        with srv.client() as c:
            info = c.get(f"/v1/sandboxes/{sid}").json()
            assert info["state"] == "running" and info["runtime"] == tier, info
            res = run(c, sid, "kill -0 $(cat /workspace/pid) && echo still")
            assert res.stdout == "still\n", res
            assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
            assert c.get(f"/v1/sandboxes/{paused}").json()["state"] == "paused"
            assert c.post(f"/v1/sandboxes/{paused}/resume").json()["state"] == "running"
            res = run(c, paused, "kill -0 $(cat /workspace/pid) && echo still")
            assert res.stdout == "still\n", res
            assert c.delete(f"/v1/sandboxes/{paused}").status_code == 204
    finally:
        srv.kill_all_sandboxes()
        srv.stop()


def test_pause_and_resume(client: httpx.Client, tier: str, tiers_server: ServerHandle) -> None:
    """Frozen with its memory on every tier: nothing runs, nothing is served, and after the
    resume its processes (a counter, a server behind an exposed port) carry on."""
    info = create_sandbox(client, runtime=tier)
    sid, token = info["sandbox_id"], {"X-Access-Token": info["access_token"]}
    counter = "while true; do echo x >> /tmp/ticks; sleep 0.02; done"
    run(client, sid, f"nohup sh -c '{counter}' >/dev/null 2>&1 &")
    run(client, sid, "nohup python3 -m http.server 8123 >/dev/null 2>&1 &")
    port = f"{tiers_server.url}/v1/sandboxes/{sid}/ports/8123/"
    deadline = time.monotonic() + 15
    while httpx.get(port, headers=token).status_code != 200:
        assert time.monotonic() < deadline, "the sandbox's server never answered"
        time.sleep(0.2)
    ticks = "wc -l < /tmp/ticks"
    before = int(run(client, sid, ticks).stdout)
    r = client.post(f"/v1/sandboxes/{sid}/pause")
    assert r.status_code == 200 and r.json()["state"] == "paused", r.text
    r = client.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "true"})
    assert r.status_code == 409 and "paused" in r.json()["message"], r.text
    r = httpx.get(port, headers=token)
    assert r.status_code == 409 and "paused" in r.text, r.text
    assert httpx.get(port).status_code == 401  # without credentials: nothing said
    time.sleep(1.5)
    assert client.post(f"/v1/sandboxes/{sid}/resume").json()["state"] == "running"
    after = int(run(client, sid, ticks).stdout)
    assert after - before < 30, (before, after)  # ~75 had it run through the pause
    time.sleep(0.5)
    assert int(run(client, sid, ticks).stdout) - after >= 5
    assert httpx.get(port, headers=token).status_code == 200
    assert client.delete(f"/v1/sandboxes/{sid}").status_code == 204


def test_health_says_why_a_tier_is_missing(tiers_server: ServerHandle) -> None:
    tiers = httpx.get(f"{tiers_server.url}/v1/health").json()["tiers"]
    assert set(tiers) == {"process", "container", "gvisor"}, tiers
    for tier in TIERS:
        assert tiers[tier]["served"] is True, tiers
    for tier in MISSING:
        assert tiers[tier]["served"] is False and BINARIES[tier] in tiers[tier]["reason"], tiers


def test_isolation_is_chosen_and_shown(client: httpx.Client, tier: str) -> None:
    info = create_sandbox(client, isolation=tier)
    assert info["runtime"] == info["isolation"] == tier, info
    r = client.post("/v1/sandboxes", json={"isolation": tier, "runtime": "fake"})
    assert r.status_code in (400, 422) and "disagree" in r.text, r.text
    client.delete(f"/v1/sandboxes/{info['sandbox_id']}")


def test_a_tenant_floor(tiers_server: ServerHandle) -> None:
    """An operator requires a tier for a tenant: a weaker request is refused naming the
    policy; a create that names none gets the weakest served tier that meets it."""
    strong = TIERS[-1]
    if strong == "process":
        pytest.skip("no tier above process is installed here")
    tenant = f"floor-{time.monotonic_ns() % 10**9}"
    key = tiers_server.make_key(tenant)
    with tiers_server.client() as admin:
        r = admin.put(f"/v1/tenants/{tenant}/quota", json={"min_isolation": strong})
        assert r.status_code == 200, r.text
    with tiers_server.client(key) as c:
        r = c.post("/v1/sandboxes", json={"isolation": "process"})
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["detail"]["setting"] == "quota.min_isolation" and strong in body["message"]
        info = create_sandbox(c)
        assert info["runtime"] == strong, info
        c.delete(f"/v1/sandboxes/{info['sandbox_id']}")


def test_warm_pools_per_tier(tiers_server: ServerHandle, client: httpx.Client) -> None:
    """A pool is per template and tier (`TEMPLATE@TIER`, the server's default tier unnamed):
    a create on that tier claims its member, one on another tier does not."""
    other = [t for t in TIERS if t != TIERS[0]]
    if not other:
        pytest.skip("one tier only")
    name = f"host@{other[-1]}"
    with tiers_server.client() as admin:
        r = admin.put(f"/v1/pools/{name}", json={"size": 1})
        assert r.status_code == 200 and r.json()["runtime"] == other[-1], r.text
        deadline = time.monotonic() + 60
        while not (pool := _pool(admin, name))["ready"]:
            assert time.monotonic() < deadline and not pool["failures"], pool
            time.sleep(0.3)
        try:
            cold = create_sandbox(client, template="host", runtime=TIERS[0])
            assert _pool(admin, name)["hits"] == 0
            warm = create_sandbox(client, template="host", isolation=other[-1])
            assert warm["runtime"] == other[-1] and _pool(admin, name)["hits"] == 1, warm
            assert run(client, warm["sandbox_id"], "echo warm").stdout == "warm\n"
            for info in (cold, warm):
                client.delete(f"/v1/sandboxes/{info['sandbox_id']}")
        finally:
            admin.put(f"/v1/pools/{name}", json={"size": 0})
        r = admin.put("/v1/pools/host@nosuch", json={"size": 1})
        assert r.status_code == 400 and "not served" in r.text, r.text


def _pool(admin: httpx.Client, name: str) -> dict:
    return next(p for p in admin.get("/v1/pools").json()["pools"] if p["template"] == name)


def test_snapshot_and_fork(client: httpx.Client, tier: str) -> None:
    """A snapshot and a fork carry the whole disk (workspace and root layer) on every tier: a
    sandbox started from either has the files as they were, owned by its own uids (it can
    write them), and its own identity; a fork works from a paused sandbox too."""
    info = create_sandbox(client, runtime=tier, template="base", envs={"FROM_CREATE": "yes"})
    sid = info["sandbox_id"]
    setup = "echo one > /workspace/a && mkdir -p /workspace/d && echo deep > /workspace/d/f"
    assert run(client, sid, setup).exit_code == 0
    assert (
        run(client, sid, "echo rootfile > /opt/r && chmod 4755 /opt/r", user="root").exit_code == 0
    )
    name = f"snap-{tier}"
    r = client.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": name})
    assert r.status_code == 201, r.text
    snap = r.json()
    assert snap["snapshot_id"].startswith("snap_") and snap["used_bytes"] > 0
    assert snap["name"] == name and snap["sandbox_id"] == sid and snap["runtime"] == tier
    run(client, sid, "echo after > /workspace/after")

    child = create_sandbox(client, template=name)
    cid = child["sandbox_id"]
    assert child["runtime"] == tier and child["origin"] == {"snapshot": snap["snapshot_id"]}
    out = run(client, cid, "cat /workspace/a /workspace/d/f /opt/r; ls /workspace; "
              "stat -c '%U %a' /workspace/a /opt/r; echo $AGENTBOX_SANDBOX_ID")  # fmt: skip
    assert out.stdout.split("\n")[:3] == ["one", "deep", "rootfile"], out.stdout
    assert "after" not in out.stdout and "user 644" in out.stdout and "root 4755" in out.stdout
    assert out.stdout.strip().endswith(cid)
    assert run(client, cid, "echo mine >> /workspace/a && mkdir /workspace/new").exit_code == 0
    assert run(client, sid, "cat /workspace/a").stdout == "one\n"  # the parent's is its own

    # A fork, of a paused sandbox: two children with the disk as it is now.
    assert client.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
    r = client.post(f"/v1/sandboxes/{sid}/fork", json={"count": 2})
    assert r.status_code == 201, r.text
    kids = r.json()["sandboxes"]
    assert len({k["sandbox_id"] for k in kids} | {sid, cid}) == 4
    assert len({k["access_token"] for k in kids}) == 2
    assert client.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"
    for k in kids:
        assert k["origin"] == {"fork_of": sid} and k["state"] == "running"
        out = run(
            client, k["sandbox_id"], "cat /workspace/after; echo $FROM_CREATE; touch /workspace/w"
        )
        assert out.stdout == "after\nyes\n" and out.exit_code == 0, out
    run(client, kids[0]["sandbox_id"], "echo k0 > /workspace/k")
    assert run(client, kids[1]["sandbox_id"], "cat /workspace/k").exit_code != 0
    for k in kids:  # (a tenant's descriptor budget holds four default sandboxes)
        assert client.delete(f"/v1/sandboxes/{k['sandbox_id']}").status_code == 204

    # Paused without memory: processes end, the disk stays, a resume boots fresh on it.
    r = client.post(f"/v1/sandboxes/{cid}/pause", json={"keep_memory": False})
    assert r.status_code == 200 and r.json()["state"] == "paused", r.text
    assert client.post(f"/v1/sandboxes/{cid}/resume").json()["state"] == "running"
    assert run(client, cid, "cat /workspace/a /opt/r").stdout == "one\nmine\nrootfile\n"

    # A disk whose root changed what the agent loads before it confines itself is refused.
    preload = "echo /workspace/x.so >> /etc/ld.so.preload"
    assert run(client, cid, preload, user="root").exit_code == 0
    bad = client.post(f"/v1/sandboxes/{cid}/snapshots").json()["snapshot_id"]
    r = client.post("/v1/sandboxes", json={"template": bad})
    assert r.status_code == 409 and "/etc/ld.so.preload" in r.json()["message"], r.text
    assert client.post(f"/v1/sandboxes/{cid}/pause", json={"keep_memory": False}).status_code == 200
    r = client.post(f"/v1/sandboxes/{cid}/resume")
    assert r.status_code == 409 and "paused as before" in r.json()["message"], r.text
    assert client.get(f"/v1/sandboxes/{cid}").json()["state"] == "paused"
    client.delete(f"/v1/snapshots/{bad}")

    assert client.delete(f"/v1/snapshots/{name}").status_code == 204
    assert client.get(f"/v1/snapshots/{snap['snapshot_id']}").status_code == 404

    for s in (sid, cid):
        assert client.delete(f"/v1/sandboxes/{s}").status_code == 204


def test_a_volume(client: httpx.Client, tier: str) -> None:
    """A volume mounted read-write, then read-only elsewhere, on every tier: its files are the
    sandbox user's in each, and outlive the sandbox that wrote them."""
    name = f"v-{tier}"
    assert client.post("/v1/volumes", json={"name": name, "size_mb": 32}).status_code == 201
    a = create_sandbox(client, runtime=tier, template="base", volume_mounts={"/data": name})
    out = run(client, a["sandbox_id"], "echo hi > /data/f && stat -c %U /data/f")
    assert out.stdout == "user\n", out
    client.delete(f"/v1/sandboxes/{a['sandbox_id']}")
    ro = {"/data": {"volume": name, "read_only": True}}
    b = create_sandbox(client, runtime=tier, volume_mounts=ro)["sandbox_id"]
    assert run(client, b, "cat /data/f").stdout == "hi\n"
    assert run(client, b, "touch /data/g").exit_code != 0
    client.delete(f"/v1/sandboxes/{b}")
    assert client.delete(f"/v1/volumes/{name}").status_code == 204
