"""Templates as the control plane serves them: built on first use (once, however many creates
wait), built and removed on request, checked at start-up by starting a sandbox of each.

A service of the core (see core/manager.py, the front object).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentbox.core.auth import Caller
from agentbox.core.errors import AgentboxError, Conflict, NotFound, SandboxUnavailable
from agentbox.core.pools import CHECK_TENANT
from agentbox.core.states import SandboxState
from agentbox.store.db import SandboxRow
from agentbox.templates import (
    BuildError,
    TemplateInfo,
    TemplateSpec,
    builtin_spec_path,
    load_spec,
)
from agentbox.vocab import ErrorCode, status_of

if TYPE_CHECKING:
    from agentbox.core.manager import SandboxManager

log = logging.getLogger("agentbox.manager")

HOST_TEMPLATE = "host"  # no built tree: the host's own userland, read-only
DEFAULT_TEMPLATE = "base"  # the shipped default: a minimal Debian with a writable root
# Names the server's default template (`--default-template`) in requests and pool settings.
DEFAULT_ALIAS = "default"
# Where the control plane notes a sandbox's template tree in its runtime state (rootfs_in_use).
TEMPLATE_ROOTFS = "template_rootfs"
TEMPLATE_CHECK_S = 120.0  # a template whose check sandbox takes longer to start has failed


@dataclass(frozen=True)
class TemplateCheck:
    """What the start-up check found: `checking`, `ok` or `failed` (with why)."""

    status: str
    error: str | None = None
    seconds: float | None = None


class TemplateService:
    def __init__(
        self, core: SandboxManager, check_at_start: bool, default: str = DEFAULT_TEMPLATE
    ) -> None:
        self.core = core
        self.default = default  # what a create that names no template gets
        self._template_locks: dict[str, asyncio.Lock] = {}
        # First-use builds of shipped templates -> how far they got (shown on `building` rows).
        self._builds: dict[str, dict[str, Any]] = {}
        # Whether each template started a sandbox at start-up (check_templates).
        self.template_checks: dict[str, TemplateCheck] = {}
        self.check_at_start = check_at_start

    def resolve(self, name: str | None) -> str:
        """The template a request means: no name, or `default`, is the server's default."""
        return self.default if name in (None, "", DEFAULT_ALIAS) else name

    def known(self) -> list[str]:
        """Every template a create may name now: the host userland and the built ones."""
        return [HOST_TEMPLATE, *sorted(t.name for t in self.core.templates.list())]

    async def template(self, name: str) -> TemplateInfo | None:
        """The built template `name` (None for the host userland); a shipped template that
        was never built is built now, once, however many creates wait for it."""
        if name == HOST_TEMPLATE:
            return None
        info = self.core.templates.get(name)
        if info is not None:
            return info
        spec_path = builtin_spec_path(name)
        if spec_path is None:
            raise NotFound(
                f"unknown template {name!r}; built: {', '.join(self.known())}; build one with "
                "`agentbox template build SPEC`",
                template=name,
            )
        async with self._template_locks.setdefault(name, asyncio.Lock()):
            info = self.core.templates.get(name)
            if info is None:
                log.info("building shipped template %s on first use", name)
                spec = load_spec(spec_path.read_text(), spec_path.parent)
                progress = self._builds[name] = {"template": name, "started_at": time.time()}

                def step(event: dict[str, Any]) -> None:  # in the build's thread
                    if event.get("type") == "step":
                        progress["step"] = event["index"] + 1
                        progress["steps"] = event["total"]
                        progress["step_name"] = event["name"]

                try:
                    info = await asyncio.to_thread(self.core.templates.build, spec, step)
                except (BuildError, OSError) as e:  # OSError: the template store's own disk
                    if not isinstance(e, BuildError):
                        log.exception("building template %s failed", name)
                    hint = (
                        f"; `agentbox setup` builds it with its log, or name template "
                        f"{HOST_TEMPLATE!r} (the host's userland, read-only)"
                        if name == self.default
                        else ""
                    )
                    raise SandboxUnavailable(
                        f"template {name} could not be built: {e}{hint}"
                    ) from None
                finally:
                    self._builds.pop(name, None)
                check = self.template_checks.get(name)
                if check is not None and check.status == "failed":
                    # A build that failed at start-up (no mirror then) and works now: not
                    # failed any more, and not checked either.
                    del self.template_checks[name]
        return info

    def needs_build(self, template: str) -> bool:
        """Whether a create of `template` waits for a first-use build of a shipped template."""
        return (
            template != HOST_TEMPLATE
            and self.core.templates.get(template) is None
            and builtin_spec_path(template) is not None
        )

    def build_progress(self, row: SandboxRow) -> dict[str, Any] | None:
        """How far the build a `building` sandbox waits for got."""
        if row.state != SandboxState.BUILDING:
            return None
        progress = dict(self._builds.get(row.template) or {"template": row.template})
        if "started_at" in progress:
            progress["seconds"] = round(time.time() - progress.pop("started_at"), 1)
        return progress

    def rootfs_in_use(self, rootfs: Path) -> bool:
        """Whether a live sandbox runs from this template tree (a rebuild must keep it)."""
        return any(
            (row.runtime_state or {}).get(TEMPLATE_ROOTFS) == str(rootfs)
            for row in self.core.store.live_sandboxes()
        )

    async def check_templates(self) -> None:
        """At start-up: start one sandbox of each ready template (the host userland included)
        and run a command in it, so that a template that cannot start is known, and why, before
        a client finds out (the log, /v1/health and the template's `check` say it)."""
        names = self.known()
        for name in names:
            self.template_checks[name] = TemplateCheck("checking")
        limit = asyncio.Semaphore(2)

        async def check(name: str) -> None:
            async with limit:
                started = time.monotonic()
                try:
                    await asyncio.wait_for(self._check_template(name), TEMPLATE_CHECK_S)
                except (AgentboxError, TimeoutError) as e:
                    why = (
                        e.message
                        if isinstance(e, AgentboxError)
                        else f"no sandbox started within {TEMPLATE_CHECK_S:g} s"
                    )
                    self.template_checks[name] = TemplateCheck("failed", why)
                    log.error(
                        "template %s cannot start a sandbox: %s (creates from it will fail "
                        "the same way; fix it, or rebuild or remove it: agentbox template)",
                        name,
                        why,
                    )
                else:
                    took = round(time.monotonic() - started, 2)
                    self.template_checks[name] = TemplateCheck("ok", seconds=took)

        await asyncio.gather(*(check(n) for n in names))

    def prepare_default(self) -> None:
        """At start-up: when the default template is a shipped one not built yet, build it in
        the background (creates that name no template wait for it, as `building`), then check
        it like the others. `agentbox setup` builds it ahead, with its log."""
        if not self.needs_build(self.default):
            return
        self.template_checks[self.default] = TemplateCheck("building")
        log.info(
            "the default template %s is not built: building it now (creates wait for it; "
            "`agentbox setup` builds it ahead of `serve`)",
            self.default,
        )

        async def build() -> None:
            started = time.monotonic()
            try:
                await self.template(self.default)
                await asyncio.wait_for(self._check_template(self.default), TEMPLATE_CHECK_S)
            except (AgentboxError, TimeoutError) as e:
                why = e.message if isinstance(e, AgentboxError) else "its check timed out"
                self.template_checks[self.default] = TemplateCheck("failed", why)
                log.error("the default template %s is not usable: %s", self.default, why)
            else:
                took = round(time.monotonic() - started, 2)
                self.template_checks[self.default] = TemplateCheck("ok", seconds=took)
                log.info("the default template %s is ready (%.1f s)", self.default, took)

        task = asyncio.create_task(build())
        self.core.watchers.add(task)
        task.add_done_callback(self.core.watchers.discard)

    async def _check_template(self, template: str) -> None:
        row = await self.core.creation.start_reserved(CHECK_TENANT, template, TEMPLATE_CHECK_S)
        try:
            await self.core.creation.run_true(row)
        finally:
            await self.core.lifecycle.end(row, SandboxState.KILLED, "checked")

    async def build_template(
        self, caller: Caller, spec: TemplateSpec
    ) -> AsyncIterator[dict[str, Any]]:
        """Build a template in a worker thread; yields its log events as they come.

        The build goes on if the client leaves: its layers land in the cache either way."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        started = time.monotonic()

        def log_event(event: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        async def run() -> None:
            lock = self._template_locks.setdefault(spec.name, asyncio.Lock())
            try:
                async with lock:
                    info = await asyncio.to_thread(self.core.templates.build, spec, log_event)
                self.core.audit(
                    caller, "template.build", started=started, template=spec.name, key=info.key
                )
            except Exception as e:  # noqa: BLE001 - reported to the client as the last event
                if not isinstance(e, BuildError):
                    log.exception("template build %s failed", spec.name)
                self.core.audit(
                    caller,
                    "template.build",
                    status=status_of(ErrorCode.BUILD_FAILED),
                    started=started,
                    template=spec.name,
                    error=str(e)[:500],
                )
                events.put_nowait({"type": "error", "code": "build_failed", "message": str(e)})
            finally:
                events.put_nowait(None)

        task = asyncio.create_task(run())
        self.core.watchers.add(task)
        task.add_done_callback(self.core.watchers.discard)
        while (event := await events.get()) is not None:
            yield event

    async def remove_template(self, caller: Caller, name: str) -> None:
        users = [r.sandbox_id for r in self.core.store.live_sandboxes() if r.template == name]
        if users:
            pooled = name in self.core.pools.pools and self.core.pools.pools[name].size > 0
            raise Conflict(
                f"template {name} is in use by {len(users)} live sandbox(es)"
                + ("; set its warm pool to 0 first" if pooled else "; kill them first"),
                template=name,
            )
        if not await asyncio.to_thread(self.core.templates.remove, name):
            raise NotFound(f"template {name!r} is not built", template=name)
        self.core.audit(caller, "template.remove", template=name)
