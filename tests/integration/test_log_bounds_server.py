"""What a sandbox (or a client) can make the server hold, with a real server and sandboxes:
descriptors for egress connections and background commands, and rows in the audit and egress
logs. Upstreams are listeners on loopback, which the test server lets policies reach."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import ServerHandle, create_sandbox, run, start_server

from agentbox.store.db import DETAIL_MAX_BYTES, DETAIL_STRING_CHARS

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def bounded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    args = ["--egress-allow-cidr", "127.0.0.0/8", "--egress-resolve", "upstream.test=127.0.0.1"]
    handle = start_server(tmp_path_factory.mktemp("bounds"), args)
    yield handle
    handle.kill_all_sandboxes()
    handle.stop()


@pytest.fixture
def client(bounded_server: ServerHandle) -> Iterator[httpx.Client]:
    key = bounded_server.make_key(f"bounds-{time.monotonic_ns() % 10**9}")
    with bounded_server.client(key) as c:
        yield c


@pytest.fixture
def upstream() -> Iterator[int]:
    """A listener that never accepts: the kernel completes connections into its backlog, so
    every tunnel to it opens and stays open."""
    with socket.create_server(("127.0.0.1", 0), backlog=1024) as s:
        yield s.getsockname()[1]


def _fds(server: ServerHandle) -> int:
    assert server.proc is not None
    return len(os.listdir(f"/proc/{server.proc.pid}/fd"))


def _settled_fds(server: ServerHandle) -> int:
    """The server's descriptor count once it stops changing (connections close lazily)."""
    last = -1
    for _ in range(20):
        now = _fds(server)
        if now == last:
            return now
        last = now
        time.sleep(0.1)
    return last


def _script(client: httpx.Client, sid: str, path: str, source: str) -> None:
    r = client.put(f"/v1/sandboxes/{sid}/files", params={"path": path}, content=source.encode())
    assert r.status_code < 300, r.text


def _events(client: httpx.Client, url: str, **params: object) -> list[dict]:
    r = client.get(url, params={"limit": 10_000, **params})
    assert r.status_code == 200, r.text
    return r.json()["events"]


# ---------------------------------------------------------------------------- the egress log

_HAMMER = r"""
import socket, sys
n, answers = int(sys.argv[1]), {}
for i in range(n):
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(b"CONNECT denied-%d.test:443 HTTP/1.1\r\nHost: x\r\n\r\n" % i)
    head = s.recv(12)
    answers[head] = answers.get(head, 0) + 1
    s.close()
print(answers)
"""


def test_5000_refused_attempts_make_a_few_rows_and_a_count(client: httpx.Client) -> None:
    sid = create_sandbox(client)["sandbox_id"]  # no egress at all: every attempt is refused
    _script(client, sid, "/tmp/hammer.py", _HAMMER)
    res = run(client, sid, "python3 /tmp/hammer.py 5000", timeout=120)
    assert "b'HTTP/1.1 403': 5000" in res.stdout, res.stdout + res.stderr
    events = _events(client, "/v1/audit/egress", sandbox_id=sid)
    summaries = [e for e in events if e["suppressed"]]
    assert len(events) <= 20 + 3, len(events)
    assert summaries and all(not e["allowed"] for e in events)
    assert len(events) - len(summaries) + sum(e["suppressed"] for e in summaries) == 5000
    assert "counted in `suppressed`" in summaries[0]["reason"]


def test_a_100k_command_is_audited_cut_and_as_json(client: httpx.Client) -> None:
    sid = create_sandbox(client)["sandbox_id"]
    assert run(client, sid, "true " + "x" * 100_000).exit_code == 0
    (event,) = _events(client, "/v1/audit", sandbox_id=sid, action="command.run")
    assert len(json.dumps(event["detail"])) <= DETAIL_MAX_BYTES
    assert event["detail"]["cmd"].startswith("true xxx")
    assert len(event["detail"]["cmd"]) <= DETAIL_STRING_CHARS + 1
    assert event["detail"]["exit_code"] == 0


# ---------------------------------------------------------------------------- descriptors

_TUNNELS = r"""
import json, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
held, answers = [], {}
for i in range(n):
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(b"CONNECT upstream.test:%d HTTP/1.1\r\nHost: upstream.test\r\n\r\n" % port)
    head = b""
    while b"\r\n\r\n" not in head:
        more = s.recv(4096)
        if not more:
            break
        head += more
    code = head[9:12].decode() or "closed"
    answers[code] = answers.get(code, 0) + 1
    if code == "503" and "reason" not in answers:
        while more:
            more = s.recv(4096)
            head += more
        answers["reason"] = head.decode(errors="replace").split("\r\n\r\n", 1)[-1][:300]
    held.append(s)
with open("/tmp/answers.json", "w") as f:
    json.dump(answers, f)
time.sleep(float(sys.argv[3]))
"""


