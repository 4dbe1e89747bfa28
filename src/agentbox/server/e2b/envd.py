"""E2B's sandbox traffic (`E2B_SANDBOX_URL`): requests that carry `E2b-Sandbox-Id` and
`E2b-Sandbox-Port` are a sandbox's, whatever their path. On port 49983 (envd) this serves
`/health`, `/files` and envd's Connect RPC (rpc.py); on port 49999 the code interpreter
(interpreter.py). The token is the sandbox's envd access token (`X-Access-Token`; on 49999 also
`E2B-Traffic-Access-Token`, which carries the same token), never an API key.

Without a valid token a sandbox looks the same whether it exists or not: `/health` answers 502
(E2B's "not running"), every other route 401.
"""

from __future__ import annotations

import asyncio
import re
import zlib
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.types import Receive, Scope, Send

from agentbox.core.auth import Caller
from agentbox.core.errors import InvalidRequest, LimitExceeded, Unauthorized
from agentbox.server.e2b.common import (
    CODE_INTERPRETER_PORT,
    ENVD_PORT,
    E2BRoute,
    e2b_error,
    token_matches,
)
from agentbox.server.e2b.interpreter import interpreter_routes
from agentbox.server.e2b.rpc import PROCESS_PATH, rpc_apps
from agentbox.server.e2b.signed import is_signed, signed_row
from agentbox.server.streaming import Streamed
from agentbox.server.surfaces import Core, SurfaceRoutes
from agentbox.store.db import SandboxRow

FILES = "/files"
MAX_UPLOAD_PARTS = 256  # files in one multipart upload
PART_QUEUE = 8  # chunks of a part held while the sandbox takes the previous ones


def claims(scope: Scope) -> bool:
    """A request for a sandbox's port, by E2B's headers; or a signed file URL, which carries
    none (signed.py)."""
    if scope["type"] != "http":
        return False
    names = {k for k, _ in scope["headers"]}
    if b"e2b-sandbox-id" in names and b"e2b-sandbox-port" in names:
        return True
    return scope["path"] == FILES and b"signature=" in scope.get("query_string", b"")


class _Sandbox:
    """The sandbox a request names, and what its token allows."""

    def __init__(self, core: Core, request: Request) -> None:
        self.id = request.headers.get("e2b-sandbox-id", "")
        self.port = request.headers.get("e2b-sandbox-port", "")
        self.via = "e2b-envd"  # the credential, as the audit log names the key
        self.refusal: Unauthorized | None = None
        mgr = core.manager
        self.running = mgr.running_row(self.id)
        paused = mgr.paused_row(self.id)
        row: SandboxRow | None = self.running or paused
        given = request.headers.get("x-access-token")
        if self.port == str(CODE_INTERPRETER_PORT):  # the SDK sends only this on /contexts
            given = given or request.headers.get("e2b-traffic-access-token")
        if given is None and request.url.path == FILES and is_signed(request):
            self.row = self._signed(core, request, row)
        else:
            self.row = row if token_matches(core, self.id, row, given) else None
        if self.row is not None:
            conn = request.scope.get("agentbox.connection")
            if conn is not None:  # a valid credential: not an anonymous connection
                conn.mark_authenticated()

    def _signed(self, core: Core, request: Request, named: SandboxRow | None) -> SandboxRow | None:
        """The sandbox a signed file URL is for: the one its headers name, else the running
        one whose token made the signature."""
        if not self.id:
            self.port = str(ENVD_PORT)
        candidates = [named] if named is not None else []
        try:
            row = signed_row(core, request, candidates if self.id else core.manager.running_rows())
        except Unauthorized as e:
            self.refusal = e
            return None
        self.id, self.via = row.sandbox_id, "e2b-signed-url"
        self.running = core.manager.running_row(row.sandbox_id)
        return row

    def caller(self, port: int = ENVD_PORT) -> Caller:
        """Who acts: the sandbox's tenant, by the sandbox's envd token (or a URL signed with
        it), on `port` (the one that serves what was asked for)."""
        if self.row is None:
            raise self.refusal or Unauthorized("missing or invalid X-Access-Token for this sandbox")
        if self.port != str(port):
            raise InvalidRequest(f"this is not served on port {self.port} of this sandbox")
        return Caller(tenant=self.row.tenant, key_id=self.via, admin=False)


def _user(username: str | None) -> str | None:
    if username in (None, ""):
        return None
    if username not in ("user", "root"):
        raise Unauthorized(f"unknown user {username!r}: use user or root")
    return username


