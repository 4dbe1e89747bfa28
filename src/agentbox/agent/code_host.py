"""The code host: persistent Python, bash and JavaScript contexts behind one JSON-lines pipe.

The in-sandbox agent starts one code host per sandbox (`python3 code_host.py`, with the sandbox's
working directory and env) and talks to it over stdin/stdout, one JSON object per line. Nothing
but protocol lines ever reaches stdout: the real fd 1 is kept private and fd 1 is pointed at
stderr, so stray prints and children's output cannot corrupt the stream. Logs go to stderr.

A context is one live interpreter: a Jupyter kernel (python: ipykernel, spoken to over ZeroMQ
`ipc` sockets with pyzmq, imported on first use), a `bash` process, or a `node` process running
`js_repl.js`. Each child runs in its own session (process group) so it can be interrupted and
killed as a tree. Each context has a worker thread that runs its jobs one at a time (executions
on one context queue, different contexts run concurrently); the main thread only reads requests.

Requests: `{"id": n, "op": ..., ...}`. Every request ends with one terminal event for its id,
`{"id": n, "event": "done", ...}` or `{"id": n, "event": "failed", "code", "message"}` with code
one of `invalid`, `not_found`, `unsupported`, `kernel_dead`, `internal`.

- `create_context {language, cwd?, envs?}` -> done `{"context": {id, language, cwd, default}}`
  once the interpreter is ready.
- `list_contexts {}` -> done `{"contexts": [...]}`; default contexts carry `"default": true`.
- `restart_context {context_id}` -> kills the interpreter at once (a running cell fails with
  `kernel_dead`), starts a fresh one under the same id; jobs already queued run on the new one.
- `remove_context {context_id}` -> kills it; queued jobs fail `not_found`.
- `set_env {envs}` -> for future contexts and, queued behind running work, existing ones.
- `warm {languages}` -> starts each language's default context; done `{"contexts": [...]}`.
- `execute {code, context_id?, language?, envs?, timeout?}` -> `accepted` once it is queued
  (or failed at once: a bad request, an unknown context), then streams `stdout`/`stderr`
  `{text, timestamp}` (timestamp: Unix epoch in nanoseconds), `result {result}` (E2B Result
  fields, only those present, plus `is_main_result`), `error {error: {name, value, traceback}}`,
  then `execution_count {execution_count}` and done `{execution_count, timed_out?, exit_code?}`.
  No context_id: the language's (default "python") default context, started on demand. Both
  context_id and a different language: `invalid`. `envs` hold for this execution only.
  `timeout` in seconds; absent, null or 0: none.
- `cancel {target}` -> the execute of request `target` is interrupted as at its timeout (its
  TimeoutError says its client went away), or never runs if still queued; done.
- `shutdown {}` -> kills everything, done, exit. EOF on stdin does the same without a reply.

Conventions chosen here:

- Timeout: the cell gets SIGINT (its process group; bash only once it has read the whole cell),
  and again every second until the cell ends. Again, for bash too: a SIGINT that lands while
  bash forks a command is taken by the child before it execs (bash's handler, which only notes
  it) and bash goes on with the cell (one timeout in six, for a loop of short commands); a
  repeat can in turn land in the microseconds bash spends on the cell's end markers, after
  which the grace below ends it as before. The interrupt's own error (KeyboardInterrupt,
  node's "Script execution interrupted", bash's status 130) becomes the traceback of one error
  named `TimeoutError`, then done has `"timed_out": true`; the context keeps its state. If the
  cell is still running INTERRUPT_GRACE_S later, its interpreter is killed and the execute fails
  `kernel_dead`.
- Interpreter death (`os._exit`, SIGKILL, the OOM killer, bash `exit`): an error named
  `KernelDied` (value: what happened), then the execute fails with code `kernel_dead` (output
  streamed before the death has already been sent). Later executes on the context fail
  `kernel_dead`, with no error event, until `restart_context`.
- bash: a non-zero exit status of the cell's last command is an error event named `ExitCode`
  (value: the tail of the cell's stderr, or "exit status N" when it wrote none; traceback:
  "exit status N") and done carries `exit_code` for every bash cell. The shell is interactive
  (`bash -i`, no rc files, no prompts, no history) because only an interactive shell aborts a
  whole cell, loops included, on SIGINT and lives on; hence `[1] <pid>` on stderr for `cmd &`.
- javascript: cells run in node's main realm (`vm.Script.runInThisContext`), not a fresh
  `vm.createContext` realm, so objects cross into `require`d modules without `instanceof`
  surprises. See js_repl.js for the declaration and top-level-await rules.
"""

from __future__ import annotations

import codecs
import hashlib
import hmac
import importlib.util
import json
import math
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

# agentbox.vocab.LANGUAGES, copied: this file runs alone inside the sandbox (test_vocab checks).
LANGUAGES = ("python", "bash", "javascript", "typescript", "r")
START_TIMEOUT_S = 60.0
INTERRUPT_GRACE_S = 5.0
STDERR_TAIL = 2000
# Without a pidfd (very old kernels, some gVisor versions) a dead child is noticed by this poll.
LIVENESS_POLL_MS = 500
SETTLE_MAX_S = 0.5  # the longest a kernel's late output for a cell is awaited
CANCEL_POLL_MS = 250  # how soon a running cell sees a `cancel` (its deadline moved to now)
JS_REPL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "js_repl.js")
NO_PYTHON_KERNEL = (
    "this template's python3 lacks ipykernel (and pyzmq), so Python contexts cannot run here; "
    "use the `code-interpreter` template"
)
NO_KERNEL = (
    "this template has no {what}, so {language} contexts cannot run here; "
    "use the `code-interpreter-full` template"
)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}


def _log(msg: str) -> None:
    sys.stderr.write(f"code_host: {msg}\n")
    sys.stderr.flush()


class HostError(Exception):
    """A request failure with a protocol code and a message the caller can act on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Output:
    """The protocol stream: whole JSON lines, one writer at a time."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self._broken = False

    def send(self, *objs: dict[str, Any]) -> None:
        """Write whole lines; several objects go out in one write."""
        data = "".join(json.dumps(o, separators=(",", ":")) + "\n" for o in objs).encode()
        with self._lock:
            if self._broken:
                return
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(self._fd, view) :]
            except OSError as e:  # the agent went away; stdin EOF will end us
                self._broken = True
                _log(f"protocol pipe broken: {e}")

    def done(self, rid: object, **fields: Any) -> None:
        self.send({"id": rid, "event": "done", **fields})

    def failed(self, rid: object, err: HostError) -> None:
        self.send({"id": rid, "event": "failed", "code": err.code, "message": err.message})


# ---------------------------------------------------------------- one execution


