"""Property-based fuzzing of every route in the server's own OpenAPI schema (schemathesis).

A real server is started, its `/openapi.json` is loaded into schemathesis, and for every
operation hypothesis generates both schema-valid (positive) and schema-violating (negative)
requests. Each request is authenticated (a tenant key; an admin key for admin routes), and
sandbox routes are also fuzzed against a live sandbox of that tenant (and a live and a finished
command in it), so generated bodies reach the manager and the in-sandbox agent rather than
stopping at `404 not_found`. Random generation rarely lands on the values that break things, so
an edge pass then sets every query, path and body field (one at a time, nested ones too) to
each of a fixed list of hostile values: NUL bytes, trailing newlines, `..`, huge digit strings,
infinities, 2^63, signal-module constants... The contract checked on every response:

- no status >= 500 (bad input is the caller's fault and must say so with a 4xx);
- every 4xx has the documented JSON error body with a non-empty `code` and `message`;
- the server never crashes or hangs (process alive, requests answered within a timeout,
  foreground command streams end, no traceback in its log), and is healthy at the end;
- no sandbox is leaked: every sandbox the fuzzer creates is killed.

It is bounded and deterministic by default (`derandomize`, AGENTBOX_FUZZ_EXAMPLES examples per
operation and generation mode, default 4: CI time). For a long, randomised run:

    AGENTBOX_FUZZ_EXAMPLES=500 AGENTBOX_FUZZ_RANDOM=1 \\
        .venv/bin/pytest -q -s --timeout 0 tests/integration/test_api_fuzz.py -k every_operation

(AGENTBOX_FUZZ_VERBOSE=1 prints every request and answer.)
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from conftest import ServerHandle, create_sandbox, run, start_server
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

EXAMPLES = int(os.environ.get("AGENTBOX_FUZZ_EXAMPLES", "4"))
RANDOM = os.environ.get("AGENTBOX_FUZZ_RANDOM", "") not in ("", "0")
REQUEST_TIMEOUT = 30.0  # any single answer slower than this is a hang
STREAM_PEEK_S = 1.0  # how long to follow an NDJSON stream that may legitimately wait
CMD_TIMEOUT_CAP = 2.0  # fuzzed commands run for at most this long
FOREGROUND_GRACE_S = 20.0  # a foreground command stream must end within cap + this
READ_CAP = 4 << 20  # bytes of a response body we bother to read
VERBOSE = os.environ.get("AGENTBOX_FUZZ_VERBOSE", "") not in ("", "0")  # print every exchange

# Known-good values of required inputs, so that each edge value is the only thing that is odd.
EDGE_BASE: dict[str, Any] = {
    "cmd": "true",
    "path": "fuzz/edge.txt",
    "src": "fuzz/edge.txt",
    "dst": "fuzz/edge2.txt",
    "tenant": "fuzz-edge",
    "timeout": 60,
}

# Values each field is set to in the edge pass, whatever its declared type.
STRING_EDGES: list[Any] = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "A\n",
    "\n",
    "/",
    ".",
    "..",
    "../../etc",
    "/proc/self/status",
    "%",
    "\\",
    "9" * 32,
    "-1",
    "1e999",
    "NaN",
    "\ufffd",
    "\U0001f600",
    "x" * 5000,
    "SIG_IGN",
    "a=b",
]
NUMBER_EDGES: list[Any] = [
    0,
    -1,
    1,
    0.5,
    1e-300,
    1e308,
    float("inf"),
    float("nan"),
    1 << 31,
    1 << 63,
    1 << 64,
    True,
    None,
    [],
    {},
]

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=not RANDOM,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: failures are recorded, not raised
    suppress_health_check=list(HealthCheck),
    print_blob=False,
    verbosity=Verbosity.quiet,  # failures are collected and reported by the test itself
)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    """A private server: fuzzing creates keys and quotas we do not want in the shared one."""
    handle = start_server(tmp_path_factory.mktemp("fuzz"))
    try:
        yield handle
    finally:
        if handle.proc is None or handle.proc.poll() is not None:
            handle.proc = None
            handle.start()  # sandboxes outlive the server: a fresh one can still kill them
        handle.kill_all_sandboxes()
        handle.stop()


def load_schema(server: ServerHandle) -> Any:
    r = httpx.get(f"{server.url}/openapi.json", timeout=10)
    assert r.status_code == 200, r.text
    return schemathesis.openapi.from_dict(r.json())


def operations(schema: Any) -> list[Any]:
    return [result.ok() for result in schema.get_all_operations()]


def documented_codes() -> set[str]:
    """The reason codes docs/API.md promises (the backticked words of its **Errors** item)."""
    text = (Path(__file__).parents[2] / "docs" / "API.md").read_text()
    item = text.split("- **Errors**", 1)[1].split("\n- **", 1)[0]
    return set(re.findall(r"`([a-z_]+)`", item)) - {"code", "message", "detail"}


DOCUMENTED_CODES = documented_codes()


def error_body_problem(r: httpx.Response, body: bytes) -> str | None:
    """Why a 4xx body is not the documented `{"code", "message", "detail"}`, or None."""
    try:
        data = json.loads(body)
    except ValueError:
        return f"not JSON ({r.headers.get('content-type')}): {body[:200]!r}"
    if not isinstance(data, dict):
        return f"not a JSON object: {body[:200]!r}"
    for name in ("code", "message"):
        value = data.get(name)
        if not isinstance(value, str) or not value.strip():
            return f"{name} missing or empty: {body[:300]!r}"
    if data["code"] not in DOCUMENTED_CODES:
        return f"code {data['code']!r} is not documented in docs/API.md: {body[:300]!r}"
    if not isinstance(data.get("detail", {}), dict):
        return f"detail is not an object: {body[:300]!r}"
    return None


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


@dataclass
class Fuzzer:
    server: ServerHandle
    tenant_key: str
    admin_key: str
    raw_schema: dict[str, Any] = field(default_factory=dict)
    client: httpx.Client = field(init=False)
    sandbox_id: str | None = None
    cmd_ids: dict[str, str] = field(default_factory=dict)
    failures: dict[tuple[str, ...], str] = field(default_factory=dict)
    statuses: dict[str, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    created: int = 0
    requests: int = 0

    def __post_init__(self) -> None:
        self.client = httpx.Client(
            base_url=self.server.url,
            timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=5.0),
        )

    # -------------------------------------------------------------- the pinned sandbox

    def live_sandbox(self) -> str:
        """The tenant's fuzzing target, recreated if a fuzzed kill or timeout ended it."""
        if self.sandbox_id is not None:
            r = self.client.get(
                f"/v1/sandboxes/{self.sandbox_id}", headers={"X-API-Key": self.tenant_key}
            )
            if r.status_code == 200 and r.json()["state"] == "running":
                return self.sandbox_id
            self.client.delete(
                f"/v1/sandboxes/{self.sandbox_id}", headers={"X-API-Key": self.tenant_key}
            )
        with self.server.client(self.tenant_key) as c:
            sid = create_sandbox(c, timeout=3600)["sandbox_id"]
            self.sandbox_id = sid
            r = c.post(
                f"/v1/sandboxes/{sid}/commands",
                json={"cmd": "cat", "background": True, "stdin": True, "timeout": 0},
            )
            assert r.status_code == 201, r.text
            self.cmd_ids["running"] = r.json()["cmd_id"]
            self.cmd_ids["done"] = run(c, sid, "echo fuzz").events[0]["cmd_id"]
        return sid

    # -------------------------------------------------------------- one generated request

    def fail(
        self, op: Any, kind: str, detail: str, request: str, key: str = "", path: Any = None
    ) -> None:
        text = f"{op.label}: {kind}: {detail}\n    request: {request}"
        self.failures.setdefault((op.label, kind, key), text)

    def execute(self, op: Any, case: Any, pinned: bool, cmd_choice: str | None) -> None:
        admin_route = "admin" in (op.tags or [])
        key = self.admin_key if admin_route else self.tenant_key
        if pinned:
            case.path_parameters = dict(case.path_parameters or {})
            case.path_parameters["sandbox_id"] = self.live_sandbox()
            if cmd_choice and "cmd_id" in case.path_parameters:
                case.path_parameters["cmd_id"] = self.cmd_ids[cmd_choice]
        is_run = op.method.upper() == "POST" and op.path.endswith("/commands")
        if is_run and isinstance(case.body, dict):
            # Fuzzed text runs as bash: bound it, whatever it turns out to be.
            t = case.body.get("timeout", 60)
            if isinstance(t, int | float) and not isinstance(t, bool) and 0 <= t <= 10**9:
                case.body["timeout"] = min(t, CMD_TIMEOUT_CAP) or CMD_TIMEOUT_CAP
        kw = case.as_transport_kwargs(base_url=self.server.url)
        headers = {
            k: v
            for k, v in (kw.get("headers") or {}).items()
            if k.lower() not in ("x-api-key", "x-schemathesis-testcaseid")
        }
        headers["X-API-Key"] = key
        send: dict[str, Any] = {"params": kw.get("params") or None, "headers": headers}
        if "json" in kw:
            send["json"] = kw["json"]
        elif "data" in kw:
            data = kw["data"]
            if isinstance(data, dict):
                send["data"] = data
            elif data is not None:
                send["content"] = data if isinstance(data, bytes) else str(data).encode()
        desc = f"{kw['method']} {kw['url']} " + _short(
            {k: v for k, v in send.items() if k != "headers" and v is not None}
        )
        # An event stream of a running command, or a directory watch, legitimately waits for
        # output: peek, then go.
        waits = op.method.upper() == "GET" and op.path.endswith(("/events", "/files/watch"))
        read = STREAM_PEEK_S if waits else REQUEST_TIMEOUT
        timeout = httpx.Timeout(REQUEST_TIMEOUT, connect=5.0, read=read)
        try:
            request = self.client.build_request(kw["method"], kw["url"], timeout=timeout, **send)
        except (httpx.HTTPError, httpx.InvalidURL, TypeError, ValueError, UnicodeError):
            return  # not expressible as an HTTP request: nothing to send
        self.requests += 1
        started = time.monotonic()
        try:
            r = self.client.send(request, stream=True)
        except httpx.TimeoutException:
            self.fail(op, "hang", f"no answer within {REQUEST_TIMEOUT}s", desc)
            return
        except httpx.TransportError as e:
            self.fail(op, "connection", f"{type(e).__name__}: {e}", desc)
            self.check_alive(op, desc)
            return
        try:
            self.statuses[op.label][r.status_code] += 1
            ndjson = r.headers.get("content-type", "").startswith("application/x-ndjson")
            if ndjson:
                self.follow_stream(op, r, desc, started, must_end=is_run)
                body = b""
            else:
                body = self.read_body(op, r, desc)
        finally:
            r.close()
        if VERBOSE:
            print(f"{r.status_code} {desc[:200]} -> {body[:200]!r}")
        if r.status_code >= 500:
            path = (send["params"] or {}).get("path")
            self.fail(op, "5xx", f"{r.status_code} {body[:500]!r}", desc, str(r.status_code), path)
        elif 400 <= r.status_code < 500:
            problem = error_body_problem(r, body)
            if problem:
                self.fail(op, "4xx without reason", f"{r.status_code}: {problem}", desc)
        if op.method.upper() == "POST" and op.path == "/v1/sandboxes" and r.status_code == 201:
            self.created += 1
            sid = json.loads(body)["sandbox_id"]
            k = self.client.delete(f"/v1/sandboxes/{sid}", headers={"X-API-Key": key})
            assert k.status_code == 204, k.text
        self.check_alive(op, desc)

    def read_body(self, op: Any, r: httpx.Response, desc: str) -> bytes:
        out = b""
        try:
            for chunk in r.iter_bytes():
                out += chunk
                if len(out) >= READ_CAP:
                    break
        except httpx.TimeoutException:
            self.fail(op, "hang", "response body stalled", desc)
        except httpx.TransportError as e:
            self.fail(op, "broken body", f"{type(e).__name__}: {e}", desc)
        return out

    def follow_stream(
        self, op: Any, r: httpx.Response, desc: str, started: float, must_end: bool
    ) -> None:
        """Read NDJSON events; a foreground run must end, other streams may keep waiting."""
        limit = CMD_TIMEOUT_CAP + FOREGROUND_GRACE_S if must_end else STREAM_PEEK_S
        last: dict[str, Any] | None = None
        try:
            for line in r.iter_lines():
                if line:
                    try:
                        last = json.loads(line)
                    except ValueError:
                        self.fail(op, "bad NDJSON", _short(line), desc)
                        return
                    if last.get("type") == "end":
                        return
                if time.monotonic() - started > limit:
                    break
        except httpx.TimeoutException:
            pass
        except httpx.TransportError as e:
            self.fail(op, "broken stream", f"{type(e).__name__}: {e}", desc)
            return
        if must_end and (last is None or last.get("type") not in ("end", "error")):
            self.fail(op, "hang", f"stream did not end within {limit}s (last {last})", desc)

    def check_alive(self, op: Any, desc: str) -> None:
        proc = self.server.proc
        if proc is not None and proc.poll() is not None:
            self.fail(op, "server crashed", f"exit code {proc.returncode}", desc)
            raise RuntimeError(f"the server died during fuzzing; last request: {desc}")

    # -------------------------------------------------------------- one operation

    def fuzz(self, op: Any, mode: GenerationMode, pinned: bool) -> None:
        strategy = op.as_strategy(generation_mode=mode)
        choices: list[str | None] = [None]
        if pinned and "{cmd_id}" in op.path:
            choices = ["running", "done", None]

        @FUZZ_SETTINGS
        @given(case=strategy, cmd_choice=st.sampled_from(choices))
        def fuzz_one(case: Any, cmd_choice: str | None) -> None:
            self.execute(op, case, pinned, cmd_choice)

        try:
            fuzz_one()
        except Unsatisfiable:
            pass  # e.g. negative mode for an operation with no inputs to break

    # -------------------------------------------------------------- the edge pass

    def template(self, op: Any) -> Any:
        """A schema-valid case of `op`, for the values of required inputs with no known-good one."""
        found: list[Any] = []

        @settings(FUZZ_SETTINGS, max_examples=1, derandomize=True)
        @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE))
        def grab(case: Any) -> None:
            found.append(case)

        grab()
        return found[0]

    def fields(self, op: Any) -> tuple[list[tuple[str, str, bool]], set[str]]:
        """(location, name, is a string map) of every input of `op` (nested ones as `a.b`), and
        the names of the required ones."""
        raw = self.raw_schema["paths"][op.path][op.method.lower()]
        schemas = self.raw_schema.get("components", {}).get("schemas", {})
        params = [p for p in raw.get("parameters", []) if p["in"] in ("query", "path")]
        out = [(p["in"], p["name"], False) for p in params]
        required = {p["name"] for p in params if p.get("required")}

        def ref(node: Any) -> dict[str, Any] | None:
            m = re.search(r'"#/components/schemas/([^"]+)"', json.dumps(node))
            return schemas.get(m.group(1)) if m else None

        body = raw.get("requestBody", {}).get("content", {}).get("application/json")
        model = (ref(body["schema"]) if body else None) or {}
        required |= set(model.get("required", []))
        for name, prop in model.get("properties", {}).items():
            nested = ref(prop)
            if nested is not None:
                out += [("body", f"{name}.{sub}", False) for sub in nested.get("properties", {})]
            out.append(("body", name, prop.get("type") == "object"))
        return out, required

    def edges(self, op: Any) -> None:
        """Each input set to each edge value in turn; every other input left out or valid."""
        pinned = "{sandbox_id}" in op.path
        fields, required = self.fields(op)
        base = self.template(op)
        good = {**dict(base.query or {}), **(base.body if isinstance(base.body, dict) else {})}
        good = {k: EDGE_BASE.get(k, v) for k, v in good.items() if k in required}
        for i, (where, name, is_map) in enumerate(fields):
            if where == "path" and name == "sandbox_id" and pinned:
                continue
            values = [*STRING_EDGES, *NUMBER_EDGES]
            if is_map:
                values = [{v: "v"} for v in STRING_EDGES] + [{"K": v} for v in STRING_EDGES]
            for j, value in enumerate(values):
                case = op.Case(
                    path_parameters=dict(base.path_parameters or {}),
                    query={k: v for k, v in good.items() if k in (base.query or {})},
                    body=(
                        {k: v for k, v in good.items() if k in base.body}
                        if isinstance(base.body, dict)
                        else base.body
                    ),
                    media_type=base.media_type,
                )
                if where == "body":
                    if not isinstance(case.body, dict):
                        case.body = {}
                    outer, _, inner = name.partition(".")
                    if inner:
                        case.body[outer] = {inner: value}
                    else:
                        case.body[name] = value
                elif where == "query":
                    case.query[name] = value
                else:
                    case.path_parameters[name] = value
                cmd_choice = None
                if pinned and "{cmd_id}" in op.path and name != "cmd_id":
                    cmd_choice = ("running", "done")[(i + j) % 2]
                self.execute(op, case, pinned, cmd_choice)

    def cleanup(self) -> None:
        if self.sandbox_id:
            self.client.delete(
                f"/v1/sandboxes/{self.sandbox_id}", headers={"X-API-Key": self.tenant_key}
            )
        self.client.close()


