"""Templates: list, look up, build (the build log streamed), remove."""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from fastapi import APIRouter, Response

from agentbox.core.errors import InvalidRequest, NotFound
from agentbox.server import models as m
from agentbox.server.routes.deps import RESPONSES, Admin, Mgr, Who
from agentbox.server.streaming import ndjson
from agentbox.templates import SpecError, builtin_spec_names, builtin_spec_path, load_spec


def router() -> APIRouter:
    r = APIRouter()

    @r.get("/v1/templates", response_model=m.TemplateList, responses=RESPONSES, tags=["templates"])
    async def list_templates(mgr: Mgr, who: Who) -> m.TemplateList:
        return m.TemplateList(
            templates=[
                m.TemplateInfo.of(t, mgr.template_checks.get(t.name)) for t in mgr.templates.list()
            ],
            builtin=builtin_spec_names(),
        )

    @r.get(
        "/v1/templates/{name}",
        response_model=m.TemplateInfo,
        responses=RESPONSES,
        tags=["templates"],
    )
    async def get_template(name: str, mgr: Mgr, who: Who) -> m.TemplateInfo:
        info = mgr.templates.get(name)
        if info is None:
            raise NotFound(f"template {name!r} is not built", template=name)
        return m.TemplateInfo.of(info, mgr.template_checks.get(name))

    @r.post(
        "/v1/templates",
        responses={**RESPONSES, 200: {"content": {"application/x-ndjson": {}}}},
        tags=["templates"],
    )
    async def build_template(body: m.TemplateBuildBody, mgr: Mgr, who: Admin) -> Response:
        """Build (or find in the cache) a template; streams the build log as NDJSON."""
        return ndjson(mgr.build_template(who, _spec_of(body)))

    @r.delete("/v1/templates/{name}", status_code=204, responses=RESPONSES, tags=["templates"])
    async def remove_template(name: str, mgr: Mgr, who: Admin) -> Response:
        await mgr.remove_template(who, name)
        return Response(status_code=204)

    return r


def _spec_of(body: m.TemplateBuildBody) -> Any:
    if (body.spec is None) == (body.builtin is None):
        raise InvalidRequest("give exactly one of spec (TOML text) or builtin (a name)")
    if body.builtin is None:
        return _spec_with_files(body.spec or "", body.files)
    path = builtin_spec_path(body.builtin)
    if path is None:
        raise NotFound(
            f"no shipped spec {body.builtin!r}; shipped: {', '.join(builtin_spec_names())}"
        )
    return _load_spec(path.read_text(), path.parent)


def _load_spec(text: str, base: Path | None) -> Any:
    try:
        return load_spec(text, base)
    except SpecError as e:
        raise InvalidRequest(f"invalid template spec: {e}") from None


def _spec_with_files(text: str, files: dict[str, str]) -> Any:
    """Load a spec whose `src` files came with the request: they are laid out in a private
    temporary directory (relative paths only) that the spec resolves against."""
    if not files:
        return _load_spec(text, None)
    with tempfile.TemporaryDirectory(prefix="agentbox-spec-") as tmp:
        for rel, b64 in files.items():
            parts = PurePosixPath(rel).parts
            if not rel or rel.startswith("/") or ".." in parts or "\0" in rel:
                raise InvalidRequest(f"files: {rel!r} must be a relative path inside the spec dir")
            try:
                data = base64.b64decode(b64, validate=True)
            except ValueError:
                raise InvalidRequest(f"files: {rel!r} is not base64") from None
            dest = Path(tmp, *parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
        return _load_spec(text, Path(tmp))
