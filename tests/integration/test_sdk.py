"""The Python SDK against a real server and real sandboxes."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbox import AsyncSandbox, AsyncSecrets, AsyncTemplates, Sandbox, Secrets, Templates
from agentbox.sdk import (
    AgentboxError,
    AuthenticationError,
    CommandExitException,
    CommandHandle,
    CommandResult,
    ConflictError,
    ConnectionFailedError,
    EntryInfo,
    InvalidArgumentError,
    NotFoundError,
    NotFoundException,
    SandboxException,
    SandboxInfo,
    SandboxTimeoutError,
    TimeoutException,
)
from agentbox.sdk.audit import list_audit_events

# ---------------------------------------------------------------------------- lifecycle


def test_create_info_list_timeout_kill(conn: dict[str, Any]) -> None:
    a = Sandbox.create(metadata={"team": "red", "run": "1"}, envs={"GREETING": "hello"}, **conn)
    b = Sandbox.create(metadata={"team": "blue"}, resources={"memory_mb": 256}, **conn)
    try:
        info = a.get_info()
        assert isinstance(info, SandboxInfo)
        assert info.sandbox_id == a.sandbox_id and info.state == "running"
        assert info.metadata == {"team": "red", "run": "1"}
        assert info.template == "host" and info.created_at and info.end_at
        assert b.get_info().resources.memory_mb == 256
        assert a.commands.run("echo $GREETING").stdout == "hello\n"

        red = Sandbox.list(metadata={"team": "red"}, **conn)
        assert [s.sandbox_id for s in red] == [a.sandbox_id]
        everyone = Sandbox.list(state="running", **conn)
        assert {s.sandbox_id for s in everyone} == {a.sandbox_id, b.sandbox_id}
        assert everyone[0].sandbox_id == b.sandbox_id  # newest first
        assert len(Sandbox.list(limit=1, **conn)) == 1

        before = info.end_at
        after = a.set_timeout(3600).end_at
        assert before and after and (after - before).total_seconds() > 3000

        assert a.is_running()
        a.kill()
        a.kill()  # idempotent
        assert not a.is_running()
        dead = a.get_info()
        assert dead.state == "killed" and dead.end_reason == "killed" and dead.ended_at
        assert [s.sandbox_id for s in Sandbox.list(state="running", **conn)] == [b.sandbox_id]
    finally:
        a.kill()
        b.kill()


def test_context_manager_kills(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        assert sbx.is_running()
        sandbox_id = sbx.sandbox_id
    again = Sandbox.connect(sandbox_id, **conn)
    assert again.get_info().state == "killed"
    assert not again.is_running()


def test_wrong_key_and_other_tenant(server: Any, conn: dict[str, Any],
                                    sbx: Sandbox) -> None:
    with pytest.raises(AuthenticationError) as e:
        Sandbox.create(api_key="abx_nope_nope", api_url=server.url)
    assert e.value.status == 401 and e.value.code == "unauthorized" and e.value.message

    other = server.make_key("other-tenant-sdk")
    with pytest.raises(NotFoundError) as nf:
        Sandbox.connect(sbx.sandbox_id, api_key=other, api_url=server.url)
    assert nf.value.status == 404 and nf.value.code == "not_found"
    assert isinstance(nf.value, NotFoundException) and isinstance(nf.value, SandboxException)
    assert sbx.sandbox_id not in {s.sandbox_id for s in
                                  Sandbox.list(api_key=other, api_url=server.url)}
    with pytest.raises(NotFoundError):
        Sandbox.connect("sbx_doesnotexist", **conn)


def test_unreachable_server(tenant_key: str) -> None:
    with pytest.raises(ConnectionFailedError) as e:
        Sandbox.create(api_key=tenant_key, api_url="http://127.0.0.1:9")
    assert isinstance(e.value, AgentboxError) and "127.0.0.1:9" in e.value.message


def test_config_from_environment(server: Any, tenant_key: str,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTBOX_API_URL", server.url)
    monkeypatch.setenv("AGENTBOX_API_KEY", tenant_key)
    with Sandbox.create() as sbx:
        assert sbx.commands.run("true").exit_code == 0


# ---------------------------------------------------------------------------- commands


def test_run_stdout_stderr_exit(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo out; echo err >&2; pwd")
    assert isinstance(r, CommandResult)
    assert (r.stdout, r.stderr, r.exit_code, r.error, r.timed_out, r.violation) == (
        "out\n/workspace\n", "err\n", 0, None, False, None)

    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo partial; echo boom >&2; exit 3")
    assert e.value.exit_code == 3
    assert e.value.stdout == "partial\n" and e.value.stderr == "boom\n"
    assert e.value.violation is None and not e.value.timed_out
    assert "3" in e.value.message and "boom" in str(e.value)


def test_run_streams_callbacks_live(sbx: Sandbox) -> None:
    seen: list[tuple[float, str]] = []
    errs: list[str] = []
    start = time.monotonic()
    r = sbx.commands.run("for i in 1 2 3; do echo $i; sleep 0.3; done; echo done >&2",
                         on_stdout=lambda d: seen.append((time.monotonic(), d)),
                         on_stderr=errs.append)
    end = time.monotonic()
    assert "".join(d for _, d in seen) == "1\n2\n3\n" == r.stdout
    assert "".join(errs) == "done\n"
    # The first chunk arrived while the command was still sleeping, not at the end.
    assert seen[0][0] - start < (end - start) - 0.4


def test_run_envs_cwd(sbx: Sandbox) -> None:
    sbx.files.make_dir("/workspace/sub")
    r = sbx.commands.run("echo $FOO-$BAR; pwd", envs={"FOO": "x", "BAR": "y z"},
                         cwd="/workspace/sub")
    assert r.stdout == "x-y z\n/workspace/sub\n"


def test_run_timeout(sbx: Sandbox) -> None:
    start = time.monotonic()
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo before; sleep 20", timeout=1)
    assert time.monotonic() - start < 10
    assert e.value.timed_out and e.value.stdout == "before\n"
    assert isinstance(e.value, SandboxTimeoutError) and isinstance(e.value, TimeoutException)
    assert e.value.violation is not None and e.value.violation.code == "command_timeout"
    # The sandbox is still usable afterwards.
    assert sbx.commands.run("echo after").stdout == "after\n"


def test_background_wait_kill_stdin(sbx: Sandbox) -> None:
    h = sbx.commands.run("echo started; sleep 0.5; echo finished", background=True)
    assert isinstance(h, CommandHandle) and h.cmd_id and h.pid
    out: list[str] = []
    r = h.wait(on_stdout=out.append)
    assert r.stdout == "started\nfinished\n" == "".join(out) and r.exit_code == 0

    cat = sbx.commands.run("cat", background=True, stdin=True)
    cat.send_stdin("hello ")
    cat.send_stdin("stdin\n")
    cat.close_stdin()
    assert cat.wait().stdout == "hello stdin\n"

    no_stdin = sbx.commands.run("sleep 30", background=True)
    with pytest.raises(ConflictError):
        no_stdin.send_stdin("x")
    assert no_stdin.kill()
    with pytest.raises(CommandExitException) as e:
        no_stdin.wait()
    assert e.value.exit_code == -9

    listed = {c.cmd_id: c for c in sbx.commands.list()}
    assert {h.cmd_id, cat.cmd_id, no_stdin.cmd_id} <= set(listed)
    assert listed[no_stdin.cmd_id].exit_code == -9 and not listed[no_stdin.cmd_id].running


def test_background_iterate_and_nonzero(sbx: Sandbox) -> None:
    h = sbx.commands.run("echo a; echo b >&2; exit 4", background=True)
    pairs = list(h)
    assert ("a\n", None) in pairs and (None, "b\n") in pairs
    with pytest.raises(CommandExitException) as e:
        h.wait()
    assert e.value.exit_code == 4 and e.value.stdout == "a\n"


def test_reconnect_via_connect(conn: dict[str, Any], sbx: Sandbox) -> None:
    h = sbx.commands.run("for i in 1 2 3 4; do echo $i; sleep 0.2; done", background=True)
    # A second client (as after a crash of the first) picks the command up by id and
    # gets the buffered output from the start.
    other = Sandbox.connect(sbx.sandbox_id, **conn)
    try:
        again = other.commands.connect(h.cmd_id)
        assert again.pid == h.pid
        assert again.wait().stdout == "1\n2\n3\n4\n"
    finally:
        other.close()
    with pytest.raises(NotFoundError):
        sbx.commands.connect("c999999")


def test_resume_after_partial_read(sbx: Sandbox) -> None:
    h = sbx.commands.run("for i in 1 2 3 4 5; do echo $i; sleep 0.2; done", background=True)
    for stdout, _ in h:
        assert stdout == "1\n"
        break  # closes this stream; wait() resumes at the offset after "1\n"
    assert h.wait().stdout == "1\n2\n3\n4\n5\n"


def test_dropped_stream_resumes_from_offset(sbx: Sandbox, monkeypatch: pytest.MonkeyPatch,
                                            ) -> None:
    transport = sbx._transport
    real_events = transport.events
    calls: list[Any] = []

    def flaky(call: Any, read_timeout: Any) -> Iterator[dict[str, Any]]:
        calls.append(call)
        for n, event in enumerate(real_events(call, read_timeout)):
            yield event
            if len(calls) == 1 and n == 1:  # start + first line, then the wire "drops"
                raise ConnectionFailedError("simulated drop", code="connection_failed")

    monkeypatch.setattr(transport, "events", flaky)
    r = sbx.commands.run("for i in 1 2 3; do echo line$i; sleep 0.2; done")
    assert r.stdout == "line1\nline2\nline3\n"
    assert len(calls) == 2 and calls[1].path.endswith("/events")
    assert ("offset", len("line1\n")) in (calls[1].params or [])


def test_output_beyond_buffer_is_truncated(sbx: Sandbox) -> None:
    h = sbx.commands.run("head -c 6291456 /dev/zero | tr '\\0' a; echo; echo tail",
                         background=True)
    deadline = time.monotonic() + 30
    while sbx.commands.get_info(h.cmd_id).running and time.monotonic() < deadline:
        time.sleep(0.1)
    r = h.wait()  # starts at offset 0, older than the 4 MiB window: reported as truncated
    assert r.exit_code == 0 and r.stdout.endswith("a\ntail\n")
    assert len(r.stdout) < 6291456


@pytest.mark.slow
def test_stream_survives_server_restart(fresh_server: Any) -> None:
    key = fresh_server.make_key("restart-sdk")
    with Sandbox.create(api_key=key, api_url=fresh_server.url) as sbx:
        seen: list[str] = []
        result: list[Any] = []
        first = threading.Event()
        opened: list[str] = []
        real_events = sbx._transport.events

        def events(call: Any, read_timeout: Any) -> Iterator[dict[str, Any]]:
            opened.append(call.path)
            return real_events(call, read_timeout)

        sbx._transport.events = events  # type: ignore[method-assign]

        def on_stdout(data: str) -> None:
            seen.append(data)
            first.set()

        def run() -> None:
            try:
                result.append(sbx.commands.run(
                    "for i in $(seq 1 12); do echo $i; sleep 0.25; done", on_stdout=on_stdout))
            except Exception as e:  # handed to the main thread's assertion
                result.append(e)

        worker = threading.Thread(target=run)
        worker.start()
        assert first.wait(20)
        fresh_server.stop(signal.SIGKILL)  # a hard drop, not a graceful drain
        fresh_server.start()
        worker.join(60)
        assert not worker.is_alive()
        assert isinstance(result[0], CommandResult), result
        expected = "".join(f"{i}\n" for i in range(1, 13))
        assert result[0].stdout == expected == "".join(seen)
        assert opened[0].endswith("/commands") and opened[-1].endswith("/events")


# ---------------------------------------------------------------------------- files


def test_files_text_bytes_and_info(sbx: Sandbox) -> None:
    entry = sbx.files.write("notes/a.txt", "héllo\n")
    assert isinstance(entry, EntryInfo)
    assert entry.path == "/workspace/notes/a.txt" and entry.type == "file"
    assert entry.size == len("héllo\n".encode())
    assert sbx.files.read("/workspace/notes/a.txt") == "héllo\n"
    assert sbx.files.read("notes/a.txt", format="bytes") == "héllo\n".encode()
    assert sbx.commands.run("cat notes/a.txt").stdout == "héllo\n"

    sbx.files.write("bin.dat", bytes(range(256)))
    assert sbx.files.read("bin.dat", format="bytes") == bytes(range(256))
    info = sbx.files.get_info("bin.dat")
    assert info.size == 256 and info.name == "bin.dat" and info.permissions.startswith("rw")


def test_files_large_stream_roundtrip(sbx: Sandbox, tmp_path: Path) -> None:
    payload = os.urandom(20 * 1024 * 1024)
    assert sbx.files.write("big.bin", payload).size == len(payload)
    chunks = list(sbx.files.read("big.bin", format="stream"))
    assert len(chunks) > 1 and b"".join(chunks) == payload
    assert sbx.files.read("big.bin", format="bytes") == payload

    source = tmp_path / "src.bin"
    source.write_bytes(payload[: 5 * 1024 * 1024])
    with source.open("rb") as f:
        assert sbx.files.write("from_file.bin", f).size == 5 * 1024 * 1024
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    assert sbx.commands.run("sha256sum from_file.bin").stdout.split()[0] == digest
    assert sbx.files.write("from_bytesio.txt", io.BytesIO(b"abc")).size == 3


def test_files_list_dirs_remove_rename(sbx: Sandbox) -> None:
    assert sbx.files.make_dir("d1/d2") is True
    assert sbx.files.make_dir("d1/d2") is False
    sbx.files.write("d1/top.txt", "t")
    sbx.files.write("d1/d2/deep.txt", "d")

    shallow = {e.path for e in sbx.files.list("d1")}
    assert shallow == {"/workspace/d1/top.txt", "/workspace/d1/d2"}
    deep = {e.path: e for e in sbx.files.list("d1", depth=2)}
    assert "/workspace/d1/d2/deep.txt" in deep and deep["/workspace/d1/d2"].type == "dir"

    assert sbx.files.exists("d1/top.txt") and not sbx.files.exists("d1/missing")
    moved = sbx.files.rename("d1/top.txt", "d1/d2/moved.txt")
    assert moved.path == "/workspace/d1/d2/moved.txt"
    assert not sbx.files.exists("d1/top.txt") and sbx.files.read("d1/d2/moved.txt") == "t"

    sbx.files.remove("d1")
    assert not sbx.files.exists("d1")


def test_files_errors(sbx: Sandbox) -> None:
    with pytest.raises(NotFoundError) as e:
        sbx.files.read("missing.txt")
    assert e.value.status == 404 and e.value.code == "path_not_found"
    with pytest.raises(NotFoundError):
        sbx.files.read("missing.txt", format="stream")
    with pytest.raises(NotFoundError):
        sbx.files.get_info("missing.txt")
    with pytest.raises(NotFoundError):
        sbx.files.remove("missing.txt")
    with pytest.raises(InvalidArgumentError) as bad:
        sbx.files.read("../etc/passwd")
    assert bad.value.status == 400 and bad.value.code == "invalid_path"
    with pytest.raises(InvalidArgumentError):
        sbx.files.write("../../etc/evil", "x")
    sbx.files.make_dir("adir")
    with pytest.raises(InvalidArgumentError) as isdir:
        sbx.files.read("adir")
    assert isdir.value.code == "is_a_directory"
    sbx.files.write("afile", "x")
    with pytest.raises(ConflictError):
        sbx.files.make_dir("afile")


def test_files_policy_violation(sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgumentError) as ro:
        sbx.files.write("/etc/evil", "x")
    assert ro.value.code == "read_only_path"
    assert ro.value.violation is not None and ro.value.violation.code == "read_only_path"


def test_files_refused_large_write(conn: dict[str, Any]) -> None:
    with Sandbox.create(resources={"file_size_mb": 5}, **conn) as sbx:
        with pytest.raises(InvalidArgumentError) as bad:
            sbx.files.write("../x", io.BytesIO(bytes(8 << 20)))
        assert bad.value.code == "invalid_path"
        with pytest.raises(InvalidArgumentError) as big:
            sbx.files.write("big", io.BytesIO(bytes(8 << 20)))
        assert big.value.code == "limit_exceeded"
        assert big.value.violation is not None
        assert big.value.violation.code == "file_size_limit"


def test_audit_through_sdk(conn: dict[str, Any], sbx: Sandbox) -> None:
    sbx.commands.run("echo audited")
    events = list_audit_events(sandbox_id=sbx.sandbox_id, **conn)
    actions = [e.action for e in events]
    assert "sandbox.create" in actions and "command.run" in actions
    run = next(e for e in events if e.action == "command.run")
    assert run.sandbox_id == sbx.sandbox_id and run.detail.get("cmd") == "echo audited"
    only = list_audit_events(sandbox_id=sbx.sandbox_id, action="sandbox.create", **conn)
    assert [e.action for e in only] == ["sandbox.create"]


# ---------------------------------------------------------------------------- async


def test_async_sandbox_flow(conn: dict[str, Any]) -> None:
    async def flow() -> None:
        chunks: list[str] = []

        async def on_stdout(data: str) -> None:
            chunks.append(data)

        async with await AsyncSandbox.create(metadata={"kind": "async"}, **conn) as sbx:
            info = await sbx.get_info()
            assert info.state == "running" and info.metadata == {"kind": "async"}
            assert [s.sandbox_id for s in await AsyncSandbox.list(metadata={"kind": "async"},
                                                                  **conn)] == [sbx.sandbox_id]
            r = await sbx.commands.run("echo one; echo two", on_stdout=on_stdout)
            assert r.stdout == "one\ntwo\n" == "".join(chunks)
            with pytest.raises(CommandExitException) as e:
                await sbx.commands.run("exit 7")
            assert e.value.exit_code == 7

            h = await sbx.commands.run("cat", background=True, stdin=True)
            await h.send_stdin("async stdin")
            await h.close_stdin()
            assert (await h.wait()).stdout == "async stdin"
            h2 = await sbx.commands.run("echo x; echo y >&2", background=True)
            assert {pair async for pair in h2} == {("x\n", None), (None, "y\n")}

            await sbx.files.write("a/b.bin", io.BytesIO(b"\x00\x01" * 1000))
            assert await sbx.files.read("a/b.bin", format="bytes") == b"\x00\x01" * 1000
            stream = await sbx.files.read("a/b.bin", format="stream")
            assert b"".join([c async for c in stream]) == b"\x00\x01" * 1000
            assert await sbx.files.exists("a/b.bin")
            assert [e.name for e in await sbx.files.list("a")] == ["b.bin"]
            with pytest.raises(NotFoundError):
                await sbx.files.read("nope")
            sandbox_id = sbx.sandbox_id
        again = await AsyncSandbox.connect(sandbox_id, **conn)
        assert not await again.is_running()
        await again.close()

    asyncio.run(flow())


def test_async_templates_and_secrets_match_the_sync_ones(server: Any,
                                                         conn: dict[str, Any]) -> None:
    admin = {"api_key": server.admin_key, "api_url": server.url}

    async def flow() -> None:
        async with AsyncSecrets(**conn) as secrets:
            made = await secrets.set("ASYNC_TOKEN", "s3cret-value", "api.example.com")
            assert (made.name, made.hosts) == ("ASYNC_TOKEN", ["api.example.com"])
            assert [s.name for s in await secrets.list()] == ["ASYNC_TOKEN"]
            with Secrets(**conn) as sync_secrets:
                assert sync_secrets.list() == await secrets.list()
            await secrets.remove("ASYNC_TOKEN")
            with pytest.raises(NotFoundError):
                await secrets.remove("ASYNC_TOKEN")
            assert await secrets.list() == []

        async with AsyncTemplates(**conn) as templates, AsyncTemplates(**admin) as admin_t:
            with Templates(**conn) as sync_templates:
                assert await templates.list() == sync_templates.list()
                shipped = await templates.builtin()
                assert shipped and shipped == sync_templates.builtin()
                with pytest.raises(NotFoundError):
                    await templates.get("no-such-template")
            with pytest.raises(AuthenticationError):  # sizing pools needs an admin key
                await templates.set_pool_size("default", 0)
            assert isinstance(await admin_t.pools(), list)

    asyncio.run(flow())


def test_watch_dir_streams_a_trees_changes(sbx: Sandbox) -> None:
    """files.watch_dir: what changed, by name relative to the directory, as it happens; new
    directories followed; a missing directory raises; 16 watches per sandbox, a closed one
    gives its place back."""
    from agentbox.sdk import ConflictError, NotFoundError

    sbx.files.make_dir("/workspace/w")
    events = sbx.files.watch_dir("/workspace/w", recursive=True)
    sbx.files.write("/workspace/w/a.txt", "x")
    sbx.commands.run("mkdir /workspace/w/d && sleep 0.3 && echo hi > /workspace/w/d/f")
    sbx.commands.run("chmod 600 /workspace/w/a.txt && rm /workspace/w/a.txt")
    seen: list[tuple[str, str]] = []
    for event in events:
        seen.append((event.name, event.type))
        if seen[-1] == ("a.txt", "remove"):
            break
    events.close()  # type: ignore[attr-defined]
    wanted = {("a.txt", "create"), ("d", "create"), ("d/f", "create"), ("d/f", "write")}
    assert wanted | {("a.txt", "chmod")} <= set(seen), seen
    assert not [name for name, _ in seen if "agentbox-upload" in name], seen

    # What a new directory holds before its watch is set is reported too; the watched
    # directory removed ends the watch with an error, never a silent stream.
    sbx.files.make_dir("/workspace/w2")
    events = sbx.files.watch_dir("/workspace/w2", recursive=True)
    sbx.commands.run("mkdir -p /workspace/w2/x/y && touch /workspace/w2/x/y/f")
    sbx.commands.run("rm -rf /workspace/w2")
    seen = []
    with pytest.raises(AgentboxError, match="w2 was removed"):
        for event in events:
            seen.append((event.name, event.type))
    assert {("x", "create"), ("x/y", "create"), ("x/y/f", "create")} <= set(seen), seen

    with pytest.raises(NotFoundError):
        sbx.files.watch_dir("/workspace/nowhere")
    open_ = [sbx.files.watch_dir("/workspace/w") for _ in range(16)]
    with pytest.raises(ConflictError, match="16 directory watches"):
        sbx.files.watch_dir("/workspace/w")
    open_.pop().close()  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while True:  # the server notices the closed stream when it next writes to it
        try:
            open_.append(sbx.files.watch_dir("/workspace/w"))
            break
        except ConflictError:
            assert time.monotonic() < deadline
            sbx.files.write("/workspace/w/poke", "x")
            time.sleep(0.2)
    for watch in open_:
        watch.close()  # type: ignore[attr-defined]
