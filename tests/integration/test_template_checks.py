"""Templates kept in the private data dir start sandboxes, and a server says at start-up which
templates cannot (its log, /v1/health, the template's `check`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ServerHandle, start_server


def _private_copy(code_template: Path, data_dir: Path) -> Path:
    """The built code-interpreter template in `data_dir`/templates, where `agentbox serve`
    keeps templates by default (hard links: seconds, not a GB of copying)."""
    templates = data_dir / "templates"
    templates.mkdir(mode=0o700, parents=True, exist_ok=True)
    data_dir.chmod(0o700)
    for part in ("rootfs", "layers"):
        shutil.rmtree(templates / part, ignore_errors=True)  # empty: the server made them
        subprocess.run(["cp", "-al", str(code_template / part), str(templates)], check=True)
    # Only code-interpreter is this server's (the shared store also holds base).
    shutil.copy2(code_template / "index/code-interpreter.json", templates / "index")
    return templates


@pytest.fixture
def private(tmp_path: Path, code_template: Path) -> Iterator[tuple[ServerHandle, Path]]:
    tmp_path.chmod(0o700)
    handle = start_server(tmp_path)  # starts with no template: made below, then restarted
    handle.stop()
    templates = _private_copy(code_template, handle.data_dir)
    handle.start()
    yield handle, templates
    handle.kill_all_sandboxes()
    handle.stop()


def test_a_template_in_the_private_data_dir_starts_sandboxes(
    private: tuple[ServerHandle, Path],
) -> None:
    srv, _ = private
    health = httpx.get(f"{srv.url}/v1/health").json()
    assert health["status"] == "ok", health
    assert health["templates"] == {"host": "ok", "code-interpreter": "ok"}, health
    key = srv.make_key("checks")
    with srv.client(key) as c:
        assert c.get("/v1/templates/code-interpreter").json()["check"]["status"] == "ok"
        r = c.post("/v1/sandboxes", json={"template": "code-interpreter", "timeout": 60})
        assert r.status_code == 201, r.text
        sid = r.json()["sandbox_id"]
        ctx = c.post(f"/v1/sandboxes/{sid}/code/contexts", json={"language": "python"})
        assert ctx.status_code in (200, 201), ctx.text
        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204


def _restarted_without_python(
    private: tuple[ServerHandle, Path], monkeypatch: pytest.MonkeyPatch, agent_start: str
) -> tuple[ServerHandle, dict]:
    """The server again, its agents started `agent_start`, its copy of the code template
    broken (its python gone; the shared tree keeps its own link); its health."""
    srv, templates = private
    srv.stop()
    entry = json.loads((templates / "index/code-interpreter.json").read_text())
    rootfs = templates / "rootfs" / entry["rootfs_key"]
    (rootfs / "usr" / "bin" / "python3").unlink()
    monkeypatch.setenv("AGENTBOX_AGENT_START", agent_start)
    srv.start()
    health = httpx.get(f"{srv.url}/v1/health").json()
    assert health["templates"] == {"host": "ok", "code-interpreter": "failed"}, health
    return srv, health


def test_a_template_that_cannot_start_is_named_at_start_up(
    private: tuple[ServerHandle, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # An agent bwrap runs is the template's python's: without it, no sandbox starts. (One the
    # zygote forks, the default, is the host's: see the next test.)
    srv, health = _restarted_without_python(private, monkeypatch, "exec")
    assert health["status"] == "degraded", health
    key = srv.make_key("checks")
    with srv.client(key) as c:
        check = c.get("/v1/templates/code-interpreter").json()["check"]
        assert check["status"] == "failed" and "agent did not start" in check["error"], check
        # A create fails the same way, with the same reason.
        r = c.post("/v1/sandboxes", json={"template": "code-interpreter", "timeout": 60})
        assert r.status_code == 503 and "agent did not start" in r.json()["message"], r.text
        # The host userland still works.
        r = c.post("/v1/sandboxes", json={"timeout": 60})
        assert r.status_code == 201, r.text
    assert srv.log_path is not None
    log = srv.log_path.read_text()
    assert "template code-interpreter cannot start a sandbox" in log, log[-2000:]


def test_a_forked_agent_names_the_missing_python_of_a_code_template(
    private: tuple[ServerHandle, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent forked from the zygote (the default) is the host's Python and starts without
    the template's; the code interpreter, started with each sandbox of a code template, is the
    template's own: the check names it, and the sandbox's path (nothing of the host's)."""
    srv, _ = _restarted_without_python(private, monkeypatch, "fork")
    with srv.client(srv.make_key("checks")) as c:
        check = c.get("/v1/templates/code-interpreter").json()["check"]
        assert check["status"] == "failed", check
        assert "the code interpreter did not start" in check["error"], check
        assert "/usr/bin/python3" in check["error"], check
        assert str(srv.data_dir) not in check["error"] and ".venv" not in check["error"], check
        r = c.post("/v1/sandboxes", json={"timeout": 60})  # the host userland still works
        assert r.status_code == 201, r.text


