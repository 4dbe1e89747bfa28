"""The `agentbox` command line.

`main` is the installed `agentbox` command: `agentbox exec` on the short path of
`agentbox.cli.quick` when that path can take it (the standard library only: a tenth of the full
CLI's start-up), else the full CLI of `agentbox.cli.app`, typer's, for everything.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    from agentbox.cli import quick

    try:
        status = quick.run(sys.argv[1:])
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        # `agentbox exec ID -- cat big | head`: the reader left; exit quietly like other tools.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    if status is None:
        from agentbox.cli.app import main as full

        full()
    else:
        sys.exit(status)