def envd_surface(core: Core) -> SurfaceRoutes:
    r = APIRouter(route_class=E2BRoute, include_in_schema=False)

    @r.get("/health")
    async def health(request: Request) -> Response:
        """204 while the sandbox runs (200 from the code interpreter); 502 when it does not
        (paused, ended, unknown, or the token is not its own): what the SDK's is_running()
        reads."""
        box = _Sandbox(core, request)
        ports = (str(ENVD_PORT), str(CODE_INTERPRETER_PORT))
        if box.row is None or box.running is None or box.port not in ports:
            return e2b_error(502, "the sandbox is not running")
        return Response(status_code=204 if box.port == str(ENVD_PORT) else 200)

    @r.get(FILES)
    async def read_file(
        request: Request,
        path: Annotated[str, Query(max_length=8192)],
        username: Annotated[str | None, Query(max_length=32)] = None,
        accept_encoding: Annotated[str, Header()] = "",
    ) -> Response:
        box = _Sandbox(core, request)
        size, chunks = await core.manager.read_file(box.caller(), box.id, path, _user(username))
        if "gzip" in accept_encoding.lower():
            return Streamed(
                _gzipped(chunks),
                media_type="application/octet-stream",
                headers={"Content-Encoding": "gzip"},
            )
        return Streamed(
            chunks, media_type="application/octet-stream", headers={"Content-Length": str(size)}
        )

    @r.post(FILES)
    async def write_files(
        request: Request,
        path: Annotated[str | None, Query(max_length=8192)] = None,
        username: Annotated[str | None, Query(max_length=32)] = None,
        content_type: Annotated[str, Header()] = "",
        content_encoding: Annotated[str, Header()] = "",
    ) -> list[dict[str, Any]]:
        """Raw (`application/octet-stream`, gzip or not) or `multipart/form-data` (a `file`
        part per file, its filename the path when no `path` is given). Each file streams into
        the sandbox; parents are made, files replaced."""
        box = _Sandbox(core, request)
        caller, user = box.caller(), _user(username)
        metadata = _metadata(request)
        mime, params = parse_options_header(content_type)
        if mime == b"multipart/form-data":
            boundary = params.get(b"boundary")
            if not boundary:
                raise InvalidRequest("a multipart upload needs a boundary in its Content-Type")
            return await _multipart(core, caller, box.id, request, boundary, path, user, metadata)
        if not path:
            raise InvalidRequest("path is required for a raw upload")
        body: AsyncIterator[bytes] = request.stream()
        encoding = content_encoding.strip().lower()
        if encoding == "gzip":
            body = _gunzipped(body)
        elif encoding not in ("", "identity"):
            raise InvalidRequest(f"unsupported Content-Encoding {encoding!r}: use gzip")
        entry = await core.manager.files.write(caller, box.id, path, body, user, metadata)
        return [_written(entry)]

    r.include_router(interpreter_routes(core, _Sandbox))  # port 49999
    for prefix, app in rpc_apps(core, _Sandbox).items():  # envd's Connect RPC
        r.mount(prefix, app)
    streams = frozenset({("POST", FILES), ("POST", f"{PROCESS_PATH}/StreamInput")})
    ports = {ENVD_PORT: host_routed, CODE_INTERPRETER_PORT: host_routed}
    return SurfaceRoutes(
        router=r, predicate=claims, authenticates=True, streams=streams, ports=ports
    )


async def host_routed(scope: Scope, receive: Receive, send: Send) -> None:
    """E2B's host-routed form, `49983-<id>.<domain>` (the SDK's address for a sandbox when
    E2B_SANDBOX_URL is unset; also the port path `/v1/sandboxes/<id>/ports/49983/...`): the
    same request with E2B's headers naming the sandbox and port, into the rest of the server,
    where this surface claims it and checks its token as for any other."""
    port = scope["agentbox.port"]
    named = (b"e2b-sandbox-id", b"e2b-sandbox-port")
    headers = [(k, v) for k, v in scope["headers"] if k not in named]
    headers += [(named[0], port["sandbox_id"].encode()), (named[1], str(port["port"]).encode())]
    await port["app"](dict(scope, headers=headers), receive, send)


def _written(entry: dict[str, Any]) -> dict[str, Any]:
    """envd's `EntryInfo` of a file written."""
    out = {
        "name": entry.get("name") or str(entry.get("path", "")).rsplit("/", 1)[-1],
        "type": "dir" if entry.get("type") == "dir" else "file",
        "path": entry.get("path"),
    }
    if entry.get("metadata"):
        out["metadata"] = entry["metadata"]
    return out


METADATA_KEY = re.compile(r"[a-z0-9!#$%&'*+\-.^_`|~]{1,128}")


def _metadata(request: Request) -> dict[str, str] | None:
    """E2B's file metadata: `X-Metadata-<key>: <value>` headers, keys lowercased, values
    printable ASCII; kept with each file written as its user.e2b.<key> xattr."""
    found: dict[str, str] = {}
    for name, value in request.headers.items():
        if not name.lower().startswith("x-metadata-"):
            continue
        key = name.lower().removeprefix("x-metadata-")
        if not METADATA_KEY.fullmatch(key):
            raise InvalidRequest(f"invalid file metadata key {key[:64]!r}")
        if not value.isascii() or not value.isprintable() or len(value) > 1024:
            raise InvalidRequest(f"file metadata {key}: at most 1024 printable ASCII characters")
        found[key] = value
    return found or None


