"""E2B SDK habits on both faces, against a real server: class-method variants taking a sandbox
id, `request_timeout=` per call, `cwd=`, `files.write_files`, `connect(id, timeout=)` and live
output callbacks of background commands under asyncio."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from agentbox import AsyncSandbox, Sandbox
from agentbox.sdk import (
    CommandExitException,
    EntryInfo,
    InvalidArgumentError,
    NotFoundError,
    SandboxTimeoutError,
)
from agentbox.sdk import protocol as p
from agentbox.sdk.async_sandbox import AsyncTransport
from agentbox.sdk.sandbox import Transport

# No server answers an HTTP request within 0.1 ms: a call given this must time out.
TOO_SHORT = 1e-4




def _seconds_left(end_at: datetime | None) -> float:
    assert end_at is not None
    return (end_at - datetime.now(UTC)).total_seconds()


# ---------------------------------------------------------------------------- class-method variants


def test_kill_set_timeout_get_info_by_id(conn: dict[str, Any], sbx: Sandbox) -> None:
    info = Sandbox.get_info(sbx.sandbox_id, **conn)
    assert info.sandbox_id == sbx.sandbox_id and info.state == "running"
    assert _seconds_left(Sandbox.set_timeout(sbx.sandbox_id, 3000, **conn).end_at) > 2900
    assert _seconds_left(Sandbox.get_info(sbx.sandbox_id, **conn).end_at) > 2900

    # The instance forms keep working beside them.
    assert sbx.get_info().sandbox_id == sbx.sandbox_id
    assert _seconds_left(sbx.set_timeout(600).end_at) < 700

    assert Sandbox.kill(sbx.sandbox_id, **conn) is True
    assert sbx.get_info().state == "killed"
    assert sbx.kill() is True  # killing an ended sandbox is fine
    assert Sandbox.kill("sbx-no-such-sandbox", **conn) is False  # E2B: False when not found
    with pytest.raises(NotFoundError):
        Sandbox.get_info("sbx-no-such-sandbox", **conn)


def test_async_kill_set_timeout_get_info_by_id(conn: dict[str, Any]) -> None:
    async def flow() -> None:
        sbx = await AsyncSandbox.create(timeout=120, **conn)
        try:
            info = await AsyncSandbox.get_info(sbx.sandbox_id, **conn)
            assert info.sandbox_id == sbx.sandbox_id and info.state == "running"
            info = await AsyncSandbox.set_timeout(sbx.sandbox_id, 3000, **conn)
            assert _seconds_left(info.end_at) > 2900
            assert (await sbx.get_info()).sandbox_id == sbx.sandbox_id
            assert await AsyncSandbox.kill(sbx.sandbox_id, **conn) is True
            assert not await sbx.is_running()
            assert await AsyncSandbox.kill("sbx-no-such-sandbox", **conn) is False
            assert await sbx.kill() is True
        finally:
            await sbx.close()

    asyncio.run(flow())


# ---------------------------------------------------------------------------- request_timeout


def test_request_timeout_overrides_the_clients(conn: dict[str, Any], sbx: Sandbox) -> None:
    # A client whose own request timeout no answer can meet: each call works only through
    # its per-call override.
    slow = Sandbox(sbx.sandbox_id, Transport(p.resolve_config(request_timeout=TOO_SHORT, **conn)))
    try:
        ok = {"request_timeout": 30}
        assert slow.get_info(**ok).state == "running"
        assert slow.set_timeout(300, **ok).state == "running"
        assert slow.files.write("a.txt", "hello", **ok).path == "/workspace/a.txt"
        assert slow.files.read("a.txt", **ok) == "hello"
        assert "a.txt" in [e.name for e in slow.files.list(**ok)]
        assert slow.files.exists("a.txt", **ok)
        assert slow.commands.run("echo fg", **ok).stdout == "fg\n"
        h = slow.commands.run("sleep 0.3; echo bg", background=True, **ok)
        assert h.wait().stdout == "bg\n"  # its resumed streams keep the override
        assert slow.kill(**ok) is True
    finally:
        slow.close()


@contextlib.contextmanager
def frozen(server: Any, seconds: float) -> Iterator[None]:
    """The server process stopped for `seconds`: requests reach its socket, none is answered."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    thaw = threading.Timer(seconds, os.kill, (server.proc.pid, signal.SIGCONT))
    thaw.start()
    try:
        yield
    finally:
        thaw.join()


def test_request_timeout_bounds_each_call(fresh_server: Any) -> None:
    conn = {"api_key": fresh_server.make_key("rt"), "api_url": fresh_server.url}
    sbx = Sandbox.create(timeout=120, **conn)
    sbx.files.write("b.txt", "x")
    short = {"request_timeout": 0.2}
    for call in (
        lambda: sbx.get_info(**short),
        lambda: sbx.set_timeout(300, **short),
        lambda: sbx.files.read("b.txt", **short),
        lambda: sbx.files.list(**short),
        lambda: sbx.files.write("c.txt", "y", **short),
        lambda: sbx.files.write_files([{"path": "d.txt", "data": "z"}], **short),
        lambda: sbx.commands.run("true", background=True, **short),
        lambda: Sandbox.get_info(sbx.sandbox_id, **conn, **short),
    ):
        started = time.monotonic()
        with frozen(fresh_server, 0.6), pytest.raises(SandboxTimeoutError) as e:
            call()
        assert e.value.code == "request_timeout" and time.monotonic() - started < 1.5

    # A client whose own timeout is short: the per-call one wins, the client's holds otherwise.
    patient = Sandbox(sbx.sandbox_id, Transport(p.resolve_config(request_timeout=0.2, **conn)))
    with frozen(fresh_server, 0.6):
        assert patient.files.read("b.txt", request_timeout=10) == "x"
    with frozen(fresh_server, 0.6), pytest.raises(SandboxTimeoutError):
        patient.files.read("b.txt")
    patient.close()

    async def flow() -> None:
        async with AsyncTransport(p.resolve_config(**conn)) as transport:
            asbx = AsyncSandbox(sbx.sandbox_id, transport)
            with frozen(fresh_server, 0.6), pytest.raises(SandboxTimeoutError):
                await asbx.get_info(request_timeout=0.2)
            with frozen(fresh_server, 0.6), pytest.raises(SandboxTimeoutError):
                await asbx.files.write("e.txt", "w", request_timeout=0.2)
            with frozen(fresh_server, 0.6):
                assert (await asbx.get_info(request_timeout=10)).state == "running"

    asyncio.run(flow())
    assert sbx.kill() is True
    sbx.close()


