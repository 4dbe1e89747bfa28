"""The egress proxy server: HTTP proxy (CONNECT and plain HTTP) and SOCKS5, one per sandbox.

Each sandbox gets its own listening sockets (on its own loopback, see
`Runtime.listen_inside`), so which sandbox is asking is known from the socket, never from
anything the sandbox says. Every attempt goes through `_admit`: the policy decides on the name
the client asked for, the proxy resolves it itself and refuses internal addresses, and connects
to the address it checked (no second lookup a rebinding DNS server could answer differently).

HTTPS is tunnelled untouched, with one check: the SNI in the client's TLS hello must name the
host it asked CONNECT for. Only for hosts a secret of the sandbox is bound to does the proxy
terminate TLS (with the sandbox's own CA, which the sandbox trusts), speak TLS to the real
upstream, verifying it, and put the secret's value where its binding allows (`secrets`); the
responses of those hosts are scrubbed of the value on their way back.

Connections are budgeted per sandbox and per tenant (`_over_cap`): each costs the server two
descriptors, and a sandbox decides how many it opens. One past a cap is answered with why.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ipaddress
import logging
import socket
import ssl
import struct
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11

from agentbox.egress.addresses import AddressGuard, name_refusal, parse_ip_literal
from agentbox.egress.policy import Decision, EgressPolicy, Rule, RuleError, decide, normalize_host
from agentbox.egress.secrets import (
    ACCEPT_ENCODING,
    ECHO_METHODS,
    BoundSecret,
    Injection,
    ResponseBody,
    Scrubber,
    Uninspectable,
    inject,
)
from agentbox.egress.tls import EgressCA, client_sni, parse_client_hello, upstream_context

log = logging.getLogger(__name__)

HTTP_PORT = 3128
SOCKS_PORT = 1080
# Connections past a sandbox's or tenant's cap are still answered, with the reason (503, SOCKS
# general failure), in at most this many at once per sandbox and this long each; past that they
# are closed unanswered.
BUSY_ANSWERS = 8
BUSY_ANSWER_S = 5.0
HEAD_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0
RESOLVE_TIMEOUT_S = 5.0
HELLO_TIMEOUT_S = 10.0
_CHUNK = 256 * 1024
_HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-connection",
    b"proxy-authorization",
    b"proxy-authenticate",
    b"te",
    b"trailer",
    b"upgrade",
}


@dataclass
class SandboxEgress:
    sandbox_id: str
    tenant: str
    policy: EgressPolicy
    placeholders: dict[str, str]  # placeholder -> secret name
    ca: EgressCA | None = None
    servers: list[asyncio.AbstractServer] = field(default_factory=list)
    conns: set[asyncio.Task[Any]] = field(default_factory=set)
    # Connections over a cap, being answered with why (`_admit` refuses them).
    busy: dict[asyncio.Task[Any], Refused] = field(default_factory=dict)
    denials: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=100))


class Refused(Exception):
    """An attempt the proxy will not carry out; `rule` names what decided.

    A 403 is the network policy's; `secret` marks what the secrets' rules refuse (an echoing
    method, a response that cannot be scrubbed); anything else is a failure."""

    def __init__(
        self,
        rule: str,
        message: str,
        status: int = 403,
        socks_code: int = 2,
        secret: bool = False,
    ) -> None:
        super().__init__(message)
        self.rule = rule
        self.message = message
        self.status = status
        self.socks_code = socks_code
        self.secret = secret


@dataclass
class _Attempt:
    """One egress attempt, recorded when it ends."""

    sbx: SandboxEgress
    protocol: str
    host: str
    port: int
    method: str | None = None
    path: str | None = None
    status: int | None = None
    bytes_out: int = 0
    bytes_in: int = 0
    allowed: bool = False
    rule: str = ""
    reason: str | None = None
    started: float = field(default_factory=time.monotonic)
    at: float = field(default_factory=time.time)


def _split_authority(authority: str, default_port: int | None) -> tuple[str, int]:
    """`host:port`, `[v6]:port` or bare host -> (host, port); ValueError if malformed."""
    a = authority.strip()
    if a.startswith("["):
        end = a.find("]")
        if end < 0:
            raise ValueError(f"bad address {authority!r}")
        host, rest = a[1:end], a[end + 1 :]
        port_text = rest[1:] if rest.startswith(":") else None
        if rest and port_text is None:
            raise ValueError(f"bad address {authority!r}")
    elif a.count(":") == 1:
        host, port_text = a.split(":")
    elif ":" in a:  # a bare IPv6 literal
        host, port_text = a, None
    else:
        host, port_text = a, None
    if port_text is None or port_text == "":
        if default_port is None:
            raise ValueError(f"{authority!r} has no port")
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad port in {authority!r}")
    return host, int(port_text)


def _latin1(text: str) -> bytes:
    return text.encode("latin-1", "replace").replace(b"\r", b" ").replace(b"\n", b" ")


class EgressProxy:
    """Serves every sandbox's egress from this process's event loop."""

    def __init__(
        self,
        *,
        guard: AddressGuard,
        operator_deny: Sequence[Rule] = (),
        static_hosts: dict[str, Any] | None = None,
        upstream_ca_files: Sequence[Path] = (),
        ceiling: Callable[[str], EgressPolicy | None] = lambda tenant: None,
        secret: Callable[[str, str], BoundSecret | None] = lambda tenant, name: None,
        record: Callable[[dict[str, Any]], None] = lambda event: None,
        weaken: frozenset[str] = frozenset(),
        conns_per_sandbox: int = 64,
        conns_per_tenant: int = 256,
    ) -> None:
        # Positive controls of the security battery only ("egress-open": no address guard, no
        # SNI or Host checks; "secrets-loose": values go into any header of a request to a bound
        # host, over plain HTTP too, and responses are neither scrubbed nor refused); reachable
        # from Python, never from the CLI or the API.
        self.weaken = weaken
        self.guard = guard
        self.operator_deny = tuple(operator_deny)
        self.static_hosts = {k.lower().rstrip("."): v for k, v in (static_hosts or {}).items()}
        self.upstream_tls = upstream_context(list(upstream_ca_files))
        self._ceiling = ceiling
        self._secret = secret
        self._record = record
        self.conns_per_sandbox = conns_per_sandbox
        self.conns_per_tenant = conns_per_tenant
        self.sandboxes: dict[str, SandboxEgress] = {}

    # ------------------------------------------------------------------ sandboxes

    async def attach(
        self,
        sandbox_id: str,
        tenant: str,
        policy: EgressPolicy,
        listeners: dict[int, socket.socket],
        placeholders: dict[str, str] | None = None,
        ca: EgressCA | None = None,
    ) -> None:
        """Start serving a sandbox on its listening sockets (port -> socket)."""
        await self.detach(sandbox_id)
        sbx = SandboxEgress(sandbox_id, tenant, policy, dict(placeholders or {}), ca)
        self.sandboxes[sandbox_id] = sbx
        for port, sock in listeners.items():
            handler = self._serve_socks if port == SOCKS_PORT else self._serve_http
            server = await asyncio.start_server(
                functools.partial(self._accept, sbx, handler), sock=sock, limit=_CHUNK
            )
            sbx.servers.append(server)

    def update(
        self, sandbox_id: str, policy: EgressPolicy | None = None, tenant: str | None = None
    ) -> None:
        """Change a served sandbox's policy or owner; takes effect on the next attempt."""
        sbx = self.sandboxes.get(sandbox_id)
        if sbx is None:
            return
        if policy is not None:
            sbx.policy = policy
        if tenant is not None:
            sbx.tenant = tenant

    async def detach(self, sandbox_id: str) -> None:
        """Stop serving a sandbox: close its listeners and every connection it has open."""
        sbx = self.sandboxes.pop(sandbox_id, None)
        if sbx is None:
            return
        for server in sbx.servers:
            server.close()
        tasks = [*sbx.conns, *sbx.busy]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if sbx.ca is not None:
            sbx.ca.close()

    async def close(self) -> None:
        for sid in list(self.sandboxes):
            await self.detach(sid)

    def denials_since(self, sandbox_id: str, since: float) -> list[dict[str, Any]]:
        """Attempts the sandbox made since `since` (monotonic) that the proxy refused."""
        sbx = self.sandboxes.get(sandbox_id)
        if sbx is None:
            return []
        return [
            {k: v for k, v in d.items() if k != "mono"} for d in sbx.denials if d["mono"] >= since
        ]

    # ------------------------------------------------------------------ decisions

    def decide(self, sbx: SandboxEgress, host: str, port: int) -> Decision:
        d = decide(
            host,
            port,
            sbx.policy,
            operator_deny=self.operator_deny,
            ceiling=self._ceiling(sbx.tenant),
        )
        if d.allowed:
            return d
        # The agent reads this: name its own sandbox in the how-to-allow hint.
        sid = sbx.sandbox_id
        message = d.message.replace("{id}", sid).replace("network ID ", f"network {sid} ")
        return dataclasses.replace(d, message=message)

    def _admit(self, sbx: SandboxEgress, raw_host: str, port: int) -> tuple[str, Decision]:
        """The normalised host and the decision that allows it; raises Refused otherwise."""
        task = asyncio.current_task()
        busy = sbx.busy.get(task) if task is not None else None
        if busy is not None:  # a connection past a cap: it learns why, and goes nowhere
            raise busy
        try:
            host = normalize_host(raw_host)
        except RuleError as e:
            raise Refused(
                "invalid_host", f"{raw_host!r} is not a valid host name: {e}", 400, 4
            ) from None
        d = self.decide(sbx, host, port)
        if not d.allowed:
            raise Refused(f"{d.source}: {d.rule}", d.message)
        return host, d

    async def _resolve(self, host: str, port: int) -> list[Any]:
        """Addresses to connect to for an admitted host, every one of them checked."""
        open_ = "egress-open" in self.weaken
        why = None if open_ else name_refusal(host)
        if why:
            raise Refused("address_guard", f"{host} is refused: {why}")
        ip = parse_ip_literal(host)
        if ip is not None:
            addrs = [ip]
        elif host in self.static_hosts:
            addrs = [ipaddress.ip_address(self.static_hosts[host])]
        else:
            loop = asyncio.get_running_loop()
            try:
                infos = await asyncio.wait_for(
                    loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_S
                )
            except (TimeoutError, OSError) as e:
                raise Refused("resolve", f"{host} could not be resolved: {e}", 502, 4) from None
            addrs = []
            for info in infos:
                a = ipaddress.ip_address(str(info[4][0]).split("%")[0])
                if a not in addrs:
                    addrs.append(a)
        for a in addrs:
            why = None if open_ else self.guard.refusal(a)
            if why:
                # Any internal answer refuses the name: a rebinding DNS server may mix them.
                shown = host if str(a) == host else f"{host} resolves to {a}, which"
                raise Refused(
                    "address_guard",
                    f"{shown} is a {why}; the egress proxy never connects to loopback, private, "
                    "link-local, CGNAT or cloud-metadata addresses (an operator can allow a "
                    "range with `agentbox serve --egress-allow-cidr CIDR`)",
                )
        if not addrs:
            raise Refused("resolve", f"{host} has no addresses", 502, 4)
        return addrs

    async def _open(
        self, addrs: list[Any], port: int, tls_host: str | None = None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        last: Exception | None = None
        for a in addrs:
            try:
                return await asyncio.wait_for(
                    asyncio.open_connection(
                        str(a),
                        port,
                        ssl=self.upstream_tls if tls_host else None,
                        server_hostname=tls_host,
                        limit=_CHUNK,
                    ),
                    CONNECT_TIMEOUT_S,
                )
            except ssl.SSLCertVerificationError as e:
                raise Refused(
                    "upstream_tls",
                    f"the certificate of {tls_host}:{port} did not verify: {e.verify_message}",
                    502,
                    5,
                ) from None
            except (TimeoutError, OSError) as e:
                last = e
        raise Refused("upstream", f"could not connect to port {port} of {addrs[0]}: {last}", 502, 5)

    # ------------------------------------------------------------------ bookkeeping

    async def _accept(
        self,
        sbx: SandboxEgress,
        handler: Callable[..., Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        busy = self._over_cap(sbx)
        if busy is not None and len(sbx.busy) >= BUSY_ANSWERS:
            writer.close()
            return
        if busy is None:
            sbx.conns.add(task)
        else:
            sbx.busy[task] = busy
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            async with asyncio.timeout(BUSY_ANSWER_S if busy else None):
                await handler(sbx, reader, writer)
        except (asyncio.CancelledError, ConnectionError, asyncio.IncompleteReadError):
            pass
        except TimeoutError:
            pass  # a connection over the cap that did not say what it wanted in time
        except Exception:  # noqa: BLE001 - one broken connection must not reach the server
            log.exception("egress connection of %s failed", sbx.sandbox_id)
        finally:
            sbx.conns.discard(task)
            sbx.busy.pop(task, None)
            writer.close()

    def _over_cap(self, sbx: SandboxEgress) -> Refused | None:
        """Why a new connection of the sandbox is refused, if it is over a cap: its own
        connections, or its tenant's (counted now: a claimed pool member changes tenant)."""
        if len(sbx.conns) >= self.conns_per_sandbox:
            whose = f"sandbox {sbx.sandbox_id} has {self.conns_per_sandbox}"
            per = "sandbox"
        else:
            tenant = sum(len(s.conns) for s in self.sandboxes.values() if s.tenant == sbx.tenant)
            if tenant < self.conns_per_tenant:
                return None
            whose = f"the sandboxes of tenant {sbx.tenant} have {self.conns_per_tenant}"
            per = "tenant"
        return Refused(
            "connection_limit",
            f"{whose} egress connections open, the most the server allows per {per}; close "
            "some (reuse keep-alive connections, fewer parallel downloads) and retry",
            503,
            socks_code=1,
        )

    def _finish(self, att: _Attempt) -> None:
        event = {
            "time": att.at,
            "tenant": att.sbx.tenant,
            "sandbox_id": att.sbx.sandbox_id,
            "protocol": att.protocol,
            "host": att.host[:255],
            "port": att.port,
            "method": att.method,
            "path": (att.path or "")[:512] or None,
            "status": att.status,
            "bytes_out": att.bytes_out,
            "bytes_in": att.bytes_in,
            "allowed": att.allowed,
            "rule": att.rule[:255],
            "reason": att.reason,
            "duration_ms": round((time.monotonic() - att.started) * 1000, 3),
        }
        if not att.allowed:
            att.sbx.denials.append(
                {
                    "mono": att.started,
                    "host": att.host,
                    "port": att.port,
                    "protocol": att.protocol,
                    "rule": att.rule,
                    "message": att.reason,
                }
            )
        try:
            self._record(event)
        except Exception:  # noqa: BLE001 - recording must never break egress
            log.exception("could not record an egress event")

    def _refuse(self, att: _Attempt, e: Refused) -> None:
        att.allowed = False
        att.rule = e.rule
        att.reason = e.message
        att.status = e.status
        self._finish(att)

    # ------------------------------------------------------------------ HTTP proxy

    async def _serve_http(
        self, sbx: SandboxEgress, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        session = _HttpSession(self, sbx, conn, reader, writer)
        await session.serve(on_connect=lambda event: self._http_connect(sbx, session, event))

    async def _http_connect(
        self, sbx: SandboxEgress, session: _HttpSession, request: h11.Request
    ) -> None:
        target = request.target.decode("latin-1")
        att = _Attempt(sbx, "connect", target[:255], 0, method="CONNECT")
        try:
            raw_host, port = _split_authority(target, None)
        except ValueError as e:
            await session.respond_error(att, Refused("invalid_request", str(e), 400))
            return
        att.host, att.port = raw_host, port

        async def accept() -> None:
            await session.send(
                h11.Response(status_code=200, headers=[], reason=b"Connection Established")
            )

        async def deny(e: Refused) -> None:
            await session.respond_error(att, e)

        await self._tunnel(
            att,
            raw_host,
            session.reader,
            session.writer,
            accept,
            deny,
            leftover=session.conn.trailing_data[0],
        )

    # ------------------------------------------------------------------ tunnels (CONNECT, SOCKS)

    async def _tunnel(
        self,
        att: _Attempt,
        raw_host: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        accept: Callable[[], Any],
        deny: Callable[[Refused], Any],
        leftover: bytes = b"",
    ) -> None:
        sbx, port = att.sbx, att.port
        try:
            host, d = self._admit(sbx, raw_host, port)
            att.host, att.rule = host, f"{d.source}: {d.rule}"
            addrs = await self._resolve(host, port)
            inspect = sbx.ca is not None and self._bound_secrets(sbx, host, port)
            if inspect:
                if leftover or reader._buffer:  # type: ignore[attr-defined]  # no public view
                    # start_tls would never see bytes already read: the handshake would hang.
                    raise Refused("invalid_request", "data was sent before the tunnel opened", 400)
                await accept()
                await self._inspect_tls(att, host, addrs, reader, writer)
                return
            up_r, up_w = await self._open(addrs, port)
        except Refused as e:
            await deny(e)
            self._refuse(att, e)
            return
        att.allowed = True
        try:
            await accept()
            # The upstream's bytes flow at once: a server-first protocol (SSH, SMTP) sends its
            # banner before the client says anything.
            down = asyncio.create_task(self._pipe(up_r, writer, att, "in"))
            try:
                first, kind = await self._first_bytes(att, reader, leftover)
            except Refused as e:
                down.cancel()
                self._refuse(att, e)
                return
            if kind == "http":
                # Plain HTTP inside a tunnel: every request's Host must be the tunnel's host
                # (else one allowed name would front for any site sharing its address).
                down.cancel()
                await asyncio.wait([down])  # it must stop reading before the session reads
                session = _HttpSession(
                    self,
                    sbx,
                    h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024),
                    reader,
                    writer,
                    tunnel=(host, port, addrs),
                    upstream_tls=False,
                )
                session.upstream = (host, port, up_r, up_w)
                session.up_conn = h11.Connection(h11.CLIENT)
                session.conn.receive_data(first)
                await session.serve()
                return
            if first:
                up_w.write(first)
                att.bytes_out += len(first)
            await self._pipe(reader, up_w, att, "out")
            with contextlib.suppress(OSError, RuntimeError):
                up_w.write_eof()
            await down
        finally:
            up_w.close()
            self._finish(att)

    async def _first_bytes(
        self, att: _Attempt, reader: asyncio.StreamReader, data: bytes
    ) -> tuple[bytes, str]:
        """The client's first bytes in a tunnel and what they start: "tls" (whose SNI must
        name the tunnel's host), "http" (a request, to be checked request by request) or
        "other" (a protocol the proxy does not look into)."""
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while True:
            if data:
                hello = parse_client_hello(data)
                if hello.status == "malformed":
                    raise Refused("tls_hello", "the TLS hello is malformed")
                if hello.status == "ok":
                    self._check_sni(att, hello.sni)
                    return data, "tls"
                if hello.status == "not_tls":
                    kind = _http_start(data)
                    if kind != "more":
                        return data, kind
            if len(data) > 64 * 1024:
                raise Refused("tls_hello", "the first message is too large to check")
            remaining = deadline - time.monotonic()
            try:
                more = await asyncio.wait_for(reader.read(_CHUNK), max(remaining, 0.001))
            except TimeoutError:
                if data:
                    raise Refused("tls_hello", "the first message did not arrive in time") from None
                deadline = time.monotonic() + 3600  # a long-silent client: keep waiting
                continue
            except (ConnectionError, OSError):
                return b"", "other"
            if not more:
                return data, "other"
            data += more

    def _check_sni(self, att: _Attempt, sni: str | None) -> None:
        if sni is None or "egress-open" in self.weaken:
            return
        try:
            name = normalize_host(sni)
        except RuleError:
            name = sni
        if name != att.host:
            raise Refused(
                "sni_mismatch",
                f"the TLS server name {sni!r} does not match the host {att.host!r} the "
                "tunnel was opened for; connect to the name you mean",
            )

    async def _pipe(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        att: _Attempt,
        direction: str,
    ) -> None:
        try:
            while True:
                chunk = await src.read(_CHUNK)
                if not chunk:
                    break
                dst.write(chunk)
                if direction == "in":
                    att.bytes_in += len(chunk)
                else:
                    att.bytes_out += len(chunk)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        if direction == "in":
            with contextlib.suppress(OSError, RuntimeError):
                dst.write_eof()

    def _bound_secrets(
        self, sbx: SandboxEgress, host: str, port: int
    ) -> list[tuple[bytes, BoundSecret]]:
        """(placeholder, secret) for the sandbox's secrets bound to `host`:`port`."""
        found = []
        for placeholder, name in sbx.placeholders.items():
            s = self._secret(sbx.tenant, name)
            if s is not None and s.bound_to(host, port):
                found.append((placeholder.encode(), s))
        return found

    async def _inspect_tls(
        self,
        att: _Attempt,
        host: str,
        addrs: list[Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Terminate the client's TLS with the sandbox's CA, then proxy its HTTP requests to
        the real upstream over verified TLS, swapping secret placeholders on the way."""
        sbx = att.sbx
        assert sbx.ca is not None
        try:
            await asyncio.wait_for(writer.start_tls(sbx.ca.server_context(host)), HELLO_TIMEOUT_S)
        except (TimeoutError, ssl.SSLError, OSError) as e:
            att.allowed, att.rule, att.reason = False, "tls", f"TLS with the client failed: {e}"
            self._finish(att)
            return
        try:
            self._check_sni(att, client_sni(writer.get_extra_info("ssl_object")))
        except Refused as mismatch:
            self._refuse(att, mismatch)
            return
        att.allowed = True
        att.protocol = "connect-inspected"
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        session = _HttpSession(
            self, sbx, conn, reader, writer, tunnel=(host, att.port, addrs), upstream_tls=True
        )
        try:
            await session.serve()
        finally:
            self._finish(att)  # the tunnel; each request in it was recorded on its own

    # ------------------------------------------------------------------ SOCKS5

    async def _serve_socks(
        self, sbx: SandboxEgress, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        async def reply(code: int) -> None:
            writer.write(bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0]))
            await writer.drain()

        ver, n = await asyncio.wait_for(reader.readexactly(2), HEAD_TIMEOUT_S)
        if ver != 5:
            return
        methods = await reader.readexactly(n)
        if 0 not in methods:
            writer.write(b"\x05\xff")
            return
        writer.write(b"\x05\x00")
        ver, cmd, _, atyp = await asyncio.wait_for(reader.readexactly(4), HEAD_TIMEOUT_S)
        if atyp == 1:
            raw_host = str(ipaddress.IPv4Address(await reader.readexactly(4)))
        elif atyp == 4:
            raw_host = str(ipaddress.IPv6Address(await reader.readexactly(16)))
        elif atyp == 3:
            length = (await reader.readexactly(1))[0]
            raw_host = (await reader.readexactly(length)).decode("latin-1")
        else:
            await reply(8)
            return
        (port,) = struct.unpack("!H", await reader.readexactly(2))
        att = _Attempt(sbx, "socks5", raw_host[:255], port, method="CONNECT")
        if cmd != 1:
            e = Refused(
                "socks_command", "only SOCKS5 CONNECT is supported (no BIND or UDP)", 400, 7
            )
            await reply(7)
            self._refuse(att, e)
            return

        async def deny(e: Refused) -> None:
            await reply(e.socks_code)

        await self._tunnel(att, raw_host, reader, writer, lambda: reply(0), deny)


_HTTP_METHODS = frozenset(
    b"GET HEAD POST PUT DELETE OPTIONS PATCH TRACE CONNECT PROPFIND PROPPATCH MKCOL COPY MOVE "
    b"LOCK UNLOCK REPORT SEARCH PURGE".split()
)


def _scrub_header(scrubber: Scrubber, name: bytes, value: bytes) -> bytes:
    return value if name in (b"content-length", b"transfer-encoding") else scrubber.line(value)


def _has_body(request: h11.Request, response: h11.Response) -> bool:
    return request.method != b"HEAD" and response.status_code not in (204, 304)


def _upgrade_of(event: h11.InformationalResponse) -> str:
    found = [v for n, v in event.headers if n == b"upgrade"]
    return found[0].decode("latin-1")[:40] if found else "another protocol"


def _http_start(data: bytes) -> str:
    """Whether a tunnel's first bytes begin an HTTP/1 request: "http", "other" or "more"."""
    d = data.lstrip(b"\r\n")
    word, space, _ = d[:16].partition(b" ")
    if space:
        return "http" if word in _HTTP_METHODS else "other"
    if len(d) >= 16 or (d and not any(m.startswith(d) for m in _HTTP_METHODS)):
        return "other"
    return "more"


class _HttpSession:
    """HTTP/1.1 requests from one client connection, sent on to their upstreams.

    Plain proxy requests (absolute URLs) are decided per request on their host; inside a
    tunnel (`tunnel` = host, port, addresses: plain HTTP sent through CONNECT or SOCKS, or an
    inspected TLS tunnel) every request must be for the tunnel's host."""

    def __init__(
        self,
        proxy: EgressProxy,
        sbx: SandboxEgress,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        tunnel: tuple[str, int, list[Any]] | None = None,
        upstream_tls: bool = False,
    ) -> None:
        self.proxy = proxy
        self.sbx = sbx
        self.conn = conn
        self.reader = reader
        self.writer = writer
        self.tunnel = tunnel
        self.upstream_tls = upstream_tls
        self.upstream: tuple[str, int, asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.up_conn: h11.Connection | None = None

    async def serve(self, on_connect: Callable[[h11.Request], Any] | None = None) -> None:
        """Carry requests until the client or an upstream ends the connection."""
        try:
            while True:
                event = await self.next_client_event(HEAD_TIMEOUT_S)
                if not isinstance(event, h11.Request):
                    return
                if event.method == b"CONNECT" and on_connect is not None:
                    await on_connect(event)
                    return
                if not await self.forward_plain(event):
                    return
        finally:
            await self.close_upstream()

    async def next_client_event(self, timeout: float | None) -> Any:
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as e:
                await self._bad_request(str(e))
                return None
            if event is h11.NEED_DATA:
                try:
                    data = await asyncio.wait_for(self.reader.read(_CHUNK), timeout)
                except (TimeoutError, ConnectionError, OSError):
                    return None
                self.conn.receive_data(data)
                continue
            if event is h11.PAUSED:
                return None
            return event

    async def send(self, event: Any) -> None:
        data = self.conn.send(event)
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def _bad_request(self, why: str) -> None:
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            with contextlib.suppress(h11.LocalProtocolError, ConnectionError, OSError):
                body = f"agentbox egress proxy: bad request: {why}\n".encode()
                await self.send(
                    h11.Response(
                        status_code=400,
                        headers=[
                            ("Content-Type", "text/plain"),
                            ("Connection", "close"),
                            ("Content-Length", str(len(body))),
                        ],
                    )
                )
                await self.send(h11.Data(data=body))
                await self.send(h11.EndOfMessage())

    async def respond_error(self, att: _Attempt, e: Refused) -> None:
        """Tell the client, in words an agent can act on, why its request was not carried."""
        if e.secret:
            outcome, kind, error = "refused to protect a secret", b"refused", b"http_request_denied"
            status_text = "Refused by agentbox egress proxy"
        elif e.status == 403:
            outcome = "blocked by the sandbox network policy"
            kind, error = b"denied", b"destination_denied"
            status_text = "Blocked by agentbox network policy"
        elif e.rule == "connection_limit":
            outcome, kind, error = "refused", b"busy", b"connection_limit_reached"
            status_text = "Too many egress connections"
        else:
            outcome, kind, error = "failed", b"failed", b"proxy_internal_error"
            status_text = "Egress failed"
        body = (
            f"agentbox: {att.method or 'request'} {att.host}:{att.port} {outcome} "
            f"(rule: {e.rule}). {e.message}\n"
        ).encode()
        headers: list[tuple[bytes, bytes]] = [
            (b"Content-Type", b"text/plain; charset=utf-8"),
            (b"Content-Length", str(len(body)).encode()),
            (b"Connection", b"close"),
            (b"X-Agentbox-Egress", kind),
            (b"X-Agentbox-Rule", _latin1(e.rule)),
            (
                b"Proxy-Status",
                b"agentbox; error="
                + error
                + b'; details="'
                + _latin1(e.message).replace(b'"', b"'")
                + b'"',
            ),
        ]
        with contextlib.suppress(h11.LocalProtocolError, ConnectionError, OSError):
            await self.send(
                h11.Response(status_code=e.status, headers=headers, reason=status_text.encode())
            )
            await self.send(h11.Data(data=body))
            await self.send(h11.EndOfMessage())

    async def close_upstream(self) -> None:
        if self.upstream is not None:
            self.upstream[3].close()
            self.upstream = None
            self.up_conn = None

    # -------------------------------------------------------------- one request

    def _target(self, request: h11.Request) -> tuple[str, int, str]:
        """(host, port, origin-form target) of a request; raises Refused if unusable."""
        target = request.target.decode("latin-1")
        host_header = None
        for name, value in request.headers:
            if name == b"host":
                host_header = value.decode("latin-1")
        open_ = "egress-open" in self.proxy.weaken
        if self.tunnel is not None:
            host, port, _ = self.tunnel
            if not target.startswith("/"):
                raise Refused("invalid_request", "send origin-form requests in a tunnel", 400)
            if host_header is None:
                raise Refused("invalid_request", "a request in a tunnel needs a Host header", 400)
            if not open_:
                try:
                    h, p = _split_authority(host_header, port)
                    same = normalize_host(h) == host and p == port
                except (ValueError, RuleError):
                    same = False
                if not same:
                    raise Refused(
                        "host_mismatch",
                        f"the Host header {host_header!r} does not match the host {host!r} "
                        "the tunnel was opened for",
                    )
            return host, port, target
        lower = target[:8].lower()
        if lower.startswith("https://"):
            raise Refused(
                "invalid_request", "send https:// requests through the proxy with CONNECT", 400
            )
        if not lower.startswith("http://"):
            raise Refused(
                "invalid_request",
                "this is the sandbox's egress proxy: send absolute http:// URLs (set "
                "HTTP_PROXY) or CONNECT for https",
                400,
            )
        rest = target[7:]
        cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
        authority, path = rest[:cut], rest[cut:] or "/"
        if path.startswith("?"):
            path = "/" + path
        if "@" in authority:
            raise Refused("invalid_request", "credentials in proxy URLs are not supported", 400)
        try:
            raw_host, port = _split_authority(authority, 80)
        except ValueError as e:
            raise Refused("invalid_request", str(e), 400) from None
        if host_header is not None and not open_:
            try:
                h, p = _split_authority(host_header, 80)
                same = normalize_host(h) == normalize_host(raw_host) and p == port
            except (ValueError, RuleError):
                same = False
            if not same:
                raise Refused(
                    "host_mismatch",
                    f"the Host header {host_header!r} does not match the URL's host {authority!r}",
                )
        return raw_host, port, path

    def _swap(
        self,
        bound: list[tuple[bytes, BoundSecret]],
        headers: Iterable[tuple[bytes, bytes]],
        target: str,
    ) -> Injection:
        """Headers (hop-by-hop ones dropped) and target with the values of `bound` secrets put
        where their binding allows: their own headers, over TLS the proxy verified (plain HTTP
        only for a secret that opts in)."""
        loose = "secrets-loose" in self.proxy.weaken
        allowed = [(p, s) for p, s in bound if loose or s.may_send(self.upstream_tls)]
        listed = {b"connection"}
        upgrade = None
        for name, value in headers:
            if name == b"connection":
                listed |= {v.strip().lower() for v in value.split(b",")}
            elif name == b"upgrade":
                upgrade = value
        out: list[tuple[bytes, bytes]] = []
        if upgrade is not None and b"upgrade" in listed:
            # A protocol switch (WebSocket) is asked of the upstream, not of the proxy.
            out += [(b"connection", b"upgrade"), (b"upgrade", upgrade)]
        for name, value in headers:
            if name in _HOP_BY_HOP or name in listed:
                continue
            if name == b"accept-encoding" and bound and not loose:
                value = ACCEPT_ENCODING  # what the scrubber can decode, not br or zstd
            out.append((name, value))
        plan = inject(out, target.encode("latin-1"), allowed, any_header=loose)
        if plan.carried and not loose:
            # Asked for in slices, an echo of the value would pass the scrubber piece by piece.
            plan.headers = [(n, v) for n, v in plan.headers if n not in (b"range", b"if-range")]
        return plan

    async def forward_plain(self, request: h11.Request) -> bool:
        """Carry one request and its response; False when the connection must end."""
        method = request.method.decode("latin-1")
        loose = "secrets-loose" in self.proxy.weaken
        att = _Attempt(
            self.sbx,
            "https-inspected" if self.upstream_tls else ("http-tunnel" if self.tunnel else "http"),
            "",
            0,
            method=method,
            path=request.target.decode("latin-1")[:512],
        )
        try:
            raw_host, port, path = self._target(request)
            att.host, att.port = raw_host[:255], port
            if self.tunnel is not None:
                host, addrs = self.tunnel[0], self.tunnel[2]
                d = self.proxy.decide(self.sbx, host, port)
                if not d.allowed:  # the policy may have changed since the tunnel opened
                    raise Refused(f"{d.source}: {d.rule}", d.message)
            else:
                host, d = self.proxy._admit(self.sbx, raw_host, port)
                addrs = []
            att.host = host
            att.rule = f"{d.source}: {d.rule}"
            att.path = path[:512]  # with placeholders: values never reach the log
            bound = self.proxy._bound_secrets(self.sbx, host, port)
            if bound and not loose and request.method.upper() in ECHO_METHODS:
                raise Refused(
                    "secret_echo_method",
                    f"{method} answers with the request itself, secret values included; it is "
                    f"refused to {host}, where a secret of this sandbox is bound",
                    405,
                    secret=True,
                )
            if self.upstream is None or self.upstream[:2] != (host, port):
                await self.close_upstream()
                if not addrs:
                    addrs = await self.proxy._resolve(host, port)
                tls_host = host if self.upstream_tls else None
                r, w = await self.proxy._open(addrs, port, tls_host=tls_host)
                self.upstream = (host, port, r, w)
                self.up_conn = h11.Connection(h11.CLIENT)
        except Refused as e:
            att.host = att.host or request.target.decode("latin-1")[:255]
            await self._drain_request()
            await self.respond_error(att, e)
            self.proxy._refuse(att, e)
            return False
        att.allowed = True
        plan = self._swap(bound, request.headers, path)
        scrubber = Scrubber.for_secrets(bound, plan.built) if bound and not loose else None
        body: ResponseBody | None = None
        assert self.upstream is not None and self.up_conn is not None
        up_r, up_w = self.upstream[2], self.upstream[3]
        up = self.up_conn
        ok = False
        try:
            data = up.send(
                h11.Request(
                    method=request.method,
                    target=plan.target,
                    headers=plan.headers,
                    http_version=b"1.1",
                )
            )
            up_w.write(data)
            att.bytes_out += len(data)
            # The request body, as it comes.
            while True:
                event = await self.next_client_event(None)
                if event is None:
                    return False
                if isinstance(event, h11.Data):
                    data = up.send(event)
                    up_w.write(data)
                    att.bytes_out += len(data)
                    await up_w.drain()
                elif isinstance(event, h11.EndOfMessage):
                    data = up.send(h11.EndOfMessage())
                    up_w.write(data)
                    att.bytes_out += len(data)
                    await up_w.drain()
                    break
            # The response, as it comes.
            while True:
                event = up.next_event()
                if event is h11.NEED_DATA:
                    chunk = await up_r.read(_CHUNK)
                    att.bytes_in += len(chunk)
                    up.receive_data(chunk)
                    continue
                if isinstance(event, h11.InformationalResponse):
                    if scrubber is not None:
                        if event.status_code == 101 and plan.carried:
                            return await self._refuse_response(
                                att,
                                f"{host} switched protocols (to {_upgrade_of(event)}) on a "
                                "request that carried a secret; the proxy cannot keep the "
                                "value out of what comes back on it. Open the WebSocket with "
                                "a placeholder only, or authenticate it another way",
                            )
                        headers = [(n, _scrub_header(scrubber, n, v)) for n, v in event.headers]
                        event = h11.InformationalResponse(
                            status_code=event.status_code, headers=headers, reason=event.reason
                        )
                    if event.status_code == 101:
                        att.status = 101
                        await self.send(event)
                        await self._relay_upgraded(up, up_r, up_w, att)
                        return False
                    await self.send(event)
                elif isinstance(event, h11.Response):
                    att.status = event.status_code
                    kept = [(n, v) for n, v in event.headers if n not in _HOP_BY_HOP]
                    if scrubber is not None:
                        try:
                            body = ResponseBody.open(scrubber, kept, _has_body(request, event))
                            kept = body.headers
                        except Uninspectable as why:
                            if plan.carried:
                                return await self._refuse_response(att, str(why))
                            # Nothing of a value went out on this request: what comes back
                            # is relayed as it is, its headers scrubbed.
                            kept = [(n, _scrub_header(scrubber, n, v)) for n, v in kept]
                    await self.send(
                        h11.Response(
                            status_code=event.status_code, headers=kept, reason=event.reason
                        )
                    )
                elif isinstance(event, h11.Data):
                    if body is None:
                        await self.send(event)
                        continue
                    for piece in body.feed(event.data):
                        await self.send(h11.Data(data=piece))
                elif isinstance(event, h11.EndOfMessage):
                    for piece in body.finish() if body is not None else ():
                        await self.send(h11.Data(data=piece))
                    await self.send(h11.EndOfMessage())
                    break
                else:  # ConnectionClosed before the end
                    raise h11.RemoteProtocolError("the upstream closed mid-response")
            ok = True
        except (h11.RemoteProtocolError, h11.LocalProtocolError, ConnectionError, OSError) as e:
            att.reason = f"upstream failed: {e}"
            if att.status is None:
                await self.respond_error(att, Refused("upstream", str(e), 502))
            return False
        except zlib.error as e:
            # The head went out already: all the sandbox can be told is a cut-off body.
            att.reason = f"the response's content coding is broken ({e}); cut off"
            return False
        finally:
            if not ok:
                await self.close_upstream()
            self.proxy._finish(att)
        if up.our_state is h11.DONE and up.their_state is h11.DONE:
            up.start_next_cycle()
        else:
            await self.close_upstream()
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
            return True
        return False

    async def _refuse_response(self, att: _Attempt, why: str) -> bool:
        """Answer 502 instead of a response the proxy cannot scrub; the attempt is recorded
        as refused, with why. False: the connection ends."""
        e = Refused("secret_uninspectable", why, 502, secret=True)
        att.allowed, att.rule, att.reason, att.status = False, e.rule, e.message, e.status
        await self.respond_error(att, e)
        return False

    async def _relay_upgraded(
        self,
        up: h11.Connection,
        up_r: asyncio.StreamReader,
        up_w: asyncio.StreamWriter,
        att: _Attempt,
    ) -> None:
        """After a 101 (a WebSocket, say): bytes both ways until either side ends."""
        client_extra, up_extra = self.conn.trailing_data[0], up.trailing_data[0]
        if up_extra:
            self.writer.write(up_extra)
            att.bytes_in += len(up_extra)
        if client_extra:
            up_w.write(client_extra)
            att.bytes_out += len(client_extra)
        down = asyncio.create_task(self.proxy._pipe(up_r, self.writer, att, "in"))
        await self.proxy._pipe(self.reader, up_w, att, "out")
        with contextlib.suppress(OSError, RuntimeError):
            up_w.write_eof()
        await down
        await self.close_upstream()

    async def _drain_request(self) -> None:
        """Read what is left of a refused request's body (bounded), so the answer arrives."""
        budget = 1 << 20
        while self.conn.their_state is h11.SEND_BODY and budget > 0:
            event = await self.next_client_event(5.0)
            if event is None or isinstance(event, h11.EndOfMessage):
                return
            if isinstance(event, h11.Data):
                budget -= len(event.data)
