"""Run inside a virtual environment that has a stock `e2b` SDK from PyPI (test_e2b.py makes
one per SDK line), pointed at an agentbox server by E2B's environment variables only:

    python e2b_client.py SCENARIO

Each scenario drives the SDK as an E2B user would and asserts what E2B does; it prints one
`ok <step>` line per step passed (the test checks them), and exits non-zero on the first
failure with the SDK's own exception.
"""

from __future__ import annotations

import inspect
import io
import os
import sys
import threading
import time
from datetime import UTC, datetime, timedelta

import httpx
from e2b import CommandExitException, PtySize, Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import (
    AuthenticationException,
    FileNotFoundException,
    InvalidArgumentException,
    NotFoundException,
    SandboxException,
    TimeoutException,
)

TEMPLATE = os.environ.get("E2B_TEST_TEMPLATE", "host")


def ok(step: str) -> None:
    print(f"ok {step}", flush=True)


def lifecycle() -> None:
    started = datetime.now(UTC) - timedelta(seconds=1)
    sbx = Sandbox.create(
        TEMPLATE, timeout=60, metadata={"suite": "e2b", "n": "1"}, envs={"GREETING": "hi"}
    )
    assert sbx.sandbox_id.startswith("sbx_"), sbx.sandbox_id
    assert sbx.is_running()
    ok("create")

    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id and info.template_id == TEMPLATE, info
    assert info.state.value == "running", info.state
    assert info.metadata == {"suite": "e2b", "n": "1"}, info.metadata
    assert info.started_at >= started and info.end_at > info.started_at, info
    assert 50 < (info.end_at - datetime.now(UTC)).total_seconds() <= 61, info.end_at
    assert info.cpu_count >= 1 and info.memory_mb > 0, info
    ok("get_info")

    sbx.set_timeout(300)
    left = (sbx.get_info().end_at - datetime.now(UTC)).total_seconds()
    assert 290 < left <= 301, left
    ok("set_timeout")

    other = Sandbox.create(TEMPLATE, timeout=60, metadata={"suite": "e2b", "n": "2"})
    mine = [
        s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"n": "1"})).next_items()
    ]
    assert mine == [sbx.sandbox_id], mine
    pager = Sandbox.list(query=SandboxQuery(metadata={"suite": "e2b"}), limit=1)
    first = pager.next_items()
    assert pager.has_next and len(first) == 1, (pager.has_next, first)
    second = pager.next_items()
    assert {first[0].sandbox_id, second[0].sandbox_id} == {sbx.sandbox_id, other.sandbox_id}
    assert first[0].sandbox_id == other.sandbox_id  # newest first
    later = Sandbox.list(query=SandboxQuery(started_after=datetime.now(UTC) + timedelta(hours=1)))
    assert later.next_items() == []
    assert [
        s.sandbox_id for s in Sandbox.list(query=SandboxQuery(template="nope")).next_items()
    ] == []
    ok("list")

    assert sbx.pause() in (True, None, sbx.sandbox_id)  # the SDK lines answer differently
    assert not sbx.is_running()
    assert sbx.get_info().state.value == "paused"
    paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
    assert [s.sandbox_id for s in paused] == [sbx.sandbox_id], paused
    running = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING])).next_items()
    assert [s.sandbox_id for s in running] == [other.sandbox_id], running
    try:
        again = Sandbox.pause(sbx.sandbox_id)
    except SandboxException as e:  # an SDK line that raises on E2B's 409
        assert "already paused" in str(e), e
    else:
        assert again is False, again
    ok("pause")

    if "on_resume" in inspect.signature(Sandbox.connect).parameters:  # newer SDK lines
        # A cold boot from disk of a sandbox paused with its memory: refused, as E2B does
        # where it cannot, never downgraded to a memory resume.
        try:
            Sandbox.connect(sbx.sandbox_id, timeout=120, on_resume="reboot")
        except SandboxException as e:
            assert "memory=false" in str(e), e
        else:
            raise AssertionError("a reboot-resume of a memory pause was answered")
        assert sbx.get_info().state.value == "paused"
    back = Sandbox.connect(sbx.sandbox_id, timeout=120)
    assert back.sandbox_id == sbx.sandbox_id and back.is_running()
    assert back.get_info().state.value == "running"
    ok("connect_resumes")

    assert sbx.kill() is True
    assert Sandbox.kill(sbx.sandbox_id) is False
    assert not sbx.is_running()
    try:
        Sandbox.get_info(sbx.sandbox_id)
    except NotFoundException:
        pass
    else:
        raise AssertionError("a killed sandbox is still found")
    ok("kill")

    other.set_timeout(0)  # E2B: ends now
    assert not other.is_running()
    ok("timeout_zero")


