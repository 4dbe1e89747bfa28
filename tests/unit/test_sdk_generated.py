"""The sync SDK is generated from the async one, and the two faces offer the same API."""

from __future__ import annotations

import inspect
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import agentbox.sdk as sdk
from agentbox.sdk import async_sandbox, audit, keys, sandbox

ROOT = Path(__file__).resolve().parents[2]
# Dunder methods named differently in the two faces.
SYNC_NAME = {"__aiter__": "__iter__", "__aenter__": "__enter__", "__aexit__": "__exit__"}


def _unasync(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "unasync.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_committed_sync_sdk_is_what_unasync_generates() -> None:
    done = _unasync(ROOT, "--check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_check_fails_and_shows_the_difference_when_the_sync_sdk_was_edited(
    tmp_path: Path,
) -> None:
    # A copy of the parts the script reads, so the repository's own files stay untouched.
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copytree(ROOT / "src" / "agentbox" / "sdk", tmp_path / "src" / "agentbox" / "sdk")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "src" / "agentbox" / "sdk" / "sandbox.py"
    target.write_text(
        target.read_text().replace(
            "def rotate_access_token(self) -> str:", "def rotate_access_token(self):"
        )
    )

    done = _unasync(tmp_path, "--check")
    assert done.returncode == 1
    assert "+    def rotate_access_token(self) -> str:" in done.stdout
    assert "is out of date" in done.stderr

    assert _unasync(tmp_path).returncode == 0  # regenerating repairs it
    assert _unasync(tmp_path, "--check").returncode == 0


def test_generated_file_says_so() -> None:
    head = (ROOT / "src" / "agentbox" / "sdk" / "sandbox.py").read_text().splitlines()[0]
    assert head.startswith("# Generated from async_sandbox.py by scripts/unasync.py")


def _classes(module: Any) -> dict[str, type]:
    return {
        name: cls
        for name, cls in vars(module).items()
        if inspect.isclass(cls) and cls.__module__ == module.__name__
    }


def _members(cls: type) -> dict[str, Any]:
    public = {n: v for n, v in vars(cls).items() if not n.startswith("_") or n.endswith("__")}
    return {SYNC_NAME.get(n, n): v for n, v in public.items() if n not in ("__doc__", "__module__")}


def _shape(member: Any) -> tuple[str, list[tuple[str, Any, Any]] | None]:
    """What kind of member it is and its parameters (name, kind, default)."""
    if isinstance(member, property):
        return "property", None
    kind = type(member).__name__
    function = member.__func__ if isinstance(member, classmethod | staticmethod) else member
    if not callable(function):
        return kind, None
    params = inspect.signature(function).parameters.values()
    return kind, [(p.name, p.kind, p.default) for p in params]


def test_every_sync_class_has_an_async_twin_and_back() -> None:
    sync_names = set(_classes(sandbox))
    async_names = {name.removeprefix("Async") for name in _classes(async_sandbox)}
    assert sync_names == async_names
    assert {"Sandbox", "Templates", "Secrets", "Workspaces", "CommandHandle"} <= sync_names


def test_twins_have_the_same_methods_with_the_same_parameters() -> None:
    async_classes = _classes(async_sandbox)
    for name, sync_cls in _classes(sandbox).items():
        sync_members = _members(sync_cls)
        async_members = _members(async_classes["Async" + name])
        assert set(sync_members) == set(async_members), name
        for member, value in sync_members.items():
            assert _shape(value) == _shape(async_members[member]), f"{name}.{member}"


def test_the_async_face_awaits_exactly_where_the_sync_face_does_io() -> None:
    # A method that blocks in the sync face must be awaitable (or async-iterable) in the other.
    async_classes = _classes(async_sandbox)
    for name, sync_cls in _classes(sandbox).items():
        twin = async_classes["Async" + name]
        for member, value in _members(twin).items():
            function = value.__func__ if isinstance(value, classmethod) else value
            if not inspect.isfunction(function):
                continue
            is_async = inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function)
            sync_function = _members(sync_cls)[member]
            sync_function = getattr(sync_function, "__func__", sync_function)
            assert not inspect.iscoroutinefunction(sync_function), f"{name}.{member}"
            pure = member in ("__init__", "__repr__", "get_host")
            assert is_async != pure, f"Async{name}.{member}"


def test_both_faces_are_exported_together() -> None:
    exported = set(sdk.__all__)
    for name in _classes(async_sandbox):
        if name.removeprefix("Async") in exported:
            assert name in exported, name
    for name in _classes(sandbox):
        if "Async" + name in exported:
            assert name in exported, name
    assert {"AsyncTemplates", "AsyncSecrets", "AsyncWorkspaces"} <= exported


def test_key_and_audit_helpers_come_in_both_faces() -> None:
    for module in (keys, audit):
        functions = {
            n: f
            for n, f in vars(module).items()
            if inspect.isfunction(f) and f.__module__ == module.__name__ and not n.startswith("_")
        }
        sync = {n: f for n, f in functions.items() if not inspect.iscoroutinefunction(f)}
        assert {n for n in functions if n not in sync} == {"a" + n for n in sync}
        for n, f in sync.items():
            assert _shape(f) == _shape(functions["a" + n]), n
