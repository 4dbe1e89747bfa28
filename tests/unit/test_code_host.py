"""The code host (src/agentbox/agent/code_host.py), driven over its JSON-lines protocol."""

from __future__ import annotations

import base64
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HOST = Path(__file__).resolve().parents[2] / "src" / "agentbox" / "agent" / "code_host.py"
WAIT_S = 60.0


class Host:
    """A code host subprocess with a reader thread that sorts events by request id."""

    def __init__(self, *python_flags: str, cwd: str | None = None, shell: str = "") -> None:
        argv = [sys.executable, *python_flags, str(HOST)]
        if shell:  # start it through `sh -c "<shell>; exec <argv>"`
            argv = ["sh", "-c", f'{shell}; exec "$@"', "sh", *argv]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=cwd,
        )
        self.next_id = 0
        self.queues: dict[int, queue.Queue[dict[str, Any]]] = {}
        self.order: list[tuple[int, str]] = []  # (id, event) as they arrived
        self.garbage: list[bytes] = []  # stdout lines that are not protocol JSON
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _queue(self, rid: int) -> queue.Queue[dict[str, Any]]:
        with self.lock:
            return self.queues.setdefault(rid, queue.Queue())

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
                rid = ev["id"]
            except (ValueError, KeyError, TypeError):
                self.garbage.append(line)
                continue
            with self.lock:
                self.order.append((rid, ev["event"]))
            self._queue(rid).put(ev)

    def send(self, op: str, **fields: Any) -> int:
        self.next_id += 1
        assert self.proc.stdin is not None
        self.proc.stdin.write(
            (json.dumps({"id": self.next_id, "op": op, **fields}) + "\n").encode()
        )
        self.proc.stdin.flush()
        return self.next_id

    def collect(self, rid: int) -> list[dict[str, Any]]:
        events = []
        q = self._queue(rid)
        while True:
            ev = q.get(timeout=WAIT_S)
            events.append(ev)
            if ev["event"] in ("done", "failed"):
                return events

    def call(self, op: str, **fields: Any) -> list[dict[str, Any]]:
        return self.collect(self.send(op, **fields))

    def ok(self, op: str, **fields: Any) -> dict[str, Any]:
        events = self.call(op, **fields)
        assert events[-1]["event"] == "done", events
        return events[-1]

    def run(self, code: str, **fields: Any) -> list[dict[str, Any]]:
        return self.call("execute", code=code, **fields)

    def context(self, language: str, **fields: Any) -> str:
        return self.ok("create_context", language=language, **fields)["context"]["id"]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def stdout(events: list[dict[str, Any]]) -> str:
    return "".join(e["text"] for e in events if e["event"] == "stdout")


def stderr(events: list[dict[str, Any]]) -> str:
    return "".join(e["text"] for e in events if e["event"] == "stderr")


def results(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["result"] for e in events if e["event"] == "result"]


def errors(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["error"] for e in events if e["event"] == "error"]


def done(events: list[dict[str, Any]]) -> dict[str, Any]:
    assert events[-1]["event"] == "done", events
    return events[-1]


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    h = Host(cwd=str(tmp_path_factory.mktemp("workdir")))
    h.ok("warm", languages=["python", "bash", "javascript"])
    yield h
    h.close()
    assert not h.garbage, f"non-protocol lines on stdout: {h.garbage[:3]}"


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


# ---------------------------------------------------------------- python


def test_python_state_persists_and_streams(host: Host) -> None:
    first = host.run("x = 6*7\nprint(x)")
    assert stdout(first) == "42\n"
    count = done(first)["execution_count"]
    assert {"event": "execution_count", "execution_count": count, "id": first[0]["id"]} in first
    second = host.run("import sys\nprint(x + 1)\nprint('warn', file=sys.stderr)")
    assert stdout(second) == "43\n"
    assert stderr(second) == "warn\n"
    assert done(second)["execution_count"] == count + 1
    assert all(isinstance(e["timestamp"], int) for e in second if e["event"] == "stdout")


