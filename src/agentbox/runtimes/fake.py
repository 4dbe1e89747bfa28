"""A runtime that isolates nothing and runs nothing: for testing the control plane in
milliseconds.

Its "sandboxes" are records in memory; each has a stand-in agent on a Unix socket that answers
`ping` (so health checks pass) and refuses every other operation with `unsupported`. Every call
is logged (`calls`), failures can be injected per method (`fail`), and a sandbox can be made to
vanish (`vanish`) or its agent to fall silent (`silence`). One instance can outlive the
managers that use it, as the host outlives a restarted server: re-adoption is tested that way.

Not registered as an entry point: nothing can serve with it; tests construct it themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from agentbox.agent import protocol as P
from agentbox.runtimes.base import AgentAddress, Runtime, RuntimeError_, SandboxSpec


@dataclass
class FakeSandbox:
    spec: SandboxSpec
    socket_path: Path
    server: asyncio.AbstractServer | None = None
    alive: bool = True
    silent: bool = False
    requests: list[dict[str, Any]] = field(default_factory=list)


class FakeRuntime(Runtime):
    name: ClassVar[str] = "fake"

    def __init__(self, data_dir: Path | None = None, **_: Any) -> None:
        base = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp())
        self.socket_dir = base / "fake-runtime"
        self.socket_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.calls: list[tuple[str, str | None]] = []
        self._failures: dict[str, list[Exception]] = {}
        self._serial = itertools.count(1)

    # ------------------------------------------------------------------ test controls

    def fail(self, method: str, error: Exception | None = None, times: int = 1) -> None:
        """Make the next `times` calls of `method` raise `error` (a RuntimeError_ by default)."""
        error = error or RuntimeError_(f"injected failure of {method}")
        self._failures.setdefault(method, []).extend([error] * times)

    def vanish(self, sandbox_id: str) -> None:
        """The sandbox's processes die underneath the control plane."""
        box = self.sandboxes[sandbox_id]
        box.alive = False
        self._close_agent(box)

    def silence(self, sandbox_id: str, silent: bool = True) -> None:
        """The sandbox's agent stops (or starts again) answering."""
        self.sandboxes[sandbox_id].silent = silent

    def _record(self, method: str, sandbox_id: str | None = None) -> None:
        self.calls.append((method, sandbox_id))
        queued = self._failures.get(method)
        if queued:
            raise queued.pop(0)

    # ------------------------------------------------------------------ the contract

    async def create(self, spec: SandboxSpec) -> dict[str, Any]:
        self._record("create", spec.sandbox_id)
        if spec.sandbox_id in self.sandboxes:
            raise RuntimeError_(f"sandbox {spec.sandbox_id} exists already")
        box = FakeSandbox(spec, self.socket_dir / f"{next(self._serial)}.sock")
        self.sandboxes[spec.sandbox_id] = box
        await self._serve_agent(box)
        return {"socket": str(box.socket_path)}

    async def destroy(
        self, sandbox_id: str, state: dict[str, Any] | None, keep_workspace: bool
    ) -> None:
        self._record("destroy", sandbox_id)
        box = self.sandboxes.pop(sandbox_id, None)
        if box is not None:
            self._close_agent(box)

    async def is_alive(self, sandbox_id: str, state: dict[str, Any]) -> bool:
        self._record("is_alive", sandbox_id)
        box = self.sandboxes.get(sandbox_id)
        return box is not None and box.alive

    async def list_sandboxes(self) -> set[str]:
        self._record("list_sandboxes")
        return set(self.sandboxes)

    def agent_address(self, sandbox_id: str, state: dict[str, Any]) -> AgentAddress:
        return AgentAddress(Path(state["socket"]))

    def adopt(self, sandbox_id: str, state: dict[str, Any]) -> None:
        self._record("adopt", sandbox_id)
        box = self.sandboxes.get(sandbox_id)
        if box is not None and box.server is None and box.alive:
            # The server that served its agent is gone with the old event loop: serve anew.
            asyncio.get_running_loop().create_task(self._serve_agent(box))

    async def close(self) -> None:
        self._record("close")
        for box in self.sandboxes.values():
            self._close_agent(box)  # the sandboxes stay; a new manager re-adopts them

    # ------------------------------------------------------------------ the stand-in agent

    async def _serve_agent(self, box: FakeSandbox) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(box.socket_path)

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                kind, length = P.HEADER.unpack(await reader.readexactly(P.HEADER.size))
                P.check_header(kind, length)
                request = P.decode_json(await reader.readexactly(length))
                box.requests.append(request)
                if box.silent:
                    await asyncio.sleep(3600)
                if request.get("op") == "ping":
                    reply = {"ok": True, "version": P.VERSION}
                else:
                    reply = P.error(
                        "unsupported", f"the fake runtime's agent cannot {request.get('op')}"
                    )
                writer.write(P.encode_json(reply))
                await writer.drain()
            except (asyncio.IncompleteReadError, P.ProtocolError, ConnectionError):
                pass
            finally:
                writer.close()

        box.server = await asyncio.start_unix_server(serve, path=str(box.socket_path))

    @staticmethod
    def _close_agent(box: FakeSandbox) -> None:
        if box.server is not None:
            box.server.close()
            box.server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(box.socket_path)
