"""Hostile input to the HTTP files API: traversal, encodings, symlinks, special files, limits.

Every rejection must be a clean 4xx carrying a JSON `code` (never a 5xx), and neither the
sandbox's read-only view nor the host may change. Symlinks are planted from inside the sandbox
with a command, exactly as untrusted code would.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

try:
    from . import _http as h
except ImportError:  # tests/integration is not a package
    import _http as h

pytestmark = pytest.mark.security

HOST_WATCHED = ("/etc/passwd", "/etc/hostname", "/etc/hosts", "/etc/shadow")


def _digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def client(server, tenant_key: str) -> Iterator[httpx.Client]:
    with server.client(tenant_key) as c:
        yield c


@pytest.fixture
def host_unchanged() -> Iterator[None]:
    """Whatever the test sends, these host files keep their content."""
    before = {p: _digest(p) for p in HOST_WATCHED if os.path.exists(p)}
    yield
    after = {p: _digest(p) for p in before}
    assert after == before, "a host file changed during the test"


@pytest.fixture
def sbx(client: httpx.Client, host_unchanged) -> Iterator[str]:
    sid = h.create(client)["sandbox_id"]
    yield sid
    h.kill(client, sid)


@pytest.fixture
def trapped(client: httpx.Client, sbx: str) -> str:
    """A sandbox whose /workspace is full of links planted by sandboxed code."""
    r = h.run(
        client,
        sbx,
        "set -e; ln -s / root; ln -s /etc/passwd pw; ln -s /workspace/loop loop; "
        "mkdir d; echo inside-d > d/f; ln -s /workspace/d dl; ln -s /etc etcl; "
        "sha256sum /etc/passwd > /tmp/passwd.sum; ls -l",
    )
    assert r.ok, r
    return sbx


def put(client: httpx.Client, url: str, **kw) -> httpx.Response:
    """PUT on a connection of its own: after the known upload race (see
    test_rejected_upload_is_4xx_not_broken_pipe) the server resets the connection, which must
    not spill over into the next, unrelated request."""
    headers = {**kw.pop("headers", {}), "Connection": "close"}
    return client.put(url, headers=headers, **kw)


def files(sid: str, route: str = "") -> str:
    return f"/v1/sandboxes/{sid}/files{route}"


# ---------------------------------------------------------------- traversal and encodings

# (raw query string for ?path=, what it decodes to once)
RAW_TRAVERSALS = [
    "../../etc/passwd",
    "..%2f..%2fetc%2fpasswd",
    "..%2F..%2F..%2Fetc%2Fpasswd",
    "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "/workspace/../../etc/passwd",
    "%2Fworkspace%2F..%2F..%2Fetc%2Fpasswd",
    "/workspace/./../etc/passwd",
    "d/../../etc/passwd",
    "..",
    "/..",
]


@pytest.mark.parametrize("raw", RAW_TRAVERSALS)
def test_traversal_rejected_on_every_route(client, sbx, raw) -> None:
    """`..` in any spelling that decodes to a `..` component is refused before anything runs."""
    sid = sbx
    for method, route in (("GET", ""), ("GET", "/stat"), ("GET", "/list"), ("DELETE", "")):
        r = client.request(method, f"{files(sid, route)}?path={raw}")
        h.assert_rejected(r, "invalid_path", status=400)
    r = put(client, f"{files(sid)}?path={raw}", content=b"pwned\n")
    h.assert_upload_rejected(r, "invalid_path", status=400)
    decoded = httpx.QueryParams(f"path={raw}")["path"]
    r = client.post(files(sid, "/mkdir"), json={"path": decoded})
    h.assert_rejected(r, "invalid_path", status=400)
    r = client.post(files(sid, "/rename"), json={"src": decoded, "dst": "x"})
    h.assert_rejected(r, "invalid_path", status=400)
    r = client.post(files(sid, "/rename"), json={"src": "nothing", "dst": decoded})
    assert 400 <= r.status_code < 500 and h.error_code(r), r.text


@pytest.mark.parametrize(
    "raw",
    [
        "..%252f..%252fetc%252fpasswd",  # double-encoded: a literal name containing "%2f"
        "..%5c..%5cetc%5cpasswd",  # backslashes are ordinary name characters
        "%252e%252e%252fetc%252fpasswd",
    ],
)
def test_double_encoding_stays_a_literal_name(client, sbx, raw) -> None:
    sid = sbx
    once = httpx.QueryParams(f"path={raw}")["path"]
    r = client.get(f"{files(sid)}?path={raw}")
    h.assert_rejected(r, "path_not_found", status=404)
    # Written, it becomes one oddly named file in /workspace and nothing else.
    r = put(client, f"{files(sid)}?path={raw}", content=b"literal\n")
    if r.status_code == 200:
        assert r.json()["path"] == f"/workspace/{once}", r.text
        listing = client.get(files(sid, "/list"), params={"path": "/workspace"}).json()
        assert [e["name"] for e in listing["entries"]] == [once], listing
    else:
        h.assert_upload_rejected(r)
    out = h.run(client, sid, "cat /etc/passwd; ls -A /etc | grep -c passwd")
    assert "literal" not in out.stdout, out


def test_nul_overlong_and_empty_paths(client, sbx) -> None:
    sid = sbx
    for raw in ("/workspace/a%00b", "a%00/../../etc/passwd", "%00", "/etc/passwd%00.txt"):
        for method, route in (("GET", ""), ("GET", "/stat"), ("GET", "/list"), ("DELETE", "")):
            h.assert_rejected(
                client.request(method, f"{files(sid, route)}?path={raw}"),
                "invalid_path",
                status=400,
            )
        h.assert_upload_rejected(
            put(client, f"{files(sid)}?path={raw}", content=b"x"), "invalid_path", status=400
        )
    for body in (
        {"path": "a\x00b"},
        {"path": ""},
        {"path": "x/" * 2100},
        {"path": None},
        {"path": 7},
    ):
        r = client.post(files(sid, "/mkdir"), json=body)
        h.assert_rejected(r, "invalid_path", "invalid_request")
    h.assert_rejected(
        client.get(files(sid), params={"path": "a/" * 2100}), "invalid_path", status=400
    )
    h.assert_upload_rejected(
        put(client, files(sid), params={"path": "a/" * 2100}, content=b"x"),
        "invalid_path",
        status=400,
    )
    # A single name over NAME_MAX (255): read-side routes refuse it cleanly (write: see below).
    for route in ("", "/stat", "/list"):
        h.assert_rejected(
            client.get(files(sid, route), params={"path": "n" * 300}), "invalid_path", status=400
        )
    h.assert_rejected(
        client.delete(files(sid), params={"path": "n" * 300}), "invalid_path", status=400
    )
    h.assert_rejected(
        client.post(files(sid, "/mkdir"), json={"path": "n" * 300}), "invalid_path", status=400
    )
    for route in ("", "/stat", "/list"):
        r = client.get(files(sid, route), params={"path": ""})
        h.assert_rejected(r, "invalid_path", "invalid_request")
        r = client.get(files(sid, route))  # no path at all
        h.assert_rejected(r, "invalid_path", "invalid_request")
    ls = client.get(files(sid, "/list"), params={"path": "/workspace"})
    assert ls.status_code == 200 and ls.json()["entries"] == [], ls.text


def test_write_with_overlong_name_is_invalid_path(client, sbx) -> None:
    r = put(client, files(sbx), params={"path": "n" * 300}, content=b"x")
    h.assert_rejected(r, "invalid_path", status=400)


def test_host_data_dir_paths_stay_inside_the_sandbox(server, client, sbx) -> None:
    sid = sbx
    runtime_json = server.data_dir / "sandboxes" / sid / "runtime.json"
    db = server.data_dir / "agentbox.db"
    assert runtime_json.exists() and db.exists()  # control: they are there on the host
    before = _digest(str(runtime_json))
    for p in (runtime_json, db, server.data_dir):
        for route in ("", "/stat", "/list"):
            r = client.get(files(sid, route), params={"path": str(p)})
            h.assert_rejected(r, "path_not_found", status=404)
        h.assert_rejected(client.delete(files(sid), params={"path": str(p)}), "path_not_found")
    # A write to that path may succeed, but only inside the sandbox (its /tmp is private).
    target = server.data_dir / "sandboxes" / sid / "planted.json"
    r = put(client, files(sid), params={"path": str(target)}, content=b'{"pwned": true}')
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        h.assert_rejected(r)
    assert not target.exists(), "a files-API write landed in the host data dir"
    r = put(client, files(sid), params={"path": str(runtime_json)}, content=b"{}")
    assert r.status_code < 500, r.text
    assert json.loads(runtime_json.read_text()).get("init_pid"), "host runtime.json overwritten"
    assert _digest(str(runtime_json)) == before
    # The sandbox still answers (its control socket was not disturbed).
    assert h.run(client, sid, "echo ok").stdout.strip() == "ok"


# ---------------------------------------------------------------- symlinks

INTERMEDIATE = [
    "root/etc/passwd",
    "root/workspace/d/f",
    "dl/f",
    "loop/x",
    "etcl/passwd",
    "/workspace/root/etc/hostname",
]


@pytest.mark.parametrize("path", ["pw", "loop", "dl", "root", "etcl"])
def test_symlink_final_component_read_and_list_refused(client, trapped, path) -> None:
    sid = trapped
    for route in ("", "/list"):
        r = client.get(files(sid, route), params={"path": path}, timeout=10)
        body = h.assert_rejected(r, "symlink_refused", status=400)
        assert body["detail"].get("link") == f"/workspace/{path}", body
        assert body["detail"].get("target"), body
    # stat describes the link itself, never its target.
    r = client.get(files(sid, "/stat"), params={"path": path})
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "symlink" and r.json()["symlink_target"], r.text


@pytest.mark.parametrize("path", INTERMEDIATE)
def test_symlink_intermediate_component_refused_everywhere(client, trapped, path) -> None:
    sid = trapped
    for method, route in (("GET", ""), ("GET", "/stat"), ("GET", "/list"), ("DELETE", "")):
        r = client.request(method, files(sid, route), params={"path": path}, timeout=10)
        h.assert_rejected(r, "symlink_refused", status=400)
    r = put(client, files(sid), params={"path": path}, content=b"pwned\n", timeout=10)
    h.assert_upload_rejected(r, "symlink_refused", status=400)
    new_dir = path.rsplit("/", 1)[0] + "/newdir"
    r = client.post(files(sid, "/mkdir"), json={"path": new_dir}, timeout=10)
    h.assert_rejected(r, "symlink_refused", status=400)
    r = client.post(files(sid, "/rename"), json={"src": path, "dst": "stolen"}, timeout=10)
    h.assert_rejected(r, "symlink_refused", status=400)
    r = client.post(files(sid, "/rename"), json={"src": "d/f", "dst": path}, timeout=10)
    h.assert_rejected(r, "symlink_refused", status=400)
    # Nothing moved, nothing was created or removed behind the links.
    out = h.run(client, sid, "cat d/f; ls -A d; ls -A /workspace; sha256sum -c /tmp/passwd.sum")
    assert out.ok, out
    assert out.stdout.splitlines()[0] == "inside-d", out
    assert "newdir" not in out.stdout and "stolen" not in out.stdout, out


def test_write_through_symlink_never_reaches_target(client, trapped) -> None:
    """However a write via a link is answered, the link's target is never written."""
    sid = trapped
    for path in ("pw", "etcl/passwd", "dl/f", "root/etc/passwd", "root/workspace/d/f"):
        r = put(client, files(sid), params={"path": path}, content=b"pwned::0:0::/:/bin/sh\n")
        if r.status_code != 200:
            h.assert_upload_rejected(r, "symlink_refused")
    out = h.run(
        client, sid, "sha256sum -c /tmp/passwd.sum && cat d/f && grep -c pwned /etc/passwd; true"
    )
    assert "/etc/passwd: OK" in out.stdout, out
    assert "inside-d" in out.stdout, out
    assert "pwned" not in h.run(client, sid, "cat /etc/passwd d/f").stdout


