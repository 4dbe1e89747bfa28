"""The README's examples, run as a new user runs them: the server started by the quick start's
own command (`bash scripts/serve.sh`) with the data dir where the README says it lives, then
every shell and Python block executed as written, its `# expected` comments checked.

A block the test cannot run says why in an HTML comment just before it
(`<!-- readme-test: skip: REASON -->`); a block that is neither run nor explained fails.

The data dir is the default one (`/var/lib/agentbox`, made 0700 by the server) when CI runs on
a fresh machine; elsewhere (a developer's machine may run its own server there) a fresh dir
made the same way, named by AGENTBOX_DATA_DIR, which the README documents. Either way the
code-interpreter template is built on first use inside it, as for a new user: from the test
run's cached layers and downloads (copied in as hard links), so the build takes seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from agentbox.battery.target import free_port

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DEFAULT_DATA_DIR = Path("/var/lib/agentbox")
BLOCK = re.compile(
    r"(?:<!-- readme-test: (?P<mark>[^\n]*?) -->\n)?^```(?P<lang>[a-z]*)\n(?P<body>.*?)^```",
    re.S | re.M,
)
ID = re.compile(r"^sbx_[0-9a-f]{16}$")


@dataclass
class Block:
    index: int
    lang: str
    body: str
    mark: str | None


def readme_blocks() -> list[Block]:
    return [
        Block(i, m["lang"], m["body"], m["mark"])
        for i, m in enumerate(BLOCK.finditer(README.read_text()))
    ]


def _block(predicate: str) -> Block:
    found = [b for b in readme_blocks() if predicate in b.body]
    assert len(found) == 1, f"the README has {len(found)} blocks with {predicate!r}"
    return found[0]


def test_every_block_is_run_or_says_why_not() -> None:
    run_here = {
        "bash scripts/serve.sh",
        "agentbox keys create",
        "sbx.files.write",
        "run_code",
        'isolation="gvisor"',
        "sbx.pause()",
        "create_snapshot",
    }
    for block in readme_blocks():
        if block.lang not in ("sh", "python", "bash"):
            continue  # diagrams, tables
        ran = any(marker in block.body for marker in run_here)
        skipped = (block.mark or "").startswith("skip: ") and len(block.mark or "") > 12
        why = f"README block {block.index} is neither run nor skipped with a reason"
        assert ran or skipped, f"{why}:\n{block.body}"


# ------------------------------------------------------------------------------ the server


@dataclass
class Readme:
    url: str
    data_dir: Path
    env: dict[str, str]
    output: Path
    workdir: Path


def _seed_template_cache(code_template: Path, data_dir: Path) -> None:
    """What a first build downloads and builds layer by layer, as this test run has it."""
    templates = data_dir / "templates"
    templates.mkdir(mode=0o700, parents=True)
    for part in ("layers", "cache"):
        if (code_template / part).is_dir():
            r = subprocess.run(["cp", "-al", str(code_template / part), str(templates)])
            if r.returncode != 0:  # another filesystem: a real copy
                shutil.rmtree(templates / part, ignore_errors=True)
                shutil.copytree(code_template / part, templates / part, symlinks=True)


@pytest.fixture(scope="module")
def readme(tmp_path_factory: pytest.TempPathFactory, code_template: Path) -> Iterator[Readme]:
    tmp = tmp_path_factory.mktemp("readme")
    literal = bool(os.environ.get("CI")) and not DEFAULT_DATA_DIR.exists()
    data_dir = DEFAULT_DATA_DIR if literal else tmp / "var-lib-agentbox"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AGENTBOX_") and k not in ("PYTHONPATH",)
    }
    if os.environ.get("PYTHONPATH"):  # a checkout tested from another tree's venv
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    if not literal:
        env["AGENTBOX_DATA_DIR"] = str(data_dir)
    port = free_port()
    env["AGENTBOX_API_URL"] = f"http://127.0.0.1:{port}"
    _seed_template_cache(code_template, data_dir)
    serve = _block("bash scripts/serve.sh").body.strip()
    assert serve == "bash scripts/serve.sh"
    output = tmp / "serve.log"
    with open(output, "wb") as log:
        proc = subprocess.Popen(
            [*serve.split(), "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300  # serve.sh installs what is missing first
        while True:
            assert proc.poll() is None, output.read_text()[-3000:]
            try:
                if httpx.get(f"{env['AGENTBOX_API_URL']}/v1/health", timeout=2).is_success:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, output.read_text()[-3000:]
            time.sleep(0.2)
        # Where a new user runs the CLI lines: `.venv/bin/agentbox` relative to it.
        workdir = tmp / "work"
        workdir.mkdir()
        (workdir / ".venv").symlink_to(REPO / ".venv")
        yield Readme(env["AGENTBOX_API_URL"], data_dir, env, output, workdir)
    finally:
        with contextlib.suppress(Exception):  # the teardown goes on whatever this says
            _end_live_sandboxes(env["AGENTBOX_API_URL"], data_dir)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if literal:
            shutil.rmtree(DEFAULT_DATA_DIR, ignore_errors=True)


def _end_live_sandboxes(url: str, data_dir: Path) -> None:
    """End whatever the examples left running, every tenant's, before the server stops (a
    stopped server leaves live sandboxes running for its next start, which never comes here,
    and the data dir is then removed): the MCP example's sandbox, ended by its session's close
    through the server's own API, was seen still running as SIGTERM closed that API."""
    admin = {"X-API-Key": (data_dir / "admin.key").read_text().strip()}
    db_url = f"file:{data_dir / 'agentbox.db'}?mode=ro"
    with contextlib.closing(sqlite3.connect(db_url, uri=True)) as db:
        tenants = [t for (t,) in db.execute("SELECT DISTINCT tenant FROM sandboxes")]
    with httpx.Client(base_url=url, timeout=60) as c:
        for tenant in tenants:
            r = c.post("/v1/keys", json={"tenant": tenant}, headers=admin)
            if r.status_code != 201:
                continue  # the server's own (`~check`: a template's check, which ends itself)
            key = {"X-API-Key": r.json()["key"]}
            live = c.get("/v1/sandboxes", params={"state": "live", "limit": 200}, headers=key)
            for s in live.json()["sandboxes"]:
                c.delete(f"/v1/sandboxes/{s['sandbox_id']}", headers=key)


