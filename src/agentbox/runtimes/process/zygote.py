"""The server's end of the agent's zygote (agent/zygote.py; docs/design/agent-zygote.md).

One zygote per runtime, started with the runtime and again when it is found dead; one request
at a time (a fork takes ~4 ms; creates queue on the lock, as they do on the user-namespace
helper's). A request that cannot be sent is sent again to a new zygote; one whose answer does
not come is never repeated (the agent may have been forked: a second one in the same sandbox
must not be), and the zygote, in a state nobody knows, is replaced.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LISTEN_FD = 3  # the forked agent's listening socket (agent/zygote.py puts it there)
ANSWER_TIMEOUT_S = 10.0
START_TIMEOUT_S = 15.0  # its imports, on a loaded host
ANSWER_MAX = 64 * 1024


# The zygote's program is sent on its socket, not named on its command line: no path of the
# server's data dir in its argv (a process naming one is one of the data dir's own to the host
# inventory, which a restarted server's new zygote is not), as the user-namespace helper's.
_BOOT = (
    "import runpy, socket, sys; s = socket.socket(fileno=int(sys.argv[1]));"
    " p = s.recv(4096).decode(); s.detach(); runpy.run_path(p, run_name='__main__')"
)


class ZygoteError(Exception):
    pass


class Zygote:
    def __init__(self, agent_dir: Path) -> None:
        self.program = agent_dir / "zygote.py"
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None

    def start(self) -> None:
        with self._lock:
            self._running()

    def fork_agent(self, request: dict[str, Any], fds: Sequence[int]) -> int:
        """The host pid of an agent forked into the sandbox `request["pid"]` is the init of."""
        message = json.dumps(request).encode()
        with self._lock:
            for attempt in (1, 2):
                sock = self._running()
                try:
                    socket.send_fds(sock, [message], list(fds))
                    break
                except OSError:
                    self._stop()
                    if attempt == 2:
                        raise ZygoteError("the agent's zygote keeps dying") from None
            try:
                sock.settimeout(ANSWER_TIMEOUT_S)
                answer = sock.recv(ANSWER_MAX)
            except OSError as e:
                self._stop()
                raise ZygoteError(f"the agent's zygote did not answer: {e}") from None
            if not answer:
                self._stop()
                raise ZygoteError("the agent's zygote died while forking an agent")
        reply = json.loads(answer)
        if "pid" not in reply:
            raise ZygoteError(f"the agent could not be forked: {reply.get('error')}")
        return int(reply["pid"])

    def pid(self) -> int | None:
        with self._lock:
            return self._proc.pid if self._proc is not None else None

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _running(self) -> socket.socket:
        if self._proc is not None and self._proc.poll() is None and self._sock is not None:
            return self._sock
        self._stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _BOOT, str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                close_fds=True,
                pass_fds=(theirs.fileno(),),
                env={},
                start_new_session=True,  # the agents' session: none of the server's
            )
        except OSError as e:
            ours.close()
            raise ZygoteError(f"could not start the agent's zygote: {e}") from None
        finally:
            theirs.close()
        self._sock = ours
        try:
            ours.settimeout(START_TIMEOUT_S)
            ours.send(str(self.program).encode())
            ready = ours.recv(ANSWER_MAX)
        except OSError as e:
            ready, failed = b"", str(e)
        else:
            failed = "" if ready else "it ended before it was ready (see the server's log)"
        if ready != b'{"ready": true}':
            self._stop()
            raise ZygoteError(f"the agent's zygote did not start: {failed or ready[:200]!r}")
        return ours

    def _stop(self) -> None:
        if self._sock is not None:
            self._sock.close()  # the zygote exits at the end of its socket
            self._sock = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None
