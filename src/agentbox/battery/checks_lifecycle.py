"""Checks on what a sandbox leaves behind for later: disks it is started from again (snapshots,
forks) and volumes the server itself reads and writes on the host.

A sandbox started from a disk boots on that disk's root, which the tenant may have changed: if
the change reaches what the sandbox's agent loads before it confines itself, the tenant's code
runs inside the agent, outside its fence. A volume is a filesystem the tenant's sandboxes
write, and the server later opens on the host for the volume files API: what a sandbox left in
it (symlinks, FIFOs) must not lead the server anywhere else.
"""

from __future__ import annotations

import base64
import contextlib
from typing import Any

import httpx

from agentbox.battery.checks import Ctx, ProbeFailed, Verdict, blocked, check, na
from agentbox.battery.target import Box

# Appended to a standard-library module the agent imports: in the agent (its command line has
# --listen-*), it records where it ran and tries what only an unconfined agent could (an entry
# in /dev, which Landlock keeps the sandbox's root from making). Elsewhere it does nothing.
_PAYLOAD = """
def _abx_boot():
    import os
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().replace(b"\\0", b" ").decode(errors="replace")
    except OSError:
        return
    if "--listen" not in argv:
        return
    try:
        os.mkdir("/dev/abx-boot-{n}")
        made = "made /dev/abx-boot-{n}"
    except OSError as e:
        made = "mkdir in /dev refused: " + str(e.strerror)
    with open("/tmp/abx-boot-{n}", "w") as f:
        f.write("pid %d: %s | %s" % (os.getpid(), argv[:160], made))
_abx_boot()
"""


def _created(ctx: Ctx, **body: Any) -> tuple[Box | None, str]:
    """A sandbox created with `body`, or None and the server's answer."""
    try:
        return ctx.box(**body), ""
    except RuntimeError as e:
        return None, str(e).removeprefix("create failed: ")


def _ran_in_agent(box: Box, n: str) -> str:
    """What the payload wrote, if it ran in `box`'s agent."""
    out = box.run(f"cat /tmp/abx-boot-{n} 2>/dev/null").stdout
    return out if out.startswith("pid ") else ""


@check(
    "persist-boot-path",
    "persistence",
    "a disk whose root changed what the agent loads before it confines itself is not booted "
    "(snapshot, fork)",
    ["boot-path-open"],
    needs_template=True,
)
def _boot_path(ctx: Ctx) -> Verdict:
    name, _ = ctx.template()
    box = ctx.box(template=name)
    n = ctx.oracle.nonce[:12]
    where = box.run("python3 -E -s -S -c 'import threading; print(threading.__file__)'")
    module = where.stdout.strip()
    if where.exit_code != 0 or not module.startswith("/usr/lib/"):
        raise ProbeFailed(f"no standard library found: {where.text[:200]}")
    code = base64.b64encode(_PAYLOAD.format(n=n).encode()).decode()
    wrote = box.run(f"echo {code} | base64 -d >> {module} && echo WROTE", user="root")
    if "WROTE" not in wrote.stdout:
        return Verdict("ERROR", evidence=f"the root is not writable: {wrote.text[:200]}")
    c = box.client
    r = c.post(f"/v1/sandboxes/{box.id}/snapshots", json={})
    if r.status_code in (400, 409) and "snapshot" in r.text and "tier" in r.text:
        return na(f"the tier takes no snapshots: {r.text[:200]}")
    if r.status_code != 201:
        raise ProbeFailed(f"snapshot: HTTP {r.status_code} {r.text[:200]}")
    snap = r.json()["snapshot_id"]
    v = blocked("")
    notes = []
    try:
        kid, answer = _created(ctx, template=snap)
        if kid is None:
            notes.append(f"from its snapshot: {answer[:160]}")
        elif ran := _ran_in_agent(kid, n):
            v.add_break("ESCAPE", f"from its snapshot, the agent ran the tenant's {module}: {ran}")
        else:
            notes.append("started from its snapshot; the change did not run")
        r = c.post(f"/v1/sandboxes/{box.id}/fork", json={"count": 1})
        if r.status_code == 201:
            fork = r.json()["sandboxes"][0]
            kid = Box(c, fork)
            ctx.server.boxes.append(kid)
            if ran := _ran_in_agent(kid, n):
                v.add_break("ESCAPE", f"its fork's agent ran the tenant's {module}: {ran}")
            else:
                notes.append("forked; the change did not run")
        else:
            notes.append(f"fork: HTTP {r.status_code} {r.text[:120]}")
            if r.status_code >= 500:
                v.add_break("DOS", f"fork: HTTP {r.status_code}")
    finally:
        with contextlib.suppress(httpx.HTTPError):
            c.delete(f"/v1/snapshots/{snap}")
    v.evidence = v.evidence or f"{module} changed; " + "; ".join(notes)
    return v