def test_the_server_makes_a_private_data_dir_and_an_admin_key(readme: Readme) -> None:
    assert readme.data_dir.stat().st_mode & 0o777 == 0o700
    key_file = readme.data_dir / "admin.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert key_file.read_text().strip() in readme.output.read_text()
    health = httpx.get(f"{readme.url}/v1/health").json()
    assert health["status"] == "ok", health
    # serve.sh built the default template first (`agentbox setup`, with its progress), so the
    # server started with it ready and checked it like the host's userland.
    assert health["default_template"] == "base", health
    assert health["templates"] == {"host": "ok", "base": "ok"}, health
    log = readme.output.read_text()
    assert "template base is ready" in log and "base: [5/5] finalize" in log, log[-3000:]


# ------------------------------------------------------------------------------ the blocks


def _shell_steps(body: str) -> list[str]:
    """The block's commands, each on a line of its own (comments after `#` dropped)."""
    return [line.split("  #")[0].strip() for line in body.splitlines() if line.strip()]


def test_the_cli_quick_start(readme: Readme) -> None:
    block = _block("agentbox keys create")
    (readme.workdir / "data.csv").write_text("x\n1\n2\n3\n")
    # The id the README writes as `sbx_…` is the one `agentbox create` printed.
    script = ["set -euo pipefail"]
    for i, step in enumerate(_shell_steps(block.body)):
        step = step.replace("sbx_…", "$SBX")
        if step.endswith("agentbox create"):
            step = f'SBX=$({step}); echo "$SBX"'
        script += [f"echo '::step {i}'", step]
    script.append('echo "::key $AGENTBOX_API_KEY"')
    r = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=readme.workdir,
        env=readme.env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    out = _steps(r.stdout)
    steps = _shell_steps(block.body)
    assert set(out) == set(range(len(steps))), r.stdout

    def output_of(command: str) -> str:
        (i,) = [i for i, step in enumerate(steps) if command in step]
        return out[i]

    key = r.stdout.split("::key ")[1].strip()
    assert key.startswith("abx_"), r.stdout
    readme.env["AGENTBOX_API_KEY"] = key  # the README's `export`, kept for the Python blocks
    created = output_of("agentbox create").strip()
    assert ID.match(created), r.stdout
    assert output_of("print(6*7)").strip() == "42"
    assert created in output_of("agentbox ls"), r.stdout  # with its whole id
    audit = output_of("agentbox audit")
    assert "sandbox.create" in audit and "file.write" in audit, r.stdout
    listed = httpx.get(f"{readme.url}/v1/sandboxes/{created}", headers={"X-API-Key": key}).json()
    assert listed["state"] == "killed" and listed["template"] == "base", listed


