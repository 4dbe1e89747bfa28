"""Shared fixtures: a real agentbox server on a free port with its own data dir."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbox.battery.target import free_port, wait_healthy

ADMIN_KEY = "test-admin-key-0123456789"


def _one_tls_context() -> None:
    """Every httpx client the tests make shares one default TLS context. httpx builds a new one
    per client, loading the CA bundle (~50 ms here), and the tests make thousands of clients
    for plain-HTTP servers: a sixth of an integration test's time went to it."""
    from httpx._transports import default

    make = default.create_ssl_context
    shared: dict[bool, Any] = {}

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is not True or cert is not None:
            return make(verify=verify, cert=cert, trust_env=trust_env)
        if trust_env not in shared:
            shared[trust_env] = make(trust_env=trust_env)
        return shared[trust_env]

    default.create_ssl_context = create_ssl_context  # type: ignore[assignment]


_one_tls_context()


@dataclass
class ServerHandle:
    """A running `agentbox serve` process and what a test needs to talk to it."""

    url: str
    data_dir: Path
    port: int
    admin_key: str = ADMIN_KEY
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)

    def client(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"X-API-Key": key or self.admin_key}, timeout=60
        )

    def make_key(self, tenant: str, admin: bool = False) -> str:
        with self.client() as c:
            r = c.post("/v1/keys", json={"tenant": tenant, "admin": admin})
            r.raise_for_status()
            key = r.json()["key"]
        self.keys.append(key)
        return key

    def start(self) -> None:
        """Start the server. Its default template is `host` and it serves the `process` tier
        alone, unless `extra_args` say otherwise (see start_server)."""
        env = dict(os.environ, AGENTBOX_ADMIN_KEY=self.admin_key)
        default = [] if "--default-template" in self.extra_args else ["--default-template", "host"]
        if "--runtime" not in self.extra_args:
            default += ["--runtime", "process"]  # the other tiers where a test asks for them
        self.log_path = self.data_dir.parent / f"server-{self.port}.log"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentbox.cli.app",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--data-dir",
                str(self.data_dir),
                *self.extra_args,
                *default,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_healthy(self.url, self.proc, self.log_path)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server process only; sandboxes outlive it by design."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill_all_sandboxes(self) -> None:
        # Warm pool members belong to no tenant: shrinking the pools ends them.
        try:
            with self.client() as c:
                r = c.get("/v1/pools")
                for pool in r.json().get("pools", []) if r.status_code == 200 else []:
                    c.put(f"/v1/pools/{pool['template']}", json={"size": 0})
        except httpx.HTTPError:
            pass
        for key in [self.admin_key, *self.keys]:
            try:
                with self.client(key) as c:
                    token = None
                    while True:
                        params = {"state": "live", "limit": 200}
                        if token:
                            params["next_token"] = token
                        r = c.get("/v1/sandboxes", params=params)
                        if r.status_code != 200:
                            break
                        body = r.json()
                        for s in body["sandboxes"]:
                            c.delete(f"/v1/sandboxes/{s['sandbox_id']}")
                        token = body.get("next_token")
                        if not token:
                            break
            except httpx.HTTPError:
                pass


def start_server(tmp: Path, extra_args: list[str] | None = None) -> ServerHandle:
    """A server on its own data dir. Its default template is `host` (the host's userland:
    nothing to build) unless `extra_args` name one: the suite's many servers would otherwise
    each build `base` into their empty data dirs. `base` as the default is tested on its own
    (test_base_template.py, and the README's quick start in test_readme.py)."""
    port = free_port()
    data_dir = tmp / f"data-{port}"
    handle = ServerHandle(
        url=f"http://127.0.0.1:{port}",
        data_dir=data_dir,
        port=port,
        extra_args=list(extra_args or []),
    )
    handle.start()
    return handle


@pytest.fixture
def data_dir() -> Iterator[Path]:
    """A fresh data dir for a runtime driven directly (no server). Under /var/tmp, not /tmp:
    sandboxes see a /tmp of their own, and a data dir must not be inside a path they see."""
    path = Path("/var/tmp") / f"agentbox-rt-{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir(mode=0o700)
    yield path
    sweep_bind_roots(path)
    shutil.rmtree(path, ignore_errors=True)


def sweep_bind_roots(data_dir: Path) -> None:
    """For a test whose runtime was not closed: inventory.sweep_bind_roots."""
    from agentbox.battery import inventory

    inventory.sweep_bind_roots(data_dir)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    """One server for the whole session; tests make their own tenants."""
    handle = start_server(tmp_path_factory.mktemp("agentbox"))
    yield handle
    handle.kill_all_sandboxes()
    handle.stop()


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[ServerHandle]:
    """A private server for tests that restart or crash it."""
    handle = start_server(tmp_path)
    yield handle
    if handle.proc is None:
        handle.start()
    handle.kill_all_sandboxes()
    handle.stop()


