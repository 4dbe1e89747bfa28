"""Property-based fuzzing of E2B's surfaces (issue 17): the control plane's REST routes, envd's
`/files`, envd's Connect RPC (unary and streamed methods) and the code interpreter's port.

E2B's routes are not in agentbox's OpenAPI schema (they are E2B's), so schemathesis does not
reach them (test_api_fuzz.py); here hypothesis builds requests from each route's field names
with hostile and random JSON values, authenticated as a real client would be (a tenant's API
key; the sandbox's envd token), against a live sandbox. The contract on every answer: no
status >= 500 and no Connect error `internal` (bad input is the caller's fault and is said with
a 4xx or a Connect code naming it), every REST error in E2B's `{"code", "message"}` body, an
answer within REQUEST_TIMEOUT, and a server that is healthy at the end with no traceback in its
log. Bounded and deterministic (`derandomize`); AGENTBOX_FUZZ_EXAMPLES raises the count.
"""

from __future__ import annotations

import json
import os
import shlex
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from conftest import ServerHandle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("AGENTBOX_FUZZ_EXAMPLES", "12"))
REQUEST_TIMEOUT = 30.0
STREAM_READ = 256 << 10  # bytes of a streamed answer read before letting go

HOSTILE = st.sampled_from(
    [
        "", "\0", "a\nb", "..", "../../etc/passwd", "/", "/proc/1/mem", "/dev/zero", "x" * 5000,
        -1, 0, 2**63, -(2**63), 2**64, 1e308, float("inf"), True, None, [], {}, [1, "a"],
        {"a": {"b": {"c": None}}}, "sbx_0000000000000000", "snap_0000000000000000", "\udcff",
    ]
)  # fmt: skip
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
VALUE = HOSTILE | JSON


def bodies(*fields: str) -> st.SearchStrategy[Any]:
    """Objects built from a route's field names (any subset, any values), or any JSON."""
    shaped = (
        st.dictionaries(st.sampled_from(fields), VALUE, max_size=len(fields))
        if fields
        else st.just({})
    )
    return shaped | JSON


