"""Commands in sandboxes: foreground and background runs, their output streams, stdin,
signals, and the audit record of every command's end (also of commands nobody follows).

A service of the core (see core/manager.py, the front object): it reaches sandboxes through the
core's agent access and keeps, per sandbox, what explains a command's end (limit counters
before it, violations found after it) and one watcher for the ends of its commands.
"""

from __future__ import annotations

import asyncio
import codecs
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from agentbox.agent.client import AgentClient, AgentOpError, AgentUnavailable, OutputChunk
from agentbox.core import violations
from agentbox.core.auth import Caller
from agentbox.core.errors import AgentboxError, InvalidRequest, SandboxNotRunning
from agentbox.core.requests import CommandRequest, check_envs
from agentbox.store.db import DETAIL_STRING_CHARS, SandboxRow
from agentbox.vocab import ErrorCode

if TYPE_CHECKING:
    from agentbox.core.manager import SandboxManager

# Commands per sandbox whose end the server waits for to audit it (background ones, and
# foreground ones their client left): all on one agent connection, but each costs memory.
MAX_WATCHED_COMMANDS = 1024
WATCH_RETRY_S = 1.0  # an agent that could not be reached is asked again this much later
ENDS_POLL_S = 2.0  # an agent without `exec.ended` is asked about each command this often
UNCLAIMED_ENDS = 256


@dataclass
class _Watched:
    """A command whose end will be audited: who started it, what, and when (monotonic)."""

    row: SandboxRow
    cmd: str
    caller: Caller | None
    started: float


@dataclass
class _CommandWatch:
    """One sandbox's commands awaiting their end, the task that waits for them all, and the
    number of the last end the agent reported (`exec.ended`)."""

    pending: dict[str, _Watched] = field(default_factory=dict)
    after: int = 0
    task: asyncio.Task[None] | None = None
    # Ends reported for commands not watched (yet): one that ends before the reply to its
    # start is read is reported before it is watched. Oldest first, bounded.
    unclaimed: dict[str, dict[str, Any]] = field(default_factory=dict)