_tenant_counter = 0


@pytest.fixture
def tenant_key(server: ServerHandle) -> str:
    """A key for a brand-new tenant (so quotas and listings start empty)."""
    global _tenant_counter
    _tenant_counter += 1
    return server.make_key(f"t{os.getpid()}-{_tenant_counter}-{time.monotonic_ns() % 10**6}")


@dataclass
class RunResult:
    """What a foreground command produced, collected from its NDJSON event stream."""

    stdout: str
    stderr: str
    exit_code: int | None
    end: dict
    events: list[dict]


def create_sandbox(client: httpx.Client, **body) -> dict:
    r = client.post("/v1/sandboxes", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def run(client: httpx.Client, sandbox_id: str, cmd: str, **body) -> RunResult:
    events: list[dict] = []
    with client.stream(
        "POST", f"/v1/sandboxes/{sandbox_id}/commands", json={"cmd": cmd, **body}
    ) as r:
        assert r.status_code == 200, r.read().decode()
        for line in r.iter_lines():
            if line:
                events.append(json.loads(line))
    end = events[-1]
    assert end["type"] == "end", events
    return RunResult(
        stdout="".join(e["data"] for e in events if e["type"] == "stdout"),
        stderr="".join(e["data"] for e in events if e["type"] == "stderr"),
        exit_code=end["exit_code"],
        end=end,
        events=events,
    )


def pip_venv(root: Path, requirements: list[str]) -> Path:
    """The python of a virtual environment with `requirements` from PyPI, kept between runs
    (by their digest) under `root`."""
    digest = hashlib.sha256("\n".join([sys.version, *requirements]).encode()).hexdigest()[:12]
    home = root / digest
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


def shared_template_dir() -> Path:
    """Built templates shared by every test server of a run (and by later runs on the same
    machine): building code-interpreter takes minutes, finding it in the cache takes ms."""
    return Path(os.environ.get("AGENTBOX_TEST_TEMPLATE_DIR", "/var/tmp/agentbox-test-templates"))


def make_deb(tmp: Path, name: str, version: str = "1.0") -> Path:
    """A tiny Debian package (built here with dpkg-deb) installing /usr/bin/NAME."""
    root = tmp / f"{name}-{version}"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "usr/bin").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(
        f"Package: {name}\nVersion: {version}\nArchitecture: all\nMaintainer: t <t@t>\n"
        "Description: agentbox test package\n"
    )
    tool = root / "usr/bin" / name
    tool.write_text(f"#!/bin/sh\necho {name} works\n")
    tool.chmod(0o755)
    out = tmp / f"{name}_{version}_all.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-b", str(root), str(out)],
        check=True,
        capture_output=True,
    )
    return out


def make_wheel(name: str, version: str = "1.0") -> tuple[str, bytes]:
    """A pure-Python wheel with a module and a console script (built by hand: no network)."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VALUE = 'from {name}'\ndef main():\n    print('{name} cli ok')\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: agentbox-test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
        f"{dist}/entry_points.txt": f"[console_scripts]\n{name}-cli = {name}:main\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
        z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return f"{name}-{version}-py3-none-any.whl", buf.getvalue()


def seed_template_store(store: Path) -> None:
    """A private template store holding the Debian base as this machine's test runs have it
    (hard links into the shared one: a minute to build otherwise)."""
    import shutil

    shared = shared_template_dir()
    store.mkdir(parents=True)
    for part in ("layers", "cache"):
        if (shared / part).is_dir():
            r = subprocess.run(["cp", "-al", str(shared / part), str(store)])
            if r.returncode != 0:
                shutil.rmtree(store / part, ignore_errors=True)


def build_shipped(name: str) -> Path:
    """The shipped template `name`, built (or found in the cache) in the shared store."""
    from agentbox.templates import TemplateStore, builtin_spec_path, load_spec

    root = shared_template_dir()
    root.mkdir(parents=True, exist_ok=True)
    path = builtin_spec_path(name)
    assert path is not None
    with open(root / "build.log", "a") as log:
        TemplateStore(root).build(
            load_spec(path.read_text(), path.parent),
            lambda e: log.write(json.dumps(e) + "\n"),
        )
    return root


@pytest.fixture(scope="session")
def base_template() -> Path:
    """The shipped default template (base), built (or found in the cache) once per session."""
    return build_shipped("base")


@pytest.fixture(scope="session")
def code_template(base_template: Path) -> Path:
    """The shipped code-interpreter template, built (or found in the cache) once per session,
    in the shared store that also holds `base` (so that store is the same whichever test asks
    first)."""
    return build_shipped("code-interpreter")


@pytest.fixture(scope="session")
def full_template(code_template: Path) -> Path:
    """code-interpreter-full (R and TypeScript kernels besides), built on code-interpreter's
    layers in the same store: its own steps take about half a minute."""
    return build_shipped("code-interpreter-full")


@pytest.fixture(scope="session")
def ci_server(
    tmp_path_factory: pytest.TempPathFactory, code_template: Path
) -> Iterator[ServerHandle]:
    """A server whose code-interpreter template is built, with a warm pool of one."""
    handle = start_server(
        tmp_path_factory.mktemp("agentbox-ci"),
        ["--template-dir", str(code_template), "--warm-pool", "code-interpreter=1"],
    )
    yield handle
    handle.kill_all_sandboxes()
    handle.stop()


# ---------------------------------------------------------------- SDK fixtures, in-process servers


@pytest.fixture
def conn(server: ServerHandle, tenant_key: str) -> dict[str, Any]:
    """How the SDK reaches the session's server as a tenant (module fixtures may override)."""
    return {"api_key": tenant_key, "api_url": server.url}


