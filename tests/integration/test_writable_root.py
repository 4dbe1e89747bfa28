"""A built template's sandbox has a writable root: the template copy-on-write (an idmapped
lower layer under an overlay whose upper layer is on the sandbox's own disk image). Root
installs packages and adds users; `user` writes where Unix lets it; the template tree and other
sandboxes never see a write; the disk limit covers the root's writes; nothing is left mounted."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import (
    ServerHandle,
    create_sandbox,
    make_deb,
    run,
    seed_template_store,
    start_server,
)

from agentbox.templates import TemplateStore, load_spec

SPEC = """
name = "rooty"
[base]
suite = "bookworm"
variant = "apt"
[[files]]
dest = "/etc/rooty/marker"
content = "from the template"
"""


def _tree_digest(root: Path) -> dict[str, tuple[int, int, int, int]]:
    """Every entry of a tree with its (mode, uid, size, mtime_ns): what a write would change."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns)
    return out


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [ln.split()[4] for ln in f if ln.split()[4].startswith(str(path) + "/")]


@pytest.fixture(scope="module")
def rooty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerHandle, Path]]:
    if os.geteuid() != 0 or not shutil.which("mmdebstrap"):
        pytest.skip("template builds need root and mmdebstrap")
    tmp = tmp_path_factory.mktemp("rooty")
    store = tmp / "store"
    seed_template_store(store)
    info = TemplateStore(store).build(load_spec(SPEC), lambda e: None)
    handle = start_server(tmp, ["--template-dir", str(store)])
    yield handle, Path(info.rootfs)
    handle.kill_all_sandboxes()
    handle.stop()


@pytest.fixture
def client(rooty: tuple[ServerHandle, Path]) -> Iterator[httpx.Client]:
    with rooty[0].client() as c:
        yield c


def _state(server: ServerHandle, sid: str) -> dict[str, Any]:
    return json.loads((server.data_dir / "sandboxes" / sid / "runtime.json").read_text())


def test_root_writes_copy_up_and_the_template_stays(
    rooty: tuple[ServerHandle, Path], client: httpx.Client, tmp_path: Path
) -> None:
    server, tree = rooty
    before = _tree_digest(tree)
    sid = create_sandbox(client, template="rooty")["sandbox_id"]
    other = create_sandbox(client, template="rooty")["sandbox_id"]
    try:
        r = run(client, sid, "cat /etc/rooty/marker; echo; id -un; ls -ld / /etc /usr/local/bin")
        assert r.stdout.startswith("from the template\nuser\n"), r
        assert all(" root root " in ln for ln in r.stdout.splitlines()[2:]), r
        # Root administers the system: files anywhere, users, packages.
        r = run(
            client,
            sid,
            "echo new > /etc/rooty/added && echo changed > /etc/rooty/marker && "
            "rm /etc/hostname; useradd -m -u 1500 bob && id bob && "
            "mkdir /opt/tools && python3 -c \"import os; os.rename('/usr/share/doc', "
            "'/usr/share/doc.moved')\" && echo renamed",
            user="root",
        )
        assert r.exit_code == 0 and "uid=1500(bob)" in r.stdout and "renamed" in r.stdout, r
        deb = make_deb(tmp_path, "abxhello")
        assert client.put(
            f"/v1/sandboxes/{sid}/files", params={"path": "abxhello.deb"}, content=deb.read_bytes()
        ).status_code in (200, 201, 204)
        r = run(client, sid, "sudo dpkg -i abxhello.deb >/dev/null && abxhello && "
                "dpkg -s abxhello | grep Status")  # fmt: skip
        assert r.stdout == "abxhello works\nStatus: install ok installed\n", r
        r = run(client, sid, "sudo apt-get install -y ./abxhello.deb 2>&1 | tail -1; echo rc=$?")
        assert "rc=0" in r.stdout, r
        # `user` writes where Unix lets it, nowhere else.
        r = run(
            client,
            sid,
            "touch /etc/nope 2>&1; touch /usr/local/bin/nope 2>&1; touch /home/bob/nope 2>&1; "
            "touch /workspace/yes /tmp/yes && echo wrote",
        )
        assert r.stdout.count("Permission denied") == 3 and "wrote" in r.stdout, r
        # Another sandbox of the same template sees none of it.
        r = run(client, other, "cat /etc/rooty/marker; echo; ls /etc/rooty; id bob 2>&1; ls /opt")
        assert r.stdout.startswith("from the template\nmarker\n"), r
        assert "no such user" in r.stdout and "tools" not in r.stdout, r
        state = _state(server, sid)
        assert state["root"]["mode"] == "overlay" and state["root"]["template"] == str(tree)
    finally:
        client.delete(f"/v1/sandboxes/{sid}")
        client.delete(f"/v1/sandboxes/{other}")
    assert _tree_digest(tree) == before


