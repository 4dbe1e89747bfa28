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
