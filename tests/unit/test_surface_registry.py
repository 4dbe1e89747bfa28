"""The surfaces registry: the built-in /v1 API always first, surfaces found under the
`agentbox.surfaces` entry-point group (a distribution made here, on sys.path, not installed
into the venv) and surfaces registered in code."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbox.core.network import NetworkSettings
from agentbox.server import surfaces
from agentbox.server.routes import v1_surface

SURFACE_MODULE = "def surface(core):\n    raise AssertionError('not called by the registry')\n"


def _distribution(root: Path, entry_points: str) -> None:
    dist = root / "hello_surface-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-surface\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[agentbox.surfaces]\n{entry_points}\n")
    (root / "hello_surface_mod.py").write_text(SURFACE_MODULE)


def test_the_v1_surface_is_there_without_entry_points_and_first() -> None:
    found = surfaces.available()
    assert next(iter(found)) == "v1"
    assert found["v1"] is v1_surface


def test_a_surface_under_the_entry_point_group_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _distribution(tmp_path, "hello = hello_surface_mod:surface")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = surfaces.available()
    assert found["hello"].__module__ == "hello_surface_mod"
    assert next(iter(found)) == "v1"


def test_an_entry_point_cannot_replace_the_built_in_v1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _distribution(tmp_path, "v1 = hello_surface_mod:surface")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert surfaces.available()["v1"] is v1_surface


def test_a_surface_registered_in_code_is_found_until_unregistered() -> None:
    def hello(core: surfaces.Core) -> surfaces.SurfaceRoutes:
        raise AssertionError("not called by the registry")

    surfaces.register("hello-code", hello)
    try:
        assert surfaces.available()["hello-code"] is hello
        with pytest.raises(ValueError, match="already registered"):
            surfaces.register("hello-code", hello)
        with pytest.raises(ValueError, match="already registered"):
            surfaces.register("v1", hello)
    finally:
        surfaces.unregister("hello-code")
    assert "hello-code" not in surfaces.available()


def test_the_core_is_not_there_before_the_server_starts() -> None:
    core = surfaces.Core(NetworkSettings())
    with pytest.raises(RuntimeError, match="not started"):
        core.manager  # noqa: B018 - the property's refusal is the point
