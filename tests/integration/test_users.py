"""Users in a sandbox: commands run as `user` (uid 1000) or, per command, as the sandbox's own
`root`, whose capabilities stop at its user namespace; `sudo` asks the agent; file operations
are `user`'s; every sandbox maps its own block of host ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ServerHandle

from agentbox import Sandbox
from agentbox.runtimes.process.userns import ROOT_CAP_MASK
from agentbox.sdk import AgentboxError, CommandExitException, InvalidArgumentError


def _state(server: ServerHandle, sid: str) -> dict[str, Any]:
    return json.loads((server.data_dir / "sandboxes" / sid / "runtime.json").read_text())


def _caps(sbx: Sandbox, user: str | None = None) -> dict[str, int]:
    out = sbx.commands.run("grep ^Cap /proc/self/status", user=user).stdout
    return {k: int(v, 16) for k, v in (ln.split(":\t") for ln in out.splitlines())}


def test_commands_run_as_user_by_default_and_as_root_on_request(sbx: Sandbox) -> None:
    assert sbx.commands.run("id -un; id -u; echo $HOME $USER").stdout.split() == [
        "user",
        "1000",
        "/workspace",
        "user",
    ]
    assert sbx.commands.run("id -un; id -u; echo $HOME $USER", user="root").stdout.split() == [
        "root",
        "0",
        "/root",
        "root",
    ]
    user, root = _caps(sbx), _caps(sbx, "root")
    assert user["CapEff"] == user["CapPrm"] == user["CapInh"] == user["CapAmb"] == 0, user
    assert root["CapEff"] == root["CapPrm"] == ROOT_CAP_MASK, root
    assert root["CapAmb"] == root["CapInh"] == 0, root
    # A user command cannot become root on its own.
    r = sbx.commands.run("python3 -c 'import os; os.setuid(0)' 2>&1; echo rc=$?")
    assert "PermissionError" in r.stdout and "rc=1" in r.stdout, r
    # Who ran a command shows in its info.
    handle = sbx.commands.run("sleep 0.1", background=True, user="root")
    handle.wait()
    assert sbx.commands.get_info(handle.cmd_id).user == "root"


def test_unknown_user_is_refused_with_a_reason(
    server: ServerHandle, conn: dict[str, Any], sbx: Sandbox
) -> None:
    with pytest.raises(InvalidArgumentError):
        sbx.commands.run("true", user="nobody")
    with server.client(conn["api_key"]) as c:
        r = c.post(
            f"/v1/sandboxes/{sbx.sandbox_id}/commands", json={"cmd": "true", "user": "admin"}
        )
    assert r.status_code in (400, 422), r.text
    assert "user" in r.text


def test_root_administers_its_own_files_and_processes(sbx: Sandbox) -> None:
    sbx.commands.run("echo mine > /workspace/f; sleep 300 & echo $! > /tmp/pid")
    r = sbx.commands.run(
        "chown root:root /workspace/f && chmod 600 /workspace/f && stat -c '%U %a' /workspace/f"
        " && kill $(cat /tmp/pid) && echo killed",
        user="root",
    )
    assert r.stdout.split() == ["root", "600", "killed"], r
    # Now `user` may not read it, and the files API acts as `user` too.
    r = sbx.commands.run("cat /workspace/f 2>&1; echo rc=$?")
    assert "Permission denied" in r.stdout and "rc=1" in r.stdout
    with pytest.raises(Exception) as e:
        sbx.files.read("/workspace/f")
    assert "denied" in str(e.value).lower() or "permission" in str(e.value).lower()


def test_files_api_writes_as_user(sbx: Sandbox) -> None:
    sbx.files.write("/workspace/made/by/api.txt", "x")
    sbx.files.write("/tmp/api.txt", "y")
    r = sbx.commands.run("stat -c '%U:%G' /workspace/made /workspace/made/by/api.txt /tmp/api.txt")
    assert r.stdout.split() == ["user:user"] * 3, r


def test_sudo_asks_the_agent(sbx: Sandbox) -> None:
    r = sbx.commands.run(
        "which sudo; sudo id -u; sudo -u user id -u; sudo -i whoami; echo $(sudo -n true; echo $?);"
        " echo piped | sudo cat; sudo FOO=bar sh -c 'echo $FOO $HOME $SUDO_USER'"
    )
    assert r.stdout.splitlines() == [
        "/.agentbox/bin/sudo",
        "0",
        "1000",
        "root",
        "0",
        "piped",
        "bar /root user",
    ], r
    # Exit codes and failures come back; the caller's cwd is kept.
    r = sbx.commands.run("cd /tmp; sudo sh -c 'pwd; exit 7'; echo rc=$?; sudo no-such-cmd; true")
    assert "/tmp\nrc=7\n" in r.stdout, r
    assert "no-such-cmd: command not found" in r.stderr, r
    # root can write where user cannot.
    r = sbx.commands.run(
        "sudo mkdir -m 700 /workspace/rootonly && sudo touch /workspace/rootonly/made && "
        "sudo ls /workspace/rootonly; ls /workspace/rootonly 2>&1 || true"
    )
    assert "made" in r.stdout and "Permission denied" in r.stdout, r
    with pytest.raises(CommandExitException):
        sbx.commands.run("sudo --bogus-option true")


def test_sudo_command_dies_with_its_caller(sbx: Sandbox) -> None:
    r = sbx.commands.run("timeout -s TERM 1 sudo sleep 77; echo rc=$?", timeout=30)
    assert "rc=124" in r.stdout, r
    left = sbx.commands.run("sleep 0.3; ps -eo user,args", user="root").stdout
    assert "sleep 77" not in left, left
    # A command killed through the API takes its sudo'd children with it.
    handle = sbx.commands.run("sudo sleep 78", background=True)
    sbx.commands.run("sleep 0.5")
    sbx.commands.kill(handle.cmd_id)
    left = sbx.commands.run("sleep 0.3; ps -eo args", user="root").stdout
    assert "sleep 78" not in left, left


def test_each_sandbox_maps_its_own_block(server: ServerHandle, conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as a, Sandbox.create(**conn) as b:
        ranges = []
        for s in (a, b):
            state = _state(server, s.sandbox_id)
            base, count = state["range"]
            assert count == 65536 and base % 65536 == 0
            inside = s.commands.run("cat /proc/self/uid_map /proc/self/gid_map").stdout.split()
            assert inside == ["0", str(base), "65536"] * 2
            host = Path(f"/proc/{state['init_pid']}/uid_map").read_text().split()
            assert host == ["0", str(base), "65536"]
            ranges.append(base)
            # No user namespace can be made inside, even by root.
            r = s.commands.run("cat /proc/sys/user/max_user_namespaces", user="root")
            assert r.stdout.strip() == "0"
            r = s.commands.run(
                "echo 5 > /proc/sys/user/max_user_namespaces 2>&1; echo rc=$?", user="root"
            )
            assert "rc=0" not in r.stdout
        assert abs(ranges[0] - ranges[1]) >= 65536


def test_command_user_in_http_api(server: ServerHandle, conn: dict[str, Any], sbx: Sandbox) -> None:
    with server.client(conn["api_key"]) as c:
        r = c.post(
            f"/v1/sandboxes/{sbx.sandbox_id}/commands",
            json={"cmd": "id -u", "user": "root", "background": True},
        )
        assert r.status_code == 201, r.text
        assert r.json()["user"] == "root"
        with httpx.Client(base_url=server.url) as anon:
            assert anon.get(f"/v1/sandboxes/{sbx.sandbox_id}/commands").status_code == 401


def test_file_operations_as_root_or_user(conn: dict[str, Any], sbx: Sandbox) -> None:
    """Files take `user` as on E2B: whose permissions apply and who owns what is made."""
    sbx.files.write("/workspace/secret", "root's", user="root")
    sbx.commands.run("chmod 600 /workspace/secret", user="root")
    sbx.files.make_dir("/workspace/rdir/sub", user="root")
    r = sbx.commands.run("stat -c '%U %a' /workspace/secret /workspace/rdir/sub")
    assert r.stdout.split("\n")[:2] == ["root 600", "root 755"], r
    with pytest.raises(AgentboxError) as e:
        sbx.files.read("/workspace/secret")
    assert e.value.code == "permission_denied", e.value
    assert sbx.files.read("/workspace/secret", user="root") == "root's"
    assert sbx.files.get_info("/workspace/secret", user="root").size == 6
    assert [e.name for e in sbx.files.list("/workspace/rdir", user="root")] == ["sub"]
    with pytest.raises(AgentboxError) as e:
        sbx.files.write("/workspace/rdir/sub/mine", "x")  # user may not write there
    assert e.value.code == "permission_denied", e.value
    sbx.files.write_files([{"path": "/workspace/rdir/sub/a", "data": "1"}], user="root")
    sbx.files.rename("/workspace/rdir/sub/a", "/workspace/rdir/sub/b", user="root")
    sbx.files.remove("/workspace/rdir", user="root")
    assert not sbx.files.exists("/workspace/rdir", user="root")
    with pytest.raises(InvalidArgumentError):
        sbx.files.read("/workspace/secret", user="admin")
