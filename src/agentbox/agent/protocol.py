"""The wire format between the control plane and the in-sandbox agent (stdlib only).

One request per connection over a Unix stream socket. Every message is a frame:
`kind (1 byte) | length (u32, big endian) | payload`. Kinds:

- `J`: a JSON object (requests, replies, events); at most MAX_JSON bytes.
- `D`: raw bytes of a file being read or written; at most MAX_DATA bytes.
- `E`: end of a `D` sequence (empty payload).
- `O`: command output: `stream (1 byte: 1 stdout, 2 stderr) | offset (u64) | bytes`.

A request is one `J` frame `{"op": ..., ...}`; replies are `J` frames with `"ok": true|false`
(errors carry `code`, `message`, `detail`). The control plane treats the agent as untrusted:
every length is bounded and every reply is validated before use.

This file is shared verbatim by the server (as `agentbox.agent.protocol`) and by the agent inside
the sandbox (as the top-level module `protocol`), so it imports nothing from agentbox.
"""

from __future__ import annotations

import struct

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs the agent's start ~7 ms
    from typing import Any

VERSION = "0.1.0"
HEADER = struct.Struct(">BI")
OUTPUT_HEADER = struct.Struct(">BQ")
MAX_JSON = 8 << 20  # a code result carries its images (base64) in one event
MAX_DATA = 1 << 20
CHUNK = 256 * 1024
LIST_LIMIT = 10_000  # entries in one page of a directory listing (fs.list)

KIND_JSON = ord("J")
KIND_DATA = ord("D")
KIND_END = ord("E")
KIND_OUTPUT = ord("O")
STDOUT = 1
STDERR = 2
STREAM_NAMES = {STDOUT: "stdout", STDERR: "stderr"}

_LIMITS = {KIND_JSON: MAX_JSON, KIND_DATA: MAX_DATA, KIND_END: 0, KIND_OUTPUT: MAX_DATA + 16}


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame."""


# JSON through the C accelerator that the json module itself drives, without importing json:
# json's decoder imports re, and re enum, ~12 ms of every sandbox's start (issue 19). The
# scanner and the encoder are made with json.loads' and json.dumps' defaults, so the results
# are the same; on any failure the json module redoes the work and raises its own error.
_WHITESPACE = " \t\n\r"


class _Defaults:
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"NaN": float("nan"), "Infinity": float("inf"),
                      "-Infinity": float("-inf")}.__getitem__  # fmt: skip


def _not_serializable(o: object) -> object:
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


_scan: Any
_encode: Any
try:
    import _json

    _scan = _json.make_scanner(_Defaults())  # type: ignore[arg-type]  # it reads these fields
    # No markers: a cycle ends in RecursionError, and json then finds it (and says so).
    _encode = _json.make_encoder(
        None, _not_serializable, _json.encode_basestring_ascii, None, ":", ",", False, False, True
    )
    if "".join(_encode({"a": [1, 0.5, "\xe9", None]}, 0)) != '{"a":[1,0.5,"\\u00e9",null]}' or (
        _scan('{"a":[1,0.5,"\\u00e9",null]}', 0) != ({"a": [1, 0.5, "\xe9", None]}, 27)
    ):
        raise TypeError("not json's accelerator as this module knows it")
except (ImportError, AttributeError, TypeError, ValueError, StopIteration):
    _scan = _encode = None  # another Python: json's own way


def dumps(obj: object) -> str:
    """`json.dumps(obj, separators=(",", ":"))`."""
    if _encode is not None:
        try:
            return "".join(_encode(obj, 0))
        except Exception:  # noqa: BLE001, S110 - json says what is wrong
            pass
    import json

    return json.dumps(obj, separators=(",", ":"))


def loads(data: bytes | str) -> object:
    """`json.loads(data)`."""
    if _scan is not None:
        try:
            s = data.decode() if isinstance(data, bytes) else data
            start = len(s) - len(s.lstrip(_WHITESPACE))
            obj, end = _scan(s, start)
            if not s[end:].strip(_WHITESPACE):
                return obj
        except Exception:  # noqa: BLE001, S110 - json says what is wrong
            pass
    import json

    return json.loads(data)


def encode(kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


def encode_json(obj: dict) -> bytes:
    return encode(KIND_JSON, dumps(obj).encode())


def encode_output(stream: int, offset: int, data: bytes) -> bytes:
    return encode(KIND_OUTPUT, OUTPUT_HEADER.pack(stream, offset) + data)


def check_header(kind: int, length: int) -> None:
    limit = _LIMITS.get(kind)
    if limit is None:
        raise ProtocolError(f"unknown frame kind {kind}")
    if length > limit:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {limit}")


def decode_json(payload: bytes) -> dict:
    try:
        obj = loads(payload)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"bad JSON frame: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("JSON frame is not an object")
    return obj


def decode_output(payload: bytes) -> tuple[int, int, bytes]:
    if len(payload) < OUTPUT_HEADER.size:
        raise ProtocolError("short output frame")
    stream, offset = OUTPUT_HEADER.unpack_from(payload)
    if stream not in STREAM_NAMES:
        raise ProtocolError(f"unknown output stream {stream}")
    return stream, offset, payload[OUTPUT_HEADER.size :]


def error(code: str, message: str, **detail: object) -> dict:
    return {"ok": False, "code": code, "message": message, "detail": detail}
