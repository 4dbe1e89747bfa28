"""An agent's first instincts work in a built template with pip: `pip install X` as `user`
without flags (a user-owned environment at /opt/venv, first on PATH, seeing the system's
packages), console scripts on PATH, `python3 -m venv`, and `%pip install` in the running
kernel, whose new package imports at once. No network: the package is a wheel made here."""

from __future__ import annotations

import time

import pytest
from conftest import make_wheel as _wheel

from agentbox import Sandbox


@pytest.fixture(scope="module")
def box(ci_server) -> Sandbox:
    key = ci_server.make_key(f"pip-{time.monotonic_ns() % 10**8}")
    s = Sandbox.create(template="code-interpreter", api_url=ci_server.url, api_key=key, timeout=600)
    yield s
    s.kill()
    s.close()


def test_pip_install_as_user_without_flags(box: Sandbox) -> None:
    name, data = _wheel("abxpipone")
    box.files.write(f"/workspace/{name}", data)
    r = box.commands.run(
        f"id -un; which python3 pip; pip install --no-index /workspace/{name} 2>&1 | tail -1; "
        "abxpipone-cli; python3 -c 'import abxpipone; print(abxpipone.VALUE)'"
    )
    lines = r.stdout.splitlines()
    assert lines[:3] == ["user", "/opt/venv/bin/python3", "/opt/venv/bin/pip"], r
    assert "Successfully installed abxpipone-1.0" in lines[3], r
    assert lines[4:] == ["abxpipone cli ok", "from abxpipone"], r
    # The system's packages stay visible (the template's numpy), the system stays untouched.
    r = box.commands.run("python3 -c 'import numpy; print(numpy.__name__)'; ls /usr/lib/python3")
    assert r.stdout.startswith("numpy\n"), r
    r = box.commands.run("/usr/bin/python3 -c 'import abxpipone' 2>&1 | tail -1")
    assert "ModuleNotFoundError" in r.stdout, r


def test_python3_venv_works(box: Sandbox) -> None:
    name, data = _wheel("abxpiptwo")
    box.files.write(f"/workspace/{name}", data)
    r = box.commands.run(
        "python3 -m venv /workspace/.venv && /workspace/.venv/bin/pip install --no-index "
        f"/workspace/{name} 2>&1 | tail -1 && /workspace/.venv/bin/python -c "
        "'import abxpiptwo, sys; print(sys.prefix)'",
        timeout=120,
    )
    assert "Successfully installed abxpiptwo-1.0" in r.stdout, r
    assert r.stdout.strip().endswith("/workspace/.venv"), r


def test_pip_in_the_running_kernel(box: Sandbox) -> None:
    name, data = _wheel("abxpipthree")
    box.files.write(f"/workspace/{name}", data)
    before = box.run_code("import sys\nprint(sys.prefix)")
    assert "".join(before.logs.stdout) == "/opt/venv\n", before
    ex = box.run_code(f"%pip install --no-index /workspace/{name}")
    assert ex.error is None, ex
    ex = box.run_code("import abxpipthree\nprint(abxpipthree.VALUE)")
    assert ex.error is None and "".join(ex.logs.stdout) == "from abxpipthree\n", ex


def test_the_code_interpreter_has_the_usual_tools(box: Sandbox) -> None:
    r = box.commands.run(
        "python3 -c 'import numpy, pandas, matplotlib, scipy, sklearn, requests; print(\"ok\")' "
        "&& pytest --version && git --version && curl --version | head -1"
    )
    lines = r.stdout.splitlines()
    assert lines[0] == "ok" and lines[1].startswith("pytest 9."), r
    assert lines[2].startswith("git version") and lines[3].startswith("curl "), r