def _steps(stdout: str) -> dict[int, str]:
    out: dict[int, str] = {}
    current = None
    for line in stdout.splitlines(keepends=True):
        if line.startswith("::step "):
            current = int(line.split()[1])
            out[current] = ""
        elif line.startswith("::key "):
            current = None
        elif current is not None:
            out[current] += line
    return out


# Runs a block with `print` recording what each call printed (one entry per call, in order).
HARNESS = """
import builtins, io, json, sys
printed = []
_print = builtins.print
def recording_print(*args, **kwargs):
    buf = io.StringIO()
    _print(*args, **{**kwargs, "file": buf})
    printed.append(buf.getvalue())
    _print(*args, **kwargs)
builtins.print = recording_print
try:
    exec(compile(open(sys.argv[1]).read(), "README block", "exec"), {"__name__": "__main__"})
finally:
    json.dump(printed, open(sys.argv[2], "w"))
"""


def _expected_prints(body: str) -> list[str | None]:
    """Per `print(` line of the block, what its `# comment` says it prints (None: no claim)."""
    out: list[str | None] = []
    for line in body.splitlines():
        if not re.match(r"\s*print\(", line):
            continue
        comment = line.split("  # ", 1)[1].strip() if "  # " in line else None
        out.append(comment)
    return out


