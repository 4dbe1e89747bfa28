"""`python -m agentbox.battery.server`: an agentbox server on a deliberately weakened runtime.

For the battery's positive controls only. This entry point exists so that weakenings never
appear among the product's own CLI options or API fields.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agentbox.server.app import serve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runtime", default="process")
    p.add_argument("--weaken", default="", help="comma-separated weakenings")
    p.add_argument("--bind-host", action="append", default=[])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    a = p.parse_args()
    config = {"weaken": [w for w in a.weaken.split(",") if w], "bind_host": a.bind_host}
    serve(a.host, a.port, a.data_dir, a.runtime, config)


if __name__ == "__main__":
    main()