# ---------------------------------------------------------------- first-use builds: `building`


@pytest.fixture
def unbuilt(tmp_path: Path, code_template: Path) -> Iterator[tuple[ServerHandle, Path]]:
    """A server whose code-interpreter is not built, but whose build cache has every layer (a
    first-use build takes seconds: only the final tree is made)."""
    handle = start_server(tmp_path)
    handle.stop()
    templates = handle.data_dir / "templates"
    for part in ("layers", "cache"):
        shutil.rmtree(templates / part, ignore_errors=True)
        subprocess.run(["cp", "-al", str(code_template / part), str(templates)], check=True)
    handle.start()
    yield handle, templates
    subprocess.run(["chattr", "-i", str(templates / "rootfs")], check=False)
    handle.kill_all_sandboxes()
    handle.stop()


def _wait(c: httpx.Client, sid: str, states: set[str], within: float) -> dict:
    deadline = time.monotonic() + within
    while True:
        info = c.get(f"/v1/sandboxes/{sid}").json()
        if info["state"] in states or time.monotonic() > deadline:
            return info
        time.sleep(0.2)


def test_a_first_use_build_answers_building_and_a_kill_ends_it(
    unbuilt: tuple[ServerHandle, Path],
) -> None:
    srv, _ = unbuilt
    with srv.client(srv.make_key("builds")) as c:
        r = c.post("/v1/sandboxes", json={"template": "code-interpreter", "timeout": 60})
        assert r.status_code == 202, r.text
        first = r.json()
        assert first["state"] == "building" and first["build"]["template"] == "code-interpreter"
        r = c.post("/v1/sandboxes", json={"template": "code-interpreter", "timeout": 60})
        assert r.status_code == 202, r.text
        second = r.json()["sandbox_id"]
        # Killed while it waits: it ends now, and the build still serves the other one.
        assert c.delete(f"/v1/sandboxes/{first['sandbox_id']}").status_code == 204
        assert c.get(f"/v1/sandboxes/{first['sandbox_id']}").json()["state"] == "killed"
        info = _wait(c, second, {"running", "failed"}, within=120)
        assert info["state"] == "running" and info["build"] is None, info
        assert c.get(f"/v1/sandboxes/{first['sandbox_id']}").json()["state"] == "killed"
        live = c.get("/v1/sandboxes", params={"state": "running"}).json()["sandboxes"]
        assert [s["sandbox_id"] for s in live] == [second]


def test_a_first_use_build_that_fails_says_why(unbuilt: tuple[ServerHandle, Path]) -> None:
    srv, templates = unbuilt
    # No tree can be made where built templates go: the build's last step fails.
    subprocess.run(["chattr", "+i", str(templates / "rootfs")], check=True)
    from agentbox import Sandbox
    from agentbox.sdk.exceptions import AgentboxError

    key = srv.make_key("builds")
    with pytest.raises(AgentboxError) as e:
        Sandbox.create(template="code-interpreter", api_key=key, api_url=srv.url)
    assert e.value.code == "build_failed", e.value
    assert "template code-interpreter could not be built" in e.value.message, e.value
    with srv.client(key) as c:
        (row,) = c.get("/v1/sandboxes", params={"state": "failed"}).json()["sandboxes"]
        assert row["end_reason"] == "build_failed" and "could not be built" in row["error"]