def test_python_contexts_are_isolated(host: Host) -> None:
    a, b = host.context("python"), host.context("python")
    host.run("x = 'a'", context_id=a)
    host.run("x = 'b'", context_id=b)
    assert results(host.run("x", context_id=a))[0]["text"] == "'a'"
    assert results(host.run("x", context_id=b))[0]["text"] == "'b'"
    listed = {c["id"]: c for c in host.ok("list_contexts")["contexts"]}
    assert listed[a]["default"] is False and listed[a]["language"] == "python"
    host.ok("remove_context", context_id=a)
    host.ok("remove_context", context_id=b)


def test_python_rich_results(host: Host) -> None:
    events = host.run("from IPython.display import HTML, display\ndisplay(HTML('<b>hi</b>'))\n6*7")
    html, main = results(events)
    assert html["html"] == "<b>hi</b>" and html["is_main_result"] is False
    assert main == {"text": "42", "is_main_result": True}


def test_matplotlib_figure_arrives_as_png(host: Host) -> None:
    # No plt.show(): the inline backend must still send the figure at the end of the cell.
    events = host.run("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2]);")
    pngs = [r for r in results(events) if "png" in r]
    assert len(pngs) == 1, events
    assert base64.b64decode(pngs[0]["png"]).startswith(b"\x89PNG\r\n\x1a\n")
    assert pngs[0]["is_main_result"] is False


def test_python_error_has_traceback(host: Host) -> None:
    events = host.run("def f():\n    return 1/0\nf()")
    (err,) = errors(events)
    assert err["name"] == "ZeroDivisionError"
    assert err["value"] == "division by zero"
    assert "return 1/0" in err["traceback"] and "\x1b[" not in err["traceback"]
    assert done(events)["execution_count"] > 0


def test_python_timeout_interrupts_and_keeps_state(host: Host) -> None:
    host.run("kept = 'still here'")
    start = time.monotonic()
    events = host.run("import time\nwhile True:\n    time.sleep(0.05)", timeout=0.5)
    assert time.monotonic() - start < 5
    (err,) = errors(events)
    assert err["name"] == "TimeoutError"
    assert "KeyboardInterrupt" in err["traceback"]
    assert done(events)["timed_out"] is True
    assert stdout(host.run("print(kept)")) == "still here\n"


def test_per_execution_envs_are_restored(host: Host) -> None:
    code = "import os\nprint(os.environ.get('AB_ONCE'))"
    assert stdout(host.run(code, envs={"AB_ONCE": "yes"})) == "yes\n"
    assert stdout(host.run(code)) == "None\n"


def test_kernel_death_then_restart(host: Host) -> None:
    ctx = host.context("python")
    host.run("doomed = 1", context_id=ctx)
    events = host.run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", context_id=ctx)
    assert events[-1]["event"] == "failed" and events[-1]["code"] == "kernel_dead", events
    # An error the caller's code can catch, named as docs/API.md promises.
    died = errors(events)
    assert [e["name"] for e in died] == ["KernelDied"], events
    assert "signal 9" in died[0]["value"], died
    again = host.run("1", context_id=ctx)
    assert again[-1]["code"] == "kernel_dead"
    assert errors(again) == [], again  # dead before this cell: nothing of it ran
    assert "restart" in again[-1]["message"]
    restarted = host.ok("restart_context", context_id=ctx)
    assert restarted["context"]["id"] == ctx
    fresh = host.run("doomed", context_id=ctx)
    assert errors(fresh)[0]["name"] == "NameError"  # state is gone, the kernel works
    assert results(host.run("2 + 2", context_id=ctx))[0]["text"] == "4"
    host.ok("remove_context", context_id=ctx)


def test_language_mismatch_and_unknown_context(host: Host) -> None:
    ctx = host.context("bash")
    bad = host.run("1", context_id=ctx, language="python")
    assert bad[-1]["event"] == "failed" and bad[-1]["code"] == "invalid"
    assert host.run("1", context_id="nope")[-1]["code"] == "not_found"
    assert host.call("create_context", language="cobol")[-1]["code"] == "invalid"
    host.ok("remove_context", context_id=ctx)


# ---------------------------------------------------------------- bash


