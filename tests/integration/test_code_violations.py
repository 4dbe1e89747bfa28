"""A kernel that dies under a cell: a `KernelDied` error, and when the OOM killer did it, a
`memory_limit` violation naming `resources.memory_mb` (as a command gets), over raw HTTP and
through the SDK. Real server, real code-interpreter sandbox, a real OOM kill."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from conftest import ServerHandle

from agentbox.sdk import ConflictError, ExecutionError, Sandbox

pytestmark = pytest.mark.slow  # needs the code-interpreter template (built once per machine)

# Touches every page (bytes * n fills them), so the memory limit is really hit.
BOMB = "x = b'\\x01' * (2 * 1024**3)\nprint('ALLOCATED')"


@pytest.fixture(scope="module")
def key(ci_server: ServerHandle) -> str:
    return ci_server.make_key(f"codeviol-{time.monotonic_ns() % 10**8}")


@pytest.fixture(scope="module")
def sbx(ci_server: ServerHandle, key: str) -> Iterator[Sandbox]:
    s = Sandbox.create(
        template="code-interpreter",
        api_url=ci_server.url,
        api_key=key,
        timeout=300,
        resources={"memory_mb": 256},
    )
    yield s
    s.kill()
    s.close()


def _execute(ci_server: ServerHandle, key: str, sid: str, body: dict) -> list[dict]:
    with ci_server.client(key) as c:
        with c.stream("POST", f"/v1/sandboxes/{sid}/code/execute", json=body) as r:
            assert r.status_code == 200, r.read().decode()
            return [json.loads(line) for line in r.iter_lines() if line]


def _is_memory_limit(v: dict | None) -> bool:
    return bool(v) and v["code"] == "memory_limit" and v["setting"] == "resources.memory_mb"


def test_oom_killed_kernel_over_http(ci_server: ServerHandle, key: str, sbx: Sandbox) -> None:
    ctx = sbx.create_code_context()
    events = _execute(ci_server, key, sbx.sandbox_id, {"code": BOMB, "context_id": ctx.id})
    assert not any("ALLOCATED" in e.get("text", "") for e in events), events
    errors = [e for e in events if e["type"] == "error"]
    assert [e["error"]["name"] for e in errors] == ["KernelDied"], events
    assert _is_memory_limit(errors[0].get("violation")), errors
    failed = events[-1]
    assert failed["type"] == "failed" and failed["code"] == "kernel_dead", events
    assert _is_memory_limit(failed.get("violation")), failed
    sbx.remove_code_context(ctx)


def test_oom_killed_kernel_through_the_sdk(sbx: Sandbox) -> None:
    ctx = sbx.create_code_context()
    sbx.run_code("before = 1", context=ctx)
    seen: list[ExecutionError] = []
    with pytest.raises(ConflictError) as info:
        sbx.run_code(BOMB, context=ctx, on_error=seen.append)
    assert info.value.code == "kernel_dead"
    v = info.value.violation
    assert v is not None and v.code == "memory_limit" and v.setting == "resources.memory_mb", v
    assert [e.name for e in seen] == ["KernelDied"], seen
    assert seen[0].violation == v
    # The context is gone until restarted; then it works, with fresh state.
    with pytest.raises(ConflictError):
        sbx.run_code("1", context=ctx)
    sbx.restart_code_context(ctx)
    assert sbx.run_code("1 + 1", context=ctx).text == "2"
    sbx.remove_code_context(ctx)


def test_kernel_death_without_a_limit_is_kernel_died_alone(sbx: Sandbox) -> None:
    ctx = sbx.create_code_context()
    seen: list[ExecutionError] = []
    with pytest.raises(ConflictError) as info:
        sbx.run_code("import os\nos._exit(3)", context=ctx, on_error=seen.append)
    assert info.value.violation is None
    assert [e.name for e in seen] == ["KernelDied"] and seen[0].violation is None, seen
    assert "exited (3)" in seen[0].value, seen
    sbx.remove_code_context(ctx)