@pytest.mark.timeout(600)  # ~150 s alone; more beside the battery (tests/conftest.py)
def test_fuzz_every_operation(fuzz_server: ServerHandle) -> None:
    raw = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=10).json()
    ops = operations(schemathesis.openapi.from_dict(raw))
    assert len(ops) >= 20, [op.label for op in ops]
    fz = Fuzzer(
        fuzz_server,
        tenant_key=fuzz_server.make_key("fuzz-tenant"),
        admin_key=fuzz_server.make_key("fuzz-admin", admin=True),
        raw_schema=raw,
    )
    assert fuzz_server.log_path is not None
    log_start = fuzz_server.log_path.stat().st_size
    started = time.monotonic()
    fuzzed: set[str] = set()
    try:
        for op in ops:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                fz.fuzz(op, mode, pinned=False)
                if "{sandbox_id}" in op.path:
                    fz.fuzz(op, mode, pinned=True)
            fz.edges(op)
            fuzzed.add(op.label)
    finally:
        fz.cleanup()
    elapsed = time.monotonic() - started

    summary = "\n".join(
        f"  {label}: {dict(sorted(counts.items()))}"
        for label, counts in sorted(fz.statuses.items())
    )
    print(
        f"\nfuzzed {len(ops)} operations, {fz.requests} requests, {fz.created} sandboxes "
        f"created and killed, {EXAMPLES} examples/op/mode, {elapsed:.1f}s\n{summary}"
    )
    assert fuzzed == {op.label for op in ops}
    assert not fz.failures, (
        f"{len(fz.failures)} problems (server log: {fuzz_server.log_path}):\n"
        + "\n".join(fz.failures.values())
    )

    # The server is still healthy, logged no unhandled error, and nothing the fuzzer created
    # is left running.
    assert fuzz_server.proc is not None and fuzz_server.proc.poll() is None
    assert httpx.get(f"{fuzz_server.url}/v1/health", timeout=10).status_code == 200
    with open(fuzz_server.log_path, "rb") as f:
        f.seek(log_start)
        log = f.read().decode(errors="replace")
    assert "Traceback" not in log, log[-4000:]
    fuzz_server.kill_all_sandboxes()
    with fuzz_server.client(fz.tenant_key) as c:
        left = c.get("/v1/sandboxes", params={"state": "running,starting"}).json()
    assert left["sandboxes"] == [], left
    runtime_dirs = [
        p.name
        for p in (fuzz_server.data_dir / "sandboxes").glob("sbx_*")
        if re.fullmatch(r"sbx_[0-9a-f]{16}", p.name)
    ]
    assert runtime_dirs == [], runtime_dirs


