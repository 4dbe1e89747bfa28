"""The code interpreter: running code in a sandbox's kernels, and managing its contexts.

A service of the core (see core/manager.py, the front object).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from agentbox.agent.client import AgentOpError, AgentUnavailable
from agentbox.core import violations
from agentbox.core.auth import Caller
from agentbox.core.errors import InvalidRequest, from_agent
from agentbox.core.requests import LANGUAGES, CodeRequest, check_envs, code_result
from agentbox.store.db import SandboxRow

if TYPE_CHECKING:
    from agentbox.core.manager import SandboxManager


class CodeService:
    def __init__(self, core: SandboxManager) -> None:
        self.core = core
        self.audit = core.audit

    async def run_code(
        self, caller: Caller, sandbox_id: str, req: CodeRequest
    ) -> AsyncIterator[dict[str, Any]]:
        """Run code in a context; events: stdout, stderr, result, error, execution_count, end."""
        if "\0" in req.code:
            raise InvalidRequest("code contains a NUL byte")
        if req.language is not None and req.language not in LANGUAGES:
            raise InvalidRequest(
                f"unsupported language {req.language!r}; use one of {', '.join(LANGUAGES)}"
            )
        if req.language is not None and req.context_id is not None:
            raise InvalidRequest("give either language or context_id, not both")
        if req.timeout is not None and req.timeout < 0:
            raise InvalidRequest("timeout must be >= 0 (0 = no timeout)")
        check_envs(req.envs)
        spec: dict[str, Any] = {"code": req.code, "envs": req.envs}
        if req.context_id is not None:
            spec["context_id"] = req.context_id
        else:
            spec["language"] = req.language or "python"
        if req.timeout:
            spec["timeout"] = req.timeout
        started = time.monotonic()
        row = await self.core.awake(caller, sandbox_id)
        detail = {"language": req.language, "context_id": req.context_id, "size": len(req.code)}
        # What the memory limit had killed before the cell: a kernel death beyond it is an OOM.
        baseline = self.core.limit_counters(row.sandbox_id)
        try:
            events = await self.core.client(row).execute_code(**spec)
        except (AgentOpError, AgentUnavailable) as e:
            raise self.core.failed(caller, row, "code.run", started, e, **detail) from None
        return self._code_events(caller, row, events, started, detail, baseline)

    async def _code_events(
        self,
        caller: Caller,
        row: SandboxRow,
        events: AsyncIterator[dict[str, Any]],
        started: float,
        detail: dict[str, Any],
        baseline: dict[str, int],
    ) -> AsyncIterator[dict[str, Any]]:
        error_name: str | None = None
        end: dict[str, Any] | None = None
        died: dict[str, Any] | None = None  # {"violation": ...} once the kernel died

        def death() -> dict[str, Any]:
            nonlocal died
            if died is None:
                after = self.core.limit_counters(row.sandbox_id)
                found = violations.explain_kernel_death(baseline, after)
                died = {"violation": found} if found else {}
            return died

        try:
            async for ev in events:
                kind = ev.get("type")
                if kind in ("stdout", "stderr"):
                    yield {
                        "type": kind,
                        "text": str(ev.get("text", "")),
                        "timestamp": ev.get("timestamp"),
                    }
                elif kind == "result" and isinstance(ev.get("result"), dict):
                    yield {"type": "result", "result": code_result(ev["result"])}
                elif kind == "error" and isinstance(ev.get("error"), dict):
                    err = ev["error"]
                    error_name = str(err.get("name", ""))
                    yield {
                        "type": "error",
                        "error": {
                            "name": error_name,
                            "value": str(err.get("value", "")),
                            "traceback": str(err.get("traceback", "")),
                        },
                        **(death() if error_name == "KernelDied" else {}),
                    }
                elif kind == "execution_count":
                    yield {"type": "execution_count", "execution_count": ev.get("execution_count")}
                elif kind == "done":
                    end = {
                        "type": "end",
                        "execution_count": ev.get("execution_count"),
                        "timed_out": bool(ev.get("timed_out")),
                    }
                    yield end
                elif kind == "failed":
                    err = from_agent(str(ev.get("code")), str(ev.get("message", "")), {})
                    error_name = err.code
                    end = {"type": "end", "execution_count": None, "timed_out": False}
                    why = death() if err.code == "kernel_dead" else {}
                    yield {"type": "failed", "code": err.code, "message": err.message, **why}
        except (AgentOpError, AgentUnavailable) as e:
            err = self.core.agent_error(row, e)
            error_name = err.code
            yield {"type": "failed", "code": err.code, "message": err.message}
        finally:
            self.audit(
                caller,
                "code.run",
                row.sandbox_id,
                started=started,
                error=error_name,
                timed_out=(end or {}).get("timed_out"),
                completed=end is not None,
                **detail,
            )

    async def code_call(
        self, caller: Caller, sandbox_id: str, call: str, action: str, **args: Any
    ) -> dict[str, Any]:
        """Context management: create_context, list_contexts, restart_context, remove_context."""
        if "language" in args and args["language"] not in LANGUAGES:
            raise InvalidRequest(
                f"unsupported language {args['language']!r}; use one of {', '.join(LANGUAGES)}"
            )
        return await self.core.agent_do(
            caller, sandbox_id, action, lambda c: c.code_call(call, **args), **args
        )