def _json(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")


# (method, path, body field names; None: no body). `{id}` is the live sandbox.
REST = [
    ("POST", "/sandboxes", ("templateID", "timeout", "secure", "metadata", "envVars", "network",
                            "autoPause", "autoResume", "volumeMounts", "allow_internet_access")),
    ("POST", "/v2/sandboxes", ("templateID", "timeout", "metadata", "envVars", "lifecycle")),
    ("GET", "/v2/sandboxes", None),
    ("GET", "/sandboxes/{id}", None),
    ("POST", "/sandboxes/{id}/timeout", ("timeout",)),
    ("POST", "/sandboxes/{id}/connect", ("timeout", "memory")),
    ("POST", "/v2/sandboxes/{id}/connect", ("timeout", "memory")),
    ("GET", "/sandboxes/{id}/metrics", None),
    ("POST", "/sandboxes/{id}/snapshots", ("name", "memory")),
    ("GET", "/snapshots", None),
    ("DELETE", "/templates/{value}", None),
    ("PUT", "/sandboxes/{id}/network", ("allowOut", "denyOut", "allowInternetAccess", "rules")),
    ("POST", "/sandboxes/{id}/fork", ("timeout", "count")),
]  # fmt: skip
UNARY = {
    "/process.Process/List": (),
    "/process.Process/SendInput": ("process", "input"),
    "/process.Process/SendSignal": ("process", "signal"),
    "/process.Process/CloseStdin": ("process",),
    "/process.Process/Update": ("process", "pty"),
    "/filesystem.Filesystem/Stat": ("path",),
    "/filesystem.Filesystem/MakeDir": ("path",),
    "/filesystem.Filesystem/Move": ("source", "destination"),
    "/filesystem.Filesystem/ListDir": ("path", "depth"),
    "/filesystem.Filesystem/Remove": ("path",),
    "/filesystem.Filesystem/CreateWatcher": ("path", "recursive", "includeEntry"),
    "/filesystem.Filesystem/GetWatcherEvents": ("watcherId",),
    "/filesystem.Filesystem/RemoveWatcher": ("watcherId",),
}
STREAMS = {
    "/process.Process/Start": ("process", "pty", "tag", "stdin"),
    "/process.Process/Connect": ("process",),
    "/filesystem.Filesystem/WatchDir": ("path", "recursive"),
}
INTERPRETER = [
    ("POST", "/execute", ("code", "context_id", "language", "env_vars")),
    ("POST", "/contexts", ("language", "cwd")),
    ("GET", "/contexts", None),
    ("POST", "/contexts/{value}/restart", None),
    ("DELETE", "/contexts/{value}", None),
]
QUERY = st.dictionaries(
    st.sampled_from(["path", "username", "limit", "nextToken", "state", "metadata", "start", "end",
                     "template", "order", "signature", "signature_expiration", "sandboxID"]),
    st.text(max_size=30) | st.sampled_from(["-1", "0", "1e309", "9" * 40, "\0", "root", "user"]),
    max_size=4,
)  # fmt: skip
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


class Target:
    def __init__(self, server: ServerHandle) -> None:
        self.key = server.make_key(f"e2b-fuzz-{os.getpid()}")
        self.client = httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT)
        made = self.client.post(
            "/v2/sandboxes", json={"templateID": "host", "timeout": 600}, headers=self.api
        )
        assert made.status_code == 201, made.text
        self.id = made.json()["sandboxID"]
        self.token = made.json()["envdAccessToken"]
        self.seen: list[str] = []

    @property
    def api(self) -> dict[str, str]:
        return {"X-API-KEY": self.key}

    def envd(self, port: int = 49983) -> dict[str, str]:
        return {
            "E2b-Sandbox-Id": self.id,
            "E2b-Sandbox-Port": str(port),
            "X-Access-Token": self.token,
        }

    def check(self, what: str, r: httpx.Response, body: bytes, connect: bool = False) -> None:
        self.seen.append(f"{what} {r.status_code}")
        assert r.status_code < 500, f"{what}: {r.status_code} {body[:500]!r}"
        if connect:
            # Framing errors are `internal` by Connect's own rule ("protocol error: ...", as in
            # connect-go); any other internal error is a bug of ours.
            internal = body.replace(b'"internal", "message": "protocol error', b"")
            assert b'"internal"' not in internal, f"{what}: Connect internal error {body[:500]!r}"
        elif r.status_code >= 400 and r.headers.get("content-type", "").startswith(
            "application/json"
        ):
            err = json.loads(body)  # E2B's shape; a path no route has gets agentbox's 404
            assert err.get("code") and err.get("message"), f"{what}: {body[:300]!r}"

    def send(self, method: str, path: str, headers: dict[str, str], **kw: Any) -> None:
        with self.client.stream(method, path, headers=headers, **kw) as r:
            body = b""
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) > STREAM_READ:
                    break
        self.check(f"{method} {path}", r, body, connect="." in path.split("/")[1])


@pytest.fixture(scope="module")
def target(server: ServerHandle) -> Any:
    t = Target(server)
    offset = server.log_path.stat().st_size if server.log_path else 0
    yield t
    # Whatever the fuzz did to it, the server answers and has logged no traceback.
    assert httpx.get(f"{server.url}/v1/health", timeout=10).status_code == 200
    if server.log_path:
        with open(server.log_path, "rb") as f:
            f.seek(offset)
            assert b"Traceback" not in f.read(), "the server logged a traceback during the fuzz"
    t.client.delete(f"/sandboxes/{t.id}", headers=t.api)
    for r in t.client.get("/v2/sandboxes", headers=t.api).json():
        t.client.delete(f"/sandboxes/{r['sandboxID']}", headers=t.api)
    t.client.close()


