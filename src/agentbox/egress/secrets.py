"""Secrets on the wire: where the proxy may put a secret's value, and keeping it out of replies.

A sandbox holds only placeholders. On a request to one of a secret's bound hosts the proxy puts
the value in place of the placeholder in the secret's bound headers (default `Authorization`,
inside `Basic` credentials too, as git sends them) and, if the secret says `in_url`, in the
request target; only over TLS the proxy verified itself, unless the secret opts into plaintext.
Everything else (other headers, other hosts, request bodies, plain HTTP) keeps the placeholder.

An upstream may send the value back: an echo endpoint, an error page quoting the request, a
redirect carrying the URL. Responses from bound hosts are scrubbed: the value in the forms an
upstream is likely to reflect (raw; base64 in both alphabets, padded or not, at every
alignment inside a longer base64 text; percent- and JSON-escaped; the Basic credentials the
proxy built) is turned back into the placeholder in headers and bodies, bodies decoded from the
content codings the proxy knows and matched across reads. A response the proxy cannot read
that way (another content coding, a protocol switch) is refused when its request carried a
value (`Uninspectable`).
"""

from __future__ import annotations

import base64
import json
import re
import urllib.parse
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from agentbox.egress.policy import Rule

PLACEHOLDER_PREFIX = "agentbox_secret_"
DEFAULT_HEADERS = ("Authorization",)
MAX_HEADERS = 16
# Shorter values cannot be scrubbed from responses without mangling them (every "abc" in a
# page would become a placeholder), and are not credentials anyway.
MIN_VALUE_BYTES = 8
# Derived forms shorter than this (base64 fragments of a short value) would match by chance.
_MIN_FORM = 8
_PIECE = 256 * 1024  # most bytes a decoder hands on at once: a bomb streams, it never piles up
# Headers that frame or route the message: a secret there would change what the message is.
_UNBINDABLE = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "upgrade",
        "expect",
    }
)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,64}")
# Methods whose answer is the request itself (the value included): refused to bound hosts.
ECHO_METHODS = frozenset({b"TRACE", b"TRACK"})
# What a request to a bound host may accept: only codings the scrubber can decode.
ACCEPT_ENCODING = b"gzip, deflate"


def parse_header_names(names: Sequence[str] | None) -> tuple[str, ...]:
    """The headers a secret is bound to, as given (deduplicated case-insensitively); ValueError
    says which entry is wrong and why."""
    if names is None:
        return DEFAULT_HEADERS
    if isinstance(names, str) or not names:
        raise ValueError("headers must be a list of header names, e.g. ['Authorization']")
    if len(names) > MAX_HEADERS:
        raise ValueError(f"headers has {len(names)} entries; at most {MAX_HEADERS} are allowed")
    out: dict[str, str] = {}
    for name in names:
        if not isinstance(name, str) or not _TOKEN.fullmatch(name):
            raise ValueError(
                f"header name {name!r} is not an HTTP header name (letters, digits and "
                "!#$%&'*+-.^_`|~, at most 64)"
            )
        if name.lower() in _UNBINDABLE:
            raise ValueError(
                f"a secret cannot be bound to {name}: it frames or routes the request; bind it "
                "to the header the API reads the credential from (e.g. Authorization)"
            )
        out.setdefault(name.lower(), name)
    return tuple(out.values())


