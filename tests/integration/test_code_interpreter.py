"""The code interpreter end to end: a real server, code-interpreter sandboxes (built from the
shipped template), real Jupyter kernels, bash and node contexts, through the SDK."""

from __future__ import annotations

import base64
import time

import httpx
import pytest

from agentbox.sdk import ConflictError, InvalidArgumentError, NotFoundError, Sandbox

pytestmark = pytest.mark.slow  # needs the code-interpreter template (built once per machine)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def key(ci_server) -> str:
    return ci_server.make_key(f"code-{time.monotonic_ns() % 10**8}")


@pytest.fixture(scope="module")
def sbx(ci_server, key):
    s = Sandbox.create(template="code-interpreter", api_url=ci_server.url, api_key=key, timeout=600)
    yield s
    s.kill()
    s.close()


def test_state_persists_between_calls(sbx):
    first = sbx.run_code("x = 6*7\nprint(x)")
    assert "".join(first.logs.stdout) == "42\n"  # ipykernel may send it in two chunks
    assert first.error is None
    second = sbx.run_code("x + 1")
    assert second.text == "43"
    assert second.execution_count == first.execution_count + 1


def test_contexts_are_isolated(sbx):
    sbx.run_code("shared = 'default context'")
    ctx = sbx.create_code_context(language="python")
    assert ctx.language == "python"
    missing = sbx.run_code("shared", context=ctx)
    assert missing.error is not None and missing.error.name == "NameError"
    sbx.run_code("shared = 'own'", context=ctx)
    assert sbx.run_code("shared").text == "'default context'"
    assert ctx.id in {c.id for c in sbx.list_code_contexts()}
    sbx.remove_code_context(ctx)
    assert ctx.id not in {c.id for c in sbx.list_code_contexts()}
    with pytest.raises(NotFoundError):
        sbx.run_code("1", context=ctx)


def test_rich_results(sbx):
    plot = sbx.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.title('t')\n"
        "plt.show()"
    )
    pngs = [r.png for r in plot.results if r.png]
    assert pngs, plot
    assert base64.b64decode(pngs[0]).startswith(PNG_SIGNATURE)
    html = sbx.run_code(
        "from IPython.display import HTML, Markdown, display\n"
        "display(HTML('<b>bold</b>'))\ndisplay(Markdown('# title'))"
    )
    assert any(r.html == "<b>bold</b>" for r in html.results)
    assert any(r.markdown == "# title" for r in html.results)
    assert all(not r.is_main_result for r in html.results)
    frame = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
    main = [r for r in frame.results if r.is_main_result]
    assert main and main[0].html and "<table" in main[0].html and main[0].text


def test_error_carries_traceback(sbx):
    ex = sbx.run_code("def f():\n    return 1 / 0\nf()")
    assert ex.error is not None
    assert ex.error.name == "ZeroDivisionError"
    assert "division by zero" in ex.error.value
    assert "f()" in ex.error.traceback


def test_callbacks_stream_as_output_appears(sbx):
    seen: list[tuple[float, str]] = []
    t0 = time.monotonic()
    ex = sbx.run_code(
        "import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.4)",
        on_stdout=lambda m: seen.append((time.monotonic() - t0, m.line)),
    )
    total = time.monotonic() - t0
    assert "".join(line for _, line in seen) == "0\n1\n2\n"
    assert seen[0][0] < total - 0.5, (seen, total)  # the first line came before the end
    assert ex.logs.stdout


def test_timeout_interrupts_and_keeps_the_context(sbx):
    t0 = time.monotonic()
    ex = sbx.run_code("import time\nkept = 5\ntime.sleep(60)", timeout=2)
    assert time.monotonic() - t0 < 20
    assert ex.timed_out
    assert ex.error is not None
    assert sbx.run_code("kept").text == "5"


def test_kernel_death_and_restart(sbx):
    ctx = sbx.create_code_context()
    sbx.run_code("before = 1", context=ctx)
    died = None
    try:
        died = sbx.run_code("import os\nos._exit(1)", context=ctx)
    except ConflictError as e:
        assert e.code == "kernel_dead"
    if died is not None:
        assert died.error is not None and "ied" in died.error.name + died.error.value
    with pytest.raises(ConflictError) as info:
        sbx.run_code("1", context=ctx)
    assert info.value.code == "kernel_dead"
    restarted = sbx.restart_code_context(ctx)
    assert restarted.id == ctx.id
    assert sbx.run_code("1 + 1", context=ctx).text == "2"
    assert sbx.run_code("before", context=ctx).error.name == "NameError"