def test_every_operation_refuses_missing_and_bad_keys(fuzz_server: ServerHandle) -> None:
    """401 with a reason on every route but health, whatever the path holds."""
    schema = load_schema(fuzz_server)
    for op in operations(schema):
        if op.path == "/v1/health":
            continue
        path = re.sub(r"\{[^}]+\}", "x", op.path)
        for headers in ({}, {"X-API-Key": "abx_nope_nope"}, {"X-API-Key": ""}):
            r = httpx.request(op.method.upper(), fuzz_server.url + path, headers=headers)
            assert r.status_code == 401, (op.label, headers, r.status_code, r.text)
            assert error_body_problem(r, r.content) is None, (op.label, r.text)


# ------------------------------------------------------------------ regressions found by fuzzing


def test_timeout_racing_expiry_never_resurrects_a_sandbox(fuzz_server: ServerHandle) -> None:
    """Fuzzed `timeout: 1e-300` then another timeout call: the second landed while the reaper
    was tearing the sandbox down and re-cached it as running, so GET said `running` forever
    while every command answered `409 expired`. Either outcome of the race is fine (expired,
    or extended in time); an answer that contradicts itself is not."""
    key = fuzz_server.make_key("fuzz-timeout-race")
    with fuzz_server.client(key) as c:
        for follow_up in (60, 1e-300, 60):
            sid = create_sandbox(c, timeout=600)["sandbox_id"]
            r = c.post(f"/v1/sandboxes/{sid}/timeout", json={"timeout": 1e-300})
            assert r.status_code == 200, r.text
            r = c.post(f"/v1/sandboxes/{sid}/timeout", json={"timeout": follow_up})
            assert r.status_code in (200, 409), r.text
            time.sleep(0.5)
            state = c.get(f"/v1/sandboxes/{sid}").json()["state"]
            r = c.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "true"})
            if state == "running":
                assert r.status_code == 200, (follow_up, r.text)
                c.delete(f"/v1/sandboxes/{sid}")
            else:
                assert state == "expired", state
                assert r.status_code == 409 and r.json()["code"] == "sandbox_not_running", r.text