@dataclass(frozen=True)
class BoundSecret:
    """A tenant's secret as the proxy sees it: the value and where it may be sent."""

    name: str
    value: str
    hosts: tuple[Rule, ...]
    in_url: bool = False
    headers: tuple[str, ...] = DEFAULT_HEADERS
    allow_plaintext: bool = False
    _header_keys: frozenset[bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        keys = frozenset(h.lower().encode("ascii") for h in self.headers)
        object.__setattr__(self, "_header_keys", keys)

    def bound_to(self, host: str, port: int) -> bool:
        return any(r.matches(host, port) for r in self.hosts)

    def goes_in(self, header: bytes) -> bool:
        """Whether the value may replace the placeholder in `header` (a lowercase name)."""
        return header in self._header_keys

    def may_send(self, verified_tls: bool) -> bool:
        """Whether the value may travel on this connection at all (its host already bound)."""
        return verified_tls or self.allow_plaintext


# ---------------------------------------------------------------------------------- requests


@dataclass
class Injection:
    """A request after the swap: what goes upstream and what the response must not echo."""

    headers: list[tuple[bytes, bytes]]
    target: bytes
    carried: set[str] = field(default_factory=set)  # names of the secrets whose value went in
    built: list[tuple[bytes, bytes]] = field(default_factory=list)  # (form, its replacement)


def inject(
    headers: Iterable[tuple[bytes, bytes]],
    target: bytes,
    secrets: Sequence[tuple[bytes, BoundSecret]],
    any_header: bool = False,
) -> Injection:
    """Swap placeholders for values. `secrets` are (placeholder, secret) pairs already allowed
    on this connection (bound host, TLS rule); each goes only in its own headers (any header
    with `any_header`: the battery's weakened proxy) and in the target if `in_url`."""
    out = Injection([], target)
    for name, value in headers:
        mine = [(p, s) for p, s in secrets if any_header or s.goes_in(name)]
        if mine:
            value = _fill(value, mine, out)
            if value[:6].lower() == b"basic ":
                value = _fill_basic(value, mine, out)
        out.headers.append((name, value))
    if PLACEHOLDER_PREFIX.encode() in target:
        out.target = _fill(target, [(p, s) for p, s in secrets if s.in_url], out)
    return out


def _fill(text: bytes, secrets: Sequence[tuple[bytes, BoundSecret]], out: Injection) -> bytes:
    for placeholder, s in secrets:
        if placeholder in text:
            text = text.replace(placeholder, s.value.encode())
            out.carried.add(s.name)
    return text


def _fill_basic(
    value: bytes, secrets: Sequence[tuple[bytes, BoundSecret]], out: Injection
) -> bytes:
    """`Basic base64(user:PLACEHOLDER)` (git, curl -u, a URL's user:password) carries the
    value encoded: decode, swap, encode again, and remember what was built for the scrubber."""
    try:
        decoded = base64.b64decode(value[6:].strip(), validate=True)
    except ValueError:
        return value
    swapped = _fill(decoded, secrets, out)
    if swapped == decoded:
        return value
    built, sent = base64.b64encode(swapped), base64.b64encode(decoded)
    # An echo of these credentials comes back as the sandbox sent them.
    out.built += [(built, sent), (built.rstrip(b"="), sent.rstrip(b"="))]
    return value[:6] + built


# ---------------------------------------------------------------------------------- responses


def value_forms(value: bytes) -> set[bytes]:
    """The spellings of `value` an upstream is likely to send back."""
    forms = {value}
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        whole = encode(value)
        forms |= {whole, whole.rstrip(b"=")}
        # Inside a longer base64 text the value starts at any offset mod 3: keep, for each,
        # the characters that depend on the value's bits alone.
        for skip in (1, 2):
            shifted = encode(b"\0" * skip + value).rstrip(b"=")
            start, end = -(-8 * skip // 6), (8 * (skip + len(value))) // 6
            forms.add(shifted[start:end])
        forms.add(whole.rstrip(b"=")[: (8 * len(value)) // 6])
    for safe in ("", "/"):
        quoted = urllib.parse.quote(value, safe=safe)
        forms |= {quoted.encode(), _lower_hex(quoted).encode()}
    plus = urllib.parse.quote_plus(value)
    forms |= {plus.encode(), _lower_hex(plus).encode()}
    text = value.decode("utf-8", "replace")
    for ascii_only in (True, False):
        escaped = json.dumps(text, ensure_ascii=ascii_only)[1:-1]
        forms |= {escaped.encode(), escaped.replace("/", "\\/").encode()}
    return {f for f in forms if f == value or len(f) >= _MIN_FORM}


def _lower_hex(quoted: str) -> str:
    return re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), quoted)


class Scrubber:
    """Replaces the forms of secret values by their placeholders in a stream of bytes.

    `feed` holds back the last (longest form - 1) bytes, so a form split across reads is still
    found; `flush` releases them at the end of the stream.
    """

    def __init__(self, forms: dict[bytes, bytes]) -> None:
        ordered = sorted(forms, key=len, reverse=True)  # at one position, the longest wins
        self._forms = forms
        self._pattern = re.compile(b"|".join(re.escape(f) for f in ordered))
        self._keep = len(ordered[0]) - 1
        self._tail = b""

    @classmethod
    def for_secrets(
        cls,
        secrets: Iterable[tuple[bytes, BoundSecret]],
        built: Iterable[tuple[bytes, bytes]] = (),
    ) -> Scrubber:
        forms: dict[bytes, bytes] = {}
        for placeholder, s in secrets:
            for form in value_forms(s.value.encode()):
                forms.setdefault(form, placeholder)
        for form, replacement in built:
            if len(form) >= _MIN_FORM:
                forms.setdefault(form, replacement)
        return cls(forms)

    def _swap(self, match: re.Match[bytes]) -> bytes:
        return self._forms[match.group(0)]

    def line(self, data: bytes) -> bytes:
        """`data` scrubbed whole (a header value)."""
        return self._pattern.sub(self._swap, data)

    def feed(self, data: bytes) -> bytes:
        buf = self._tail + data
        # A match starting before `limit` is decided: its longest possible form fits in `buf`.
        limit = len(buf) - self._keep
        out, pos = [], 0
        for m in self._pattern.finditer(buf):
            if m.start() >= limit:
                break
            out += [buf[pos : m.start()], self._forms[m.group(0)]]
            pos = m.end()
        cut = max(pos, limit)
        out.append(buf[pos:cut])
        self._tail = buf[cut:]
        return b"".join(out)

    def flush(self) -> bytes:
        tail, self._tail = self._tail, b""
        return self.line(tail)


class Uninspectable(Exception):
    """A response the proxy cannot scrub; the message says why, for the agent."""


class _Inflate:
    """One gzip or deflate layer, streamed. Output comes in pieces of at most _PIECE bytes."""

    def __init__(self, gzip: bool) -> None:
        self._gzip = gzip
        self._d: zlib._Decompress | None = zlib.decompressobj(31) if gzip else None
        self._head = b""
        self._done = False

    def _start(self, data: bytes) -> bytes:
        # "deflate" is meant to be zlib-wrapped; some servers send raw deflate. Two bytes tell.
        self._head += data
        if len(self._head) < 2:
            return b""
        cmf, flg = self._head[0], self._head[1]
        zlib_wrapped = cmf & 0x0F == 8 and (cmf << 8 | flg) % 31 == 0
        self._d = zlib.decompressobj(15 if zlib_wrapped else -15)
        data, self._head = self._head, b""
        return data

    def feed(self, data: bytes) -> Iterator[bytes]:
        if self._d is None:
            data = self._start(data)
        while self._d is not None and not self._done:
            if self._d.eof:
                data = data.lstrip(b"\0")
                if not self._gzip or data[:1] != b"\x1f":
                    self._done = bool(data)  # what follows the stream is not content
                    return
                self._d = zlib.decompressobj(31)  # a further gzip member
            piece = self._d.decompress(data, _PIECE)
            data = self._d.unused_data if self._d.eof else self._d.unconsumed_tail
            if piece:
                yield piece
            # A full piece may leave output inside zlib: ask again, with no new input.
            if not data and (self._d.eof or len(piece) < _PIECE):
                return

    def finish(self) -> Iterator[bytes]:
        if self._d is not None and not self._d.eof and not self._done:
            tail = self._d.flush()
            if tail:
                yield tail


_DECODERS = {"gzip": True, "x-gzip": True, "deflate": False}


class ResponseBody:
    """One response body from a bound host on its way to the sandbox: decoded, then scrubbed.

    `open` looks at the response head first and raises Uninspectable for content codings it
    cannot decode; `headers` is the head to send on (values scrubbed, framing and coding
    headers dropped when there is a body, which then goes out chunked).
    """

    def __init__(self, scrubber: Scrubber, layers: list[_Inflate]) -> None:
        self.scrubber = scrubber
        self._layers = layers
        self.headers: list[tuple[bytes, bytes]] = []

    @classmethod
    def open(
        cls, scrubber: Scrubber, headers: Sequence[tuple[bytes, bytes]], has_body: bool
    ) -> ResponseBody:
        codings = [
            c.strip().lower()
            for name, value in headers
            if name == b"content-encoding"
            for c in value.decode("latin-1").split(",")
        ]
        codings = [c for c in codings if c and c != "identity"]
        unknown = [c for c in codings if c not in _DECODERS]
        if unknown and has_body:
            raise Uninspectable(
                f"the response is {', '.join(unknown)}-encoded, which the proxy cannot decode "
                "to keep the secret's value out of it; ask for gzip, deflate or identity "
                "(Accept-Encoding)"
            )
        # Codings are listed in the order they were applied: undo the last one first.
        layers = [_Inflate(_DECODERS[c]) for c in reversed(codings)] if has_body else []
        body = cls(scrubber, layers)
        framing = (b"content-length", b"transfer-encoding", b"content-encoding")
        for name, value in headers:
            if has_body and name in framing:
                continue
            body.headers.append((name, value if name in framing else scrubber.line(value)))
        return body

    def feed(self, data: bytes) -> Iterator[bytes]:
        """Scrubbed bytes for the sandbox; zlib.error if the coding is broken."""
        yield from self._through(0, [data])

    def finish(self) -> Iterator[bytes]:
        for i, layer in enumerate(self._layers):
            yield from self._through(i + 1, layer.finish())
        tail = self.scrubber.flush()
        if tail:
            yield tail

    def _through(self, start: int, pieces: Iterable[bytes]) -> Iterator[bytes]:
        for piece in pieces:
            if start < len(self._layers):
                yield from self._through(start + 1, self._layers[start].feed(piece))
                continue
            out = self.scrubber.feed(piece)
            if out:
                yield out