def files() -> None:
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    try:
        info = sbx.files.write("/tmp/e2b/hello.txt", "hello e2b")  # parents made
        assert info.path == "/tmp/e2b/hello.txt" and info.name == "hello.txt", info
        assert sbx.files.read("/tmp/e2b/hello.txt") == "hello e2b"
        ok("write_read_text")

        blob = bytes(range(256)) * 20_000  # 5 MiB, streamed (octet-stream)
        sbx.files.write("/tmp/e2b/blob.bin", io.BytesIO(blob))
        assert sbx.files.read("/tmp/e2b/blob.bin", format="bytes") == blob
        streamed = b"".join(sbx.files.read("/tmp/e2b/blob.bin", format="stream"))
        assert streamed == blob
        ok("stream")

        sbx.files.write("/tmp/e2b/gz.txt", "squeezed " * 1000, gzip=True)
        assert sbx.files.read("/tmp/e2b/gz.txt", gzip=True) == "squeezed " * 1000
        ok("gzip")

        many = sbx.files.write_files(
            [{"path": "/tmp/e2b/a.txt", "data": "A"}, {"path": "/tmp/e2b/b.bin", "data": b"\0B"}]
        )
        assert [w.path for w in many] == ["/tmp/e2b/a.txt", "/tmp/e2b/b.bin"], many
        assert sbx.files.read("/tmp/e2b/b.bin", format="bytes") == b"\0B"
        sbx.files.write("/tmp/e2b/a.txt", "replaced")
        assert sbx.files.read("/tmp/e2b/a.txt") == "replaced"
        ok("multipart")

        try:
            sbx.files.read("/tmp/e2b/missing.txt")
        except FileNotFoundException:
            pass
        else:
            raise AssertionError("reading a missing file did not raise")
        ok("missing")

        sbx.files.write("/tmp/e2b-root.txt", "root's", user="root")
        assert sbx.files.read("/tmp/e2b-root.txt", user="user") == "root's"
        try:
            sbx.files.write("/tmp/e2b-root.txt", "user's", user="user")
        except SandboxException as e:
            assert "e2b-root.txt" in str(e) and ("denied" in str(e) or "not permitted" in str(e))
        else:
            raise AssertionError("user overwrote root's file")
        ok("users")

        # File metadata: X-Metadata-* headers, kept as the file's user.e2b.* xattrs.
        info = sbx.files.write("/tmp/e2b/meta.txt", "m", metadata={"Author": "me", "run": "7"})
        assert info.metadata == {"author": "me", "run": "7"}, info
        assert sbx.files.get_info("/tmp/e2b/meta.txt").metadata == {"author": "me", "run": "7"}
        listed = {e.name: e.metadata for e in sbx.files.list("/tmp/e2b")}
        assert listed["meta.txt"] == {"author": "me", "run": "7"} and not listed["a.txt"], listed
        got = sbx.commands.run("getfattr -d --absolute-names /tmp/e2b/meta.txt || true").stdout
        assert 'user.e2b.author="me"' in got or not got, got  # getfattr may be missing
        sbx.files.write("/tmp/e2b/meta.txt", "m2")  # replaced whole: its metadata with it
        assert not sbx.files.get_info("/tmp/e2b/meta.txt").metadata
        try:
            sbx.files.write("/tmp/e2b/meta.txt", "m", metadata={"big": "x" * 1000} | {
                f"k{i}": "v" for i in range(40)})
        except (SandboxException, InvalidArgumentException) as e:
            assert "metadata" in str(e), e
        else:
            raise AssertionError("40 metadata keys were kept")
        ok("metadata")

        # Without the sandbox's envd token: the sandbox is as good as unknown.
        url = os.environ["E2B_SANDBOX_URL"]
        real = sbx._envd_access_token
        assert real, "a secure sandbox has an envd access token"
        for token in ("", "ea_wrong", real[:-1] + ("x" if real[-1] != "x" else "y")):
            headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
            if token:
                headers["X-Access-Token"] = token
            assert httpx.get(f"{url}/health", headers=headers).status_code == 502
            r = httpx.get(f"{url}/files", params={"path": "/tmp/e2b/a.txt"}, headers=headers)
            assert r.status_code == 401 and r.json()["code"] == 401, r.text
        ok("token_required")

        # Signed URLs, opened by a plain client that sends no E2B header: the signature alone
        # names the sandbox and authorizes that path, that operation, that user.
        r = httpx.get(sbx.download_url("/tmp/e2b/a.txt"))
        assert r.status_code == 200 and r.content == b"replaced", r.text
        up = sbx.upload_url("/tmp/e2b/up.txt", use_signature_expiration=60)
        r = httpx.post(up, files={"file": ("up.txt", b"uploaded")})
        assert r.status_code == 200, r.text
        assert sbx.files.read("/tmp/e2b/up.txt") == "uploaded"
        assert httpx.get(sbx.download_url("/tmp/e2b-root.txt", user="root")).text == "root's"
        read_a = sbx.download_url("/tmp/e2b/a.txt")
        as_root = sbx.download_url("/tmp/e2b/a.txt", user="root")
        for forged in (
            read_a.replace("a.txt", "b.bin"),  # another path
            read_a.replace("signature=v1_", "signature=v1_A"),  # another signature
            as_root.replace("username=root", "username=user"),  # another user
        ):
            r = httpx.get(forged)
            assert r.status_code == 401 and r.json()["code"] == 401, (forged, r.text)
        r = httpx.post(read_a, files={"file": ("a.txt", b"overwritten")})  # read's, not write's
        assert r.status_code == 401 and sbx.files.read("/tmp/e2b/a.txt") == "replaced", r.text
        r = httpx.get(sbx.download_url("/tmp/e2b/a.txt", use_signature_expiration=-5))
        assert r.status_code == 401, r.text
        assert r.json() == {"code": 401, "message": "signature is already expired"}, r.text
        ok("signed_urls")
    finally:
        sbx.kill()


