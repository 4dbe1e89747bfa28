"""The one writer of sandbox states.

Every change of a sandbox's state goes through `SandboxStates`: it checks the move against the
transition table (core/states.py), writes it with a compare-and-set on the stored state (so two
racing writers cannot both win, and a sandbox that ended meanwhile stays ended), and tells every
subscriber (the dashboard and E2B's auto-resume will be ones). The store refuses a state written
any other way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentbox.core.states import INITIAL, SandboxState, allowed
from agentbox.store.db import SandboxRow, Store

log = logging.getLogger("agentbox.lifecycle")


@dataclass(frozen=True)
class StateChange:
    sandbox_id: str
    tenant: str
    old: SandboxState | None  # None: the sandbox was just created
    new: SandboxState
    reason: str | None  # the end reason, for an ended state
    at: float


Listener = Callable[[StateChange], None]


class InvalidTransition(Exception):
    """A move the transition table does not allow: a bug in the caller, never user input."""


class SandboxStates:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call `listener` after every change (in the writer's thread, so it must be quick and
        must not raise); returns the unsubscribe function."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def create(self, state: SandboxState, **values: Any) -> None:
        """Store a new sandbox in one of the initial states."""
        if state not in INITIAL:
            raise InvalidTransition(f"a sandbox cannot be created {state}")
        self.store.insert_sandbox(state=state.value, **values)
        self._tell(StateChange(values["sandbox_id"], values["tenant"], None, state, None,
                               time.time()))  # fmt: skip

    def move(
        self,
        sandbox_id: str,
        new: SandboxState,
        *,
        only_from: frozenset[SandboxState] | None = None,
        **values: Any,
    ) -> StateChange | None:
        """Move the sandbox to `new` (writing `values` with it) if its state allows it, and
        `only_from` (when given) contains its state. None when it does not: the sandbox ended
        or moved meanwhile, which a caller racing a kill or a timeout must expect.

        Raises InvalidTransition when no state could make the move (a caller's bug)."""
        if only_from is not None and not any(allowed(s, new) for s in only_from):
            raise InvalidTransition(f"no move from {sorted(only_from)} to {new}")
        while True:
            row = self.store.get_sandbox(sandbox_id)
            if row is None:
                return None
            old = SandboxState(row.state)
            if not allowed(old, new) or (only_from is not None and old not in only_from):
                return None
            if self.store.move_sandbox(sandbox_id, old.value, state=new.value, **values):
                change = StateChange(
                    sandbox_id, row.tenant, old, new, values.get("end_reason"), time.time()
                )
                self._tell(change)
                return change
            # Another writer moved it between the read and the write: look again.

    def _tell(self, change: StateChange) -> None:
        for listener in list(self._listeners):
            try:
                listener(change)
            except Exception:  # noqa: BLE001 - one bad subscriber must not stop a state change
                log.exception("a state listener failed on %s", change)

    @staticmethod
    def state_of(row: SandboxRow) -> SandboxState:
        return SandboxState(row.state)
