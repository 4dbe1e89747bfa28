"""Sandbox lifecycle over the HTTP API: create, get, list, timeout, kill, TTL, quotas."""

from __future__ import annotations

import subprocess
import time

from conftest import ServerHandle, create_sandbox, run


def test_create_get_and_run(server: ServerHandle, tenant_key: str) -> None:
    with server.client(tenant_key) as c:
        sbx = create_sandbox(c, metadata={"purpose": "test"}, envs={"GREETING": "hello"})
        assert sbx["state"] == "running"
        assert sbx["sandbox_id"].startswith("sbx_")
        assert sbx["metadata"] == {"purpose": "test"}
        got = c.get(f"/v1/sandboxes/{sbx['sandbox_id']}").json()
        assert got["sandbox_id"] == sbx["sandbox_id"]
        res = run(c, sbx["sandbox_id"], "echo $GREETING; pwd; echo $HOME; whoami || id -u")
        assert res.exit_code == 0
        lines = res.stdout.splitlines()
        assert lines[:3] == ["hello", "/workspace", "/workspace"]
        assert c.delete(f"/v1/sandboxes/{sbx['sandbox_id']}").status_code == 204


def test_list_filters_and_paginates(server: ServerHandle, tenant_key: str) -> None:
    with server.client(tenant_key) as c:
        ids = [
            create_sandbox(c, metadata={"batch": "x", "n": str(i)})["sandbox_id"] for i in range(3)
        ]
        other = create_sandbox(c, metadata={"batch": "y"})["sandbox_id"]
        r = c.get("/v1/sandboxes", params={"metadata": "batch=x"}).json()
        assert sorted(s["sandbox_id"] for s in r["sandboxes"]) == sorted(ids)
        seen: list[str] = []
        token = None
        while True:
            params = {"limit": 2, "state": "running"}
            if token:
                params["next_token"] = token
            page = c.get("/v1/sandboxes", params=params).json()
            assert len(page["sandboxes"]) <= 2
            seen += [s["sandbox_id"] for s in page["sandboxes"]]
            token = page["next_token"]
            if not token:
                break
        assert sorted(seen) == sorted([*ids, other])
        c.delete(f"/v1/sandboxes/{ids[0]}")
        killed = c.get("/v1/sandboxes", params={"state": "killed"}).json()["sandboxes"]
        assert [s["sandbox_id"] for s in killed] == [ids[0]]
        bad = c.get("/v1/sandboxes", params={"metadata": "novalue"})
        assert bad.status_code == 400 and bad.json()["code"] == "invalid_request"
        for sid in [*ids[1:], other]:
            c.delete(f"/v1/sandboxes/{sid}")


def test_kill_is_idempotent_and_unknown_is_404(server: ServerHandle, tenant_key: str) -> None:
    with server.client(tenant_key) as c:
        sid = create_sandbox(c)["sandbox_id"]
        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
        info = c.get(f"/v1/sandboxes/{sid}").json()
        assert info["state"] == "killed" and info["end_reason"] == "killed"
        r = c.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "true"})
        assert r.status_code == 409 and r.json()["code"] == "sandbox_not_running"
        r = c.delete("/v1/sandboxes/sbx_doesnotexist")
        assert r.status_code == 404 and r.json()["code"] == "not_found"


def test_ttl_kills_at_deadline_never_before(server: ServerHandle, tenant_key: str) -> None:
    with server.client(tenant_key) as c:
        sbx = create_sandbox(c, timeout=2)
        sid = sbx["sandbox_id"]
        from datetime import datetime

        deadline = datetime.fromisoformat(sbx["end_at"].replace("Z", "+00:00")).timestamp()
        while time.time() < deadline - 0.3:
            assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
            time.sleep(0.1)
        while time.time() < deadline + 1.0:
            state = c.get(f"/v1/sandboxes/{sid}").json()
            if state["state"] != "running":
                break
            time.sleep(0.02)
        assert state["state"] == "expired", state
        assert state["end_reason"] == "timeout"
        ended = datetime.fromisoformat(state["ended_at"].replace("Z", "+00:00")).timestamp()
        assert deadline <= ended <= deadline + 1.0


def test_set_timeout_extends(server: ServerHandle, tenant_key: str) -> None:
    with server.client(tenant_key) as c:
        sid = create_sandbox(c, timeout=1)["sandbox_id"]
        r = c.post(f"/v1/sandboxes/{sid}/timeout", json={"timeout": 30})
        assert r.status_code == 200
        time.sleep(1.5)
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        c.delete(f"/v1/sandboxes/{sid}")