def test_unparseable_body_and_unknown_routes_answer_documented_codes(
    fuzz_server: ServerHandle,
) -> None:
    """A body that is not UTF-8 JSON answered `400 http_error` ("There was an error parsing the
    body"): a code docs/API.md does not list. Unknown routes and methods said only "Not Found"."""
    key = fuzz_server.make_key("fuzz-framework-errors")
    with fuzz_server.client(key) as c:
        for path in ("/v1/sandboxes", "/v1/sandboxes/sbx_x/files/mkdir"):
            r = c.post(path, content=b"\x86\xec", headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text
            assert r.json()["code"] == "invalid_request" and "JSON" in r.json()["message"]
        r = c.get("/v1/nope")
        assert r.status_code == 404 and r.json()["code"] == "not_found"
        assert "GET /v1/nope" in r.json()["message"]
        r = c.patch("/v1/sandboxes")
        assert r.status_code == 405 and r.json()["code"] == "method_not_allowed", r.text
        assert "PATCH /v1/sandboxes" in r.json()["message"]
    for code in ("invalid_request", "not_found", "method_not_allowed"):
        assert code in DOCUMENTED_CODES


def test_out_of_range_next_token_is_400(fuzz_server: ServerHandle) -> None:
    """A digits-only next_token beyond SQLite's integers was a 500 (OverflowError)."""
    key = fuzz_server.make_key("fuzz-next-token")
    with fuzz_server.client(key) as c:
        for token in ("9" * 32, "-1", str(1 << 63)):
            r = c.get("/v1/sandboxes", params={"next_token": token})
            assert r.status_code == 400, (token, r.text)
            assert r.json()["code"] == "invalid_request"
        assert c.get("/v1/sandboxes", params={"next_token": "12"}).status_code == 200


def test_nul_in_cmd_and_newline_in_env_names_are_400(fuzz_server: ServerHandle) -> None:
    """A NUL in `cmd` reached Popen in the agent: `500 agent_error` (embedded null byte). An env
    name with a trailing newline passed the `^...$` check (`$` matches before a final "\\n")."""
    key = fuzz_server.make_key("fuzz-cmd-input")
    with fuzz_server.client(key) as c:
        sid = create_sandbox(c)["sandbox_id"]
        for background in (False, True):
            r = c.post(
                f"/v1/sandboxes/{sid}/commands",
                json={"cmd": "echo\x00hi", "background": background},
            )
            assert r.status_code == 400, r.text
            assert r.json()["code"] == "invalid_request" and "NUL" in r.json()["message"]
        r = c.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "true", "envs": {"A\n": "x"}})
        assert r.status_code == 400 and r.json()["code"] == "invalid_request", r.text
        r = c.post("/v1/sandboxes", json={"envs": {"A\n": "x"}})
        assert r.status_code == 400 and r.json()["code"] == "invalid_request", r.text
        assert run(c, sid, "echo ok", envs={"A_1": "x"}).stdout == "ok\n"
        c.delete(f"/v1/sandboxes/{sid}")