def commands() -> None:
    """envd's process RPC: foreground, background, stdin, signals, list, connect, users."""
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    try:
        r = sbx.commands.run("echo out; echo err >&2")
        assert (r.exit_code, r.stdout, r.stderr, r.error) == (0, "out\n", "err\n", None), r
        ok("run")

        seen: list[str] = []
        r = sbx.commands.run(
            "for i in 1 2 3; do echo $i; sleep 0.2; done; echo $A",
            envs={"A": "env"},
            on_stdout=seen.append,
        )
        assert r.stdout == "1\n2\n3\nenv\n" and "".join(seen) == r.stdout, (r, seen)
        assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
        ok("stream_envs_cwd")

        # E2B's layout: the user's home and working directory are /home/user (the same files
        # as agentbox's /workspace, written through either path).
        r = sbx.commands.run("pwd; echo $HOME")
        assert r.stdout == "/home/user\n/home/user\n", r
        sbx.files.write("/home/user/layout.txt", "one")
        r = sbx.commands.run("cat layout.txt /workspace/layout.txt; echo two > /workspace/b.txt")
        assert r.stdout == "oneone" and sbx.files.read("/home/user/b.txt") == "two\n", r
        assert sbx.commands.run("pwd", user="root").stdout != "/home/user\n"
        ok("home")

        try:
            sbx.commands.run("echo bad >&2; exit 3")
        except CommandExitException as e:
            assert e.exit_code == 3 and e.stderr == "bad\n", e
        else:
            raise AssertionError("a failing command did not raise")
        ok("exit_code")

        assert sbx.commands.run("id -un").stdout.strip() == "user"
        assert sbx.commands.run("id -un", user="root").stdout.strip() == "root"
        ok("users")

        h = sbx.commands.run("sleep 60", background=True)
        assert h.pid > 0
        assert h.pid in [p.pid for p in sbx.commands.list()], sbx.commands.list()
        listed = next(p for p in sbx.commands.list() if p.pid == h.pid)
        assert listed.cmd == "/bin/bash" and listed.args[-1] == "sleep 60", listed
        assert sbx.commands.kill(h.pid) is True
        try:
            h.wait()
        except CommandExitException as e:
            assert e.exit_code != 0, e
        assert h.pid not in [p.pid for p in sbx.commands.list()]
        assert sbx.commands.kill(h.pid) is False  # gone: envd's "not found"
        ok("background_kill")

        h = sbx.commands.run("read line; echo got:$line", background=True, stdin=True)
        sbx.commands.send_stdin(h.pid, "hello\n")
        assert h.wait().stdout == "got:hello\n"
        ok("stdin")

        h = sbx.commands.run("echo first; sleep 1; echo second", background=True)
        again = sbx.commands.connect(h.pid)
        assert "second" in again.wait().stdout
        ok("connect")

        try:  # as envd: the command's timeout ends the process, not only the wait
            sbx.commands.run("sleep 30 && echo late", timeout=2)
        except TimeoutException:
            pass
        else:
            raise AssertionError("a command past its timeout did not raise")
        deadline = time.monotonic() + 10
        while any(p.args[-1:] == ["sleep 30 && echo late"] for p in sbx.commands.list()):
            assert time.monotonic() < deadline, sbx.commands.list()
            time.sleep(0.2)
        ok("timeout")
    finally:
        sbx.kill()