def test_bash_context_keeps_cwd_and_variables(sbx):
    sbx.run_code("cd /tmp && FOO=bar", language="bash")
    ex = sbx.run_code("echo $PWD $FOO", language="bash")
    assert ex.logs.stdout and "".join(ex.logs.stdout).strip() == "/tmp bar"
    failed = sbx.run_code("ls /nonexistent", language="bash")
    assert failed.error is not None


def test_javascript_context_keeps_state(sbx):
    sbx.run_code("let a = 2; function twice(n) { return n * 2 }", language="javascript")
    ex = sbx.run_code("console.log(twice(a) * 10 + 2)", language="javascript")
    assert "".join(ex.logs.stdout).strip() == "42"
    err = sbx.run_code("throw new TypeError('nope')", language="javascript")
    assert err.error is not None and "nope" in err.error.value


@pytest.fixture(scope="module")
def full(ci_server, key, full_template):
    s = Sandbox.create(
        template="code-interpreter-full", api_url=ci_server.url, api_key=key, timeout=600
    )
    yield s
    s.kill()
    s.close()


def test_typescript_kernel(full):
    """Deno's Jupyter kernel: types, state, top-level await, node: imports, errors, envs for
    one cell, and a timeout that interrupts it by a control message (SIGINT would end Deno)
    and keeps its state."""
    full.run_code("const base: number = 40; let kept = 'still here'", language="typescript")
    ex = full.run_code("await Promise.resolve(base + 2)", language="typescript")
    assert ex.text == "42" and ex.results[0].is_main_result, ex
    ex = full.run_code("import { join } from 'node:path'; join('a', 'b')", language="typescript")
    assert ex.text == '"a/b"', ex
    ex = full.run_code("console.log('out'); console.error('err')", language="typescript")
    assert ex.logs.stdout == ["out\n"] and ex.logs.stderr == ["err\n"], ex.logs
    err = full.run_code("throw new RangeError('far')", language="typescript")
    assert err.error and err.error.name == "RangeError" and err.error.value == "far", err
    code = "Deno.env.get('ONCE') ?? 'unset'"
    assert full.run_code(code, language="typescript", envs={"ONCE": "yes"}).text == '"yes"'
    assert full.run_code(code, language="typescript").text == '"unset"'
    t0 = time.monotonic()
    ex = full.run_code("while (true) {}", language="typescript", timeout=2)
    assert ex.timed_out and time.monotonic() - t0 < 10, ex
    assert full.run_code("kept", language="typescript").text == '"still here"'


def test_r_kernel(full):
    """IRkernel: state, output, rich results, errors, envs for one cell, a timeout that
    interrupts (SIGINT) and keeps the state, and its own context."""
    full.run_code("kept <- 'still here'; x <- 1:3", language="r")
    ex = full.run_code("cat('sum is', sum(x), '\\n')\nx * 2", language="r")
    assert ex.logs.stdout == ["sum is 6 \n"], ex.logs
    assert ex.results and ex.results[0].text == "[1] 2 4 6" and ex.results[0].html, ex
    err = full.run_code("stop('went wrong')", language="r")
    assert err.error and "went wrong" in err.error.value, err
    code = "Sys.getenv('ONCE', 'unset')"
    assert full.run_code(code, language="r", envs={"ONCE": "yes"}).results[0].text == '[1] "yes"'
    assert full.run_code(code, language="r").results[0].text == '[1] "unset"'
    t0 = time.monotonic()
    ex = full.run_code("while (TRUE) {}", language="r", timeout=2)
    assert ex.timed_out and time.monotonic() - t0 < 10, ex
    assert full.run_code("kept", language="r").results[0].text == '[1] "still here"'
    ctx = full.create_code_context(language="r", cwd="/tmp")
    assert full.run_code("getwd()", context=ctx).results[0].text == '[1] "/tmp"'
    assert full.run_code("exists('kept')", context=ctx).results[0].text == "[1] FALSE"


def test_kernels_missing_from_a_template_are_named(sbx):
    """code-interpreter has no R or Deno: the answer names the template that has them."""
    with pytest.raises(Exception) as info:
        sbx.run_code("1", language="r")
    assert "code-interpreter-full" in str(info.value), info.value


def test_language_and_context_together_is_refused(sbx):
    with pytest.raises(InvalidArgumentError):
        sbx.run_code("1", language="python", context="abc")
    with httpx.Client(
        base_url=sbx._transport.config.api_url, headers={"X-API-Key": sbx._transport.config.api_key}
    ) as c:
        r = c.post(
            f"/v1/sandboxes/{sbx.sandbox_id}/code/execute",
            json={"code": "1", "language": "python", "context_id": "abc"},
        )
        assert r.status_code == 400, r.text
        r = c.post(
            f"/v1/sandboxes/{sbx.sandbox_id}/code/execute", json={"code": "1", "language": "cobol"}
        )
        assert r.status_code in (400, 422), r.text