def test_home_user_is_the_workspace(client: httpx.Client) -> None:
    """E2B's home, /home/user, is the workspace mounted there too: the same files through
    either path (the files API's too), and a mount point the sandbox's root cannot move."""
    sid = create_sandbox(client, template="rooty")["sandbox_id"]
    try:
        r = client.put(f"/v1/sandboxes/{sid}/files", params={"path": "/home/user/e2b.txt"},
                       content=b"e2b")  # fmt: skip
        assert r.status_code in (200, 201) and r.json()["path"] == "/home/user/e2b.txt", r.text
        assert run(client, sid, "cat /workspace/e2b.txt /home/user/e2b.txt").stdout == "e2be2b"
        r = run(client, sid, "mv /home/user /home/moved 2>&1; ls /home", user="root")
        assert "busy" in r.stdout and "moved" not in r.stdout.split(), r
        r = client.get(f"/v1/sandboxes/{sid}/files", params={"path": "/home/user/e2b.txt"})
        assert r.status_code == 200 and r.content == b"e2b", r.text
    finally:
        client.delete(f"/v1/sandboxes/{sid}")


def test_the_disk_limit_covers_the_root(client: httpx.Client) -> None:
    sid = create_sandbox(client, template="rooty", resources={"disk_mb": 64})["sandbox_id"]
    try:
        fill = "dd if=/dev/zero of=/var/fill bs=1M count=200 2>&1 | grep -o 'No space left'"
        r = run(client, sid, fill, user="root")
        assert "No space left" in r.stdout, r
        r = run(client, sid, "{ head -c 1048576 /dev/zero > /workspace/after; } 2>&1; echo rc=$?")
        assert "No space left" in r.stdout and "rc=1" in r.stdout, r
    finally:
        client.delete(f"/v1/sandboxes/{sid}")


def test_no_host_path_in_mountinfo_and_nothing_left(
    rooty: tuple[ServerHandle, Path], client: httpx.Client
) -> None:
    server, tree = rooty
    sid = create_sandbox(client, template="rooty")["sandbox_id"]
    bind_root = Path(_state(server, sid)["socket"]).parent.parent
    r = run(client, sid, "cat /proc/self/mountinfo")
    for leak in (str(bind_root), str(server.data_dir), str(tree), bind_root.name):
        assert leak not in r.stdout, (leak, r.stdout)
    assert " / / " in r.stdout and "overlay" in r.stdout
    assert _mounts_under(bind_root / sid)
    assert client.delete(f"/v1/sandboxes/{sid}").status_code == 204
    assert _mounts_under(bind_root / sid) == []
    assert not (bind_root / sid).exists()


def test_restart_keeps_the_root_and_cleans_up(rooty: tuple[ServerHandle, Path]) -> None:
    server, _ = rooty
    with server.client() as c:
        sid = create_sandbox(c, template="rooty", timeout=600)["sandbox_id"]
        run(c, sid, "echo kept > /etc/rooty/kept", user="root")
    bind_root = Path(_state(server, sid)["socket"]).parent.parent
    server.stop()
    server.start()
    with server.client() as c:
        r = run(c, sid, "cat /etc/rooty/kept")
        assert r.stdout == "kept\n", r
        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
    assert _mounts_under(bind_root / sid) == []