def filesystem() -> None:
    """envd's filesystem RPC: make_dir, list (with depth), exists, get_info, rename, remove."""
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    try:
        assert sbx.files.make_dir("/tmp/fs/sub") is True
        assert sbx.files.make_dir("/tmp/fs/sub") is False  # there already
        sbx.files.write("/tmp/fs/sub/a.txt", "abc")
        info = sbx.files.get_info("/tmp/fs/sub/a.txt")
        assert (info.name, info.type.value, info.size) == ("a.txt", "file", 3), info
        assert info.permissions.startswith("rw"), info
        ok("make_dir_info")

        top = sbx.files.list("/tmp/fs")
        assert [(e.name, e.type.value) for e in top] == [("sub", "dir")], top
        deep = {e.path for e in sbx.files.list("/tmp/fs", depth=2)}
        assert deep == {"/tmp/fs/sub", "/tmp/fs/sub/a.txt"}, deep
        ok("list")

        sbx.commands.run("ln -s sub/a.txt /tmp/fs/link")  # every SDK line decodes its entry
        link = next(e for e in sbx.files.list("/tmp/fs") if e.name == "link")
        assert link.symlink_target == "sub/a.txt" and link.type.value == "symlink", link
        sbx.files.remove("/tmp/fs/link")
        ok("symlink")

        moved = sbx.files.rename("/tmp/fs/sub/a.txt", "/tmp/fs/b.txt")
        assert moved.path == "/tmp/fs/b.txt", moved
        assert sbx.files.exists("/tmp/fs/b.txt") and not sbx.files.exists("/tmp/fs/sub/a.txt")
        sbx.files.remove("/tmp/fs/b.txt")
        assert not sbx.files.exists("/tmp/fs/b.txt")
        ok("rename_remove")

        try:
            sbx.files.get_info("/tmp/fs/nothing")
        except FileNotFoundException:
            pass
        else:
            raise AssertionError("stat of a missing path did not raise")
        ok("missing")
    finally:
        sbx.kill()


def pty() -> None:
    """A terminal: input typed, its size read and changed, job control, ^C, exit."""
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    try:
        out = bytearray()
        ended: list[int] = []
        term = sbx.pty.create(PtySize(rows=24, cols=80), timeout=60)
        assert term.pid > 0

        def follow() -> None:
            try:
                term.wait(on_pty=out.extend)
            except CommandExitException as e:
                ended.append(e.exit_code)

        def shows(text: str) -> None:
            deadline = time.monotonic() + 30
            while text not in out.decode(errors="replace"):
                assert time.monotonic() < deadline, (text, bytes(out))
                time.sleep(0.05)

        reader = threading.Thread(target=follow)
        reader.start()
        sbx.pty.send_stdin(term.pid, b"stty size; tty; echo $((6*7))\n")
        shows("\n42")
        text = out.decode(errors="replace")
        assert "24 80" in text and "/dev/pts/" in text, text
        sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
        sbx.pty.send_stdin(term.pid, b"stty size; sleep 30\n")
        shows("30 100")
        sbx.pty.send_stdin(term.pid, b"\x03")  # ^C ends the sleep, not the shell
        sbx.pty.send_stdin(term.pid, b"echo after-$((1+1)); exit 7\n")
        reader.join(30)
        assert ended == [7] and "after-2" in out.decode(errors="replace"), (ended, bytes(out))
        ok("terminal")

        term = sbx.pty.create(PtySize(rows=10, cols=40), timeout=60)
        assert term.pid in [p.pid for p in sbx.commands.list()]
        assert sbx.pty.kill(term.pid) is True
        try:
            term.wait()
        except CommandExitException:
            pass
        ok("kill")
    finally:
        sbx.kill()


