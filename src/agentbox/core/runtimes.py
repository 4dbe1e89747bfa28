"""The runtimes a server serves with, and which one each sandbox gets.

A sandbox's runtime is chosen when it is created — asked for by name, else its tenant's default
(`default_runtime` in the tenant's quota), else the server's — and stored on its record; every
later call about it goes to that runtime, also after a restart. The core asks a runtime what it
can do through its declared `RuntimeFeatures`, never by its name.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

from agentbox.core.errors import InvalidRequest, SandboxUnavailable
from agentbox.runtimes.base import ISOLATION_RANKS, RESOURCE_NAMES, Runtime, RuntimeFeatures
from agentbox.store.db import SandboxRow

TIERS_TTL_S = 10.0  # how long the health check's answer on tiers not served is kept


class Runtimes:
    def __init__(
        self,
        runtimes: Mapping[str, Runtime],
        default: str,
        unavailable: Mapping[str, str] | None = None,
    ) -> None:
        """`unavailable`: runtimes asked for that could not start on this host, and why."""
        if default not in runtimes:
            raise ValueError(f"the default runtime {default!r} is not among {sorted(runtimes)}")
        for name, rt in runtimes.items():
            if rt.name != name:  # records name it, and features are asked by it
                raise ValueError(f"the runtime registered as {name!r} calls itself {rt.name!r}")
        self._by_name = dict(runtimes)
        self.default = default
        self.unavailable = dict(unavailable or {})
        # Declared once: what a runtime can do on this host does not change while it runs.
        self._features = {name: rt.features() for name, rt in self._by_name.items()}
        self._tiers: tuple[float, dict[str, dict[str, Any]]] | None = None

    @classmethod
    def of(cls, runtime: Runtime) -> Runtimes:
        """A server with one runtime."""
        return cls({runtime.name: runtime}, runtime.name)

    def __iter__(self) -> Iterator[Runtime]:
        return iter(self._by_name.values())

    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str) -> Runtime:
        found = self._by_name.get(name)
        if found is None:
            why = self.unavailable.get(name)
            how = f"it cannot run on this host: {why}" if why else "add it with --runtime"
            raise InvalidRequest(
                f"runtime {name!r} is not served here ({how}); this server has: "
                f"{', '.join(self._by_name)}",
                setting="runtime",
            )
        return found

    def features(self, name: str) -> RuntimeFeatures:
        self.get(name)
        return self._features[name]

    def for_row(self, row: SandboxRow) -> Runtime:
        """The runtime a sandbox runs on; a sandbox of a runtime this server no longer serves
        (its operator dropped it) cannot be reached, only found and listed."""
        found = self._by_name.get(row.runtime)
        if found is None:
            raise SandboxUnavailable(
                f"sandbox {row.sandbox_id} runs on the {row.runtime} runtime, which this "
                f"server does not serve (it has {', '.join(self._by_name)}); restart the "
                f"server with --runtime {','.join([*self._by_name, row.runtime])}"
            )
        return found

    def serves(self, row: SandboxRow) -> bool:
        return row.runtime in self._by_name

    def choose(self, requested: str | None, quota: Mapping[str, Any]) -> str:
        """The runtime of a new sandbox: asked for, else the tenant's default, else the
        server's. A tenant may only use runtimes its quota allows (`runtimes`, all if unset),
        and none weaker than its floor (`min_isolation`): a default below the floor gives way
        to the weakest served tier that meets it, a request below it is refused."""
        name = requested or quota.get("default_runtime") or self.default
        self.get(name)
        allowed = quota.get("runtimes")
        floor = quota.get("min_isolation")
        if floor is not None and self._rank(name) < ISOLATION_RANKS.get(floor, 0):
            meeting = self._meeting(floor, allowed)
            if requested is not None or not meeting:
                have = ", ".join(meeting) or f"none is served here ({', '.join(self.names())})"
                raise InvalidRequest(
                    f"this tenant's sandboxes need at least {floor} isolation, and {name} is "
                    f"weaker; use {have}",
                    setting="quota.min_isolation",
                )
            name = meeting[0]
        if allowed is not None and name not in allowed:
            raise InvalidRequest(
                f"runtime {name!r} is not allowed for this tenant; it may use: "
                f"{', '.join(allowed) or 'none'}",
                setting="quota.runtimes",
            )
        return name

    def _rank(self, name: str) -> int:
        return self._features[name].isolation

    def _meeting(self, floor: str, allowed: list[str] | None) -> list[str]:
        """Served runtimes at or above the tier `floor` (and allowed), weakest first."""
        need = ISOLATION_RANKS.get(floor, 0)
        found = [
            n for n in self._by_name
            if self._rank(n) >= need and (allowed is None or n in allowed)
        ]  # fmt: skip
        return sorted(found, key=self._rank)

    def check_request(
        self,
        name: str,
        requested: Mapping[str, Any],
        wants_network: bool,
        keep_workspace: bool,
    ) -> None:
        """Refuse what the runtime cannot do rather than start a sandbox that silently lacks
        it: a limit it does not enforce, egress it cannot give, a workspace it cannot keep."""
        feats = self.features(name)
        loose = sorted(k for k in requested if k in RESOURCE_NAMES and k not in feats.enforces)
        if loose:
            held = ", ".join(sorted(feats.enforces)) or "none"
            raise InvalidRequest(
                f"the {name} runtime does not enforce {', '.join(loose)} on this host (it "
                f"enforces: {held}); leave them out or use another runtime",
                setting="resources",
            )
        if wants_network and not feats.network:
            raise InvalidRequest(
                f"the {name} runtime cannot give a sandbox network access; create it without "
                "a network policy, or use another runtime",
                setting="network",
            )
        if keep_workspace and not feats.kept_workspaces:
            raise InvalidRequest(
                f"the {name} runtime cannot keep a workspace after the sandbox ends; create it "
                "without keep_workspace, or use another runtime",
                setting="keep_workspace",
            )

    def info(self) -> dict[str, Any]:
        """Per runtime: its features and what it reports of this host (health)."""
        return {
            name: {
                "default": name == self.default,
                "features": self._features[name].to_dict(),
                **rt.capabilities(),
            }
            for name, rt in self._by_name.items()
        }

    def tiers(self) -> dict[str, dict[str, Any]]:
        """Per isolation tier: whether this server serves it, and if not, why. Probing the host
        for the tiers not served (binaries on PATH, kernel features) was most of a health
        check's cost, so the answer is kept for TIERS_TTL_S: a tier installed meanwhile shows
        within that."""
        now = time.monotonic()
        if self._tiers is None or now - self._tiers[0] > TIERS_TTL_S:
            self._tiers = (now, self._probe_tiers())
        return {tier: dict(row) for tier, row in self._tiers[1].items()}

    def _probe_tiers(self) -> dict[str, dict[str, Any]]:
        from agentbox import runtimes as registry

        out: dict[str, dict[str, Any]] = {}
        for tier in ISOLATION_RANKS:
            if tier in self._by_name:
                out[tier] = {"served": True, "default": tier == self.default}
                continue
            why = self.unavailable.get(tier)
            if why is None:
                try:
                    why = registry.factory(tier).unavailable()  # type: ignore[attr-defined]
                except (registry.UnknownRuntime, AttributeError):
                    why = "not installed"
                why = why or "available on this host, not served (agentbox serve --runtime)"
            out[tier] = {"served": False, "reason": why}
        return out

    async def close(self) -> None:
        for rt in self._by_name.values():
            await rt.close()