def test_quota_concurrent_sandboxes(server: ServerHandle, tenant_key: str) -> None:
    with server.client(tenant_key) as c:
        tenant = c.get("/v1/sandboxes").json()  # warm up the client
        assert tenant["sandboxes"] == []
    me = None
    with server.client() as admin:
        keys = admin.get("/v1/keys").json()["keys"]
        me = next(k["tenant"] for k in keys if tenant_key.startswith(f"abx_{k['key_id']}_"))
        assert (
            admin.put(
                f"/v1/tenants/{me}/quota", json={"max_sandboxes": 2, "max_memory_mb": 1024}
            ).status_code
            == 200
        )
    with server.client(tenant_key) as c:
        a = create_sandbox(c)["sandbox_id"]
        b = create_sandbox(c)["sandbox_id"]
        r = c.post("/v1/sandboxes", json={})
        assert r.status_code == 429
        body = r.json()
        assert body["code"] == "quota_exceeded" and "max_sandboxes" in body["message"]
        r = c.post("/v1/sandboxes", json={"resources": {"memory_mb": 4096}})
        assert r.status_code in (400, 429)
        c.delete(f"/v1/sandboxes/{a}")
        over = c.post("/v1/sandboxes", json={"resources": {"memory_mb": 4096}})
        assert over.status_code == 400 and over.json()["code"] == "limit_exceeded"
        assert over.json()["detail"]["setting"] == "quota.max_memory_mb"
        c_ok = create_sandbox(c, resources={"memory_mb": 256, "cpu_count": 0.5})
        assert c_ok["resources"]["memory_mb"] == 256
        for sid in (b, c_ok["sandbox_id"]):
            c.delete(f"/v1/sandboxes/{sid}")


def test_bad_input_gets_4xx_with_reason(server: ServerHandle, tenant_key: str) -> None:
    with server.client(tenant_key) as c:
        cases = [
            c.post("/v1/sandboxes", json={"timeout": -1}),
            c.post("/v1/sandboxes", json={"timeout": "soon"}),
            c.post("/v1/sandboxes", json={"bogus": 1}),
            c.post("/v1/sandboxes", json={"resources": {"gpus": 1}}),
            c.post("/v1/sandboxes", json={"envs": {"1BAD": "x"}}),
            c.post(
                "/v1/sandboxes", content=b"{not json", headers={"content-type": "application/json"}
            ),
            c.post("/v1/sandboxes", json={"template": "nope"}),
        ]
        for r in cases:
            assert 400 <= r.status_code < 500, r.text
            body = r.json()
            assert body["code"] and body["message"], body
        assert cases[-1].status_code == 404


def test_openapi_and_health(server: ServerHandle) -> None:
    spec = httpx_get(server, "/openapi.json")
    assert "/v1/sandboxes" in spec["paths"]
    health = httpx_get(server, "/v1/health")
    assert health["status"] == "ok"
    assert health["runtime"]["runtime"] == "process"


def httpx_get(server: ServerHandle, path: str) -> dict:
    import httpx

    r = httpx.get(server.url + path)
    assert r.status_code == 200
    return r.json()


def test_keep_workspace_survives_kill(server: ServerHandle, tenant_key: str) -> None:
    with server.client(tenant_key) as c:
        sid = create_sandbox(c, keep_workspace=True, resources={"disk_mb": 64})["sandbox_id"]
        c.put(f"/v1/sandboxes/{sid}/files", params={"path": "result.txt"}, content=b"keep me")
        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
    kept = server.data_dir / "kept-workspaces" / sid
    assert kept.is_dir()
    assert not (server.data_dir / "sandboxes" / sid).exists()
    image = kept / "workspace.img"
    if image.exists():  # loop-mounted workspace: the image holds the files
        out = subprocess.run(["debugfs", "-R", "cat /result.txt", str(image)],
                             capture_output=True, text=True)
        assert "keep me" in out.stdout
    else:
        assert (kept / "workspace" / "result.txt").read_bytes() == b"keep me"


def test_resource_limits_bind(server: ServerHandle, tenant_key: str) -> None:
    with server.client(tenant_key) as c:
        sid = create_sandbox(
            c, resources={"cpu_count": 0.25, "nofile": 200, "file_size_mb": 2, "tmp_mb": 8}
        )["sandbox_id"]
        # CPU: a busy loop for 2 s of wall time gets about a quarter of one CPU.
        spin = run(c, sid, "python3 -c \"import os,time\nt=time.time()\nwhile time.time()-t<2: "
                   "pass\nprint(os.times().user+os.times().system)\"", timeout=30)
        assert float(spin.stdout) < 1.0, spin.stdout
        assert run(c, sid, "ulimit -n").stdout.strip() == "200"
        big = run(c, sid, "head -c 3000000 /dev/zero > f.bin")
        assert big.exit_code != 0 and big.end["violation"]["code"] == "file_size_limit"
        tmp = run(c, sid, "for i in 1 2 3 4 5 6; do head -c 1900000 /dev/zero > /tmp/f$i "
                  "|| exit 1; done")
        assert tmp.exit_code != 0 and "No space left" in tmp.stderr
        c.delete(f"/v1/sandboxes/{sid}")
