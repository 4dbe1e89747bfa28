"""Process-wide settings shared by the server, the CLI and the SDK (paths, URLs, env names)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8686
DEFAULT_API_URL = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
ADMIN_KEY_FILE = "admin.key"


def default_data_dir() -> Path:
    """`AGENTBOX_DATA_DIR`, else /var/lib/agentbox for root, else ~/.local/share/agentbox."""
    env = os.environ.get("AGENTBOX_DATA_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/agentbox")
    return Path.home() / ".local/share/agentbox"


def local_admin_key(data_dir: Path | None = None) -> str | None:
    """The bootstrap admin key a local server wrote, when this user may read it."""
    path = (data_dir or default_data_dir()) / ADMIN_KEY_FILE
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def parse_pool_sizes(items: list[str]) -> dict[str, int]:
    """`TEMPLATE=N` or `TEMPLATE@RUNTIME=N` items (from `--warm-pool` and AGENTBOX_WARM_POOLS,
    comma-separated)."""
    sizes: dict[str, int] = {}
    for item in items:
        for part in filter(None, (p.strip() for p in item.split(","))):
            name, sep, count = part.partition("=")
            if not sep or not name or not count.isdigit():
                raise ValueError(f"{part!r} must look like TEMPLATE=N (e.g. code-interpreter=2)")
            sizes[name] = int(count)
    return sizes


def default_pool_sizes() -> dict[str, int]:
    """Warm pools from the server config (AGENTBOX_WARM_POOLS="default=2,code-interpreter=1")."""
    return parse_pool_sizes([os.environ.get("AGENTBOX_WARM_POOLS", "")])


def default_template() -> str:
    """AGENTBOX_DEFAULT_TEMPLATE: what a create that names no template gets (`base`, the
    shipped minimal Debian; `host` for the host's own userland)."""
    return os.environ.get("AGENTBOX_DEFAULT_TEMPLATE") or "base"


def default_template_dir() -> Path | None:
    """AGENTBOX_TEMPLATE_DIR (several servers, or test runs, may share built templates)."""
    env = os.environ.get("AGENTBOX_TEMPLATE_DIR")
    return Path(env) if env else None
