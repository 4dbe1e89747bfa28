"""`agentbox exec` on a short path: the standard library only, no typer, no httpx, no SDK.

The whole CLI takes ~160 ms to import on a 2-core host (the SDK with httpx, typer, rich's
stand-ins), most of an `agentbox exec ID -- true` that an agent may run hundreds of times.
`run` answers `agentbox [--api-url U] [--api-key K] exec [OPTIONS] ID -- CMD...` itself when
it understands every word of it and the server is plain HTTP (the local one); for anything else
(another command, `--help`, an option spelt another way, https, no API key) it returns None and
the full CLI runs, as it always did.

It speaks only the usual course of the command protocol: the POST that starts the command and
streams its events (NDJSON, chunked), the output written as it comes, stdin forwarded, the
`end` event and the exit status. Everything else has one implementation, the SDK's:

- the server refuses the POST (no such sandbox, paused, bad option, quota): nothing started,
  so the full CLI runs the same command line and reports the refusal its usual way;
- the server cannot be reached: the same;
- the POST went out and no answer came: the command may have started, so it is not sent again:
  the error is the SDK's (`agentbox.cli.app.continue_exec`), as for a request that got none;
- after the POST was answered, the stream breaks, goes silent too long, sends an `error` event
  or a line that is not JSON, or Ctrl-C is pressed: `agentbox.cli.app.continue_exec` takes the
  command over where this left it (its id and output offset), resuming or reporting as the SDK
  does.
"""

from __future__ import annotations

import json
import os
import socket
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from io import BufferedReader
    from typing import Any, NoReturn

# The exit code `timeout(1)` uses, so scripts can tell a timeout from a failure.
TIMEOUT_EXIT = 124
# The stdin route takes at most this many characters per request; each request is audited,
# so piped input goes in pieces this large when it is there to read.
STDIN_PIECE = 1 << 20
DROPPED = ("{} bytes of output were dropped before they were read (nobody followed the command "
           "while the sandbox's output buffer overflowed: 4 MiB per command, 16 MiB per sandbox)")
NOT_UTF8 = ("stdin is not UTF-8 text: its invalid bytes were replaced (copy binary files with "
            "`agentbox cp`)")
# As the SDK's client: its server (config.DEFAULT_API_URL, which this module does not import:
# pathlib), its request timeout, and the silence allowed on a command's stream beyond the
# command's own timeout (protocol.STREAM_GRACE). tests/unit/test_cli_quick_parse.py holds them
# equal.
DEFAULT_API_URL = "http://127.0.0.1:8686"
REQUEST_TIMEOUT = 60.0
STREAM_GRACE = 30.0
# Bounds on what is read of an answer's head: a server that sends more is not one to talk to.
_HEAD_LINE = 65536
_HEAD_LINES = 100
_VALUED = {"--cwd": "cwd", "--env": "env", "-e": "env", "--user": "user", "-u": "user",
           "--timeout": "timeout"}
_GLOBAL = {"--api-url": "api_url", "--api-key": "api_key"}
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-~")


class Exec:
    """One `agentbox exec` command line, as the full CLI would read it."""

    def __init__(self) -> None:
        self.api_url: str | None = None
        self.api_key: str | None = None
        self.sandbox_id = ""
        self.cmd: list[str] = []
        self.cwd: str | None = None
        self.env: list[str] = []
        self.user: str | None = None
        self.timeout = 60.0
        self.stdin: bool | None = None

    def set(self, name: str, value: str) -> bool:
        if name == "env":
            self.env.append(value)
        elif name == "timeout":
            try:
                self.timeout = float(value)
            except ValueError:
                return False
            return abs(self.timeout) < float("inf")  # NaN and infinities: the full CLI's
        else:
            setattr(self, name, value)
        return True

    def line(self) -> str:
        if len(self.cmd) == 1:
            return self.cmd[0]
        import shlex

        return shlex.join(self.cmd)

    def envs(self) -> dict[str, str] | None:
        envs: dict[str, str] = {}
        for item in self.env:
            key, sep, value = item.partition("=")
            if not sep or not key:
                return None  # a usage error, which the full CLI words
            envs[key] = value
        return envs