def test_template_is_read_only_and_offline(sbx):
    ex = sbx.run_code("open('/usr/lib/agentbox-probe', 'w')")
    assert ex.error is not None and ex.error.name in ("OSError", "PermissionError")
    net = sbx.run_code("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)")
    assert net.error is not None
    # The template's own /etc, not the host's.
    assert sbx.run_code("open('/etc/debian_version').read().strip()[:2]").text == "'12'"


def test_other_tenants_cannot_run_code(ci_server, sbx):
    other = ci_server.make_key(f"other-{time.monotonic_ns() % 10**8}")
    with httpx.Client(base_url=ci_server.url, headers={"X-API-Key": other}) as c:
        r = c.post(f"/v1/sandboxes/{sbx.sandbox_id}/code/execute", json={"code": "1"})
        assert r.status_code == 404
        r = c.get(f"/v1/sandboxes/{sbx.sandbox_id}/code/contexts")
        assert r.status_code == 404


def _build_events(client: httpx.Client, body: dict) -> tuple[int, list[dict]]:
    import json

    with client.stream("POST", "/v1/templates", json=body, timeout=600) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        return 200, [json.loads(line) for line in r.iter_lines() if line]


def test_template_api_build_is_a_cache_hit_and_admin_only(ci_server, key):
    with ci_server.client() as admin:
        status, events = _build_events(admin, {"builtin": "code-interpreter"})
        assert status == 200, events
        steps = [e for e in events if e["type"] == "step"]
        assert steps and all(e["cached"] for e in steps), steps
        assert events[-1]["type"] == "done"
        listed = admin.get("/v1/templates").json()
        assert "code-interpreter" in {t["name"] for t in listed["templates"]}
        assert "code-interpreter" in listed["builtin"]
        status, events = _build_events(admin, {"spec": 'name = "x"\nbogus = 1\n'})
        assert status == 400 and "bogus" in events[0]["message"], events
        status, events = _build_events(
            admin,
            {
                "spec": 'name = "x"\n[[files]]\ndest = "/etc/a"\nsrc = "../../etc/shadow"\n',
                "files": {"../../etc/shadow": "eA=="},
            },
        )
        assert status == 400, events
        # In use by the warm pool's member and by live sandboxes: refused, not yanked away.
        r = admin.delete("/v1/templates/code-interpreter")
        assert r.status_code == 409, r.text
    with ci_server.client(key) as tenant:
        status, events = _build_events(tenant, {"builtin": "code-interpreter"})
        assert status == 403, events
        assert tenant.delete("/v1/templates/code-interpreter").status_code == 403
        assert tenant.get("/v1/templates/code-interpreter").status_code == 200


def test_pool_claim_has_a_warm_kernel_and_the_callers_envs(ci_server, key):
    deadline = time.monotonic() + 120
    while True:
        with ci_server.client() as c:
            pool = next(
                p for p in c.get("/v1/pools").json()["pools"] if p["template"] == "code-interpreter"
            )
        if pool["ready"] == 1:
            break
        assert time.monotonic() < deadline, pool
        time.sleep(0.2)
    s = Sandbox.create(
        template="code-interpreter", envs={"GREETING": "hi"}, api_url=ci_server.url, api_key=key
    )
    try:
        t0 = time.monotonic()
        ex = s.run_code("import os\nos.environ['GREETING']")
        assert ex.text == "'hi'"
        assert time.monotonic() - t0 < 2  # the kernel was already running
        assert s.commands.run("echo $GREETING").stdout == "hi\n"
        with ci_server.client() as c:
            after = next(
                p for p in c.get("/v1/pools").json()["pools"] if p["template"] == "code-interpreter"
            )
        assert after["hits"] >= pool["hits"] + 1
    finally:
        s.kill()
        s.close()


def test_templates_in_a_private_dir_still_start(tmp_path, code_template):
    """The default template dir is inside the data dir, which sandbox uids cannot traverse:
    the runtime hands bwrap the root filesystem as an fd."""
    from conftest import start_server

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "store").symlink_to(code_template)
    server = start_server(tmp_path, ["--template-dir", str(private / "store")])
    try:
        s = Sandbox.create(
            template="code-interpreter", api_url=server.url, api_key=server.admin_key
        )
        try:
            assert s.run_code("6 * 7").text == "42"
        finally:
            s.kill()
            s.close()
    finally:
        server.kill_all_sandboxes()
        server.stop()