def test_egress_connections_are_capped_per_sandbox_and_the_server_fds_stay_bounded(
    bounded_server: ServerHandle, client: httpx.Client, upstream: int
) -> None:
    net = {"allow_out": ["upstream.test"]}
    sid = create_sandbox(client, network=net)["sandbox_id"]
    _script(client, sid, "/tmp/tunnels.py", _TUNNELS)
    before = _settled_fds(bounded_server)
    r = client.post(
        f"/v1/sandboxes/{sid}/commands",
        json={"cmd": f"python3 /tmp/tunnels.py {upstream} 300 30", "background": True},
    )
    assert r.status_code == 201, r.text
    cmd_id = r.json()["cmd_id"]
    deadline = time.monotonic() + 60
    got = client.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/answers.json"})
    while got.status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.3)
        got = client.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/answers.json"})
    answers = got.json()
    during = _settled_fds(bounded_server)
    assert answers["200"] == 64 and answers["503"] + answers.get("closed", 0) == 236, answers
    assert f"sandbox {sid} has 64 egress connections open" in answers["reason"], answers
    # 64 tunnels hold two descriptors each; the 236 refused ones hold none for long.
    assert during - before <= 2 * 64 + 16, (before, during)
    client.post(f"/v1/sandboxes/{sid}/commands/{cmd_id}/kill", json={"signal": 9})


def test_background_commands_share_one_watcher_descriptor(bounded_server: ServerHandle) -> None:
    # 150 commands need their pids and the agent's pipes: more descriptors (pids × nofile)
    # than a tenant's default share, so this tenant gets a bigger one.
    tenant = f"watchers-{time.monotonic_ns() % 10**9}"
    big = {"max_descriptors": 2048 * 1024, "max_total_descriptors": 2048 * 1024}
    with bounded_server.client() as admin:
        assert admin.put(f"/v1/tenants/{tenant}/quota", json=big).status_code == 200
    with bounded_server.client(bounded_server.make_key(tenant)) as client:
        sid = create_sandbox(client, resources={"pids": 2048})["sandbox_id"]
        before = _settled_fds(bounded_server)
        for _ in range(150):
            r = client.post(
                f"/v1/sandboxes/{sid}/commands", json={"cmd": "sleep 120", "background": True}
            )
            assert r.status_code == 201, r.text
        after = _settled_fds(bounded_server)
        assert after - before <= 10, (before, after)  # was one agent connection per command


def test_watched_commands_are_still_audited_when_they_end(client: httpx.Client) -> None:
    sid = create_sandbox(client)["sandbox_id"]
    ids = set()
    for i in range(30):
        cmd = f"sleep 0.{i % 10}; exit {i % 4}"
        r = client.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": cmd, "background": True})
        assert r.status_code == 201, r.text
        ids.add(r.json()["cmd_id"])
    # A foreground command whose client leaves is watched too.
    with client.stream(
        "POST", f"/v1/sandboxes/{sid}/commands", json={"cmd": "sleep 1; exit 7"}
    ) as r:
        assert r.status_code == 200
        ids.add(json.loads(next(r.iter_lines()))["cmd_id"])  # the start event, then leave
    deadline = time.monotonic() + 30
    audited: dict[str, int] = {}
    while time.monotonic() < deadline and len(audited) < 31:
        time.sleep(0.3)
        for e in _events(client, "/v1/audit", sandbox_id=sid, action="command.run"):
            audited[e["detail"]["cmd_id"]] = e["detail"]["exit_code"]
    assert set(audited) == ids, audited
    assert sorted(audited.values()) == sorted([i % 4 for i in range(30)] + [7])


def test_quick_commands_are_audited_while_others_are_watched(client: httpx.Client) -> None:
    """A command that ends before the reply to its start is read is reported to the (already
    running) watcher before it is watched: it must be audited all the same."""
    sid = create_sandbox(client)["sandbox_id"]
    r = client.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "sleep 60", "background": True})
    assert r.status_code == 201, r.text
    ids = set()
    for _ in range(40):
        r = client.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "exit 5", "background": True})
        assert r.status_code == 201, r.text
        ids.add(r.json()["cmd_id"])
    deadline = time.monotonic() + 20
    audited: set[str] = set()
    while time.monotonic() < deadline and not ids <= audited:
        time.sleep(0.3)
        events = _events(client, "/v1/audit", sandbox_id=sid, action="command.run")
        audited = {e["detail"]["cmd_id"] for e in events if e["detail"]["exit_code"] == 5}
    assert ids <= audited, ids - audited
