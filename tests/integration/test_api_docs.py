"""docs/API.md's examples, run against a real server, so the docs and the API cannot drift.

Every fenced block in docs/API.md carries a mark in an HTML comment just before it, saying how
it is checked (or why not):

- `<!-- api-test: run -->`: a shell session. Each command runs in order (one bash, `set -euo
  pipefail`, `AGENTBOX_API_URL`/`AGENTBOX_API_KEY` set); the `#>` lines after a command are what
  it prints, one per line. A `#>` line that is JSON is compared as JSON: the same keys, equal
  values; `…` stands for any value, and inside a string for any text. Other lines compare as
  text, `…` again for any text.
- `<!-- api-test: shape of a sandbox -->`: a `SandboxInfo`; a live one has the same keys (at
  every level), the same JSON types, and `null` where the block has `null`.
- `<!-- api-test: network policy -->`: a policy the API accepts as written and gives back.
- `<!-- api-test: skip: REASON -->`: not checked, and says why.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import ServerHandle, create_sandbox

API_MD = Path(__file__).resolve().parents[2] / "docs" / "API.md"
BLOCK = re.compile(
    r"(?:<!-- api-test: (?P<mark>[^\n]*?) -->\n)?^```(?P<lang>[a-z]*)\n(?P<body>.*?)^```",
    re.S | re.M,
)
ANY = "\u2026"  # …


@dataclass
class Block:
    index: int
    lang: str
    body: str
    mark: str | None


def api_blocks() -> list[Block]:
    return [
        Block(i, m["lang"], m["body"], m["mark"])
        for i, m in enumerate(BLOCK.finditer(API_MD.read_text()))
    ]


def _marked(mark: str) -> list[Block]:
    found = [b for b in api_blocks() if b.mark == mark]
    assert found, f"docs/API.md has no block marked {mark!r}"
    return found


def test_every_block_is_checked_or_says_why_not() -> None:
    known = {"run", "shape of a sandbox", "network policy", "states diagram"}
    for b in api_blocks():
        skipped = (b.mark or "").startswith("skip: ") and len(b.mark or "") > 12
        assert b.mark in known or skipped, (
            f"docs/API.md block {b.index} has no api-test mark (or skip reason):\n{b.body}"
        )


def test_the_states_diagram_is_the_code_s() -> None:
    """The lifecycle picture in docs/API.md is the one core/states.py documents, and every
    state and move it draws is in the transition table."""
    from agentbox.core import states

    (block,) = _marked("states diagram")
    drawn = [line.strip() for line in block.body.strip().splitlines()]
    code = [line.strip() for line in (states.__doc__ or "").splitlines()]
    assert all(line in code for line in drawn), drawn
    for state in states.SandboxState:
        assert state.value in block.body, state
    assert states.allowed("running", "paused") and states.allowed("paused", "running")


# ------------------------------------------------------------------------------ matching


def _glob(pattern: str, text: str) -> bool:
    return re.fullmatch(".*".join(map(re.escape, pattern.split(ANY))), text, re.S) is not None


def _matches(doc: Any, live: Any) -> bool:
    if doc == ANY:
        return True
    if isinstance(doc, dict):
        return (
            isinstance(live, dict)
            and doc.keys() == live.keys()
            and all(_matches(doc[k], live[k]) for k in doc)
        )
    if isinstance(doc, list):
        return isinstance(live, list) and len(doc) == len(live) and all(map(_matches, doc, live))
    if isinstance(doc, str):
        return isinstance(live, str) and _glob(doc, live)
    return type(doc) is type(live) and doc == live


def _as_json(line: str) -> Any:
    """The `#>` line as JSON (a bare `…` is any value), or None if it is text."""
    if not line.startswith(("{", "[")):
        return None
    return json.loads(re.sub(r'(?<!["\w])\u2026(?!["\w])', lambda _: json.dumps(ANY), line))


def _line_matches(expected: str, got: str) -> bool:
    doc = _as_json(expected)
    if doc is None:
        return _glob(expected, got)
    try:
        return _matches(doc, json.loads(got))
    except json.JSONDecodeError:
        return False


def _same_shape(doc: Any, live: Any) -> bool:
    if doc is None or live is None:
        return doc is None and live is None
    if isinstance(doc, dict):
        return (
            isinstance(live, dict)
            and doc.keys() == live.keys()
            and all(_same_shape(doc[k], live[k]) for k in doc)
        )
    if isinstance(doc, list):
        return isinstance(live, list) and all(_same_shape(doc[0], x) for x in live[:1] if doc)
    return type(doc) is type(live)


def test_the_matcher_catches_what_it_should() -> None:
    assert _line_matches('{"a": …, "b": "x…z"}', '{"a": [1], "b": "xyz"}')
    assert not _line_matches('{"a": …}', '{"a": 1, "extra": 2}')
    assert not _line_matches('{"t": 1.5}', '{"t": 15}')
    assert not _line_matches('{"t": 1}', '{"t": 1.0}')
    assert _line_matches("204", "204") and not _line_matches("204", "422")
    assert not _same_shape({"a": None}, {"a": 1})
    assert _same_shape({"a": {"k": "v"}, "b": [1]}, {"a": {"k": "w"}, "b": []})


# ------------------------------------------------------------------------------ the session


@dataclass
class Step:
    command: str
    expected: list[str]


def _session(body: str) -> list[Step]:
    """The block's commands (`\\` continuations joined) with their `#>` lines."""
    steps: list[Step] = []
    pending = ""
    for line in body.splitlines():
        if line.startswith("#>"):
            steps[-1].expected.append(line[2:].strip())
        elif line.startswith("#") or not line.strip():
            continue
        elif line.endswith("\\"):
            pending += line[:-1]
        else:
            steps.append(Step(pending + line, []))
            pending = ""
    return steps


