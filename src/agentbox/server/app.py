"""The HTTP server: a FastAPI app whose surfaces (the /v1 API first) share one port, the
lifespan that starts and stops the core under them, and `serve()` to run it under uvicorn.

This module assembles: routes live in `server/routes/` (one module per resource), surfaces are
found in `server/surfaces.py`, errors become answers in `server/errors.py`.
"""

import dataclasses
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from agentbox import __version__
from agentbox.core.auth import Authenticator, Caller
from agentbox.core.errors import AgentboxError
from agentbox.core.logs import LogKeeper
from agentbox.core.manager import SandboxManager
from agentbox.core.network import NetworkService, NetworkSettings
from agentbox.core.runtimes import Runtimes
from agentbox.core.template_service import DEFAULT_TEMPLATE
from agentbox.runtimes.base import RuntimeError_
from agentbox.server import logfilter, surfaces
from agentbox.server.errors import install_handlers
from agentbox.server.gateway import PortGateway, PortTarget
from agentbox.server.limits import RequestGuard, ServerLimits, protocol_class, raise_nofile
from agentbox.server.surfaces import Core, Services, Surface
from agentbox.store.db import Store
from agentbox.templates import TemplateStore

log = logging.getLogger("agentbox.server")

# Served without an API key: the API's own description (and what surfaces declare open).
DOC_ROUTES = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def create_app(
    data_dir: Path,
    admin_key: str | None = None,
    runtime_name: str = "process",
    runtime_config: dict[str, Any] | None = None,
    template_dir: Path | None = None,
    warm_pools: dict[str, int] | None = None,
    network: NetworkSettings | None = None,
    limits: ServerLimits | None = None,
    with_surfaces: Sequence[Surface] | None = None,
    default_template: str = DEFAULT_TEMPLATE,
    check_templates: bool = True,
) -> FastAPI:
    """The HTTP API over one data dir and its runtimes (`runtime_name`: comma-separated names,
    the first the default for new sandboxes; `runtime_config` goes to its constructor).

    Templates live in `template_dir` (default `<data_dir>/templates`; servers may share one);
    `warm_pools` maps template names to pool sizes; `network` holds the operator's egress and
    exposed-ports settings; `limits` what clients may make the server spend; `with_surfaces`
    the surfaces served (default: every one available, the /v1 API first);
    `default_template` what a create that names none gets (`host`: the host's userland);
    `check_templates`: start a sandbox of each template at start-up, to name those that cannot.
    """
    data_dir = data_dir.resolve()
    limits = limits or ServerLimits()
    net_settings = network or NetworkSettings()
    core = Core(net_settings, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import fcntl

        data_dir.mkdir(parents=True, exist_ok=True)
        # One server per data dir, decided before anything is read or touched: a second one
        # would reconcile (and end) the first one's sandboxes and pool members.
        lock_fd = os.open(data_dir / "server.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(lock_fd, 32, 0).decode("ascii", "replace").strip()
            os.close(lock_fd)
            msg = (
                f"the data dir {data_dir} is in use by another agentbox server "
                f"(pid {holder or 'unknown'}); stop it, or give this one another --data-dir"
            )
            print(f"agentbox: {msg}", file=sys.stderr, flush=True)
            raise RuntimeError(msg) from None
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
        store = Store.for_data_dir(data_dir)
        auth = Authenticator(store, admin_key)
        made = auth.bootstrap(data_dir)
        if made:
            log.warning("created bootstrap admin key in %s", data_dir / "admin.key")
            print(
                f"agentbox: admin API key (also in {data_dir / 'admin.key'}): {made}",
                file=sys.stderr,
                flush=True,
            )
        runtime = open_runtimes(runtime_name, data_dir, runtime_config)
        # A rebuilt or removed template keeps the tree its live sandboxes run from.
        templates = TemplateStore(
            template_dir or data_dir / "templates",
            in_use=lambda rootfs: manager.rootfs_in_use(rootfs),
        )
        netsvc = NetworkService(store, data_dir, net_settings, limits.logs)
        health: dict[str, Any] = {
            arg: float(os.environ[var])
            for arg, var in (
                ("health_interval", "AGENTBOX_HEALTH_INTERVAL"),
                ("ping_timeout", "AGENTBOX_AGENT_PING_TIMEOUT"),
            )
            if os.environ.get(var)
        }
        manager = SandboxManager(
            store, runtime, templates, netsvc, warm_pools, default_quota=limits.tenant_quota,
            default_template=default_template, follow_links=not limits.host_files_nofollow,
            check_templates=check_templates, **health,
        )  # fmt: skip
        await manager.start()
        log_keeper = LogKeeper(store, limits.logs)
        log_keeper.start()
        core.attach(Services(manager, store, auth, runtime, netsvc))
        try:
            async with AsyncExitStack() as surfaces_running:
                for surface_lifespan in installed.lifespans:
                    await surfaces_running.enter_async_context(surface_lifespan())
                yield
        finally:
            # Sandboxes are not stopped: they outlive the server and are re-adopted.
            await manager.stop()
            await gateway.aclose()
            await netsvc.close()
            await log_keeper.stop()
            await runtime.close()
            os.close(lock_fd)  # the lock goes with it

    app = FastAPI(
        title="agentbox",
        version=__version__,
        lifespan=lifespan,
        description="Self-hosted sandboxes for AI agents. See docs/API.md.",
    )
    app.state.core = core
    # The port gateway, once the middleware stack is built: the server's protocol runs its
    # fast path (server/fastpath.py).
    gateway_holder: list[PortGateway] = []
    app.state.gateways = gateway_holder

    # ------------------------------------------------------------------ exposed ports

    async def port_target(sandbox_id: str) -> PortTarget | None:
        return port_target_now(sandbox_id)

    def port_target_now(sandbox_id: str) -> PortTarget | None:
        row = core.manager.running_row(sandbox_id) or core.manager.paused_row(sandbox_id)
        if row is None or row.access_token is None:
            return None
        return PortTarget(
            sandbox_id=sandbox_id,
            tenant=row.tenant,
            access_token=row.access_token,
            public=bool((row.network or {}).get("allow_public_traffic")),
            paused=row.state == "paused",
            auto_resume=bool((row.lifecycle or {}).get("auto_resume")),
        )

    async def wake_port(sandbox_id: str) -> bool:
        row = core.manager.paused_row(sandbox_id)
        if row is None or not (row.lifecycle or {}).get("auto_resume"):
            return False
        try:
            await core.manager.resume(Caller(row.tenant, "port-gateway", False), sandbox_id)
        except AgentboxError as e:
            log.warning("sandbox %s: a port request could not resume it: %s", sandbox_id, e)
            return False
        return True

    async def tenant_of_key(key: str) -> str | None:
        return tenant_of_key_now(key)

    def tenant_of_key_now(key: str) -> str | None:
        try:
            return core.auth.authenticate(key).tenant
        except AgentboxError:
            return None

    async def connect_port(sandbox_id: str, port: int) -> Any:
        return await core.manager.connect_port(sandbox_id, port)

    def make_gateway(inner: Any) -> PortGateway:
        gw = PortGateway(
            inner,
            domain=net_settings.ports_domain,
            lookup=port_target,
            tenant_of_key=tenant_of_key,
            connect=connect_port,
            limits=limits.relay,
            handlers=installed.ports,
            wake=wake_port,
            lookup_now=port_target_now,
            tenant_of_key_now=tenant_of_key_now,
        )
        gateway_holder.append(gw)
        return gw

    class _Gateway:
        """Holds the gateway the middleware stack builds, for closing at shutdown."""

        async def aclose(self) -> None:
            for gw in gateway_holder:
                await gw.aclose()

    gateway = _Gateway()

    def key_owner(key: str) -> Caller | None:
        try:
            return core.auth.authenticate(key)
        except AgentboxError:
            return None

    installed = surfaces.install(app, core, _chosen(with_surfaces))
    # Inside the gateway (which authorizes port requests its own way): every API request shows
    # a valid key before its body is read.
    app.add_middleware(
        RequestGuard,  # type: ignore[arg-type]
        authenticate=key_owner,
        limits=limits,
        open_routes=DOC_ROUTES | installed.open_paths,
        own_credentials=installed.own_credentials,
    )
    app.add_middleware(make_gateway)  # type: ignore[arg-type]

    install_handlers(app)
    return app


def open_runtimes(names: str, data_dir: Path, default_config: dict[str, Any] | None) -> Runtimes:
    """The runtimes named (comma-separated, the first the default), each over the data dir;
    `default_config` goes to the default one's constructor."""
    from agentbox.runtimes import factory, get_runtime

    wanted = list(dict.fromkeys(n.strip() for n in names.split(",") if n.strip()))
    if not wanted:
        raise ValueError("no runtime named: give at least one, e.g. --runtime process")
    for name in wanted:  # an unknown name stops the server before any runtime is made (each
        factory(name)  # sets up host scaffolding, /run/agentbox/<digest>, that would be left)
    config = default_config or {}
    opened = {wanted[0]: get_runtime(wanted[0], data_dir=data_dir, **config)}
    unavailable: dict[str, str] = {}
    for name in wanted[1:]:
        # Another tier that cannot run here (not installed, no root) does not stop the server:
        # health says why, and a create asking for it is refused saying so.
        try:
            opened[name] = get_runtime(name, data_dir=data_dir, **_shared(config))
        except RuntimeError_ as e:
            log.warning("runtime %s is not served: %s", name, e)
            unavailable[name] = str(e)
    return Runtimes(opened, wanted[0], unavailable)


def _shared(config: dict[str, Any]) -> dict[str, Any]:
    """What of the default runtime's configuration the others take too (the operator's host
    paths apply to every tier that shows the host's userland)."""
    return {k: v for k, v in config.items() if k == "host_paths"}


def _chosen(given: Sequence[Surface] | None) -> list[Surface]:
    return list(given) if given is not None else list(surfaces.available().values())


def serve(
    host: str,
    port: int,
    data_dir: Path,
    runtime_name: str = "process",
    runtime_config: dict[str, Any] | None = None,
    template_dir: Path | None = None,
    warm_pools: dict[str, int] | None = None,
    network: NetworkSettings | None = None,
    limits: ServerLimits | None = None,
    default_template: str = DEFAULT_TEMPLATE,
    check_templates: bool = True,
) -> None:
    """Run the server in the foreground until SIGINT/SIGTERM (sandboxes keep running)."""
    import uvicorn

    if os.geteuid() != 0:
        print(
            "agentbox: warning: not running as root; cgroup limits, per-sandbox uids and "
            "disk limits are unavailable",
            file=sys.stderr,
        )
    logging.basicConfig(
        level=os.environ.get("AGENTBOX_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    limits = limits or ServerLimits()
    if limits.log_repeats:
        # Sandboxes and clients decide how often some things get logged: repeats are counted.
        logfilter.install(burst=limits.log_repeats)
    nofile = raise_nofile()
    if network is None or not network.public_url:
        shown = "localhost" if host in ("0.0.0.0", "::", "127.0.0.1") else host
        network = dataclasses.replace(
            network or NetworkSettings(), public_url=f"http://{shown}:{port}"
        )
    app = create_app(
        data_dir,
        os.environ.get("AGENTBOX_ADMIN_KEY"),
        runtime_name,
        runtime_config,
        template_dir,
        warm_pools,
        network,
        limits,
        default_template=default_template,
        check_templates=check_templates,
    )
    gateways: list[PortGateway] = app.state.gateways
    started = time.monotonic()
    log.info(
        "agentbox %s starting on http://%s:%d (data dir %s, %d descriptors, %d connections)",
        __version__,
        host,
        port,
        data_dir,
        nofile,
        limits.connection_cap(),
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        http=protocol_class(limits, lambda: gateways[0] if gateways else None),
        ws_max_size=limits.relay.ws_max_message,
        ws_ping_interval=limits.ws_ping_interval,
        ws_ping_timeout=limits.ws_ping_interval,
        log_level="warning",
        # uvicorn's loggers go to the root handler, through the repeat filter.
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
        # Exposed ports relay the sandbox server's own Date and Server headers.
        server_header=False,
        date_header=False,
    )
    log.info("agentbox stopped after %.0f s", time.monotonic() - started)