class Run:
    """One `execute` request: its event stream, its deadline and its interrupt bookkeeping."""

    def __init__(
        self, rid: object, code: str, envs: dict[str, str], timeout: float | None, out: Output
    ) -> None:
        self.rid = rid
        self.code = code
        self.envs = envs
        self.timeout = timeout
        self.out = out
        self.deadline = time.monotonic() + timeout if timeout else None
        self.kill_at = 0.0
        self.reinterrupt_at: float | None = None
        self.timed_out = False
        self.cancelled = False  # its client went away (the host's `cancel`)
        self.interrupt_traceback = ""
        # False while an interrupt would hit the interpreter before the cell runs (bash reading
        # the cell); the deadline is checked again the moment the backend arms it.
        self.armed = True

    def emit(self, event: str, **fields: Any) -> None:
        self.out.send({"id": self.rid, "event": event, **fields})

    def stream(self, name: str, text: str) -> None:
        if text:
            self.emit(name, text=text, timestamp=time.time_ns())

    def error(self, name: str, value: str, traceback: str) -> None:
        if self.timed_out:  # the interrupt's own error: folded into the TimeoutError
            self.interrupt_traceback = self.interrupt_traceback or traceback
            return
        self.emit("error", error={"name": name, "value": value, "traceback": traceback})

    def cancel(self) -> None:
        """Interrupt the cell as its timeout would (from the host's request thread: the
        worker sees the deadline within CANCEL_POLL_MS)."""
        self.cancelled = True
        self.deadline = time.monotonic()

    @property
    def why(self) -> str:
        """What the interrupt was for, for the messages that tell."""
        if self.cancelled:
            return "its client went away"
        return f"its {self.timeout:g} s timeout"

    def wait_ms(self, have_pidfd: bool) -> int | None:
        """How long a poll may block before the deadline machinery must look again."""
        cap = CANCEL_POLL_MS if have_pidfd else min(LIVENESS_POLL_MS, CANCEL_POLL_MS)
        if not self.armed:
            due = None
        elif not self.timed_out:
            due = self.deadline
        else:
            due = min(self.kill_at, self.reinterrupt_at or self.kill_at)
        if due is None:
            return cap
        left = max(0, int((due - time.monotonic()) * 1000) + 1)
        return left if cap is None else min(left, cap)

    def check_deadline(self, backend: Backend) -> None:
        if not self.armed or self.deadline is None:
            return
        now = time.monotonic()
        if not self.timed_out:
            if now >= self.deadline:
                self.timed_out = True
                self.kill_at = now + INTERRUPT_GRACE_S
                backend.interrupt()
                if backend.reinterrupt_s:
                    self.reinterrupt_at = now + backend.reinterrupt_s
        elif self.reinterrupt_at is not None and self.reinterrupt_at <= now < self.kill_at:
            backend.interrupt()
            self.reinterrupt_at = now + (backend.reinterrupt_s or INTERRUPT_GRACE_S)
        elif now >= self.kill_at:
            backend.dead = True
            backend.kill("ignored_interrupt")
            raise HostError(
                "kernel_dead",
                f"the code ignored the interrupt sent at {self.why}, so the "
                f"{backend.language} process was killed; restart the context",
            )

    def finish(self, execution_count: int | None, **extra: Any) -> None:
        if self.timed_out:
            self.emit(
                "error",
                error={
                    "name": "TimeoutError",
                    "value": f"execution was interrupted at {self.why}; "
                    "the context keeps its state",
                    "traceback": self.interrupt_traceback,
                },
            )
            extra["timed_out"] = True
        done = {"id": self.rid, "event": "done", "execution_count": execution_count, **extra}
        if execution_count is None:
            self.out.send(done)
        else:
            count = {"id": self.rid, "event": "execution_count", "execution_count": execution_count}
            self.out.send(count, done)


# ---------------------------------------------------------------- interpreters


