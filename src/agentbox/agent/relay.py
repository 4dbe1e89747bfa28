"""Byte relays between the sandbox's loopback and the host, for runtimes whose sandbox has a
network stack of its own that the server cannot enter (gVisor's netstack).

- `net.connect` (exposed ports): the server connects to the agent's socket and asks for a port;
  the agent connects to it on the sandbox's loopback, answers, and from then on the server's
  connection carries that TCP stream's bytes both ways.
- `net.listen` (the egress proxy): the agent listens on the sandbox's loopback at the proxy's
  port and relays every connection made there to a Unix socket the server listens on, in the
  channel directory only the sandbox's root can enter. The proxy tells sandboxes apart by that
  socket, never by anything a sandbox says.

Every relay lives on one thread with a selector (threads count against the sandbox's process
limit): per direction at most BUFFER bytes wait, and a half-close is passed on.
`close_relays` ends every relay (a checkpoint wants no host socket open).
"""

from __future__ import annotations

import _socket
import os
import selectors
import threading

BUFFER = 256 * 1024
LOOPBACK = ("127.0.0.1", "::1")


class _Pipe:
    """One direction of a relay: what was read from `src` and not yet written to `dst`."""

    def __init__(self, src: _socket.socket, dst: _socket.socket) -> None:
        self.src, self.dst = src, dst
        self.buf = bytearray()
        self.eof = False  # src has no more to send
        self.done = False  # ... and all of it reached dst (dst was shut down for writing)


class Relays:
    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self.lock = threading.Lock()
        self.pending: list[tuple[str, object]] = []
        self.listeners: dict[int, tuple[_socket.socket, str]] = {}  # port -> (sock, to)
        self.pairs: list[tuple[_Pipe, _Pipe]] = []
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.sel.register(self.wake_r, selectors.EVENT_READ, ("wake", None))
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ from other threads

    def _post(self, what: str, arg: object) -> None:
        with self.lock:
            self.pending.append((what, arg))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="relays", daemon=True)
                self.thread.start()
        try:
            os.write(self.wake_w, b"x")
        except BlockingIOError:
            pass

    def pair(self, a: _socket.socket, b: _socket.socket) -> None:
        """Relay between two connected sockets until both sides are done; owns them now."""
        self._post("pair", (a, b))

    def listen(self, port: int, to: str) -> None:
        """Relay every connection to the sandbox's 127.0.0.1:`port` to the Unix socket `to`
        (idempotent: a second call only updates `to`)."""
        with self.lock:
            if port in self.listeners:
                sock, _ = self.listeners[port]
                self.listeners[port] = (sock, to)
                return
        sock = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
        sock.setblocking(False)
        with self.lock:
            self.listeners[port] = (sock, to)
        self._post("listener", port)

    def close_relays(self) -> None:
        """End every relay (both sides); the listeners on the sandbox's loopback stay (they
        are the sandbox kernel's own sockets, not the host's)."""
        if self.thread is None:
            return
        done = threading.Event()
        self._post("close_relays", done)
        done.wait(5)

    # ------------------------------------------------------------------ the relay thread

    def _run(self) -> None:
        while True:
            for key, _ in self.sel.select():
                kind, obj = key.data
                if kind == "wake":
                    self._drain_wake()
                elif kind == "listener":
                    self._accept(obj)  # type: ignore[arg-type]
                else:
                    self._service(obj)  # type: ignore[arg-type]

    def _drain_wake(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        with self.lock:
            work, self.pending = self.pending, []
        for what, arg in work:
            if what == "pair":
                assert isinstance(arg, tuple)
                self._add_pair(arg[0], arg[1])
            elif what == "listener":
                with self.lock:
                    sock, _ = self.listeners[arg]  # type: ignore[index]
                self.sel.register(sock, selectors.EVENT_READ, ("listener", arg))
            elif what == "close_relays":
                for pair in list(self.pairs):
                    self._close_pair(pair)
                arg.set()  # type: ignore[attr-defined]

    def _accept(self, port: int) -> None:
        with self.lock:
            sock, to = self.listeners[port]
        try:
            fd, _ = sock._accept()  # type: ignore[attr-defined]  # accept4(CLOEXEC)
        except OSError:  # nothing after all, or the client gave up
            return
        conn = _socket.socket(fileno=fd)
        out = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            out.connect(to)
        except OSError:
            conn.close()  # the server is not serving this port now: the client sees a reset
            out.close()
            return
        self._add_pair(conn, out)

    def _add_pair(self, a: _socket.socket, b: _socket.socket) -> None:
        a.setblocking(False)
        b.setblocking(False)
        pair = (_Pipe(a, b), _Pipe(b, a))
        self.pairs.append(pair)
        self._watch(pair)

    def _watch(self, pair: tuple[_Pipe, _Pipe]) -> None:
        """(Re-)register both sockets for what each direction needs now."""
        for sock in (pair[0].src, pair[1].src):
            want = 0
            for pipe in pair:
                if pipe.src is sock and not pipe.eof and len(pipe.buf) < BUFFER:
                    want |= selectors.EVENT_READ
                if pipe.dst is sock and pipe.buf:
                    want |= selectors.EVENT_WRITE
            try:
                if want:
                    try:
                        self.sel.modify(sock, want, ("pair", pair))
                    except KeyError:
                        self.sel.register(sock, want, ("pair", pair))
                else:
                    self.sel.unregister(sock)
            except (KeyError, ValueError, OSError):
                pass

    def _service(self, pair: tuple[_Pipe, _Pipe]) -> None:
        try:
            for pipe in pair:
                if not pipe.eof and len(pipe.buf) < BUFFER:
                    try:
                        data = pipe.src.recv(BUFFER - len(pipe.buf))
                    except (BlockingIOError, InterruptedError):
                        data = None
                    if data == b"":
                        pipe.eof = True
                    elif data:
                        pipe.buf += data
                if pipe.buf:
                    try:
                        sent = pipe.dst.send(pipe.buf)
                        del pipe.buf[:sent]
                    except (BlockingIOError, InterruptedError):
                        pass
                if pipe.eof and not pipe.buf and not pipe.done:
                    pipe.done = True
                    try:
                        pipe.dst.shutdown(_socket.SHUT_WR)
                    except OSError:
                        pass
        except OSError:  # reset, broken pipe: the relay is over both ways
            self._close_pair(pair)
            return
        if pair[0].done and pair[1].done:
            self._close_pair(pair)
        else:
            self._watch(pair)

    def _close_pair(self, pair: tuple[_Pipe, _Pipe]) -> None:
        for sock in (pair[0].src, pair[1].src):
            try:
                self.sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        if pair in self.pairs:
            self.pairs.remove(pair)



RELAYS = Relays()


def connect_loopback(port: int, timeout: float) -> _socket.socket:
    """A connection to `port` on the sandbox's loopback (IPv4, then IPv6); raises the last
    OSError (ECONNREFUSED when nothing listens)."""
    last: OSError | None = None
    for host in LOOPBACK:
        family = _socket.AF_INET6 if ":" in host else _socket.AF_INET
        sock = _socket.socket(family, _socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect((host, port))
            sock.settimeout(None)
            return sock
        except OSError as e:
            sock.close()
            last = e
    assert last is not None
    raise last
