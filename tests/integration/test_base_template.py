"""The shipped default template, `base`: a minimal Debian that `agentbox setup` builds with its
progress (and `serve` at start-up when it is missing), that a create naming no template gets,
and in which an agent's first instincts work (sudo apt-get, pip, venv, git, curl). The host's
userland stays available as `host`.

No network: the store is seeded with this run's cached layers and downloads (conftest), so a
build only makes the final tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ServerHandle, make_deb, make_wheel, seed_template_store, start_server

from agentbox import Sandbox


def _setup(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentbox.cli.app", "setup", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if not k.startswith("AGENTBOX_")} | (env or {}),
    )


@pytest.fixture(scope="module")
def base_server(
    tmp_path_factory: pytest.TempPathFactory, base_template: Path
) -> Iterator[ServerHandle]:
    """A server whose default is `base`, not built in its store when it starts."""
    tmp = tmp_path_factory.mktemp("base")
    store = tmp / "templates"
    seed_template_store(store)
    handle = start_server(tmp, ["--template-dir", str(store), "--default-template", "base"])
    yield handle
    handle.kill_all_sandboxes()
    handle.stop()


def _health_until(url: str, done: set[str], within: float = 300) -> list[dict]:
    seen = []
    deadline = time.monotonic() + within
    while True:
        health = httpx.get(f"{url}/v1/health").json()
        seen.append(health)
        if health["templates"].get("base") in done:
            return seen
        assert time.monotonic() < deadline, seen[-1]
        time.sleep(0.2)


def test_serve_builds_a_missing_default_at_start_up(base_server: ServerHandle) -> None:
    seen = _health_until(base_server.url, {"ok", "failed"})
    assert seen[0]["default_template"] == "base", seen[0]
    # Started at once, building in the background; then checked like every template.
    assert seen[0]["templates"]["host"] == "ok", seen[0]
    assert seen[-1]["templates"] == {"host": "ok", "base": "ok"}, seen[-1]
    assert seen[-1]["status"] == "ok", seen[-1]
    assert base_server.log_path is not None
    log = base_server.log_path.read_text()
    assert "the default template base is not built: building it now" in log, log[-3000:]
    assert "the default template base is ready" in log, log[-3000:]


@pytest.fixture(scope="module")
def box(base_server: ServerHandle) -> Iterator[Sandbox]:
    key = base_server.make_key("base-box")
    s = Sandbox.create(api_url=base_server.url, api_key=key, timeout=600)  # names no template
    yield s
    s.kill()
    s.close()


def test_a_create_naming_no_template_gets_base(box: Sandbox) -> None:
    assert box.get_info().template == "base"
    r = box.commands.run(
        ". /etc/os-release; echo $VERSION_CODENAME; id -un; sudo id -un; pwd; "
        "for t in bash git curl python3 pip ps; do command -v $t; done"
    )
    assert r.stdout.splitlines() == [
        "bookworm",
        "user",
        "root",
        "/workspace",
        "/usr/bin/bash",
        "/usr/bin/git",
        "/usr/bin/curl",
        "/opt/venv/bin/python3",
        "/opt/venv/bin/pip",
        "/usr/bin/ps",
    ], r
    r = box.commands.run("git init -q /tmp/repo && git -C /tmp/repo status --short && echo ok")
    assert r.stdout.strip() == "ok", r


def test_the_login_profile_gives_each_user_debians_path_without_asking_id(box: Sandbox) -> None:
    # /etc/profile reads bash's $EUID where Debian's runs `id -u` (a fork and an exec in
    # every command); a shell without EUID (dash) still asks `id`: the same PATH either way.
    user_path = "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
    root_path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    r = box.commands.run(
        "grep -c 'EUID:-' /etc/profile; "
        "for who in '' sudo; do for sh in bash sh; do "
        "$who env -i HOME=/nonexistent $sh -l -c 'echo $PATH'; done; done"
    )
    assert r.stdout.splitlines() == ["2", user_path, user_path, root_path, root_path], r


def test_sudo_apt_get_installs_a_package(box: Sandbox, tmp_path: Path) -> None:
    deb = make_deb(tmp_path, "abxbase")
    box.files.write(f"/workspace/{deb.name}", deb.read_bytes())
    r = box.commands.run(
        f"sudo apt-get install -y -q ./{deb.name} >/dev/null 2>&1; echo $?; abxbase; "
        "dpkg-query -W -f '${Status}\\n' abxbase",
        timeout=120,
    )
    assert r.stdout.splitlines() == ["0", "abxbase works", "install ok installed"], r


def test_pip_and_venv_work_for_user_without_flags(box: Sandbox) -> None:
    name, data = make_wheel("abxbasepip")
    box.files.write(f"/workspace/{name}", data)
    r = box.commands.run(
        f"pip install --no-index /workspace/{name} 2>&1 | tail -1; abxbasepip-cli; "
        f"python3 -m venv /tmp/v && /tmp/v/bin/pip install -q --no-index /workspace/{name} && "
        "/tmp/v/bin/python -c 'import abxbasepip, sys; print(sys.prefix)'",
        timeout=120,
    )
    lines = r.stdout.splitlines()
    assert "Successfully installed abxbasepip-1.0" in lines[0], r
    assert lines[1:] == ["abxbasepip cli ok", "/tmp/v"], r


def test_default_names_the_default_and_host_the_host_userland(base_server: ServerHandle) -> None:
    key = base_server.make_key("base-names")
    with base_server.client(key) as c:
        made = {}
        for name in ("default", "host"):
            r = c.post("/v1/sandboxes", json={"template": name, "timeout": 60})
            assert r.status_code == 201, r.text
            made[name] = r.json()
        assert made["default"]["template"] == "base"
        assert made["host"]["template"] == "host"
        for info in made.values():
            assert c.delete(f"/v1/sandboxes/{info['sandbox_id']}").status_code == 204
        r = c.post("/v1/sandboxes", json={"template": "nosuch", "timeout": 60})
        assert r.status_code == 404 and "built: host, base" in r.json()["message"], r.text


def test_a_default_that_cannot_be_built_says_why_and_is_tried_again(
    tmp_path: Path, base_template: Path
) -> None:
    store = tmp_path / "templates"
    seed_template_store(store)
    # No tree can be made where built templates go (as without a mirror: the build fails).
    (store / "rootfs").mkdir(mode=0o755)
    subprocess.run(["chattr", "+i", str(store / "rootfs")], check=True)
    srv = start_server(tmp_path, ["--template-dir", str(store), "--default-template", "base"])
    try:
        seen = _health_until(srv.url, {"ok", "failed"})
        assert seen[-1]["templates"]["base"] == "failed", seen[-1]
        assert seen[-1]["status"] == "degraded", seen[-1]
        assert srv.log_path is not None
        log = srv.log_path.read_text()
        assert "the default template base is not usable" in log, log[-3000:]
        assert "`agentbox setup` builds it with its log, or name template 'host'" in log, log
        key = srv.make_key("base-fails")
        with srv.client(key) as c:
            r = c.post("/v1/sandboxes", json={"template": "host", "timeout": 60})
            assert r.status_code == 201, r.text  # the host's userland needs no build
            subprocess.run(["chattr", "-i", str(store / "rootfs")], check=True)
            # The next create that names no template builds it again, and it works.
            r = c.post("/v1/sandboxes", json={"timeout": 60})
            assert r.status_code == 202 and r.json()["state"] == "building", r.text
            sid = r.json()["sandbox_id"]
            deadline = time.monotonic() + 120
            waiting = ("building", "starting")
            while (info := c.get(f"/v1/sandboxes/{sid}").json())["state"] in waiting:
                assert time.monotonic() < deadline, info
                time.sleep(0.2)
            assert info["state"] == "running" and info["template"] == "base", info
        health = httpx.get(f"{srv.url}/v1/health").json()
        assert "base" not in health["templates"] and health["status"] == "ok", health
    finally:
        subprocess.run(["chattr", "-i", str(store / "rootfs")], check=False)
        srv.kill_all_sandboxes()
        srv.stop()


# ------------------------------------------------------------------------------ agentbox setup


def test_setup_builds_the_default_with_its_progress(tmp_path: Path, base_template: Path) -> None:
    store = tmp_path / "store"
    seed_template_store(store)
    data = tmp_path / "data"
    r = _setup("--data-dir", str(data), "--template-dir", str(store))
    assert r.returncode == 0, r.stderr
    # Not on a terminal: a line per step (the layers came from the cache, the tree is made).
    steps = [line for line in r.stderr.splitlines() if line.startswith("base: [")]
    assert steps == [
        "base: [1/5] base: cached",
        "base: [2/5] apt: cached",
        "base: [3/5] pip: nothing to do",
        "base: [4/5] files: nothing to do",
        "base: [5/5] finalize: building",
    ], r.stderr
    assert r.stdout.startswith("template base is ready ("), r.stdout
    entry = json.loads((store / "index/base.json").read_text())
    assert (store / "rootfs" / entry["rootfs_key"] / "opt/venv/bin/pip").exists()
    assert data.stat().st_mode & 0o777 == 0o700
    # Again: nothing to do. AGENTBOX_DEFAULT_TEMPLATE=host: nothing to build at all.
    again = _setup("--data-dir", str(data), "--template-dir", str(store))
    assert again.returncode == 0 and "base: [5/5] finalize: cached" in again.stderr, again
    host = _setup("--data-dir", str(data), env={"AGENTBOX_DEFAULT_TEMPLATE": "host"})
    assert host.returncode == 0 and "nothing to build" in host.stderr, host
    assert not (data / "templates").exists()


def test_setup_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    r = _setup("--data-dir", str(tmp_path / "d"), "--template", "nosuch")
    assert r.returncode == 2 and "'nosuch' is not a shipped template" in r.stderr, r.stderr
    assert "base" in r.stderr and "code-interpreter" in r.stderr, r.stderr
    # A server holds the data dir: its builds go through it (it knows what sandboxes use).
    srv = start_server(tmp_path)
    try:
        r = _setup("--data-dir", str(srv.data_dir))
        assert r.returncode == 1 and "a server is running on" in r.stderr, r.stderr
    finally:
        srv.stop()