def test_quota_values_are_finite_and_bounded(fuzz_server: ServerHandle) -> None:
    """`max_timeout: 1e999` (infinity) and unbounded integers were accepted into a quota."""
    with fuzz_server.client() as admin:
        for body in (
            b'{"max_timeout": 1e999}',
            b'{"max_cpu_count": 1e999}',
            b'{"max_memory_mb": 1000000000000000000000000000000}',
        ):
            r = admin.put(
                "/v1/tenants/fuzz-quota/quota",
                content=body,
                headers={"Content-Type": "application/json"},
            )
            assert r.status_code == 422 and r.json()["code"] == "invalid_request", (body, r.text)
        r = admin.put("/v1/tenants/fuzz-quota/quota", json={"max_timeout": 3600})
        assert r.status_code == 200 and r.json()["max_timeout"] == 3600, r.text


def test_non_utf8_names_are_listed_not_500(fuzz_server: ServerHandle) -> None:
    """A file name (or symlink target) that is not UTF-8 made listing the directory a 500 and
    an error quoting it unserialisable; such bytes are now shown as U+FFFD."""
    key = fuzz_server.make_key("fuzz-names")
    with fuzz_server.client(key) as c:
        sid = create_sandbox(c)["sandbox_id"]
        res = run(c, sid, "touch $'bad\\xff' && ln -s $'\\xfe' link && ls | wc -l")
        assert res.stdout.strip() == "2", res
        r = c.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "/workspace"})
        assert r.status_code == 200, r.text
        entries = {e["name"]: e for e in r.json()["entries"]}
        assert "bad\ufffd" in entries and entries["bad\ufffd"]["path"] == "/workspace/bad\ufffd"
        assert entries["link"]["symlink_target"] == "\ufffd"
        r = c.get(f"/v1/sandboxes/{sid}/files/stat", params={"path": "link/x"})
        assert r.status_code == 400 and r.json()["code"] == "symlink_refused", r.text
        c.delete(f"/v1/sandboxes/{sid}")