class CommandService:
    def __init__(self, core: SandboxManager) -> None:
        self.core = core
        self.network = core.network
        self.audit = core.audit
        # (sandbox, command) -> limit counters, timeout and monotonic start of the command.
        self._baselines: dict[tuple[str, str], tuple[dict[str, int], float, float]] = {}
        # (sandbox, command) -> what explains its end: {"violation", "network_blocked"}.
        self._violations: dict[tuple[str, str], dict[str, Any]] = {}
        self.watchers: set[asyncio.Task] = set()
        self._command_watches: dict[str, _CommandWatch] = {}

    def forget(self, sandbox_id: str) -> None:
        """Drop what was kept about an ended sandbox's commands."""
        self._command_watches.pop(sandbox_id, None)
        for key in [k for k in self._baselines if k[0] == sandbox_id]:
            self._baselines.pop(key, None)
        for key in [k for k in self._violations if k[0] == sandbox_id]:
            self._violations.pop(key, None)

    async def stop(self) -> None:
        for t in list(self.watchers):
            t.cancel()
        await asyncio.gather(*self.watchers, return_exceptions=True)

    def _exec_spec(self, req: CommandRequest) -> dict[str, Any]:
        if not req.cmd.strip():
            raise InvalidRequest("cmd must not be empty")
        if "\0" in req.cmd:
            raise InvalidRequest("cmd contains a NUL byte")
        if req.timeout < 0:
            raise InvalidRequest("timeout must be >= 0 (0 = no timeout)")
        check_envs(req.envs)
        if req.user not in (None, "user", "root"):
            raise InvalidRequest(f'user must be "user" or "root", not {req.user!r}')
        spec: dict[str, Any] = {
            "cmd": req.cmd,
            "cwd": req.cwd,
            "envs": req.envs,
            "timeout": req.timeout,
            "stdin": req.stdin,
        }
        if req.pty is not None:
            spec["pty"] = _terminal(*req.pty)
        return spec if req.user is None else {**spec, "user": req.user}

    async def start_command(
        self, caller: Caller, sandbox_id: str, req: CommandRequest
    ) -> dict[str, Any]:
        """Start a background command; an audit watcher records how it ends."""
        spec = self._exec_spec(req)
        started = time.monotonic()
        row = await self.core.awake(caller, sandbox_id)
        self._check_watch_room(sandbox_id)
        baseline = self.core.limit_counters(sandbox_id)
        try:
            info = await self.core.client(row).start_command(**spec)
        except (AgentOpError, AgentUnavailable) as e:
            raise self.core.failed(caller, row, "command.run", started, e, cmd=req.cmd) from None
        self._baselines[(sandbox_id, info["cmd_id"])] = (baseline, req.timeout, started)
        self.watch(row, info["cmd_id"], req.cmd, caller, started)
        return info

    async def run_command(
        self, caller: Caller, sandbox_id: str, req: CommandRequest
    ) -> tuple[dict[str, Any], AsyncIterator[dict[str, Any]]]:
        """Start a foreground command; its events stream on the same agent connection."""
        spec = self._exec_spec(req)
        started = time.monotonic()
        row = await self.core.awake(caller, sandbox_id)
        self._check_watch_room(sandbox_id)  # its client may leave before the end
        baseline = self.core.limit_counters(sandbox_id)
        try:
            info, stream = await self.core.client(row).run_command(**spec)
        except (AgentOpError, AgentUnavailable) as e:
            raise self.core.failed(caller, row, "command.run", started, e, cmd=req.cmd) from None
        cmd_id = info["cmd_id"]
        self._baselines[(sandbox_id, cmd_id)] = (baseline, req.timeout, started)

        def ended(end: dict[str, Any] | None) -> None:
            if end is None:  # the client left before the end: audit when it does end
                self.watch(row, cmd_id, req.cmd, caller, started, verify=True)
            else:
                self._audit_command(caller, row, cmd_id, req.cmd, started, end)

        return info, self._event_stream(row, cmd_id, stream, ended)

    def _audit_command(
        self,
        caller: Caller | None,
        row: SandboxRow,
        cmd_id: str,
        cmd: str,
        started: float,
        end: dict[str, Any],
    ) -> None:
        self.audit(
            caller,
            "command.run",
            row.sandbox_id,
            started=started,
            tenant=row.tenant,
            cmd=cmd,
            cmd_id=cmd_id,
            exit_code=end.get("exit_code"),
            timed_out=end.get("timed_out"),
            violation=(end.get("violation") or {}).get("code"),
        )

    def _check_watch_room(self, sandbox_id: str) -> None:
        w = self._command_watches.get(sandbox_id)
        if w is not None and len(w.pending) >= MAX_WATCHED_COMMANDS:
            raise AgentboxError(
                f"sandbox {sandbox_id} has {MAX_WATCHED_COMMANDS} commands running in the "
                "background (or left running by their clients), the most the server follows "
                "per sandbox; wait for some to end or kill them, then retry",
                code=ErrorCode.TOO_MANY_COMMANDS,
                limit=MAX_WATCHED_COMMANDS,
            )

    def watch(
        self,
        row: SandboxRow,
        cmd_id: str,
        cmd: str,
        caller: Caller | None,
        started: float,
        verify: bool = False,
    ) -> None:
        """Audit the command when it ends, whoever (if anyone) is streaming its output.

        A sandbox's commands are all awaited on one agent connection (`_watch_ends`): the
        server's descriptors do not grow with the commands a sandbox keeps running. `verify`:
        the command may have ended unseen already (its client left the stream), ask once."""
        w = self._command_watches.setdefault(row.sandbox_id, _CommandWatch())
        t0 = started or time.monotonic()  # 0: found running after a restart
        w.pending[cmd_id] = _Watched(row, cmd[:DETAIL_STRING_CHARS], caller, t0)
        end = w.unclaimed.pop(cmd_id, None)
        if end is not None:  # a quick command: its end came before its start's reply
            self._ended(w, cmd_id, end)
            return
        if w.task is None or w.task.done():
            w.task = self._background(self._watch_ends(row, w))
        if verify:
            self._background(self._poll_ends(self.core.client(row, tracked=False), w, [cmd_id]))

    def rewatch(self, row: SandboxRow) -> None:
        """After a resume: watch again the commands whose ends were awaited when the sandbox
        paused (the watch stops when it stops running)."""
        w = self._command_watches.get(row.sandbox_id)
        if w is not None and w.pending and (w.task is None or w.task.done()):
            for cmd_id, watched in list(w.pending.items()):
                w.pending[cmd_id] = replace(watched, row=row)
            w.task = self._background(self._watch_ends(row, w))

    def _background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self.watchers.add(task)
        task.add_done_callback(self.watchers.discard)
        return task

    async def _watch_ends(self, row: SandboxRow, w: _CommandWatch) -> None:
        """Audit the sandbox's watched commands as the agent reports their ends, until none
        is left or the sandbox is gone."""
        client = self.core.client(row, tracked=False)
        while w.pending:
            try:
                reply = await client.ended_commands(w.after)
            except AgentOpError as e:
                if e.code == "invalid_request":  # an agent from before exec.ended
                    await self._poll_ends(client, w, list(w.pending), ENDS_POLL_S)
                    continue
                reply = {}  # at its process limit, say: ask again in a while
            except AgentUnavailable:
                reply = {}
            seq, ends = reply.get("seq"), reply.get("ends")
            if not isinstance(seq, int) or not isinstance(ends, list):
                table = self.core.table
                if row.sandbox_id not in table.running or row.sandbox_id in table.ending:
                    break
                # A wedged or broken agent (the health check decides) may not make us spin.
                await asyncio.sleep(WATCH_RETRY_S)
                continue
            w.after = seq
            audited = sum(
                self._ended(w, str(end.get("cmd_id")), end) for end in ends if isinstance(end, dict)
            )
            if reply.get("complete") is not True:  # some ends were dropped meanwhile
                await self._poll_ends(client, w, list(w.pending))
            if not audited:
                await asyncio.sleep(0.05)  # only others' ends: a lying agent may not spin us
        if w.pending and self._command_watches.get(row.sandbox_id) is w:
            del self._command_watches[row.sandbox_id]  # the sandbox is gone, and its commands

    async def _poll_ends(
        self, client: AgentClient, w: _CommandWatch, cmd_ids: Sequence[str], wait: float = 0
    ) -> None:
        """Ask the agent about each of these commands (one connection at a time)."""
        await asyncio.sleep(wait)
        for cmd_id in cmd_ids:
            try:
                info = await client.command_info(cmd_id)
            except AgentOpError:
                w.pending.pop(cmd_id, None)  # gone from the agent's memory: nothing to audit
                continue
            except (AgentUnavailable, KeyError, TypeError):
                return
            if isinstance(info, dict) and info.get("running") is False and cmd_id in w.pending:
                code = info.get("exit_code")
                signal = -code if isinstance(code, int) and code < 0 else None
                self._ended(w, cmd_id, {**info, "type": "end", "signal": signal})

    def _ended(self, w: _CommandWatch, cmd_id: str, end: dict[str, Any]) -> bool:
        """Audit a watched command's end; False if it is not watched (yet: kept a while)."""
        watched = w.pending.pop(cmd_id, None)
        if watched is None:
            tail = str(end.get("stderr_tail") or "")[-1024:]  # enough for the hints it holds
            w.unclaimed[cmd_id] = {**end, "stderr_tail": tail}
            while len(w.unclaimed) > UNCLAIMED_ENDS:
                w.unclaimed.pop(next(iter(w.unclaimed)))
            return False
        row = watched.row
        final = self.finish(row.sandbox_id, cmd_id, end)
        self._audit_command(watched.caller, row, cmd_id, watched.cmd, watched.started, final)
        return True

    def finish(self, sandbox_id: str, cmd_id: str, end: dict[str, Any]) -> dict[str, Any]:
        """Turn the agent's end event into the API's, with the violation that explains it."""
        key = (sandbox_id, cmd_id)
        if key not in self._violations:
            baseline, timeout, started = self._baselines.pop(key, ({}, 0.0, None))
            after = self.core.limit_counters(sandbox_id) if baseline else {}
            blocked = self.network.proxy.denials_since(sandbox_id, started) if started else []
            found = violations.explain_command_end(end, baseline, after, timeout)
            if blocked and (found is None or found["code"] == "network_disabled"):
                if end.get("exit_code") not in (0, None) or found is not None:
                    found = violations.network_blocked(blocked)
            self._violations[key] = {"violation": found, "network_blocked": blocked}
            if len(self._violations) > 10_000:
                self._violations.pop(next(iter(self._violations)))
        return {
            "type": "end",
            "exit_code": end.get("exit_code"),
            "timed_out": bool(end.get("timed_out")),
            "killed": bool(end.get("killed")),
            "signal": end.get("signal"),
            **self._violations[key],
        }

    async def command_events(
        self, caller: Caller, sandbox_id: str, cmd_id: str, offset: int = 0
    ) -> AsyncIterator[dict[str, Any]]:
        """API events for a command from `offset`: output as text, then `end`."""
        row = await self.core.awake(caller, sandbox_id)
        try:
            stream = await self.core.client(row).command_events(cmd_id, offset)
        except (AgentOpError, AgentUnavailable) as e:
            raise self.core.agent_error(row, e) from None
        return self._event_stream(row, cmd_id, stream, None)

    async def _event_stream(
        self,
        row: SandboxRow,
        cmd_id: str,
        stream: AsyncIterator[Any],
        ended: Callable[[dict[str, Any] | None], None] | None,
    ) -> AsyncIterator[dict[str, Any]]:
        decoders = {
            "stdout": codecs.getincrementaldecoder("utf-8")("replace"),
            "stderr": codecs.getincrementaldecoder("utf-8")("replace"),
        }
        end: dict[str, Any] | None = None
        try:
            async for item in stream:
                if isinstance(item, OutputChunk):
                    text = decoders[item.stream].decode(item.data)
                    if text:
                        yield {"type": item.stream, "data": text, "offset": item.offset}
                elif item.get("type") == "truncated":
                    yield _truncated_event(item)
                elif item.get("type") == "end":
                    for name, dec in decoders.items():
                        tail = dec.decode(b"", final=True)
                        if tail:
                            yield {"type": name, "data": tail, "offset": -1}
                    end = self.finish(row.sandbox_id, cmd_id, item)
                    yield end
                    return
        except (AgentOpError, AgentUnavailable) as e:
            err = self.core.agent_error(row, e)
            if isinstance(err, SandboxNotRunning):
                yield {
                    "type": "end",
                    "exit_code": None,
                    "timed_out": False,
                    "killed": True,
                    "signal": None,
                    "violation": violations.sandbox_ended(err.detail.get("reason")),
                }
            else:
                yield {"type": "error", "code": err.code, "message": err.message}
        finally:
            if ended is not None:
                ended(end)

    async def list(self, caller: Caller, sandbox_id: str) -> list[dict[str, Any]]:
        """The sandbox's commands (running ones and the last finished), as the agent holds."""
        return await self.core.agent_do(
            caller, sandbox_id, "command.list", lambda c: c.list_commands()
        )

    async def info(self, caller: Caller, sandbox_id: str, cmd_id: str) -> dict[str, Any]:
        return await self.core.agent_do(
            caller, sandbox_id, "command.info", lambda c: c.command_info(cmd_id), cmd_id=cmd_id
        )

    async def command_stdin(
        self, caller: Caller, sandbox_id: str, cmd_id: str, data: str, eof: bool
    ) -> None:
        await self.core.agent_do(
            caller,
            sandbox_id,
            "command.stdin",
            lambda c: c.send_stdin(cmd_id, data, eof),
            cmd_id=cmd_id,
            size=len(data),
            eof=eof,
        )

    async def command_resize(
        self, caller: Caller, sandbox_id: str, cmd_id: str, cols: int, rows: int
    ) -> None:
        """A terminal command's new size."""
        size = _terminal(cols, rows)
        await self.core.agent_do(
            caller,
            sandbox_id,
            "command.resize",
            lambda c: c.resize_terminal(cmd_id, size["cols"], size["rows"]),
            cmd_id=cmd_id,
            **size,
        )

    async def command_kill(self, caller: Caller, sandbox_id: str, cmd_id: str, sig: int) -> None:
        await self.core.agent_do(
            caller,
            sandbox_id,
            "command.kill",
            lambda c: c.kill_command(cmd_id, sig),
            cmd_id=cmd_id,
            signal=sig,
        )


MAX_TERMINAL_SIDE = 4096  # columns or rows of a command's terminal


def _terminal(cols: int, rows: int) -> dict[str, int]:
    for name, n in (("cols", cols), ("rows", rows)):
        if not 1 <= n <= MAX_TERMINAL_SIDE:
            raise InvalidRequest(f"a terminal's {name} must be 1 to {MAX_TERMINAL_SIDE}, not {n}")
    return {"cols": cols, "rows": rows}


def _truncated_event(item: dict[str, Any]) -> dict[str, Any]:
    """The agent's note that output nobody read was dropped, said for whoever reads now."""
    dropped, offset = int(item.get("dropped", 0)), int(item.get("offset", 0))
    cap, budget = int(item.get("command_cap", 0)), int(item.get("sandbox_budget", 0))
    return {
        "type": "truncated",
        "offset": offset,
        "dropped": dropped,
        "message": (
            f"{dropped} bytes of this command's output, from byte {offset}, were dropped: "
            f"nobody was reading it, and a sandbox keeps at most {cap >> 20} MiB of unread "
            f"output per command and {budget >> 20} MiB in all; follow the output as it "
            "comes (on_stdout, or the command's stream), or send it to a file"
        ),
    }