# ---------------------------------------------------------------------------- cwd


def test_run_cwd(sbx: Sandbox) -> None:
    sbx.files.make_dir("/workspace/deep/er")
    assert sbx.commands.run("pwd").stdout == "/workspace\n"
    assert sbx.commands.run("pwd", cwd="/workspace/deep/er").stdout == "/workspace/deep/er\n"
    h = sbx.commands.run("pwd", background=True, cwd="/tmp")
    assert h.wait().stdout == "/tmp\n"


# ---------------------------------------------------------------------------- write_files


def test_write_files(sbx: Sandbox) -> None:
    written = sbx.files.write_files(
        [
            {"path": "w/one.txt", "data": "one"},
            {"path": "/workspace/w/two.bin", "data": b"\x00\x02"},
        ]
    )
    assert all(isinstance(e, EntryInfo) for e in written)
    assert [e.path for e in written] == ["/workspace/w/one.txt", "/workspace/w/two.bin"]
    assert sbx.files.read("w/one.txt") == "one"
    assert sbx.files.read("w/two.bin", format="bytes") == b"\x00\x02"
    assert sbx.files.write_files([]) == []

    # A bad entry is refused before any file is written.
    bad: list[Any] = [{"path": "w/three.txt", "data": "3"}, {"data": "no path"}]
    with pytest.raises(InvalidArgumentError, match="write_files takes entries"):
        sbx.files.write_files(bad)
    assert not sbx.files.exists("w/three.txt")


def test_async_write_files(conn: dict[str, Any]) -> None:
    async def flow() -> None:
        async with await AsyncSandbox.create(timeout=120, **conn) as sbx:
            written = await sbx.files.write_files(
                [{"path": "x.txt", "data": "x"}, {"path": "y.txt", "data": "y"}]
            )
            assert [e.name for e in written] == ["x.txt", "y.txt"]
            assert await sbx.files.read("y.txt") == "y"

    asyncio.run(flow())


# ---------------------------------------------------------------------------- connect(timeout=)


def test_connect_with_timeout_extends_never_shortens(conn: dict[str, Any], sbx: Sandbox) -> None:
    assert _seconds_left(sbx.get_info().end_at) < 130
    again = Sandbox.connect(sbx.sandbox_id, timeout=1800, **conn)
    try:
        assert _seconds_left(again.get_info().end_at) > 1700
    finally:
        again.close()
    shorter = Sandbox.connect(sbx.sandbox_id, timeout=30, **conn)
    try:
        assert _seconds_left(shorter.get_info().end_at) > 1700
    finally:
        shorter.close()
    plain = Sandbox.connect(sbx.sandbox_id, **conn)  # no timeout: the end stays
    plain.close()
    assert _seconds_left(sbx.get_info().end_at) > 1700


def test_async_connect_with_timeout(conn: dict[str, Any], sbx: Sandbox) -> None:
    async def flow() -> None:
        again = await AsyncSandbox.connect(sbx.sandbox_id, timeout=1800, **conn)
        await again.close()

    asyncio.run(flow())
    assert _seconds_left(sbx.get_info().end_at) > 1700


# ---------------------------------------------------------------------------- live callbacks


def test_async_background_callbacks_fire_live(conn: dict[str, Any]) -> None:
    async def flow() -> None:
        async with await AsyncSandbox.create(timeout=120, **conn) as sbx:
            out: list[str] = []
            err: list[str] = []
            first = asyncio.Event()

            def on_stdout(data: str) -> None:
                out.append(data)
                first.set()

            async def on_stderr(data: str) -> None:
                err.append(data)

            started = time.monotonic()
            h = await sbx.commands.run(
                "echo one; echo oops >&2; sleep 2; echo two",
                background=True,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
            )
            # The caller never waited, yet the first line came while the command slept.
            await asyncio.wait_for(first.wait(), timeout=1.8)
            assert out == ["one\n"] and time.monotonic() - started < 2
            with pytest.raises(InvalidArgumentError):
                async for _ in h:
                    pass
            r = await h.wait()
            assert r.stdout == "one\ntwo\n" == "".join(out)
            assert r.stderr == "oops\n" == "".join(err)

            failing = await sbx.commands.run(
                "echo bye; exit 3", background=True, on_stdout=out.append
            )
            with pytest.raises(CommandExitException) as e:
                await failing.wait()
            assert e.value.exit_code == 3 and out[-1] == "bye\n"

    asyncio.run(flow())


def test_sync_background_callbacks_fire_in_wait(sbx: Sandbox) -> None:
    out: list[str] = []
    h = sbx.commands.run("echo one; echo two", background=True, on_stdout=out.append)
    r = h.wait()
    assert r.stdout == "one\ntwo\n" == "".join(out)
