"""A sandbox's states and the moves between them: the one place they are written down.

    (create) ──> building ──> starting ──> running <──> paused
                    │            │  ▲         │           │
                    │            │  └─────────┼───────────┤ (resumed without memory)
                    └────────────┴────────────┴───────────┴──> killed | failed | expired
                                                                     (ended: final)

`building` waits for the first-use build of its template; `starting` is the runtime bringing it
up; `running` serves. `paused`: its processes are frozen with their memory, its TTL clock stopped;
`resume` makes it `running` again with the time it had left (a paused sandbox whose retention
runs out ends `expired`, reason `paused_retention`). Paused without its memory, its processes
ended and only its disk kept, it is `starting` again while it resumes (booting fresh on that
disk), and `paused` again if that fails. Every ended state is final: a sandbox never
comes back. `unhealthy` is not a state: it is shown instead of `running` while the sandbox's agent
does not answer, and never stored.
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
LIVE = frozenset(
    {SandboxState.BUILDING, SandboxState.STARTING, SandboxState.RUNNING, SandboxState.PAUSED}
)
ENDED = frozenset({SandboxState.KILLED, SandboxState.FAILED, SandboxState.EXPIRED})

# Every allowed move; anything else is a bug in whoever asked.
TRANSITIONS: dict[SandboxState, frozenset[SandboxState]] = {
    SandboxState.BUILDING: frozenset({SandboxState.STARTING}) | ENDED,
    # starting -> paused: a resume without memory that could not start it again.
    SandboxState.STARTING: frozenset({SandboxState.RUNNING, SandboxState.PAUSED}) | ENDED,
    SandboxState.RUNNING: frozenset({SandboxState.PAUSED}) | ENDED,
    # paused -> starting: the resume of a sandbox paused without memory (it boots again).
    SandboxState.PAUSED: frozenset({SandboxState.RUNNING, SandboxState.STARTING}) | ENDED,
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
