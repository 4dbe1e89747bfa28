"""The agent's side of the code interpreter: one code host process per sandbox, multiplexed.

`code_host.py` (started on first use with the sandbox's own python3, so it sees the template's
ipykernel) owns the kernels and speaks JSON lines on its stdin/stdout: a request carries an
`id`, and every event for it carries the same `id`, ending with `done` or `failed`. Many agent
connections share that one pipe; a reader thread hands each event to the queue of the request
that asked. Imported lazily: sandboxes that never run code never pay for it.

Standard library only (it runs inside every sandbox).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading

import users

HOST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_host.py")
TERMINAL = ("done", "failed")
# The host's failure codes, as the agent protocol names them (their statuses: vocab.STATUS).
CODES = {
    "invalid": "invalid_request",
    "not_found": "context_not_found",
    "unsupported": "unsupported",
    "kernel_dead": "kernel_dead",
    "busy": "conflict",
}


def _python(env: dict) -> str:
    """The python3 first on the sandbox's PATH (a template's user environment, whose pip
    installs into what the kernel imports), else the agent's own."""
    import shutil

    return shutil.which("python3", path=env.get("PATH")) or sys.executable


class HostGone(Exception):
    """The code host could not be started or died."""


class CodeHost:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.waiters: dict[int, queue.SimpleQueue] = {}
        self.seq = 0
        self.envs: dict[str, str] = {}

    def _ensure(self) -> subprocess.Popen:
        """The running host (started if needed); caller holds the lock."""
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        env = users.environment(users.DEFAULT, dict(os.environ))
        env.update(self.envs)
        try:
            with users.spawning_as(users.DEFAULT):
                proc = subprocess.Popen(
                    [_python(env), "-s", HOST],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    cwd=os.getcwd(),
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                )
            threading.Thread(target=self._read, args=(proc,), daemon=True).start()
        except (OSError, RuntimeError) as e:
            raise HostGone(f"could not start the code interpreter: {e}") from None
        self.proc = proc
        return proc

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
                rid = event["id"]
            except (ValueError, KeyError, TypeError):
                continue
            with self.lock:
                q = self.waiters.get(rid)
                if event.get("event") in TERMINAL:
                    self.waiters.pop(rid, None)
            if q is not None:
                q.put(event)
        proc.wait()
        with self.lock:
            if self.proc is proc:
                self.proc = None
            orphans = list(self.waiters.values())
            self.waiters.clear()
        gone = {
            "event": "failed",
            "code": "kernel_dead",
            "message": "the code interpreter process exited; retry to start a new one",
        }
        for q in orphans:
            q.put(gone)

    def request(self, op: str, args: dict) -> tuple[int, queue.SimpleQueue]:
        """Send a request; its id, and the queue its events arrive on, ending with a terminal."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        with self.lock:
            proc = self._ensure()
            self.seq += 1
            rid = self.seq
            self.waiters[rid] = q
            line = json.dumps({**args, "id": rid, "op": op}) + "\n"
            try:
                assert proc.stdin is not None
                proc.stdin.write(line.encode())
                proc.stdin.flush()
            except OSError as e:
                self.waiters.pop(rid, None)
                raise HostGone(f"the code interpreter is not answering: {e}") from None
        return rid, q

    def abandon(self, rid: int) -> None:
        """Nobody waits for request `rid` any more: its events are dropped, and an execution
        it started is interrupted (the host's `cancel`)."""
        with self.lock:
            if self.waiters.pop(rid, None) is None:
                return  # it has ended
        try:
            cancel, _ = self.request("cancel", {"target": rid})
        except HostGone:
            return
        with self.lock:
            self.waiters.pop(cancel, None)  # its own reply is dropped too

    def call(self, op: str, args: dict) -> dict:
        """A request whose only interesting event is its terminal one."""
        _, q = self.request(op, args)
        while True:
            event = q.get()
            if event.get("event") in TERMINAL:
                return event

    def set_env(self, envs: dict[str, str]) -> None:
        """New defaults for commands and code: this agent's environment and every context's."""
        os.environ.update(envs)
        with self.lock:
            self.envs.update(envs)
            running = self.proc is not None and self.proc.poll() is None
        if running:
            self.call("set_env", {"envs": envs})


HOST_PROCESS = CodeHost()


def failure(event: dict) -> tuple[str, str]:
    """(agent error code, message) of a `failed` event."""
    code = str(event.get("code", "internal"))
    return CODES.get(code, "code_host_error"), str(event.get("message", "code interpreter error"))