def test_bash_cwd_and_variables_persist(host: Host, tmp_path: Path) -> None:
    ctx = host.context("bash")
    host.run(f"cd {tmp_path}\nGREETING=hello", context_id=ctx)
    events = host.run('pwd; echo "$GREETING"; echo oops >&2', context_id=ctx)
    assert stdout(events) == f"{tmp_path}\nhello\n"
    assert stderr(events) == "oops\n"
    assert done(events)["exit_code"] == 0
    # the cell's stdin is /dev/null: `cat` must not eat the protocol's next cell
    assert stdout(host.run("cat; echo after", context_id=ctx)) == "after\n"
    host.ok("remove_context", context_id=ctx)


def test_bash_nonzero_exit_is_an_error(host: Host) -> None:
    events = host.run("echo out; ls /definitely/not/here", language="bash")
    (err,) = errors(events)
    assert err["name"] == "ExitCode"
    assert "/definitely/not/here" in err["value"]
    assert done(events)["exit_code"] == 2
    assert stdout(events) == "out\n"


def test_bash_timeout_keeps_the_shell(host: Host) -> None:
    host.run("SURVIVOR=yes", language="bash")
    events = host.run("while true; do :; done", language="bash", timeout=0.3)
    assert [e["name"] for e in errors(events)] == ["TimeoutError"]
    assert done(events)["timed_out"] is True
    assert stdout(host.run("echo $SURVIVOR", language="bash")) == "yes\n"


def test_bash_timeout_of_a_loop_of_commands_keeps_the_shell(host: Host) -> None:
    # A SIGINT that lands while bash forks is taken by the child before it execs, and bash goes
    # on with the loop: about one timeout in six of this loop, each then killed the shell after
    # the grace, when bash was interrupted only once.
    host.run("SURVIVOR=yes", language="bash")
    for _ in range(12):
        events = host.run("while true; do /bin/true; done", language="bash", timeout=0.05)
        assert [e["name"] for e in errors(events)] == ["TimeoutError"], errors(events)
        assert done(events)["timed_out"] is True
    assert stdout(host.run("echo $SURVIVOR", language="bash")) == "yes\n"


def test_same_context_queues_other_contexts_run_concurrently(host: Host) -> None:
    slow, fast = host.context("bash"), host.context("bash")
    first = host.send("execute", code="sleep 0.5; echo first", context_id=slow)
    queued = host.send("execute", code="echo second", context_id=slow)
    other = host.send("execute", code="echo other", context_id=fast)
    assert stdout(host.collect(other)) == "other\n"
    assert stdout(host.collect(first)) == "first\n"
    assert stdout(host.collect(queued)) == "second\n"
    order = [item for item in host.order if item[0] in (first, queued, other)]
    assert order.index((other, "done")) < order.index((first, "done"))
    assert order.index((first, "done")) < order.index((queued, "stdout"))
    for ctx in (slow, fast):
        host.ok("remove_context", context_id=ctx)


def test_restart_kills_a_running_cell_and_queued_cells_run_fresh(host: Host) -> None:
    ctx = host.context("bash")
    host.run("STATE=old", context_id=ctx)
    running = host.send("execute", code="sleep 30", context_id=ctx)
    time.sleep(0.2)  # let it start
    restart = host.send("restart_context", context_id=ctx)
    killed = host.collect(running)[-1]
    assert killed["code"] == "kernel_dead" and "restarted" in killed["message"]
    assert host.collect(restart)[-1]["event"] == "done"
    assert stdout(host.run('echo "[$STATE]"', context_id=ctx)) == "[]\n"
    host.ok("remove_context", context_id=ctx)


def test_cell_that_ignores_the_interrupt_is_killed(host: Host) -> None:
    ctx = host.context("bash")
    host.run("trap '' INT", context_id=ctx)  # the shell now ignores SIGINT
    start = time.monotonic()
    events = host.run("while true; do :; done", context_id=ctx, timeout=0.2)
    assert events[-1]["event"] == "failed" and events[-1]["code"] == "kernel_dead", events
    assert "ignored the interrupt" in events[-1]["message"]
    assert time.monotonic() - start < 10
    assert host.run("echo hi", context_id=ctx)[-1]["code"] == "kernel_dead"
    host.ok("restart_context", context_id=ctx)
    assert stdout(host.run("echo hi", context_id=ctx)) == "hi\n"
    host.ok("remove_context", context_id=ctx)