class Backend:
    """One interpreter process. Start, execute, set_env and close run on the context's worker
    thread; interrupt and kill may come from any thread."""

    language = ""
    kind = "process"
    # Seconds between repeated interrupts of a cell past its deadline (None: interrupt once).
    reinterrupt_s: float | None = None

    def __init__(self, name: str, cwd: str, env: dict[str, str], runtime_dir: str) -> None:
        self.name = name
        self.cwd = cwd
        self.env = env
        self.runtime_dir = runtime_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.pidfd = -1
        self.dead = False
        self.kill_reason: str | None = None
        self.count = 0

    def start(self) -> None:
        raise NotImplementedError

    def execute(self, run: Run) -> None:
        raise NotImplementedError

    def set_env(self, envs: dict[str, str]) -> None:
        raise NotImplementedError

    def _spawn(self, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        kw.setdefault("stdin", subprocess.DEVNULL)
        try:
            env = {**self.env, "PWD": self.cwd}  # as a shell should say it (the agent's start)
            proc = subprocess.Popen(argv, cwd=self.cwd, env=env, start_new_session=True, **kw)
        except FileNotFoundError as e:
            raise HostError("unsupported", f"{argv[0]} is not installed in this template") from e
        self.proc = proc
        try:
            self.pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            self.pidfd = -1
        return proc

    def _signal(self, sig: int) -> None:
        proc = self.proc
        if proc is None or self._group_gone:
            return
        if proc.returncode is not None:
            if sig != signal.SIGKILL:
                return
            # The leader is reaped, but what it started may live on in its group (whose id
            # cannot be reused while it has members): one last SIGKILL for them.
            self._group_gone = True
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            self._group_gone = True

    _group_gone = False

    def interrupt(self) -> None:
        self._signal(signal.SIGINT)

    def kill(self, reason: str | None = None) -> None:
        if reason and not self.kill_reason:
            self.kill_reason = reason
        self._signal(signal.SIGKILL)

    def exited(self) -> bool:
        return self.proc is None or self.proc.poll() is not None

    def died(self) -> HostError:
        """Mark the interpreter dead and say why, for the execute that noticed."""
        self.dead = True
        self.kill(None)
        rc = self.proc.wait() if self.proc is not None else None
        if self.kill_reason == "restarted":
            return HostError("kernel_dead", "the context was restarted while this code ran")
        if self.kill_reason == "removed":
            return HostError("not_found", "the context was removed while this code ran")
        how = f"was killed by signal {-rc}" if rc is not None and rc < 0 else f"exited ({rc})"
        return HostError(
            "kernel_dead",
            f"the {self.language} {self.kind} of this context {how}; its state is lost, "
            "restart the context to get a fresh one",
        )

    def reap(self) -> None:
        self.kill(None)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _log(f"{self.name}: pid {self.proc.pid} did not die")

    def close(self) -> None:
        self.reap()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


_zmq: dict[str, Any] = {}
_zmq_lock = threading.Lock()


def _load_zmq() -> tuple[Any, Any]:
    """Import pyzmq on first use (bash-only templates lack it): the module and one context."""
    with _zmq_lock:
        if not _zmq:
            try:
                import zmq
            except ImportError as e:
                raise HostError("unsupported", NO_PYTHON_KERNEL) from e
            _zmq.update(module=zmq, context=zmq.Context.instance())
        return _zmq["module"], _zmq["context"]


# Result fields that are text, and those that are base64 (docs/API.md, "Code interpreter").
_TEXT_FIELDS = frozenset({"text", "html", "markdown", "svg", "latex", "javascript"})
_BASE64_FIELDS = frozenset({"png", "jpeg", "pdf"})
_B64_CHARS = re.compile(rb"[A-Za-z0-9+/]*={0,2}")


def _as_text(value: object) -> str | None:
    """A kernel-sent value as the string the API promises: nbformat's list-of-lines joined,
    other JSON values as JSON text, null as nothing."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "".join(value)
    value = _finite(value)
    return None if value is None else json.dumps(value)


def _finite(value: object) -> object:
    """A JSON value with NaN and the infinities as null (as JSON.stringify does): Python's
    json reads and writes them, but they are not JSON and break every strict reader."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _as_base64(value: object) -> str | None:
    text = _as_text(value) if isinstance(value, str | list) else None
    if text is None:
        return None
    compact = "".join(text.split()).encode("ascii", "replace")
    return compact.decode() if len(compact) % 4 == 0 and _B64_CHARS.fullmatch(compact) else None


def _rich_result(data: object, main: bool) -> dict[str, Any]:
    """A display's mime bundle as a result event. A kernel (or code talking to the kernel's
    sockets) may send anything: values are coerced to the documented types or dropped, so one
    bad display never costs the cell its other output."""
    result: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for mime, value in (data if isinstance(data, dict) else {}).items():
        field = _MIME_FIELDS.get(mime)
        if field in _TEXT_FIELDS:
            coerced: object = _as_text(value)
        elif field in _BASE64_FIELDS:
            coerced = _as_base64(value)
        else:
            coerced = _finite(value)
        if coerced is None:
            continue
        if field:
            result[field] = coerced
        else:
            extra[str(mime)] = coerced
    if extra:
        result["extra"] = extra
    result["is_main_result"] = main
    return result


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _traceback(value: object) -> str:
    if isinstance(value, list):
        return "\n".join(v if isinstance(v, str) else str(v) for v in value)
    return _as_text(value) or ""


def _error_fields(c: dict[str, Any]) -> tuple[str, str, str]:
    return (
        _as_text(c.get("ename")) or "Error",
        _as_text(c.get("evalue")) or "",
        _traceback(c.get("traceback")),
    )


class _Cell:
    """The kernel's messages about one execute_request, turned into protocol events."""

    def __init__(self, msg_id: str, run: Run) -> None:
        self.msg_id = msg_id
        self.run = run
        self.count: int | None = None
        self.replied = self.idle = self.errored = False
        self.reply_error: tuple[str, str, str] | None = None

    def on_iopub(self, msg: dict[str, Any]) -> None:
        if msg["parent_header"].get("msg_id") != self.msg_id:
            return  # late output of an earlier cell, or bookkeeping
        kind, c, run = msg["msg_type"], msg["content"], self.run
        if kind == "stream":
            text = _as_text(c.get("text"))
            if text:
                run.stream("stderr" if c.get("name") == "stderr" else "stdout", text)
        elif kind in ("execute_result", "display_data", "update_display_data"):
            result = _rich_result(c.get("data"), kind == "execute_result")
            if len(result) > 1:  # something besides is_main_result survived
                run.emit("result", result=result)
        elif kind == "error":
            self.errored = True
            run.error(*_error_fields(c))
        elif kind == "execute_input":
            self.count = _count(c.get("execution_count")) or self.count
        elif kind == "status" and c.get("execution_state") == "idle":
            self.idle = True

    def on_reply(self, msg: dict[str, Any]) -> None:
        if msg["parent_header"].get("msg_id") != self.msg_id:
            return
        self.replied = True
        c = msg["content"]
        self.count = _count(c.get("execution_count")) or self.count
        # Reported at the end, and only if iopub (a different socket, so in no fixed order
        # with this one) did not carry the error already.
        if c.get("status") == "error":
            self.reply_error = _error_fields(c)
        elif c.get("status") == "aborted":
            self.reply_error = ("Aborted", "the kernel aborted this execution", "")

    def finish(self) -> None:
        if self.reply_error and not self.errored:
            self.run.error(*self.reply_error)
        self.run.finish(self.count)


class JupyterKernel(Backend):
    """A Jupyter kernel process, spoken to over ZeroMQ (unix sockets where the kernel can,
    loopback TCP otherwise). Subclasses say how to start one and how to change its
    environment in its own language.

    The Jupyter wire protocol (v5.3: signed multipart messages) is spoken here directly with
    pyzmq; jupyter_client's Session costs several times as much per message (deep copies,
    ISO-date parsing with dateutil) and ~140 ms to import, all on the latency-critical path.
    """

    kind = "kernel"
    transport = "ipc"
    # Seconds of iopub quiet awaited after a cell's reply and idle, for kernels that may
    # publish its output after its idle status (0: the idle is the end).
    settle_s = 0.0
    # How a cell is interrupted: SIGINT to the kernel's process group, or (for kernels that
    # die of SIGINT) an interrupt_request on the control channel.
    interrupt_mode = "signal"

    def available(self) -> None:
        """Raise HostError("unsupported") when this template cannot run the kernel."""

    def argv(self, conn_file: str) -> list[str]:
        raise NotImplementedError

    def kernel_env(self, env: dict[str, str]) -> None:
        """Adjust the kernel's environment (in place) before it starts."""

    def set_env_code(self, envs: dict[str, str]) -> str:
        raise NotImplementedError

    def save_env_code(self, envs: dict[str, str]) -> str:
        """Code that remembers the old values of `envs`' names, then sets `envs`."""
        raise NotImplementedError

    def restore_env_code(self) -> str:
        """Code that puts back what save_env_code remembered."""
        raise NotImplementedError

    def start(self) -> None:
        self.available()
        key = secrets.token_hex(16)
        prefix = os.path.join(self.runtime_dir, self.name)
        conn_file = prefix + ".json"
        if self.transport == "ipc":
            ip, ports = prefix, [1, 2, 3, 4, 5]  # ipc endpoints are the files `<ip>-<port>`
        else:
            ip, ports = "127.0.0.1", _free_ports(5)
        self.endpoints = [
            f"ipc://{prefix}-{port}" if self.transport == "ipc" else f"tcp://{ip}:{port}"
            for port in ports
        ]
        conn = {
            "transport": self.transport,
            "ip": ip,
            "shell_port": ports[0],
            "iopub_port": ports[1],
            "stdin_port": ports[2],
            "control_port": ports[3],
            "hb_port": ports[4],
            "key": key,
            "signature_scheme": "hmac-sha256",
            "kernel_name": self.language,
        }
        fd = os.open(conn_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(conn, f)
        env = dict(self.env)
        env.update(
            JUPYTER_RUNTIME_DIR=self.runtime_dir,
            JUPYTER_DATA_DIR=os.path.join(self.runtime_dir, "jupyter-data"),
            JUPYTER_CONFIG_DIR=os.path.join(self.runtime_dir, "jupyter-config"),
            JUPYTER_PLATFORM_DIRS="1",
            JPY_PARENT_PID=str(os.getpid()),  # the kernel exits if the code host vanishes
        )
        self.kernel_env(env)
        self.env = env
        self.log_path = prefix + ".log"
        log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self._spawn(self.argv(conn_file), stdout=log, stderr=log)
        finally:
            os.close(log)
        zmq, zmq_context = _load_zmq()  # overlaps with the kernel's own start-up
        self.zmq = zmq
        self.key = key.encode()
        self.session_id = secrets.token_hex(16)
        self.shell = zmq_context.socket(zmq.DEALER)
        self.iopub = zmq_context.socket(zmq.SUB)
        self.control = zmq_context.socket(zmq.DEALER) if self.interrupt_mode == "message" else None
        for sock, i in ((self.shell, 0), (self.iopub, 1), (self.control, 3)):
            if sock is not None:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RECONNECT_IVL, 10)  # the kernel binds ~0.5 s from now
                sock.connect(self.endpoints[i])
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        self.poller = zmq.Poller()
        self.poller.register(self.shell, zmq.POLLIN)
        self.poller.register(self.iopub, zmq.POLLIN)
        if self.control is not None:
            self.poller.register(self.control, zmq.POLLIN)
        if self.pidfd >= 0:
            self.poller.register(self.pidfd, zmq.POLLIN)
        self._wait_ready()

    def interrupt(self) -> None:
        if self.control is None:
            super().interrupt()
        else:  # called on the worker thread, the only one that uses the sockets
            self._send("interrupt_request", {}, self.control)

    def _wait_ready(self) -> None:
        """Ready = a kernel_info reply on shell and a status message on iopub (a SUB socket
        misses whatever is published before it is connected, so ask until iopub hears)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        asked: set[str] = set()
        replied = heard = False
        next_ask = 0.0
        while not (replied and heard):
            now = time.monotonic()
            if now >= deadline:
                self.kill("start_timeout")
                raise HostError(
                    "internal", f"the {self.language} kernel did not start in {START_TIMEOUT_S:g} s"
                )
            if now >= next_ask:
                asked.add(self._send("kernel_info_request", {}))
                next_ask = now + 0.25
            for sock, _ in self.poller.poll(int((min(next_ask, deadline) - now) * 1000) + 1):
                if sock is self.control:
                    self._drain(sock)
                elif sock is self.shell or sock is self.iopub:
                    for msg in self._drain(sock):
                        if msg["parent_header"].get("msg_id") in asked:
                            if sock is self.shell:
                                replied = True
                            else:
                                heard = True
            if self.exited():
                raise HostError("internal", self._startup_failure())

    def _startup_failure(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - STDERR_TAIL))
                tail = f.read().decode("utf-8", "replace").strip()
        except OSError:
            tail = ""
        rc = self.proc.returncode if self.proc else None
        return f"the {self.language} kernel exited during start-up ({rc}): {tail or 'no output'}"

    def _drain(self, sock: Any) -> list[dict[str, Any]]:
        """Every message waiting on sock (only msg_type, parent msg_id and content are used)."""
        msgs: list[dict[str, Any]] = []
        while True:
            try:
                frames = sock.recv_multipart(self.zmq.NOBLOCK)
            except self.zmq.Again:
                return msgs
            try:
                i = frames.index(b"<IDS|MSG>")
                sig, header, parent, metadata, content = frames[i + 1 : i + 6]
            except ValueError:
                _log(f"{self.name}: dropped a malformed kernel message")
                continue
            mac = hmac.new(self.key, header, hashlib.sha256)
            for part in (parent, metadata, content):
                mac.update(part)
            if not hmac.compare_digest(mac.hexdigest().encode(), sig):
                _log(f"{self.name}: dropped a kernel message with a bad signature")
                continue
            # Signed is not well-formed: the cell's code holds the key and may send anything.
            try:
                msg = {
                    "msg_type": json.loads(header)["msg_type"],
                    "parent_header": json.loads(parent),
                    "content": json.loads(content),
                }
            except (ValueError, KeyError, TypeError):
                msg = {}
            if not all(isinstance(msg.get(k), dict) for k in ("parent_header", "content")):
                _log(f"{self.name}: dropped a malformed kernel message")
                continue
            msgs.append(msg)

    def _request(self, code: str, silent: bool) -> str:
        content = {
            "code": code,
            "silent": silent,
            "store_history": not silent,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        }
        return self._send("execute_request", content)

    def _send(self, msg_type: str, content: dict[str, Any], sock: Any = None) -> str:
        """Sign and send one shell (or control) message; returns its msg_id."""
        msg_id = secrets.token_hex(16)
        header = {
            "msg_id": msg_id,
            "msg_type": msg_type,
            "session": self.session_id,
            "username": "agentbox",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + "Z",
            "version": "5.3",
        }
        parts = [json.dumps(header).encode(), b"{}", b"{}", json.dumps(content).encode()]
        mac = hmac.new(self.key, parts[0], hashlib.sha256)
        for part in parts[1:]:
            mac.update(part)
        (sock or self.shell).send_multipart([b"<IDS|MSG>", mac.hexdigest().encode(), *parts])
        return msg_id

    def _silent(self, code: str) -> None:
        """Run bookkeeping code (env changes) without output or an execution count."""
        msg_id = self._request(code, silent=True)
        while True:
            for sock, _ in self.poller.poll(None if self.pidfd >= 0 else LIVENESS_POLL_MS):
                if sock is self.iopub or sock is self.control:
                    self._drain(sock)  # its busy/idle (and stray late output): not for anyone
                elif sock is self.shell:
                    for msg in self._drain(sock):
                        if msg["parent_header"].get("msg_id") == msg_id:
                            return
            if self.exited():
                raise self.died()

    def set_env(self, envs: dict[str, str]) -> None:
        self._silent(self.set_env_code(envs))

    def execute(self, run: Run) -> None:
        if run.envs:
            self._silent(self.save_env_code(run.envs))
        cell = _Cell(self._request(run.code, silent=False), run)
        have_pidfd = self.pidfd >= 0
        while not (cell.replied and cell.idle):
            ready = self.poller.poll(run.wait_ms(have_pidfd))
            for sock, _ in ready:
                if sock is self.iopub:
                    for msg in self._drain(sock):
                        cell.on_iopub(msg)
                elif sock is self.shell:
                    for msg in self._drain(sock):
                        cell.on_reply(msg)
                elif sock is self.control:
                    self._drain(sock)  # interrupt replies
            if (have_pidfd and any(s == self.pidfd for s, _ in ready)) or (
                not ready and self.exited()
            ):
                for msg in self._drain(self.iopub):  # whatever it said before dying
                    if msg["msg_type"] == "stream":
                        cell.on_iopub(msg)
                raise self.died()
            if not ready or run.deadline is not None:
                run.check_deadline(self)
        if self.settle_s:
            self._settle(cell)
        if run.envs:
            self._silent(self.restore_env_code())
        cell.finish()

    def _settle(self, cell: _Cell) -> None:
        """Take the cell's late iopub messages: until settle_s passes without one (at most
        SETTLE_MAX_S), before anything else is sent to the kernel, which would be credited
        with whatever the kernel publishes after that."""
        quiet_until = time.monotonic() + self.settle_s
        give_up = time.monotonic() + SETTLE_MAX_S
        while (now := time.monotonic()) < min(quiet_until, give_up):
            if self.iopub.poll(int((min(quiet_until, give_up) - now) * 1000) + 1):
                for msg in self._drain(self.iopub):
                    if msg["parent_header"].get("msg_id") == cell.msg_id:
                        cell.on_iopub(msg)
                        quiet_until = time.monotonic() + self.settle_s

    def close(self) -> None:
        super().close()
        for name in ("shell", "iopub", "control"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(0)
        for endpoint in getattr(self, "endpoints", ()):
            if endpoint.startswith("ipc://"):
                _unlink(endpoint[len("ipc://") :])
        _unlink(os.path.join(self.runtime_dir, f"{self.name}.json"))


def _free_ports(n: int) -> list[int]:
    """n loopback TCP ports free right now (the kernel binds them a moment later; in a
    sandbox's own network namespace nothing else is racing for them but its own code)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class PythonKernel(JupyterKernel):
    """ipykernel, over unix sockets."""

    language = "python"
    # ipykernel ignores SIGINT outside a cell, so one sent while the request was still queued
    # in a busy kernel is lost; later ones are harmless once the cell is over.
    reinterrupt_s = 1.0

    def available(self) -> None:
        if not (importlib.util.find_spec("ipykernel") and importlib.util.find_spec("zmq")):
            raise HostError("unsupported", NO_PYTHON_KERNEL)

    def argv(self, conn_file: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "ipykernel_launcher",
            "-f",
            conn_file,
            "--HistoryManager.enabled=False",
            "--InteractiveShell.colors=nocolor",
            # ipykernel sleeps 0.5 ms before each execute_reply so that output reaches
            # clients which stop at the reply; we stop at iopub's idle, which follows
            # all of the cell's output on the same socket.
            "--IPythonKernel._execute_sleep=0",
        ]

    def kernel_env(self, env: dict[str, str]) -> None:
        # The inline backend turns every figure a cell creates into a PNG at the end of the
        # cell, plt.show() or not. ipykernel sets it too, but only when MPLBACKEND is unset.
        env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        env["IPYTHONDIR"] = os.path.join(self.runtime_dir, "ipython")  # HOME may be read-only
        env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"

    def set_env_code(self, envs: dict[str, str]) -> str:
        return f"__import__('os').environ.update({envs!r})"

    def save_env_code(self, envs: dict[str, str]) -> str:
        return (
            "__agentbox_saved_env__ = (lambda e, new: ({k: e.get(k) for k in new}, "
            f"e.update(new))[0])(__import__('os').environ, {envs!r})"
        )

    def restore_env_code(self) -> str:
        return (
            "(lambda e, old: [e.pop(k, None) if v is None else e.__setitem__(k, v) "
            "for k, v in old.items()])(__import__('os').environ, __agentbox_saved_env__); "
            "del __agentbox_saved_env__"
        )


def _literal(value: str) -> str:
    """A string literal for R and TypeScript alike (JSON's escapes are both languages')."""
    return json.dumps(value, ensure_ascii=False)


class RKernel(JupyterKernel):
    """R's IRkernel (Debian's r-cran-irkernel), over loopback TCP (its ZeroMQ binding takes
    `ip:port` endpoints only)."""

    language = "r"
    transport = "tcp"
    reinterrupt_s = 1.0

    def available(self) -> None:
        if shutil.which("R", path=self.env.get("PATH")) is None:
            raise HostError("unsupported", NO_KERNEL.format(language="r", what="R's IRkernel"))

    def argv(self, conn_file: str) -> list[str]:
        return ["R", "--no-save", "--no-restore", "--slave", "-e", "IRkernel::main()",
                "--args", conn_file]  # fmt: skip

    def set_env_code(self, envs: dict[str, str]) -> str:
        pairs = ", ".join(f"{_literal(k)} = {_literal(v)}" for k, v in envs.items())
        return f"invisible(do.call(Sys.setenv, list({pairs})))"

    def save_env_code(self, envs: dict[str, str]) -> str:
        names = ", ".join(_literal(k) for k in envs)
        return (
            f".agentbox_saved_env <- Sys.getenv(c({names}), unset = NA, names = TRUE); "
            + self.set_env_code(envs)
        )

    def restore_env_code(self) -> str:
        return (
            "invisible(for (k in names(.agentbox_saved_env)) { v <- .agentbox_saved_env[[k]]; "
            "if (is.na(v)) Sys.unsetenv(k) else do.call(Sys.setenv, setNames(list(v), k)) }); "
            "rm(.agentbox_saved_env)"
        )


class DenoKernel(JupyterKernel):
    """TypeScript (and JavaScript modules) in Deno's Jupyter kernel, over loopback TCP (it
    speaks no ipc). SIGINT ends Deno, so cells are interrupted by a control message."""

    language = "typescript"
    transport = "tcp"
    interrupt_mode = "message"
    # Deno publishes a cell's value and its console output from other tasks than its status,
    # so either can follow the cell's idle (measured: about 1 cell in 50 right after an error),
    # and is credited to whatever request Deno received last when it goes out.
    settle_s = 0.025
    reinterrupt_s = 1.0

    def available(self) -> None:
        if shutil.which("deno", path=self.env.get("PATH")) is None:
            raise HostError("unsupported", NO_KERNEL.format(language="typescript", what="Deno"))

    def argv(self, conn_file: str) -> list[str]:
        return ["deno", "jupyter", "--kernel", "--conn", conn_file]

    def kernel_env(self, env: dict[str, str]) -> None:
        env.setdefault("DENO_DIR", os.path.join(self.runtime_dir, "deno"))
        env.setdefault("DENO_NO_UPDATE_CHECK", "1")
        env["NO_COLOR"] = "1"  # tracebacks as plain text

    def set_env_code(self, envs: dict[str, str]) -> str:
        sets = "; ".join(f"Deno.env.set({_literal(k)}, {_literal(v)})" for k, v in envs.items())
        return f"{sets}; void 0"

    def save_env_code(self, envs: dict[str, str]) -> str:
        names = ", ".join(_literal(k) for k in envs)
        return (
            f"globalThis.__agentbox_saved_env__ = Object.fromEntries([{names}]"
            ".map((k) => [k, Deno.env.get(k) ?? null])); " + self.set_env_code(envs)
        )

    def restore_env_code(self) -> str:
        return (
            "for (const [k, v] of Object.entries(globalThis.__agentbox_saved_env__)) "
            "{ if (v === null) Deno.env.delete(k); else Deno.env.set(k, v); } "
            "delete globalThis.__agentbox_saved_env__; void 0"
        )


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _Pipe:
    """A child's stdout or stderr: decoded incrementally, split at the end-of-cell marker."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self.name = name
        self.buf = b""
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.eof = False
        os.set_blocking(fd, False)

    def read(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        if data:
            self.buf += data
        else:
            self.eof = True

    def take(self, marker: bytes | None) -> tuple[str, bytes | None]:
        """Text that is safe to emit now, and what follows the marker once it has arrived."""
        if marker is None:
            data, self.buf = self.buf, b""
            return self.decoder.decode(data), None
        i = self.buf.find(marker)
        if i >= 0:
            data, rest, self.buf = self.buf[:i], self.buf[i + len(marker) :], b""
            return self.decoder.decode(data), rest
        keep = 0  # hold back a tail that could be the start of a split marker
        for k in range(min(len(marker) - 1, len(self.buf)), 0, -1):
            if self.buf.endswith(marker[:k]):
                keep = k
                break
        cut = len(self.buf) - keep
        data, self.buf = self.buf[:cut], self.buf[cut:]
        return self.decoder.decode(data), None


class _PipeBackend(Backend):
    """Shared plumbing of bash and node: stream two pipes until both carry the cell's marker."""

    def _pipes(self) -> None:
        assert self.proc is not None and self.proc.stdout and self.proc.stderr
        self.out = _Pipe(self.proc.stdout.fileno(), "stdout")
        self.err = _Pipe(self.proc.stderr.fileno(), "stderr")

    def _stream(
        self,
        run: Run | None,
        markers: dict[str, list[bytes]],
        extra_fd: int = -1,
        on_extra: Callable[[], bool] | None = None,
        deadline: float | None = None,
    ) -> dict[str, bytes]:
        """Forward output until each pipe has shown its markers, in order, (and on_extra, if
        given, says the cell is over). A marker before a pipe's last arms the run's deadline.
        Returns what followed each pipe's last marker."""
        poll = select.poll()
        fds = {self.out.fd: self.out, self.err.fd: self.err}
        for fd in fds:
            poll.register(fd, select.POLLIN)
        if extra_fd >= 0:
            poll.register(extra_fd, select.POLLIN)
        if self.pidfd >= 0:
            poll.register(self.pidfd, select.POLLIN)
        expect = {name: list(ms) for name, ms in markers.items() if ms}
        tails: dict[str, bytes] = {}
        extra_done = on_extra is None
        have_pidfd = self.pidfd >= 0
        while len(tails) < len(expect) or not extra_done:
            if run is not None:
                wait = run.wait_ms(have_pidfd)
            elif deadline is not None:
                wait = max(0, int((deadline - time.monotonic()) * 1000) + 1)
            else:
                wait = None if have_pidfd else LIVENESS_POLL_MS
            ready = poll.poll(wait)
            # Pipes before the REPL channel: text printed before a result is shown before it.
            ready.sort(key=lambda r: r[0] == extra_fd)
            died = False
            for fd, _ in ready:
                pipe = fds.get(fd)
                if pipe is not None:
                    pipe.read()
                    if pipe.eof:
                        poll.unregister(fd)
                        del fds[fd]
                    self._scan(run, pipe, expect.get(pipe.name), tails)
                elif fd == extra_fd and on_extra is not None:
                    extra_done = on_extra() or extra_done
                elif fd == self.pidfd:
                    died = True
            if died or (not ready and not have_pidfd and self.exited()) or not fds:
                self._flush(run)
                raise self.died()
            if len(tails) == len(expect) and extra_done:
                break  # the cell is over: a deadline passed meanwhile must not interrupt or kill
            if run is not None:
                run.check_deadline(self)
            elif not ready and deadline is not None and time.monotonic() >= deadline:
                self.kill("start_timeout")
                raise HostError("internal", f"{self.language} did not start in time")
        return tails

    def _scan(
        self, run: Run | None, pipe: _Pipe, expect: list[bytes] | None, tails: dict[str, bytes]
    ) -> None:
        """Emit a pipe's text up to its next expected marker; consume markers as they show."""
        while pipe.name not in tails:
            text, rest = pipe.take(expect[0] if expect else None)
            if run is not None:
                self._emit_text(run, pipe.name, text)
            if rest is None or not expect:
                return
            expect.pop(0)
            if expect:  # an intermediate marker: the cell is running now
                pipe.buf = rest + pipe.buf
                if run is not None:
                    run.armed = True
            else:
                tails[pipe.name] = rest

    def _flush(self, run: Run | None) -> None:
        """Forward whatever the pipes hold now (output written between cells, or before a death)."""
        for pipe in (self.out, self.err):
            for _ in range(64):  # bounded: a chatty background job must not hold us here
                before = len(pipe.buf)
                pipe.read()
                if len(pipe.buf) == before:
                    break
            text, _ = pipe.take(None)
            if run is not None:
                self._emit_text(run, pipe.name, text)

    def _emit_text(self, run: Run, name: str, text: str) -> None:
        run.stream(name, text)


def _check_env_names(envs: dict[str, str]) -> None:
    for k in envs:
        if not _ENV_NAME.match(k):
            raise HostError("invalid", f"env var name {k!r} is not a valid shell identifier")


class BashShell(_PipeBackend):
    """An interactive `bash` (interactive so SIGINT aborts the whole cell, loops included, and
    the shell survives) fed cells on stdin; each cell is read whole by `read` from a heredoc
    and eval'd with stdin from /dev/null, so the code can never swallow the next cell."""

    language = "bash"
    reinterrupt_s = 1.0

    def start(self) -> None:
        bash = shutil.which("bash", path=self.env.get("PATH")) or "/bin/bash"
        self._spawn(
            [bash, "--noprofile", "--norc", "--noediting", "-i"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self._pipes()
        # No prompts, no history, no `!` expansion; errors at start-up ("no job control") are
        # swallowed by the first marker wait.
        self._send(
            "PS1=''; PS2=''; PS0=''; PROMPT_COMMAND=''; unset HISTFILE; set +m +H +o history\n"
        )
        token = secrets.token_hex(8)
        self._send(_bash_markers(token))
        self._stream(None, _bash_marker_bytes(token), deadline=time.monotonic() + START_TIMEOUT_S)

    def _send(self, text: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(text.encode())
            self.proc.stdin.flush()
        except BrokenPipeError as e:
            raise self.died() from e

    def set_env(self, envs: dict[str, str]) -> None:
        _check_env_names(envs)
        self._send("".join(f"export {k}={_shell_quote(v)}\n" for k, v in envs.items()))

    def interrupt(self) -> None:
        self._swallow_newline = True  # bash answers SIGINT with a bare newline on stderr
        super().interrupt()

    _swallow_newline = False
    _stderr_tail = ""

    def _emit_text(self, run: Run, name: str, text: str) -> None:
        if name == "stderr":
            if self._swallow_newline and text.startswith("\n"):
                self._swallow_newline = False
                text = text[1:]
            self._stderr_tail = (self._stderr_tail + text)[-STDERR_TAIL:]
        run.stream(name, text)

    def execute(self, run: Run) -> None:
        _check_env_names(run.envs)
        self._flush(run)  # output that background jobs wrote since the last cell
        self._stderr_tail = ""
        self._swallow_newline = False
        token = secrets.token_hex(8)
        delim = f"AGENTBOX_CELL_{token}"
        prefix = "".join(f"{k}={_shell_quote(v)} " for k, v in run.envs.items())
        go = f"AGENTBOX_GO_{token}_"
        # SIGINT while bash still reads the heredoc would make it run the rest of the cell's
        # lines as commands of their own, so the deadline is armed only once bash reports (on
        # stderr) that the whole cell is read. eval has a line of its own: an interrupt aborts
        # that line only, and the marker line after it still runs.
        self._send(
            f"IFS= read -r -d '' __agentbox_cell <<'{delim}'\n{run.code}\n{delim}\n"
            f"printf '%s\\n' '{go}' >&2; {prefix}eval \"$__agentbox_cell\" < /dev/null\n"
            + _bash_markers(token)
        )
        run.armed = False
        markers = _bash_marker_bytes(token)
        markers["stderr"].insert(0, f"{go}\n".encode())
        tails = self._stream(run, markers)
        rc = int(tails["stdout"].split(b"\n", 1)[0] or 0)
        self.count += 1
        if rc != 0 and not run.timed_out:
            tail = self._stderr_tail.strip()
            run.error("ExitCode", tail or f"exit status {rc}", f"exit status {rc}")
        run.finish(self.count, exit_code=rc)


def _bash_markers(token: str) -> str:
    return (
        f"__agentbox_rc=$?; unset __agentbox_cell; printf '%s%d\\n' 'AGENTBOX_END_{token}_' "
        f"\"$__agentbox_rc\"; printf '%s\\n' 'AGENTBOX_END_{token}_' >&2; unset __agentbox_rc\n"
    )


def _bash_marker_bytes(token: str) -> dict[str, list[bytes]]:
    marker = f"AGENTBOX_END_{token}_".encode()
    return {"stdout": [marker], "stderr": [marker]}


def _shell_quote(value: str) -> str:
    return "'" + value.replace("'", "'\"'\"'") + "'"


class NodeRepl(_PipeBackend):
    """`node js_repl.js`: cells and their results travel on a socketpair (the child's end is
    named in argv); the cells' own stdout/stderr are plain pipes, streamed as they come."""

    language = "javascript"
    # A SIGINT that node takes while it is between its event loop and the cell's script is
    # turned into an interrupt of the cell's start; a repeat catches the rest.
    reinterrupt_s = 1.0

    def start(self) -> None:
        node = shutil.which("node", path=self.env.get("PATH")) or shutil.which("nodejs")
        if not node:
            raise HostError("unsupported", "node is not installed in this template")
        if not os.path.exists(JS_REPL):
            raise HostError("internal", f"{JS_REPL} is missing")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._spawn(
                # --expose-internals: the REPL borrows node's own top-level-await rewriter
                [node, "--expose-internals", JS_REPL, str(theirs.fileno())],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        self.chan = ours
        self.chan_buf = b""
        self._pipes()
        self._stream(
            None,
            {},
            self.chan.fileno(),
            lambda: self._read_chan(None),
            deadline=time.monotonic() + START_TIMEOUT_S,
        )

    def _read_chan(self, run: Run | None) -> bool:
        """Read REPL messages; True once the current cell (or start-up) is over."""
        data = self.chan.recv(65536)
        if not data:
            self._flush(run)
            raise self.died()
        self.chan_buf += data
        over = False
        while b"\n" in self.chan_buf:
            line, self.chan_buf = self.chan_buf.split(b"\n", 1)
            msg = json.loads(line)
            event = msg.get("event")
            if event in ("ready", "done"):
                over = True
            elif run is not None:
                if event == "result":
                    run.emit("result", result=msg["result"])
                elif event == "error":
                    e = msg["error"]
                    run.error(e["name"], e["value"], e["traceback"])
        return over

    def _tell(self, msg: dict[str, Any]) -> None:
        try:
            self.chan.sendall((json.dumps(msg) + "\n").encode())
        except OSError as e:
            raise self.died() from e

    def set_env(self, envs: dict[str, str]) -> None:
        self._tell({"op": "env", "envs": envs})

    def execute(self, run: Run) -> None:
        self._flush(run)
        marker = f"AGENTBOX_END_{secrets.token_hex(8)}_"
        self._tell({"op": "execute", "code": run.code, "envs": run.envs, "marker": marker})
        both = {"stdout": [marker.encode()], "stderr": [marker.encode()]}
        self._stream(run, both, self.chan.fileno(), lambda: self._read_chan(run))
        self.count += 1
        run.finish(self.count)

    def close(self) -> None:
        super().close()
        chan = getattr(self, "chan", None)
        if chan is not None:
            chan.close()


BACKENDS: dict[str, type[Backend]] = {
    "python": PythonKernel,
    "bash": BashShell,
    "javascript": NodeRepl,
    "typescript": DenoKernel,
    "r": RKernel,
}


# ---------------------------------------------------------------- contexts


class Job:
    """Work for a context's worker: `run` on the worker, or `cancel` if the context goes away."""

    def __init__(self, run: Callable[[], None], cancel: Callable[[HostError], None]) -> None:
        self.run = run
        self.cancel = cancel


class Context:
    """One interpreter plus the worker thread that serialises its jobs."""

    def __init__(
        self, host: CodeHost, language: str, cwd: str, envs: dict[str, str], default: bool
    ) -> None:
        self.host = host
        self.id = secrets.token_hex(6)
        self.language = language
        self.cwd = cwd
        self.envs = envs
        self.default = default
        self.backend: Backend | None = None
        self.generation = 0
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed: HostError | None = None
        self._thread = threading.Thread(target=self._work, name=f"ctx-{self.id}", daemon=True)
        self._thread.start()

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd, "default": self.default}

    def submit(self, job: Job, front: bool = False) -> None:
        with self._cond:
            closed = self._closed
            if closed is None:
                if front:
                    self._jobs.appendleft(job)
                else:
                    self._jobs.append(job)
                self._cond.notify()
        if closed is not None:
            job.cancel(closed)

    def close(self, err: HostError, reason: str) -> None:
        """Stop taking jobs, cancel the queued ones and kill the interpreter."""
        with self._cond:
            if self._closed is None:
                self._closed = err
            jobs = list(self._jobs)
            self._jobs.clear()
            backend = self.backend
            self._cond.notify()
        if backend is not None:
            backend.kill(reason)
        for job in jobs:
            job.cancel(err)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and self._closed is None:
                    self._cond.wait()
                if not self._jobs:
                    break
                job = self._jobs.popleft()
            try:
                job.run()
            except Exception as e:  # a bug here must not take the context's queue down
                _log(f"context {self.id}: job crashed: {e!r}")
                job.cancel(HostError("internal", f"code host error: {e!r}"))
        if self.backend is not None:
            self.backend.close()

    # Jobs (run on the worker thread)

    def start(self) -> None:
        """Start a fresh interpreter, replacing (and reaping) any previous one."""
        old = self.backend
        if old is not None:
            old.close()
        self.generation += 1
        env = {**self.host.env, **self.envs}
        backend = BACKENDS[self.language](
            f"{self.id}-{self.generation}", self.cwd, env, self.host.runtime_dir
        )
        self.backend = backend
        try:
            backend.start()
        except HostError:
            backend.dead = True
            backend.close()
            raise
        except Exception as e:
            backend.dead = True
            backend.close()
            raise HostError("internal", f"could not start {self.language}: {e!r}") from e

    def usable(self) -> Backend:
        b = self.backend
        if b is None or b.dead:
            raise HostError(
                "kernel_dead",
                f"the {self.language} interpreter of context {self.id} is dead; "
                "restart the context (restart_context) to get a fresh one",
            )
        return b


class _Latch:
    """Replies to one request once every context it waits on has answered."""

    def __init__(self, out: Output, rid: object, contexts: list[Context]) -> None:
        self.out = out
        self.rid = rid
        self.contexts = contexts
        self.left = len(contexts)
        self.error: HostError | None = None
        self.lock = threading.Lock()

    def arrive(self, err: HostError | None) -> None:
        with self.lock:
            self.left -= 1
            self.error = self.error or err
            last = self.left == 0
        if last:
            if self.error:
                self.out.failed(self.rid, self.error)
            else:
                self.out.done(self.rid, contexts=[c.describe() for c in self.contexts])


# ---------------------------------------------------------------- the host


def _str_dict(value: object, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise HostError("invalid", f"{what} must be an object of string values")
    if any("\0" in k or "\0" in v or "=" in k or not k for k, v in value.items()):
        raise HostError("invalid", f"{what} has an empty name, '=' in a name, or a NUL byte")
    return value


class CodeHost:
    """The registry of contexts and the dispatcher of requests."""

    def __init__(self, out: Output) -> None:
        self.out = out
        self.env = dict(os.environ)
        self.cwd = os.getcwd()
        self.runtime_dir = tempfile.mkdtemp(prefix="agentbox-code-")
        self.contexts: dict[str, Context] = {}
        self.defaults: dict[str, Context] = {}
        self.runs: dict[int, Run] = {}  # executions queued or running, by request id
        self.lock = threading.Lock()

    def handle(self, line: bytes) -> bool:
        """Serve one request line; True when the host should exit."""
        rid: object = None
        try:
            try:
                req = json.loads(line)
            except ValueError as e:
                raise HostError("invalid", f"request is not JSON: {e}") from e
            if not isinstance(req, dict):
                raise HostError("invalid", "request must be a JSON object")
            rid = req.get("id")
            op = req.get("op")
            handler = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
            if handler is None:
                raise HostError("invalid", f"unknown op {op!r}")
            return bool(handler(rid, req))
        except HostError as e:
            self.out.failed(rid, e)
        except Exception as e:
            _log(f"request {rid!r} crashed: {e!r}")
            self.out.failed(rid, HostError("internal", f"code host error: {e!r}"))
        return False

    def _lookup(self, req: dict[str, Any]) -> Context:
        cid = req.get("context_id")
        if not isinstance(cid, str):
            raise HostError("invalid", "context_id must be a string")
        with self.lock:
            ctx = self.contexts.get(cid)
        if ctx is None:
            raise HostError("not_found", f"no context {cid!r}; list_contexts shows the live ones")
        return ctx

    def _new_context(
        self, language: str, cwd: str, envs: dict[str, str], default: bool, rid: object
    ) -> Context:
        """Register a context and queue its start; with rid, the start replies to it.
        Caller holds self.lock."""
        ctx = Context(self, language, cwd, envs, default)
        self.contexts[ctx.id] = ctx
        if default:
            self.defaults[language] = ctx

        def run() -> None:
            try:
                ctx.start()
            except HostError as e:
                backend = ctx.backend
                if backend is None or backend.kill_reason != "restarted":
                    self._forget(ctx)  # a restart_context is queued otherwise: keep it
                    ctx.close(e, "start_failed")
                if rid is not None:
                    self.out.failed(rid, e)
                return
            if rid is not None:
                self.out.done(rid, context=ctx.describe())

        def cancel(e: HostError) -> None:
            if rid is not None:
                self.out.failed(rid, e)

        ctx.submit(Job(run, cancel))
        return ctx

    def _forget(self, ctx: Context) -> None:
        with self.lock:
            self.contexts.pop(ctx.id, None)
            if self.defaults.get(ctx.language) is ctx:
                del self.defaults[ctx.language]

    def _default(self, language: str) -> Context:
        with self.lock:
            ctx = self.defaults.get(language)
            if ctx is None:
                ctx = self._new_context(language, self.cwd, {}, True, None)
            return ctx

    @staticmethod
    def _language(value: object, default: str | None = None) -> str:
        if value is None and default is not None:
            return default
        if value not in LANGUAGES:
            raise HostError("invalid", f"language must be one of {', '.join(LANGUAGES)}")
        return str(value)

    # ops

    def op_create_context(self, rid: object, req: dict[str, Any]) -> None:
        language = self._language(req.get("language"))
        cwd = req.get("cwd") or self.cwd
        if not isinstance(cwd, str):
            raise HostError("invalid", "cwd must be a string")
        cwd = os.path.join(self.cwd, cwd)
        if not os.path.isdir(cwd):
            raise HostError("invalid", f"cwd {cwd!r} is not a directory")
        envs = _str_dict(req.get("envs"), "envs")
        if language == "bash":
            _check_env_names(envs)
        with self.lock:
            self._new_context(language, cwd, envs, False, rid)

    def op_list_contexts(self, rid: object, req: dict[str, Any]) -> None:
        with self.lock:
            contexts = [c.describe() for c in self.contexts.values()]
        self.out.done(rid, contexts=contexts)

    def op_restart_context(self, rid: object, req: dict[str, Any]) -> None:
        ctx = self._lookup(req)
        old = ctx.backend  # before queueing: the worker may replace it at once

        def run() -> None:
            try:
                ctx.start()
            except HostError as e:
                self.out.failed(rid, e)
                return
            self.out.done(rid, context=ctx.describe())

        ctx.submit(Job(run, lambda e: self.out.failed(rid, e)), front=True)
        if old is not None:
            old.kill("restarted")  # a running cell fails kernel_dead; queued ones wait

    def op_remove_context(self, rid: object, req: dict[str, Any]) -> None:
        ctx = self._lookup(req)
        self._forget(ctx)
        ctx.close(HostError("not_found", f"context {ctx.id} was removed"), "removed")
        self.out.done(rid)

    def op_set_env(self, rid: object, req: dict[str, Any]) -> None:
        envs = _str_dict(req.get("envs"), "envs")
        _check_env_names(envs)
        with self.lock:
            self.env.update(envs)
            contexts = list(self.contexts.values())
        for ctx in contexts:
            ctx.envs = {k: v for k, v in ctx.envs.items() if k not in envs}

            def run(ctx: Context = ctx) -> None:
                backend = ctx.backend
                if backend is None or backend.dead:
                    return  # a restart will start from the updated env
                try:
                    backend.set_env(envs)
                except HostError as e:
                    _log(f"context {ctx.id}: set_env: {e.message}")

            ctx.submit(Job(run, lambda e: None))
        self.out.done(rid)

    def op_warm(self, rid: object, req: dict[str, Any]) -> None:
        languages = req.get("languages")
        if not isinstance(languages, list) or not languages:
            raise HostError("invalid", "languages must be a non-empty list")
        contexts = [self._default(self._language(lang)) for lang in dict.fromkeys(languages)]
        latch = _Latch(self.out, rid, contexts)
        for ctx in contexts:

            def run(ctx: Context = ctx) -> None:
                try:
                    ctx.usable()
                except HostError as e:
                    latch.arrive(e)
                    return
                latch.arrive(None)

            ctx.submit(Job(run, latch.arrive))

    def op_execute(self, rid: object, req: dict[str, Any]) -> None:
        code = req.get("code")
        if not isinstance(code, str):
            raise HostError("invalid", "code must be a string")
        envs = _str_dict(req.get("envs"), "envs")
        timeout = req.get("timeout")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0
        ):
            raise HostError("invalid", "timeout must be a non-negative number of seconds")
        if req.get("context_id") is not None:
            ctx = self._lookup(req)
            language = req.get("language")
            if language is not None and language != ctx.language:
                raise HostError(
                    "invalid",
                    f"context {ctx.id} runs {ctx.language}, not {language!r}; "
                    "pass context_id or language, not both",
                )
        else:
            ctx = self._default(self._language(req.get("language"), "python"))
        run = Run(rid, code, envs, float(timeout) if timeout else None, self.out)
        if isinstance(rid, int):
            with self.lock:
                self.runs[rid] = run

        def job() -> None:
            try:
                if run.cancelled:  # its client went away while it queued: it never runs
                    self.out.failed(rid, HostError("invalid", "cancelled before it ran"))
                    return
                try:
                    backend = ctx.usable()
                except HostError as e:  # dead before this cell: nothing of it ran
                    self.out.failed(rid, e)
                    return
                try:
                    backend.execute(run)
                except HostError as e:
                    if e.code == "kernel_dead":
                        # Died under this cell: an error the caller's code can catch, as E2B's
                        # clients expect, before the failure that says the context is gone.
                        run.emit(
                            "error",
                            error={"name": "KernelDied", "value": e.message, "traceback": ""},
                        )
                    self.out.failed(rid, e)
            finally:
                self._ran(rid)

        def cancelled(e: HostError) -> None:
            self._ran(rid)
            self.out.failed(rid, e)

        # Taken: the caller learns now (not at the cell's first output, which a silent cell
        # sends only at its end) that nothing was refused, and can hand its client a stream.
        self.out.send({"id": rid, "event": "accepted"})
        ctx.submit(Job(job, cancelled))

    def _ran(self, rid: object) -> None:
        with self.lock:
            if isinstance(rid, int):
                self.runs.pop(rid, None)

    def op_cancel(self, rid: object, req: dict[str, Any]) -> None:
        """`{target}`: the execution of request `target` is interrupted as its timeout would
        (or never runs, if it is still queued); done either way, also for one that ended."""
        target = req.get("target")
        with self.lock:
            run = self.runs.get(target) if isinstance(target, int) else None
        if run is not None:
            run.cancel()
        self.out.done(rid)

    def op_shutdown(self, rid: object, req: dict[str, Any]) -> bool:
        self.close()
        self.out.done(rid)
        return True

    def close(self) -> None:
        """Kill every interpreter and wait for them, then drop the runtime dir."""
        with self.lock:
            contexts = list(self.contexts.values())
            self.contexts.clear()
            self.defaults.clear()
        gone = HostError("not_found", "the code host is shutting down")
        for ctx in contexts:
            ctx.close(gone, "removed")
        for ctx in contexts:
            ctx._thread.join(timeout=5)
            if ctx.backend is not None:  # in case the worker is wedged
                ctx.backend.reap()
        try:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        except RecursionError:  # a tree made thousands deep in it: /tmp goes with the sandbox
            _log(f"left {self.runtime_dir}: too deep to remove")


def main() -> int:
    # Keep the protocol fds private: fd 0 becomes /dev/null and fd 1 a copy of stderr, so
    # nothing this process or its children print can land in (or read from) the protocol.
    proto_in = os.dup(0)
    proto_out = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    os.close(devnull)
    for fd in (proto_in, proto_out):
        os.set_inheritable(fd, False)
    host = CodeHost(Output(proto_out))

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    # Handlers, not SIG_IGN: an ignored SIGINT (we may be started from a background job) would
    # be inherited by every interpreter and the programs it runs, and no cell could be stopped.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, stop)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    try:
        with os.fdopen(proto_in, "rb") as requests:
            for line in requests:
                if line.strip() and host.handle(line):
                    break
    finally:
        host.close()
    return 0


if __name__ == "__main__":
    status = main()
    sys.stderr.flush()
    # Not sys.exit: interpreter shutdown could hang in zmq's context teardown if a worker is
    # wedged, and every child is dead by now anyway.
    os._exit(status)