@pytest.fixture
def sbx(conn: dict[str, Any]) -> Iterator[Any]:
    """An SDK sandbox of the session's server, killed after the test (modules may override)."""
    from agentbox.sdk import Sandbox

    sandbox = Sandbox.create(timeout=120, **conn)
    yield sandbox
    sandbox.kill()
    sandbox.close()


@contextmanager
def serving_app(app: Any) -> Iterator[str]:
    """Serve an ASGI app made in this process (with surfaces or runtimes registered in code)
    under uvicorn on a free port; yields its URL."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


# ---------------------------------------------------------------- the battery, beside the rest
#
# The escape battery is one long subprocess that mostly waits (servers starting, timeouts
# expiring). When a run selects it, it starts as soon as collection ends and runs beside the
# integration and unit tests; test_escape_battery then only collects its result. Reliability
# tests, which want a quiet machine, run after it.

ORDER = {"integration": 0, "unit": 1, "security": 2, "reliability": 3}
BATTERY_TEST = "tests/security/test_battery.py::test_escape_battery"
BATTERY_TIMEOUT = 2900.0
BATTERY_KEY = pytest.StashKey["BatteryRun"]()


@dataclass
class BatteryRun:
    """The battery subprocess started for this session, and where it writes."""

    workdir: Path
    tiers: list[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    failed: str = ""

    @property
    def markdown(self) -> Path:
        return self.workdir / "scorecard.md"

    @property
    def json(self) -> Path:
        return self.workdir / "scorecard.json"

    def start(self) -> None:
        templates = self.workdir / "templates"
        try:
            build_shipped("base")  # the session needs it anyway; the battery's store links it
            seed_template_store(templates)
        except Exception as e:  # the battery test reports it
            self.failed = f"could not prepare the battery's template store: {e!r}"
            return
        argv = [sys.executable, "-m", "agentbox.battery", "--runtime", ",".join(self.tiers)]
        argv += ["--markdown", str(self.markdown), "--json", str(self.json)]
        # The battery's template shares its Debian base with the test run's templates, in a
        # store of its own (the shared one's index stays the test run's).
        argv += ["--template-dir", str(templates)]
        with open(self.workdir / "stdout", "wb") as out, open(self.workdir / "stderr", "wb") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, start_new_session=True)
        self.started = time.monotonic()

    def wait(self) -> str:
        """Waits for the battery to end; returns the tail of its output."""
        if self.proc is not None:
            left = BATTERY_TIMEOUT - (time.monotonic() - self.started)
            try:
                self.proc.wait(timeout=max(left, 1.0))
            except subprocess.TimeoutExpired:
                self.stop()
                self.failed = f"the battery ran longer than {BATTERY_TIMEOUT:.0f} s"
        tails = [self.failed]
        for name in ("stdout", "stderr"):
            if (self.workdir / name).exists():
                tails.append((self.workdir / name).read_text(errors="replace")[-3000:])
        return "\n".join(tails)

    def stop(self) -> None:
        """Interrupts the battery, which then stops its servers and removes what it planted."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def battery_tiers() -> list[str]:
    """Every isolation tier installed here."""
    tiers = ["process"]
    tiers += [
        t for t, binary in (("container", "runc"), ("gvisor", "runsc")) if shutil.which(binary)
    ]
    return tiers


def _place(item: pytest.Item) -> int:
    parts = item.nodeid.split("/")
    return ORDER.get(parts[1], 1) if len(parts) > 2 else 1


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_place)
    wanted = any(item.nodeid == BATTERY_TEST for item in items)
    if not wanted or os.geteuid() != 0 or config.option.collectonly:
        return
    import tempfile

    run = BatteryRun(Path(tempfile.mkdtemp(prefix="agentbox-battery-")), battery_tiers())
    config.stash[BATTERY_KEY] = run
    run.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    run = session.config.stash.get(BATTERY_KEY, None)
    if run is not None:
        run.stop()
        shutil.rmtree(run.workdir, ignore_errors=True)
