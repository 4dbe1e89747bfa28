"""What the battery attacks: a real agentbox server on a runtime, and sandboxes over its API.

The default profile is the product exactly as shipped (`agentbox serve`). A weakened profile is
the same server with runtime weakenings, started through `agentbox.battery.server` (Python only:
weakenings are never reachable over the API or the CLI).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

PROBES_SRC = Path(__file__).resolve().parent / "probes.py"

# Small limits, so exhaustion probes hit them quickly.
BATTERY_RESOURCES = {
    "memory_mb": 128,
    "pids": 64,
    "nofile": 256,
    "disk_mb": 64,
    "tmp_mb": 16,
    "cpu_count": 1.0,
    "file_size_mb": 256,
}


def answers(url: str, within: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """Whether the server at `url` answers /v1/health within `within` seconds (asked until
    then, while `alive`)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and alive():
        try:
            if httpx.get(f"{url}/v1/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout: float = 30) -> None:
    """Wait until a just-started server answers /v1/health; RuntimeError with its log if not."""
    if answers(url, timeout, lambda: proc.poll() is None):
        return
    state = "exited" if proc.poll() is not None else "did not come up"
    try:
        log = log_path.read_text(errors="replace")[-3000:]
    except OSError:
        log = ""
    raise RuntimeError(f"server at {url} {state}: {log}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    exit_code: int | None
    stdout: str
    stderr: str
    end: dict[str, Any]

    @property
    def text(self) -> str:
        return self.stdout + self.stderr


class Box:
    """One sandbox, driven only through the public HTTP API."""

    def __init__(
        self, client: httpx.Client, info: dict[str, Any], user: str | None = "root"
    ) -> None:
        self.client = client
        self.id: str = info["sandbox_id"]
        self.info = info
        self._probe_path: str | None = None
        # Probes run as the sandbox's own root, its strongest principal (ROOT_CAPS in its user
        # namespace), unless a check says otherwise; a sandbox without a root (unsandboxed)
        # runs them as its one user.
        self.user: str | None = user

    def run(self, cmd: str, timeout: float = 60, user: str | None = None) -> Run:
        """Run `cmd` as `user` ("user", "root"; None: the box's `user`, else the default)."""
        out, err, end = [], [], {}
        body: dict[str, Any] = {"cmd": cmd, "timeout": timeout}
        if user or self.user:
            body["user"] = user or self.user
        with self.client.stream(
            "POST",
            f"/v1/sandboxes/{self.id}/commands",
            json=body,
            timeout=timeout + 30,
        ) as r:
            if r.status_code != 200:
                r.read()
                return Run(None, "", f"HTTP {r.status_code}: {r.text}", {})
            for line in r.iter_lines():
                if not line:
                    continue
                ev = json.loads(line)
                if ev["type"] == "stdout":
                    out.append(ev["data"])
                elif ev["type"] == "stderr":
                    err.append(ev["data"])
                elif ev["type"] in ("end", "error"):
                    end = ev
        return Run(end.get("exit_code"), "".join(out), "".join(err), end)

    def start(self, cmd: str, user: str | None = None) -> str:
        body: dict[str, Any] = {"cmd": cmd, "background": True}
        if user or self.user:
            body["user"] = user or self.user
        r = self.client.post(f"/v1/sandboxes/{self.id}/commands", json=body)
        r.raise_for_status()
        return r.json()["cmd_id"]

    def output(self, cmd_id: str) -> str:
        r = self.client.get(f"/v1/sandboxes/{self.id}/commands/{cmd_id}/events", timeout=5)
        out = []
        for line in r.text.splitlines():
            if line:
                ev = json.loads(line)
                if ev["type"] in ("stdout", "stderr"):
                    out.append(ev["data"])
        return "".join(out)

    def wait_output(self, cmd_id: str, needle: str, timeout: float = 15) -> str:
        """Poll a background command's output until `needle` shows up (or time runs out)."""
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            info = self.client.get(f"/v1/sandboxes/{self.id}/commands/{cmd_id}").json()
            text = self.output_so_far(cmd_id)
            if needle in text or not info.get("running", False):
                return text
            time.sleep(0.1)
        return text

    def output_so_far(self, cmd_id: str) -> str:
        # /events blocks until the command ends; read what is buffered with a short timeout.
        out = []
        try:
            with self.client.stream(
                "GET", f"/v1/sandboxes/{self.id}/commands/{cmd_id}/events", timeout=0.5
            ) as r:
                for line in r.iter_lines():
                    if line:
                        ev = json.loads(line)
                        if ev["type"] in ("stdout", "stderr"):
                            out.append(ev["data"])
        except httpx.TimeoutException:
            pass
        return "".join(out)

    def probe(
        self, name: str, timeout: float = 60, user: str | None = None, **args: Any
    ) -> dict[str, Any]:
        """Run one probe of probes.py inside the sandbox; its JSON answer (or why not)."""
        if self._probe_path is None:
            path = f"/tmp/.abx-probe-{self.id}.py"
            r = self.put(path, PROBES_SRC.read_bytes())
            if r.status_code >= 300:
                return {"error": f"upload failed: HTTP {r.status_code} {r.text[:200]}"}
            self._probe_path = path
        arg = json.dumps(args).replace("'", "'\\''")
        res = self.run(f"python3 {self._probe_path} {name} '{arg}'", timeout=timeout, user=user)
        for line in reversed(res.stdout.splitlines()):
            try:
                body = json.loads(line)
            except ValueError:
                continue
            if isinstance(body, dict):
                body.setdefault("_exit", res.exit_code)
                body["_raw"] = res.text[-4000:]
                return body
        return {"error": "no answer", "_exit": res.exit_code, "_raw": res.text[-4000:]}

    def put(self, path: str, data: bytes) -> httpx.Response:
        return self.client.put(
            f"/v1/sandboxes/{self.id}/files", params={"path": path}, content=data
        )

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.client.get(f"/v1/sandboxes/{self.id}/files", params={"path": path}, **kw)

    def kill(self, timeout: float = 60) -> httpx.Response:
        return self.client.delete(f"/v1/sandboxes/{self.id}", timeout=timeout)


class Server:
    """An agentbox server process for one profile, in the battery's network namespace."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        weaken: frozenset[str],
        bind_host: list[str],
        extra_env: dict[str, str],
        runtime: str = "process",
        options: list[str] | None = None,
    ) -> None:
        self.name = name
        self.options = list(options or [])
        self.weaken = weaken
        self.bind_host = bind_host
        self.runtime = runtime
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = workdir / f"data-{name}"
        self.log_path = workdir / f"server-{name}.log"
        self.admin_key = f"abx_battery_{secrets.token_hex(16)}"
        self.extra_env = extra_env
        self.proc: subprocess.Popen | None = None
        self.keys: dict[str, str] = {}
        self.clients: list[httpx.Client] = []
        self.boxes: list[Box] = []
        self.enforced: frozenset[str] = frozenset(BATTERY_RESOURCES)

    def start(self) -> None:
        if not self.weaken:  # the product as shipped
            argv = [sys.executable, "-m", "agentbox.cli.app", "serve", "--runtime", self.runtime]
        else:
            argv = [sys.executable, "-m", "agentbox.battery.server", "--runtime", self.runtime]
            argv += ["--weaken", ",".join(sorted(self.weaken))]
            for p in self.bind_host:
                argv += ["--bind-host", p]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--data-dir", str(self.data_dir)]
        # Sandboxes that name no template run on the host's userland: the battery runs inside
        # a network namespace of its own, where `base` (the shipped default) cannot be built.
        # Checks of a built template's writable root name the battery's own template.
        argv += ["--default-template", "host", *self.options]
        env = dict(os.environ, AGENTBOX_ADMIN_KEY=self.admin_key, **self.extra_env)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_healthy(self.url, self.proc, self.log_path)
        self.enforced = self._enforced()

    def _enforced(self) -> frozenset[str]:
        """The limits the server's default runtime declares it enforces."""
        served = httpx.get(f"{self.url}/v1/health", timeout=10).json()["runtimes"]
        default = next(info for info in served.values() if info["default"])
        return frozenset(default["features"]["enforces"])

    def alive(self) -> bool:
        try:
            return httpx.get(f"{self.url}/v1/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def key(self, tenant: str) -> str:
        if tenant not in self.keys:
            with self.client(self.admin_key) as c:
                r = c.post("/v1/keys", json={"tenant": tenant, "admin": False})
                r.raise_for_status()
                self.keys[tenant] = r.json()["key"]
        return self.keys[tenant]

    def client(self, key: str) -> httpx.Client:
        c = httpx.Client(base_url=self.url, headers={"X-API-Key": key}, timeout=60)
        self.clients.append(c)
        return c

    def box(self, tenant: str = "battery-a", **body: Any) -> Box:
        c = self.client(self.key(tenant))
        body.setdefault("timeout", 600)
        resources = {**BATTERY_RESOURCES, **body.get("resources", {})}
        if self.weaken:
            # A control that takes the limits away declares it enforces none, and the server
            # refuses to be asked for a limit that would not hold: its sandboxes ask none.
            resources = {k: v for k, v in resources.items() if k in self.enforced}
        body["resources"] = resources
        r = c.post("/v1/sandboxes", json=body)
        if r.status_code != 201:
            raise RuntimeError(f"create failed: HTTP {r.status_code} {r.text[:300]}")
        b = Box(c, r.json(), user=None if "unsandboxed" in self.weaken else "root")
        self.boxes.append(b)
        return b

    def kill_boxes(self) -> None:
        for b in self.boxes:
            try:
                b.kill(timeout=15)
            except httpx.TimeoutException:
                break  # a server a positive control starved: its stop and reconcile clean up
            except httpx.HTTPError:
                pass
        self.boxes.clear()
        for c in self.clients:
            c.close()
        self.clients.clear()

    def stop(self) -> None:
        self.kill_boxes()
        self._stop_process()
        if self.weaken:
            self._clean_up_after_weakened()

    def _clean_up_after_weakened(self) -> None:
        """A positive control may leave what the product never would (a daemon that survived
        kill, its busy mount): kill it, then let a restarted server's reconcile remove the rest."""
        from agentbox.battery import inventory

        inv = inventory.take(self.data_dir)
        if inv.is_empty():
            return
        for p in inv.processes:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
        self.start()
        self._stop_process()

    def _stop_process(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