@check(
    "host-files-traps",
    "files-api",
    "symlinks and FIFOs a sandbox left in a volume or kept workspace, read and written through "
    "the files APIs the server serves on the host",
    ["host-files-follow"],
    needs_template=True,
)
def _host_files(ctx: Ctx) -> Verdict:
    o = ctx.oracle
    name, _ = ctx.template()
    n = o.nonce[:12]
    c = ctx.server.client(ctx.server.key("battery-a"))
    r = c.post("/v1/volumes", json={"name": f"battery-{n}", "size_mb": 16})
    if r.status_code != 201:
        raise ProbeFailed(f"volume: HTTP {r.status_code} {r.text[:200]}")
    vol = r.json()["volume_id"]
    v = blocked("")
    codes: dict[int, int] = {}
    box = None
    try:
        box = ctx.box(template=name, keep_workspace=True, volume_mounts={"/data": vol})
        traps = (
            f"ln -s {o.canary_file} filelink && ln -s {o.canary_dir} dirlink"
            f" && ln -s {o.drop_dir} droplink && ln -s /proc/self/root rootlink"
            " && ln -s loop2 loop1 && ln -s loop1 loop2 && mkfifo fifo && echo PLANTED"
        )
        for d in ("/workspace", "/data"):
            out = box.run(f"cd {d} && {traps}")
            if "PLANTED" not in out.stdout:
                return Verdict("ERROR", evidence=f"could not plant in {d}: {out.text[:200]}")
        if box.kill().status_code != 204:
            raise ProbeFailed("the sandbox was not killed")
        reads = ["filelink", "dirlink/secret.txt", f"rootlink{o.canary_file}", "loop1", "fifo"]
        where = {"volume": f"/v1/volumes/{vol}/files"}
        where["kept workspace"] = f"/v1/workspaces/{box.id}/files"

        def judge(label: str, method: str, url: str, path: str, body: bytes | None) -> None:
            try:
                r = c.request(method, url, params={"path": path}, content=body, timeout=10)
            except httpx.TimeoutException:
                v.add_break("DOS", f"{label}: no answer in 10 s")
                return
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
            if r.status_code >= 500:
                v.add_break("DOS", f"{label} -> HTTP {r.status_code}")
            for leaked in o.leaks(r.text):
                v.add_break("READ", f"{label} leaked the {leaked}")

        for what, url in where.items():
            for p in reads:
                judge(f"GET {what} {p}", "GET", url, p, None)
        # (Not through `filelink`: the canary's content is what later checks look for.)
        for p in (f"droplink/abx-{n}-vol", f"rootlink{o.drop_dir}/abx-{n}-root"):
            judge(f"PUT volume {p}", "PUT", where["volume"], p, b"PWNED")
        dropped = sorted(o.drop_dir.glob(f"abx-{n}-*"))
        if dropped:
            names = [f.name for f in dropped]
            v.add_break("WRITE", f"the volume files API wrote {names} in {o.drop_dir}")
        for f in dropped:  # (a later tier's run looks again)
            f.unlink()
    finally:
        with contextlib.suppress(httpx.HTTPError):
            c.delete(f"/v1/volumes/{vol}")
            if box is not None:
                box.kill()
                c.delete(f"/v1/workspaces/{box.id}")
    v.evidence = v.evidence or f"HTTP codes {dict(sorted(codes.items()))}"
    return v
