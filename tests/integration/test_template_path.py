"""A PATH given by a template, a sandbox or a command is the PATH commands see. Commands run as
`bash -l -c`, whose /etc/profile (Debian's) set PATH outright: a template that installed tools
in /opt/x/bin and put it on PATH had them found by code contexts but not by commands."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator

import pytest
from conftest import ServerHandle, create_sandbox, run, seed_template_store, start_server

from agentbox.templates import TemplateStore, load_spec

TOOL = "#!/bin/sh\\necho found xtool\\n"
SPEC = f"""
name = "opt-tools"
[base]
suite = "bookworm"
variant = "apt"
[[files]]
dest = "/opt/x/bin/xtool"
content = "{TOOL}"
mode = "0755"
[env]
PATH = "/opt/x/bin:/usr/local/bin:/usr/bin:/bin"
"""


def _code_path(client, sid: str) -> str:
    r = client.post(
        f"/v1/sandboxes/{sid}/code/execute",
        json={"code": "echo $PATH; xtool", "language": "bash"},
    )
    assert r.status_code == 200, r.text
    events = [json.loads(line) for line in r.text.splitlines() if line]
    return "".join(e["text"] for e in events if e["type"] == "stdout")


def test_sandbox_and_command_path_come_first(server: ServerHandle, tenant_key: str) -> None:
    with server.client(tenant_key) as c:
        sid = create_sandbox(c, envs={"PATH": "/workspace/bin:/usr/bin:/bin"})["sandbox_id"]
        try:
            made = run(c, sid, "mkdir -p bin && printf '#!/bin/sh\\necho mine\\n' > bin/mytool")
            assert made.exit_code == 0, made
            run(c, sid, "chmod +x bin/mytool")
            res = run(c, sid, "echo $PATH; mytool")
            assert res.stdout.splitlines()[0].startswith("/workspace/bin:/usr/bin:/bin"), res
            assert res.stdout.splitlines()[1] == "mine", res
            res = run(c, sid, "echo $PATH", envs={"PATH": "/cmd/bin:/usr/bin:/bin"})
            assert res.stdout.startswith("/cmd/bin:/usr/bin:/bin"), res
            # The login scripts' own directories stay, after the given ones, once each.
            dirs = run(c, sid, "echo $PATH").stdout.strip().split(":")
            assert "/usr/local/bin" in dirs and len(dirs) == len(set(dirs)), dirs
            # Not passed on: a script the command runs keeps the PATH it is given.
            res = run(c, sid, "PATH=/only:$PATH bash -c 'echo $PATH; echo ${BASH_ENV-unset}'")
            assert res.stdout.splitlines() == [
                "/only:" + ":".join(dirs),
                "unset",
            ], res
        finally:
            c.delete(f"/v1/sandboxes/{sid}")


def test_a_bash_env_of_the_callers_own_still_runs(server: ServerHandle, tenant_key: str) -> None:
    with server.client(tenant_key) as c:
        sid = create_sandbox(c)["sandbox_id"]
        try:
            run(c, sid, "echo 'GREETING=from-bash-env' > /workspace/env.sh")
            res = run(c, sid, "echo $GREETING $BASH_ENV", envs={"BASH_ENV": "/workspace/env.sh"})
            assert res.stdout == "from-bash-env /workspace/env.sh\n", res
        finally:
            c.delete(f"/v1/sandboxes/{sid}")


# ------------------------------------------------------------------------ a real template


@pytest.fixture(scope="module")
def opt_tools_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    if os.geteuid() != 0 or not shutil.which("mmdebstrap"):
        pytest.skip("template builds need root and mmdebstrap")
    tmp = tmp_path_factory.mktemp("opt-tools")
    seed_template_store(tmp / "store")
    TemplateStore(tmp / "store").build(load_spec(SPEC), lambda e: None)
    handle = start_server(tmp, ["--template-dir", str(tmp / "store")])
    yield handle
    handle.kill_all_sandboxes()
    handle.stop()


def test_a_templates_path_reaches_commands_and_code(opt_tools_server: ServerHandle) -> None:
    with opt_tools_server.client() as c:
        sid = create_sandbox(c, template="opt-tools")["sandbox_id"]
        try:
            res = run(c, sid, "echo $PATH; xtool")
            lines = res.stdout.splitlines()
            assert lines[0].startswith("/opt/x/bin:/usr/local/bin:/usr/bin:/bin"), res
            assert lines[1] == "found xtool" and res.exit_code == 0, res
            code = _code_path(c, sid).splitlines()
            assert code[0].startswith("/opt/x/bin:") and code[1] == "found xtool", code
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