def test_cancel_interrupts_a_running_cell_and_drops_a_queued_one(host: Host) -> None:
    """`cancel` is what the agent sends when a cell's client goes away (E2B's SDK times out by
    disconnecting): the running cell (no timeout of its own) is interrupted within moments, a
    cell queued behind it never runs, the context keeps its state."""
    host.run("kept = 'still here'")
    running = host.send("execute", code="import time\nprint('started', flush=True)\ntime.sleep(60)")
    queued = host.send("execute", code="print('must not run')")
    q = host._queue(running)
    assert q.get(timeout=WAIT_S)["event"] == "accepted"
    assert q.get(timeout=WAIT_S)["text"] == "started\n"
    start = time.monotonic()
    assert host.call("cancel", target=queued)[-1]["event"] == "done"
    assert host.call("cancel", target=running)[-1]["event"] == "done"
    rest = host.collect(running)
    assert time.monotonic() - start < 3, rest
    (err,) = errors(rest)
    assert err["name"] == "TimeoutError" and "client went away" in err["value"], err
    assert done(rest)["timed_out"] is True
    skipped = host.collect(queued)
    assert [e["event"] for e in skipped] == ["accepted", "failed"], skipped
    assert stdout(host.run("print(kept)")) == "still here\n"
    # A cancel for a request that has ended (or never was) is answered and changes nothing.
    assert host.call("cancel", target=running)[-1]["event"] == "done"
    assert host.call("cancel", target=10**9)[-1]["event"] == "done"


def test_an_execute_is_accepted_before_its_cell_says_anything(host: Host) -> None:
    """A silent cell's first event would otherwise be its end: the agent answers its caller
    (and the server its client, who may hang up) on `accepted`; a bad request fails instead."""
    rid = host.send("execute", code="import time\ntime.sleep(2)")
    start = time.monotonic()
    assert host._queue(rid).get(timeout=WAIT_S)["event"] == "accepted"
    assert time.monotonic() - start < 1
    assert done(host.collect(rid))["execution_count"]
    refused = host.call("execute", code="1", context_id="nope")
    assert [e["event"] for e in refused] == ["failed"] and refused[0]["code"] == "not_found"


def test_cancel_of_a_bash_cell(host: Host) -> None:
    host.run("SURVIVOR=yes", language="bash")
    running = host.send("execute", code="echo go; sleep 60", language="bash")
    assert host._queue(running).get(timeout=WAIT_S)["event"] == "accepted"
    assert host._queue(running).get(timeout=WAIT_S)["text"] == "go\n"
    host.ok("cancel", target=running)
    assert [e["name"] for e in errors(host.collect(running))] == ["TimeoutError"]
    assert stdout(host.run("echo $SURVIVOR", language="bash")) == "yes\n"


def test_a_cell_whose_end_is_read_as_its_grace_runs_out_is_not_killed(tmp_path: Path) -> None:
    """The last marker and the end of the interrupt's grace in one turn of the read loop: the
    cell is over, so the shell must not be killed (it was: the deadline was checked after the
    markers that ended the loop)."""
    from agentbox.agent import code_host as ch

    class Slow(ch.BashShell):
        def _send(self, text: str) -> None:
            super()._send(text)
            time.sleep(0.3)  # every marker is in the pipes before the loop reads one

    shell = Slow("bash", str(tmp_path), {"PATH": os.environ["PATH"]}, str(tmp_path))
    shell.start()
    r, w = os.pipe()
    try:
        run = ch.Run(1, "true", {}, 60, ch.Output(w))
        now = time.monotonic()
        # As after an interrupt at a deadline passed: the grace ends while the cell's output
        # waits unread.
        run.deadline, run.timed_out, run.kill_at = now - 1, True, now + 0.1
        shell.execute(run)  # raised HostError (kernel_dead) before the fix
        assert not shell.dead and shell.proc is not None and shell.proc.poll() is None
    finally:
        shell.kill("test")
        if shell.proc is not None:
            shell.proc.wait()
        os.close(r)
        os.close(w)