@pytest.mark.parametrize(
    "op",
    [
        "write",
        "mkdir",
    ],
)
def test_symlink_final_component_write_and_mkdir_refused(client, trapped, op) -> None:
    sid = trapped
    if op == "write":
        r = put(client, files(sid), params={"path": "pw"}, content=b"x\n")
    else:
        r = client.post(files(sid, "/mkdir"), json={"path": "dl"})
    h.assert_rejected(r, "symlink_refused", status=400)


def test_remove_and_rename_act_on_the_link_itself(client, trapped) -> None:
    sid = trapped
    for path in ("pw", "root", "dl", "loop", "etcl"):
        r = client.delete(files(sid), params={"path": path})
        assert r.status_code == 204, r.text
    r = h.run(
        client,
        sid,
        "ls -A /workspace; echo; sha256sum -c /tmp/passwd.sum; cat d/f; "
        "ls / | wc -l; ls /etc | wc -l",
    )
    assert r.ok, r
    assert r.stdout.split()[0:1] == ["d"] and "pw" not in r.stdout.split(), r
    assert "inside-d" in r.stdout, r
    counts = [int(x) for x in r.stdout.split()[-2:]]
    assert counts[0] >= 8 and counts[1] >= 20, r  # / and /etc are intact
    # rename moves a link, not what it points to.
    h.run(client, sid, "ln -s /etc/passwd /workspace/pw2 && ln -s /workspace/d /workspace/dl2")
    r = client.post(files(sid, "/rename"), json={"src": "pw2", "dst": "moved-link"})
    assert r.status_code == 200 and r.json()["type"] == "symlink", r.text
    r = client.post(files(sid, "/rename"), json={"src": "d/f", "dst": "dl2"})
    assert r.status_code == 200 and r.json()["type"] == "file", r.text  # replaced the link
    r = h.run(client, sid, "ls -l /workspace; ls -A d; sha256sum -c /tmp/passwd.sum")
    assert "moved-link -> /etc/passwd" in r.stdout and "/etc/passwd: OK" in r.stdout, r