def test_only_real_signal_names_are_accepted(fuzz_server: ServerHandle) -> None:
    """`SIG_IGN`, `SIG_DFL`, `SIG_BLOCK` are `signal` module constants, not signals: `sig_ign`
    was taken as signal 1 (SIGHUP)."""
    key = fuzz_server.make_key("fuzz-signals")
    with fuzz_server.client(key) as c:
        sid = create_sandbox(c)["sandbox_id"]
        r = c.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "sleep 30", "background": True})
        assert r.status_code == 201, r.text
        cmd = r.json()["cmd_id"]
        for bad in ("sig_ign", "SIG_DFL", "_IGN", "SIG_BLOCK", "Signals", "", 0, 65):
            r = c.post(f"/v1/sandboxes/{sid}/commands/{cmd}/kill", json={"signal": bad})
            assert r.status_code == 400 and r.json()["code"] == "invalid_request", (bad, r.text)
        r = c.get(f"/v1/sandboxes/{sid}/commands/{cmd}")
        assert r.json()["running"] is True, r.text
        r = c.post(f"/v1/sandboxes/{sid}/commands/{cmd}/kill", json={"signal": "term"})
        assert r.status_code == 204, r.text
        c.delete(f"/v1/sandboxes/{sid}")


# ------------------------------------------------------------------ agent bugs the fuzzer found


def test_deep_listing_of_root_is_not_5xx(fuzz_server: ServerHandle) -> None:
    key = fuzz_server.make_key("fuzz-list-root")
    with fuzz_server.client(key) as c:
        sid = create_sandbox(c)["sandbox_id"]
        try:
            r = c.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "/", "depth": 8})
            assert r.status_code < 500, r.text
        finally:
            c.delete(f"/v1/sandboxes/{sid}")


def test_writing_to_root_is_400_invalid_path(fuzz_server: ServerHandle) -> None:
    key = fuzz_server.make_key("fuzz-write-root")
    with fuzz_server.client(key) as c:
        sid = create_sandbox(c)["sandbox_id"]
        try:
            r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/"}, content=b"x" * 100_000)
            assert r.status_code == 400 and r.json()["code"] == "invalid_path", r.text
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