def watch() -> None:
    """files.watch_dir (CreateWatcher, GetWatcherEvents, RemoveWatcher): what changed, by
    name, in the tree, and nothing after stop()."""
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    try:
        sbx.files.make_dir("/tmp/w/old")
        handle = sbx.files.watch_dir("/tmp/w", recursive=True)
        sbx.files.write("/tmp/w/a.txt", "x")
        sbx.files.make_dir("/tmp/w/sub")
        time.sleep(0.3)  # the new directory is followed once its create is read
        sbx.files.write("/tmp/w/sub/b.txt", "y")
        sbx.files.write("/tmp/w/old/c.txt", "z")
        sbx.files.rename("/tmp/w/a.txt", "/tmp/w/moved.txt")
        sbx.commands.run("chmod 600 /tmp/w/moved.txt; rm /tmp/w/moved.txt")
        wanted = {
            ("a.txt", "create"), ("sub", "create"), ("sub/b.txt", "create"),
            ("old/c.txt", "create"), ("a.txt", "rename"), ("moved.txt", "create"),
            ("moved.txt", "chmod"), ("moved.txt", "remove"),
        }  # fmt: skip
        seen: set[tuple[str, str]] = set()
        deadline = time.monotonic() + 20
        while not wanted <= seen:
            assert time.monotonic() < deadline, (wanted - seen, seen)
            seen |= {(e.name, e.type.value) for e in handle.get_new_events()}
            time.sleep(0.2)
        sbx.commands.run("echo more >> /tmp/w/old/c.txt")  # written in place: a write
        while ("old/c.txt", "write") not in seen:
            assert time.monotonic() < deadline, seen
            seen |= {(e.name, e.type.value) for e in handle.get_new_events()}
            time.sleep(0.2)
        assert not [name for name, _ in seen if "agentbox-upload" in name], seen
        handle.stop()
        try:
            handle.get_new_events()
        except SandboxException:
            pass
        else:
            raise AssertionError("a stopped watcher gave events")
        ok("watch_dir")

        handle = sbx.files.watch_dir("/tmp/w", include_entry=True)
        sbx.files.write("/tmp/w/e.txt", "12345")
        events: list = []
        deadline = time.monotonic() + 20

        def until(kind: str) -> None:
            while not any(e.type.value == kind for e in events):
                assert time.monotonic() < deadline, events
                events.extend(handle.get_new_events())
                time.sleep(0.2)

        # The entry is the path as it is when the agent reads the event: removed before that
        # (a slow tier, a busy host), the event comes alone. So the removal waits.
        until("create")
        sbx.files.remove("/tmp/w/e.txt")
        until("remove")
        made = next(e for e in events if e.type.value == "create")
        assert made.name == "e.txt" and made.entry is not None, made
        assert made.entry.path == "/tmp/w/e.txt" and made.entry.type.value == "file", made.entry
        assert next(e for e in events if e.type.value == "remove").entry is None, events
        handle.stop()
        ok("include_entry")

        try:
            sbx.files.watch_dir("/tmp/nowhere")
        except (FileNotFoundException, NotFoundException):
            pass
        else:
            raise AssertionError("watching a missing directory did not raise")
        ok("missing")
    finally:
        sbx.kill()


def tenants() -> None:
    """Another tenant's key sees nothing of this tenant's sandbox; no key gets 401."""
    sbx = Sandbox.create(TEMPLATE, timeout=60)
    try:
        foreign = {"api_key": os.environ["E2B_OTHER_API_KEY"]}
        try:
            Sandbox.get_info(sbx.sandbox_id, **foreign)
        except NotFoundException:
            pass
        else:
            raise AssertionError("another tenant got the sandbox's info")
        assert Sandbox.kill(sbx.sandbox_id, **foreign) is False
        assert Sandbox.list(**foreign).next_items() == []
        assert sbx.is_running()
        try:
            Sandbox.list(api_key="abx_x_nope").next_items()
        except AuthenticationException:
            pass
        else:
            raise AssertionError("an unknown key listed sandboxes")
        ok("tenants")
    finally:
        sbx.kill()


def refusals() -> None:
    """What agentbox does not do is refused by name, never dropped."""
    api = os.environ["E2B_API_URL"]
    key = {"X-API-KEY": os.environ["E2B_API_KEY"]}
    for body, says in (
        ({"templateID": TEMPLATE, "secure": False}, "secure=false"),
        ({"templateID": TEMPLATE, "mcp": {"github": {}}}, "mcp"),
        ({"templateID": TEMPLATE, "network": {"rules": [{"x": 1}]}}, "network.rules"),
        ({"templateID": "no-such-template"}, "no-such-template"),
        ({"timeout": 10}, "templateID"),
    ):
        r = httpx.post(f"{api}/sandboxes", json=body, headers=key, timeout=30)
        assert r.status_code in (400, 404, 422), (body, r.status_code, r.text)
        assert r.json()["code"] == r.status_code and says in r.json()["message"], r.text
    ok("refusals")


if __name__ == "__main__":
    scenarios = {"lifecycle": lifecycle, "files": files, "tenants": tenants}
    scenarios |= {"refusals": refusals, "commands": commands, "filesystem": filesystem}
    scenarios |= {"pty": pty, "watch": watch}
    scenarios[sys.argv[1]]()