# ---------------------------------------------------------------- special files


def test_fifo_device_and_directory_reads_fail_fast(client, sbx) -> None:
    sid = sbx
    assert h.run(client, sid, "mkfifo /workspace/f && mkfifo /tmp/f && mkdir -p dd").ok
    for path in ("f", "/tmp/f", "/dev/zero", "/dev/urandom", "/dev/stdin", "/proc/self/fd/0"):
        t0 = time.monotonic()
        r = client.get(files(sid), params={"path": path}, timeout=15)
        assert time.monotonic() - t0 < 5, f"read of {path} took too long"
        h.assert_rejected(r)
    r = client.get(files(sid), params={"path": "dd"})
    h.assert_rejected(r, "is_a_directory", status=400)
    r = client.get(files(sid), params={"path": "/workspace"})
    h.assert_rejected(r, "is_a_directory", status=400)
    r = client.get(files(sid, "/stat"), params={"path": "f"})
    assert r.status_code == 200 and r.json()["type"] == "other", r.text
    # The agent is still healthy after all of that (no thread stuck on the FIFO).
    assert h.run(client, sid, "echo ok", timeout=10).stdout.strip() == "ok"


def test_read_of_unopenable_device_is_4xx(client, sbx) -> None:
    t0 = time.monotonic()
    r = client.get(files(sbx), params={"path": "/dev/tty"}, timeout=15)
    assert time.monotonic() - t0 < 5
    h.assert_rejected(r)