# ---------------------------------------------------------------- javascript


def test_javascript_state_console_and_errors(host: Host) -> None:
    ctx = host.context("javascript")
    events = host.run(
        "let a = 1; const b = 2\nconsole.log('hi', a); console.error('oops')", context_id=ctx
    )
    assert stdout(events) == "hi 1\n"
    assert stderr(events) == "oops\n"
    assert results(host.run("a + b", context_id=ctx))[0]["text"] == "3"
    # re-running a cell that declares a `let` must work, as in a notebook
    assert results(host.run("let a = 10; a", context_id=ctx))[0]["text"] == "10"
    assert (
        results(host.run("const r = await Promise.resolve(7)\nr", context_id=ctx))[0]["text"] == "7"
    )
    assert results(host.run("r * 2", context_id=ctx))[0]["text"] == "14"
    (err,) = errors(host.run("null.x", context_id=ctx))
    assert err["name"] == "TypeError" and "null" in err["value"] and "<cell-" in err["traceback"]
    host.ok("remove_context", context_id=ctx)


def test_javascript_timeout_keeps_context(host: Host) -> None:
    host.run("var kept = 'js'", language="javascript")
    events = host.run("while (true) {}", language="javascript", timeout=0.3)
    assert [e["name"] for e in errors(events)] == ["TimeoutError"]
    assert results(host.run("kept", language="javascript"))[0]["text"] == "'js'"


# ---------------------------------------------------------------- env, removal, lifecycle


def test_set_env_reaches_existing_and_new_contexts(host: Host) -> None:
    py, sh, js = host.context("python"), host.context("bash"), host.context("javascript")
    host.ok("set_env", envs={"AB_HANDOFF": "token-1"})
    code = "import os\nprint(os.environ['AB_HANDOFF'])"
    assert stdout(host.run(code, context_id=py)) == "token-1\n"
    assert stdout(host.run("echo $AB_HANDOFF; sh -c 'echo $AB_HANDOFF'", context_id=sh)) == (
        "token-1\ntoken-1\n"
    )
    assert results(host.run("process.env.AB_HANDOFF", context_id=js))[0]["text"] == "'token-1'"
    late = host.context("python")
    assert stdout(host.run(code, context_id=late)) == "token-1\n"
    for ctx in (py, sh, js, late):
        host.ok("remove_context", context_id=ctx)


def test_remove_context(host: Host) -> None:
    ctx = host.context("bash")
    assert ctx in [c["id"] for c in host.ok("list_contexts")["contexts"]]
    host.ok("remove_context", context_id=ctx)
    assert ctx not in [c["id"] for c in host.ok("list_contexts")["contexts"]]
    assert host.run("echo hi", context_id=ctx)[-1]["code"] == "not_found"
    assert host.call("remove_context", context_id=ctx)[-1]["code"] == "not_found"


def test_default_contexts_are_listed(host: Host) -> None:
    defaults = {c["language"] for c in host.ok("list_contexts")["contexts"] if c["default"]}
    assert defaults == {"python", "bash", "javascript"}


