"""Templates: root filesystems that sandboxes see read-only, built from TOML specs.

`load_spec` turns a spec into a `TemplateSpec`; `TemplateStore.build` makes it (Debian base by
mmdebstrap, then apt, pip and file layers, cached by content) and `TemplateStore.get` hands the
runtime a `TemplateInfo` with the root filesystem's path and how to start in it. The format
and the build are described in docs/TEMPLATES.md.
"""

from agentbox.templates.spec import (
    FileSpec,
    SpecError,
    TemplateSpec,
    builtin_spec_names,
    builtin_spec_path,
    load_spec,
    valid_name,
)
from agentbox.templates.store import BuildError, TemplateInfo, TemplateStore

__all__ = [
    "BuildError",
    "FileSpec",
    "SpecError",
    "TemplateInfo",
    "TemplateSpec",
    "TemplateStore",
    "builtin_spec_names",
    "builtin_spec_path",
    "load_spec",
    "valid_name",
]
