"""E2B's code interpreter (`e2b-code-interpreter`), port 49999 of the sandbox surface: `POST
/execute` streams a cell's output as E2B's NDJSON lines, `/contexts` manages its contexts. Each
route is one call of agentbox's code interpreter (core/code.py), so the tenant check, limits and
audit are the native API's.

The credential is the sandbox's envd token: the SDK sends it as `X-Access-Token` on `/execute`
only, and as `E2B-Traffic-Access-Token` on every request when the sandbox has a traffic token,
which agentbox always issues (the same token, see common.created). E2B leaves a public sandbox's
contexts open to anyone who knows its id; agentbox does not.

E2B's SDK bounds an execution on the client side: at its timeout it drops the request. The
agent then interrupts the cell (code_host `cancel`), so the context's next cell runs promptly
and keeps the state it had.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from pydantic import Field

from agentbox.core.auth import Caller
from agentbox.core.errors import InvalidRequest, SandboxUnavailable
from agentbox.core.requests import LANGUAGES, CodeRequest
from agentbox.server.e2b.common import CODE_INTERPRETER_PORT, Body, E2BRoute, sandbox_home
from agentbox.server.streaming import ndjson
from agentbox.server.surfaces import Core

# E2B's language names beside agentbox's own.
ALIASES = {"js": "javascript", "sh": "bash", "ts": "typescript", "deno": "typescript"}
# E2B languages agentbox's code interpreter does not run: refused with what it does run.
MISSING = ("java",)
CODE_MAX = 1 << 20  # characters in one cell


class ExecuteBody(Body):
    code: Annotated[str, Field(max_length=CODE_MAX)]
    context_id: Annotated[str | None, Field(max_length=64)] = None
    language: Annotated[str | None, Field(max_length=32)] = None
    env_vars: dict[str, str] | None = None


class ContextBody(Body):
    language: Annotated[str | None, Field(max_length=32)] = None
    cwd: Annotated[str | None, Field(max_length=4096)] = None


def language(name: str | None) -> str | None:
    """agentbox's name for an E2B language (None: the default, python)."""
    if name is None or name == "":
        return None
    name = name.lower()
    name = ALIASES.get(name, name)
    if name not in LANGUAGES:
        also = " (agentbox has no kernel for it: none is packaged here)" if name in MISSING else ""
        raise InvalidRequest(
            f"unsupported language {name!r}{also}; use one of {', '.join(LANGUAGES)}"
        )
    return name


def context(raw: Any) -> dict[str, Any]:
    """E2B's `Context` from the agent's (untrusted) description of one."""
    if not isinstance(raw, dict) or not isinstance(raw.get("id"), str):
        raise SandboxUnavailable("the sandbox sent no context")
    return {"id": raw["id"], "language": str(raw.get("language")), "cwd": str(raw.get("cwd"))}


async def e2b_events(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """agentbox's code events as E2B's `/execute` lines."""
    errored = False
    try:
        async for ev in events:
            kind = ev.get("type")
            if kind in ("stdout", "stderr"):
                yield {"type": kind, "text": ev["text"], "timestamp": ev.get("timestamp")}
            elif kind == "result":
                yield {"type": "result", **ev["result"]}
            elif kind == "error":
                errored = True
                yield {"type": "error", **_explained(ev["error"], ev.get("violation"))}
            elif kind == "execution_count":
                yield {"type": "number_of_executions", "execution_count": ev["execution_count"]}
            elif kind == "end":
                yield {"type": "end_of_execution"}
            elif kind == "failed":  # the cell did not finish (its interpreter died, ...)
                if not errored:
                    error = {"name": ev["code"], "value": ev["message"], "traceback": ""}
                    yield {"type": "error", **_explained(error, ev.get("violation"))}
                yield {"type": "unexpected_end_of_execution"}
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def _explained(error: dict[str, Any], violation: dict[str, Any] | None) -> dict[str, Any]:
    """An error whose value also says which limit caused it (E2B's error has no such field)."""
    if not violation:
        return error
    value = f"{error['value']} [agentbox: {violation['message']} ({violation['setting']})]"
    return {**error, "value": value.strip(), "violation": violation}


def interpreter_routes(core: Core, sandbox: Callable[[Core, Request], Any]) -> APIRouter:
    r = APIRouter(route_class=E2BRoute, include_in_schema=False)

    def caller(request: Request) -> tuple[Caller, str]:
        box = sandbox(core, request)
        return box.caller(CODE_INTERPRETER_PORT), box.id

    @r.post("/execute")
    async def execute(body: ExecuteBody, request: Request) -> Response:
        who, sandbox_id = caller(request)
        if body.context_id and body.language:
            raise InvalidRequest("give either context_id or language, not both")
        req = CodeRequest(
            code=body.code,
            language=None if body.context_id else language(body.language),
            context_id=body.context_id or None,
            envs=body.env_vars or {},
        )
        events = await core.manager.run_code(who, sandbox_id, req)
        return ndjson(e2b_events(events))

    @r.post("/contexts")
    async def create_context(body: ContextBody, request: Request) -> dict[str, Any]:
        who, sandbox_id = caller(request)
        args: dict[str, Any] = {"language": language(body.language) or "python"}
        cwd = body.cwd or sandbox_home(core, sandbox_id)  # E2B's contexts start in its home
        if cwd:
            args["cwd"] = cwd
        reply = await core.manager.code_call(
            who, sandbox_id, "create_context", "code.context.create", **args
        )
        return context(reply.get("context"))

    @r.get("/contexts")
    async def list_contexts(request: Request) -> list[dict[str, Any]]:
        who, sandbox_id = caller(request)
        reply = await core.manager.code_call(who, sandbox_id, "list_contexts", "code.context.list")
        listed = reply.get("contexts")
        if not isinstance(listed, list):
            raise SandboxUnavailable("the sandbox sent no context list")
        return [context(c) for c in listed]

    @r.post("/contexts/{context_id}/restart", status_code=204)
    async def restart_context(context_id: str, request: Request) -> Response:
        who, sandbox_id = caller(request)
        await core.manager.code_call(
            who, sandbox_id, "restart_context", "code.context.restart", context_id=context_id
        )
        return Response(status_code=204)

    @r.delete("/contexts/{context_id}", status_code=204)
    async def remove_context(context_id: str, request: Request) -> Response:
        who, sandbox_id = caller(request)
        await core.manager.code_call(
            who, sandbox_id, "remove_context", "code.context.remove", context_id=context_id
        )
        return Response(status_code=204)

    return r
