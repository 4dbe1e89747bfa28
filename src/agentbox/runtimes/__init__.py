"""Isolation backends behind one contract (`base.Runtime`), found by name.

Built-in runtimes are listed here; third-party ones register under the `agentbox.runtimes`
entry-point group. The embedded default, `process`, needs only bubblewrap.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from agentbox.runtimes.base import Runtime

_BUILTIN = {"process": "agentbox.runtimes.process.runtime:ProcessRuntime"}


def get_runtime(name: str, **config: Any) -> Runtime:
    target = _BUILTIN.get(name)
    if target is None:
        for ep in entry_points(group="agentbox.runtimes"):
            if ep.name == name:
                return ep.load()(**config)
        raise ValueError(f"unknown runtime {name!r}; available: {', '.join(_BUILTIN)}")
    module, _, cls = target.partition(":")
    return getattr(__import__(module, fromlist=[cls]), cls)(**config)