def parse(argv: list[str]) -> Exec | None:
    """The command line when it is an `exec` this module reads exactly as typer would."""
    line = Exec()
    i = _options(argv, 0, _GLOBAL, line)
    if i is None or i >= len(argv) or argv[i] != "exec":
        return None
    i += 1
    while i < len(argv) and argv[i] != "--":
        word = argv[i]
        if word in ("--stdin", "--no-stdin"):
            line.stdin = word == "--stdin"
            i += 1
        elif word.startswith("-"):
            after = _options(argv, i, _VALUED, line, one=True)
            if after is None:
                return None
            i = after
        elif not line.sandbox_id:
            line.sandbox_id = word
            i += 1
        else:
            return None  # the command's words without `--` before them
    line.cmd = argv[i + 1:]
    if not line.sandbox_id or not line.cmd:
        return None
    return line


def _options(argv: list[str], i: int, known: dict[str, str], line: Exec,
             one: bool = False) -> int | None:
    """Read `--name VALUE` and `--name=VALUE` options from i; where they end, None if unknown."""
    while i < len(argv) and argv[i].startswith("-"):
        name, eq, value = argv[i].partition("=")
        if name not in known or (eq and not name.startswith("--")):
            return None
        if not eq:
            if i + 1 >= len(argv):
                return None
            i, value = i + 1, argv[i + 1]
        if not line.set(known[name], value):
            return None
        i += 1
        if one:
            break
    return i


class Server:
    """A plain-HTTP agentbox server: where to connect and what to send with each request."""

    def __init__(self, url: str, key: str) -> None:
        self.url = url
        self.key = key
        rest = url[len("http://"):]
        self.netloc, _, path = rest.partition("/")
        self.prefix = "/" + path if path else ""
        host, port = self.netloc, "80"
        if host.startswith("["):
            host, _, after = host[1:].partition("]")
            port = after[1:] if after.startswith(":") else ("80" if not after else "")
        elif ":" in host:
            host, _, port = host.partition(":")
        self.address = (host, int(port) if port.isdigit() else -1)
        from agentbox import __version__

        self.head = (f"Host: {self.netloc}\r\nX-API-Key: {key}\r\n"
                     f"User-Agent: agentbox-sdk/{__version__}\r\nAccept: */*\r\n"
                     "Connection: close\r\n")

    @classmethod
    def resolve(cls, api_url: str | None, api_key: str | None) -> Server | None:
        """As the SDK's resolve_config, when the result is a URL this module can talk to."""
        url = (api_url or os.environ.get("AGENTBOX_API_URL") or DEFAULT_API_URL).rstrip("/")
        key = api_key or os.environ.get("AGENTBOX_API_KEY")
        if not key:
            from agentbox.config import local_admin_key

            key = local_admin_key()
        if not key or not url[:7].lower() == "http://" or not _plain(url) or not _plain(key):
            return None
        server = cls("http://" + url[7:], key)
        host, port = server.address
        if not host or not 0 < port < 65536:
            return None
        return server

    def send(self, method: str, path: str, body: Any = None,
             timeout: float | None = REQUEST_TIMEOUT) -> Answer:
        """Send one request on a new connection; the answer's head is read."""
        data = b""
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n{self.head}"
        if body is not None:
            # As httpx encodes a json= body.
            data = json.dumps(body, ensure_ascii=False, separators=(",", ":"),
                              allow_nan=False).encode("utf-8")
            head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        try:
            sock = socket.create_connection(self.address, timeout=REQUEST_TIMEOUT)
        except OSError as e:
            raise Unreached(str(e)) from None
        try:
            sock.sendall(head.encode("ascii") + b"\r\n" + data)
            sock.settimeout(timeout)
            return Answer(sock)
        except BaseException:
            sock.close()
            raise


def _plain(text: str) -> bool:
    """Nothing that could end a header line or change a URL's meaning."""
    return text.isascii() and text.isprintable() and not any(c in text for c in " @?#%\\")


def _quote(value: str) -> str:
    """An id in a URL path, as urllib.parse.quote(value, safe="") writes it."""
    return "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in value.encode("utf-8"))


class Broken(Exception):
    """The answer stopped making sense or stopped coming."""


class Unreached(Exception):
    """No connection to the server: nothing was sent."""


