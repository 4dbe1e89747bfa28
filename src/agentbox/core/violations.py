"""Explain why a command failed when the sandbox stopped it: what, by which setting, what to do.

Agents recover far better when told why; this turns limit counters, signals and well-known
error lines into a structured violation `{code, setting, message}`.
"""

from __future__ import annotations

import re
import signal
from typing import Any

_STDERR_HINTS = (
    (
        ("Read-only file system",),
        "read_only_path",
        "path",
        "only /workspace and /tmp are writable in the sandbox; write there instead",
    ),
    (
        (
            "Network is unreachable",
            "Temporary failure in name resolution",
            "Could not resolve host",
            "Name or service not known",
            "No address associated with hostname",
        ),
        "network_disabled",
        "network",
        "the sandbox has no direct network access (only loopback): programs must go through "
        "the egress proxy named in HTTP_PROXY/HTTPS_PROXY (set in the environment), and the "
        "sandbox's network policy must allow the host (network.allow_out)",
    ),
    (
        ("No space left on device", "Disk quota exceeded"),
        "disk_limit",
        "resources.disk_mb",
        "the workspace filesystem is full; delete files or create the sandbox with a larger "
        "resources.disk_mb",
    ),
    (
        ("File too large", "File size limit exceeded"),
        "file_size_limit",
        "resources.file_size_mb",
        "a file exceeded the per-file size limit; raise resources.file_size_mb",
    ),
    (
        ("Resource temporarily unavailable", "retry: fork failed"),
        "pids_limit",
        "resources.pids",
        "the sandbox hit its process limit; run fewer processes at once or raise resources.pids",
    ),
)


def violation(code: str, setting: str, message: str) -> dict[str, str]:
    return {"code": code, "setting": setting, "message": message}


def network_blocked(blocked: list[dict[str, Any]]) -> dict[str, str]:
    """The violation for a command whose network attempts the egress proxy refused."""
    first = blocked[0]
    more = f" (and {len(blocked) - 1} more attempts)" if len(blocked) > 1 else ""
    return violation(
        "network_blocked",
        "network",
        f"the sandbox's egress proxy refused {first['host']}:{first['port']}{more}: "
        f"{first['message']}",
    )


def sandbox_ended(reason: str | None) -> dict[str, str]:
    """The violation for a command whose sandbox ended under it, by the sandbox's end_reason."""
    if reason == "memory_limit":
        return violation(
            "memory_limit",
            "resources.memory_mb",
            "the sandbox went over its memory limit and was ended with everything in it (a "
            "gVisor sandbox's kernel is one process to the host's OOM killer); use less memory "
            "or create the sandbox with a larger resources.memory_mb",
        )
    return violation(
        "sandbox_ended",
        "timeout",
        "the sandbox was killed or reached its timeout while the command ran; extend it "
        "with set_timeout or create a new one",
    )


def explain_kernel_death(before: dict[str, int], after: dict[str, int]) -> dict[str, str] | None:
    """The violation behind a code context's interpreter dying mid-cell, if a limit did it."""
    if after.get("oom_kill", 0) > before.get("oom_kill", 0):
        return violation(
            "memory_limit",
            "resources.memory_mb",
            "the sandbox ran out of memory and the kernel's OOM killer killed the code's "
            "interpreter (its state is lost: restart the context); use less memory or create "
            "the sandbox with a larger resources.memory_mb",
        )
    return None


def explain_command_end(
    end: dict[str, Any], before: dict[str, int], after: dict[str, int], timeout: float
) -> dict[str, str] | None:
    """The violation that best explains a command's end, or None if it ended on its own."""
    if end.get("timed_out"):
        return violation(
            "command_timeout",
            "timeout",
            f"the command ran longer than its timeout of {timeout:g} s and was "
            "killed with its whole process tree; pass a larger timeout (0 = none) "
            "or run it in the background",
        )
    code = end.get("exit_code")
    if after.get("oom_kill", 0) > before.get("oom_kill", 0) and code not in (0, None):
        return violation(
            "memory_limit",
            "resources.memory_mb",
            "the sandbox ran out of memory and the kernel killed a process; use "
            "less memory or create the sandbox with a larger resources.memory_mb",
        )
    if code == -signal.SIGXFSZ:
        return violation(
            "file_size_limit",
            "resources.file_size_mb",
            "a file exceeded the per-file size limit; raise resources.file_size_mb",
        )
    if after.get("pids_max", 0) > before.get("pids_max", 0):
        return violation(
            "pids_limit",
            "resources.pids",
            "the sandbox hit its process limit; run fewer processes at once or "
            "raise resources.pids",
        )
    if code in (0, None):
        return None
    tail = str(end.get("stderr_tail") or "")
    for needles, vcode, setting, message in _STDERR_HINTS:
        if any(n in tail for n in needles):
            if vcode == "disk_limit" and _tmp_filled(tail, end.get("full")):
                return violation("disk_limit", "resources.tmp_mb", _TMP_FULL)
            return violation(vcode, setting, message)
    return None


_TMP_FULL = (
    "/tmp is full (a tmpfs in memory, like /var/tmp and /dev/shm); remove files there, write "
    "large files to /workspace, or create the sandbox with a larger resources.tmp_mb"
)
# A path on an ENOSPC line: where it starts decides which filesystem filled up.
_PATH = re.compile(r"(?<![\w.~/-])(/tmp|/var/tmp|/dev/shm|/workspace)(?=[/'\"`:\s]|$)")


def _tmp_filled(tail: str, full: object) -> bool:
    """Whether /tmp (not the workspace) ran out of space: the error lines' paths say so, else
    which mounts the agent found full when the command ended (`full`). A tmpfs has no quota:
    "Disk quota exceeded" is always the workspace."""
    if "No space left on device" not in tail:
        return False
    seen = {
        m.group(1) != "/workspace"
        for line in tail.splitlines()
        if "No space left on device" in line
        for m in _PATH.finditer(line)
    }
    if len(seen) == 1:
        return seen.pop()
    mounts = set(full) if isinstance(full, list) else set()
    return bool(mounts) and "/workspace" not in mounts
