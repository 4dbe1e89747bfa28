"""The stock E2B SDKs from PyPI against agentbox, unmodified, pointed at it by E2B's
environment variables only (issue 17, first slice: the control plane, and envd's /health and
/files). Each SDK line gets a virtual environment of its own, made here: the 2.45 line needs
`connectrpc<0.12`, the newest `>=0.12.1`, so they cannot share one. The scenarios run inside
them (e2b_client.py) and assert what E2B does."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ServerHandle, pip_venv, start_server

CLIENT = Path(__file__).with_name("e2b_client.py")
INTERPRETER_CLIENT = Path(__file__).with_name("e2b_interpreter_client.py")
OPERATIONS_CLIENT = Path(__file__).with_name("e2b_operations_client.py")
NPM_CLIENT = Path(__file__).with_name("e2b_npm_client.mjs")
NPM_E2B = "e2b@2.51.0"  # npm's newest here; needs node >= 20.18.1
NPM_SCENARIOS = {
    "lifecycle": ["create", "timeout_list", "pause_connect", "kill"],
    "commands": ["run", "exit_code", "background_stdin_kill", "pty"],
    "files": ["write_read", "filesystem", "watch", "signed_url"],
}
# The SDK lines: the oldest the issue names (creates through POST /sandboxes) and the newest
# (POST /v2/sandboxes).
SDKS = {
    "2.45": ["e2b==2.45.1", "e2b-code-interpreter==2.9.2", "connectrpc<0.12"],
    "2.63": ["e2b==2.63.0", "e2b-code-interpreter==2.11.5"],
}
SCENARIOS = {
    "lifecycle": [
        "create", "get_info", "set_timeout", "list", "pause", "connect_resumes", "kill",
        "timeout_zero",
    ],
    "files": [
        "write_read_text", "stream", "gzip", "multipart", "missing", "users", "metadata",
        "token_required", "signed_urls",
    ],
    "commands": [
        "run", "stream_envs_cwd", "home", "exit_code", "users", "background_kill", "stdin",
        "connect", "timeout",
    ],
    "filesystem": ["make_dir_info", "list", "symlink", "rename_remove", "missing"],
    "pty": ["terminal", "kill"],
    "watch": ["watch_dir", "include_entry", "missing"],
    "tenants": ["tenants"],
    "refusals": ["refusals"],
}  # fmt: skip
VENVS = Path("/var/tmp/agentbox-test-e2b")


def _venv(requirements: list[str]) -> Path:
    return pip_venv(VENVS, requirements)


def _npm_package(package: str) -> Path:
    """A directory with `package` installed from npm, kept between runs under /var/tmp."""
    node = subprocess.run(["node", "--version"], capture_output=True, text=True, check=True)
    version = tuple(int(x) for x in node.stdout.strip().lstrip("v").split("."))
    assert version >= (20, 18, 1), f"E2B's npm SDK needs node >= 20.18.1, this is {node.stdout}"
    digest = hashlib.sha256(f"{node.stdout}{package}".encode()).hexdigest()[:12]
    home = VENVS / f"npm-{digest}"
    if (home / "ready").exists():
        return home
    home.mkdir(parents=True, exist_ok=True)
    (home / "package.json").write_text('{"name": "agentbox-e2b-npm-test", "private": true}\n')
    done = subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error", package],
        cwd=home,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (home / "ready").touch()
    return home


@pytest.fixture(scope="module", params=sorted(SDKS))
def sdk(request: pytest.FixtureRequest) -> tuple[str, Path]:
    return request.param, _venv(SDKS[request.param])


INTERPRETER_SCENARIOS = {
    "cells": [
        "stateful", "rich_results", "error", "languages", "home_user", "envs",
        "timeout_interrupts",
    ],
    "contexts": ["create", "list", "restart", "remove", "credential"],
}  # fmt: skip


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_e2b_sdk(sdk: tuple[str, Path], scenario: str, server: ServerHandle) -> None:
    _drive(sdk, CLIENT, scenario, SCENARIOS[scenario], server)


def test_e2b_sdk_operations(sdk: tuple[str, Path], server: ServerHandle) -> None:
    """Metrics, snapshots (create, list, start from, delete), fork and network updates."""
    steps = ["metrics", "snapshot", "fork", "delete_snapshot", "update_network"]
    _drive(sdk, OPERATIONS_CLIENT, "operations", steps, server)


@pytest.mark.slow  # the code-interpreter template (built once per machine)
@pytest.mark.parametrize("scenario", sorted(INTERPRETER_SCENARIOS))
def test_e2b_code_interpreter_sdk(
    sdk: tuple[str, Path], scenario: str, ci_server: ServerHandle, full_template: Path
) -> None:
    """`e2b-code-interpreter` on E2B's port 49999, its default template `code-interpreter-v1`
    being agentbox's code interpreter with every kernel (code-interpreter-full)."""
    _drive(sdk, INTERPRETER_CLIENT, scenario, INTERPRETER_SCENARIOS[scenario], ci_server)