class Answer:
    """An HTTP/1.1 answer read from a socket: status and headers, then the body as it comes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.file: BufferedReader = sock.makefile("rb")
        first = self.file.readline(_HEAD_LINE)
        parts = first.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise Broken(f"not an HTTP answer: {first[:80]!r}")
        self.status = int(parts[1])
        self.headers: dict[str, str] = {}
        for _ in range(_HEAD_LINES):
            line = self.file.readline(_HEAD_LINE)
            if not line.endswith(b"\n"):
                raise Broken("the answer's head was cut off")
            if not line.strip():
                break
            name, _, value = line.decode("latin-1").partition(":")
            self.headers[name.strip().lower()] = value.strip()
        else:
            raise Broken("the answer's head has too many lines")

    def chunks(self) -> Iterator[bytes]:
        """The body, as it arrives; Broken if it ends before its end."""
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = self.file.readline(1024)
                try:
                    size = int(size_line.split(b";", 1)[0], 16)
                except ValueError:
                    raise Broken("the answer's body was cut off") from None
                if size == 0:
                    return
                data = self.file.read(size + 2)
                if len(data) < size + 2:
                    raise Broken("the answer's body was cut off")
                yield data[:size]
        try:
            left = int(self.headers.get("content-length", -1))
        except ValueError:
            raise Broken("the answer's length is not a number") from None
        while left:
            data = self.file.read1(65536 if left < 0 else min(left, 65536))
            if not data:
                if left > 0:
                    raise Broken("the answer's body was cut off")
                return
            left -= len(data) if left > 0 else 0
            yield data

    def body(self, limit: int = 1 << 20) -> bytes:
        data = b""
        for chunk in self.chunks():
            data += chunk
            if len(data) > limit:
                break
        return data[:limit]

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def run(argv: list[str]) -> int | None:
    """Run `agentbox exec` on the short path; its exit status, or None: the full CLI's to run."""
    if os.environ.get("AGENTBOX_CLI_QUICK", "1") == "0":
        return None
    line = parse(argv)
    if line is None:
        return None
    server = Server.resolve(line.api_url, line.api_key)
    envs = line.envs()
    if server is None or envs is None:
        return None
    forward = not sys.stdin.isatty() if line.stdin is None else line.stdin
    body: dict[str, Any] = {"cmd": line.line(), "cwd": line.cwd, "envs": envs,
                            "timeout": line.timeout, "background": False, "stdin": forward}
    if line.user is not None:
        body["user"] = line.user
    stream = CommandStream(server, line.sandbox_id, forward, line.timeout)
    try:
        answer = server.send("POST", f"/v1/sandboxes/{_quote(line.sandbox_id)}/commands", body,
                             None if not line.timeout else line.timeout + STREAM_GRACE)
    except (Unreached, ValueError):
        return None  # nothing sent (no server there, or a body httpx would not send either)
    except (OSError, Broken) as e:
        # Sent, and no answer: the command may have started, so it must not run again; the
        # SDK's words for a request that got no answer.
        return stream._hand_over("unanswered", e)
    if not 200 <= answer.status < 300:
        answer.close()
        return None  # refused, so nothing started: the full CLI runs it and reports why
    try:
        return stream.follow(answer)
    finally:
        answer.close()