def test_rejected_upload_is_4xx_not_broken_pipe(server, client, trapped) -> None:
    body = b"x" * (4 * 1024 * 1024)
    for path, code in (
        ("../x", "invalid_path"),
        ("/etc/x", "read_only_path"),
        ("d/f/x", "not_a_directory"),
        ("root/etc/x", "symlink_refused"),
    ):
        with server.client(client.headers["X-API-Key"]) as c:  # fresh connection each time
            r = put(c, files(trapped), params={"path": path}, content=body, timeout=60)
        h.assert_rejected(r, code)


def test_writes_outside_workspace_are_read_only_violations(client, sbx) -> None:
    sid = sbx
    for path in ("/etc/x", "/usr/x", "/.agentbox/x", "/usr/local/bin/x"):
        r = put(client, files(sid), params={"path": path}, content=b"x")
        body = h.assert_upload_rejected(r, "read_only_path", status=403)
        if r.status_code == 500:
            continue
        v = body["detail"]["violation"]
        assert v["code"] == "read_only_path" and v["message"], body
    r = client.post(files(sid, "/mkdir"), json={"path": "/etc/newdir"})
    h.assert_rejected(r, "read_only_path", status=403)
    r = client.delete(files(sid), params={"path": "/etc/hostname"})
    h.assert_rejected(r, "read_only_path", "permission_denied", status=403)
    for path in ("/x", "/var/x", "/etc/shadow"):
        r = put(client, files(sid), params={"path": path}, content=b"x")
        h.assert_upload_rejected(r, "read_only_path", "permission_denied", status=403)
    r = client.get(files(sid), params={"path": "/etc/shadow"})
    h.assert_rejected(r, "permission_denied", status=403)
    out = h.run(client, sid, "ls /etc/x /usr/x /x 2>&1; test -e /etc/hostname && echo present")
    assert "present" in out.stdout and "No such file" in out.stdout, out
    # Control: /workspace and /tmp are writable through the API.
    for path in ("/workspace/ok.txt", "/tmp/ok.txt"):
        r = put(client, files(sid), params={"path": path}, content=b"fine")
        assert r.status_code == 200, r.text
        assert client.get(files(sid), params={"path": path}).content == b"fine"


