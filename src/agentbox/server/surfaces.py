"""Surfaces: the ways into the core that share the server's port (the /v1 HTTP API first; an
E2B-compatible API, MCP or a dashboard can be added beside it).

A surface is a plug-in: a callable that receives the `Core` (the sandbox manager, the core's
front object, and the services beside it) and returns the routes it contributes. Each owns a
path prefix (its routes' paths) or, where paths collide with another surface's, a request
predicate (a header, a host) checked before the path. Surfaces are found under the
`agentbox.surfaces` entry-point group or registered in code with `register`; the /v1 API is
built in, so it is there whether or not the package's entry points are installed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from agentbox.core.auth import Authenticator
from agentbox.core.manager import SandboxManager
from agentbox.core.network import NetworkService, NetworkSettings
from agentbox.core.runtimes import Runtimes
from agentbox.server.errors import install_handlers
from agentbox.store.db import Store

if TYPE_CHECKING:
    from agentbox.server.limits import ServerLimits

GROUP = "agentbox.surfaces"
DEFAULT = "v1"
_BUILTIN = {DEFAULT: "agentbox.server.routes:v1_surface"}


@dataclass(frozen=True)
class Services:
    """What the server's lifespan makes: the core's front object and the services beside it."""

    manager: SandboxManager
    store: Store
    auth: Authenticator
    runtimes: Runtimes
    network: NetworkService


class Core:
    """The core as a surface sees it.

    Surfaces are assembled when the app is made, the services only when the server starts (they
    need the data dir's lock), so handlers read them per request, never at assembly.
    """

    def __init__(self, settings: NetworkSettings, limits: ServerLimits | None = None) -> None:
        from agentbox.server.limits import ServerLimits

        self.settings = settings  # the operator's network settings: public URL, ports domain
        self.limits = limits or ServerLimits()  # what clients may make the server spend
        self._services: Services | None = None

    def attach(self, services: Services | None) -> None:
        self._services = services

    @property
    def services(self) -> Services:
        if self._services is None:
            raise RuntimeError("the core is not started: the server's lifespan has not run")
        return self._services

    @property
    def manager(self) -> SandboxManager:
        return self.services.manager

    @property
    def store(self) -> Store:
        return self.services.store

    @property
    def auth(self) -> Authenticator:
        return self.services.auth

    @property
    def runtimes(self) -> Runtimes:
        return self.services.runtimes

    @property
    def network(self) -> NetworkService:
        return self.services.network


@dataclass(frozen=True)
class SurfaceRoutes:
    """What a surface contributes: its routes, when they apply, and which need no API key."""

    router: APIRouter = field(default_factory=APIRouter)
    # Served as it is, in place of the router, for the requests `predicate` claims: a surface
    # that speaks its own protocol over HTTP (MCP).
    asgi: ASGIApp | None = None
    # Entered once the core has started, left before it stops (a surface's own tasks).
    lifespan: Callable[[], AbstractAsyncContextManager[None]] | None = None
    # Checked before any path: the requests it claims are this surface's alone.
    predicate: Callable[[Scope], bool] | None = None
    open_paths: frozenset[str] = frozenset()
    # Sandbox ports it serves itself instead of the sandbox (an E2B envd port): port -> ASGI
    # app, reached as `<port>-<sandbox_id>.<domain>` or the port path; see PortGateway.
    ports: Mapping[int, ASGIApp] = field(default_factory=dict)
    # The requests it claims carry their own credential (E2B's envd token), which the
    # surface checks: the server does not ask them for an API key.
    authenticates: bool = False
    # Of those, the (method, path)s whose bodies stream (uploads): no body cap but the stall
    # timeout, as for the /v1 file uploads.
    streams: frozenset[tuple[str, str]] = frozenset()


@dataclass(frozen=True)
class Installed:
    """What the surfaces need of the rest of the server: paths served without an API key, and
    the ports they serve in place of sandboxes."""

    open_paths: frozenset[str]
    ports: Mapping[int, ASGIApp]
    # Every claim in the order requests are routed (the first that matches takes it): whether
    # its surface checks its own credential, and its streamed routes.
    claims: tuple[tuple[Callable[[Scope], bool], bool, frozenset[tuple[str, str]]], ...] = ()
    lifespans: tuple[Callable[[], AbstractAsyncContextManager[None]], ...] = ()

    def own_credentials(self, scope: Scope) -> tuple[bool, bool]:
        """Whether the surface that takes the request checks its credential itself, and
        whether its body streams."""
        for claims, authenticates, streams in self.claims:
            if claims(scope):
                return authenticates, authenticates and (scope["method"], scope["path"]) in streams
        return False, False


Surface = Callable[[Core], SurfaceRoutes]

_registered: dict[str, Surface] = {}


def register(name: str, surface: Surface) -> None:
    """Add a surface in code (tests, embedders), as an entry point would."""
    if name in _registered or name in _BUILTIN:
        raise ValueError(f"a surface named {name!r} is already registered")
    _registered[name] = surface


def unregister(name: str) -> None:
    _registered.pop(name, None)


def available() -> dict[str, Surface]:
    """Every surface by name: the built-in /v1 API, then entry points, then those registered in
    code. The built-in one wins over an entry point of its name (the package's own)."""
    found: dict[str, Surface] = {name: _load(target) for name, target in _BUILTIN.items()}
    for ep in entry_points(group=GROUP):
        if ep.name not in found:
            found[ep.name] = ep.load()
    for name, surface in _registered.items():
        found.setdefault(name, surface)
    return found


def _load(target: str) -> Surface:
    module, _, attr = target.partition(":")
    loaded: Surface = getattr(__import__(module, fromlist=[attr]), attr)
    return loaded


def install(app: FastAPI, core: Core, surfaces: Iterable[Surface]) -> Installed:
    """Add every surface's routes to the app.

    A surface with a predicate is served as an app of its own, chosen before any path is
    matched: a request it claims reaches it even where another surface has the same path. Two
    surfaces may not serve the same sandbox port.
    """
    claims: list[tuple[Callable[[Scope], bool], ASGIApp]] = []
    own: list[tuple[Callable[[Scope], bool], bool, frozenset[tuple[str, str]]]] = []
    open_paths: set[str] = set()
    ports: dict[int, ASGIApp] = {}
    lifespans = []
    for contribution in (surface(core) for surface in surfaces):
        if contribution.predicate is None:
            app.include_router(contribution.router)
        else:
            served = contribution.asgi or _own_app(contribution.router, core)
            claims.append((contribution.predicate, served))
            own.append((contribution.predicate, contribution.authenticates, contribution.streams))
        open_paths |= contribution.open_paths
        for port, handler in contribution.ports.items():
            if port in ports:
                raise ValueError(f"two surfaces serve sandbox port {port}")
            ports[port] = handler
        if contribution.lifespan is not None:
            lifespans.append(contribution.lifespan)
    if claims:
        # Added before the request guard and the gateway, so inside them: the same keys and
        # limits apply to every surface.
        app.add_middleware(_Claimed, claims=claims)  # type: ignore[arg-type]
    return Installed(frozenset(open_paths), ports, tuple(own), tuple(lifespans))


def _own_app(router: APIRouter, core: Core) -> FastAPI:
    own = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    own.state.core = core
    install_handlers(own)
    own.include_router(router)
    return own


class _Claimed:
    """ASGI middleware: requests a surface's predicate claims go to that surface's app."""

    def __init__(self, app: ASGIApp, claims: list[tuple[Callable[[Scope], bool], ASGIApp]]):
        self.app = app
        self.claims = claims

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            for predicate, claimant in self.claims:
                if predicate(scope):
                    await claimant(scope, receive, send)
                    return
        await self.app(scope, receive, send)