def test_disk_use_counts_at_once(client: httpx.Client) -> None:
    """What a sandbox's files take, in its metrics, is its disk's own count (statvfs of the
    mounted disk: /workspace and the root's upper layer alike), not the image file's blocks,
    which come only when the kernel writes the page cache back (~30 s)."""
    sid = create_sandbox(client, template="rooty")["sandbox_id"]
    assert run(client, sid, "head -c 30000000 /dev/urandom > /workspace/blob && "
                            "head -c 20000000 /dev/urandom > /opt/blob",
                            user="root").exit_code == 0  # fmt: skip
    written = time.time()
    deadline = written + 12  # two of the server's 5 s metrics rounds, and then some
    used = 0
    while used < 50_000_000:
        assert time.time() < deadline, f"disk_used {used}: the image's lagging blocks"
        time.sleep(0.5)
        r = client.get(f"/v1/sandboxes/{sid}/metrics", params={"start": written})
        assert r.status_code == 200, r.text
        used = max([m["disk_used"] for m in r.json()["metrics"]], default=0)


def test_a_sandbox_starts_from_a_namespace_without_the_others_mounts(
    rooty: tuple[ServerHandle, Path], client: httpx.Client
) -> None:
    """bwrap copies the mount namespace it starts in (the cost that grows with every live
    sandbox's mounts, issue 19): a sandbox's outer bwrap runs in a namespace of its own that
    holds its own disk and root but not another sandbox's, while the server's namespace keeps
    both (destroy, snapshots and usage work there)."""
    server, _ = rooty
    first = create_sandbox(client, template="rooty")["sandbox_id"]
    second = create_sandbox(client, template="rooty")["sandbox_id"]
    try:
        bind_root = Path(_state(server, second)["socket"]).parent.parent
        assert server.proc is not None
        outer = _state(server, second)["bwrap_pid"]
        own_ns = os.readlink(f"/proc/{outer}/ns/mnt")
        assert own_ns != os.readlink(f"/proc/{server.proc.pid}/ns/mnt")
        assert own_ns != os.readlink(f"/proc/{_state(server, first)['bwrap_pid']}/ns/mnt")
        with open(f"/proc/{outer}/mountinfo") as f:
            seen = [ln.split()[4] for ln in f]
        assert f"{bind_root}/{second}/disk" in seen and f"{bind_root}/{second}/root" in seen
        assert not [p for p in seen if p.startswith(f"{bind_root}/{first}")], seen
        assert len(seen) < len(Path(f"/proc/{server.proc.pid}/mountinfo").read_text().splitlines())
        # The server's namespace has both, and the sandboxes work.
        assert _mounts_under(bind_root / first) and _mounts_under(bind_root / second)
        assert run(client, second, "echo hi > /workspace/x && cat /workspace/x").stdout == "hi\n"
    finally:
        for sid in (first, second):
            client.delete(f"/v1/sandboxes/{sid}")
    assert _mounts_under(bind_root / first) == [] and _mounts_under(bind_root / second) == []


def test_a_read_only_template_is_bound_from_the_sandbox_s_own_namespace(
    rooty: tuple[ServerHandle, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a template cannot be given copy-on-write (no idmapped mounts), bwrap binds it
    read-only by a descriptor, whose path bwrap resolves again in its own namespace (and
    refuses what it finds there unless it is the same tree): the template's bind must be
    cloned into the clean namespace's copy at its path."""
    import asyncio

    from agentbox.runtimes.base import Resources, SandboxSpec
    from agentbox.runtimes.process.runtime import ProcessRuntime

    _, tree = rooty
    runtime = ProcessRuntime(tmp_path / "data")
    try:
        assert runtime.clean_ns is not None
        monkeypatch.setattr(runtime, "_writable_root", lambda spec: False)
        sid = "sbx_readonlytemplate"
        spec = SandboxSpec(sid, "rooty", Resources(disk_mb=64), rootfs=str(tree))
        state = runtime._create_sync(spec)  # the agent answered: bwrap bound the template
        try:
            with open(f"/proc/{state['bwrap_pid']}/mountinfo") as f:
                points = [ln.split()[4] for ln in f]
            binds = str(runtime.bind_root / "templates") + "/"
            assert [p for p in points if p.startswith(binds)], points
            assert "root" not in state  # read-only: no overlay was made
        finally:
            runtime._destroy_sync(sid, state, keep_workspace=False)
    finally:
        asyncio.run(runtime.close())