def _upload_64mib(client: httpx.Client, sid: str, path: str) -> tuple[httpx.Response, bytes]:
    chunk = os.urandom(1024 * 1024)

    def body() -> Iterator[bytes]:
        for _ in range(64):
            yield chunk

    t0 = time.monotonic()
    r = put(client, files(sid), params={"path": path}, content=body(), timeout=120)
    assert time.monotonic() - t0 < 60, "the over-limit upload was not cut short"
    return r, chunk


@pytest.fixture
def small_disk(client: httpx.Client, host_unchanged) -> Iterator[str]:
    sid = h.create(client, resources={"disk_mb": 32})["sandbox_id"]
    yield sid
    h.kill(client, sid)


def test_upload_larger_than_disk_limit_is_limit_exceeded(client, small_disk) -> None:
    r, _ = _upload_64mib(client, small_disk, "big.bin")
    b = h.assert_rejected(r, "limit_exceeded", status=400)
    v = b["detail"].get("violation") or {}
    assert v.get("code") == "disk_limit" and v.get("setting") == "resources.disk_mb", b


def test_upload_larger_than_disk_limit_leaves_sandbox_usable(client, small_disk) -> None:
    sid = small_disk
    # Control: the workspace really is a ~32 MiB filesystem.
    st = h.run(client, sid, "df -B1M --output=size /workspace | tail -1")
    assert int(st.stdout.strip()) <= 40, st
    r, chunk = _upload_64mib(client, sid, "big.bin")
    assert r.status_code != 200 and h.error_code(r), r.text
    # The partial upload left nothing behind, the space is back and the sandbox works.
    r = h.run(client, sid, "ls -A /workspace; df -m /workspace | tail -1; echo ok")
    assert r.ok and r.stdout.strip().endswith("ok"), r
    assert "big.bin" not in r.stdout and ".agentbox-" not in r.stdout, r
    used_mb = int(r.stdout.splitlines()[-2].split()[2])
    assert used_mb < 8, r
    r = put(client, files(sid), params={"path": "small.bin"}, content=chunk)
    assert r.status_code == 200 and r.json()["size"] == len(chunk), r.text
    assert client.get(files(sid), params={"path": "small.bin"}).content == chunk


# ---------------------------------------------------------------- tenants


def test_other_tenants_sandbox_is_404_on_every_files_route(server, client, sbx) -> None:
    sid = sbx
    canary = secrets.token_hex(8)
    assert (
        put(client, files(sid), params={"path": "mine.txt"}, content=canary.encode()).status_code
        == 200
    )
    other_key = server.make_key(f"intruder-{secrets.token_hex(4)}")
    with server.client(other_key) as other:
        attempts = [
            other.get(files(sid), params={"path": "mine.txt"}),
            put(other, files(sid), params={"path": "mine.txt"}, content=b"overwritten"),
            put(other, files(sid), params={"path": "new.txt"}, content=b"planted"),
            other.get(files(sid, "/list"), params={"path": "/workspace"}),
            other.get(files(sid, "/stat"), params={"path": "mine.txt"}),
            other.post(files(sid, "/mkdir"), json={"path": "newdir"}),
            other.delete(files(sid), params={"path": "mine.txt"}),
            other.post(files(sid, "/rename"), json={"src": "mine.txt", "dst": "gone.txt"}),
        ]
        for r in attempts:
            h.assert_rejected(r, "not_found", status=404)
        # Exactly like an id that never existed.
        ghost = "sbx_" + secrets.token_hex(8)
        r = other.get(files(ghost), params={"path": "mine.txt"})
        h.assert_rejected(r, "not_found", status=404)
        assert r.json()["message"].replace(ghost, sid) == attempts[0].json()["message"]
    listing = client.get(files(sid, "/list"), params={"path": "/workspace"}).json()
    assert [e["name"] for e in listing["entries"]] == ["mine.txt"], listing
    assert client.get(files(sid), params={"path": "mine.txt"}).text == canary
