"""envd's Connect apps, by path prefix, each behind the envd token gate (connect.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp

from agentbox.server.e2b.connect import (
    FILESYSTEM_PATH,
    PROCESS_PATH,
    READ_MAX_BYTES,
    Authenticated,
)
from agentbox.server.e2b.filesystem import FilesystemService
from agentbox.server.e2b.process import ProcessService
from agentbox.server.e2b.wire.filesystem.filesystem_connect import FilesystemASGIApplication
from agentbox.server.e2b.wire.process.process_connect import ProcessASGIApplication
from agentbox.server.surfaces import Core

__all__ = ["PROCESS_PATH", "rpc_apps"]


def rpc_apps(core: Core, sandbox: Callable[[Core, Request], Any]) -> dict[str, ASGIApp]:
    """The Connect apps by path prefix, each behind the envd token check."""
    process = ProcessASGIApplication(ProcessService(core), read_max_bytes=READ_MAX_BYTES)
    filesystem = FilesystemASGIApplication(FilesystemService(core), read_max_bytes=READ_MAX_BYTES)
    return {
        PROCESS_PATH: Authenticated(core, process, sandbox),
        FILESYSTEM_PATH: Authenticated(core, filesystem, sandbox),
    }