def _drive(
    sdk: tuple[str, Path], client: Path, scenario: str, steps: list[str], server: ServerHandle
) -> None:
    line, python = sdk
    tag = f"{time.monotonic_ns() % 10**9}"
    env = {
        **os.environ,
        "E2B_API_URL": server.url,
        "E2B_SANDBOX_URL": server.url,
        "E2B_DOMAIN": "localhost",
        "E2B_API_KEY": server.make_key(f"e2b-{scenario}-{tag}"),
        "E2B_OTHER_API_KEY": server.make_key(f"e2b-other-{tag}"),
        "E2B_VALIDATE_API_KEY": "false",
    }
    env.pop("E2B_DEBUG", None)
    done = subprocess.run(
        [str(python), str(client), scenario], env=env, capture_output=True, text=True, timeout=240
    )
    passed = [line[3:] for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert done.returncode == 0 and passed == steps, (
        f"e2b {line}, {scenario}: passed {passed}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )


# On the gvisor tier (a user-space kernel): the newest SDK line, every area but the terminal
# (runsc's 2022 build turns no ^C into SIGINT, docs/E2B.md) and file metadata (its tmpfs keeps
# no user xattrs).
GVISOR = shutil.which("runsc") is not None
GVISOR_SCENARIOS = {
    "commands": SCENARIOS["commands"],
    "filesystem": SCENARIOS["filesystem"],
    "watch": SCENARIOS["watch"],
}


@pytest.fixture(scope="module")
def gvisor_server(
    tmp_path_factory: pytest.TempPathFactory, full_template: Path
) -> Iterator[ServerHandle]:
    args = ["--runtime", "gvisor", "--template-dir", str(full_template)]
    handle = start_server(tmp_path_factory.mktemp("e2b-gvisor"), args)
    yield handle
    handle.kill_all_sandboxes()
    handle.stop()


@pytest.mark.slow
@pytest.mark.skipif(not GVISOR, reason="runsc is not installed (apt-get install runsc)")
@pytest.mark.parametrize("scenario", [*sorted(GVISOR_SCENARIOS), "cells"])
def test_e2b_sdk_on_gvisor(scenario: str, gvisor_server: ServerHandle) -> None:
    sdk = ("2.63", _venv(SDKS["2.63"]))
    if scenario == "cells":
        steps = INTERPRETER_SCENARIOS["cells"]
        _drive(sdk, INTERPRETER_CLIENT, scenario, steps, gvisor_server)
    else:
        _drive(sdk, CLIENT, scenario, GVISOR_SCENARIOS[scenario], gvisor_server)


@pytest.mark.parametrize("scenario", sorted(NPM_SCENARIOS))
def test_e2b_npm_sdk(scenario: str, server: ServerHandle) -> None:
    """The npm `e2b` package under node, unmodified: sandboxes, commands, terminals, files,
    watching, signed URLs."""
    home = _npm_package(NPM_E2B)
    script = home / NPM_CLIENT.name  # node resolves `e2b` from the script's directory
    shutil.copyfile(NPM_CLIENT, script)
    env = {
        **os.environ,
        "E2B_API_URL": server.url,
        "E2B_SANDBOX_URL": server.url,
        "E2B_DOMAIN": "localhost",
        "E2B_API_KEY": server.make_key(f"e2b-npm-{scenario}-{time.monotonic_ns() % 10**9}"),
    }
    env.pop("E2B_DEBUG", None)
    done = subprocess.run(
        ["node", str(script), scenario], env=env, capture_output=True, text=True, timeout=240
    )
    passed = [line[3:] for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert done.returncode == 0 and passed == NPM_SCENARIOS[scenario], (
        f"npm {NPM_E2B}, {scenario}: passed {passed}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )


def test_envd_headers_never_reach_the_api_without_a_token(server: ServerHandle) -> None:
    """A request with E2B's sandbox headers is the envd surface's, whatever its path: an API
    key does not make it an API request, and without the sandbox's envd token it gets nothing
    (a sandbox that is not running or is not known answers /health 502, the rest 401)."""
    key = server.make_key(f"e2b-headers-{time.monotonic_ns() % 10**9}")
    with server.client(key) as c:
        sid = c.post("/v1/sandboxes", json={"timeout": 60}).json()["sandbox_id"]
        try:
            for sandbox in (sid, "sbx_0000000000000000"):
                headers = {"E2b-Sandbox-Id": sandbox, "E2b-Sandbox-Port": "49983"}
                assert c.get("/health", headers=headers).status_code == 502
                r = c.get(f"/v1/sandboxes/{sid}", headers=headers)
                assert r.status_code == 404, r.text  # not an API route on this surface
                r = c.post("/files", params={"path": "/tmp/x"}, content=b"x", headers=headers)
                assert r.status_code == 401 and r.json()["code"] == 401, r.text
            # The surface is there for E2B's SDKs only: /v1 is unchanged for everyone else.
            assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
    # The control plane asks for an API key like /v1.
    r = httpx.post(f"{server.url}/v2/sandboxes", json={"templateID": "host"}, timeout=10)
    assert r.status_code == 401, r.text


def test_the_host_routed_form_serves_envd_and_the_code_interpreter(server: ServerHandle) -> None:
    """`49983-<id>.<domain>` (and 49999-): the SDK's address for a sandbox when E2B_SANDBOX_URL
    is unset, served as the header form is, behind the same token."""
    key = server.make_key(f"e2b-host-{time.monotonic_ns() % 10**9}")
    with httpx.Client(base_url=server.url, timeout=30) as c:
        made = c.post("/v2/sandboxes", json={"templateID": "host"}, headers={"X-API-KEY": key})
        assert made.status_code == 201, made.text
        sid, token = made.json()["sandboxID"], made.json()["envdAccessToken"]
        envd = {"Host": f"49983-{sid}.localhost:{server.port}"}
        assert c.get("/health", headers=envd).status_code == 502  # no token: as if unknown
        assert c.get("/health", headers={**envd, "X-Access-Token": token}).status_code == 204
        mine = {**envd, "X-Access-Token": token}
        r = c.post("/files", params={"path": "/tmp/h.txt"}, content=b"via host", headers=mine)
        assert r.status_code == 200, r.text
        assert c.get("/files", params={"path": "/tmp/h.txt"}, headers=mine).content == b"via host"
        # Headers a client adds do not name another sandbox.
        forged = {**mine, "E2b-Sandbox-Id": "sbx_0000000000000000", "E2b-Sandbox-Port": "1"}
        assert c.get("/files", params={"path": "/tmp/h.txt"}, headers=forged).status_code == 200
        r = c.get("/v1/sandboxes", headers={**envd, "X-API-Key": key})
        assert r.status_code == 404, r.text  # the port serves envd, not the API
        interp = {"Host": f"49999-{sid}.localhost:{server.port}"}
        r = c.get("/contexts", headers={**interp, "E2B-Traffic-Access-Token": token})
        assert r.status_code == 200 and isinstance(r.json(), list), r.text
        assert c.get("/contexts", headers=interp).status_code == 401
        c.delete(f"/sandboxes/{sid}", headers={"X-API-KEY": key})


def test_sandbox_logs_are_its_audit(server: ServerHandle) -> None:
    """`/sandboxes/{id}/logs` (v1, and v2 with cursor, direction, level and search): what was
    done to and in the sandbox, from its audit; another tenant's key gets 404."""
    key = server.make_key(f"e2b-logs-{time.monotonic_ns() % 10**9}")
    other = server.make_key(f"e2b-logs-other-{time.monotonic_ns() % 10**9}")
    with httpx.Client(base_url=server.url, timeout=30, headers={"X-API-KEY": key}) as c:
        made = c.post("/v2/sandboxes", json={"templateID": "host"})
        assert made.status_code == 201, made.text
        sid = made.json()["sandboxID"]
        begun = int(time.time() * 1000) - 1000
        for cmd in ("echo logged", "exit 3"):
            c.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": cmd}, headers={"X-API-Key": key})
        deadline, v1 = time.monotonic() + 5, {}
        while time.monotonic() < deadline:
            v1 = c.get(f"/sandboxes/{sid}/logs", params={"start": begun}).json()
            if any("exit 3" in e["message"] for e in v1["logEntries"]):
                break
            time.sleep(0.05)
        messages = [e["message"] for e in v1["logEntries"]]
        assert messages[0] == "sandbox.create", messages  # oldest first
        assert "command.run: echo logged" in messages, messages
        assert "command.run: exit 3 (exit code 3)" in messages, messages
        assert [x["line"] for x in v1["logs"]] == messages
        entry = v1["logEntries"][0]
        assert entry["level"] == "info" and entry["fields"]["action"] == "sandbox.create", entry
        assert entry["timestamp"].endswith("Z"), entry
        newest = c.get(
            f"/v2/sandboxes/{sid}/logs",
            params={"cursor": int(time.time() * 1000) + 1000, "direction": "backward", "limit": 1},
        ).json()["logs"]
        assert [e["message"] for e in newest] == ["command.run: exit 3 (exit code 3)"], newest
        found = c.get(f"/v2/sandboxes/{sid}/logs", params={"search": "logged"}).json()["logs"]
        assert [e["message"] for e in found] == ["command.run: echo logged"], found
        assert c.get(f"/v2/sandboxes/{sid}/logs", params={"level": "error"}).json() == {"logs": []}
        bad = c.get(f"/v2/sandboxes/{sid}/logs", params={"direction": "sideways"})
        assert bad.status_code == 422 and "direction" in bad.json()["message"], bad.text
        for path in (f"/sandboxes/{sid}/logs", f"/v2/sandboxes/{sid}/logs"):
            assert c.get(path, headers={"X-API-KEY": other}).status_code == 404
        c.delete(f"/sandboxes/{sid}")


def test_a_create_retried_with_its_idempotency_key_makes_one_sandbox(server: ServerHandle) -> None:
    """E2B's newer SDKs send `Idempotency-Key` on creates so that a retry after a lost answer
    does not make a second sandbox."""
    key = server.make_key(f"e2b-idem-{time.monotonic_ns() % 10**9}")
    body = {"templateID": "host", "timeout": 60}
    with httpx.Client(base_url=server.url, headers={"X-API-KEY": key}, timeout=30) as c:
        made = [c.post("/v2/sandboxes", json=body, headers={"Idempotency-Key": k}) for k in "aab"]
        assert [r.status_code for r in made] == [201] * 3, [r.text for r in made]
        ids = [r.json()["sandboxID"] for r in made]
        assert ids[0] == ids[1] != ids[2], ids
        listed = c.get("/v2/sandboxes").json()
        assert sorted(s["sandboxID"] for s in listed) == sorted({*ids}), listed
        r = c.post("/v2/sandboxes", json=body, headers={"Idempotency-Key": "Not Valid"})
        assert r.status_code == 400 and "Idempotency-Key" in r.json()["message"], r.text
        for sid in {*ids}:
            assert c.delete(f"/sandboxes/{sid}").status_code == 204
        # The key's sandbox has ended: a retry says so, and makes none.
        r = c.post("/v2/sandboxes", json=body, headers={"Idempotency-Key": "a"})
        assert r.status_code == 409 and ids[0] in r.json()["message"], r.text
        assert c.get("/v2/sandboxes").json() == []


def test_malformed_e2b_requests_get_a_4xx(server: ServerHandle) -> None:
    """Filters, boundaries and part counts past what is served are refused with a reason."""
    key = server.make_key(f"e2b-bad-{time.monotonic_ns() % 10**9}")
    with httpx.Client(base_url=server.url, headers={"X-API-KEY": key}, timeout=30) as c:
        meta = "&".join(f"k{i}=v" for i in range(65))
        r = c.get("/v2/sandboxes", params={"metadata": meta})
        assert r.status_code == 400 and "64" in r.json()["message"], r.text
        made = c.post("/v2/sandboxes", json={"templateID": "host", "timeout": 60}).json()
        envd = {
            "E2b-Sandbox-Id": made["sandboxID"],
            "E2b-Sandbox-Port": "49983",
            "X-Access-Token": made["envdAccessToken"],
        }
        try:
            long = "b" * 300
            r = c.post(
                "/files",
                content=f"--{long}--\r\n".encode(),
                headers={**envd, "Content-Type": f"multipart/form-data; boundary={long}"},
            )
            assert r.status_code == 400 and "boundary" in r.json()["message"], r.text
            empty = b"".join(
                b'--b\r\nContent-Disposition: form-data; name="file"; filename="/tmp/e%d"\r\n\r\n'
                b"\r\n" % i
                for i in range(300)
            )
            r = c.post(
                "/files",
                content=empty + b"--b--\r\n",
                headers={**envd, "Content-Type": "multipart/form-data; boundary=b"},
            )
            assert r.status_code == 400 and "256 files" in r.json()["message"], r.text
        finally:
            c.delete(f"/sandboxes/{made['sandboxID']}")


def test_envd_rpc_refuses_by_name(server: ServerHandle) -> None:
    """envd's Connect RPC, spoken raw: no token is UNAUTHENTICATED (another sandbox's token
    too), a malformed body or a PTY of no width INVALID_ARGUMENT, a 17th directory watch
    FAILED_PRECONDITION, another sandbox's watcher NOT_FOUND; never a 5xx. The calls made
    are audited as the tenant's."""
    tenant = f"e2b-rpc-{time.monotonic_ns() % 10**9}"
    key = server.make_key(tenant)
    rpc = {"Content-Type": "application/json", "Connect-Protocol-Version": "1"}
    with httpx.Client(base_url=server.url, headers={"X-API-KEY": key}, timeout=30) as c:
        made = [c.post("/v2/sandboxes", json={"templateID": "host"}).json() for _ in range(2)]
        sid, token = made[0]["sandboxID"], made[0]["envdAccessToken"]
        envd = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", **rpc}
        try:
            for given in ({}, {"X-Access-Token": made[1]["envdAccessToken"]}):
                r = c.post("/process.Process/List", json={}, headers={**envd, **given})
                assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text
            envd["X-Access-Token"] = token
            r = c.post("/process.Process/List", json={}, headers=envd)
            assert r.status_code == 200 and r.json() == {}, r.text
            r = c.post("/process.Process/List", content=b"{nope", headers=envd)
            assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text
            grpc = {**envd, "Content-Type": "application/grpc"}
            r = c.post("/process.Process/List", content=b"\0\0\0\0\0", headers=grpc)
            assert r.status_code == 415 and "Connect" in r.json()["message"], r.text
            r = c.post(
                "/filesystem.Filesystem/ListDir", json={"path": "/", "depth": 65}, headers=envd
            )
            assert r.status_code == 400 and "64" in r.json()["message"], r.text
            pty = {"process": {"cmd": "/bin/bash"}, "pty": {"size": {"cols": 0, "rows": 24}}}
            r = c.post("/process.Process/Start", content=_enveloped(pty), headers=_stream(envd))
            assert r.status_code == 200 and b"invalid_argument" in r.content, r.content
            assert b"cols must be 1 to 4096" in r.content, r.content
            watch = {"path": "/tmp", "recursive": False}
            with c.stream(
                "POST",
                "/filesystem.Filesystem/WatchDir",
                content=_enveloped(watch),
                headers=_stream(envd),
            ) as streamed:  # WatchDir streams: start, then each change
                frames = streamed.iter_raw()
                got = next(frames)
                assert b'"start"' in got, got
                r = c.post("/filesystem.Filesystem/MakeDir", json={"path": "/tmp/w1"}, headers=envd)
                assert r.status_code == 200, r.text
                while b"w1" not in got:
                    got += next(frames)
                assert b'"EVENT_TYPE_CREATE"' in got, got
            watchers = [
                c.post("/filesystem.Filesystem/CreateWatcher", json={"path": "/"}, headers=envd)
                for _ in range(17)
            ]
            assert [w.status_code for w in watchers[:16]] == [200] * 16, watchers[0].text
            assert watchers[16].json()["code"] == "failed_precondition", watchers[16].text
            assert "16 " in watchers[16].json()["message"], watchers[16].text
            other = {
                **envd,
                "E2b-Sandbox-Id": made[1]["sandboxID"],
                "X-Access-Token": made[1]["envdAccessToken"],
            }  # another sandbox of the tenant: its token does not reach this one's watchers
            poll = {"watcherId": watchers[0].json()["watcherId"]}
            r = c.post("/filesystem.Filesystem/GetWatcherEvents", json=poll, headers=other)
            assert r.status_code == 404, r.text
            r = c.post("/filesystem.Filesystem/GetWatcherEvents", json=poll, headers=envd)
            assert r.status_code == 200, r.text
            r = c.post("/filesystem.Filesystem/Stat", json={"path": "/nope"}, headers=envd)
            assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
            r = c.post(
                "/filesystem.Filesystem/Stat",
                json={"path": "/"},
                headers={**envd, "Authorization": "Basic bm9ib2R5Og=="},  # nobody:
            )
            assert r.status_code == 403 and "nobody" in r.json()["message"], r.text
            r = c.post("/process.Process/Nope", json={}, headers=envd)
            assert r.status_code < 500, r.text
            start = {"process": {"cmd": "/bin/echo", "args": ["a b", "c"]}}
            r = c.post("/process.Process/Start", content=_enveloped(start), headers=_stream(envd))
            assert r.status_code == 200 and b"YSBiIGMK" in r.content, r.content  # "a b c\n"
            audit = c.get("/v1/audit", params={"sandbox_id": sid, "action": "command.run"})
            assert [e["key_id"] for e in audit.json()["events"]] == ["e2b-envd"], audit.text
        finally:
            for m in made:
                c.delete(f"/sandboxes/{m['sandboxID']}")


def _stream(headers: dict[str, str]) -> dict[str, str]:
    """A Connect server stream's request headers."""
    return {**headers, "Content-Type": "application/connect+json"}


def _enveloped(message: dict) -> bytes:
    """A Connect server stream's request body: one enveloped message (flags, length, JSON)."""
    data = json.dumps(message).encode()
    return b"\0" + len(data).to_bytes(4, "big") + data


@pytest.mark.parametrize("service", ["process", "filesystem"])
def test_our_envd_protos_are_the_sdks_wire(sdk: tuple[str, Path], service: str) -> None:
    """proto/envd is written here, not copied: each message's fields (names, numbers, types,
    oneofs) and each method (streaming, types) are the ones the SDK's generated code was made
    from, whatever the order."""
    line, python = sdk
    site = next(python.parent.parent.glob("lib/python3*/site-packages"))
    theirs = site / "e2b" / "envd" / service / f"{service}_pb.py"
    ours = Path(__file__).parents[2] / f"src/agentbox/server/e2b/wire/{service}/{service}_pb.py"
    mine = _wire(ours)
    if line == "2.45" and service == "filesystem":  # is_symlink came with 2.55; older
        entry = mine["filesystem.EntryInfo"] = [  # SDKs skip fields they do not know
            f for f in mine["filesystem.EntryInfo"] if f[1] != "is_symlink"
        ]
        assert len(entry) == 11
    assert _wire(theirs) == mine


def _wire(generated: Path) -> dict[str, object]:
    """The wire-relevant parts of a generated module's file descriptor."""
    import ast

    from protobuf.wkt.google.protobuf.descriptor_pb import FileDescriptorProto

    call = next(
        n
        for n in ast.walk(ast.parse(generated.read_text()))
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "file_desc"
    )
    fd = FileDescriptorProto.from_binary(ast.literal_eval(call.args[0]))
    wire: dict[str, object] = {"package": fd.package}

    def message(m: object, prefix: str) -> None:
        name = f"{prefix}.{m.name}"  # type: ignore[attr-defined]
        wire[name] = sorted(
            (f.number, f.name, f.json_name, int(f.type), int(f.label), f.type_name,
             f.oneof_index, f.proto3_optional)
            for f in m.field  # type: ignore[attr-defined]
        )  # fmt: skip
        wire[f"{name} oneofs"] = [o.name for o in m.oneof_decl]  # type: ignore[attr-defined]
        for nested in m.nested_type:  # type: ignore[attr-defined]
            message(nested, name)
        for e in m.enum_type:  # type: ignore[attr-defined]
            wire[f"{name}.{e.name}"] = sorted((v.number, v.name) for v in e.value)

    for m in fd.message_type:
        message(m, fd.package)
    for e in fd.enum_type:
        wire[f"{fd.package}.{e.name}"] = sorted((v.number, v.name) for v in e.value)
    for s in fd.service:
        wire[s.name] = sorted(
            (x.name, x.input_type, x.output_type, x.client_streaming, x.server_streaming)
            for x in s.method
        )
    return wire
