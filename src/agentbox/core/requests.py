"""What callers ask of the core: requests for sandboxes, commands and code, and the checks on
their parts that more than one service makes. No I/O here."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from agentbox.core.errors import InvalidRequest
from agentbox.vocab import LANGUAGES as LANGUAGES  # re-exported: its users import it from here

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class CreateRequest:
    template: str | None = None  # None: the server's default (`--default-template`)
    timeout: float = 300
    metadata: dict[str, str] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=dict)
    keep_workspace: bool = False
    network: dict[str, Any] | None = None  # None: the tenant's default (else no egress)
    secrets: list[str] = field(default_factory=list)
    runtime: str | None = None  # None: the tenant's default, else the server's
    # {"on_timeout": "kill" | "pause", "auto_resume": bool} (E2B's names); None: kill, no wake
    lifecycle: dict[str, Any] | None = None
    # {path in the sandbox: volume name or id, or {"volume": ..., "read_only": bool}}
    volume_mounts: dict[str, Any] | None = None


@dataclass
class CodeRequest:
    code: str
    language: str | None = None
    context_id: str | None = None
    envs: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None


@dataclass
class CommandRequest:
    cmd: str
    cwd: str | None = None
    user: str | None = None  # "user" or "root"; None: the sandbox's default
    envs: dict[str, str] = field(default_factory=dict)
    timeout: float = 60
    background: bool = False
    stdin: bool = False
    pty: tuple[int, int] | None = None  # a terminal of its own: (cols, rows)


# A code result's fields (docs/API.md, "Code interpreter"): strings, or any JSON value.
_RESULT_STRINGS = ("text", "html", "markdown", "svg", "png", "jpeg", "pdf", "latex", "javascript")
_RESULT_VALUES = ("json", "data", "chart")


def code_result(raw: dict[str, Any]) -> dict[str, Any]:
    """A result event from the agent (untrusted) with only the documented fields and types."""
    out: dict[str, Any] = {k: raw[k] for k in _RESULT_STRINGS if isinstance(raw.get(k), str)}
    out.update((k, raw[k]) for k in _RESULT_VALUES if raw.get(k) is not None)
    if isinstance(raw.get("extra"), dict) and raw["extra"]:
        out["extra"] = raw["extra"]
    out["is_main_result"] = raw.get("is_main_result") is True
    return out


def check_envs(envs: dict[str, str]) -> None:
    for k, v in envs.items():
        if not ENV_NAME.fullmatch(k):  # fullmatch: `$` would also accept a trailing newline
            raise InvalidRequest(f"invalid environment variable name {k!r}")
        if "\0" in v:
            raise InvalidRequest(f"environment variable {k} contains a NUL byte")


def check_metadata(meta: dict[str, str]) -> None:
    if len(meta) > 64:
        raise InvalidRequest("metadata may hold at most 64 keys")
    for k, v in meta.items():
        if not k or len(k) > 128 or len(v) > 1024:
            raise InvalidRequest("metadata keys must be 1-128 characters and values at most 1024")


_OBJECT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_object_name(kind: str, name: str, id_prefix: str) -> None:
    """A name a tenant gives a snapshot or volume: 1-64 safe characters, never one that looks
    like an id of its kind (`id_prefix`), which is looked up first."""
    if not _OBJECT_NAME.fullmatch(name) or name.startswith(id_prefix):
        raise InvalidRequest(
            f"{kind} name {name!r}: 1-64 letters, digits, '.', '_' or '-', starting with a "
            f"letter or digit, and not starting with {id_prefix!r}",
            setting="name",
        )