class CommandStream:
    """A command's events, from the POST's answer, written out as they come."""

    def __init__(self, server: Server, sandbox_id: str, forward: bool, timeout: float) -> None:
        self.server = server
        self.sandbox_id = sandbox_id
        self.forward = forward
        self.timeout = timeout
        self.cmd_id: str | None = None
        self.pid: int | None = None
        self.offset = 0
        self.dropped = 0
        self.ended: Any = None  # a threading.Event once stdin is being forwarded

    def follow(self, answer: Answer) -> int:
        try:
            end = self._events(answer)
        except KeyboardInterrupt:
            if self.cmd_id is None:
                return 130
            return self._hand_over("interrupt", None)
        finally:
            if self.ended is not None:
                self.ended.set()
        if isinstance(end, tuple):
            return self._hand_over(*end)
        return self._finish(end)

    def _events(self, answer: Answer) -> dict[str, Any] | tuple[str, Any]:
        """The `end` event, or why the SDK must take over: (kind, what). Errors writing the
        output are not the stream's: they leave from here (a closed pipe ends the CLI)."""
        rest = b""
        chunks = answer.chunks()
        while True:
            try:
                chunk = next(chunks)
            except StopIteration:
                break
            except TimeoutError:
                return "timeout", None
            except (OSError, Broken):
                break
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            for raw in lines:
                text = raw.decode("utf-8", "replace").strip()
                if not text:
                    continue
                try:
                    event = json.loads(text)
                except ValueError:
                    return "line", text
                if not isinstance(event, dict):
                    continue
                kind = event.get("type")
                if kind in ("stdout", "stderr"):
                    data = str(event.get("data", ""))
                    self.offset += len(data.encode("utf-8", "surrogatepass"))
                    out = sys.stdout if kind == "stdout" else sys.stderr
                    out.write(data)
                    out.flush()
                elif kind == "start":
                    self._started(event)
                elif kind == "truncated":
                    dropped = int(event.get("dropped") or 0)
                    self.dropped += dropped
                    self.offset += dropped
                elif kind == "end":
                    return event
                elif kind == "error":
                    return "event", event
                # Unknown event types are skipped so newer servers stay readable (as the SDK).
        if rest.strip():
            return "line", rest.decode("utf-8", "replace").strip()
        return "broken", None

    def _started(self, event: dict[str, Any]) -> None:
        first = self.cmd_id is None
        self.cmd_id = str(event.get("cmd_id")) if event.get("cmd_id") else self.cmd_id
        self.pid = event.get("pid", self.pid)
        if first and self.forward and self.cmd_id is not None:
            import threading

            self.ended = threading.Event()
            threading.Thread(target=self._forward_stdin, args=(self.cmd_id,),
                             daemon=True).start()

    def _forward_stdin(self, cmd_id: str) -> None:
        """This process's stdin to the command as it comes, then its end (as app's)."""
        path = f"/v1/sandboxes/{_quote(self.sandbox_id)}/commands/{_quote(cmd_id)}/stdin"
        warned = False
        try:
            for text, replaced in utf8_pieces():
                if replaced and not warned:
                    warn(NOT_UTF8)
                    warned = True
                if not self._send_stdin(path, text, False):
                    return
            self._send_stdin(path, "", True)
        except Exception as e:  # a thread's traceback is no message; after the end, not news
            if not self.ended.is_set():
                warn(f"stopped forwarding stdin: {e}")

    def _send_stdin(self, path: str, data: str, eof: bool) -> bool:
        """False when the command ended or closed its stdin (409): like a pipe's reader leaving."""
        answer = self.server.send("POST", path, {"data": data, "eof": eof})
        try:
            if answer.status == 409:
                return False
            if not 200 <= answer.status < 300:
                raise RuntimeError(error_text(answer.status, answer.body()))
            return True
        finally:
            answer.close()

    def _finish(self, end: dict[str, Any]) -> int:
        """What the full CLI prints and exits with at a command's end."""
        exit_code = end.get("exit_code")
        timed_out = bool(end.get("timed_out"))
        sys.stdout.flush()
        if self.dropped:
            warn(DROPPED.format(self.dropped))
        if exit_code == 0 and not timed_out:
            return 0
        violation = end.get("violation")
        if isinstance(violation, dict):
            print(str(violation.get("message", "")), file=sys.stderr)
        elif exit_code is None:
            print("command timed out" if timed_out else "command ended without an exit code",
                  file=sys.stderr)
        return exit_status(exit_code, timed_out)

    def _hand_over(self, kind: str, what: Any) -> int:
        sys.stdout.flush()
        from agentbox.cli.app import continue_exec

        return continue_exec(self, kind, what)


def utf8_pieces() -> Iterator[tuple[str, bool]]:
    """Stdin in pieces as it comes, as text; each byte that is not UTF-8 becomes U+FFFD, and
    the flag says whether any did."""
    for piece in stdin_pieces():
        text = piece.decode("utf-8", "surrogateescape")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            import re

            yield re.sub("[\udc80-\udcff]", "\ufffd", text), True
        else:
            yield text, False


def stdin_pieces() -> Iterator[bytes]:
    # os.read, not sys.stdin: a thread left blocked in a buffered read at exit aborts Python.
    import select

    while True:
        piece = os.read(0, STDIN_PIECE)
        if not piece:
            return
        while len(piece) < STDIN_PIECE and select.select([0], [], [], 0)[0]:
            more = os.read(0, STDIN_PIECE - len(piece))
            if not more:
                yield piece
                return
            piece += more
        yield piece


def exit_status(exit_code: int | None, timed_out: bool) -> int:
    if timed_out:
        return TIMEOUT_EXIT
    if exit_code is None:
        return 1
    if exit_code < 0:
        return 128 - exit_code  # shell convention for "killed by signal N"
    return exit_code


def error_text(status: int, body: bytes) -> str:
    """An error answer as the SDK's errors print: the server's message and code."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict) and "message" in data:
        code = str(data.get("code") or f"http_{status}")
        message = str(data["message"])
    else:
        code = f"http_{status}"
        message = body.decode("utf-8", "replace").strip()[:500] or f"HTTP {status}"
    return f"{message} ({code})" if code != "error" else message


def reader_left() -> NoReturn:
    """Stdout's reader left (`agentbox exec ID -- cat big | head`): exit quietly, as other
    tools do, without a second BrokenPipeError from the flush at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(141)


def warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)
