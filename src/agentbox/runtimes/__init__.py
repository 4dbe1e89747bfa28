"""Isolation backends behind one contract (`base.Runtime`), found by name.

Every runtime, the built-in `process` one included, is a plug-in registered under the
`agentbox.runtimes` entry-point group (see pyproject.toml): adding one is a module and an entry
point, with no edit here or in the core. Tests and embedders can `register` one in code, which
feeds the same lookup.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from agentbox.runtimes.base import Runtime

GROUP = "agentbox.runtimes"

Factory = Callable[..., Runtime]

_registered: dict[str, Factory] = {}


class UnknownRuntime(ValueError):
    """No runtime of that name is installed."""


def register(name: str, factory: Factory) -> None:
    """Add a runtime in code (tests, embedders), as an entry point would."""
    if name in _registered:
        raise ValueError(f"a runtime named {name!r} is already registered")
    _registered[name] = factory


def unregister(name: str) -> None:
    _registered.pop(name, None)


@functools.cache
def _entry_points() -> dict[str, Any]:
    # Read once per process: a scan of every installed distribution costs ~25 ms, and health
    # (unauthenticated) asks for each tier this server does not serve. A runtime installed
    # later is found by the next start, as it is loaded then anyway.
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def available() -> list[str]:
    """Names of every runtime this installation has (whether or not it works on this host)."""
    return sorted({*_entry_points(), *_registered})


def factory(name: str) -> Factory:
    if name in _registered:
        return _registered[name]
    ep = _entry_points().get(name)
    if ep is None:
        have = ", ".join(available()) or "none (is agentbox installed? its entry points are)"
        raise UnknownRuntime(f"unknown runtime {name!r}; installed: {have}")
    loaded: Factory = ep.load()
    return loaded


def get_runtime(name: str, **config: Any) -> Runtime:
    """A new instance of the runtime `name`; `config` goes to its constructor."""
    return factory(name)(**config)
