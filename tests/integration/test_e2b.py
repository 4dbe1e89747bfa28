"""The stock E2B SDKs from PyPI against agentbox, unmodified, pointed at it by E2B's
environment variables only (issue 17, first slice: the control plane, and envd's /health and
/files). Each SDK line gets a virtual environment of its own, made here: the 2.45 line needs
`connectrpc<0.12`, the newest `>=0.12.1`, so they cannot share one. The scenarios run inside
them (e2b_client.py) and assert what E2B does."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import ServerHandle

CLIENT = Path(__file__).with_name("e2b_client.py")
# The SDK lines: the oldest the issue names (creates through POST /sandboxes) and the newest
# (POST /v2/sandboxes).
SDKS = {
    "2.45": ["e2b==2.45.1", "connectrpc<0.12"],
    "2.63": ["e2b==2.63.0"],
}
SCENARIOS = {
    "lifecycle": [
        "create", "get_info", "set_timeout", "list", "pause", "connect_resumes", "kill",
        "timeout_zero",
    ],
    "files": [
        "write_read_text", "stream", "gzip", "multipart", "missing", "users", "token_required",
    ],
    "tenants": ["tenants"],
    "refusals": ["refusals"],
}  # fmt: skip
VENVS = Path("/var/tmp/agentbox-test-e2b")


def _venv(requirements: list[str]) -> Path:
    """A virtual environment with `requirements` from PyPI, kept between runs (by their
    digest) under /var/tmp."""
    digest = hashlib.sha256("\n".join([sys.version, *requirements]).encode()).hexdigest()[:12]
    home = VENVS / digest
    python = home / "bin" / "python"
    if (home / "ready").exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(home)], check=True)
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *requirements],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (home / "ready").touch()
    return python


@pytest.fixture(scope="module", params=sorted(SDKS))
def sdk(request: pytest.FixtureRequest) -> tuple[str, Path]:
    return request.param, _venv(SDKS[request.param])


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_e2b_sdk(sdk: tuple[str, Path], scenario: str, server: ServerHandle) -> None:
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
        [str(python), str(CLIENT), scenario], env=env, capture_output=True, text=True, timeout=240
    )
    passed = [line[3:] for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert done.returncode == 0 and passed == SCENARIOS[scenario], (
        f"e2b {line}, {scenario}: passed {passed}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
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