def _run_python(readme: Readme, block: Block, timeout: float) -> list[str]:
    assert "AGENTBOX_API_KEY" in readme.env, "the CLI quick start exports the key first"
    src, printed = readme.workdir / f"block{block.index}.py", readme.workdir / "printed.json"
    src.write_text(block.body)
    harness = readme.workdir / "harness.py"
    harness.write_text(HARNESS)
    r = subprocess.run(
        [".venv/bin/python", str(harness), str(src), str(printed)],
        cwd=readme.workdir,
        env=readme.env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, f"README block {block.index} failed:\n{r.stdout}\n{r.stderr}"
    calls: list[str] = json.loads(printed.read_text())
    expected = _expected_prints(block.body)
    assert len(calls) == len(expected), (calls, expected)
    for got, claim in zip(calls, expected, strict=True):
        if claim is not None:
            assert got.rstrip("\n") == claim, f"README says {claim!r}, the code printed {got!r}"
    return calls


def test_the_python_quick_start(readme: Readme) -> None:
    calls = _run_python(readme, _block("sbx.files.write"), timeout=120)
    assert calls[0] == "hi from the sandbox\n 0\n" and calls[1] == "done\n\n", calls


def test_the_pause_example(readme: Readme) -> None:
    _run_python(readme, _block("sbx.pause()"), timeout=120)


def test_the_snapshot_fork_and_volume_example(readme: Readme) -> None:
    _run_python(readme, _block("create_snapshot"), timeout=180)


def test_the_isolation_example(readme: Readme) -> None:
    if shutil.which("runsc") is None:
        pytest.skip("runsc is not installed (scripts/install.sh installs it)")
    _run_python(readme, _block('isolation="gvisor"'), timeout=120)


def test_the_code_interpreter_example_builds_its_template_on_first_use(readme: Readme) -> None:
    index = readme.data_dir / "templates" / "index" / "code-interpreter.json"
    assert not index.exists(), "the template must not be built before the example asks for it"
    _run_python(readme, _block("run_code"), timeout=600)
    health = httpx.get(f"{readme.url}/v1/health").json()
    assert health["status"] == "ok", health
    # Built inside the private data dir, which sandbox uids cannot traverse.
    assert index.exists()
    assert readme.data_dir.stat().st_mode & 0o777 == 0o700
    # The create answered at once (`building`), the SDK waited for the build and the start.
    key = readme.env["AGENTBOX_API_KEY"]
    events = httpx.get(
        f"{readme.url}/v1/audit", headers={"X-API-Key": key}, params={"limit": 1000}
    ).json()["events"]
    creates = [e for e in events if e["action"] == "sandbox.create"]
    built = [e for e in creates if (e.get("detail") or {}).get("template") == "code-interpreter"]
    assert [e["status"] for e in built] == [202], creates
    starts = [e for e in events if e["action"] == "sandbox.start"]
    assert [e["status"] for e in starts] == [200], starts


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_mcp_config(readme: Readme, anyio_backend: str) -> None:  # noqa: ARG001
    """The MCP config as an agent would use it: its command, args and env (the key and the URL
    of this test's server put in), driven by the official `mcp` client. Last: its sandbox
    is a code-interpreter one, which the code interpreter example builds on first use."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    assert "AGENTBOX_API_KEY" in readme.env, "the CLI quick start exports the key first"
    block = next(b for b in readme_blocks() if b.lang == "json" and "mcpServers" in b.body)
    server = json.loads(block.body)["mcpServers"]["agentbox"]
    env = dict(server["env"])
    assert env == {"AGENTBOX_API_URL": "http://127.0.0.1:8686", "AGENTBOX_API_KEY": "<your key>"}
    env["AGENTBOX_API_URL"] = readme.env["AGENTBOX_API_URL"]
    env["AGENTBOX_API_KEY"] = readme.env["AGENTBOX_API_KEY"]
    command = str(REPO / ".venv/bin" / server["command"])  # the README's "full path" note
    params = StdioServerParameters(command=command, args=server["args"], env={**readme.env, **env})
    async with stdio_client(params) as (read, write), ClientSession(read, write) as s:
        await s.initialize()
        assert "run_code" in {t.name for t in (await s.list_tools()).tools}
        r = await s.call_tool("run_command", {"command": "echo hi from mcp"})
        text = "\n".join(c.text for c in r.content if c.type == "text")
        assert not r.is_error and "hi from mcp" in text, text

    # The remote agent's config: the server's /mcp over streamable HTTP, with the key.
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    block = next(b for b in readme_blocks() if b.lang == "json" and '"url"' in b.body)
    remote = json.loads(block.body)["mcpServers"]["agentbox"]
    assert remote["type"] == "http" and remote["url"] == "http://127.0.0.1:8686/mcp", remote
    url = readme.env["AGENTBOX_API_URL"] + "/mcp"
    auth = remote["headers"]["Authorization"].replace("<your key>", readme.env["AGENTBOX_API_KEY"])
    async with (
        httpx2.AsyncClient(headers={"Authorization": auth}, timeout=120) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        r = await client.call_tool("run_code", {"code": "print('hi over http')"})
        text = "\n".join(c.text for c in r.content if c.type == "text")
        assert not r.is_error and "hi over http" in text, text


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