def _path(path: str, target: Target, value: Any) -> str:
    segment = quote(str(value), safe="") or "x"  # any text, as one path segment
    return path.replace("{id}", target.id).replace("{value}", segment)


@pytest.mark.parametrize("path", sorted(UNARY))
def test_envd_rpc_unary(target: Target, path: str) -> None:
    @FUZZ
    @given(body=bodies(*UNARY[path]))
    def one(body: Any) -> None:
        headers = {**target.envd(), "Content-Type": "application/json"}
        target.send("POST", path, headers, content=_json(body))

    one()


@pytest.mark.parametrize("path", sorted(STREAMS))
def test_envd_rpc_streams(target: Target, path: str) -> None:
    @FUZZ
    @given(body=bodies(*STREAMS[path]), flags=st.sampled_from([0, 0, 1, 2, 255]))
    def one(body: Any, flags: int) -> None:
        message = _json(body)
        envelope = bytes([flags]) + len(message).to_bytes(4, "big") + message
        headers = {
            **target.envd(),
            "Content-Type": "application/connect+json",
            "Connect-Timeout-Ms": "1000",  # a started command or watch ends with the deadline
        }
        target.send("POST", path, headers, content=envelope)

    one()


def test_envd_files(target: Target) -> None:
    @FUZZ
    @given(query=QUERY, body=st.binary(max_size=2048), method=st.sampled_from(["GET", "POST"]),
           kind=st.sampled_from(["application/octet-stream", "multipart/form-data; boundary=x",
                                 "multipart/form-data", "text/plain"]),
           encoding=st.sampled_from(["", "gzip", "br"]))  # fmt: skip
    def one(query: dict[str, str], body: bytes, method: str, kind: str, encoding: str) -> None:
        headers = {**target.envd(), "Content-Type": kind}
        if encoding:
            headers["Content-Encoding"] = encoding
        target.send(
            method, "/files", headers, params=query, content=body if method == "POST" else None
        )

    one()


@pytest.mark.parametrize(
    ("method", "path", "fields"), INTERPRETER, ids=[f"{m} {p}" for m, p, _ in INTERPRETER]
)
def test_code_interpreter_port(
    target: Target, method: str, path: str, fields: tuple[str, ...] | None
) -> None:
    """The host template has no Jupyter kernel: python cells fail with a clear 4xx, bash and
    javascript run."""

    @FUZZ
    @given(body=bodies(*(fields or ())), value=st.text(max_size=20))
    def one(body: Any, value: str) -> None:
        headers = {**target.envd(49999), "Content-Type": "application/json"}
        if (
            isinstance(body, dict)
            and isinstance(body.get("code"), str)
            and "\0" not in body["code"]
        ):
            # Fuzz the request, not the sandbox: the text is echoed, never run (a cell has no
            # timeout on this port: E2B's client drops the request instead).
            body["code"] = "echo " + shlex.quote(body["code"][:100])
            body.setdefault("language", "bash")
        content = _json(body) if fields is not None else None
        target.send(method, _path(path, target, value), headers, content=content)

    one()


# Last: a fuzzed timeout of 0 ends the live sandbox the other tests use.
@pytest.mark.parametrize(("method", "path", "fields"), REST, ids=[f"{m} {p}" for m, p, _ in REST])
def test_e2b_rest(target: Target, method: str, path: str, fields: tuple[str, ...] | None) -> None:
    @FUZZ
    @given(body=bodies(*(fields or ())), query=QUERY, value=st.text(max_size=20))
    def one(body: Any, query: dict[str, str], value: str) -> None:
        kw: dict[str, Any] = {"params": query}
        if fields is not None:
            kw["content"] = _json(body)
            kw["headers"] = {**target.api, "Content-Type": "application/json"}
        target.send(method, _path(path, target, value), kw.pop("headers", target.api), **kw)

    one()