def _outputs(stdout: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    current = None
    for line in stdout.splitlines():
        if line.startswith("::step "):
            current = int(line.split()[1])
            out[current] = []
        elif current is not None and line:
            out[current].append(line)
    return out


@pytest.mark.skipif(
    not shutil.which("curl") or not shutil.which("jq"),
    reason="needs curl and jq (scripts/test.sh installs them)",
)
def test_the_curl_session_prints_what_the_docs_say(server: ServerHandle, tenant_key: str) -> None:
    (block,) = _marked("run")
    steps = _session(block.body)
    script = ["set -euo pipefail"]
    for i, step in enumerate(steps):
        # A newline first: a JSON body ends without one.
        script += [f"printf '\\n::step {i}\\n'", step.command]
    env = {"PATH": "/usr/bin:/bin", "AGENTBOX_API_URL": server.url, "AGENTBOX_API_KEY": tenant_key}
    r = subprocess.run(
        ["bash", "-c", "\n".join(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    out = _outputs(r.stdout)
    assert set(out) == set(range(len(steps))), r.stdout
    for i, step in enumerate(steps):
        got = out[i]
        where = f"docs/API.md: `{step.command}` printed\n" + "\n".join(got)
        assert len(got) == len(step.expected), f"{where}\nthe docs say\n" + "\n".join(step.expected)
        for expected, line in zip(step.expected, got, strict=True):
            assert _line_matches(expected, line), f"{where}\nthe docs say\n{expected}"


# ------------------------------------------------------------------------------ JSON blocks


def test_sandbox_info_has_the_documented_shape(server: ServerHandle, tenant_key: str) -> None:
    (block,) = _marked("shape of a sandbox")
    doc = json.loads(block.body)
    with server.client(tenant_key) as c:
        sid = create_sandbox(c, metadata={"k": "v"})["sandbox_id"]
        try:
            live = c.get(f"/v1/sandboxes/{sid}").json()
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
    assert _same_shape(doc, live), f"docs/API.md:\n{json.dumps(doc)}\nlive:\n{json.dumps(live)}"


def test_the_documented_network_policy_is_accepted_as_written(
    server: ServerHandle, tenant_key: str
) -> None:
    (block,) = _marked("network policy")
    policy = json.loads(block.body)
    with server.client(tenant_key) as c:
        sid = create_sandbox(c)["sandbox_id"]
        try:
            r = c.put(f"/v1/sandboxes/{sid}/network", json=policy)
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
    assert r.status_code == 200, r.text
    assert r.json()["network"] == policy, r.text
