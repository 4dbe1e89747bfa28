"""Run inside a virtual environment with stock `e2b` and `e2b-code-interpreter` packages from
PyPI (test_e2b.py makes one per SDK line), pointed at an agentbox server by E2B's environment
variables only:

    python e2b_interpreter_client.py SCENARIO

Like e2b_client.py: one `ok <step>` line per step passed, a non-zero exit on the first failure.
The sandbox is E2B's default for the code interpreter, `code-interpreter-v1`.
"""

from __future__ import annotations

import os
import sys
import time

import httpx
from e2b.exceptions import NotFoundException, SandboxException, TimeoutException
from e2b_code_interpreter import Sandbox


def ok(step: str) -> None:
    print(f"ok {step}", flush=True)


def cells() -> None:
    """Stateful Python cells, streamed output, rich results, errors, other languages, envs,
    and a cell the SDK times out (which interrupts it: the next cell runs at once)."""
    sbx = Sandbox.create(timeout=300)  # E2B's default template, code-interpreter-v1
    try:
        assert sbx.get_info().template_id == "code-interpreter-full", sbx.get_info()
        seen: list[str] = []
        sbx.run_code("x = 21")
        ex = sbx.run_code("print('half', x)\nx * 2", on_stdout=lambda m: seen.append(m.line))
        assert ex.text == "42" and "".join(ex.logs.stdout) == "half 21\n", ex
        assert "".join(seen) == "half 21\n" and ex.execution_count and ex.execution_count >= 2, ex
        ok("stateful")

        ex = sbx.run_code(
            "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()\n"
            "import pandas as pd\npd.DataFrame({'a': [1, 2]})"
        )
        assert ex.error is None, ex.error
        assert any(r.png for r in ex.results), ex.results
        main = [r for r in ex.results if r.is_main_result]
        assert len(main) == 1 and main[0].html and "<table" in main[0].html, ex.results
        ok("rich_results")

        ex = sbx.run_code("def f():\n    return 1/0\nf()")
        assert ex.error and ex.error.name == "ZeroDivisionError", ex.error
        assert "division by zero" in ex.error.value and "f()" in ex.error.traceback, ex.error
        ok("error")

        ex = sbx.run_code("[1, 2].map(v => v * 3).reduce((a, b) => a + b)", language="js")
        assert ex.text == "9", ex
        ex = sbx.run_code("echo hi; echo oops >&2", language="bash")
        assert ex.logs.stdout == ["hi\n"] and ex.logs.stderr == ["oops\n"], ex.logs
        ex = sbx.run_code("const n: number = 20;\nawait Promise.resolve(n + 1)", language="ts")
        assert ex.text == "21", ex
        ex = sbx.run_code("throw new TypeError('bad')", language="typescript")
        assert ex.error and ex.error.name == "TypeError" and ex.error.value == "bad", ex.error
        ex = sbx.run_code("cat('from R\\n')\nsum(1:10)", language="r")
        assert ex.logs.stdout == ["from R\n"] and ex.results[0].text == "[1] 55", ex
        ex = sbx.run_code("stop('no')", language="r")
        assert ex.error and "no" in ex.error.value, ex.error
        try:
            sbx.run_code("1", language="java")
        except SandboxException as e:
            assert "400" in str(e) and "unsupported language" in str(e), e
        else:
            raise AssertionError("a Java cell ran")
        ok("languages")

        # E2B's home: files written there are where code finds them.
        sbx.files.write("/home/user/data.csv", "a,b\n1,2\n3,4\n")
        ex = sbx.run_code("import pandas as pd\nint(pd.read_csv('/home/user/data.csv')['b'].sum())")
        assert ex.text == "6", ex
        assert sbx.commands.run("cat /home/user/data.csv").stdout.endswith("3,4\n")
        assert sbx.commands.run("pwd; cat /workspace/data.csv").stdout.startswith("/home/user\n")
        ctx = sbx.create_code_context()
        assert sbx.run_code("import os\nos.getcwd()", context=ctx).text == "'/home/user'"
        ok("home_user")

        code = "import os\nos.environ.get('ONCE')"
        assert sbx.run_code(code, envs={"ONCE": "yes"}).text == "'yes'"
        assert sbx.run_code(code).text is None  # None's repr is no result
        ok("envs")

        sbx.run_code("kept = 'still here'")
        start = time.monotonic()
        try:
            sbx.run_code("import time\nwhile True:\n    time.sleep(0.1)", timeout=2)
        except TimeoutException:
            pass
        else:
            raise AssertionError("the endless cell returned")
        ex = sbx.run_code("kept")
        assert ex.text == "'still here'", ex
        assert time.monotonic() - start < 12, time.monotonic() - start
        ok("timeout_interrupts")
    finally:
        sbx.kill()


def contexts() -> None:
    """create (with a cwd), run in, list, restart (state gone), remove; their credential."""
    sbx = Sandbox.create(timeout=300)
    try:
        ctx = sbx.create_code_context(cwd="/tmp", language="python")
        assert ctx.language == "python" and ctx.cwd == "/tmp", ctx
        assert sbx.run_code("import os\nos.getcwd()", context=ctx).text == "'/tmp'"
        sbx.run_code("y = 1", context=ctx)
        assert sbx.run_code("y").error.name == "NameError"  # the default context is another
        ok("create")

        listed = sbx.list_code_contexts()
        assert ctx.id in {c.id for c in listed}, listed
        assert {"python"} <= {c.language for c in listed}, listed
        ok("list")

        sbx.restart_code_context(ctx)
        assert sbx.run_code("y", context=ctx).error.name == "NameError"
        ok("restart")

        sbx.remove_code_context(ctx.id)
        assert ctx.id not in {c.id for c in sbx.list_code_contexts()}
        try:
            sbx.run_code("1", context=ctx)
        except NotFoundException:
            pass
        else:
            raise AssertionError("a removed context ran code")
        ok("remove")

        # The credential: the sandbox's token, as the SDK sends it (E2B-Traffic-Access-Token;
        # X-Access-Token on /execute). Without it, or with another's, nothing answers.
        url = os.environ["E2B_SANDBOX_URL"]
        base = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
        token = sbx.traffic_access_token
        assert token, "agentbox issues a traffic access token"
        for headers in ({}, {"E2B-Traffic-Access-Token": "ea_wrong"}):
            r = httpx.get(f"{url}/contexts", headers={**base, **headers}, timeout=30)
            assert r.status_code == 401, r.text
            r = httpx.post(f"{url}/execute", json={"code": "1"}, headers={**base, **headers})
            assert r.status_code == 401, r.text
            r = httpx.get(f"{url}/health", headers={**base, **headers}, timeout=30)
            assert r.status_code == 502, r.text
        good = {**base, "E2B-Traffic-Access-Token": token}
        assert httpx.get(f"{url}/health", headers=good, timeout=30).status_code == 200
        r = httpx.get(f"{url}/contexts", headers={**good, "E2b-Sandbox-Port": "49983"})
        assert r.status_code == 401, r.text  # envd's port takes X-Access-Token only
        ok("credential")
    finally:
        sbx.kill()


if __name__ == "__main__":
    {"cells": cells, "contexts": contexts}[sys.argv[1]]()