async def _gzipped(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    z = zlib.compressobj(6, zlib.DEFLATED, 31)
    async for chunk in chunks:
        out = z.compress(chunk)
        if out:
            yield out
    yield z.flush()


async def _gunzipped(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    z = zlib.decompressobj(47)  # gzip or zlib header
    try:
        async for chunk in chunks:
            while chunk:
                out = z.decompress(chunk, 1 << 20)
                if out:
                    yield out
                chunk = z.unconsumed_tail
        tail = z.flush()
    except zlib.error as e:
        raise InvalidRequest(f"the gzip body is corrupt: {e}") from None
    if tail:
        yield tail
    if not z.eof:
        raise InvalidRequest("the gzip body ended early")


async def _multipart(
    core: Core,
    caller: Caller,
    sandbox_id: str,
    request: Request,
    boundary: bytes,
    path: str | None,
    user: str | None,
    metadata: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Stream each file part of a multipart body into the sandbox, one after the other."""
    events: list[tuple[str, bytes]] = []
    try:
        parser = MultipartParser(
            boundary,
            {
                "on_part_begin": lambda: events.append(("begin", b"")),
                "on_header_field": lambda d, s, e: events.append(("field", bytes(d[s:e]))),
                "on_header_value": lambda d, s, e: events.append(("value", bytes(d[s:e]))),
                "on_header_end": lambda: events.append(("header_end", b"")),
                "on_part_data": lambda d, s, e: events.append(("data", bytes(d[s:e]))),
                "on_part_end": lambda: events.append(("end", b"")),
            },
            max_header_count=16,
            max_header_size=8192,
        )
    except Exception as e:  # a boundary it refuses (too long, ...)
        raise InvalidRequest(f"the multipart boundary is not usable: {e}") from None
    written: list[dict[str, Any]] = []
    queue: asyncio.Queue[bytes | None] | None = None
    writer: asyncio.Task[dict[str, Any]] | None = None
    field = value = b""
    disposition = b""
    parts = 0

    async def drain(q: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
        while (chunk := await q.get()) is not None:
            yield chunk

    async def put(item: bytes | None) -> None:
        assert queue is not None and writer is not None
        putting = asyncio.ensure_future(queue.put(item))
        done, _ = await asyncio.wait({putting, writer}, return_when=asyncio.FIRST_COMPLETED)
        if putting not in done:  # the write ended (failed) before taking everything
            putting.cancel()
            writer.result()
            raise InvalidRequest("the sandbox stopped taking the upload")

    try:
        async for chunk in request.stream():
            try:
                parser.write(chunk)
            except Exception as e:  # python-multipart's errors have no common base
                raise InvalidRequest(f"the multipart body is malformed: {e}") from None
            for kind, data in events:
                if kind == "begin":
                    field = value = disposition = b""
                elif kind == "field":
                    field += data
                elif kind == "value":
                    value += data
                elif kind == "header_end":
                    if field.lower() == b"content-disposition":
                        disposition = value
                    field = value = b""
                elif kind == "data" and queue is None and disposition:
                    _, opts = parse_options_header(disposition)
                    disposition = b""
                    name = opts.get(b"filename")
                    if name is None:
                        continue  # a plain form field, not a file
                    parts += 1
                    if parts > MAX_UPLOAD_PARTS:
                        raise LimitExceeded(f"at most {MAX_UPLOAD_PARTS} files per upload")
                    target = path or name.decode("utf-8", "replace")
                    queue = asyncio.Queue(PART_QUEUE)
                    writer = asyncio.ensure_future(
                        core.manager.files.write(
                            caller, sandbox_id, target, drain(queue), user, metadata
                        )
                    )
                    await put(data)
                elif kind == "data" and queue is not None:
                    await put(data)
                elif kind == "end":
                    if queue is None and disposition:  # an empty file part
                        _, opts = parse_options_header(disposition)
                        name = opts.get(b"filename")
                        if name is not None:
                            parts += 1
                            if parts > MAX_UPLOAD_PARTS:
                                raise LimitExceeded(f"at most {MAX_UPLOAD_PARTS} files per upload")
                            target = path or name.decode("utf-8", "replace")
                            entry = await core.manager.files.write(
                                caller, sandbox_id, target, _nothing(), user, metadata
                            )
                            written.append(_written(entry))
                    elif queue is not None and writer is not None:
                        await put(None)
                        written.append(_written(await writer))
                    queue, writer, disposition = None, None, b""
            events.clear()
        parser.finalize()
    finally:
        if writer is not None and not writer.done():
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
    if queue is not None:
        raise InvalidRequest("the multipart body ended inside a part")
    return written


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""
