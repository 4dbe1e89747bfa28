"""Code output timestamps are integer Unix-epoch nanoseconds, E2B's `OutputMessage.timestamp`
shape, on the wire, in the SDK and in docs/API.md (which said float seconds)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from conftest import ServerHandle

from agentbox.sdk import OutputMessage, Sandbox

API_MD = Path(__file__).resolve().parents[2] / "docs" / "API.md"


def _close_to_now_ns(ts: object, before: int) -> None:
    assert isinstance(ts, int) and not isinstance(ts, bool), repr(ts)
    assert before - 10**9 <= ts <= time.time_ns() + 10**9, (ts, before)


def test_sdk_output_messages_carry_nanoseconds(server: ServerHandle, tenant_key: str) -> None:
    seen: list[OutputMessage] = []
    with Sandbox.create(api_key=tenant_key, api_url=server.url, timeout=120) as sbx:
        before = time.time_ns()
        sbx.run_code(
            "echo out; echo err >&2", language="bash", on_stdout=seen.append, on_stderr=seen.append
        )
    assert sorted(m.line for m in seen) == ["err\n", "out\n"], seen
    for m in seen:
        _close_to_now_ns(m.timestamp, before)


def test_wire_events_and_docs_agree(server: ServerHandle, tenant_key: str) -> None:
    with server.client(tenant_key) as c:
        sid = c.post("/v1/sandboxes", json={"timeout": 120}).json()["sandbox_id"]
        try:
            before = time.time_ns()
            r = c.post(
                f"/v1/sandboxes/{sid}/code/execute", json={"code": "echo hi", "language": "bash"}
            )
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
    events = [json.loads(line) for line in r.text.splitlines() if line]
    (out,) = [e for e in events if e["type"] == "stdout"]
    _close_to_now_ns(out["timestamp"], before)
    documented = re.search(r'"type": "stdout".*?"timestamp": ([0-9.e]+)', API_MD.read_text())
    assert documented, "docs/API.md shows no stdout event of the code interpreter"
    assert type(json.loads(documented[1])) is type(out["timestamp"]), documented[0]