def test_eof_kills_every_interpreter(tmp_path: Path) -> None:
    h = Host(cwd=str(tmp_path))
    py = h.context("python")
    # children of the interpreters too: they share the interpreter's process group
    h.run("import subprocess\np = subprocess.Popen(['sleep', '300'])", context_id=py)
    h.run("sleep 300 &", language="bash")
    h.run("require('child_process').spawn('sleep', ['300'])", language="javascript")
    kids = descendants(h.proc.pid)
    assert len(kids) >= 6, kids  # kernel, bash, node and a sleep under each
    argv = [Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0") for p in kids]
    (conn_file,) = [a[a.index(b"-f") + 1] for a in argv if b"ipykernel_launcher" in a]
    runtime_dir = Path(conn_file.decode()).parent
    assert runtime_dir.is_dir()
    h.close()
    assert h.proc.returncode == 0
    deadline = time.monotonic() + 5
    while any(alive(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in kids if alive(p)]
    assert not runtime_dir.exists()  # sockets, connection files, IPython dir: all gone


def test_shutdown_replies_then_exits(tmp_path: Path) -> None:
    h = Host(cwd=str(tmp_path))
    h.run("echo warm", language="bash")
    kids = descendants(h.proc.pid)
    assert h.ok("shutdown")
    assert h.proc.wait(timeout=10) == 0
    assert not [p for p in kids if alive(p)]


def test_without_jupyter_python_is_unsupported_and_bash_works(tmp_path: Path) -> None:
    h = Host("-S", cwd=str(tmp_path))  # -S: no site-packages, so no jupyter_client
    try:
        failed = h.call("create_context", language="python")[-1]
        assert failed["event"] == "failed" and failed["code"] == "unsupported"
        assert "code-interpreter" in failed["message"]
        assert h.run("1")[-1]["code"] == "unsupported"
        assert stdout(h.run("echo fine", language="bash")) == "fine\n"
    finally:
        h.close()


def test_interrupts_work_when_started_with_sigint_ignored(tmp_path: Path) -> None:
    # A background job's SIGINT is SIG_IGN, and ignored signals survive exec: the host must not
    # hand that on, or `sleep` in a cell could never be interrupted.
    h = Host(cwd=str(tmp_path), shell="trap '' INT QUIT")
    try:
        start = time.monotonic()
        events = h.run("sleep 30", language="bash", timeout=0.3)
        assert [e["name"] for e in errors(events)] == ["TimeoutError"], events
        assert time.monotonic() - start < 3
        ignored = h.run("grep SigIgn /proc/self/status", language="bash")
        assert int(stdout(ignored).split()[1], 16) & (1 << 1) == 0  # bit 1: SIGINT (2)
    finally:
        h.close()


def test_malformed_displays_keep_the_cell_and_its_output(host: Host) -> None:
    # The cell's code holds the kernel's key: it can put any message on iopub, before the
    # kernel has flushed the cell's earlier prints.
    host.run(
        "k = get_ipython().kernel\n"
        "def raw(kind, content):\n"
        "    k.session.send(k.iopub_socket, kind, content, parent=k.get_parent())\n"
    )
    png = base64.b64encode(b"\x89PNG\r\n\x1a\nfake").decode()
    events = host.run(
        "print('before')\n"
        "raw('display_data', {'data': 5, 'metadata': {}})\n"
        "raw('display_data', {'metadata': []})\n"
        # bytes go out as they are: Python's json accepts NaN and Infinity, JSON does not
        'raw(\'execute_result\', b\'{"data": {"text/plain": NaN, "application/json": '
        '[Infinity]}, "execution_count": "x"}\')\n'
        "raw('stream', {'name': 'stdout', 'text': ['in ', 'parts\\n']})\n"
        "raw('error', {'ename': 5})\n"
        "from IPython.display import display\n"
        "display({'text/plain': 7, 'text/html': ['<b>', 'x</b>'], 'image/png': 12345,\n"
        "         'image/jpeg': 'not base64!', 'application/json': {'a': [1, 2]},\n"
        "         'application/x-custom': {'k': 'v'}}, raw=True)\n"
        f"display({{'image/png': '{png[:8]}\\n{png[8:]}', 'text/plain': None}}, raw=True)\n"
        "print('after')"
    )
    assert done(events)["execution_count"] is not None
    assert stdout(events) == "in parts\nbefore\nafter\n"
    assert [e["name"] for e in errors(events)] == ["5"]
    assert results(events) == [
        {"json": [None], "is_main_result": True},
        {
            "text": "7",
            "html": "<b>x</b>",
            "json": {"a": [1, 2]},
            "extra": {"application/x-custom": {"k": "v"}},
            "is_main_result": False,
        },
        {"png": png, "is_main_result": False},
    ]
    # Every event is strict JSON (no NaN or Infinity).
    for e in events:
        json.loads(json.dumps(e, allow_nan=False))
