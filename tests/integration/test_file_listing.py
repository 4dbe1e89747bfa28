"""A directory listing that stops at its limit says so, and the rest can be had page by page:
the API, the SDK and the CLI carry `truncated` and a cursor."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentbox import Sandbox
from agentbox.sdk import EntryList

CLI = [sys.executable, "-m", "agentbox.cli.app"]

# 50,000 files with long names: the page fills its reply frame long before 10,000 entries
# (the case that was listed as 4,561 with no sign of the rest).
MANY = 50_000
MAKE_MANY = (
    'mkdir -p /workspace/many && cd /workspace/many && python3 -c "import os\n'
    f"for i in range({MANY}): open(f'file-{{i:06d}}-' + 'x' * 120, 'w').close()\""
)
# A small tree with nested directories, for page boundaries at every depth.
MAKE_TREE = (
    "mkdir -p /workspace/t/a/b/c /workspace/t/a/d /workspace/t/e && cd /workspace/t && "
    "touch a/1 a/b/2 a/b/c/3 a/b/c/4 a/d/5 e/6 e/7 f g && ln -s a h"
)


@pytest.fixture(scope="module")
def tenant_key(server: Any) -> str:
    return str(server.make_key("listing"))


@pytest.fixture(scope="module")
def sbx(server: Any, tenant_key: str) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(
        timeout=600, api_key=tenant_key, api_url=server.url, resources={"disk_mb": 1024}
    )
    assert sandbox.commands.run(MAKE_MANY, timeout=120).exit_code == 0
    assert sandbox.commands.run(MAKE_TREE).exit_code == 0
    yield sandbox
    sandbox.kill()
    sandbox.close()


def _every_page(sbx: Sandbox, path: str, depth: int, limit: int | None = None) -> list[str]:
    page = sbx.files.list(path, depth, limit=limit)
    paths = [e.path for e in page]
    while page.truncated:
        assert page.next_cursor == paths[-1]
        page = sbx.files.list(path, depth, limit=limit, cursor=page.next_cursor)
        paths += [e.path for e in page]
    return paths


def test_a_listing_at_its_limit_says_so_and_pages(sbx: Sandbox) -> None:
    first = sbx.files.list("/workspace/many")
    assert isinstance(first, EntryList)
    assert 0 < len(first) < MANY and first.truncated, len(first)
    paths = _every_page(sbx, "/workspace/many", 1)
    assert len(paths) == MANY and len(set(paths)) == MANY
    assert paths == sorted(paths)
    # A listing that fits says it is whole.
    whole = sbx.files.list("/workspace/t", depth=5)
    assert not whole.truncated and whole.next_cursor is None


def test_pages_of_every_size_make_the_whole_tree(sbx: Sandbox) -> None:
    whole = [e.path for e in sbx.files.list("/workspace/t", depth=5)]
    assert whole[:4] == [
        "/workspace/t/a",
        "/workspace/t/a/1",
        "/workspace/t/a/b",
        "/workspace/t/a/b/2",
    ]
    assert "/workspace/t/h" in whole and not any(p.startswith("/workspace/t/h/") for p in whole)
    for limit in (1, 2, 3, 5):
        assert _every_page(sbx, "/workspace/t", 5, limit) == whole, limit
    shallow = [e.path for e in sbx.files.list("/workspace/t", depth=2)]
    assert _every_page(sbx, "/workspace/t", 2, 2) == shallow


def test_the_raw_api_pages_and_refuses_a_foreign_cursor(
    sbx: Sandbox, server: Any, tenant_key: str
) -> None:
    url = f"{server.url}/v1/sandboxes/{sbx.sandbox_id}/files/list"
    with httpx.Client(headers={"X-API-Key": tenant_key}, timeout=60) as c:
        r = c.get(url, params={"path": "/workspace/t", "depth": 5, "limit": 3})
        body = r.json()
        assert r.status_code == 200 and body["truncated"] is True, body
        assert body["next_cursor"] == body["entries"][-1]["path"] == "/workspace/t/a/b"
        r = c.get(url, params={"path": "/workspace/t", "depth": 5, "cursor": "/workspace/x/y"})
        assert r.status_code == 400 and "cursor" in r.json()["message"], r.text
        r = c.get(url, params={"path": "/workspace/t", "limit": 0})
        assert r.status_code in (400, 422), r.text


def test_the_cli_says_when_a_listing_stopped(sbx: Sandbox, server: Any, tenant_key: str) -> None:
    env = {"AGENTBOX_API_URL": server.url, "AGENTBOX_API_KEY": tenant_key, "PATH": "/usr/bin:/bin"}
    first = subprocess.run(
        [*CLI, "files", "ls", sbx.sandbox_id, "/workspace/many"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    shown = len(first.stdout.splitlines()) - 1  # the header
    assert 0 < shown < MANY
    assert f"listing stopped after {shown} entries" in first.stderr and "--all" in first.stderr
    every = subprocess.run(
        [*CLI, "files", "ls", sbx.sandbox_id, "/workspace/many", "--all", "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert every.returncode == 0, every.stderr
    listing = json.loads(every.stdout)
    assert len(listing["entries"]) == MANY and listing["truncated"] is False
    assert "stopped" not in every.stderr
