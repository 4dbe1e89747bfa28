"""A loopback TCP server standing in for a server in a sandbox, for the gateway's tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable


class RawServer:
    """A loopback TCP server running `handler` in a thread per connection; `ended` is set for
    each connection once the handler is done (for the hostile ones: the gateway hung up)."""

    def __init__(self, handler: Callable[[socket.socket], None]) -> None:
        self.handler = handler
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.ended: list[float] = []
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self.handler(conn)
        except OSError:
            pass
        finally:
            self.ended.append(time.monotonic())
            conn.close()

    def wait_ended(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.ended) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(self.ended) >= n
