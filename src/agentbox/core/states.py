"""A sandbox's states and the moves between them: the one place they are written down.

    (create) ──> building ──> starting ──> running
                    │            │            │
                    └────────────┴────────────┴──> killed | failed | expired   (ended: final)

`building` waits for the first-use build of its template; `starting` is the runtime bringing it
up; `running` serves. Every ended state is final: a sandbox never comes back (later issues add
`paused` beside `running`, with its own arrows, here). `unhealthy` is not a state: it is shown
instead of `running` while the sandbox's agent does not answer, and never stored.
"""

from __future__ import annotations

# The states themselves are shared with the SDK, so they are written down in agentbox.vocab.
from agentbox.vocab import LIVE_FILTER, UNHEALTHY, SandboxState

__all__ = [
    "SandboxState",
    "UNHEALTHY",
    "LIVE_FILTER",
    "INITIAL",
    "LIVE",
    "ENDED",
    "TRANSITIONS",
    "allowed",
]

# What a sandbox is first stored as.
INITIAL = frozenset({SandboxState.BUILDING, SandboxState.STARTING})
LIVE = frozenset({SandboxState.BUILDING, SandboxState.STARTING, SandboxState.RUNNING})
ENDED = frozenset({SandboxState.KILLED, SandboxState.FAILED, SandboxState.EXPIRED})

# Every allowed move; anything else is a bug in whoever asked.
TRANSITIONS: dict[SandboxState, frozenset[SandboxState]] = {
    SandboxState.BUILDING: frozenset({SandboxState.STARTING}) | ENDED,
    SandboxState.STARTING: frozenset({SandboxState.RUNNING}) | ENDED,
    SandboxState.RUNNING: ENDED,
    SandboxState.KILLED: frozenset(),
    SandboxState.FAILED: frozenset(),
    SandboxState.EXPIRED: frozenset(),
}


def allowed(old: str, new: str) -> bool:
    """Whether a sandbox may move from `old` to `new`."""
    try:
        return SandboxState(new) in TRANSITIONS[SandboxState(old)]
    except ValueError:
        return False
